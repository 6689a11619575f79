//! Lifecycle types: pause modes, sleep levels, wake-up tags, and what the lifecycle state
//! machine (`scheduler/lifecycle_machine.rs`) asks the engine to do.
//!
//! The contract is `../shared/design/lifecycle.md`. The core decides *when* an operation can
//! complete (idle, every transfer back, the reset done); the engine thread owns the reply
//! channels, the KV arena and the executor, so it acts on [`LifecycleEvent`]s.

/// How a pause treats requests already in the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PauseMode {
    /// Finish every running and waiting request as aborted (partial output, `abort`).
    Abort,
    /// Admit nothing new; let admitted requests finish; then stop.
    Wait,
    /// Freeze everything where it is; frozen requests continue on resume.
    Keep,
}

impl PauseMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Wait => "wait",
            Self::Keep => "keep",
        }
    }
}

impl std::str::FromStr for PauseMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "abort" => Ok(Self::Abort),
            "wait" => Ok(Self::Wait),
            "keep" => Ok(Self::Keep),
            _ => Err(format!(
                "unknown pause mode `{s}` (expected abort, wait or keep)"
            )),
        }
    }
}

/// How deep a sleep goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SleepLevel {
    /// Pause only.
    L0,
    /// Reset caches, release KV memory, move the weights to a host copy.
    L1,
    /// Reset caches, release KV memory, drop the weights.
    L2,
}

impl SleepLevel {
    pub fn from_u8(level: u8) -> Option<Self> {
        match level {
            0 => Some(Self::L0),
            1 => Some(Self::L1),
            2 => Some(Self::L2),
            _ => None,
        }
    }

    pub fn as_u8(self) -> u8 {
        self as u8
    }
}

/// What `wake_up` restores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WakeTag {
    Weights,
    KvCache,
}

impl std::str::FromStr for WakeTag {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "weights" => Ok(Self::Weights),
            "kv_cache" => Ok(Self::KvCache),
            _ => Err(format!(
                "unknown wake-up tag `{s}` (expected weights or kv_cache)"
            )),
        }
    }
}

/// Where weights are (sleep levels 1 and 2). The lifecycle tracks the state it asked for;
/// each executor tracks its own weights' (`ferry_model::ModelWeights::residency`), with the
/// same transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightResidency {
    /// Ready to run steps.
    #[default]
    Resident,
    /// Sleep level 1: moved to a host copy; `restore` brings them back.
    Offloaded,
    /// Sleep level 2: dropped; a complete install must come before they can be restored.
    Dropped,
    /// Lent to a reload in place while the engine is paused: nothing may compute until the
    /// reload hands them back, `Resident` with the new weights, or `Dropped` (as sleep level 2
    /// leaves them) when the read failed midway and they hold some of each.
    Reloading,
}

impl WeightResidency {
    /// Sleep level 1: resident weights move to the host copy (dropped ones stay dropped).
    pub fn offload(&mut self) {
        if *self == Self::Resident {
            *self = Self::Offloaded;
        }
    }

    /// A complete set of weights was installed: dropped weights are back, but asleep until
    /// a wake-up restores them.
    pub fn refill(&mut self) {
        if *self == Self::Dropped {
            *self = Self::Offloaded;
        }
    }

    /// Wake-up: resident again. False, changing nothing, while the weights are dropped or
    /// lent to a reload.
    pub fn restore(&mut self) -> bool {
        if matches!(self, Self::Dropped | Self::Reloading) {
            return false;
        }
        *self = Self::Resident;
        true
    }
}

/// Names a deferred lifecycle operation; the engine maps it to the caller's reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(pub u64);

