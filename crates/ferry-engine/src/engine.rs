//! The engine thread: a thin loop around [`EngineCore`] that owns what the core must not: the
//! input queue, the clock, the readers' channels and the callers' replies.
//!
//! `run` reads as its phases: `drain_inputs` (every queued input, in order, between steps,
//! each handed to the core with the time it is handled at), then `step` (the core's step, or
//! its idle work when there is nothing to step) and the core's events delivered; idle, a
//! wait for the next input or the core's next deadline (an export's lease, a lifecycle
//! operation's bound), whichever comes first. Nothing spins: workers report on the input
//! queue. Pending deferred replies are checked after every step and when idle.
//!
//! A panic on this thread (a broken invariant: the block pool's and the holds' checks are
//! `assert!`s; a bug in an executor) is the engine's failure. `run` catches it, touches the
//! core no more, publishes the panic's message as `EngineStats::failure` and only then closes
//! every channel: each stream ends with an error naming it, each pending or later call fails
//! with `Stopped::Failed(message)`, and nothing hangs.

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use ferry_arena::Reports;
use ferry_core::{ConnectorId, FinishReason, KvEventBatch, OpId, ReqIdx, Scheduler, StepKind};
use ferry_model::Executor;
use tokio::sync::{mpsc, oneshot, watch};

use crate::connector::Connector;
use crate::engine_core::{CallResult, CoreEnv, CoreEvent, EngineCore, MaskWork, NewRequest};
use crate::event::Event;
use crate::input::{AddInput, Input, Queued, Reply, Utility};
use crate::EngineStats;

/// The engine thread's environment: the wall clock from `epoch`, masks on rayon's threads.
/// Here, not beside [`CoreEnv`]: the core itself reads no clock and starts no thread.
#[derive(Debug, Clone, Copy)]
pub struct ThreadedEnv {
    pub epoch: Instant,
}

impl CoreEnv for ThreadedEnv {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn run_masks(&self, work: &mut [MaskWork<'_>]) {
        use rayon::prelude::*;
        work.par_iter_mut().for_each(MaskWork::run);
    }
}

/// A reply held back until the engine reaches a state.
#[derive(Debug)]
enum Deferred {
    /// Until no request is live.
    Idle(Reply<()>),
}

/// Everything the engine thread owns.
pub(crate) struct EngineLoop {
    core: EngineCore,
    inputs: mpsc::UnboundedReceiver<Queued>,
    /// Each live request's reader, indexed by `ReqIdx` (the core reuses slots).
    readers: Vec<Option<mpsc::UnboundedSender<Event>>>,
    deferred: Vec<Deferred>,
    /// Replies of pending lifecycle calls, by the id the core answers them by.
    ops: BTreeMap<OpId, Reply<CallResult>>,
    /// Lifecycle answers waiting for the stats to be published (`send_replies`).
    replies: Vec<(Reply<CallResult>, CallResult)>,
    stats: watch::Sender<EngineStats>,
    /// Where KV event batches go (the publisher), when the engine publishes them.
    kv_events: Option<mpsc::UnboundedSender<KvEventBatch>>,
    /// Requests this loop finished itself (aborted because their reader was gone, or at
    /// shutdown), counted in the stats on top of the core's finishes.
    n_late_finished: u64,
    /// Set by `Shutdown`: its reply is sent as the thread's last act.
    shutdown: Option<oneshot::Sender<()>>,
    /// Set when the loop must end (shutdown, or every handle gone).
    stopping: bool,
    /// The core's clock is `epoch.elapsed()`.
    epoch: Instant,
    /// Runs the timed wait for an input (tokio's channel has no blocking receive with a
    /// timeout); current-thread, so it adds no thread.
    waiter: tokio::runtime::Runtime,
}

impl EngineLoop {
    /// Serves LoRA adapters under `settings`; the table the engine thread publishes them in.
    pub(crate) fn with_lora(
        mut self,
        settings: Option<crate::LoraSettings>,
    ) -> (Self, crate::lora::LoraTable) {
        self.core.set_lora_settings(settings);
        let table = self.core.lora_table();
        (self, table)
    }

    pub(crate) fn new(
        sched: Scheduler,
        executor: Box<dyn Executor>,
        inputs: mpsc::UnboundedReceiver<Queued>,
        stats: watch::Sender<EngineStats>,
        connectors: Vec<Connector>,
        reports: mpsc::WeakUnboundedSender<Queued>,
        kv_events: Option<mpsc::UnboundedSender<KvEventBatch>>,
    ) -> std::io::Result<Self> {
        // Each worker reports on this engine's input queue, through a weak sender: reports
        // never keep a stopped engine's queue alive.
        let report_to = |connector: ConnectorId| {
            let tx = reports.clone();
            Reports::new(move |report| {
                if let Some(tx) = tx.upgrade() {
                    let _ = tx.send(Queued {
                        input: Input::Connector(connector, report),
                        permit: None,
                        slot: None,
                    });
                }
            })
        };
        let epoch = Instant::now();
        let core = EngineCore::with_connectors(
            sched,
            executor,
            connectors,
            report_to,
            Box::new(ThreadedEnv { epoch }),
        );
        let waiter = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        Ok(Self {
            core,
            inputs,
            readers: Vec::new(),
            deferred: Vec::new(),
            ops: BTreeMap::new(),
            replies: Vec::new(),
            stats,
            kv_events,
            n_late_finished: 0,
            shutdown: None,
            stopping: false,
            epoch,
            waiter,
        })
    }

