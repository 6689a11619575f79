//! [`EngineCore`]: the engine without its thread. The scheduler, the executor, the KV arena
//! and the connectors' workers behind one synchronous interface: inputs in, [`step`], events
//! out, time passed in. No channel, clock or thread of its own, so the engine thread
//! (`engine.rs`, a thin loop around it), the simulation (`ferry-sim`) and tests all run this
//! one implementation of the step, of the lifecycle events and of wake-up.
//!
//! # How to drive it
//!
//! Inputs, each handled at once, in the order they arrive:
//! * [`handle_time`](EngineCore::handle_time) moves the core's clock (before each input and
//!   before each step: a call after an idle spell must see the time it arrives at);
//! * [`handle_add`](EngineCore::handle_add), [`handle_abort`](EngineCore::handle_abort),
//!   [`handle_report`](EngineCore::handle_report) (a connector's worker reported),
//!   [`handle_call`](EngineCore::handle_call) (a lifecycle call; its reply comes out as an
//!   event, at once or when the operation completes).
//!
//! Then [`step`](EngineCore::step) while [`has_work`](EngineCore::has_work): one engine
//! step (see `ferry_core::StepDriver`: schedule → masks → workers → forward → output), then
//! the lifecycle moves forward (a pause that waited for the drain, a reset's next stage) and
//! the memory it asks for is released or restored. Idle, the caller waits for an input or
//! for [`next_deadline`](EngineCore::next_deadline), whichever comes first, and calls `step`
//! again (an idle step only moves the lifecycle).
//!
//! Everything the core tells the outside world leaves by one route:
//! [`poll_event`](EngineCore::poll_event), drained after every input and every step (before
//! the next input: request slots are reused, so a [`CoreEvent::Request`] names a request
//! only until the next input is handled). A request's events keep their order: at most one
//! `Admitted`, then outputs, the last with its finish.
//!
//! Work the engine hands to other threads, the structured-output masks, goes through the
//! injected [`CoreEnv`]: the engine's runs it on rayon's threads, the simulation's inline.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ferry_arena::{KvArena, Reports, WorkerConnector};
use ferry_core::{
    AddError, Cleared, ConnectorId, FinishReason, KvEventBatch, LifecycleError, LifecycleEvent,
    LifecycleStatus, ModelOutput, OpId, PauseMode, PromptLogprobs, ReqIdx, RequestOutput,
    SamplingParams, Scheduler, SleepLevel, Step, StepDriver, StepError, StepKind, StepModel,
    StepPlan, StepWork, TokenId, TransferRequest, WakeTag, WeightResidency, WorkPhase,
    WorkerReport,
};
use ferry_model::{ExecError, Executor, PreparedWeights, RetiredWeights, WeightError};

use crate::connector::Connector;
use crate::constraint::{Constraint, ConstraintState, Next};
use crate::event::{EngineFinish, Event};
use crate::lora::{LoraCallError, LoraInfo, LoraLoad, LoraSettings, Loras};
use crate::transfer_stats::{TransferStats, TransferTally};
use ferry_core::LoraId;

/// Consecutive failed steps after which every live request is finished with `error`.
pub const MAX_CONSECUTIVE_FAILURES: u32 = 3;

/// What the core needs of the world it runs in.
pub trait CoreEnv: Send {
    /// A monotonic reading, for the stats only (forward time, transfer times); no decision
    /// depends on it. The simulation's stands still.
    fn now(&self) -> Duration;

