//! LoRA adapters: a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`)
//! read, checked against the base model's [`LlamaConfig`] and a rank limit, and held in f32 in
//! the layout the forward applies it in (`llama/lora.rs`).
//!
//! An adapter adds `scale · B·(A·x)` to the output of each projection it targets (`A`:
//! `[r, in]`, `B`: `[out, r]`, `scale` = `lora_alpha / r`, or `lora_alpha / sqrt(r)` with
//! `use_rslora`), as PEFT's `Linear` layer does after the base layer (bias included).
//! ferry fuses q/k/v into one matmul and gate/up into another; an adapter's matrices are
//! laid out the same way here: the `A`s of a fused projection's parts stacked into one matrix
//! (one pass over the activations for all of them), each part's `B` with the columns of the
//! fused output it adds to.
//!
//! What is read is checked whole: every tensor the config implies must be there with its
//! shape, and every tensor in the file must be one of them; what ferry does not compute is
//! refused by name rather than ignored (`modules_to_save`, DoRA, LoRA biases, embeddings and
//! the head as targets, MoE experts, regex targets...), so an adapter either runs as PEFT
//! would run it or does not load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::LlamaConfig;
use crate::dtype::WeightDtype;
use crate::weights::matrix::Matrix;
use crate::weights::store::Tensor;

mod config;
pub mod random;

use config::{config_err, names};
pub use config::{LoraConfig, Targets};

/// The adapter config's file in a PEFT folder.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter weights' file in a PEFT folder.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// What is wrong with an adapter, naming the file, config key or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{CONFIG_FILE}: invalid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("{file}: {message}")]
    Safetensors { file: String, message: String },
    #[error("{CONFIG_FILE}: `{key}`: {message}")]
    Config { key: String, message: String },
    #[error("{CONFIG_FILE}: `{key}`: rank {rank} of {module} is above the limit of {max_rank} (--max-lora-rank)")]
    RankAboveLimit {
        key: String,
        module: String,
        rank: usize,
        max_rank: usize,
    },
    #[error("{CONFIG_FILE}: `target_modules`: {message}")]
    Target { message: String },
    #[error("missing tensor `{name}`")]
    MissingTensor { name: String },
    #[error("unexpected tensor `{name}`: {message}")]
    UnexpectedTensor { name: String, message: String },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    BadShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {dtype} (supported: F32, F16, BF16)")]
    BadDtype { name: String, dtype: String },
    #[error("tensor `{name}` holds {got} bytes, its shape {shape:?} in {dtype} takes {expected}")]
    BadLength {
        name: String,
        shape: Vec<usize>,
        dtype: WeightDtype,
        expected: usize,
        got: usize,
    },
    #[error("tensor `{name}` holds a value that is not finite")]
    NotFinite { name: String },
}

impl LoraError {
    /// The error is the config's (`adapter_config.json`: a key, its JSON, a rank above the
    /// limit, the targets), not the tensors'.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Self::Json(_) | Self::Config { .. } | Self::RankAboveLimit { .. } | Self::Target { .. }
        )
    }
}

/// A projection of a decoder layer an adapter may target, by its Hugging Face module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TargetModule {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
}

impl TargetModule {
    /// Every module, in the order of the layer's forward.
    pub const ALL: [TargetModule; 7] = [
        Self::QProj,
        Self::KProj,
        Self::VProj,
        Self::OProj,
        Self::GateProj,
        Self::UpProj,
        Self::DownProj,
    ];

