//! The engine thread: drains inputs, steps the core and the executor, sends raw outputs.
//!
//! `run` reads as its phases: `drain_inputs` (every queued input, in order, between steps),
//! the core's clock moved to now, then `step` while there is work (`schedule` → the
//! connectors' workers → `Executor::execute` → `on_step_output` → `dispatch_outputs`; a
//! step with connector work but no tokens runs the workers only), else `run_idle_work` and a
//! wait for the next input or the core's next deadline (an export's lease, a lifecycle
//! operation's bound), whichever comes first. Nothing spins: workers report on the input
//! queue. Pending deferred replies are checked after every step and when idle.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ferry_core::{
    ConnectorId, FinishReason, LifecycleError, LifecycleEvent, OpId, ReqIdx, RequestOutput,
    Scheduler, StepPlan, TokenId, WakeTag, WeightResidency,
};
use ferry_kv::{KvArena, Reports, WorkerConnector};
use ferry_model::{ExecError, Executor, PreparedWeights, WeightError};
use rayon::prelude::*;
use tokio::sync::{mpsc, oneshot, watch};

use crate::constraint::{ConstraintState, Next};
use crate::input::{
    AddInput, EngineFinish, Event, Input, LifecycleCall, OpReply, Queued, Reply, Utility,
};
use crate::transfer_stats::TransferTally;
use crate::{EngineStats, WeightInfo};

/// Consecutive failed steps after which every live request is finished with `error`.
pub(crate) const MAX_CONSECUTIVE_FAILURES: u32 = 3;

/// The engine thread's view of one live request.
#[derive(Debug)]
struct Live {
    events: mpsc::UnboundedSender<Event>,
    /// `Event::Admitted` was sent (at the first schedule).
    admitted: bool,
    /// The structured-output constraint, with the mask of the next token.
    constraint: Option<ConstraintState>,
}

/// A reply held back until the engine reaches a state.
#[derive(Debug)]
enum Deferred {
    /// Until no request is live.
    Idle(Reply<()>),
}

/// Why a step produced no outputs.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("the executor's output does not answer the plan: {0}")]
    Output(#[from] ferry_core::OutputError),
}

/// Everything the engine thread owns.
pub(crate) struct EngineLoop {
    core: Scheduler,
    executor: Box<dyn Executor>,
    arena: KvArena,
    inputs: mpsc::UnboundedReceiver<Queued>,
    /// Indexed by `ReqIdx`: the core reuses slots, so this stays as small as the peak load.
    live: Vec<Option<Live>>,
    deferred: Vec<Deferred>,
    /// Replies of pending lifecycle operations, by the id the core knows them by.
    ops: BTreeMap<OpId, OpReply>,
    next_op: u64,
    /// Reused by `poll_lifecycle`.
    lifecycle_events: Vec<LifecycleEvent>,
    /// Lifecycle replies waiting for the stats to be published (`reply_later`).
    replies: Vec<Box<dyn FnOnce() + Send>>,
    n_weight_updates: u64,
    stats: watch::Sender<EngineStats>,
    consecutive_failures: u32,
    /// Set by `Shutdown`: its reply is sent as the thread's last act.
    shutdown: Option<oneshot::Sender<()>>,
    /// Set when the loop must end (shutdown, or every handle gone).
    stopping: bool,
    /// Each connector's worker side, by `ConnectorId` (`None`: its jobs need no worker).
    workers: Vec<Option<Box<dyn WorkerConnector>>>,
    /// Each connector's report sink: puts a worker's result on this engine's input queue.
    reports: Vec<Reports>,
    /// The core's clock is `epoch.elapsed()`.
    epoch: Instant,
    /// Reused for the connector work a step's output produces.
    after_work: Vec<ferry_core::StepWork>,
    /// Runs the timed wait for an input (tokio's channel has no blocking receive with a
    /// timeout); current-thread, so it adds no thread.
    waiter: tokio::runtime::Runtime,
    /// KV transfer counters for the stats.
    transfers: TransferTally,
}

