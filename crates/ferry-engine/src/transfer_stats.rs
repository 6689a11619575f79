//! KV transfer counters for [`crate::EngineStats`], read off what the engine thread already
//! sees: the worker jobs it hands out (an export published, a load started) and the worker
//! reports it takes in (pulled, gone, load done). Nothing here reaches into a connector or a
//! transport, so any connector's transfers are counted alike.

use std::collections::HashMap;
use std::time::Duration;

use ferry_core::{
    ConnectorId, FetchCancel, FetchEnd, PdJob, PdReport, TransferId, WorkerJob, WorkerReport,
};

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
    /// D: loads that did not land, whatever the reason: the sum of the four below.
    pub n_loads_failed_total: u64,
    /// D: loads that broke (the link, the peer, a grant).
    pub n_loads_broken_total: u64,
    /// D: loads that timed out: a transfer step past `io_timeout`, or the load's bound
    /// (`kv_load_timeout`).
    pub n_loads_timed_out_total: u64,
    /// D: loads cut short by a retraction (a cache reset, the request's end).
    pub n_loads_cancelled_total: u64,
    /// D: loads refused before any block moved (P's refusal: revoked, expired, invalid; or
    /// a check of the pull).
    pub n_loads_refused_total: u64,
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
    /// Loads the scheduler cancelled, and why: their end counts as that.
    cancels: HashMap<(ConnectorId, TransferId), FetchCancel>,
    pub(crate) stats: TransferStats,
}

impl TransferTally {
    pub(crate) fn new(block_bytes: usize) -> Self {
        Self {
            block_bytes: block_bytes as u64,
            exports: HashMap::new(),
            loads: HashMap::new(),
            cancels: HashMap::new(),
            stats: TransferStats::default(),
        }
    }

    /// Jobs handed to connector `c`'s worker.
    pub(crate) fn on_jobs(&mut self, c: ConnectorId, jobs: &[WorkerJob], now: Duration) {
        for job in jobs {
            // The offload tier's copies are counted by the tier itself (`TierStats`).
            let WorkerJob::Pd(job) = job else { continue };
            match job {
                PdJob::Publish { hold, blocks, .. } => {
                    self.stats.n_exports_started_total += 1;
                    self.exports.insert((c, *hold), blocks.len() as u64);
                }
                PdJob::Fetch { hold, blocks, .. } => {
                    self.stats.n_loads_started_total += 1;
                    self.loads.insert((c, *hold), (blocks.len() as u64, now));
                }
                PdJob::CancelFetch { hold, why } => {
                    if self.loads.contains_key(&(c, *hold)) {
                        self.cancels.insert((c, *hold), *why);
                    }
                }
                PdJob::Unpublish { .. } | PdJob::Release { .. } => {}
            }
        }
    }

