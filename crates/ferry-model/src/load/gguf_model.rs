//! A GGUF file (llama, Mixtral as llama with experts, qwen2, qwen3, qwen3moe, qwen2moe or
//! olmoe architecture) → [`LoadedModel`]: config from `<arch>.*` metadata, tensors renamed to
//! Hugging Face names (kept as stored or dequantized to f32), stacked expert tensors split
//! into one tensor per expert, a llama model's q/k rows un-permuted, and the tokenizer and
//! chat template from `tokenizer.*` metadata.

use ferry_core::TokenId;
use std::path::Path;

use super::gguf::{GgufFile, GgufValue};
use super::tokenizer::{byte_level_bpe, byte_to_char, ByteLevelBpeSpec, PreTokenizerKind};
use super::{
    expected_tensors, LoadError, LoadedModel, Precision, Progress, StoredDest, TensorDest,
};
use crate::dtype::WeightDtype;
use crate::{ExpertNaming, LlamaConfig, MoeConfig, RopeScaling, WeightStore};

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

pub(crate) fn load_gguf(
    path: &Path,
    precision: Precision,
    progress: Progress<'_>,
) -> Result<LoadedModel, LoadError> {
    let gguf = GgufFile::open(path)?;
    let config = gguf_config(&gguf)?;
    let mut weights = WeightStore::default();
    match precision {
        Precision::F32 => gguf_weights(&gguf, &config, &mut weights, progress)?,
        Precision::Stored => gguf_weights(&gguf, &config, &mut StoredDest(&mut weights), progress)?,
    }
    let tokenizer = gguf_tokenizer(&gguf)?;
    let chat_template = gguf
        .get("tokenizer.chat_template")
        .and_then(GgufValue::as_str)
        .map(str::to_owned);
    Ok(LoadedModel {
        config,
        weights,
        tokenizer,
        chat_template,
        source: path.display().to_string(),
    })
}

/// Layer tensors llama.cpp names `blk.{l}.<gguf>.{weight,bias}`, and their Hugging Face
/// names after `model.layers.{l}.` (the first of a GGUF part's names is the one
/// [`hf_tensor_name`] gives; a Mixtral router is `block_sparse_moe.gate`). The stacked expert
/// tensors are [`EXPERT_PARTS`].
const BLOCK_PARTS: [(&str, &str); 17] = [
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_inp", "block_sparse_moe.gate"),
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
];

/// llama.cpp's stacked expert tensors (`blk.{l}.<gguf>.weight`, ggml dims `[cols, rows,
/// experts]`: expert `e` is the `e`-th `[rows, cols]` matrix) and each expert's projection
/// in the Qwen/OLMoE and Mixtral namings.
const EXPERT_PARTS: [(&str, &str, &str); 3] = [
    ("ffn_gate_exps", "gate_proj", "w1"),
    ("ffn_up_exps", "up_proj", "w3"),
    ("ffn_down_exps", "down_proj", "w2"),
];

/// The Hugging Face name of a GGUF tensor name, or `None` for tensors the model does not use
/// and for the stacked expert tensors (`ffn_*_exps`), which hold one tensor per expert (see
/// [`gguf_place`]).
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_owned());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let (_, hf) = BLOCK_PARTS.iter().find(|(g, _)| *g == part)?;
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Where a Hugging Face tensor is in a GGUF file: the GGUF tensor's name, and for one
/// expert's projection, the expert's index in the stacked tensor. `None` for a name no GGUF
/// tensor holds.
pub fn gguf_place(hf: &str) -> Option<(String, Option<usize>)> {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return Some(((*g).to_owned(), None));
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, param) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = param.rsplit_once('.')?;
    for block in ["mlp", "block_sparse_moe"] {
        let Some(expert) = part.strip_prefix(block) else {
            continue;
        };
        let Some(expert) = expert.strip_prefix(".experts.") else {
            continue;
        };
        let (e, proj) = expert.split_once('.')?;
        let e: usize = e.parse().ok()?;
        let (g, _, _) = EXPERT_PARTS
            .iter()
            .find(|(_, qwen, mixtral)| proj == if block == "mlp" { *qwen } else { *mixtral })?;
        return Some((format!("blk.{layer}.{g}.{suffix}"), Some(e)));
    }
    let (g, _) = BLOCK_PARTS.iter().find(|(_, h)| *h == part)?;
    Some((format!("blk.{layer}.{g}.{suffix}"), None))
}

