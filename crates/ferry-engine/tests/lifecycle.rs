//! Every lifecycle operation through the engine thread with the checksum model, idle and with
//! requests streaming: replies come within a bound, no request is lost, and tokens equal the
//! checksum oracle (which sees stale or missing KV).
//!
//! "Streaming" is made exact with a gated executor: the test holds the engine inside a step,
//! queues the operation behind it, then lets the step finish, so the operation meets running
//! requests every time (no sleeps, no races).

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{FinishReason, TokenId, TransferId};
use ferry_engine::{
    spawn_with_connectors, EngineConfig, EngineHandle, KvConnector, KvTransferParams,
    LifecycleCallError, LifecycleError, PauseMode, SleepLevel, WakeTag, WeightResidency,
    WeightStore,
};
use support::*;

/// Every reply must come well within this (they take microseconds; CI machines are slow).
const BOUND: Duration = Duration::from_secs(10);

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("the reply did not come within the bound")
}

fn prompts(n: usize) -> Vec<(String, Vec<TokenId>)> {
    (0..n)
        .map(|i| {
            let mut p: Vec<TokenId> = (1..=8).map(TokenId).collect();
            p.extend((0..3 + i % 5).map(|j| TokenId((200 + 17 * i + j) as u32)));
            (format!("r{i}"), p)
        })
        .collect()
}

const MAX_TOKENS: u32 = 12;

/// A gated engine with requests `r0..rn` all admitted, held inside a step.
async fn busy(n: usize) -> (EngineHandle, Gate, Vec<tokio::task::JoinHandle<Collected>>) {
    busy_with(n, Vec::new()).await
}

async fn busy_with(
    n: usize,
    connectors: Vec<Box<dyn KvConnector>>,
) -> (EngineHandle, Gate, Vec<tokio::task::JoinHandle<Collected>>) {
    let (exec, mut gate) = gated(checksum());
    let config = EngineConfig {
        scheduler: small_config(128, 8),
        input_queue_capacity: 64,
        lora: None,
    };
    let connectors = connectors.into_iter().map(Into::into).collect();
    let engine = spawn_with_connectors(config, Box::new(exec), None, connectors).unwrap();
    let reqs = prompts(n)
        .into_iter()
        .map(|(id, p)| request(&id, p, MAX_TOKENS))
        .collect();
    let tasks = spawn_held(&engine, &mut gate, reqs).await;
    // Admit the queued requests, and hold the engine in the step that runs them all.
    gate.release();
    gate.next_step().await;
    (engine, gate, tasks)
}

/// Waits until `n` inputs are queued behind the step the engine is held in.
async fn until_queued(engine: &EngineHandle, n: usize) {
    while engine.n_queued_inputs() < n {
        tokio::task::yield_now().await;
    }
}

/// Checks a request that ran across a weight update (`v0` → `v1`) with its KV recomputed
/// after it: some prefix is `v0`'s output, the rest continues it under `v1`.
fn assert_spliced(c: &Collected, prompt: &[TokenId]) {
    let n = MAX_TOKENS as usize;
    let ok = (1..n).any(|k| {
        c.tokens[..k] == oracle("v0", prompt, k)[..]
            && c.tokens == continue_with("v1", prompt, &c.tokens[..k], n)
    });
    assert!(ok, "{:?} is not v0's output continued under v1", c.tokens);
}

async fn results(tasks: Vec<tokio::task::JoinHandle<Collected>>) -> Vec<Collected> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(within(t).await.unwrap());
    }
    out
}

fn assert_oracle(results: &[Collected], version: &str) {
    for (c, (id, p)) in results.iter().zip(prompts(results.len())) {
        assert_eq!(c.reason(), FinishReason::Length, "{id}");
        assert_eq!(c.tokens, oracle(version, &p, MAX_TOKENS as usize), "{id}");
    }
}

async fn assert_clean(engine: &EngineHandle) {
    within(engine.wait_idle()).await.unwrap();
    within(engine.check_invariants()).await.unwrap().unwrap();
    assert_eq!(engine.stats().scheduler.n_blocks_used, 0);
}

/// Lets one held step run, and holds the engine in the next one (if any comes).
async fn step_once(gate: &mut Gate) {
    gate.release();
    let _ = tokio::time::timeout(Duration::from_millis(200), gate.next_step()).await;
}

