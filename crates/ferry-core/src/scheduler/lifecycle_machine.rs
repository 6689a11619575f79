//! The lifecycle state machine: pause, resume, sleep, wake-up, KV release, weight version,
//! and the one idle-time cache reset they share (`../shared/design/lifecycle.md`).
//!
//! This is the one home of lifecycle state ([`Control`]): the pause (one enum saying how far
//! compute is paused and whose pause it is), pending operations, the reset's stage, what is
//! asleep (KV memory, weight residency) and the weight version. The scheduler reads the pause
//! through [`Control::frozen`] and [`Control::admits_new`] only. What it is built from lives
//! beside it: aborts, preemption and cache resets (`aborts_and_resets.rs`), transfer holds
//! (`transfers.rs`), the connectors' reports (`connectors.rs`) and the clock (`time.rs`).
//!
//! Operations that cannot complete at once are *pending*, named by an [`OpId`] the engine
//! maps to its caller's reply. [`Scheduler::poll_lifecycle`] runs after every step and when
//! idle; it moves pending operations forward and says what the engine must do
//! ([`LifecycleEvent`]): free memory, then reply. Every pending operation ends with `Done` or
//! `Failed`: a resume or wake-up fails what it cancels, and nothing here ever waits on
//! anything but the engine reaching a state.
//!
//! The idle-time reset, in order: (1) wait until the engine is frozen (a `wait` pause has
//! drained); (2) preempt what is frozen (it recomputes after resume) and call
//! `release_transfer_kv` once; (3) keep polling until every transfer has handed its blocks
//! back and no connector has pending work; (4) drop every cached hash and every connector's
//! cache; then, with connectors, on a later poll once no connector has pending work again
//! (the engine turned once more, so what their reset left for the workers reached them),
//! the memory steps of a sleep or KV release, then the replies.
//!
//! Steps (3) and (4)'s waits are bounded: past `SchedulerConfig::lifecycle_wait_timeout`
//! from the release, every operation waiting for the reset fails with
//! [`LifecycleError::Timeout`]; the pause stays, nothing is lost, and asking again starts
//! the reset over. The drain of step (1) is the caller's choice and is not bounded.

use std::sync::Arc;

use super::{RequestOutput, Scheduler};
use crate::hash::chain_root;
use crate::ids::ReqIdx;
use crate::lifecycle::{
    LifecycleError, LifecycleEvent, LifecycleStatus, OpId, PauseMode, SleepLevel, WakeTag,
    WeightResidency,
};
use crate::request::Request;

/// Whether compute is paused, how far, and whose pause it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Pause {
    #[default]
    Running,
    /// Between a pause (or sleep) and a resume (or the full wake-up that ends a sleep's pause).
    Paused { compute: Compute, by: PausedBy },
}

/// How far a pause stops compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compute {
    /// Admit nothing new, but keep running admitted requests (pause mode `wait`); becomes
    /// `Frozen` once they have drained.
    Draining,
    /// Schedule nothing at all; requests stay where they are (`keep`, `abort`, or drained).
    Frozen,
}

/// Whose pause it is: a wake-up ends only a sleep's own pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PausedBy {
    Client,
    Sleep,
}

/// The lifecycle's state, inside the scheduler: all of it, in one place.
#[derive(Debug)]
pub(crate) struct Control {
    pause: Pause,
    /// In arrival order.
    pending: Vec<Pending>,
    reset: ResetStage,
    /// When the reset under way gives up waiting for transfers and connector work (set when
    /// it releases the transfers; meaningful only while `reset` is not `NotStarted`).
    reset_deadline: std::time::Duration,
    /// The deepest completed sleep, until a full wake-up or a resume.
    sleeping: Option<SleepLevel>,
    kv_released: bool,
    weights: WeightResidency,
    /// Produced between polls (immediate completions and cancellations).
    events: Vec<LifecycleEvent>,
    /// The version of the weights loaded now; stamped on outputs by the engine.
    pub(super) weight_version: Arc<str>,
    /// Counts weight-version changes; with the version it seeds the hash chains, so even a
    /// version string used twice never lets a prefix hit cross a weight update.
    weight_epoch: u64,
    /// Counts pauses (and sleeps) entered.
    n_pauses: u64,
}

impl Control {
    pub(super) fn new(weight_version: &str) -> Self {
        Self {
            pause: Pause::Running,
            pending: Vec::new(),
            reset: ResetStage::NotStarted,
            reset_deadline: std::time::Duration::ZERO,
            sleeping: None,
            kv_released: false,
            weights: WeightResidency::Resident,
            events: Vec::new(),
            weight_version: Arc::from(weight_version),
            weight_epoch: 0,
            n_pauses: 0,
        }
    }