/// GGUF architectures (`general.architecture`) and the Hugging Face architecture each is. A
/// `llama` file with `llama.expert_count` is Mixtral (llama.cpp converts Mixtral to `llama`).
pub const GGUF_ARCHITECTURES: [(&str, &str); 6] = [
    ("llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("qwen3moe", "Qwen3MoeForCausalLM"),
    ("qwen2moe", "Qwen2MoeForCausalLM"),
    ("olmoe", "OlmoeForCausalLM"),
];

/// The config a GGUF of a supported architecture ([`GGUF_ARCHITECTURES`]) describes, from
/// its `<arch>.*` metadata and which tensors it holds: q/k/v biases where layer 0 has
/// `attn_q.bias` (Qwen2 and Qwen2-MoE always, which must have them), an `o_proj` bias where
/// it has `attn_output.bias` (never Qwen2 or Qwen2-MoE, whose `o_proj` has none: one there is
/// refused as unused), q/k norms for Qwen3 and Qwen3-MoE (per head) and OLMoE (over the whole
/// projection), experts per [`moe_config`].
pub fn gguf_config(gguf: &GgufFile) -> Result<LlamaConfig, LoadError> {
    let meta = Meta { gguf };
    let arch = meta.str("general.architecture")?;
    let Some(&(_, hf_architecture)) = GGUF_ARCHITECTURES.iter().find(|(a, _)| *a == arch) else {
        return Err(LoadError::UnsupportedArchitecture {
            path: gguf.path.clone(),
            architecture: arch.to_owned(),
            supported: "llama (with experts: Mixtral), qwen2, qwen3, qwen3moe, qwen2moe, olmoe",
        });
    };
    let k = |key: &str| format!("{arch}.{key}");
    let hidden_size = meta.usize(&k("embedding_length"))?;
    let num_attention_heads = meta.usize(&k("attention.head_count"))?;
    if num_attention_heads == 0 {
        return Err(meta.err(&k("attention.head_count"), "must be positive"));
    }
    let head_dim = match meta.opt_usize(&k("attention.key_length"))? {
        Some(d) => d,
        None => hidden_size / num_attention_heads,
    };
    // Partial rotary embeddings (rope over fewer dims than the head) are not implemented.
    if let Some(rope_dims) = meta.opt_usize(&k("rope.dimension_count"))? {
        if rope_dims != head_dim {
            return Err(LoadError::UnsupportedRope {
                path: gguf.path.clone(),
                rope_type: format!("partial rope over {rope_dims} of {head_dim} head dims"),
            });
        }
    }
    let vocab_size = match gguf.array_len("tokenizer.ggml.tokens") {
        Some(n) => n,
        None => meta.usize(&k("vocab_size"))?,
    };
    let mut eos_token_ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = meta.opt_u32(key)? {
            super::config_json::merge_eos(&mut eos_token_ids, &[TokenId(id)]);
        }
    }
    let num_hidden_layers = meta.usize(&k("block_count"))?;
    let intermediate_size = meta.usize(&k("feed_forward_length"))?;
    let moe = moe_config(&meta, arch, num_hidden_layers, intermediate_size)?;
    let hf_architecture = match (&moe, arch) {
        (Some(_), "llama") => "MixtralForCausalLM",
        _ => hf_architecture,
    };
    let qwen2_like = matches!(arch, "qwen2" | "qwen2moe");
    let config = LlamaConfig {
        architecture: hf_architecture.into(),
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: meta
            .opt_usize(&k("attention.head_count_kv"))?
            .unwrap_or(num_attention_heads),
        head_dim,
        rms_norm_eps: meta
            .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        rope_theta: meta.opt_f32(&k("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_scaling: rope_scaling(&meta, arch, head_dim)?,
        max_position_embeddings: meta.opt_usize(&k("context_length"))?.unwrap_or(2048),
        tie_word_embeddings: gguf.tensor_info("output.weight").is_none(),
        attention_bias: qwen2_like || gguf.tensor_info("blk.0.attn_q.bias").is_some(),
        o_proj_bias: !qwen2_like && gguf.tensor_info("blk.0.attn_output.bias").is_some(),
        qk_norm: matches!(arch, "qwen3" | "qwen3moe" | "olmoe"),
        qk_norm_whole: arch == "olmoe",
        // llama.cpp's converter writes no clamp for OLMoE (whose released checkpoints have
        // none); one given as `attention.clamp_kqv`, OLMo's key, is transformers' clip_qkv.
        clip_qkv: match arch {
            "olmoe" => meta.opt_f32(&k("attention.clamp_kqv"))?,
            _ => None,
        },
        moe,
        bos_token_id: meta.opt_u32("tokenizer.ggml.bos_token_id")?.map(TokenId),
        eos_token_ids,
    };
    super::config_json::validate(&config, &gguf.path)?;
    Ok(config)
}

/// The experts of a `qwen3moe`, `qwen2moe`, `olmoe` or `llama` (Mixtral) file, from the keys
/// llama.cpp reads (`<arch>.expert_count`, `expert_used_count`, `expert_feed_forward_length`,
/// `expert_shared_feed_forward_length`) with its defaults, and its routing: softmax top-k,
/// renormalised for qwen3moe and llama as llama.cpp hard-codes it (and transformers' Qwen3-MoE
/// checkpoints and Mixtral do) unless `expert_weights_norm` says otherwise, not for qwen2moe
/// and olmoe. A layer routes to experts where it has `ffn_gate_inp` (llama.cpp's files route
/// in every layer; a Qwen-MoE's dense layers are read as `ffn_gate`/`ffn_up`/`ffn_down`).
/// Routing llama.cpp would compute otherwise (scaled or sigmoid weights, expert groups,
/// several shared experts) is refused, naming the key. `None` for a dense model.
fn moe_config(
    meta: &Meta<'_>,
    arch: &str,
    n_layers: usize,
    intermediate_size: usize,
) -> Result<Option<MoeConfig>, LoadError> {
    let k = |key: &str| format!("{arch}.{key}");
    let count_key = k("expert_count");
    let num_experts = match arch {
        "qwen3moe" | "qwen2moe" | "olmoe" => meta.usize(&count_key)?,
        "llama" => match meta.opt_usize(&count_key)? {
            None | Some(0) => return Ok(None),
            Some(n) => n,
        },
        _ => return Ok(None),
    };
    let max = super::config_json::MAX_EXPERTS;
    if num_experts == 0 || num_experts > max {
        return Err(meta.err(
            &count_key,
            format!("{num_experts} experts: expected 1 to {max}"),
        ));
    }
    let used_key = k("expert_used_count");
    let top_k = meta.usize(&used_key)?;
    if top_k == 0 || top_k > num_experts {
        return Err(meta.err(
            &used_key,
            format!("{top_k} is not between 1 and the {num_experts} experts of {count_key}"),
        ));
    }
    let qwen = matches!(arch, "qwen3moe" | "qwen2moe");
    // llama.cpp's defaults: a Qwen expert is `feed_forward_length / expert_used_count` wide,
    // an OLMoE or Mixtral one `feed_forward_length`.
    let expert_intermediate_size = match meta.opt_usize(&k("expert_feed_forward_length"))? {
        Some(n) => n,
        None if qwen => intermediate_size / top_k,
        None => intermediate_size,
    };
    if expert_intermediate_size == 0 {
        return Err(meta.err(&k("expert_feed_forward_length"), "must be positive"));
    }
    let norm_key = k("expert_weights_norm");
    let norm_topk_prob = match meta.gguf.get(&norm_key) {
        Some(v) => v
            .as_bool()
            .ok_or_else(|| meta.err(&norm_key, "expected a bool"))?,
        None => matches!(arch, "qwen3moe" | "llama"),
    };
    let scale_key = k("expert_weights_scale");
    if let Some(scale) = meta.opt_f32(&scale_key)? {
        // llama.cpp scales the routing weights by it unless it is 0 or 1.
        if scale != 0.0 && scale != 1.0 {
            return Err(meta.err(
                &scale_key,
                format!("routing weights scaled by {scale} are not supported"),
            ));
        }
    }
    let gating_key = k("expert_gating_func");
    if let Some(f) = meta.opt_usize(&gating_key)? {
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX.
        if f != 1 {
            return Err(meta.err(
                &gating_key,
                format!("gating function {f} is not supported (1, softmax, only)"),
            ));
        }
    }
    for key in ["expert_group_count", "expert_group_used_count"] {
        if meta.opt_usize(&k(key))?.is_some_and(|n| n > 1) {
            return Err(meta.err(&k(key), "grouped expert routing is not supported"));
        }
    }
    let shared_expert_intermediate_size = match arch {
        "qwen2moe" => {
            let key = k("expert_shared_feed_forward_length");
            let n = meta.opt_usize(&key)?.unwrap_or(intermediate_size);
            if n == 0 {
                return Err(meta.err(&key, "must be positive"));
            }
            Some(n)
        }
        _ => None,
    };
    let shared_key = k("expert_shared_count");
    if let Some(n) = meta.opt_usize(&shared_key)? {
        let have = usize::from(shared_expert_intermediate_size.is_some());
        if n != have {
            return Err(meta.err(
                &shared_key,
                format!("{n} shared experts: {arch} has {have}"),
            ));
        }
    }
    let sparse_layers: Vec<bool> = (0..n_layers)
        .map(|l| {
            meta.gguf
                .tensor_info(&format!("blk.{l}.ffn_gate_inp.weight"))
                .is_some()
        })
        .collect();
    let dense_key = k("leading_dense_block_count");
    if let Some(n) = meta.opt_usize(&dense_key)? {
        if let Some(l) = (0..n_layers).find(|&l| sparse_layers[l] == (l < n)) {
            return Err(meta.err(
                &dense_key,
                format!(
                    "says {n} leading dense layers, but layer {l} {} blk.{l}.ffn_gate_inp.weight",
                    if sparse_layers[l] { "has" } else { "lacks" }
                ),
            ));
        }
    }
    if !sparse_layers.contains(&true) {
        return Err(LoadError::MissingTensor {
            path: meta.gguf.path.clone(),
            tensor: format!(
                "blk.0.ffn_gate_inp.weight (the router of an MoE layer; {count_key} is \
                 {num_experts} but no layer has one)"
            ),
        });
    }
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        expert_intermediate_size,
        norm_topk_prob,
        sparse_layers,
        shared_expert_intermediate_size,
        naming: if arch == "llama" {
            ExpertNaming::Mixtral
        } else {
            ExpertNaming::Qwen
        },
    }))
}

