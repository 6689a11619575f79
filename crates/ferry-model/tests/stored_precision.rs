//! Weights kept in their stored precision against the same weights dequantized to f32 at
//! load, through the whole paged forward: the tiny model in every dtype (and in a mix of
//! dtypes), token by token and logit by logit, bitwise, at batch 1 and in a crowded batch;
//! and the loaders keeping a file's dtypes (a bf16 safetensors folder).

mod model_support;

use ferry_model::tiny::{tiny_config, tiny_weights};
use ferry_model::{
    load_model, load_model_stored, LlamaConfig, LlamaModel, StoredTensor, WeightDtype, WeightStore,
};
use model_support::{arena_for, argmax, bits, random_tokens, step, Pool, Seq};

const BS: usize = 4;

/// The tiny model's weights with every matrix in `dtype_of(name)` (vectors stay f32).
fn tiny_in(dtype_of: impl Fn(&str) -> WeightDtype) -> (LlamaConfig, WeightStore) {
    let config = tiny_config();
    let f32s = tiny_weights(&config);
    (config, stored_in(&f32s, dtype_of))
}

/// `f32s` with every matrix in `dtype_of(name)` (vectors stay f32).
fn stored_in(f32s: &WeightStore, dtype_of: impl Fn(&str) -> WeightDtype) -> WeightStore {
    let mut store = WeightStore::default();
    for (name, t) in &f32s.tensors {
        if t.shape.len() == 2 {
            let stored = StoredTensor::quantized(t.shape.clone(), dtype_of(name), &t.data);
            store.insert_stored(name.clone(), stored);
        } else {
            store.insert(name.clone(), t.clone());
        }
    }
    store
}

/// A random model whose every row length is a multiple of 256 (hidden 256, intermediate
/// 512, four heads of 64), as the K-quants need, with q/k/v and o biases.
fn k_quant_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        attention_bias: true,
        o_proj_bias: true,
        ..ferry_model::random_model::small_config()
    }
}

/// Every logits row of a run of three requests: prompts prefilled in uneven chunks side by
/// side, then `n_decode` greedy tokens each, all in one batch. Tokens come from the model's
/// own argmax, so two models that agree bit for bit agree on every token too.
fn crowded_run(model: &mut LlamaModel, n_decode: usize) -> Vec<Vec<u32>> {
    let vocab = model.config().vocab_size;
    let mut kv = arena_for(model, 64, BS);
    let mut pool = Pool::new(64, BS, 11);
    let mut seqs: Vec<Seq> = (0..3)
        .map(|i| {
            Seq::new(
                i,
                random_tokens(5 + 3 * i as usize, vocab, 20 + u64::from(i)),
            )
        })
        .collect();
    let mut rows = Vec::new();
    let mut run = |seqs: &mut Vec<Seq>, counts: &[usize], rows: &mut Vec<Vec<u32>>| {
        let mut refs: Vec<&mut Seq> = seqs.iter_mut().collect();
        let logits = step(model, &mut kv, &mut pool, &mut refs, counts);
        for (i, &req) in logits.reqs.iter().enumerate() {
            rows.push(bits(logits.row(i)));
            let seq = seqs.iter_mut().find(|s| s.req == req).unwrap();
            seq.tokens.push(argmax(logits.row(i)));
        }
    };
    run(&mut seqs, &[5, 4, 3], &mut rows);
    run(&mut seqs, &[0, 4, 8], &mut rows);
    for _ in 0..n_decode {
        run(&mut seqs, &[1, 1, 1], &mut rows);
    }
    rows
}

/// One request alone: its prompt in one prefill, then `n_decode` greedy tokens.
fn alone_run(model: &mut LlamaModel, prompt: Vec<u32>, n_decode: usize) -> Vec<Vec<u32>> {
    let mut kv = arena_for(model, 64, BS);
    let mut pool = Pool::new(64, BS, 12);
    let n = prompt.len();
    let mut seq = Seq::new(0, prompt);
    let mut rows = Vec::new();
    let mut count = n;
    for _ in 0..=n_decode {
        let logits = step(model, &mut kv, &mut pool, &mut [&mut seq], &[count]);
        rows.push(bits(logits.row(0)));
        seq.tokens.push(argmax(logits.row(0)));
        count = 1;
    }
    rows
}

