//! Requests as the core sees them: tokens, sampling parameters, KV blocks and a state enum
//! that carries its data.

use crate::hash::BlockHash;
use crate::ids::{BlockId, ReqIdx, TokenId, TransferId};
use crate::lora::{LoraError, LoraRef};
use crate::sampling::SamplingParams;

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An EOS token (unless `ignore_eos`) or one of the request's stop token ids.
    Stop,
    /// `max_tokens` generated, or the sequence reached the model's maximum length.
    Length,
    /// Aborted by the client or by a lifecycle operation.
    Abort,
    /// The request could not be served (e.g. a failed KV load under the `fail` policy).
    Error,
}

impl FinishReason {
    /// The OpenAI-style name (`stop`, `length`, `abort`, `error`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

/// Where a request is in its life. Each state carries what only that state needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestState {
    /// In the waiting queue, never admitted.
    Waiting,
    /// In the waiting queue, at its place, while a connector loads `n_tokens` tokens of its
    /// prompt KV into its blocks through the hold `transfer`; not schedulable until the load
    /// ends (`KvConnector::take_finished_loads`).
    WaitingForRemoteKv {
        transfer: TransferId,
        n_tokens: usize,
    },
    /// Admitted: in the running list, holding blocks.
    Running,
    /// Was running, lost its KV to preemption (recompute) and is back in the waiting queue;
    /// `n_preemptions` counts how often that happened to this request.
    Preempted { n_preemptions: u32 },
    /// Done; the request is removed once its final output has been returned.
    Finished(FinishReason),
}

/// Why `add_request` refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error("request {id:?}: prompt is empty")]
    EmptyPrompt { id: String },
    #[error("request {id:?}: prompt has {prompt_len} tokens, the model's maximum length is {max_model_len} (the prompt must be shorter, to leave room for one generated token)")]
    PromptTooLong {
        id: String,
        prompt_len: usize,
        max_model_len: usize,
    },
    #[error("request {id:?}: a request with this id is already in the engine")]
    DuplicateId { id: String },
    #[error("request {id:?}: max_tokens must be at least 1")]
    ZeroMaxTokens { id: String },
    #[error("request {id:?}: needs {n_blocks_needed} KV blocks at its longest, the pool has {n_blocks_usable}")]
    TooLongForKvCache {
        id: String,
        n_blocks_needed: usize,
        n_blocks_usable: usize,
    },
    #[error("request {id:?}: {reason}")]
    KvTransfer { id: String, reason: String },
    #[error("request {id:?}: {error}")]
    Lora { id: String, error: LoraError },
    /// The request names a LoRA adapter by a name no adapter is loaded under.
    #[error("the model `{name}` does not exist (no LoRA adapter is loaded under that name)")]
    UnknownLora { id: String, name: String },
    #[error("request {id:?}: prompt has {prompt_len} tokens but chunked prefill is off and a step holds at most {max_num_batched_tokens}")]
    PromptExceedsBatch {
        id: String,
        prompt_len: usize,
        max_num_batched_tokens: usize,
    },
}

/// One live request.
#[derive(Debug)]
pub struct Request {
    pub id: String,
    pub idx: ReqIdx,
    pub params: SamplingParams,
    pub state: RequestState,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<TokenId>,
    pub prompt_len: usize,
    /// Tokens whose KV is in `blocks` (computed, hit in the prefix cache, or loaded).
    pub n_computed: usize,
    /// The block table: block `i` holds positions `i*block_size..(i+1)*block_size`.
    pub blocks: Vec<BlockId>,
    /// The LoRA adapter it is computed with now (`None`: the base model): the one it named
    /// (`SamplingParams::lora`), at the version loaded now (an in-place reload moves it on).
    pub lora: Option<LoraRef>,
    /// Hashes of every full block of `tokens`, chained from `hash_root`.
    pub(crate) block_hashes: Vec<BlockHash>,
    /// The chain root the hashes were computed from: `weight_root`, mixed with the adapter
    /// at `chain_lora_version` for a request with one (`hash::lora_root`).
    pub(crate) hash_root: BlockHash,
    /// The weight version's root `hash_root` follows.
    pub(crate) weight_root: BlockHash,
    /// The version of its adapter `hash_root` follows (`None` for the base model).
    pub(crate) chain_lora_version: Option<u64>,
    /// How many leading blocks of `blocks` are registered in the prefix cache (or were
    /// offered to it).
    pub(crate) n_cached_blocks: usize,
    /// Prompt tokens this request did not compute (at its latest admission): local
    /// prefix-cache hits plus what a connector loaded (an offload tier's hit, a P/D import).
    /// What `usage.prompt_tokens_details.cached_tokens` reports, as vLLM does.
    pub n_cached_tokens: usize,
    /// It was admitted once (scheduled, or a load was started for it): a `wait` pause lets
    /// it finish, loads in flight included.
    pub(crate) admitted: bool,
    /// The lifecycle's pause mark when it arrived (`Control::pause_mark`): an export that
    /// expired while it waited behind a pause was retracted by the lifecycle, not lost to a
    /// fault.
    pub(crate) pause_mark: u64,
    /// How often this request was preempted (it outlives the readmissions in between, which
    /// [`RequestState::Preempted`]'s copy does not).
    pub n_preemptions: u32,
    /// On a non-abort finish, hand the blocks to a transfer hold the caller frees
    /// (`Scheduler::hold_kv_on_finish`) instead of freeing them.
    pub(crate) export_on_finish: bool,
    /// The expert routing of positions `0..routing.len() / width`, when the engine captures
    /// it (`Scheduler::set_routing_shape`): position-major, each row `width` ids. A
    /// recompute overwrites its rows; it never shrinks, so a preempted request keeps the
    /// rows it had.
    pub(crate) routing: Vec<u16>,
}

impl Request {
    /// Whether its hash chain is the one it would start now: under the weights whose root is
    /// `weight_root` and the version of its adapter it is computed with now. A request whose
    /// chain is not (it ran across a weight update or an adapter reload, so its KV mixes
    /// both) caches no more blocks, offers none to a tier and is never exported.
    pub(crate) fn chain_is_current(&self, weight_root: &BlockHash) -> bool {
        self.weight_root == *weight_root
            && self.chain_lora_version == self.lora.as_ref().map(|l| l.version)
    }

    pub fn n_output_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The expert routing accumulated so far (see the field), position-major; empty when
    /// the engine does not capture routing.
    pub fn routing(&self) -> &[u16] {
        &self.routing
    }

    /// Tokens not computed yet (prefill left, or 1 while decoding).
    pub fn n_uncomputed(&self) -> usize {
        self.tokens.len() - self.n_computed
    }

    /// The longest this request can get, in tokens.
    pub(crate) fn max_len(prompt_len: usize, max_tokens: u32, max_model_len: usize) -> usize {
        (prompt_len + max_tokens as usize).min(max_model_len)
    }
}
