//! The block pool: a fixed set of KV blocks with reference counts, an LRU free queue and the
//! prefix-cache index (block hash → block).
//!
//! The free queue is an intrusive doubly linked list threaded through the block metadata, so
//! taking from the head, putting back at the tail and removing a block from the middle (a
//! prefix hit on a free but still cached block) are all O(1) with no allocation. Cached blocks
//! stay in the free queue: they are evicted lazily, when the queue hands them out again.
//! Block 0 is the null block: never in the queue, never handed out.
//!
//! Every change of a block's state states its precondition with an `assert!`, kept in release
//! builds: a block taken from the free queue is held by no one, a reference is given back
//! only by someone holding one (no double free, no count below zero), a count never wraps,
//! the null block is never referenced, a block is cached only while held. Each operation is
//! told who it acts for ([`Owner`]), so a broken precondition panics naming the block, that
//! owner and the operation; the engine reports the panic as its own failure. The checks are
//! a compare each on data the operation touches anyway; the message is built out of line.

use crate::hash::{BlockHash, BlockHashMap};
use crate::ids::BlockId;
use crate::kv_events::{KvEventLog, Medium};
use crate::lora::LoraTag;
use crate::owner::Owner;

/// The null block: padding in block tables, never owned.
pub const NULL_BLOCK: BlockId = BlockId::NULL;

/// End-of-list marker for the intrusive free queue.
const NIL: BlockId = BlockId(u32::MAX);

#[derive(Debug, Clone)]
struct BlockMeta {
    ref_cnt: u32,
    prev: BlockId,
    next: BlockId,
    in_free_queue: bool,
    /// Set while the block's contents are registered in the prefix cache under this hash.
    hash: Option<BlockHash>,
    /// The LoRA adapter (and its version) that computed it, while it is cached; `None` for
    /// the base model's blocks.
    lora: Option<LoraTag>,
}

/// Fixed-size pool of KV blocks. Owners are accounted for by the caller (requests,
/// transfers); the pool only counts references.
#[derive(Debug)]
pub struct BlockPool {
    meta: Vec<BlockMeta>,
    head: BlockId,
    tail: BlockId,
    n_free: usize,
    cached: BlockHashMap<BlockId>,
    /// The journal of cache changes for KV events (off unless the engine publishes them).
    log: KvEventLog,
}

impl BlockPool {
    /// A pool of `n_blocks` blocks, block 0 being the null block. All others start free, in
    /// id order, so the first blocks handed out are 1, 2, 3, ...
    pub fn new(n_blocks: u32) -> Self {
        let mut pool = Self {
            meta: vec![
                BlockMeta {
                    ref_cnt: 0,
                    prev: NIL,
                    next: NIL,
                    in_free_queue: false,
                    hash: None,
                    lora: None,
                };
                n_blocks.max(1) as usize
            ],
            head: NIL,
            tail: NIL,
            n_free: 0,
            // At most one entry per block: sized once, so it never rehashes mid-step.
            cached: BlockHashMap::with_capacity_and_hasher(n_blocks as usize, Default::default()),
            log: KvEventLog::new(false, 0, ""),
        };
        for b in 1..pool.meta.len() as u32 {
            pool.push_back(BlockId(b));
        }
        pool
    }

    /// Total blocks, the null block included.
    pub fn n_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks that can ever be handed out (all but the null block).
    pub fn n_usable(&self) -> usize {
        self.meta.len() - 1
    }

    /// Blocks in the free queue (cached or not).
    pub fn n_free(&self) -> usize {
        self.n_free
    }

