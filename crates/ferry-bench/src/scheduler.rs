//! `ferry bench scheduler`: replays a request trace through the core scheduler with a fake
//! model and prints step-time figures.
//!
//! The trace is gzip'd JSON lines, each `{"request_id", "prompt_token_ids", "max_tokens"}`.
//! Every request is added before the first step; each step is one `StepDriver` step
//! (schedule → fake model → feed back), and only the core's part is timed: the step less the
//! fake model's own time (it times itself), then handing the plan back. The fake model gives
//! request `i` (its line index) the token `(i*7 + n_output_tokens_so_far) % 32000 + 1`.
//!
//! With `--kv-connector`, the real connectors are registered on the core (P/D's producer or
//! consumer side, the offload tier) and the fake model is also their worker: it answers every
//! job at once, as a worker whose copies and transfers take no time would (`FakeModel`'s
//! `run_connector_work`, not timed), and its reports reach the core after the step, as the
//! engine delivers them between steps. Delivering them (`on_worker_report`) is timed with the
//! step: it is the core's work (freeing ended holds, moving landed loads on). So the figures
//! are the scheduler's cost with the connectors on, not the transfers'. A step that only
//! hands out connector work (D's first step: every admission starts a load) counts as a step.

use std::convert::Infallible;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry_core::{
    AllowedPeers, ConnectorId, FetchError, ImportSpec, ModelOutput, OffloadConfig,
    OffloadConnector, OffloadPolicy, PdConfig, PdConnector, PdRole, ReqIdx, SampledToken,
    SamplingParams, Scheduler, SchedulerConfig, Step, StepDriver, StepModel, StepPlan, StepWork,
    TokenId, TransferRequest, WorkPhase, WorkerJob, WorkerReport,
};
use ferry_core::{BlockId, PdJob, PdReport, TierJob, TierReport};
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
    /// KV connectors to register on the core, in order (comma-separated or repeated):
    /// `pd-producer` (every request exports its KV when it finishes; each export is pulled at
    /// once), `pd-consumer` (every request loads its prompt's KV from a P; each load lands at
    /// once), `offload` (the CPU tier stores every full block; stores and loads complete at
    /// once). Default: none.
    #[arg(long = "kv-connector", value_enum, value_delimiter = ',')]
    kv_connectors: Vec<BenchConnector>,
    /// The offload tier's size, in KV blocks (with `--kv-connector offload`). Default: the
    /// pool's `--n-blocks`.
    #[arg(long)]
    kv_offload_blocks: Option<usize>,
}

/// A connector `ferry bench scheduler` can register (`--kv-connector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchConnector {
    /// P of P/D: `PdConnector` as a producer; every request asks to export its KV.
    PdProducer,
    /// D of P/D: `PdConnector` as a consumer; every request names an export of its whole
    /// prompt on a P.
    PdConsumer,
    /// The CPU offload tier: `OffloadConnector`, LRU, one KV block per offloaded block.
    Offload,
}

impl BenchConnector {
    fn name(self) -> &'static str {
        match self {
            Self::PdProducer => "pd-producer",
            Self::PdConsumer => "pd-consumer",
            Self::Offload => "offload",
        }
    }
}

/// The connectors a replay registers, and the tier's size.
#[derive(Debug, Clone, Default)]
pub struct Connectors {
    pub kinds: Vec<BenchConnector>,
    /// The offload tier's capacity, in KV blocks.
    pub offload_blocks: usize,
}

impl Connectors {
    /// The names, comma-separated; `none` for none.
    fn label(&self) -> String {
        if self.kinds.is_empty() {
            return "none".to_owned();
        }
        let names: Vec<_> = self.kinds.iter().map(|k| k.name()).collect();
        names.join(",")
    }

    /// Registers each connector on `sched`, in order.
    fn register(&self, sched: &mut Scheduler) -> anyhow::Result<()> {
        let block_size = sched.config().block_size;
        let has = |k| self.kinds.contains(&k);
        if has(BenchConnector::PdProducer) && has(BenchConnector::PdConsumer) {
            bail!("--kv-connector: pd-producer and pd-consumer are two engines; pick one");
        }
        for (i, &kind) in self.kinds.iter().enumerate() {
            if self.kinds[..i].contains(&kind) {
                bail!("--kv-connector: {} given twice", kind.name());
            }
            match kind {
                BenchConnector::PdProducer | BenchConnector::PdConsumer => {
                    let (role, engine_id) = if kind == BenchConnector::PdProducer {
                        (PdRole::Producer, BENCH_P)
                    } else {
                        (PdRole::Consumer, "bench-d")
                    };
                    sched.add_connector(Box::new(PdConnector::new(PdConfig {
                        role,
                        engine_id: engine_id.to_owned(),
                        host: Some(BENCH_P_HOST.to_owned()),
                        port: Some(BENCH_P_PORT),
                        secret: [7; 32],
                        block_size,
                        allowed_peers: AllowedPeers::default(),
                    })));
                }
                BenchConnector::Offload => {
                    // Only the arithmetic of host memory matters here: one byte per block.
                    let config = OffloadConfig {
                        block_size,
                        blocks_per_slot: 1,
                        block_bytes: 1,
                        capacity_bytes: self.offload_blocks as u64,
                        policy: OffloadPolicy::Lru,
                    };
                    config
                        .validate()
                        .map_err(|e| anyhow::anyhow!("--kv-offload-blocks: {e}"))?;
                    sched.add_connector(Box::new(OffloadConnector::new(config)));
                }
            }
        }
        Ok(())
    }

