//! P/D disaggregation between two engines in one process, over the in-memory transport: P
//! computes a prompt to its first token and exports its KV, D loads it and generates. The
//! checksum model makes every sampled token a function of the whole KV it attends over, so D
//! producing the single-engine tokens proves the right bytes landed in the right blocks;
//! the tiny Llama checks the same with a real forward.

mod pd_common;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{FinishReason, TokenId};
use ferry_engine::{
    spawn_with_connectors, Connector, EngineConfig, EngineHandle, InMemoryFabric,
    InMemoryTransport, KvLoadFailurePolicy, PauseMode, PdConfig, PdRole, SchedulerConfig,
};
use pd_common::*;
use support::*;

fn pd_connector(id: &str, role: PdRole, fabric: &Arc<InMemoryFabric>, bs: usize) -> Connector {
    let config = PdConfig {
        role,
        engine_id: id.to_owned(),
        host: None,
        port: None,
        secret: [id.len() as u8 + 41; 32],
        block_size: bs,
        allowed_peers: ferry_core::AllowedPeers::default(),
    };
    Connector::pd(config, Arc::new(InMemoryTransport::new(id, fabric.clone())))
}

fn pd_engine(
    id: &str,
    role: PdRole,
    fabric: &Arc<InMemoryFabric>,
    config: SchedulerConfig,
) -> EngineHandle {
    let bs = config.block_size;
    let config = EngineConfig {
        scheduler: config,
        input_queue_capacity: 256,
        lora: None,
    };
    spawn_with_connectors(
        config,
        Box::new(checksum()),
        None,
        vec![pd_connector(id, role, fabric, bs)],
    )
    .unwrap()
}

#[tokio::test]
async fn d_generates_what_a_single_engine_generates() {
    let fabric = InMemoryFabric::new();
    let p = pd_engine("P", PdRole::Producer, &fabric, small_config(256, 16));
    let d = pd_engine("D", PdRole::Consumer, &fabric, small_config(256, 16));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (p, d) = (p.clone(), d.clone());
        tasks.push(tokio::spawn(async move {
            let id = format!("r{i}");
            let prompt = prompt(i, 5 + 3 * i);
            let params = prefill(&p, &id, prompt.clone()).await;
            let c = decode(&d, &id, prompt.clone(), params).await;
            (prompt, c)
        }));
    }
    for t in tasks {
        let (prompt, c) = t.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Length);
        assert_eq!(
            c.tokens,
            oracle("v0", &prompt, MAX_TOKENS as usize),
            "D's tokens are a single engine's"
        );
    }
    until_clean(&p).await;
    until_clean(&d).await;
    assert_eq!(fabric.n_published(), 0, "every export was pulled");
}

#[tokio::test]
async fn a_forged_token_never_produces_output_from_wrong_kv() {
    let fabric = InMemoryFabric::new();
    let p = pd_engine("P", PdRole::Producer, &fabric, small_config(128, 8));
    let mut cfg = small_config(128, 8);
    cfg.kv_load_failure_policy = KvLoadFailurePolicy::Fail;
    let d_fail = pd_engine("D1", PdRole::Consumer, &fabric, cfg);
    let mut cfg = small_config(128, 8);
    cfg.kv_load_failure_policy = KvLoadFailurePolicy::Recompute;
    let d_recompute = pd_engine("D2", PdRole::Consumer, &fabric, cfg);
    // Two exports of different prompts: the second's parameters with the first's prompt
    // would load KV of the wrong tokens, and are refused by its prompt hash.
    let (a, b) = (prompt(1, 13), prompt(2, 13));
    let params_a = prefill(&p, "a", a.clone()).await;
    let params_b = prefill(&p, "b", b.clone()).await;
    let mut forged = params_a.clone();
    forged.export_token = Some("f".repeat(64));
    let c = decode(&d_fail, "x", a.clone(), forged).await;
    assert_eq!(c.reason(), FinishReason::Error);
    assert!(c.tokens.is_empty());
    let message = c.finish.unwrap().message.unwrap();
    assert!(message.contains("no export"), "{message}");
    // Invalid input fails closed under `recompute` too: the policy is for faults.
    let c = decode(&d_recompute, "y", a.clone(), params_b.clone()).await;
    assert_eq!(c.reason(), FinishReason::Error);
    assert!(c.tokens.is_empty(), "no output from another prompt's KV");
    let message = c.finish.unwrap().message.unwrap();
    assert!(message.contains("(invalid)"), "{message}");
    // The real parameters still load (a refused pull consumes nothing).
    let c = decode(&d_fail, "a", a.clone(), params_a).await;
    assert_eq!(c.tokens, oracle("v0", &a, MAX_TOKENS as usize));
    let c = decode(&d_fail, "b", b.clone(), params_b).await;
    assert_eq!(c.tokens, oracle("v0", &b, MAX_TOKENS as usize));
    until_clean(&p).await;
    until_clean(&d_fail).await;
    until_clean(&d_recompute).await;
}

