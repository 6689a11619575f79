//! KV cache events: what the prefix cache gained and lost, for routers outside the engine
//! (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, `vllm/distributed/kv_events.py`).
//!
//! The block pool journals each change as it happens ([`KvEventLog`]); the engine drains the
//! journal after every input and every step ([`Scheduler::take_kv_events`]), so a clear is
//! published when it happens, idle or asleep, not after the next forward. The journal is cut
//! into batches at every wipe: each [`KvEventBatch`] names the weight version and the cache
//! epoch all its blocks belong to, and a batch that starts with [`KvEvent::AllCleared`] opens a
//! new epoch. The epoch counts wipes (a cleared prefix cache, a new weight version), so a
//! subscriber that sees the epoch move knows every block it indexed before is gone, even if it
//! missed the clear itself.
//!
//! A block computed with a LoRA adapter is stored with the adapter ([`KvEvent::Stored`]'s
//! `lora`: vLLM's `lora_name`, with ferry's id and version beside it): its hash already
//! differs from the base model's and from every other adapter's or version's (`hash.rs`), and
//! the event says whose it is, so a router can send a request to an engine that cached its
//! prefix under the same adapter.
//!
//! [`Scheduler::take_kv_events`]: crate::Scheduler::take_kv_events

use std::sync::Arc;

use crate::hash::BlockHash;
use crate::ids::TokenId;
use crate::lora::LoraRef;

/// Where a block lives: ferry's KV arena (the primary tier, `"GPU"` in vLLM's events, the
/// name consumers give the primary tier) or the CPU offload tier (`"CPU"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    Primary,
    Tier,
}

impl Medium {
    /// The medium's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Primary => "GPU",
            Self::Tier => "CPU",
        }
    }
}

/// One change of the cache, with block hashes as consumers key them ([`external_hash`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks now cached, in chain order: `parent` is the hash of the block before the
    /// first (none for a prompt's first block), `tokens` the blocks' tokens, `block_size` each.
    /// `lora`: the adapter that computed them (none: the base model; always none for the
    /// offload tier's blocks, which it knows by hash only). Its name is vLLM's `lora_name`,
    /// its id vLLM's `lora_id`; its version is ferry's, and says which weights the name had,
    /// as the batch's `weight_version` does for the base.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<TokenId>,
        medium: Medium,
        lora: Option<LoraRef>,
    },
    /// Blocks no longer cached.
    Removed { hashes: Vec<u64>, medium: Medium },
    /// Every cached block of every medium is gone.
    AllCleared,
}

/// Events under one weight version and one cache epoch (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventBatch {
    pub events: Vec<KvEvent>,
    pub block_size: usize,
    pub weight_version: Arc<str>,
    pub epoch: u64,
}

/// A block hash as KV events carry it: its first 8 bytes, big-endian (as vLLM turns its
/// bytes hashes into ints). The full 32 bytes stay the engine's own key.
pub fn external_hash(hash: &BlockHash) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.0[..8]);
    u64::from_be_bytes(first)
}

/// A change of a connector's own cache (the offload tier), journaled by the connector and
/// collected by the scheduler (`KvConnector::take_tier_changes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierChange {
    /// The block keyed by this hash is stored in the tier (loadable).
    Stored(BlockHash),
    /// It is not any more (evicted, or the tier was reset).
    Removed(BlockHash),
}

/// One journaled change, as the pool and the scheduler see it.
#[derive(Debug, Clone)]
enum Change {
    Event(KvEvent),
    /// The prefix cache was cleared.
    Cleared,
    /// The weights changed: every cached block is unreachable.
    NewVersion(Arc<str>),
}

/// The journal of cache changes, off unless the engine publishes events (then it costs
/// nothing but a branch).
#[derive(Debug)]
pub struct KvEventLog {
    on: bool,
    changes: Vec<Change>,
    block_size: usize,
    version: Arc<str>,
    epoch: u64,
}

impl KvEventLog {
    pub fn new(on: bool, block_size: usize, version: &str) -> Self {
        Self {
            on,
            changes: Vec::new(),
            block_size,
            version: Arc::from(version),
            epoch: 0,
        }
    }

    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Block `hash` (after `parent`, holding `tokens`, computed with `lora`) is now cached in
    /// the arena.
    pub fn stored(
        &mut self,
        hash: &BlockHash,
        parent: Option<&BlockHash>,
        tokens: &[TokenId],
        lora: Option<&LoraRef>,
    ) {
        if !self.on {
            return;
        }
        let (h, p) = (external_hash(hash), parent.map(external_hash));
        // A chain's next block joins the event of the block before it (one adapter's: a chain
        // is, but 8 bytes of two hashes could agree).
        if let Some(Change::Event(KvEvent::Stored {
            hashes,
            tokens: t,
            medium: Medium::Primary,
            lora: l,
            ..
        })) = self.changes.last_mut()
        {
            if p.is_some() && hashes.last().copied() == p && l.as_ref() == lora {
                hashes.push(h);
                t.extend_from_slice(tokens);
                return;
            }
        }
        self.changes.push(Change::Event(KvEvent::Stored {
            hashes: vec![h],
            parent: p,
            tokens: tokens.to_vec(),
            medium: Medium::Primary,
            lora: lora.cloned(),
        }));
    }

    /// Blocks of `medium` no longer cached.
    pub fn removed(&mut self, hash: &BlockHash, medium: Medium) {
        if !self.on {
            return;
        }
        let h = external_hash(hash);
        if let Some(Change::Event(KvEvent::Removed { hashes, medium: m })) = self.changes.last_mut()
        {
            if *m == medium {
                hashes.push(h);
                return;
            }
        }
        self.changes.push(Change::Event(KvEvent::Removed {
            hashes: vec![h],
            medium,
        }));
    }

