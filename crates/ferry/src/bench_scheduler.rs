//! `ferry bench scheduler`: replays a request trace through the core scheduler with a fake
//! model and prints step-time figures.
//!
//! The trace is gzip'd JSON lines, each `{"request_id", "prompt_token_ids", "max_tokens"}`.
//! Every request is added before the first step; each step is one `StepDriver` step
//! (schedule → fake model → feed back), and only `schedule()` and `on_step_output()` are timed
//! (the fake model times itself and its time is subtracted). The fake model gives request
//! `i` (its line index) the token `(i*7 + n_output_tokens_so_far) % 32000 + 1`.

use std::convert::Infallible;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry_core::{
    ModelOutput, ReqIdx, SampledToken, SamplingParams, Scheduler, SchedulerConfig, Step,
    StepDriver, StepModel, StepPlan, TokenId,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Gzip'd JSON-lines trace.
    #[arg(long)]
    trace: PathBuf,
    /// Print one JSON line instead of a readable summary.
    #[arg(long)]
    json: bool,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks in the pool, the null block included.
    #[arg(long, default_value_t = 65536)]
    n_blocks: u32,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prefix_caching: bool,
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    chunked_prefill: bool,
    /// Replay only the first N requests (for profiling on a short trace).
    #[arg(long)]
    limit: Option<usize>,
    /// Check block ownership after every step (outside the timed region; slow).
    #[arg(long)]
    check: bool,
    /// Write one line per step (`step us n_reqs n_tokens`) to this file, for profiling.
    #[arg(long)]
    dump_steps: Option<PathBuf>,
}

/// One line of the trace.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<TokenId>,
    pub max_tokens: u32,
}

/// The figures the benchmark prints.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub requests: usize,
    pub steps: u64,
    pub step_mean_us: f64,
    pub step_p50_us: f64,
    pub step_p99_us: f64,
    /// Mean over steps with `max_num_seqs` requests running, all decoding (0 if none).
    pub steady_decode_mean_us: f64,
    pub steady_decode_steps: u64,
    pub prefix_cache_hit_rate: f64,
    pub output_tokens: u64,
    pub preemptions: u64,
    pub peak_rss_mib: f64,
    pub block_hash: &'static str,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut trace = read_trace(&args.trace)?;
    if let Some(n) = args.limit {
        trace.truncate(n);
    }
    let config = SchedulerConfig {
        block_size: args.block_size,
        n_blocks: args.n_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        enable_prefix_caching: args.prefix_caching,
        enable_chunked_prefill: args.chunked_prefill,
        eos_token_ids: Vec::new(),
        weight_version: "bench".to_owned(),
        ..SchedulerConfig::default()
    };
    let mut steps = Vec::new();
    let report = replay(&trace, config, args.check, &mut steps)?;
    if let Some(path) = &args.dump_steps {
        let text: String = steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                format!(
                    "{i} {:.1} {} {}\n",
                    s.ns as f64 / 1000.0,
                    s.n_reqs,
                    s.n_tokens
                )
            })
            .collect();
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_summary(&report);
    }
    Ok(())
}

/// Reads a gzip'd JSON-lines trace.
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<TraceRequest>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let reader = std::io::BufReader::new(flate2::read::GzDecoder::new(file));
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading {} line {}", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let req: TraceRequest = serde_json::from_str(&line)
            .with_context(|| format!("parsing {} line {}", path.display(), i + 1))?;
        out.push(req);
    }
    Ok(out)
}

/// One step's timing and size.
#[derive(Debug, Clone, Copy)]
pub struct StepRecord {
    pub ns: u64,
    pub n_reqs: usize,
    pub n_tokens: usize,
}

