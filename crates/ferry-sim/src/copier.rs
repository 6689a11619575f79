//! The offload tier's worker, with the simulation deciding when its copier runs.
//!
//! The real worker (`ferry_kv::OffloadWorker`) queues each `Store`/`Load` job for a copier
//! thread and reports when the copy is done; a `Flush` and a memory release wait until the
//! copier has finished everything queued. This stand-in keeps that contract without a
//! thread: jobs wait in a queue the simulation drains at drawn moments, oldest first (the
//! real copier's order), a `Flush` or a release drains it at once, and the copies themselves
//! run `ferry_kv::HostMemory`, the real copier's code.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use ferry_core::{HostCopy, TransferId, WorkerJob};
use ferry_kv::access::Access;
use ferry_kv::{copy_report, BlockGrant, HostMemory, KvArena, Reports, WorkerConnector};

struct Job {
    hold: TransferId,
    epoch: u64,
    store: bool,
    copies: Vec<HostCopy>,
    grant: BlockGrant,
    reports: Reports,
}

/// The copier's queue and memory, shared by the worker and the simulation.
pub struct CopierState {
    jobs: VecDeque<Job>,
    memory: HostMemory,
    pub n_copied: u64,
}

impl std::fmt::Debug for CopierState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopierState")
            .field("n_queued", &self.jobs.len())
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl CopierState {
    /// Runs the `n` oldest jobs; returns how many ran.
    pub fn run(&mut self, n: usize) -> usize {
        let n = n.min(self.jobs.len());
        for _ in 0..n {
            let Job {
                hold,
                epoch,
                store,
                copies,
                mut grant,
                reports,
            } = self.jobs.pop_front().expect("counted");
            let result = self.memory.copy(store, &copies, &mut grant);
            drop(grant);
            self.n_copied += 1;
            reports.send(copy_report(hold, epoch, store, result));
        }
        n
    }

    /// The holds of the `n` oldest jobs.
    pub fn next_holds(&self, n: usize) -> Vec<TransferId> {
        self.jobs.iter().take(n).map(|j| j.hold).collect()
    }

    pub fn n_queued(&self) -> usize {
        self.jobs.len()
    }

    pub fn host_bytes(&self) -> u64 {
        self.memory.bytes_allocated()
    }
}

/// A handle on the copier (the worker's and the simulation's).
#[derive(Debug, Clone)]
pub struct Copier(Arc<Mutex<CopierState>>);

impl Copier {
    pub fn new(n_host_blocks: usize, block_bytes: usize) -> Self {
        Self(Arc::new(Mutex::new(CopierState {
            jobs: VecDeque::new(),
            memory: HostMemory::new(n_host_blocks, block_bytes),
            n_copied: 0,
        })))
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, CopierState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The worker side to register with the engine.
    pub fn worker(&self) -> Box<dyn WorkerConnector> {
        Box::new(SimOffloadWorker(self.clone()))
    }
}

#[derive(Debug)]
struct SimOffloadWorker(Copier);

impl SimOffloadWorker {
    fn start(
        &self,
        hold: TransferId,
        epoch: u64,
        store: bool,
        copies: &[HostCopy],
        arena: &KvArena,
        reports: &Reports,
    ) {
        let blocks: Vec<u32> = copies.iter().map(|c| c.block).collect();
        let access = if store { Access::Read } else { Access::Write };
        // SAFETY: the blocks are those of the job's `Store` or `Load` hold, which ends only
        // after this job is reported, and the grant is dropped before the report.
        match unsafe { arena.grant(&blocks, access) } {
            Ok(grant) => self.0.lock().jobs.push_back(Job {
                hold,
                epoch,
                store,
                copies: copies.to_vec(),
                grant,
                reports: reports.clone(),
            }),
            Err(e) => reports.send(copy_report(hold, epoch, store, Err(e.to_string()))),
        }
    }
}

impl WorkerConnector for SimOffloadWorker {
    fn before_forward(&mut self, jobs: &[WorkerJob], arena: &mut KvArena, reports: &Reports) {
        for job in jobs {
            match job {
                WorkerJob::Store {
                    hold,
                    epoch,
                    copies,
                } => self.start(*hold, *epoch, true, copies, arena, reports),
                WorkerJob::Load {
                    hold,
                    epoch,
                    copies,
                } => self.start(*hold, *epoch, false, copies, arena, reports),
                // The fence: everything handed over so far is done before the step goes on.
                WorkerJob::Flush { .. } => {
                    let mut s = self.0.lock();
                    let n = s.n_queued();
                    s.run(n);
                }
                other => panic!("not an offload job: {other:?}"),
            }
        }
    }

    fn release_memory(&mut self) {
        let mut s = self.0.lock();
        let n = s.n_queued();
        s.run(n);
        s.memory.release();
    }
}
