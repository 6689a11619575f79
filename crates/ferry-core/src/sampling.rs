//! Per-request sampling parameters: what the scheduler needs (stop conditions, lengths) and,
//! as one part of them, what the executor's sampler needs ([`SamplerSpec`]: temperature,
//! top-k/p, min-p, seed, logprobs), which the plan carries to the executor as it is.

use crate::ids::TokenId;
use crate::lora::LoraRef;

/// How a request is sampled and when it stops. Stop *strings* are not here: they need text,
/// and text is the server's business (it detokenizes and aborts on a match).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Maximum number of generated tokens.
    pub max_tokens: u32,
    /// How each token is drawn; copied into every step plan that samples this request.
    pub sampler: SamplerSpec,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Extra token ids that stop generation (the stop token is included in the output).
    pub stop_token_ids: Vec<TokenId>,
    /// Isolates prefix-cache hits between tenants: folded into the first block's hash.
    pub cache_salt: Option<String>,
    /// Penalties, `logit_bias` and `min_tokens`: the logits processing that depends on the
    /// request's tokens (see [`LogitsParams`]).
    pub logits: LogitsParams,
    /// Logprobs of the prompt's tokens (each under the logits of the position before it),
    /// with this many top logprobs besides: computed in the prefill, which then takes no
    /// prefix-cache hit so that every position is computed (as vLLM). `None`: none.
    pub prompt_logprobs: Option<u32>,
    /// The LoRA adapter the request is computed with (`None`: the base model). It must be
    /// the adapter as loaded when the request is added (`Scheduler::load_lora`); an in-place
    /// reload while the request lives moves it to the new version (`Request::lora`).
    pub lora: Option<LoraRef>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            sampler: SamplerSpec::default(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            cache_salt: None,
            logits: LogitsParams::default(),
            prompt_logprobs: None,
            lora: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of exactly `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            max_tokens,
            ignore_eos: true,
            ..Self::default()
        }
    }
}

/// What the sampler needs to draw one token (small, `Copy`): the part of
/// [`SamplingParams`] the executor reads, carried in the [`crate::StepPlan`].
///
/// * `temperature`: `0.0` is greedy;
/// * `top_k` (`0`: off), `top_p` (`1.0`: off), `min_p` (`0.0`: off): the filters;
/// * `seed`: with one, sampling is reproducible whatever the batch;
/// * `seed_stream`: which of the seed's independent random streams the request draws from
///   (choice `i` of an `n > 1` request uses stream `i`, so choices of nearby seeds never share
///   draws); `0` for a lone request, whose draws are those of the seed alone;
/// * `logprobs`: how many top logprobs to return besides the sampled token's (`None`: none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerSpec {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub seed_stream: u32,
    pub logprobs: Option<u32>,
}

impl Default for SamplerSpec {
    /// Greedy, no filters, no seed, no logprobs.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            seed_stream: 0,
            logprobs: None,
        }
    }
}

/// vLLM's logits processors that look at the request's tokens, with vLLM's semantics:
///
/// * `logit_bias`: added to the token's logit;
/// * `min_tokens`: until that many tokens are generated, EOS (unless `ignore_eos`) and the
///   `stop_token_ids` cannot be sampled (their logits are `-inf`) and do not stop the request;
/// * `repetition_penalty` (`1.0`: off): a token that appears in the prompt or the output has
///   its logit divided by the penalty when positive, multiplied by it otherwise;
/// * `frequency_penalty` times the token's count in the output, and `presence_penalty` once
///   if it appears in the output, are subtracted (OpenAI's definition).
///
/// Applied in that order (bias and `min_tokens`, then repetition, frequency, presence), on
/// the raw logits, before temperature and the filters, as vLLM's v1 sampler does; the
/// scheduler turns them into one [`crate::plan::LogitsAdjust`] per sample.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsParams {
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// `(token, bias)`, one entry per token.
    pub logit_bias: Vec<(TokenId, f32)>,
    pub min_tokens: u32,
}

impl Default for LogitsParams {
    /// Nothing: no penalty, no bias, no minimum.
    fn default() -> Self {
        Self {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
        }
    }
}

impl LogitsParams {
    /// Whether the penalties change any logit (bias and `min_tokens` aside).
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}
