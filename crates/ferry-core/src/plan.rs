//! The step plan (scheduler → executor) and the model output (executor → scheduler).
//!
//! This is the one contract between `ferry-core` and every executor (the real model, the
//! checksum model, a future CUDA backend). It is plain data: flat vectors with ranges into
//! them, so building one costs a few allocations per step, not one per request.

use std::ops::Range;

use crate::connector::StepWork;
use crate::ids::{BlockId, LoraId, ReqIdx, TokenId};
use crate::sampling::SamplerSpec;

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledReq {
    pub req: ReqIdx,
    /// Position of the first token computed this step (= tokens whose KV is already in the
    /// arena for this request, from earlier steps, a prefix-cache hit or a connector load).
    pub start_pos: usize,
    /// This request's tokens for this step: `plan.token_ids[tokens]`, at positions
    /// `start_pos..start_pos + tokens.len()`.
    pub tokens: Range<usize>,
    /// The request's block table: `plan.block_tables[blocks]`. Covers at least
    /// `start_pos + tokens.len()` positions; token at position `p` has its KV in block
    /// `table[p / block_size]`, slot `p % block_size`.
    pub blocks: Range<usize>,
    /// `Some` when this step computes the last known token of the request (the end of its
    /// prefill, or a decode step), so the executor must sample the next token.
    pub sample: Option<SampleSpec>,
    /// The LoRA adapter this request's tokens are computed with (`None`: the base model).
    pub lora: Option<LoraId>,
}

/// What the executor needs to sample one token for a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSpec {
    pub params: SamplerSpec,
    /// Number of tokens this request has generated so far: with a seed, the random draw is a
    /// function of (seed, seed stream, output_idx) alone, so it does not depend on the batch.
    pub output_idx: u32,
    /// The tokens the sample may take (a structured-output constraint), as an index into
    /// [`StepPlan::token_masks`]; `None`: any token. The scheduler never sets it: the engine
    /// fills it in, from the request's constraint, between `schedule` and the forward.
    pub mask: Option<u32>,
    /// The request's logits processing (penalties, `logit_bias`, `min_tokens`), as an index
    /// into [`StepPlan::logits_adjusts`]; `None`: the logits are sampled as the model gave
    /// them. The scheduler sets it from the request's tokens.
    pub adjust: Option<u32>,
}

/// One sample's logits processing ([`crate::sampling::LogitsParams`] applied to its
/// request's tokens so far): a short list of the tokens whose logit changes, so the executor
/// needs nothing but the plan, and a request's sample depends on its own tokens alone.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LogitsAdjust {
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// Every token whose logit changes, sorted by id, each once.
    pub tokens: Vec<AdjustedToken>,
}

/// One token's entry in a [`LogitsAdjust`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdjustedToken {
    pub token: TokenId,
    /// Added first: the request's `logit_bias`, or `-inf` for a stop token `min_tokens`
    /// still holds back.
    pub bias: f32,
    /// How often the token appears in the output so far.
    pub output_count: u32,
    /// It appears in the prompt or the output (the repetition penalty applies).
    pub seen: bool,
}

impl LogitsAdjust {
    /// The processed logit of `entry`'s token, from its logit `l`: vLLM's order and
    /// arithmetic (bias, then `l / r` if positive else `l * r` for a seen token, then
    /// `- f * count`, then `- p` if it is in the output).
    pub fn apply(&self, entry: &AdjustedToken, l: f32) -> f32 {
        let mut l = l + entry.bias;
        if entry.seen && self.repetition_penalty != 1.0 {
            l = if l > 0.0 {
                l / self.repetition_penalty
            } else {
                l * self.repetition_penalty
            };
        }
        if entry.output_count > 0 {
            l -= self.frequency_penalty * entry.output_count as f32;
            l -= self.presence_penalty;
        }
        l
    }

    /// Applies the processing to a row of logits in place.
    pub fn apply_row(&self, logits: &mut [f32]) {
        for e in &self.tokens {
            if let Some(l) = logits.get_mut(e.token.index()) {
                *l = self.apply(e, *l);
            }
        }
    }
}

