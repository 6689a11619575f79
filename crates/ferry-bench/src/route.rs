//! `ferry bench route`: the routing policies of `ferry proxy` on a shared-prefix workload an
//! RL fleet sees, in one invocation (JSON with `--json`).
//!
//! `--groups` groups, each a shared prompt of `--prefix-len` tokens, and `--rounds` requests
//! per group with short distinct suffixes, arriving interleaved (every group once per round,
//! in a shuffled order),
//! `--concurrency` at a time, each asking for one token (so its latency is its time to first
//! token). For each policy a fresh fleet: `--instances` `ferry serve` processes, each pinned
//! to one core (`taskset`) with KV for about half the groups, publishing KV events, behind
//! `ferry proxy --routing <policy>`. Midway, `pause(keep, clear_cache)` → a new weight version
//! → `resume` goes through the proxy while requests run (`--no-rl-cycle`: none). The baseline
//! is one instance with the whole fleet's KV, sent the same requests directly: the hit rate a
//! perfect router could reach.
//!
//! Per policy: TTFT p50/p90, the prefix-cache hit rate (cached prompt tokens over prompt
//! tokens, from the answers' `cached_tokens`), and from the proxy's `/metrics` the predicted
//! hits, misses and stale routes.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use clap::ValueEnum;
use ferry_cli::RoutingArg;
use serde_json::{json, Value};

use crate::child::{start, strings, Proc};

pub(crate) const BLOCK_SIZE: usize = 16;
pub(crate) const EVENTS: &str = r#"{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model each instance serves (as `ferry serve --model`; default: the default model).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 2)]
    instances: usize,
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// Tokens of each group's shared prompt.
    #[arg(long, default_value_t = 1024)]
    prefix_len: usize,
    /// Tokens of each request's own suffix.
    #[arg(long, default_value_t = 16)]
    suffix_len: usize,
    /// Requests per group (with 8 groups and one wipe midway, 24 leaves 16 of 192 requests
    /// that no policy can serve from the cache: under a tenth, so p90 measures the routing).
    #[arg(long, default_value_t = 24)]
    rounds: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// KV blocks per instance. Default: half the groups' prefixes, plus room for the
    /// requests in flight.
    #[arg(long)]
    num_kv_blocks: Option<u32>,
    /// The policies, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "kv,least-loaded,round-robin"
    )]
    policies: Vec<RoutingArg>,
    /// Do not pin each instance to a core.
    #[arg(long)]
    no_pin: bool,
    /// No pause → update → resume midway.
    #[arg(long)]
    no_rl_cycle: bool,
    #[arg(long)]
    json: bool,
}

/// The workload: one prompt per request, in arrival order, and its group.
fn workload(args: &Args) -> Vec<(usize, Vec<u32>)> {
    // Token ids every supported vocabulary has (the built-in tiny model's included), from a
    // fixed generator so every policy gets the same prompts.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        5 + (state % 190) as u32
    };
    let prefixes: Vec<Vec<u32>> = (0..args.groups)
        .map(|_| (0..args.prefix_len).map(|_| next()).collect())
        .collect();
    let mut out = Vec::new();
    for _ in 0..args.rounds {
        // Each round visits every group once, in an order of its own (rollouts of an RL step
        // come back in no fixed order): no policy gets a placement for free from a period.
        let mut order: Vec<usize> = (0..args.groups).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, next() as usize % (i + 1));
        }
        for g in order {
            let mut p = prefixes[g].clone();
            p.extend((0..args.suffix_len).map(|_| next()));
            out.push((g, p));
        }
    }
    out
}

