//! `ferry bench serve`: a load generator against a running OpenAI-compatible server.
//!
//! It sends streaming `/v1/completions` requests with token-id prompts (greedy, `ignore_eos`,
//! exactly `max_tokens` out), at most `--concurrency` in flight and arriving as a Poisson
//! process at `--request-rate`, and reports throughput and latency (time to first token, time
//! per output token, inter-token latency, end to end) as JSON. Scraping `/metrics` before and
//! after gives the engine's share of step time spent outside the model forward.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

mod client;
mod metrics;
pub(crate) mod sse;
mod stats;
mod workload;

use client::Variant;
use stats::{Outcome, Report, RunInfo};
use workload::{LenDist, RequestSpec, SyntheticWorkload, MAX_SECONDS};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of the server.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Model name to send (default: the first one `/v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 64)]
    num_requests: usize,
    /// Most requests in flight at once (default: no limit).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Requests per second, Poisson arrivals (default: all at once).
    #[arg(long)]
    request_rate: Option<f64>,
    /// Prompt tokens: `N` or `uniform:LO:HI`.
    #[arg(long, default_value = "128")]
    prompt_len: LenDist,
    /// Output tokens (`max_tokens`): `N` or `uniform:LO:HI`.
    #[arg(long, default_value = "128")]
    output_len: LenDist,
    /// JSONL trace instead of the length flags: one object per request with `prompt_len` or
    /// `prompt` (token ids), `output_len`, optional `arrival_s`.
    #[arg(long, conflicts_with_all = ["num_requests", "request_rate", "prompt_len", "output_len"])]
    trace: Option<PathBuf>,
    /// Random prompt token ids are drawn below this.
    #[arg(long, default_value_t = 32000)]
    vocab_size: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Give up on a request after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    request_timeout_s: f64,
    /// Print only the JSON report (else a readable summary, then the JSON).
    #[arg(long)]
    json: bool,
    /// The cost of a structured-output constraint: run the workload unconstrained, then again
    /// with this JSON schema (a file, or the schema itself when it starts with `{`) on every
    /// request, each run under its own `cache_salt` so that neither hits the other's prefix
    /// cache. The report has both runs and the constrained/unconstrained throughput ratio.
    /// Pick a schema the output cannot complete within `--output-len` (e.g. an array with a
    /// large `minItems`), or a request ends early and the ratio compares unequal work.
    #[arg(long, conflicts_with = "baseline_url")]
    json_schema: Option<String>,
    /// A second server to run the same workload against, after --url: e.g. one `ferry serve`
    /// when --url is `ferry proxy` in front of P and D. The report is then `{"target": ...,
    /// "baseline": ..., "ttft_added_ms": ..., "e2e_added_ms": ...}`: both runs, and what
    /// --url adds to the time to first token and to the whole request (mean, p50, p99
    /// differences).
    #[arg(long)]
    baseline_url: Option<String>,
    /// With --baseline-url: run the workload against each side this many times, alternating,
    /// with new prompts each round (--seed + round).
    #[arg(long, default_value_t = 1, requires = "baseline_url")]
    rounds: usize,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if args.concurrency == Some(0) {
        bail!("--concurrency must be at least 1");
    }
    if let Some(rate) = args.request_rate {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--request-rate must be a positive number, got {rate}");
        }
    }
    if !(args.request_timeout_s > 0.0 && args.request_timeout_s <= MAX_SECONDS) {
        bail!("--request-timeout-s must be in (0, {MAX_SECONDS}]");
    }
    let specs = workload_of(&args, 0)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    if let Some(schema) = &args.json_schema {
        return constraint_cost(&args, &runtime, specs, read_schema(schema)?);
    }
    let Some(baseline_url) = &args.baseline_url else {
        let report = runtime.block_on(async {
            let mut side = Side::start(&args, &args.url).await?;
            side.run(&args, specs, &Variant::default()).await;
            anyhow::Ok(side.finish(&args).await)
        })?;
        if !args.json {
            print_summary(&report);
        }
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    };
    let comparison = runtime.block_on(compare(&args, baseline_url))?;
    if !args.json {
        print_summary(&comparison.target);
        println!();
        print_summary(&comparison.baseline);
        println!();
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:+.2}"));
        let added = &comparison.ttft_added_ms;
        println!(
            "TTFT added (ms)       mean {}  p50 {}  p99 {}",
            ms(added.mean),
            ms(added.p50),
            ms(added.p99)
        );
    }
    println!("{}", serde_json::to_string(&comparison)?);
    Ok(())
}

