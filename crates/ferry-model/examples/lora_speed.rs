//! Decode with LoRA adapters against the base alone, on random weights in SmolLM2-135M's
//! shape kept as Q8_0: `cargo run --release -p ferry-model --example lora_speed -- [STEPS]`
//! prints ms per decode step of batch 32 with no adapter and with 4 rank-16 adapters (8 rows
//! each, interleaved), and of batch 1 with no adapter and with one, for attention-only and
//! all-linear targets. Runs alternate, best of several rounds.

use std::sync::Arc;
use std::time::Instant;

use ferry_arena::KvArena;
use ferry_core::{
    BlockId, LoraId, ReqIdx, SampleSpec, SamplerSpec, ScheduledReq, StepPlan, TokenId,
};
use ferry_model::lora::random::{random_lora, RandomLora};
use ferry_model::random_model::{random_weights, smollm2_135m_config};
use ferry_model::{
    Executor, LlamaModel, LoraAdapter, StoredTensor, TargetModule, WeightDtype, WeightStore,
};

const BLOCK: usize = 16;
const PROMPT: usize = 32;

/// Mean seconds per decode step of `loras.len()` requests, each under its adapter, after a
/// prefill of `PROMPT` tokens.
fn decode_s(model: &mut LlamaModel, loras: &[Option<LoraId>], steps: usize) -> f64 {
    let n = loras.len();
    let per_seq = (PROMPT + steps).div_ceil(BLOCK);
    let mut kv = KvArena::new(model.kv_layout(BLOCK), n * per_seq + 1);
    let tables: Vec<Vec<BlockId>> = (0..n)
        .map(|i| {
            (0..per_seq)
                .map(|j| BlockId((1 + i * per_seq + j) as u32))
                .collect()
        })
        .collect();
    let sample = SampleSpec {
        params: SamplerSpec::default(),
        output_idx: 0,
        mask: None,
        adjust: None,
    };
    let plan = |start: usize, len: usize, tokens: &[TokenId]| {
        let mut plan = StepPlan {
            block_size: BLOCK,
            ..StepPlan::default()
        };
        for (i, (table, &lora)) in tables.iter().zip(loras).enumerate() {
            let t0 = plan.token_ids.len();
            plan.token_ids
                .extend((0..len).map(|k| TokenId(((i * 31 + start + k) * 7 % 4000) as u32 + 5)));
            if len == 1 {
                plan.token_ids[t0] = tokens[i];
            }
            let b0 = plan.block_tables.len();
            plan.block_tables.extend(table);
            plan.reqs.push(ScheduledReq {
                req: ReqIdx(i as u32),
                start_pos: start,
                tokens: t0..plan.token_ids.len(),
                blocks: b0..plan.block_tables.len(),
                sample: Some(sample),
                lora,
            });
        }
        plan
    };
    let mut tokens = vec![TokenId(5); n];
    let out = model.execute(&plan(0, PROMPT, &tokens), &mut kv).unwrap();
    tokens = out.sampled.iter().map(|s| s.token).collect();
    let t = Instant::now();
    for s in 0..steps {
        let out = model
            .execute(&plan(PROMPT + s, 1, &tokens), &mut kv)
            .unwrap();
        tokens = out.sampled.iter().map(|s| s.token).collect();
    }
    t.elapsed().as_secs_f64() / steps as f64
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .map_or(16, |s| s.parse().expect("STEPS"));
    let config = smollm2_135m_config();
    let f32s = random_weights(&config, 1);
    let mut store = WeightStore::default();
    for (name, t) in &f32s.tensors {
        if t.shape.len() == 2 {
            let q = StoredTensor::quantized(t.shape.clone(), WeightDtype::Q8_0, &t.data);
            store.insert_stored(name.clone(), q);
        } else {
            store.insert(name.clone(), t.clone());
        }
    }
    drop(f32s);
    let mut model = LlamaModel::new(&config, &store).unwrap();
    drop(store);
    let attention = [
        TargetModule::QProj,
        TargetModule::KProj,
        TargetModule::VProj,
        TargetModule::OProj,
    ];
    for (what, targets) in [
        ("attention", &attention[..]),
        ("all-linear", &TargetModule::ALL[..]),
    ] {
        for i in 0..4u32 {
            let spec = RandomLora {
                rank: 16,
                alpha: 32.0,
                targets: targets.to_vec(),
                use_rslora: false,
                seed: u64::from(i),
            };
            let (c, tensors) = random_lora(&config, &spec);
            let a = LoraAdapter::from_f32(c, &tensors, &config, 64).unwrap();
            model.load_lora(LoraId(i), Arc::new(a)).unwrap();
        }
        let base32 = vec![None; 32];
        let mixed32: Vec<_> = (0..32).map(|i| Some(LoraId(i % 4))).collect();
        let (mut b32, mut l32, mut b1, mut l1) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..3 {
            b32 = b32.min(decode_s(&mut model, &base32, steps));
            l32 = l32.min(decode_s(&mut model, &mixed32, steps));
            b1 = b1.min(decode_s(&mut model, &[None], steps));
            l1 = l1.min(decode_s(&mut model, &[Some(LoraId(0))], steps));
        }
        println!(
            "{what}, rank 16: batch 32 base {:.2} ms/step, 4 adapters mixed {:.2} ({:.2}x); \
             batch 1 base {:.2} ms, with an adapter {:.2} ({:.2}x)",
            b32 * 1e3,
            l32 * 1e3,
            b32 / l32,
            b1 * 1e3,
            l1 * 1e3,
            b1 / l1
        );
    }
}
