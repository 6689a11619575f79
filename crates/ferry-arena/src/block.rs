//! What the arena and the grants over its memory both say about a block: the shape of the KV
//! in it ([`KvLayout`], [`KvPlane`]), what a grant may do with it ([`Access`]) and why an
//! access to it failed ([`KvError`]).
//!
//! They are here, in a module that imports nothing of this crate, so that the arena
//! (`arena.rs`) and the cross-thread access to its memory (`access.rs`, below the arena) can
//! both name them.

use ferry_core::BlockId;

/// What a [`BlockGrant`](crate::BlockGrant) may do with its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Read the blocks (an export sending them, an offload store copying them out).
    Read,
    /// Overwrite the blocks (an import landing, an offload load copying them in).
    Write,
}

/// Shape of the KV a model needs per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// 32-bit words per token kept after the K/V planes of a block, for data that lives and
    /// moves with the token's KV (an MoE model's expert routing, two u16 ids a word); 0 for
    /// none. Part of the block's bytes, so transfers, the offload tier and layout checks
    /// carry and compare it with the KV.
    pub aux_floats: usize,
}

/// Which half of a layer's KV: keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvPlane {
    K,
    V,
}

impl KvLayout {
    /// Floats of one token's K (or V) in one layer.
    pub fn token_floats(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Floats of K (or V) of one layer in one block.
    pub fn plane_floats(&self) -> usize {
        self.block_size * self.token_floats()
    }

    /// Floats of one whole block (every layer, K and V, then the tokens' aux words).
    pub fn block_floats(&self) -> usize {
        self.aux_offset() + self.block_size * self.aux_floats
    }

    /// Offset (in floats, inside a block) of the aux words of its first slot; slot `s`'s are
    /// `aux_floats` further per slot.
    pub fn aux_offset(&self) -> usize {
        self.n_layers * 2 * self.plane_floats()
    }

    pub fn block_bytes(&self) -> usize {
        self.block_floats() * std::mem::size_of::<f32>()
    }

    /// Offset (in floats, inside a block) of layer `layer`'s K plane (`v = false`) or V plane.
    pub fn plane_offset(&self, layer: usize, v: bool) -> usize {
        (layer * 2 + usize::from(v)) * self.plane_floats()
    }

    /// Offset (in floats, inside a block) of the K or V vector (all heads) of the token in
    /// slot `slot` (`0..block_size`) of layer `layer`.
    pub fn token_offset(&self, layer: usize, plane: KvPlane, slot: usize) -> usize {
        self.plane_offset(layer, plane == KvPlane::V) + slot * self.token_floats()
    }

    /// Offset (in floats, inside a block) of one head's vector of the token in slot `slot`.
    pub fn head_offset(&self, layer: usize, plane: KvPlane, slot: usize, head: usize) -> usize {
        self.token_offset(layer, plane, slot) + head * self.head_dim
    }
}

/// Why a byte-level block access failed. Every variant names the block it was about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV block {block} is out of range: the arena has {n_blocks} blocks")]
    BlockOutOfRange { block: BlockId, n_blocks: usize },
    #[error("KV block {block}: got {actual} bytes, a block holds {expected}")]
    WrongLength {
        block: BlockId,
        expected: usize,
        actual: usize,
    },
    #[error("KV block {block}: the arena is released (sleeping or KV memory released)")]
    Released { block: BlockId },
    #[error("KV block {block}: source layout {src:?} differs from destination layout {dst:?}")]
    LayoutMismatch {
        block: BlockId,
        src: KvLayout,
        dst: KvLayout,
    },
    #[error("KV block {block} appears more than once in one write grant")]
    DuplicateBlock { block: BlockId },
    #[error("KV block {block} is already granted to another worker ({held:?})")]
    BlockBusy { block: BlockId, held: Access },
    #[error("KV block {block}: the grant is read-only")]
    ReadOnlyGrant { block: BlockId },
}
