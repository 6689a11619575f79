//! Shared by the scheduler-driven tests: a deterministic workload and a run of it through the
//! core's step driver with a real executor (block ownership checked in every step).

#![allow(dead_code)] // each test binary uses a different subset

use std::collections::BTreeMap;

use ferry_core::{SamplingParams, Scheduler, SchedulerConfig, StepDriver, TokenId};
use ferry_model::{Executor, ExecutorModel};

/// `(request id, prompt, max_tokens)` per request, in arrival order.
pub type Workload = Vec<(String, Vec<TokenId>, u32)>;

pub struct Run {
    pub outputs: BTreeMap<String, Vec<TokenId>>,
    pub n_preemptions: u64,
    pub prefix_hit_tokens: u64,
}

/// A small deterministic generator (no RNG dependency needed for a fixed workload).
fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *state >> 33
}

/// `n` requests; every other one starts with the same `shared_len`-token prefix, then 1..=30
/// tokens of its own; each asks for 1..=12 tokens.
pub fn workload(n: usize, seed: u64, vocab: usize, shared_len: usize) -> Workload {
    let mut s = seed;
    let token = |s: &mut u64| TokenId((lcg(s) % vocab as u64) as u32);
    let shared: Vec<TokenId> = (0..shared_len).map(|_| token(&mut s)).collect();
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

/// Runs every request of `reqs` to completion (greedy) through a scheduler built from
/// `config` and `model`, block ownership and queues checked in every step; asserts nothing is
/// left running and every block is free at the end.
pub fn run(model: impl Executor, config: SchedulerConfig, reqs: &Workload) -> Run {
    let model = ExecutorModel::new(model, &config);
    let mut driver = StepDriver::new(Scheduler::new(config).unwrap(), model).checked();
    for (id, prompt, max_tokens) in reqs {
        driver
            .sched
            .add_request(
                id.clone(),
                prompt.clone(),
                SamplingParams::greedy(*max_tokens),
            )
            .unwrap();
    }
    let mut outputs: BTreeMap<String, Vec<TokenId>> = BTreeMap::new();
    let drained = driver.drain(10_000, |sched, step| {
        for o in &step.outputs {
            if let Some(s) = &o.sampled {
                // A finished request is gone from the core; its output names it.
                let id = o.finished.as_ref().map_or_else(
                    || sched.request(o.req).unwrap().id.clone(),
                    |f| f.request_id.clone(),
                );
                outputs.entry(id).or_default().push(s.token);
            }
        }
    });
    drained.expect("requests left unfinished");
    let stats = driver.sched.stats();
    assert_eq!(stats.n_blocks_used, 0, "blocks still held after draining");
    Run {
        outputs,
        n_preemptions: stats.n_preemptions,
        prefix_hit_tokens: stats.prefix_hit_tokens,
    }
}