    /// Blocks of the offload tier now cached there (no tokens: the tier keys by hash).
    pub fn tier_stored(&mut self, hash: &BlockHash) {
        if !self.on {
            return;
        }
        let h = external_hash(hash);
        if let Some(Change::Event(KvEvent::Stored {
            hashes,
            medium: Medium::Tier,
            ..
        })) = self.changes.last_mut()
        {
            hashes.push(h);
            return;
        }
        self.changes.push(Change::Event(KvEvent::Stored {
            hashes: vec![h],
            parent: None,
            tokens: Vec::new(),
            medium: Medium::Tier,
            lora: None,
        }));
    }

    /// A change of the offload tier.
    pub fn tier(&mut self, change: TierChange) {
        match change {
            TierChange::Stored(h) => self.tier_stored(&h),
            TierChange::Removed(h) => self.removed(&h, Medium::Tier),
        }
    }

    /// The prefix cache was cleared.
    pub fn cleared(&mut self) {
        if self.on {
            self.changes.push(Change::Cleared);
        }
    }

    /// The weights changed to `version`.
    pub fn new_version(&mut self, version: Arc<str>) {
        if self.on {
            self.changes.push(Change::NewVersion(version));
        } else {
            self.version = version;
        }
    }

    /// `events` as a batch of the current weight version and epoch.
    fn batch(&self, events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            events,
            block_size: self.block_size,
            weight_version: self.version.clone(),
            epoch: self.epoch,
        }
    }

    /// Everything journaled since the last call, cut into batches at every wipe.
    pub fn drain(&mut self, out: &mut impl Extend<KvEventBatch>) {
        let mut events = Vec::new();
        // Out of `self` while it is read (its capacity comes back after).
        let mut changes = std::mem::take(&mut self.changes);
        for change in changes.drain(..) {
            let event = match change {
                Change::Event(e) => e,
                wipe => {
                    if !events.is_empty() {
                        let batch = std::mem::take(&mut events);
                        out.extend(Some(self.batch(batch)));
                    }
                    if let Change::NewVersion(v) = wipe {
                        self.version = v;
                    }
                    self.epoch += 1;
                    KvEvent::AllCleared
                }
            };
            events.push(event);
        }
        self.changes = changes;
        if !events.is_empty() {
            out.extend(Some(self.batch(events)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> BlockHash {
        BlockHash([n; 32])
    }

    #[test]
    fn a_chain_is_one_event_and_a_wipe_opens_a_new_epoch_batch() {
        let mut log = KvEventLog::new(true, 2, "v0");
        log.stored(&h(1), None, &TokenId::list([1, 2]), None);
        log.stored(&h(2), Some(&h(1)), &TokenId::list([3, 4]), None);
        log.removed(&h(9), Medium::Primary);
        log.cleared();
        log.stored(&h(3), None, &TokenId::list([5, 6]), None);
        log.new_version(Arc::from("v1"));
        let mut out = Vec::new();
        log.drain(&mut out);
        let hx = |n| external_hash(&h(n));
        assert_eq!(out.len(), 3);
        assert_eq!((out[0].epoch, &*out[0].weight_version), (0, "v0"));
        assert_eq!(
            out[0].events,
            vec![
                KvEvent::Stored {
                    hashes: vec![hx(1), hx(2)],
                    parent: None,
                    tokens: TokenId::list([1, 2, 3, 4]),
                    medium: Medium::Primary,
                    lora: None,
                },
                KvEvent::Removed {
                    hashes: vec![hx(9)],
                    medium: Medium::Primary
                },
            ]
        );
        assert_eq!((out[1].epoch, &*out[1].weight_version), (1, "v0"));
        assert_eq!(out[1].events[0], KvEvent::AllCleared);
        assert_eq!(out[1].events.len(), 2);
        assert_eq!((out[2].epoch, &*out[2].weight_version), (2, "v1"));
        assert_eq!(out[2].events, vec![KvEvent::AllCleared]);
    }

    #[test]
    fn a_stored_block_names_its_adapter_and_adapters_never_share_an_event() {
        let a1 = LoraRef::new(crate::ids::LoraId(3), "a", 1);
        let mut log = KvEventLog::new(true, 2, "v0");
        log.stored(&h(1), None, &TokenId::list([1, 2]), Some(&a1));
        log.stored(&h(2), Some(&h(1)), &TokenId::list([3, 4]), Some(&a1));
        // The same parent under another adapter (or the base) starts an event of its own.
        log.stored(&h(3), Some(&h(2)), &TokenId::list([5, 6]), None);
        let mut out = Vec::new();
        log.drain(&mut out);
        let hx = |n| external_hash(&h(n));
        assert_eq!(
            out[0].events,
            vec![
                KvEvent::Stored {
                    hashes: vec![hx(1), hx(2)],
                    parent: None,
                    tokens: TokenId::list([1, 2, 3, 4]),
                    medium: Medium::Primary,
                    lora: Some(a1),
                },
                KvEvent::Stored {
                    hashes: vec![hx(3)],
                    parent: Some(hx(2)),
                    tokens: TokenId::list([5, 6]),
                    medium: Medium::Primary,
                    lora: None,
                },
            ]
        );
    }

    #[test]
    fn off_it_journals_nothing_but_follows_the_version() {
        let mut log = KvEventLog::new(false, 2, "v0");
        log.stored(&h(1), None, &TokenId::list([1, 2]), None);
        log.cleared();
        log.new_version(Arc::from("v1"));
        let mut out = Vec::new();
        log.drain(&mut out);
        assert!(out.is_empty());
        assert_eq!(&*log.version, "v1");
    }
}
