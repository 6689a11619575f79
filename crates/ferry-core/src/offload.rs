//! The CPU offload tier, scheduler side: an index of KV blocks copied to host memory, looked
//! up after the local prefix cache, with stores and loads run by a copier thread
//! (`ferry_kv::OffloadWorker`) under `Store` and `Load` holds.
//!
//! * **Keys.** An offloaded block is `blocks_per_slot` engine blocks (a *slot* of host
//!   memory). It is keyed by the chain hash of its last engine block, which covers every
//!   token before it, the cache salt and the weight version's root: no hit can cross a
//!   weight update, reset or not.
//! * **Stores.** When a step has computed full slots of a request (`blocks_computed`), each
//!   one the index does not know gets a free slot (evicting by [`OffloadPolicy`] if needed)
//!   and one `Store` job copies them, holding their arena blocks until the worker reports
//!   the job done: an arena block a store still reads is never reused before that.
//! * **Loads.** At admission, after the local prefix hit, the longest run of stored slots
//!   continuing the request's prefix is offered as an asynchronous hit; the scheduler holds
//!   fresh blocks for it (`Load`) and the request waits until the copy landed. Entries being
//!   stored or loaded are never evicted.
//! * **Reset** (`../shared/design/lifecycle.md`, "Offload tier reset"): `abort_transfers` and
//!   `reset_cache` move every job in flight into the *flush set* and retract loads (their
//!   requests recompute); `reset_cache` drops the index and starts a new epoch. Both are
//!   re-entrant: a second reset before the next step only adds to the flush set, never
//!   asserts. An undelivered flush set is pending work, so the engine steps once more and
//!   the worker waits for those jobs; completions of jobs from an older epoch end their
//!   holds but never enter the index. A slot an abandoned job touches is reused only after
//!   that job reported.

mod policy;

use std::collections::{BTreeMap, BTreeSet};

use policy::Policy;
pub use policy::{OffloadPolicy, UnknownPolicy};

use crate::connector::{
    AllocatedLoad, ComputedBlocks, ExternalMatch, ExternalQuery, FetchFailure, HostCopy,
    KvConnector, LoadOutcome, LoadResult, StoreHolds, TierJob, TierReport, TierStats, WorkerJob,
};
use crate::hash::{BlockHash, BlockHashMap};
use crate::holds::HoldKind;
use crate::ids::{ReqIdx, TransferId};
use crate::kv_events::TierChange;

/// The tier's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadConfig {
    /// The engine's block size, in tokens.
    pub block_size: usize,
    /// Engine blocks per offloaded block (a slot of host memory); at least 1.
    pub blocks_per_slot: usize,
    /// Bytes of one engine block's KV (every layer, K and V).
    pub block_bytes: usize,
    /// Host memory for the tier, in bytes (`--kv-offload-bytes`).
    pub capacity_bytes: u64,
    pub policy: OffloadPolicy,
}

impl OffloadConfig {
    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> u64 {
        (self.blocks_per_slot * self.block_bytes) as u64
    }

    /// How many slots the capacity holds.
    pub fn n_slots(&self) -> usize {
        (self.capacity_bytes / self.slot_bytes().max(1)) as usize
    }

    /// Host memory the worker addresses, in engine blocks.
    pub fn n_host_blocks(&self) -> usize {
        self.n_slots() * self.blocks_per_slot
    }

    /// Why this configuration cannot work, if it cannot.
    pub fn validate(&self) -> Result<(), OffloadConfigError> {
        if self.blocks_per_slot == 0 || self.block_size == 0 || self.block_bytes == 0 {
            return Err(OffloadConfigError::EmptyBlock);
        }
        if self.n_slots() == 0 {
            return Err(OffloadConfigError::NoSlot {
                capacity_bytes: self.capacity_bytes,
                slot_bytes: self.slot_bytes(),
            });
        }
        if self.n_slots() > u32::MAX as usize / self.blocks_per_slot {
            return Err(OffloadConfigError::TooLarge {
                capacity_bytes: self.capacity_bytes,
            });
        }
        Ok(())
    }
}

