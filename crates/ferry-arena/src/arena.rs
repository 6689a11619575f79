//! The KV arena: one allocation of `n_blocks` blocks.
//!
//! Layout of one block (all `f32`):
//! `[layer][k|v][slot in block][kv head][head_dim]`, so each token's head vector is contiguous,
//! and a block is `KvLayout::block_floats()` floats in one range.
//!
//! Two kinds of access:
//! * typed, infallible accessors for attention ([`KvArena::token`], [`KvArena::head`],
//!   [`KvArena::plane`]): they index directly and panic on out-of-range ids, because the
//!   executor validates the plan's block ids once per step ([`KvArena::check_block`]) and the
//!   hot loop should not pay for a `Result` per token;
//! * fallible byte-level access for transports and offload ([`KvArena::try_block_bytes`],
//!   [`KvArena::write_block_bytes`], [`KvArena::copy_block_from`]): their block ids come from
//!   another process or a job queue, so a bad id is an error ([`KvError`]) naming the block,
//!   never a panic.
//!
//! The memory itself is shared storage ([`crate::access`]): the engine thread uses it through
//! `&self`/`&mut self` as if it were a `Vec<f32>`, and worker threads reach the blocks a transfer
//! holds through a [`BlockGrant`].

use std::ops::Range;

use ferry_core::BlockId;

use crate::access::{ArenaMemory, BlockGrant};
use crate::block::{Access, KvError, KvLayout, KvPlane};

/// Block-major KV memory. Can be released (sleep, KV memory release) and reallocated.
#[derive(Debug)]
pub struct KvArena {
    layout: KvLayout,
    n_blocks: usize,
    /// Empty while released.
    memory: ArenaMemory,
}

