//! One instance's prefix cache as its KV events describe it ([`KvIndex`]), for routing a
//! request to the instance that already holds its prompt's prefix.
//!
//! Blocks are keyed by their content, not by the engine's hash: a block's key is a hash of its
//! parent's key and its tokens, so the proxy finds a prompt's blocks from its tokens alone,
//! without knowing how the engine hashes (weight version, cache salt). The engine's hashes
//! are kept only to apply `BlockRemoved` and to place a chain after its parent.
//!
//! The offload tier's blocks count too (a request whose prefix the tier holds loads it instead
//! of computing it): the tier announces them by hash only (`BlockStored` with medium `CPU`),
//! so a tier block is placed by the key the device's event gave that hash, and a device
//! block's removal (an eviction, a reset of the device cache alone) leaves its tier entry.
//!
//! The index is fenced: it is dropped on `AllBlocksCleared`, on a batch of another weight
//! version or cache epoch (the engine wiped its cache, even if the clear itself was missed),
//! on a gap in the sequence numbers that the replay cannot fill, and when a clearing admin
//! call went through the proxy (only the device's entries, for a reset that leaves the tier). A dropped index predicts no hit, so a wipe can cost a hit but
//! never sends a request to a cache that is gone. Each wipe's time is kept, so a miss on a
//! route made from blocks a wipe had already taken can be told apart from an eviction
//! ([`KvIndex::was_stale`]).

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{KvEvent, KvEventBatch, Medium, TokenId};

/// How long a block the proxy routed a prompt to counts as cached before the engine's event
/// confirms it (the gap between routing and the prefill).
pub const PROVISIONAL: Duration = Duration::from_secs(10);

/// Where the index stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// Not known yet whether the instance publishes events.
    Unknown,
    /// It does not (`/kv_events_info` says so): routed by load.
    NoEvents,
    /// Subscribed; the replay is not done yet: routed by load.
    Syncing,
    /// The index follows the instance's events.
    Synced,
}

/// One instance's prefix cache as its events describe it (see the module docs).
#[derive(Debug)]
pub struct KvIndex {
    pub sync: Sync,
    pub block_size: usize,
    /// The epoch and weight version of the events applied; `None` before the first.
    epoch: Option<(u64, Arc<str>)>,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Confirmed blocks of the device's prefix cache: key → engine hash.
    blocks: HashMap<u64, u64>,
    by_hash: HashMap<u64, u64>,
    /// Confirmed blocks of the offload tier: engine hash → key, and their keys.
    tier: HashMap<u64, u64>,
    tier_keys: HashSet<u64>,
    /// Blocks the proxy routed prompts to, not confirmed yet: key → until when.
    provisional: HashMap<u64, Instant>,
    /// Every wipe seen: (the index's generation after it, when it happened, seconds since the
    /// Unix epoch by the instance's clock or the proxy's).
    wipes: Vec<(u64, f64)>,
    /// Counts wipes; a route remembers the generation it was predicted under.
    generation: u64,
    pub n_drops: u64,
    /// The latest version of each LoRA adapter whose blocks the instance announced: a
    /// request naming the adapter is looked up under it.
    loras: HashMap<Arc<str>, u64>,
}

/// The key a chain's first block hangs from: 0 for the base model; for a LoRA adapter, a key
/// of its name and version, so no block is ever found across adapters or versions (the
/// engine's hashes differ there too).
pub fn chain_root(lora: Option<(&str, u64)>) -> u64 {
    match lora {
        None => 0,
        Some((name, version)) => {
            let mut h = DefaultHasher::new();
            ("lora", name, version).hash(&mut h);
            h.finish().max(1)
        }
    }
}

/// The key of the block holding `tokens` after the block keyed `parent` (0: none).
pub fn block_key(parent: u64, tokens: &[TokenId]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    TokenId::as_raw_slice(tokens).hash(&mut h);
    // 0 stands for "no parent".
    h.finish().max(1)
}

impl Default for KvIndex {
    fn default() -> Self {
        Self {
            sync: Sync::Unknown,
            block_size: 0,
            epoch: None,
            last_seq: None,
            blocks: HashMap::new(),
            by_hash: HashMap::new(),
            tier: HashMap::new(),
            tier_keys: HashSet::new(),
            provisional: HashMap::new(),
            wipes: Vec::new(),
            generation: 0,
            n_drops: 0,
            loras: HashMap::new(),
        }
    }
}