/// The tokens one sample may take: bit `t % 32` of word `t / 32` set means token `t` is
/// allowed (llguidance's layout). Tokens past the end are not allowed.
pub type TokenMask = Vec<u32>;

/// Whether `mask` allows `token`.
pub fn mask_allows(mask: &[u32], token: TokenId) -> bool {
    let t = token.index();
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// Everything the executor runs in one step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepPlan {
    /// Step counter (logical clock).
    pub step: u64,
    pub block_size: usize,
    pub reqs: Vec<ScheduledReq>,
    pub token_ids: Vec<TokenId>,
    pub block_tables: Vec<BlockId>,
    /// What each connector's worker does this step (before the forward), in connector order;
    /// only connectors with jobs appear. A plan with no requests but some work is a
    /// connector-only step: the engine runs the workers and no forward.
    pub connector_work: Vec<StepWork>,
    /// The masks of constrained samples ([`SampleSpec::mask`] indexes them).
    pub token_masks: Vec<TokenMask>,
    /// The logits processing of samples that have one ([`SampleSpec::adjust`] indexes them).
    pub logits_adjusts: Vec<LogitsAdjust>,
    /// The prompt logprobs this step computes, in plan order (requests that asked for them
    /// and compute prompt positions this step).
    pub prompt_logprobs: Vec<PromptLogprobsWork>,
    /// Requests whose earlier positions' expert routing the executor reads back from their
    /// blocks this step (an executor capturing routing, [`RoutingShape`]): positions whose KV
    /// the request did not compute itself (a prefix-cache hit, a connector's load), so its
    /// routing has a gap.
    pub routing_reads: Vec<RoutingRead>,
}

/// One request's read-back of stored routing: positions `from..start_pos` of
/// `reqs[req_pos]`, whose KV (and the routing stored with it) is in its blocks already.
///
/// The blocks read may be ones an earlier request of the same plan computes in this step (a
/// same-step prefix hit, as the choices of an `n` > 1 request take on the first's prompt):
/// like KV, an executor stores the routing of every request of the plan before it reads any
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingRead {
    /// Index of the request in [`StepPlan::reqs`].
    pub req_pos: usize,
    pub from: usize,
}

/// The shape of one token's expert routing as an executor captures it: for each decoder
/// layer in order, the `top_k` experts the router picked (best first); a dense layer of a
/// model with some (`mlp_only_layers`, `decoder_sparse_step`) has a row of zeros, as vLLM's
/// and SGLang's capture buffers leave them, so row `l` is always layer `l`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingShape {
    /// Decoder layers (`num_hidden_layers`).
    pub layers: usize,
    pub top_k: usize,
    /// Experts per layer (ids are below it).
    pub num_experts: usize,
}

impl RoutingShape {
    /// Expert ids per token: `layers × top_k`.
    pub fn width(&self) -> usize {
        self.layers * self.top_k
    }
}

/// A request's expert routing of its positions `0..rows()`, as the scheduler accumulated it
/// ([`crate::Finished::routing`]): the row of position `p` is the routing computed when the
/// token at `p` was the input of a forward (the latest such forward, after a preemption), or
/// read back from its block's stored routing when the request took the block as a
/// prefix-cache hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertRouting {
    pub shape: RoutingShape,
    /// `rows() × shape.width()` expert ids, position-major, then layer, then rank.
    pub ids: Vec<u16>,
}

impl ExpertRouting {
    /// Positions covered.
    pub fn rows(&self) -> usize {
        self.ids.len().checked_div(self.shape.width()).unwrap_or(0)
    }

    /// The first `n` rows (all of them if there are fewer).
    pub fn truncate_rows(&mut self, n: usize) {
        self.ids.truncate(n.saturating_mul(self.shape.width()));
    }
}

