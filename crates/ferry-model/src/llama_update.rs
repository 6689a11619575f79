//! Weight updates for the Llama model, prepared off the engine thread: [`LlamaPreparer`]
//! checks pushed tensors against [`expected_tensors`] and turns them into a [`LlamaUpdate`],
//! which [`crate::LlamaModel`]'s `install` applies between two steps.
//!
//! The model keeps its weights fused (q/k/v rows in one `qkv` matrix, gate/up rows in one
//! `gate_up` matrix, see [`crate::llama_weights`]), so every Hugging Face tensor maps to a
//! [`Place`]: a buffer of [`LlamaWeights`] and a float offset in it. A complete set is
//! written straight into a whole new [`LlamaWeights`] ([`LlamaSlots`]), so installing it is
//! a pointer swap; a partial set is a list of [`Patch`]es, each in its own buffer, and
//! installing it copies each patch's floats to its place, nothing else.

use std::collections::{BTreeMap, BTreeSet};

use crate::llama_weights::{LayerWeights, LlamaWeights};
use crate::load::expected_tensors;
use crate::weight_buf::WeightBuf;
use crate::weight_update::{PreparedWeights, WeightError, WeightPreparer, WeightSlots};
use crate::{LlamaConfig, WeightStore};

/// A buffer of [`LayerWeights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerBuffer {
    InputNorm,
    Qkv,
    QkvBias,
    QNorm,
    KNorm,
    OProj,
    PostNorm,
    GateUp,
    Down,
}

/// A buffer of [`LlamaWeights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buffer {
    Embed,
    Norm,
    LmHead,
    Layer(usize, LayerBuffer),
}

/// Where one Hugging Face tensor lives in the fused layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    pub buffer: Buffer,
    /// Offset in floats of the tensor's first value in the buffer.
    pub offset: usize,
}

/// One checked tensor and where it goes.
#[derive(Debug)]
pub(crate) struct Patch {
    pub name: String,
    pub place: Place,
    pub data: WeightBuf,
}

/// What a prepared Llama update holds.
#[derive(Debug)]
pub(crate) enum LlamaUpdate {
    /// Every parameter, already in the model's layout.
    Full(Box<LlamaWeights>),
    /// Some parameters, to copy into the weights in place.
    Partial(Vec<Patch>),
}

/// The payload of a [`PreparedWeights`] from [`LlamaPreparer`]: the update and the config it
/// was checked against, so a model of another shape refuses it instead of indexing past a
/// buffer.
#[derive(Debug)]
pub(crate) struct LlamaPayload {
    pub config: LlamaConfig,
    pub update: LlamaUpdate,
}

/// Checks and converts weight updates for one Llama model, on any thread.
#[derive(Debug, Clone)]
pub struct LlamaPreparer {
    config: LlamaConfig,
}

impl LlamaPreparer {
    pub fn new(config: LlamaConfig) -> Self {
        Self { config }
    }
}

impl WeightPreparer for LlamaPreparer {
    fn prepare(&self, store: WeightStore) -> Result<PreparedWeights, WeightError> {
        if store.tensors.is_empty() {
            return Err(WeightError::Empty);
        }
        let expected: BTreeMap<String, Vec<usize>> =
            expected_tensors(&self.config).into_iter().collect();
        check_store(&expected, &store)?;
        let list: Vec<(String, Vec<usize>)> = store
            .tensors
            .iter()
            .map(|(name, t)| (name.clone(), t.shape.clone()))
            .collect();
        let mut slots = self.slots(&list)?;
        for (idx, tensor) in store.tensors.into_values().enumerate() {
            slots.slot(idx).copy_from_slice(&tensor.data);
        }
        Ok(slots.finish())
    }

    fn slots(&self, tensors: &[(String, Vec<usize>)]) -> Result<Box<dyn WeightSlots>, WeightError> {
        if tensors.is_empty() {
            return Err(WeightError::Empty);
        }
        let expected: BTreeMap<String, Vec<usize>> =
            expected_tensors(&self.config).into_iter().collect();
        let places = check_list(&self.config, &expected, tensors)?;
        // Names are unique and all expected, so as many as expected means every one.
        let target = if tensors.len() == expected.len() {
            Target::Full(Box::new(zeroed_weights(&self.config)))
        } else {
            Target::Partial(
                tensors
                    .iter()
                    .zip(&places)
                    .map(|((name, shape), &place)| Patch {
                        name: name.clone(),
                        place,
                        data: WeightBuf::zeroed(shape.iter().product()),
                    })
                    .collect(),
            )
        };
        let lens = tensors
            .iter()
            .map(|(_, shape)| shape.iter().product())
            .collect();
        Ok(Box::new(LlamaSlots {
            config: self.config.clone(),
            places,
            lens,
            target,
        }))
    }

