//! Models with random weights in a real architecture's shape: for tests (small configs) and
//! for `ferry bench model --random` (the SmolLM2-135M shape) before or without a download.
//! Among the weights, which it makes as a store of tensors, so that their own tests can use
//! it; the crate root names it `random_model` as before.

use super::store::{Tensor, WeightStore};
use crate::config::expected_tensors;
use crate::config::{ExpertNaming, LlamaConfig, MoeConfig};
use ferry_core::TokenId;

/// A small Llama config for tests: hidden 64, 4 heads, 2 KV heads, 2 layers, vocab 97.
pub fn small_config() -> LlamaConfig {
    LlamaConfig {
        architecture: "LlamaForCausalLM".into(),
        vocab_size: 97,
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        attention_bias: false,
        o_proj_bias: false,
        qk_norm: false,
        qk_norm_whole: false,
        clip_qkv: None,
        moe: None,
        bos_token_id: Some(TokenId(1)),
        eos_token_ids: vec![TokenId(2)],
    }
}

/// A small MoE config of `architecture` (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM,
/// OlmoeForCausalLM, MixtralForCausalLM) in the shape of [`small_config`]: 8 experts, top-2
/// (Qwen3-MoE: top-3, head_dim 24, its last layer dense), each architecture's own options on.
pub fn small_moe_config(architecture: &str) -> LlamaConfig {
    let base = small_config();
    let n_layers = 3;
    let mut moe = MoeConfig {
        num_experts: 8,
        top_k: 2,
        expert_intermediate_size: 32,
        norm_topk_prob: false,
        sparse_layers: vec![true; n_layers],
        shared_expert_intermediate_size: None,
        naming: ExpertNaming::Qwen,
    };
    let mut c = LlamaConfig {
        architecture: architecture.into(),
        num_hidden_layers: n_layers,
        ..base
    };
    match architecture {
        "Qwen3MoeForCausalLM" => {
            c.qk_norm = true;
            c.head_dim = 24;
            moe.top_k = 3;
            moe.norm_topk_prob = true;
            moe.sparse_layers[2] = false;
        }
        "Qwen2MoeForCausalLM" => {
            c.attention_bias = true;
            moe.shared_expert_intermediate_size = Some(48);
        }
        "OlmoeForCausalLM" => {
            // OLMoE's and Mixtral's configs have one intermediate size, the experts'.
            c.intermediate_size = moe.expert_intermediate_size;
            c.qk_norm = true;
            c.qk_norm_whole = true;
            c.clip_qkv = Some(0.9);
        }
        "MixtralForCausalLM" => {
            c.intermediate_size = moe.expert_intermediate_size;
            moe.norm_topk_prob = true;
            moe.naming = ExpertNaming::Mixtral;
        }
        other => panic!("{other} is not an MoE architecture"),
    }
    c.moe = Some(moe);
    c
}

/// The MoE architectures [`small_moe_config`] makes.
pub const MOE_ARCHITECTURES: [&str; 4] = [
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "OlmoeForCausalLM",
    "MixtralForCausalLM",
];

/// The shape of SmolLM2-135M (hidden 576, 30 layers, 9 heads, 3 KV heads, vocab 49152, tied).
pub fn smollm2_135m_config() -> LlamaConfig {
    LlamaConfig {
        architecture: "LlamaForCausalLM".into(),
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        attention_bias: false,
        o_proj_bias: false,
        qk_norm: false,
        qk_norm_whole: false,
        clip_qkv: None,
        moe: None,
        bos_token_id: Some(TokenId(1)),
        eos_token_ids: vec![TokenId(2)],
    }
}

/// Random weights for `config`, a pure function of `seed`. Norm weights are near 1 and
/// matrices scaled by `1/sqrt(fan_in)`, so activations stay in a realistic range.
pub fn random_weights(config: &LlamaConfig, seed: u64) -> WeightStore {
    let mut rng = SplitMix64(seed);
    let mut store = WeightStore::default();
    for (name, shape) in expected_tensors(config) {
        let n: usize = shape.iter().product();
        let is_norm = name.ends_with("norm.weight");
        let scale = if is_norm {
            0.2
        } else if shape.len() == 2 {
            2.0 / (shape[1] as f32).sqrt()
        } else {
            0.2
        };
        let data = (0..n)
            .map(|_| {
                let u = rng.next_f32() - 0.5;
                if is_norm {
                    1.0 + u * scale
                } else {
                    u * scale
                }
            })
            .collect();
        store.insert(name, Tensor::new(shape, data));
    }
    store
}

/// A tiny deterministic generator (SplitMix64): random weights need no crate, and the same
/// seed must give the same model on every platform.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}