/// Why an offload tier's configuration cannot work ([`OffloadConfig::validate`]); the command
/// line names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffloadConfigError {
    #[error("the offloaded block must be at least one engine block")]
    EmptyBlock,
    #[error("{capacity_bytes} bytes hold no offloaded block of {slot_bytes} bytes")]
    NoSlot {
        capacity_bytes: u64,
        slot_bytes: u64,
    },
    /// More host blocks than a host block id (`u32`) can name.
    #[error("{capacity_bytes} bytes is too large a tier")]
    TooLarge { capacity_bytes: u64 },
}

/// One offloaded block in the index.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    /// Its store job has not reported yet: not loadable, not evictable.
    storing: bool,
    /// Loads in flight reading it: not evictable.
    pins: u32,
}

#[derive(Debug)]
enum JobKind {
    Store {
        keys: Vec<BlockHash>,
    },
    Load {
        req: ReqIdx,
        keys: Vec<BlockHash>,
        /// Its outcome went to the scheduler already (retracted by a reset, or timed out).
        reported: bool,
    },
}

/// A job handed to the worker (or about to be) whose report has not come back.
#[derive(Debug)]
struct Job {
    epoch: u64,
    /// The slots it touches (one entry per slot, even if several blocks of it).
    slots: Vec<u32>,
    kind: JobKind,
}

/// The offload tier's scheduler side (see the module docs).
#[derive(Debug)]
pub struct OffloadConnector {
    config: OffloadConfig,
    /// Keyed by block hashes, which need no rehashing (`BlockHashMap`).
    index: BlockHashMap<Entry>,
    policy: Policy,
    /// Lowest first, so slot use is deterministic.
    free_slots: BTreeSet<u32>,
    /// Per slot: jobs in flight that touch it.
    busy: Vec<u32>,
    /// Per slot: the index forgot it (a reset) while a job still touched it; free once the
    /// last such job reported.
    orphaned: Vec<bool>,
    epoch: u64,
    in_flight: BTreeMap<TransferId, Job>,
    /// Jobs a reset abandoned, not yet delivered to the worker as a `Flush`.
    flush: BTreeSet<TransferId>,
    jobs: Vec<TierJob>,
    ended: Vec<TransferId>,
    loads: Vec<LoadResult>,
    stats: TierStats,
    /// Stored and removed blocks for KV events, once `publish_tier_changes` turned it on.
    changes: Option<Vec<TierChange>>,
}

impl OffloadConnector {
    /// A tier for `config`, which must be valid ([`OffloadConfig::validate`]).
    pub fn new(config: OffloadConfig) -> Self {
        let n_slots = config.n_slots();
        Self {
            policy: Policy::new(config.policy, n_slots),
            index: BlockHashMap::default(),
            free_slots: (0..n_slots as u32).collect(),
            busy: vec![0; n_slots],
            orphaned: vec![false; n_slots],
            epoch: 0,
            in_flight: BTreeMap::new(),
            flush: BTreeSet::new(),
            jobs: Vec::new(),
            ended: Vec::new(),
            loads: Vec::new(),
            changes: None,
            stats: TierStats {
                bytes_capacity: n_slots as u64 * config.slot_bytes(),
                ..TierStats::default()
            },
            config,
        }
    }

    pub fn config(&self) -> &OffloadConfig {
        &self.config
    }

    /// Offloaded blocks in the index (stored or being stored).
    pub fn n_entries(&self) -> usize {
        self.index.len()
    }

    /// Whether the index has the offloaded block ending with this hash, stored.
    pub fn contains(&self, key: &BlockHash) -> bool {
        self.index.get(key).is_some_and(|e| !e.storing)
    }

    /// Jobs whose report has not come back.
    pub fn n_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The current epoch: one more on every reset.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The key of offloaded block `j` of a request: its last engine block's hash.
    fn key(&self, hashes: &[BlockHash], j: usize) -> Option<BlockHash> {
        hashes
            .get((j + 1) * self.config.blocks_per_slot - 1)
            .copied()
    }

