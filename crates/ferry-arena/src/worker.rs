//! The interface of a connector's worker side: what runs the jobs a connector's scheduler
//! side plans (`ferry_core::WorkerJob`), and how its results get back to the engine.
//!
//! The engine thread hands each step's jobs to the connector's [`WorkerConnector`] before the
//! forward (also on a step with no tokens: a connector-only step) and calls it again after
//! the forward. A worker never blocks the engine thread on a transfer: it starts the work
//! (a transport's threads move the bytes through [`BlockGrant`](crate::BlockGrant)s) and returns; results come
//! back through [`Reports`], which puts them on the engine's input queue, so they wake the
//! engine and reach the core in order, between steps.
//!
//! The interface lives beside the arena, not with the workers (`ferry-kv`'s `PdWorker` and
//! `OffloadWorker`, the simulation's), so the engine core that drives it reaches no transport
//! and no async runtime.

use std::sync::Arc;

use ferry_core::{PdJob, TierJob, WorkerJob, WorkerReport};

use crate::arena::KvArena;

/// Where a worker's results go: the engine's input queue, tagged with the connector. Cheap
/// to clone into transport threads. Reporting to an engine that has stopped does nothing.
#[derive(Clone)]
pub struct Reports(Arc<dyn Fn(WorkerReport) + Send + Sync>);

impl Reports {
    pub fn new(send: impl Fn(WorkerReport) + Send + Sync + 'static) -> Self {
        Self(Arc::new(send))
    }

    /// Sends one report (a family's own, `PdReport` or `TierReport`, wrapped on the way).
    pub fn send(&self, report: impl Into<WorkerReport>) {
        (self.0)(report.into());
    }
}

impl std::fmt::Debug for Reports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reports")
    }
}

/// The worker side of one connector, on the engine thread. A worker implements the jobs of
/// its own family (`run_pd` or `run_tier`); `before_forward` unwraps each job once and hands
/// it there, so no worker sees another family's jobs. A job of a family the worker does not
/// run would be the engine pairing a connector with another's worker: it is logged and
/// dropped.
pub trait WorkerConnector: Send + std::fmt::Debug {
    /// This step's jobs, before the forward. Start them; do not wait for transfers.
    ///
    /// # Safety contract of the grants it makes
    ///
    /// Every job names blocks the scheduler holds for it (a transfer hold), so no step
    /// touches them until the hold ends, and the hold ends only after the worker reported
    /// the job done (and dropped its grant). That is the ledger argument `KvArena::grant`
    /// asks for.
    fn before_forward(&mut self, jobs: &[WorkerJob], arena: &mut KvArena, reports: &Reports) {
        for job in jobs {
            match job {
                WorkerJob::Pd(job) => self.run_pd(job, arena, reports),
                WorkerJob::Tier(job) => self.run_tier(job, arena, reports),
            }
        }
    }

    /// Starts one P/D job (a P/D worker). Same contract as `before_forward`.
    fn run_pd(&mut self, job: &PdJob, _arena: &mut KvArena, _reports: &Reports) {
        tracing::error!(?job, worker = ?self, "a P/D job for a worker that runs none; dropped");
    }

    /// Starts one local tier's job (a tier's copier). Same contract as `before_forward`.
    fn run_tier(&mut self, job: &TierJob, _arena: &mut KvArena, _reports: &Reports) {
        tracing::error!(?job, worker = ?self, "a tier job for a worker that runs none; dropped");
    }

    /// After the forward, once the core has the step's output: the jobs that output produced
    /// (P's exports of requests that just finished, before their parameters reach anyone; a
    /// store of blocks the step just wrote). Same contract as `before_forward`.
    fn after_forward(&mut self, jobs: &[WorkerJob], arena: &mut KvArena, reports: &Reports) {
        self.before_forward(jobs, arena, reports);
    }

    /// Gives back memory the worker holds of its own (an offload tier's host memory): sleep
    /// level >= 1 and `release_kv_cache_memory`, once every transfer hold came back. The next
    /// job may allocate it again.
    fn release_memory(&mut self) {}
}