    /// The module's name in the checkpoint (`q_proj`...).
    pub fn name(self) -> &'static str {
        match self {
            Self::QProj => "q_proj",
            Self::KProj => "k_proj",
            Self::VProj => "v_proj",
            Self::OProj => "o_proj",
            Self::GateProj => "gate_proj",
            Self::UpProj => "up_proj",
            Self::DownProj => "down_proj",
        }
    }

    /// The module by its name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Whether it is an attention projection (the only kind ferry adapts in MoE models).
    pub fn is_attention(self) -> bool {
        matches!(self, Self::QProj | Self::KProj | Self::VProj | Self::OProj)
    }

    /// Its path in a decoder layer, `model.layers.{layer}.self_attn.q_proj`.
    pub fn path(self, layer: usize) -> String {
        let block = if self.is_attention() {
            "self_attn"
        } else {
            "mlp"
        };
        format!("model.layers.{layer}.{block}.{}", self.name())
    }

    /// `(in, out)` features of the module in a model of `c`.
    pub fn dims(self, c: &LlamaConfig) -> (usize, usize) {
        let (h, q_w, kv_w) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let inter = c.intermediate_size;
        match self {
            Self::QProj => (h, q_w),
            Self::KProj | Self::VProj => (h, kv_w),
            Self::OProj => (q_w, h),
            Self::GateProj | Self::UpProj => (h, inter),
            Self::DownProj => (inter, h),
        }
    }

    /// The fused matmul of the forward it is part of.
    pub(crate) fn site(self) -> Site {
        match self {
            Self::QProj | Self::KProj | Self::VProj => Site::Qkv,
            Self::OProj => Site::O,
            Self::GateProj | Self::UpProj => Site::GateUp,
            Self::DownProj => Site::Down,
        }
    }

    /// The first column of its output in its site's fused output.
    fn out_start(self, c: &LlamaConfig) -> usize {
        let (q_w, kv_w) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        match self {
            Self::KProj => q_w,
            Self::VProj => q_w + kv_w,
            Self::UpProj => c.intermediate_size,
            _ => 0,
        }
    }
}

impl std::fmt::Display for TargetModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The matmuls of a decoder layer an adapter adds to: q/k/v fused, o, gate/up fused, down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Site {
    Qkv,
    O,
    GateUp,
    Down,
}

impl Site {
    const COUNT: usize = 4;

    fn index(self) -> usize {
        self as usize
    }
}

/// One tensor of an adapter as handed over: from a file, or pushed.
#[derive(Debug, Clone, Copy)]
pub struct LoraTensor<'a> {
    pub name: &'a str,
    pub dtype: WeightDtype,
    pub shape: &'a [usize],
    /// Little-endian values, row-major.
    pub bytes: &'a [u8],
}

/// One part of a fused site: a module's `B` and where its rank and output columns lie.
#[derive(Debug, Clone)]
pub(crate) struct LoraPart {
    pub(crate) module: TargetModule,
    /// Its rows of the site's stacked `A` (its columns of `A·x`).
    pub(crate) rank_start: usize,
    pub(crate) rank: usize,
    /// `[out, rank]`.
    pub(crate) b: Matrix,
    pub(crate) out_start: usize,
    pub(crate) scale: f32,
}

/// An adapter's share of one fused matmul of one layer.
#[derive(Debug, Clone)]
pub(crate) struct LoraSite {
    /// The parts' `A`s stacked: `[Σ rank, in]`.
    pub(crate) a: Matrix,
    pub(crate) parts: Vec<LoraPart>,
}

/// The base dimensions an adapter was checked against: a model it is loaded into must have
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BaseDims {
    layers: usize,
    dims: Vec<(usize, usize)>,
}

impl BaseDims {
    fn of(c: &LlamaConfig) -> Self {
        Self {
            layers: c.num_hidden_layers,
            dims: TargetModule::ALL.iter().map(|m| m.dims(c)).collect(),
        }
    }
}

/// A LoRA adapter checked against a base model, in f32, ready for the forward.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    config: LoraConfig,
    base: BaseDims,
    /// Per decoder layer, per [`Site`].
    layers: Vec<[Option<LoraSite>; Site::COUNT]>,
    targets: Vec<TargetModule>,
    max_rank: usize,
    n_params: usize,
    digest: [u8; 32],
}