    /// Twice the pauses entered, plus one while paused: a request that saw another mark than
    /// today's, or an odd one, waited behind a pause.
    pub(super) fn pause_mark(&self) -> u64 {
        2 * self.n_pauses + u64::from(self.paused())
    }

    /// Schedule nothing at all.
    pub(super) fn frozen(&self) -> bool {
        matches!(
            self.pause,
            Pause::Paused {
                compute: Compute::Frozen,
                ..
            }
        )
    }

    /// Admit never-admitted requests (false while any pause is in force).
    pub(super) fn admits_new(&self) -> bool {
        self.pause == Pause::Running
    }

    fn paused(&self) -> bool {
        self.pause != Pause::Running
    }
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    op: OpId,
    kind: OpKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Pause { clear_cache: bool },
    Sleep(SleepLevel),
    ReleaseKv,
}

impl OpKind {
    fn needs_reset(self) -> bool {
        match self {
            Self::Pause { clear_cache } => clear_cache,
            Self::Sleep(level) => level >= SleepLevel::L1,
            Self::ReleaseKv => true,
        }
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ResetStage {
    #[default]
    NotStarted,
    /// `release_transfer_kv` was called; waiting for the transfers' blocks.
    Releasing,
    /// Hashes and connector caches were dropped; waiting for a later turn of the engine,
    /// once no connector has pending work, so that what the connectors' reset left for their
    /// workers (a flush set) reached them before memory is released or anyone is told.
    Flushing,
}

impl Scheduler {
    /// Pauses with `mode` (see [`PauseMode`]); the pause completes (a `Done(op)` from
    /// `poll_lifecycle`) once frozen, and with `clear_cache` once the cache reset is done.
    /// Returns the outputs of requests an `abort` pause finished. A pause never loosens an
    /// earlier one: `wait` on a frozen engine stays frozen.
    pub fn pause(&mut self, op: OpId, mode: PauseMode, clear_cache: bool) -> Vec<RequestOutput> {
        // The client paused: the pause is the client's now, and only its resume ends it (a
        // wake-up from a sleep under way does not).
        let aborted = self.enter_pause(mode, PausedBy::Client);
        self.control.pending.push(Pending {
            op,
            kind: OpKind::Pause { clear_cache },
        });
        aborted
    }

    /// Sleeps: pauses with `mode`, then (level 1 and 2) resets every cache, releases the KV
    /// memory and offloads or drops the weights. A full wake-up resumes, unless the client
    /// paused the engine before it went to sleep or while it slept.
    pub fn sleep(&mut self, op: OpId, level: SleepLevel, mode: PauseMode) -> Vec<RequestOutput> {
        if self.control.weights == WeightResidency::Reloading {
            // The reload holds the weights: a sleep could neither offload nor drop them.
            self.control
                .events
                .push(LifecycleEvent::Failed(op, LifecycleError::Reloading));
            return Vec::new();
        }
        // A wake-up undoes only the sleep's own pause: an engine the client paused before it
        // slept stays paused until the client resumes it.
        let aborted = self.enter_pause(mode, PausedBy::Sleep);
        self.control.pending.push(Pending {
            op,
            kind: OpKind::Sleep(level),
        });
        aborted
    }

    /// Pauses (never loosening a pause in force). A client's pause takes the pause over; a
    /// sleep's pause stays the client's if the client had paused first.
    fn enter_pause(&mut self, mode: PauseMode, by: PausedBy) -> Vec<RequestOutput> {
        let target = match mode {
            PauseMode::Wait => Compute::Draining,
            PauseMode::Abort | PauseMode::Keep => Compute::Frozen,
        };
        self.control.n_pauses += 1;
        self.control.pause = match self.control.pause {
            Pause::Running => Pause::Paused {
                compute: target,
                by,
            },
            Pause::Paused { compute, by: was } => Pause::Paused {
                compute: if compute == Compute::Frozen {
                    Compute::Frozen
                } else {
                    target
                },
                by: if by == PausedBy::Client {
                    PausedBy::Client
                } else {
                    was
                },
            },
        };
        match mode {
            PauseMode::Abort => self.abort_all(),
            PauseMode::Wait | PauseMode::Keep => Vec::new(),
        }
    }

    /// Resets every cache and frees the KV memory; needs a completed pause (no pause or sleep
    /// still pending). `wake_up([KvCache])` brings the memory back.
    pub fn release_kv_cache_memory(&mut self, op: OpId) -> Result<(), LifecycleError> {
        let pause_pending = self
            .control
            .pending
            .iter()
            .any(|p| matches!(p.kind, OpKind::Pause { .. } | OpKind::Sleep(_)));
        if !self.control.frozen() || pause_pending {
            return Err(LifecycleError::NotPaused);
        }
        self.control.pending.push(Pending {
            op,
            kind: OpKind::ReleaseKv,
        });
        Ok(())
    }

    /// Continues scheduling. Every pending operation fails (`CancelledByResume`); no request
    /// is lost. Refused while memory is released (wake it up first).
    pub fn resume(&mut self) -> Result<(), LifecycleError> {
        if self.control.weights == WeightResidency::Reloading {
            return Err(LifecycleError::Reloading);
        }
        if self.control.kv_released {
            return Err(LifecycleError::Asleep { what: "KV cache" });
        }
        if self.control.weights != WeightResidency::Resident {
            return Err(LifecycleError::Asleep { what: "weights" });
        }
        self.cancel_pending(LifecycleError::CancelledByResume);
        self.unpause();
        Ok(())
    }

    /// Marks `tags` (none: all) awake; the engine has already restored their memory. A sleep
    /// still pending is cancelled, and so is a pending KV release when the KV cache wakes.
    /// When nothing is asleep any more and the pause is the sleep's own, scheduling resumes.
    pub fn wake_up(&mut self, tags: &[WakeTag]) {
        let all = tags.is_empty();
        if all || tags.contains(&WakeTag::KvCache) {
            self.control.kv_released = false;
        }
        if all || tags.contains(&WakeTag::Weights) {
            self.control.weights = WeightResidency::Resident;
        }
        // What the wake-up brings back must not be released again by an operation that was
        // still waiting: a sleep, or (for the KV cache) a KV release.
        let kv = all || tags.contains(&WakeTag::KvCache);
        self.cancel_pending_where(
            |p| matches!(p.kind, OpKind::Sleep(_)) || (kv && p.kind == OpKind::ReleaseKv),
            LifecycleError::CancelledByWakeUp,
        );
        let awake = !self.control.kv_released && self.control.weights == WeightResidency::Resident;
        if awake {
            self.control.sleeping = None;
            if matches!(
                self.control.pause,
                Pause::Paused {
                    by: PausedBy::Sleep,
                    ..
                }
            ) {
                self.cancel_pending(LifecycleError::CancelledByWakeUp);
                self.unpause();
            }
        }
    }

    /// Lends the weights to a reload in place ([`WeightResidency::Reloading`]) if the engine
    /// is in a completed pause: frozen, so no step computes until they come back, with no
    /// operation pending (a sleep would offload or drop them) and the weights resident.
    /// False, changing nothing, otherwise. Until [`Self::weights_returned`], resume and sleep
    /// are refused with [`LifecycleError::Reloading`].
    pub fn lend_weights(&mut self) -> bool {
        let c = &mut self.control;
        let lendable = c.frozen() && c.pending.is_empty() && c.weights == WeightResidency::Resident;
        if lendable {
            c.weights = WeightResidency::Reloading;
        }
        lendable
    }

    /// The reload in place ended: the weights are resident again with the new weights
    /// (`reloaded`), or dropped, as sleep level 2 leaves them, when its read failed midway
    /// (a complete install and a wake-up of the weights bring them back). The pause stays.
    pub fn weights_returned(&mut self, reloaded: bool) {
        let c = &mut self.control;
        if c.weights == WeightResidency::Reloading {
            c.weights = if reloaded {
                WeightResidency::Resident
            } else {
                WeightResidency::Dropped
            };
        }
    }

    fn cancel_pending(&mut self, error: LifecycleError) {
        self.cancel_pending_where(|_| true, error);
    }

    /// Fails the pending operations `cancel` picks. A reset no operation waits for any more
    /// starts over next time (frozen requests preempted, transfers released again).
    fn cancel_pending_where(&mut self, cancel: impl Fn(&Pending) -> bool, error: LifecycleError) {
        let c = &mut self.control;
        for p in c.pending.iter().filter(|p| cancel(p)) {
            c.events.push(LifecycleEvent::Failed(p.op, error.clone()));
        }
        c.pending.retain(|p| !cancel(p));
        if !c.pending.iter().any(|p| p.kind.needs_reset()) {
            c.reset = ResetStage::NotStarted;
        }
    }

    fn unpause(&mut self) {
        self.control.pause = Pause::Running;
        self.control.sleeping = None;
    }

    pub fn lifecycle_status(&self) -> LifecycleStatus {
        let c = &self.control;
        LifecycleStatus {
            paused: c.paused(),
            sleeping: c.sleeping.is_some()
                || c.kv_released
                || c.weights != WeightResidency::Resident,
            kv_released: c.kv_released,
            weights: c.weights,
            n_pending: c.pending.len(),
        }
    }

    /// When the reset under way stops waiting, if one is waiting (see [`Self::next_deadline`]).
    pub(super) fn reset_deadline(&self) -> Option<std::time::Duration> {
        let waiting = self.control.reset != ResetStage::NotStarted
            && self.control.frozen()
            && self.control.pending.iter().any(|p| p.kind.needs_reset());
        waiting.then_some(self.control.reset_deadline)
    }

    /// Whether the engine must keep stepping with nothing to compute: a connector has jobs
    /// to hand to its worker (a zero-token step delivers them), or a reset's connector flush
    /// needs one more turn of the engine. Waiting for transfers to hand blocks back needs no
    /// steps: the worker's report arrives as an input and wakes the engine (or the reset's
    /// deadline does, `next_deadline`).
    pub fn needs_idle_steps(&self) -> bool {
        let flushing = self.control.reset == ResetStage::Flushing
            && self.control.frozen()
            && !self.control.pending.is_empty();
        flushing || self.connectors.iter().any(|c| c.has_pending_work())
    }

    /// Moves pending operations forward; appends what the engine must do, in order, to `out`.
    /// Call after every step and when idle.
    pub fn poll_lifecycle(&mut self, out: &mut Vec<LifecycleEvent>) {
        self.poll_connectors();
        if let Pause::Paused {
            compute: compute @ Compute::Draining,
            ..
        } = &mut self.control.pause
        {
            if self.running.is_empty() && drained(&self.waiting, &self.requests) {
                *compute = Compute::Frozen;
            }
        }
        if self.control.frozen() && !self.control.pending.is_empty() {
            self.complete_without_reset();
            let reset_wanted = self.control.pending.iter().any(|p| p.kind.needs_reset());
            if reset_wanted {
                if self.advance_reset() {
                    self.complete_after_reset();
                } else if self.now >= self.control.reset_deadline {
                    self.time_out_reset();
                }
            }
        }
        out.append(&mut self.control.events);
    }

    /// Completes, in order, the pending operations that need no reset.
    fn complete_without_reset(&mut self) {
        let c = &mut self.control;
        for p in c.pending.iter().filter(|p| !p.kind.needs_reset()) {
            if p.kind == OpKind::Sleep(SleepLevel::L0) {
                c.sleeping = c.sleeping.max(Some(SleepLevel::L0));
            }
            c.events.push(LifecycleEvent::Done(p.op));
        }
        c.pending.retain(|p| p.kind.needs_reset());
    }

    /// Runs the idle-time reset as far as it can go; true once it is done.
    fn advance_reset(&mut self) -> bool {
        if self.control.reset == ResetStage::NotStarted {
            // Frozen requests lose their KV and recompute after resume, in queue order; so do
            // waiting ones holding KV (loads that landed), and loads in flight are retracted
            // once their connectors cut them short.
            self.preempt_all_running();
            self.retract_waiting_kv();
            self.release_transfer_kv();
            self.control.reset = ResetStage::Releasing;
            self.control.reset_deadline = self.now + self.config.lifecycle_wait_timeout;
        }
        self.poll_connectors();
        let busy = !self.holds.is_empty() || self.connectors.iter().any(|c| c.has_pending_work());
        // With every request preempted and every transfer back, no block is held, so the pool
        // reset cannot refuse; should it, the reset simply tries again at the next poll.
        if busy || !self.kv.pool_mut().reset_cache() {
            return false;
        }
        if self.control.reset == ResetStage::Releasing {
            for c in &mut self.connectors {
                c.reset_cache();
            }
            if !self.connectors.is_empty() {
                // Done on a later poll: the engine turns once more (`needs_idle_steps`).
                self.control.reset = ResetStage::Flushing;
                return false;
            }
        }
        self.control.reset = ResetStage::NotStarted;
        true
    }

    /// The reset waited past its deadline: every operation waiting for it fails with a
    /// timeout naming what was still out. The pause stays in force; the reset starts over
    /// (transfers released again) when an operation asks for it again.
    fn time_out_reset(&mut self) {
        let n_holds = self.holds.len();
        let n_blocks = self.holds.n_blocks();
        let mut parts = Vec::new();
        if n_holds > 0 {
            parts.push(format!(
                "{n_holds} transfer hold(s) to hand back {n_blocks} KV block(s)"
            ));
        }
        let busy: Vec<&str> = self
            .connectors
            .iter()
            .filter(|c| c.has_pending_work())
            .map(|c| c.name())
            .collect();
        if !busy.is_empty() {
            parts.push(format!(
                "connector work (a flush or revocation) to reach the workers of {}",
                busy.join(", ")
            ));
        }
        if parts.is_empty() {
            // Released and flushed, but the flush's later turn did not come in time.
            parts.push("the connectors' reset to reach their workers".to_owned());
        }
        let error = LifecycleError::Timeout {
            waited: self.config.lifecycle_wait_timeout,
            waiting_for: parts.join(" and "),
        };
        self.cancel_pending_where(|p| p.kind.needs_reset(), error);
    }

    /// After a reset: every pending operation needs it (the others completed first), so all
    /// complete now, each with its memory steps before its reply.
    fn complete_after_reset(&mut self) {
        let c = &mut self.control;
        for p in std::mem::take(&mut c.pending) {
            let release_kv = matches!(p.kind, OpKind::ReleaseKv | OpKind::Sleep(_));
            if release_kv && !c.kv_released {
                c.kv_released = true;
                c.events.push(LifecycleEvent::ReleaseKvMemory);
            }
            if let OpKind::Sleep(level) = p.kind {
                if level == SleepLevel::L1 && c.weights == WeightResidency::Resident {
                    c.weights = WeightResidency::Offloaded;
                    c.events.push(LifecycleEvent::OffloadWeights);
                }
                if level == SleepLevel::L2 && c.weights != WeightResidency::Dropped {
                    c.weights = WeightResidency::Dropped;
                    c.events.push(LifecycleEvent::DropWeights);
                }
                c.sleeping = c.sleeping.max(Some(level));
            }
            c.events.push(LifecycleEvent::Done(p.op));
        }
    }
}

/// No admitted request is waiting: the waiting queue holds only never-admitted requests.
fn drained(waiting: &std::collections::VecDeque<ReqIdx>, requests: &[Option<Request>]) -> bool {
    // Preempted requests, loads in flight and landed or failed loads were admitted: a `wait`
    // pause waits for them too.
    waiting.iter().all(|&r| {
        requests[r.0 as usize]
            .as_ref()
            .is_none_or(|req| !req.admitted)
    })
}

impl Scheduler {
    /// Switches the weight version: every new hash chain is seeded by it and by a count of
    /// changes, so KV computed under the old weights can never be hit again (old entries age
    /// out of the cache). Requests holding no KV rehash on admission; running ones keep their
    /// old-rooted chain and cache no further blocks (their KV mixes both weights), and are
    /// never exported.
    ///
    /// KV a waiting request was handed but has not computed on (a landed load, the good part
    /// of a failed one) is of the old weights: it is dropped, and the request recomputes in
    /// its place in the queue. A load still in flight lands stale KV, so its result is taken
    /// as a retraction (`on_load_result`). No request is ever handed KV of other weights,
    /// whether the update came before, during or after its load.
    pub fn set_weight_version(&mut self, version: impl Into<String>) {
        self.outdate_waiting_kv(|_| true);
        let c = &mut self.control;
        c.weight_version = Arc::from(version.into());
        c.weight_epoch += 1;
        // The epoch makes every change a new root, even back to a version string seen before.
        let seed = format!("{}\u{0}{}", c.weight_version, c.weight_epoch);
        self.hash_root = chain_root(&seed);
        self.kv.set_current_root(self.hash_root);
        let version = c.weight_version.clone();
        self.kv.pool_mut().log_mut().new_version(version);
    }

    /// The KV events since the last call, in batches (`kv_events.rs`); none unless
    /// `SchedulerConfig::kv_events` is on.
    pub fn take_kv_events(&mut self, out: &mut impl Extend<crate::KvEventBatch>) {
        let log = self.kv.pool_mut().log_mut();
        if log.is_on() {
            let mut changes = Vec::new();
            for c in &mut self.connectors {
                c.take_tier_changes(&mut changes);
            }
            for change in changes {
                log.tier(change);
            }
        }
        log.drain(out);
    }

    /// The version of the weights loaded now.
    pub fn weight_version(&self) -> &str {
        &self.control.weight_version
    }

    /// [`weight_version`](Self::weight_version), shared: the engine stamps it on every output
    /// token without copying the string.
    pub fn weight_version_shared(&self) -> Arc<str> {
        self.control.weight_version.clone()
    }
}