    /// Computes each constrained request's next mask ([`MaskWork::run`] on every item);
    /// the engine spreads them over threads (a mask over a 50k vocabulary can take a
    /// millisecond), the simulation runs them in order.
    fn run_masks(&self, work: &mut [MaskWork<'_>]);
}

/// A deterministic environment: no clock (time stands at zero), masks computed inline in
/// request order. The simulation's, and tests'.
#[derive(Debug, Clone, Copy, Default)]
pub struct InlineEnv;

impl CoreEnv for InlineEnv {
    fn now(&self) -> Duration {
        Duration::ZERO
    }

    fn run_masks(&self, work: &mut [MaskWork<'_>]) {
        work.iter_mut().for_each(MaskWork::run);
    }
}

/// One constrained request's sampled token, to feed its matcher.
pub struct MaskWork<'a> {
    state: &'a mut ConstraintState,
    token: TokenId,
    /// The request finished with this token: no next mask is needed.
    finished: bool,
    slot: usize,
    /// Whether the token was forced, and what the constraint says next.
    result: Option<(bool, Next)>,
}

impl fmt::Debug for MaskWork<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MaskWork")
            .field("token", &self.token)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl MaskWork<'_> {
    /// Feeds the token and computes the next mask (nothing after the last token).
    pub fn run(&mut self) {
        let forced = self.state.forced();
        self.result = Some(if self.finished {
            (forced, Next::Continue)
        } else {
            (forced, self.state.advance(self.token))
        });
    }
}

/// Sees every computed step (the simulation's oracle checks each sampled token).
pub trait StepObserver: Send {
    fn on_computed(&mut self, core: &Scheduler, plan: &StepPlan, output: &ModelOutput);
}

/// A request for [`EngineCore::handle_add`].
#[derive(Debug)]
pub struct NewRequest {
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// What the request asks of the P/D transfer, for the connectors.
    pub transfer: Option<TransferRequest>,
    /// A structured-output constraint, compiled.
    pub constraint: Option<Constraint>,
    /// The LoRA adapter it names (`None`: the base model), resolved to the version loaded
    /// now when the core takes it.
    pub lora: Option<Arc<str>>,
}

/// A lifecycle call (`../shared/design/lifecycle.md`); each is answered by a
/// [`CoreEvent::Reply`] with the [`OpId`] `handle_call` returned. Its name, [`CallKind`],
/// lists every call ([`CallKind::iter`]): the simulation checks that its runs make each.
#[derive(Debug, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(CallKind),
    derive(Hash, PartialOrd, Ord, strum::EnumIter),
    doc = "A lifecycle call's name."
)]
pub enum Call {
    Pause {
        mode: PauseMode,
        clear_cache: bool,
    },
    Resume,
    Sleep {
        level: SleepLevel,
        mode: PauseMode,
    },
    /// Restores the memory of `tags` (empty: all).
    WakeUp {
        tags: Vec<WakeTag>,
    },
    ReleaseKvCacheMemory,
    ResetPrefixCache {
        reset_running_requests: bool,
        reset_connector: bool,
    },
    /// `None`: every live request.
    AbortRequests {
        ids: Option<Vec<String>>,
    },
    /// Weights already checked and converted off the engine thread; no version: the next
    /// one after the current (`v` → `v+1`).
    InstallWeights {
        weights: PreparedWeights,
        version: Option<String>,
    },
    SetWeightVersion {
        version: String,
    },
    Status,
    /// Lends the weights to the reload in place `lend` ([`WeightResidency::Reloading`]) if
    /// the engine is in a completed pause and the executor reloads in place; `Lent(None)`
    /// otherwise. A reload is driven by [`crate::DiskReload`].
    LendWeights {
        lend: LendId,
    },
    /// The weights the reload `lend` wrote over (the complete update its slots finished),
    /// back under `version` (none: the next after the current).
    ReturnWeights {
        lend: LendId,
        weights: PreparedWeights,
        version: Option<String>,
    },
    /// The reload `lend` failed midway, or its caller went away: what it was lent is gone,
    /// the weights are dropped. Nothing if the weights are not lent to `lend`.
    LoseWeights {
        lend: LendId,
    },
    /// Loads a LoRA adapter (read and checked off the engine thread), or replaces a loaded
    /// one's weights under its next version (`inplace`).
    LoadLora(Box<LoraLoad>),
    /// Unloads a LoRA adapter: its live requests finish as aborted, its KV leaves the caches.
    UnloadLora {
        name: Arc<str>,
    },
}

/// Names one lend of the weights to a reload in place, so that a return or a loss reaches
/// only the lend it is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LendId(pub u64);

/// A lifecycle call's answer, by kind of call.
#[derive(Debug)]
pub enum CallResult {
    /// Pause, resume, sleep, wake-up, KV memory release.
    Op(Result<(), LifecycleError>),
    /// A cache reset: false while blocks were held.
    Reset(Option<Cleared>),
    /// How many requests an abort finished.
    Aborted(usize),
    /// The installed version, and the weights it retired (to drop off the engine thread).
    Installed(Result<(String, Option<RetiredWeights>), WeightError>),
    VersionSet,
    Status(LifecycleStatus, WeightInfo),
    /// The weights lent to a reload in place, if they were.
    Lent(Option<RetiredWeights>),
    /// The adapter loaded, as it is now.
    LoraLoaded(Result<LoraInfo, LoraCallError>),
    /// How many live requests the unload aborted.
    LoraUnloaded(Result<usize, LoraCallError>),
}

/// The weights as the engine sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightInfo {
    pub weight_version: String,
    /// Completed weight updates (reloads and pushes) since start.
    pub n_weight_updates: u64,
    pub residency: WeightResidency,
    /// Bytes of the weights held, each tensor in its stored dtype (a pushed tensor keeps
    /// the dtype it came in); 0 after sleep level 2.
    pub n_bytes: u64,
}

/// The answer of one kind of call, or the answer back when it is of another kind.
impl CallResult {
    pub fn into_op(self) -> Result<Result<(), LifecycleError>, Self> {
        match self {
            Self::Op(r) => Ok(r),
            other => Err(other),
        }
    }

    pub fn into_reset(self) -> Result<Option<Cleared>, Self> {
        match self {
            Self::Reset(r) => Ok(r),
            other => Err(other),
        }
    }

    pub fn into_lora_loaded(self) -> Result<Result<LoraInfo, LoraCallError>, Self> {
        match self {
            Self::LoraLoaded(r) => Ok(r),
            other => Err(other),
        }
    }

    pub fn into_lora_unloaded(self) -> Result<Result<usize, LoraCallError>, Self> {
        match self {
            Self::LoraUnloaded(r) => Ok(r),
            other => Err(other),
        }
    }

    pub fn into_aborted(self) -> Result<usize, Self> {
        match self {
            Self::Aborted(n) => Ok(n),
            other => Err(other),
        }
    }

    #[allow(clippy::type_complexity)]
    pub fn into_installed(
        self,
    ) -> Result<Result<(String, Option<RetiredWeights>), WeightError>, Self> {
        match self {
            Self::Installed(r) => Ok(r),
            other => Err(other),
        }
    }

    pub fn into_version_set(self) -> Result<(), Self> {
        match self {
            Self::VersionSet => Ok(()),
            other => Err(other),
        }
    }

    pub fn into_status(self) -> Result<(LifecycleStatus, WeightInfo), Self> {
        match self {
            Self::Status(s, w) => Ok((s, w)),
            other => Err(other),
        }
    }

    pub fn into_lent(self) -> Result<Option<RetiredWeights>, Self> {
        match self {
            Self::Lent(w) => Ok(w),
            other => Err(other),
        }
    }
}

