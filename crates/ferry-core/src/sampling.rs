//! Per-request sampling parameters: what the scheduler needs (stop conditions, lengths) and
//! what the executor's sampler needs (temperature, top-k/p, min-p, seed, logprobs).

use crate::plan::TokenId;

/// How a request is sampled and when it stops. Stop *strings* are not here: they need text,
/// and text is the server's business (it detokenizes and aborts on a match).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Maximum number of generated tokens.
    pub max_tokens: u32,
    /// `0.0` means greedy.
    pub temperature: f32,
    /// `0` means disabled.
    pub top_k: u32,
    /// `1.0` means disabled.
    pub top_p: f32,
    /// `0.0` means disabled.
    pub min_p: f32,
    /// Per-request seed; with a seed, sampling is reproducible whatever the batch.
    pub seed: Option<u64>,
    /// Number of top logprobs to return besides the sampled token's (None: no logprobs).
    pub logprobs: Option<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Extra token ids that stop generation (the stop token is included in the output).
    pub stop_token_ids: Vec<TokenId>,
    /// Isolates prefix-cache hits between tenants: folded into the first block's hash.
    pub cache_salt: Option<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            logprobs: None,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            cache_salt: None,
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

    /// The part of the parameters the executor's sampler needs (small, `Copy`).
    pub fn sampler_spec(&self) -> SamplerSpec {
        SamplerSpec {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            logprobs: self.logprobs,
        }
    }
}

/// What the sampler needs to draw one token; copied into the [`crate::StepPlan`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerSpec {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub logprobs: Option<u32>,
}
