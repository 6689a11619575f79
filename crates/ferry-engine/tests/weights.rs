//! Weight updates through the engine with the real (tiny) Llama model: a push or a reload
//! gives exactly the new weights' tokens, never a stale prefix hit, reset or not; a bad push
//! changes nothing and says what is wrong.

mod support;

use std::time::Duration;

use ferry_core::{FinishReason, SamplingParams, TokenId};
use ferry_engine::{
    EngineHandle, GenerateRequest, LifecycleCallError, PauseMode, WeightError, WeightReloadError,
    WeightUpdateError,
};
use ferry_model::random_model::random_weights;
use ferry_model::tiny::{tiny_config, tiny_model, write_hf_folder};
use ferry_model::{LlamaModel, Tensor, WeightStore};
use support::*;

const BOUND: Duration = Duration::from_secs(30);

fn config() -> ferry_core::SchedulerConfig {
    ferry_core::SchedulerConfig {
        weight_version: "base".into(),
        ..small_config(64, 4)
    }
}

fn llama(weights: &WeightStore) -> LlamaModel {
    LlamaModel::new(&tiny_config(), weights).unwrap()
}

/// A prompt long enough to fill several KV blocks (block size 4), so a stale hit would show.
fn prompt() -> Vec<TokenId> {
    (0..23).map(|i| TokenId(40 + 7 * i)).collect()
}

async fn generate(engine: &EngineHandle, id: &str) -> support::Collected {
    let req = GenerateRequest {
        request_id: id.to_owned(),
        prompt: prompt(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(8)
        },
        ..GenerateRequest::default()
    };
    let stream = engine.generate(req).await.unwrap();
    tokio::time::timeout(BOUND, collect(stream)).await.unwrap()
}

/// What a fresh engine with `weights` generates.
async fn fresh(weights: &WeightStore) -> Vec<TokenId> {
    let engine = engine(llama(weights), config());
    let c = generate(&engine, "fresh").await;
    engine.shutdown().await.unwrap();
    c.tokens
}