#[tokio::test]
async fn keep_pause_replies_at_once_and_frozen_requests_continue_with_the_same_tokens() {
    let (engine, mut gate, tasks) = busy(6).await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Keep, false).await });
    until_queued(&engine, 1).await;
    gate.release();
    within(pause).await.unwrap().unwrap();
    assert!(within(engine.is_paused()).await.unwrap());
    let n_steps = engine.stats().n_steps;
    // Requests that arrive while paused are queued, not rejected.
    let late = engine
        .generate(request("late", TokenId::list([5, 6, 7]), 4))
        .await
        .unwrap();
    assert!(within(engine.is_paused()).await.unwrap());
    assert!(
        gate.entered.try_recv().is_err(),
        "a paused engine runs no step"
    );
    assert_eq!(engine.stats().n_steps, n_steps);
    within(engine.resume()).await.unwrap();
    gate.open();
    assert!(!within(engine.is_paused()).await.unwrap());
    assert_oracle(&results(tasks).await, "v0");
    let late = within(collect(late)).await;
    assert_eq!(late.tokens, oracle("v0", &TokenId::list([5, 6, 7]), 4));
    assert_clean(&engine).await;
}

#[tokio::test]
async fn keep_pause_on_an_idle_engine_and_resume_reply_and_nothing_changes() {
    let (exec, _gate) = gated(checksum());
    let engine = engine(exec, small_config(64, 4));
    for _ in 0..3 {
        within(engine.pause(PauseMode::Keep, false)).await.unwrap();
        within(engine.pause(PauseMode::Abort, true)).await.unwrap();
        within(engine.pause(PauseMode::Wait, true)).await.unwrap();
        within(engine.resume()).await.unwrap();
        within(engine.resume()).await.unwrap();
    }
    assert!(!within(engine.is_paused()).await.unwrap());
    assert!(!within(engine.is_sleeping()).await.unwrap());
}

#[tokio::test]
async fn abort_pause_ends_every_stream_with_abort_and_its_partial_output() {
    let (engine, mut gate, tasks) = busy(6).await;
    step_once(&mut gate).await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Abort, false).await });
    until_queued(&engine, 1).await;
    gate.open();
    within(pause).await.unwrap().unwrap();
    for (c, (id, p)) in results(tasks).await.iter().zip(prompts(6)) {
        assert_eq!(c.reason(), FinishReason::Abort, "{id}");
        assert!(c.tokens.len() < MAX_TOKENS as usize, "{id}");
        assert_eq!(
            c.tokens,
            oracle("v0", &p, c.tokens.len()),
            "{id}: partial output"
        );
    }
    assert_clean(&engine).await;
    within(engine.resume()).await.unwrap();
}

#[tokio::test]
async fn wait_pause_drains_admitted_requests_and_keeps_new_ones_queued() {
    let (engine, mut gate, tasks) = busy(6).await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Wait, true).await });
    let e = engine.clone();
    let late = tokio::spawn(async move {
        e.generate(request("late", TokenId::list([9, 9, 9]), 3))
            .await
    });
    until_queued(&engine, 2).await;
    gate.open();
    within(pause).await.unwrap().unwrap();
    // The admitted requests are done: the pause waited for them.
    assert_oracle(&results(tasks).await, "v0");
    assert_eq!(
        engine.stats().scheduler.n_waiting,
        1,
        "the late request is queued"
    );
    assert_eq!(
        engine.stats().scheduler.n_blocks_cached,
        0,
        "clear_cache reset the cache"
    );
    within(engine.resume()).await.unwrap();
    let late = within(collect(late.await.unwrap().unwrap())).await;
    assert_eq!(late.tokens, oracle("v0", &TokenId::list([9, 9, 9]), 3));
    assert_clean(&engine).await;
}

#[tokio::test]
async fn keep_pause_with_clear_cache_makes_frozen_requests_recompute_correctly() {
    let (engine, mut gate, tasks) = busy(6).await;
    step_once(&mut gate).await;
    step_once(&mut gate).await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Keep, true).await });
    until_queued(&engine, 1).await;
    gate.release();
    within(pause).await.unwrap().unwrap();
    let s = engine.stats().scheduler;
    assert_eq!((s.n_blocks_used, s.n_blocks_cached, s.n_running), (0, 0, 0));
    assert_eq!(s.n_waiting, 6, "kept, preempted");
    within(engine.resume()).await.unwrap();
    gate.open();
    assert_oracle(&results(tasks).await, "v0");
    assert_clean(&engine).await;
}

