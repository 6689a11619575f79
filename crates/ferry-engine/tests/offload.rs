//! The CPU offload tier in a running engine: real copier thread, real arena. The checksum
//! model makes every sampled token a function of every KV byte the request attends over, so
//! a request served from tier hits producing the oracle's tokens proves the right bytes came
//! back into the right blocks; the tiny Llama checks tokens and logprobs bitwise against an
//! engine without a tier. P/D and the tier run together through a full RL cycle.

mod pd_common;
mod support;

use std::sync::Arc;

use ferry_core::{FinishReason, TokenId};
use ferry_engine::{
    spawn_with_connectors, Connector, EngineConfig, EngineHandle, InMemoryFabric,
    InMemoryTransport, OffloadConfig, OffloadPolicy, PauseMode, PdConfig, PdRole, SchedulerConfig,
    SleepLevel, TierStats, WakeTag, WeightStore,
};
use ferry_model::Executor;
use pd_common::*;
use support::*;

const BS: usize = 4;

fn tier(n_slots: usize, policy: OffloadPolicy) -> OffloadConfig {
    let block_bytes = checksum().kv_layout(BS).block_bytes();
    OffloadConfig {
        block_size: BS,
        blocks_per_slot: 1,
        block_bytes,
        capacity_bytes: (n_slots * block_bytes) as u64,
        policy,
    }
}

fn offload_engine(config: SchedulerConfig, t: OffloadConfig) -> EngineHandle {
    spawn_with_connectors(
        EngineConfig {
            scheduler: config,
            input_queue_capacity: 256,
            lora: None,
        },
        Box::new(checksum()),
        None,
        vec![Connector::offload(t).unwrap()],
    )
    .unwrap()
}

fn tier_stats(e: &EngineHandle) -> TierStats {
    e.stats().tier.expect("the engine has a tier")
}

async fn run(e: &EngineHandle, id: &str, prompt: Vec<TokenId>, n: u32) -> Collected {
    within(collect(
        within(e.generate(request(id, prompt, n))).await.unwrap(),
    ))
    .await
}