/// One request's outcome.
#[derive(Debug, Clone, Copy)]
struct Sample {
    latency: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Sends the workload to `base`, `concurrency` at a time; midway, the RL cycle through
/// `admin` (when given).
async fn drive(
    args: &Args,
    base: &str,
    admin: Option<&str>,
    prompts: Arc<Vec<(usize, Vec<u32>)>>,
) -> anyhow::Result<(Vec<Sample>, f64)> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()?;
    let model = client
        .get(format!("{base}/v1/models"))
        .send()
        .await?
        .json::<Value>()
        .await?["data"][0]["id"]
        .as_str()
        .context("no model")?
        .to_owned();
    let next = Arc::new(AtomicUsize::new(0));
    let cycle_at = prompts.len() / 2;
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency {
        let (client, next, prompts) = (client.clone(), Arc::clone(&next), Arc::clone(&prompts));
        let (base, model, admin) = (base.to_owned(), model.clone(), admin.map(str::to_owned));
        workers.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((_, prompt)) = prompts.get(i) else {
                    return Ok::<_, anyhow::Error>(samples);
                };
                if i == cycle_at {
                    if let Some(admin) = &admin {
                        rl_cycle(&client, admin).await?;
                    }
                }
                let body = json!({"model": model, "prompt": prompt, "max_tokens": 1,
                                  "temperature": 0});
                let t = Instant::now();
                let response = client
                    .post(format!("{base}/v1/completions"))
                    .json(&body)
                    .send()
                    .await?;
                let status = response.status();
                let answer: Value = response.json().await?;
                ensure!(status.is_success(), "request {i}: {status}: {answer}");
                let usage = &answer["usage"];
                samples.push(Sample {
                    latency: t.elapsed(),
                    prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
                    cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0),
                });
            }
        }));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await??);
    }
    Ok((samples, started.elapsed().as_secs_f64()))
}

/// `pause(keep, clear_cache)` → a new weight version → `resume`, as an RL trainer's step.
async fn rl_cycle(client: &reqwest::Client, admin: &str) -> anyhow::Result<()> {
    for (path, body) in [
        ("/pause?mode=keep&clear_cache=true", json!({})),
        ("/update_weight_version", json!({"new_version": "w1"})),
        ("/resume", json!({})),
    ] {
        let r = client
            .post(format!("{admin}{path}"))
            .json(&body)
            .send()
            .await?;
        ensure!(r.status().is_success(), "{path}: {}", r.text().await?);
    }
    Ok(())
}

pub(crate) fn percentile(sorted_ms: &[f64], p: f64) -> f64 {
    if sorted_ms.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ms.len() - 1) as f64 * p).round() as usize;
    sorted_ms[i]
}

fn summary(samples: &[Sample], wall_s: f64) -> Value {
    let mut ms: Vec<f64> = samples
        .iter()
        .map(|s| s.latency.as_secs_f64() * 1e3)
        .collect();
    ms.sort_by(f64::total_cmp);
    let prompt: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = samples.iter().map(|s| s.cached_tokens).sum();
    json!({
        "n_requests": samples.len(),
        "ttft_p50_ms": percentile(&ms, 0.5),
        "ttft_p90_ms": percentile(&ms, 0.9),
        "hit_rate": cached as f64 / prompt.max(1) as f64,
        "wall_s": wall_s,
    })
}

/// The sum of a metric's samples in a `/metrics` text.
pub(crate) fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The longest sequence of the workload (a prompt, its token, and slack), in whole blocks.
fn max_model_len(args: &Args) -> usize {
    (args.prefix_len + args.suffix_len + 16).next_multiple_of(BLOCK_SIZE)
}

fn serve_args(args: &Args, n_blocks: u32) -> Vec<String> {
    let max_len = max_model_len(args);
    let mut a = strings(&["serve", "--port", "0", "--enable-admin-api"]);
    if let Some(m) = &args.model {
        a.extend(["--model".into(), m.clone()]);
    }
    a.extend([
        "--num-kv-blocks".into(),
        n_blocks.to_string(),
        "--max-model-len".into(),
        max_len.to_string(),
        "--kv-events-config".into(),
        EVENTS.into(),
    ]);
    a
}

