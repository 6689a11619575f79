//! One simulated engine: `ferry_engine::EngineCore`, the engine thread's own core (its step,
//! lifecycle events and wake-up), with checks on, driven as the engine thread drives it; what
//! the core is given in the simulation is built in `setup.rs`. [`SimEngine::tick`] is one turn
//! of the engine loop: every queued input in arrival order (each followed by the checks), the
//! clock, one step (or the idle work).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use ferry_core::kv_events::external_hash;
use ferry_core::{KvEvent, KvEventBatch, Medium, OpId, Scheduler};
use ferry_engine::{CoreEvent, EngineCore, Event as CoreOut};

use crate::copier::Copier;
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
    /// The arena's cached blocks as a KV event subscriber sees them (the current epoch's).
    kv_index: (u64, BTreeSet<u64>),
    /// KV event batches applied, and the offload tier's events among them.
    pub n_kv_batches: u64,
    pub n_tier_events: u64,
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
            kv_index: (0, BTreeSet::new()),
            n_kv_batches: 0,
            n_tier_events: 0,
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
            self.core.check()?;
        }
        let stepped = self
            .core
            .step()
            .map_err(|e| format!("step: {e}"))?
            .is_some();
        self.n_steps += u64::from(stepped);
        self.drain(events)?;
        self.check_kv_index()?;
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

    /// Applies a KV event batch to the subscriber's view: a new epoch starts from nothing.
    fn index_kv_events(&mut self, batch: KvEventBatch) -> Result<(), String> {
        self.n_kv_batches += 1;
        let (epoch, index) = &mut self.kv_index;
        if batch.epoch < *epoch {
            return Err(format!(
                "KV events went back from epoch {epoch} to {}",
                batch.epoch
            ));
        }
        if batch.epoch > *epoch && batch.events.first() != Some(&KvEvent::AllCleared) {
            return Err(format!(
                "epoch {} began without AllBlocksCleared",
                batch.epoch
            ));
        }
        *epoch = batch.epoch;
        // The arena's blocks (the tier's are checked by the tier's own accounting).
        for event in batch.events {
            match event {
                KvEvent::AllCleared => index.clear(),
                KvEvent::Stored {
                    hashes,
                    medium: Medium::Primary,
                    ..
                } => index.extend(hashes),
                KvEvent::Removed {
                    hashes,
                    medium: Medium::Primary,
                } => {
                    for h in &hashes {
                        index.remove(h);
                    }
                }
                KvEvent::Stored { .. } | KvEvent::Removed { .. } => self.n_tier_events += 1,
            }
        }
        Ok(())
    }

    /// Every block a KV event subscriber believes cached is cached: a router never sends a
    /// request for a hit that a wipe or an eviction took away.
    fn check_kv_index(&self) -> Result<(), String> {
        let pool = self.core.sched().kv_pool();
        let cached: BTreeSet<u64> = pool
            .cached_entries()
            .map(|(h, _)| external_hash(h))
            .collect();
        match self.kv_index.1.iter().find(|h| !cached.contains(h)) {
            Some(h) => Err(format!(
                "KV events announce block {h:016x}, which is not cached"
            )),
            None => Ok(()),
        }
    }

    /// The core's events, as the simulation reads them; checks each request finishes once.
    fn drain(&mut self, events: &mut Vec<Event>) -> Result<(), String> {
        while let Some(event) = self.core.poll_event() {
            let (idx, sampled, finish) = match event {
                CoreEvent::Request(_, CoreOut::Admitted { .. }) => continue,
                CoreEvent::Kv(batch) => {
                    self.index_kv_events(batch)?;
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
