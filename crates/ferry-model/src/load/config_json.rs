//! `config.json` and `generation_config.json` of a Hugging Face folder → [`LlamaConfig`].
//!
//! Parsing goes through `serde_json::Value` rather than a derived struct because the fields
//! vary by architecture and transformers version (`rope_scaling` vs `rope_parameters`,
//! `eos_token_id` as an int or a list), and every error must name the field.

use std::path::Path;

use ferry_core::TokenId;
use serde_json::{Map, Value};

use super::LoadError;
use crate::{ExpertNaming, LlamaConfig, MoeConfig, RopeScaling};

/// Architectures whose forward is the Llama one plus the flags in [`LlamaConfig`].
pub const SUPPORTED_ARCHITECTURES: &str = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, \
Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM";

/// The most layers a config may declare.
pub const MAX_LAYERS: usize = 1024;

/// The most experts per layer (expert ids travel as u16).
pub const MAX_EXPERTS: usize = 1 << 16;

/// Reads `config.json` and, when present, `generation_config.json` from `dir`.
pub fn read_folder_config(dir: &Path) -> Result<LlamaConfig, LoadError> {
    let config_path = dir.join("config.json");
    let config = read_json(&config_path)?;
    let generation_path = dir.join("generation_config.json");
    let generation = if generation_path.exists() {
        Some(read_json(&generation_path)?)
    } else {
        None
    };
    let mut parsed = parse_config(&config, &config_path)?;
    if let Some(generation) = &generation {
        let extra = eos_ids(generation, &generation_path)?;
        merge_eos(&mut parsed.eos_token_ids, &extra);
    }
    Ok(parsed)
}

pub(crate) fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json {
        path: path.to_owned(),
        source,
    })
}

/// Parses a `config.json` value; `path` only names the file in errors.
pub fn parse_config(json: &Value, path: &Path) -> Result<LlamaConfig, LoadError> {
    let obj = json
        .as_object()
        .ok_or_else(|| LoadError::invalid(path, "config.json is not a JSON object"))?;
    let fields = Fields { obj, path };
    let architecture = architecture(&fields)?;
    let flavour = Flavour::of(&architecture);
    check_activation(&fields)?;

    let hidden_size = fields.usize("hidden_size")?;
    let num_attention_heads = fields.usize("num_attention_heads")?;
    let head_dim = match fields.opt_usize("head_dim")? {
        Some(d) => d,
        None => {
            if num_attention_heads == 0 || hidden_size % num_attention_heads != 0 {
                return Err(LoadError::field(
                    path,
                    "num_attention_heads",
                    format!("must divide hidden_size {hidden_size}"),
                ));
            }
            hidden_size / num_attention_heads
        }
    };
    let (rope_theta, rope_scaling) = rope(&fields)?;
    let bias_flag = fields.opt_bool("attention_bias")?.unwrap_or(false);
    let num_hidden_layers = fields.usize("num_hidden_layers")?;
    // Qwen2 (and Qwen2-MoE, unless `qkv_bias` says otherwise) has q/k/v biases and never an
    // o_proj one; Llama, Qwen3, Qwen3-MoE and OLMoE put a bias on all four projections when
    // `attention_bias` says so; Mixtral has none.
    let (attention_bias, o_proj_bias) = match flavour {
        Flavour::Qwen2 => (true, false),
        Flavour::Qwen2Moe => (fields.opt_bool("qkv_bias")?.unwrap_or(true), false),
        Flavour::Mixtral => (false, false),
        _ => (bias_flag, bias_flag),
    };
    let moe = moe_config(&fields, flavour, num_hidden_layers)?;
    let config = LlamaConfig {
        vocab_size: fields.usize("vocab_size")?,
        hidden_size,
        intermediate_size: fields.usize("intermediate_size")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: fields
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads),
        head_dim,
        rms_norm_eps: fields.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        max_position_embeddings: fields.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        tie_word_embeddings: fields.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        attention_bias,
        o_proj_bias,
        qk_norm: matches!(flavour, Flavour::Qwen3 | Flavour::Qwen3Moe | Flavour::Olmoe),
        qk_norm_whole: flavour == Flavour::Olmoe,
        clip_qkv: match flavour {
            Flavour::Olmoe => fields.opt_f32("clip_qkv")?,
            _ => None,
        },
        moe,
        bos_token_id: fields.opt_u32("bos_token_id")?.map(TokenId),
        eos_token_ids: eos_ids(json, path)?,
        architecture,
    };
    validate(&config, path)?;
    Ok(config)
}