    /// The thread's body: loops until shutdown or until every handle is gone, or until a
    /// panic fails the engine.
    pub(crate) fn run(mut self) {
        match catch_unwind(AssertUnwindSafe(|| self.run_steps())) {
            Ok(()) => self.stop(),
            Err(panic) => self.fail(&panic_message(&*panic)),
        }
    }

    fn run_steps(&mut self) {
        self.publish_stats(Duration::ZERO, Duration::ZERO);
        let mut busy_since = Instant::now();
        while !self.stopping {
            let started = Instant::now();
            self.drain_inputs();
            if self.stopping {
                break;
            }
            self.core.handle_time(self.epoch.elapsed());
            let stepped = match self.core.step() {
                Ok(stepped) => stepped,
                // Only with checks on, which the engine thread never turns on.
                Err(e) => {
                    tracing::error!("engine invariant broken: {e}");
                    None
                }
            };
            // The step's counts are published before its first event goes out, so a client
            // that has read its last token never sees metrics without it.
            match stepped {
                Some(s) if s.kind == StepKind::Forward => {
                    self.publish_stats(started.elapsed(), s.forward)
                }
                _ => self.publish_stats(Duration::ZERO, Duration::ZERO),
            }
            self.deliver();
            self.send_replies();
            self.check_deferred();
            // Nothing stepped (idle, or nothing schedulable, e.g. paused): a connector with
            // jobs to deliver, or a reset's flush, needs another turn (a connector-only step);
            // otherwise wait for an input or the next deadline rather than spin.
            if stepped.is_none() && !self.core.sched().needs_idle_steps() {
                let busy = busy_since.elapsed().as_secs_f64();
                let transfers = self.core.transfer_stats().clone();
                self.stats.send_modify(|s| {
                    s.busy_seconds_total += busy;
                    s.transfers = transfers;
                });
                self.wait_for_input();
                busy_since = Instant::now();
            }
        }
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
        self.core.handle_time(self.epoch.elapsed());
        // The permit frees a queue slot as soon as the input is off the queue.
        let Queued {
            input,
            permit,
            slot,
        } = queued;
        drop((permit, slot));
        match input {
            Input::Add(add) => self.add(add),
            Input::AddAll(adds) => adds.into_iter().for_each(|add| self.add(add)),
            Input::Abort(id) => {
                self.core.handle_abort(&id);
            }
            Input::Utility(call) => self.utility(call),
            Input::Connector(connector, report) => self.core.handle_report(connector, report),
        }
        self.deliver();
    }

    fn add(&mut self, add: AddInput) {
        let AddInput {
            request_id,
            prompt,
            params,
            events,
            accepted,
            transfer,
            constraint,
            lora,
        } = add;
        let added = self.core.handle_add(NewRequest {
            request_id,
            prompt,
            params,
            transfer: transfer.map(|t| *t),
            constraint: constraint.map(|c| *c),
            lora,
        });
        match added {
            Ok(idx) => {
                if accepted.send(Ok(())).is_err() {
                    // The caller stopped waiting: nobody would read the stream.
                    self.core.handle_abort_idx(idx);
                    return;
                }
                let i = idx.0 as usize;
                if self.readers.len() <= i {
                    self.readers.resize_with(i + 1, || None);
                }
                self.readers[i] = Some(events);
            }
            Err(e) => {
                let _ = accepted.send(Err(e));
            }
        }
    }

    fn utility(&mut self, call: Utility) {
        match call {
            Utility::Shutdown(reply) => {
                self.shutdown = Some(reply);
                self.stopping = true;
            }
            Utility::WaitIdle(reply) => self.deferred.push(Deferred::Idle(reply)),
            Utility::CheckInvariants(reply) => {
                let _ = reply.send(self.core.check());
            }
            Utility::Lifecycle(call, reply) => {
                let started = Instant::now();
                let op = self.core.handle_call(call);
                self.ops.insert(op, reply);
                self.deliver();
                let handled = started.elapsed().as_secs_f64();
                self.stats.send_modify(|s| {
                    s.n_lifecycle_calls_total += 1;
                    s.lifecycle_call_seconds_total += handled;
                });
                self.publish_stats(Duration::ZERO, Duration::ZERO);
                self.send_replies();
            }
        }
    }

