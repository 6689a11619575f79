//! One simulated engine: the real core (`ferry_core::Scheduler`, with the real P/D and
//! offload connectors) stepped by the shared step driver (`ferry_core::StepDriver`, checked:
//! block ownership and queues after every schedule and every output), the checksum
//! executor over a real KV arena, the real P/D worker over the simulated network and the
//! offload worker with a simulated copier.
//!
//! [`SimEngine::tick`] is one turn of `ferry-engine`'s loop: handle every queued input in
//! arrival order (requests, aborts, worker reports, lifecycle calls, each call followed by a
//! lifecycle poll as the engine does), move the core's clock, then one step if there is work
//! (or the idle work if there is none). The lifecycle calls do what the engine thread does
//! for them (`ferry-engine/src/engine.rs`): free and reallocate the arena, offload, drop and
//! restore the weights, install an update; the engine thread itself is not reused because it
//! owns threads and clocks, which a deterministic simulation cannot have.
//!
//! The oracle lives in the model ([`Oracle`]): every sampled token is compared with the
//! checksum model's reference for the request's tokens under the weights of that step,
//! unless the request's own KV mixes weight versions (a request frozen across an update
//! without a cache clear keeps its KV: that is allowed, and its tokens are then not
//! predictable). KV a request did not compute itself (a prefix hit, a P/D load, an offload
//! load) is taken to be of the current weights: stale KV shows as a wrong token.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::{
    ConnectorId, FinishReason, KvLoadFailurePolicy, KvTransferParams, LifecycleError,
    LifecycleEvent, ModelOutput, OffloadConfig, OffloadConnector, OffloadPolicy, OpId, PdConfig,
    PdConnector, PdRole, SamplingParams, Scheduler, SchedulerConfig, StepDriver, StepModel,
    StepPlan, StepWork, TokenId, WakeTag, WeightResidency, WorkerReport,
};
use ferry_kv::{KvArena, PdWorker, Reports, WorkerConnector};
use ferry_model::{ChecksumModel, ExecError, Executor, WeightStore};

use crate::copier::Copier;
use crate::net::SimNet;
use crate::schedule::{OpKind, Side};

/// The checksum model's vocabulary: large enough that a wrong digest rarely maps to the
/// right token by chance.
pub const VOCAB: usize = 50_000;

/// A worker report on its way to an engine's input queue.
#[derive(Debug)]
pub struct Mail {
    pub side: Side,
    pub incarnation: u32,
    pub connector: ConnectorId,
    pub report: WorkerReport,
}

/// Where every worker's reports go, for the simulation to hand to the right engine.
pub type Mailbox = Arc<Mutex<Vec<Mail>>>;

/// An engine's input, as `ferry-engine`'s input queue carries it.
#[derive(Debug)]
pub enum Input {
    Add {
        id: String,
        prompt: Vec<TokenId>,
        max_tokens: u32,
        kv: Option<KvTransferParams>,
    },
    Abort(String),
    Report(ConnectorId, WorkerReport),
    /// A lifecycle call; `op` is the simulation's id for its reply.
    Op {
        op: u64,
        kind: OpKind,
        version: String,
    },
}

/// What an engine tells the outside world.
#[derive(Debug)]
pub enum Event {
    Token {
        id: String,
        token: TokenId,
    },
    Finished {
        id: String,
        reason: FinishReason,
        kv: Option<KvTransferParams>,
        message: Option<String>,
    },
    Refused {
        id: String,
        message: String,
    },
    Reply {
        op: u64,
        result: Result<(), String>,
    },
}

/// How the engines of a run are set up (drawn per seed).
#[derive(Debug, Clone)]
pub struct EngineSetup {
    pub sched: SchedulerConfig,
    /// The offload tier's capacity in engine blocks (none: no tier).
    pub tier_blocks: Option<usize>,
    pub tier_blocks_per_slot: usize,
    pub tier_policy: OffloadPolicy,
    /// Register the tier before the P/D connector (`--kv-connector offload,pd`).
    pub tier_first: bool,
}

impl EngineSetup {
    pub fn scheduler_config(
        block_size: usize,
        n_blocks: u32,
        policy: KvLoadFailurePolicy,
    ) -> SchedulerConfig {
        SchedulerConfig {
            block_size,
            n_blocks,
            max_num_seqs: 6,
            max_num_batched_tokens: 32,
            max_model_len: 64,
            weight_version: "w0".into(),
            export_lease: Duration::from_millis(1500),
            kv_load_timeout: Duration::from_millis(500),
            lifecycle_wait_timeout: Duration::from_millis(1000),
            kv_load_failure_policy: policy,
            ..SchedulerConfig::default()
        }
    }
}

