//! A KV event subscriber's view of one engine's arena, as a router builds it from the events
//! the engine core puts out, and the check that holds it: every block the view holds is
//! cached. A router that trusts the events never sends a request for a hit that a wipe or an
//! eviction took away.

use std::collections::BTreeSet;

use ferry_core::kv_events::external_hash;
use ferry_core::{KvEvent, KvEventBatch, Medium, Scheduler};

/// The view (see the module docs).
#[derive(Debug, Default)]
pub struct KvView {
    epoch: u64,
    blocks: BTreeSet<u64>,
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
        // The arena's blocks (the tier's are checked by the tier's own accounting).
        for event in batch.events {
            match event {
                KvEvent::AllCleared => self.blocks.clear(),
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
                KvEvent::Stored { .. } | KvEvent::Removed { .. } => self.n_tier_events += 1,
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
        match self.blocks.iter().find(|h| !cached.contains(h)) {
            Some(h) => Err(format!(
                "KV events announce block {h:016x}, which is not cached"
            )),
            None => Ok(()),
        }
    }
}
