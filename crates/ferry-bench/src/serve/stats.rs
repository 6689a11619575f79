//! Summaries of per-request timings: mean and nearest-rank percentiles, and the report that
//! `ferry bench serve` prints.

use serde::Serialize;

use super::client::{RequestError, Timing};

/// Mean, median and 99th percentile of a set of latencies, in milliseconds. `null` in the
/// JSON when there were no samples (no successful request, or no request with two tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencyMs {
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
}

impl LatencyMs {
    /// Summarises `seconds` (reordered in place).
    pub fn from_seconds(seconds: &mut [f64]) -> Self {
        if seconds.is_empty() {
            return Self::default();
        }
        let mean = seconds.iter().sum::<f64>() / seconds.len() as f64;
        Self {
            mean: Some(mean * 1e3),
            p50: percentile(seconds, 0.50).map(|s| s * 1e3),
            p99: percentile(seconds, 0.99).map(|s| s * 1e3),
        }
    }
}

/// Two runs of one workload (`--baseline-url`) and what the target adds over the baseline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub target: Report,
    pub baseline: Report,
    /// Target minus baseline time to first token (mean, p50, p99), in milliseconds.
    pub ttft_added_ms: LatencyMs,
    /// Target minus baseline end-to-end latency.
    pub e2e_added_ms: LatencyMs,
}

impl Comparison {
    pub fn new(target: Report, baseline: Report) -> Self {
        Self {
            ttft_added_ms: target.ttft_ms.minus(&baseline.ttft_ms),
            e2e_added_ms: target.e2e_ms.minus(&baseline.e2e_ms),
            target,
            baseline,
        }
    }
}

impl LatencyMs {
    /// Each statistic's difference, `None` where either is.
    pub fn minus(&self, other: &Self) -> Self {
        let d = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
        Self {
            mean: d(self.mean, other.mean),
            p50: d(self.p50, other.p50),
            p99: d(self.p99, other.p99),
        }
    }
}

/// The nearest-rank percentile (the smallest sample with at least `q` of the samples at or
/// below it), as `ferry bench scheduler` reports: always a value that was observed.
/// `None` for no samples.
pub fn percentile(samples: &mut [f64], q: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable_by(f64::total_cmp);
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    Some(samples[rank - 1])
}

/// One failed request, as reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failure {
    /// Position of the request in the workload (arrival order).
    pub request_idx: usize,
    pub error: String,
}

/// What `ferry bench serve` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub url: String,
    pub model: String,
    pub n_requests: usize,
    pub n_completed: usize,
    pub n_failed: usize,
    pub failures: Vec<Failure>,
    /// Completed requests whose output token count differed from the `max_tokens` asked
    /// (with `ignore_eos` a server should produce exactly that many).
    pub n_output_len_mismatch: usize,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub duration_s: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub request_throughput_per_s: f64,
    pub output_token_throughput_per_s: f64,
    pub total_token_throughput_per_s: f64,
    pub ttft_ms: LatencyMs,
    /// Per request: (e2e − ttft) / (n_out − 1), over requests with at least two tokens.
    pub tpot_ms: LatencyMs,
    /// Every gap between consecutive token-carrying chunks, over all requests.
    pub itl_ms: LatencyMs,
    pub e2e_ms: LatencyMs,
    /// `1 − Δforward / Δstep` from the server's `/metrics` over the run; `null` when the
    /// server does not export both counters or no step ran.
    pub engine_overhead_fraction: Option<f64>,
}

/// Run-level facts that are not per-request timings.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub url: String,
    pub model: String,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub duration_s: f64,
    pub engine_overhead_fraction: Option<f64>,
}

/// The outcome of one request, with what was asked of it.
#[derive(Debug)]
pub struct Outcome {
    pub prompt_len: u32,
    pub output_len: u32,
    pub result: Result<Timing, RequestError>,
}

