//! Weight updates for the Llama model, prepared off the engine thread: [`LlamaPreparer`]
//! checks pushed tensors against [`expected_tensors`] and turns them into a [`LlamaUpdate`],
//! which [`crate::LlamaModel`]'s `install` applies between two steps.
//!
//! The model keeps its weights fused (q/k/v rows in one `qkv` matrix, gate/up rows in one
//! `gate_up` matrix, see [`crate::weights::llama`]), so every Hugging Face tensor maps to a
//! [`Place`]: a buffer of [`LlamaWeights`] and where in it (a segment of a matrix, a float
//! offset in a vector). A complete set is written straight into a whole new [`LlamaWeights`]
//! ([`LlamaSlots`]), so installing it is a pointer swap; a partial set is a list of
//! [`Patch`]es, each in its own buffer, and installing it puts each matrix patch in place of
//! its segment (in the patch's dtype, whatever the old one's) and copies each vector patch's
//! floats to its place, nothing else.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::expected_tensors;
use crate::dtype::WeightDtype;
use crate::weights::buf::WeightBuf;
use crate::weights::llama::{ExpertWeights, LayerWeights, LlamaWeights};
use crate::weights::matrix::{Matrix, Segment};
use crate::weights::update::{
    PreparedWeights, RetiredWeights, WeightError, WeightPreparer, WeightSlots,
};
use crate::{LlamaConfig, MoeConfig, WeightStore};

/// A buffer of [`LayerWeights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerBuffer {
    InputNorm,
    Qkv,
    QkvBias,
    QNorm,
    KNorm,
    OProj,
    OBias,
    PostNorm,
    GateUp,
    Down,
    Router,
    SharedGate,
    ExpertGateUp(usize),
    ExpertDown(usize),
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
    /// In a matrix buffer, the index of the tensor's segment; in a vector buffer, the offset
    /// in floats of its first value.
    pub offset: usize,
}

/// One checked tensor and where it goes: a matrix's rows in their dtype, or a vector as one
/// row (made f32 when it is installed).
#[derive(Debug)]
pub(crate) struct Patch {
    pub name: String,
    pub place: Place,
    pub data: Segment,
}

