//! `ferry bench offload`: the CPU offload tier's copy throughput against a plain memcpy of
//! the same bytes, and time to first token on repeated long prefixes that do not fit the KV
//! cache, with and without the tier.
//!
//! * **Throughput.** An `OffloadWorker` stores `--n-blocks` arena blocks into host memory in
//!   one job and loads them back into the arena in another, each timed from handing the job
//!   over to its report (the grant, the copier thread's hand-off and the report included).
//!   The baseline copies the same bytes from one buffer to another, a block at a time, on
//!   the calling thread. Both destinations are written once before timing (no first-touch
//!   page faults in either); each is run `--repeat` times alternately, best of each reported.
//! * **TTFT.** `--n-prompts` prompts of `--prompt-len` tokens, asked round-robin for
//!   `--rounds` rounds (one request at a time), on an engine whose KV cache holds about
//!   `--cache-prompts` of them: without the tier every request recomputes its prompt (the
//!   others evicted it); with it, every round after the first loads its prefix from host
//!   memory. The first round is excluded (it computes in both). The outputs of both runs
//!   must be the same tokens, or the bench fails.

use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use ferry_arena::{KvArena, KvLayout, Reports, WorkerConnector};
use ferry_core::{
    BlockId, HostCopy, TierJob, TierReport, TokenId, TransferId, WorkerJob, WorkerReport,
};
use ferry_engine::{
    start_model_with_connectors, Connector, EngineHandle, GenerateRequest, KvCacheSize,
    ModelEngineConfig, OffloadConfig, OffloadPolicy, SamplingParams,
};
use ferry_kv::OffloadWorker;
use ferry_model::LoadedModel;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Blocks copied per throughput run.
    #[arg(long, default_value_t = 256)]
    n_blocks: usize,
    /// Throughput runs of each kind; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// The TTFT model: `random` (SmolLM2-135M's shape, random weights: a realistic prefill
    /// cost without a download) or `tiny` (the built-in test model). The throughput part uses
    /// its KV layout too.
    #[arg(long, default_value = "random")]
    model: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Distinct prompts in the TTFT workload.
    #[arg(long, default_value_t = 4)]
    n_prompts: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 256)]
    prompt_len: usize,
    /// Times each prompt is asked.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// How many prompts the KV cache holds (fewer than --n-prompts: they do not fit).
    #[arg(long, default_value_t = 1.5)]
    cache_prompts: f64,
    /// Eviction policy of the tier.
    #[arg(long, default_value = "lru")]
    policy: OffloadPolicy,
    /// Print one JSON object instead of a readable summary.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    ensure!(args.n_blocks > 0, "--n-blocks must be at least 1");
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    ensure!(args.block_size > 0, "--block-size must be at least 1");
    ensure!(args.n_prompts > 0, "--n-prompts must be at least 1");
    ensure!(
        args.rounds >= 2,
        "--rounds must be at least 2 (the first is excluded)"
    );
    ensure!(
        args.prompt_len >= 2 * args.block_size,
        "--prompt-len must be at least two blocks (--block-size {})",
        args.block_size
    );
    ensure!(
        args.cache_prompts >= 1.0 && args.cache_prompts < args.n_prompts as f64,
        "--cache-prompts must be at least 1 and below --n-prompts {}",
        args.n_prompts
    );
    let c = &model_config(&args.model)?;
    let layout = KvLayout {
        n_layers: c.num_hidden_layers,
        n_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        block_size: args.block_size,
        aux_floats: 0,
    };
    let copy = throughput(&args, layout)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let without = runtime.block_on(ttft_run(&args, layout, false))?;
    let with = runtime.block_on(ttft_run(&args, layout, true))?;
    ensure!(
        with.tokens == without.tokens,
        "the tier changed the outputs: the bench's runs disagree"
    );
    let speedup = without.ttft_ms_mean / with.ttft_ms_mean;
    if args.json {
        let report = serde_json::json!({
            "model": args.model,
            "block_bytes": layout.block_bytes(),
            "n_blocks": args.n_blocks,
            "total_bytes": copy.total_bytes,
            "repeat": args.repeat,
            "store_gb_per_s": copy.store_gbps,
            "load_gb_per_s": copy.load_gbps,
            "memcpy_gb_per_s": copy.memcpy_gbps,
            "store_ratio": copy.store_gbps / copy.memcpy_gbps,
            "load_ratio": copy.load_gbps / copy.memcpy_gbps,
            "n_prompts": args.n_prompts,
            "prompt_len": args.prompt_len,
            "rounds": args.rounds,
            "kv_cache_blocks": without.n_blocks,
            "ttft_ms_mean_without_tier": without.ttft_ms_mean,
            "ttft_ms_p50_without_tier": without.ttft_ms_p50,
            "ttft_ms_mean_with_tier": with.ttft_ms_mean,
            "ttft_ms_p50_with_tier": with.ttft_ms_p50,
            "ttft_speedup": speedup,
            "tier_hits": with.tier_hits,
            "tier_bytes_used": with.tier_bytes,
        });
        println!("{report}");
    } else {
        println!(
            "{} blocks of {} bytes ({:.1} MB), best of {}",
            args.n_blocks,
            layout.block_bytes(),
            copy.total_bytes as f64 / 1e6,
            args.repeat
        );
        println!(
            "store (arena → host): {:.2} GB/s ({:.0}% of memcpy)",
            copy.store_gbps,
            100.0 * copy.store_gbps / copy.memcpy_gbps
        );
        println!(
            "load (host → arena):  {:.2} GB/s ({:.0}% of memcpy)",
            copy.load_gbps,
            100.0 * copy.load_gbps / copy.memcpy_gbps
        );
        println!("memcpy:               {:.2} GB/s", copy.memcpy_gbps);
        println!(
            "TTFT, {} prompts of {} tokens × {} rounds, KV cache of {} blocks:",
            args.n_prompts, args.prompt_len, args.rounds, without.n_blocks
        );
        println!(
            "  without the tier: mean {:.1} ms, p50 {:.1} ms",
            without.ttft_ms_mean, without.ttft_ms_p50
        );
        println!(
            "  with the tier:    mean {:.1} ms, p50 {:.1} ms ({} hits), {speedup:.2}× faster",
            with.ttft_ms_mean, with.ttft_ms_p50, with.tier_hits
        );
    }
    Ok(())
}

