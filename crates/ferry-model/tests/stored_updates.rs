//! Weight updates of a model kept in its stored precision: a pushed tensor is kept in the
//! dtype it arrives in (a bf16 push into a Q4_1 model makes that tensor bf16, never
//! re-quantized), through the engine's path (a safetensors body fed to `SafetensorsPush`,
//! then `install`), and the model computes the bits of one built from those tensors; sleep
//! level 2 drops the stored bytes and a complete push brings them back.

mod model_support;

use ferry_model::tiny::{tiny_config, tiny_weights};
use ferry_model::{
    Executor, LlamaConfig, LlamaModel, Matrix, SafetensorsPush, StoredTensor, WeightDtype,
    WeightError, WeightResidency, WeightStore,
};
use model_support::{arena_for, argmax, bits, random_tokens, step, Pool, Seq};
use safetensors::Dtype;

const BS: usize = 4;

/// The tiny model with every matrix in `dtype` (vectors f32).
fn tiny_in(dtype: WeightDtype) -> (LlamaConfig, WeightStore) {
    let config = tiny_config();
    let mut store = WeightStore::default();
    for (name, t) in tiny_weights(&config).tensors {
        if t.shape.len() == 2 {
            let stored = StoredTensor::quantized(t.shape.clone(), dtype, &t.data);
            store.insert_stored(name, stored);
        } else {
            store.insert(name, t);
        }
    }
    (config, store)
}

/// Logits bits of a prefill and four greedy decode steps.
fn outputs(model: &mut LlamaModel) -> Vec<Vec<u32>> {
    let vocab = model.config().vocab_size;
    let mut kv = arena_for(model, 16, BS);
    let mut pool = Pool::new(16, BS, 7);
    let mut seq = Seq::new(0, random_tokens(7, vocab, 8));
    let mut rows = Vec::new();
    let mut count = seq.tokens.len();
    for _ in 0..5 {
        let out = step(model, &mut kv, &mut pool, &mut [&mut seq], &[count]);
        rows.push(bits(out.row(0)));
        seq.tokens.push(argmax(out.row(0)));
        count = 1;
    }
    rows
}

/// A safetensors body of `tensors` (name, dtype, shape, bytes).
fn body(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views = tensors.iter().map(|(name, dtype, shape, bytes)| {
        let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
        (name.clone(), view)
    });
    safetensors::serialize(views, None).unwrap()
}

/// Pushes `bytes` as the engine does: fed in pieces, prepared, installed.
fn push(model: &mut LlamaModel, bytes: &[u8]) -> Result<usize, WeightError> {
    let mut push = SafetensorsPush::new(model.weight_ops().preparer());
    for piece in bytes.chunks(1000) {
        push.feed(piece)?;
    }
    let prepared = push.finish()?;
    let n_bytes = prepared.n_bytes;
    model.weight_ops_mut().install(prepared)?;
    Ok(n_bytes)
}

fn dtypes(m: &Matrix) -> Vec<WeightDtype> {
    m.segments().iter().map(|s| s.dtype()).collect()
}

/// Values a trainer might push: the tiny model's q_proj of layer 1, scaled, as bf16 bytes.
fn bf16_values(config: &LlamaConfig, name: &str) -> (Vec<usize>, Vec<u8>) {
    let t = tiny_weights(config).tensors[name].clone();
    let bytes = t
        .data
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x * 1.5).to_le_bytes())
        .collect();
    (t.shape, bytes)
}

#[test]
fn a_bf16_push_into_a_q4_1_model_keeps_that_tensor_bf16() {
    let (config, store) = tiny_in(WeightDtype::Q4_1);
    let mut model = LlamaModel::new(&config, &store).unwrap();
    let before = outputs(&mut model);
    let name = "model.layers.1.self_attn.q_proj.weight";
    let (shape, bytes) = bf16_values(&config, name);
    let n_bytes = push(
        &mut model,
        &body(&[(name.into(), Dtype::BF16, shape.clone(), bytes.clone())]),
    )
    .unwrap();
    assert_eq!(n_bytes, bytes.len(), "the update holds the bf16 bytes");

    let layers = &model.weights().layers;
    use WeightDtype::{BF16, Q4_1};
    assert_eq!(dtypes(&layers[1].qkv), [BF16, Q4_1, Q4_1]);
    assert_eq!(dtypes(&layers[0].qkv), [Q4_1, Q4_1, Q4_1]);
    assert_eq!(layers[1].qkv.segments()[0].bytes(), &bytes[..]);

    // The same tensors, built directly: the pushed tensor as bf16, the rest as they were.
    let mut want_store = store.clone();
    let pushed = StoredTensor {
        shape,
        dtype: BF16,
        bytes,
    };
    want_store.insert_stored(name, pushed);
    let want = outputs(&mut LlamaModel::new(&config, &want_store).unwrap());
    let got = outputs(&mut model);
    assert!(
        got == want,
        "the pushed model computes the bits of one built from its tensors"
    );
    assert!(got != before, "the push changed the model");
}

#[test]
fn a_complete_f16_push_keeps_every_matrix_f16_and_survives_sleep_level_2() {
    let (config, q4) = tiny_in(WeightDtype::Q4_0);
    let (_, f16) = tiny_in(WeightDtype::F16);
    let mut tensors = Vec::new();
    for (name, t) in &f16.stored {
        tensors.push((name.clone(), Dtype::F16, t.shape.clone(), t.bytes.clone()));
    }
    for (name, t) in &f16.tensors {
        let bytes = t.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push((name.clone(), Dtype::F32, t.shape.clone(), bytes));
    }
    let bytes = body(&tensors);
    let want = outputs(&mut LlamaModel::new(&config, &f16).unwrap());

    let mut model = LlamaModel::new(&config, &q4).unwrap();
    let q4_bytes = model.weights().total_bytes();
    // Sleep level 2 gives every stored byte back; only a complete push brings weights back.
    let retired = model.weight_ops_mut().drop_weights();
    assert!(retired.is_some());
    assert_eq!(model.weights().total_bytes(), 0);
    push(&mut model, &bytes).unwrap();
    model.weight_ops_mut().restore().unwrap();
    assert_eq!(model.weight_ops().residency(), WeightResidency::Resident);

    let w = model.weights();
    let all_f16 = std::iter::once(&w.embed)
        .chain(w.lm_head.as_ref())
        .chain(
            w.layers
                .iter()
                .flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down]),
        )
        .all(|m| dtypes(m).iter().all(|&d| d == WeightDtype::F16));
    assert!(all_f16, "every matrix is kept as pushed");
    assert!(w.total_bytes() > q4_bytes, "f16 holds more bytes than Q4_0");
    assert!(outputs(&mut model) == want);
}

/// A pushed f32 tensor into a quantized model is stored as f32 (what arrived), beside the
/// quantized part of the same fused matrix.
#[test]
fn an_f32_push_into_a_q8_0_model_is_kept_as_f32() {
    let (config, store) = tiny_in(WeightDtype::Q8_0);
    let mut model = LlamaModel::new(&config, &store).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    let t = tiny_weights(&config).tensors[name].clone();
    let f32_bytes: Vec<u8> = t.data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let one = body(&[(name.into(), Dtype::F32, t.shape.clone(), f32_bytes)]);
    push(&mut model, &one).unwrap();
    let gate_up = &model.weights().layers[0].gate_up;
    assert_eq!(dtypes(gate_up), [WeightDtype::Q8_0, WeightDtype::F32]);
    assert_eq!(gate_up.to_f32()[t.data.len()..], t.data[..]);
}
