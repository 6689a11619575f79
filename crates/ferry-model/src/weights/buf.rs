//! [`WeightBuf`]: f32 weight storage that gives its memory back to the OS when dropped, on
//! whichever thread drops it.
//!
//! Why not `Vec<f32>`: glibc's malloc serves an allocation below its mmap threshold from the
//! calling thread's arena and keeps the chunk there when it is freed, and the threshold is
//! dynamic: after the first free of a mapped chunk it rises to that chunk's size (up to 32 MiB
//! on 64-bit), so from then on every layer matrix lands in an arena. A weight update allocates
//! hundreds of megabytes on one blocking-pool thread and the replaced weights are freed on
//! another, so each update left a copy of the layer matrices resident in some thread's arena:
//! serving SmolLM2-135M (513 MiB of f32 weights), resident memory went from 650 MiB idle to
//! 1,516 MiB after the first full push and 2,068 MiB after four (with the threshold fixed by
//! `MALLOC_MMAP_THRESHOLD_`, it stayed at 546 MiB). A `WeightBuf` is its own anonymous mapping
//! (`memmap2`, already used for model files), so it starts as untouched zero pages, costs
//! nothing to zero, and `munmap` on drop returns every page at once.

use std::ops::{Deref, DerefMut};

mod slab;

pub(crate) use slab::page_size;

/// A fixed-length run of f32 weights in its own anonymous memory mapping (none when empty).
#[derive(Default)]
pub struct WeightBuf {
    map: Option<memmap2::MmapMut>,
    len: usize,
}

impl WeightBuf {
    /// `len` zeros. The pages are the kernel's zero pages until written.
    ///
    /// # Panics
    /// When the kernel refuses the mapping (out of address space or memory), as `Vec`
    /// aborts when an allocation fails.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self::default();
        }
        let n_bytes = len
            .checked_mul(size_of::<f32>())
            .unwrap_or_else(|| panic!("{len} weights overflow the address space"));
        let map = memmap2::MmapMut::map_anon(n_bytes)
            .unwrap_or_else(|e| panic!("mapping {n_bytes} bytes of weights: {e}"));
        Self {
            map: Some(map),
            len,
        }
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[f32]) -> Self {
        let mut buf = Self::zeroed(values.len());
        buf.copy_from_slice(values);
        buf
    }

    /// The weights as bytes (little-endian on every target ferry runs on).
    pub fn n_bytes(&self) -> usize {
        self.len * size_of::<f32>()
    }
}

impl Deref for WeightBuf {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.map {
            // SAFETY: the mapping is page-aligned (so aligned for f32), `len * 4` bytes long
            // (`zeroed` maps exactly that), starts zeroed and is written only as f32 through
            // `deref_mut`; every bit pattern is a valid f32. It lives as long as `self`.
            Some(map) => unsafe { std::slice::from_raw_parts(map.as_ptr().cast(), self.len) },
            None => &[],
        }
    }
}

impl DerefMut for WeightBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.map {
            // SAFETY: as in `deref`; `&mut self` makes the borrow exclusive.
            Some(map) => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().cast(), self.len)
            },
            None => &mut [],
        }
    }
}

impl Clone for WeightBuf {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl PartialEq for WeightBuf {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for WeightBuf {
    /// The length only: a weight matrix is millions of floats.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightBuf").field("len", &self.len).finish()
    }
}

/// A fixed-length run of raw weight bytes (a matrix in its stored precision), carved out of a
/// slab of huge-page memory (`weights/buf/slab.rs`): tensors side by side fill whole 2 MiB
/// pages, which a decode step streams through with a TLB miss every 2 MiB instead of every
/// 4 KiB. Its pages go back to the OS when it is dropped, on whichever thread, for the same
/// reason as a [`WeightBuf`]'s. Page-aligned, so any dtype's values can be read from it in
/// place.
#[derive(Default)]
pub struct ByteBuf {
    mem: Option<slab::Carved>,
}

impl ByteBuf {
    /// `len` zero bytes, untouched pages until written.
    ///
    /// # Panics
    /// When the kernel refuses the mapping, as [`WeightBuf::zeroed`].
    pub fn zeroed(len: usize) -> Self {
        Self {
            mem: (len > 0).then(|| slab::carve(len)),
        }
    }

    /// A copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut buf = Self::zeroed(bytes.len());
        buf.copy_from_slice(bytes);
        buf
    }
}

impl Deref for ByteBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.mem.as_ref().map_or(&[], slab::Carved::bytes)
    }
}

impl DerefMut for ByteBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.mem.as_mut().map_or(&mut [], slab::Carved::bytes_mut)
    }
}

impl Clone for ByteBuf {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl PartialEq for ByteBuf {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for ByteBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBuf").field("len", &self.len()).finish()
    }
}

