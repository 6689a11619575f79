//! One simulated engine: `ferry_engine::EngineCore`, the engine thread's own core (its step,
//! lifecycle events and wake-up), with checks on, driven as the engine thread drives it; what
//! the core is given in the simulation is built in `setup.rs`. [`SimEngine::tick`] is one turn
//! of the engine loop: every queued input in arrival order (each followed by the checks), the
//! clock, one step (or the idle work). A reload from disk runs the engine's own machine
//! beside it (`reload.rs`), its calls queued as its handle's would be. An adapter's load
//! carries the weights of its name at the version the engine will give it (a first load 1,
//! each later one the next: `ferry_engine::LoraInfo::version`), which the reply must confirm;
//! each token's reported adapter version must be the one the oracle saw compute it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::PoisonError;
use std::time::Duration;

use ferry_core::{OpId, Scheduler};
use ferry_engine::{
    Call, CallKind, CallResult, CoreEvent, EngineCore, Event as CoreOut, LendId, LoraLoad,
};

use crate::adapters::adapter;
use crate::copier::Copier;
use crate::kv_view::KvView;
pub use crate::messages::{Event, Input};
use crate::oracle::SharedOracle;
use crate::reload::{Guarded, Next, SimReload};
use crate::schedule::{OpKind, Side, LORA_NAMES};
pub use crate::setup::EngineSetup;
use crate::setup::{Built, StepFaults};

/// One engine (see the module docs).
#[derive(Debug)]
pub struct SimEngine {
    pub side: Side,
    pub incarnation: u32,
    /// Simulated time this incarnation started: its core's clock counts from here.
    epoch: Duration,
    pub core: EngineCore,
    inbox: VecDeque<Input>,
    pub copier: Option<Copier>,
    pub oracle: SharedOracle,
    pub faults: StepFaults,
    /// Core op id → the simulation's.
    ops: BTreeMap<OpId, u64>,
    /// Request slot → id, for the core's events.
    ids: BTreeMap<u32, String>,
    /// Requests accepted and not finished yet: each must finish exactly once.
    pub live: BTreeSet<String>,
    /// The arena as a KV event subscriber sees it (checked after every tick).
    pub kv_view: KvView,
    pub n_steps: u64,
    /// Reloads from disk in flight.
    pub reloads: Vec<SimReload>,
    /// Calls the reloads' guards sent, queued for the engine.
    guarded: Guarded,
    /// Lends named so far.
    n_lends: u64,
    /// The calls the core was made, by kind.
    pub calls: BTreeMap<CallKind, u64>,
    /// Adapter name → the latest version this engine gave it (loaded now or not).
    lora_latest: BTreeMap<&'static str, u64>,
    /// Adapter loads waiting for their reply: the name and the version it must get.
    lora_loads: BTreeMap<OpId, (&'static str, u64)>,
    /// Load every version with the first one's weights (a check of the oracle).
    stale_lora_weights: bool,
}

impl SimEngine {
    pub fn start(side: Side, incarnation: u32, now: Duration, parts: Built) -> Self {
        let Built {
            core,
            copier,
            oracle,
            faults,
            stale_lora_weights,
        } = parts;
        Self {
            side,
            incarnation,
            epoch: now,
            core,
            inbox: VecDeque::new(),
            copier,
            oracle,
            faults,
            ops: BTreeMap::new(),
            ids: BTreeMap::new(),
            live: BTreeSet::new(),
            kv_view: KvView::default(),
            n_steps: 0,
            reloads: Vec::new(),
            guarded: Guarded::default(),
            n_lends: 0,
            calls: BTreeMap::new(),
            lora_latest: BTreeMap::new(),
            lora_loads: BTreeMap::new(),
            stale_lora_weights,
        }
    }

    pub fn push(&mut self, input: Input) {
        self.inbox.push_back(input);
    }

    pub fn core(&self) -> &Scheduler {
        self.core.sched()
    }

    pub fn has_inputs(&self) -> bool {
        !self.inbox.is_empty() || !self.reloads.is_empty()
    }

    /// The core's next deadline, or a reload's next read, in simulated time.
    pub fn next_deadline(&self) -> Option<Duration> {
        let core = self.core.next_deadline().map(|d| self.epoch + d);
        core.into_iter()
            .chain(self.reloads.iter().filter_map(SimReload::due))
            .min()
    }