    /// Takes every event out of the core: each request's to its reader (a request whose
    /// reader is gone is aborted here, its stream's own abort may still be queued), each
    /// lifecycle answer queued until the stats are published (`send_replies`).
    fn deliver(&mut self) {
        let mut n_late = 0;
        while let Some(event) = self.core.poll_event() {
            match event {
                CoreEvent::Request(req, event) => {
                    n_late += u64::from(self.send_to_reader(req, event))
                }
                CoreEvent::Reply(op, result) => {
                    if let Some(reply) = self.ops.remove(&op) {
                        self.replies.push((reply, result));
                    }
                }
                // A publisher that is gone loses nothing the engine needs.
                CoreEvent::Kv(batch) => {
                    if let Some(tx) = &self.kv_events {
                        let _ = tx.send(batch);
                    }
                }
            }
        }
        if n_late > 0 {
            self.n_late_finished += n_late;
            self.stats
                .send_modify(|s| s.n_requests_finished_total += n_late);
        }
    }

    /// Sends `event` to `req`'s reader; true if the reader was gone and the request was
    /// aborted for it.
    fn send_to_reader(&mut self, req: ReqIdx, event: Event) -> bool {
        let i = req.0 as usize;
        let Some(reader) = self.readers.get(i).and_then(Option::as_ref) else {
            return false;
        };
        let finished = matches!(
            event,
            Event::Output {
                finish: Some(_),
                ..
            }
        );
        let gone = reader.send(event).is_err();
        if finished {
            self.readers[i] = None;
            return false;
        }
        gone && self.core.handle_abort_idx(req)
    }

    /// Answers lifecycle calls, after the stats were published: a caller that reads the
    /// stats after its reply sees what its call did.
    fn send_replies(&mut self) {
        for (reply, result) in self.replies.drain(..) {
            // A caller that stopped waiting is no one's concern.
            let _ = reply.send(result);
        }
    }

    /// Completes every deferred reply whose state has been reached.
    fn check_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        let idle = self.core.sched().n_live() == 0;
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

    fn publish_stats(&mut self, step: Duration, forward: Duration) {
        let core = &self.core;
        let sched = core.sched();
        let scheduler = sched.stats();
        let n_blocks_total = sched.config().n_blocks as usize;
        let version = sched.weight_version();
        let lifecycle = sched.lifecycle_status();
        let transfers = core.transfer_stats();
        let tier = sched.tier_stats();
        let counters = core.counters();
        let n_late = self.n_late_finished;
        let stepped = u64::from(!step.is_zero());
        self.stats.send_modify(|s| {
            s.scheduler = scheduler;
            s.n_blocks_total = n_blocks_total;
            s.n_steps += stepped;
            s.step_seconds_total += step.as_secs_f64();
            s.forward_seconds_total += forward.as_secs_f64();
            s.n_generated_tokens_total = counters.n_generated_tokens_total;
            s.n_requests_finished_total = counters.n_requests_finished_total + n_late;
            s.n_step_failures_total = counters.n_step_failures_total;
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
        self.n_late_finished += self.core.finish_all(FinishReason::Abort);
        self.deliver();
        // A reply dropped unanswered reads as `Stopped` to its caller.
        drop(std::mem::take(&mut self.deferred));
        self.send_replies();
        drop(std::mem::take(&mut self.ops));
        self.publish_stats(Duration::ZERO, Duration::ZERO);
        self.stats.send_modify(|s| s.running = false);
        // Inputs queued behind the shutdown are dropped with the receiver: their callers see
        // their reply channels close and report `Stopped`.
        self.inputs.close();
        if let Some(reply) = self.shutdown.take() {
            let _ = reply.send(());
        }
    }
}

impl EngineLoop {
    /// The engine failed: a panic unwound out of a step or an input's handling, so the core
    /// may be half-way through a change and is not touched again. The failure is published
    /// first (stopped, with the panic's message), then the loop drops, closing every
    /// request's stream (each ends with an error naming the failure), every pending reply
    /// and the input queue (their callers, and every later call, get `Stopped::Failed`).
    fn fail(mut self, message: &str) {
        tracing::error!(
            "the engine failed: {message}; every request and call ends with this error"
        );
        self.publish_failure(message);
        self.inputs.close();
    }

    fn publish_failure(&mut self, message: &str) {
        self.stats.send_modify(|s| {
            s.running = false;
            s.failure.get_or_insert_with(|| message.to_owned());
        });
    }
}

impl Drop for EngineLoop {
    /// A panic while stopping (`stop`, outside `run`'s catch) unwinds through here: the
    /// failure is published before the fields drop and close every channel, as `fail` does.
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("the engine thread panicked while stopping");
            self.publish_failure("the engine thread panicked while stopping");
        }
    }
}

/// A panic's message: its payload, when it is text (`panic!`, `assert!` and `expect` give
/// text).
fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".into())
}