#[tokio::test]
async fn a_complete_push_without_a_reset_gives_the_new_weights_tokens() {
    let a = tiny_model().weights;
    let b = random_weights(&tiny_config(), 7);
    let (want_a, want_b) = (fresh(&a).await, fresh(&b).await);
    assert_ne!(
        want_a, want_b,
        "the two weight sets must differ for this test to mean much"
    );
    let engine = engine(llama(&a), config());
    assert_eq!(generate(&engine, "1").await.tokens, want_a);
    let hit = generate(&engine, "2").await;
    assert!(
        hit.finish.unwrap().n_cached_tokens > 0,
        "same weights: a prefix hit"
    );
    let info = engine
        .update_weights(b.clone(), Some("b".into()))
        .await
        .unwrap();
    assert!(info.complete);
    let after = generate(&engine, "3").await;
    let f = after.finish.as_ref().unwrap();
    assert_eq!(f.n_cached_tokens, 0, "no prefix hit crosses the update");
    assert_eq!(f.weight_versions, ["b"]);
    assert_eq!(after.tokens, want_b);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_partial_push_patches_only_the_named_tensors() {
    let a = tiny_model().weights;
    let b = random_weights(&tiny_config(), 11);
    let name = "model.layers.0.mlp.down_proj.weight";
    let mut patched = a.clone();
    patched.insert(name, b.get(name).unwrap().clone());
    let want = fresh(&patched).await;
    let engine = engine(llama(&a), config());
    let _ = generate(&engine, "warm").await;
    let mut push = WeightStore::default();
    push.insert(name, b.get(name).unwrap().clone());
    let info = engine.update_weights(push, None).await.unwrap();
    assert_eq!((info.n_tensors, info.complete), (1, false));
    assert_eq!(info.weight_version, "base+1");
    assert_eq!(generate(&engine, "after").await.tokens, want);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_bad_push_changes_nothing_and_names_what_is_wrong() {
    let a = tiny_model().weights;
    let want = fresh(&a).await;
    let engine = engine(llama(&a), config());
    let good = "model.norm.weight";
    let cases: Vec<(WeightStore, IsExpected)> = vec![
        (
            store(&[
                (good, a.get(good).unwrap().clone()),
                ("model.nope.weight", Tensor::new(vec![1], vec![0.0])),
            ]),
            |e| matches!(e, WeightError::UnknownTensor { name } if name == "model.nope.weight"),
        ),
        (
            store(&[(good, Tensor::new(vec![3], vec![0.0; 3]))]),
            |e| matches!(e, WeightError::BadShape { name, .. } if name == "model.norm.weight"),
        ),
        (WeightStore::default(), |e| matches!(e, WeightError::Empty)),
    ];
    for (push, expected) in cases {
        match engine.update_weights(push, Some("bad".into())).await {
            Err(WeightUpdateError::Weights(e)) => assert!(expected(&e), "{e}"),
            other => panic!("expected a weight error, got {other:?}"),
        }
    }
    let info = engine.weight_info().await.unwrap();
    assert_eq!(
        (info.weight_version.as_str(), info.n_weight_updates),
        ("base", 0)
    );
    let after = generate(&engine, "after").await;
    assert_eq!(after.tokens, want);
    assert_eq!(after.finish.unwrap().weight_versions, ["base"]);
    engine.shutdown().await.unwrap();
}

/// Says whether a push's error is the one expected.
type IsExpected = fn(&WeightError) -> bool;

fn store(tensors: &[(&str, Tensor)]) -> WeightStore {
    let mut s = WeightStore::default();
    for (n, t) in tensors {
        s.insert(*n, t.clone());
    }
    s
}

#[tokio::test]
async fn reload_from_disk_in_a_pause_keep_cycle_and_a_bad_folder_changes_nothing() {
    let a = tiny_model().weights;
    let b = random_weights(&tiny_config(), 3);
    let want_b = fresh(&b).await;
    let dir = tempfile::tempdir().unwrap();
    let mut model_b = tiny_model();
    model_b.weights = b;
    write_hf_folder(&model_b, dir.path()).unwrap();

    let engine = engine(llama(&a), config());
    let _ = generate(&engine, "warm").await;
    let missing = engine
        .update_weights_from_disk(dir.path().join("nope"), None)
        .await;
    assert!(
        matches!(missing, Err(WeightReloadError::Load(_))),
        "{missing:?}"
    );
    engine.pause(PauseMode::Keep, false).await.unwrap();
    let info = engine
        .update_weights_from_disk(dir.path().to_owned(), Some("step-1".into()))
        .await
        .unwrap();
    assert!(info.complete && info.prepare_seconds > 0.0);
    assert!(info.in_place, "paused: read over the weights");
    engine.resume().await.unwrap();
    let after = generate(&engine, "after").await;
    assert_eq!(after.reason(), FinishReason::Length);
    assert_eq!(after.tokens, want_b);
    assert_eq!(after.finish.unwrap().weight_versions, ["step-1"]);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn sleep_level_2_drops_the_weights_and_a_reload_must_come_before_waking() {
    let a = tiny_model().weights;
    let want = fresh(&a).await;
    let engine = engine(llama(&a), config());
    let f32_bytes: usize = a.tensors.values().map(|t| 4 * t.numel()).sum();
    assert_eq!(
        engine.weight_info().await.unwrap().n_bytes,
        f32_bytes as u64,
        "every tensor held, in f32"
    );
    engine
        .sleep(ferry_engine::SleepLevel::L2, PauseMode::Wait)
        .await
        .unwrap();
    let info = engine.weight_info().await.unwrap();
    assert_eq!(info.residency, ferry_model::WeightResidency::Dropped);
    assert_eq!(info.n_bytes, 0, "dropped");
    let refused = engine.wake_up(&[]).await;
    assert!(matches!(
        refused,
        Err(LifecycleCallError::Lifecycle(
            ferry_engine::LifecycleError::WeightsDropped
        ))
    ));
    // A partial push has nothing to patch.
    let mut one = WeightStore::default();
    one.insert(
        "model.norm.weight",
        a.get("model.norm.weight").unwrap().clone(),
    );
    assert!(matches!(
        engine.update_weights(one, None).await,
        Err(WeightUpdateError::Weights(WeightError::Incomplete { .. }))
    ));
    engine
        .update_weights(a.clone(), Some("again".into()))
        .await
        .unwrap();
    assert_eq!(
        engine.weight_info().await.unwrap().n_bytes,
        f32_bytes as u64
    );
    engine.wake_up(&[]).await.unwrap();
    assert!(!engine.is_sleeping().await.unwrap());
    assert_eq!(generate(&engine, "after").await.tokens, want);
    engine.shutdown().await.unwrap();
}

/// `prompt()`'s greedy tokens with their logprobs (and the top 3), as bits.
async fn generate_logprobs(engine: &EngineHandle, id: &str, n: u32) -> (Vec<TokenId>, Vec<u32>) {
    let req = GenerateRequest {
        request_id: id.to_owned(),
        prompt: prompt(),
        params: {
            let mut params = SamplingParams::greedy(n);
            params.sampler.logprobs = Some(3);
            params
        },
        ..GenerateRequest::default()
    };
    let stream = engine.generate(req).await.unwrap();
    let c = tokio::time::timeout(BOUND, collect(stream)).await.unwrap();
    let bits = c
        .chunks
        .iter()
        .flat_map(|chunk| &chunk.logprobs)
        .flat_map(|l| std::iter::once(l.logprob).chain(l.top.iter().map(|t| t.1)))
        .map(f32::to_bits)
        .collect();
    (c.tokens, bits)
}

/// The RL loop's reload: paused with a request kept mid-generation, the folder is read over
/// the weights (no second copy), and after resume a new request's tokens and logprobs are
/// bit for bit a fresh engine's on the folder's weights; the kept request goes on, on the new
/// weights. Back again in place gives the first weights' logprobs; running, the same reload
/// reads into new weights.
#[tokio::test]
async fn a_reload_while_paused_is_in_place_and_gives_a_fresh_engines_logprobs() {
    let a = tiny_model().weights;
    let b = random_weights(&tiny_config(), 5);
    let fresh_logprobs = |w: WeightStore| async move {
        let engine = engine(llama(&w), config());
        let out = generate_logprobs(&engine, "fresh", 8).await;
        engine.shutdown().await.unwrap();
        out
    };
    let (want_a, want_b) = (
        fresh_logprobs(a.clone()).await,
        fresh_logprobs(b.clone()).await,
    );
    assert_ne!(want_a.1, want_b.1);
    let tmp = tempfile::tempdir().unwrap();
    let folder = |name: &str, weights: &WeightStore| {
        let mut model = tiny_model();
        model.weights = weights.clone();
        let dir = tmp.path().join(name);
        write_hf_folder(&model, &dir).unwrap();
        dir
    };
    let (dir_a, dir_b) = (folder("a", &a), folder("b", &b));

    // A long request held inside its first step; the pause comes behind it and keeps it.
    let (exec, mut gate) = gated(llama(&a));
    let engine = engine(exec, config());
    let bytes = engine.weight_info().await.unwrap().n_bytes;
    let long = GenerateRequest {
        request_id: "long".into(),
        prompt: prompt(),
        params: SamplingParams::greedy(40),
        ..GenerateRequest::default()
    };
    let stream = engine.generate(long).await.unwrap();
    let kept = tokio::spawn(async move { tokio::time::timeout(BOUND, collect(stream)).await });
    gate.next_step().await;
    let e = engine.clone();
    let pause = tokio::spawn(async move { e.pause(PauseMode::Keep, false).await });
    while engine.n_queued_inputs() < 1 {
        tokio::task::yield_now().await;
    }
    gate.release();
    tokio::time::timeout(BOUND, pause)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let info = engine
        .update_weights_from_disk(dir_b.clone(), Some("b".into()))
        .await
        .unwrap();
    assert!(info.in_place && info.complete);
    assert_eq!(info.weight_version, "b");
    let w = engine.weight_info().await.unwrap();
    assert_eq!(w.residency, ferry_model::WeightResidency::Resident);
    assert_eq!(w.n_bytes, bytes);
    assert!(
        engine.is_paused().await.unwrap(),
        "the pause stays the client's"
    );
    gate.open();
    engine.resume().await.unwrap();
    let kept = kept.await.unwrap().unwrap();
    assert_eq!(
        kept.reason(),
        FinishReason::Length,
        "the kept request was not lost"
    );
    assert_eq!(kept.tokens.len(), 40);
    assert_eq!(kept.finish.unwrap().weight_versions, ["base", "b"]);
    assert_eq!(generate_logprobs(&engine, "after-b", 8).await, want_b);

    // And back, in place again.
    engine.pause(PauseMode::Abort, true).await.unwrap();
    let info = engine
        .update_weights_from_disk(dir_a.clone(), Some("a".into()))
        .await
        .unwrap();
    assert!(info.in_place);
    engine.resume().await.unwrap();
    assert_eq!(generate_logprobs(&engine, "after-a", 8).await, want_a);

    // Running: into new weights, which replace these between two steps.
    let info = engine
        .update_weights_from_disk(dir_b, Some("b-running".into()))
        .await
        .unwrap();
    assert!(!info.in_place);
    assert_eq!(generate_logprobs(&engine, "running", 8).await, want_b);
    engine.shutdown().await.unwrap();
}