    /// A free slot, evicting the policy's victim when none is free.
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(slot) = self.free_slots.pop_first() {
            let n = self.busy[slot as usize];
            assert!(
                n == 0,
                "offload tier: take of free host slot {slot}, which {n} jobs in flight still copy"
            );
            return Some(slot);
        }
        let index = &self.index;
        let victim = self
            .policy
            .victim(|k| index.get(k).is_some_and(|e| !e.storing && e.pins == 0))?;
        let entry = self
            .index
            .remove(&victim)
            .expect("the policy lists index keys");
        self.policy.evicted(victim);
        self.stats.n_evictions += 1;
        self.note(TierChange::Removed(victim));
        let n = self.busy[entry.slot as usize];
        assert!(
            n == 0,
            "offload tier: eviction of host slot {} for a new block, which {n} jobs in flight \
             still copy",
            entry.slot
        );
        Some(entry.slot)
    }

    fn note(&mut self, change: TierChange) {
        if let Some(changes) = &mut self.changes {
            changes.push(change);
        }
    }

    /// Job `hold`, which touched `slots`, reported: slots the index forgot meanwhile become
    /// free.
    fn release_slots(&mut self, hold: TransferId, slots: &[u32]) {
        for &slot in slots {
            let s = slot as usize;
            assert!(
                self.busy[s] > 0,
                "offload tier: end of job {} on host slot {slot}, which no job in flight copies",
                hold.0
            );
            self.busy[s] -= 1;
            if self.busy[s] == 0 && self.orphaned[s] {
                self.orphaned[s] = false;
                self.free_slots.insert(slot);
            }
        }
    }

    /// Every job in flight goes into the flush set; loads not yet answered are retracted
    /// (their requests recompute). Re-entrant.
    fn abandon_in_flight(&mut self) {
        for (&hold, job) in &mut self.in_flight {
            self.flush.insert(hold);
            if let JobKind::Load { req, reported, .. } = &mut job.kind {
                if !*reported {
                    *reported = true;
                    self.loads.push(LoadResult {
                        req: *req,
                        hold,
                        outcome: LoadOutcome::Cancelled,
                    });
                }
            }
        }
    }

    fn update_bytes(&mut self) {
        self.stats.bytes_used = self.index.len() as u64 * self.config.slot_bytes();
    }

    /// A job reported: its hold ends, and a flush set not yet delivered need not wait for it.
    fn job_done(&mut self, hold: TransferId) -> Option<Job> {
        let job = self.in_flight.remove(&hold)?;
        self.flush.remove(&hold);
        self.ended.push(hold);
        self.release_slots(hold, &job.slots);
        Some(job)
    }

    fn on_store_done(&mut self, hold: TransferId, epoch: u64, ok: bool) {
        let Some(job) = self.job_done(hold) else {
            return;
        };
        let JobKind::Store { keys } = job.kind else {
            return;
        };
        if job.epoch != self.epoch || epoch != job.epoch {
            // From before a reset: its slots were handled above; the index is not its.
            return;
        }
        for key in keys {
            let Some(e) = self.index.get_mut(&key) else {
                continue;
            };
            if ok {
                e.storing = false;
                self.note(TierChange::Stored(key));
            } else {
                let slot = e.slot;
                self.index.remove(&key);
                self.policy.removed(&key);
                self.free_slots.insert(slot);
            }
        }
        self.update_bytes();
    }

    fn on_load_done(&mut self, hold: TransferId, epoch: u64, result: Result<(), String>) {
        let Some(job) = self.job_done(hold) else {
            return;
        };
        let JobKind::Load {
            req,
            keys,
            reported,
        } = job.kind
        else {
            return;
        };
        let current = job.epoch == self.epoch && epoch == job.epoch;
        if current {
            for key in &keys {
                if let Some(e) = self.index.get_mut(key) {
                    assert!(
                        e.pins > 0,
                        "offload tier: end of load {} on host slot {}, which no load pins",
                        hold.0,
                        e.slot
                    );
                    e.pins -= 1;
                }
            }
        }
        if reported {
            return;
        }
        let outcome = match result {
            Ok(()) if current => LoadOutcome::Loaded,
            Ok(()) => LoadOutcome::Cancelled,
            Err(reason) => LoadOutcome::Failed {
                good_blocks: 0,
                reason,
                kind: FetchFailure::Fault,
            },
        };
        self.loads.push(LoadResult { req, hold, outcome });
    }
}

impl KvConnector for OffloadConnector {
    fn name(&self) -> &str {
        "offload"
    }

    fn match_external(&mut self, q: ExternalQuery<'_>) -> ExternalMatch {
        let (bs, k) = (self.config.block_size, self.config.blocks_per_slot);
        let hit_blocks = q.local_hit_tokens / bs;
        let mut j = hit_blocks / k;
        while let Some(key) = self.key(q.block_hashes, j) {
            if !self.contains(&key) {
                break;
            }
            j += 1;
        }
        let end_block = j * k;
        if end_block <= hit_blocks {
            return ExternalMatch::None;
        }
        ExternalMatch::Hit {
            tokens: (end_block - hit_blocks) * bs,
            kind: HoldKind::Load,
        }
    }