/// The oracle's record of which weights computed each position of a request's KV.
#[derive(Debug, Default)]
pub struct Oracle {
    versions: Vec<String>,
    /// Request id → per position, the index (in `versions`) of the weights its KV is of.
    shadow: HashMap<String, Vec<u32>>,
    refs: BTreeMap<String, ChecksumModel>,
    pub violations: Vec<String>,
    pub n_checked: u64,
    pub n_mixed: u64,
    /// Off: a test that the checks catch a planted fault turns the oracle's answer around.
    pub enabled: bool,
}

impl Oracle {
    fn intern(&mut self, version: &str) -> u32 {
        match self.versions.iter().position(|v| v == version) {
            Some(i) => i as u32,
            None => {
                self.versions.push(version.to_owned());
                self.versions.len() as u32 - 1
            }
        }
    }

    fn reference(&mut self, version: &str, tokens: &[TokenId]) -> TokenId {
        self.refs
            .entry(version.to_owned())
            .or_insert_with(|| ChecksumModel::new(version, VOCAB).expect("valid vocabulary"))
            .reference_next_token(tokens)
    }

    pub fn forget(&mut self, id: &str) {
        self.shadow.remove(id);
    }

    fn check(&mut self, core: &Scheduler, plan: &StepPlan, out: &ModelOutput, version: &str) {
        let current = self.intern(version);
        let mut sampled = out.sampled.iter();
        for r in &plan.reqs {
            let Some(req) = core.request(r.req) else {
                self.violations.push(format!(
                    "the plan schedules a request that is not live: {:?}",
                    r.req
                ));
                continue;
            };
            let shadow = self.shadow.entry(req.id.clone()).or_default();
            if r.start_pos != shadow.len() {
                // KV the request did not compute in its last step (a hit, a load, or what is
                // left after a preemption or a failed load) must be of the current weights.
                shadow.clear();
                shadow.resize(r.start_pos, current);
            }
            shadow.extend(std::iter::repeat_n(current, r.tokens.len()));
            if r.sample.is_none() {
                continue;
            }
            let Some(token) = sampled.next() else {
                self.violations.push(format!(
                    "{}: no token sampled where the plan asked for one",
                    req.id
                ));
                continue;
            };
            if shadow.iter().any(|&g| g != current) {
                self.n_mixed += 1;
                continue;
            }
            let end = r.start_pos + r.tokens.len();
            let expected = self.reference(version, &req.tokens[..end]);
            self.n_checked += 1;
            if token.token != expected {
                self.violations.push(format!(
                    "{}: sampled token {} after {end} tokens under weights {version:?}, the \
                     reference is {expected}: its KV is wrong, stale or misplaced",
                    req.id, token.token
                ));
            }
        }
    }
}

/// The model the driver steps: the checksum executor, its arena, the workers, the oracle.
#[derive(Debug)]
pub struct SimModel {
    pub executor: ChecksumModel,
    pub arena: KvArena,
    workers: Vec<Box<dyn WorkerConnector>>,
    reports: Vec<Reports>,
    pub oracle: Oracle,
}

impl SimModel {
    pub fn executor_residency(&self) -> WeightResidency {
        self.executor.weight_ops().residency()
    }
}

impl StepModel for SimModel {
    type Error = ExecError;