/// The file's rope scaling: the per-frequency factors of `rope_freqs.weight` (llama.cpp's
/// converter writes Llama 3's scaling that way), or `<arch>.rope.scaling.*` (none or linear).
/// Both at once is refused: which one llama.cpp applies depends on its version.
fn rope_scaling(
    meta: &Meta<'_>,
    arch: &str,
    head_dim: usize,
) -> Result<Option<RopeScaling>, LoadError> {
    let k = |key: &str| format!("{arch}.{key}");
    let key = &k("rope.scaling.type");
    let factors = rope_factors(meta.gguf, head_dim)?;
    let kind = match meta.gguf.get(key) {
        None => return Ok(factors),
        Some(_) if factors.is_some() => {
            return Err(meta.err(
                key,
                "given beside rope_freqs.weight; expected one of the two",
            ))
        }
        Some(v) => v
            .as_str()
            .ok_or_else(|| meta.err(key, "expected a string"))?,
    };
    match kind {
        "none" => Ok(None),
        "linear" => {
            let factor = meta
                .opt_f32(&k("rope.scaling.factor"))?
                .ok_or_else(|| meta.err(&k("rope.scaling.factor"), "missing"))?;
            Ok(Some(RopeScaling::Linear { factor }))
        }
        other => Err(LoadError::UnsupportedRope {
            path: meta.gguf.path.clone(),
            rope_type: other.to_owned(),
        }),
    }
}