/// A buffer of [`LlamaWeights`], borrowed: a matrix, or a vector of f32.
pub(crate) enum BufferMut<'a> {
    Matrix(&'a mut Matrix),
    Vector(&'a mut WeightBuf),
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
        if store.tensors.is_empty() && store.stored.is_empty() {
            return Err(WeightError::Empty);
        }
        let store = unfuse(&self.config, store)?;
        let expected: BTreeMap<String, Vec<usize>> =
            expected_tensors(&self.config).into_iter().collect();
        check_store(&expected, &store)?;
        let list: Vec<(String, Vec<usize>)> = store
            .tensors
            .iter()
            .map(|(name, t)| (name.clone(), t.shape.clone()))
            .chain(
                store
                    .stored
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shape.clone())),
            )
            .collect();
        let mut slots = self.slots(&list)?;
        let n_f32 = store.tensors.len();
        for (idx, tensor) in store.tensors.into_values().enumerate() {
            slots.slot(idx).copy_from_slice(&tensor.data);
        }
        for (idx, t) in store.stored.into_values().enumerate() {
            match slots.stored_slot(n_f32 + idx, t.dtype) {
                Some(bytes) => bytes.copy_from_slice(&t.bytes),
                None => slots.slot(n_f32 + idx).copy_from_slice(&t.to_f32()),
            }
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
                        data: zeroed_rows(shape),
                    })
                    .collect(),
            )
        };
        Ok(Box::new(LlamaSlots::new(
            &self.config,
            tensors,
            places,
            target,
        )))
    }

    fn slots_in_place(
        &self,
        lent: RetiredWeights,
        tensors: &[(String, Vec<usize>)],
    ) -> Result<Box<dyn WeightSlots>, (WeightError, RetiredWeights)> {
        let mut weights = match lent.downcast::<LlamaWeights>() {
            Ok(weights) => weights,
            Err(lent) => return Err((WeightError::WrongExecutor, lent)),
        };
        let expected: BTreeMap<String, Vec<usize>> =
            expected_tensors(&self.config).into_iter().collect();
        let places = match check_list(&self.config, &expected, tensors) {
            Ok(places) if tensors.len() == expected.len() => places,
            Ok(_) => {
                let names = tensors.iter().map(|(name, _)| name.as_str());
                let (n_missing, first) = missing(&self.config, names);
                return Err((WeightError::Incomplete { n_missing, first }, weights));
            }
            Err(e) => return Err((e, weights)),
        };
        // Lent by a model of this config, so every place is there; checked all the same, as
        // the reader writes each slot whole.
        let fits = tensors
            .iter()
            .zip(&places)
            .all(|((_, shape), &place)| place_fits(&mut weights, place, shape));
        if !fits {
            return Err((WeightError::WrongExecutor, weights));
        }
        let target = Target::InPlace(weights);
        Ok(Box::new(LlamaSlots::new(
            &self.config,
            tensors,
            places,
            target,
        )))
    }

    fn expected(&self) -> Vec<(String, Vec<usize>)> {
        expected_tensors(&self.config)
    }

    fn fused_parts(&self, name: &str) -> Option<(Vec<usize>, Vec<crate::config::FusedPart>)> {
        crate::config::fused_parts(&self.config, name)
    }

    /// Buckets' patches joined; when they hold every parameter, moved into whole weights
    /// (each matrix patch's own buffer takes its place, so nothing is copied but the
    /// vectors), which install by a swap, also after sleep level 2.
    fn merge(&self, parts: Vec<PreparedWeights>) -> Result<PreparedWeights, WeightError> {
        if parts.len() == 1 {
            return Ok(parts.into_iter().next().expect("one part"));
        }
        if parts.is_empty() {
            return Err(WeightError::Empty);
        }
        let (mut n_tensors, mut n_bytes) = (0, 0);
        let mut patches = Vec::new();
        for part in parts {
            n_tensors += part.n_tensors;
            n_bytes += part.n_bytes;
            let payload = part.into_payload::<LlamaPayload>()?;
            if payload.config != self.config {
                return Err(WeightError::WrongExecutor);
            }
            match payload.update {
                LlamaUpdate::Partial(more) => patches.extend(more),
                // A bucket holding every parameter leaves no name for another bucket.
                LlamaUpdate::Full(_) => return Err(WeightError::WrongExecutor),
            }
        }
        let complete = patches.len() == expected_tensors(&self.config).len();
        let update = if complete {
            LlamaUpdate::Full(Box::new(assemble(&self.config, patches)?))
        } else {
            LlamaUpdate::Partial(patches)
        };
        let payload = LlamaPayload {
            config: self.config.clone(),
            update,
        };
        Ok(PreparedWeights::new(
            n_tensors,
            n_bytes,
            complete,
            Box::new(payload),
        ))
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
fn forward_fields(c: &LlamaConfig) -> [(&'static str, String); 19] {
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
        ("o_proj_bias", c.o_proj_bias.to_string()),
        ("qk_norm", c.qk_norm.to_string()),
        ("qk_norm_whole", c.qk_norm_whole.to_string()),
        ("clip_qkv", format!("{:?}", c.clip_qkv)),
        ("moe", format!("{:?}", c.moe)),
    ]
}

/// `store` with each tensor of transformers 5's fused MoE layout split into the parameters
/// it holds ([`crate::config::fused_parts`]), each in the fused tensor's dtype.
fn unfuse(c: &LlamaConfig, mut store: WeightStore) -> Result<WeightStore, WeightError> {
    let fused: Vec<_> = store
        .tensors
        .keys()
        .chain(store.stored.keys())
        .filter_map(|name| Some((name.clone(), crate::config::fused_parts(c, name)?)))
        .collect();
    for (name, (shape, parts)) in fused {
        let bad_shape = |got: &[usize]| WeightError::BadShape {
            name: name.clone(),
            expected: shape.clone(),
            got: got.to_vec(),
        };
        if let Some(t) = store.tensors.remove(&name) {
            if t.shape != shape {
                return Err(bad_shape(&t.shape));
            }
            for part in parts {
                let n: usize = part.shape.iter().product();
                let data = t.data[part.offset..part.offset + n].to_vec();
                store.insert(part.name, crate::Tensor::new(part.shape, data));
            }
        } else if let Some(t) = store.stored.remove(&name) {
            if t.shape != shape {
                return Err(bad_shape(&t.shape));
            }
            let k = shape[shape.len() - 1];
            let row_bytes = t.dtype.row_bytes(k).ok_or_else(|| bad_shape(&t.shape))?;
            for part in parts {
                let (first, rows) = (part.offset / k, part.shape[0]);
                let bytes = t.bytes[first * row_bytes..(first + rows) * row_bytes].to_vec();
                let dtype = t.dtype;
                let part_t = crate::StoredTensor {
                    shape: part.shape,
                    dtype,
                    bytes,
                };
                store.insert_stored(part.name, part_t);
            }
        }
    }
    Ok(store)
}

/// Every name known, every shape as expected, every data length matching its shape; the
/// first failure (in name order) is the error.
fn check_store(
    expected: &BTreeMap<String, Vec<usize>>,
    store: &WeightStore,
) -> Result<(), WeightError> {
    for (name, t) in &store.stored {
        let Some(shape) = expected.get(name) else {
            return Err(WeightError::UnknownTensor { name: name.clone() });
        };
        if &t.shape != shape || store.tensors.contains_key(name) {
            return Err(WeightError::BadShape {
                name: name.clone(),
                expected: shape.clone(),
                got: t.shape.clone(),
            });
        }
        let want = t.dtype.row_bytes(shape[shape.len() - 1]);
        let rows: usize = shape[..shape.len() - 1].iter().product();
        if want.map(|r| r * rows) != Some(t.bytes.len()) {
            return Err(WeightError::Malformed(format!(
                "tensor `{name}` holds {} bytes, not {shape:?} of {}",
                t.bytes.len(),
                t.dtype
            )));
        }
    }
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

/// What [`LlamaSlots`] fills: new whole weights, weights lent for a reload in place (their
/// memory already taken), or one buffer per pushed tensor.
enum Target {
    Full(Box<LlamaWeights>),
    InPlace(Box<LlamaWeights>),
    Partial(Vec<Patch>),
}

/// Whether tensor `shape`'s place is in `w`, as long as the tensor: a matrix segment of as
/// many rows (of `shape[1]` elements), or that many floats of a vector.
fn place_fits(w: &mut LlamaWeights, place: Place, shape: &[usize]) -> bool {
    let len: usize = shape.iter().product();
    match buffer_mut(w, place.buffer) {
        Some(BufferMut::Vector(v)) => place.offset + len <= v.len(),
        Some(BufferMut::Matrix(m)) => {
            let k = m.k();
            let rows = m.segment_mut(place.offset).map(|s| s.rows());
            matches!(shape, [r, c] if Some(*r) == rows && *c == k)
        }
        None => false,
    }
}

/// The slots of a checked Llama update (see [`WeightPreparer::slots`]).
struct LlamaSlots {
    config: LlamaConfig,
    /// Where each tensor of the list goes, its length in elements, and the bytes it holds.
    places: Vec<Place>,
    lens: Vec<usize>,
    n_bytes: Vec<usize>,
    target: Target,
}

impl LlamaSlots {
    /// Slots for the checked list `tensors`, each at its place in `target`, counted in f32
    /// until a reader keeps it in another dtype.
    fn new(
        config: &LlamaConfig,
        tensors: &[(String, Vec<usize>)],
        places: Vec<Place>,
        target: Target,
    ) -> Self {
        let lens: Vec<usize> = tensors
            .iter()
            .map(|(_, shape)| shape.iter().product())
            .collect();
        Self {
            config: config.clone(),
            places,
            n_bytes: lens.iter().map(|n| n * size_of::<f32>()).collect(),
            lens,
            target,
        }
    }
}

impl WeightSlots for LlamaSlots {
    fn slot(&mut self, idx: usize) -> &mut [f32] {
        let (place, len) = (self.places[idx], self.lens[idx]);
        let missing = "whole weights have a buffer for every place of their config (checked)";
        match &mut self.target {
            Target::Full(weights) | Target::InPlace(weights) => {
                match buffer_mut(weights, place.buffer).expect(missing) {
                    BufferMut::Vector(buffer) => &mut buffer[place.offset..place.offset + len],
                    BufferMut::Matrix(m) => {
                        let k = m.k();
                        let segment = m.segment_mut(place.offset).expect(missing);
                        if segment.dtype() != WeightDtype::F32 {
                            // Lent weights hold this matrix in another dtype: f32 rows anew.
                            *segment = Segment::zeroed(WeightDtype::F32, segment.rows(), k)
                                .expect("f32 rows hold any length");
                        }
                        f32s_mut(segment)
                    }
                }
            }
            Target::Partial(patches) => f32s_mut(&mut patches[idx].data),
        }
    }

    /// A matrix is kept in the dtype it arrives in (a bf16 push into a Q4_1 model makes that
    /// tensor bf16, never re-quantized): its zeroed f32 segment gives way to one of `dtype`.
    fn stored_slot(&mut self, idx: usize, dtype: WeightDtype) -> Option<&mut [u8]> {
        let place = self.places[idx];
        let segment = match &mut self.target {
            Target::Full(weights) | Target::InPlace(weights) => {
                match buffer_mut(weights, place.buffer)? {
                    BufferMut::Matrix(m) => {
                        let k = m.k();
                        let rows = m.segment_mut(place.offset)?.rows();
                        if m.segment_mut(place.offset)?.dtype() != dtype {
                            let fresh = Segment::zeroed(dtype, rows, k).ok()?;
                            m.replace_segment(place.offset, fresh).ok()?;
                        }
                        m.segment_mut(place.offset)?
                    }
                    BufferMut::Vector(_) => return None,
                }
            }
            Target::Partial(patches) => {
                let patch = &mut patches[idx];
                if !is_matrix(place.buffer) {
                    return None;
                }
                if patch.data.dtype() != dtype {
                    let (rows, k) = (patch.data.rows(), self.lens[idx] / patch.data.rows().max(1));
                    patch.data = Segment::zeroed(dtype, rows, k).ok()?;
                }
                &mut patch.data
            }
        };
        self.n_bytes[idx] = segment.bytes().len();
        // Lent weights' rows may be arranged for the kernels; the reader writes the file's.
        Some(segment.overwrite_mut())
    }

    /// A full update's matrices (all but a few kilobytes of norms): their fresh pages are
    /// taken, and cleared by the kernel, on rayon's threads at once.
    fn prefault(&mut self) {
        // Lent weights' memory is already taken.
        let Target::Full(w) = &mut self.target else {
            return;
        };
        let mut matrices: Vec<&mut Matrix> = vec![&mut w.embed];
        matrices.extend(w.lm_head.as_mut());
        for l in &mut w.layers {
            matrices.extend(l.matrices_mut());
        }
        let regions: Vec<&mut [u8]> = matrices
            .into_iter()
            .flat_map(|m| m.segments_mut().iter_mut().map(Segment::bytes_mut))
            .collect();
        crate::weights::buf::prefault(regions);
    }

    fn finish(mut self: Box<Self>) -> PreparedWeights {
        // Readers write stored matrices in the file's layout; the kernels may read another.
        for (idx, place) in self.places.iter().enumerate() {
            let segment = match &mut self.target {
                Target::Full(weights) | Target::InPlace(weights) => {
                    match buffer_mut(weights, place.buffer) {
                        Some(BufferMut::Matrix(m)) => m.segment_mut(place.offset),
                        _ => None,
                    }
                }
                Target::Partial(patches) => Some(&mut patches[idx].data),
            };
            if let Some(segment) = segment {
                segment.arrange();
            }
        }
        let n_tensors = self.lens.len();
        let n_bytes = self.n_bytes.iter().sum();
        let (update, complete) = match self.target {
            Target::Full(weights) | Target::InPlace(weights) => (LlamaUpdate::Full(weights), true),
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
    let (buffer, offset) = layer_place(c, layer, param)?;
    Some(Place {
        buffer: Buffer::Layer(layer, buffer),
        offset,
    })
}

/// A layer parameter's buffer and place in it: q, k, v as segments 0, 1, 2 of `qkv` (their
/// biases at float offsets in `qkv_bias`), gate and up as segments 0 and 1 of `gate_up`.
fn layer_place(c: &LlamaConfig, layer: usize, param: &str) -> Option<(LayerBuffer, usize)> {
    let hd = c.head_dim;
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let bias = c.attention_bias;
    Some(match param {
        "input_layernorm.weight" => (LayerBuffer::InputNorm, 0),
        "self_attn.q_proj.weight" => (LayerBuffer::Qkv, 0),
        "self_attn.k_proj.weight" => (LayerBuffer::Qkv, 1),
        "self_attn.v_proj.weight" => (LayerBuffer::Qkv, 2),
        "self_attn.q_proj.bias" if bias => (LayerBuffer::QkvBias, 0),
        "self_attn.k_proj.bias" if bias => (LayerBuffer::QkvBias, q_out),
        "self_attn.v_proj.bias" if bias => (LayerBuffer::QkvBias, q_out + kv_out),
        "self_attn.q_norm.weight" if c.qk_norm => (LayerBuffer::QNorm, 0),
        "self_attn.k_norm.weight" if c.qk_norm => (LayerBuffer::KNorm, 0),
        "self_attn.o_proj.weight" => (LayerBuffer::OProj, 0),
        "self_attn.o_proj.bias" if c.o_proj_bias => (LayerBuffer::OBias, 0),
        "post_attention_layernorm.weight" => (LayerBuffer::PostNorm, 0),
        _ => return mlp_place(c.sparse_layer(layer), param),
    })
}

/// An MLP parameter's place: a dense layer's gate and up as segments 0 and 1 of `gate_up`;
/// in an MoE layer, the router, each expert's gate/up/down likewise, and Qwen2-MoE's shared
/// expert in `gate_up`/`down` with its gate.
fn mlp_place(moe: Option<&MoeConfig>, param: &str) -> Option<(LayerBuffer, usize)> {
    let Some(moe) = moe else {
        return Some(match param {
            "mlp.gate_proj.weight" => (LayerBuffer::GateUp, 0),
            "mlp.up_proj.weight" => (LayerBuffer::GateUp, 1),
            "mlp.down_proj.weight" => (LayerBuffer::Down, 0),
            _ => return None,
        });
    };
    let shared = moe.shared_expert_intermediate_size.is_some();
    match param.strip_prefix(moe.naming.block())?.strip_prefix('.')? {
        "gate.weight" => return Some((LayerBuffer::Router, 0)),
        "shared_expert.gate_proj.weight" if shared => return Some((LayerBuffer::GateUp, 0)),
        "shared_expert.up_proj.weight" if shared => return Some((LayerBuffer::GateUp, 1)),
        "shared_expert.down_proj.weight" if shared => return Some((LayerBuffer::Down, 0)),
        "shared_expert_gate.weight" if shared => return Some((LayerBuffer::SharedGate, 0)),
        _ => {}
    }
    let rest = param
        .strip_prefix(moe.naming.block())?
        .strip_prefix(".experts.")?;
    let (e_text, _) = rest.split_once('.')?;
    let e: usize = e_text.parse().ok()?;
    if e >= moe.num_experts || e.to_string() != e_text {
        return None;
    }
    let [gate, up, down] = moe.naming.expert(e);
    match param {
        p if p == gate => Some((LayerBuffer::ExpertGateUp(e), 0)),
        p if p == up => Some((LayerBuffer::ExpertGateUp(e), 1)),
        p if p == down => Some((LayerBuffer::ExpertDown(e), 0)),
        _ => None,
    }
}

/// Whether a buffer holds a matrix (kept in its stored precision) rather than a vector.
fn is_matrix(b: Buffer) -> bool {
    match b {
        Buffer::Embed | Buffer::LmHead => true,
        Buffer::Norm => false,
        Buffer::Layer(_, lb) => matches!(
            lb,
            LayerBuffer::Qkv
                | LayerBuffer::OProj
                | LayerBuffer::GateUp
                | LayerBuffer::Down
                | LayerBuffer::Router
                | LayerBuffer::SharedGate
                | LayerBuffer::ExpertGateUp(_)
                | LayerBuffer::ExpertDown(_)
        ),
    }
}

/// Whether `patch` fits `w`: a matrix patch as many rows as the segment it replaces and the
/// matrix's row length, a vector patch inside its buffer. A patch that does not was prepared
/// for a model of another shape.
pub(crate) fn patch_fits(w: &mut LlamaWeights, patch: &Patch) -> bool {
    let (offset, data) = (patch.place.offset, &patch.data);
    match buffer_mut(w, patch.place.buffer) {
        Some(BufferMut::Matrix(m)) => {
            let k = m.k();
            m.segment_mut(offset).is_some_and(|s| {
                s.rows() == data.rows()
                    && data.dtype().row_bytes(k).map(|r| r * s.rows()) == Some(data.bytes().len())
            })
        }
        Some(BufferMut::Vector(v)) => {
            data.dtype() == WeightDtype::F32 && offset + data.bytes().len() / 4 <= v.len()
        }
        None => false,
    }
}

/// Puts one patch in place (checked with [`patch_fits`] first); returns the segment it
/// replaced when the patch brought another dtype, for the caller to drop.
pub(crate) fn apply_patch(
    w: &mut LlamaWeights,
    patch: Patch,
) -> Result<Option<Segment>, WeightError> {
    if !patch_fits(w, &patch) {
        return Err(WeightError::WrongExecutor);
    }
    let offset = patch.place.offset;
    match buffer_mut(w, patch.place.buffer) {
        Some(BufferMut::Matrix(m)) => {
            let segment = m.segment_mut(offset).ok_or(WeightError::WrongExecutor)?;
            // Same dtype (held the same way): a copy into the pages already there, as an f32
            // update always was; otherwise the patch's own buffer takes the old one's place.
            if segment.dtype() == patch.data.dtype()
                && segment.grouped_rows() == patch.data.grouped_rows()
            {
                segment.bytes_mut().copy_from_slice(patch.data.bytes());
                return Ok(None);
            }
            m.replace_segment(offset, patch.data)
                .map(Some)
                .map_err(|_| WeightError::WrongExecutor)
        }
        Some(BufferMut::Vector(v)) => {
            let mut values = patch.data;
            let values = f32s_mut(&mut values);
            v[offset..offset + values.len()].copy_from_slice(values);
            Ok(None)
        }
        None => Err(WeightError::WrongExecutor),
    }
}

/// An f32 segment's values, to be written in place.
fn f32s_mut(segment: &mut Segment) -> &mut [f32] {
    assert_eq!(segment.dtype(), WeightDtype::F32, "a slot is f32");
    // SAFETY: every bit pattern is a valid f32, and a segment's bytes are their own page-aligned
    // mapping (or empty), so the middle part is all of them, which the assert checks.
    let (head, floats, tail) = unsafe { segment.bytes_mut().align_to_mut::<f32>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "segment bytes are aligned"
    );
    floats
}

/// Zeros for a tensor of `shape` as one f32 segment: a matrix's rows, or a vector as a row.
fn zeroed_rows(shape: &[usize]) -> Segment {
    let (rows, k) = match shape {
        [rows, k] => (*rows, *k),
        _ => (1, shape.iter().product()),
    };
    Segment::zeroed(WeightDtype::F32, rows, k).expect("f32 rows hold any length")
}

/// The buffer `b` names in `w`, if the model has it (biases and q/k norms are optional).
pub(crate) fn buffer_mut(w: &mut LlamaWeights, b: Buffer) -> Option<BufferMut<'_>> {
    use BufferMut::{Matrix as M, Vector as V};
    match b {
        Buffer::Embed => Some(M(&mut w.embed)),
        Buffer::Norm => Some(V(&mut w.norm)),
        Buffer::LmHead => w.lm_head.as_mut().map(M),
        Buffer::Layer(l, lb) => {
            let layer = w.layers.get_mut(l)?;
            match lb {
                LayerBuffer::InputNorm => Some(V(&mut layer.input_norm)),
                LayerBuffer::Qkv => Some(M(&mut layer.qkv)),
                LayerBuffer::QkvBias => layer.qkv_bias.as_mut().map(V),
                LayerBuffer::QNorm => layer.q_norm.as_mut().map(V),
                LayerBuffer::KNorm => layer.k_norm.as_mut().map(V),
                LayerBuffer::OProj => Some(M(&mut layer.o_proj)),
                LayerBuffer::OBias => layer.o_bias.as_mut().map(V),
                LayerBuffer::PostNorm => Some(V(&mut layer.post_norm)),
                LayerBuffer::GateUp => Some(M(&mut layer.gate_up)),
                LayerBuffer::Down => Some(M(&mut layer.down)),
                LayerBuffer::Router => layer.router.as_mut().map(M),
                LayerBuffer::SharedGate => layer.shared_gate.as_mut().map(M),
                LayerBuffer::ExpertGateUp(e) => layer.experts.get_mut(e).map(|x| M(&mut x.gate_up)),
                LayerBuffer::ExpertDown(e) => layer.experts.get_mut(e).map(|x| M(&mut x.down)),
            }
        }
    }
}

/// Weights of `config`'s shapes, all zero f32: untouched pages until a reader writes them.
fn zeroed_weights(c: &LlamaConfig) -> LlamaWeights {
    let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let zeros = WeightBuf::zeroed;
    let matrix = |k: usize, parts: &[usize]| {
        Matrix::new(
            k,
            parts.iter().map(|&rows| zeroed_rows(&[rows, k])).collect(),
        )
    };
    let (q_norm_len, k_norm_len) = crate::config::qk_norm_lens(c);
    let layer = |l: usize| {
        let mlp = |inter: usize| (matrix(h, &[inter, inter]), matrix(inter, &[h]));
        let (mut gate_up, mut down) = (Matrix::default(), Matrix::default());
        let (mut router, mut experts, mut shared_gate) = (None, Vec::new(), None);
        match c.sparse_layer(l) {
            None => (gate_up, down) = mlp(i),
            Some(moe) => {
                router = Some(matrix(h, &[moe.num_experts]));
                experts = (0..moe.num_experts)
                    .map(|_| {
                        let (gate_up, down) = mlp(moe.expert_intermediate_size);
                        ExpertWeights { gate_up, down }
                    })
                    .collect();
                if let Some(s_i) = moe.shared_expert_intermediate_size {
                    (gate_up, down) = mlp(s_i);
                    shared_gate = Some(matrix(h, &[1]));
                }
            }
        }
        LayerWeights {
            input_norm: zeros(h),
            qkv: matrix(h, &[q_out, kv_out, kv_out]),
            qkv_bias: c.attention_bias.then(|| zeros(q_out + 2 * kv_out)),
            q_norm: c.qk_norm.then(|| zeros(q_norm_len)),
            k_norm: c.qk_norm.then(|| zeros(k_norm_len)),
            o_proj: matrix(q_out, &[h]),
            o_bias: c.o_proj_bias.then(|| zeros(h)),
            post_norm: zeros(h),
            gate_up,
            down,
            router,
            experts,
            shared_gate,
        }
    };
    LlamaWeights {
        embed: matrix(h, &[c.vocab_size]),
        layers: (0..c.num_hidden_layers).map(layer).collect(),
        norm: zeros(h),
        lm_head: (!c.tie_word_embeddings).then(|| matrix(h, &[c.vocab_size])),
    }
}

/// Whole weights from patches of distinct names covering every parameter: each matrix
/// patch's segment is moved into place (the zeroed one it replaces was never touched, so it
/// cost no memory), each vector copied.
fn assemble(c: &LlamaConfig, patches: Vec<Patch>) -> Result<LlamaWeights, WeightError> {
    let mut w = zeroed_weights(c);
    for patch in patches {
        if !patch_fits(&mut w, &patch) {
            return Err(WeightError::WrongExecutor);
        }
        if let Some(BufferMut::Matrix(m)) = buffer_mut(&mut w, patch.place.buffer) {
            m.replace_segment(patch.place.offset, patch.data)
                .map_err(|_| WeightError::WrongExecutor)?;
        } else {
            apply_patch(&mut w, patch)?;
        }
    }
    Ok(w)
}

/// Weights that hold nothing: what a model keeps after sleep level 2 dropped its own.
pub(crate) fn empty_weights() -> LlamaWeights {
    LlamaWeights {
        embed: Matrix::default(),
        layers: Vec::new(),
        norm: WeightBuf::default(),
        lm_head: None,
    }
}

/// The first expected tensor a partial update (of the tensors `present`) lacks, and how many
/// it lacks.
pub(crate) fn missing<'a>(
    config: &LlamaConfig,
    present: impl IntoIterator<Item = &'a str>,
) -> (usize, String) {
    let present: BTreeSet<&str> = present.into_iter().collect();
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
    use crate::weights::random::small_config;

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
    fn fused_places_follow_the_stacking_order() {
        let c = LlamaConfig {
            attention_bias: true,
            ..small_config()
        };
        let (q_out, kv_out) = (4 * 16, 2 * 16);
        let at = |name: &str| place_of(&c, name).map(|p| p.offset);
        assert_eq!(at("model.layers.1.self_attn.k_proj.weight"), Some(1));
        assert_eq!(at("model.layers.1.self_attn.v_proj.weight"), Some(2));
        assert_eq!(at("model.layers.1.mlp.up_proj.weight"), Some(1));
        assert_eq!(at("model.layers.1.self_attn.k_proj.bias"), Some(q_out));
        assert_eq!(
            at("model.layers.1.self_attn.v_proj.bias"),
            Some(q_out + kv_out)
        );
    }

    #[test]
    fn missing_names_the_first_absent_tensor() {
        let c = small_config();
        let patch = |name: &str| Patch {
            name: name.into(),
            place: place_of(&c, name).unwrap(),
            data: zeroed_rows(&[0]),
        };
        let n = expected_tensors(&c).len();
        let patches = [patch("model.embed_tokens.weight")];
        let (n_missing, first) = missing(&c, patches.iter().map(|p| p.name.as_str()));
        assert_eq!(
            (n_missing, first.as_str()),
            (n - 1, "model.layers.0.input_layernorm.weight")
        );
    }
}