    /// Blocks held by at least one owner.
    pub fn n_used(&self) -> usize {
        self.n_usable() - self.n_free
    }

    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.meta.get(block.index()).map_or(0, |m| m.ref_cnt)
    }

    pub fn is_in_free_queue(&self, block: BlockId) -> bool {
        self.meta
            .get(block.index())
            .is_some_and(|m| m.in_free_queue)
    }

    /// The hash a block is cached under, if any.
    pub fn cached_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.meta.get(block.index()).and_then(|m| m.hash)
    }

    /// The adapter that computed a cached block (`None`: the base model's, or not cached).
    pub fn cached_lora(&self, block: BlockId) -> Option<LoraTag> {
        self.meta.get(block.index()).and_then(|m| m.lora)
    }

    /// Number of distinct hashes in the prefix cache.
    pub fn n_cached(&self) -> usize {
        self.cached.len()
    }

    /// The block cached under `hash`, if any (held or free).
    pub fn lookup(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached.get(hash).copied()
    }

    /// Takes `n` blocks from the head of the free queue (least recently used first) into
    /// `out` for `owner`, evicting their cached hashes. Takes nothing and returns false if fewer
    /// than `n` are free. Panics if a block in the free queue is still held.
    pub fn take(&mut self, n: usize, out: &mut Vec<BlockId>, owner: Owner) -> bool {
        if n > self.n_free {
            return false;
        }
        for _ in 0..n {
            let b = self.head;
            let ref_cnt = self.meta[b.index()].ref_cnt;
            if ref_cnt != 0 {
                broken(BlockOp::Take, b, owner, Broken::StillHeld(ref_cnt));
            }
            self.unlink(b);
            self.evict(b);
            self.meta[b.index()].ref_cnt = 1;
            out.push(b);
        }
        true
    }

    /// Adds a reference to a block for `owner` (a prefix hit or a second owner), pulling it
    /// out of the free queue if it was there. Panics on the null block or a count at its
    /// maximum.
    pub fn touch(&mut self, block: BlockId, owner: Owner) {
        if block == NULL_BLOCK {
            broken(BlockOp::Touch, block, owner, Broken::Null);
        }
        let m = &self.meta[block.index()];
        if m.ref_cnt == u32::MAX {
            broken(BlockOp::Touch, block, owner, Broken::Overflow);
        }
        if m.in_free_queue {
            self.unlink(block);
        }
        self.meta[block.index()].ref_cnt += 1;
    }

    /// Gives back `owner`'s reference to a block; a block nobody holds goes to the tail of the
    /// free queue (keeping its hash, so it can still be hit until it is reused). Callers release
    /// a request's blocks tail first, so a chain's tail is evicted before its head. Panics if
    /// no one holds the block (a double free: the count would go below zero).
    pub fn release(&mut self, block: BlockId, owner: Owner) {
        let m = &mut self.meta[block.index()];
        if m.ref_cnt == 0 || block == NULL_BLOCK {
            let why = if block == NULL_BLOCK {
                Broken::Null
            } else {
                Broken::NotHeld
            };
            broken(BlockOp::Release, block, owner, why);
        }
        m.ref_cnt -= 1;
        if m.ref_cnt == 0 && !m.in_free_queue {
            self.push_back(block);
        }
    }

    /// Registers a full block's contents, computed for `owner` (with the adapter `lora`, if
    /// any), under `hash`; returns whether it was newly cached. If another block is already cached under the same hash (two
    /// requests computed the same prefix at once), this one stays uncached and is simply freed
    /// later. Panics if no one holds the block: a free block's contents may be reused at any
    /// time, so they cannot be what the hash promises.
    pub fn cache(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        owner: Owner,
        lora: Option<LoraTag>,
    ) -> bool {
        let m = &self.meta[block.index()];
        if m.ref_cnt == 0 {
            broken(BlockOp::Cache, block, owner, Broken::NotHeld);
        }
        if m.hash.is_some() {
            return false;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            let m = &mut self.meta[block.index()];
            m.hash = Some(hash);
            m.lora = lora;
            return true;
        }
        false
    }

    /// The journal of cache changes (KV events).
    pub fn log_mut(&mut self) -> &mut KvEventLog {
        &mut self.log
    }

    /// Journals the pool's changes into `log` from now on.
    pub fn set_log(&mut self, log: KvEventLog) {
        self.log = log;
    }

    /// Drops a block's hash from the prefix cache (its contents can no longer be hit).
    /// Returns whether it was cached.
    pub fn evict(&mut self, block: BlockId) -> bool {
        let Some(m) = self.meta.get_mut(block.index()) else {
            return false;
        };
        m.lora = None;
        let Some(hash) = m.hash.take() else {
            return false;
        };
        if self.cached.get(&hash) == Some(&block) {
            self.cached.remove(&hash);
            self.log.removed(&hash, Medium::Primary);
        }
        true
    }

    /// Drops every cached hash, if no block is held; returns false (changing nothing) while
    /// any block is still held by some owner. Journaled as a whole-cache clear: call it when
    /// every tier is cleared with it (see [`Self::reset_device_cache`]).
    pub fn reset_cache(&mut self) -> bool {
        self.reset(true)
    }

    /// [`Self::reset_cache`], journaled as the removal of each block from this tier alone
    /// (`BlockRemoved` with the device's medium): a cache below it (the offload tier) keeps
    /// its blocks, and a subscriber must not forget them.
    pub fn reset_device_cache(&mut self) -> bool {
        self.reset(false)
    }

    fn reset(&mut self, whole: bool) -> bool {
        if self.n_free != self.n_usable() {
            return false;
        }
        // A block has a hash exactly when the index maps that hash to it (`cache`, `evict`), so
        // clearing the indexed blocks clears them all, in time proportional to the cache, not
        // to the pool (a pool has hundreds of thousands of blocks for a small model).
        for (hash, &b) in &self.cached {
            self.meta[b.index()].hash = None;
            self.meta[b.index()].lora = None;
            if !whole {
                self.log.removed(hash, Medium::Primary);
            }
        }
        self.cached.clear();
        if whole {
            self.log.cleared();
        }
        true
    }

    /// Drops from the prefix cache every block computed with an adapter `pick` chooses,
    /// held or not, journaling each removal; returns how many. A held block stays with its
    /// holders, uncached: when they release it, it is free like any other, and it is never a
    /// hit again. In block order, so the events do not follow the index's order. Costs a pass
    /// over the cached blocks.
    pub fn evict_lora(&mut self, pick: impl Fn(LoraTag) -> bool) -> usize {
        let mut blocks: Vec<BlockId> = self
            .cached
            .values()
            .copied()
            .filter(|b| self.meta[b.index()].lora.is_some_and(&pick))
            .collect();
        blocks.sort_unstable();
        for &b in &blocks {
            self.evict(b);
        }
        blocks.len()
    }

    /// The free queue from head (next to be evicted) to tail.
    pub fn free_queue(&self) -> FreeQueueIter<'_> {
        FreeQueueIter {
            pool: self,
            cur: self.head,
            remaining: self.n_free,
        }
    }

    /// Every (hash, block) entry of the prefix-cache index, in no particular order.
    pub fn cached_entries(&self) -> impl Iterator<Item = (&BlockHash, &BlockId)> {
        self.cached.iter()
    }

    fn push_back(&mut self, b: BlockId) {
        let m = &mut self.meta[b.index()];
        m.prev = self.tail;
        m.next = NIL;
        m.in_free_queue = true;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.meta[self.tail.index()].next = b;
        }
        self.tail = b;
        self.n_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let (prev, next) = {
            let m = &mut self.meta[b.index()];
            m.in_free_queue = false;
            (
                std::mem::replace(&mut m.prev, NIL),
                std::mem::replace(&mut m.next, NIL),
            )
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev.index()].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next.index()].prev = prev;
        }
        self.n_free -= 1;
    }
}

