//! Cross-thread access to the KV arena: the one audited module through which a worker thread (a
//! transport, an offload copier) reads or writes arena blocks while the engine thread keeps
//! running steps on the same memory.
//!
//! The arena's memory is one zeroed allocation owned by a reference-counted `Storage`. The
//! engine thread reaches it through [`KvArena`] exactly as before (`&` to read, `&mut` to write,
//! no atomics or locks per access). A worker reaches it through a [`BlockGrant`]: a `Send` handle
//! over exactly the blocks a transfer hold names, made by [`KvArena::grant`].
//!
//! # Safety argument
//!
//! Three things can go wrong when two threads touch one allocation: they touch the same bytes at
//! once (a data race), one of them keeps a reference that the aliasing model forbids while the
//! other writes, or one of them touches memory after it is freed.
//!
//! 1. **Engine thread against a grant: the block ledger.** The scheduler's ownership ledger in
//!    `ferry-core` never puts a block held by a transfer into a step, and never holds a block for
//!    a transfer while a step uses it. The engine makes a grant only for a hold's blocks and keeps
//!    the hold until the worker has dropped the grant, so while a grant lives the engine thread
//!    neither reads nor writes its blocks. This module cannot see the ledger, so the promise is
//!    the contract of the `unsafe fn` [`KvArena::grant`], discharged once where the engine turns a
//!    hold into a grant.
//! 2. **References stay as narrow as the blocks they are for.** Disjoint accesses are not enough:
//!    making a reference (a retag) counts, for data races, as an access to its whole range, since
//!    it licenses the compiler to insert speculative reads (and, for `&mut`, writes) anywhere in
//!    it. Miri with Tree Borrows reports a whole-arena `&mut [f32]` made while a worker writes a
//!    granted block as a data race even if the slice never touches that block (Tree Borrows'
//!    aliasing rules alone would accept it: a location another pointer writes is only disabled
//!    for a reference that never accesses it; the race is the retag). So `Storage` keeps a raw
//!    pointer and
//!    never a reference to the memory; every block- and token-level accessor of [`KvArena`]
//!    (`block`, `token`, `plane`, `head`, `block_bytes`, `write_block_bytes`, `copy_block_from`,
//!    their `_mut`s) derives its slice from that pointer for exactly the block it names; and a
//!    grant makes references only to its own blocks, for one borrow of the grant. The whole-arena
//!    [`KvArena::as_slice`] and [`KvArena::as_mut_slice`] cover granted blocks too, so they must
//!    not be called while a grant over the current memory is outstanding (asserted, in release
//!    builds too); the forward uses the block- and token-level accessors only.
//! 3. **Grant against grant: the claim registry.** Each `Storage` keeps a small registry of the
//!    blocks live grants claim, touched only when a grant is made or dropped (never per access).
//!    A write grant needs its blocks unclaimed and distinct; a read grant needs them not claimed
//!    for writing. Two grants can therefore only ever share a block to read it. The registry's
//!    lock also orders a dropped grant's accesses before the next grant over the same block.
//! 4. **Lifetime: reference counts.** A grant holds the `Storage`, so [`KvArena::release`] drops
//!    only the engine's reference: a worker still writing after a release writes into memory that
//!    nobody reads, never into freed memory, and the memory goes back to the OS when the last grant
//!    drops. [`KvArena::reallocate`] makes fresh storage with a new [`KvArena::generation`], so a
//!    grant from before a release is recognisably stale ([`BlockGrant::is_current`]). The engine
//!    waits for [`KvArena::n_outstanding_grants`] (or the ledger's returned holds) before it counts
//!    memory as given back.
//!
//! Checked at run time: every id in range and the arena allocated when the grant is made (an
//! error naming the block, [`KvError`]), distinct ids and no overlapping claims for write grants,
//! exact block lengths on every write and copy, equal layouts on a copy between arenas, writes
//! only through write grants, the generation on request, no whole-arena slice while a grant
//! is outstanding, and a dropped grant's claims as it made them. These are `assert!`s or errors,
//! kept in release builds. Not checked here: (1), which is the ledger's job (`ferry-core`'s
//! block pool asserts that no block is handed out while a hold, and so a grant, still has it)
//! and `grant`'s safety contract.
//!
//! The tests (`access_tests.rs`) run under Miri, with Stacked and with Tree Borrows, sizes shrunk:
//! `MIRIFLAGS=-Zmiri-tree-borrows cargo +nightly miri test -p ferry-arena --lib -- access`. Miri is
//! a manual check (it needs nightly), not part of `.ci/run`.
//!
//! [`KvArena`]: crate::KvArena
//! [`KvArena::as_mut_slice`]: crate::KvArena::as_mut_slice
//! [`KvArena::as_slice`]: crate::KvArena::as_slice
//! [`KvArena::generation`]: crate::KvArena::generation
//! [`KvArena::grant`]: crate::KvArena::grant
//! [`KvArena::n_outstanding_grants`]: crate::KvArena::n_outstanding_grants
//! [`KvArena::reallocate`]: crate::KvArena::reallocate
//! [`KvArena::release`]: crate::KvArena::release

