//! The worker side of connectors: what runs the jobs a connector's scheduler side plans
//! (`ferry_core::WorkerJob`), and how its results get back to the engine.
//!
//! The engine thread hands each step's jobs to the connector's [`WorkerConnector`] before the
//! forward (also on a step with no tokens: a connector-only step) and calls it again after
//! the forward. A worker never blocks the engine thread on a transfer: it starts the work
//! (a transport's threads move the bytes through [`BlockGrant`]s) and returns; results come
//! back through [`Reports`], which puts them on the engine's input queue, so they wake the
//! engine and reach the core in order, between steps.

use std::sync::Arc;

use ferry_core::{BlockId, FetchError, PdJob, PdReport, TierJob, WorkerJob, WorkerReport};

use crate::access::{Access, BlockGrant};
use crate::arena::KvArena;
use crate::transport::{ExportOffer, FetchSpec, ReleaseSpec, Transport};

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

/// The P/D connector's worker: publishes exports on its transport (P) and fetches remote
/// exports into the arena (D).
pub struct PdWorker {
    engine_id: String,
    transport: Arc<dyn Transport>,
}

impl std::fmt::Debug for PdWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdWorker")
            .field("engine_id", &self.engine_id)
            .finish_non_exhaustive()
    }
}

impl PdWorker {
    pub fn new(engine_id: impl Into<String>, transport: Arc<dyn Transport>) -> Self {
        Self {
            engine_id: engine_id.into(),
            transport,
        }
    }

    fn grant(arena: &KvArena, blocks: &[BlockId], access: Access) -> Result<BlockGrant, String> {
        // SAFETY: the blocks are those of a transfer hold the scheduler made for this job
        // (see `WorkerConnector::before_forward`): no step touches them while the grant lives.
        unsafe { arena.grant(blocks, access) }.map_err(|e| e.to_string())
    }
}

impl WorkerConnector for PdWorker {
    fn run_pd(&mut self, job: &PdJob, arena: &mut KvArena, reports: &Reports) {
        match job {
            PdJob::Publish {
                hold,
                token,
                weight_version,
                blocks,
                prompt_hash,
                n_tokens,
                ..
            } => match Self::grant(arena, blocks, Access::Read) {
                Ok(grant) => self.transport.publish(
                    ExportOffer {
                        engine_id: self.engine_id.clone(),
                        hold: *hold,
                        token: token.clone(),
                        weight_version: weight_version.clone(),
                        prompt_hash: *prompt_hash,
                        n_tokens: *n_tokens,
                        grant,
                    },
                    reports.clone(),
                ),
                Err(e) => {
                    tracing::warn!(hold = hold.0, "cannot publish an export: {e}");
                    reports.send(PdReport::ExportGone { hold: *hold });
                }
            },
            PdJob::Unpublish { hold, reason } => {
                self.transport
                    .unpublish(&self.engine_id, *hold, *reason, reports.clone())
            }
            PdJob::Release {
                remote_engine_id,
                remote_host,
                remote_port,
                token,
            } => self.transport.release(ReleaseSpec {
                remote_engine_id: remote_engine_id.clone(),
                remote_host: remote_host.clone(),
                remote_port: *remote_port,
                token: token.clone(),
            }),
            PdJob::Fetch {
                hold,
                remote_engine_id,
                remote_host,
                remote_port,
                token,
                weight_version,
                prompt_hash,
                first_block,
                src_blocks,
                blocks,
            } => match Self::grant(arena, blocks, Access::Write) {
                Ok(grant) => self.transport.fetch(
                    FetchSpec {
                        hold: *hold,
                        remote_engine_id: remote_engine_id.clone(),
                        remote_host: remote_host.clone(),
                        remote_port: *remote_port,
                        token: token.clone(),
                        weight_version: weight_version.clone(),
                        prompt_hash: *prompt_hash,
                        first_block: *first_block,
                        src_blocks: src_blocks.clone(),
                    },
                    grant,
                    reports.clone(),
                ),
                Err(e) => reports.send(PdReport::FetchDone {
                    hold: *hold,
                    result: Err(FetchError::fault(0, e)),
                }),
            },
            PdJob::CancelFetch { hold, .. } => self.transport.cancel_fetch(*hold),
        }
    }
}
