//! LoRA adapters against transformers + peft (`tests/golden/lora.json`, made by
//! `scripts/golden/make_lora.py` from the tiny bases and PEFT adapter folders in
//! `tests/fixtures/lora/`): the log-probabilities at every position of three prompts within
//! the golden tolerance (1e-4), and the greedy continuation token for token.

mod model_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_core::LoraId;
use ferry_model::{load_model, Executor, LlamaModel, LoraAdapter};
use model_support::*;
use serde_json::Value;

const BS: usize = 4;
const ID: LoraId = LoraId(1);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_owned()
}

fn golden() -> Value {
    let text = std::fs::read_to_string(root().join("tests/golden/lora.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Log-softmax of a logits row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row.iter().map(|&v| v as f64 - max - sum.ln()).collect()
}

/// The logits after each token of `tokens` under the adapter, one decode step a token.
fn logits_per_position(model: &mut LlamaModel, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = arena_for(model, 64, BS);
    let mut pool = Pool::new(64, BS, 5);
    let mut seq = Seq::new(0, Vec::new());
    seq.lora = Some(ID);
    tokens
        .iter()
        .map(|&t| {
            seq.tokens.push(t);
            let logits = step(model, &mut kv, &mut pool, &mut [&mut seq], &[1]);
            logits.row(0).to_vec()
        })
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn adapters_match_transformers_and_peft() {
    let golden = golden();
    let tol = golden["tolerance_logprobs_abs"].as_f64().unwrap();
    let fixtures = root().join("tests/fixtures/lora");
    let cases = golden["cases"].as_object().unwrap();
    assert_eq!(cases.len(), 6);
    let mut worst = 0.0f64;
    for (name, case) in cases {
        let base = load_model(&fixtures.join(case["base"].as_str().unwrap())).unwrap();
        let adapter_dir = fixtures.join(case["adapter"].as_str().unwrap());
        let adapter = LoraAdapter::load(&adapter_dir, &base.config, 64).unwrap();
        let mut model = LlamaModel::new(&base.config, &base.weights).unwrap();
        model.load_lora(ID, Arc::new(adapter)).unwrap();
        for (p, prompt) in case["prompts"].as_array().unwrap().iter().enumerate() {
            let tokens = ids(&prompt["ids"]);
            let rows = logits_per_position(&mut model, &tokens);
            let want = prompt["logprobs"].as_array().unwrap();
            assert_eq!(rows.len(), want.len());
            for (pos, (row, want)) in rows.iter().zip(want).enumerate() {
                for (t, (got, want)) in log_softmax(row)
                    .iter()
                    .zip(want.as_array().unwrap())
                    .enumerate()
                {
                    let err = (got - want.as_f64().unwrap()).abs();
                    worst = worst.max(err);
                    assert!(
                        err <= tol,
                        "{name} prompt {p} position {pos} token {t}: {got} vs {want} (error {err:e})"
                    );
                }
            }
        }
        let greedy = &case["greedy"];
        let prompt = &case["prompts"][greedy["prompt"].as_u64().unwrap() as usize];
        let mut tokens = ids(&prompt["ids"]);
        let n = tokens.len();
        for _ in 0..ids(&greedy["ids"]).len() {
            let rows = logits_per_position(&mut model, &tokens);
            tokens.push(argmax(rows.last().unwrap()));
        }
        assert_eq!(tokens[n..], ids(&greedy["ids"]), "{name}: greedy tokens");
    }
    eprintln!("largest log-probability error against peft: {worst:e}");
}

/// The goldens test the adapters: the base model alone is far from them.
#[test]
fn the_goldens_differ_from_the_base_models() {
    let golden = golden();
    let fixtures = root().join("tests/fixtures/lora");
    for (name, case) in golden["cases"].as_object().unwrap() {
        let base = load_model(&fixtures.join(case["base"].as_str().unwrap())).unwrap();
        let mut model = LlamaModel::new(&base.config, &base.weights).unwrap();
        let prompt = &case["prompts"][0];
        let tokens = ids(&prompt["ids"]);
        let mut kv = arena_for(&model, 64, BS);
        let mut pool = Pool::new(64, BS, 5);
        let mut seq = Seq::new(0, tokens.clone());
        let logits = step(
            &mut model,
            &mut kv,
            &mut pool,
            &mut [&mut seq],
            &[tokens.len()],
        );
        let want = prompt["logprobs"].as_array().unwrap().last().unwrap();
        let moved = log_softmax(logits.row(0))
            .iter()
            .zip(want.as_array().unwrap())
            .fold(0.0f64, |m, (g, w)| m.max((g - w.as_f64().unwrap()).abs()));
        assert!(
            moved > 0.1,
            "{name}: the base alone is within {moved} of the golden"
        );
    }
}
