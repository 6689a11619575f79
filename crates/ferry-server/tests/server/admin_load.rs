//! The admin API with requests streaming through the engine: every call answers within the
//! bound, no request is lost (every stream ends with a finish_reason), abort pauses end
//! streams with `abort`, keep pauses and sleeps continue after resume with exactly the
//! tokens an unpaused run gives (greedy), and a resume cancels a pending cache-clearing
//! pause with a 409.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::admin::{bounded, BOUND};
use crate::support::{ids, metric, start, Options, Server};

const N_TOKENS: usize = 40;
const PROMPTS: [&str; 3] = ["hello there", "the quick brown fox", "one two three"];

async fn slow_admin_server() -> Server {
    start(Options {
        admin_api: true,
        step_delay: Duration::from_millis(5),
        ..Options::default()
    })
    .await
}

fn body(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": N_TOKENS, "ignore_eos": true, "temperature": 0,
           "return_token_ids": true, "stream": stream})
}

/// What one streamed choice produced.
#[derive(Debug, Clone, PartialEq)]
struct Streamed {
    tokens: Vec<u64>,
    finish_reason: String,
    weight_versions: Value,
}

/// Starts a streaming completion on its own task (with `X-Request-Id: request_id`).
fn spawn_stream(s: &Server, prompt: &str, request_id: &str) -> tokio::task::JoinHandle<Streamed> {
    let req = s
        .http
        .post(s.url("/v1/completions"))
        .header("x-request-id", request_id)
        .json(&body(prompt, true));
    tokio::spawn(async move {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let events = crate::support::parse_sse(&resp.text().await.unwrap());
        streamed(&events)
    })
}

fn streamed(events: &[Value]) -> Streamed {
    let choices: Vec<&Value> = events.iter().map(|e| &e["choices"][0]).collect();
    let last = choices.last().expect("no chunk");
    for c in &choices[..choices.len() - 1] {
        assert!(
            c["finish_reason"].is_null() && c.get("weight_versions").is_none(),
            "{c}"
        );
    }
    Streamed {
        tokens: choices.iter().flat_map(|c| ids(&c["token_ids"])).collect(),
        finish_reason: last["finish_reason"]
            .as_str()
            .expect("no finish_reason")
            .to_owned(),
        weight_versions: last["weight_versions"].clone(),
    }
}

/// Each prompt's greedy tokens, run alone on an unpaused engine.
async fn reference(s: &Server) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for p in PROMPTS {
        let r = s.ok("/v1/completions", &body(p, false)).await;
        out.push(ids(&r["choices"][0]["token_ids"]));
    }
    out
}

