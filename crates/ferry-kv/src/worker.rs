//! The P/D connector's worker ([`PdWorker`]): runs the P/D jobs the scheduler plans on a
//! [`Transport`], through grants over the hold's blocks. Its interface,
//! [`WorkerConnector`], is `ferry-arena`'s.

use std::sync::Arc;

use ferry_arena::{Access, BlockGrant, KvArena, KvError, Reports, WorkerConnector};
use ferry_core::{BlockId, FetchError, PdJob, PdReport};

use crate::transport::{ExportOffer, FetchSpec, ReleaseSpec, Transport};

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

    fn grant(arena: &KvArena, blocks: &[BlockId], access: Access) -> Result<BlockGrant, KvError> {
        // SAFETY: the blocks are those of a transfer hold the scheduler made for this job
        // (see `WorkerConnector::before_forward`): no step touches them while the grant lives.
        unsafe { arena.grant(blocks, access) }
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
                // The adapter is not checked by the transports yet (only D's connector does).
                lora: _,
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
                    result: Err(FetchError::fault(0, e.to_string())),
                }),
            },
            PdJob::CancelFetch { hold, .. } => self.transport.cancel_fetch(*hold),
        }
    }
}