    fn check_config(&self, config: &LlamaConfig) -> Result<(), WeightError> {
        let running = forward_fields(&self.config);
        let new = forward_fields(config);
        match running.into_iter().zip(new).find(|(r, n)| r.1 != n.1) {
            Some(((field, running), (_, new))) => Err(WeightError::ConfigMismatch {
                field,
                running,
                new,
            }),
            None => Ok(()),
        }
    }
}

/// The config fields that shape or change the forward, as text for comparison and errors
/// (`{:?}` of an f32 round-trips, so equal text means equal bits). Token ids (`bos`, `eos`)
/// are left out: they steer tokenization and stopping, which the engine fixed at start.
fn forward_fields(c: &LlamaConfig) -> [(&'static str, String); 15] {
    [
        ("architecture", c.architecture.clone()),
        ("vocab_size", c.vocab_size.to_string()),
        ("hidden_size", c.hidden_size.to_string()),
        ("intermediate_size", c.intermediate_size.to_string()),
        ("num_hidden_layers", c.num_hidden_layers.to_string()),
        ("num_attention_heads", c.num_attention_heads.to_string()),
        ("num_key_value_heads", c.num_key_value_heads.to_string()),
        ("head_dim", c.head_dim.to_string()),
        ("rms_norm_eps", format!("{:?}", c.rms_norm_eps)),
        ("rope_theta", format!("{:?}", c.rope_theta)),
        ("rope_scaling", format!("{:?}", c.rope_scaling)),
        (
            "max_position_embeddings",
            c.max_position_embeddings.to_string(),
        ),
        ("tie_word_embeddings", c.tie_word_embeddings.to_string()),
        ("attention_bias", c.attention_bias.to_string()),
        ("qk_norm", c.qk_norm.to_string()),
    ]
}

/// Every name known, every shape as expected, every data length matching its shape; the
/// first failure (in name order) is the error.
fn check_store(
    expected: &BTreeMap<String, Vec<usize>>,
    store: &WeightStore,
) -> Result<(), WeightError> {
    for (name, tensor) in &store.tensors {
        let Some(shape) = expected.get(name) else {
            return Err(WeightError::UnknownTensor { name: name.clone() });
        };
        if &tensor.shape != shape {
            return Err(WeightError::BadShape {
                name: name.clone(),
                expected: shape.clone(),
                got: tensor.shape.clone(),
            });
        }
        let numel: usize = shape.iter().product();
        if tensor.data.len() != numel {
            return Err(WeightError::Malformed(format!(
                "tensor `{name}` holds {} values, but its shape {shape:?} needs {numel}",
                tensor.data.len()
            )));
        }
    }
    Ok(())
}

/// Every name known and given once, every shape as expected, checked in name order (the
/// first failure is the error); the place of each tensor of the list, in list order.
fn check_list(
    config: &LlamaConfig,
    expected: &BTreeMap<String, Vec<usize>>,
    tensors: &[(String, Vec<usize>)],
) -> Result<Vec<Place>, WeightError> {
    let mut by_name: Vec<&(String, Vec<usize>)> = tensors.iter().collect();
    by_name.sort_by(|a, b| a.0.cmp(&b.0));
    let mut seen = BTreeSet::new();
    for (name, shape) in by_name {
        let Some(want) = expected.get(name) else {
            return Err(WeightError::UnknownTensor { name: name.clone() });
        };
        if shape != want {
            return Err(WeightError::BadShape {
                name: name.clone(),
                expected: want.clone(),
                got: shape.clone(),
            });
        }
        if !seen.insert(name) {
            return Err(WeightError::Malformed(format!(
                "tensor `{name}` is given twice"
            )));
        }
    }
    tensors
        .iter()
        .map(|(name, _)| {
            place_of(config, name).ok_or_else(|| WeightError::UnknownTensor { name: name.clone() })
        })
        .collect()
}

/// What [`LlamaSlots`] fills: new whole weights, or one buffer per pushed tensor.
enum Target {
    Full(Box<LlamaWeights>),
    Partial(Vec<Patch>),
}

/// The slots of a checked Llama update (see [`WeightPreparer::slots`]).
struct LlamaSlots {
    config: LlamaConfig,
    /// Where each tensor of the list goes, and its length in floats.
    places: Vec<Place>,
    lens: Vec<usize>,
    target: Target,
}

impl WeightSlots for LlamaSlots {
    fn slot(&mut self, idx: usize) -> &mut [f32] {
        let (place, len) = (self.places[idx], self.lens[idx]);
        match &mut self.target {
            Target::Full(weights) => {
                let buffer = buffer_mut(weights, place.buffer)
                    .expect("zeroed_weights has a buffer for every place of its config");
                &mut buffer[place.offset..place.offset + len]
            }
            Target::Partial(patches) => &mut patches[idx].data,
        }
    }

    fn finish(self: Box<Self>) -> PreparedWeights {
        let n_tensors = self.lens.len();
        let n_bytes = self.lens.iter().sum::<usize>() * size_of::<f32>();
        let (update, complete) = match self.target {
            Target::Full(weights) => (LlamaUpdate::Full(weights), true),
            Target::Partial(patches) => (LlamaUpdate::Partial(patches), false),
        };
        let payload = LlamaPayload {
            config: self.config,
            update,
        };
        PreparedWeights::new(n_tensors, n_bytes, complete, Box::new(payload))
    }
}

/// Where the tensor `name` goes in the fused layout; `None` for a name the model lacks.
pub(crate) fn place_of(c: &LlamaConfig, name: &str) -> Option<Place> {
    let whole = |buffer| Some(Place { buffer, offset: 0 });
    match name {
        "model.embed_tokens.weight" => return whole(Buffer::Embed),
        "model.norm.weight" => return whole(Buffer::Norm),
        "lm_head.weight" if !c.tie_word_embeddings => return whole(Buffer::LmHead),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer_text, param) = rest.split_once('.')?;
    let layer: usize = layer_text.parse().ok()?;
    // `01` parses as 1 but is not a parameter's name.
    if layer >= c.num_hidden_layers || layer.to_string() != layer_text {
        return None;
    }
    let (buffer, offset) = layer_place(c, param)?;
    Some(Place {
        buffer: Buffer::Layer(layer, buffer),
        offset,
    })
}

/// A layer parameter's buffer and float offset: q, k, v stacked in `qkv` (and their biases
/// in `qkv_bias`), gate then up in `gate_up`.
fn layer_place(c: &LlamaConfig, param: &str) -> Option<(LayerBuffer, usize)> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let bias = c.attention_bias;
    Some(match param {
        "input_layernorm.weight" => (LayerBuffer::InputNorm, 0),
        "self_attn.q_proj.weight" => (LayerBuffer::Qkv, 0),
        "self_attn.k_proj.weight" => (LayerBuffer::Qkv, q_out * h),
        "self_attn.v_proj.weight" => (LayerBuffer::Qkv, (q_out + kv_out) * h),
        "self_attn.q_proj.bias" if bias => (LayerBuffer::QkvBias, 0),
        "self_attn.k_proj.bias" if bias => (LayerBuffer::QkvBias, q_out),
        "self_attn.v_proj.bias" if bias => (LayerBuffer::QkvBias, q_out + kv_out),
        "self_attn.q_norm.weight" if c.qk_norm => (LayerBuffer::QNorm, 0),
        "self_attn.k_norm.weight" if c.qk_norm => (LayerBuffer::KNorm, 0),
        "self_attn.o_proj.weight" => (LayerBuffer::OProj, 0),
        "post_attention_layernorm.weight" => (LayerBuffer::PostNorm, 0),
        "mlp.gate_proj.weight" => (LayerBuffer::GateUp, 0),
        "mlp.up_proj.weight" => (LayerBuffer::GateUp, c.intermediate_size * h),
        "mlp.down_proj.weight" => (LayerBuffer::Down, 0),
        _ => return None,
    })
}

