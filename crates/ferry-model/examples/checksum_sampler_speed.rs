//! Timing of the checksum model and the sampler, one JSON object per line.
//!
//! `cargo run --release -p ferry-model --example checksum_sampler_speed`
//!
//! A stand-in until `ferry bench model` can drive these; wall-clock figures, so run it on a
//! quiet machine.

use std::error::Error;
use std::time::{Duration, Instant};

use ferry_arena::KvArena;
use ferry_core::sampling::SamplerSpec;
use ferry_core::{BlockId, ReqIdx, SampleSpec, ScheduledReq, StepPlan, TokenId};
use ferry_model::sampler::{sample, SamplerScratch};
use ferry_model::{ChecksumModel, Executor};

const VOCAB: usize = 49_152;
const BLOCK_SIZE: usize = 16;
const N_REQS: usize = 64;
const SEQ_LEN: usize = 1024;

fn spec(temperature: f32, top_k: u32, top_p: f32, min_p: f32, logprobs: Option<u32>) -> SampleSpec {
    SampleSpec {
        params: SamplerSpec {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(1),
            seed_stream: 0,
            logprobs,
        },
        output_idx: 0,
        mask: None,
        adjust: None,
    }
}

/// `N_REQS` requests of `SEQ_LEN` tokens each, prefilled in one step, each sampling.
fn prefill_plan() -> StepPlan {
    let blocks_per_req = SEQ_LEN / BLOCK_SIZE;
    let mut plan = StepPlan {
        block_size: BLOCK_SIZE,
        ..StepPlan::default()
    };
    for r in 0..N_REQS {
        let (t0, b0) = (plan.token_ids.len(), plan.block_tables.len());
        plan.token_ids
            .extend((0..SEQ_LEN).map(|i| TokenId(((i * 31 + r) % VOCAB) as u32)));
        plan.block_tables
            .extend((0..blocks_per_req).map(|j| BlockId((1 + r * blocks_per_req + j) as u32)));
        plan.reqs.push(ScheduledReq {
            lora: None,
            req: ReqIdx(r as u32),
            start_pos: 0,
            tokens: t0..t0 + SEQ_LEN,
            blocks: b0..b0 + blocks_per_req,
            sample: Some(spec(0.0, 0, 1.0, 0.0, None)),
        });
    }
    plan
}

fn per(d: Duration, n: usize) -> f64 {
    d.as_nanos() as f64 / n as f64
}

fn checksum() -> Result<(), Box<dyn Error>> {
    let mut model = ChecksumModel::new("v1", VOCAB)?;
    let mut kv = KvArena::new(
        model.kv_layout(BLOCK_SIZE),
        1 + N_REQS * SEQ_LEN / BLOCK_SIZE,
    );
    let plan = prefill_plan();
    let start = Instant::now();
    model.execute(&plan, &mut kv)?;
    let prefill = start.elapsed();
    // A decode step: the last token of every request again, each sampling over its context.
    let mut decode = plan.clone();
    for r in &mut decode.reqs {
        r.start_pos = SEQ_LEN - 1;
        r.tokens = r.tokens.end - 1..r.tokens.end;
    }
    let steps = 50;
    let start = Instant::now();
    for _ in 0..steps {
        model.execute(&decode, &mut kv)?;
    }
    let step = start.elapsed() / steps;
    let positions = N_REQS * SEQ_LEN;
    println!(
        "{}",
        serde_json::json!({
            "bench": "checksum", "n_reqs": N_REQS, "seq_len": SEQ_LEN,
            "prefill_ns_per_token": per(prefill, positions),
            "decode_step_us": step.as_secs_f64() * 1e6,
            "decode_ns_per_context_position": per(step, positions),
        })
    );
    Ok(())
}

fn sampler() {
    // Deterministic, roughly uniform logits in [-4, 4): a flat distribution is the slow case
    // for top-p (a large nucleus).
    let logits: Vec<f32> = (0..VOCAB as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0 * 8.0 - 4.0)
        .collect();
    let mut scratch = SamplerScratch::with_seed(0);
    let cases = [
        ("greedy", spec(0.0, 0, 1.0, 0.0, None)),
        ("greedy_logprobs5", spec(0.0, 0, 1.0, 0.0, Some(5))),
        ("temperature1", spec(1.0, 0, 1.0, 0.0, None)),
        ("top_k50", spec(1.0, 50, 1.0, 0.0, None)),
        ("top_p0.9", spec(1.0, 0, 0.9, 0.0, None)),
        ("min_p0.1", spec(1.0, 0, 1.0, 0.1, None)),
        (
            "k50_p0.9_minp0.05_logprobs5",
            spec(0.8, 50, 0.9, 0.05, Some(5)),
        ),
    ];
    for (name, s) in cases {
        let n = 500;
        let start = Instant::now();
        for i in 0..n {
            let s = SampleSpec { output_idx: i, ..s };
            std::hint::black_box(sample(&logits, &s, ReqIdx(0), &mut scratch));
        }
        println!(
            "{}",
            serde_json::json!({
                "bench": "sampler", "case": name, "vocab": VOCAB,
                "us_per_token": per(start.elapsed(), n as usize) / 1e3,
            })
        );
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    checksum()?;
    sampler();
    Ok(())
}
