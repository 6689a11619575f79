//! The tensors a [`LlamaConfig`] needs, by Hugging Face name and PyTorch shape. Part of the
//! config (the architecture it describes holds them), below everything that builds or checks
//! them: the loaders, the weights, the random and tiny models.
//!
//! The loaders validate against this list (so a checkpoint that lacks or misshapes a tensor
//! fails at load, naming it), and the model reads exactly these names. A tensor a file holds
//! beyond the list is refused too, naming it (a weight the forward would silently drop is a
//! wrong answer with no warning), unless [`is_ignorable`] says it carries nothing the
//! forward lacks; docs/model.md lists those.

use super::LlamaConfig;

/// Every tensor the model needs, in a stable order: embeddings, then each layer, then the
/// final norm and (unless tied to the embeddings) `lm_head.weight`.
pub fn expected_tensors(config: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let hidden = config.hidden_size;
    let q_dim = config.num_attention_heads * config.head_dim;
    let kv_dim = config.num_key_value_heads * config.head_dim;
    let inter = config.intermediate_size;

    let mut out = vec![(
        "model.embed_tokens.weight".to_owned(),
        vec![config.vocab_size, hidden],
    )];
    for layer in 0..config.num_hidden_layers {
        let p = |name: &str| format!("model.layers.{layer}.{name}");
        out.push((p("input_layernorm.weight"), vec![hidden]));
        out.push((p("self_attn.q_proj.weight"), vec![q_dim, hidden]));
        out.push((p("self_attn.k_proj.weight"), vec![kv_dim, hidden]));
        out.push((p("self_attn.v_proj.weight"), vec![kv_dim, hidden]));
        if config.attention_bias {
            out.push((p("self_attn.q_proj.bias"), vec![q_dim]));
            out.push((p("self_attn.k_proj.bias"), vec![kv_dim]));
            out.push((p("self_attn.v_proj.bias"), vec![kv_dim]));
        }
        if config.qk_norm {
            let (q, k) = qk_norm_lens(config);
            out.push((p("self_attn.q_norm.weight"), vec![q]));
            out.push((p("self_attn.k_norm.weight"), vec![k]));
        }
        out.push((p("self_attn.o_proj.weight"), vec![hidden, q_dim]));
        if config.o_proj_bias {
            out.push((p("self_attn.o_proj.bias"), vec![hidden]));
        }
        out.push((p("post_attention_layernorm.weight"), vec![hidden]));
        match config.sparse_layer(layer) {
            None => {
                out.push((p("mlp.gate_proj.weight"), vec![inter, hidden]));
                out.push((p("mlp.up_proj.weight"), vec![inter, hidden]));
                out.push((p("mlp.down_proj.weight"), vec![hidden, inter]));
            }
            Some(moe) => {
                let block = moe.naming.block();
                let e_inter = moe.expert_intermediate_size;
                out.push((
                    p(&format!("{block}.gate.weight")),
                    vec![moe.num_experts, hidden],
                ));
                for e in 0..moe.num_experts {
                    let [gate, up, down] = moe.naming.expert(e);
                    out.push((p(&gate), vec![e_inter, hidden]));
                    out.push((p(&up), vec![e_inter, hidden]));
                    out.push((p(&down), vec![hidden, e_inter]));
                }
                if let Some(s_inter) = moe.shared_expert_intermediate_size {
                    out.push((
                        p("mlp.shared_expert.gate_proj.weight"),
                        vec![s_inter, hidden],
                    ));
                    out.push((p("mlp.shared_expert.up_proj.weight"), vec![s_inter, hidden]));
                    out.push((
                        p("mlp.shared_expert.down_proj.weight"),
                        vec![hidden, s_inter],
                    ));
                    out.push((p("mlp.shared_expert_gate.weight"), vec![1, hidden]));
                }
            }
        }
    }
    out.push(("model.norm.weight".to_owned(), vec![hidden]));
    if !config.tie_word_embeddings {
        out.push(("lm_head.weight".to_owned(), vec![config.vocab_size, hidden]));
    }
    out
}

/// One per-expert tensor inside a tensor of transformers 5's fused MoE layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedPart {
    /// Its name in [`expected_tensors`].
    pub name: String,
    pub shape: Vec<usize>,
    /// Offset of its first element in the fused tensor (row-major).
    pub offset: usize,
}

