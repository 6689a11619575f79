//! Random LoRA adapters for tests and benchmarks (`ferry make-model lora`): every `A` and `B`
//! drawn from a seed (`B` nonzero, unlike PEFT's initialisation, so the adapter changes the
//! outputs), written as a PEFT folder.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, View};

use super::{LoraConfig, LoraError, TargetModule, Targets, CONFIG_FILE, WEIGHTS_FILE};
use crate::config::LlamaConfig;
use crate::weights::random::SplitMix64;
use crate::weights::store::Tensor;

/// What a random adapter targets and how it scales.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomLora {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<TargetModule>,
    pub use_rslora: bool,
    pub seed: u64,
}

/// A random adapter of `spec` for a base of `base`: its config and tensors, named as PEFT
/// names them. `A`'s rows have unit-scale dot products with unit-scale inputs, and `B` is
/// small enough that the adapter moves the outputs without swamping the base.
pub fn random_lora(base: &LlamaConfig, spec: &RandomLora) -> (LoraConfig, Vec<(String, Tensor)>) {
    let mut rng = SplitMix64(spec.seed);
    let mut uniform = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
            .collect()
    };
    let mut targets = spec.targets.clone();
    targets.sort();
    targets.dedup();
    let mut tensors = Vec::new();
    for layer in 0..base.num_hidden_layers {
        for &m in &targets {
            let (fan_in, fan_out) = m.dims(base);
            let r = spec.rank;
            let prefix = format!("base_model.model.{}", m.path(layer));
            let a = uniform(r * fan_in, (3.0 / fan_in as f32).sqrt());
            let b = uniform(fan_out * r, 0.5 / (r as f32).sqrt());
            tensors.push((
                format!("{prefix}.lora_A.weight"),
                Tensor::new(vec![r, fan_in], a),
            ));
            tensors.push((
                format!("{prefix}.lora_B.weight"),
                Tensor::new(vec![fan_out, r], b),
            ));
        }
    }
    let config = LoraConfig {
        r: spec.rank,
        lora_alpha: spec.alpha,
        use_rslora: spec.use_rslora,
        target_modules: Targets::Names(targets.iter().map(|m| m.name().to_owned()).collect()),
        rank_pattern: BTreeMap::new(),
        alpha_pattern: BTreeMap::new(),
        layers_to_transform: None,
    };
    (config, tensors)
}

/// Writes `config` and `tensors` (f32) as a PEFT folder at `dir` (created if missing).
pub fn write_peft_folder(
    dir: &Path,
    config: &LoraConfig,
    tensors: &[(String, Tensor)],
) -> Result<(), LoraError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| LoraError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let text = serde_json::to_string_pretty(&config.to_json()).map_err(LoraError::Json)?;
    let path = dir.join(CONFIG_FILE);
    std::fs::write(&path, text + "\n").map_err(io(&path))?;
    let views: Vec<(&str, F32View<'_>)> = tensors
        .iter()
        .map(|(name, t)| (name.as_str(), F32View(t)))
        .collect();
    let path = dir.join(WEIGHTS_FILE);
    let metadata = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(views.iter().map(|(n, v)| (*n, v)), Some(metadata), &path)
        .map_err(|e| LoraError::Safetensors {
            file: WEIGHTS_FILE.into(),
            message: format!("writing: {e}"),
        })
}

/// An f32 tensor as little-endian bytes for the safetensors writer.
struct F32View<'a>(&'a Tensor);

impl View for &F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(self.0.data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        size_of_val(self.0.data.as_slice())
    }
}
