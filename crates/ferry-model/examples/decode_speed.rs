//! Batch-1 decode time of a model file kept in its stored precision: `cargo run --release
//! -p ferry-model --example decode_speed -- MODEL.gguf [STEPS]` prints ms per step (wall and
//! this process's CPU), for quick A/B checks of the kernels without building the binary.

use std::time::Instant;

use ferry_arena::KvArena;
use ferry_core::{BlockId, ReqIdx, SampleSpec, SamplerSpec, ScheduledReq, StepPlan, TokenId};
use ferry_model::{load_model_stored, Executor, LlamaModel};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: decode_speed MODEL [STEPS]")?;
    let steps: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let loaded = load_model_stored(std::path::Path::new(path))?;
    let mut model = LlamaModel::new(&loaded.config, &loaded.weights)?;
    drop(loaded);
    let block_size = 16;
    let n_blocks = (steps + 1).div_ceil(block_size);
    let mut kv = KvArena::new(model.kv_layout(block_size), n_blocks + 1);
    let table: Vec<BlockId> = (1..=n_blocks as u32).map(BlockId).collect();
    let mut token = TokenId(1);
    let (mut wall, mut best) = (0.0f64, f64::INFINITY);
    for pos in 0..steps {
        let plan = StepPlan {
            block_size,
            reqs: vec![ScheduledReq {
                lora: None,
                req: ReqIdx(0),
                start_pos: pos,
                tokens: 0..1,
                blocks: 0..table.len(),
                sample: Some(SampleSpec {
                    params: SamplerSpec::default(),
                    output_idx: 0,
                    mask: None,
                    adjust: None,
                }),
            }],
            token_ids: vec![token],
            block_tables: table.clone(),
            ..StepPlan::default()
        };
        let t = Instant::now();
        let out = model.execute(&plan, &mut kv)?;
        let s = t.elapsed().as_secs_f64();
        wall += s;
        best = best.min(s);
        token = out.sampled[0].token;
    }
    println!(
        "{path}: {:.2} ms/step mean, {:.2} best, {:.1} tok/s",
        wall * 1e3 / steps as f64,
        best * 1e3,
        steps as f64 / wall
    );
    Ok(())
}