impl LoraAdapter {
    /// Reads the PEFT folder `dir` for a base model of `base`, with ranks up to `max_rank`.
    pub fn load(dir: &Path, base: &LlamaConfig, max_rank: usize) -> Result<Self, LoraError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|source| LoraError::Io { path, source })
        };
        let config_text = read(CONFIG_FILE)?;
        let config_text =
            String::from_utf8(config_text).map_err(|_| config_err("", "the file is not UTF-8"))?;
        let config = LoraConfig::from_json(&config_text)?;
        if !dir.join(WEIGHTS_FILE).exists() && dir.join("adapter_model.bin").exists() {
            return Err(LoraError::Safetensors {
                file: "adapter_model.bin".into(),
                message: format!(
                    "pickled weights are not read: save the adapter as {WEIGHTS_FILE} (safe_serialization)"
                ),
            });
        }
        let bytes = read(WEIGHTS_FILE)?;
        Self::from_safetensors(config, &bytes, WEIGHTS_FILE, base, max_rank)
    }

    /// An adapter from its config and the bytes of a safetensors file of its tensors (a
    /// folder's `adapter_model.safetensors`, or a pushed body), checked as [`Self::load`]
    /// checks a folder's; `file` names the bytes in errors.
    pub fn from_safetensors(
        config: LoraConfig,
        bytes: &[u8],
        file: &str,
        base: &LlamaConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let file =
            safetensors::SafeTensors::deserialize(bytes).map_err(|e| LoraError::Safetensors {
                file: file.into(),
                message: e.to_string(),
            })?;
        let views = file.tensors();
        let mut tensors = Vec::with_capacity(views.len());
        for (name, view) in &views {
            let dtype =
                WeightDtype::from_safetensors(view.dtype()).ok_or_else(|| LoraError::BadDtype {
                    name: name.clone(),
                    dtype: format!("{:?}", view.dtype()),
                })?;
            tensors.push(LoraTensor {
                name,
                dtype,
                shape: view.shape(),
                bytes: view.data(),
            });
        }
        Self::from_tensors(config, tensors, base, max_rank)
    }

    /// An adapter from its config and tensors in memory (a pushed adapter), checked as
    /// [`Self::load`] checks a folder's.
    pub fn from_tensors<'a>(
        config: LoraConfig,
        tensors: impl IntoIterator<Item = LoraTensor<'a>>,
        base: &LlamaConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let mut by_name: BTreeMap<&str, LoraTensor<'a>> = BTreeMap::new();
        for t in tensors {
            if by_name.insert(t.name, t).is_some() {
                return Err(LoraError::UnexpectedTensor {
                    name: t.name.to_owned(),
                    message: "given twice".into(),
                });
            }
        }
        let wanted = targeted(&config, base)?;
        let mut adapter = Self {
            base: BaseDims::of(base),
            layers: vec![[None, None, None, None]; base.num_hidden_layers],
            targets: Vec::new(),
            max_rank: 0,
            n_params: 0,
            digest: [0; 32],
            config,
        };
        let mut hasher = blake3::Hasher::new();
        for (layer, modules) in wanted.iter().enumerate() {
            let mut sites: [Vec<ModuleWeights>; Site::COUNT] = Default::default();
            for &module in modules {
                let (rank, key, scale) = adapter.config.rank_and_scale(module, layer)?;
                if rank > max_rank {
                    return Err(LoraError::RankAboveLimit {
                        key,
                        module: module.path(layer),
                        rank,
                        max_rank,
                    });
                }
                let (fan_in, fan_out) = module.dims(base);
                let prefix = format!("base_model.model.{}", module.path(layer));
                let a_name = format!("{prefix}.lora_A.weight");
                let b_name = format!("{prefix}.lora_B.weight");
                let a = take_tensor(&mut by_name, &a_name, &[rank, fan_in])?;
                let b = take_tensor(&mut by_name, &b_name, &[fan_out, rank])?;
                for (name, values) in [(&a_name, &a), (&b_name, &b)] {
                    hasher.update(name.as_bytes());
                    for v in values.iter() {
                        hasher.update(&v.to_le_bytes());
                    }
                }
                hasher.update(&scale.to_le_bytes());
                adapter.max_rank = adapter.max_rank.max(rank);
                adapter.n_params += a.len() + b.len();
                if !adapter.targets.contains(&module) {
                    adapter.targets.push(module);
                }
                sites[module.site().index()].push(ModuleWeights {
                    module,
                    rank,
                    scale,
                    a,
                    b,
                });
            }
            for (slot, parts) in adapter.layers[layer].iter_mut().zip(sites) {
                *slot = site(parts, base);
            }
        }
        if let Some((name, _)) = by_name.into_iter().next() {
            return Err(LoraError::UnexpectedTensor {
                name: name.to_owned(),
                message: "not a lora_A or lora_B weight of a targeted module in a targeted layer"
                    .into(),
            });
        }
        adapter.targets.sort();
        adapter.digest = *hasher.finalize().as_bytes();
        Ok(adapter)
    }

    /// [`Self::from_tensors`] from f32 tensors by name.
    pub fn from_f32(
        config: LoraConfig,
        tensors: &[(String, Tensor)],
        base: &LlamaConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, t)| t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views = tensors.iter().zip(&bytes).map(|((name, t), b)| LoraTensor {
            name,
            dtype: WeightDtype::F32,
            shape: &t.shape,
            bytes: b,
        });
        Self::from_tensors(config, views, base, max_rank)
    }

    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The modules adapted in at least one layer, in [`TargetModule::ALL`]'s order.
    pub fn targets(&self) -> &[TargetModule] {
        &self.targets
    }

    /// The largest rank of any adapted module.
    pub fn max_rank(&self) -> usize {
        self.max_rank
    }

    /// Values held (every `A` and `B`).
    pub fn n_params(&self) -> usize {
        self.n_params
    }

    /// The rank and scale of `module` in `layer`; `None` when it is not adapted there.
    pub fn rank_and_scale(&self, layer: usize, module: TargetModule) -> Option<(usize, f32)> {
        let site = self.layers.get(layer)?[module.site().index()].as_ref()?;
        let part = site.parts.iter().find(|p| p.module == module)?;
        Some((part.rank, part.scale))
    }

    /// BLAKE3 of the adapter's values as computed with (names, every `A` and `B` in f32 and
    /// each scale): two adapters with the same digest compute the same.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// The first 8 bytes of [`Self::digest`], as a seed (the checksum model mixes it in).
    pub fn seed(&self) -> u64 {
        let mut seed = [0u8; 8];
        seed.copy_from_slice(&self.digest[..8]);
        u64::from_le_bytes(seed)
    }

    /// Whether the adapter fits a model of `base` (the dimensions it was checked against);
    /// what differs, otherwise.
    pub fn check_base(&self, base: &LlamaConfig) -> Result<(), String> {
        let want = BaseDims::of(base);
        if want.layers != self.base.layers {
            return Err(format!(
                "made for {} decoder layers, the model has {}",
                self.base.layers, want.layers
            ));
        }
        for ((m, got), have) in TargetModule::ALL
            .iter()
            .zip(&self.base.dims)
            .zip(&want.dims)
        {
            if self.targets.contains(m) && got != have {
                return Err(format!(
                    "{m} is {got:?} (in, out) in the adapter's base, {have:?} in the model"
                ));
            }
        }
        Ok(())
    }

    /// The adapter's share of `site` in `layer`.
    pub(crate) fn site(&self, layer: usize, site: Site) -> Option<&LoraSite> {
        self.layers.get(layer)?[site.index()].as_ref()
    }
}

