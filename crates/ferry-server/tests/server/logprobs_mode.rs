//! `--logprobs-mode` end to end on the tiny model: one engine per mode, the same seeded chat
//! request with every filter on and the whole vocabulary as top logprobs; each mode's values
//! must equal a reference computed from the `raw_logits` engine's logits.

use ferry_engine::LogprobsMode;
use serde_json::{json, Value};

use crate::support::{start, Options};

const TEMPERATURE: f64 = 0.8;
const TOP_K: usize = 12;
const TOP_P: f64 = 0.9;
const MIN_P: f64 = 0.05;
/// What a filtered token's `-inf` is clamped to on the wire (as vLLM does).
const MASKED: f64 = -9999.0;

/// The request's `logprobs.content`, from an engine in `mode`.
async fn content(mode: LogprobsMode) -> Vec<Value> {
    let s = start(Options {
        logprobs_mode: mode,
        max_top_logprobs: Some(1000),
        ..Options::default()
    })
    .await;
    let body = json!({
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_completion_tokens": 6, "ignore_eos": true, "seed": 5,
        "temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P,
        "logprobs": true, "top_logprobs": 1000,
    });
    let out = s.ok("/v1/chat/completions", &body).await;
    out["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone()
}

fn values(entries: &Value) -> Vec<f64> {
    entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["logprob"].as_f64().unwrap())
        .collect()
}

fn lse(xs: impl Iterator<Item = f64>) -> f64 {
    let xs: Vec<f64> = xs.collect();
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + xs.iter().map(|x| (x - max).exp()).sum::<f64>().ln()
}

/// How many of `logits` (best first) survive top-k, then top-p, then min-p.
fn n_survivors(logits: &[f64]) -> usize {
    let probs: Vec<f64> = logits
        .iter()
        .map(|l| ((l - logits[0]) / TEMPERATURE).exp())
        .collect();
    let mut n = TOP_K.min(logits.len());
    let total: f64 = probs[..n].iter().sum();
    let mut mass = 0.0;
    for (j, p) in probs[..n].iter().enumerate() {
        mass += p;
        if mass >= TOP_P * total {
            n = j + 1;
            break;
        }
    }
    probs[..n].iter().take_while(|&&p| p >= MIN_P).count()
}

/// What `mode` reports at each position of the raw-order list, from the raw logits.
fn reference(mode: LogprobsMode, logits: &[f64]) -> Vec<f64> {
    let n = n_survivors(logits);
    let raw_lse = lse(logits.iter().copied());
    let processed_lse = lse(logits[..n].iter().map(|l| l / TEMPERATURE));
    logits
        .iter()
        .enumerate()
        .map(|(j, &l)| match mode {
            LogprobsMode::RawLogits => l,
            LogprobsMode::RawLogprobs => l - raw_lse,
            _ if j >= n => MASKED,
            LogprobsMode::ProcessedLogits => l / TEMPERATURE,
            LogprobsMode::ProcessedLogprobs => l / TEMPERATURE - processed_lse,
        })
        .collect()
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() < 1e-4, "{what}: {got} vs {want}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_logprobs_mode_matches_a_reference_from_the_raw_logits() {
    let raw = content(LogprobsMode::RawLogits).await;
    assert_eq!(raw.len(), 6);
    let mut n_masked = 0;
    for mode in LogprobsMode::ALL {
        let got = content(mode).await;
        assert_eq!(got.len(), raw.len(), "{mode}");
        for (pos, (r, g)) in raw.iter().zip(&got).enumerate() {
            // The mode changes what is reported, never what is sampled or the order.
            assert_eq!(g["token"], r["token"], "{mode} token {pos}");
            let tokens = |e: &Value| -> Vec<Value> {
                e["top_logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t["bytes"].clone())
                    .collect()
            };
            assert_eq!(tokens(g), tokens(r), "{mode} order at token {pos}");
            let logits = values(&r["top_logprobs"]);
            let want = reference(mode, &logits);
            let have = values(&g["top_logprobs"]);
            assert_eq!(have.len(), want.len());
            for (j, (h, w)) in have.iter().zip(&want).enumerate() {
                assert_close(*h, *w, &format!("{mode} token {pos} top {j}"));
            }
            // The sampled token's own value is its entry's in the list.
            let sampled_logit = r["logprob"].as_f64().unwrap();
            let j = r["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .position(|t| t["token"] == r["token"] && t["logprob"] == sampled_logit)
                .unwrap();
            assert!(j < n_survivors(&logits), "sampled a filtered token");
            assert_close(
                g["logprob"].as_f64().unwrap(),
                want[j],
                &format!("{mode} {pos}"),
            );
            n_masked += want.iter().filter(|&&w| w == MASKED).count();
        }
    }
    // The filters bit: processed modes masked most of the vocabulary.
    assert!(n_masked > 2 * 6 * 200, "{n_masked}");
}
