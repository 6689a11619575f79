//! ferry-engine: the engine core, the engine thread that drives it, and the async handle that
//! feeds it.
//!
//! [`EngineCore`] (`engine_core.rs`) is the engine without a thread: the sans-IO scheduler
//! ([`ferry_core::Scheduler`]), the executor, the KV arena and the connectors' workers behind
//! one synchronous interface. Inputs go in by `handle_*` (time, adds, aborts, worker reports,
//! lifecycle calls), [`EngineCore::step`] runs a step and moves the lifecycle, and everything
//! that comes out leaves by one route, [`EngineCore::poll_event`], drained after every input
//! and every step (the order to call things in is in `engine_core.rs`'s docs). The engine
//! thread, the simulation (`ferry-sim`) and tests all drive this one core. It is sans-IO by
//! construction: `engine_core.rs` and `reload.rs` (the reload from disk as a state machine)
//! and every module they import (`connector.rs`, `constraint.rs`, `event.rs`,
//! `transfer_stats.rs`) name no async runtime, thread, clock or channel; ferry-lint's
//! `tests/sans_io.rs` fails if one does. The tokio side (`handle.rs`, `input.rs`,
//! `stream.rs`, the engine thread in `engine.rs`) sits above them.
//!
//! One `std::thread` (the engine thread, `engine.rs`) is a thin loop around the core. Everything
//! that can change its state arrives as one closed enum (`input::Input`) on one queue and is
//! handled between steps, never during one, in arrival order. Async callers hold an
//! [`EngineHandle`]: `generate` queues a request and returns a [`GenerateStream`] of
//! [`OutputChunk`]s.
//!
//! The key decision: the engine thread does only what must be serial (scheduling, the
//! forward, bookkeeping) and never blocks on a reader. Per request it pushes raw events
//! (token, logprobs, finish) into an unbounded channel; the caller's side (`stream.rs`) merges
//! what has queued up, detokenizes incrementally ([`detok`]) and matches stop strings
//! ([`stop`]), aborting the request when one matches. A slow client therefore costs the engine
//! nothing, and text work runs on the callers' tokio threads in parallel.

use std::sync::Arc;

mod connector;
pub mod constraint;
pub mod detok;
mod engine;
pub mod engine_core;
mod error;
mod event;
mod handle;
mod input;
mod lifecycle;
mod lora;
pub mod reload;
mod start;
pub mod stop;
mod stream;
#[cfg(feature = "testing")]
pub mod testing;
mod transfer_stats;

// What the engine's API takes and returns, so its callers (the server, the binary) need no
// other ferry crate.
pub use connector::Connector;
pub use constraint::{Constraint, ConstraintError, Constraints, StructuredOutput};
pub use engine::ThreadedEnv;
pub use engine_core::{
    Call, CallKind, CallResult, CoreCounters, CoreEnv, CoreEvent, EngineCore, InlineEnv, LendId,
    MaskWork, NewRequest, StepObserver, Stepped, WeightInfo,
};
pub use error::{
    GenerateError, LifecycleCallError, SpawnError, StartError, Stopped, WeightPushError,
    WeightReloadError, WeightUpdateError,
};
pub use event::{EngineFinish, Event};
pub use ferry_arena::WorkerConnector;
pub use ferry_core::{
    ip_literal, AddError, AllowedPeers, BlockId, Cleared, ConnectorId, ExpertRouting, FinishReason,
    KvConnector, KvEvent, KvEventBatch, KvLoadFailurePolicy, KvTransferParams, LifecycleError,
    LifecycleStatus, LogitsParams, LoraKey, Medium, OffloadConfig, OffloadConnector, OffloadPolicy,
    PauseMode, PdConfig, PdConnector, PdRole, PromptTokenLogprob, RoutingShape, SamplerSpec,
    SamplingParams, SchedulerConfig, SchedulerStats, SleepLevel, StepError, TierStats, TokenId,
    TransferId, TransferRequest, WakeTag, WeightResidency,
};
pub use ferry_kv::{InMemoryFabric, InMemoryTransport, OffloadWorker, PdWorker, Transport};
pub use ferry_model::{
    BucketInfo, ExecError, Executor, LoadError, LoadedModel, LogprobsMode, ModelSpec,
    PreparedWeights, Tensor, WeightError, WeightStore, WeightUpload,
};
pub use handle::{random_secret, spawn, spawn_with_connectors, EngineHandle};
pub use lora::{LoraCallError, LoraInfo, LoraLoad, LoraSettings};
pub use reload::{DiskReload, ReloadFailure, Reloaded, Step as ReloadStep};
pub use start::{
    start_model, start_model_with, start_model_with_connectors, KvCacheSize, ModelEngineConfig,
    ModelInfo, ModelLoraConfig, StartedEngine, DEFAULT_MAX_MODEL_LEN_CAP,
};
pub use stream::GenerateStream;
pub use transfer_stats::TransferStats;

