//! The scheduler driving the real model (the built-in `tiny` Llama): with greedy sampling a
//! request's tokens must not depend on what else runs beside it. Every request run alone, in
//! a fresh engine, must give exactly the tokens it gets in a crowded engine with prefix-cache
//! hits, chunked prefill and preemption by recompute. This holds bit for bit only because the
//! forward is batch invariant and a prefix hit or a recompute hands back exactly the KV the
//! request would have computed itself.

mod engine_support;

use engine_support::{run, workload};
use ferry_core::SchedulerConfig;
use ferry_model::{tiny::tiny_model, LlamaModel};

fn model() -> LlamaModel {
    let tiny = tiny_model();
    LlamaModel::new(&tiny.config, &tiny.weights).unwrap()
}

#[test]
fn tokens_in_a_crowded_engine_equal_tokens_alone() {
    let vocab = tiny_model().config.vocab_size;
    let reqs = workload(24, 5, vocab, 21);
    let crowded = SchedulerConfig {
        block_size: 4,
        // Too few blocks for 8 running requests of ~60 tokens: forces preemption.
        n_blocks: 48,
        max_num_seqs: 8,
        max_num_batched_tokens: 32,
        max_model_len: 256,
        ..SchedulerConfig::default()
    };
    let together = run(&mut model(), crowded.clone(), &reqs);
    assert!(together.prefix_hit_tokens > 0, "expected prefix-cache hits");
    assert!(together.n_preemptions > 0, "expected preemptions");

    let alone_config = SchedulerConfig {
        n_blocks: 256,
        max_num_batched_tokens: 4096,
        enable_prefix_caching: false,
        ..crowded
    };
    for req in &reqs {
        let alone = run(&mut model(), alone_config.clone(), &vec![req.clone()]);
        let (id, _, max_tokens) = req;
        assert_eq!(alone.outputs[id].len(), *max_tokens as usize);
        assert_eq!(
            together.outputs[id], alone.outputs[id],
            "{id}: tokens differ between the crowded engine and a run alone"
        );
    }
}

/// Tokens of one unseeded request sampled at temperature 1 by a model whose engine RNG has
/// `engine_seed`.
fn sampled_tokens(engine_seed: u64) -> Vec<ferry_core::TokenId> {
    use ferry_core::{SamplingParams, Scheduler, StepDriver};
    let config = SchedulerConfig::default();
    let model = ferry_model::ExecutorModel::new(model().with_sampler_seed(engine_seed), &config);
    let mut driver = StepDriver::new(Scheduler::new(config).unwrap(), model);
    let mut params = SamplingParams::greedy(24);
    params.sampler.temperature = 1.0;
    driver
        .sched
        .add_request("r", ferry_core::TokenId::list([1, 2, 3]), params)
        .unwrap();
    let mut tokens = Vec::new();
    driver
        .drain(usize::MAX, |_, step| {
            tokens.extend(
                step.outputs
                    .iter()
                    .filter_map(|o| o.sampled.as_ref().map(|s| s.token)),
            );
        })
        .unwrap();
    tokens
}

#[test]
fn the_engine_seed_makes_unseeded_sampling_reproducible() {
    let a = sampled_tokens(7);
    assert_eq!(a.len(), 24);
    assert_eq!(a, sampled_tokens(7), "same engine seed, different tokens");
    assert_ne!(
        a,
        sampled_tokens(8),
        "different engine seeds drew the same 24 tokens"
    );
}
