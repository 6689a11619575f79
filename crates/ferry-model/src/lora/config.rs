//! `adapter_config.json`: what PEFT's `LoraConfig` says that decides the computation, read
//! with every setting ferry does not follow refused by its key.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::{LoraError, TargetModule};

/// `target_modules` as given.
#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    /// Module names (or dotted suffixes of module paths, as PEFT matches them).
    Names(Vec<String>),
    /// `"all-linear"`: every linear layer but the head.
    AllLinear,
}

/// The parts of `adapter_config.json` that decide the computation, as read and checked on
/// their own (what depends on the base model is checked by [`LoraAdapter`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub lora_alpha: f64,
    pub use_rslora: bool,
    pub target_modules: Targets,
    /// Per-module ranks and alphas (`rank_pattern`, `alpha_pattern`): keys are module names
    /// or dotted suffixes of module paths, matched like `target_modules`' names.
    pub rank_pattern: BTreeMap<String, usize>,
    pub alpha_pattern: BTreeMap<String, f64>,
    /// The layers adapted (`layers_to_transform`); `None`: all.
    pub layers_to_transform: Option<Vec<usize>>,
}

impl LoraConfig {
    /// Reads `adapter_config.json`'s text, refusing what ferry does not compute by its key.
    pub fn from_json(text: &str) -> Result<Self, LoraError> {
        let value: Value = serde_json::from_str(text).map_err(LoraError::Json)?;
        let Value::Object(map) = value else {
            return Err(config_err("", "the file is not a JSON object"));
        };
        refuse_unsupported(&map)?;
        let r = match map.get("r") {
            Some(v) => positive(v).ok_or_else(|| config_err("r", "not a positive integer"))?,
            None => return Err(config_err("r", "missing")),
        };
        let lora_alpha = match map.get("lora_alpha") {
            None | Some(Value::Null) => 8.0, // PEFT's default
            Some(v) => v
                .as_f64()
                .filter(|a| a.is_finite())
                .ok_or_else(|| config_err("lora_alpha", "not a number"))?,
        };
        let use_rslora = flag(&map, "use_rslora")?;
        let target_modules = match map.get("target_modules") {
            None | Some(Value::Null) => {
                return Err(config_err(
                    "target_modules",
                    "missing: name the modules (q_proj, v_proj, ...) or \"all-linear\"",
                ))
            }
            Some(Value::String(s)) if s == "all-linear" => Targets::AllLinear,
            Some(Value::String(s)) => {
                return Err(config_err(
                    "target_modules",
                    &format!(
                        "the regular expression {s:?} is not supported: give a list of module names"
                    ),
                ))
            }
            Some(Value::Array(items)) => Targets::Names(
                items
                    .iter()
                    .map(|v| {
                        let name = v.as_str().ok_or_else(|| {
                            config_err("target_modules", "an entry is not a string")
                        })?;
                        plain_pattern("target_modules", name)?;
                        Ok(name.to_owned())
                    })
                    .collect::<Result<_, LoraError>>()?,
            ),
            Some(_) => return Err(config_err("target_modules", "not a list of names")),
        };
        let rank_pattern = pattern(&map, "rank_pattern", positive)?;
        let alpha_pattern = pattern(&map, "alpha_pattern", |v| {
            v.as_f64().filter(|a| a.is_finite())
        })?;
        let layers_to_transform = match map.get("layers_to_transform") {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|v| {
                        v.as_u64().map(|l| l as usize).ok_or_else(|| {
                            config_err("layers_to_transform", "an entry is not a layer index")
                        })
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Some(v) => Some(vec![v.as_u64().ok_or_else(|| {
                config_err("layers_to_transform", "not a layer index or a list of them")
            })? as usize]),
        };
        Ok(Self {
            r,
            lora_alpha,
            use_rslora,
            target_modules,
            rank_pattern,
            alpha_pattern,
            layers_to_transform,
        })
    }

    /// The config as PEFT writes it (`adapter_config.json`), for adapters ferry makes.
    pub fn to_json(&self) -> Value {
        let targets = match &self.target_modules {
            Targets::Names(names) => serde_json::json!(names),
            Targets::AllLinear => serde_json::json!("all-linear"),
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "target_modules": targets,
            "rank_pattern": self.rank_pattern,
            "alpha_pattern": self.alpha_pattern,
            "layers_to_transform": self.layers_to_transform,
            "layers_pattern": null,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_dora": false,
            "modules_to_save": null,
            "init_lora_weights": true,
            "inference_mode": true,
        })
    }