/// A block-state change of the pool, named in the panic of a broken precondition.
#[derive(Debug, Clone, Copy)]
enum BlockOp {
    Take,
    Touch,
    Release,
    Cache,
}

/// Which precondition a block-state change broke.
#[derive(Debug, Clone, Copy)]
enum Broken {
    /// Taken from the free queue with this many references still held.
    StillHeld(u32),
    /// No one holds it: a release would be a double free, a cache would name reusable memory.
    NotHeld,
    /// One more reference would wrap the count.
    Overflow,
    /// The null block is padding, never owned.
    Null,
}

/// Panics naming the block, the owner and the operation. Out of line and cold, so the
/// operations' common path is the compare that guards the call.
#[cold]
#[inline(never)]
fn broken(op: BlockOp, block: BlockId, owner: Owner, why: Broken) -> ! {
    let what = match op {
        BlockOp::Take => "take for",
        BlockOp::Touch => "reference by",
        BlockOp::Release => "release by",
        BlockOp::Cache => "cache by",
    };
    let why = match (op, why) {
        (_, Broken::StillHeld(n)) => {
            format!("which is still held ({n} references): a block reused while held")
        }
        (BlockOp::Release, Broken::NotHeld) => {
            "which no one holds: a double free (its reference count would go below zero)".into()
        }
        (_, Broken::NotHeld) => "which no one holds: its contents may be reused at any time".into(),
        (_, Broken::Overflow) => {
            format!("whose reference count is at its maximum ({})", u32::MAX)
        }
        (_, Broken::Null) => "the null block, which is never owned".into(),
    };
    panic!("block pool: {what} {owner} of block {block}, {why}")
}