/// `rope_freqs.weight` as [`RopeScaling::Factors`], checked to hold `head_dim / 2` factors;
/// `None` when the file has none.
fn rope_factors(gguf: &GgufFile, head_dim: usize) -> Result<Option<RopeScaling>, LoadError> {
    let Some(info) = gguf.tensor_info(ROPE_FREQS) else {
        return Ok(None);
    };
    if info.shape() != [head_dim / 2] {
        return Err(LoadError::TensorShape {
            path: gguf.path.clone(),
            tensor: ROPE_FREQS.into(),
            expected: vec![head_dim / 2],
            actual: info.shape(),
        });
    }
    let factors = gguf.dequantize(info)?;
    Ok(Some(RopeScaling::Factors { factors }))
}

/// The GGUF tensor of per-frequency rope factors, read into the config rather than the
/// weights.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// Every expected tensor, dequantized straight into `dest` (as tensor `idx` of
/// [`expected_tensors`]), checked against its expected shape, and (q/k) with llama.cpp's
/// rope permutation undone; an expert's projection is its slice of the stacked
/// `ffn_*_exps` tensor, whose shape must be `[experts, rows, cols]`. First, every tensor of
/// the file is checked to be one of them ([`check_unused`]).
pub(crate) fn gguf_weights(
    gguf: &GgufFile,
    config: &LlamaConfig,
    dest: &mut dyn TensorDest,
    progress: Progress<'_>,
) -> Result<(), LoadError> {
    let expected = expected_tensors(config);
    let infos: std::collections::HashMap<&str, &super::gguf::GgufTensorInfo> =
        gguf.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let places: Vec<(String, Option<usize>)> = expected
        .iter()
        .map(|(name, _)| {
            let (stacked, expert) =
                gguf_place(name).expect("every expected tensor has a GGUF name");
            // Files converted before llama.cpp stacked the experts hold one tensor each.
            match expert.and_then(|e| legacy_expert_name(&stacked, e)) {
                Some(own)
                    if !infos.contains_key(stacked.as_str())
                        && infos.contains_key(own.as_str()) =>
                {
                    (own, None)
                }
                _ => (stacked, expert),
            }
        })
        .collect();
    check_unused(gguf, &places)?;
    let n_expected = expected.len();
    let n_experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    for (idx, ((name, shape), (gguf_name, expert))) in expected.into_iter().zip(places).enumerate()
    {
        let info = infos
            .get(gguf_name.as_str())
            .ok_or_else(|| LoadError::MissingTensor {
                path: gguf.path.clone(),
                tensor: format!("{name} (GGUF: {gguf_name})"),
            })?;
        let (part, parts, file_shape) = match expert {
            Some(e) => (e, n_experts, [&[n_experts][..], &shape].concat()),
            None => (0, 1, shape.clone()),
        };
        // A `[1, n]` matrix (Qwen2-MoE's shared-expert gate) may be stored as `[n]`, as
        // llama.cpp declares it and older converters squeezed it.
        let squeezed =
            file_shape.len() == 2 && file_shape[0] == 1 && info.shape() == file_shape[1..];
        if info.shape() != file_shape && !squeezed {
            return Err(LoadError::TensorShape {
                path: gguf.path.clone(),
                tensor: info.name.clone(),
                expected: file_shape,
                actual: info.shape(),
            });
        }
        if shape.len() == 2 {
            if let Some(dtype) = WeightDtype::from_ggml(info.dtype) {
                let row_bytes = dtype.row_bytes(shape[1]);
                if let Some(out) = dest.stored_mut(idx, &name, &shape, dtype) {
                    let row_bytes = row_bytes.expect("stored_mut refuses partial blocks");
                    match permuted_heads(&name, config) {
                        Some(n_heads) => {
                            let mut rows = vec![0u8; out.len()];
                            gguf.read_into(info, &mut rows)?;
                            let shape = [out.len() / row_bytes, row_bytes];
                            unpermute_rows_into(&rows, n_heads, &shape, out);
                        }
                        None => gguf.read_part_into(info, part, parts, out)?,
                    }
                    progress(idx + 1, n_expected, &name);
                    continue;
                }
            }
        }
        let out = dest.tensor_mut(idx, &name, &shape);
        match permuted_heads(&name, config) {
            // q and k are a few rows of the hidden size: the one copy left.
            Some(n_heads) => {
                let mut rows = vec![0.0; out.len()];
                gguf.dequantize_into(info, &mut rows)?;
                unpermute_rows_into(&rows, n_heads, &shape, out);
            }
            None => gguf.dequantize_part_into(info, part, parts, out)?,
        }
        progress(idx + 1, n_expected, &name);
    }
    Ok(())
}