/// Bytes per page a [`prefault`] touches: the base page; a huge page is taken whole by its
/// first touch, and the others in it cost a load each.
const PAGE_BYTES: usize = 4096;
/// A piece of [`prefault`]'s work: small enough that rayon's threads share a model's matrices
/// evenly.
const PREFAULT_PIECE_BYTES: usize = 4 << 20;

/// Touches every page of `regions` on rayon's threads at once, so the kernel takes and clears
/// them now, in parallel, instead of one fault at a time under a single-threaded reader.
/// Fresh anonymous memory costs its clearing wherever it is first written: a reload of a model
/// from files in the page cache spent two thirds of its time in the kernel's `clear_page` with
/// one thread (perf, SmolLM2-135M f32). Writes a zero byte per page: for slots a reader then
/// fills whole, as every update's are.
pub fn prefault(regions: Vec<&mut [u8]>) {
    use rayon::prelude::*;
    let pieces: Vec<&mut [u8]> = regions
        .into_iter()
        .flat_map(|r| r.chunks_mut(PREFAULT_PIECE_BYTES))
        .collect();
    pieces.into_par_iter().for_each(|piece| {
        for page in piece.chunks_mut(PAGE_BYTES) {
            // SAFETY: `page` is a valid, exclusively borrowed, non-empty byte slice. Volatile,
            // so the store of a value the compiler may believe is already there is kept.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
    });
}

/// The resident pages of `bytes` (page-aligned: the start of a mapping, anonymous or of a
/// file), by `mincore`, which reads no byte of them; `None` when the kernel refuses.
#[cfg(target_os = "linux")]
pub(crate) fn resident_pages(bytes: &[u8]) -> Option<usize> {
    let mut status = vec![0u8; bytes.len().div_ceil(page_size())];
    // SAFETY: `mincore` only writes one status byte per page of the range into `status`,
    // which has that many; the range is a live borrow, so mapped.
    let r = unsafe {
        libc::mincore(
            bytes.as_ptr() as *mut libc::c_void,
            bytes.len(),
            status.as_mut_ptr(),
        )
    };
    (r == 0).then(|| status.iter().filter(|&&s| s & 1 == 1).count())
}

#[cfg(test)]
mod tests {
    use super::{resident_pages, WeightBuf};

    #[test]
    fn starts_zeroed_and_keeps_what_is_written() {
        let mut buf = WeightBuf::zeroed(1000);
        assert_eq!(buf.len(), 1000);
        assert!(buf.iter().all(|&x| x.to_bits() == 0));
        buf[999] = -1.5;
        buf[0] = f32::MIN_POSITIVE;
        assert_eq!((buf[0], buf[999]), (f32::MIN_POSITIVE, -1.5));
        assert_eq!(buf.clone(), buf);
        assert_eq!(buf.n_bytes(), 4000);
    }

    #[test]
    fn an_empty_buffer_maps_nothing() {
        let mut buf = WeightBuf::zeroed(0);
        assert!(buf.is_empty() && buf.map.is_none());
        assert_eq!(&mut *buf, &mut [] as &mut [f32]);
        assert_eq!(WeightBuf::from_slice(&[]), WeightBuf::default());
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn prefault_takes_every_page_and_keeps_the_zeros() {
        let n = 9 << 20;
        let mut a = WeightBuf::zeroed(n / 4);
        let mut b = WeightBuf::zeroed(n / 8);
        let bytes = |w: &mut WeightBuf| {
            let f: &mut [f32] = w;
            // SAFETY: every byte of an f32 slice is initialised; u8 has alignment 1.
            unsafe { std::slice::from_raw_parts_mut(f.as_mut_ptr().cast::<u8>(), f.len() * 4) }
        };
        assert_eq!(
            resident_pages(bytes(&mut a)),
            Some(0),
            "fresh pages are not taken"
        );
        super::prefault(vec![bytes(&mut a), bytes(&mut b)]);
        let page = super::page_size();
        assert_eq!(resident_pages(bytes(&mut a)), Some(n / page));
        assert_eq!(resident_pages(bytes(&mut b)), Some(n / 2 / page));
        assert!(a.iter().chain(b.iter()).all(|x| x.to_bits() == 0));
    }

    #[test]
    fn byte_buf_keeps_its_bytes() {
        let buf = super::ByteBuf::from_slice(&[1, 2, 3]);
        assert_eq!(&*buf, &[1, 2, 3]);
        assert_eq!(buf.clone(), buf);
        assert!(super::ByteBuf::zeroed(0).is_empty());
    }

    #[test]
    fn from_slice_copies_every_bit() {
        let values = [0.0, -0.0, 1.0, f32::NAN, f32::INFINITY, 1e-40];
        let buf = WeightBuf::from_slice(&values);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&buf), bits(&values));
    }
}