    fn after_alloc(&mut self, load: AllocatedLoad<'_>) {
        let k = self.config.blocks_per_slot;
        let mut copies = Vec::with_capacity(load.blocks.len());
        let mut keys: Vec<BlockHash> = Vec::new();
        let mut slots: Vec<u32> = Vec::new();
        for (i, &block) in load.blocks.iter().enumerate() {
            let e = load.first_block + i;
            let (j, sub) = (e / k, e % k);
            let entry = self
                .key(load.block_hashes, j)
                .and_then(|key| Some((key, *self.index.get(&key)?)))
                .filter(|(_, entry)| !entry.storing);
            let Some((key, entry)) = entry else {
                // Not what `match_external` offered: nothing is copied, the request recomputes.
                self.loads.push(LoadResult {
                    req: load.req,
                    hold: load.hold,
                    outcome: LoadOutcome::Failed {
                        good_blocks: 0,
                        reason: "the offloaded prefix is gone".into(),
                        // Evicted between the offer and the load: nothing is at fault,
                        // the request computes its prompt under either policy.
                        kind: FetchFailure::Revoked,
                    },
                });
                self.ended.push(load.hold);
                return;
            };
            if keys.last() != Some(&key) {
                keys.push(key);
                slots.push(entry.slot);
            }
            copies.push(HostCopy {
                block,
                host_block: entry.slot * k as u32 + sub as u32,
            });
        }
        for (key, &slot) in keys.iter().zip(&slots) {
            self.index.get_mut(key).expect("found above").pins += 1;
            self.busy[slot as usize] += 1;
            self.policy.touched(*key);
        }
        self.stats.n_hits += 1;
        self.stats.n_hit_blocks += copies.len() as u64;
        self.stats.n_loads += 1;
        self.jobs.push(TierJob::Load {
            hold: load.hold,
            epoch: self.epoch,
            copies,
        });
        self.in_flight.insert(
            load.hold,
            Job {
                epoch: self.epoch,
                slots,
                kind: JobKind::Load {
                    req: load.req,
                    keys,
                    reported: false,
                },
            },
        );
    }

    fn stores_blocks(&self) -> bool {
        true
    }

    fn blocks_computed(&mut self, c: ComputedBlocks<'_>, holds: &mut dyn StoreHolds) {
        let k = self.config.blocks_per_slot;
        let span = k * self.config.block_size;
        let first = c.n_before / span;
        let end = (c.n_after / span).min(c.block_hashes.len() / k);
        let mut copies = Vec::new();
        let mut keys = Vec::new();
        let mut slots = Vec::new();
        for j in first..end {
            let key = c.block_hashes[(j + 1) * k - 1];
            if self.index.contains_key(&key) {
                self.policy.touched(key);
                continue;
            }
            let Some(slot) = self.take_slot() else {
                // Everything is being stored or loaded: this and later blocks are not stored
                // (a later block without this one could never be hit anyway).
                break;
            };
            self.index.insert(
                key,
                Entry {
                    slot,
                    storing: true,
                    pins: 0,
                },
            );
            self.policy.inserted(key);
            self.busy[slot as usize] += 1;
            for sub in 0..k {
                copies.push(HostCopy {
                    block: c.blocks[j * k + sub],
                    host_block: slot * k as u32 + sub as u32,
                });
            }
            keys.push(key);
            slots.push(slot);
        }
        if copies.is_empty() {
            return;
        }
        let blocks: Vec<_> = copies.iter().map(|c| c.block).collect();
        let hold = holds.hold(&blocks);
        self.stats.n_stores += keys.len() as u64;
        self.jobs.push(TierJob::Store {
            hold,
            epoch: self.epoch,
            copies,
        });
        self.in_flight.insert(
            hold,
            Job {
                epoch: self.epoch,
                slots,
                kind: JobKind::Store { keys },
            },
        );
        self.update_bytes();
    }

    fn tier_stats(&self) -> Option<TierStats> {
        Some(self.stats)
    }