impl KvArena {
    /// Allocates and zeroes `n_blocks` blocks.
    pub fn new(layout: KvLayout, n_blocks: usize) -> Self {
        Self {
            layout,
            n_blocks,
            memory: ArenaMemory::zeroed(n_blocks * layout.block_floats()),
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn is_allocated(&self) -> bool {
        !self.memory.is_released() || self.total_floats() == 0
    }

    /// Bytes held right now (0 while released, even while a grant keeps the old memory alive).
    pub fn bytes(&self) -> usize {
        self.memory.len() * std::mem::size_of::<f32>()
    }

    /// Frees the memory itself (not just marks it free): the allocation goes back to the OS, at
    /// once, or when the last outstanding [`BlockGrant`] over it drops
    /// ([`KvArena::n_outstanding_grants`]).
    pub fn release(&mut self) {
        self.memory.release();
    }

    /// Allocates fresh zeroed memory after [`KvArena::release`], one [`KvArena::generation`]
    /// later; a no-op when allocated. Untouched blocks cost no resident memory until written.
    pub fn reallocate(&mut self) {
        if self.memory.is_released() {
            self.memory.reallocate(self.total_floats());
        }
    }

    pub(crate) fn memory(&self) -> &ArenaMemory {
        &self.memory
    }

    fn total_floats(&self) -> usize {
        self.n_blocks * self.layout.block_floats()
    }

    fn range(&self, block: BlockId) -> Range<usize> {
        let n = self.layout.block_floats();
        let start = block.index() * n;
        start..start + n
    }

    /// `Ok` when `block` can be accessed: in range, and the arena is allocated. Executors call
    /// this for every block id of a plan before using the infallible accessors.
    pub fn check_block(&self, block: BlockId) -> Result<(), KvError> {
        if block.index() >= self.n_blocks {
            return Err(KvError::BlockOutOfRange {
                block,
                n_blocks: self.n_blocks,
            });
        }
        if !self.is_allocated() {
            return Err(KvError::Released { block });
        }
        Ok(())
    }

    /// One block's floats. Panics if the block is out of range or the arena is released.
    ///
    /// Like every block- and token-level accessor, it makes a reference to that block only, never
    /// to the whole arena, so it may run while workers hold grants over other blocks.
    pub fn block(&self, block: BlockId) -> &[f32] {
        self.memory.floats(self.range(block))
    }

    pub fn block_mut(&mut self, block: BlockId) -> &mut [f32] {
        let r = self.range(block);
        self.memory.floats_mut(r)
    }

    /// Layer `layer`'s K or V plane of `block`: `block_size` token vectors back to back.
    /// Panics if out of range (see the module doc).
    pub fn plane(&self, block: BlockId, layer: usize, plane: KvPlane) -> &[f32] {
        let start = self.layout.token_offset(layer, plane, 0);
        &self.block(block)[start..start + self.layout.plane_floats()]
    }

    /// The K or V vector (all KV heads, `n_kv_heads * head_dim` floats) of the token in slot
    /// `slot` of `block`, layer `layer`. Panics if out of range (see the module doc).
    pub fn token(&self, block: BlockId, slot: usize, layer: usize, plane: KvPlane) -> &[f32] {
        let start = self.layout.token_offset(layer, plane, slot);
        &self.block(block)[start..start + self.layout.token_floats()]
    }

    /// Mutable [`KvArena::token`]: where the forward writes a token's K or V.
    pub fn token_mut(
        &mut self,
        block: BlockId,
        slot: usize,
        layer: usize,
        plane: KvPlane,
    ) -> &mut [f32] {
        let start = self.layout.token_offset(layer, plane, slot);
        let len = self.layout.token_floats();
        &mut self.block_mut(block)[start..start + len]
    }

    /// The aux words of arena slot `block * block_size + offset` ([`KvLayout::aux_floats`]).
    pub fn aux_at(&self, arena_slot: usize) -> &[f32] {
        let (block, at) = self.aux_place(arena_slot);
        &self.block(block)[at..at + self.layout.aux_floats]
    }

    pub fn aux_at_mut(&mut self, arena_slot: usize) -> &mut [f32] {
        let (block, at) = self.aux_place(arena_slot);
        let n = self.layout.aux_floats;
        &mut self.block_mut(block)[at..at + n]
    }

    fn aux_place(&self, arena_slot: usize) -> (BlockId, usize) {
        let bs = self.layout.block_size;
        let block = BlockId((arena_slot / bs) as u32);
        (
            block,
            self.layout.aux_offset() + (arena_slot % bs) * self.layout.aux_floats,
        )
    }

    /// [`KvArena::token`] by arena slot (`block * block_size + slot`, what
    /// `StepPlan::slot_of` returns).
    pub fn token_at(&self, arena_slot: usize, layer: usize, plane: KvPlane) -> &[f32] {
        let (block, slot) = self.split_slot(arena_slot);
        self.token(block, slot, layer, plane)
    }

    /// [`KvArena::token_mut`] by arena slot.
    pub fn token_at_mut(&mut self, arena_slot: usize, layer: usize, plane: KvPlane) -> &mut [f32] {
        let (block, slot) = self.split_slot(arena_slot);
        self.token_mut(block, slot, layer, plane)
    }

    fn split_slot(&self, arena_slot: usize) -> (BlockId, usize) {
        let bs = self.layout.block_size;
        (BlockId((arena_slot / bs) as u32), arena_slot % bs)
    }

    /// One KV head's vector (`head_dim` floats) of the token in slot `slot` of `block`.
    pub fn head(
        &self,
        block: BlockId,
        slot: usize,
        layer: usize,
        plane: KvPlane,
        head: usize,
    ) -> &[f32] {
        let start = self.layout.head_offset(layer, plane, slot, head);
        &self.block(block)[start..start + self.layout.head_dim]
    }

    /// One block as bytes, for transfers and offload copies. Panics like [`KvArena::block`];
    /// see [`KvArena::try_block_bytes`] for ids that come from outside.
    pub fn block_bytes(&self, block: BlockId) -> &[u8] {
        floats_as_bytes(self.block(block))
    }

    pub fn block_bytes_mut(&mut self, block: BlockId) -> &mut [u8] {
        floats_as_bytes_mut(self.block_mut(block))
    }

    /// One block as bytes, or an error naming the block if it is out of range or the arena is
    /// released.
    pub fn try_block_bytes(&self, block: BlockId) -> Result<&[u8], KvError> {
        self.check_block(block)?;
        Ok(self.block_bytes(block))
    }

    /// Overwrites a whole block with `bytes` (a transfer or an offload load landing). The length
    /// must be exactly one block.
    pub fn write_block_bytes(&mut self, block: BlockId, bytes: &[u8]) -> Result<(), KvError> {
        self.check_block(block)?;
        let expected = self.layout.block_bytes();
        if bytes.len() != expected {
            return Err(KvError::WrongLength {
                block,
                expected,
                actual: bytes.len(),
            });
        }
        self.block_bytes_mut(block).copy_from_slice(bytes);
        Ok(())
    }

    /// Copies block `src_block` of `src` into block `dst` of this arena (an in-process transfer,
    /// or a copy between the device arena and a host tier). The layouts must match.
    pub fn copy_block_from(
        &mut self,
        dst: BlockId,
        src: &KvArena,
        src_block: BlockId,
    ) -> Result<(), KvError> {
        if src.layout != self.layout {
            return Err(KvError::LayoutMismatch {
                block: src_block,
                src: src.layout,
                dst: self.layout,
            });
        }
        let bytes = src.try_block_bytes(src_block)?;
        self.write_block_bytes(dst, bytes)
    }

    /// The whole arena as floats (for kernels that index by `block * block_floats`).
    ///
    /// Not while a worker holds a grant over this memory: a reference to the whole arena counts
    /// as an access to every block, the granted ones included, and so races with the worker
    /// (see [`crate::access`], point 2). Asserted, in release builds too.
    pub fn as_slice(&self) -> &[f32] {
        self.memory.as_slice()
    }

    /// Mutable [`KvArena::as_slice`], under the same rule.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.memory.as_mut_slice()
    }
}

impl KvArena {
    /// A handle a worker thread uses to read or write exactly `blocks` (in that order; `i` in
    /// [`BlockGrant`]'s methods indexes this list) while the engine thread keeps stepping.
    ///
    /// Refused with an error naming the block when an id is out of range, the arena is released,
    /// a write grant names a block twice, or another live grant claims a block in a conflicting
    /// way (any claim, for a write grant; a write claim, for a read grant).
    ///
    /// # Safety
    ///
    /// Until the returned grant drops, the engine thread must not write `blocks` through this
    /// arena, nor read them if `access` is [`Access::Write`]. The block ledger guarantees this for
    /// the blocks of a transfer hold that stays held until the grant is dropped
    /// ([`crate::access`]'s module doc).
    pub unsafe fn grant(&self, blocks: &[BlockId], access: Access) -> Result<BlockGrant, KvError> {
        for &block in blocks {
            self.check_block(block)?;
        }
        // SAFETY: the caller's promise is the one `ArenaMemory::grant` asks for.
        unsafe { self.memory().grant(blocks, access, self.layout()) }
    }