#[tokio::test]
async fn resume_while_a_reset_is_pending_fails_it_clearly_and_loses_no_request() {
    let (engine, mut gate, tasks) = busy(6).await;
    let e = engine.clone();
    // A wait pause with clear_cache cannot complete while the engine is held in a step.
    let pause = tokio::spawn(async move { e.pause(PauseMode::Wait, true).await });
    let e = engine.clone();
    let sleep = tokio::spawn(async move { e.sleep(SleepLevel::L1, PauseMode::Wait).await });
    let e = engine.clone();
    let resume = tokio::spawn(async move { e.resume().await });
    until_queued(&engine, 3).await;
    gate.release();
    within(resume).await.unwrap().unwrap();
    assert!(matches!(
        within(pause).await.unwrap(),
        Err(LifecycleCallError::Lifecycle(
            LifecycleError::CancelledByResume
        ))
    ));
    assert!(matches!(
        within(sleep).await.unwrap(),
        Err(LifecycleCallError::Lifecycle(
            LifecycleError::CancelledByResume
        ))
    ));
    gate.open();
    assert_oracle(&results(tasks).await, "v0");
    assert!(!within(engine.is_sleeping()).await.unwrap());
    assert_clean(&engine).await;
}

#[tokio::test]
async fn back_to_back_resets_answer_false_while_busy_and_true_when_idle() {
    let (engine, mut gate, tasks) = busy(4).await;
    let resets = |running, connector| {
        let e = engine.clone();
        tokio::spawn(async move { e.reset_prefix_cache(running, connector).await.unwrap() })
    };
    let (a, b) = (resets(false, false), resets(false, true));
    until_queued(&engine, 2).await;
    step_once(&mut gate).await;
    assert!(!within(a).await.unwrap(), "running requests hold blocks");
    assert!(!within(b).await.unwrap());
    // Preempting first always succeeds, twice in a row, under load.
    let (a, b) = (resets(true, true), resets(true, false));
    until_queued(&engine, 2).await;
    step_once(&mut gate).await;
    assert!(within(a).await.unwrap());
    assert!(within(b).await.unwrap());
    gate.open();
    assert_oracle(&results(tasks).await, "v0");
    assert!(within(engine.reset_prefix_cache(false, false))
        .await
        .unwrap());
    assert!(within(engine.reset_prefix_cache(false, false))
        .await
        .unwrap());
    assert_clean(&engine).await;
}

#[tokio::test]
async fn abort_requests_by_id_and_all() {
    let (engine, mut gate, tasks) = busy(6).await;
    let e = engine.clone();
    let aborts = tokio::spawn(async move {
        let ids = vec!["r1".to_owned(), "r3".to_owned(), "unknown".to_owned()];
        e.abort_requests(Some(ids)).await.unwrap()
    });
    until_queued(&engine, 1).await;
    gate.release();
    assert_eq!(within(aborts).await.unwrap(), 2, "unknown ids are ignored");
    gate.open();
    let results = results(tasks).await;
    for (i, (c, (_, p))) in results.iter().zip(prompts(6)).enumerate() {
        if i == 1 || i == 3 {
            assert_eq!(c.reason(), FinishReason::Abort);
        } else {
            assert_eq!(c.tokens, oracle("v0", &p, MAX_TOKENS as usize));
        }
    }
    assert_eq!(within(engine.abort_requests(None)).await.unwrap(), 0);
    assert_clean(&engine).await;
}

#[tokio::test]
async fn abort_all_aborts_every_live_request_queued_ones_too() {
    let (engine, mut gate, tasks) = busy(6).await;
    let e = engine.clone();
    let aborts = tokio::spawn(async move { e.abort_requests(None).await.unwrap() });
    until_queued(&engine, 1).await;
    gate.open();
    assert_eq!(within(aborts).await.unwrap(), 6);
    assert!(results(tasks)
        .await
        .iter()
        .all(|c| c.reason() == FinishReason::Abort));
    assert_clean(&engine).await;
}