    /// The transfer request `line` (its index in the trace) arrives with, on a core with
    /// `block_size` and `weight_version`: what the edge would parse its parameters into.
    fn transfer_params(
        &self,
        line: usize,
        prompt_len: usize,
        block_size: usize,
        weight_version: &str,
    ) -> Option<TransferRequest> {
        if self.kinds.contains(&BenchConnector::PdProducer) {
            return Some(TransferRequest::Export);
        }
        if self.kinds.contains(&BenchConnector::PdConsumer) {
            // What P's export of the whole prompt would carry (P computed every prompt token).
            let n_blocks = prompt_len.div_ceil(block_size) as u32;
            return Some(TransferRequest::Import(ImportSpec {
                remote_engine_id: BENCH_P.to_owned(),
                remote_block_ids: (1..=n_blocks).map(BlockId).collect(),
                remote_host: Some(BENCH_P_HOST.to_owned()),
                remote_port: Some(BENCH_P_PORT),
                weight_version: weight_version.to_owned(),
                lora: None,
                export_token: format!("export-{line}"),
                n_tokens: prompt_len,
            }));
        }
        None
    }
}

/// The P that P/D runs name (the bench's own engine as a producer, D's exports' source).
const BENCH_P: &str = "bench-p";
const BENCH_P_HOST: &str = "127.0.0.1";
const BENCH_P_PORT: u16 = 1;

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
    /// The connectors registered (`--kv-connector`), comma-separated; `none` without.
    pub kv_connector: String,
    /// What their workers were asked to do (all zero without connectors).
    pub connector_jobs: JobCounts,
    pub prefix_cache_hit_rate: f64,
    pub output_tokens: u64,
    pub preemptions: u64,
    pub peak_rss_mib: f64,
    pub block_hash: &'static str,
}

/// Worker jobs the fake model answered, by kind, and the reports it sent back.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct JobCounts {
    /// P: exports published (each pulled at once).
    pub publish: u64,
    /// D: loads fetched from P (each landed at once).
    pub fetch: u64,
    /// D: exports released unread (their requests took no load).
    pub release: u64,
    /// The tier: store and load jobs.
    pub store: u64,
    pub load: u64,
    /// Revocations, cancelled fetches and flushes.
    pub other: u64,
    pub reports: u64,
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
    let connectors = Connectors {
        kinds: args.kv_connectors.clone(),
        offload_blocks: args.kv_offload_blocks.unwrap_or(args.n_blocks as usize),
    };
    let mut steps = Vec::new();
    let report = replay(&trace, config, &connectors, args.check, &mut steps)?;
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

