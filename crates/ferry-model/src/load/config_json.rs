//! `config.json` and `generation_config.json` of a Hugging Face folder → [`LlamaConfig`].
//!
//! Parsing goes through `serde_json::Value` rather than a derived struct because the fields
//! vary by architecture and transformers version (`rope_scaling` vs `rope_parameters`,
//! `eos_token_id` as an int or a list), and every error must name the field.

use std::path::Path;

use ferry_core::TokenId;
use serde_json::{Map, Value};

use super::LoadError;
use crate::{LlamaConfig, RopeScaling};

/// Architectures whose forward is the Llama one plus the flags in [`LlamaConfig`].
pub const SUPPORTED_ARCHITECTURES: &str = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

/// The most layers a config may declare.
pub const MAX_LAYERS: usize = 1024;

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
    let config = LlamaConfig {
        vocab_size: fields.usize("vocab_size")?,
        hidden_size,
        intermediate_size: fields.usize("intermediate_size")?,
        num_hidden_layers: fields.usize("num_hidden_layers")?,
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
        // Qwen2 always has q/k/v biases and never an o_proj one (its config has no flag);
        // Llama and Qwen3 put a bias on all four projections when `attention_bias` says so.
        attention_bias: flavour == Flavour::Qwen2 || bias_flag,
        o_proj_bias: flavour != Flavour::Qwen2 && bias_flag,
        qk_norm: flavour == Flavour::Qwen3,
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
}

impl Flavour {
    fn of(architecture: &str) -> Self {
        match architecture {
            "Qwen2ForCausalLM" => Self::Qwen2,
            "Qwen3ForCausalLM" => Self::Qwen3,
            _ => Self::Llama,
        }
    }
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
    let model_type = match Flavour::of(&config.architecture) {
        Flavour::Llama => "llama",
        Flavour::Qwen2 => "qwen2",
        Flavour::Qwen3 => "qwen3",
    };
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
    serde_json::json!({
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
    })
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