    /// One turn of the engine loop at simulated time `now`. `Err`: a broken invariant.
    pub fn tick(&mut self, now: Duration, events: &mut Vec<Event>) -> Result<bool, String> {
        self.core.handle_time(now.saturating_sub(self.epoch));
        self.reloads_at(now, events);
        self.drain(now, events)?;
        while let Some(input) = self.inbox.pop_front() {
            self.handle(input, now, events);
            self.drain(now, events)?;
            self.core.check().map_err(|e| e.to_string())?;
        }
        let stepped = self
            .core
            .step()
            .map_err(|e| format!("step: {e}"))?
            .is_some();
        self.n_steps += u64::from(stepped);
        self.drain(now, events)?;
        self.kv_view.check(self.core.sched())?;
        match self.oracle.lock().violations.first() {
            Some(v) => Err(format!("oracle: {v}")),
            None => Ok(stepped),
        }
    }

    fn handle(&mut self, input: Input, now: Duration, events: &mut Vec<Event>) {
        match input {
            Input::Add(req) => {
                let id = req.request_id.clone();
                match self.core.handle_add(*req) {
                    Ok(idx) => drop((self.ids.insert(idx.0, id.clone()), self.live.insert(id))),
                    Err(e) => events.push(Event::Refused {
                        id,
                        unknown_lora: matches!(e, ferry_core::AddError::UnknownLora { .. }),
                        message: e.to_string(),
                    }),
                }
            }
            Input::Abort(id) => drop(self.core.handle_abort(&id)),
            Input::Report(c, report) => self.core.handle_report(c, report),
            Input::Op { op, kind, version } => {
                let weights = || self.core.executor().weight_ops().preparer();
                if kind == OpKind::SetWeightVersion {
                    let old = self.core.sched().weight_version().to_owned();
                    self.oracle.lock().rename(&version, &old);
                }
                if let OpKind::LoadLora { name, inplace } = kind {
                    self.load_lora(op, LORA_NAMES[usize::from(name)], inplace);
                    return;
                }
                match kind.call(&self.live, weights, version.clone()) {
                    Ok(Some(call)) => {
                        let id = self.call(call);
                        self.ops.insert(id, op);
                    }
                    Ok(None) => self.start_reload(op, kind, version, now, events),
                    Err(e) => events.push(Event::Reply { op, result: Err(e) }),
                }
            }
        }
    }

    /// Loads adapter `name` (in place: replaces its weights if it is loaded) with the weights
    /// of the version the engine will give it.
    fn load_lora(&mut self, op: u64, name: &'static str, inplace: bool) {
        let version = self.lora_latest.get(name).map_or(1, |v| v + 1);
        let id = self.call(Call::LoadLora(Box::new(LoraLoad {
            name: name.into(),
            adapter: adapter(name, if self.stale_lora_weights { 1 } else { version }),
            source: None,
            inplace,
            pinned: false,
        })));
        self.ops.insert(id, op);
        self.lora_loads.insert(id, (name, version));
    }

    /// Makes `call`, counted.
    fn call(&mut self, call: Call) -> OpId {
        *self.calls.entry(CallKind::from(&call)).or_default() += 1;
        self.core.handle_call(call)
    }

    fn start_reload(
        &mut self,
        op: u64,
        kind: OpKind,
        version: String,
        now: Duration,
        events: &mut Vec<Event>,
    ) {
        let OpKind::Reload {
            in_place,
            check_ms,
            read_ms,
            fault,
        } = kind
        else {
            unreachable!("only a reload is no one call")
        };
        self.n_lends += 1;
        let lend = LendId(self.n_lends);
        let plan = (in_place, check_ms, read_ms, fault);
        let (reload, next) = SimReload::start(op, now, plan, version, lend, &self.guarded);
        self.reloads.push(reload);
        let i = self.reloads.len() - 1;
        self.follow(i, next, events);
    }

    /// Takes reload `i`'s next step.
    fn follow(&mut self, i: usize, next: Next, events: &mut Vec<Event>) {
        match next {
            Next::Call(call) => {
                let id = self.call(call);
                self.reloads[i].called(id);
            }
            Next::Wait => {}
            Next::Done(result) => {
                let reload = self.reloads.remove(i);
                events.push(Event::Reply {
                    op: reload.op,
                    result,
                });
            }
        }
    }