use std::alloc::{self, Layout};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ferry_core::BlockId;

use crate::block::{Access, KvError, KvLayout};

/// One zeroed allocation of arena memory, shared by the arena and the grants made over it.
///
/// Holds the memory only through a raw pointer, so no reference to it exists except the ones
/// [`KvArena`](crate::KvArena) and [`BlockGrant`] make for the duration of one borrow (see
/// the module doc).
pub(crate) struct Storage {
    ptr: NonNull<f32>,
    n_floats: usize,
    /// Blocks claimed by live grants over this storage.
    claims: Mutex<BTreeMap<BlockId, Claim>>,
    /// Live grants over this storage, for the whole-arena slices' assertion.
    n_grants: AtomicUsize,
    /// Unique in the process ([`MemoryRegion::id`]): addresses are reused, ids are not.
    id: u64,
    /// Run when the memory is freed, before it goes back ([`BlockGrant::on_region_freed`]).
    on_free: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

/// The ids of [`Storage`]s: one more for every allocation.
static NEXT_STORAGE_ID: AtomicU64 = AtomicU64::new(1);

/// One arena allocation as a transport that registers memory with a network stack (NIXL)
/// sees it: where it starts, how many bytes it spans, and an id no other allocation of this
/// process shares (the same addresses come back in later allocations; ids do not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryRegion {
    pub base: usize,
    pub bytes: usize,
    pub id: u64,
}

/// How the live grants over one storage use one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// Read by this many grant entries (a read grant may name a block more than once).
    Read(usize),
    Write,
}

// SAFETY: `Storage` owns its allocation like a `Box<[f32]>` and never reads or writes it itself;
// who may touch which floats is decided by `KvArena`'s borrows and by grants (module doc), and the
// registry is behind a `Mutex`. Freeing from any thread is fine for the global allocator.
unsafe impl Send for Storage {}
// SAFETY: as above; a `&Storage` gives access only to the `Mutex`-protected registry.
unsafe impl Sync for Storage {}

impl Storage {
    /// `n_floats` zeroed floats. `alloc_zeroed` asks for zeroed pages (calloc, or fresh mmap'd
    /// pages for large sizes), so untouched blocks cost no resident memory until written.
    fn zeroed(n_floats: usize) -> Arc<Self> {
        let ptr = if n_floats == 0 {
            NonNull::dangling()
        } else {
            let layout = Self::layout(n_floats);
            // SAFETY: `layout` has a non-zero size.
            let raw = unsafe { alloc::alloc_zeroed(layout) };
            let ptr = NonNull::new(raw.cast::<f32>())
                .unwrap_or_else(|| alloc::handle_alloc_error(layout));
            advise_huge_pages(raw, layout.size());
            ptr
        };
        Arc::new(Self {
            ptr,
            n_floats,
            claims: Mutex::default(),
            n_grants: AtomicUsize::new(0),
            id: NEXT_STORAGE_ID.fetch_add(1, Ordering::Relaxed),
            on_free: Mutex::default(),
        })
    }

    fn layout(n_floats: usize) -> Layout {
        Layout::array::<f32>(n_floats).expect("KV arena size overflows isize")
    }