#[tokio::test]
async fn an_idle_producer_expires_its_lease_with_no_input_arriving() {
    let fabric = InMemoryFabric::new();
    let mut cfg = small_config(128, 8);
    cfg.export_lease = Duration::from_millis(200);
    let p = pd_engine("P", PdRole::Producer, &fabric, cfg);
    let params = prefill(&p, "a", prompt(1, 13)).await;
    until(&p, |s| s.n_transfers == 1).await;
    assert_eq!(fabric.n_published(), 1);
    // Nothing is sent to P: its idle wait ends at the lease.
    until_clean(&p).await;
    assert_eq!(fabric.n_published(), 0, "unpublished");
    let d = pd_engine("D", PdRole::Consumer, &fabric, small_config(128, 8));
    let c = decode(&d, "a", prompt(1, 13), params).await;
    assert_eq!(c.reason(), FinishReason::Error, "the export expired");
}

#[tokio::test]
async fn a_keep_pause_on_p_with_held_exports_replies_at_once_and_a_clearing_one_revokes_them() {
    let fabric = InMemoryFabric::new();
    let p = pd_engine("P", PdRole::Producer, &fabric, small_config(256, 16));
    for i in 0..6 {
        prefill(&p, &format!("r{i}"), prompt(i, 17)).await;
    }
    until(&p, |s| s.n_transfers == 6).await;
    within(p.pause(PauseMode::Keep, false)).await.unwrap();
    assert_eq!(p.stats().scheduler.n_transfers, 6, "keep revokes nothing");
    assert!(!within(p.reset_prefix_cache(false, false)).await.unwrap());
    within(p.pause(PauseMode::Keep, true)).await.unwrap();
    let s = p.stats().scheduler;
    assert_eq!(
        (s.n_transfers, s.n_blocks_used),
        (0, 0),
        "revoked and freed"
    );
    assert_eq!(fabric.n_published(), 0);
    within(p.resume()).await.unwrap();
    until_clean(&p).await;
}

/// The in-memory transport with D's fetches held until the test releases them: loads in
/// flight, as long as a test needs. A cancelled fetch is acknowledged only at the release,
/// like a transport that must wait for its bytes to stop landing.
#[derive(Debug, Default)]
struct Held {
    fetches: Vec<(
        ferry_kv::FetchSpec,
        ferry_arena::BlockGrant,
        ferry_arena::Reports,
        bool,
    )>,
}

#[derive(Debug, Clone)]
struct GatedTransport {
    inner: InMemoryTransport,
    held: Arc<std::sync::Mutex<Option<Held>>>,
}

impl GatedTransport {
    /// Lets every held fetch go (cancelled ones fail), and every later one through.
    fn release(&self) {
        let held = self.held.lock().unwrap().take();
        for (spec, grant, reports, cancelled) in held.map(|h| h.fetches).unwrap_or_default() {
            if cancelled {
                drop(grant);
                reports.send(ferry_core::WorkerReport::Pd(
                    ferry_core::PdReport::FetchDone {
                        hold: spec.hold,
                        result: Err(ferry_core::FetchError::fault(0, "cancelled")),
                    },
                ));
            } else {
                ferry_kv::Transport::fetch(&self.inner, spec, grant, reports);
            }
        }
    }