/// Expert `e`'s own tensor in files converted before llama.cpp stacked the experts (older
/// Mixtral files): `blk.{l}.ffn_gate.{e}.weight` for `blk.{l}.ffn_gate_exps.weight`.
fn legacy_expert_name(stacked: &str, e: usize) -> Option<String> {
    let (layer, part) = stacked.strip_suffix("_exps.weight")?.rsplit_once('.')?;
    Some(format!("{layer}.{part}.{e}.weight"))
}

/// Refuses a file holding a tensor the forward would not read, naming it (with its Hugging
/// Face name where it has one): a bias of a later layer only, a tensor of another
/// architecture, experts in a dense layer. `rope_freqs.weight` is read by [`gguf_config`]
/// into the rope scaling.
fn check_unused(gguf: &GgufFile, places: &[(String, Option<usize>)]) -> Result<(), LoadError> {
    let wanted: std::collections::HashSet<&str> =
        places.iter().map(|(name, _)| name.as_str()).collect();
    for info in gguf.tensors.iter().filter(|t| t.name != ROPE_FREQS) {
        if wanted.contains(info.name.as_str()) {
            continue;
        }
        let tensor = match hf_tensor_name(&info.name) {
            Some(hf) => format!("{} ({hf})", info.name),
            None => info.name.clone(),
        };
        return Err(LoadError::UnusedTensor {
            path: gguf.path.clone(),
            tensor,
            message: "the forward of this config does not read it (see docs/model.md)".into(),
        });
    }
    Ok(())
}

