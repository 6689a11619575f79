//! The scheduler driving the checksum model end to end: every generated token must equal the
//! checksum model's oracle computed from the tokens alone. Because the checksum model's next
//! token depends on every KV byte of the sequence, this proves that prefix-cache hits
//! (including hits on blocks scheduled earlier in the same step), chunked prefill and
//! preemption by recompute all hand the executor exactly the right KV.

use std::collections::BTreeMap;

use ferry_core::{SamplingParams, Scheduler, SchedulerConfig, TokenId};
use ferry_kv::KvArena;
use ferry_model::{ChecksumModel, Executor};

const VOCAB: usize = 1000;

type Workload = Vec<(String, Vec<TokenId>, u32)>;

struct Run {
    outputs: BTreeMap<String, Vec<TokenId>>,
    n_preemptions: u64,
    prefix_hit_tokens: u64,
}

/// A small deterministic generator (no RNG dependency needed for a fixed workload).
fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *state >> 33
}

fn workload(n: usize, seed: u64) -> Workload {
    let mut s = seed;
    let mut token = |s: &mut u64| (lcg(s) % VOCAB as u64) as TokenId;
    let shared: Vec<TokenId> = (0..40).map(|_| token(&mut s)).collect();
    (0..n)
        .map(|i| {
            let mut prompt = if i % 2 == 0 {
                shared.clone()
            } else {
                Vec::new()
            };
            let extra = 1 + lcg(&mut s) as usize % 30;
            prompt.extend((0..extra).map(|_| token(&mut s)));
            let max_tokens = 1 + (lcg(&mut s) % 12) as u32;
            (format!("r{i}"), prompt, max_tokens)
        })
        .collect()
}

fn run(config: SchedulerConfig, reqs: &Workload) -> Run {
    let mut model = ChecksumModel::new(config.weight_version.clone(), VOCAB).unwrap();
    let mut arena = KvArena::new(model.kv_layout(config.block_size), config.n_blocks as usize);
    let mut sched = Scheduler::new(config).unwrap();
    for (id, prompt, max_tokens) in reqs {
        sched
            .add_request(
                id.clone(),
                prompt.clone(),
                SamplingParams::greedy(*max_tokens),
            )
            .unwrap();
    }
    let mut outputs: BTreeMap<String, Vec<TokenId>> = BTreeMap::new();
    let mut ids = BTreeMap::new();
    for _ in 0..10_000 {
        if sched.n_live() == 0 {
            break;
        }
        let plan = sched.schedule();
        for r in &plan.reqs {
            ids.insert(r.req, sched.request(r.req).unwrap().id.clone());
        }
        let out = model.execute(&plan, &mut arena).unwrap();
        for o in sched.on_step_output(&plan, &out).unwrap() {
            if let Some(s) = &o.sampled {
                outputs
                    .entry(ids[&o.req].clone())
                    .or_default()
                    .push(s.token);
            }
        }
        sched.check_ownership().unwrap();
        sched.recycle_plan(plan);
    }
    assert_eq!(sched.n_live(), 0, "requests left unfinished");
    let stats = sched.stats();
    assert_eq!(stats.n_blocks_used, 0, "blocks still held after draining");
    Run {
        outputs,
        n_preemptions: stats.n_preemptions,
        prefix_hit_tokens: stats.prefix_hit_tokens,
    }
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