#[tokio::test]
async fn a_weight_update_without_a_reset_never_serves_a_stale_prefix_hit() {
    let engine = engine(checksum(), small_config(128, 8));
    let p: Vec<TokenId> = (1..=30).map(TokenId).collect();
    let first = within(collect(
        engine.generate(request("a", p.clone(), 5)).await.unwrap(),
    ))
    .await;
    assert_eq!(first.tokens, oracle("v0", &p, 5));
    assert_eq!(first.finish.as_ref().unwrap().weight_versions, ["v0"]);
    let again = within(collect(
        engine.generate(request("b", p.clone(), 5)).await.unwrap(),
    ))
    .await;
    assert!(
        again.finish.as_ref().unwrap().n_cached_tokens > 0,
        "same weights: a hit"
    );
    let info = within(engine.update_weights(WeightStore::default(), Some("v1".into())))
        .await
        .unwrap();
    assert_eq!(info.weight_version, "v1");
    let after = within(collect(
        engine.generate(request("c", p.clone(), 5)).await.unwrap(),
    ))
    .await;
    let f = after.finish.as_ref().unwrap();
    assert_eq!(
        f.n_cached_tokens, 0,
        "no prefix hit crosses a weight update"
    );
    assert_eq!(f.weight_versions, ["v1"]);
    assert_eq!(after.tokens, oracle("v1", &p, 5));
    // A version named by the engine, then a rename (no weights change).
    let info = within(engine.update_weights(WeightStore::default(), None))
        .await
        .unwrap();
    assert_eq!(info.weight_version, "v1+1");
    within(engine.update_weight_version("rl-step-3".into()))
        .await
        .unwrap();
    let w = within(engine.weight_info()).await.unwrap();
    assert_eq!(
        (w.weight_version.as_str(), w.n_weight_updates),
        ("rl-step-3", 2)
    );
    assert_eq!(engine.stats().weight_version, "rl-step-3");
    assert_clean(&engine).await;
}

/// Runs pause(keep, `clear_cache`) → weight update to `v1` → resume while 4 requests are
/// mid-decode, and returns their outputs.
async fn keep_update_resume(clear_cache: bool) -> Vec<Collected> {
    let (engine, mut gate, tasks) = busy(4).await;
    step_once(&mut gate).await;
    let e = engine.clone();
    let cycle = tokio::spawn(async move {
        e.pause(PauseMode::Keep, clear_cache).await.unwrap();
        e.update_weights(WeightStore::default(), Some("v1".into()))
            .await
            .unwrap();
        e.resume().await.unwrap();
    });
    until_queued(&engine, 1).await;
    gate.release();
    within(cycle).await.unwrap();
    gate.open();
    let results = results(tasks).await;
    assert_clean(&engine).await;
    results
}

#[tokio::test]
async fn pause_keep_update_resume_reports_both_versions_and_clear_cache_recomputes() {
    // Keep: frozen requests continue on their old KV with the new weights.
    for c in keep_update_resume(false).await {
        assert_eq!(c.reason(), FinishReason::Length);
        assert_eq!(c.finish.unwrap().weight_versions, ["v0", "v1"]);
    }
    // Keep with clear_cache: everything recomputes with the new weights.
    for (c, (id, p)) in keep_update_resume(true).await.iter().zip(prompts(4)) {
        let f = c.finish.as_ref().unwrap();
        assert_eq!(f.weight_versions, ["v0", "v1"], "{id}");
        assert_spliced(c, &p);
    }
}