/// Builds the report from every request's outcome, in workload order.
pub fn summarise(info: RunInfo, outcomes: &[Outcome]) -> Report {
    let mut failures = Vec::new();
    let (mut ttft, mut tpot, mut itl, mut e2e) = (vec![], vec![], vec![], vec![]);
    let (mut input_tokens, mut output_tokens, mut mismatch) = (0u64, 0u64, 0usize);
    for (request_idx, o) in outcomes.iter().enumerate() {
        let t = match &o.result {
            Ok(t) => t,
            Err(e) => {
                failures.push(Failure {
                    request_idx,
                    error: e.to_string(),
                });
                continue;
            }
        };
        input_tokens += u64::from(t.n_prompt_tokens.unwrap_or(o.prompt_len));
        output_tokens += u64::from(t.n_output_tokens);
        mismatch += usize::from(t.n_output_tokens != o.output_len);
        ttft.push(t.ttft_s);
        e2e.push(t.e2e_s);
        if t.n_output_tokens > 1 {
            tpot.push((t.e2e_s - t.ttft_s) / f64::from(t.n_output_tokens - 1));
        }
        itl.extend_from_slice(&t.itl_s);
    }
    let n_completed = outcomes.len() - failures.len();
    // A zero-length run (every request refused at once) would divide by zero.
    let duration = info.duration_s.max(f64::MIN_POSITIVE);
    Report {
        url: info.url,
        model: info.model,
        n_requests: outcomes.len(),
        n_completed,
        n_failed: failures.len(),
        failures,
        n_output_len_mismatch: mismatch,
        concurrency: info.concurrency,
        request_rate: info.request_rate,
        duration_s: info.duration_s,
        total_input_tokens: input_tokens,
        total_output_tokens: output_tokens,
        request_throughput_per_s: n_completed as f64 / duration,
        output_token_throughput_per_s: output_tokens as f64 / duration,
        total_token_throughput_per_s: (input_tokens + output_tokens) as f64 / duration,
        ttft_ms: LatencyMs::from_seconds(&mut ttft),
        tpot_ms: LatencyMs::from_seconds(&mut tpot),
        itl_ms: LatencyMs::from_seconds(&mut itl),
        e2e_ms: LatencyMs::from_seconds(&mut e2e),
        engine_overhead_fraction: info.engine_overhead_fraction,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), Some(50.0));
        assert_eq!(percentile(&mut v, 0.99), Some(99.0));
        assert_eq!(percentile(&mut v, 1.0), Some(100.0));
        assert_eq!(percentile(&mut v, 0.0), Some(1.0));
        let mut three = [3.0, 1.0, 2.0];
        assert_eq!(percentile(&mut three, 0.5), Some(2.0));
        assert_eq!(percentile(&mut three, 0.99), Some(3.0));
        assert_eq!(percentile(&mut [7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&mut [], 0.5), None);
    }

    #[test]
    fn latency_summary_is_in_milliseconds() {
        let mut s = [0.001, 0.003, 0.002, 0.010];
        let l = LatencyMs::from_seconds(&mut s);
        assert_eq!(l.p50, Some(2.0));
        assert_eq!(l.p99, Some(10.0));
        assert!((l.mean.unwrap() - 4.0).abs() < 1e-12);
        assert_eq!(LatencyMs::from_seconds(&mut []), LatencyMs::default());
    }

    fn ok(ttft_s: f64, e2e_s: f64, n_out: u32, itl_s: Vec<f64>) -> Outcome {
        Outcome {
            prompt_len: 10,
            output_len: 3,
            result: Ok(Timing {
                ttft_s,
                e2e_s,
                itl_s,
                n_output_tokens: n_out,
                n_prompt_tokens: None,
            }),
        }
    }

    #[test]
    fn summary_counts_tokens_latencies_and_failures() {
        let outcomes = [
            ok(0.1, 0.5, 3, vec![0.2, 0.2]),
            Outcome {
                prompt_len: 4,
                output_len: 3,
                result: Err(RequestError::NoDone),
            },
            ok(0.3, 0.3, 1, vec![]),
        ];
        let info = RunInfo {
            url: "u".into(),
            model: "m".into(),
            concurrency: Some(2),
            request_rate: None,
            duration_s: 2.0,
            engine_overhead_fraction: None,
        };
        let r = summarise(info, &outcomes);
        assert_eq!((r.n_completed, r.n_failed), (2, 1));
        assert_eq!(r.failures[0].request_idx, 1);
        assert!(
            r.failures[0].error.contains("[DONE]"),
            "{}",
            r.failures[0].error
        );
        assert_eq!((r.total_input_tokens, r.total_output_tokens), (20, 4));
        assert_eq!(r.n_output_len_mismatch, 1);
        assert_eq!(r.request_throughput_per_s, 1.0);
        assert_eq!(r.output_token_throughput_per_s, 2.0);
        assert_eq!(r.total_token_throughput_per_s, 12.0);
        // Only the 3-token request has a time per output token: (0.5 - 0.1) / 2.
        assert!((r.tpot_ms.p50.unwrap() - 200.0).abs() < 1e-9);
        assert_eq!(r.itl_ms.p99, Some(200.0));
        assert_eq!(r.ttft_ms.p99, Some(300.0));
        assert_eq!(r.e2e_ms.p50, Some(300.0));
    }
}
