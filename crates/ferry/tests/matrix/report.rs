//! The matrix's results: one line per case on stderr (seen with `--nocapture`), and, when
//! `FERRY_MATRIX_OUT` names a file, every result so far as a JSON array in it (rewritten
//! after each case, so the file is whole even when a later case hangs or the run is cut).

use std::sync::Mutex;

use crate::ctx::{CallRecord, Record};
use crate::load::Counts;

/// One case's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CaseResult {
    pub case: String,
    pub tier: &'static str,
    pub model: &'static str,
    /// D's `kv_load_failure_policy`: "fail (default)" or "recompute".
    pub policy: &'static str,
    pub pass: bool,
    /// The reply time of the operation under test (the case's first admin call, unless the
    /// case named another).
    pub reply_ms: Option<f64>,
    pub bound_ms: Option<u64>,
    pub counts: Counts,
    /// Every admin call the case made.
    pub calls: Vec<CallRecord>,
    pub notes: Vec<String>,
    pub counters: std::collections::BTreeMap<&'static str, f64>,
    /// Wall time of the case, its drain included.
    pub wall_ms: u64,
    pub error: Option<String>,
}

impl CaseResult {
    pub fn new(
        case: &str,
        tier: &'static str,
        model: &'static str,
        policy: &'static str,
        record: Record,
        wall_ms: u64,
        error: Option<String>,
    ) -> Self {
        let first = record.calls.get(record.main_call.unwrap_or(0));
        CaseResult {
            case: case.to_owned(),
            tier,
            model,
            policy,
            pass: error.is_none(),
            reply_ms: first.map(|c| c.reply_ms),
            bound_ms: first.map(|c| c.bound_ms),
            counts: record.counts,
            calls: record.calls,
            notes: record.notes,
            counters: record.counters,
            wall_ms,
            error,
        }
    }
}

static RESULTS: Mutex<Vec<CaseResult>> = Mutex::new(Vec::new());

/// Keeps a result: prints it and rewrites the summary file.
pub fn keep(result: CaseResult) {
    eprintln!(
        "matrix: {:<4} {:<48} tier {:<3} {:<12} D {:<14} reply {:>6} ms (bound {:>6}) \
         requests {:>2}: {} finished, {} aborted, {} failed, {} left{}",
        if result.pass { "ok" } else { "FAIL" },
        result.case,
        result.tier,
        result.model,
        result.policy,
        result
            .reply_ms
            .map_or("-".to_owned(), |m| format!("{m:.1}")),
        result.bound_ms.map_or("-".to_owned(), |m| m.to_string()),
        result.counts.n_requests,
        result.counts.n_finished,
        result.counts.n_aborted,
        result.counts.n_failed,
        result.counts.n_disconnected,
        result
            .error
            .as_deref()
            .map_or(String::new(), |e| format!("\n  {e}")),
    );
    let mut all = RESULTS.lock().unwrap();
    all.push(result);
    if let Some(path) = std::env::var_os("FERRY_MATRIX_OUT") {
        let json = serde_json::to_string_pretty(&*all).unwrap();
        std::fs::write(&path, json)
            .unwrap_or_else(|e| panic!("writing FERRY_MATRIX_OUT {}: {e}", path.to_string_lossy()));
    }
}
