//! The offload tier's worker: a copier thread that moves KV blocks between the arena and the
//! tier's host memory, off the engine thread.
//!
//! The engine thread hands [`OffloadWorker`] each step's `Store` and `Load` jobs
//! (`ferry_core::TierJob`); the worker takes a grant over exactly the job's arena blocks (a
//! read grant for a store, a write grant for a load: the blocks of the job's `Store`/`Load`
//! hold) and queues the job for its copier, then returns. The copier runs jobs in order,
//! drops each grant, then reports (`StoreDone`, `LoadDone`) on the engine's input queue, so a
//! hold ends only once nothing reads or writes its blocks any more.
//!
//! A `Flush` job (a reset's flush set) is the fence: the engine thread waits until the
//! copier has finished every job handed to it so far (the abandoned ones included), so no
//! grant outlives the reset and no host block they touch is reused before.
//! [`WorkerConnector::release_memory`] (sleep, KV release) waits the same way, then gives
//! the host memory back to the OS; the next store allocates it again, empty.
//!
//! Host memory is one zeroed allocation (`n_host_blocks` engine blocks), made on the first
//! job after start or a release: pages cost resident memory only once written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use ferry_arena::{Access, BlockGrant, KvArena, KvError, Reports, WorkerConnector};
use ferry_core::{BlockId, FetchError, HostCopy, TierJob, TierReport, TransferId};

/// One `Store` or `Load` job with a grant over exactly its hold's blocks, as a copier runs
/// it: the copier thread here, and the simulation's deterministic copier (`ferry-sim`), so
/// both start and run jobs with this code.
pub struct CopyJob {
    pub hold: TransferId,
    epoch: u64,
    store: bool,
    copies: Vec<HostCopy>,
    grant: BlockGrant,
    reports: Reports,
}

impl std::fmt::Debug for CopyJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyJob")
            .field("hold", &self.hold)
            .field("store", &self.store)
            .field("n_copies", &self.copies.len())
            .finish_non_exhaustive()
    }
}

impl CopyJob {
    /// The copy `job` asks for (`Store` or `Load`; `None` for any other job), with its grant
    /// (read for a store, write for a load). A grant that cannot be made is reported as the
    /// job's failure at once, and gives `None` too.
    pub fn start(job: &TierJob, arena: &KvArena, reports: &Reports) -> Option<Self> {
        let (hold, epoch, store, copies) = match job {
            TierJob::Store {
                hold,
                epoch,
                copies,
            } => (*hold, *epoch, true, copies),
            TierJob::Load {
                hold,
                epoch,
                copies,
            } => (*hold, *epoch, false, copies),
            TierJob::Flush { .. } => return None,
        };
        let blocks: Vec<BlockId> = copies.iter().map(|c| c.block).collect();
        let access = if store { Access::Read } else { Access::Write };
        // SAFETY: the blocks are those of the job's `Store` or `Load` hold (see
        // `WorkerConnector::before_forward`): no step touches them until the copier reported
        // the job, which it does only after dropping this grant (`run`).
        match unsafe { arena.grant(&blocks, access) } {
            Ok(grant) => Some(Self {
                hold,
                epoch,
                store,
                copies: copies.clone(),
                grant,
                reports: reports.clone(),
            }),
            Err(e) => {
                reports.send(copy_report(hold, epoch, store, Err(e.into())));
                None
            }
        }
    }

    /// Copies, drops the grant, then reports: once the hold ends, nothing here touches its
    /// blocks.
    pub fn run(self, memory: &mut HostMemory) {
        let Self {
            hold,
            epoch,
            store,
            copies,
            mut grant,
            reports,
        } = self;
        let result = memory.copy(store, &copies, &mut grant);
        drop(grant);
        reports.send(copy_report(hold, epoch, store, result));
    }
}

enum Msg {
    Copy(CopyJob),
    /// Give the host memory back.
    Release,
}

/// How many messages the copier has finished, for waits.
#[derive(Default)]
struct Progress {
    done: Mutex<u64>,
    advanced: Condvar,
}

/// The offload tier's worker side (see the module docs).
pub struct OffloadWorker {
    tx: Option<mpsc::Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<Progress>,
    n_sent: u64,
    /// Host bytes allocated now (0 or the whole tier).
    host_bytes: Arc<AtomicU64>,
}

