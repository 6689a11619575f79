//! The admin API with the engine idle: every endpoint and SGLang alias answers with the
//! documented shape and moves the lifecycle state as it should; every bad argument is a 4xx
//! that names it and changes nothing; weight pushes are validated; the API is a 404 unless
//! enabled. Under load: `admin_load.rs`.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{metric, start, Options, Server};

/// The tiny model's weights in f32, as it is served: the 4-byte values of its 112,448
/// parameters (`GET /weight_info`'s `weight_bytes`).
const TINY_F32_BYTES: u64 = 4 * 112_448;

/// Every admin reply must come within this bound.
pub const BOUND: Duration = Duration::from_secs(10);

pub async fn admin_server() -> Server {
    start(Options {
        admin_api: true,
        ..Options::default()
    })
    .await
}

/// Awaits `f` within [`BOUND`].
pub async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not answer within {BOUND:?}"))
}

impl Server {
    /// POSTs to an admin route with no body; expects 200 within the bound.
    pub async fn admin_ok(&self, path_and_query: &str) -> Value {
        let (status, json) = bounded(path_and_query, self.admin(path_and_query)).await;
        assert_eq!(status, 200, "{path_and_query} -> {json}");
        json
    }

    /// POSTs `body` as JSON to an admin route; expects 200 within the bound.
    pub async fn admin_json_ok(&self, path: &str, body: &Value) -> Value {
        let (status, json) = bounded(path, self.post(path, body)).await;
        assert_eq!(status, 200, "{path} {body} -> {json}");
        json
    }

    /// GETs an admin route; expects 200 within the bound.
    pub async fn admin_get(&self, path: &str) -> Value {
        let (status, json) = bounded(path, self.send_json(self.http.get(self.url(path)))).await;
        assert_eq!(status, 200, "{path} -> {json}");
        json
    }

    pub async fn is_paused(&self) -> bool {
        self.admin_get("/is_paused").await["is_paused"]
            .as_bool()
            .unwrap()
    }

    pub async fn is_sleeping(&self) -> bool {
        self.admin_get("/is_sleeping").await["is_sleeping"]
            .as_bool()
            .unwrap()
    }

