//! Llama-family model configuration, as read from a Hugging Face `config.json` or GGUF metadata.

use ferry_core::TokenId;
use serde::{Deserialize, Serialize};

pub mod tensors;

pub use tensors::{
    expected_tensors, fused_parts, is_ignorable, qk_norm_lens, FusedPart, FUSED_PARAMS,
};

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
    /// RMSNorm on q and k before rope: per head (Qwen3), or over the whole projection when
    /// `qk_norm_whole` is set (OLMoE: weights `[heads · head_dim]` and `[kv_heads · head_dim]`).
    pub qk_norm: bool,
    #[serde(default)]
    pub qk_norm_whole: bool,
    /// OLMoE's `clip_qkv`: q, k and v clamped to `[-c, c]` after the q/k norms.
    #[serde(default)]
    pub clip_qkv: Option<f32>,
    /// Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral); `None`: dense.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<TokenId>,
    /// Every token id that ends generation (config.json and generation_config.json merged).
    pub eos_token_ids: Vec<TokenId>,
}

/// The mixture-of-experts part of a config: which layers route, to how many experts, and how
/// the checkpoint names them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts`, Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's intermediate size (`moe_intermediate_size`; Mixtral's and OLMoE's
    /// `intermediate_size`). Dense layers of the model use [`LlamaConfig::intermediate_size`].
    pub expert_intermediate_size: usize,
    /// Whether the top-k routing weights are renormalised to sum to 1 (`norm_topk_prob`;
    /// Mixtral always does).
    pub norm_topk_prob: bool,
    /// Per layer, whether its MLP is a mixture of experts (`decoder_sparse_step` and
    /// `mlp_only_layers` decide it in Qwen's configs; every layer elsewhere).
    pub sparse_layers: Vec<bool>,
    /// Qwen2-MoE's shared expert: its intermediate size (`shared_expert_intermediate_size`);
    /// its output is scaled by `sigmoid(shared_expert_gate · x)` and added to the experts'.
    pub shared_expert_intermediate_size: Option<usize>,
    /// How the checkpoint names the block's tensors.
    pub naming: ExpertNaming,
}

/// Tensor names of an MoE block, after `model.layers.{l}.`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertNaming {
    /// `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen, OLMoE).
    Qwen,
    /// `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
    /// (Mixtral: w1 is the gate, w3 the up and w2 the down projection).
    Mixtral,
}

impl ExpertNaming {
    /// The block's prefix after the layer's: `mlp` or `block_sparse_moe`.
    pub fn block(self) -> &'static str {
        match self {
            Self::Qwen => "mlp",
            Self::Mixtral => "block_sparse_moe",
        }
    }

    /// Expert `e`'s gate, up and down projections (after the layer's prefix).
    pub fn expert(self, e: usize) -> [String; 3] {
        let b = self.block();
        let [g, u, d] = match self {
            Self::Qwen => ["gate_proj", "up_proj", "down_proj"],
            Self::Mixtral => ["w1", "w3", "w2"],
        };
        [g, u, d].map(|m| format!("{b}.experts.{e}.{m}.weight"))
    }
}

impl MoeConfig {
    /// Whether layer `l` routes to experts (a dense MLP otherwise).
    pub fn is_sparse(&self, l: usize) -> bool {
        self.sparse_layers.get(l).copied().unwrap_or(false)
    }

    /// How many layers route to experts.
    pub fn n_sparse(&self) -> usize {
        self.sparse_layers.iter().filter(|&&s| s).count()
    }
}

impl LlamaConfig {
    /// The MoE config when layer `l` routes to experts.
    pub fn sparse_layer(&self, l: usize) -> Option<&MoeConfig> {
        self.moe.as_ref().filter(|m| m.is_sparse(l))
    }
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