impl std::fmt::Debug for OffloadWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadWorker")
            .field("n_sent", &self.n_sent)
            .field("host_bytes", &self.host_bytes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl OffloadWorker {
    /// A worker for a tier of `n_host_blocks` engine blocks of `block_bytes` each (the
    /// scheduler side's `OffloadConfig::n_host_blocks`); starts its copier thread.
    pub fn new(n_host_blocks: usize, block_bytes: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let progress = Arc::new(Progress::default());
        let memory = HostMemory::new(n_host_blocks, block_bytes);
        let host_bytes = Arc::clone(&memory.host_bytes);
        let copier = Copier {
            rx,
            progress: Arc::clone(&progress),
            memory,
        };
        let thread = std::thread::Builder::new()
            .name("ferry-offload".into())
            .spawn(move || copier.run())?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            progress,
            n_sent: 0,
            host_bytes,
        })
    }

    /// Host bytes the tier holds allocated now.
    pub fn host_bytes(&self) -> u64 {
        self.host_bytes.load(Ordering::Relaxed)
    }

    fn send(&mut self, msg: Msg) {
        if let Some(tx) = &self.tx {
            if tx.send(msg).is_ok() {
                self.n_sent += 1;
            }
        }
    }

    /// Blocks until the copier finished everything sent so far (or has died: a copier that
    /// panicked reports nothing more, so its holds never end and the reset waiting for them
    /// fails with its timeout instead of this hanging the engine thread).
    pub fn wait_idle(&self) {
        let mut done = self
            .progress
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while *done < self.n_sent {
            if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                tracing::error!("the offload copier thread is gone");
                return;
            }
            done = self
                .progress
                .advanced
                .wait_timeout(done, std::time::Duration::from_millis(100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// The report that ends a copy job: `StoreDone` for a store, `LoadDone` for a load.
fn copy_report(
    hold: TransferId,
    epoch: u64,
    store: bool,
    result: Result<(), CopyError>,
) -> TierReport {
    if store {
        TierReport::StoreDone {
            hold,
            epoch,
            ok: result.is_ok(),
        }
    } else {
        TierReport::LoadDone {
            hold,
            epoch,
            result: result.map_err(|e| FetchError::fault(0, e.to_string())),
        }
    }
}

impl WorkerConnector for OffloadWorker {
    fn run_tier(&mut self, job: &TierJob, arena: &mut KvArena, reports: &Reports) {
        match job {
            TierJob::Flush { .. } => self.wait_idle(),
            TierJob::Store { .. } | TierJob::Load { .. } => {
                if let Some(copy) = CopyJob::start(job, arena, reports) {
                    self.send(Msg::Copy(copy));
                }
            }
        }
    }

    fn release_memory(&mut self) {
        self.send(Msg::Release);
        self.wait_idle();
    }
}

impl Drop for OffloadWorker {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The copier thread's state.
struct Copier {
    rx: mpsc::Receiver<Msg>,
    progress: Arc<Progress>,
    memory: HostMemory,
}

impl Copier {
    fn run(mut self) {
        while let Ok(msg) = self.rx.recv() {
            match msg {
                Msg::Copy(job) => job.run(&mut self.memory),
                Msg::Release => self.memory.release(),
            }
            let mut done = self
                .progress
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            *done += 1;
            self.progress.advanced.notify_all();
        }
    }
}

/// The tier's host memory and the copies between it and arena blocks: what the copier
/// thread runs for each job, and what a deterministic stand-in for that thread (the
/// simulation's, `ferry-sim`) runs, so both copy with this code.
///
/// Host memory is one zeroed allocation (`n_host_blocks` engine blocks), made by the first
/// copy after creation or a [`release`](Self::release).
#[derive(Debug)]
pub struct HostMemory {
    n_host_blocks: usize,
    block_bytes: usize,
    host: Option<Box<[u8]>>,
    /// Bytes allocated now, shared with the worker's gauge.
    host_bytes: Arc<AtomicU64>,
}

impl HostMemory {
    pub fn new(n_host_blocks: usize, block_bytes: usize) -> Self {
        Self {
            n_host_blocks,
            block_bytes,
            host: None,
            host_bytes: Arc::default(),
        }
    }

    /// Host bytes allocated now (0 or the whole tier).
    pub fn bytes_allocated(&self) -> u64 {
        self.host_bytes.load(Ordering::Relaxed)
    }

    /// Copies each of `copies` between the grant's block at the same position and its host
    /// block: arena to host for a store, host to arena for a load.
    pub fn copy(
        &mut self,
        store: bool,
        copies: &[HostCopy],
        grant: &mut BlockGrant,
    ) -> Result<(), CopyError> {
        let bb = self.block_bytes;
        let n = self.n_host_blocks;
        if let Some(c) = copies.iter().find(|c| c.host_block as usize >= n) {
            return Err(CopyError::HostBlockOutOfRange {
                host_block: c.host_block,
                n_host_blocks: n,
            });
        }
        let host_bytes = &self.host_bytes;
        let host = self.host.get_or_insert_with(|| {
            host_bytes.store((n * bb) as u64, Ordering::Relaxed);
            vec![0u8; n * bb].into_boxed_slice()
        });
        for (i, c) in copies.iter().enumerate() {
            let at = c.host_block as usize * bb;
            let slot = &mut host[at..at + bb];
            if store {
                grant.read_block_into(i, slot)?;
            } else {
                grant.write_block(i, slot)?;
            }
        }
        Ok(())
    }

    /// Gives the host memory back to the OS; the next copy allocates it again, zeroed.
    pub fn release(&mut self) {
        self.host = None;
        self.host_bytes.store(0, Ordering::Relaxed);
    }
}

/// Why a copy job failed: a host block the tier does not have, or the arena refused the grant
/// or a block (a `KvError` naming it). A load that fails is a fault (`LoadDone`'s
/// `FetchError`), a store that fails is not kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("host block {host_block} is out of range (the tier has {n_host_blocks})")]
    HostBlockOutOfRange {
        host_block: u32,
        n_host_blocks: usize,
    },
    #[error(transparent)]
    Arena(#[from] KvError),
}

#[cfg(test)]
#[path = "offload_tests.rs"]
mod tests;