    /// A report from connector `c`'s worker. A second end of the same hold (an export
    /// unpublished after its pull) counts nothing.
    pub(crate) fn on_report(&mut self, c: ConnectorId, report: &WorkerReport, now: Duration) {
        let WorkerReport::Pd(report) = report else {
            return;
        };
        match report {
            PdReport::ExportPulled { hold } => {
                if let Some(n_blocks) = self.exports.remove(&(c, *hold)) {
                    self.stats.n_exports_pulled_total += 1;
                    self.stats.bytes_total += n_blocks * self.block_bytes;
                }
            }
            PdReport::ExportGone { hold } => {
                if self.exports.remove(&(c, *hold)).is_some() {
                    self.stats.n_exports_expired_total += 1;
                }
            }
            PdReport::FetchDone { hold, result } => {
                let Some((n_blocks, started)) = self.loads.remove(&(c, *hold)) else {
                    return;
                };
                let cancel = self.cancels.remove(&(c, *hold));
                match result {
                    Ok(()) => {
                        self.stats.n_loads_finished_total += 1;
                        self.stats.bytes_total += n_blocks * self.block_bytes;
                        self.stats.load_seconds_total += now.saturating_sub(started).as_secs_f64();
                    }
                    Err(e) => {
                        self.stats.n_loads_failed_total += 1;
                        // The scheduler's reason for a cancel is what the worker cannot know.
                        let end = match cancel {
                            Some(FetchCancel::TimedOut) => FetchEnd::TimedOut,
                            Some(FetchCancel::Retracted) => FetchEnd::Cancelled,
                            None => e.end,
                        };
                        *match end {
                            FetchEnd::Failed => &mut self.stats.n_loads_broken_total,
                            FetchEnd::TimedOut => &mut self.stats.n_loads_timed_out_total,
                            FetchEnd::Cancelled => &mut self.stats.n_loads_cancelled_total,
                            FetchEnd::Refused => &mut self.stats.n_loads_refused_total,
                        } += 1;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{BlockId, FetchError, FetchFailure};

    #[test]
    fn counts_each_transfer_once_by_how_it_ended() {
        let mut t = TransferTally::new(100);
        let c = ConnectorId(0);
        let now = Duration::from_secs(1);
        let publish = |hold| {
            WorkerJob::Pd(PdJob::Publish {
                hold: TransferId(hold),
                token: String::new(),
                weight_version: String::new(),
                lora: None,
                blocks: BlockId::list([1, 2]),
                prompt_hash: [0; 32],
                n_tokens: 8,
            })
        };
        let fetch = |hold| {
            WorkerJob::Pd(PdJob::Fetch {
                hold: TransferId(hold),
                remote_engine_id: String::new(),
                remote_host: None,
                remote_port: None,
                token: String::new(),
                weight_version: String::new(),
                lora: None,
                prompt_hash: [0; 32],
                first_block: 0,
                src_blocks: BlockId::list([5, 6, 7]),
                blocks: BlockId::list([1, 2, 3]),
            })
        };
        t.on_jobs(c, &[publish(1), publish(2), fetch(3), fetch(4)], now);
        t.on_report(
            c,
            &WorkerReport::Pd(PdReport::ExportPulled {
                hold: TransferId(1),
            }),
            now,
        );
        t.on_report(
            c,
            &WorkerReport::Pd(PdReport::ExportGone {
                hold: TransferId(1),
            }),
            now,
        );
        t.on_report(
            c,
            &WorkerReport::Pd(PdReport::ExportGone {
                hold: TransferId(2),
            }),
            now,
        );
        let done = |hold, result| {
            WorkerReport::Pd(PdReport::FetchDone {
                hold: TransferId(hold),
                result,
            })
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
                n_loads_broken_total: 1,
                bytes_total: 500,
                load_seconds_total: 0.0,
                ..TransferStats::default()
            }
        );
    }

    #[test]
    fn a_refused_a_timed_out_a_cancelled_and_a_broken_load_are_counted_apart() {
        let mut t = TransferTally::new(100);
        let c = ConnectorId(0);
        let now = Duration::from_secs(1);
        let fetch = |hold| {
            WorkerJob::Pd(PdJob::Fetch {
                hold: TransferId(hold),
                remote_engine_id: String::new(),
                remote_host: None,
                remote_port: None,
                token: String::new(),
                weight_version: String::new(),
                lora: None,
                prompt_hash: [0; 32],
                first_block: 0,
                src_blocks: vec![BlockId(5)],
                blocks: vec![BlockId(1)],
            })
        };
        let done = |hold, e| {
            WorkerReport::Pd(PdReport::FetchDone {
                hold: TransferId(hold),
                result: Err(e),
            })
        };
        t.on_jobs(c, &[fetch(1), fetch(2), fetch(3), fetch(4), fetch(5)], now);
        // P refused the pull: the export was revoked.
        t.on_report(
            c,
            &done(1, FetchError::refused(FetchFailure::Revoked, "")),
            now,
        );
        // The load's bound ran out: the scheduler cancelled it, the worker saw a cancel.
        let cancel = |hold, why| {
            WorkerJob::Pd(PdJob::CancelFetch {
                hold: TransferId(hold),
                why,
            })
        };
        t.on_jobs(c, &[cancel(2, FetchCancel::TimedOut)], now);
        t.on_report(c, &done(2, FetchError::cancelled(0)), now);
        // A read on the link timed out.
        t.on_report(c, &done(3, FetchError::timed_out(1, "read timed out")), now);
        // A cache reset retracted it.
        t.on_jobs(c, &[cancel(4, FetchCancel::Retracted)], now);
        t.on_report(c, &done(4, FetchError::cancelled(0)), now);
        // The link broke.
        t.on_report(c, &done(5, FetchError::fault(0, "reset")), now);
        assert_eq!(
            t.stats,
            TransferStats {
                n_loads_started_total: 5,
                n_loads_failed_total: 5,
                n_loads_broken_total: 1,
                n_loads_timed_out_total: 2,
                n_loads_cancelled_total: 1,
                n_loads_refused_total: 1,
                ..TransferStats::default()
            }
        );
    }
}
