//! The scheduler driving the checksum model end to end: every generated token must equal the
//! checksum model's oracle computed from the tokens alone. Because the checksum model's next
//! token depends on every KV byte of the sequence, this proves that prefix-cache hits
//! (including hits on blocks scheduled earlier in the same step), chunked prefill and
//! preemption by recompute all hand the executor exactly the right KV.

mod engine_support;

use engine_support::{Run, Workload};
use ferry_core::SchedulerConfig;
use ferry_model::ChecksumModel;

const VOCAB: usize = 1000;

fn workload(n: usize, seed: u64) -> Workload {
    engine_support::workload(n, seed, VOCAB, 40)
}

fn run(config: SchedulerConfig, reqs: &Workload) -> Run {
    let mut model = ChecksumModel::new(config.weight_version.clone(), VOCAB).unwrap();
    engine_support::run(&mut model, config, reqs)
}

fn assert_matches_oracle(run: &Run, reqs: &Workload) {
    let oracle = ChecksumModel::new("0", VOCAB).unwrap();
    for (id, prompt, max_tokens) in reqs {
        let got = &run.outputs[id];
        assert_eq!(
            got.len(),
            *max_tokens as usize,
            "{id}: wrong number of tokens"
        );
        let mut seq = prompt.clone();
        for (i, &tok) in got.iter().enumerate() {
            let want = oracle.reference_next_token(&seq);
            assert_eq!(tok, want, "{id}: token {i} differs from the oracle");
            seq.push(tok);
        }
    }
}

fn small_config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        n_blocks: 512,
        max_num_seqs: 8,
        max_num_batched_tokens: 24,
        max_model_len: 256,
        ..SchedulerConfig::default()
    }
}

#[test]
fn prefix_hits_and_chunked_prefill_give_the_oracle_tokens() {
    let reqs = workload(40, 7);
    let run = run(small_config(), &reqs);
    assert!(
        run.prefix_hit_tokens > 0,
        "the workload shares prefixes: expected hits"
    );
    assert_matches_oracle(&run, &reqs);
}

#[test]
fn preemption_by_recompute_gives_the_oracle_tokens() {
    let reqs = workload(40, 11);
    // Too few blocks for 8 running requests: forces preemption.
    let config = SchedulerConfig {
        n_blocks: 40,
        max_num_batched_tokens: 64,
        ..small_config()
    };
    let run = run(config, &reqs);
    assert!(
        run.n_preemptions > 0,
        "expected the small pool to force preemptions"
    );
    assert_matches_oracle(&run, &reqs);
}

#[test]
fn same_step_prefix_hits_without_chunking_give_the_oracle_tokens() {
    let reqs = workload(24, 3);
    let config = SchedulerConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 4096,
        enable_chunked_prefill: false,
        ..small_config()
    };
    let run = run(config, &reqs);
    assert!(run.prefix_hit_tokens > 0);
    assert_matches_oracle(&run, &reqs);
}