    fn compute(&mut self, core: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, ExecError> {
        // As the engine: a plan with no request runs the workers only, never the forward.
        if plan.is_empty() {
            return Ok(ModelOutput::default());
        }
        let out = self.executor.execute(plan, &mut self.arena)?;
        if self.oracle.enabled {
            let version = self.executor.weight_version().to_owned();
            self.oracle.check(core, plan, &out, &version);
        }
        Ok(out)
    }

    fn run_connector_work(&mut self, work: &[StepWork]) {
        for w in work {
            let c = w.connector.0 as usize;
            self.workers[c].before_forward(&w.jobs, &mut self.arena, &self.reports[c]);
        }
    }
}

/// One engine (see the module docs).
#[derive(Debug)]
pub struct SimEngine {
    pub side: Side,
    pub incarnation: u32,
    /// Simulated time this incarnation started: its core's clock counts from here.
    epoch: Duration,
    pub driver: StepDriver<SimModel>,
    inbox: VecDeque<Input>,
    pub copier: Option<Copier>,
    /// Core op id → the simulation's.
    ops: BTreeMap<OpId, u64>,
    next_op: u64,
    /// Requests accepted and not finished yet: each must finish exactly once.
    pub live: BTreeSet<String>,
    pub n_steps: u64,
}

impl SimEngine {
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        side: Side,
        incarnation: u32,
        now: Duration,
        setup: &EngineSetup,
        net: &SimNet,
        mailbox: &Mailbox,
        secret: [u8; 32],
    ) -> Self {
        let executor = ChecksumModel::new(setup.sched.weight_version.clone(), VOCAB)
            .expect("valid vocabulary");
        let layout = executor.kv_layout(setup.sched.block_size);
        let arena = KvArena::new(layout, setup.sched.n_blocks as usize);
        let mut sched = Scheduler::new(setup.sched.clone()).expect("valid scheduler config");
        let mut workers: Vec<Box<dyn WorkerConnector>> = Vec::new();
        let mut reports = Vec::new();
        let mut copier = None;
        let engine_id = side.name();
        let report_to = |c: ConnectorId| {
            let mailbox = Arc::clone(mailbox);
            Reports::new(move |report| {
                mailbox
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(Mail {
                        side,
                        incarnation,
                        connector: c,
                        report,
                    })
            })
        };
        let add_pd = |sched: &mut Scheduler,
                      workers: &mut Vec<Box<dyn WorkerConnector>>,
                      reports: &mut Vec<Reports>| {
            let c = sched.add_connector(Box::new(PdConnector::new(PdConfig {
                role: match side {
                    Side::P => PdRole::Producer,
                    Side::D => PdRole::Consumer,
                },
                engine_id: engine_id.to_owned(),
                host: Some("127.0.0.1".into()),
                port: Some(side.idx() as u16 + 1),
                secret,
                block_size: setup.sched.block_size,
                allowed_peers: ferry_core::AllowedPeers::default(),
            })));
            workers.push(Box::new(PdWorker::new(
                engine_id,
                Arc::new(net.endpoint(engine_id)),
            )));
            reports.push(report_to(c));
        };
        let mut add_tier = |sched: &mut Scheduler,
                            workers: &mut Vec<Box<dyn WorkerConnector>>,
                            reports: &mut Vec<Reports>,
                            n_blocks: usize| {
            let config = OffloadConfig {
                block_size: setup.sched.block_size,
                blocks_per_slot: setup.tier_blocks_per_slot,
                block_bytes: layout.block_bytes(),
                capacity_bytes: (n_blocks * layout.block_bytes()) as u64,
                policy: setup.tier_policy,
            };
            config.validate().expect("valid tier config");
            let c = sched.add_connector(Box::new(OffloadConnector::new(config.clone())));
            let tier = Copier::new(config.n_host_blocks(), config.block_bytes);
            workers.push(tier.worker());
            reports.push(report_to(c));
            copier = Some(tier);
        };
        match setup.tier_blocks {
            Some(n) if setup.tier_first => {
                add_tier(&mut sched, &mut workers, &mut reports, n);
                add_pd(&mut sched, &mut workers, &mut reports);
            }
            Some(n) => {
                add_pd(&mut sched, &mut workers, &mut reports);
                add_tier(&mut sched, &mut workers, &mut reports, n);
            }
            None => add_pd(&mut sched, &mut workers, &mut reports),
        }
        let model = SimModel {
            executor,
            arena,
            workers,
            reports,
            oracle: Oracle {
                enabled: true,
                ..Oracle::default()
            },
        };
        Self {
            side,
            incarnation,
            epoch: now,
            driver: StepDriver::new(sched, model).checked(),
            inbox: VecDeque::new(),
            copier,
            ops: BTreeMap::new(),
            next_op: 0,
            live: BTreeSet::new(),
            n_steps: 0,
        }
    }

    pub fn push(&mut self, input: Input) {
        self.inbox.push_back(input);
    }

    pub fn core(&self) -> &Scheduler {
        &self.driver.sched
    }

    pub fn has_inputs(&self) -> bool {
        !self.inbox.is_empty()
    }