impl KvIndex {
    /// Confirmed blocks of the device's prefix cache held.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Confirmed blocks of the offload tier held.
    pub fn n_tier_blocks(&self) -> usize {
        self.tier.len()
    }

    /// The index's generation: it moves at every wipe.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Drops everything: the cache was wiped at `at` (seconds since the Unix epoch).
    pub fn wipe(&mut self, at: f64) {
        self.tier.clear();
        self.tier_keys.clear();
        self.wipe_device(at);
    }

    /// Drops the device's entries (and the provisional ones): its prefix cache was wiped at
    /// `at`, and the offload tier kept its blocks.
    pub fn wipe_device(&mut self, at: f64) {
        self.blocks.clear();
        self.by_hash.clear();
        self.provisional.clear();
        self.generation += 1;
        self.n_drops += 1;
        self.wipes.push((self.generation, at));
        // Only recent wipes matter for classifying misses.
        if self.wipes.len() > 64 {
            self.wipes.remove(0);
        }
    }

    /// Applies one batch, stamped `ts` by the publisher.
    pub fn apply(&mut self, batch: &KvEventBatch, ts: f64) {
        let fresh = match &self.epoch {
            Some((e, v)) => *e != batch.epoch || **v != *batch.weight_version,
            None => false,
        };
        if fresh && batch.events.first() != Some(&KvEvent::AllCleared) {
            // A wipe whose clear this index never saw.
            self.wipe(ts);
        }
        self.epoch = Some((batch.epoch, batch.weight_version.clone()));
        if batch.block_size > 0 {
            self.block_size = batch.block_size;
        }
        for event in &batch.events {
            match event {
                KvEvent::AllCleared => self.wipe(ts),
                KvEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    medium: Medium::Primary,
                    lora,
                } => {
                    let root = lora.as_ref().map(|l| {
                        let latest = self.loras.entry(l.name.clone()).or_default();
                        *latest = (*latest).max(l.version);
                        chain_root(Some((&l.name, l.version)))
                    });
                    self.stored(hashes, *parent, tokens, root.unwrap_or(0));
                }
                KvEvent::Removed {
                    hashes,
                    medium: Medium::Primary,
                } => {
                    for h in hashes {
                        if let Some(k) = self.by_hash.remove(h) {
                            self.blocks.remove(&k);
                        }
                    }
                }
                KvEvent::Stored {
                    hashes,
                    medium: Medium::Tier,
                    ..
                } => {
                    for h in hashes {
                        // Placed by the key the device's event gave this hash; one the index
                        // never saw on the device cannot be (its tokens are not announced).
                        if let Some(&k) = self.by_hash.get(h).or_else(|| self.tier.get(h)) {
                            self.tier.insert(*h, k);
                            self.tier_keys.insert(k);
                        }
                    }
                }
                KvEvent::Removed {
                    hashes,
                    medium: Medium::Tier,
                } => {
                    for h in hashes {
                        if let Some(k) = self.tier.remove(h) {
                            self.tier_keys.remove(&k);
                        }
                    }
                }
            }
        }
    }

    fn stored(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[TokenId], root: u64) {
        let bs = self.block_size;
        let mut key = match parent {
            None => root,
            Some(p) => match self.by_hash.get(&p) {
                Some(&k) => k,
                // A chain whose head this index does not hold (stored before the index
                // started, in batches no longer replayable): it cannot be placed.
                None => return,
            },
        };
        if bs == 0 || tokens.len() != hashes.len() * bs {
            return;
        }
        for (h, block) in hashes.iter().zip(tokens.chunks(bs)) {
            key = block_key(key, block);
            self.blocks.insert(key, *h);
            self.by_hash.insert(*h, key);
            self.provisional.remove(&key);
        }
    }

    /// The root a request naming `model` is looked up under: an adapter's whose blocks the
    /// instance announced (its latest version), else the base model's.
    pub fn root_of(&self, model: Option<&str>) -> u64 {
        model
            .and_then(|m| self.loras.get_key_value(m))
            .map_or(0, |(name, &v)| chain_root(Some((name, v))))
    }

    /// How many of `tokens`' leading full blocks the instance holds (or was just sent), under
    /// the chain root `root` ([`Self::root_of`]).
    pub fn overlap(&self, tokens: &[TokenId], root: u64, now: Instant) -> usize {
        let bs = self.block_size;
        if bs == 0 {
            return 0;
        }
        let mut key = root;
        let mut n = 0;
        for block in tokens.chunks_exact(bs) {
            key = block_key(key, block);
            let held = self.blocks.contains_key(&key)
                || self.tier_keys.contains(&key)
                || self.provisional.get(&key).is_some_and(|&t| t > now);
            if !held {
                break;
            }
            n += 1;
        }
        n
    }

    /// `tokens`' full blocks will be cached there soon: the proxy just sent them.
    pub fn add_provisional(&mut self, tokens: &[TokenId], root: u64, now: Instant) {
        let bs = self.block_size;
        if bs == 0 {
            return;
        }
        self.provisional.retain(|_, &mut t| t > now);
        let mut key = root;
        for block in tokens.chunks_exact(bs) {
            key = block_key(key, block);
            if !self.blocks.contains_key(&key) {
                self.provisional.insert(key, now + PROVISIONAL);
            }
        }
    }

    /// Whether a route predicted under `generation` at `routed_at` was made more than
    /// `grace` after a wipe the index had not applied yet: a stale route, the fleet's bug
    /// (an ordinary miss is an eviction).
    pub fn was_stale(&self, generation: u64, routed_at: f64, grace: f64) -> bool {
        self.wipes
            .iter()
            .any(|&(g, at)| g > generation && at + grace < routed_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(epoch: u64, events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            events,
            block_size: 2,
            weight_version: Arc::from("v0"),
            epoch,
        }
    }

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::Stored {
            hashes,
            parent,
            tokens: TokenId::from_raw_vec(tokens),
            medium: Medium::Primary,
            lora: None,
        }
    }

    /// An adapter's blocks are found only by requests naming that adapter, under the latest
    /// version the instance announced: never by the base's, another adapter's, or after a
    /// new version (whose blocks start their own chain).
    #[test]
    fn an_adapters_blocks_are_found_only_under_its_name_and_latest_version() {
        let now = Instant::now();
        let mut ix = KvIndex::default();
        let under = |hashes: Vec<u64>, version: u64| KvEvent::Stored {
            hashes,
            parent: None,
            tokens: TokenId::list([1, 2, 3, 4]),
            medium: Medium::Primary,
            lora: Some(ferry_core::LoraRef::new(
                ferry_core::LoraId(0),
                "pol",
                version,
            )),
        };
        ix.apply(&batch(0, vec![under(vec![10, 11], 1)]), 0.0);
        let prompt = TokenId::list([1, 2, 3, 4, 5]);
        let at = |ix: &KvIndex, model: Option<&str>| ix.overlap(&prompt, ix.root_of(model), now);
        assert_eq!(at(&ix, Some("pol")), 2);
        assert_eq!(at(&ix, None), 0, "the base");
        assert_eq!(
            at(&ix, Some("other")),
            0,
            "another adapter, looked up as the base"
        );
        // Version 2's first blocks: version 1's are not found any more.
        ix.apply(&batch(0, vec![under(vec![20], 2)]), 0.0);
        assert_eq!(at(&ix, Some("pol")), 0);
        ix.apply(
            &batch(0, vec![stored(vec![30, 31], None, vec![1, 2, 3, 4])]),
            0.0,
        );
        assert_eq!((at(&ix, None), at(&ix, Some("pol"))), (2, 0));
    }

    #[test]
    fn a_prompt_finds_its_blocks_and_a_wipe_or_a_new_epoch_drops_them() {
        let now = Instant::now();
        let mut ix = KvIndex::default();
        ix.apply(
            &batch(0, vec![stored(vec![10, 11], None, vec![1, 2, 3, 4])]),
            1.0,
        );
        ix.apply(&batch(0, vec![stored(vec![12], Some(11), vec![5, 6])]), 1.0);
        assert_eq!(ix.overlap(&TokenId::list([1, 2, 3, 4, 5, 6, 7]), 0, now), 3);
        assert_eq!(
            ix.overlap(&TokenId::list([1, 2, 9, 9, 5, 6]), 0, now),
            1,
            "a prefix, block by block"
        );
        ix.apply(
            &batch(
                0,
                vec![KvEvent::Removed {
                    hashes: vec![11],
                    medium: Medium::Primary,
                }],
            ),
            1.0,
        );
        assert_eq!(ix.overlap(&TokenId::list([1, 2, 3, 4, 5, 6]), 0, now), 1);
        let g = ix.generation();
        // A batch of the next epoch without its clear (missed): everything is gone.
        ix.apply(&batch(1, vec![stored(vec![20], None, vec![7, 8])]), 5.0);
        assert_eq!(ix.overlap(&TokenId::list([1, 2]), 0, now), 0);
        assert_eq!(ix.overlap(&TokenId::list([7, 8]), 0, now), 1);
        assert!(ix.was_stale(g, 5.2, 0.1), "routed 200 ms after the wipe");
        assert!(!ix.was_stale(g, 5.05, 0.1), "within the grace");
        assert!(!ix.was_stale(ix.generation(), 9.0, 0.1));
        ix.apply(&batch(2, vec![KvEvent::AllCleared]), 6.0);
        assert_eq!(
            (ix.overlap(&TokenId::list([7, 8]), 0, now), ix.n_blocks()),
            (0, 0)
        );
    }

    /// The tier's blocks count for a prefix; a reset of the device alone keeps them, a whole
    /// clear does not.
    #[test]
    fn tier_blocks_outlive_the_device_cache_but_not_a_whole_clear() {
        let now = Instant::now();
        let prompt = TokenId::list([1, 2, 3, 4, 5]);
        let mut ix = KvIndex::default();
        let tier = |hashes: Vec<u64>| KvEvent::Stored {
            hashes,
            parent: None,
            tokens: Vec::new(),
            medium: Medium::Tier,
            lora: None,
        };
        ix.apply(
            &batch(
                0,
                vec![
                    stored(vec![10, 11], None, vec![1, 2, 3, 4]),
                    tier(vec![10, 11, 99]),
                ],
            ),
            1.0,
        );
        assert_eq!(
            (ix.n_blocks(), ix.n_tier_blocks()),
            (2, 2),
            "99: never seen"
        );
        // Evicted from the device: still a hit, from the tier.
        let evicted = KvEvent::Removed {
            hashes: vec![10, 11],
            medium: Medium::Primary,
        };
        ix.apply(&batch(0, vec![evicted]), 1.0);
        assert_eq!((ix.n_blocks(), ix.overlap(&prompt, 0, now)), (0, 2));
        ix.apply(&batch(0, vec![stored(vec![10], None, vec![1, 2])]), 1.0);
        ix.wipe_device(2.0);
        assert_eq!((ix.n_blocks(), ix.overlap(&prompt, 0, now)), (0, 2));
        ix.apply(
            &batch(
                0,
                vec![KvEvent::Removed {
                    hashes: vec![11],
                    medium: Medium::Tier,
                }],
            ),
            3.0,
        );
        assert_eq!(ix.overlap(&prompt, 0, now), 1);
        ix.apply(&batch(1, vec![KvEvent::AllCleared]), 4.0);
        assert_eq!((ix.n_tier_blocks(), ix.overlap(&prompt, 0, now)), (0, 0));
    }

    #[test]
    fn provisional_blocks_count_until_confirmed_or_expired() {
        let now = Instant::now();
        let mut ix = KvIndex {
            block_size: 2,
            ..KvIndex::default()
        };
        ix.add_provisional(&TokenId::list([1, 2, 3, 4, 5]), 0, now);
        assert_eq!(ix.overlap(&TokenId::list([1, 2, 3, 4]), 0, now), 2);
        assert_eq!(
            ix.overlap(&TokenId::list([1, 2, 3, 4]), 0, now + PROVISIONAL),
            0
        );
        ix.apply(&batch(0, vec![stored(vec![1], None, vec![1, 2])]), 1.0);
        assert_eq!(ix.overlap(&TokenId::list([1, 2]), 0, now + PROVISIONAL), 1);
        ix.wipe(2.0);
        assert_eq!(
            ix.overlap(&TokenId::list([1, 2, 3, 4]), 0, now),
            0,
            "a wipe drops the provisional too"
        );
    }
}