/// Copies one patch's floats to its place in `buffer`, or says the place is not there.
pub(crate) fn copy_patch(buffer: &mut [f32], patch: &Patch) -> Result<(), WeightError> {
    let end = patch.place.offset + patch.data.len();
    let dst = buffer
        .get_mut(patch.place.offset..end)
        .ok_or_else(out_of_place)?;
    dst.copy_from_slice(&patch.data);
    Ok(())
}

/// A checked patch that does not fit the weights it is applied to: they were prepared for a
/// model of another shape.
fn out_of_place() -> WeightError {
    WeightError::WrongExecutor
}

/// The buffer `b` names in `w`, if the model has it (biases and q/k norms are optional).
pub(crate) fn buffer_mut(w: &mut LlamaWeights, b: Buffer) -> Option<&mut WeightBuf> {
    match b {
        Buffer::Embed => Some(&mut w.embed),
        Buffer::Norm => Some(&mut w.norm),
        Buffer::LmHead => w.lm_head.as_mut(),
        Buffer::Layer(l, lb) => {
            let layer = w.layers.get_mut(l)?;
            match lb {
                LayerBuffer::InputNorm => Some(&mut layer.input_norm),
                LayerBuffer::Qkv => Some(&mut layer.qkv),
                LayerBuffer::QkvBias => layer.qkv_bias.as_mut(),
                LayerBuffer::QNorm => layer.q_norm.as_mut(),
                LayerBuffer::KNorm => layer.k_norm.as_mut(),
                LayerBuffer::OProj => Some(&mut layer.o_proj),
                LayerBuffer::PostNorm => Some(&mut layer.post_norm),
                LayerBuffer::GateUp => Some(&mut layer.gate_up),
                LayerBuffer::Down => Some(&mut layer.down),
            }
        }
    }
}