    fn n_held(&self) -> usize {
        self.held
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |h| h.fetches.len())
    }
}

impl ferry_kv::Transport for GatedTransport {
    fn publish(&self, offer: ferry_kv::ExportOffer, reports: ferry_arena::Reports) {
        self.inner.publish(offer, reports);
    }
    fn unpublish(
        &self,
        engine_id: &str,
        hold: ferry_core::TransferId,
        reason: ferry_core::Unpublished,
        reports: ferry_arena::Reports,
    ) {
        self.inner.unpublish(engine_id, hold, reason, reports);
    }
    fn release(&self, spec: ferry_kv::ReleaseSpec) {
        self.inner.release(spec);
    }
    fn fetch(
        &self,
        spec: ferry_kv::FetchSpec,
        dst: ferry_arena::BlockGrant,
        reports: ferry_arena::Reports,
    ) {
        let mut held = self.held.lock().unwrap();
        match held.as_mut() {
            Some(h) => h.fetches.push((spec, dst, reports, false)),
            None => {
                drop(held);
                self.inner.fetch(spec, dst, reports);
            }
        }
    }
    fn cancel_fetch(&self, hold: ferry_core::TransferId) {
        let mut held = self.held.lock().unwrap();
        match held.as_mut() {
            Some(h) => {
                for f in &mut h.fetches {
                    if f.0.hold == hold {
                        f.3 = true;
                    }
                }
            }
            None => {
                drop(held);
                self.inner.cancel_fetch(hold);
            }
        }
    }
}

