//! Shared by the `load_*` tests: the golden files, checks of logits against them, and a dense
//! reference Llama forward.
//!
//! The reference forward is test-only and deliberately naive (one sequence, no KV cache,
//! f32 dot products in eight lanes, f64 elsewhere): it exists to prove that the loaded weights mean what the golden logits
//! (computed by Hugging Face transformers from the same files) say they mean, independently of
//! the engine's paged forward. The engine's forward is checked against the same golden data
//! through [`check_tiny_logits`] and [`check_top_logits`].

#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;

use ferry_model::{LlamaConfig, LoadedModel, WeightStore};
use serde_json::Value;

pub fn golden(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats_of(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Checks a forward against tiny.json: `forward(ids)` must return the logits of every
/// position (`ids.len()` rows of `vocab_size`), within the file's `tolerance_abs`.
pub fn check_tiny_logits(mut forward: impl FnMut(&[u32]) -> Vec<Vec<f32>>) {
    let g = golden("tiny.json");
    let tol = g["tolerance_abs"].as_f64().unwrap() as f32;
    for (p, prompt) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = ids_of(&prompt["ids"]);
        let got = forward(&ids);
        let want = prompt["logits"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "prompt {p}: positions");
        for (pos, (g_row, w_row)) in got.iter().zip(want).enumerate() {
            assert_close(
                g_row,
                &floats_of(w_row),
                tol,
                &format!("prompt {p} position {pos}"),
            );
        }
    }
}

/// Checks a forward against smollm2.json: `last_logits(ids)` returns the full-vocabulary
/// logits of the last position. Every golden top-20 entry must match within
/// `tolerance_logits_abs`, and the argmax must be the golden top-1.
pub fn check_top_logits(mut last_logits: impl FnMut(&[u32]) -> Vec<f32>) {
    let g = golden("smollm2.json");
    let tol = g["tolerance_logits_abs"].as_f64().unwrap() as f32;
    for (p, prompt) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let logits = last_logits(&ids_of(&prompt["ids"]));
        let top_ids = ids_of(&prompt["top_ids"]);
        let top = floats_of(&prompt["top_logits"]);
        for (id, want) in top_ids.iter().zip(&top) {
            let got = logits[*id as usize];
            assert!(
                (got - want).abs() <= tol,
                "prompt {p}: logit of token {id} is {got}, golden {want} (tolerance {tol})"
            );
        }
        let argmax = argmax(&logits);
        assert_eq!(argmax, top_ids[0] as usize, "prompt {p}: argmax");
    }
}

pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (idx, diff) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold(
            (0, 0.0f32),
            |best, (i, d)| if d > best.1 { (i, d) } else { best },
        );
    assert!(
        diff <= tol,
        "{what}: element {idx} is {} vs golden {} (|diff| {diff} > {tol})",
        got[idx],
        want[idx]
    );
}

fn argmax(xs: &[f32]) -> usize {
    xs.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 {
                (i, x)
            } else {
                best
            }
        })
        .0
}

// ---------------------------------------------------------------------------------------------
// Dense reference forward (Hugging Face LlamaForCausalLM semantics: rotate_half rope, GQA,
// SwiGLU MLP, RMSNorm with the weight applied after normalizing).

/// Logits for `ids` (one sequence from position 0): every position when `all_positions`,
/// else only the last.
pub fn reference_forward(model: &LoadedModel, ids: &[u32], all_positions: bool) -> Vec<Vec<f32>> {
    let c = &model.config;
    let w = &model.weights;
    let mut h: Vec<Vec<f32>> = ids
        .iter()
        .map(|&id| row(w, "model.embed_tokens.weight", id as usize, c.hidden_size))
        .collect();
    for layer in 0..c.num_hidden_layers {
        let p = |n: &str| format!("model.layers.{layer}.{n}");
        let x: Vec<Vec<f32>> = h
            .iter()
            .map(|v| rms_norm(v, param(w, &p("input_layernorm.weight")), c.rms_norm_eps))
            .collect();
        let attn = attention(model, layer, &x);
        for (hv, a) in h.iter_mut().zip(&attn) {
            add(hv, &matvec(w, &p("self_attn.o_proj.weight"), a));
        }
        for hv in h.iter_mut() {
            let x = rms_norm(
                hv,
                param(w, &p("post_attention_layernorm.weight")),
                c.rms_norm_eps,
            );
            let gate = matvec(w, &p("mlp.gate_proj.weight"), &x);
            let up = matvec(w, &p("mlp.up_proj.weight"), &x);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            add(hv, &matvec(w, &p("mlp.down_proj.weight"), &act));
        }
    }
    let head = if c.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    let first = if all_positions { 0 } else { h.len() - 1 };
    h[first..]
        .iter()
        .map(|v| {
            matvec(
                w,
                head,
                &rms_norm(v, param(w, "model.norm.weight"), c.rms_norm_eps),
            )
        })
        .collect()
}

