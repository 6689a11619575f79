//! Llama-family model configuration, as read from a Hugging Face `config.json` or GGUF metadata.

use ferry_core::TokenId;
use serde::{Deserialize, Serialize};

pub mod tensors;

pub use tensors::{expected_tensors, is_ignorable};

/// One configuration for every supported architecture (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3):
/// they differ only in the flags below.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `architectures[0]` from config.json (or derived from GGUF), e.g. "LlamaForCausalLM".
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` unless config.json says otherwise (Qwen3 does).
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2/2.5 always; Llama and Qwen3 with `attention_bias`).
    pub attention_bias: bool,
    /// Bias on the output projection `o_proj` (Llama and Qwen3 with `attention_bias`, which
    /// transformers gives every attention projection; never Qwen2, whose `o_proj` has none).
    #[serde(default)]
    pub o_proj_bias: bool,
    /// RMSNorm on q and k per head before rope (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<TokenId>,
    /// Every token id that ends generation (config.json and generation_config.json merged).
    pub eos_token_ids: Vec<TokenId>,
}

/// Rope scaling variants we support.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// Plain linear position interpolation.
    Linear { factor: f32 },
    /// Per-frequency divisors of the base frequencies (`head_dim / 2` of them): a GGUF's
    /// `rope_freqs.weight`, which is how llama.cpp's converter writes Llama 3's scaling
    /// (its factors are `1 / (llama3 scale)` of each frequency, so dividing by them gives
    /// Hugging Face's frequencies to f32 precision).
    Factors { factors: Vec<f32> },
}
