//! The KV arena: one allocation of `n_blocks` blocks.
//!
//! Layout of one block (all `f32`):
//! `[layer][k|v][slot in block][kv head][head_dim]`, so each token's head vector is contiguous,
//! and a block is `KvLayout::block_floats()` floats in one range.

/// Shape of the KV a model needs per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
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

    /// Floats of one whole block (every layer, K and V).
    pub fn block_floats(&self) -> usize {
        self.n_layers * 2 * self.plane_floats()
    }

    pub fn block_bytes(&self) -> usize {
        self.block_floats() * std::mem::size_of::<f32>()
    }

    /// Offset (in floats, inside a block) of layer `layer`'s K plane (`v = false`) or V plane.
    pub fn plane_offset(&self, layer: usize, v: bool) -> usize {
        (layer * 2 + usize::from(v)) * self.plane_floats()
    }
}

/// Block-major KV memory. Can be released (sleep, KV memory release) and reallocated.
#[derive(Debug)]
pub struct KvArena {
    layout: KvLayout,
    n_blocks: usize,
    /// Empty while released.
    data: Vec<f32>,
}

impl KvArena {
    /// Allocates and zeroes `n_blocks` blocks.
    pub fn new(layout: KvLayout, n_blocks: usize) -> Self {
        let mut arena = Self {
            layout,
            n_blocks,
            data: Vec::new(),
        };
        arena.reallocate();
        arena
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn is_allocated(&self) -> bool {
        !self.data.is_empty() || self.n_blocks == 0
    }

    /// Bytes held right now (0 while released).
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    /// Frees the memory itself (not just marks it free): the allocation goes back to the OS.
    pub fn release(&mut self) {
        self.data = Vec::new();
    }

    /// Allocates (zeroed) memory again after [`KvArena::release`]; a no-op when allocated.
    pub fn reallocate(&mut self) {
        if self.data.is_empty() {
            // `vec![0.0; n]` asks the allocator for zeroed pages (calloc), so untouched blocks
            // cost no resident memory until they are written.
            self.data = vec![0.0; self.n_blocks * self.layout.block_floats()];
        }
    }

    fn range(&self, block: u32) -> std::ops::Range<usize> {
        let n = self.layout.block_floats();
        let start = block as usize * n;
        start..start + n
    }

    /// One block's floats. Panics if the block is out of range or the arena is released.
    pub fn block(&self, block: u32) -> &[f32] {
        &self.data[self.range(block)]
    }

    pub fn block_mut(&mut self, block: u32) -> &mut [f32] {
        let r = self.range(block);
        &mut self.data[r]
    }

    /// One block as bytes, for transfers and offload copies.
    pub fn block_bytes(&self, block: u32) -> &[u8] {
        let floats = self.block(block);
        // SAFETY: f32 has no invalid bit patterns and u8 has alignment 1; the slice covers
        // exactly the same memory.
        unsafe {
            std::slice::from_raw_parts(floats.as_ptr().cast::<u8>(), std::mem::size_of_val(floats))
        }
    }

    pub fn block_bytes_mut(&mut self, block: u32) -> &mut [u8] {
        let floats = self.block_mut(block);
        let len = std::mem::size_of_val(floats);
        // SAFETY: as in `block_bytes`; any byte pattern is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(floats.as_mut_ptr().cast::<u8>(), len) }
    }

    /// The whole arena as floats (for kernels that index by `block * block_floats`).
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }
}