/// llama.cpp's converter permutes a llama model's (Mixtral's too: arch `llama`) q_proj rows
/// over `num_attention_heads` and k_proj rows over `num_key_value_heads` (weights and biases)
/// for its interleaved rope; Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and OLMoE keep Hugging Face's
/// order (llama.cpp runs them with the NEOX rope, which is Hugging Face's `rotate_half`).
fn permuted_heads(hf_name: &str, config: &LlamaConfig) -> Option<usize> {
    if !matches!(
        config.architecture.as_str(),
        "LlamaForCausalLM" | "MixtralForCausalLM"
    ) {
        None
    } else if hf_name.contains(".self_attn.q_proj.") {
        Some(config.num_attention_heads)
    } else if hf_name.contains(".self_attn.k_proj.") {
        Some(config.num_key_value_heads)
    } else {
        None
    }
}

/// Undoes `w.reshape(n_head, 2, half, in).swapaxes(1, 2)`: within each head, GGUF row
/// `2*i + s` is Hugging Face row `s*half + i` (the rotate_half layout). `shape[0]` is the row
/// count; any remaining dims (none for a bias) make up a row.
pub fn unpermute_rows(data: &[f32], n_heads: usize, shape: &[usize]) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    unpermute_rows_into(data, n_heads, shape, &mut out);
    out
}

/// [`unpermute_rows`] into `out` (as long as `data`), of values or of a row's bytes.
fn unpermute_rows_into<T: Copy>(data: &[T], n_heads: usize, shape: &[usize], out: &mut [T]) {
    let rows = shape[0];
    let row_len: usize = shape[1..].iter().product();
    let head_rows = rows / n_heads;
    let half = head_rows / 2;
    for head in 0..n_heads {
        for s in 0..2 {
            for i in 0..half {
                let src = head * head_rows + 2 * i + s;
                let dst = head * head_rows + s * half + i;
                out[dst * row_len..(dst + 1) * row_len]
                    .copy_from_slice(&data[src * row_len..(src + 1) * row_len]);
            }
        }
    }
}

/// The tokenizer in `tokenizer.ggml.*` (byte-level BPE, model `gpt2`); `None` when the file
/// has no tokenizer.
fn gguf_tokenizer(gguf: &GgufFile) -> Result<Option<tokenizers::Tokenizer>, LoadError> {
    let Some(model) = gguf.get("tokenizer.ggml.model") else {
        return Ok(None);
    };
    let meta = Meta { gguf };
    let model = model
        .as_str()
        .ok_or_else(|| meta.err("tokenizer.ggml.model", "expected a string"))?;
    if model != "gpt2" {
        return Err(tokenizer_err(
            gguf,
            format!("tokenizer model `{model}` is not supported (only gpt2 byte-level BPE)"),
        ));
    }
    let spec = byte_level_spec(&meta)?;
    byte_level_bpe(&spec)
        .map(Some)
        .map_err(|m| tokenizer_err(gguf, m))
}