/// The modules each layer adapts, after checking every target names something ferry adapts
/// in this model and every targeted layer exists.
fn targeted(config: &LoraConfig, base: &LlamaConfig) -> Result<Vec<Vec<TargetModule>>, LoraError> {
    let n_layers = base.num_hidden_layers;
    let moe = base.moe.is_some();
    let adaptable = |m: TargetModule| !moe || m.is_attention();
    let supported = if moe {
        "on a mixture-of-experts model ferry adapts the attention projections only (q_proj, k_proj, v_proj, o_proj)"
    } else {
        "ferry adapts q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj of the decoder layers"
    };
    let mut per_layer = vec![Vec::new(); n_layers];
    match &config.target_modules {
        Targets::AllLinear => {
            if moe {
                return Err(LoraError::Target {
                    message: format!("\"all-linear\" takes in the experts and router: {supported}"),
                });
            }
            for modules in &mut per_layer {
                *modules = TargetModule::ALL.to_vec();
            }
        }
        Targets::Names(entries) => {
            if entries.is_empty() {
                return Err(LoraError::Target {
                    message: "the list is empty".into(),
                });
            }
            for entry in entries {
                let mut hit = false;
                for (l, modules) in per_layer.iter_mut().enumerate() {
                    for m in TargetModule::ALL {
                        if names(entry, &m.path(l)) && adaptable(m) {
                            hit = true;
                            if !modules.contains(&m) {
                                modules.push(m);
                            }
                        }
                    }
                }
                if !hit {
                    return Err(LoraError::Target {
                        message: format!("{entry:?} names no module ferry adapts: {supported}"),
                    });
                }
            }
        }
    }
    if let Some(layers) = &config.layers_to_transform {
        if let Some(&l) = layers.iter().find(|&&l| l >= n_layers) {
            return Err(config_err(
                "layers_to_transform",
                &format!("layer {l} is past the model's {n_layers} layers"),
            ));
        }
        for (l, modules) in per_layer.iter_mut().enumerate() {
            if !layers.contains(&l) {
                modules.clear();
            }
        }
    }
    for modules in &mut per_layer {
        modules.sort();
    }
    Ok(per_layer)
}