impl CallResult {
    /// Why the call failed, if it did (a refused lifecycle op or weight install).
    pub fn error(&self) -> Option<String> {
        match self {
            Self::Op(Err(e)) => Some(e.to_string()),
            Self::Installed(Err(e)) => Some(e.to_string()),
            _ => None,
        }
    }
}

/// What leaves the core ([`EngineCore::poll_event`]).
#[derive(Debug)]
pub enum CoreEvent {
    /// An event for a request's reader.
    Request(ReqIdx, Event),
    /// A lifecycle call's answer.
    Reply(OpId, CallResult),
    /// Changes of the prefix cache, for KV event subscribers (only with
    /// `SchedulerConfig::kv_events`). They come out before any other event of the same input
    /// or step, so a cleared cache is announced before the reply of the call that cleared it.
    Kv(KvEventBatch),
}

/// Counters the engine publishes with its stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreCounters {
    /// Tokens sampled by successful steps.
    pub n_generated_tokens_total: u64,
    /// Requests finished by a step (a stop, a length, a constraint), and those a step failure
    /// ended. Aborts from outside and failed loads are not counted here.
    pub n_requests_finished_total: u64,
    pub n_step_failures_total: u64,
    pub n_weight_updates: u64,
}

/// What a step did, for the caller's timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stepped {
    pub kind: StepKind,
    /// Time in `Executor::execute` (by [`CoreEnv::now`]).
    pub forward: Duration,
}

/// The core's view of one live request.
#[derive(Debug)]
struct Live {
    /// `Event::Admitted` was sent (at the first schedule).
    admitted: bool,
    /// The structured-output constraint, with the mask of the next token.
    constraint: Option<ConstraintState>,
    /// The prompt position whose logprob is sent next (prompt logprobs start at 1; a
    /// preempted request computes its prompt again, and nothing goes out twice).
    next_prompt_logprob: usize,
    /// Its LoRA adapter (the id stays across in-place loads; the version is the table's).
    lora: Option<LoraId>,
}

/// The step driver's model: the executor, its arena, the connectors' workers.
struct EngineModel {
    executor: Box<dyn Executor>,
    arena: KvArena,
    /// Each connector's worker side, by `ConnectorId` (`None`: its jobs need no worker).
    workers: Vec<Option<Box<dyn WorkerConnector>>>,
    /// Each connector's report sink (the caller's route back to `handle_report`).
    reports: Vec<Reports>,
    transfers: TransferTally,
    env: Box<dyn CoreEnv>,
    observer: Option<Box<dyn StepObserver>>,
    /// The last forward's duration.
    forward: Duration,
    /// The last forward's prompt logprobs, until the step's events are sent.
    prompt_logprobs: Vec<PromptLogprobs>,
}