fn model_config(model: &str) -> anyhow::Result<ferry_model::LlamaConfig> {
    match model {
        "tiny" => Ok(ferry_model::tiny::tiny_config()),
        "random" => Ok(ferry_model::random_model::smollm2_135m_config()),
        other => bail!("--model {other:?}: expected random or tiny"),
    }
}

fn load(model: &str) -> anyhow::Result<LoadedModel> {
    match model {
        "tiny" => Ok(ferry_model::tiny::tiny_model()),
        "random" => {
            let config = ferry_model::random_model::smollm2_135m_config();
            let weights = ferry_model::random_model::random_weights(&config, 7);
            Ok(LoadedModel {
                config,
                weights,
                tokenizer: None,
                chat_template: None,
                source: "random".into(),
            })
        }
        other => bail!("--model {other:?}: expected random or tiny"),
    }
}

struct Copy {
    total_bytes: usize,
    store_gbps: f64,
    load_gbps: f64,
    memcpy_gbps: f64,
}

fn throughput(args: &Args, layout: KvLayout) -> anyhow::Result<Copy> {
    let n = args.n_blocks;
    let block_bytes = layout.block_bytes();
    let total_bytes = n * block_bytes;
    let mut arena = KvArena::new(layout, n);
    for b in 0..n {
        let bytes: Vec<u8> = (0..block_bytes).map(|i| (i * 7 + b * 13) as u8).collect();
        arena.write_block_bytes(BlockId(b as u32), &bytes)?;
    }
    let original: Vec<Vec<u8>> = (0..n as u32)
        .map(|b| arena.block_bytes(BlockId(b)).to_vec())
        .collect();
    let mut worker = OffloadWorker::new(n, block_bytes).context("starting the copier")?;
    let (tx, rx) = channel();
    let tx = std::sync::Mutex::new(tx);
    let reports = Reports::new(move |r| {
        let _ = tx.lock().map(|tx| tx.send(r));
    });
    let copies: Vec<HostCopy> = (0..n as u32)
        .map(|b| HostCopy {
            block: BlockId(b),
            host_block: b,
        })
        .collect();
    let mut job = |store: bool, hold: u64| -> anyhow::Result<f64> {
        let job = if store {
            WorkerJob::Tier(TierJob::Store {
                hold: TransferId(hold),
                epoch: 0,
                copies: copies.clone(),
            })
        } else {
            WorkerJob::Tier(TierJob::Load {
                hold: TransferId(hold),
                epoch: 0,
                copies: copies.clone(),
            })
        };
        let started = Instant::now();
        worker.before_forward(&[job], &mut arena, &reports);
        let report = rx.recv_timeout(Duration::from_secs(60))?;
        let elapsed = started.elapsed().as_secs_f64();
        match report {
            WorkerReport::Tier(TierReport::StoreDone { ok: true, .. })
            | WorkerReport::Tier(TierReport::LoadDone { result: Ok(()), .. }) => Ok(elapsed),
            other => bail!("the copy failed: {other:?}"),
        }
    };
    let src: Vec<u8> = (0..total_bytes).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; total_bytes];
    // Untimed: the host memory and the baseline's destination are touched once.
    job(true, 0)?;
    memcpy(&src, &mut dst, block_bytes);
    let (mut store_s, mut load_s, mut memcpy_s) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for r in 0..args.repeat as u64 {
        store_s = store_s.min(job(true, 2 * r + 1)?);
        load_s = load_s.min(job(false, 2 * r + 2)?);
        memcpy_s = memcpy_s.min(memcpy(&src, &mut dst, block_bytes));
    }
    for (b, bytes) in original.iter().enumerate() {
        ensure!(
            arena.block_bytes(BlockId(b as u32)) == &bytes[..],
            "block {b} came back wrong"
        );
    }
    ensure!(dst == src, "the memcpy baseline copied wrong");
    let gb = total_bytes as f64 / 1e9;
    Ok(Copy {
        total_bytes,
        store_gbps: gb / store_s,
        load_gbps: gb / load_s,
        memcpy_gbps: gb / memcpy_s,
    })
}