/// `--baseline-url`: the workload against --url, then against the baseline, `--rounds`
/// times, each side's requests pooled (alternating rounds spread any change in the machine's
/// load over both sides).
async fn compare(args: &Args, baseline_url: &str) -> anyhow::Result<stats::Comparison> {
    let mut target = Side::start(args, &args.url).await?;
    let mut baseline = Side::start(args, baseline_url).await?;
    for round in 0..args.rounds {
        // Each round draws new prompts (seed + round), so no round is served from the prefix
        // cache an earlier one filled; both sides get the same ones.
        let specs = workload_of(args, round as u64)?;
        let plain = Variant::default();
        target.run(args, specs.clone(), &plain).await;
        baseline.run(args, specs, &plain).await;
    }
    Ok(stats::Comparison::new(
        target.finish(args).await,
        baseline.finish(args).await,
    ))
}

/// `--json-schema`: the workload unconstrained, then with the schema on every request, each
/// run under its own cache salt; both reports and the throughput ratio.
fn constraint_cost(
    args: &Args,
    runtime: &tokio::runtime::Runtime,
    specs: Vec<RequestSpec>,
    schema: Value,
) -> anyhow::Result<()> {
    let salt = |run: &str| Some(format!("ferry-bench-{run}-{}", std::process::id()));
    let plain = Variant {
        json_schema: None,
        cache_salt: salt("unconstrained"),
    };
    let constrained = Variant {
        json_schema: Some(schema),
        cache_salt: salt("constrained"),
    };
    let run = |variant: &Variant, specs: Vec<RequestSpec>| {
        runtime.block_on(async {
            let mut side = Side::start(args, &args.url).await?;
            side.run(args, specs, variant).await;
            anyhow::Ok(side.finish(args).await)
        })
    };
    let unconstrained = run(&plain, specs.clone())?;
    let constrained = run(&constrained, specs)?;
    let ratio = (unconstrained.output_token_throughput_per_s > 0.0).then(|| {
        constrained.output_token_throughput_per_s / unconstrained.output_token_throughput_per_s
    });
    if !args.json {
        println!("== unconstrained");
        print_summary(&unconstrained);
        println!("== constrained (--json-schema)");
        print_summary(&constrained);
        match ratio {
            Some(r) => println!("constrained/unconstrained output throughput {r:.3}"),
            None => println!("constrained/unconstrained output throughput -"),
        }
    }
    let report = serde_json::json!({
        "unconstrained": unconstrained,
        "constrained": constrained,
        "constrained_output_throughput_ratio": ratio,
    });
    println!("{report}");
    Ok(())
}

/// `--json-schema`: the schema itself, or a file holding it.
fn read_schema(arg: &str) -> anyhow::Result<Value> {
    let text = if arg.trim_start().starts_with('{') {
        arg.to_owned()
    } else {
        std::fs::read_to_string(arg).with_context(|| format!("--json-schema: reading {arg}"))?
    };
    let schema: Value =
        serde_json::from_str(&text).with_context(|| format!("--json-schema: {arg} is not JSON"))?;
    if !schema.is_object() {
        bail!("--json-schema: a JSON schema is an object, got {schema}");
    }
    Ok(schema)
}

/// The requests of round `round`: the trace or the length flags, drawn with `--seed` +
/// `round`.
fn workload_of(args: &Args, round: u64) -> anyhow::Result<Vec<RequestSpec>> {
    let seed = args.seed.wrapping_add(round);
    Ok(match &args.trace {
        Some(path) => workload::read_trace(path, args.vocab_size, seed)?,
        None => workload::synthetic(&SyntheticWorkload {
            n_requests: args.num_requests,
            prompt_len: args.prompt_len,
            output_len: args.output_len,
            request_rate: args.request_rate,
            vocab_size: args.vocab_size,
            seed,
        })?,
    })
}

/// One server under test: its client, model, first `/metrics` scrape, and the outcomes of
/// every run against it.
struct Side {
    client: reqwest::Client,
    base: String,
    model: String,
    before: Option<metrics::EngineTime>,
    duration_s: f64,
    outcomes: Vec<Outcome>,
}

