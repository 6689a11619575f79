//! `ferry bench lora`: decode and prefill with LoRA adapters against the base model alone, in
//! one process. Every batch size runs twice over the same requests, once on the base and once
//! with its requests spread over `--adapters` random adapters (request `i` under adapter
//! `i mod n`), the two runs' steps interleaved one by one in alternating order (as `ferry
//! bench model --routed-experts-cost`), so both meet the same host. The report is `ferry
//! bench model`'s, with `lora_cost`: per batch size, the rates under adapters over the base's.

use std::sync::Arc;

use anyhow::Context;
use ferry_core::LoraId;
use ferry_model::lora::random::{random_lora, RandomLora};
use ferry_model::{Executor, LoraAdapter, TargetModule};

use crate::model;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A model file or folder, or `tiny` (default: random weights in SmolLM2-135M's shape).
    #[arg(long)]
    model: Option<String>,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    batch: Vec<usize>,
    /// Adapters a batch's requests are spread over (one at batch 1).
    #[arg(long, default_value_t = 4)]
    adapters: usize,
    /// Every adapter's rank.
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// The modules adapted in every layer, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj"
    )]
    targets: Vec<String>,
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let out = measure(&args, model::BANDWIDTH_BYTES)?;
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

fn measure(args: &Args, bandwidth_bytes: usize) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(args.adapters > 0, "--adapters must be at least 1");
    anyhow::ensure!(args.rank > 0, "--rank must be at least 1");
    let targets = args
        .targets
        .iter()
        .map(|t| {
            TargetModule::from_name(t).with_context(|| {
                format!("--targets: `{t}` is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let model_args = model::Args {
        model: args.model.clone(),
        random: args.model.is_none().then(|| "smollm2-135m".to_owned()),
        batch: args.batch.clone(),
        prompt_len: args.prompt_len,
        decode_steps: args.decode_steps,
        prefill_chunk: 2048,
        json: true,
        routed_experts_cost: false,
        lora_adapters: args.adapters,
    };
    let mut out = model::measure_with(&model_args, bandwidth_bytes, |model, config| {
        for i in 0..args.adapters {
            let spec = RandomLora {
                rank: args.rank,
                alpha: 2.0 * args.rank as f64,
                targets: targets.clone(),
                use_rslora: false,
                seed: i as u64,
            };
            let (c, tensors) = random_lora(config, &spec);
            let adapter = LoraAdapter::from_f32(c, &tensors, config, args.rank)
                .context("building a random adapter")?;
            model.load_lora(LoraId(i as u32), Arc::new(adapter))?;
        }
        Ok(())
    })?;
    out["lora"] = serde_json::json!({
        "adapters": args.adapters,
        "rank": args.rank,
        "targets": args.targets,
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each batch size runs on the base and under the adapters (at batch 3 with 2 adapters,
    /// both; at batch 1, one), and the report has each pair's ratios.
    #[test]
    fn reports_each_batch_on_the_base_and_under_adapters() {
        let args = Args {
            model: Some("tiny".into()),
            batch: vec![1, 3],
            adapters: 2,
            rank: 4,
            targets: vec!["q_proj".into(), "down_proj".into()],
            prompt_len: 5,
            decode_steps: 2,
            json: true,
        };
        let out = measure(&args, 1 << 20).unwrap();
        let results = out["results"].as_array().unwrap();
        let shape: Vec<_> = results
            .iter()
            .map(|r| {
                (
                    r["batch"].as_u64().unwrap(),
                    r["lora_adapters"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(shape, [(1, 0), (1, 1), (3, 0), (3, 2)]);
        let cost = out["lora_cost"].as_array().unwrap();
        assert_eq!(cost.len(), 2);
        assert!(cost
            .iter()
            .all(|c| c["decode_tok_s_ratio"].as_f64().unwrap() > 0.0));
        let bad = Args {
            targets: vec!["lm_head".into()],
            ..args
        };
        let err = measure(&bad, 1 << 20).unwrap_err();
        assert!(err.to_string().contains("--targets"), "{err}");
    }
}