/// Replays `trace` to completion and measures it, appending one record per step to `steps`.
/// With `check`, verifies block ownership after every step. Fails if a request is rejected,
/// lost, or the run stalls.
pub fn replay(
    trace: &[TraceRequest],
    config: SchedulerConfig,
    check: bool,
    steps: &mut Vec<StepRecord>,
) -> anyhow::Result<Report> {
    let max_num_seqs = config.max_num_seqs;
    let mut driver = StepDriver::new(Scheduler::new(config)?, FakeModel::default());
    for (i, r) in trace.iter().enumerate() {
        let idx = driver.sched.add_request(
            r.request_id.clone(),
            r.prompt_token_ids.clone(),
            SamplingParams::greedy(r.max_tokens),
        )?;
        driver.model.set_line(idx, i as u64);
    }
    let mut step_ns = Vec::new();
    let mut steady_ns = Vec::new();
    let mut output_tokens = 0u64;
    let mut n_finished = 0usize;
    while driver.sched.n_live() > 0 {
        // Timed: the step less the fake model's own time, then handing the plan back.
        let t0 = Instant::now();
        let Step { plan, outputs, .. } = driver.step()?;
        let mut elapsed = t0.elapsed().saturating_sub(driver.model.elapsed);
        if plan.is_empty() {
            bail!(
                "stalled: nothing scheduled with {} requests live",
                driver.sched.n_live()
            );
        }
        let steady = is_steady_decode(&plan, max_num_seqs);
        let n_reqs = plan.reqs.len();
        let n_tokens = plan.num_tokens();
        let t1 = Instant::now();
        driver.sched.recycle_plan(plan);
        elapsed += t1.elapsed();
        step_ns.push(elapsed.as_nanos() as u64);
        steps.push(StepRecord {
            ns: elapsed.as_nanos() as u64,
            n_reqs,
            n_tokens,
        });
        if steady {
            steady_ns.push(elapsed.as_nanos() as u64);
        }
        output_tokens += outputs.iter().filter(|o| o.sampled.is_some()).count() as u64;
        n_finished += outputs.iter().filter(|o| o.finished.is_some()).count();
        if check {
            driver.check()?;
        }
    }
    driver.sched.check_ownership()?;
    let stats = driver.sched.stats();
    if n_finished != trace.len() || stats.n_blocks_used != 0 {
        bail!(
            "{} of {} requests finished, {} blocks still used",
            n_finished,
            trace.len(),
            stats.n_blocks_used
        );
    }
    Ok(Report {
        requests: trace.len(),
        steps: step_ns.len() as u64,
        step_mean_us: mean_us(&step_ns),
        step_p50_us: percentile_us(&mut step_ns, 0.50),
        step_p99_us: percentile_us(&mut step_ns, 0.99),
        steady_decode_mean_us: mean_us(&steady_ns),
        steady_decode_steps: steady_ns.len() as u64,
        prefix_cache_hit_rate: stats.prefix_hit_tokens as f64
            / (stats.prefix_query_tokens.max(1)) as f64,
        output_tokens,
        preemptions: stats.n_preemptions,
        peak_rss_mib: peak_rss_mib(),
        block_hash: "blake3",
    })
}

/// A step with a full batch of single-token decodes.
fn is_steady_decode(plan: &StepPlan, max_num_seqs: usize) -> bool {
    plan.reqs.len() == max_num_seqs
        && plan
            .reqs
            .iter()
            .all(|r| r.tokens.len() == 1 && r.sample.is_some())
}

/// The fake model: request `i` (its line in the trace) gets
/// `(i*7 + n_output_tokens_so_far) % 32000 + 1`. It times itself, so that the step time can
/// leave it out.
#[derive(Debug, Default)]
struct FakeModel {
    /// `ReqIdx` → line index: slots are only reused after a request finishes, and every
    /// request is added before the first step, so this stays valid for the whole run.
    line_of: Vec<u64>,
    /// The last output, handed back for reuse.
    spare: ModelOutput,
    /// Time spent in the last `compute`.
    elapsed: Duration,
}

impl FakeModel {
    fn set_line(&mut self, idx: ReqIdx, line: u64) {
        let slot = idx.0 as usize;
        if self.line_of.len() <= slot {
            self.line_of.resize(slot + 1, 0);
        }
        self.line_of[slot] = line;
    }
}

impl StepModel for FakeModel {
    type Error = Infallible;

