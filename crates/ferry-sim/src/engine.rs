//! One simulated engine: `ferry_engine::EngineCore`, the engine thread's own core (its step,
//! lifecycle events and wake-up), with checks on, driven as the engine thread drives it; what
//! the core is given in the simulation is built in `setup.rs`. [`SimEngine::tick`] is one turn
//! of the engine loop: every queued input in arrival order (each followed by the checks), the
//! clock, one step (or the idle work).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use ferry_core::{OpId, Scheduler};
use ferry_engine::{CoreEvent, EngineCore, Event as CoreOut};

use crate::copier::Copier;
use crate::kv_view::KvView;
pub use crate::messages::{Event, Input};
use crate::oracle::SharedOracle;
use crate::schedule::Side;
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
}

impl SimEngine {
    pub fn start(side: Side, incarnation: u32, now: Duration, parts: Built) -> Self {
        let Built {
            core,
            copier,
            oracle,
            faults,
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
        }
    }

    pub fn push(&mut self, input: Input) {
        self.inbox.push_back(input);
    }

    pub fn core(&self) -> &Scheduler {
        self.core.sched()
    }

    pub fn has_inputs(&self) -> bool {
        !self.inbox.is_empty()
    }

    /// The core's next deadline, in simulated time.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.core.next_deadline().map(|d| self.epoch + d)
    }

    /// One turn of the engine loop at simulated time `now`. `Err`: a broken invariant.
    pub fn tick(&mut self, now: Duration, events: &mut Vec<Event>) -> Result<bool, String> {
        self.core.handle_time(now.saturating_sub(self.epoch));
        while let Some(input) = self.inbox.pop_front() {
            self.handle(input, events);
            self.drain(events)?;
            self.core.check().map_err(|e| e.to_string())?;
        }
        let stepped = self
            .core
            .step()
            .map_err(|e| format!("step: {e}"))?
            .is_some();
        self.n_steps += u64::from(stepped);
        self.drain(events)?;
        self.kv_view.check(self.core.sched())?;
        match self.oracle.lock().violations.first() {
            Some(v) => Err(format!("oracle: {v}")),
            None => Ok(stepped),
        }
    }

    fn handle(&mut self, input: Input, events: &mut Vec<Event>) {
        match input {
            Input::Add(req) => {
                let id = req.request_id.clone();
                match self.core.handle_add(*req) {
                    Ok(idx) => drop((self.ids.insert(idx.0, id.clone()), self.live.insert(id))),
                    Err(e) => events.push(Event::Refused {
                        id,
                        message: e.to_string(),
                    }),
                }
            }
            Input::Abort(id) => drop(self.core.handle_abort(&id)),
            Input::Report(c, report) => self.core.handle_report(c, report),
            Input::Op { op, kind, version } => {
                let weights = || self.core.executor().weight_ops().preparer();
                match kind.call(&self.live, weights, version) {
                    Ok(call) => drop(self.ops.insert(self.core.handle_call(call), op)),
                    Err(e) => events.push(Event::Reply { op, result: Err(e) }),
                }
            }
        }
    }

    /// The core's events, as the simulation reads them; checks each request finishes once.
    fn drain(&mut self, events: &mut Vec<Event>) -> Result<(), String> {
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
                        sampled, finish, ..
                    },
                ) => (idx, sampled, finish),
                CoreEvent::Reply(op, result) => {
                    if let Some(op) = self.ops.remove(&op) {
                        let result = result.error().map_or(Ok(()), Err);
                        events.push(Event::Reply { op, result });
                    }
                    continue;
                }
            };
            let Some(id) = self.ids.get(&idx.0).cloned() else {
                return Err(format!("an output for a request not live: {idx:?}"));
            };
            if let Some(t) = sampled {
                events.push(Event::Token {
                    id: id.clone(),
                    token: t.token,
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