impl fmt::Debug for EngineModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineModel")
            .field("arena", &self.arena)
            .field("n_workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

impl StepModel for EngineModel {
    type Error = ExecError;

    fn compute(&mut self, core: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, ExecError> {
        let started = self.env.now();
        let mut out = self.executor.execute(plan, &mut self.arena);
        self.forward = self.env.now().saturating_sub(started);
        if let (Ok(out), Some(observer)) = (&out, &mut self.observer) {
            observer.on_computed(core, plan, out);
        }
        if let Ok(out) = &mut out {
            self.prompt_logprobs = std::mem::take(&mut out.prompt_logprobs);
        }
        out
    }

    /// Hands each connector's jobs to its worker: the plan's before the forward, those the
    /// step's output produced after it.
    fn run_connector_work(&mut self, work: &[StepWork], phase: WorkPhase) {
        for w in work {
            self.transfers.on_jobs(w.connector, &w.jobs, self.env.now());
            let c = w.connector.0 as usize;
            let reports = &self.reports[c];
            match (self.workers.get_mut(c).and_then(Option::as_mut), phase) {
                (Some(worker), WorkPhase::AfterOutput) => {
                    worker.after_forward(&w.jobs, &mut self.arena, reports)
                }
                (Some(worker), WorkPhase::BeforeForward) => {
                    worker.before_forward(&w.jobs, &mut self.arena, reports)
                }
                (None, _) => tracing::error!(
                    connector = c,
                    n_jobs = w.jobs.len(),
                    "a connector planned worker jobs but has no worker; they are dropped"
                ),
            }
        }
    }
}

/// The engine without its thread (see the module docs).
#[derive(Debug)]
pub struct EngineCore {
    driver: StepDriver<EngineModel>,
    /// Indexed by `ReqIdx`: the core reuses slots, so this stays as small as the peak load.
    live: Vec<Option<Live>>,
    events: VecDeque<CoreEvent>,
    /// Whether the scheduler journals KV events (`SchedulerConfig::kv_events`).
    kv_events: bool,
    /// KV event batches drained from the scheduler, not yet polled.
    kv_batches: VecDeque<KvEventBatch>,
    /// Reused by `poll_lifecycle`.
    lifecycle_events: Vec<LifecycleEvent>,
    next_op: u64,
    /// The reload in place the weights are lent to, while they are.
    lent_to: Option<LendId>,
    consecutive_failures: u32,
    counters: CoreCounters,
    /// The LoRA adapters' names, ids and versions (off until `set_lora_settings`).
    loras: Loras,
}

impl EngineCore {
    /// The core over `sched` (its connectors registered), with `workers[c]` and `reports[c]`
    /// the worker side of connector `c`. The arena is shaped for `executor`.
    ///
    /// The scheduler takes the executor's routing shape
    /// (`Scheduler::set_routing_shape`): requests then carry their expert routing to their
    /// finish. Panics if the shape is one the scheduler refuses; [`crate::spawn`] checks it
    /// first.
    pub fn new(
        mut sched: Scheduler,
        executor: Box<dyn Executor>,
        workers: Vec<Option<Box<dyn WorkerConnector>>>,
        reports: Vec<Reports>,
        env: Box<dyn CoreEnv>,
    ) -> Self {
        if let Err(e) = sched.set_routing_shape(executor.routing_shape()) {
            panic!("engine core: the executor's {e}");
        }
        let config = sched.config();
        let kv_events = config.kv_events;
        let layout = executor.kv_layout(config.block_size);
        let arena = KvArena::new(layout, config.n_blocks as usize);
        let model = EngineModel {
            executor,
            arena,
            workers,
            reports,
            transfers: TransferTally::new(layout.block_bytes()),
            env,
            observer: None,
            forward: Duration::ZERO,
            prompt_logprobs: Vec::new(),
        };
        Self {
            driver: StepDriver::new(sched, model),
            live: Vec::new(),
            events: VecDeque::new(),
            kv_events,
            kv_batches: VecDeque::new(),
            lifecycle_events: Vec::new(),
            next_op: 0,
            lent_to: None,
            consecutive_failures: 0,
            counters: CoreCounters::default(),
            loras: Loras::default(),
        }
    }

    /// Serves LoRA adapters under `settings` (`None`: refuses them, the default).
    pub fn set_lora_settings(&mut self, settings: Option<LoraSettings>) {
        self.loras = Loras::new(settings);
    }

    /// The adapters loaded now, as the engine thread last published them.
    pub(crate) fn lora_table(&self) -> crate::lora::LoraTable {
        self.loras.table()
    }

    /// The core over `sched` with `connectors` registered in order (connector `c` is the
    /// `c`-th), each worker reporting through `reports(c)`.
    pub fn with_connectors(
        mut sched: Scheduler,
        executor: Box<dyn Executor>,
        connectors: Vec<Connector>,
        mut reports: impl FnMut(ConnectorId) -> Reports,
        env: Box<dyn CoreEnv>,
    ) -> Self {
        let mut workers = Vec::with_capacity(connectors.len());
        let mut sinks = Vec::with_capacity(connectors.len());
        for c in connectors {
            sinks.push(reports(sched.add_connector(c.scheduler)));
            workers.push(c.worker);
        }
        Self::new(sched, executor, workers, sinks, env)
    }

    /// Verifies block ownership and the queues around every step (slow: the simulation, tests).
    pub fn checked(mut self) -> Self {
        self.driver = self.driver.checked();
        self
    }

    /// Shows every computed step to `observer`.
    pub fn with_observer(mut self, observer: Box<dyn StepObserver>) -> Self {
        self.driver.model.observer = Some(observer);
        self
    }

    // ---- reading ----

    pub fn sched(&self) -> &Scheduler {
        &self.driver.sched
    }

    pub fn executor(&self) -> &dyn Executor {
        &*self.driver.model.executor
    }

    pub fn arena(&self) -> &KvArena {
        &self.driver.model.arena
    }

    pub fn counters(&self) -> CoreCounters {
        self.counters
    }

    pub fn transfer_stats(&self) -> &TransferStats {
        &self.driver.model.transfers.stats
    }

    /// The weights' state, for a status call.
    pub fn weight_info(&self) -> WeightInfo {
        let ops = self.driver.model.executor.weight_ops();
        WeightInfo {
            weight_version: self.driver.sched.weight_version().to_owned(),
            n_weight_updates: self.counters.n_weight_updates,
            residency: ops.residency(),
            n_bytes: ops.n_bytes() as u64,
        }
    }

    /// A step would do something: a live request, or connector work or a reset's flush that
    /// needs a (connector-only) step.
    pub fn has_work(&self) -> bool {
        self.driver.sched.n_live() > 0 || self.driver.sched.needs_idle_steps()
    }

    /// The core's next deadline (an export's lease, a lifecycle operation's bound), on the
    /// clock `handle_time` moves.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.driver.sched.next_deadline()
    }

    /// Block ownership, then the queues; the error names the block or request.
    pub fn check(&self) -> Result<(), StepError<ExecError>> {
        self.driver.check()
    }

    // ---- inputs ----

    /// Moves the core's clock to `now`.
    pub fn handle_time(&mut self, now: Duration) {
        self.driver.sched.advance_time(now);
    }

    /// Adds a request. A constraint that allows no first token ends it at once (`stop`,
    /// with why), as an event.
    pub fn handle_add(&mut self, req: NewRequest) -> Result<ReqIdx, AddError> {
        let NewRequest {
            request_id,
            prompt,
            params,
            transfer,
            constraint,
            lora,
        } = req;
        let mut params = params;
        if let Some(name) = lora {
            let Some(lora) = self.loras.resolve(&name) else {
                return Err(AddError::UnknownLora {
                    id: request_id,
                    name: name.to_string(),
                });
            };
            params.lora = Some(lora);
        }
        let lora = params.lora.as_ref().map(|l| l.id);
        // The first mask, before the request can be scheduled.
        let (constraint, refused) = match constraint.map(ConstraintState::start) {
            Some((state, Next::Continue)) => (Some(state), None),
            Some((_, Next::Stop(why))) => (None, Some(why)),
            None => (None, None),
        };
        let idx = self
            .driver
            .sched
            .add_request_with_transfer(request_id, prompt, params, transfer)?;
        let i = idx.0 as usize;
        if self.live.len() <= i {
            self.live.resize_with(i + 1, || None);
        }
        self.live[i] = Some(Live {
            admitted: false,
            constraint,
            next_prompt_logprob: 1,
            lora,
        });
        if let Some(why) = refused {
            self.stop_for_constraint(idx, why);
        }
        Ok(idx)
    }

    /// Aborts a live request by id; false if `id` is not live.
    pub fn handle_abort(&mut self, id: &str) -> bool {
        let Some(out) = self.driver.sched.abort(id) else {
            return false;
        };
        self.emit_finish(out, None, None);
        true
    }

    /// Aborts the live request in slot `idx` (its reader is gone); false if none.
    pub fn handle_abort_idx(&mut self, idx: ReqIdx) -> bool {
        let Some(out) = abort_idx(&mut self.driver.sched, idx) else {
            return false;
        };
        self.emit_finish(out, None, None);
        true
    }

    /// A connector's worker reported; requests it ended (a failed load) finish now.
    pub fn handle_report(&mut self, connector: ConnectorId, report: WorkerReport) {
        let now = self.driver.model.env.now();
        self.driver
            .model
            .transfers
            .on_report(connector, &report, now);
        self.driver.sched.on_worker_report(connector, report);
        self.emit_side_outputs();
    }

    /// A lifecycle call. Its reply comes out as a [`CoreEvent::Reply`] with the returned id:
    /// at once, or (pause, sleep, KV release) when the operation completes.
    pub fn handle_call(&mut self, call: Call) -> OpId {
        self.next_op += 1;
        let op = OpId(self.next_op);
        let result = match call {
            Call::Pause { mode, clear_cache } => {
                let aborted = self.driver.sched.pause(op, mode, clear_cache);
                self.emit_finishes(aborted);
                None
            }
            Call::Sleep { level, mode } => {
                let aborted = self.driver.sched.sleep(op, level, mode);
                self.emit_finishes(aborted);
                None
            }
            Call::Resume => Some(CallResult::Op(self.driver.sched.resume())),
            Call::WakeUp { tags } => Some(CallResult::Op(self.wake_up(&tags))),
            Call::ReleaseKvCacheMemory => match self.driver.sched.release_kv_cache_memory(op) {
                Ok(()) => None,
                Err(e) => Some(CallResult::Op(Err(e))),
            },
            Call::ResetPrefixCache {
                reset_running_requests,
                reset_connector,
            } => Some(CallResult::Reset(
                self.driver
                    .sched
                    .reset_caches_saying(reset_running_requests, reset_connector),
            )),
            Call::AbortRequests { ids } => Some(CallResult::Aborted(match ids {
                None => self.finish_all(FinishReason::Abort) as usize,
                Some(ids) => ids.iter().filter(|id| self.handle_abort(id)).count(),
            })),
            Call::InstallWeights { weights, version } => Some(CallResult::Installed(
                self.install_weights(weights, version),
            )),
            Call::SetWeightVersion { version } => {
                self.driver.sched.set_weight_version(version);
                Some(CallResult::VersionSet)
            }
            Call::Status => Some(CallResult::Status(
                self.driver.sched.lifecycle_status(),
                self.weight_info(),
            )),
            Call::LendWeights { lend } => Some(CallResult::Lent(self.lend_weights(lend))),
            Call::ReturnWeights {
                lend,
                weights,
                version,
            } => Some(CallResult::Installed(
                self.return_weights(lend, weights, version),
            )),
            Call::LoseWeights { lend } => {
                self.lose_weights(lend);
                Some(CallResult::Op(Ok(())))
            }
            Call::LoadLora(load) => {
                let d = &mut self.driver;
                Some(CallResult::LoraLoaded(self.loras.load(
                    *load,
                    &mut *d.model.executor,
                    &mut d.sched,
                )))
            }
            Call::UnloadLora { name } => {
                let d = &mut self.driver;
                let unloaded = self
                    .loras
                    .unload(&name, &mut *d.model.executor, &mut d.sched);
                Some(CallResult::LoraUnloaded(unloaded.map(|aborted| {
                    let n = aborted.len();
                    self.emit_finishes(aborted);
                    n
                })))
            }
        };
        if let Some(result) = result {
            self.events.push_back(CoreEvent::Reply(op, result));
        }
        // Operations that can complete at once reply now, not after the next step.
        self.poll_lifecycle();
        op
    }

    // ---- the step ----

    /// One step if there is work, then the lifecycle moves forward. `None`: nothing was
    /// computed and no worker ran (idle: wait for an input or the next deadline). `Err`: a
    /// broken invariant (ownership, queues, a plan's limits), only with checks on; a failed
    /// forward is no error here (the step's requests are preempted and retried).
    pub fn step(&mut self) -> Result<Option<Stepped>, StepError<ExecError>> {
        let stepped = if self.has_work() {
            self.step_once()?
        } else {
            None
        };
        self.poll_lifecycle();
        Ok(stepped)
    }

    fn step_once(&mut self) -> Result<Option<Stepped>, StepError<ExecError>> {
        let Self {
            driver,
            live,
            events,
            ..
        } = self;
        let step = driver.try_step_with(|sched, plan| {
            attach_masks(live, plan);
            note_admissions(live, events, sched, plan);
        })?;
        let Step {
            plan,
            kind,
            mut outputs,
            n_between,
            failure,
            ..
        } = step;
        // Requests the schedule finished (a failed load) end as aborts do: not counted.
        let step_outputs = outputs.split_off(n_between);
        self.emit_finishes(outputs);
        let forward = self.driver.model.forward;
        match failure {
            None if kind == StepKind::Forward => {
                self.consecutive_failures = 0;
                self.emit_prompt_logprobs();
                self.emit_outputs(step_outputs);
            }
            None => {}
            Some(e) => self.on_step_failure(&plan, &e.to_string()),
        }
        // A failed step's prompt logprobs are not sent.
        self.driver.model.prompt_logprobs.clear();
        self.driver.sched.recycle_plan(plan);
        Ok(match kind {
            StepKind::Idle => None,
            kind => Some(Stepped {
                kind,
                forward: if kind == StepKind::Forward {
                    forward
                } else {
                    Duration::ZERO
                },
            }),
        })
    }

    // ---- the one way out ----

    /// The next event, in the order they happened.
    pub fn poll_event(&mut self) -> Option<CoreEvent> {
        if self.kv_events && self.kv_batches.is_empty() {
            self.driver.sched.take_kv_events(&mut self.kv_batches);
        }
        if let Some(batch) = self.kv_batches.pop_front() {
            return Some(CoreEvent::Kv(batch));
        }
        self.events.pop_front()
    }

    // ---- inside ----

    /// Moves pending lifecycle operations forward and acts on what the core asks: memory
    /// first, then the replies.
    fn poll_lifecycle(&mut self) {
        let mut events = std::mem::take(&mut self.lifecycle_events);
        self.driver.sched.poll_lifecycle(&mut events);
        for event in events.drain(..) {
            let model = &mut self.driver.model;
            match event {
                LifecycleEvent::ReleaseKvMemory => {
                    // Every transfer hold came back before this, so every worker let go of
                    // its grant; one still out would keep only the old memory alive.
                    let n = model.arena.n_outstanding_grants();
                    if n > 0 {
                        tracing::warn!(n, "KV memory released with worker grants still out");
                    }
                    model.arena.release();
                    // Workers' own memory too (the offload tier's host memory).
                    for worker in model.workers.iter_mut().flatten() {
                        worker.release_memory();
                    }
                }
                LifecycleEvent::OffloadWeights => model.executor.weight_ops_mut().offload(),
                // Dropped here, not on another thread: a sleep returns once memory is free.
                LifecycleEvent::DropWeights => drop(model.executor.weight_ops_mut().drop_weights()),
                LifecycleEvent::Done(op) => self
                    .events
                    .push_back(CoreEvent::Reply(op, CallResult::Op(Ok(())))),
                LifecycleEvent::Failed(op, e) => self
                    .events
                    .push_back(CoreEvent::Reply(op, CallResult::Op(Err(e)))),
            }
        }
        self.lifecycle_events = events;
    }

    /// Restores the memory of `tags` (empty: all), weights first since only they can fail,
    /// then tells the core, which resumes once nothing is asleep after a sleep.
    fn wake_up(&mut self, tags: &[WakeTag]) -> Result<(), LifecycleError> {
        let status = self.driver.sched.lifecycle_status();
        let wants = |t: WakeTag| tags.is_empty() || tags.contains(&t);
        let model = &mut self.driver.model;
        if wants(WakeTag::Weights) && status.weights == WeightResidency::Reloading {
            return Err(LifecycleError::Reloading);
        }
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

    /// Installs weights prepared off this thread; a new weight version seeds every hash chain
    /// from now on, so no prefix hit crosses the update, reset or not.
    fn install_weights(
        &mut self,
        weights: PreparedWeights,
        version: Option<String>,
    ) -> Result<(String, Option<RetiredWeights>), WeightError> {
        let retired = self
            .driver
            .model
            .executor
            .weight_ops_mut()
            .install(weights)?;
        Ok((self.new_weight_version(version), retired))
    }

    /// The weights now installed go by `version` (none: the next after the current).
    fn new_weight_version(&mut self, version: Option<String>) -> String {
        let version = version.unwrap_or_else(|| next_version(self.driver.sched.weight_version()));
        self.driver
            .model
            .executor
            .weight_ops_mut()
            .set_version(&version);
        self.driver.sched.set_weight_version(version.clone());
        self.counters.n_weight_updates += 1;
        version
    }

    /// Lends the weights to a reload in place: the lifecycle first (a completed pause, so no
    /// step computes until they return), then the executor (if it reloads in place).
    fn lend_weights(&mut self, lend: LendId) -> Option<RetiredWeights> {
        if !self.driver.sched.lend_weights() {
            return None;
        }
        let lent = self.driver.model.executor.weight_ops_mut().lend();
        if lent.is_none() {
            // Nothing was lent: the weights are where they were.
            self.driver.sched.weights_returned(true);
        } else {
            self.lent_to = Some(lend);
        }
        lent
    }

    /// Whether the weights are lent to `lend`.
    fn lent_to(&self, lend: LendId) -> bool {
        self.lent_to == Some(lend)
            && self.driver.sched.lifecycle_status().weights == WeightResidency::Reloading
    }

    /// Lent weights back, written over with the new ones, under a new version as any update
    /// installs. Refused if none are lent; and (the weights are then lost, as the lent ones
    /// are no more) for weights that are not the complete update of this executor's slots.
    fn return_weights(
        &mut self,
        lend: LendId,
        weights: PreparedWeights,
        version: Option<String>,
    ) -> Result<(String, Option<RetiredWeights>), WeightError> {
        if !self.lent_to(lend) {
            return Err(WeightError::NotLent);
        }
        if let Err(e) = self
            .driver
            .model
            .executor
            .weight_ops_mut()
            .take_back(Some(weights))
        {
            self.lose_weights(lend);
            return Err(e);
        }
        self.lent_to = None;
        self.driver.sched.weights_returned(true);
        Ok((self.new_weight_version(version), None))
    }

    /// A reload in place failed midway: the weights are dropped, as sleep level 2 leaves
    /// them (a complete install and a wake-up of the weights bring them back). Nothing if
    /// the weights are not lent to `lend`.
    fn lose_weights(&mut self, lend: LendId) {
        if !self.lent_to(lend) {
            return;
        }
        self.lent_to = None;
        let ops = self.driver.model.executor.weight_ops_mut();
        if ops.take_back(None).is_err() {
            tracing::error!("the executor had no weights lent to lose");
        }
        self.driver.sched.weights_returned(false);
    }

    /// A failed step (the driver already preempted every running request). After
    /// `MAX_CONSECUTIVE_FAILURES` in a row, every live request ends with `error` so that no
    /// client waits forever on a broken executor.
    fn on_step_failure(&mut self, plan: &StepPlan, error: &str) {
        self.consecutive_failures += 1;
        tracing::error!(
            step = plan.step,
            consecutive = self.consecutive_failures,
            "engine step failed: {error}"
        );
        self.counters.n_step_failures_total += 1;
        if self.consecutive_failures < MAX_CONSECUTIVE_FAILURES {
            return;
        }
        tracing::error!(
            n_requests = self.driver.sched.n_live(),
            "{MAX_CONSECUTIVE_FAILURES} consecutive step failures: finishing every request with an error"
        );
        self.consecutive_failures = 0;
        // Each request's error says why: a client (and the simulation's blame check) reads
        // the executor's failure, not a bare `error`.
        let why =
            format!("{MAX_CONSECUTIVE_FAILURES} engine steps failed in a row, the last: {error}");
        let n = self.end_all(FinishReason::Error, Some(&why));
        self.counters.n_requests_finished_total += n;
    }

    /// Finishes every live request with `reason` (abort or error). Returns how many.
    pub fn finish_all(&mut self, reason: FinishReason) -> u64 {
        self.end_all(reason, None)
    }

    /// Finishes every live request with `reason` and, if given, `message` as each one's.
    fn end_all(&mut self, reason: FinishReason, message: Option<&str>) -> u64 {
        let outs = self.driver.sched.abort_all();
        let n = outs.len() as u64;
        for out in outs {
            self.emit_finish(out, Some(reason), message);
        }
        n
    }

    /// The outputs of requests the core finished between steps (a failed KV load).
    fn emit_side_outputs(&mut self) {
        let outs = self.driver.sched.take_outputs();
        self.emit_finishes(outs);
    }

    fn emit_finishes(&mut self, outs: Vec<RequestOutput>) {
        for out in outs {
            self.emit_finish(out, None, None);
        }
    }

    /// The final event of a request finished outside a step's output (abort, error, a failed
    /// load), with `reason` and `message` overriding the core's.
    fn emit_finish(
        &mut self,
        out: RequestOutput,
        reason: Option<FinishReason>,
        message: Option<&str>,
    ) {
        let Some(finished) = out.finished else {
            return;
        };
        if self
            .live
            .get_mut(out.req.0 as usize)
            .and_then(Option::take)
            .is_none()
        {
            return;
        }
        if let Some(message) = &finished.message {
            tracing::warn!(request_id = %finished.request_id, "request failed: {message}");
        }
        let mut finish = EngineFinish::of(*finished);
        if let Some(reason) = reason {
            finish.reason = reason;
        }
        if let Some(message) = message {
            finish.message = Some(message.to_owned());
        }
        self.events.push_back(CoreEvent::Request(
            out.req,
            Event::Output {
                sampled: None,
                finish: Some(finish),
                weight_version: None,
                lora_version: None,
                forced: false,
            },
        ));
    }

    /// Ends a live request whose constraint cannot go on: `stop`, with why.
    fn stop_for_constraint(&mut self, idx: ReqIdx, why: String) {
        let Some(out) = abort_idx(&mut self.driver.sched, idx) else {
            return;
        };
        if self
            .live
            .get_mut(idx.0 as usize)
            .and_then(Option::take)
            .is_none()
        {
            return;
        }
        let (transfer, routing) = out
            .finished
            .map_or((None, None), |f| (f.transfer, f.routing));
        self.events.push_back(CoreEvent::Request(
            idx,
            Event::Output {
                sampled: None,
                finish: Some(EngineFinish {
                    reason: FinishReason::Stop,
                    stop_token: None,
                    transfer,
                    kv_transfer_params: None,
                    message: None,
                    constraint_stop: Some(why),
                    routing,
                }),
                weight_version: None,
                lora_version: None,
                forced: false,
            },
        ));
    }

    /// A successful step's outputs, each to its request: the token (stamped with the weight
    /// version that computed it) and, on the last, the finish. A constrained request's
    /// matcher takes its token first; one that cannot go on ends with this token.
    fn emit_outputs(&mut self, outputs: Vec<RequestOutput>) {
        let mut n_tokens = 0;
        let mut n_finished = 0;
        let version = self.driver.sched.weight_version_shared();
        let mut constrained = self.advance_constraints(&outputs);
        for out in outputs {
            n_tokens += u64::from(out.sampled.is_some());
            n_finished += u64::from(out.finished.is_some());
            let i = out.req.0 as usize;
            if self.live.get(i).and_then(Option::as_ref).is_none() {
                continue;
            }
            let mut finish = out.finished.map(|f| EngineFinish {
                stop_token: (f.reason == FinishReason::Stop)
                    .then(|| out.sampled.as_ref().map(|s| s.token))
                    .flatten(),
                ..EngineFinish::of(*f)
            });
            let mut forced = false;
            if let Some((was_forced, next)) = constrained.get_mut(i).and_then(Option::take) {
                forced = was_forced;
                if let (Next::Stop(why), None) = (next, &finish) {
                    let aborted = abort_idx(&mut self.driver.sched, out.req);
                    n_finished += 1;
                    finish = aborted.and_then(|a| a.finished).map(|f| EngineFinish {
                        reason: FinishReason::Stop,
                        kv_transfer_params: None,
                        message: None,
                        constraint_stop: Some(why),
                        ..EngineFinish::of(*f)
                    });
                }
            }
            let weight_version = out.sampled.is_some().then(|| version.clone());
            // Calls run between steps, so the table's version is the one this step used.
            let lora_version = match (&out.sampled, self.live[i].as_ref().and_then(|l| l.lora)) {
                (Some(_), Some(id)) => self.driver.sched.lora(id).map(|l| l.version),
                _ => None,
            };
            if finish.is_some() {
                self.live[i] = None;
            }
            self.events.push_back(CoreEvent::Request(
                out.req,
                Event::Output {
                    sampled: out.sampled,
                    finish,
                    weight_version,
                    lora_version,
                    forced,
                },
            ));
        }
        self.counters.n_generated_tokens_total += n_tokens;
        self.counters.n_requests_finished_total += n_finished;
    }

    /// Sends the last forward's prompt logprobs to their requests, each position once.
    fn emit_prompt_logprobs(&mut self) {
        for p in std::mem::take(&mut self.driver.model.prompt_logprobs) {
            let Some(live) = self.live.get_mut(p.req.0 as usize).and_then(Option::as_mut) else {
                continue;
            };
            let skip = live.next_prompt_logprob.saturating_sub(p.first_target);
            if p.first_target > live.next_prompt_logprob || skip >= p.tokens.len() {
                continue;
            }
            live.next_prompt_logprob = p.first_target + p.tokens.len();
            let tokens = p.tokens.into_iter().skip(skip).collect();
            self.events
                .push_back(CoreEvent::Request(p.req, Event::PromptLogprobs(tokens)));
        }
    }

    /// Feeds each constrained request the token it just sampled and computes its next mask
    /// (through the environment: in parallel on the engine thread): per live slot, whether
    /// the token was forced and what the constraint says next. A request that finished with
    /// this token only reports whether it was forced.
    fn advance_constraints(&mut self, outputs: &[RequestOutput]) -> Vec<Option<(bool, Next)>> {
        let mut work = Vec::new();
        let mut by_slot: Vec<Option<(TokenId, bool)>> = Vec::new();
        for out in outputs {
            let i = out.req.0 as usize;
            let constrained = self
                .live
                .get(i)
                .and_then(Option::as_ref)
                .is_some_and(|l| l.constraint.is_some());
            if let (Some(s), true) = (&out.sampled, constrained) {
                if by_slot.is_empty() {
                    by_slot = vec![None; self.live.len()];
                }
                by_slot[i] = Some((s.token, out.finished.is_some()));
            }
        }
        if by_slot.is_empty() {
            return Vec::new();
        }
        for (slot, (live, token)) in self.live.iter_mut().zip(&by_slot).enumerate() {
            let (Some(state), Some((token, finished))) =
                (live.as_mut().and_then(|l| l.constraint.as_mut()), *token)
            else {
                continue;
            };
            work.push(MaskWork {
                state,
                token,
                finished,
                slot,
                result: None,
            });
        }
        if work.len() == 1 {
            work[0].run();
        } else {
            self.driver.model.env.run_masks(&mut work);
        }
        let mut results: Vec<Option<(bool, Next)>> = vec![None; by_slot.len()];
        for w in work {
            results[w.slot] = w.result;
        }
        results
    }
}

/// Gives each constrained sample of `plan` its request's mask: the plan's `token_masks`,
/// indexed by the sample's `mask`.
fn attach_masks(live: &[Option<Live>], plan: &mut StepPlan) {
    let StepPlan {
        reqs, token_masks, ..
    } = plan;
    for r in reqs.iter_mut() {
        let Some(sample) = r.sample.as_mut() else {
            continue;
        };
        let live = live.get(r.req.0 as usize).and_then(Option::as_ref);
        if let Some(state) = live.and_then(|l| l.constraint.as_ref()) {
            sample.mask = Some(token_masks.len() as u32);
            token_masks.push(state.mask().clone());
        }
    }
}

/// `Admitted` (with the prefix-cache and loaded token count) for requests scheduled for the
/// first time, read while the plan's requests are all still live.
fn note_admissions(
    live: &mut [Option<Live>],
    events: &mut VecDeque<CoreEvent>,
    sched: &Scheduler,
    plan: &StepPlan,
) {
    for r in &plan.reqs {
        let Some(l) = live.get_mut(r.req.0 as usize).and_then(Option::as_mut) else {
            continue;
        };
        if l.admitted {
            continue;
        }
        l.admitted = true;
        let n_cached_tokens = sched.request(r.req).map_or(0, |req| req.n_cached_tokens);
        events.push_back(CoreEvent::Request(
            r.req,
            Event::Admitted { n_cached_tokens },
        ));
    }
}

/// Aborts the live request at `idx` in the core.
fn abort_idx(core: &mut Scheduler, idx: ReqIdx) -> Option<RequestOutput> {
    let id = core.request(idx)?.id.clone();
    core.abort(&id)
}

/// The version a weight update gets when the caller names none: `v` → `v+1`, `v+1` → `v+2`.
pub fn next_version(current: &str) -> String {
    if let Some((base, n)) = current.rsplit_once('+') {
        if let Ok(n) = n.parse::<u64>() {
            return format!("{base}+{}", n + 1);
        }
    }
    format!("{current}+1")
}
