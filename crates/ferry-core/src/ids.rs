//! The basic ids every other module names: tokens, KV blocks, live requests, transfer holds
//! and connectors.
//!
//! They are here, in a module that imports nothing of the crate, so that any module can name
//! them without importing the module whose job they serve (and so without an import loop: the
//! plan, the ownership ledger, the connectors and requests all name blocks and holds).
//!
//! Each is a type of its own, not a `u32` alias: a block id passed where a token id belongs,
//! or an index into the wrong table, does not compile. The number underneath is `.0`; the
//! edges (the tokenizer, HTTP JSON, the wire codecs, the model's embedding lookup) convert,
//! the code between them passes ids. [`TokenId`] and [`BlockId`] are `#[repr(transparent)]`
//! over `u32` and derive bytemuck's `TransparentWrapper`, so a `&[u32]` from a tokenizer or a
//! wire buffer is viewed as a `&[TokenId]` (and back) without a copy and without unsafe code
//! here. On the JSON wire they are plain numbers (`#[serde(transparent)]`).

use std::fmt;

use bytemuck::{TransparentWrapper, TransparentWrapperAlloc};
use serde::{Deserialize, Serialize};

/// A token of the model's vocabulary.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Serialize,
    Deserialize,
    TransparentWrapper,
)]
#[repr(transparent)]
#[serde(transparent)]
pub struct TokenId(pub u32);

/// Index of a KV block in the arena. Block 0 is the null block ([`BlockId::NULL`]): never
/// allocated to a request, used as padding.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Serialize,
    Deserialize,
    TransparentWrapper,
)]
#[repr(transparent)]
#[serde(transparent)]
pub struct BlockId(pub u32);

impl TokenId {
    /// The token's row in the vocabulary (embedding table, logits).
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }

    /// Token ids from numbers (tests, traces, hand-made prompts).
    pub fn list(ids: impl IntoIterator<Item = u32>) -> Vec<TokenId> {
        ids.into_iter().map(TokenId).collect()
    }
}

impl BlockId {
    /// The null block: padding in block tables, never owned.
    pub const NULL: BlockId = BlockId(0);

    /// The block's index in the arena and in the pool's tables.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }

    /// Block ids from numbers (tests, hand-made block tables).
    pub fn list(ids: impl IntoIterator<Item = u32>) -> Vec<BlockId> {
        ids.into_iter().map(BlockId).collect()
    }
}

// Debug prints the bare number, as the `u32` did: plans, block tables and token lists are
// printed by the hundred in traces and test failures, where `[3, 4, 5]` reads better than
// `[BlockId(3), BlockId(4), BlockId(5)]` and the field's name already says what they are.
macro_rules! number_like {
    ($($id:ident),*) => {$(
        impl fmt::Debug for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl $id {
            /// Views numbers (a tokenizer's output, a wire buffer) as ids, without a copy.
            #[inline]
            pub fn from_raw_slice(raw: &[u32]) -> &[$id] {
                <$id as TransparentWrapper<u32>>::wrap_slice(raw)
            }

            /// Views ids as the numbers underneath (for a codec or a kernel), without a copy.
            #[inline]
            pub fn as_raw_slice(ids: &[$id]) -> &[u32] {
                <$id as TransparentWrapper<u32>>::peel_slice(ids)
            }

            /// Takes numbers as ids, reusing their allocation.
            #[inline]
            pub fn from_raw_vec(raw: Vec<u32>) -> Vec<$id> {
                <$id as TransparentWrapperAlloc<u32>>::wrap_vec(raw)
            }

            /// Gives ids back as numbers, reusing their allocation.
            #[inline]
            pub fn into_raw_vec(ids: Vec<$id>) -> Vec<u32> {
                <$id as TransparentWrapperAlloc<u32>>::peel_vec(ids)
            }
        }

        impl From<u32> for $id {
            #[inline]
            fn from(n: u32) -> Self {
                Self(n)
            }
        }

        impl From<$id> for u32 {
            #[inline]
            fn from(id: $id) -> u32 {
                id.0
            }
        }
    )*};
}

number_like!(TokenId, BlockId);

/// Handle of a live request inside the core (a slab index). Valid from `add_request` until the
/// request's finished output has been returned; then the slot may be reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReqIdx(pub u32);

/// Identifies a transfer hold (an export for a remote reader, or an import being written);
/// handed out by the holds table when it opens the hold (`holds.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferId(pub u64);

/// Names a registered connector: its index in registration order (`Scheduler::add_connector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnectorId(pub u32);

/// Names a LoRA adapter the executor holds: handed out by the engine when it loads an adapter
/// (each name keeps its id across in-place reloads; the adapter's version says which weights).
/// A request without one runs the base model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoraId(pub u32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_plain_numbers_on_the_json_wire_and_in_messages() {
        let tokens = TokenId::list([7, 0, 4_000_000_000]);
        assert_eq!(serde_json::to_string(&tokens).unwrap(), "[7,0,4000000000]");
        assert_eq!(
            serde_json::from_str::<Vec<TokenId>>("[7,0,4000000000]").unwrap(),
            tokens
        );
        assert_eq!(
            format!("{} {:?}", BlockId(12), BlockId::list([1, 2])),
            "12 [1, 2]"
        );
    }

    #[test]
    fn slices_of_ids_are_views_of_the_numbers() {
        let raw = [3u32, 1, 4];
        let ids: &[TokenId] = TokenId::from_raw_slice(&raw);
        assert_eq!(ids, TokenId::list([3, 1, 4]));
        assert_eq!(std::ptr::addr_of!(ids[0]).cast::<u32>(), raw.as_ptr());
        assert_eq!(BlockId::as_raw_slice(&BlockId::list([9, 8])), &[9, 8]);
        let v = vec![5u32, 6];
        let at = v.as_ptr();
        let ids = BlockId::from_raw_vec(v);
        assert_eq!(ids, BlockId::list([5, 6]));
        let back = BlockId::into_raw_vec(ids);
        assert_eq!(
            (back.as_ptr(), back),
            (at, vec![5, 6]),
            "the allocation is reused"
        );
    }
}