#[tokio::test]
async fn loads_in_flight_at_a_reset_keep_their_blocks_until_the_transfer_ends_then_recompute() {
    for path in ["pause", "sleep", "release"] {
        let fabric = InMemoryFabric::new();
        let p = pd_engine("P", PdRole::Producer, &fabric, small_config(256, 16));
        let gated = GatedTransport {
            inner: InMemoryTransport::new("D", fabric.clone()),
            held: Arc::new(std::sync::Mutex::new(Some(Held::default()))),
        };
        let config = PdConfig {
            role: PdRole::Consumer,
            engine_id: "D".into(),
            host: None,
            port: None,
            secret: [1; 32],
            block_size: 4,
            allowed_peers: ferry_core::AllowedPeers::default(),
        };
        let d = spawn_with_connectors(
            EngineConfig {
                scheduler: small_config(256, 16),
                input_queue_capacity: 256,
                lora: None,
            },
            Box::new(checksum()),
            None,
            vec![Connector::pd(config, Arc::new(gated.clone()))],
        )
        .unwrap();
        let mut params = Vec::new();
        for i in 0..8 {
            params.push(prefill(&p, &format!("r{i}"), prompt(i, 21)).await);
        }
        let mut tasks = Vec::new();
        for (i, params) in params.into_iter().enumerate() {
            let d = d.clone();
            tasks.push(tokio::spawn(async move {
                decode(&d, &format!("r{i}"), prompt(i, 21), params).await
            }));
        }
        let started = Instant::now();
        while gated.n_held() < 8 {
            assert!(started.elapsed() < BOUND, "the loads did not start");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Each load holds its 5 blocks (the stats are published just after the step that
        // started the loads).
        let used = 8 * 5;
        until(&d, |s| s.n_blocks_used == used).await;
        let d2 = d.clone();
        let op = tokio::spawn(async move {
            match path {
                "pause" => d2.pause(PauseMode::Keep, true).await,
                "sleep" => {
                    d2.sleep(ferry_engine::SleepLevel::L1, PauseMode::Keep)
                        .await
                }
                _ => {
                    d2.pause(PauseMode::Keep, false).await?;
                    d2.release_kv_cache_memory().await
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!op.is_finished(), "{path}: the reset waits for the loads");
        assert_eq!(
            d.stats().scheduler.n_blocks_used,
            used,
            "{path}: retracted requests free nothing the loads may still write"
        );
        gated.release();
        within(op).await.unwrap().unwrap();
        assert_eq!(d.stats().scheduler.n_blocks_used, 0, "{path}");
        if path != "pause" {
            within(d.wake_up(&[])).await.unwrap();
        }
        if within(d.is_paused()).await.unwrap() {
            within(d.resume()).await.unwrap();
        }
        for (i, t) in tasks.into_iter().enumerate() {
            let c = within(t).await.unwrap();
            assert_eq!(
                c.tokens,
                oracle("v0", &prompt(i, 21), MAX_TOKENS as usize),
                "{path}: r{i} recomputed"
            );
        }
        // The cancelled loads never pulled: P still holds the exports until their lease.
        within(p.pause(PauseMode::Keep, true)).await.unwrap();
        within(p.resume()).await.unwrap();
        until_clean(&p).await;
        until_clean(&d).await;
    }
}

#[tokio::test]
async fn with_the_tiny_llama_d_generates_what_a_single_engine_generates() {
    use ferry_engine::testing::tiny_model;
    use ferry_engine::{start_model, start_model_with_connectors, ModelEngineConfig};
    let config = ModelEngineConfig {
        block_size: 4,
        kv_cache: ferry_engine::KvCacheSize::Blocks(256),
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: Some(256),
        sampler_seed: Some(0),
        ..ModelEngineConfig::default()
    };
    let fabric = InMemoryFabric::new();
    let started = |id: &str, role| {
        start_model_with_connectors(
            tiny_model(),
            &config,
            |e| e,
            vec![pd_connector(id, role, &fabric, 4)],
        )
        .unwrap()
        .handle
    };
    let p = started("P", PdRole::Producer);
    let d = started("D", PdRole::Consumer);
    let single = start_model(tiny_model(), &config).unwrap().handle;
    for i in 0..4 {
        let id = format!("r{i}");
        let prompt: Vec<TokenId> = (0..9 + 5 * i)
            .map(|j| TokenId((5 + 13 * i + 7 * j) as u32 % 250 + 3))
            .collect();
        let params = prefill(&p, &id, prompt.clone()).await;
        let c = decode(&d, &id, prompt.clone(), params).await;
        let mut req = request(&id, prompt, MAX_TOKENS);
        req.params.sampler.logprobs = Some(0);
        let reference = within(collect(within(single.generate(req)).await.unwrap())).await;
        assert_eq!(c.tokens, reference.tokens, "r{i}");
    }
    until_clean(&p).await;
    until_clean(&d).await;
}

#[tokio::test]
async fn a_clearing_pause_after_an_idle_spell_longer_than_the_wait_bound_succeeds() {
    // Found by the simulation (ferry-sim): the engine handled a call that came after an idle
    // wait before moving the core's clock, so the reset started with a deadline already
    // past, and once the clock moved the pause failed with a timeout while P's export was
    // still being revoked. An RL trainer's pause after a long training step is exactly that.
    let fabric = InMemoryFabric::new();
    let config = SchedulerConfig {
        lifecycle_wait_timeout: Duration::from_millis(150),
        ..small_config(64, 4)
    };
    let p = pd_engine("P", PdRole::Producer, &fabric, config);
    prefill(&p, "r", prompt(1, 20)).await;
    assert_eq!(fabric.n_published(), 1, "an export is held for D");
    tokio::time::sleep(Duration::from_millis(400)).await;
    within(p.pause(PauseMode::Keep, true))
        .await
        .expect("the reset has its whole bound from the moment it starts");
    assert_eq!(fabric.n_published(), 0, "the export was revoked");
    within(p.resume()).await.unwrap();
    until_clean(&p).await;
}