fn byte_level_spec(meta: &Meta<'_>) -> Result<ByteLevelBpeSpec, LoadError> {
    let table = byte_to_char();
    let alphabet: std::collections::HashSet<char> = table.iter().copied().collect();
    // A token spelled outside the byte alphabet is stored as raw text: respell it the way the
    // vocabulary's merges expect (transformers does the same).
    let tokens: Vec<String> = meta
        .str_array("tokenizer.ggml.tokens")?
        .into_iter()
        .map(|t| {
            if t.chars().all(|c| alphabet.contains(&c)) {
                t.to_owned()
            } else {
                super::tokenizer::to_byte_alphabet(t, &table)
            }
        })
        .collect();
    let merges = meta
        .str_array("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| meta.err("tokenizer.ggml.merges", format!("bad merge `{m}`")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (special_ids, added_ids) = marked_tokens(meta, &tokens)?;
    let add_bos = meta
        .gguf
        .get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let pre_tokenizer = match meta
        .gguf
        .get("tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
    {
        Some("smollm") => PreTokenizerKind::Gpt2IndividualDigits,
        Some("qwen2") => PreTokenizerKind::Qwen2,
        // llama.cpp's names for GPT-2's own split.
        None | Some("default" | "gpt-2" | "gpt2") => PreTokenizerKind::Gpt2,
        // Another split (llama-bpe, deepseek, ...) done the GPT-2 way would tokenize text
        // wrongly without a word: refused.
        Some(other) => {
            return Err(meta.err(
                "tokenizer.ggml.pre",
                format!(
                    "pre-tokenizer `{other}` is not supported (ferry splits text as `smollm`, \
                     `qwen2` and GPT-2's `default`/`gpt-2` do); its text would be tokenized \
                     wrongly"
                ),
            ))
        }
    };
    Ok(ByteLevelBpeSpec {
        tokens,
        merges,
        special_ids,
        added_ids,
        bos_id: if add_bos {
            meta.opt_u32("tokenizer.ggml.bos_token_id")?
        } else {
            None
        },
        pre_tokenizer,
    })
}

/// Ids of control tokens (special) and user-defined tokens (added, not special).
fn marked_tokens(meta: &Meta<'_>, tokens: &[String]) -> Result<(Vec<u32>, Vec<u32>), LoadError> {
    let key = "tokenizer.ggml.token_type";
    let Some(types) = meta.gguf.get(key) else {
        return Ok((Vec::new(), Vec::new()));
    };
    let types = types
        .as_array()
        .filter(|t| t.len() == tokens.len())
        .ok_or_else(|| meta.err(key, "expected one token type per token"))?;
    let (mut special, mut added) = (Vec::new(), Vec::new());
    for (id, t) in types.iter().enumerate() {
        match t.as_i64() {
            Some(TOKEN_TYPE_CONTROL) => special.push(id as u32),
            Some(TOKEN_TYPE_USER_DEFINED) => added.push(id as u32),
            Some(_) => {}
            None => return Err(meta.err(key, "expected integers")),
        }
    }
    Ok((special, added))
}

fn tokenizer_err(gguf: &GgufFile, message: String) -> LoadError {
    LoadError::Tokenizer {
        path: gguf.path.clone(),
        message,
    }
}

/// Typed access to GGUF metadata, with errors naming the file and key.
struct Meta<'a> {
    gguf: &'a GgufFile,
}

impl<'a> Meta<'a> {
    fn err(&self, key: &str, message: impl Into<String>) -> LoadError {
        LoadError::field(&self.gguf.path, key, message)
    }

    fn str(&self, key: &str) -> Result<&'a str, LoadError> {
        self.gguf
            .get(key)
            .ok_or_else(|| self.err(key, "missing"))?
            .as_str()
            .ok_or_else(|| self.err(key, "expected a string"))
    }

    fn str_array(&self, key: &str) -> Result<Vec<&'a str>, LoadError> {
        let items = self
            .gguf
            .get(key)
            .ok_or_else(|| self.err(key, "missing"))?
            .as_array()
            .ok_or_else(|| self.err(key, "expected an array"))?;
        items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| self.err(key, "expected strings")))
            .collect()
    }

    fn usize(&self, key: &str) -> Result<usize, LoadError> {
        self.opt_usize(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        self.gguf
            .get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.err(key, "expected a non-negative integer"))
            })
            .transpose()
    }

    fn opt_u32(&self, key: &str) -> Result<Option<u32>, LoadError> {
        self.gguf
            .get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| self.err(key, "expected a token id"))
            })
            .transpose()
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        self.gguf
            .get(key)
            .map(|v| v.as_f32().ok_or_else(|| self.err(key, "expected a number")))
            .transpose()
    }
}