/// Checks the relations the forward relies on (so a bad file is an error here, never a
/// division by zero or a silently wrong shape later); field names are Hugging Face's.
pub fn validate(config: &LlamaConfig, path: &Path) -> Result<(), LoadError> {
    let positive = [
        ("vocab_size", config.vocab_size),
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("head_dim", config.head_dim),
    ];
    for (field, value) in positive {
        if value == 0 {
            return Err(LoadError::field(path, field, "must be positive"));
        }
    }
    // Far above any real model (the largest have ~130 layers); a corrupt count must not make
    // the loader build a list of billions of tensor names.
    if config.num_hidden_layers > MAX_LAYERS {
        return Err(LoadError::field(
            path,
            "num_hidden_layers",
            format!("{} is more than {MAX_LAYERS}", config.num_hidden_layers),
        ));
    }
    if !config
        .num_attention_heads
        .is_multiple_of(config.num_key_value_heads)
    {
        return Err(LoadError::field(
            path,
            "num_key_value_heads",
            format!(
                "{} does not divide num_attention_heads {}",
                config.num_key_value_heads, config.num_attention_heads
            ),
        ));
    }
    if !config.head_dim.is_multiple_of(2) {
        return Err(LoadError::field(
            path,
            "head_dim",
            format!("{} is odd; rotary embeddings need pairs", config.head_dim),
        ));
    }
    if let Some(RopeScaling::Factors { factors }) = &config.rope_scaling {
        let half = config.head_dim / 2;
        if factors.len() != half || !factors.iter().all(|f| f.is_finite() && *f > 0.0) {
            return Err(LoadError::field(
                path,
                "rope_scaling.factors",
                format!(
                    "expected {half} positive factors (head_dim / 2), got {:?}",
                    factors
                ),
            ));
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Qwen2Moe,
    Olmoe,
    Mixtral,
}

impl Flavour {
    fn of(architecture: &str) -> Self {
        match architecture {
            "Qwen2ForCausalLM" => Self::Qwen2,
            "Qwen3ForCausalLM" => Self::Qwen3,
            "Qwen3MoeForCausalLM" => Self::Qwen3Moe,
            "Qwen2MoeForCausalLM" => Self::Qwen2Moe,
            "OlmoeForCausalLM" => Self::Olmoe,
            "MixtralForCausalLM" => Self::Mixtral,
            _ => Self::Llama,
        }
    }

    /// transformers' `model_type` of the architecture.
    fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Olmoe => "olmoe",
            Self::Mixtral => "mixtral",
        }
    }
}