    /// Sends `req` (an admin call) and expects `status` with an OpenAI error naming `param`.
    pub async fn expect_admin_error(
        &self,
        req: reqwest::RequestBuilder,
        what: &str,
        status: u16,
        param: Option<&str>,
    ) -> Value {
        let (got, json) = bounded(what, self.send_json(req)).await;
        assert_eq!(got, status, "{what} -> {json}");
        assert_eq!(json["error"]["param"].as_str(), param, "{what} -> {json}");
        assert_eq!(json["error"]["code"].as_u64(), Some(u64::from(status)));
        assert!(!json["error"]["message"].as_str().unwrap().is_empty());
        json
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_are_404_unless_enabled() {
    let s = start(Options::default()).await;
    for path in [
        "/pause",
        "/resume",
        "/sleep",
        "/update_weights",
        "/flush_cache",
    ] {
        let (status, json) = s.admin(path).await;
        assert_eq!(status, 404, "{path} -> {json}");
        assert_eq!(json["error"]["code"], 404);
    }
    assert_eq!(s.get("/is_paused").await.status().as_u16(), 404);
    // The engine was not touched.
    assert!(!s.engine.is_paused().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_sleep_cycles_idle() {
    let s = admin_server().await;
    assert!(!s.is_paused().await);
    assert!(!s.is_sleeping().await);
    for query in [
        "",
        "?mode=abort",
        "?mode=wait&clear_cache=false",
        "?mode=keep",
        "?wait_for_inflight_requests=true",
    ] {
        let reply = s.admin_ok(&format!("/pause{query}")).await;
        assert_eq!(reply, json!({"status": "paused"}), "{query}");
        assert!(s.is_paused().await, "{query}");
        assert_eq!(s.admin_ok("/resume").await, json!({"status": "resumed"}));
        assert!(!s.is_paused().await, "{query}");
    }
    // A resume with nothing paused is fine.
    s.admin_ok("/resume").await;

    // Sleep level 1, woken one tag at a time: asleep until both are back, then scheduling
    // resumes by itself.
    let reply = s.admin_ok("/sleep?level=1&mode=wait").await;
    assert_eq!(reply, json!({"status": "sleeping", "level": 1}));
    assert!(s.is_sleeping().await && s.is_paused().await);
    assert_eq!(weight_info(&s).await["residency"], "offloaded");
    let reply = s.admin_ok("/wake_up?tags=weights").await;
    assert_eq!(reply, json!({"is_sleeping": true}));
    assert_eq!(weight_info(&s).await["residency"], "resident");
    let reply = s.admin_ok("/wake_up?tags=kv_cache").await;
    assert_eq!(reply, json!({"is_sleeping": false}));
    assert!(!s.is_paused().await);

    // Level 0 (the default mode, abort) only pauses; a wake-up with no tags resumes.
    s.admin_ok("/sleep?level=0").await;
    assert!(s.is_paused().await);
    assert_eq!(s.admin_ok("/wake_up").await, json!({"is_sleeping": false}));
    assert!(!s.is_paused().await);

    // Both tags in one call.
    s.admin_ok("/sleep").await;
    assert!(s.is_sleeping().await);
    s.admin_ok("/wake_up?tags=weights&tags=kv_cache").await;
    assert!(!s.is_sleeping().await && !s.is_paused().await);
    assert_generates(&s).await;
}

/// Engine bug (reported to the lead): a sleep on an engine paused by the client marks the
/// pause as the sleep's own, so the wake-up resumes it. A trainer that pauses, sleeps, wakes
/// and only then updates the weights gets tokens from the old weights in between; SGLang's
/// pause_generation → release → resume_memory_occupation → continue_generation relies on the
/// pause lasting until continue_generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_keeps_a_pause_that_came_before_the_sleep() {
    let s = admin_server().await;
    s.admin_ok("/pause?mode=keep&clear_cache=false").await;
    s.admin_ok("/sleep?level=1&mode=keep").await;
    s.admin_ok("/wake_up").await;
    assert!(!s.is_sleeping().await);
    assert!(
        s.is_paused().await,
        "the wake-up resumed a pause the client made before the sleep"
    );
    s.admin_ok("/resume").await;
    assert!(!s.is_paused().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_kv_cache_memory_needs_a_pause_and_wakes_with_kv_cache() {
    let s = admin_server().await;
    let err = s
        .expect_admin_error(
            s.http.post(s.url("/release_kv_cache_memory")),
            "release without pause",
            409,
            None,
        )
        .await;
    assert_eq!(err["error"]["type"], "conflict_error");
    s.admin_ok("/pause?mode=keep&clear_cache=false").await;
    assert_eq!(
        s.admin_ok("/release_kv_cache_memory").await,
        json!({"status": "released"})
    );
    assert!(s.is_sleeping().await);
    // Resuming with the KV memory released is a conflict, not a crash.
    s.expect_admin_error(s.http.post(s.url("/resume")), "resume", 409, None)
        .await;
    s.admin_ok("/wake_up?tags=kv_cache").await;
    assert!(!s.is_sleeping().await);
    // The pause came from /pause, so it lasts until /resume.
    assert!(s.is_paused().await);
    s.admin_ok("/resume").await;
    assert_generates(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_reset_abort_and_weight_version_idle() {
    let s = admin_server().await;
    // Back to back, and concurrently: every call answers.
    for _ in 0..2 {
        assert_eq!(
            s.admin_ok("/reset_prefix_cache").await,
            json!({"success": true, "cleared": ["device"]})
        );
    }
    let query = "/reset_prefix_cache?reset_running_requests=true&reset_external=true";
    let (a, b) = tokio::join!(s.admin_ok(query), s.admin_ok(query));
    assert_eq!(
        (a["success"].as_bool(), b["success"].as_bool()),
        (Some(true), Some(true))
    );

    let none = json!({"status": "aborted", "aborted": 0});
    assert_eq!(s.admin_ok("/abort_requests").await, none);
    assert_eq!(s.admin_json_ok("/abort_requests", &json!({})).await, none);
    let ids = json!({"request_ids": ["no-such-request"]});
    assert_eq!(s.admin_json_ok("/abort_requests", &ids).await, none);

    assert_eq!(
        weight_info(&s).await,
        json!({"weight_version": "0", "n_weight_updates": 0, "residency": "resident", "weight_bytes": TINY_F32_BYTES})
    );
    let reply = s
        .admin_json_ok("/update_weight_version", &json!({"new_version": "v2"}))
        .await;
    assert_eq!(reply, json!({"success": true, "new_version": "v2"}));
    assert_eq!(weight_info(&s).await["weight_version"], "v2");
    assert_eq!(
        s.admin_get("/get_weight_version").await,
        json!({"weight_version": "v2"})
    );
    let m = s.metrics().await;
    assert_eq!(
        metric(&m, r#"ferry_weight_version_info{version="v2"}"#),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_aliases_idle() {
    let s = admin_server().await;
    let paused = json!({"message": "Generation paused successfully.", "status": "ok"});
    let continued = json!({"message": "Generation continued successfully.", "status": "ok"});
    for mode in [None, Some("abort"), Some("retract"), Some("in_place")] {
        let body = mode.map_or(json!({}), |m| json!({"mode": m}));
        assert_eq!(s.admin_json_ok("/pause_generation", &body).await, paused);
        assert!(s.is_paused().await, "{mode:?}");
        let m = s.metrics().await;
        assert_eq!(metric(&m, "ferry_engine_paused"), 1.0);
        assert_eq!(s.admin_ok("/continue_generation").await, continued);
        assert!(!s.is_paused().await, "{mode:?}");
    }
    let flushed = json!({"success": true, "message": "Cache flushed.", "cleared": ["device"]});
    assert_eq!(s.admin_ok("/flush_cache").await, flushed);
    assert_eq!(s.admin_get("/flush_cache").await, flushed);

    // Only the named memory stays released; resuming it continues generation.
    let kv = json!({"tags": ["kv_cache"]});
    s.admin_json_ok("/release_memory_occupation", &kv).await;
    assert!(s.is_sleeping().await && s.is_paused().await);
    assert_eq!(weight_info(&s).await["residency"], "resident");
    s.admin_json_ok("/resume_memory_occupation", &kv).await;
    assert!(!s.is_sleeping().await && !s.is_paused().await);

    let weights = json!({"tags": ["weights"]});
    s.admin_json_ok("/release_memory_occupation", &weights)
        .await;
    assert_eq!(weight_info(&s).await["residency"], "offloaded");
    assert!(s.is_sleeping().await && s.is_paused().await);
    s.admin_json_ok("/resume_memory_occupation", &weights).await;
    assert!(!s.is_sleeping().await && !s.is_paused().await);

    // No tags: everything (a GET with no body, as some clients send it).
    let (status, _) = s
        .send_json(s.http.get(s.url("/release_memory_occupation")))
        .await;
    assert_eq!(status, 200);
    assert_eq!(weight_info(&s).await["residency"], "offloaded");
    let all = json!({"tags": ["weights", "kv_cache", "cuda_graph"]});
    assert_eq!(
        s.admin_json_ok("/resume_memory_occupation", &all).await,
        json!({"success": true})
    );
    assert!(!s.is_sleeping().await && !s.is_paused().await);
    assert_generates(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_4xx_naming_them_and_change_nothing() {
    let s = admin_server().await;
    let post = |path: &str| s.http.post(s.url(path));
    let cases: Vec<(&str, Option<Value>, Option<&str>)> = vec![
        ("/pause?mode=nap", None, Some("mode")),
        ("/pause?clear_cache=maybe", None, Some("clear_cache")),
        ("/pause?clear_cach=false", None, Some("clear_cach")),
        (
            "/pause?wait_for_inflight_requests=2",
            None,
            Some("wait_for_inflight_requests"),
        ),
        ("/resume?now=1", None, Some("now")),
        ("/sleep?level=3", None, Some("level")),
        ("/sleep?level=one", None, Some("level")),
        ("/sleep?mode=deep", None, Some("mode")),
        ("/wake_up?tags=gpu", None, Some("tags")),
        ("/wake_up?tags=weights&tags=", None, Some("tags")),
        (
            "/reset_prefix_cache?reset_running_requests=2",
            None,
            Some("reset_running_requests"),
        ),
        (
            "/reset_prefix_cache?reset_external=x",
            None,
            Some("reset_external"),
        ),
        (
            "/abort_requests",
            Some(json!({"request_ids": "a"})),
            Some("request_ids"),
        ),
        (
            "/abort_requests",
            Some(json!({"request_ids": [1]})),
            Some("request_ids[0]"),
        ),
        (
            "/update_weights_from_disk",
            Some(json!({})),
            Some("model_path"),
        ),
        (
            "/update_weights_from_disk",
            Some(json!({"model_path": ""})),
            Some("model_path"),
        ),
        (
            "/update_weights_from_disk",
            Some(json!({"model_path": 7})),
            Some("model_path"),
        ),
        (
            "/update_weights_from_disk",
            Some(json!({"model_path": "/nonexistent/model-folder"})),
            Some("model_path"),
        ),
        (
            "/update_weights_from_disk",
            Some(json!({"model_path": "/tmp", "weight_version": ""})),
            Some("weight_version"),
        ),
        (
            "/update_weight_version",
            Some(json!({})),
            Some("new_version"),
        ),
        (
            "/update_weight_version",
            Some(json!({"new_version": ""})),
            Some("new_version"),
        ),
        (
            "/pause_generation",
            Some(json!({"mode": "later"})),
            Some("mode"),
        ),
        (
            "/release_memory_occupation",
            Some(json!({"tags": ["gpu"]})),
            Some("tags"),
        ),
        (
            "/resume_memory_occupation",
            Some(json!({"tags": "weights"})),
            Some("tags"),
        ),
    ];
    for (path, body, param) in cases {
        let req = match &body {
            Some(b) => post(path).json(b),
            None => post(path),
        };
        let what = format!("{path} {body:?}");
        s.expect_admin_error(req, &what, 400, param).await;
    }
    // Malformed JSON bodies: a 400 about the body as a whole.
    for path in [
        "/abort_requests",
        "/update_weights_from_disk",
        "/pause_generation",
    ] {
        s.expect_admin_error(post(path).body("{"), path, 400, None)
            .await;
    }
    // Nothing changed.
    assert!(!s.is_paused().await && !s.is_sleeping().await);
    assert_eq!(
        weight_info(&s).await,
        json!({"weight_version": "0", "n_weight_updates": 0, "residency": "resident", "weight_bytes": TINY_F32_BYTES})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_weight_pushes_are_400s_naming_the_tensor_and_change_nothing() {
    let s = admin_server().await;
    let before = generate_ids(&s).await;
    let push = |body: Vec<u8>| {
        s.http
            .post(s.url("/update_weights?weight_version=v9"))
            .header("content-type", "application/octet-stream")
            .body(body)
    };
    let norm = tiny_tensor("model.norm.weight");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty body", Vec::new(), "body"),
        ("not safetensors", b"hello".to_vec(), "body"),
        ("no tensors", safetensors_bytes(&[]), "body"),
        (
            "unknown tensor",
            safetensors_bytes(&[("model.nope.weight", f32_tensor(vec![2], &[1.0, 2.0]))]),
            "model.nope.weight",
        ),
        (
            "bad dtype",
            safetensors_bytes(&[(
                "model.norm.weight",
                Raw {
                    dtype: safetensors::Dtype::I32,
                    shape: norm.shape.clone(),
                    data: vec![0; norm.data.len() * 4],
                },
            )]),
            "model.norm.weight",
        ),
    ];
    for (what, body, param) in cases {
        s.expect_admin_error(push(body), what, 400, Some(param))
            .await;
    }
    s.expect_admin_error(
        s.http.post(s.url("/update_weights?weight_version=")),
        "empty version",
        400,
        Some("weight_version"),
    )
    .await;
    // Nothing changed: same version, no update counted, same tokens.
    assert_eq!(weight_info(&s).await["n_weight_updates"], 0);
    assert_eq!(weight_info(&s).await["weight_version"], "0");
    assert_eq!(generate_ids(&s).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_with_a_bad_shape_names_the_tensor_and_the_shape() {
    let s = admin_server().await;
    let body = safetensors_bytes(&[("model.norm.weight", f32_tensor(vec![3], &[1.0; 3]))]);
    let err = s
        .expect_admin_error(
            s.http.post(s.url("/update_weights")).body(body),
            "bad shape",
            400,
            Some("model.norm.weight"),
        )
        .await;
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("shape"), "{message}");
    assert_eq!(weight_info(&s).await["n_weight_updates"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_weights_change_the_output_and_its_weight_version() {
    let s = admin_server().await;
    let before = generate(&s).await;
    assert_eq!(before["choices"][0]["weight_versions"], json!(["0"]));
    // Negated final-norm weights negate the logits: greedy picks other tokens.
    let norm = tiny_tensor("model.norm.weight");
    let negated: Vec<f32> = norm.data.iter().map(|x| -x).collect();
    let body = safetensors_bytes(&[(
        "model.norm.weight",
        f32_tensor(norm.shape.clone(), &negated),
    )]);
    let (status, reply) = bounded(
        "push",
        s.send_json(
            s.http
                .post(s.url("/update_weights?weight_version=v7"))
                .header("content-type", "application/octet-stream")
                .body(body),
        ),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["weight_version"], "v7");
    assert_eq!(reply["n_tensors"], 1);
    assert_eq!(reply["complete"], false);
    assert_eq!(
        weight_info(&s).await,
        json!({"weight_version": "v7", "n_weight_updates": 1, "residency": "resident", "weight_bytes": TINY_F32_BYTES})
    );
    let after = generate(&s).await;
    assert_eq!(after["choices"][0]["weight_versions"], json!(["v7"]));
    assert_ne!(
        after["choices"][0]["token_ids"], before["choices"][0]["token_ids"],
        "the pushed weights did not change the output"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_weight_version_never_hits_the_old_prefix_cache() {
    let s = admin_server().await;
    let body = json!({"prompt": "the quick brown fox jumps over the lazy dog again and again",
                      "max_tokens": 2, "temperature": 0});
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    s.ok("/v1/completions", &body).await;
    let again = s.ok("/v1/completions", &body).await;
    assert!(cached(&again) > Some(0), "{again}");
    // No reset: the version alone keeps the old entries from being hit.
    s.admin_json_ok("/update_weight_version", &json!({"new_version": "v2"}))
        .await;
    let after = s.ok("/v1/completions", &body).await;
    assert_eq!(cached(&after), Some(0), "{after}");
    assert_eq!(after["choices"][0]["weight_versions"], json!(["v2"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_from_disk_after_sleep_level_2_wakes_the_engine() {
    let s = admin_server().await;
    let before = generate(&s).await;
    let dir = tempfile::tempdir().unwrap();
    ferry_engine::testing::write_tiny_folder(dir.path()).unwrap();
    s.admin_ok("/sleep?level=2").await;
    assert_eq!(weight_info(&s).await["residency"], "dropped");
    // The weights are gone: waking them is a conflict until new ones come.
    s.expect_admin_error(s.http.post(s.url("/wake_up")), "wake_up", 409, None)
        .await;
    assert!(s.is_sleeping().await);
    let reload = json!({"model_path": dir.path(), "weight_version": "step-1"});
    let reply = s.admin_json_ok("/update_weights_from_disk", &reload).await;
    assert_eq!(
        (&reply["weight_version"], &reply["complete"]),
        (&json!("step-1"), &json!(true))
    );
    s.admin_ok("/wake_up").await;
    assert!(!s.is_sleeping().await && !s.is_paused().await);
    let after = generate(&s).await;
    // The same weights again: the same tokens, under the new version.
    assert_eq!(
        after["choices"][0]["token_ids"],
        before["choices"][0]["token_ids"]
    );
    assert_eq!(after["choices"][0]["weight_versions"], json!(["step-1"]));
    assert_eq!(weight_info(&s).await["n_weight_updates"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_over_the_body_limit_is_a_413() {
    let s = start(Options {
        admin_api: true,
        max_weight_push_bytes: Some(1024),
        ..Options::default()
    })
    .await;
    let (status, json) = s
        .send_json(s.http.post(s.url("/update_weights")).body(vec![0u8; 4096]))
        .await;
    assert_eq!(status, 413, "{json}");
    assert_eq!(json["error"]["param"], "body");
    assert_eq!(weight_info(&s).await["n_weight_updates"], 0);
}

/// The tiny model's own weights as one safetensors body.
fn tiny_body() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    ferry_engine::testing::write_tiny_folder(dir.path()).unwrap();
    std::fs::read(dir.path().join("model.safetensors")).unwrap()
}

/// `body` sent chunked (no `Content-Length`), in pieces of `piece` bytes.
fn chunked(body: &[u8], piece: usize) -> reqwest::Body {
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(piece).map(|c| Ok(c.to_vec())).collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(pieces))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_push_in_small_chunks_gives_the_same_tokens() {
    let s = admin_server().await;
    let before = generate_ids(&s).await;
    // Pieces of 1000 bytes split elements and the header: the body is converted as it comes.
    let (status, reply) = bounded(
        "push",
        s.send_json(
            s.http
                .post(s.url("/update_weights?weight_version=same"))
                .header("content-type", "application/octet-stream")
                .body(chunked(&tiny_body(), 1000)),
        ),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        (&reply["complete"], &reply["weight_version"]),
        (&json!(true), &json!("same"))
    );
    // The same weights, bit for bit: the same tokens.
    assert_eq!(generate_ids(&s).await, before);
    assert_eq!(weight_info(&s).await["n_weight_updates"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_are_not_held_to_the_json_body_limit() {
    let s = admin_server().await;
    // Over the 32 MiB limit of the JSON routes: read in full, then refused as not safetensors.
    let (status, json) = s
        .send_json(
            s.http
                .post(s.url("/update_weights"))
                .body(vec![b'x'; 40 << 20]),
        )
        .await;
    assert_eq!(status, 400, "{json}");
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("safetensors"),
        "{json}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_engine_makes_admin_calls_503() {
    let s = admin_server().await;
    s.engine.shutdown().await.unwrap();
    for path in ["/pause", "/resume", "/reset_prefix_cache", "/flush_cache"] {
        s.expect_admin_error(s.http.post(s.url(path)), path, 503, None)
            .await;
    }
    let (status, _) = s.send_json(s.http.get(s.url("/is_paused"))).await;
    assert_eq!(status, 503);
}

pub async fn weight_info(s: &Server) -> Value {
    s.admin_get("/weight_info").await
}

/// A short greedy completion with token ids.
pub async fn generate(s: &Server) -> Value {
    let body = json!({"prompt": "hello there", "max_tokens": 6, "ignore_eos": true,
                      "temperature": 0, "return_token_ids": true});
    bounded("generate", s.ok("/v1/completions", &body)).await
}

async fn generate_ids(s: &Server) -> Value {
    generate(s).await["choices"][0]["token_ids"].clone()
}

async fn assert_generates(s: &Server) {
    let out = generate(s).await;
    assert_eq!(out["choices"][0]["finish_reason"], "length", "{out}");
}

fn tiny_tensor(name: &str) -> ferry_engine::Tensor {
    ferry_engine::testing::tiny_model()
        .weights
        .get(name)
        .unwrap_or_else(|| panic!("the tiny model has no {name}"))
        .clone()
}

/// A tensor for a safetensors body.
struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn f32_tensor(shape: Vec<usize>, values: &[f32]) -> Raw {
    Raw {
        dtype: safetensors::Dtype::F32,
        shape,
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn safetensors_bytes(tensors: &[(&str, Raw)]) -> Vec<u8> {
    let views = tensors.iter().map(|(name, t)| {
        let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap();
        (name.to_string(), view)
    });
    safetensors::serialize(views, None).unwrap()
}
