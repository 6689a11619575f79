//! The offload tier's worker, with the simulation deciding when its copier runs.
//!
//! The real worker (`ferry_kv::OffloadWorker`) queues each `Store`/`Load` job for a copier
//! thread and reports when the copy is done; a `Flush` and a memory release wait until the
//! copier has finished everything queued. This stand-in keeps that contract without a
//! thread: jobs wait in a queue the simulation drains at drawn moments, oldest first (the
//! real copier's order), and a `Flush` or a release drains it at once. Jobs are started and
//! run by the real copier's code (`ferry_kv::CopyJob`, `ferry_kv::HostMemory`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use ferry_arena::{KvArena, Reports, WorkerConnector};
use ferry_core::{TierJob, TransferId};
use ferry_kv::{CopyJob, HostMemory};

/// The copier's queue and memory, shared by the worker and the simulation.
#[derive(Debug)]
pub struct CopierState {
    jobs: VecDeque<CopyJob>,
    memory: HostMemory,
    pub n_copied: u64,
}

impl CopierState {
    /// Runs the `n` oldest jobs; returns how many ran.
    pub fn run(&mut self, n: usize) -> usize {
        let n = n.min(self.jobs.len());
        for job in self.jobs.drain(..n) {
            job.run(&mut self.memory);
            self.n_copied += 1;
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

impl WorkerConnector for SimOffloadWorker {
    fn run_tier(&mut self, job: &TierJob, arena: &mut KvArena, reports: &Reports) {
        match job {
            // The fence: everything handed over so far is done before the step goes on.
            TierJob::Flush { .. } => {
                let mut s = self.0.lock();
                let n = s.n_queued();
                s.run(n);
            }
            TierJob::Store { .. } | TierJob::Load { .. } => {
                if let Some(copy) = CopyJob::start(job, arena, reports) {
                    self.0.lock().jobs.push_back(copy);
                }
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