/// `src` into `dst` a block at a time; seconds.
fn memcpy(src: &[u8], dst: &mut [u8], block_bytes: usize) -> f64 {
    let started = Instant::now();
    for (d, s) in dst.chunks_mut(block_bytes).zip(src.chunks(block_bytes)) {
        d.copy_from_slice(s);
    }
    std::hint::black_box(&dst);
    started.elapsed().as_secs_f64()
}

struct Ttft {
    n_blocks: u32,
    ttft_ms_mean: f64,
    ttft_ms_p50: f64,
    tier_hits: u64,
    tier_bytes: u64,
    tokens: Vec<Vec<TokenId>>,
}

async fn ttft_run(args: &Args, layout: KvLayout, tier: bool) -> anyhow::Result<Ttft> {
    let bs = args.block_size;
    let prompt_blocks = args.prompt_len.div_ceil(bs);
    let max_model_len = args.prompt_len + bs;
    // Room for `cache_prompts` prompts, and never less than one sequence.
    let n_blocks = ((prompt_blocks as f64 * args.cache_prompts).ceil() as u32 + 1)
        .max(max_model_len.div_ceil(bs) as u32 + 1);
    let config = ModelEngineConfig {
        block_size: bs,
        kv_cache: KvCacheSize::Blocks(n_blocks),
        max_num_seqs: 4,
        max_num_batched_tokens: 2048,
        max_model_len: Some(max_model_len),
        sampler_seed: Some(0),
        ..ModelEngineConfig::default()
    };
    let mut connectors = Vec::new();
    if tier {
        let offload = OffloadConfig {
            block_size: bs,
            blocks_per_slot: 1,
            block_bytes: layout.block_bytes(),
            // Every prompt's blocks, twice over.
            capacity_bytes: (2 * args.n_prompts * prompt_blocks * layout.block_bytes()) as u64,
            policy: args.policy,
        };
        connectors.push(Connector::offload(offload).context("starting the copier")?);
    }
    let model = load(&args.model)?;
    let vocab_size = model.config.vocab_size;
    ensure!(vocab_size > 3, "the model's vocabulary is too small");
    let engine = start_model_with_connectors(model, &config, |e| e, connectors)
        .context("starting the engine")?
        .handle;
    let prompts: Vec<Vec<TokenId>> = (0..args.n_prompts)
        .map(|p| {
            (0..args.prompt_len)
                .map(|j| TokenId(((p * 7919 + j * 104_729 + 3) % (vocab_size - 3)) as u32 + 3))
                .collect()
        })
        .collect();
    let mut ttfts = Vec::new();
    let mut tokens = Vec::new();
    for round in 0..args.rounds {
        for (p, prompt) in prompts.iter().enumerate() {
            let (ttft, out) = one(&engine, &format!("r{round}-p{p}"), prompt.clone()).await?;
            if round > 0 {
                ttfts.push(ttft);
            }
            tokens.push(out);
        }
    }
    let stats = engine.stats();
    engine.shutdown().await.ok();
    ttfts.sort_by(f64::total_cmp);
    let mean = ttfts.iter().sum::<f64>() / ttfts.len() as f64;
    Ok(Ttft {
        n_blocks,
        ttft_ms_mean: mean * 1e3,
        ttft_ms_p50: ttfts[ttfts.len() / 2] * 1e3,
        tier_hits: stats.tier.map_or(0, |t| t.n_hits),
        tier_bytes: stats.tier.map_or(0, |t| t.bytes_used),
        tokens,
    })
}

/// One request of 4 greedy tokens; seconds to its first token, and its tokens.
async fn one(
    engine: &EngineHandle,
    id: &str,
    prompt: Vec<TokenId>,
) -> anyhow::Result<(f64, Vec<TokenId>)> {
    let started = Instant::now();
    let mut stream = engine
        .generate(GenerateRequest {
            request_id: id.to_owned(),
            prompt,
            params: SamplingParams::greedy(4),
            ..GenerateRequest::default()
        })
        .await?;
    let mut ttft = None;
    let mut tokens = Vec::new();
    while let Some(chunk) = stream.next().await {
        if ttft.is_none() && !chunk.token_ids.is_empty() {
            ttft = Some(started.elapsed().as_secs_f64());
        }
        tokens.extend_from_slice(&chunk.token_ids);
    }
    Ok((ttft.context("no token")?, tokens))
}
