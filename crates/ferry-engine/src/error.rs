//! One error type per kind of engine call, each listing only what that call can return, so a
//! caller's match (the server's mapping to HTTP) is exhaustive with no arm that cannot happen.
//!
//! * Starting the engine thread ([`crate::spawn`]): [`SpawnError`].
//! * Sizing and starting an engine for a loaded model ([`crate::start_model`]): [`StartError`].
//! * Generating ([`crate::EngineHandle::generate`]): [`GenerateError`].
//! * Calls that can only fail because the engine is gone (aborts, status reads, cache resets,
//!   waits): [`Stopped`], which says whether it was shut down or failed (and with what).
//! * Pause, resume, sleep, wake-up, KV release (the core may refuse or cancel them):
//!   [`LifecycleCallError`].
//! * A tensor push: [`WeightUpdateError`]; a streamed push, whose body can also fail to read:
//!   [`WeightPushError`]; a reload from disk, which can also fail to read the model:
//!   [`WeightReloadError`].

use ferry_core::{AddError, ConfigError, LifecycleError, TokenId};
use ferry_model::{LoadError, ModelError, WeightError};

/// The engine thread has stopped; nothing was done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Stopped {
    /// It was shut down, or every handle was dropped.
    #[error("the engine has stopped")]
    ShutDown,
    /// It failed: the engine thread panicked (a broken invariant, such as the block pool's
    /// checks, or a bug in an executor), with this message. Every later call fails with it;
    /// [`crate::EngineStats::failure`] has it too.
    #[error("the engine failed: {0}")]
    Failed(String),
}

impl Stopped {
    /// What a caller is told once the engine thread is gone: its failure
    /// (`EngineStats::failure`), if it failed.
    pub fn from_failure(failure: Option<&str>) -> Self {
        failure.map_or(Self::ShutDown, |m| Self::Failed(m.to_owned()))
    }
}

/// Why [`crate::spawn`] could not start the engine thread.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The scheduler configuration is invalid.
    #[error("engine configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("engine configuration: input_queue_capacity must be at least 1")]
    ZeroQueueCapacity,
    /// The operating system refused to start the engine thread.
    #[error("cannot start the engine thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Why [`crate::start_model`] could not build or start an engine for a model. Each variant
/// carries the numbers at fault, so a caller can name its own flag for them.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("building the model from {source_name}: {error}")]
    Model {
        source_name: String,
        #[source]
        error: ModelError,
    },
    #[error("max_model_len {requested} is longer than the model's max_position_embeddings ({model_max})")]
    MaxModelLenTooLong { requested: usize, model_max: usize },
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("the KV cache size gives {n_blocks} blocks, more than a block id can name")]
    TooManyBlocks { n_blocks: u64 },
    /// A request may run to `max_model_len` (the server's default `max_tokens` fills it), so
    /// the pool must hold one such sequence, or those requests could never be admitted.
    #[error(
        "the KV cache ({n_blocks} blocks of {block_size} tokens, {block_bytes} bytes each) \
         cannot hold one sequence of max_model_len {max_model_len} tokens: give it at least \
         {n_blocks_needed} blocks ({} bytes) or lower max_model_len",
        n_blocks_needed * block_bytes
    )]
    KvCacheTooSmall {
        n_blocks: u32,
        block_size: usize,
        block_bytes: u64,
        max_model_len: usize,
        n_blocks_needed: u64,
    },
    #[error(transparent)]
    Spawn(#[from] SpawnError),
}

/// Why [`crate::EngineHandle::generate`] did not start a request; nothing was queued.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the engine's input queue is full ({capacity} inputs); retry later")]
    Overloaded { capacity: usize },
    /// The core refused the request (empty prompt, too long, ...).
    #[error(transparent)]
    Rejected(AddError),
    #[error("stop strings or text output need a tokenizer, and this model has none")]
    NoTokenizer,
    /// A prompt token the executor has no embedding for; refused before it reaches the
    /// engine, where it would fail the whole batch's step.
    /// Worded as vLLM words it ("Token id N is out of vocabulary"), which clients match.
    #[error(
        "Token id {token} is out of vocabulary: the model's vocabulary has {vocab_size} tokens"
    )]
    TokenOutOfVocabulary { token: TokenId, vocab_size: usize },
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// Why a lifecycle operation (pause, resume, sleep, wake-up, KV release) did not complete.
/// Nothing was lost: a refused call changed nothing, a cancelled one left the requests queued.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleCallError {
    /// Refused or cancelled by the lifecycle state machine (a conflict, not bad input).
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// Why a weight push was refused; the weights did not change.
#[derive(Debug, thiserror::Error)]
pub enum WeightUpdateError {
    #[error("weight update refused: {0}")]
    Weights(#[from] WeightError),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// Why a streamed tensor push failed; the weights did not change.
#[derive(Debug, thiserror::Error)]
pub enum WeightPushError<E> {
    /// The body could not be read (the caller's stream yielded this error).
    #[error("reading the pushed body: {0}")]
    Body(E),
    #[error(transparent)]
    Update(#[from] WeightUpdateError),
}

/// Why a reload from disk failed; the weights did not change, except after [`WeightReloadError::Torn`].
#[derive(Debug, thiserror::Error)]
pub enum WeightReloadError {
    /// The model folder or file could not be read.
    #[error("weight reload failed: {0}")]
    Load(#[from] LoadError),
    #[error("weight update refused: {0}")]
    Weights(#[from] WeightError),
    /// A reload in place failed after it began writing over the weights (the disk failed, or
    /// the files changed under it): they are dropped, as sleep level 2 leaves them.
    #[error("weight reload failed midway: {0}; it was writing over the weights in place (the engine was paused), so they are dropped: reload a complete set of weights, then wake_up the weights before resuming")]
    Torn(LoadError),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

impl From<WeightUpdateError> for WeightReloadError {
    fn from(e: WeightUpdateError) -> Self {
        match e {
            WeightUpdateError::Weights(w) => Self::Weights(w),
            WeightUpdateError::Stopped(s) => Self::Stopped(s),
        }
    }
}