    fn lock_claims(&self) -> MutexGuard<'_, BTreeMap<BlockId, Claim>> {
        // The map is only changed after all checks passed, so a panic elsewhere while the lock
        // was held cannot have left it half-updated.
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `blocks` for one grant, or names the first block another live grant's claim
    /// conflicts with. Write grants' ids must already be distinct.
    fn claim(&self, blocks: &[BlockId], access: Access) -> Result<(), KvError> {
        let mut claims = self.lock_claims();
        for &block in blocks {
            let held = match (access, claims.get(&block)) {
                (_, None) | (Access::Read, Some(Claim::Read(_))) => continue,
                (_, Some(Claim::Read(_))) => Access::Read,
                (_, Some(Claim::Write)) => Access::Write,
            };
            return Err(KvError::BlockBusy { block, held });
        }
        for &block in blocks {
            match access {
                Access::Write => {
                    claims.insert(block, Claim::Write);
                }
                Access::Read => match claims.entry(block).or_insert(Claim::Read(0)) {
                    Claim::Read(n) => *n += 1,
                    Claim::Write => unreachable!("checked above"),
                },
            }
        }
        Ok(())
    }

    /// Gives back one grant's claims. Each must be there as the grant made it: a missing or
    /// different claim means the registry no longer knows who reads or writes the block.
    fn unclaim(&self, blocks: &[BlockId], access: Access) {
        let mut claims = self.lock_claims();
        for &block in blocks {
            match (access, claims.get_mut(&block)) {
                (Access::Read, Some(Claim::Read(n))) if *n > 1 => *n -= 1,
                (Access::Read, Some(Claim::Read(_))) | (Access::Write, Some(Claim::Write)) => {
                    claims.remove(&block);
                }
                // Not while unwinding already: a second panic in a drop would abort.
                (_, claim) if !std::thread::panicking() => {
                    let claim = claim.map(|c| format!("{c:?}"));
                    drop(claims);
                    panic!(
                        "KV arena: end of a {access:?} grant over block {block}, which the \
                         registry claims as {}",
                        claim.as_deref().unwrap_or("nothing")
                    );
                }
                _ => {
                    claims.remove(&block);
                }
            }
        }
    }

    #[cfg(test)]
    fn n_claimed_blocks(&self) -> usize {
        self.lock_claims().len()
    }

    /// Empties the registry behind the live grants' backs, as a bug in it would.
    #[cfg(test)]
    fn forget_claims(&self) {
        self.lock_claims().clear();
    }
}

/// Panics: a whole-arena slice covers blocks `n` live grants may be reading or writing right
/// now (module doc, point 2). Out of line, so the check inlines to a load and a compare.
#[cold]
#[inline(never)]
fn whole_arena_while_granted(what: &str, n: usize) -> ! {
    panic!("KV arena: {what} while workers hold {n} grants over the arena races with them")
}

/// Below this many bytes an arena is left on the allocator's pages as they come.
///
/// At and above it glibc always serves an allocation with a mapping of its own (its dynamic
/// mmap threshold tops out at 32 MiB on 64-bit), which the advice below then covers alone: it
/// never reaches a heap that later reuses the range for small allocations.
const HUGE_PAGE_MIN_BYTES: usize = 32 << 20;

