//! The `tiny` model: deterministic, written as a Hugging Face folder and loaded back exactly,
//! a lossless byte-level tokenizer, and logits equal to the golden values transformers computed
//! from the written folder.

mod load_common;

use ferry_model::tiny::{tiny_model, write_hf_folder, CHATML_TEMPLATE, IM_END, IM_START};
use ferry_model::{expected_tensors, load_model, load_model_with_progress, ModelSpec};
use load_common::{check_tiny_logits, golden, ids_of, paged_logits, reference_forward};
use proptest::prelude::*;

#[test]
fn written_folder_loads_back_as_the_in_memory_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model();
    write_hf_folder(&model, tmp.path()).unwrap();
    let loaded = load_model(tmp.path()).unwrap();
    assert_eq!(loaded.config, model.config);
    assert_eq!(loaded.weights, model.weights);
    assert_eq!(loaded.chat_template, model.chat_template);
    let (a, b) = (model.tokenizer.unwrap(), loaded.tokenizer.unwrap());
    assert_eq!(a.to_string(false).unwrap(), b.to_string(false).unwrap());
    let text = "<|im_start|>user\nThe answer is 42 ✓<|im_end|>";
    assert_eq!(
        a.encode(text, false).unwrap().get_ids(),
        b.encode(text, false).unwrap().get_ids()
    );
}

#[test]
fn loading_reports_every_tensor_once_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model();
    write_hf_folder(&model, tmp.path()).unwrap();
    let mut seen = Vec::new();
    let loaded = load_model_with_progress(tmp.path(), &mut |done, total, name| {
        seen.push((done, total, name.to_owned()));
    })
    .unwrap();
    let expected = expected_tensors(&loaded.config);
    assert_eq!(seen.len(), expected.len());
    for (i, (done, total, name)) in seen.iter().enumerate() {
        assert_eq!((*done, *total), (i + 1, expected.len()));
        assert!(
            loaded.weights.get(name).is_some(),
            "{name} reported but not loaded"
        );
    }
}

#[test]
fn tiny_is_deterministic_and_not_degenerate() {
    let (a, b) = (tiny_model(), tiny_model());
    assert_eq!(a.weights, b.weights);
    let c = &a.config;
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers),
        (64, 128, 2)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (4, 2, 16)
    );
    // Matrices: mean ~0, std ~0.05; norms within 1 ± 0.1 and not all equal.
    let q = &a
        .weights
        .get("model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .data;
    let n = q.len() as f64;
    let mean = q.iter().map(|x| *x as f64).sum::<f64>() / n;
    let std = (q.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(
        mean.abs() < 0.005 && (std - 0.05).abs() < 0.005,
        "mean {mean} std {std}"
    );
    let norm = &a.weights.get("model.norm.weight").unwrap().data;
    assert!(norm.iter().all(|x| (0.9..=1.1).contains(x)));
    assert!(norm.iter().any(|x| *x != norm[0]));
    assert_eq!(ModelSpec::Tiny.load().unwrap().weights, a.weights);
}

#[test]
fn tokenizer_vocabulary_special_tokens_and_template() {
    let model = tiny_model();
    let tok = model.tokenizer.as_ref().unwrap();
    assert_eq!(tok.get_vocab_size(true), model.config.vocab_size);
    let im_end = tok.token_to_id(IM_END).unwrap();
    assert_eq!(
        model.config.eos_token_ids,
        vec![ferry_core::TokenId(im_end)]
    );
    let ids = tok.encode("<|im_start|>hi<|im_end|>", false).unwrap();
    let ids = ids.get_ids();
    assert_eq!(ids.first(), tok.token_to_id(IM_START).as_ref());
    assert_eq!(ids.last(), Some(&im_end));
    assert_eq!(tok.decode(ids, true).unwrap(), "hi");
    // Merges apply: " the" is one token.
    assert_eq!(tok.encode(" the", false).unwrap().get_ids().len(), 1);
    assert_eq!(model.chat_template.as_deref(), Some(CHATML_TEMPLATE));
}

#[test]
fn token_ids_equal_the_python_tokenizers_library() {
    let model = tiny_model();
    let tok = model.tokenizer.as_ref().unwrap();
    let g = golden("tiny.json");
    for case in g["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(ids.get_ids(), ids_of(&case["ids"]).as_slice(), "{text:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Byte-level BPE is lossless on any UTF-8 text (special tokens included).
    #[test]
    fn encode_decode_round_trips(text in "\\PC{0,40}|(<\\|im_(start|end)\\|>| |a|é|\n){0,8}") {
        let model = tiny_model();
        let tok = model.tokenizer.as_ref().unwrap();
        let ids = tok.encode(text.as_str(), false).unwrap();
        prop_assert_eq!(tok.decode(ids.get_ids(), false).unwrap(), text);
    }
}

/// The tiny golden logits were computed by transformers from the folder `ferry make-model tiny`
/// writes; the dense reference forward over the in-memory model must reproduce them. (The
/// engine's forward is checked the same way: call `check_tiny_logits` with a closure that
/// runs `LlamaModel` over the prompt and returns every position's logits.)
#[test]
fn reference_forward_matches_golden_logits() {
    let model = tiny_model();
    check_tiny_logits(|ids| reference_forward(&model, ids, true));
}

#[test]
fn model_spec_resolution() {
    use std::path::{Path, PathBuf};
    let cache = Path::new("/cache/ferry");
    let default = PathBuf::from("/cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(ferry_model::default_model_path(cache), default);
    assert_eq!(ModelSpec::resolve(Some("tiny"), cache), ModelSpec::Tiny);
    assert_eq!(ModelSpec::resolve(None, cache), ModelSpec::Path(default));
    let spec = ModelSpec::resolve(Some("/m/x.gguf"), cache);
    assert_eq!(spec, ModelSpec::Path("/m/x.gguf".into()));
    // What start-up errors print: the path as written, not `Path("...")`.
    assert_eq!(spec.to_string(), "/m/x.gguf");
    assert_eq!(ModelSpec::Tiny.to_string(), "tiny");
    let err = spec.load().unwrap_err().to_string();
    assert!(
        err.contains("/m/x.gguf") && err.contains("scripts/fetch-model.sh"),
        "{err}"
    );
}

/// The engine's paged forward, one token at a time through a reversed block table, against
/// transformers' logits at every position (tolerance in tiny.json).
#[test]
fn paged_forward_matches_golden_logits() {
    let model = ferry_model::tiny::tiny_model();
    check_tiny_logits(|ids| paged_logits(&model, ids, true));
}