    fn step_work(&mut self, out: &mut Vec<WorkerJob>) {
        out.extend(self.jobs.drain(..).map(WorkerJob::Tier));
        if !self.flush.is_empty() {
            // After this step's jobs: the worker waits for everything handed to it so far.
            let holds = std::mem::take(&mut self.flush).into_iter().collect();
            out.push(WorkerJob::Tier(TierJob::Flush { holds }));
            self.stats.n_flushes += 1;
        }
    }

    fn on_tier_report(&mut self, report: TierReport) {
        match report {
            TierReport::StoreDone { hold, epoch, ok } => self.on_store_done(hold, epoch, ok),
            TierReport::LoadDone {
                hold,
                epoch,
                result,
            } => self.on_load_done(hold, epoch, result.map_err(|e| e.reason)),
        }
    }

    fn abort_transfers(&mut self) {
        self.abandon_in_flight();
    }

    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>) {
        out.append(&mut self.ended);
    }

    fn take_finished_loads(&mut self, out: &mut Vec<LoadResult>) {
        out.append(&mut self.loads);
    }

    fn hold_expired(&mut self, hold: TransferId) {
        // A load that did not answer in time: the request recomputes; the hold ends with
        // the worker's report (the copy may still be writing).
        if let Some(Job {
            kind: JobKind::Load { req, reported, .. },
            ..
        }) = self.in_flight.get_mut(&hold)
        {
            if !*reported {
                *reported = true;
                self.loads.push(LoadResult {
                    req: *req,
                    hold,
                    outcome: LoadOutcome::Failed {
                        good_blocks: 0,
                        reason: "the offload load did not answer in time".into(),
                        kind: FetchFailure::Fault,
                    },
                });
            }
        }
    }

    fn has_pending_work(&self) -> bool {
        !self.jobs.is_empty() || !self.flush.is_empty()
    }

    fn publish_tier_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    fn tier_blocks(&self, out: &mut Vec<BlockHash>) {
        out.extend(
            self.index
                .iter()
                .filter(|(_, e)| !e.storing)
                .map(|(key, _)| *key),
        );
    }

    fn take_tier_changes(&mut self, out: &mut Vec<TierChange>) {
        if let Some(changes) = &mut self.changes {
            out.append(changes);
        }
    }

    fn reset_cache(&mut self) {
        self.abandon_in_flight();
        for (key, entry) in self.index.drain() {
            if !entry.storing {
                if let Some(changes) = &mut self.changes {
                    changes.push(TierChange::Removed(key));
                }
            }
            let s = entry.slot as usize;
            if self.busy[s] == 0 {
                self.free_slots.insert(entry.slot);
            } else {
                self.orphaned[s] = true;
            }
        }
        self.policy.clear();
        self.epoch += 1;
        self.update_bytes();
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;

    fn config(blocks_per_slot: usize, capacity_bytes: u64) -> OffloadConfig {
        OffloadConfig {
            block_size: 16,
            blocks_per_slot,
            block_bytes: 100,
            capacity_bytes,
            policy: OffloadPolicy::Lru,
        }
    }

    #[test]
    fn a_config_counts_its_slots_and_host_blocks_and_refuses_what_cannot_work() {
        let c = config(3, 1_000);
        assert_eq!(c.slot_bytes(), 300);
        assert_eq!(c.n_slots(), 3);
        assert_eq!(c.n_host_blocks(), 9);
        assert_eq!(c.validate(), Ok(()));
        // Exactly one slot fits.
        assert_eq!(config(3, 300).validate(), Ok(()));
        for bad in [
            OffloadConfig {
                blocks_per_slot: 0,
                ..c.clone()
            },
            OffloadConfig {
                block_size: 0,
                ..c.clone()
            },
            OffloadConfig {
                block_bytes: 0,
                ..c.clone()
            },
        ] {
            assert_eq!(
                bad.validate(),
                Err(OffloadConfigError::EmptyBlock),
                "{bad:?}"
            );
        }
        assert_eq!(
            config(3, 299).validate(),
            Err(OffloadConfigError::NoSlot {
                capacity_bytes: 299,
                slot_bytes: 300
            })
        );
        // The slot count times the blocks per slot must fit the host block ids (u32).
        let huge = config(2, u64::from(u32::MAX) * 200);
        assert_eq!(
            huge.validate(),
            Err(OffloadConfigError::TooLarge {
                capacity_bytes: u64::from(u32::MAX) * 200
            }),
            "{huge:?}"
        );
        let largest = config(2, u64::from(u32::MAX / 2) * 200);
        assert_eq!(largest.validate(), Ok(()));
    }
}