/// Asks Linux to back the whole 2 MiB windows of an arena allocation of `len` bytes at `ptr`
/// with 2 MiB pages (`MADV_HUGEPAGE`; `transparent_hugepage/enabled` is `madvise` on the
/// machines here, so without the advice an arena gets 4 KiB pages).
///
/// Why: attention reads every sequence's K and V of a layer a block at a time, 12 KiB runs of
/// a layer's plane scattered over the arena, so with 4 KiB pages a batch-64 decode step took a
/// TLB miss (a two-level page walk under a hypervisor) every 4 KiB of the ~450 MB it reads. On
/// a 2-vCPU Xeon, batch-64 decode attention of the default model went from 25.6–26.3 to
/// 23.9–24.1 ms per step (`attn_speed`, context 144; the step's `write_kv` page faults fell as
/// well). Pages are still only faulted in when written, 2 MiB at a time, so an untouched
/// arena costs nothing; the allocation is freed as before and its mapping goes with it.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(all(target_os = "linux", not(miri)))]
    if len >= HUGE_PAGE_MIN_BYTES {
        const HUGE_PAGE: usize = 2 << 20;
        let skip = ptr.align_offset(HUGE_PAGE);
        let windows = len.saturating_sub(skip) / HUGE_PAGE * HUGE_PAGE;
        if windows > 0 {
            // SAFETY: `[ptr + skip, ptr + skip + windows)` lies inside the allocation, and the
            // advice only changes which pages the kernel backs it with, never its contents. A
            // failure (no THP support) leaves the 4 KiB pages, which is only slower.
            unsafe { libc::madvise(ptr.add(skip).cast(), windows, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    let _ = (ptr, len);
}

impl Drop for Storage {
    fn drop(&mut self) {
        // Whoever registered this memory elsewhere lets go of it while it is still allocated.
        let hooks = std::mem::take(
            self.on_free
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for hook in hooks {
            hook();
        }
        if self.n_floats != 0 {
            // SAFETY: allocated in `zeroed` with this same layout; the last reference is going
            // away, so no slice or grant points into it any more.
            unsafe { alloc::dealloc(self.ptr.as_ptr().cast::<u8>(), Self::layout(self.n_floats)) };
        }
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Storage")
            .field("n_floats", &self.n_floats)
            .finish_non_exhaustive()
    }
}

/// The engine thread's side of the arena memory: the current `Storage`, its pointer and length
/// copied out so the typed accessors cost what a `Vec<f32>` costs, its generation, and the count
/// of live grants over any generation.
pub(crate) struct ArenaMemory {
    ptr: NonNull<f32>,
    len: usize,
    storage: Arc<Storage>,
    released: bool,
    generation: u64,
    n_grants: Arc<AtomicUsize>,
}

// SAFETY: `ArenaMemory` is the engine's owning handle, used like the `Vec<f32>` it replaces:
// `as_slice` needs `&self`, `as_mut_slice` needs `&mut self`, so the borrow checker orders the
// engine thread's own accesses, wherever the arena is moved or shared; grants are covered by the
// module's safety argument.
unsafe impl Send for ArenaMemory {}
// SAFETY: as above; through `&ArenaMemory` the memory can only be read.
unsafe impl Sync for ArenaMemory {}

impl ArenaMemory {
    /// `n_floats` zeroed floats, generation 0.
    pub(crate) fn zeroed(n_floats: usize) -> Self {
        let storage = Storage::zeroed(n_floats);
        Self {
            ptr: storage.ptr,
            len: n_floats,
            storage,
            released: false,
            generation: 0,
            n_grants: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Drops the engine's reference to the memory; it is freed now, or when the last grant over
    /// it drops.
    pub(crate) fn release(&mut self) {
        *self = Self {
            released: true,
            generation: self.generation,
            n_grants: Arc::clone(&self.n_grants),
            ..Self::zeroed(0)
        };
    }

    /// Fresh zeroed storage of `n_floats`, one generation later.
    pub(crate) fn reallocate(&mut self, n_floats: usize) {
        *self = Self {
            generation: self.generation + 1,
            n_grants: Arc::clone(&self.n_grants),
            ..Self::zeroed(n_floats)
        };
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Floats `range` of the memory, and a reference to no other float (module doc, point 2).
    /// Panics when out of bounds, like slice indexing.
    #[inline]
    pub(crate) fn floats(&self, range: Range<usize>) -> &[f32] {
        self.check_range(&range);
        // SAFETY: `range` lies inside the `len` initialised floats (zeroed at allocation) that
        // `storage` keeps alive; the engine thread's `&`/`&mut` discipline goes through `self`,
        // and a block a grant may write is never in such a range (module doc, point 1).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.len()) }
    }

    #[inline]
    pub(crate) fn floats_mut(&mut self, range: Range<usize>) -> &mut [f32] {
        self.check_range(&range);
        // SAFETY: as in `floats`, and `&mut self` makes this the engine's only live reference;
        // no grant reads or writes a block in `range` (module doc, point 1).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len()) }
    }

    #[inline]
    fn check_range(&self, range: &Range<usize>) {
        if range.start > range.end || range.end > self.len {
            out_of_bounds(range, self.len);
        }
    }

    /// Every float; only while no grant over this memory is outstanding (module doc, point 2).
    #[inline]
    pub(crate) fn as_slice(&self) -> &[f32] {
        self.assert_no_grants("a whole-arena KV slice");
        self.floats(0..self.len)
    }

    #[inline]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        self.assert_no_grants("a whole-arena mutable KV slice");
        self.floats_mut(0..self.len)
    }

    /// Point 2 of the module doc, in release builds too: one relaxed load per whole-arena
    /// slice, and those are made outside the forward's inner loops.
    #[inline]
    fn assert_no_grants(&self, what: &str) {
        let n = self.storage.n_grants.load(Ordering::Relaxed);
        if n != 0 {
            whole_arena_while_granted(what, n);
        }
    }

    /// A grant over `blocks` of this memory, whose layout is `layout`, for
    /// [`KvArena::grant`](crate::KvArena::grant), which has checked that every id is in range
    /// and the memory allocated: refused when a write grant names a block twice, or when
    /// another live grant claims a block in a conflicting way.
    ///
    /// # Safety
    ///
    /// `KvArena::grant`'s: until the grant drops, the engine thread neither writes `blocks`
    /// nor, for a write grant, reads them.
    pub(crate) unsafe fn grant(
        &self,
        blocks: &[BlockId],
        access: Access,
        layout: KvLayout,
    ) -> Result<BlockGrant, KvError> {
        if access == Access::Write {
            let mut seen = BTreeSet::new();
            if let Some(&block) = blocks.iter().find(|&&block| !seen.insert(block)) {
                return Err(KvError::DuplicateBlock { block });
            }
        }
        self.storage.claim(blocks, access)?;
        self.storage.n_grants.fetch_add(1, Ordering::Relaxed);
        self.n_grants.fetch_add(1, Ordering::Relaxed);
        Ok(BlockGrant {
            storage: Arc::clone(&self.storage),
            blocks: blocks.into(),
            access,
            layout,
            generation: self.generation,
            n_grants: Arc::clone(&self.n_grants),
        })
    }

    /// Grants made over this memory (any generation) not dropped yet; reading it zero also
    /// makes their writes visible here.
    pub(crate) fn n_outstanding_grants(&self) -> usize {
        self.n_grants.load(Ordering::Acquire)
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    #[cfg(test)]
    pub(crate) fn storage_weak(&self) -> std::sync::Weak<Storage> {
        Arc::downgrade(&self.storage)
    }

    #[cfg(test)]
    pub(crate) fn n_claimed_blocks(&self) -> usize {
        self.storage.n_claimed_blocks()
    }

    #[cfg(test)]
    pub(crate) fn forget_claims(&self) {
        self.storage.forget_claims();
    }
}

#[cold]
fn out_of_bounds(range: &Range<usize>, len: usize) -> ! {
    panic!("KV float range {range:?} is out of bounds of an arena of {len} floats")
}

impl fmt::Debug for ArenaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaMemory")
            .field("len", &self.len)
            .field("released", &self.released)
            .field("generation", &self.generation)
            .field("n_grants", &self.n_grants.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A worker thread's access to some blocks of one arena allocation; see
/// [`KvArena::grant`](crate::KvArena::grant).
///
/// Keeps the allocation alive and its blocks claimed until dropped. Block indexes `i` are
/// positions in [`BlockGrant::blocks`]; a position past its end panics, like slice indexing,
/// because the worker built that list itself.
pub struct BlockGrant {
    storage: Arc<Storage>,
    blocks: Box<[BlockId]>,
    access: Access,
    layout: KvLayout,
    generation: u64,
    n_grants: Arc<AtomicUsize>,
}

impl BlockGrant {
    pub fn access(&self) -> Access {
        self.access
    }

    /// The granted block ids, in the order given to [`KvArena::grant`](crate::KvArena::grant).
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The arena generation this grant was made in.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The allocation the grant's blocks live in (for registering it with a network stack).
    pub fn region(&self) -> MemoryRegion {
        MemoryRegion {
            base: self.storage.ptr.as_ptr() as usize,
            bytes: self.storage.n_floats * std::mem::size_of::<f32>(),
            id: self.storage.id,
        }
    }

    /// Where block `blocks()[i]` starts, as an address inside [`BlockGrant::region`], for a
    /// transport that moves bytes without this process (a one-sided read posts it to the
    /// network stack). No reference is made; the grant's claims cover whoever uses it.
    pub fn block_addr(&self, i: usize) -> usize {
        self.block_raw(i).0 as usize
    }

    /// Runs `hook` when the allocation this grant is over is freed (after the arena let go of
    /// it and the last grant dropped), before its memory goes back: a transport that
    /// registered the memory deregisters it there. The hook runs on whichever thread drops
    /// the last reference, so it must not wait for anything that thread may hold.
    pub fn on_region_freed(&self, hook: Box<dyn FnOnce() + Send>) {
        self.storage
            .on_free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(hook);
    }

    /// Whether `memory` is the allocation this grant was made over
    /// ([`BlockGrant::is_current`](crate::BlockGrant::is_current) asks it of an arena).
    pub(crate) fn is_over(&self, memory: &ArenaMemory) -> bool {
        Arc::ptr_eq(&self.storage, &memory.storage)
    }

    /// Block `blocks()[i]` as bytes.
    pub fn block_bytes(&self, i: usize) -> &[u8] {
        let (ptr, len) = self.block_raw(i);
        // SAFETY: `block_raw` points into live storage; no other thread writes this block while
        // the grant lives (module doc, points 1 and 3), and `&self` keeps this grant's own writes
        // out for the borrow.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// Block `blocks()[i]` as writable bytes; refused for a read grant.
    pub fn block_bytes_mut(&mut self, i: usize) -> Result<&mut [u8], KvError> {
        let (ptr, len) = self.writable_raw(i)?;
        // SAFETY: as in `block_bytes`, and for a write grant no other thread reads this block
        // either; `&mut self` makes this the grant's only reference to it for the borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    /// Copies block `blocks()[i]` into `dst`, which must be exactly one block long.
    pub fn read_block_into(&self, i: usize, dst: &mut [u8]) -> Result<(), KvError> {
        let src = self.block_bytes(i);
        check_len(self.blocks[i], src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    /// Overwrites block `blocks()[i]` with `bytes`, which must be exactly one block long.
    pub fn write_block(&mut self, i: usize, bytes: &[u8]) -> Result<(), KvError> {
        check_len(self.blocks[i], self.layout.block_bytes(), bytes.len())?;
        self.block_bytes_mut(i)?.copy_from_slice(bytes);
        Ok(())
    }

    /// Copies block `blocks()[i]` of this grant into block `dst.blocks()[j]` of `dst`, a write
    /// grant over an arena of the same layout (an in-process transfer between two arenas).
    pub fn copy_into(&self, i: usize, dst: &mut BlockGrant, j: usize) -> Result<(), KvError> {
        if self.layout != dst.layout {
            return Err(KvError::LayoutMismatch {
                block: self.blocks[i],
                src: self.layout,
                dst: dst.layout,
            });
        }
        let (dst_ptr, len) = dst.writable_raw(j)?;
        let (src_ptr, src_len) = self.block_raw(i);
        assert_eq!(
            len, src_len,
            "grant copy of block {} into block {}: equal layouts give equal block sizes",
            self.blocks[i], dst.blocks[j]
        );
        // SAFETY: both ranges are live and `len` bytes long. They do not overlap: different
        // storages are different allocations, and within one storage the registry never lets a
        // write grant's block be claimed by another grant (module doc, point 3).
        unsafe { std::ptr::copy_nonoverlapping(src_ptr, dst_ptr, len) };
        Ok(())
    }

    /// Start and length in bytes of block `blocks()[i]`.
    fn block_raw(&self, i: usize) -> (*mut u8, usize) {
        let block_floats = self.layout.block_floats();
        let start = self.blocks[i].index() * block_floats;
        assert!(
            start + block_floats <= self.storage.n_floats,
            "grant over block {}: past the end of its arena's memory",
            self.blocks[i]
        );
        // SAFETY: `grant` checked the block is in range of the arena this storage was allocated
        // for, so the offset stays inside the allocation.
        let ptr = unsafe { self.storage.ptr.as_ptr().add(start) };
        (ptr.cast::<u8>(), self.layout.block_bytes())
    }

    fn writable_raw(&self, i: usize) -> Result<(*mut u8, usize), KvError> {
        let block = self.blocks[i];
        match self.access {
            Access::Write => Ok(self.block_raw(i)),
            Access::Read => Err(KvError::ReadOnlyGrant { block }),
        }
    }
}

fn check_len(block: BlockId, expected: usize, actual: usize) -> Result<(), KvError> {
    if actual == expected {
        Ok(())
    } else {
        Err(KvError::WrongLength {
            block,
            expected,
            actual,
        })
    }
}

impl Drop for BlockGrant {
    fn drop(&mut self) {
        self.storage.unclaim(&self.blocks, self.access);
        self.storage.n_grants.fetch_sub(1, Ordering::Release);
        // Release: this grant's accesses happen before an `n_outstanding_grants` that reads the
        // decremented count.
        self.n_grants.fetch_sub(1, Ordering::Release);
    }
}

impl fmt::Debug for BlockGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockGrant")
            .field("access", &self.access)
            .field("blocks", &self.blocks)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}