/// Weights of `config`'s shapes, all zero: untouched pages until a reader writes them.
fn zeroed_weights(c: &LlamaConfig) -> LlamaWeights {
    let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let qkv_out = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;
    let zeros = WeightBuf::zeroed;
    let layer = || LayerWeights {
        input_norm: zeros(h),
        qkv: zeros(qkv_out * h),
        qkv_bias: c.attention_bias.then(|| zeros(qkv_out)),
        q_norm: c.qk_norm.then(|| zeros(hd)),
        k_norm: c.qk_norm.then(|| zeros(hd)),
        o_proj: zeros(h * c.num_attention_heads * hd),
        post_norm: zeros(h),
        gate_up: zeros(2 * i * h),
        down: zeros(h * i),
    };
    LlamaWeights {
        embed: zeros(c.vocab_size * h),
        layers: (0..c.num_hidden_layers).map(|_| layer()).collect(),
        norm: zeros(h),
        lm_head: (!c.tie_word_embeddings).then(|| zeros(c.vocab_size * h)),
    }
}

/// Weights that hold nothing: what a model keeps after sleep level 2 dropped its own.
pub(crate) fn empty_weights() -> LlamaWeights {
    LlamaWeights {
        embed: WeightBuf::default(),
        layers: Vec::new(),
        norm: WeightBuf::default(),
        lm_head: None,
    }
}

/// The first expected tensor a partial update lacks, and how many it lacks.
pub(crate) fn missing(config: &LlamaConfig, patches: &[Patch]) -> (usize, String) {
    let present: std::collections::BTreeSet<&str> =
        patches.iter().map(|p| p.name.as_str()).collect();
    let absent: Vec<String> = expected_tensors(config)
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !present.contains(name.as_str()))
        .collect();
    let n_missing = absent.len();
    (n_missing, absent.into_iter().next().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random_model::small_config;

    #[test]
    fn every_expected_tensor_has_a_place_and_nothing_else_does() {
        for config in [
            small_config(),
            LlamaConfig {
                attention_bias: true,
                qk_norm: true,
                tie_word_embeddings: true,
                ..small_config()
            },
        ] {
            for (name, _) in expected_tensors(&config) {
                assert!(place_of(&config, &name).is_some(), "{name}");
            }
            for name in [
                "model.layers.2.input_layernorm.weight",
                "model.layers.01.input_layernorm.weight",
                "model.layers.0.mlp.gate_proj.bias",
                "model.layers.x.input_layernorm.weight",
                "lm_head.bias",
            ] {
                assert_eq!(place_of(&config, name), None, "{name}");
            }
            let tied = place_of(&config, "lm_head.weight");
            assert_eq!(tied.is_none(), config.tie_word_embeddings);
            let bias = place_of(&config, "model.layers.0.self_attn.q_proj.bias");
            assert_eq!(bias.is_some(), config.attention_bias);
        }
    }

    #[test]
    fn fused_offsets_follow_the_stacking_order() {
        let c = small_config();
        let (h, q_out, kv_out) = (64, 4 * 16, 2 * 16);
        let at = |name: &str| place_of(&c, name).map(|p| p.offset);
        assert_eq!(
            at("model.layers.1.self_attn.k_proj.weight"),
            Some(q_out * h)
        );
        assert_eq!(
            at("model.layers.1.self_attn.v_proj.weight"),
            Some((q_out + kv_out) * h)
        );
        assert_eq!(at("model.layers.1.mlp.up_proj.weight"), Some(96 * h));
    }

    #[test]
    fn missing_names_the_first_absent_tensor() {
        let c = small_config();
        let patch = |name: &str| Patch {
            name: name.into(),
            place: place_of(&c, name).unwrap(),
            data: WeightBuf::default(),
        };
        let n = expected_tensors(&c).len();
        let (n_missing, first) = missing(&c, &[patch("model.embed_tokens.weight")]);
        assert_eq!(
            (n_missing, first.as_str()),
            (n - 1, "model.layers.0.input_layernorm.weight")
        );
    }
}