/// The MoE part of an MoE architecture's config (`None` for dense ones), every relation the
/// forward relies on checked here, naming the key.
fn moe_config(
    fields: &Fields<'_>,
    flavour: Flavour,
    n_layers: usize,
) -> Result<Option<MoeConfig>, LoadError> {
    let (experts_key, naming) = match flavour {
        Flavour::Llama | Flavour::Qwen2 | Flavour::Qwen3 => return Ok(None),
        Flavour::Mixtral => ("num_local_experts", ExpertNaming::Mixtral),
        _ => ("num_experts", ExpertNaming::Qwen),
    };
    // transformers 5 writes Qwen3-MoE's count as `num_local_experts`; checkpoints on the
    // hub say `num_experts`.
    let experts_key = match fields.present(experts_key) {
        None if fields.present("num_local_experts").is_some() => "num_local_experts",
        _ => experts_key,
    };
    let num_experts = fields.usize(experts_key)?;
    let top_k = fields.usize("num_experts_per_tok")?;
    if num_experts == 0 || num_experts > MAX_EXPERTS {
        return Err(fields.err(
            experts_key,
            format!("{num_experts} experts: expected 1 to {MAX_EXPERTS}"),
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return Err(fields.err(
            "num_experts_per_tok",
            format!("{top_k} is not between 1 and the {num_experts} experts"),
        ));
    }
    let qwen = matches!(flavour, Flavour::Qwen3Moe | Flavour::Qwen2Moe);
    let expert_intermediate_size = if qwen {
        fields.usize("moe_intermediate_size")?
    } else {
        fields.usize("intermediate_size")?
    };
    if expert_intermediate_size == 0 {
        return Err(fields.err("moe_intermediate_size", "must be positive"));
    }
    // Mixtral always renormalises its top-k; the others say so (off unless set).
    let norm_topk_prob = match flavour {
        Flavour::Mixtral => true,
        _ => fields.opt_bool("norm_topk_prob")?.unwrap_or(false),
    };
    let mut sparse_layers = vec![true; n_layers];
    if qwen {
        let step = fields.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        if step == 0 {
            return Err(fields.err("decoder_sparse_step", "must be positive"));
        }
        for (l, sparse) in sparse_layers.iter_mut().enumerate() {
            *sparse = (l + 1) % step == 0;
        }
        if let Some(list) = fields.present("mlp_only_layers") {
            let bad = || {
                fields.err(
                    "mlp_only_layers",
                    format!("expected a list of layer indices below num_hidden_layers {n_layers}"),
                )
            };
            for v in list.as_array().ok_or_else(bad)? {
                let l = v
                    .as_u64()
                    .and_then(|l| usize::try_from(l).ok())
                    .ok_or_else(bad)?;
                *sparse_layers.get_mut(l).ok_or_else(bad)? = false;
            }
        }
    }
    let shared_expert_intermediate_size = match flavour {
        Flavour::Qwen2Moe => {
            let n = fields.usize("shared_expert_intermediate_size")?;
            if n == 0 {
                return Err(fields.err("shared_expert_intermediate_size", "must be positive"));
            }
            Some(n)
        }
        _ => None,
    };
    // A router ferry does not know would be computed as the softmax top-k one: refuse it.
    for key in [
        "scoring_func",
        "topk_method",
        "router_type",
        "moe_router_type",
    ] {
        if let Some(v) = fields.present(key) {
            return Err(fields.err(
                key,
                format!("router {v} is not supported (softmax top-k only)"),
            ));
        }
    }
    for key in ["n_group", "topk_group", "num_experts_per_group"] {
        if fields.present(key).is_some() {
            return Err(fields.err(key, "grouped expert routing is not supported"));
        }
    }
    if flavour == Flavour::Mixtral && fields.present("sliding_window").is_some() {
        return Err(fields.err(
            "sliding_window",
            "sliding-window attention is not supported",
        ));
    }
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        expert_intermediate_size,
        norm_topk_prob,
        sparse_layers,
        shared_expert_intermediate_size,
        naming,
    }))
}

fn architecture(fields: &Fields<'_>) -> Result<String, LoadError> {
    let list = fields
        .obj
        .get("architectures")
        .and_then(Value::as_array)
        .ok_or_else(|| fields.err("architectures", "missing or not a list"))?;
    let name = list
        .first()
        .and_then(Value::as_str)
        .ok_or_else(|| fields.err("architectures", "empty or not a list of strings"))?;
    if !SUPPORTED_ARCHITECTURES.split(", ").any(|s| s == name) {
        return Err(LoadError::UnsupportedArchitecture {
            path: fields.path.to_owned(),
            architecture: name.to_owned(),
            supported: SUPPORTED_ARCHITECTURES,
        });
    }
    Ok(name.to_owned())
}

/// The forward implements SiLU-gated MLPs only, without MLP biases or sliding windows: refuse
/// configs that ask for anything else rather than computing something different.
fn check_activation(fields: &Fields<'_>) -> Result<(), LoadError> {
    if let Some(act) = fields.opt_str("hidden_act")? {
        if act != "silu" {
            return Err(fields.err(
                "hidden_act",
                format!("`{act}` is not supported (only silu)"),
            ));
        }
    }
    if fields.opt_bool("mlp_bias")? == Some(true) {
        return Err(fields.err("mlp_bias", "MLP biases are not supported"));
    }
    if fields.opt_bool("use_sliding_window")? == Some(true) {
        return Err(fields.err(
            "use_sliding_window",
            "sliding-window attention is not supported",
        ));
    }
    Ok(())
}

