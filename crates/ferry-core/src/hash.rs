//! Chained block hashes for the prefix cache.
//!
//! A full block's hash is `blake3(parent hash ‖ token bytes ‖ extra keys)`. The chain's root
//! (the "parent" of the first block) is derived from the weight version, so KV computed under
//! other weights can never be hit, even if a caller forgets to reset the cache. A request
//! with a LoRA adapter chains from a root that mixes that one with the adapter's name and
//! version ([`lora_root`]), so no adapter, version of one, or the base model hits another's
//! KV; a base request's root is the weight version's alone, as it always was. The cache salt
//! is an extra key of the first block only: since every later hash chains through the first,
//! the salt isolates the whole chain.
//!
//! blake3 is a cryptographic hash: two different prefixes colliding would silently hand a
//! request someone else's KV, so a fast non-cryptographic hash is not good enough here.

use std::hash::{BuildHasherDefault, Hash, Hasher};

use crate::ids::TokenId;

/// The hash of one full block and, through the chain, of every token before it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Eight hex digits are enough to tell hashes apart in test output.
        write!(
            f,
            "BlockHash({:02x}{:02x}{:02x}{:02x})",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

impl Hash for BlockHash {
    /// The key is already a cryptographic hash: its first 8 bytes are as well distributed as
    /// any hasher could make them, so the map hashes just those (see [`PrefixHasher`]).
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(first));
    }
}

/// A pass-through hasher for maps keyed by [`BlockHash`]: the key is already uniformly
/// distributed, so rehashing it (SipHash by default) would only cost time.
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefixHasher(u64);

impl Hasher for PrefixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached if a key other than `BlockHash` is used; fold bytes in so it still works.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Map from block hash to anything, hashing keys with [`PrefixHasher`].
pub type BlockHashMap<V> =
    std::collections::HashMap<BlockHash, V, BuildHasherDefault<PrefixHasher>>;

/// Domain separation, so a block hash can never equal some other blake3 use in the engine.
const ROOT_DOMAIN: &[u8] = b"ferry.prefix-cache.root.v1";

/// The root of every hash chain computed under one weight version.
pub fn chain_root(weight_version: &str) -> BlockHash {
    let mut h = blake3::Hasher::new();
    h.update(ROOT_DOMAIN);
    h.update(&(weight_version.len() as u64).to_le_bytes());
    h.update(weight_version.as_bytes());
    BlockHash(*h.finalize().as_bytes())
}

/// Domain separation of adapter roots from weight roots and block hashes.
const LORA_DOMAIN: &[u8] = b"ferry.prefix-cache.lora-root.v1";

/// The root of every hash chain computed with the adapter `name` at `version` over the
/// weights whose root is `weight_root` ([`chain_root`]).
pub fn lora_root(weight_root: &BlockHash, name: &str, version: u64) -> BlockHash {
    let mut h = blake3::Hasher::new();
    h.update(LORA_DOMAIN);
    h.update(&weight_root.0);
    h.update(&(name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update(&version.to_le_bytes());
    BlockHash(*h.finalize().as_bytes())
}

/// Hash of one full block given its parent's hash (or the chain root for the first block).
/// `salt` is only passed for the first block.
pub fn hash_block(parent: &BlockHash, tokens: &[TokenId], salt: Option<&str>) -> BlockHash {
    let mut h = blake3::Hasher::new();
    h.update(&parent.0);
    // One write instead of one per token: the token bytes in a fixed (little-endian) order.
    let mut buf = [0u8; 4 * 64];
    for chunk in tokens.chunks(64) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.0.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    // Extra keys: tagged and length-prefixed, so "no salt" and "empty salt" differ and token
    // bytes can never be confused with key bytes.
    match salt {
        None => {
            h.update(&[0]);
        }
        Some(s) => {
            h.update(&[1]);
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    }
    BlockHash(*h.finalize().as_bytes())
}

/// Extends `hashes` with the hashes of every full block of `tokens` not hashed yet.
pub fn extend_block_hashes(
    hashes: &mut Vec<BlockHash>,
    root: &BlockHash,
    tokens: &[TokenId],
    block_size: usize,
    salt: Option<&str>,
) {
    let n_full = tokens.len() / block_size;
    for block_idx in hashes.len()..n_full {
        let parent = if block_idx == 0 {
            *root
        } else {
            hashes[block_idx - 1]
        };
        let salt = if block_idx == 0 { salt } else { None };
        let span = block_idx * block_size..(block_idx + 1) * block_size;
        hashes.push(hash_block(&parent, &tokens[span], salt));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(version: &str, tokens: &[TokenId], salt: Option<&str>) -> Vec<BlockHash> {
        let mut v = Vec::new();
        extend_block_hashes(&mut v, &chain_root(version), tokens, 4, salt);
        v
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let toks: Vec<TokenId> = (0..11).map(TokenId).collect();
        assert_eq!(chain("w0", &toks, None).len(), 2);
    }

    #[test]
    fn shared_prefix_gives_shared_hashes_then_diverges() {
        let a: Vec<TokenId> = (0..12).map(TokenId).collect();
        let mut b = a.clone();
        b[9] = TokenId(99);
        let (ha, hb) = (chain("w0", &a, None), chain("w0", &b, None));
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
    }

    #[test]
    fn weight_version_and_salt_change_every_block() {
        let toks: Vec<TokenId> = (0..8).map(TokenId).collect();
        let base = chain("w0", &toks, None);
        for other in [
            chain("w1", &toks, None),
            chain("w0", &toks, Some("tenant")),
            chain("w0", &toks, Some("")),
        ] {
            assert_ne!(base[0], other[0]);
            assert_ne!(base[1], other[1]);
        }
    }

    #[test]
    fn an_adapter_its_version_and_the_base_share_no_block_hash() {
        let toks: Vec<TokenId> = (0..8).map(TokenId).collect();
        let w0 = chain_root("w0");
        let with = |root: BlockHash| {
            let mut v = Vec::new();
            extend_block_hashes(&mut v, &root, &toks, 4, None);
            v
        };
        let base = with(w0);
        let a1 = with(lora_root(&w0, "a", 1));
        // The base chain is the weight version's, unchanged by adapters existing.
        assert_eq!(base, chain("w0", &toks, None));
        for other in [
            with(lora_root(&w0, "a", 2)),
            with(lora_root(&w0, "b", 1)),
            with(lora_root(&chain_root("w1"), "a", 1)),
            base.clone(),
        ] {
            assert!(other.iter().all(|h| !a1.contains(h)), "{other:?} vs {a1:?}");
        }
        assert_eq!(a1, with(lora_root(&w0, "a", 1)));
        // The name's length is hashed: "a" at a version never reads as another name.
        assert_ne!(lora_root(&w0, "a1", 0), lora_root(&w0, "a", 1));
    }

    #[test]
    fn extending_incrementally_equals_hashing_at_once() {
        let toks: Vec<TokenId> = (0..16).map(TokenId).collect();
        let root = chain_root("w");
        let mut inc = Vec::new();
        for n in 0..=16 {
            extend_block_hashes(&mut inc, &root, &toks[..n], 4, Some("s"));
        }
        assert_eq!(inc, chain("w", &toks, Some("s")));
    }

    #[test]
    fn map_hasher_uses_the_first_eight_bytes() {
        let mut h = PrefixHasher::default();
        let mut key = [0u8; 32];
        key[0] = 7;
        key[20] = 1;
        BlockHash(key).hash(&mut h);
        assert_eq!(h.finish(), 7);
    }
}