#[tokio::test]
async fn sleep_levels_release_memory_and_wake_up_restores_it_under_load() {
    for level in [SleepLevel::L0, SleepLevel::L1, SleepLevel::L2] {
        for mode in [PauseMode::Wait, PauseMode::Abort, PauseMode::Keep] {
            let (engine, mut gate, tasks) = busy(4).await;
            let e = engine.clone();
            let sleep = tokio::spawn(async move { e.sleep(level, mode).await });
            until_queued(&engine, 1).await;
            gate.open();
            within(sleep).await.unwrap().unwrap();
            assert!(within(engine.is_sleeping()).await.unwrap());
            assert!(within(engine.is_paused()).await.unwrap());
            let lifecycle = engine.stats().lifecycle;
            assert_eq!(lifecycle.kv_released, level != SleepLevel::L0);
            let late = engine
                .generate(request("late", TokenId::list([4, 4, 4]), 3))
                .await
                .unwrap();
            if level == SleepLevel::L2 {
                assert_eq!(lifecycle.weights, WeightResidency::Dropped);
                assert!(matches!(
                    within(engine.wake_up(&[WakeTag::Weights])).await,
                    Err(LifecycleCallError::Lifecycle(
                        LifecycleError::WeightsDropped
                    ))
                ));
                within(engine.update_weights(WeightStore::default(), Some("v0".into())))
                    .await
                    .unwrap();
            }
            assert!(matches!(
                within(engine.resume()).await,
                Err(LifecycleCallError::Lifecycle(LifecycleError::Asleep { .. })) | Ok(())
            ));
            within(engine.wake_up(&[WakeTag::Weights])).await.unwrap();
            within(engine.wake_up(&[WakeTag::KvCache])).await.unwrap();
            assert!(!within(engine.is_sleeping()).await.unwrap());
            assert!(
                !within(engine.is_paused()).await.unwrap(),
                "a full wake-up resumes"
            );
            let late = within(collect(late)).await;
            assert_eq!(
                late.tokens,
                oracle("v0", &TokenId::list([4, 4, 4]), 3),
                "{level:?} {mode:?}"
            );
            let results = results(tasks).await;
            match mode {
                PauseMode::Abort => {
                    let reasons: Vec<_> = results
                        .iter()
                        .map(|c| (c.reason(), c.tokens.len()))
                        .collect();
                    assert!(
                        results.iter().all(|c| c.reason() == FinishReason::Abort),
                        "{level:?} {reasons:?}"
                    )
                }
                _ => assert_oracle(&results, "v0"),
            }
            assert_clean(&engine).await;
        }
    }
}

#[tokio::test]
async fn release_kv_cache_memory_needs_a_pause_and_wake_up_brings_it_back() {
    let (engine, mut gate, tasks) = busy(4).await;
    let e = engine.clone();
    let early = tokio::spawn(async move { e.release_kv_cache_memory().await });
    until_queued(&engine, 1).await;
    gate.release();
    assert!(matches!(
        within(early).await.unwrap(),
        Err(LifecycleCallError::Lifecycle(LifecycleError::NotPaused))
    ));
    step_once(&mut gate).await;
    let e = engine.clone();
    let release = tokio::spawn(async move {
        e.pause(PauseMode::Keep, false).await.unwrap();
        e.release_kv_cache_memory().await
    });
    until_queued(&engine, 1).await;
    gate.release();
    within(release).await.unwrap().unwrap();
    assert!(engine.stats().lifecycle.kv_released);
    assert!(within(engine.is_sleeping()).await.unwrap());
    assert!(matches!(
        within(engine.resume()).await,
        Err(LifecycleCallError::Lifecycle(LifecycleError::Asleep { .. }))
    ));
    within(engine.wake_up(&[WakeTag::KvCache])).await.unwrap();
    within(engine.resume()).await.unwrap();
    gate.open();
    // Kept requests recomputed their KV after the wake-up.
    assert_oracle(&results(tasks).await, "v0");
    assert_clean(&engine).await;
}

/// A connector with work pending (a flush not yet handed to its workers) for `n` polls after
/// each abort: the engine must keep stepping with nothing to compute.
#[derive(Debug)]
struct Pending(Arc<Mutex<(u32, u32, u32)>>);

impl KvConnector for Pending {
    fn name(&self) -> &str {
        "pending"
    }
    fn abort_transfers(&mut self) {
        let mut s = self.0.lock().unwrap();
        s.0 = s.2;
    }
    fn take_finished_transfers(&mut self, _out: &mut Vec<TransferId>) {
        let mut s = self.0.lock().unwrap();
        s.0 = s.0.saturating_sub(1);
    }
    fn has_pending_work(&self) -> bool {
        self.0.lock().unwrap().0 > 0
    }
    fn reset_cache(&mut self) {
        self.0.lock().unwrap().1 += 1;
    }
}

#[tokio::test]
async fn a_reset_keeps_stepping_until_connectors_have_no_pending_work() {
    let state = Arc::new(Mutex::new((0, 0, 50)));
    let (engine, mut gate, tasks) = busy_with(4, vec![Box::new(Pending(state.clone()))]).await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Keep, true).await });
    until_queued(&engine, 1).await;
    gate.release();
    within(pause).await.unwrap().unwrap();
    let s = *state.lock().unwrap();
    assert_eq!(
        (s.0, s.1),
        (0, 1),
        "every poll consumed, then one connector reset"
    );
    within(engine.resume()).await.unwrap();
    gate.open();
    assert_oracle(&results(tasks).await, "v0");
    assert_clean(&engine).await;
}

