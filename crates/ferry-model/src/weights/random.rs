//! Models with random weights in a real architecture's shape: for tests (small configs) and
//! for `ferry bench model --random` (the SmolLM2-135M shape) before or without a download.
//! Among the weights, which it makes as a store of tensors, so that their own tests can use
//! it; the crate root names it `random_model` as before.

use super::store::{Tensor, WeightStore};
use crate::config::expected_tensors;
use crate::config::LlamaConfig;
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
        bos_token_id: Some(TokenId(1)),
        eos_token_ids: vec![TokenId(2)],
    }
}

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