/// Expert routing of one request's consecutive positions, from one step: the positions it
/// computed, after the positions it read back ([`RoutingRead`]) if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedExperts {
    pub req: ReqIdx,
    /// Position of the first row.
    pub first_pos: usize,
    /// `positions × shape.width()` expert ids, position-major, then layer, then rank.
    pub ids: Vec<u16>,
}

/// One request's prompt logprobs in a step: the logits of each position this step computes
/// whose next token is in the prompt, scored against that token.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobsWork {
    /// Index of the request in [`StepPlan::reqs`].
    pub req_pos: usize,
    /// How many top logprobs besides the prompt token's.
    pub top_n: u32,
    /// The prompt tokens at positions `start_pos + 1 ..`, one per position from `start_pos`:
    /// position `start_pos + i` is scored against `targets[i]`.
    pub targets: Vec<TokenId>,
}

/// The logprob of one prompt token under the logits of the position before it (raw
/// log-softmax, whatever the logprobs mode, as vLLM reports prompt logprobs).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTokenLogprob {
    pub token: TokenId,
    pub logprob: f32,
    /// How many tokens have a logprob at least this one's, itself included (vLLM's rank: 1
    /// for the most likely token).
    pub rank: u32,
    /// The top-n `(token, logprob)` pairs, best first.
    pub top: Vec<(TokenId, f32)>,
}

/// A request's prompt logprobs computed by one step: positions `first_target..` of its
/// prompt, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    pub req: ReqIdx,
    /// Position of the first scored prompt token (at least 1).
    pub first_target: usize,
    pub tokens: Vec<PromptTokenLogprob>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// No request to compute (there may still be connector work).
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Nothing at all to do: no request and no connector work.
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty() && self.connector_work.is_empty()
    }

    pub fn tokens_of(&self, r: &ScheduledReq) -> &[TokenId] {
        &self.token_ids[r.tokens.clone()]
    }

    pub fn block_table_of(&self, r: &ScheduledReq) -> &[BlockId] {
        &self.block_tables[r.blocks.clone()]
    }

    /// The mask a sample is held to, if any.
    pub fn mask_of(&self, spec: &SampleSpec) -> Option<&[u32]> {
        spec.mask
            .and_then(|i| self.token_masks.get(i as usize))
            .map(Vec::as_slice)
    }

    /// The logits processing of a sample, if any.
    pub fn adjust_of(&self, spec: &SampleSpec) -> Option<&LogitsAdjust> {
        spec.adjust
            .and_then(|i| self.logits_adjusts.get(i as usize))
    }

    /// Arena slot (`block * block_size + offset`) of the token at absolute position `pos`.
    pub fn slot_of(&self, r: &ScheduledReq, pos: usize) -> usize {
        let table = self.block_table_of(r);
        table[pos / self.block_size].index() * self.block_size + pos % self.block_size
    }
}

/// One sampled token with its logprobs, computed from the same logits the sample used.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub req: ReqIdx,
    pub token: TokenId,
    /// Log-probability of `token` under the raw model logits (log-softmax before temperature,
    /// top-k/p or min-p), as vLLM's default `raw_logprobs` reports them; an executor set to
    /// another logprobs mode reports that mode's value here instead (processed logprobs,
    /// raw or processed logits; `ferry_model::sampler::LogprobsMode`).
    pub logprob: f32,
    /// The top-n `(token, logprob)` pairs, best first, when logprobs were asked for (values
    /// in the same mode as `logprob`).
    pub top_logprobs: Vec<(TokenId, f32)>,
}

/// The executor's answer to a [`StepPlan`]: one entry per scheduled request with `sample`
/// set, in plan order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelOutput {
    pub sampled: Vec<SampledToken>,
    /// One entry per [`StepPlan::prompt_logprobs`] item, in its order (an executor that cannot
    /// compute them, such as the checksum model, leaves this empty).
    pub prompt_logprobs: Vec<PromptLogprobs>,
    /// Expert routing, one entry per scheduled request, in plan order, when the executor
    /// captures it ([`RoutingShape`]); empty otherwise.
    pub routed: Vec<RoutedExperts>,
}