    /// The rank and scale of `module` in `layer` (`rank_pattern` and `alpha_pattern` first,
    /// then `r` and `lora_alpha`).
    pub(super) fn rank_and_scale(
        &self,
        module: TargetModule,
        layer: usize,
    ) -> Result<(usize, String, f32), LoraError> {
        let path = module.path(layer);
        let (rank, key) = match lookup(&self.rank_pattern, "rank_pattern", &path)? {
            Some((key, &r)) => (r, format!("rank_pattern.{key}")),
            None => (self.r, "r".to_owned()),
        };
        let alpha = match lookup(&self.alpha_pattern, "alpha_pattern", &path)? {
            Some((_, &a)) => a,
            None => self.lora_alpha,
        };
        let scale = if self.use_rslora {
            alpha / (rank as f64).sqrt()
        } else {
            alpha / rank as f64
        };
        Ok((rank, key, scale as f32))
    }
}

pub(super) fn config_err(key: &str, message: &str) -> LoraError {
    LoraError::Config {
        key: key.to_owned(),
        message: message.to_owned(),
    }
}

fn positive(v: &Value) -> Option<usize> {
    v.as_u64().filter(|&r| r > 0).map(|r| r as usize)
}

fn flag(map: &Map<String, Value>, key: &str) -> Result<bool, LoraError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(config_err(key, "not true or false")),
    }
}

/// Whether `v` says "nothing": absent, null, false, or an empty list or object.
fn empty(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Object(o)) => o.is_empty(),
        Some(_) => false,
    }
}

/// Refuses, by key, every setting that would change the computation in a way ferry does not
/// follow.
fn refuse_unsupported(map: &Map<String, Value>) -> Result<(), LoraError> {
    match map.get("peft_type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "LORA" => {}
        Some(t) => {
            return Err(config_err(
                "peft_type",
                &format!("{t} is not a LoRA adapter (\"LORA\")"),
            ))
        }
    }
    let refusals: [(&str, &str); 9] = [
        ("modules_to_save", "modules trained in full (modules_to_save) are not supported: ferry serves only the low-rank deltas"),
        ("use_dora", "DoRA (use_dora) is not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D-style weights) is not supported"),
        ("lora_bias", "a bias on lora_B (lora_bias) is not supported"),
        ("target_parameters", "adapters on parameters (target_parameters, MoE experts) are not supported"),
        ("layer_replication", "layer_replication is not supported"),
        ("trainable_token_indices", "trainable token embeddings (trainable_token_indices) are not supported"),
        ("use_qalora", "QA-LoRA (use_qalora) is not supported"),
        ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ];
    for (key, message) in refusals {
        if !empty(map.get(key)) {
            return Err(config_err(key, message));
        }
    }
    if !empty(map.get("exclude_modules")) {
        return Err(config_err(
            "exclude_modules",
            "excluded modules are not supported: list the targets instead",
        ));
    }
    match map.get("bias") {
        None | Some(Value::Null) => {}
        Some(Value::String(b)) if b == "none" => {}
        Some(b) => {
            return Err(config_err(
                "bias",
                &format!("{b}: only \"none\" is supported (trained biases are not served)"),
            ))
        }
    }
    match map.get("layers_pattern") {
        None | Some(Value::Null) => {}
        Some(Value::String(p)) if p == "layers" => {}
        Some(Value::Array(a)) if a.iter().all(|p| p == "layers") => {}
        Some(p) => {
            return Err(config_err(
                "layers_pattern",
                &format!("{p}: the decoder layers are `layers` in every model ferry serves"),
            ))
        }
    }
    Ok(())
}

/// Checks that a module name or pattern is a plain dotted name (PEFT would read some of
/// these as regular expressions, which ferry does not).
fn plain_pattern(key: &str, name: &str) -> Result<(), LoraError> {
    let plain = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if plain {
        Ok(())
    } else {
        Err(config_err(
            key,
            &format!("{name:?} is a regular expression, which is not supported: give module names"),
        ))
    }
}

fn pattern<T>(
    map: &Map<String, Value>,
    key: &str,
    value: impl Fn(&Value) -> Option<T>,
) -> Result<BTreeMap<String, T>, LoraError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| {
                plain_pattern(key, k)?;
                let v = value(v)
                    .ok_or_else(|| config_err(&format!("{key}.{k}"), "not a positive number"))?;
                Ok((k.clone(), v))
            })
            .collect(),
        Some(_) => Err(config_err(key, "not an object")),
    }
}

/// Whether the name or dotted suffix `entry` names the module at `path`, as PEFT matches a
/// target: the whole path, or its end after a dot.
pub(super) fn names(entry: &str, path: &str) -> bool {
    path == entry
        || path
            .strip_suffix(entry)
            .is_some_and(|head| head.ends_with('.'))
}

/// The one pattern of `patterns` that names `path`; two that do are ambiguous.
fn lookup<'a, T>(
    patterns: &'a BTreeMap<String, T>,
    key: &str,
    path: &str,
) -> Result<Option<(&'a String, &'a T)>, LoraError> {
    let mut found = patterns.iter().filter(|(k, _)| names(k, path));
    let first = found.next();
    if let Some((second, _)) = found.next() {
        return Err(config_err(
            key,
            &format!(
                "both {:?} and {second:?} name {path}: ambiguous",
                first.map_or("", |f| f.0)
            ),
        ));
    }
    Ok(first)
}