/// Everything the engine thread needs, resolved once by the caller.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Capacity of the input queue for adds. `generate` on a full queue fails at once with
    /// [`GenerateError::Overloaded`]; it never waits. Aborts are not counted
    /// (see `input.rs`): they are never refused.
    pub input_queue_capacity: usize,
    /// LoRA adapters (`None`: refused; `SchedulerConfig::max_loras` bounds them per step).
    pub lora: Option<LoraSettings>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerConfig::default(),
            input_queue_capacity: 4096,
            lora: None,
        }
    }
}

/// One generation request. `request_id` must be unique among live requests.
#[derive(Debug, Clone, Default)]
pub struct GenerateRequest {
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    /// Enforced by the core and the executor's sampler.
    pub params: SamplingParams,
    /// Stop strings: generation stops when the detokenized output contains one; the returned
    /// text ends before it (OpenAI semantics). Needs a tokenizer.
    pub stop: Vec<String>,
    /// Produce text deltas (needs a tokenizer; with `false` the chunks' `text` stays empty).
    pub detokenize: bool,
    /// What the request asks of the P/D transfer: its `kv_transfer_params` (vLLM's:
    /// `do_remote_decode` on P, P's returned parameters on D), parsed at the edge by
    /// [`TransferRequest::parse`]. Every connector sees it; one that refuses it refuses the
    /// request (`AddError::KvTransfer`).
    pub transfer: Option<TransferRequest>,
    /// A structured-output constraint ([`EngineHandle::constraints`] compiles one): every
    /// output token is one the constraint allows.
    pub constraint: Option<Constraint>,
    /// Special tokens stay in the text (vLLM's `skip_special_tokens: false`); by default they
    /// are left out.
    pub keep_special_tokens: bool,
    /// The LoRA adapter to compute with, by name (`None`: the base model). The engine takes
    /// the version loaded when it adds the request; a name not loaded then is refused
    /// ([`AddError::UnknownLora`]).
    pub lora: Option<Arc<str>>,
    /// A matched stop string stays at the end of the text, and a stop token's text is kept
    /// (vLLM's `include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
}

/// New output since the previous chunk (usually one token; several if the reader fell behind
/// and chunks were merged). The last chunk has `finish` set (and may have no tokens).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputChunk {
    pub token_ids: Vec<TokenId>,
    /// One entry per token in `token_ids` when the request asked for logprobs, else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// Text delta (empty unless `detokenize`). Never splits a UTF-8 character; text that could
    /// be the start of a stop string is held back until it is known not to be one.
    pub text: String,
    /// For a constrained request, one entry per token in `token_ids`: the constraint allowed
    /// only that token (it was forced, not chosen by the model). Empty otherwise.
    pub forced: Vec<bool>,
    /// Logprobs of the prompt's tokens from position 1 on, for a request that asked for
    /// them (`SamplingParams::prompt_logprobs`): they arrive in order, with or before the
    /// first token (all of them once the first token has come).
    pub prompt_logprobs: Vec<PromptTokenLogprob>,
    pub finish: Option<Finish>,
}