#[tokio::test]
async fn shutdown_fails_a_pending_operation_with_stopped() {
    let (engine, _gate, _tasks) = busy(2).await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Wait, false).await });
    until_queued(&engine, 1).await;
    let e = engine.clone();
    let stop = tokio::spawn(async move { e.shutdown().await });
    until_queued(&engine, 2).await;
    // The engine is held in a step; opening the gate lets it see the shutdown.
    drop(_gate);
    within(stop).await.unwrap().unwrap();
    assert!(matches!(
        within(pause).await.unwrap(),
        Err(LifecycleCallError::Stopped(_))
    ));
}

/// The P side of a P/D connector: it knows the exports it asked for and reports them
/// finished once their reader pulled them, or when `abort_transfers` revokes them.
#[derive(Debug, Default)]
struct ExportState {
    /// Requests that asked for an export (`do_remote_decode`).
    wanted: Vec<ferry_core::ReqIdx>,
    exports: Vec<TransferId>,
    /// The reader pulled every export (or they were revoked).
    pulled: bool,
}

#[derive(Debug)]
struct Exports(Arc<Mutex<ExportState>>);

impl KvConnector for Exports {
    fn name(&self) -> &str {
        "exports"
    }
    fn abort_transfers(&mut self) {
        self.0.lock().unwrap().pulled = true;
    }
    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>) {
        let mut s = self.0.lock().unwrap();
        if s.pulled {
            out.append(&mut s.exports);
        }
    }
    fn has_pending_work(&self) -> bool {
        false
    }
    fn reset_cache(&mut self) {}
    fn on_new_request(
        &mut self,
        new: ferry_core::NewRequest<'_>,
    ) -> Result<(), ferry_core::TransferParamsError> {
        if new.transfer.is_some_and(|t| t.exports()) {
            self.0.lock().unwrap().wanted.push(new.req);
        }
        Ok(())
    }
    fn request_finished(&mut self, f: ferry_core::FinishedRequest<'_>) -> Option<KvTransferParams> {
        let mut s = self.0.lock().unwrap();
        let at = s.wanted.iter().position(|&r| r == f.req)?;
        s.wanted.swap_remove(at);
        if f.blocks.is_empty() {
            return None;
        }
        s.exports.push(f.hold);
        Some(KvTransferParams {
            remote_engine_id: Some("exports".into()),
            remote_block_ids: Some(f.blocks.to_vec()),
            ..KvTransferParams::default()
        })
    }
}

#[tokio::test]
async fn an_export_holds_its_blocks_until_its_connector_reports_it_finished() {
    let state = Arc::new(Mutex::new(ExportState::default()));
    let config = EngineConfig {
        scheduler: small_config(128, 8),
        input_queue_capacity: 64,
        lora: None,
    };
    let conn: Box<dyn KvConnector> = Box::new(Exports(state.clone()));
    let engine =
        spawn_with_connectors(config, Box::new(checksum()), None, vec![conn.into()]).unwrap();
    let (id, p) = prompts(1).remove(0);
    let mut req = request(&id, p, MAX_TOKENS);
    req.transfer = Some(ferry_engine::TransferRequest::Export);
    let stream = within(engine.generate(req)).await.unwrap();
    let c = within(collect(stream)).await;
    let finish = c.finish.as_ref().unwrap();
    let export = finish.export;
    assert!(export.is_some(), "the finish names the export");
    let params = finish.kv_transfer_params.as_ref().expect("P's parameters");
    assert_eq!(params.remote_engine_id.as_deref(), Some("exports"));
    assert!(!params.remote_block_ids.as_ref().unwrap().is_empty());
    assert_oracle(&[c], "v0");
    within(engine.wait_idle()).await.unwrap();
    assert_eq!(
        state.lock().unwrap().exports,
        Vec::from_iter(export),
        "the connector that asked for the export owns its hold"
    );
    let s = engine.stats().scheduler;
    assert_eq!(
        s.n_transfers, 1,
        "the finished request's KV is held for its reader"
    );
    assert!(s.n_blocks_used > 0);
    // A clearing pause revokes the export; its connector reports it ended, and the reset
    // gets every block back.
    within(engine.pause(PauseMode::Keep, true)).await.unwrap();
    let s = engine.stats().scheduler;
    assert_eq!((s.n_transfers, s.n_blocks_used), (0, 0));
    within(engine.resume()).await.unwrap();
    assert_clean(&engine).await;
}
