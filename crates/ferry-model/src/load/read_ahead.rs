//! Reading a weights file at the disk's rate: the two things a reader of fresh memory waits
//! on, besides the copy, are the disk and the kernel clearing the pages it writes into. Both
//! are started ahead of the reader here, so they run while it copies:
//! * [`ReadAhead`] asks the kernel to read the file's next bytes into the page cache
//!   (`POSIX_FADV_WILLNEED`, which starts the I/O and returns), a window ahead of the reader;
//! * [`populate`] takes the destination's pages from the OS on another thread
//!   (`MADV_POPULATE_WRITE`: each page faulted in writable and cleared, its contents not
//!   touched), in the order the reader writes them.
//!
//! Measured with the page cache dropped before each read of the f32 default model (538 MB,
//! one file) on this project's 2-vCPU VM, a server reloading it (`update_weights_from_disk`)
//! beside `cat`, interleaved rounds: the reload went from a median of 0.58 s (every page
//! cleared on two threads first, then the tensors read in the model's order) to 0.42 s, with
//! `cat` at 0.30 s; `scripts/bench-cold-reload.sh` measures it. Each part was tried alone in
//! a throwaway C program first (medians of 15–20 rounds, `cat` 0.29–0.30 s): the file's order
//! instead of the model's, 0.53 s against 0.50 s but far steadier (quartiles 0.50–0.55 against
//! 0.33–0.94); with the window below, 0.40 s; with the pages taken on another thread instead
//! of first, 0.34 s. Both are hints: where the kernel has neither, or refuses, the reader only
//! does the waiting itself.
//!
//! A file whose every page is already in the page cache ([`cached`]: a checkpoint the trainer
//! just wrote, the common case in an RL loop) has no disk to wait on; the copy and the new
//! pages are the whole work, and the safetensors reader shares it among several threads
//! instead ([`cached_readers`]), each taking its own pages as it writes them.

use std::sync::atomic::{AtomicBool, Ordering};

/// How far ahead of the reader the kernel is asked to read. In the C program above, 16 MiB
/// measured slower (median 0.61 s against 0.41 s) and 128 MiB no faster and less even.
pub(super) const WINDOW_BYTES: u64 = 64 << 20;

/// The part of a file the kernel has been asked to read ahead.
pub(super) struct ReadAhead<'a> {
    file: &'a std::fs::File,
    /// Bytes from the start asked for so far.
    asked: u64,
    len: u64,
}

impl<'a> ReadAhead<'a> {
    pub(super) fn new(file: &'a std::fs::File, len: u64) -> Self {
        Self {
            file,
            asked: 0,
            len,
        }
    }

    /// The reader is about to read up to byte `end`: asks for the file up to a window past
    /// it, a window at a time.
    pub(super) fn reading_to(&mut self, end: u64) {
        let want = end.saturating_add(WINDOW_BYTES).min(self.len);
        while self.asked < want {
            let n = WINDOW_BYTES.min(self.len - self.asked);
            will_need(self.file, self.asked, n);
            self.asked += n;
        }
    }
}

#[cfg(target_os = "linux")]
fn will_need(file: &std::fs::File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: a hint about an open file's range; it reads or writes no memory of ours. An
    // error (which it returns, never sets errno for) only means no read-ahead.
    let _ =
        unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED) };
}

#[cfg(not(target_os = "linux"))]
fn will_need(_file: &std::fs::File, _offset: u64, _len: u64) {}

/// Whether every page of `map` (a file's whole mapping) is in the page cache (`mincore`,
/// which reads nothing): then reading it waits on no disk, only on copying and on the new
/// memory, and several readers share that work ([`cached_readers`]). False where the kernel
/// cannot tell.
pub(super) fn cached(map: &[u8]) -> bool {
    #[cfg(target_os = "linux")]
    {
        let page = crate::weights::buf::page_size();
        crate::weights::buf::resident_pages(map) == Some(map.len().div_ceil(page))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = map;
        false
    }
}

/// Readers of a file in the page cache: one per core, at least two (a reader stalled on a
/// page fault leaves its core to the other), at most eight (memory bandwidth runs out long
/// before). On this project's 2-vCPU VM, two servers reloading the f32 default model from the
/// page cache in turn (15 rounds, `cat` of the file 0.059 s): one reader with the pages taken
/// on another thread 0.098 s, two readers 0.084 s. In a throwaway C program (20 rounds, `cat`
/// 0.048 s): 0.091 s against 0.063 s with two readers, 0.058 s with three, 0.068 s with four.
pub(super) fn cached_readers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8))
}