    /// Grants made by this arena (over any generation) that have not been dropped yet. Zero
    /// means every worker let go; reading it zero also makes their writes visible here.
    pub fn n_outstanding_grants(&self) -> usize {
        self.memory().n_outstanding_grants()
    }

    /// Which allocation the arena holds: 0 from [`KvArena::new`], one more on every
    /// [`KvArena::reallocate`] that allocates.
    pub fn generation(&self) -> u64 {
        self.memory().generation()
    }
}

// Here rather than beside the rest of `BlockGrant` in `access.rs`: it takes the arena, and
// `access.rs` (the memory and the grants over it) sits below `arena.rs`.
impl BlockGrant {
    /// `true` while `arena` still holds the allocation this grant was made over: `false` after a
    /// release (and any reallocation), or for another arena.
    pub fn is_current(&self, arena: &KvArena) -> bool {
        self.is_over(arena.memory())
    }
}

fn floats_as_bytes(floats: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 has alignment 1; the byte slice covers exactly the
    // memory of `floats` and borrows it for the same lifetime.
    unsafe { std::slice::from_raw_parts(floats.as_ptr().cast::<u8>(), size_of_val(floats)) }
}

fn floats_as_bytes_mut(floats: &mut [f32]) -> &mut [u8] {
    let len = size_of_val(floats);
    // SAFETY: as in `floats_as_bytes`; also every byte pattern is a valid f32, so writes
    // through the byte view cannot create an invalid value. The borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(floats.as_mut_ptr().cast::<u8>(), len) }
}

#[cfg(test)]
#[path = "arena_tests.rs"]
mod tests;

// The grants' tests make their grants through the arena, so they are the arena's: as
// `access`'s they would import upwards.
#[cfg(test)]
#[path = "access_tests.rs"]
mod access_tests;
