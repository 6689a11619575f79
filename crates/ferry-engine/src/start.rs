//! From a loaded model to a running engine in one call: [`start_model`] builds the executor,
//! sizes the scheduler (KV pool from a byte budget or a block count, `max_model_len` from the
//! model) and spawns the engine thread. `ferry serve`, `ferry bench lifecycle`, the server's
//! example and the server's tests all start engines this way, so they size them alike.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::{KvLoadFailurePolicy, SchedulerConfig, TokenId};
use ferry_model::{Executor, LlamaModel, LoadedModel, LogprobsMode};

use crate::{
    spawn_with_connectors, Connector, EngineConfig, EngineHandle, LoraSettings, StartError,
};

/// `max_model_len` when none is given: the model's, capped here, since larger contexts only
/// make the KV pool's worst case bigger on a CPU.
pub const DEFAULT_MAX_MODEL_LEN_CAP: usize = 8192;

/// How much memory the KV pool gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheSize {
    Blocks(u32),
    /// As many blocks as fit in this many bytes.
    Bytes(u64),
}

/// How to size and run an engine for a model; everything not the model's own.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    pub kv_cache: KvCacheSize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// `None`: the model's `max_position_embeddings`, capped at
    /// [`DEFAULT_MAX_MODEL_LEN_CAP`].
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// See [`EngineConfig::input_queue_capacity`].
    pub input_queue_capacity: usize,
    /// Seed of the engine RNG that requests without a seed draw from (`None`: OS entropy).
    pub sampler_seed: Option<u64>,
    /// What logprobs report for every request (vLLM's `--logprobs-mode`).
    pub logprobs_mode: LogprobsMode,
    /// The weight version the model starts as.
    pub weight_version: String,
    /// How long P keeps an export for its reader (`SchedulerConfig::export_lease`).
    pub export_lease: Duration,
    /// How long D waits for a load (`SchedulerConfig::kv_load_timeout`).
    pub kv_load_timeout: Duration,
    /// Bound of a deferred lifecycle operation's wait (`SchedulerConfig::lifecycle_wait_timeout`).
    pub lifecycle_wait_timeout: Duration,
    /// What a failed KV load does to its request.
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Publish KV events (`EngineHandle::take_kv_events`).
    pub kv_events: bool,
    /// Capture each token's expert routing and return it with every finish (vLLM's
    /// `--enable-return-routed-experts`): `LlamaModel::with_routed_experts`, which a model
    /// without mixture-of-experts layers refuses (`StartError::Model`).
    pub routed_experts: bool,
    /// Serve LoRA adapters (vLLM's `--enable-lora` and its limits); `None`: refused.
    pub lora: Option<ModelLoraConfig>,
}

/// The limits of an engine serving LoRA adapters (vLLM's flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLoraConfig {
    /// Most adapters computed in one step (`--max-loras`; `SchedulerConfig::max_loras`).
    pub max_loras: usize,
    /// Largest adapter rank (`--max-lora-rank`).
    pub max_lora_rank: usize,
    /// Most adapters loaded at once (`--max-cpu-loras`; `None`: no bound).
    pub max_cpu_loras: Option<usize>,
}

impl Default for ModelEngineConfig {
    /// `ferry serve`'s defaults (the core's for leases, bounds and the failed-load policy).
    fn default() -> Self {
        let core = SchedulerConfig::default();
        Self {
            block_size: 16,
            kv_cache: KvCacheSize::Bytes(1 << 30),
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            enable_prefix_caching: true,
            input_queue_capacity: 4096,
            sampler_seed: None,
            logprobs_mode: LogprobsMode::default(),
            weight_version: "0".to_owned(),
            export_lease: core.export_lease,
            kv_load_timeout: core.kv_load_timeout,
            lifecycle_wait_timeout: core.lifecycle_wait_timeout,
            kv_load_failure_policy: core.kv_load_failure_policy,
            kv_events: false,
            routed_experts: false,
            lora: None,
        }
    }
}

/// What callers of a started engine need to know of its model (the server's chat template
/// and vocabulary checks, a benchmark's memory figures).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// Where it came from (a path, or `tiny`).
    pub source: String,
    pub chat_template: Option<String>,
    /// The texts of the BOS and first EOS token, as chat templates use them (empty when the
    /// model has no such token or no tokenizer).
    pub bos_token: String,
    pub eos_token: String,
    pub vocab_size: usize,
    /// Bytes of weights the executor holds.
    pub weights_bytes: u64,
    /// Bytes of one KV block (every layer's K and V for `block_size` tokens).
    pub kv_block_bytes: u64,
}

/// A running engine with what it was built from.
#[derive(Debug)]
pub struct StartedEngine {
    pub handle: EngineHandle,
    /// The resolved scheduler configuration (blocks, `max_model_len`, EOS ids, ...).
    pub scheduler: SchedulerConfig,
    pub model: ModelInfo,
}