fn attention(model: &LoadedModel, layer: usize, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let c = &model.config;
    let w = &model.weights;
    let p = |n: &str| format!("model.layers.{layer}.self_attn.{n}");
    let q: Vec<Vec<f32>> = x
        .iter()
        .map(|v| matvec(w, &p("q_proj.weight"), v))
        .collect();
    let k: Vec<Vec<f32>> = x
        .iter()
        .map(|v| matvec(w, &p("k_proj.weight"), v))
        .collect();
    let v: Vec<Vec<f32>> = x
        .iter()
        .map(|v| matvec(w, &p("v_proj.weight"), v))
        .collect();
    let hd = c.head_dim;
    let group = c.num_attention_heads / c.num_key_value_heads;
    let rope = |vec: &[f32], pos: usize, n_heads: usize| -> Vec<f32> {
        (0..n_heads)
            .flat_map(|h| rotate(&vec[h * hd..(h + 1) * hd], pos, c))
            .collect()
    };
    let q: Vec<Vec<f32>> = q
        .iter()
        .enumerate()
        .map(|(i, v)| rope(v, i, c.num_attention_heads))
        .collect();
    let k: Vec<Vec<f32>> = k
        .iter()
        .enumerate()
        .map(|(i, v)| rope(v, i, c.num_key_value_heads))
        .collect();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![vec![0.0f32; c.num_attention_heads * hd]; x.len()];
    for (t, o) in out.iter_mut().enumerate() {
        for h in 0..c.num_attention_heads {
            let kvh = h / group;
            let qh = &q[t][h * hd..(h + 1) * hd];
            let scores: Vec<f64> = (0..=t)
                .map(|s| dot(qh, &k[s][kvh * hd..(kvh + 1) * hd]) * scale)
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for d in 0..hd {
                let acc: f64 = (0..=t)
                    .map(|s| exps[s] / sum * v[s][kvh * hd + d] as f64)
                    .sum();
                o[h * hd + d] = acc as f32;
            }
        }
    }
    out
}

/// HF rotate_half rope on one head: pairs are (i, i + hd/2).
fn rotate(x: &[f32], pos: usize, c: &LlamaConfig) -> Vec<f32> {
    let hd = x.len();
    let half = hd / 2;
    let mut out = vec![0.0; hd];
    for i in 0..half {
        let inv_freq = 1.0 / (c.rope_theta as f64).powf((2 * i) as f64 / hd as f64);
        let angle = pos as f64 * inv_freq;
        let (s, co) = angle.sin_cos();
        let (a, b) = (x[i] as f64, x[i + half] as f64);
        out[i] = (a * co - b * s) as f32;
        out[i + half] = (b * co + a * s) as f32;
    }
    out
}

fn param<'a>(w: &'a WeightStore, name: &str) -> &'a [f32] {
    &w.get(name).unwrap_or_else(|| panic!("{name} missing")).data
}

fn row(w: &WeightStore, name: &str, r: usize, len: usize) -> Vec<f32> {
    param(w, name)[r * len..(r + 1) * len].to_vec()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    // Eight f32 lanes, summed in f64 at the end: vectorizes even in the test profile, and
    // accurate to ~1e-6 relative over these row lengths (well inside the tolerances).
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| *x as f64 * *y as f64).sum();
    acc.iter().map(|&v| v as f64).sum::<f64>() + tail
}

/// `W x` for a row-major `[out, in]` weight.
fn matvec(w: &WeightStore, name: &str, x: &[f32]) -> Vec<f32> {
    let t = w.get(name).unwrap_or_else(|| panic!("{name} missing"));
    let cols = t.shape[1];
    assert_eq!(cols, x.len(), "{name}");
    t.data
        .chunks_exact(cols)
        .map(|r| dot(r, x) as f32)
        .collect()
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter()
        .zip(weight)
        .map(|(v, g)| ((*v as f64 * inv) as f32) * g)
        .collect()
}

fn add(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Logits through the engine's paged forward ([`ferry_model::LlamaModel`]) for one sequence.
/// With `every_position`, the tokens go in one at a time (each step reads all earlier KV back
/// through the block table, as decode does) and every position's logits are returned; else
/// the whole prompt is one prefill step and only the last position's logits come back.
pub fn paged_logits(model: &LoadedModel, ids: &[u32], every_position: bool) -> Vec<Vec<f32>> {
    let mut llama = ferry_model::LlamaModel::new(&model.config, &model.weights).expect("model");
    paged_logits_of(&mut llama, ids, every_position)
}

/// [`paged_logits`] of a model already built.
pub fn paged_logits_of(
    llama: &mut ferry_model::LlamaModel,
    ids: &[u32],
    every_position: bool,
) -> Vec<Vec<f32>> {
    use ferry_core::{SampleSpec, SamplerSpec, ScheduledReq, StepPlan};

    const BLOCK_SIZE: usize = 4;
    let n_blocks = ids.len().div_ceil(BLOCK_SIZE);
    let layout = ferry_model::Executor::kv_layout(&*llama, BLOCK_SIZE);
    let mut kv = ferry_arena::KvArena::new(layout, n_blocks + 1);
    // Blocks in reverse order, so a forward that ignored the table would read the wrong KV.
    let table: Vec<ferry_core::BlockId> = (1..=n_blocks as u32)
        .rev()
        .map(ferry_core::BlockId)
        .collect();
    let chunks: Vec<std::ops::Range<usize>> = if every_position {
        (0..ids.len()).map(|p| p..p + 1).collect()
    } else {
        std::iter::once(0..ids.len()).collect()
    };
    let mut rows = Vec::new();
    for (step, chunk) in chunks.into_iter().enumerate() {
        let plan = StepPlan {
            step: step as u64,
            block_size: BLOCK_SIZE,
            reqs: vec![ScheduledReq {
                lora: None,
                req: ferry_core::ReqIdx(0),
                start_pos: chunk.start,
                tokens: 0..chunk.len(),
                blocks: 0..table.len(),
                sample: Some(SampleSpec {
                    params: SamplerSpec::default(),
                    output_idx: 0,
                    mask: None,
                    adjust: None,
                }),
            }],
            token_ids: ferry_core::TokenId::from_raw_slice(&ids[chunk]).to_vec(),
            block_tables: table.clone(),
            connector_work: Vec::new(),
            token_masks: Vec::new(),
            logits_adjusts: Vec::new(),
            prompt_logprobs: Vec::new(),
            routing_reads: Vec::new(),
        };
        let logits = llama.forward(&plan, &mut kv).expect("valid plan");
        rows.push(logits.row(0).to_vec());
    }
    rows
}