/// The names (after `model.layers.{l}.`) of the tensors [`fused_parts`] splits: every
/// tensor of transformers 5's MoE layout that is not a checkpoint's own.
pub const FUSED_PARAMS: [&str; 3] = [
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "mlp.gate.weight",
];

/// The tensors of [`expected_tensors`] that `name` holds in the layout transformers 5 keeps
/// MoE weights in memory (a trainer's `state_dict`, or `save_pretrained(...,
/// save_original_format=False)`), with the shape it must have; `None` for any other name.
///
/// * `model.layers.{l}.mlp.experts.gate_up_proj` `[E, 2I, H]`: expert `e`'s gate rows, then
///   its up rows (transformers' forward `linear(x, gate_up_proj[e]).chunk(2)`).
/// * `model.layers.{l}.mlp.experts.down_proj` `[E, H, I]`: expert `e`'s down projection.
/// * Mixtral's router, which transformers 5 renames `mlp.gate.weight`.
pub fn fused_parts(config: &LlamaConfig, name: &str) -> Option<(Vec<usize>, Vec<FusedPart>)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer_text, param) = rest.split_once('.')?;
    let layer: usize = layer_text.parse().ok()?;
    if layer.to_string() != layer_text {
        return None;
    }
    let moe = config.sparse_layer(layer)?;
    let (h, i, n) = (
        config.hidden_size,
        moe.expert_intermediate_size,
        moe.num_experts,
    );
    let prefix = format!("model.layers.{layer}.");
    let part = |name: &str, shape: Vec<usize>, offset| FusedPart {
        name: format!("{prefix}{name}"),
        shape,
        offset,
    };
    match param {
        "mlp.experts.gate_up_proj" => Some((
            vec![n, 2 * i, h],
            (0..n)
                .flat_map(|e| {
                    let [gate, up, _] = moe.naming.expert(e);
                    let at = e * 2 * i * h;
                    [
                        part(&gate, vec![i, h], at),
                        part(&up, vec![i, h], at + i * h),
                    ]
                })
                .collect(),
        )),
        "mlp.experts.down_proj" => Some((
            vec![n, h, i],
            (0..n)
                .map(|e| part(&moe.naming.expert(e)[2], vec![h, i], e * h * i))
                .collect(),
        )),
        "mlp.gate.weight" if moe.naming == crate::config::ExpertNaming::Mixtral => Some((
            vec![n, h],
            vec![part("block_sparse_moe.gate.weight", vec![n, h], 0)],
        )),
        _ => None,
    }
}

/// Lengths of the q and k norm weights: one head's (Qwen3, per head), or the whole
/// projection's (OLMoE).
pub fn qk_norm_lens(config: &LlamaConfig) -> (usize, usize) {
    let hd = config.head_dim;
    if config.qk_norm_whole {
        (
            config.num_attention_heads * hd,
            config.num_key_value_heads * hd,
        )
    } else {
        (hd, hd)
    }
}

/// Whether a checkpoint tensor outside [`expected_tensors`] may be left unread: only
/// `rotary_emb.inv_freq` buffers (per layer or model-wide), the rope inverse frequencies that
/// older transformers versions saved and that the config's `rope_theta` and `rope_scaling`
/// determine (transformers recomputes them at load too). A tied model's `lm_head.weight` is
/// not on this list: the safetensors loader accepts it only when it equals the embedding.
pub fn is_ignorable(name: &str) -> bool {
    name.strip_suffix(".rotary_emb.inv_freq")
        .is_some_and(|prefix| prefix == "model" || prefix.starts_with("model.layers."))
}

#[cfg(test)]
mod tests {
    use super::is_ignorable;

    #[test]
    fn only_rope_inverse_frequencies_are_ignorable() {
        assert!(is_ignorable("model.layers.3.self_attn.rotary_emb.inv_freq"));
        assert!(is_ignorable("model.rotary_emb.inv_freq"));
        assert!(!is_ignorable("rotary_emb.inv_freq"));
        assert!(!is_ignorable("model.layers.0.self_attn.o_proj.bias"));
        assert!(!is_ignorable("lm_head.weight"));
    }
}