    fn compute(&mut self, _: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, Infallible> {
        let t0 = Instant::now();
        let mut output = std::mem::take(&mut self.spare);
        output.sampled.clear();
        for r in &plan.reqs {
            let Some(spec) = r.sample else { continue };
            let i = self.line_of[r.req.0 as usize];
            let token = ((i * 7 + u64::from(spec.output_idx)) % 32000 + 1) as TokenId;
            output.sampled.push(SampledToken {
                req: r.req,
                token,
                logprob: 0.0,
                top_logprobs: Vec::new(),
            });
        }
        self.elapsed = t0.elapsed();
        Ok(output)
    }

    fn recycle_output(&mut self, output: ModelOutput) {
        self.spare = output;
    }
}

fn mean_us(ns: &[u64]) -> f64 {
    if ns.is_empty() {
        return 0.0;
    }
    ns.iter().sum::<u64>() as f64 / ns.len() as f64 / 1000.0
}

/// Nearest-rank percentile.
fn percentile_us(ns: &mut [u64], q: f64) -> f64 {
    if ns.is_empty() {
        return 0.0;
    }
    ns.sort_unstable();
    let rank = ((q * ns.len() as f64).ceil() as usize).clamp(1, ns.len());
    ns[rank - 1] as f64 / 1000.0
}

/// Peak resident set (VmHWM) from /proc/self/status; 0 where that is unavailable.
fn peak_rss_mib() -> f64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return 0.0;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn print_summary(r: &Report) {
    println!("requests              {}", r.requests);
    println!("steps                 {}", r.steps);
    println!(
        "step time (us)        mean {:.1}  p50 {:.1}  p99 {:.1}",
        r.step_mean_us, r.step_p50_us, r.step_p99_us
    );
    println!(
        "steady decode (us)    mean {:.1} over {} steps",
        r.steady_decode_mean_us, r.steady_decode_steps
    );
    println!("prefix cache hit rate {:.4}", r.prefix_cache_hit_rate);
    println!("output tokens         {}", r.output_tokens);
    println!("preemptions           {}", r.preemptions);
    println!("peak RSS (MiB)        {:.1}", r.peak_rss_mib);
    println!("block hash            {}", r.block_hash);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small synthetic trace: every other request shares a 40-token prefix.
    fn synthetic(n: usize) -> Vec<TraceRequest> {
        (0..n)
            .map(|i| {
                let shared = i % 2 == 0;
                let len = 20 + (i * 37) % 90;
                let prompt = (0..len)
                    .map(|p| {
                        if shared && p < 40 {
                            p as TokenId + 1
                        } else {
                            (i * 1000 + p) as TokenId
                        }
                    })
                    .collect();
                TraceRequest {
                    request_id: format!("r{i}"),
                    prompt_token_ids: prompt,
                    max_tokens: 5 + (i % 7) as u32,
                }
            })
            .collect()
    }

    fn small_config(n_blocks: u32) -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            n_blocks,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            max_model_len: 256,
            ..SchedulerConfig::default()
        }
    }

    #[test]
    fn replay_produces_every_output_token_and_frees_all_blocks() {
        let trace = synthetic(40);
        let want: u64 = trace.iter().map(|r| u64::from(r.max_tokens)).sum();
        let report = replay(&trace, small_config(512), true, &mut Vec::new()).unwrap();
        assert_eq!(report.output_tokens, want);
        assert_eq!(report.requests, 40);
        assert!(report.prefix_cache_hit_rate > 0.0);
    }

    #[test]
    fn replay_survives_preemption_under_a_tight_pool() {
        let trace = synthetic(40);
        let want: u64 = trace.iter().map(|r| u64::from(r.max_tokens)).sum();
        let report = replay(&trace, small_config(40), true, &mut Vec::new()).unwrap();
        assert_eq!(report.output_tokens, want);
        assert!(report.preemptions > 0, "the pool was meant to be too small");
    }

    #[test]
    fn trace_lines_parse_from_gzip() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("ferry-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).unwrap(),
            flate2::Compression::fast(),
        );
        writeln!(
            gz,
            r#"{{"request_id":"a","prompt_token_ids":[1,2,3],"max_tokens":4}}"#
        )
        .unwrap();
        writeln!(
            gz,
            r#"{{"request_id":"b","prompt_token_ids":[5],"max_tokens":1}}"#
        )
        .unwrap();
        gz.finish().unwrap();
        let t = read_trace(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(
            (
                t[0].request_id.as_str(),
                &t[0].prompt_token_ids[..],
                t[0].max_tokens
            ),
            ("a", &[1, 2, 3][..], 4)
        );
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let mut v: Vec<u64> = (1..=100).map(|x| x * 1000).collect();
        assert_eq!(percentile_us(&mut v, 0.5), 50.0);
        assert_eq!(percentile_us(&mut v, 0.99), 99.0);
    }
}