#[test]
fn tiny_in_every_dtype_gives_the_bits_of_its_f32_dequantization() {
    let mut f32_rows = None;
    for dtype in WeightDtype::ALL {
        let (config, stored) = tiny_in(|_| dtype);
        let mut kept = LlamaModel::new(&config, &stored).unwrap();
        let mut dequantized = LlamaModel::new(&config, &stored.dequantized()).unwrap();
        assert!(kept.weights().total_bytes() <= dequantized.weights().total_bytes());
        let (got, want) = (
            crowded_run(&mut kept, 12),
            crowded_run(&mut dequantized, 12),
        );
        assert_eq!(got.len(), want.len());
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "{dtype}: logits row {step} differs");
        }
        // Each dtype computes a different model (the test would pass vacuously otherwise).
        match &f32_rows {
            None => f32_rows = Some(got),
            Some(f32_rows) => assert_ne!(f32_rows, &got, "{dtype} computed the f32 model"),
        }
    }
}

/// The dtypes the matmul reads through an f32 scratch (Q5_0, Q5_1 in the tiny model; all
/// four, Q4_K and Q6_K included, in a model of rows 256 long) give the bits of the same
/// weights dequantized to f32 at load, at batch 1 and in a crowded batch, and each computes
/// its own model.
#[test]
fn by_rows_dtypes_give_the_bits_of_their_f32_dequantization() {
    let config = k_quant_config();
    let f32s = ferry_model::random_model::random_weights(&config, 7);
    let tiny = tiny_config();
    let tiny_f32s = tiny_weights(&tiny);
    let mut seen: Vec<Vec<Vec<u32>>> = Vec::new();
    for dtype in WeightDtype::BY_ROWS {
        let mut cases = vec![(config.clone(), stored_in(&f32s, |_| dtype))];
        if dtype.block_elems() == 32 {
            cases.push((tiny.clone(), stored_in(&tiny_f32s, |_| dtype)));
        }
        for (config, stored) in cases {
            let mut kept = LlamaModel::new(&config, &stored).unwrap();
            let mut dequantized = LlamaModel::new(&config, &stored.dequantized()).unwrap();
            assert!(kept.weights().total_bytes() * 4 < dequantized.weights().total_bytes());
            let got = crowded_run(&mut kept, 6);
            assert!(
                got == crowded_run(&mut dequantized, 6),
                "{dtype}: logits differ"
            );
            let prompt = random_tokens(5, config.vocab_size, 20);
            let alone = alone_run(&mut kept, prompt.clone(), 3);
            assert!(
                alone == alone_run(&mut dequantized, prompt, 3),
                "{dtype}: logits alone differ"
            );
            assert!(
                !seen.contains(&got),
                "{dtype} computed another dtype's model"
            );
            seen.push(got);
        }
    }
    // A mix in one fused matrix, with a register-kernel dtype beside them.
    let mixed = stored_in(&f32s, |name| {
        if name.contains("q_proj") || name.contains("up_proj") {
            WeightDtype::Q4_K
        } else if name.contains("k_proj") || name.contains("down_proj") {
            WeightDtype::Q6_K
        } else if name.contains("v_proj") {
            WeightDtype::Q5_1
        } else if name.contains("gate_proj") {
            WeightDtype::Q4_1
        } else {
            WeightDtype::Q5_0
        }
    });
    let mut kept = LlamaModel::new(&config, &mixed).unwrap();
    let mut dequantized = LlamaModel::new(&config, &mixed.dequantized()).unwrap();
    assert!(crowded_run(&mut kept, 6) == crowded_run(&mut dequantized, 6));
}