    /// The reloads' checks and reads due by `now`, and callers that left by then (each
    /// reload dropped with its guard, whose calls are made at once, as the handle's guard
    /// queues them).
    fn reloads_at(&mut self, now: Duration, events: &mut Vec<Event>) {
        let mut i = 0;
        while i < self.reloads.len() {
            if self.reloads[i].leaves_at.is_some_and(|t| t <= now) {
                let reload = self.reloads.remove(i);
                events.push(Event::Reply {
                    op: reload.op,
                    result: Err("the caller went away".into()),
                });
                drop(reload);
                continue;
            }
            if self.reloads[i].due().is_some_and(|t| t <= now) {
                let preparer = self.core.executor().weight_ops().preparer();
                let next = self.reloads[i].io_done(now, &*preparer);
                let n = self.reloads.len();
                self.follow(i, next, events);
                if self.reloads.len() < n {
                    continue;
                }
            }
            i += 1;
        }
        let guarded =
            std::mem::take(&mut *self.guarded.lock().unwrap_or_else(PoisonError::into_inner));
        for call in guarded {
            self.call(call);
        }
    }

    /// The answer to core call `id`, if a reload waits for it.
    fn reload_answer(
        &mut self,
        id: OpId,
        answer: CallResult,
        now: Duration,
        events: &mut Vec<Event>,
    ) -> Option<CallResult> {
        let Some(i) = self.reloads.iter().position(|r| r.waits_for(id)) else {
            return Some(answer);
        };
        let next = self.reloads[i].answered(answer, now);
        self.follow(i, next, events);
        None
    }

    /// The core's events, as the simulation reads them; checks each request finishes once.
    fn drain(&mut self, now: Duration, events: &mut Vec<Event>) -> Result<(), String> {
        while let Some(event) = self.core.poll_event() {
            let (idx, sampled, finish) = match event {
                CoreEvent::Request(_, CoreOut::Admitted { .. } | CoreOut::PromptLogprobs(_)) => {
                    continue
                }
                CoreEvent::Kv(batch) => {
                    self.kv_view.apply(batch)?;
                    continue;
                }
                CoreEvent::Request(
                    idx,
                    CoreOut::Output {
                        sampled,
                        finish,
                        lora_version,
                        ..
                    },
                ) => (idx, (sampled, lora_version), finish),
                CoreEvent::Reply(id, result) => {
                    let Some(result) = self.reload_answer(id, result, now, events) else {
                        continue;
                    };
                    if let Some((name, version)) = self.lora_loads.remove(&id) {
                        if let CallResult::LoraLoaded(Ok(info)) = &result {
                            if info.version != version {
                                return Err(format!(
                                    "adapter {name} loaded as version {}, not {version} (a \
                                     first load is 1, each later one the next)",
                                    info.version
                                ));
                            }
                            self.lora_latest.insert(name, version);
                        }
                    }
                    if let Some(op) = self.ops.remove(&id) {
                        let result = result.error().map_or(Ok(()), Err);
                        events.push(Event::Reply { op, result });
                    }
                    continue;
                }
            };
            let Some(id) = self.ids.get(&idx.0).cloned() else {
                return Err(format!("an output for a request not live: {idx:?}"));
            };
            let (sampled, lora_version) = sampled;
            if let Some(t) = sampled {
                let mut oracle = self.oracle.lock();
                if oracle.enabled {
                    let computed = oracle.take_lora_version(&id);
                    if computed != Some(lora_version) {
                        let name = |v: Option<u64>| {
                            v.map_or("the base model".to_owned(), |v| format!("version {v}"))
                        };
                        return Err(format!(
                            "{id}: a token reported as of adapter {}, computed under {}",
                            name(lora_version),
                            computed.map_or("no step the oracle saw".to_owned(), name)
                        ));
                    }
                }
                drop(oracle);
                events.push(Event::Token {
                    id: id.clone(),
                    token: t.token,
                    lora_version,
                });
            }
            if let Some(f) = finish {
                self.ids.remove(&idx.0);
                if !self.live.remove(&id) {
                    return Err(format!("{id}: finished twice (or before it was accepted)"));
                }
                self.oracle.lock().forget(&id);
                events.push(Event::Finished {
                    id,
                    reason: f.reason,
                    kv: f.kv_transfer_params.map(|p| *p),
                    message: f.message.or(f.constraint_stop),
                });
            }
        }
        Ok(())
    }
}