/// Waits (bounded) until the engine has generated `n` more tokens than `from`.
async fn wait_for_tokens(s: &Server, from: u64, n: u64) {
    let deadline = Instant::now() + BOUND;
    while s.engine.stats().n_generated_tokens_total < from + n {
        assert!(Instant::now() < deadline, "no tokens are flowing");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Starts one stream per prompt and waits until they are generating.
async fn start_streams(s: &Server, tag: &str) -> Vec<tokio::task::JoinHandle<Streamed>> {
    let from = s.engine.stats().n_generated_tokens_total;
    let streams = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| spawn_stream(s, p, &format!("{tag}-{i}")))
        .collect();
    wait_for_tokens(s, from, 2 * PROMPTS.len() as u64).await;
    streams
}

async fn finish_all(streams: Vec<tokio::task::JoinHandle<Streamed>>) -> Vec<Streamed> {
    let mut out = Vec::new();
    for s in streams {
        out.push(bounded("stream", s).await.unwrap());
    }
    out
}

/// Waits for every stream; each must end with `length`. Returns their tokens.
async fn finish_all_length(
    streams: Vec<tokio::task::JoinHandle<Streamed>>,
    context: &str,
) -> Vec<Vec<u64>> {
    let mut tokens = Vec::new();
    for o in finish_all(streams).await {
        assert_eq!(o.finish_reason, "length", "{context}: {o:?}");
        tokens.push(o.tokens);
    }
    tokens
}

/// No token is produced for a while (the engine is really paused).
async fn assert_frozen(s: &Server) {
    let before = s.engine.stats().n_generated_tokens_total;
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(s.engine.stats().n_generated_tokens_total, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_pause_ends_streams_with_abort_and_queues_new_requests() {
    let s = slow_admin_server().await;
    let streams = start_streams(&s, "abort").await;
    s.admin_ok("/pause").await;
    for out in finish_all(streams).await {
        assert_eq!(out.finish_reason, "abort", "{out:?}");
        assert!(out.tokens.len() < N_TOKENS, "{out:?}");
        assert_eq!(out.weight_versions, json!(["0"]));
    }
    assert!(s.is_paused().await);
    // A request that arrives while paused waits, and runs after the resume.
    let late = spawn_stream(&s, PROMPTS[0], "late");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!late.is_finished());
    s.admin_ok("/resume").await;
    let out = bounded("late stream", late).await.unwrap();
    assert_eq!(out.finish_reason, "length");
    assert_eq!(out.tokens, reference(&s).await[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_pauses_and_sleeps_continue_with_the_unpaused_tokens() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let cycles: [(&str, &str); 4] = [
        ("/pause?mode=keep&clear_cache=false", "/resume"),
        // The reset drops the frozen requests' KV: they recompute it after the resume.
        ("/pause?mode=keep&clear_cache=true", "/resume"),
        ("/sleep?level=1&mode=keep", "/wake_up"),
        ("/sleep?level=0&mode=keep", "/wake_up?tags=kv_cache"),
    ];
    for (pause, resume) in cycles {
        let streams = start_streams(&s, "keep").await;
        s.admin_ok(pause).await;
        assert!(s.is_paused().await, "{pause}");
        assert_frozen(&s).await;
        assert!(streams.iter().all(|t| !t.is_finished()), "{pause}");
        s.admin_ok(resume).await;
        assert!(!s.is_paused().await, "{pause}");
        assert_eq!(finish_all_length(streams, pause).await, want);
        s.engine.check_invariants().await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_kv_memory_comes_back_and_frozen_requests_recompute() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let streams = start_streams(&s, "release").await;
    s.admin_ok("/pause?mode=keep&clear_cache=false").await;
    s.admin_ok("/release_kv_cache_memory").await;
    assert!(s.is_sleeping().await);
    assert_frozen(&s).await;
    s.admin_ok("/wake_up?tags=kv_cache").await;
    s.admin_ok("/resume").await;
    assert_eq!(finish_all_length(streams, "").await, want);
    s.engine.check_invariants().await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_cancels_a_pending_sleep_with_a_409() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let streams = start_streams(&s, "pending-sleep").await;
    // A wait-mode sleep waits for the streams to drain; a wake-up first cancels it.
    let sleep = {
        let req = s.http.post(s.url("/sleep?level=1&mode=wait"));
        tokio::spawn(async move { req.send().await.unwrap().status().as_u16() })
    };
    // The sleep is taken (the engine admits nothing new) but still waits for the drain.
    let deadline = Instant::now() + BOUND;
    while !s.engine.is_paused().await.unwrap() {
        assert!(
            Instant::now() < deadline,
            "the sleep never reached the engine"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(!sleep.is_finished());
    s.admin_ok("/wake_up").await;
    assert_eq!(bounded("sleep", sleep).await.unwrap(), 409);
    assert_eq!(finish_all_length(streams, "").await, want);
    assert!(!s.is_sleeping().await && !s.is_paused().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_pause_replies_after_the_streams_finish() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let streams = start_streams(&s, "wait").await;
    s.admin_ok("/pause?mode=wait").await;
    // Every request finished in the engine before the pause replied.
    assert_eq!(s.engine.stats().scheduler.n_running, 0);
    assert_eq!(finish_all_length(streams, "").await, want);
    s.admin_ok("/resume").await;
}

// The guard is a std mutex on purpose: the engine thread (not a task) blocks on it, and the
// test holds it across awaits to keep the engine inside a step.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_cancels_a_pending_clear_cache_pause_with_a_409_and_loses_nothing() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let streams = start_streams(&s, "pending").await;
    // Hold the engine inside a step, so both calls queue behind it in this order.
    let guard = s.gate.lock().unwrap();
    let steps = s.n_steps.load(Ordering::SeqCst);
    let deadline = Instant::now() + BOUND;
    while s.n_steps.load(Ordering::SeqCst) == steps {
        assert!(Instant::now() < deadline, "the engine never entered a step");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let pause = {
        let req = s.http.post(s.url("/pause?mode=wait&clear_cache=true"));
        tokio::spawn(async move { req.send().await.unwrap() })
    };
    // Loopback delivers the pause to the engine's queue well within this.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resume = {
        let req = s.http.post(s.url("/resume"));
        tokio::spawn(async move { req.send().await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pause.is_finished() && !resume.is_finished());
    drop(guard);
    let pause = bounded("pause", pause).await.unwrap();
    assert_eq!(pause.status().as_u16(), 409);
    let err: Value = pause.json().await.unwrap();
    assert_eq!(err["error"]["type"], "conflict_error", "{err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("resume"),
        "{err}"
    );
    assert_eq!(
        bounded("resume", resume).await.unwrap().status().as_u16(),
        200
    );
    assert!(!s.is_paused().await);
    assert_eq!(finish_all_length(streams, "").await, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_resets_while_streaming_answer_and_keep_the_tokens() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let streams = start_streams(&s, "reset").await;
    // Running requests hold blocks: false, twice, never an error.
    for _ in 0..2 {
        assert_eq!(
            s.admin_ok("/reset_prefix_cache").await,
            json!({"success": false})
        );
    }
    let flush = s.expect_admin_error(s.http.post(s.url("/flush_cache")), "flush", 400, None);
    flush.await;
    // Preempting them first lets the reset through; they recompute and lose nothing.
    let query = "/reset_prefix_cache?reset_running_requests=true";
    let (a, b) = tokio::join!(s.admin_ok(query), s.admin_ok(query));
    assert_eq!(a["success"], true, "{a}");
    assert!(b["success"].is_boolean(), "{b}");
    assert_eq!(finish_all_length(streams, "").await, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_requests_by_request_id_and_all() {
    let s = slow_admin_server().await;
    let mut streams = start_streams(&s, "ab").await;
    let reply = s
        .admin_json_ok("/abort_requests", &json!({"request_ids": ["ab-0"]}))
        .await;
    assert_eq!(reply, json!({"status": "aborted", "aborted": 1}));
    let first = bounded("aborted stream", streams.remove(0)).await.unwrap();
    assert_eq!(first.finish_reason, "abort");
    assert!(streams.iter().all(|t| !t.is_finished()));
    let reply = s
        .admin_json_ok("/abort_requests", &json!({"request_ids": []}))
        .await;
    assert_eq!(reply, json!({"status": "aborted", "aborted": 2}));
    for out in finish_all(streams).await {
        assert_eq!(out.finish_reason, "abort");
    }
    assert!(!s.is_paused().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_in_abort_mode_ends_streams_and_frees_memory() {
    let s = slow_admin_server().await;
    let streams = start_streams(&s, "sleep").await;
    s.admin_ok("/sleep?level=1").await;
    for out in finish_all(streams).await {
        assert_eq!(out.finish_reason, "abort");
    }
    assert!(s.is_sleeping().await);
    assert_eq!(metric(&s.metrics().await, "ferry_engine_sleeping"), 1.0);
    s.admin_ok("/wake_up").await;
    assert!(!s.is_sleeping().await && !s.is_paused().await);
    let got = finish_all(vec![spawn_stream(&s, PROMPTS[1], "after")]).await;
    assert_eq!(got[0].tokens, reference(&s).await[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_report_their_weight_versions() {
    let s = slow_admin_server().await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                      "temperature": 0});
    let full = s.ok("/v1/chat/completions", &chat).await;
    assert_eq!(
        full["choices"][0]["weight_versions"],
        json!(["0"]),
        "{full}"
    );
    let mut streamed_chat = chat.clone();
    streamed_chat["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &streamed_chat).await;
    let last = &events.last().unwrap()["choices"][0];
    assert!(!last["finish_reason"].is_null());
    assert_eq!(last["weight_versions"], json!(["0"]), "{last}");
    assert!(events[..events.len() - 1]
        .iter()
        .all(|e| e["choices"][0].get("weight_versions").is_none()));

    // A rename while a request runs: its tokens came from both versions, in order.
    let stream = spawn_stream(&s, PROMPTS[0], "versions");
    wait_for_tokens(&s, s.engine.stats().n_generated_tokens_total, 3).await;
    s.admin_json_ok("/update_weight_version", &json!({"new_version": "v1"}))
        .await;
    let out = bounded("stream", stream).await.unwrap();
    assert_eq!(out.finish_reason, "length");
    assert_eq!(out.weight_versions, json!(["0", "v1"]));
    let after = s.ok("/v1/completions", &body(PROMPTS[0], false)).await;
    assert_eq!(after["choices"][0]["weight_versions"], json!(["v1"]));
}

/// The tiny model written as a folder (to reload from) and its safetensors file (to push).
fn tiny_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    ferry_engine::testing::write_tiny_folder(dir.path()).unwrap();
    dir
}

/// Finished streams' tokens, each checked to have run to its length.
async fn lengths(streams: Vec<tokio::task::JoinHandle<Streamed>>) -> Vec<Streamed> {
    let out = finish_all(streams).await;
    for o in &out {
        assert_eq!(o.finish_reason, "length", "{o:?}");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_updates_while_streaming_with_and_without_a_pause() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let dir = tiny_folder();
    let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();

    // Paused (keep): the same weights pushed under a new version; frozen requests continue.
    let streams = start_streams(&s, "push").await;
    s.admin_ok("/pause?mode=keep&clear_cache=false").await;
    let (status, reply) = bounded(
        "push",
        s.send_json(
            s.http
                .post(s.url("/update_weights?weight_version=v1"))
                .body(file.clone()),
        ),
    )
    .await;
    assert_eq!((status, &reply["complete"]), (200, &json!(true)), "{reply}");
    s.admin_ok("/resume").await;
    for (o, want) in lengths(streams).await.iter().zip(&want) {
        assert_eq!(&o.tokens, want);
        assert_eq!(o.weight_versions, json!(["0", "v1"]));
    }

    // Not paused: a reload between two steps; the streams never stop.
    let streams = start_streams(&s, "reload").await;
    let reload = json!({"model_path": dir.path(), "weight_version": "v2"});
    s.admin_json_ok("/update_weights_from_disk", &reload).await;
    for (o, want) in lengths(streams).await.iter().zip(&want) {
        assert_eq!(&o.tokens, want);
        assert_eq!(o.weight_versions, json!(["v1", "v2"]));
    }
    s.engine.check_invariants().await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_rl_cycle_while_streaming_loses_nothing() {
    let s = slow_admin_server().await;
    let want = reference(&s).await;
    let dir = tiny_folder();
    let streams = start_streams(&s, "sglang").await;
    s.admin_json_ok("/pause_generation", &json!({"mode": "in_place"}))
        .await;
    s.admin_json_ok("/release_memory_occupation", &json!({}))
        .await;
    assert!(s.is_sleeping().await);
    assert_frozen(&s).await;
    s.admin_json_ok("/resume_memory_occupation", &json!({"tags": ["weights"]}))
        .await;
    let reload = json!({"model_path": dir.path(), "weight_version": "step-1"});
    s.admin_json_ok("/update_weights_from_disk", &reload).await;
    s.admin_json_ok("/resume_memory_occupation", &json!({"tags": ["kv_cache"]}))
        .await;
    assert!(!s.is_sleeping().await);
    s.admin_ok("/continue_generation").await;
    for (o, want) in lengths(streams).await.iter().zip(&want) {
        // The release dropped their KV: recomputed under step-1, with the same weights.
        assert_eq!(&o.tokens, want);
        assert_eq!(o.weight_versions, json!(["0", "step-1"]));
    }
    assert_eq!(
        s.admin_get("/get_weight_version").await,
        json!({"weight_version": "step-1"})
    );
}