    /// Work the engine loop would do now without an input: a step or idle steps.
    pub fn busy(&self) -> bool {
        let core = self.core();
        core.n_live() > 0 || core.needs_idle_steps()
    }

    /// The core's next deadline, in simulated time.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.core().next_deadline().map(|d| self.epoch + d)
    }

    /// One turn of the engine loop at simulated time `now`. `Err`: a broken invariant.
    pub fn tick(&mut self, now: Duration, events: &mut Vec<Event>) -> Result<bool, String> {
        // As the engine: the clock moves before any input is handled (a call after an idle
        // spell must see the time it arrives at).
        let local = now.saturating_sub(self.epoch);
        self.driver.sched.advance_time(local);
        while let Some(input) = self.inbox.pop_front() {
            self.handle(input, events)?;
            self.driver.check().map_err(|e| e.to_string())?;
        }
        let stepped = if self.busy() {
            let step = self.driver.step().map_err(|e| format!("step: {e}"))?;
            let did = !step.plan.is_idle();
            self.n_steps += u64::from(did);
            let outputs = step.outputs;
            self.driver.sched.recycle_plan(step.plan);
            self.dispatch(outputs, events)?;
            did
        } else {
            false
        };
        self.poll(events);
        if let Some(v) = self.driver.model.oracle.violations.first() {
            return Err(format!("oracle: {v}"));
        }
        Ok(stepped)
    }

    fn handle(&mut self, input: Input, events: &mut Vec<Event>) -> Result<(), String> {
        match input {
            Input::Add {
                id,
                prompt,
                max_tokens,
                kv,
            } => {
                let params = SamplingParams::greedy(max_tokens);
                match self
                    .driver
                    .sched
                    .add_request_with_transfer(id.clone(), prompt, params, kv)
                {
                    Ok(_) => {
                        if !self.live.insert(id.clone()) {
                            return Err(format!("{id} accepted twice"));
                        }
                    }
                    Err(e) => events.push(Event::Refused {
                        id,
                        message: e.to_string(),
                    }),
                }
            }
            Input::Abort(id) => {
                if let Some(out) = self.driver.sched.abort(&id) {
                    self.dispatch(vec![out], events)?;
                }
            }
            Input::Report(c, report) => {
                self.driver.sched.on_worker_report(c, report);
                let outs = self.driver.sched.take_outputs();
                self.dispatch(outs, events)?;
            }
            Input::Op { op, kind, version } => {
                self.lifecycle(op, kind, version, events)?;
                self.poll(events);
            }
        }
        Ok(())
    }

    fn lifecycle(
        &mut self,
        op: u64,
        kind: OpKind,
        version: String,
        events: &mut Vec<Event>,
    ) -> Result<(), String> {
        let reply = |events: &mut Vec<Event>, result: Result<(), String>| {
            events.push(Event::Reply { op, result })
        };
        match kind {
            OpKind::Pause { mode, clear_cache } => {
                let id = self.core_op(op);
                let aborted = self.driver.sched.pause(id, mode, clear_cache);
                self.dispatch(aborted, events)?;
            }
            OpKind::Sleep { level, mode } => {
                let id = self.core_op(op);
                let aborted = self.driver.sched.sleep(id, level, mode);
                self.dispatch(aborted, events)?;
            }
            OpKind::Resume => {
                let r = self.driver.sched.resume().map_err(|e| e.to_string());
                reply(events, r);
            }
            OpKind::WakeUp { tags } => {
                let tags: Vec<WakeTag> = [(1, WakeTag::Weights), (2, WakeTag::KvCache)]
                    .iter()
                    .filter(|(bit, _)| tags & bit != 0)
                    .map(|&(_, t)| t)
                    .collect();
                let r = self.wake_up(&tags).map_err(|e| e.to_string());
                reply(events, r);
            }
            OpKind::ReleaseKv => {
                let id = self.core_op(op);
                if let Err(e) = self.driver.sched.release_kv_cache_memory(id) {
                    self.ops.remove(&id);
                    reply(events, Err(e.to_string()));
                }
            }
            OpKind::ResetPrefixCache { running, connector } => {
                // A bool, never an error: false while blocks are held.
                self.driver.sched.reset_caches(running, connector);
                reply(events, Ok(()));
            }
            OpKind::AbortAll => {
                let outs = self.driver.sched.abort_all();
                self.dispatch(outs, events)?;
                reply(events, Ok(()));
            }
            OpKind::AbortOne { pick } => {
                if !self.live.is_empty() {
                    let id = self
                        .live
                        .iter()
                        .nth(usize::from(pick) % self.live.len())
                        .cloned()
                        .expect("in range");
                    if let Some(out) = self.driver.sched.abort(&id) {
                        self.dispatch(vec![out], events)?;
                    }
                }
                reply(events, Ok(()));
            }
            OpKind::WeightUpdate => {
                let r = self.install_weights(&version);
                reply(events, r);
            }
        }
        Ok(())
    }

    fn core_op(&mut self, op: u64) -> OpId {
        self.next_op += 1;
        let id = OpId(self.next_op);
        self.ops.insert(id, op);
        id
    }

    /// As `ferry-engine`'s wake-up: weights first (only they can fail), then the arena,
    /// then the core.
    fn wake_up(&mut self, tags: &[WakeTag]) -> Result<(), LifecycleError> {
        let status = self.driver.sched.lifecycle_status();
        let wants = |t: WakeTag| tags.is_empty() || tags.contains(&t);
        let model = &mut self.driver.model;
        if wants(WakeTag::Weights) && status.weights != WeightResidency::Resident {
            model
                .executor
                .weight_ops_mut()
                .restore()
                .map_err(|_| LifecycleError::WeightsDropped)?;
        }
        if wants(WakeTag::KvCache) && status.kv_released {
            model.arena.reallocate();
        }
        self.driver.sched.wake_up(tags);
        Ok(())
    }

    /// An update in place: new (weightless) weights, a new version on the executor and in
    /// the core, as the engine's install does.
    fn install_weights(&mut self, version: &str) -> Result<(), String> {
        let ops = self.driver.model.executor.weight_ops_mut();
        let prepared = ops
            .preparer()
            .prepare(WeightStore::default())
            .map_err(|e| e.to_string())?;
        ops.install(prepared).map_err(|e| e.to_string())?;
        ops.set_version(version);
        self.driver.sched.set_weight_version(version);
        Ok(())
    }

    /// Acts on what the lifecycle asks (memory first), then queues the replies.
    fn poll(&mut self, events: &mut Vec<Event>) {
        let mut out = Vec::new();
        self.driver.sched.poll_lifecycle(&mut out);
        for event in out {
            match event {
                LifecycleEvent::ReleaseKvMemory => {
                    let model = &mut self.driver.model;
                    model.arena.release();
                    for w in &mut model.workers {
                        w.release_memory();
                    }
                }
                LifecycleEvent::OffloadWeights => {
                    self.driver.model.executor.weight_ops_mut().offload();
                }
                LifecycleEvent::DropWeights => {
                    drop(self.driver.model.executor.weight_ops_mut().drop_weights());
                }
                LifecycleEvent::Done(id) => {
                    if let Some(op) = self.ops.remove(&id) {
                        events.push(Event::Reply { op, result: Ok(()) });
                    }
                }
                LifecycleEvent::Failed(id, e) => {
                    if let Some(op) = self.ops.remove(&id) {
                        events.push(Event::Reply {
                            op,
                            result: Err(e.to_string()),
                        });
                    }
                }
            }
        }
    }

    fn dispatch(
        &mut self,
        outputs: Vec<ferry_core::RequestOutput>,
        events: &mut Vec<Event>,
    ) -> Result<(), String> {
        for out in outputs {
            let id = match &out.finished {
                Some(f) => f.request_id.clone(),
                None => match self.driver.sched.request(out.req) {
                    Some(r) => r.id.clone(),
                    None => return Err(format!("an output for a request not live: {:?}", out.req)),
                },
            };
            if !self.live.contains(&id) {
                return Err(format!(
                    "{id}: an output after it finished (or before it was accepted)"
                ));
            }
            if let Some(t) = &out.sampled {
                events.push(Event::Token {
                    id: id.clone(),
                    token: t.token,
                });
            }
            if let Some(f) = out.finished {
                self.live.remove(&id);
                self.driver.model.oracle.forget(&id);
                events.push(Event::Finished {
                    id,
                    reason: f.reason,
                    kv: f.kv_transfer_params,
                    message: f.message,
                });
            }
        }
        Ok(())
    }

    /// Memory the engine holds now: arena allocated, tier host bytes.
    pub fn kv_allocated(&self) -> bool {
        self.driver.model.arena.is_allocated()
    }
}