/// Replays `trace` to completion with `connectors` registered and measures it, appending one
/// record per step to `steps`. With `check`, verifies block ownership after every step. Fails
/// if a request is rejected, lost, or the run stalls.
pub fn replay(
    trace: &[TraceRequest],
    config: SchedulerConfig,
    connectors: &Connectors,
    check: bool,
    steps: &mut Vec<StepRecord>,
) -> anyhow::Result<Report> {
    let max_num_seqs = config.max_num_seqs;
    let block_size = config.block_size;
    let mut sched = Scheduler::new(config)?;
    connectors.register(&mut sched)?;
    let mut driver = StepDriver::new(sched, FakeModel::default());
    for (i, r) in trace.iter().enumerate() {
        let params = connectors.transfer_params(
            i,
            r.prompt_token_ids.len(),
            block_size,
            driver.sched.weight_version(),
        );
        let idx = driver.sched.add_request_with_transfer(
            r.request_id.clone(),
            r.prompt_token_ids.clone(),
            SamplingParams::greedy(r.max_tokens),
            params,
        )?;
        driver.model.set_line(idx, i as u64);
    }
    let mut step_ns = Vec::new();
    let mut steady_ns = Vec::new();
    let mut output_tokens = 0u64;
    let mut n_finished = 0usize;
    let mut reports = Vec::new();
    while driver.sched.n_live() > 0 || driver.sched.needs_idle_steps() {
        // Timed: the step less the fake model's own time (its forward and its connector
        // work), then the workers' reports reaching the core, then handing the plan back.
        driver.model.elapsed = Duration::ZERO;
        let t0 = Instant::now();
        let Step { plan, outputs, .. } = driver.step()?;
        let mut elapsed = t0.elapsed().saturating_sub(driver.model.elapsed);
        if plan.is_idle() {
            bail!(
                "stalled: nothing scheduled with {} requests live",
                driver.sched.n_live()
            );
        }
        let steady = is_steady_decode(&plan, max_num_seqs);
        let n_reqs = plan.reqs.len();
        let n_tokens = plan.num_tokens();
        std::mem::swap(&mut reports, &mut driver.model.reports);
        let t1 = Instant::now();
        for (connector, report) in reports.drain(..) {
            driver.sched.on_worker_report(connector, report);
        }
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
    if n_finished != trace.len() || stats.n_blocks_used != 0 || stats.n_transfers != 0 {
        bail!(
            "{} of {} requests finished, {} blocks still used, {} transfers still held",
            n_finished,
            trace.len(),
            stats.n_blocks_used,
            stats.n_transfers
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
        kv_connector: connectors.label(),
        connector_jobs: driver.model.jobs,
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
/// `(i*7 + n_output_tokens_so_far) % 32000 + 1`. It is also every connector's worker, and
/// answers each job at once (see the module docs). It times itself, so that the step time can
/// leave it out.
#[derive(Debug, Default)]
struct FakeModel {
    /// `ReqIdx` → line index: slots are only reused after a request finishes, and every
    /// request is added before the first step, so this stays valid for the whole run.
    line_of: Vec<u64>,
    /// The last output, handed back for reuse.
    spare: ModelOutput,
    /// Time spent in `compute` and `run_connector_work` since the caller last zeroed it.
    elapsed: Duration,
    /// The workers' reports, for the core after the step.
    reports: Vec<(ConnectorId, WorkerReport)>,
    jobs: JobCounts,
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
            let token = TokenId(((i * 7 + u64::from(spec.output_idx)) % 32000 + 1) as u32);
            output.sampled.push(SampledToken {
                req: r.req,
                token,
                logprob: 0.0,
                top_logprobs: Vec::new(),
            });
        }
        self.elapsed += t0.elapsed();
        Ok(output)
    }

    /// What a worker whose copies and transfers take no time reports: every export is pulled
    /// (P), every fetch lands (D), every store and load completes (the tier), every
    /// revocation or cancellation is acknowledged.
    fn run_connector_work(&mut self, work: &[StepWork], _phase: WorkPhase) {
        let t0 = Instant::now();
        for w in work {
            for job in &w.jobs {
                let report: Option<WorkerReport> = match job {
                    WorkerJob::Pd(PdJob::Publish { hold, .. }) => {
                        self.jobs.publish += 1;
                        Some(PdReport::ExportPulled { hold: *hold }.into())
                    }
                    WorkerJob::Pd(PdJob::Fetch { hold, .. }) => {
                        self.jobs.fetch += 1;
                        Some(
                            PdReport::FetchDone {
                                hold: *hold,
                                result: Ok(()),
                            }
                            .into(),
                        )
                    }
                    WorkerJob::Pd(PdJob::Release { .. }) => {
                        self.jobs.release += 1;
                        None
                    }
                    WorkerJob::Tier(TierJob::Store { hold, epoch, .. }) => {
                        self.jobs.store += 1;
                        Some(
                            TierReport::StoreDone {
                                hold: *hold,
                                epoch: *epoch,
                                ok: true,
                            }
                            .into(),
                        )
                    }
                    WorkerJob::Tier(TierJob::Load { hold, epoch, .. }) => {
                        self.jobs.load += 1;
                        Some(
                            TierReport::LoadDone {
                                hold: *hold,
                                epoch: *epoch,
                                result: Ok(()),
                            }
                            .into(),
                        )
                    }
                    WorkerJob::Pd(PdJob::Unpublish { hold, .. }) => {
                        self.jobs.other += 1;
                        Some(PdReport::ExportGone { hold: *hold }.into())
                    }
                    WorkerJob::Pd(PdJob::CancelFetch { hold, .. }) => {
                        self.jobs.other += 1;
                        Some(
                            PdReport::FetchDone {
                                hold: *hold,
                                result: Err(FetchError::cancelled(0)),
                            }
                            .into(),
                        )
                    }
                    WorkerJob::Tier(TierJob::Flush { .. }) => {
                        self.jobs.other += 1;
                        None
                    }
                };
                if let Some(report) = report {
                    self.jobs.reports += 1;
                    self.reports.push((w.connector, report));
                }
            }
        }
        self.elapsed += t0.elapsed();
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
    println!("kv connectors         {}", r.kv_connector);
    if r.connector_jobs != JobCounts::default() {
        let j = &r.connector_jobs;
        println!(
            "worker jobs           publish {}  fetch {}  release {}  store {}  load {}  other {}  ({} reports)",
            j.publish, j.fetch, j.release, j.store, j.load, j.other, j.reports
        );
    }
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
                            TokenId(p as u32 + 1)
                        } else {
                            TokenId((i * 1000 + p) as u32)
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
        let report = replay(
            &trace,
            small_config(512),
            &Connectors::default(),
            true,
            &mut Vec::new(),
        )
        .unwrap();
        assert_eq!(report.output_tokens, want);
        assert_eq!(report.requests, 40);
        assert!(report.prefix_cache_hit_rate > 0.0);
    }

    #[test]
    fn replay_survives_preemption_under_a_tight_pool() {
        let trace = synthetic(40);
        let want: u64 = trace.iter().map(|r| u64::from(r.max_tokens)).sum();
        let report = replay(
            &trace,
            small_config(40),
            &Connectors::default(),
            true,
            &mut Vec::new(),
        )
        .unwrap();
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
            ("a", &TokenId::list([1, 2, 3])[..], 4)
        );
    }

    fn connectors(kinds: &[BenchConnector], offload_blocks: usize) -> Connectors {
        Connectors {
            kinds: kinds.to_vec(),
            offload_blocks,
        }
    }

    fn run_with(kinds: &[BenchConnector], n_blocks: u32, offload_blocks: usize) -> Report {
        let c = connectors(kinds, offload_blocks);
        replay(
            &synthetic(40),
            small_config(n_blocks),
            &c,
            true,
            &mut Vec::new(),
        )
        .unwrap()
    }

    #[test]
    fn a_producer_exports_every_request_and_each_export_is_pulled() {
        let want: u64 = synthetic(40).iter().map(|r| u64::from(r.max_tokens)).sum();
        let report = run_with(&[BenchConnector::PdProducer], 512, 0);
        assert_eq!(report.output_tokens, want);
        assert_eq!(report.kv_connector, "pd-producer");
        let jobs = report.connector_jobs;
        assert_eq!((jobs.publish, jobs.reports), (40, 40), "{jobs:?}");
        assert_eq!((jobs.fetch, jobs.store, jobs.load), (0, 0, 0), "{jobs:?}");
    }

    #[test]
    fn a_consumer_loads_or_releases_every_export_and_outputs_the_same_tokens() {
        let none = run_with(&[], 512, 0);
        let report = run_with(&[BenchConnector::PdConsumer], 512, 0);
        assert_eq!(report.output_tokens, none.output_tokens);
        assert_eq!(report.kv_connector, "pd-consumer");
        let jobs = report.connector_jobs;
        assert!(jobs.fetch > 0, "{jobs:?}");
        assert_eq!(jobs.fetch + jobs.release, 40, "{jobs:?}");
        assert_eq!(jobs.reports, jobs.fetch, "{jobs:?}");
    }

    #[test]
    fn the_tier_stores_blocks_and_loads_them_back_under_a_tight_pool() {
        let none = run_with(&[], 40, 0);
        let report = run_with(&[BenchConnector::Offload], 40, 512);
        assert_eq!(report.output_tokens, none.output_tokens);
        assert_eq!(report.kv_connector, "offload");
        let jobs = report.connector_jobs;
        assert!(jobs.store > 0 && jobs.load > 0, "{jobs:?}");
        assert_eq!(jobs.reports, jobs.store + jobs.load, "{jobs:?}");
    }

    #[test]
    fn the_tier_and_a_consumer_run_together_and_one_engine_is_not_both_sides() {
        let report = run_with(
            &[BenchConnector::Offload, BenchConnector::PdConsumer],
            40,
            512,
        );
        assert_eq!(report.kv_connector, "offload,pd-consumer");
        assert!(
            report.connector_jobs.fetch > 0,
            "{:?}",
            report.connector_jobs
        );
        let both = connectors(&[BenchConnector::PdProducer, BenchConnector::PdConsumer], 0);
        let err = replay(
            &synthetic(4),
            small_config(64),
            &both,
            false,
            &mut Vec::new(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("pick one"), "{err}");
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let mut v: Vec<u64> = (1..=100).map(|x| x * 1000).collect();
        assert_eq!(percentile_us(&mut v, 0.5), 50.0);
        assert_eq!(percentile_us(&mut v, 0.99), 99.0);
    }
}