/// `name` out of `by_name`, checked to be `shape` and finite, as f32.
fn take_tensor(
    by_name: &mut BTreeMap<&str, LoraTensor<'_>>,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, LoraError> {
    let t = by_name
        .remove(name)
        .ok_or_else(|| LoraError::MissingTensor { name: name.into() })?;
    if t.shape != shape {
        return Err(LoraError::BadShape {
            name: name.into(),
            expected: shape.to_vec(),
            got: t.shape.to_vec(),
        });
    }
    if !matches!(
        t.dtype,
        WeightDtype::F32 | WeightDtype::F16 | WeightDtype::BF16
    ) {
        return Err(LoraError::BadDtype {
            name: name.into(),
            dtype: t.dtype.to_string(),
        });
    }
    let n: usize = shape.iter().product();
    let expected = n * t.dtype.block_bytes();
    if t.bytes.len() != expected {
        return Err(LoraError::BadLength {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: t.dtype,
            expected,
            got: t.bytes.len(),
        });
    }
    let mut values = vec![0.0f32; n];
    crate::dtype::dequantize_into(t.dtype, t.bytes, &mut values);
    if values.iter().any(|v| !v.is_finite()) {
        return Err(LoraError::NotFinite { name: name.into() });
    }
    Ok(values)
}

/// One adapted module's values as read, before they are laid out by site.
struct ModuleWeights {
    module: TargetModule,
    rank: usize,
    scale: f32,
    a: Vec<f32>,
    b: Vec<f32>,
}

/// A site's parts (in module order) as one stacked `A` and each part's `B`; `None` if none.
fn site(parts: Vec<ModuleWeights>, base: &LlamaConfig) -> Option<LoraSite> {
    let fan_in = parts.first()?.module.dims(base).0;
    let mut a = Vec::new();
    let mut out = Vec::with_capacity(parts.len());
    for ModuleWeights {
        module,
        rank,
        scale,
        a: a_m,
        b: b_m,
    } in parts
    {
        let rank_start = a.len() / fan_in;
        a.extend_from_slice(&a_m);
        out.push(LoraPart {
            module,
            rank_start,
            rank,
            b: Matrix::from_f32(rank, &b_m),
            out_start: module.out_start(base),
            scale,
        });
    }
    Some(LoraSite {
        a: Matrix::from_f32(fan_in, &a),
        parts: out,
    })
}

#[cfg(test)]
mod tests;