pub fn run(args: Args, ferry: &Path) -> anyhow::Result<()> {
    ensure!(
        args.instances > 0 && args.groups > 0 && args.rounds > 0,
        "nothing to run"
    );
    ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let prefix_blocks = args.prefix_len.div_ceil(BLOCK_SIZE) as u32;
    let running = (max_model_len(&args) / BLOCK_SIZE + 1) as u32 * args.concurrency as u32;
    // Each instance holds its share of the groups' prefixes (half of them with two), so
    // placement decides whether a prefix is still cached when its group comes back.
    let share = (args.groups as u32).div_ceil(args.instances as u32);
    let n_blocks = args
        .num_kv_blocks
        .unwrap_or(share * prefix_blocks + running);
    let n_cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let pin = |i: usize| (!args.no_pin).then_some(i % n_cpus);
    let prompts = Arc::new(workload(&args));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    // The baseline: one instance with the whole fleet's KV, sent the requests directly.
    let baseline = {
        let serve = serve_args(&args, n_blocks * args.instances as u32);
        let one = start(ferry, &serve, pin(0))?;
        let admin = (!args.no_rl_cycle).then_some(one.url.as_str());
        let (samples, wall) =
            runtime.block_on(drive(&args, &one.url, admin, Arc::clone(&prompts)))?;
        summary(&samples, wall)
    };
    let mut policies = Vec::new();
    for arg in &args.policies {
        let policy = arg
            .to_possible_value()
            .expect("every routing policy has a name")
            .get_name()
            .to_owned();
        let fleet: Vec<Proc> = (0..args.instances)
            .map(|i| start(ferry, &serve_args(&args, n_blocks), pin(i)))
            .collect::<anyhow::Result<_>>()?;
        let mut proxy_args = strings(&["proxy", "--port", "0", "--enable-admin-api"]);
        proxy_args.extend(["--routing".into(), policy.clone()]);
        for i in &fleet {
            proxy_args.extend(["--instance".into(), i.url.clone()]);
        }
        let proxy = start(ferry, &proxy_args, None)?;
        let result = runtime.block_on(async {
            let client = reqwest::Client::builder().no_proxy().build()?;
            let metrics = || async {
                client
                    .get(format!("{}/metrics", proxy.url))
                    .send()
                    .await?
                    .text()
                    .await
            };
            if *arg == RoutingArg::Kv {
                let deadline = Instant::now() + Duration::from_secs(60);
                while metric(&metrics().await?, "ferry_proxy_kv_synced") < args.instances as f64 {
                    ensure!(
                        Instant::now() < deadline,
                        "the proxy never followed every instance"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let admin = (!args.no_rl_cycle).then_some(proxy.url.as_str());
            let (samples, wall) = drive(&args, &proxy.url, admin, Arc::clone(&prompts)).await?;
            let m = metrics().await?;
            let mut s = summary(&samples, wall);
            s["policy"] = json!(policy);
            s["predicted_hit_tokens"] =
                json!(metric(&m, "ferry_proxy_kv_predicted_hit_tokens_total"));
            s["misses"] = json!(metric(&m, "ferry_proxy_kv_misses_total"));
            s["stale_routes"] = json!(metric(&m, "ferry_proxy_kv_stale_routes_total"));
            anyhow::Ok(s)
        })?;
        drop((proxy, fleet));
        policies.push(result);
    }
    let find = |name: &str| policies.iter().find(|p| p["policy"] == name);
    let ratio = |a: Option<&Value>, b: Option<&Value>, key: &str| -> Value {
        match (
            a.and_then(|v| v[key].as_f64()),
            b.and_then(|v| v[key].as_f64()),
        ) {
            (Some(a), Some(b)) if b > 0.0 => json!(a / b),
            _ => Value::Null,
        }
    };
    let report = json!({
        "workload": {
            "instances": args.instances, "groups": args.groups, "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len, "rounds": args.rounds,
            "concurrency": args.concurrency, "kv_blocks_per_instance": n_blocks,
            "block_size": BLOCK_SIZE, "pinned": !args.no_pin, "rl_cycle": !args.no_rl_cycle,
            "model": args.model.clone().unwrap_or_else(|| "default".into()),
        },
        "baseline_one_instance": baseline,
        "policies": policies,
        "round_robin_over_kv_ttft_p90": ratio(find("round-robin"), find("kv"), "ttft_p90_ms"),
        "kv_hit_rate_over_baseline": ratio(find("kv"), Some(&baseline), "hit_rate"),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for p in report["policies"].as_array().into_iter().flatten() {
            println!(
                "{:>13}: TTFT p50 {:>8.1} ms, p90 {:>8.1} ms, hit rate {:.3}, misses {}, stale routes {}",
                p["policy"].as_str().unwrap_or(""),
                p["ttft_p50_ms"].as_f64().unwrap_or(0.0),
                p["ttft_p90_ms"].as_f64().unwrap_or(0.0),
                p["hit_rate"].as_f64().unwrap_or(0.0),
                p["misses"],
                p["stale_routes"],
            );
        }
        println!(
            "baseline (one instance, all the KV): hit rate {:.3}",
            report["baseline_one_instance"]["hit_rate"]
                .as_f64()
                .unwrap_or(0.0)
        );
    }
    Ok(())
}