/// Walks the free queue; bounded by the free count so a corrupted list cannot loop forever.
#[derive(Debug)]
pub struct FreeQueueIter<'a> {
    pool: &'a BlockPool,
    cur: BlockId,
    remaining: usize,
}

impl Iterator for FreeQueueIter<'_> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        if self.cur == NIL || self.remaining == 0 {
            return None;
        }
        let b = self.cur;
        self.cur = self.pool.meta[b.index()].next;
        self.remaining -= 1;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ReqIdx, TransferId};
    use crate::owner::{HoldKind, Holder};

    const R: Owner = Owner::Request(ReqIdx(0));
    const T: Owner = Owner::Transfer {
        hold: TransferId(3),
        holder: Holder::Caller,
        kind: HoldKind::Caller,
    };

    fn h(n: u8) -> BlockHash {
        BlockHash([n; 32])
    }

    fn queue(p: &BlockPool) -> Vec<BlockId> {
        p.free_queue().collect()
    }

    #[test]
    fn starts_with_all_but_null_free_in_order() {
        let p = BlockPool::new(5);
        assert_eq!(queue(&p), BlockId::list([1, 2, 3, 4]));
        assert_eq!((p.n_usable(), p.n_free(), p.n_used()), (4, 4, 0));
    }

    #[test]
    fn take_is_all_or_nothing() {
        let mut p = BlockPool::new(3);
        let mut out = Vec::new();
        assert!(!p.take(3, &mut out, R));
        assert!(out.is_empty());
        assert!(p.take(2, &mut out, R));
        assert_eq!(out, BlockId::list([1, 2]));
        assert_eq!(p.n_free(), 0);
    }

    #[test]
    fn released_tail_first_evicts_tail_first() {
        let mut p = BlockPool::new(6);
        let mut a = Vec::new();
        p.take(3, &mut a, R); // 1,2,3
        for &b in a.iter().rev() {
            p.release(b, R);
        }
        assert_eq!(queue(&p), BlockId::list([4, 5, 3, 2, 1]));
    }

    #[test]
    fn touch_removes_from_middle_and_release_appends() {
        let mut p = BlockPool::new(5);
        p.touch(BlockId(2), R);
        assert_eq!(queue(&p), BlockId::list([1, 3, 4]));
        p.touch(BlockId(2), R);
        assert_eq!(p.ref_cnt(BlockId(2)), 2);
        p.release(BlockId(2), R);
        assert_eq!(queue(&p), BlockId::list([1, 3, 4]));
        p.release(BlockId(2), R);
        assert_eq!(queue(&p), BlockId::list([1, 3, 4, 2]));
        p.touch(BlockId(4), R);
        p.touch(BlockId(1), R);
        assert_eq!(queue(&p), BlockId::list([3, 2]));
    }

    #[test]
    fn cached_free_block_is_hit_until_reused() {
        let mut p = BlockPool::new(3);
        let mut out = Vec::new();
        p.take(1, &mut out, R);
        p.cache(BlockId(1), h(9), R, None);
        p.release(BlockId(1), R);
        assert_eq!(p.lookup(&h(9)), Some(BlockId(1)));
        out.clear();
        p.take(2, &mut out, R); // 2 first, then 1 (evicted lazily now)
        assert_eq!(out, BlockId::list([2, 1]));
        assert_eq!(p.lookup(&h(9)), None);
        assert_eq!(p.cached_hash(BlockId(1)), None);
    }

    #[test]
    fn duplicate_hash_keeps_first_block() {
        let mut p = BlockPool::new(3);
        let mut out = Vec::new();
        p.take(2, &mut out, R);
        p.cache(BlockId(1), h(1), R, None);
        p.cache(BlockId(2), h(1), R, None);
        assert_eq!(p.lookup(&h(1)), Some(BlockId(1)));
        assert_eq!(p.cached_hash(BlockId(2)), None);
        assert!(!p.evict(BlockId(2)));
        assert!(p.evict(BlockId(1)));
        assert_eq!(p.lookup(&h(1)), None);
    }

    #[test]
    fn reset_fails_while_held_and_clears_when_free() {
        let mut p = BlockPool::new(3);
        let mut out = Vec::new();
        p.take(1, &mut out, R);
        p.cache(BlockId(1), h(3), R, None);
        assert!(!p.reset_cache());
        assert_eq!(p.lookup(&h(3)), Some(BlockId(1)));
        p.release(BlockId(1), R);
        assert!(p.reset_cache());
        assert_eq!((p.lookup(&h(3)), p.n_cached()), (None, 0));
    }

    #[test]
    fn evicting_an_adapter_drops_its_blocks_held_or_not_and_nothing_else() {
        use crate::ids::LoraId;
        let tag = |id, version| {
            Some(LoraTag {
                id: LoraId(id),
                version,
            })
        };
        let mut p = BlockPool::new(6);
        p.set_log(KvEventLog::new(true, 1, "w"));
        let mut out = Vec::new();
        p.take(4, &mut out, R);
        p.cache(BlockId(1), h(1), R, tag(7, 1));
        p.cache(BlockId(2), h(2), R, tag(7, 2));
        p.cache(BlockId(3), h(3), R, tag(8, 1));
        p.cache(BlockId(4), h(4), R, None);
        p.release(BlockId(1), R);
        // Version 1 of adapter 7 only: block 1, free.
        assert_eq!(p.evict_lora(|t| t.id == LoraId(7) && t.version < 2), 1);
        assert_eq!(p.lookup(&h(1)), None);
        assert_eq!(p.cached_lora(BlockId(1)), None);
        // Every version of 7: block 2, still held; it stays held, uncached.
        assert_eq!(p.evict_lora(|t| t.id == LoraId(7)), 1);
        assert_eq!((p.lookup(&h(2)), p.ref_cnt(BlockId(2))), (None, 1));
        assert_eq!(p.lookup(&h(3)), Some(BlockId(3)));
        assert_eq!(p.lookup(&h(4)), Some(BlockId(4)));
        let mut batches = Vec::new();
        p.log_mut().drain(&mut batches);
        let ext = crate::kv_events::external_hash;
        assert_eq!(
            batches[0].events,
            vec![crate::kv_events::KvEvent::Removed {
                hashes: vec![ext(&h(1)), ext(&h(2))],
                medium: Medium::Primary
            }]
        );
    }

    // Each broken precondition panics, in release builds too, naming the block, the owner
    // and the operation (`cargo test --release -p ferry-core --lib block_pool` runs these
    // without debug assertions).

    #[test]
    #[should_panic(
        expected = "block pool: release by request #0 of block 1, which no one \
                               holds: a double free (its reference count would go below zero)"
    )]
    fn a_double_free_panics() {
        let mut p = BlockPool::new(3);
        let mut out = Vec::new();
        p.take(1, &mut out, R);
        p.release(BlockId(1), R);
        p.release(BlockId(1), R);
    }

    #[test]
    #[should_panic(
        expected = "block pool: release by caller's hold 3 (ended by the caller) of \
                               block 2, which no one holds: a double free"
    )]
    fn releasing_a_block_never_taken_panics_naming_the_hold() {
        let mut p = BlockPool::new(3);
        p.release(BlockId(2), T);
    }

    #[test]
    #[should_panic(
        expected = "block pool: take for request #0 of block 1, which is still held \
                               (2 references): a block reused while held"
    )]
    fn taking_a_held_block_from_the_free_queue_panics() {
        let mut p = BlockPool::new(3);
        // A free queue that lists a held block: what a bug in the pool's own bookkeeping
        // would leave behind.
        p.meta[1].ref_cnt = 2;
        p.take(1, &mut Vec::new(), R);
    }

    #[test]
    #[should_panic(
        expected = "block pool: reference by caller's hold 3 (ended by the caller) \
                               of block 1, whose reference count is at its maximum (4294967295)"
    )]
    fn a_reference_count_never_wraps() {
        let mut p = BlockPool::new(3);
        p.take(1, &mut Vec::new(), R);
        p.meta[1].ref_cnt = u32::MAX;
        p.touch(BlockId(1), T);
    }

    #[test]
    #[should_panic(
        expected = "block pool: reference by request #0 of block 0, the null block, \
                               which is never owned"
    )]
    fn the_null_block_is_never_referenced() {
        BlockPool::new(3).touch(NULL_BLOCK, R);
    }

    #[test]
    #[should_panic(expected = "block pool: release by request #0 of block 0, the null block")]
    fn the_null_block_is_never_released() {
        BlockPool::new(3).release(NULL_BLOCK, R);
    }

    #[test]
    #[should_panic(
        expected = "block pool: cache by request #0 of block 2, which no one holds: \
                               its contents may be reused at any time"
    )]
    fn caching_a_free_block_panics() {
        let mut p = BlockPool::new(3);
        p.cache(BlockId(2), h(1), R, None);
    }
}
