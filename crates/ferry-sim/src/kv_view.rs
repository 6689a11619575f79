//! A KV event subscriber's view of one engine's caches (the arena's prefix cache and the
//! offload tier), as a router builds it from the events the engine core puts out, and the
//! checks that hold it: every block the view holds is cached (a router that trusts the events
//! never sends a request for a hit that a wipe or an eviction took away), and the view holds
//! every block of the tier (a reset of the device cache alone must not say the tier is gone:
//! a router would forget blocks that still serve).

use std::collections::BTreeSet;

use ferry_core::kv_events::external_hash;
use ferry_core::{KvEvent, KvEventBatch, Medium, Scheduler};

/// The view (see the module docs).
#[derive(Debug, Default)]
pub struct KvView {
    epoch: u64,
    blocks: BTreeSet<u64>,
    tier: BTreeSet<u64>,
    /// The weight version of the last batch.
    version: Option<std::sync::Arc<str>>,
    /// Tier blocks a new weight version made unreachable (their hashes chain from the old
    /// version's root): the tier may keep them until it evicts them, and no hit can reach
    /// them.
    stale: BTreeSet<u64>,
    /// Batches applied, and the offload tier's events among them.
    pub n_batches: u64,
    pub n_tier_events: u64,
}

impl KvView {
    /// Applies a batch: a new epoch starts from nothing, and must say so.
    pub fn apply(&mut self, batch: KvEventBatch) -> Result<(), String> {
        self.n_batches += 1;
        if batch.epoch < self.epoch {
            let (was, now) = (self.epoch, batch.epoch);
            return Err(format!("KV events went back from epoch {was} to {now}"));
        }
        if batch.epoch > self.epoch && batch.events.first() != Some(&KvEvent::AllCleared) {
            return Err(format!(
                "epoch {} began without AllBlocksCleared",
                batch.epoch
            ));
        }
        self.epoch = batch.epoch;
        let new_version = self
            .version
            .as_ref()
            .is_some_and(|v| *v != batch.weight_version);
        self.version = Some(batch.weight_version.clone());
        for event in batch.events {
            match event {
                // Under a new weight version every block is unreachable; otherwise a whole
                // clear says the tier was cleared too.
                KvEvent::AllCleared if new_version => {
                    self.blocks.clear();
                    self.stale.append(&mut self.tier);
                }
                KvEvent::AllCleared => {
                    self.blocks.clear();
                    self.tier.clear();
                }
                KvEvent::Stored {
                    hashes,
                    medium: Medium::Primary,
                    ..
                } => self.blocks.extend(hashes),
                KvEvent::Removed {
                    hashes,
                    medium: Medium::Primary,
                } => {
                    for h in &hashes {
                        self.blocks.remove(h);
                    }
                }
                KvEvent::Stored {
                    hashes,
                    medium: Medium::Tier,
                    ..
                } => {
                    self.n_tier_events += 1;
                    self.tier.extend(hashes);
                }
                KvEvent::Removed {
                    hashes,
                    medium: Medium::Tier,
                } => {
                    self.n_tier_events += 1;
                    for h in &hashes {
                        self.tier.remove(h);
                    }
                }
            }
        }
        Ok(())
    }

    /// Every block the view holds is in `sched`'s prefix cache.
    pub fn check(&self, sched: &Scheduler) -> Result<(), String> {
        let cached: BTreeSet<u64> = sched
            .kv_pool()
            .cached_entries()
            .map(|(h, _)| external_hash(h))
            .collect();
        if let Some(h) = self.blocks.iter().find(|h| !cached.contains(h)) {
            return Err(format!(
                "KV events announce block {h:016x}, which is not cached"
            ));
        }
        // The tier's changes are taken with the events, so the view is the tier exactly.
        let tier: BTreeSet<u64> = sched.tier_blocks().iter().map(external_hash).collect();
        if let Some(h) = self.tier.difference(&tier).next() {
            return Err(format!(
                "KV events announce block {h:016x} in the offload tier, which does not hold it"
            ));
        }
        if let Some(h) = tier
            .difference(&self.tier)
            .find(|h| !self.stale.contains(h))
        {
            return Err(format!(
                "the offload tier holds block {h:016x}, which the KV events say is gone"
            ));
        }
        Ok(())
    }
}
