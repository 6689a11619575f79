//! Immediate operations that take work or KV back from the scheduler: aborting requests (one
//! or all), preempting every running request, and resetting the prefix cache (alone, or as
//! the admin API has it, with the running requests and the connectors' caches) or evicting
//! given bad blocks from it.
//!
//! Each acts at once and keeps no state of its own; the lifecycle state machine
//! (`lifecycle_machine.rs`) builds its pauses, sleeps and resets from them.

use super::{RequestOutput, Scheduler};
use crate::ids::{BlockId, ReqIdx};
use crate::request::{FinishReason, RequestState};

impl Scheduler {
    /// Finishes a live request as aborted, freeing its blocks (transfers holding some of them
    /// keep theirs). Unknown or finished ids are ignored (`None`).
    pub fn abort(&mut self, id: &str) -> Option<RequestOutput> {
        let idx = self.request_idx(id)?;
        self.remove_from_queues(idx);
        Some(self.aborted_output(idx))
    }

    /// Aborts every live request: running ones first, then waiting ones, each in queue order.
    pub fn abort_all(&mut self) -> Vec<RequestOutput> {
        let order: Vec<ReqIdx> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        order.into_iter().map(|r| self.aborted_output(r)).collect()
    }

    pub(super) fn remove_from_queues(&mut self, idx: ReqIdx) {
        match self.request(idx).map(|r| &r.state) {
            Some(RequestState::Running) => self.running.retain(|&r| r != idx),
            Some(
                RequestState::Waiting
                | RequestState::Preempted { .. }
                | RequestState::WaitingForRemoteKv { .. },
            ) => self.waiting.retain(|&r| r != idx),
            _ => {}
        }
    }

    pub(super) fn aborted_output(&mut self, idx: ReqIdx) -> RequestOutput {
        let n_output_tokens = self.request(idx).map_or(0, |r| r.n_output_tokens());
        RequestOutput {
            req: idx,
            sampled: None,
            n_output_tokens,
            finished: Some(self.release_request(idx, FinishReason::Abort)),
        }
    }

    /// Preempts every running request (they recompute later), keeping queue order: they go
    /// back to the head of the waiting queue in admission order. Returns how many.
    pub fn preempt_all_running(&mut self) -> usize {
        let n = self.running.len();
        // Latest-admitted first, each pushed to the head: the earliest ends up first.
        while let Some(r) = self.running.pop() {
            self.preempt(r);
        }
        n
    }

    /// Drops every cached block hash. Returns false, changing nothing, while any block is held
    /// (by a running request or a transfer); never fails otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.pool_mut().reset_cache()
    }

    /// `reset_prefix_cache` as the admin API has it: with `reset_running_requests`, running
    /// requests are preempted first, and waiting ones holding KV (landed loads) drop it (all
    /// kept, recomputed later, queue order preserved); with
    /// `reset_connector`, every connector's cache is reset too. Never fails on busy blocks:
    /// false (the prefix cache unchanged) while any block is held.
    ///
    /// With `reset_connector`, connectors are reset only once the prefix cache was: false
    /// (nothing reset) while any transfer or connector job (a store or load of an offload
    /// tier) still holds blocks or waits to reach its worker.
    pub fn reset_caches(&mut self, reset_running_requests: bool, reset_connector: bool) -> bool {
        self.reset_caches_saying(reset_running_requests, reset_connector)
            .is_some()
    }

    /// [`Self::reset_caches`], saying what it cleared (`None`: nothing, blocks are held). The
    /// device's prefix cache always; the offload tier only with `reset_connector` (vLLM's
    /// default leaves a connector's cache alone). The KV events say the same: a whole-cache
    /// clear only when no tier keeps blocks, else the removal of each device block.
    pub fn reset_caches_saying(
        &mut self,
        reset_running_requests: bool,
        reset_connector: bool,
    ) -> Option<Cleared> {
        self.poll_connectors();
        if reset_running_requests {
            // Waiting requests holding KV (landed loads) hold it as running ones do.
            self.preempt_all_running();
            self.retract_waiting_kv();
        }
        if reset_connector
            && (!self.holds.is_empty() || self.connectors.iter().any(|c| c.has_pending_work()))
        {
            return None;
        }
        let tier = self.connectors.iter().any(|c| c.tier_stats().is_some());
        let offload = reset_connector && tier;
        let pool = self.kv.pool_mut();
        let reset = if offload || !tier {
            pool.reset_cache()
        } else {
            pool.reset_device_cache()
        };
        if !reset {
            return None;
        }
        if reset_connector {
            for c in &mut self.connectors {
                c.reset_cache();
            }
        }
        Some(Cleared {
            device: true,
            offload,
        })
    }

    /// Drops the given blocks from the prefix cache (their KV is bad, e.g. a failed load).
    pub fn evict_blocks(&mut self, blocks: &[BlockId]) {
        self.kv.evict_blocks(blocks);
    }
}

/// What a cache reset cleared ([`Scheduler::reset_caches_saying`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cleared {
    /// The device's prefix cache (the KV arena's cached blocks).
    pub device: bool,
    /// The CPU offload tier.
    pub offload: bool,
}

impl Cleared {
    /// The caches cleared, by the names the admin API answers with (`"device"`, `"offload"`).
    pub fn names(&self) -> Vec<&'static str> {
        [(self.device, "device"), (self.offload, "offload")]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect()
    }
}
