//! Where [`super::ByteBuf`]s live: slabs of anonymous memory that Linux may back with 2 MiB
//! pages, carved front to back.
//!
//! Why: batch-1 decode streams every weight once a step, and with 4 KiB pages that is a TLB
//! miss every 4 KiB (under a hypervisor, a two-level page walk). Linux backs an anonymous
//! range with 2 MiB pages only where a whole aligned 2 MiB window lies in one mapping advised
//! `MADV_HUGEPAGE` (`transparent_hugepage/enabled` is `madvise` on the machines here), and the
//! default model's matrices are 69 KiB to 1.9 MiB each, so one mapping per tensor got none.
//! Tensors carved one after another out of one aligned, advised slab fill whole windows. On
//! a 2-vCPU Xeon, batch-1 decode of the Q8_0 file went from 112–139 to 161–166 tok/s and of
//! the Q4_1 file from 164–184 to 198–206 (`ferry bench model`, 4 interleaved rounds in a slow
//! hour of the host; a first one-arena build gave 164–175 → 171–187 and 220–247 → 237–248 in
//! a faster one); a plain read of 256 MiB on two threads went from 24–26 to 29–31 GB/s.
//!
//! A buffer owns its page-rounded range of a slab, which is never handed out again. Dropping
//! it gives the range's pages back at once (`MADV_DONTNEED`) and takes the range out of
//! huge-page service (`MADV_NOHUGEPAGE`): otherwise khugepaged may later collapse a window
//! around the hole and fill it with zeros, and an update's freed weights would come back as
//! resident memory. A slab is unmapped once its last buffer is gone and the carver has moved
//! on to another; when the carver does, it gives back the old slab's unused tail the same way
//! (a 2 MiB page may have been faulted across the last tensor's end). A request larger than a
//! slab gets a slab of its own size. At most the window at the current slab's front, under
//! 2 MiB, is resident beyond the bytes held.
//!
//! Why by hand: a general allocator (glibc's, jemalloc, mimalloc) reuses freed ranges and
//! caches freed memory per thread or arena, which is what made weight updates leave copies of
//! the weights resident (see `WeightBuf`); what is needed here is the opposite, a bump
//! pointer whose freed pages go straight back to the OS, in ~150 lines.

use std::sync::{Arc, Mutex, PoisonError};

/// Address space of one slab: room for many tensors, so few slabs end with an unused tail.
const SLAB_BYTES: usize = 64 << 20;
/// The huge-page size slabs are aligned to (x86-64 and the common aarch64 configurations).
const HUGE_PAGE: usize = 2 << 20;

/// One anonymous mapping; `len` bytes usable from its `HUGE_PAGE`-aligned start `base`.
struct Slab {
    map: memmap2::MmapMut,
    base: usize,
    len: usize,
    /// The aligned start, for carved buffers' writes (each to its own range).
    ptr: *mut u8,
}

// SAFETY: a slab's bytes are only reached through `Carved` buffers, each of which owns a
// disjoint range; the mapping itself is only advised and finally unmapped.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

impl Slab {
    /// A fresh mapping of `len` usable bytes, advised for huge pages (a kernel without them
    /// refuses the advice, and the slab simply keeps 4 KiB pages).
    ///
    /// # Panics
    /// When the kernel refuses the mapping, as `Vec` aborts when an allocation fails.
    fn new(len: usize) -> Self {
        let mut map = memmap2::MmapMut::map_anon(len + HUGE_PAGE)
            .unwrap_or_else(|e| panic!("mapping {len} bytes of weights: {e}"));
        let base = map.as_ptr().align_offset(HUGE_PAGE).min(HUGE_PAGE);
        #[cfg(target_os = "linux")]
        let _ = map.advise_range(memmap2::Advice::HugePage, base, len);
        // SAFETY: base + len lies inside the mapping of len + HUGE_PAGE bytes.
        let ptr = unsafe { map.as_mut_ptr().add(base) };
        Self {
            map,
            base,
            len,
            ptr,
        }
    }

    /// Gives the pages of `offset..offset + len` (page-aligned, inside the slab) back to the
    /// OS and keeps huge pages out of them. The caller owns the range.
    fn release(&self, offset: usize, len: usize) {
        #[cfg(target_os = "linux")]
        {
            let at = self.base + offset;
            // SAFETY: the caller owns these bytes and no longer reads them; DONTNEED makes
            // them read as zeros, which nobody will.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, len)
            };
            let _ = self.map.advise_range(memmap2::Advice::NoHugePage, at, len);
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (offset, len);
    }
}

/// A buffer's range of a slab: `len` bytes at `offset` from the slab's aligned start, which
/// it owns up to the next page boundary.
pub(super) struct Carved {
    slab: Arc<Slab>,
    offset: usize,
    len: usize,
}

impl Carved {
    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: the range lies inside the slab, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.slab.ptr.add(self.offset), self.len) }
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and no other `Carved` reaches this range.
        unsafe { std::slice::from_raw_parts_mut(self.slab.ptr.add(self.offset), self.len) }
    }
}