#[tokio::test]
async fn tier_hits_give_the_tokens_of_a_fresh_computation_when_prefixes_do_not_fit_the_arena() {
    for policy in [OffloadPolicy::Lru, OffloadPolicy::Arc] {
        // 40 usable blocks; each prompt takes 10: four prompts evict each other locally,
        // the tier (64 blocks) keeps them all.
        let e = offload_engine(small_config(41, 4), tier(64, policy));
        let prompts: Vec<Vec<TokenId>> = (0..6).map(|i| prompt(i, 37)).collect();
        for round in 0..3 {
            for (i, p) in prompts.iter().enumerate() {
                let c = run(&e, &format!("r{round}-{i}"), p.clone(), 3).await;
                assert_eq!(
                    c.tokens,
                    oracle("v0", p, 3),
                    "{policy:?} round {round} r{i}"
                );
            }
            until_clean(&e).await;
        }
        let s = tier_stats(&e);
        assert!(
            s.n_hits >= 6,
            "{policy:?}: later rounds load from the tier: {s:?}"
        );
        assert_eq!(
            s.n_stores,
            6 * 9,
            "{policy:?}: each full block stored once: {s:?}"
        );
        assert_eq!(s.n_evictions, 0);
        assert_eq!(s.bytes_used, 6 * 9 * tier(1, policy).block_bytes as u64);
        e.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn eviction_under_pressure_keeps_outputs_exact_with_each_policy() {
    for policy in [OffloadPolicy::Lru, OffloadPolicy::Arc] {
        // The tier holds 20 blocks: 2 of the 6 prompts' prefixes.
        let e = offload_engine(small_config(41, 4), tier(20, policy));
        let prompts: Vec<Vec<TokenId>> = (0..6).map(|i| prompt(10 + i, 37)).collect();
        // Forward, then backward without the local cache: the last prompts stored are asked
        // first, and hit; the others miss and evict.
        let order: Vec<usize> = (0..6).chain((0..6).rev()).collect();
        for (n, &i) in order.iter().enumerate() {
            assert!(within(e.reset_prefix_cache(false, false)).await.unwrap());
            let c = run(&e, &format!("r{n}-{i}"), prompts[i].clone(), 2).await;
            assert_eq!(c.tokens, oracle("v0", &prompts[i], 2), "{policy:?}");
            until_clean(&e).await;
        }
        let s = tier_stats(&e);
        assert!(s.n_evictions > 0, "{policy:?}: {s:?}");
        assert!(s.n_hits >= 2, "{policy:?}: {s:?}");
        assert!(s.bytes_used <= s.bytes_capacity, "{policy:?}: {s:?}");
        e.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn reset_prefix_cache_with_reset_external_empties_the_tier_and_no_hit_crosses_an_update() {
    let e = offload_engine(small_config(128, 4), tier(64, OffloadPolicy::Lru));
    let p = prompt(1, 30);
    run(&e, "a", p.clone(), 2).await;
    until_clean(&e).await;
    assert!(tier_stats(&e).bytes_used > 0);
    // The local cache only: the next request loads from the tier.
    assert!(within(e.reset_prefix_cache(false, false)).await.unwrap());
    let c = run(&e, "b", p.clone(), 4).await;
    assert_eq!(c.tokens, oracle("v0", &p, 4));
    assert_eq!(tier_stats(&e).n_hits, 1);
    let loaded = tier_stats(&e).n_hit_blocks as usize * BS;
    assert!(loaded > 0);
    assert_eq!(
        c.finish.as_ref().unwrap().n_cached_tokens,
        loaded,
        "a tier hit is a prompt token not computed: cached_tokens counts it"
    );
    until_clean(&e).await;
    // The tier too.
    assert!(within(e.reset_prefix_cache(false, true)).await.unwrap());
    assert_eq!(tier_stats(&e).bytes_used, 0);
    run(&e, "c", p.clone(), 2).await;
    until_clean(&e).await;
    assert_eq!(tier_stats(&e).n_hits, 1, "nothing to hit after the reset");
    // A weight update without any reset: the tier's blocks are never hit again.
    within(e.reset_prefix_cache(false, false)).await.unwrap();
    within(e.update_weights(WeightStore::default(), Some("v1".into())))
        .await
        .unwrap();
    let c = run(&e, "d", p.clone(), 4).await;
    assert_eq!(
        c.tokens,
        oracle("v1", &p, 4),
        "computed with the new weights"
    );
    assert_eq!(tier_stats(&e).n_hits, 1, "no hit crosses the update");
    until_clean(&e).await;
    e.shutdown().await.unwrap();
}

#[tokio::test]
async fn sleep_and_kv_release_empty_the_tier_and_it_refills_after_wake_up() {
    let e = offload_engine(small_config(128, 8), tier(64, OffloadPolicy::Arc));
    // Requests finish with their stores in flight, and the sleep comes right behind them.
    let mut tasks = Vec::new();
    for i in 0..6 {
        let e = e.clone();
        tasks.push(tokio::spawn(async move {
            let p = prompt(20 + i, 17 + i);
            (run(&e, &format!("s{i}"), p.clone(), 2).await, p)
        }));
    }
    for t in tasks {
        let (c, p) = t.await.unwrap();
        assert_eq!(c.tokens, oracle("v0", &p, 2));
    }
    within(e.sleep(SleepLevel::L1, PauseMode::Keep))
        .await
        .unwrap();
    let s = e.stats();
    assert_eq!(s.tier.unwrap().bytes_used, 0, "the tier's index is gone");
    assert_eq!(
        s.scheduler.n_transfers, 0,
        "every store ended before the reply"
    );
    within(e.wake_up(&[])).await.unwrap();
    let p = prompt(30, 21);
    run(&e, "after", p.clone(), 2).await;
    until_clean(&e).await;
    assert!(
        tier_stats(&e).bytes_used > 0,
        "the tier works again after the wake-up"
    );
    within(e.reset_prefix_cache(false, false)).await.unwrap();
    let c = run(&e, "hit", p.clone(), 3).await;
    assert_eq!(c.tokens, oracle("v0", &p, 3));
    // KV release: the same, on a paused engine.
    within(e.pause(PauseMode::Keep, false)).await.unwrap();
    within(e.release_kv_cache_memory()).await.unwrap();
    assert_eq!(tier_stats(&e).bytes_used, 0);
    within(e.wake_up(&[WakeTag::KvCache])).await.unwrap();
    within(e.resume()).await.unwrap();
    let c = run(&e, "again", p.clone(), 3).await;
    assert_eq!(c.tokens, oracle("v0", &p, 3));
    until_clean(&e).await;
    e.shutdown().await.unwrap();
}

#[tokio::test]
async fn with_the_tiny_llama_tier_hits_give_bitwise_the_tokens_and_logprobs_of_no_tier() {
    use ferry_engine::testing::tiny_model;
    use ferry_engine::{start_model, start_model_with_connectors, ModelEngineConfig};
    let config = ModelEngineConfig {
        block_size: BS,
        kv_cache: ferry_engine::KvCacheSize::Blocks(256),
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: Some(256),
        sampler_seed: Some(0),
        ..ModelEngineConfig::default()
    };
    let started = start_model(tiny_model(), &config).unwrap();
    let block_bytes = started.model.kv_block_bytes as usize;
    let single = started.handle;
    let t = OffloadConfig {
        block_size: BS,
        blocks_per_slot: 2,
        block_bytes,
        capacity_bytes: (64 * block_bytes) as u64,
        policy: OffloadPolicy::Lru,
    };
    let tiered = start_model_with_connectors(
        tiny_model(),
        &config,
        |e| e,
        vec![Connector::offload(t).unwrap()],
    )
    .unwrap()
    .handle;
    for i in 0..3 {
        let p: Vec<TokenId> = (0..21 + 4 * i)
            .map(|j| TokenId((5 + 13 * i + 7 * j) as u32 % 250 + 3))
            .collect();
        let req = |id: &str| {
            let mut r = request(id, p.clone(), 6);
            r.params.sampler.logprobs = Some(2);
            r
        };
        let reference = within(collect(within(single.generate(req("ref"))).await.unwrap())).await;
        within(collect(
            within(tiered.generate(req("store"))).await.unwrap(),
        ))
        .await;
        until_clean(&tiered).await;
        within(tiered.reset_prefix_cache(false, false))
            .await
            .unwrap();
        let hit = within(collect(within(tiered.generate(req("hit"))).await.unwrap())).await;
        assert_eq!(hit.tokens, reference.tokens, "prompt {i}");
        let logprobs = |c: &Collected| -> Vec<_> {
            c.chunks.iter().flat_map(|ch| ch.logprobs.clone()).collect()
        };
        assert_eq!(logprobs(&hit), logprobs(&reference), "prompt {i}: bitwise");
        assert_eq!(tier_stats(&tiered).n_hits, i as u64 + 1);
    }
    until_clean(&tiered).await;
}

fn pd_connector(id: &str, role: PdRole, fabric: &Arc<InMemoryFabric>) -> Connector {
    let config = PdConfig {
        role,
        engine_id: id.to_owned(),
        host: None,
        port: None,
        secret: [id.len() as u8 + 7; 32],
        block_size: BS,
        allowed_peers: ferry_core::AllowedPeers::default(),
    };
    Connector::pd(config, Arc::new(InMemoryTransport::new(id, fabric.clone())))
}

/// An engine with the tier first (it supplies a load when it has the prefix) and P/D.
fn pd_offload_engine(id: &str, role: PdRole, fabric: &Arc<InMemoryFabric>) -> EngineHandle {
    spawn_with_connectors(
        EngineConfig {
            scheduler: small_config(64, 8),
            input_queue_capacity: 256,
            lora: None,
        },
        Box::new(checksum()),
        None,
        vec![
            Connector::offload(tier(128, OffloadPolicy::Arc)).unwrap(),
            pd_connector(id, role, fabric),
        ],
    )
    .unwrap()
}

async fn rollouts(p: &EngineHandle, d: &EngineHandle, version: &str, tag: &str) {
    let mut tasks = Vec::new();
    for i in 0..6 {
        let (p, d) = (p.clone(), d.clone());
        let tag = tag.to_owned();
        tasks.push(tokio::spawn(async move {
            let id = format!("{tag}-{i}");
            // Distinct prompts: D never has a prompt locally, so it pulls every export (an
            // export D has no use for stays on P until its lease ends).
            let prompt = prompt(i, 25);
            let params = prefill(&p, &id, prompt.clone()).await;
            (prompt.clone(), decode(&d, &id, prompt, params).await)
        }));
    }
    for t in tasks {
        let (prompt, c) = t.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Length);
        assert_eq!(
            c.tokens,
            oracle(version, &prompt, MAX_TOKENS as usize),
            "{tag}"
        );
        // Every prompt token but the last came from P (or D's tier): none computed on D.
        assert_eq!(
            c.finish.as_ref().unwrap().n_cached_tokens,
            prompt.len() - 1,
            "{tag}: cached_tokens counts the import"
        );
    }
}

#[tokio::test]
async fn pd_and_offload_together_through_a_full_rl_cycle() {
    let fabric = InMemoryFabric::new();
    let p = pd_offload_engine("P", PdRole::Producer, &fabric);
    let d = pd_offload_engine("D", PdRole::Consumer, &fabric);
    rollouts(&p, &d, "v0", "a").await;
    until_clean(&p).await;
    until_clean(&d).await;
    assert!(tier_stats(&p).n_stores > 0);
    // D's tier keeps what D imported (6 full blocks of each prompt) as well as what it computed.
    assert!(tier_stats(&d).n_stores >= 6 * 6, "{:?}", tier_stats(&d));
    // So D serves a prompt it once imported from its own tier, with no P at all.
    assert!(within(d.reset_prefix_cache(false, false)).await.unwrap());
    let c = run(&d, "local", prompt(2, 25), MAX_TOKENS).await;
    assert_eq!(c.tokens, oracle("v0", &prompt(2, 25), MAX_TOKENS as usize));
    assert_eq!(tier_stats(&d).n_hits, 1, "{:?}", tier_stats(&d));
    until_clean(&d).await;
    // Rollouts again with the local caches gone: P's prefills load from its tier.
    for e in [&p, &d] {
        assert!(within(e.reset_prefix_cache(false, false)).await.unwrap());
    }
    rollouts(&p, &d, "v0", "b").await;
    assert!(tier_stats(&p).n_hits > 0, "{:?}", tier_stats(&p));
    // The RL step: pause and clear every cache, push new weights, resume.
    for e in [&p, &d] {
        within(e.pause(PauseMode::Keep, true)).await.unwrap();
        assert_eq!(tier_stats(e).bytes_used, 0);
        within(e.update_weights(WeightStore::default(), Some("v1".into())))
            .await
            .unwrap();
        within(e.resume()).await.unwrap();
    }
    let hits = tier_stats(&p).n_hits;
    rollouts(&p, &d, "v1", "c").await;
    until_clean(&p).await;
    until_clean(&d).await;
    // Sleep and wake both, then once more with the new weights.
    for e in [&p, &d] {
        within(e.sleep(SleepLevel::L1, PauseMode::Wait))
            .await
            .unwrap();
        within(e.wake_up(&[])).await.unwrap();
    }
    rollouts(&p, &d, "v1", "d").await;
    assert!(tier_stats(&p).n_hits >= hits, "{:?}", tier_stats(&p));
    until_clean(&p).await;
    until_clean(&d).await;
    assert_eq!(fabric.n_published(), 0, "every export was pulled");
}