impl Side {
    async fn start(args: &Args, url: &str) -> anyhow::Result<Self> {
        let base = url.trim_end_matches('/').to_owned();
        let client = reqwest::Client::builder()
            // The server is on this machine: a proxy from the environment must not be used.
            .no_proxy()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs_f64(args.request_timeout_s))
            .build()
            .context("building the HTTP client")?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => first_model(&client, &base).await?,
        };
        let before = scrape_engine_time(&client, &base).await;
        Ok(Self {
            client,
            base,
            model,
            before,
            duration_s: 0.0,
            outcomes: Vec::new(),
        })
    }

    async fn run(&mut self, args: &Args, specs: Vec<RequestSpec>, variant: &Variant) {
        let start = Instant::now();
        let outcomes = send_all(
            &self.client,
            &self.base,
            &self.model,
            args.concurrency,
            specs,
            variant,
        )
        .await;
        self.duration_s += start.elapsed().as_secs_f64();
        self.outcomes.extend(outcomes);
    }

    async fn finish(self, args: &Args) -> Report {
        let after = scrape_engine_time(&self.client, &self.base).await;
        let info = RunInfo {
            url: self.base,
            model: self.model,
            concurrency: args.concurrency,
            request_rate: args.request_rate,
            duration_s: self.duration_s,
            engine_overhead_fraction: self
                .before
                .zip(after)
                .and_then(|(b, a)| metrics::overhead_fraction(b, a)),
        };
        stats::summarise(info, &self.outcomes)
    }
}

/// The first model `/v1/models` lists.
async fn first_model(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let url = format!("{base}/v1/models");
    let body: Value = client
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("GET {url}"))?
        .json()
        .await
        .with_context(|| format!("GET {url}: body is not JSON"))?;
    match body["data"][0]["id"].as_str() {
        Some(id) => Ok(id.to_owned()),
        None => bail!("GET {url}: no data[0].id in {body}; pass --model"),
    }
}

/// The engine's time counters, or `None` when `/metrics` cannot be read.
async fn scrape_engine_time(client: &reqwest::Client, base: &str) -> Option<metrics::EngineTime> {
    let response = client.get(format!("{base}/metrics")).send().await.ok()?;
    let text = response.error_for_status().ok()?.text().await.ok()?;
    Some(metrics::EngineTime::parse(&text))
}

/// Sends every request at its arrival time (or later, while `concurrency` are in flight) and
/// returns the outcomes in workload order.
async fn send_all(
    client: &reqwest::Client,
    base: &str,
    model: &str,
    concurrency: Option<usize>,
    specs: Vec<RequestSpec>,
    variant: &Variant,
) -> Vec<Outcome> {
    let url: Arc<str> = format!("{base}/v1/completions").into();
    let slots = concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let start = tokio::time::Instant::now();
    let mut tasks = JoinSet::new();
    for (idx, spec) in specs.into_iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_secs_f64(spec.arrival_s)).await;
        let permit = match &slots {
            // The semaphore is never closed, so acquiring cannot fail.
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        };
        let body = client::request_body(model, &spec, variant);
        let (client, url) = (client.clone(), url.clone());
        tasks.spawn(async move {
            let result = client::send(&client, &url, &body).await;
            drop(permit);
            let outcome = Outcome {
                prompt_len: spec.prompt.len() as u32,
                output_len: spec.output_len,
                result,
            };
            (idx, outcome)
        });
    }
    let mut outcomes: Vec<(usize, Outcome)> = tasks.join_all().await;
    outcomes.sort_by_key(|(idx, _)| *idx);
    outcomes.into_iter().map(|(_, o)| o).collect()
}

fn print_summary(r: &Report) {
    let ms = |l: &stats::LatencyMs| {
        let f = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
        format!("mean {}  p50 {}  p99 {}", f(l.mean), f(l.p50), f(l.p99))
    };
    println!("server                {} (model {})", r.url, r.model);
    println!(
        "requests              {} completed, {} failed, in {:.2} s",
        r.n_completed, r.n_failed, r.duration_s
    );
    for f in &r.failures {
        println!("  request {} failed: {}", f.request_idx, f.error);
    }
    println!(
        "tokens                {} in, {} out",
        r.total_input_tokens, r.total_output_tokens
    );
    println!(
        "request throughput    {:.2} req/s",
        r.request_throughput_per_s
    );
    println!(
        "token throughput      {:.1} out tok/s, {:.1} total tok/s",
        r.output_token_throughput_per_s, r.total_token_throughput_per_s
    );
    println!("TTFT (ms)             {}", ms(&r.ttft_ms));
    println!("TPOT (ms)             {}", ms(&r.tpot_ms));
    println!("ITL (ms)              {}", ms(&r.itl_ms));
    println!("E2E (ms)              {}", ms(&r.e2e_ms));
    match r.engine_overhead_fraction {
        Some(f) => println!("engine overhead       {:.2}% of step time", f * 100.0),
        None => println!("engine overhead       - (server exports no step/forward counters)"),
    }
}