impl EngineLoop {
    pub(crate) fn new(
        core: Scheduler,
        executor: Box<dyn Executor>,
        inputs: mpsc::UnboundedReceiver<Queued>,
        stats: watch::Sender<EngineStats>,
        workers: Vec<Option<Box<dyn WorkerConnector>>>,
        reports: mpsc::WeakUnboundedSender<Queued>,
    ) -> std::io::Result<Self> {
        let config = core.config();
        let layout = executor.kv_layout(config.block_size);
        let transfers = TransferTally::new(layout.block_bytes());
        let arena = KvArena::new(layout, config.n_blocks as usize);
        let reports = (0..workers.len())
            .map(|c| {
                let tx = reports.clone();
                let connector = ConnectorId(c as u32);
                Reports::new(move |report| {
                    // A weak sender: reports never keep a stopped engine's queue alive.
                    if let Some(tx) = tx.upgrade() {
                        let _ = tx.send(Queued {
                            input: Input::Connector(connector, report),
                            permit: None,
                            slot: None,
                        });
                    }
                })
            })
            .collect();
        let waiter = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        Ok(Self {
            core,
            executor,
            arena,
            inputs,
            live: Vec::new(),
            deferred: Vec::new(),
            ops: BTreeMap::new(),
            next_op: 0,
            lifecycle_events: Vec::new(),
            replies: Vec::new(),
            n_weight_updates: 0,
            stats,
            consecutive_failures: 0,
            shutdown: None,
            stopping: false,
            workers,
            reports,
            epoch: Instant::now(),
            after_work: Vec::new(),
            waiter,
            transfers,
        })
    }

    /// The thread's body: loops until shutdown or until every handle is gone.
    pub(crate) fn run(mut self) {
        self.publish_stats(Duration::ZERO, Duration::ZERO, 0, 0);
        let mut busy_since = Instant::now();
        while !self.stopping {
            let started = Instant::now();
            self.drain_inputs();
            if self.stopping {
                break;
            }
            self.core.advance_time(self.epoch.elapsed());
            if self.step(started) {
                self.poll_lifecycle();
                if !self.replies.is_empty() {
                    self.publish_stats(Duration::ZERO, Duration::ZERO, 0, 0);
                    self.send_replies();
                }
                self.check_deferred();
            } else {
                self.run_idle_work();
                // A connector with jobs to deliver, or a reset's flush, needs another turn
                // (a connector-only step); otherwise wait for an input or the next deadline.
                if !self.core.needs_idle_steps() {
                    let busy = busy_since.elapsed().as_secs_f64();
                    let transfers = &self.transfers.stats;
                    self.stats.send_modify(|s| {
                        s.busy_seconds_total += busy;
                        s.transfers.clone_from(transfers);
                    });
                    self.wait_for_input();
                    busy_since = Instant::now();
                }
            }
        }
        self.stop();
    }

    /// Handles every queued input, in arrival order, without blocking.
    fn drain_inputs(&mut self) {
        while !self.stopping {
            match self.inputs.try_recv() {
                Ok(queued) => self.handle(queued),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => self.stopping = true,
            }
        }
    }

    /// Blocks until an input arrives or the core's next deadline passes (only when there is
    /// nothing to step). An idle engine with an export on lease wakes to expire it.
    fn wait_for_input(&mut self) {
        let received = match self.core.next_deadline() {
            None => self.inputs.blocking_recv(),
            Some(deadline) => {
                let Some(left) = deadline.checked_sub(self.epoch.elapsed()) else {
                    return;
                };
                let inputs = &mut self.inputs;
                match self
                    .waiter
                    .block_on(async { tokio::time::timeout(left, inputs.recv()).await })
                {
                    Ok(received) => received,
                    // The deadline: the loop moves the core's clock and acts on it.
                    Err(_) => return,
                }
            }
        };
        match received {
            Some(queued) => self.handle(queued),
            None => self.stopping = true,
        }
    }

    fn handle(&mut self, queued: Queued) {
        // The core's clock first: an input can come after a long idle wait, and a lifecycle
        // call that starts a reset takes its deadline from the core's clock (found by the
        // simulation: after an idle spell longer than `lifecycle_wait_timeout`, a clearing
        // pause timed out at once).
        self.core.advance_time(self.epoch.elapsed());
        // The permit frees a queue slot as soon as the input is off the queue.
        let Queued {
            input,
            permit,
            slot,
        } = queued;
        drop((permit, slot));
        match input {
            Input::Add(add) => self.add(add),
            Input::Abort(id) => {
                self.abort(&id);
            }
            Input::Utility(call) => self.utility(call),
            Input::Connector(connector, report) => {
                self.transfers.on_report(connector, &report, Instant::now());
                self.core.on_worker_report(connector, report);
                self.finish_side_outputs();
            }
        }
    }

