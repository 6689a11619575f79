//! KV transfer counters for [`crate::EngineStats`], read off what the engine thread already
//! sees: the worker jobs it hands out (an export published, a load started) and the worker
//! reports it takes in (pulled, gone, load done). Nothing here reaches into a connector or a
//! transport, so any connector's transfers are counted alike.

use std::collections::HashMap;
use std::time::Duration;

use ferry_core::{ConnectorId, TransferId, WorkerJob, WorkerReport};

/// Running totals, published with the engine's stats.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TransferStats {
    /// P: exports published for a reader.
    pub n_exports_started_total: u64,
    /// P: exports a reader pulled in full.
    pub n_exports_pulled_total: u64,
    /// P: exports whose blocks came back unread (lease expired, or revoked by a cache reset).
    pub n_exports_expired_total: u64,
    /// D: loads started.
    pub n_loads_started_total: u64,
    /// D: loads whose KV landed.
    pub n_loads_finished_total: u64,
    /// D: loads that failed, timed out or were cancelled.
    pub n_loads_failed_total: u64,
    /// KV bytes that crossed: landed loads (D) plus pulled exports (P).
    pub bytes_total: u64,
    /// Wall time from a load's start to its end, summed over finished loads (D).
    pub load_seconds_total: f64,
}

/// The engine thread's bookkeeping behind [`TransferStats`]: transfers in flight by hold.
#[derive(Debug)]
pub(crate) struct TransferTally {
    block_bytes: u64,
    /// Exports published and not ended: their size in blocks.
    exports: HashMap<(ConnectorId, TransferId), u64>,
    /// Loads started and not ended: their size in blocks and start.
    loads: HashMap<(ConnectorId, TransferId), (u64, Duration)>,
    pub(crate) stats: TransferStats,
}

impl TransferTally {
    pub(crate) fn new(block_bytes: usize) -> Self {
        Self {
            block_bytes: block_bytes as u64,
            exports: HashMap::new(),
            loads: HashMap::new(),
            stats: TransferStats::default(),
        }
    }

    /// Jobs handed to connector `c`'s worker.
    pub(crate) fn on_jobs(&mut self, c: ConnectorId, jobs: &[WorkerJob], now: Duration) {
        for job in jobs {
            match job {
                WorkerJob::Publish { hold, blocks, .. } => {
                    self.stats.n_exports_started_total += 1;
                    self.exports.insert((c, *hold), blocks.len() as u64);
                }
                WorkerJob::Fetch { hold, blocks, .. } => {
                    self.stats.n_loads_started_total += 1;
                    self.loads.insert((c, *hold), (blocks.len() as u64, now));
                }
                // The offload tier's copies are counted by the tier itself (`TierStats`).
                WorkerJob::Unpublish { .. }
                | WorkerJob::Release { .. }
                | WorkerJob::CancelFetch { .. }
                | WorkerJob::Store { .. }
                | WorkerJob::Load { .. }
                | WorkerJob::Flush { .. } => {}
            }
        }
    }

    /// A report from connector `c`'s worker. A second end of the same hold (an export
    /// unpublished after its pull) counts nothing.
    pub(crate) fn on_report(&mut self, c: ConnectorId, report: &WorkerReport, now: Duration) {
        match report {
            WorkerReport::ExportPulled { hold } => {
                if let Some(n_blocks) = self.exports.remove(&(c, *hold)) {
                    self.stats.n_exports_pulled_total += 1;
                    self.stats.bytes_total += n_blocks * self.block_bytes;
                }
            }
            WorkerReport::ExportGone { hold } => {
                if self.exports.remove(&(c, *hold)).is_some() {
                    self.stats.n_exports_expired_total += 1;
                }
            }
            WorkerReport::FetchDone { hold, result } => {
                let Some((n_blocks, started)) = self.loads.remove(&(c, *hold)) else {
                    return;
                };
                match result {
                    Ok(()) => {
                        self.stats.n_loads_finished_total += 1;
                        self.stats.bytes_total += n_blocks * self.block_bytes;
                        self.stats.load_seconds_total += now.saturating_sub(started).as_secs_f64();
                    }
                    Err(_) => self.stats.n_loads_failed_total += 1,
                }
            }
            WorkerReport::StoreDone { .. } | WorkerReport::LoadDone { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::FetchError;

    #[test]
    fn counts_each_transfer_once_by_how_it_ended() {
        let mut t = TransferTally::new(100);
        let c = ConnectorId(0);
        let now = Duration::from_secs(1);
        let publish = |hold| WorkerJob::Publish {
            hold: TransferId(hold),
            token: String::new(),
            weight_version: String::new(),
            blocks: vec![1, 2],
            prompt_hash: [0; 32],
            n_tokens: 8,
        };
        let fetch = |hold| WorkerJob::Fetch {
            hold: TransferId(hold),
            remote_engine_id: String::new(),
            remote_host: None,
            remote_port: None,
            token: String::new(),
            weight_version: String::new(),
            prompt_hash: [0; 32],
            first_block: 0,
            src_blocks: vec![5, 6, 7],
            blocks: vec![1, 2, 3],
        };
        t.on_jobs(c, &[publish(1), publish(2), fetch(3), fetch(4)], now);
        t.on_report(
            c,
            &WorkerReport::ExportPulled {
                hold: TransferId(1),
            },
            now,
        );
        t.on_report(
            c,
            &WorkerReport::ExportGone {
                hold: TransferId(1),
            },
            now,
        );
        t.on_report(
            c,
            &WorkerReport::ExportGone {
                hold: TransferId(2),
            },
            now,
        );
        let done = |hold, result| WorkerReport::FetchDone {
            hold: TransferId(hold),
            result,
        };
        t.on_report(c, &done(3, Ok(())), now);
        let failed = Err(FetchError::fault(0, ""));
        t.on_report(c, &done(4, failed.clone()), now);
        t.on_report(c, &done(4, failed), now);
        assert_eq!(
            t.stats,
            TransferStats {
                n_exports_started_total: 2,
                n_exports_pulled_total: 1,
                n_exports_expired_total: 1,
                n_loads_started_total: 2,
                n_loads_finished_total: 1,
                n_loads_failed_total: 1,
                bytes_total: 500,
                load_seconds_total: 0.0,
            }
        );
    }
}
