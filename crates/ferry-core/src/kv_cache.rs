//! The KV cache manager: turns "this request computes these tokens this step" into blocks.
//!
//! It looks up a new request's computed prefix in the prefix cache, allocates slots for the
//! tokens scheduled this step (plus room for KV a connector will load), registers newly full
//! blocks in the prefix cache, frees a request's blocks tail first, and evicts given blocks.
//! The scheduler decides *what* runs; this module only does the block arithmetic. Every
//! block it takes, references, caches or frees it does for the request as its owner
//! (`Owner::Request`), so the pool's checks name the request when one fails.

use crate::block_pool::BlockPool;
use crate::hash::{extend_block_hashes, lora_root, BlockHash};
use crate::ids::BlockId;
use crate::lora::LoraRef;
use crate::owner::Owner;
use crate::request::Request;

/// The result of a prefix lookup, to be passed to [`KvCacheManager::allocate_slots`]. The hit
/// blocks themselves wait in the manager's scratch list: they are not referenced until the
/// allocation succeeds, so a lookup that is not followed by an admission costs nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[must_use]
pub struct PrefixHit {
    n_blocks: usize,
}

impl PrefixHit {
    /// Cached blocks found, each worth `block_size` tokens.
    pub fn n_blocks(self) -> usize {
        self.n_blocks
    }
}

/// Block arithmetic for requests over a [`BlockPool`].
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    enable_prefix_caching: bool,
    /// Blocks found by the latest `find_computed_blocks`, reused to avoid an allocation.
    hit_blocks: Vec<BlockId>,
    /// The hash root of the weights now loaded, once the scheduler has set it: a request
    /// whose chain follows another root, or another version of its adapter (it was running
    /// across a weight update or an adapter reload, so its KV mixes both), caches no further
    /// blocks.
    current_root: Option<BlockHash>,
}

impl KvCacheManager {
    pub fn new(n_blocks: u32, block_size: usize, enable_prefix_caching: bool) -> Self {
        Self {
            pool: BlockPool::new(n_blocks),
            block_size,
            enable_prefix_caching,
            hit_blocks: Vec::new(),
            current_root: None,
        }
    }