    /// Sends the outputs of requests the core finished between steps (a failed KV load).
    fn finish_side_outputs(&mut self) {
        for out in self.core.take_outputs() {
            self.finish_output(out, None);
        }
    }

    fn add(&mut self, add: AddInput) {
        let AddInput {
            request_id,
            prompt,
            params,
            events,
            accepted,
            kv_transfer_params,
            constraint,
        } = add;
        // The first mask, before the request can be scheduled. A constraint that allows no
        // first token ends the request at once (with `stop`, and why).
        let (constraint, refused) = match constraint.map(|c| ConstraintState::start(*c)) {
            Some((state, Next::Continue)) => (Some(state), None),
            Some((_, Next::Stop(why))) => (None, Some(why)),
            None => (None, None),
        };
        let added = self.core.add_request_with_transfer(
            request_id.clone(),
            prompt,
            params,
            kv_transfer_params.map(|p| *p),
        );
        match added {
            Ok(idx) => {
                if accepted.send(Ok(())).is_err() {
                    // The caller stopped waiting: nobody would read the stream.
                    self.core.abort(&request_id);
                    return;
                }
                self.set_live(
                    idx,
                    Live {
                        events,
                        admitted: false,
                        constraint,
                    },
                );
                if let Some(why) = refused {
                    self.stop_for_constraint(idx, why);
                }
            }
            Err(e) => {
                let _ = accepted.send(Err(e));
            }
        }
    }

    fn set_live(&mut self, idx: ReqIdx, live: Live) {
        let i = idx.0 as usize;
        if self.live.len() <= i {
            self.live.resize_with(i + 1, || None);
        }
        self.live[i] = Some(live);
    }

    /// Aborts a live request; false if `id` is not live.
    fn abort(&mut self, id: &str) -> bool {
        let Some(out) = self.core.abort(id) else {
            return false;
        };
        self.finish_output(out, None);
        true
    }

    fn utility(&mut self, call: Utility) {
        match call {
            Utility::Shutdown(reply) => {
                self.shutdown = Some(reply);
                self.stopping = true;
            }
            Utility::WaitIdle(reply) => self.deferred.push(Deferred::Idle(reply)),
            Utility::CheckInvariants(reply) => {
                let result = self
                    .core
                    .check_ownership()
                    .map_err(|e| e.to_string())
                    .and_then(|()| self.core.check_queues().map_err(|e| e.to_string()));
                let _ = reply.send(result);
            }
            Utility::Lifecycle(call) => {
                let started = Instant::now();
                self.lifecycle(call);
                // Operations that can complete at once reply now, not after the next step.
                self.poll_lifecycle();
                let handled = started.elapsed().as_secs_f64();
                self.stats.send_modify(|s| {
                    s.n_lifecycle_calls_total += 1;
                    s.lifecycle_call_seconds_total += handled;
                });
                self.publish_stats(Duration::ZERO, Duration::ZERO, 0, 0);
                self.send_replies();
            }
        }
    }