impl Drop for Carved {
    fn drop(&mut self) {
        // The last owner's drop unmaps the slab, which gives everything back anyway.
        if Arc::strong_count(&self.slab) > 1 {
            self.slab
                .release(self.offset, self.len.next_multiple_of(page_size()));
        }
    }
}

/// Carves buffers out of its current slab, front to back.
pub(super) struct Carver {
    slab_bytes: usize,
    current: Option<(Arc<Slab>, usize)>,
}

impl Carver {
    pub(super) const fn new(slab_bytes: usize) -> Self {
        Self {
            slab_bytes,
            current: None,
        }
    }

    /// `len` (> 0) zero bytes.
    pub(super) fn carve(&mut self, len: usize) -> Carved {
        let rounded = len.next_multiple_of(page_size());
        if rounded > self.slab_bytes {
            let slab = Arc::new(Slab::new(rounded));
            return Carved {
                slab,
                offset: 0,
                len,
            };
        }
        let full = self
            .current
            .as_ref()
            .is_none_or(|(slab, used)| used + rounded > slab.len);
        if full {
            if let Some((slab, used)) = self.current.take() {
                slab.release(used, slab.len - used);
            }
            self.current = Some((Arc::new(Slab::new(self.slab_bytes)), 0));
        }
        let (slab, used) = self.current.as_mut().expect("a slab with room");
        let offset = *used;
        *used += rounded;
        Carved {
            slab: Arc::clone(slab),
            offset,
            len,
        }
    }
}

/// The process's carver: every `ByteBuf` comes from it.
pub(super) fn carve(len: usize) -> Carved {
    static CARVER: Mutex<Carver> = Mutex::new(Carver::new(SLAB_BYTES));
    CARVER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .carve(len)
}

/// The OS page size: a released range must cover whole pages, or the advice would reach a
/// neighbour's bytes (on a 16 or 64 KiB-page kernel as much as on a 4 KiB one).
pub(crate) fn page_size() -> usize {
    #[cfg(unix)]
    {
        static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        // SAFETY: sysconf only reads a system constant.
        *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as usize,
            _ => 4096,
        })
    }
    #[cfg(not(unix))]
    4096
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the page holding `at` is resident.
    #[cfg(target_os = "linux")]
    fn resident(at: *const u8) -> bool {
        let page = page_size();
        let start = (at as usize) / page * page;
        let mut v = 0u8;
        // SAFETY: one page of a live mapping; `v` holds its one status byte.
        let r = unsafe { libc::mincore(start as *mut libc::c_void, page, &mut v) };
        assert_eq!(r, 0, "mincore failed");
        v & 1 == 1
    }

    #[test]
    fn buffers_are_disjoint_page_aligned_zeroed_and_keep_their_bytes() {
        let mut carver = Carver::new(1 << 20);
        let page = page_size();
        let mut bufs: Vec<Carved> = [1, page, 3 * page + 5, 100_000]
            .iter()
            .map(|&n| carver.carve(n))
            .collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.bytes().iter().all(|&x| x == 0));
            assert_eq!(b.bytes().as_ptr() as usize % page, 0);
            b.bytes_mut().fill(i as u8 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.bytes().iter().all(|&x| x == i as u8 + 1), "buffer {i}");
        }
        // Consecutive carves come back to back, each from a page boundary.
        let (a, b) = (&bufs[1], &bufs[2]);
        assert_eq!(b.offset, a.offset + page);
        assert!(Arc::ptr_eq(&a.slab, &b.slab));
    }

    #[test]
    fn a_slab_is_unmapped_once_its_buffers_and_the_carver_let_go() {
        let mut carver = Carver::new(1 << 20);
        let first = carver.carve(600 << 10);
        let slab = Arc::downgrade(&first.slab);
        // Does not fit in what is left: a fresh slab, and the carver lets go of the first.
        let second = carver.carve(600 << 10);
        assert!(!Arc::ptr_eq(&first.slab, &second.slab));
        assert!(slab.upgrade().is_some());
        drop(first);
        assert!(slab.upgrade().is_none(), "the first slab is unmapped");
        // Larger than a slab: one of its own, gone with the buffer.
        let big = carver.carve(3 << 20);
        assert_eq!(big.bytes().len(), 3 << 20);
        let own = Arc::downgrade(&big.slab);
        drop(big);
        assert!(own.upgrade().is_none());
        drop(second);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_dropped_buffer_gives_its_pages_back_and_leaves_its_neighbours() {
        let mut carver = Carver::new(8 << 20);
        let page = page_size();
        let mut bufs: Vec<Carved> = (0..3).map(|_| carver.carve(4 * page)).collect();
        for b in &mut bufs {
            b.bytes_mut().fill(7);
        }
        let middle = bufs[1].bytes().as_ptr();
        assert!((0..4).all(|p| resident(middle.wrapping_add(p * page))));
        let last = bufs.pop().unwrap();
        drop(bufs.remove(1));
        // The slab is still mapped (the carver and the others hold it): the pages are gone.
        assert!((0..4).all(|p| !resident(middle.wrapping_add(p * page))));
        assert!(bufs[0].bytes().iter().all(|&x| x == 7));
        assert!(last.bytes().iter().all(|&x| x == 7));
    }
}