/// Why a lifecycle operation failed or was refused. Nothing is lost either way: requests stay
/// queued or frozen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    #[error("a resume cancelled this operation before it completed")]
    CancelledByResume,
    #[error("a wake_up cancelled this sleep before it completed")]
    CancelledByWakeUp,
    #[error("release_kv_cache_memory needs a completed pause: pause the engine first (and wait for the pause to return)")]
    NotPaused,
    #[error("the engine is sleeping ({what} released): call wake_up before resuming")]
    Asleep { what: &'static str },
    #[error("the weights were dropped (by sleep(level=2), or by a reload in place that failed midway): reload or push a complete set of weights before waking them")]
    WeightsDropped,
    /// The weights are lent to a reload in place ([`WeightResidency::Reloading`]).
    #[error("the weights are being reloaded in place (update_weights_from_disk while paused): ask again once that reload has returned")]
    Reloading,
    /// A clearing operation's wait for transfers and connector work outlasted
    /// `SchedulerConfig::lifecycle_wait_timeout`. The engine stays paused and consistent; the
    /// operation can be asked for again (it completes once the transfers are gone).
    #[error("timed out after {waited:?} waiting for {waiting_for} before resetting the KV cache; the engine stays paused: ask again, or resume")]
    Timeout {
        waited: std::time::Duration,
        /// What was still out: transfer holds, connector work.
        waiting_for: String,
    },
}

/// What the lifecycle state machine asks of the engine, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LifecycleEvent {
    /// Free the KV arena's memory (the cache reset is done; no block is in use).
    ReleaseKvMemory,
    /// Sleep level 1: move the weights to a host copy.
    OffloadWeights,
    /// Sleep level 2: drop the weights.
    DropWeights,
    /// The operation completed: reply success.
    Done(OpId),
    /// The operation failed: reply with the error.
    Failed(OpId, LifecycleError),
}

/// A snapshot of the lifecycle state, for `is_paused` / `is_sleeping` and stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LifecycleStatus {
    /// Between a pause (or sleep) and a resume (or full wake-up).
    pub paused: bool,
    /// A sleep completed and not every tag is awake yet.
    pub sleeping: bool,
    pub kv_released: bool,
    pub weights: WeightResidency,
    /// Operations waiting for a state (drain, idle, transfers, reset).
    pub n_pending: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_modes_sleep_levels_and_wake_tags_read_their_wire_names() {
        for (mode, name) in [
            (PauseMode::Abort, "abort"),
            (PauseMode::Wait, "wait"),
            (PauseMode::Keep, "keep"),
        ] {
            assert_eq!(mode.as_str(), name);
            assert_eq!(name.parse::<PauseMode>(), Ok(mode));
        }
        let err = "retract".parse::<PauseMode>().unwrap_err();
        assert!(err.contains("retract"), "{err}");
        for (level, n) in [
            (SleepLevel::L0, 0),
            (SleepLevel::L1, 1),
            (SleepLevel::L2, 2),
        ] {
            assert_eq!(SleepLevel::from_u8(n), Some(level));
            assert_eq!(level.as_u8(), n);
        }
        assert_eq!(SleepLevel::from_u8(3), None);
        assert_eq!("weights".parse::<WakeTag>(), Ok(WakeTag::Weights));
        assert_eq!("kv_cache".parse::<WakeTag>(), Ok(WakeTag::KvCache));
        assert!("cuda_graph"
            .parse::<WakeTag>()
            .unwrap_err()
            .contains("cuda_graph"));
    }

    #[test]
    fn weight_residency_moves_as_sleep_levels_and_wake_ups_say() {
        use WeightResidency::*;
        // offload: resident → offloaded; dropped stays dropped.
        for (from, to) in [
            (Resident, Offloaded),
            (Offloaded, Offloaded),
            (Dropped, Dropped),
            (Reloading, Reloading),
        ] {
            let mut r = from;
            r.offload();
            assert_eq!(r, to, "offload from {from:?}");
        }
        // refill: dropped → offloaded (asleep until a wake-up); the others stay.
        for (from, to) in [
            (Resident, Resident),
            (Offloaded, Offloaded),
            (Dropped, Offloaded),
            (Reloading, Reloading),
        ] {
            let mut r = from;
            r.refill();
            assert_eq!(r, to, "refill from {from:?}");
        }
        // restore: resident again, except from dropped, which refuses and stays.
        for (from, ok, to) in [
            (Resident, true, Resident),
            (Offloaded, true, Resident),
            (Dropped, false, Dropped),
            (Reloading, false, Reloading),
        ] {
            let mut r = from;
            assert_eq!(r.restore(), ok, "restore from {from:?}");
            assert_eq!(r, to, "restore from {from:?}");
        }
    }
}