    fn next_op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(self.next_op)
    }

    /// One lifecycle call (see `lifecycle.rs` for each one's contract).
    fn lifecycle(&mut self, call: LifecycleCall) {
        match call {
            LifecycleCall::Pause {
                mode,
                clear_cache,
                reply,
            } => {
                let op = self.next_op();
                self.ops.insert(op, reply);
                let aborted = self.core.pause(op, mode, clear_cache);
                self.finish_outputs(aborted);
            }
            LifecycleCall::Sleep { level, mode, reply } => {
                let op = self.next_op();
                self.ops.insert(op, reply);
                let aborted = self.core.sleep(op, level, mode);
                self.finish_outputs(aborted);
            }
            LifecycleCall::Resume(reply) => {
                let result = self.core.resume();
                self.reply_later(reply, result);
            }
            LifecycleCall::WakeUp { tags, reply } => {
                let result = self.wake_up(&tags);
                self.reply_later(reply, result);
            }
            LifecycleCall::ReleaseKvCacheMemory(reply) => {
                let op = self.next_op();
                match self.core.release_kv_cache_memory(op) {
                    Ok(()) => {
                        self.ops.insert(op, reply);
                    }
                    Err(e) => {
                        self.reply_later(reply, Err(e));
                    }
                }
            }
            LifecycleCall::ResetPrefixCache {
                reset_running_requests,
                reset_connector,
                reply,
            } => {
                let ok = self
                    .core
                    .reset_caches(reset_running_requests, reset_connector);
                self.reply_later(reply, ok);
            }
            LifecycleCall::AbortRequests { ids, reply } => {
                let n = match ids {
                    None => self.finish_all(FinishReason::Abort) as usize,
                    Some(ids) => ids.iter().filter(|id| self.abort(id)).count(),
                };
                self.reply_later(reply, n);
            }
            LifecycleCall::InstallWeights {
                weights,
                version,
                reply,
            } => {
                let result = self.install_weights(weights, version);
                self.reply_later(reply, result);
            }
            LifecycleCall::SetWeightVersion { version, reply } => {
                self.set_weight_version(version);
                self.reply_later(reply, ());
            }
            LifecycleCall::Status(reply) => {
                let info = WeightInfo {
                    weight_version: self.core.weight_version().to_owned(),
                    n_weight_updates: self.n_weight_updates,
                    residency: self.executor.weight_ops().residency(),
                    n_bytes: self.executor.weight_ops().n_bytes() as u64,
                };
                let status = self.core.lifecycle_status();
                self.reply_later(reply, (status, info));
            }
        }
    }

    /// Restores the memory of `tags` (empty: all), weights first since only they can fail,
    /// then tells the core, which resumes once nothing is asleep after a sleep.
    fn wake_up(&mut self, tags: &[WakeTag]) -> Result<(), LifecycleError> {
        let status = self.core.lifecycle_status();
        let wants = |t: WakeTag| tags.is_empty() || tags.contains(&t);
        if wants(WakeTag::Weights) && status.weights != WeightResidency::Resident {
            self.executor
                .weight_ops_mut()
                .restore()
                .map_err(|_| LifecycleError::WeightsDropped)?;
        }
        if wants(WakeTag::KvCache) && status.kv_released {
            self.arena.reallocate();
        }
        self.core.wake_up(tags);
        Ok(())
    }

    /// Installs weights prepared off this thread; a new weight version seeds every hash chain
    /// from now on, so no prefix hit crosses the update, reset or not.
    fn install_weights(
        &mut self,
        weights: PreparedWeights,
        version: Option<String>,
    ) -> Result<(String, Option<ferry_model::RetiredWeights>), WeightError> {
        let retired = self.executor.weight_ops_mut().install(weights)?;
        let version = version.unwrap_or_else(|| next_version(self.core.weight_version()));
        self.executor.weight_ops_mut().set_version(&version);
        self.set_weight_version(version.clone());
        self.n_weight_updates += 1;
        Ok((version, retired))
    }

    fn set_weight_version(&mut self, version: String) {
        self.core.set_weight_version(version);
    }

    /// Moves pending lifecycle operations forward and acts on what the core asks: memory
    /// first, then the replies (queued; see `reply_later`).
    fn poll_lifecycle(&mut self) {
        let mut events = std::mem::take(&mut self.lifecycle_events);
        self.core.poll_lifecycle(&mut events);
        for event in events.drain(..) {
            match event {
                LifecycleEvent::ReleaseKvMemory => {
                    // Every transfer hold came back before this, so every worker let go of
                    // its grant; one still out would keep only the old memory alive.
                    let n = self.arena.n_outstanding_grants();
                    if n > 0 {
                        tracing::warn!(n, "KV memory released with worker grants still out");
                    }
                    self.arena.release();
                    // Workers' own memory too (the offload tier's host memory).
                    for worker in self.workers.iter_mut().flatten() {
                        worker.release_memory();
                    }
                }
                LifecycleEvent::OffloadWeights => self.executor.weight_ops_mut().offload(),
                // Dropped here, not on another thread: a sleep returns once memory is free.
                LifecycleEvent::DropWeights => drop(self.executor.weight_ops_mut().drop_weights()),
                LifecycleEvent::Done(op) => self.reply_op(op, Ok(())),
                LifecycleEvent::Failed(op, e) => self.reply_op(op, Err(e)),
            }
        }
        self.lifecycle_events = events;
    }

    fn reply_op(&mut self, op: OpId, result: Result<(), LifecycleError>) {
        if let Some(reply) = self.ops.remove(&op) {
            self.reply_later(reply, result);
        }
    }

    /// Queues a lifecycle reply until `send_replies`, which runs after the stats are
    /// published: a caller that reads the stats after its reply sees what its call did.
    fn reply_later<T: Send + 'static>(&mut self, reply: Reply<T>, result: T) {
        self.replies.push(Box::new(move || {
            let _ = reply.send(result);
        }));
    }

    fn send_replies(&mut self) {
        for send in self.replies.drain(..) {
            send();
        }
    }

    fn finish_outputs(&mut self, outs: Vec<RequestOutput>) {
        for out in outs {
            self.finish_output(out, None);
        }
    }

    /// Runs one step if there is work; false if there was none (the caller then waits). A
    /// plan with connector work and no tokens is a connector-only step: the workers run, the
    /// executor does not.
    fn step(&mut self, started: Instant) -> bool {
        if self.core.n_live() == 0 && !self.core.needs_idle_steps() {
            return false;
        }
        let mut plan = self.core.schedule();
        self.attach_masks(&mut plan);
        self.finish_side_outputs();
        if plan.is_idle() {
            // Nothing schedulable (e.g. paused): wait for an input rather than spin.
            self.core.recycle_plan(plan);
            return false;
        }
        self.run_workers(&plan.connector_work, false);
        if plan.is_empty() {
            self.core.recycle_plan(plan);
            return true;
        }
        self.note_admissions(&plan);
        let forward_started = Instant::now();
        let result = self.executor.execute(&plan, &mut self.arena);
        let forward = forward_started.elapsed();
        let result = result
            .map_err(StepError::from)
            .and_then(|out| Ok(self.core.on_step_output(&plan, &out)?));
        let (n_tokens, n_finished) = match result {
            Ok(outputs) => {
                self.consecutive_failures = 0;
                // Exports of requests that just finished are served before their parameters
                // reach anyone.
                let mut work = std::mem::take(&mut self.after_work);
                self.core.take_connector_work(&mut work);
                self.run_workers(&work, true);
                work.clear();
                self.after_work = work;
                (0, self.dispatch_outputs(outputs))
            }
            Err(e) => (0, self.on_step_failure(&plan, e)),
        };
        self.core.recycle_plan(plan);
        self.publish_stats(started.elapsed(), forward, n_tokens, n_finished);
        true
    }

    /// Hands each connector's jobs to its worker: the plan's before the forward, those the
    /// step's output produced after it (`after`).
    fn run_workers(&mut self, work: &[ferry_core::StepWork], after: bool) {
        for w in work {
            self.transfers.on_jobs(w.connector, &w.jobs, Instant::now());
            let c = w.connector.0 as usize;
            let reports = &self.reports[c];
            match self.workers.get_mut(c).and_then(Option::as_mut) {
                Some(worker) if after => worker.after_forward(&w.jobs, &mut self.arena, reports),
                Some(worker) => worker.before_forward(&w.jobs, &mut self.arena, reports),
                None => tracing::error!(
                    connector = c,
                    n_jobs = w.jobs.len(),
                    "a connector planned worker jobs but has no worker; they are dropped"
                ),
            }
        }
    }

    /// Sends `Admitted` (with the prefix-cache hit count) to requests scheduled for the first
    /// time.
    fn note_admissions(&mut self, plan: &StepPlan) {
        for r in &plan.reqs {
            let Some(live) = self.live.get_mut(r.req.0 as usize).and_then(Option::as_mut) else {
                continue;
            };
            if live.admitted {
                continue;
            }
            live.admitted = true;
            let n_cached_tokens = self
                .core
                .request(r.req)
                .map_or(0, |req| req.n_cached_tokens);
            let _ = live.events.send(Event::Admitted { n_cached_tokens });
        }
    }

    /// Sends each output to its request's channel. A request whose reader is gone is aborted
    /// here too (the stream's own abort may still be queued). The step's token and finish
    /// counts are published before the first event goes out, so a client that has read its
    /// last token never sees metrics without it. Returns the finishes counted after that
    /// (requests aborted because their reader was gone).
    fn dispatch_outputs(&mut self, outputs: Vec<RequestOutput>) -> u64 {
        let mut n_tokens = 0;
        let mut n_finished = 0;
        let mut events = Vec::with_capacity(outputs.len());
        // Stamped on every output token: the version of the weights that computed it.
        let version = self.core.weight_version_shared();
        let mut constrained = self.advance_constraints(&outputs);
        for out in outputs {
            n_tokens += u64::from(out.sampled.is_some());
            n_finished += u64::from(out.finished.is_some());
            let i = out.req.0 as usize;
            if self.live.get(i).and_then(Option::as_ref).is_none() {
                continue;
            }
            let mut finish = out.finished.map(|f| EngineFinish {
                reason: f.reason,
                stop_token: (f.reason == FinishReason::Stop)
                    .then(|| out.sampled.as_ref().map(|s| s.token))
                    .flatten(),
                transfer: f.transfer,
                kv_transfer_params: f.kv_transfer_params.map(Box::new),
                message: f.message,
                constraint_stop: None,
            });
            // The constraint takes the token and readies the next mask; one that cannot go
            // on ends the request with this token.
            let mut forced = false;
            if let Some((was_forced, next)) = constrained.get_mut(i).and_then(Option::take) {
                forced = was_forced;
                if let (Next::Stop(why), None) = (next, &finish) {
                    let aborted = abort_idx(&mut self.core, out.req);
                    n_finished += 1;
                    finish = aborted.and_then(|a| a.finished).map(|f| EngineFinish {
                        reason: FinishReason::Stop,
                        stop_token: None,
                        transfer: f.transfer,
                        kv_transfer_params: f.kv_transfer_params.map(Box::new),
                        message: None,
                        constraint_stop: Some(why),
                    });
                }
            }
            let weight_version = out.sampled.is_some().then(|| version.clone());
            let finished = finish.is_some();
            let event = Event::Output {
                sampled: out.sampled,
                finish,
                weight_version,
                forced,
            };
            events.push((i, out.req, event, finished));
        }
        self.stats.send_modify(|s| {
            s.n_generated_tokens_total += n_tokens;
            s.n_requests_finished_total += n_finished;
        });
        let mut n_late = 0;
        for (i, req, event, finished) in events {
            let Some(live) = self.live.get_mut(i).and_then(Option::as_mut) else {
                continue;
            };
            let gone = live.events.send(event).is_err();
            if finished {
                self.live[i] = None;
            } else if gone {
                if let Some(id) = self.core.request(req).map(|r| r.id.clone()) {
                    n_late += u64::from(self.abort(&id));
                }
            }
        }
        n_late
    }

    /// Feeds each constrained request the token it just sampled and computes its next mask,
    /// spread over rayon's threads (a mask over a 50k vocabulary can take a millisecond):
    /// per live slot, whether the token was forced and what the constraint says next. A
    /// request that finished with this token only reports whether it was forced.
    fn advance_constraints(&mut self, outputs: &[RequestOutput]) -> Vec<Option<(bool, Next)>> {
        let mut tokens: Vec<Option<(TokenId, bool)>> = vec![None; self.live.len()];
        let mut n = 0;
        for out in outputs {
            let i = out.req.0 as usize;
            let constrained = self
                .live
                .get(i)
                .and_then(Option::as_ref)
                .is_some_and(|l| l.constraint.is_some());
            if let (Some(s), true) = (&out.sampled, constrained) {
                tokens[i] = Some((s.token, out.finished.is_some()));
                n += 1;
            }
        }
        if n == 0 {
            return Vec::new();
        }
        let advance = |(live, token): (&mut Option<Live>, &Option<(TokenId, bool)>)| {
            let state = live.as_mut()?.constraint.as_mut()?;
            let (token, finished) = (*token)?;
            let forced = state.forced();
            Some(if finished {
                (forced, Next::Continue)
            } else {
                (forced, state.advance(token))
            })
        };
        if n == 1 {
            self.live.iter_mut().zip(&tokens).map(advance).collect()
        } else {
            self.live.par_iter_mut().zip(&tokens).map(advance).collect()
        }
    }

    /// Sends the final event of a request finished outside a step (abort, error), with
    /// `reason` overriding the core's.
    fn finish_output(&mut self, out: RequestOutput, reason: Option<FinishReason>) {
        let Some(finished) = out.finished else {
            return;
        };
        let Some(live) = self.live.get_mut(out.req.0 as usize).and_then(Option::take) else {
            return;
        };
        if let Some(message) = &finished.message {
            tracing::warn!(request_id = %finished.request_id, "request failed: {message}");
        }
        let finish = EngineFinish {
            reason: reason.unwrap_or(finished.reason),
            stop_token: None,
            transfer: finished.transfer,
            kv_transfer_params: finished.kv_transfer_params.map(Box::new),
            message: finished.message,
            constraint_stop: None,
        };
        let _ = live.events.send(Event::Output {
            sampled: None,
            finish: Some(finish),
            weight_version: None,
            forced: false,
        });
    }

    /// Ends a live request whose constraint cannot go on: `stop`, with why.
    fn stop_for_constraint(&mut self, idx: ReqIdx, why: String) {
        let Some(out) = abort_idx(&mut self.core, idx) else {
            return;
        };
        let Some(live) = self.live.get_mut(idx.0 as usize).and_then(Option::take) else {
            return;
        };
        let finished = out.finished;
        let _ = live.events.send(Event::Output {
            sampled: None,
            finish: Some(EngineFinish {
                reason: FinishReason::Stop,
                stop_token: None,
                transfer: finished.as_ref().and_then(|f| f.transfer),
                kv_transfer_params: None,
                message: None,
                constraint_stop: Some(why),
            }),
            weight_version: None,
            forced: false,
        });
    }

    /// Gives each constrained sample of `plan` its request's mask: the plan's
    /// `token_masks`, indexed by the sample's `mask`.
    fn attach_masks(&self, plan: &mut StepPlan) {
        let StepPlan {
            reqs, token_masks, ..
        } = plan;
        for r in reqs.iter_mut() {
            let Some(sample) = r.sample.as_mut() else {
                continue;
            };
            let live = self.live.get(r.req.0 as usize).and_then(Option::as_ref);
            if let Some(state) = live.and_then(|l| l.constraint.as_ref()) {
                sample.mask = Some(token_masks.len() as u32);
                token_masks.push(state.mask().clone());
            }
        }
    }

    /// A failed step: the core already advanced its computed counts for the plan, so every
    /// running request is preempted (its KV recomputed later). After
    /// `MAX_CONSECUTIVE_FAILURES` in a row, every live request ends with `error` so that no
    /// client waits forever on a broken executor. Returns how many requests it finished.
    fn on_step_failure(&mut self, plan: &StepPlan, error: StepError) -> u64 {
        self.consecutive_failures += 1;
        tracing::error!(
            step = plan.step,
            consecutive = self.consecutive_failures,
            "engine step failed: {error}"
        );
        self.stats.send_modify(|s| s.n_step_failures_total += 1);
        self.evict_unwritten_blocks(plan);
        self.core.preempt_all_running();
        if self.consecutive_failures < MAX_CONSECUTIVE_FAILURES {
            return 0;
        }
        tracing::error!(
            n_requests = self.core.n_live(),
            "{MAX_CONSECUTIVE_FAILURES} consecutive step failures: finishing every request with an error"
        );
        self.consecutive_failures = 0;
        self.finish_all(FinishReason::Error)
    }

    /// Drops from the prefix cache every block the failed plan was to write: the core caches
    /// full blocks when they are scheduled, so without this a recomputing request (or any
    /// later one with the same prefix) would hit blocks whose KV was never written.
    fn evict_unwritten_blocks(&mut self, plan: &StepPlan) {
        for r in &plan.reqs {
            let table = plan.block_table_of(r);
            let n = r.tokens.len();
            if n == 0 || table.is_empty() {
                continue;
            }
            let first = r.start_pos / plan.block_size;
            let last = ((r.start_pos + n - 1) / plan.block_size).min(table.len() - 1);
            if first <= last {
                self.core.evict_blocks(&table[first..=last]);
            }
        }
    }

    /// Finishes every live request with `reason` (abort or error). Returns how many.
    fn finish_all(&mut self, reason: FinishReason) -> u64 {
        let outs = self.core.abort_all();
        let n = outs.len() as u64;
        for out in outs {
            self.finish_output(out, Some(reason));
        }
        n
    }

    /// Work for idle moments (nothing to step): the lifecycle moves forward (a pause that
    /// waited for the drain, the idle-time reset), and since inputs handled since the last
    /// step changed the core's state, the stats are published before deferred replies are
    /// answered.
    fn run_idle_work(&mut self) {
        self.poll_lifecycle();
        self.publish_stats(Duration::ZERO, Duration::ZERO, 0, 0);
        self.send_replies();
        self.check_deferred();
    }

    /// Completes every deferred reply whose state has been reached.
    fn check_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        let idle = self.core.n_live() == 0;
        let mut i = 0;
        while i < self.deferred.len() {
            let ready = match &self.deferred[i] {
                Deferred::Idle(_) => idle,
            };
            if ready {
                match self.deferred.swap_remove(i) {
                    Deferred::Idle(reply) => {
                        let _ = reply.send(());
                    }
                }
            } else {
                i += 1;
            }
        }
    }

    fn publish_stats(&mut self, step: Duration, forward: Duration, n_tokens: u64, n_fin: u64) {
        let scheduler = self.core.stats();
        let n_blocks_total = self.core.config().n_blocks as usize;
        let version = self.core.weight_version();
        let lifecycle = self.core.lifecycle_status();
        let transfers = &self.transfers.stats;
        let tier = self.core.tier_stats();
        let stepped = u64::from(!step.is_zero());
        self.stats.send_modify(|s| {
            s.scheduler = scheduler;
            s.n_blocks_total = n_blocks_total;
            s.n_steps += stepped;
            s.step_seconds_total += step.as_secs_f64();
            s.forward_seconds_total += forward.as_secs_f64();
            s.n_generated_tokens_total += n_tokens;
            s.n_requests_finished_total += n_fin;
            if s.weight_version != version {
                s.weight_version = version.to_owned();
            }
            s.lifecycle = lifecycle;
            s.transfers.clone_from(transfers);
            s.tier = tier;
            s.running = true;
        });
    }

    /// The end: every live request ends with `abort`, every deferred reply with `Stopped`,
    /// the stats say stopped, then the shutdown caller (if any) is answered.
    fn stop(mut self) {
        let n = self.finish_all(FinishReason::Abort);
        // A reply dropped unanswered reads as `Stopped` to its caller.
        drop(std::mem::take(&mut self.deferred));
        self.send_replies();
        drop(std::mem::take(&mut self.ops));
        self.publish_stats(Duration::ZERO, Duration::ZERO, 0, n);
        self.stats.send_modify(|s| s.running = false);
        // Inputs queued behind the shutdown are dropped with the receiver: their callers see
        // their reply channels close and report `Stopped`.
        self.inputs.close();
        if let Some(reply) = self.shutdown.take() {
            let _ = reply.send(());
        }
    }
}

/// The version a weight update gets when the caller names none: `v` → `v+1`, `v+1` → `v+2`.
/// Aborts the live request at `idx` in the core.
fn abort_idx(core: &mut Scheduler, idx: ReqIdx) -> Option<RequestOutput> {
    let id = core.request(idx)?.id.clone();
    core.abort(&id)
}

fn next_version(current: &str) -> String {
    if let Some((base, n)) = current.rsplit_once('+') {
        if let Ok(n) = n.parse::<u64>() {
            return format!("{base}+{}", n + 1);
        }
    }
    format!("{current}+1")
}

impl Drop for EngineLoop {
    /// A panic (a bug, or an executor that panics) unwinds the loop: the stats say stopped
    /// first, then the fields drop, closing every request's channel, so every stream ends
    /// with `error` rather than hanging and new calls get `Stopped`.
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("the engine thread panicked; every request ends with an error");
            self.stats.send_modify(|s| s.running = false);
        }
    }
}