/// Bytes populated per call, so a reader that fails stops the work soon after.
const POPULATE_PIECE_BYTES: usize = 8 << 20;

/// Takes the pages of each `(address, length)` range from the OS in turn, until `stop`:
/// faulted in writable and cleared by the kernel now, on this thread, rather than one fault
/// at a time under the reader that fills them. The contents are never read or written, so
/// the reader may be filling the same pages meanwhile; a range whose memory has gone (or is
/// not writable) is refused by the kernel and skipped. A kernel without the call (before
/// Linux 5.14) makes this return at once.
pub(super) fn populate(ranges: &[(usize, usize)], stop: &AtomicBool) {
    let page = crate::weights::buf::page_size();
    for &(addr, len) in ranges {
        let (start, end) = (addr / page * page, (addr + len).next_multiple_of(page));
        let mut at = start;
        while at < end {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let n = POPULATE_PIECE_BYTES.min(end - at);
            if !populate_write(at, n) {
                return;
            }
            at += n;
        }
    }
}

/// `MADV_POPULATE_WRITE` over `addr..addr + len` (page-aligned); false when the kernel does
/// not know the call.
#[cfg(target_os = "linux")]
fn populate_write(addr: usize, len: usize) -> bool {
    // SAFETY: the advice neither reads nor writes the range's contents (it only faults its
    // pages in, as a write would, without writing); a range that is not mapped writable is
    // refused with an error, so no memory of anyone's changes.
    let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
}

#[cfg(not(target_os = "linux"))]
fn populate_write(_addr: usize, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn populating_keeps_what_a_writer_wrote() {
        let page = crate::weights::buf::page_size();
        let mut map = memmap2::MmapMut::map_anon(64 * page).unwrap();
        map[..page].fill(7);
        map[10 * page + 3] = 9;
        // Unaligned ranges round out to whole pages.
        let at = map.as_ptr() as usize;
        let ranges = [(at + 5, 3 * page - 5), (at + 10 * page + 1, 30 * page - 1)];
        populate(&ranges, &AtomicBool::new(false));
        // Told to stop, it takes nothing more.
        populate(&[(at + 50 * page, page)], &AtomicBool::new(true));
        #[cfg(target_os = "linux")]
        assert_eq!(
            crate::weights::buf::resident_pages(&map[..]),
            Some(33),
            "pages 0–2 and 10–39 are taken, and no other"
        );
        assert!(map[..page].iter().all(|&b| b == 7));
        assert_eq!(map[10 * page + 3], 9);
        assert_eq!(
            map.iter().map(|&b| u64::from(b)).sum::<u64>(),
            7 * page as u64 + 9
        );
    }

    #[test]
    fn read_ahead_asks_a_window_past_the_reader_and_stops_at_the_end() {
        let file = tempfile::tempfile().unwrap();
        let len = 3 * WINDOW_BYTES + 5;
        let mut ahead = ReadAhead::new(&file, len);
        // A window at a time, until a window past byte 10 is asked for.
        ahead.reading_to(10);
        assert_eq!(ahead.asked, 2 * WINDOW_BYTES);
        ahead.reading_to(WINDOW_BYTES);
        assert_eq!(ahead.asked, 2 * WINDOW_BYTES);
        ahead.reading_to(2 * WINDOW_BYTES);
        assert_eq!(ahead.asked, 3 * WINDOW_BYTES);
        ahead.reading_to(len);
        assert_eq!(ahead.asked, len);
    }

    /// A file just written is all in the page cache; one whose pages were never written nor
    /// read (a hole) is not, and a reader would wait on the disk.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_written_file_is_cached_and_an_untouched_one_is_not() {
        use std::io::Write;
        let page = crate::weights::buf::page_size();
        let mut written = tempfile::tempfile().unwrap();
        written.write_all(&vec![3u8; 8 * page + 5]).unwrap();
        // SAFETY: a private temporary file nobody else can change.
        let map = unsafe { memmap2::Mmap::map(&written) }.unwrap();
        assert!(cached(&map));
        let hole = tempfile::tempfile().unwrap();
        hole.set_len(8 * page as u64).unwrap();
        // SAFETY: as above.
        let map = unsafe { memmap2::Mmap::map(&hole) }.unwrap();
        assert!(!cached(&map));
    }
}
