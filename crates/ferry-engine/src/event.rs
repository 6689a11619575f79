//! What the engine says about one request: the raw events the core emits for it
//! ([`crate::CoreEvent::Request`]) and the engine thread forwards to the request's stream,
//! which turns them into [`crate::OutputChunk`]s. Plain data, no channel: the core, the
//! engine thread and the stream all name these, so they sit below all three.

use std::sync::Arc;

use ferry_core::{
    ExpertRouting, FinishReason, Finished, KvTransferParams, PromptTokenLogprob, SampledToken,
    TokenId, TransferId,
};

/// A raw per-request event from the engine core. No text: detokenizing is the reader's job.
#[derive(Debug)]
pub enum Event {
    /// The request was scheduled for the first time; that many prompt tokens were cache hits.
    Admitted { n_cached_tokens: usize },
    /// One step's output: a token (none for an abort or error) and, on the last, the finish.
    /// The two travel together so that a reader sees a stop token and its finish at once.
    Output {
        sampled: Option<SampledToken>,
        finish: Option<EngineFinish>,
        /// The weight version the token was computed with (set with `sampled`).
        weight_version: Option<Arc<str>>,
        /// The LoRA adapter version the token was computed with (set with `sampled`, for a
        /// request under an adapter).
        lora_version: Option<u64>,
        /// The token was the only one the request's constraint allowed.
        forced: bool,
    },
    /// Logprobs of the request's next prompt tokens (it asked for prompt logprobs), in
    /// prompt order from position 1, each position once; before the outputs of that step.
    PromptLogprobs(Vec<PromptTokenLogprob>),
}

/// The engine's side of a finish: the reader adds prompt and cache counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFinish {
    pub reason: FinishReason,
    /// The stop token, when a token (EOS or a stop token id) stopped the request.
    pub stop_token: Option<TokenId>,
    /// The hold keeping the request's KV (`Finished::transfer`): a connector's export.
    pub transfer: Option<TransferId>,
    /// The connectors' transfer parameters for the client (P's export).
    pub kv_transfer_params: Option<Box<KvTransferParams>>,
    /// Why, for an `error` finish the core explained (a failed KV load).
    pub message: Option<String>,
    /// Why, for a `stop` a structured-output constraint decided.
    pub constraint_stop: Option<String>,
    /// The request's expert routing, when the engine captures it (`Finished::routing`).
    pub routing: Option<ExpertRouting>,
}

impl EngineFinish {
    /// The core's finish as it stands: no stop token or constraint named (the caller adds
    /// what it knows).
    pub fn of(f: Finished) -> Self {
        Self {
            reason: f.reason,
            stop_token: None,
            transfer: f.transfer,
            kv_transfer_params: f.kv_transfer_params.map(Box::new),
            message: f.message,
            constraint_stop: None,
            routing: f.routing,
        }
    }
}
