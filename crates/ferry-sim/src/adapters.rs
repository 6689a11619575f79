//! The simulation's LoRA adapters: their weights drawn from (name, version) alone, so every
//! engine and the oracle agree on what a pair means.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_model::lora::random::{random_lora, RandomLora};
use ferry_model::{LoraAdapter, TargetModule};

/// The rank of the simulation's adapters (and the engines' `--max-lora-rank`).
pub const LORA_RANK: usize = 1;

/// The weights of the LoRA adapter `name` at `version`: a small random adapter over the tiny
/// model's config, drawn from the name and the version alone. So a (name, version) pair names
/// one set of weights on every engine, as the contract asks of whoever loads adapters (KV
/// exported under the pair is another engine's to take), and a new version has new weights,
/// whose seed the checksum model mixes in: KV of an older version, or of another adapter,
/// shows as wrong tokens. Built once per thread.
pub fn adapter(name: &str, version: u64) -> Arc<LoraAdapter> {
    thread_local! {
        static BUILT: std::cell::RefCell<BTreeMap<(String, u64), Arc<LoraAdapter>>> =
            std::cell::RefCell::default();
    }
    BUILT.with(|built| {
        built
            .borrow_mut()
            .entry((name.to_owned(), version))
            .or_insert_with(|| {
                let base = ferry_model::tiny::tiny_config();
                let seed = name.bytes().fold(0xCBF2_9CE4_8422_2325_u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
                }) ^ version.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let spec = RandomLora {
                    rank: LORA_RANK,
                    alpha: 2.0,
                    targets: vec![TargetModule::QProj],
                    use_rslora: false,
                    seed,
                };
                let (config, tensors) = random_lora(&base, &spec);
                Arc::new(
                    LoraAdapter::from_f32(config, &tensors, &base, LORA_RANK)
                        .expect("the simulation's adapter fits the tiny model"),
                )
            })
            .clone()
    })
}