/// `rope_theta` and `rope_scaling`, from the classic fields or from transformers 5's
/// `rope_parameters` object (which holds both).
fn rope(fields: &Fields<'_>) -> Result<(f32, Option<RopeScaling>), LoadError> {
    let params = fields.obj.get("rope_parameters").filter(|v| !v.is_null());
    let scaling = fields.obj.get("rope_scaling").filter(|v| !v.is_null());
    let (field, table) = match (scaling, params) {
        (Some(s), _) => ("rope_scaling", Some(s)),
        (None, Some(p)) => ("rope_parameters", Some(p)),
        (None, None) => ("rope_scaling", None),
    };
    let theta_in_params = params
        .and_then(|p| p.get("rope_theta"))
        .map(|v| as_f32(v, fields.path, "rope_parameters.rope_theta"))
        .transpose()?;
    let theta = match fields.opt_f32("rope_theta")? {
        Some(t) => t,
        None => theta_in_params.unwrap_or(10_000.0),
    };
    let scaling = match table {
        None => None,
        Some(value) => rope_scaling(value, fields.path, field)?,
    };
    Ok((theta, scaling))
}

fn rope_scaling(value: &Value, path: &Path, field: &str) -> Result<Option<RopeScaling>, LoadError> {
    let obj = value
        .as_object()
        .ok_or_else(|| LoadError::field(path, field, "not an object"))?;
    let sub = Fields { obj, path };
    let kind = match sub.opt_str("rope_type")? {
        Some(k) => Some(k),
        None => sub.opt_str("type")?,
    };
    let num = |name: &str| -> Result<f32, LoadError> {
        let v = obj
            .get(name)
            .ok_or_else(|| LoadError::field(path, &format!("{field}.{name}"), "missing"))?;
        as_f32(v, path, &format!("{field}.{name}"))
    };
    match kind.unwrap_or("default") {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor")?,
        })),
        // ferry's own, written by `to_hf_config_json` for a GGUF's `rope_freqs.weight`.
        "rope_freqs" => {
            let name = format!("{field}.factors");
            let factors = obj
                .get("factors")
                .and_then(Value::as_array)
                .ok_or_else(|| LoadError::field(path, &name, "missing or not a list"))?
                .iter()
                .map(|v| as_f32(v, path, &name))
                .collect::<Result<_, _>>()?;
            Ok(Some(RopeScaling::Factors { factors }))
        }
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        })),
        other => Err(LoadError::UnsupportedRope {
            path: path.to_owned(),
            rope_type: other.to_owned(),
        }),
    }
}

/// `eos_token_id` as an int, a list of ints, or absent.
pub(crate) fn eos_ids(json: &Value, path: &Path) -> Result<Vec<TokenId>, LoadError> {
    let bad = || LoadError::field(path, "eos_token_id", "expected a token id or a list of ids");
    match json.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| as_u32(v).map(TokenId).ok_or_else(bad))
            .collect(),
        Some(v) => Ok(vec![TokenId(as_u32(v).ok_or_else(bad)?)]),
    }
}

/// Appends the ids of `extra` not already in `ids`, keeping the first-seen order.
pub(crate) fn merge_eos(ids: &mut Vec<TokenId>, extra: &[TokenId]) {
    for id in extra {
        if !ids.contains(id) {
            ids.push(*id);
        }
    }
}

fn as_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

fn as_f32(v: &Value, path: &Path, field: &str) -> Result<f32, LoadError> {
    v.as_f64()
        .map(|x| x as f32)
        .ok_or_else(|| LoadError::field(path, field, "expected a number"))
}