/// The tier's slot bookkeeping states its preconditions in release builds too: a slot is
/// never handed out or evicted while a job copies it, and a job never ends on a slot no job
/// copies. A consistent tier cannot break them through its interface, so each test breaks
/// the bookkeeping first, as a bug in it would.
#[cfg(test)]
mod slot_tests {
    use super::*;
    use crate::connector::{AllocatedLoad, ComputedBlocks, KvConnector, StoreHolds};
    use crate::ids::BlockId;

    struct Holds(u64);

    impl StoreHolds for Holds {
        fn hold(&mut self, _: &[BlockId]) -> TransferId {
            self.0 += 1;
            TransferId(self.0)
        }
    }

    fn hashes() -> Vec<BlockHash> {
        (0..4u8).map(|i| BlockHash([i; 32])).collect()
    }

    /// A one-slot tier (one block a slot, block size 4) storing block 0's hash: job 1 copies
    /// host slot 0.
    /// Request 1 computes a block after [`storing`]'s: the tier takes a slot for it.
    fn store_a_second_block(t: &mut OffloadConnector) {
        let (blocks, hashes) = (BlockId::list([1, 2]), hashes());
        let second = ComputedBlocks {
            req: ReqIdx(1),
            blocks: &blocks,
            block_hashes: &hashes,
            n_before: 4,
            n_after: 8,
        };
        t.blocks_computed(second, &mut Holds(1));
    }

    fn storing() -> OffloadConnector {
        let mut t = OffloadConnector::new(OffloadConfig {
            block_size: 4,
            blocks_per_slot: 1,
            block_bytes: 100,
            capacity_bytes: 100,
            policy: OffloadPolicy::Lru,
        });
        let (blocks, hashes) = (BlockId::list([1, 2]), hashes());
        let computed = ComputedBlocks {
            req: ReqIdx(0),
            blocks: &blocks,
            block_hashes: &hashes,
            n_before: 0,
            n_after: 4,
        };
        t.blocks_computed(computed, &mut Holds(0));
        assert_eq!(t.busy, vec![1]);
        t
    }

    #[test]
    #[should_panic(
        expected = "offload tier: end of job 1 on host slot 0, which no job in \
                               flight copies"
    )]
    fn a_job_ending_on_a_slot_no_job_copies_panics() {
        let mut t = storing();
        t.busy[0] = 0;
        t.on_tier_report(TierReport::StoreDone {
            hold: TransferId(1),
            epoch: 0,
            ok: true,
        });
    }

    #[test]
    #[should_panic(
        expected = "offload tier: eviction of host slot 0 for a new block, which 1 \
                               jobs in flight still copy"
    )]
    fn evicting_a_slot_a_job_still_copies_panics() {
        let mut t = storing();
        // Marked stored while its job is still in flight: the slot looks evictable.
        t.index.values_mut().for_each(|e| e.storing = false);
        store_a_second_block(&mut t);
    }

    #[test]
    #[should_panic(
        expected = "offload tier: take of free host slot 0, which 1 jobs in flight \
                               still copy"
    )]
    fn handing_out_a_free_slot_a_job_still_copies_panics() {
        let mut t = storing();
        t.free_slots.insert(0);
        store_a_second_block(&mut t);
    }

    #[test]
    #[should_panic(expected = "offload tier: end of load 7 on host slot 0, which no load pins")]
    fn a_load_unpinning_a_block_no_load_pins_panics() {
        let mut t = storing();
        t.on_tier_report(TierReport::StoreDone {
            hold: TransferId(1),
            epoch: 0,
            ok: true,
        });
        let hashes = hashes();
        t.after_alloc(AllocatedLoad {
            req: ReqIdx(2),
            hold: TransferId(7),
            blocks: &[BlockId(5)],
            first_block: 0,
            n_tokens: 4,
            block_hashes: &hashes,
        });
        t.index.values_mut().for_each(|e| e.pins = 0);
        t.on_tier_report(TierReport::LoadDone {
            hold: TransferId(7),
            epoch: 0,
            result: Ok(()),
        });
    }
}