    pub fn set_current_root(&mut self, root: BlockHash) {
        self.current_root = Some(root);
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Makes sure `req`'s block hashes cover all its full blocks and are chained from the root
    /// of the weights whose root is `root` and of the adapter version it is computed with
    /// (recomputing them if either changed since they were computed). Only for a request
    /// holding no KV, whose hashes can still change.
    pub fn rehash_if_stale(&self, req: &mut Request, root: &BlockHash) {
        if !req.chain_is_current(root) {
            assert!(
                req.blocks.is_empty(),
                "kv cache: rehash of request #{} ({:?}), which holds {} blocks: its hashes \
                 would no longer describe its KV",
                req.idx.0,
                req.id,
                req.blocks.len()
            );
            req.block_hashes.clear();
            req.weight_root = *root;
            req.chain_lora_version = req.lora.as_ref().map(|l| l.version);
            req.hash_root = match &req.lora {
                None => *root,
                Some(l) => lora_root(root, &l.name, l.version),
            };
        }
        self.extend_hashes(req);
    }

    /// Hashes any block of `req` that became full since the last call.
    pub fn extend_hashes(&self, req: &mut Request) {
        if self.enable_prefix_caching {
            let salt = req.params.cache_salt.as_deref();
            let root = req.hash_root;
            extend_block_hashes(
                &mut req.block_hashes,
                &root,
                &req.tokens,
                self.block_size,
                salt,
            );
        }
    }

    /// Finds the longest cached prefix of a request holding no blocks. A hit always leaves at
    /// least one token to compute: the model needs that token's logits to sample.
    pub fn find_computed_blocks(&mut self, req: &Request) -> PrefixHit {
        self.hit_blocks.clear();
        if !self.enable_prefix_caching || !req.blocks.is_empty() || req.tokens.is_empty() {
            return PrefixHit::default();
        }
        let max_blocks = ((req.tokens.len() - 1) / self.block_size).min(req.block_hashes.len());
        for hash in &req.block_hashes[..max_blocks] {
            match self.pool.lookup(hash) {
                Some(block) => self.hit_blocks.push(block),
                None => break,
            }
        }
        PrefixHit {
            n_blocks: self.hit_blocks.len(),
        }
    }

    /// Gives `req` blocks for `hit` (from the preceding `find_computed_blocks`), then for
    /// `n_external` tokens a connector will load and `n_new` tokens computed this step, all
    /// after its current `n_computed`; registers the blocks that will be full in the prefix
    /// cache, except those a connector will load (and every block after them, since cache
    /// entries are a chain): until the load has landed their KV is not there, so no other
    /// request may hit them. They are registered by the request's first allocation after the
    /// load, when its `n_computed` counts the loaded tokens. All or nothing: returns false,
    /// changing nothing, if the pool is short.
    pub fn allocate_slots(
        &mut self,
        req: &mut Request,
        hit: PrefixHit,
        n_new: usize,
        n_external: usize,
    ) -> bool {
        // A stale `PrefixHit` (another lookup ran since) can claim at most what is listed.
        let hits = &self.hit_blocks[..hit.n_blocks.min(self.hit_blocks.len())];
        let n_hit_tokens = hits.len() * self.block_size;
        let n_tokens = req.n_computed + n_hit_tokens + n_external + n_new;
        let n_required = n_tokens.div_ceil(self.block_size);
        let n_take = n_required.saturating_sub(req.blocks.len() + hits.len());
        // Hit blocks nobody holds sit in the free queue: touching them uses up free blocks too.
        let n_free_hits = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if n_take + n_free_hits > self.pool.n_free() {
            return false;
        }
        let owner = Owner::Request(req.idx);
        for &b in hits {
            self.pool.touch(b, owner);
        }
        req.blocks.extend_from_slice(hits);
        req.n_cached_blocks = req.n_cached_blocks.max(hits.len());
        let taken = self.pool.take(n_take, &mut req.blocks, owner);
        assert!(
            taken,
            "kv cache: take for request #{} ({:?}) of {n_take} blocks, counted free, failed: \
             the pool's free count is wrong",
            req.idx.0, req.id
        );
        self.hit_blocks.clear();
        let n_cacheable = if n_external == 0 {
            n_tokens
        } else {
            req.n_computed + n_hit_tokens
        };
        self.cache_full_blocks(req, n_cacheable);
        true
    }

    /// Registers `req`'s blocks that are full within its first `n_tokens` tokens. They are
    /// registered when scheduled, before their KV is written: a request admitted later in the
    /// same step comes later in the plan, so the executor writes the KV before reading it.
    fn cache_full_blocks(&mut self, req: &mut Request, n_tokens: usize) {
        if !self.enable_prefix_caching
            || self.current_root.is_some_and(|r| !req.chain_is_current(&r))
        {
            return;
        }
        let n_full = (n_tokens.min(req.tokens.len()) / self.block_size)
            .min(req.block_hashes.len())
            .min(req.blocks.len());
        let owner = Owner::Request(req.idx);
        let tag = req.lora.as_ref().map(LoraRef::tag);
        for i in req.n_cached_blocks..n_full {
            if self
                .pool
                .cache(req.blocks[i], req.block_hashes[i], owner, tag)
                && self.pool.log_mut().is_on()
            {
                let parent = i.checked_sub(1).map(|p| &req.block_hashes[p]);
                let tokens = &req.tokens[i * self.block_size..(i + 1) * self.block_size];
                self.pool
                    .log_mut()
                    .stored(&req.block_hashes[i], parent, tokens, req.lora.as_ref());
            }
        }
        req.n_cached_blocks = req.n_cached_blocks.max(n_full);
    }

    /// Frees all of `req`'s blocks, tail first, so the chain's tail is evicted before its head.
    pub fn free(&mut self, req: &mut Request) {
        let owner = Owner::Request(req.idx);
        for &b in req.blocks.iter().rev() {
            self.pool.release(b, owner);
        }
        req.blocks.clear();
        req.n_cached_blocks = 0;
    }

    /// Drops the given blocks from the prefix cache (e.g. their KV failed to load), so no later
    /// request can hit them. Holders keep the blocks themselves.
    pub fn evict_blocks(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.pool.evict(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::chain_root;
    use crate::ids::{ReqIdx, TokenId};
    use crate::request::RequestState;
    use crate::sampling::SamplingParams;

    fn req(tokens: Vec<TokenId>) -> Request {
        Request {
            id: "r".into(),
            idx: ReqIdx(0),
            params: SamplingParams::greedy(4),
            state: RequestState::Waiting,
            prompt_len: tokens.len(),
            tokens,
            n_computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            hash_root: chain_root("w"),
            weight_root: chain_root("w"),
            chain_lora_version: None,
            lora: None,
            n_cached_blocks: 0,
            n_cached_tokens: 0,
            admitted: false,
            pause_mark: 0,
            n_preemptions: 0,
            export_on_finish: false,
            routing: Vec::new(),
        }
    }

    fn admit(kv: &mut KvCacheManager, r: &mut Request, budget: usize) -> usize {
        kv.rehash_if_stale(r, &chain_root("w"));
        let hit = kv.find_computed_blocks(r);
        let n_hit = hit.n_blocks() * kv.block_size();
        let n_new = (r.tokens.len() - n_hit).min(budget);
        assert!(kv.allocate_slots(r, hit, n_new, 0));
        r.n_computed = n_hit + n_new;
        n_hit
    }

    #[test]
    fn second_request_hits_full_shared_blocks_only() {
        let mut kv = KvCacheManager::new(16, 4, true);
        let mut a = req((0..10).map(TokenId).collect());
        assert_eq!(admit(&mut kv, &mut a, 100), 0);
        assert_eq!(a.blocks, BlockId::list([1, 2, 3]));
        let mut b = req((0..9).chain([50, 51]).map(TokenId).collect());
        assert_eq!(admit(&mut kv, &mut b, 100), 8);
        assert_eq!(b.blocks, BlockId::list([1, 2, 4]));
        assert_eq!(
            (kv.pool().ref_cnt(BlockId(1)), kv.pool().ref_cnt(BlockId(3))),
            (2, 1)
        );
    }

    #[test]
    fn hit_leaves_one_token_to_compute() {
        let mut kv = KvCacheManager::new(16, 4, true);
        let mut a = req((0..8).map(TokenId).collect());
        admit(&mut kv, &mut a, 100);
        let mut b = req((0..8).map(TokenId).collect());
        assert_eq!(admit(&mut kv, &mut b, 100), 4);
        // Only the first block may hit; the second is recomputed into a fresh block.
        assert_eq!(b.blocks, BlockId::list([1, 3]));
    }

    #[test]
    fn allocation_is_all_or_nothing_and_counts_free_hits() {
        let mut kv = KvCacheManager::new(4, 4, true); // 3 usable
        let mut a = req((0..9).map(TokenId).collect());
        admit(&mut kv, &mut a, 100);
        kv.free(&mut a); // blocks 3,2,1 free (cached 1,2)
        let mut b = req((0..8).chain([70; 9]).map(TokenId).collect()); // 17 tokens: 5 blocks
        kv.rehash_if_stale(&mut b, &chain_root("w"));
        let hit = kv.find_computed_blocks(&b);
        assert_eq!(hit.n_blocks(), 2);
        assert!(!kv.allocate_slots(&mut b, hit, 9, 0));
        assert!(b.blocks.is_empty());
        assert_eq!(kv.pool().n_free(), 3);
    }

    #[test]
    fn external_tokens_get_room() {
        let mut kv = KvCacheManager::new(8, 4, false);
        let mut a = req((0..3).map(TokenId).collect());
        assert!(kv.allocate_slots(&mut a, PrefixHit::default(), 3, 8));
        assert_eq!(a.blocks.len(), 3);
    }

    #[test]
    fn blocks_a_connector_will_load_are_hit_only_once_the_load_landed() {
        let mut kv = KvCacheManager::new(16, 4, true);
        let mut a = req((0..10).map(TokenId).collect());
        kv.rehash_if_stale(&mut a, &chain_root("w"));
        // 8 tokens (two full blocks) come from a connector; 1 is computed after them.
        assert!(kv.allocate_slots(&mut a, PrefixHit::default(), 1, 8));
        let mut b = req((0..10).map(TokenId).collect());
        kv.rehash_if_stale(&mut b, &chain_root("w"));
        assert_eq!(
            kv.find_computed_blocks(&b).n_blocks(),
            0,
            "blocks still being loaded must not be prefix hits"
        );
        // The load landed: the tokens are computed, and the next allocation registers them.
        a.n_computed = 9;
        assert!(kv.allocate_slots(&mut a, PrefixHit::default(), 1, 0));
        assert_eq!(kv.find_computed_blocks(&b).n_blocks(), 2);
    }

    #[test]
    fn only_the_same_adapter_at_the_same_version_hits() {
        use crate::ids::LoraId;
        let with = |lora: Option<(&str, u64)>| {
            let mut r = req((0..9).map(TokenId).collect());
            r.lora = lora.map(|(name, v)| LoraRef::new(LoraId(name.len() as u32), name, v));
            r
        };
        let mut kv = KvCacheManager::new(32, 4, true);
        let mut a = with(Some(("a", 1)));
        assert_eq!(admit(&mut kv, &mut a, 100), 0);
        // Cached under the adapter that computed them.
        let tag = kv.pool().cached_lora(a.blocks[0]);
        assert_eq!(tag.map(|t| (t.id, t.version)), Some((LoraId(1), 1)));
        for other in [None, Some(("a", 2)), Some(("bb", 1))] {
            let mut b = with(other);
            assert_eq!(admit(&mut kv, &mut b, 100), 0, "{other:?} hit a's blocks");
            assert!(b.block_hashes.iter().all(|h| !a.block_hashes.contains(h)));
        }
        let mut same = with(Some(("a", 1)));
        assert_eq!(admit(&mut kv, &mut same, 100), 8);
        assert_eq!(same.block_hashes, a.block_hashes);
    }

    #[test]
    fn evicted_blocks_are_no_longer_hit() {
        let mut kv = KvCacheManager::new(8, 4, true);
        let mut a = req((0..9).map(TokenId).collect());
        admit(&mut kv, &mut a, 100);
        kv.evict_blocks(&a.blocks[..1]);
        let mut b = req((0..9).map(TokenId).collect());
        assert_eq!(admit(&mut kv, &mut b, 100), 0);
    }

    #[test]
    fn caching_disabled_never_hits() {
        let mut kv = KvCacheManager::new(16, 4, false);
        let mut a = req((0..9).map(TokenId).collect());
        admit(&mut kv, &mut a, 100);
        let mut b = req((0..9).map(TokenId).collect());
        assert_eq!(admit(&mut kv, &mut b, 100), 0);
        assert_eq!(kv.pool().n_cached(), 0);
    }
}