/// The logprob of one generated token, with the top-n alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: TokenId,
    pub logprob: f32,
    /// Top-n `(token, logprob)`, best first (n = `params.sampler.logprobs`).
    pub top: Vec<(TokenId, f32)>,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    pub reason: FinishReason,
    /// What stopped it, for [`FinishReason::Stop`]: a stop token id (EOS or `stop_token_ids`)
    /// or a stop string.
    pub stop_reason: Option<StopReason>,
    pub n_prompt_tokens: usize,
    pub n_output_tokens: usize,
    /// Prompt tokens served from the prefix cache (at the request's first admission).
    pub n_cached_tokens: usize,
    /// The weight versions the output tokens were computed with, in order, each once (more
    /// than one when a weight update came while the request was running).
    pub weight_versions: Vec<String>,
    /// For a request under a LoRA adapter, the adapter versions its output tokens were
    /// computed with, in order, each once (more than one when the adapter was replaced in
    /// place while the request ran); empty for the base model.
    pub lora_versions: Vec<u64>,
    /// The transfer hold that keeps the request's KV for a remote reader (a connector
    /// exported it); its connector frees it.
    pub export: Option<TransferId>,
    /// The connectors' transfer parameters (P: where and how D loads the export), for the
    /// response's `kv_transfer_params`.
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Why, for an `error` finish the engine explained (a failed KV load under the `fail`
    /// policy).
    pub message: Option<String>,
    /// The request's expert routing, when the engine captures it
    /// ([`EngineHandle::routing_shape`]): one row per position whose token was an input, the
    /// prompt's and the output's but the last (`n_prompt_tokens + n_output_tokens - 1`
    /// rows). `None` without capture, or for a request that ended before its first token.
    pub routing: Option<ExpertRouting>,
}

/// What stopped a request that finished with [`FinishReason::Stop`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Token(TokenId),
    String(String),
    /// A structured-output constraint ended the output: complete (with `ignore_eos`), or
    /// no token could continue it. The text says which.
    Constraint(String),
}

/// Published by the engine thread after every step; read without touching the engine thread.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub scheduler: SchedulerStats,
    pub n_blocks_total: usize,
    pub n_steps: u64,
    /// Wall time of whole steps (inputs drained → schedule → forward → outputs sent), summed.
    pub step_seconds_total: f64,
    /// Wall time inside `Executor::execute`, summed. Engine overhead = 1 - forward/step.
    pub forward_seconds_total: f64,
    pub n_generated_tokens_total: u64,
    pub n_requests_finished_total: u64,
    pub n_step_failures_total: u64,
    pub weight_version: String,
    /// The lifecycle state after the latest step or idle moment.
    pub lifecycle: LifecycleStatus,
    /// Lifecycle calls handled, and the engine thread's time handling them (from taking the
    /// call off the queue to its reply or, for a deferred one, its registration), summed:
    /// the engine-side cost of pause, resume and the rest, without the wait for a step to end.
    pub n_lifecycle_calls_total: u64,
    pub lifecycle_call_seconds_total: f64,
    /// Wall time the engine thread spent not waiting for an input (steps, connector-only
    /// steps, lifecycle calls, worker reports), summed; published when it goes idle.
    pub busy_seconds_total: f64,
    /// KV transfers (P/D connectors): started, ended by kind, bytes, load time.
    pub transfers: TransferStats,
    /// The offload tier's gauges and counters (`None` without a tier).
    pub tier: Option<TierStats>,
    /// False once the engine thread has stopped.
    pub running: bool,
    /// Set when the engine thread failed (panicked), with the panic's message; `running` is
    /// false then too. A shutdown leaves it `None`.
    pub failure: Option<String>,
}

/// What a weight update did.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightUpdateInfo {
    /// The version now loaded (given, or made from the previous one: `v` → `v+1`).
    pub weight_version: String,
    pub n_tensors: usize,
    /// f32 bytes installed.
    pub n_bytes: usize,
    /// Every parameter was replaced (else only the named ones).
    pub complete: bool,
    /// Reading and converting, off the engine thread.
    pub prepare_seconds: f64,
    /// From queueing the install to its reply; the engine thread's share is a swap or a copy
    /// of the pushed bytes.
    pub install_seconds: f64,
    /// A reload that wrote the new weights over the old ones, as the engine was paused: no
    /// second copy, no fresh memory ([`EngineHandle::update_weights_from_disk`]).
    pub in_place: bool,
}

/// The server shares one handle between tasks and moves streams into them.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    const fn assert_send<T: Send>() {}
    assert_send_sync::<EngineHandle>();
    assert_send::<GenerateStream>();
};