/// q/k/v and gate/up fused from parts of different dtypes, as after a partial update.
#[test]
fn a_mix_of_dtypes_in_one_fused_matrix_gives_the_bits_of_its_f32_dequantization() {
    let (config, stored) = tiny_in(|name| {
        if name.contains("q_proj") || name.contains("up_proj") {
            WeightDtype::BF16
        } else if name.contains("k_proj") || name.contains("lm_head") {
            WeightDtype::Q4_1
        } else if name.contains("v_proj") || name.contains("embed") {
            WeightDtype::Q8_0
        } else if name.contains("gate_proj") {
            WeightDtype::F16
        } else {
            WeightDtype::Q4_0
        }
    });
    let mut kept = LlamaModel::new(&config, &stored).unwrap();
    let mut dequantized = LlamaModel::new(&config, &stored.dequantized()).unwrap();
    assert!(crowded_run(&mut kept, 8) == crowded_run(&mut dequantized, 8));
}

/// Batch invariance with quantized weights: a request alone (batch 1, the 8×1 decode tiles)
/// has the bits it has among others (the batched tiles).
#[test]
fn quantized_weights_keep_batch_invariance() {
    for dtype in [WeightDtype::Q4_1, WeightDtype::BF16] {
        let (config, stored) = tiny_in(|_| dtype);
        let mut model = LlamaModel::new(&config, &stored).unwrap();
        let crowded = crowded_run(&mut model, 6);
        let prompt = random_tokens(5, config.vocab_size, 20);
        let alone = alone_run(&mut model, prompt, 6);
        // Request 0's rows in the crowded run: the first prefill's, then one per decode step
        // (requests 1 and 2 sample only from the second step on).
        let mut req0 = vec![crowded[0].clone()];
        req0.extend((0..6).map(|d| crowded[3 + 3 * d].clone()));
        assert!(
            req0 == alone,
            "{dtype}: request 0 alone differs from in a batch"
        );
    }
}

/// A bf16 safetensors folder loads with its matrices kept as bf16 (half the bytes of f32)
/// and computes the bits of the same folder loaded as f32.
#[test]
fn a_bf16_folder_is_kept_in_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = ferry_model::tiny::tiny_model();
    // bf16 values, so writing them as f32 and as bf16 holds the same numbers.
    for t in model.weights.tensors.values_mut() {
        for x in &mut t.data {
            *x = half::bf16::from_f32(*x).to_f32();
        }
    }
    ferry_model::tiny::write_hf_folder(&model, dir.path()).unwrap();
    rewrite_as_bf16(&dir.path().join("model.safetensors"), &model.weights);

    let f32s = load_model(dir.path()).unwrap();
    let kept = load_model_stored(dir.path()).unwrap();
    let stored = &kept.weights.stored;
    let q = &stored["model.layers.0.self_attn.q_proj.weight"];
    assert_eq!(q.dtype, WeightDtype::BF16);
    assert!(stored
        .values()
        .all(|t| t.shape.len() == 2 && t.dtype == WeightDtype::BF16));
    assert!(kept.weights.tensors.values().all(|t| t.shape.len() == 1));
    let mut a = LlamaModel::new(&kept.config, &kept.weights).unwrap();
    let mut b = LlamaModel::new(&f32s.config, &f32s.weights).unwrap();
    let matrices = |m: &LlamaModel| m.weights().bytes_read_per_step();
    assert!(
        matrices(&a) * 10 < matrices(&b) * 6,
        "bf16 is about half the bytes"
    );
    assert!(crowded_run(&mut a, 6) == crowded_run(&mut b, 6));
}

fn rewrite_as_bf16(path: &std::path::Path, weights: &WeightStore) {
    use safetensors::tensor::TensorView;
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .tensors
        .iter()
        .map(|(name, t)| {
            let bytes = t
                .data
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect();
            (name.clone(), t.shape.clone(), bytes)
        })
        .collect();
    let views = raw.iter().map(|(name, shape, bytes)| {
        let view = TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes).unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}