/// Typed access to one JSON object's fields, with errors naming the file and field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> LoadError {
        LoadError::field(self.path, field, message)
    }

    fn present(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn usize(&self, name: &str) -> Result<usize, LoadError> {
        self.opt_usize(name)?
            .ok_or_else(|| self.err(name, "missing"))
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>, LoadError> {
        self.present(name)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.err(name, "expected a non-negative integer"))
            })
            .transpose()
    }

    fn opt_u32(&self, name: &str) -> Result<Option<u32>, LoadError> {
        self.present(name)
            .map(|v| as_u32(v).ok_or_else(|| self.err(name, "expected a token id")))
            .transpose()
    }

    fn opt_f32(&self, name: &str) -> Result<Option<f32>, LoadError> {
        self.present(name)
            .map(|v| as_f32(v, self.path, name))
            .transpose()
    }

    fn opt_bool(&self, name: &str) -> Result<Option<bool>, LoadError> {
        self.present(name)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.err(name, "expected true or false"))
            })
            .transpose()
    }

    fn opt_str(&self, name: &str) -> Result<Option<&str>, LoadError> {
        self.present(name)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.err(name, "expected a string"))
            })
            .transpose()
    }
}

/// Serializes a config back into a Hugging Face `config.json` (used to write model folders;
/// `transformers` loads it).
pub fn to_hf_config_json(config: &LlamaConfig) -> Value {
    let model_type = Flavour::of(&config.architecture).model_type();
    let rope_scaling = match &config.rope_scaling {
        None => Value::Null,
        Some(RopeScaling::Linear { factor }) => {
            serde_json::json!({ "rope_type": "linear", "factor": f32_json(*factor) })
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => serde_json::json!({
            "rope_type": "llama3",
            "factor": f32_json(*factor),
            "low_freq_factor": f32_json(*low_freq_factor),
            "high_freq_factor": f32_json(*high_freq_factor),
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        // No Hugging Face rope type divides by given factors: ferry's own name, which ferry
        // reads back and transformers refuses (never a silently different rope).
        Some(RopeScaling::Factors { factors }) => serde_json::json!({
            "rope_type": "rope_freqs",
            "factors": factors.iter().map(|&f| f32_json(f)).collect::<Vec<_>>(),
        }),
    };
    let eos = match config.eos_token_ids.as_slice() {
        [] => Value::Null,
        [one] => Value::from(one.0),
        many => Value::from(TokenId::as_raw_slice(many)),
    };
    let mut json = serde_json::json!({
        "architectures": [config.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32_json(config.rms_norm_eps),
        "rope_theta": f32_json(config.rope_theta),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": false,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    });
    if let (Some(moe), Some(obj)) = (&config.moe, json.as_object_mut()) {
        obj.extend(moe_json(config, moe));
    }
    if let (Some(clip), Some(obj)) = (config.clip_qkv, json.as_object_mut()) {
        obj.insert("clip_qkv".into(), f32_json(clip));
    }
    json
}

/// The MoE keys of a config.json, as each architecture's transformers config names them.
fn moe_json(config: &LlamaConfig, moe: &MoeConfig) -> Map<String, Value> {
    let mut out = Map::new();
    let mut put = |k: &str, v: Value| {
        out.insert(k.to_owned(), v);
    };
    put("num_experts_per_tok", moe.top_k.into());
    match Flavour::of(&config.architecture) {
        Flavour::Mixtral => {
            put("num_local_experts", moe.num_experts.into());
            put("sliding_window", Value::Null);
        }
        flavour => {
            put("num_experts", moe.num_experts.into());
            put("norm_topk_prob", moe.norm_topk_prob.into());
            if matches!(flavour, Flavour::Qwen3Moe | Flavour::Qwen2Moe) {
                let dense: Vec<usize> = (0..config.num_hidden_layers)
                    .filter(|&l| !moe.is_sparse(l))
                    .collect();
                put("moe_intermediate_size", moe.expert_intermediate_size.into());
                put("decoder_sparse_step", 1.into());
                put("mlp_only_layers", dense.into());
            }
            if let Some(shared) = moe.shared_expert_intermediate_size {
                put("shared_expert_intermediate_size", shared.into());
                put("qkv_bias", config.attention_bias.into());
            }
        }
    }
    out
}

/// An f32 as the JSON number with its shortest decimal (`1e-5`, not `9.999999747378752e-6`),
/// which reads back as the same f32.
fn f32_json(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}
