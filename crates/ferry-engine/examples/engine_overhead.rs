//! Measures the engine's overhead outside the model forward: N concurrent greedy requests
//! through `ferry_engine`, then `1 - forward / step` from the published stats, as JSON.
//!
//! `cargo run --release -p ferry-engine --example engine_overhead -- MODEL CONCURRENCY
//! PROMPT_LEN OUTPUT_LEN` where MODEL is `tiny` or a model folder / GGUF file.

use std::path::Path;
use std::time::Instant;

use ferry_core::{SamplingParams, SchedulerConfig, TokenId};
use ferry_engine::{spawn, EngineConfig, GenerateRequest};
use ferry_model::{load_model, tiny::tiny_model, LlamaModel};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let model_arg = arg(0, "tiny");
    let concurrency: usize = arg(1, "64").parse()?;
    let prompt_len: usize = arg(2, "64").parse()?;
    let output_len: u32 = arg(3, "64").parse()?;

    let loaded = if model_arg == "tiny" {
        tiny_model()
    } else {
        load_model(Path::new(&model_arg))?
    };
    let model = LlamaModel::new(&loaded.config, &loaded.weights)?;
    let vocab = loaded.config.vocab_size as u32;
    let block_size = 16;
    let per_request = (prompt_len + output_len as usize).div_ceil(block_size) + 1;
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            block_size,
            n_blocks: (per_request * concurrency + 1) as u32,
            max_num_seqs: concurrency,
            max_model_len: prompt_len + output_len as usize + 1,
            ..SchedulerConfig::default()
        },
        input_queue_capacity: 4096,
        lora: None,
    };
    let tokenizer = loaded.tokenizer.map(std::sync::Arc::new);
    let engine = spawn(config, Box::new(model), tokenizer.clone())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()?;
    let started = Instant::now();
    let n_tokens = rt.block_on(async {
        let mut tasks = Vec::new();
        for i in 0..concurrency {
            // Distinct prompts: no prefix sharing, so every request prefills in full.
            let prompt = (0..prompt_len)
                .map(|j| TokenId(((i * 7919 + j * 31 + 1) as u32) % vocab))
                .collect();
            let req = GenerateRequest {
                request_id: format!("r{i}"),
                prompt,
                params: SamplingParams::greedy(output_len),
                stop: vec![],
                detokenize: tokenizer.is_some(),
                transfer: None,
                constraint: None,
                ..GenerateRequest::default()
            };
            let mut stream = engine.generate(req).await?;
            tasks.push(tokio::spawn(async move {
                let mut n = 0;
                while let Some(chunk) = stream.next().await {
                    n += chunk.token_ids.len();
                }
                n
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await?;
        }
        Ok::<usize, Box<dyn std::error::Error>>(n)
    })?;
    let wall = started.elapsed().as_secs_f64();
    // The last step's stats are published just after its outputs are sent.
    rt.block_on(engine.wait_idle())?;
    let stats = engine.stats();
    rt.block_on(engine.shutdown())?;
    println!(
        "{{\"model\": {model_arg:?}, \"concurrency\": {concurrency}, \"prompt_len\": {prompt_len}, \
         \"output_len\": {output_len}, \"n_steps\": {}, \"output_tokens\": {n_tokens}, \
         \"wall_s\": {wall:.3}, \"output_tok_per_s\": {:.1}, \"step_s_total\": {:.4}, \
         \"forward_s_total\": {:.4}, \"overhead_fraction\": {:.4}, \"overhead_us_per_step\": {:.1}}}",
        stats.n_steps,
        n_tokens as f64 / wall,
        stats.step_seconds_total,
        stats.forward_seconds_total,
        1.0 - stats.forward_seconds_total / stats.step_seconds_total,
        (stats.step_seconds_total - stats.forward_seconds_total) / stats.n_steps as f64 * 1e6,
    );
    Ok(())
}
