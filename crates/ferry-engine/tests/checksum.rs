//! The engine with the checksum model: exact token streams under concurrency, aborts,
//! ordering, overload, failures and shutdown.

mod support;

use std::collections::BTreeMap;

use ferry_core::{FinishReason, SamplingParams, TokenId};
use ferry_engine::{EngineHandle, GenerateRequest};
use support::*;

fn request(id: &str, prompt: Vec<TokenId>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_owned(),
        prompt,
        params: SamplingParams::greedy(max_tokens),
        ..GenerateRequest::default()
    }
}

/// `n` requests, every other one sharing a 10-token prefix.
fn workload(n: usize) -> Vec<(String, Vec<TokenId>, u32)> {
    (0..n)
        .map(|i| {
            let mut prompt: Vec<TokenId> = if i % 2 == 0 {
                (1..=10).collect()
            } else {
                vec![]
            };
            prompt.extend((0..1 + i % 7).map(|j| (100 + 13 * i + j) as TokenId));
            (format!("r{i}"), prompt, 1 + (i % 9) as u32)
        })
        .collect()
}

async fn run_all(
    engine: &EngineHandle,
    reqs: &[(String, Vec<TokenId>, u32)],
) -> BTreeMap<String, Vec<TokenId>> {
    let mut tasks = Vec::new();
    for (id, prompt, max_tokens) in reqs {
        let stream = engine
            .generate(request(id, prompt.clone(), *max_tokens))
            .await
            .unwrap();
        tasks.push((id.clone(), tokio::spawn(collect(stream))));
    }
    let mut out = BTreeMap::new();
    for (id, task) in tasks {
        let c = task.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Length, "{id}");
        out.insert(id, c.tokens);
    }
    out
}

#[tokio::test]
async fn concurrent_requests_get_the_tokens_they_get_alone() {
    let reqs = workload(24);
    let mut alone = BTreeMap::new();
    for r in &reqs {
        let engine = engine(checksum(), small_config(64, 4));
        alone.extend(run_all(&engine, std::slice::from_ref(r)).await);
        engine.shutdown().await.unwrap();
    }
    // Few blocks and seats: requests wait, share prefixes and get preempted.
    let engine = engine(checksum(), small_config(24, 6));
    let together = run_all(&engine, &reqs).await;
    assert_eq!(together, alone);
    engine.wait_idle().await.unwrap();
    engine.check_invariants().await.unwrap().unwrap();
    let stats = engine.stats();
    assert_eq!(stats.scheduler.n_blocks_used, 0);
    assert_eq!(stats.n_requests_finished_total, reqs.len() as u64);
    let n_tokens: u64 = reqs.iter().map(|r| u64::from(r.2)).sum();
    assert_eq!(stats.n_generated_tokens_total, n_tokens);
    assert!(stats.scheduler.prefix_hit_tokens > 0);
    engine.shutdown().await.unwrap();
    assert!(!engine.stats().running);
}
