//! What a weight update costs on each thread, for the SmolLM2-135M shape with random
//! weights: preparing (off the engine thread), installing (on it), retiring and sleeping.
//! Prints one JSON object; times in milliseconds.
//!
//! `cargo run --release -p ferry-model --example weight_update_cost`

use std::time::Instant;

use ferry_model::random_model::{random_weights, smollm2_135m_config};
use ferry_model::{Executor, LlamaModel, WeightStore};

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = smollm2_135m_config();
    let store = random_weights(&config, 1);
    let mut model = LlamaModel::new(&config, &store)?;
    let preparer = model.weight_ops().preparer();

    let pushed = random_weights(&config, 2);
    let t = Instant::now();
    let full = preparer.prepare(pushed)?;
    let full_mb = full.n_bytes as f64 / 1e6;
    let prepare_full_ms = ms(t);
    let t = Instant::now();
    let retired = model.weight_ops_mut().install(full)?;
    let install_full_ms = ms(t);
    let t = Instant::now();
    drop(retired);
    let retire_full_ms = ms(t);

    // One layer's q_proj (the smallest useful partial push).
    let name = "model.layers.7.self_attn.q_proj.weight";
    let mut one = WeightStore::default();
    one.insert(name, store.get(name).ok_or("no q_proj")?.clone());
    let t = Instant::now();
    let one = preparer.prepare(one)?;
    let prepare_one_ms = ms(t);
    let one_mb = one.n_bytes as f64 / 1e6;
    let t = Instant::now();
    model.weight_ops_mut().install(one)?;
    let install_one_ms = ms(t);

    // Every layer tensor (all but the embedding table): a patch as large as it gets.
    let mut layers = store.clone();
    layers.tensors.remove("model.embed_tokens.weight");
    let t = Instant::now();
    let layers = preparer.prepare(layers)?;
    let prepare_layers_ms = ms(t);
    let layers_mb = layers.n_bytes as f64 / 1e6;
    let t = Instant::now();
    model.weight_ops_mut().install(layers)?;
    let install_layers_ms = ms(t);

    let t = Instant::now();
    drop(model.weight_ops_mut().drop_weights());
    let drop_weights_ms = ms(t);

    let report = serde_json::json!({
        "model": "smollm2-135m shape, random f32",
        "complete": { "mb": full_mb, "prepare_ms": prepare_full_ms,
                      "install_ms": install_full_ms, "retire_ms": retire_full_ms },
        "partial_one_q_proj": { "mb": one_mb, "prepare_ms": prepare_one_ms,
                                "install_ms": install_one_ms },
        "partial_all_layers": { "mb": layers_mb, "prepare_ms": prepare_layers_ms,
                                "install_ms": install_layers_ms },
        "sleep2_drop_weights_ms": drop_weights_ms,
    });
    println!("{report}");
    Ok(())
}