/// Builds the Llama-family executor for `model`, sizes the scheduler from `config` and starts
/// the engine thread. The loaded tensors are dropped once the executor holds its own copy.
pub fn start_model(
    model: LoadedModel,
    config: &ModelEngineConfig,
) -> Result<StartedEngine, StartError> {
    start_model_with(model, config, |executor| executor)
}

/// [`start_model`] with the executor wrapped by `wrap` before the engine takes it (tests hold
/// or slow the forward this way; see `testing`).
pub fn start_model_with(
    model: LoadedModel,
    config: &ModelEngineConfig,
    wrap: impl FnOnce(Box<dyn Executor>) -> Box<dyn Executor>,
) -> Result<StartedEngine, StartError> {
    start_model_with_connectors(model, config, wrap, Vec::new())
}

/// [`start_model_with`] with KV connectors (P/D, offload), in order.
pub fn start_model_with_connectors(
    model: LoadedModel,
    config: &ModelEngineConfig,
    wrap: impl FnOnce(Box<dyn Executor>) -> Box<dyn Executor>,
    connectors: Vec<Connector>,
) -> Result<StartedEngine, StartError> {
    let LoadedModel {
        config: llama,
        weights,
        tokenizer,
        chat_template,
        source,
    } = model;
    let mut executor = LlamaModel::new(&llama, &weights).map_err(|error| StartError::Model {
        source_name: source.clone(),
        error,
    })?;
    drop(weights);
    if let Some(seed) = config.sampler_seed {
        executor = executor.with_sampler_seed(seed);
    }
    let executor = executor
        .with_logprobs_mode(config.logprobs_mode)
        .with_routed_experts(config.routed_experts)
        .map_err(|error| StartError::Model {
            source_name: source.clone(),
            error,
        })?;
    let weights_bytes = executor.weights().total_bytes() as u64;
    let lora = config.lora.map(|l| LoraSettings {
        base: Arc::new(llama.clone()),
        max_rank: l.max_lora_rank,
        max_cpu_loras: l.max_cpu_loras,
    });
    let scheduler = scheduler_config(config, &llama, &executor)?;
    let token_text = |id: Option<TokenId>| {
        id.and_then(|id| tokenizer.as_ref()?.id_to_token(id.0))
            .unwrap_or_default()
    };
    let info = ModelInfo {
        source,
        chat_template,
        bos_token: token_text(llama.bos_token_id),
        eos_token: token_text(llama.eos_token_ids.first().copied()),
        vocab_size: llama.vocab_size,
        weights_bytes,
        kv_block_bytes: executor.kv_layout(config.block_size).block_bytes() as u64,
    };
    let handle = spawn_with_connectors(
        EngineConfig {
            scheduler: scheduler.clone(),
            input_queue_capacity: config.input_queue_capacity,
            lora,
        },
        wrap(Box::new(executor)),
        tokenizer.map(Arc::new),
        connectors,
    )?;
    Ok(StartedEngine {
        handle,
        scheduler,
        model: info,
    })
}

fn scheduler_config(
    config: &ModelEngineConfig,
    model: &ferry_model::LlamaConfig,
    executor: &dyn Executor,
) -> Result<SchedulerConfig, StartError> {
    let max_model_len = match config.max_model_len {
        Some(n) if n > model.max_position_embeddings => {
            return Err(StartError::MaxModelLenTooLong {
                requested: n,
                model_max: model.max_position_embeddings,
            })
        }
        Some(n) => n,
        None => model.max_position_embeddings.min(DEFAULT_MAX_MODEL_LEN_CAP),
    };
    if config.block_size == 0 {
        return Err(StartError::ZeroBlockSize);
    }
    let block_bytes = executor.kv_layout(config.block_size).block_bytes() as u64;
    let n_blocks = match config.kv_cache {
        KvCacheSize::Blocks(n) => n,
        KvCacheSize::Bytes(bytes) => {
            let n = bytes / block_bytes;
            u32::try_from(n).map_err(|_| StartError::TooManyBlocks { n_blocks: n })?
        }
    };
    let n_blocks_needed = max_model_len.div_ceil(config.block_size) as u64 + 1;
    if u64::from(n_blocks) < n_blocks_needed {
        return Err(StartError::KvCacheTooSmall {
            n_blocks,
            block_size: config.block_size,
            block_bytes,
            max_model_len,
            n_blocks_needed,
        });
    }
    Ok(SchedulerConfig {
        block_size: config.block_size,
        n_blocks,
        max_num_seqs: config.max_num_seqs,
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_model_len,
        enable_prefix_caching: config.enable_prefix_caching,
        enable_chunked_prefill: true,
        eos_token_ids: model.eos_token_ids.clone(),
        weight_version: config.weight_version.clone(),
        export_lease: config.export_lease,
        kv_load_timeout: config.kv_load_timeout,
        lifecycle_wait_timeout: config.lifecycle_wait_timeout,
        kv_load_failure_policy: config.kv_load_failure_policy,
        kv_events: config.kv_events,
        max_loras: config.lora.map(|l| l.max_loras),
    })
}
