//! The engine's own failure over HTTP: a broken invariant on the engine thread (a double
//! free, which the block pool's assert catches in every build) fails the engine, and the
//! server says so, naming it, everywhere: `/health`, the requests in flight, every later
//! request and admin call. Nothing hangs.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry_engine::testing::DOUBLE_FREE;
use serde_json::{json, Value};

use crate::support::*;

/// The OpenAI error body's message, after checking it is a 500 of `kind`.
fn message_of(status: u16, body: &Value, kind: &str) -> String {
    assert_eq!(status, 500, "{body}");
    let error = &body["error"];
    assert_eq!(
        (error["code"].as_u64(), error["type"].as_str()),
        (Some(500), Some(kind)),
        "{body}"
    );
    error["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_double_free_fails_the_engine_and_every_call_gets_a_500_naming_it() {
    let s = start(Options {
        admin_api: true,
        ..Options::default()
    })
    .await;
    let failed = format!("the engine failed: {DOUBLE_FREE}");
    let completion = |stream: bool| json!({"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": stream});
    assert_eq!(s.get("/health").await.status().as_u16(), 200);
    s.ok("/v1/completions", &completion(false)).await;

    // Two requests in flight, one streaming: accepted while the engine is paused (kept), so
    // both are in the step that fails, the first after the resume.
    s.admin_ok("/pause?mode=keep&clear_cache=false").await;
    let plain = s
        .http
        .post(s.url("/v1/completions"))
        .json(&completion(false));
    let plain = tokio::spawn(async move {
        let resp = plain.send().await.unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    });
    let streamed = s
        .http
        .post(s.url("/v1/completions"))
        .json(&completion(true));
    let streamed = tokio::spawn(async move {
        let resp = streamed.send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(&s.metrics().await, "ferry_num_requests_waiting") != 2.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the requests never queued"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.double_free.store(true, Ordering::SeqCst);
    s.admin_ok("/resume").await;

    // The request in flight: a 500 whose message names the failure.
    let (status, body) = plain.await.unwrap();
    assert_eq!(
        message_of(status, &body, "generation_error"),
        format!("choice 0 failed: {failed}")
    );
    // The stream in flight: its last event names the failure.
    let (status, text) = streamed.await.unwrap();
    assert_eq!(status, 200, "{text}");
    let events = parse_sse(&text);
    let last = events.last().unwrap();
    assert_eq!(
        message_of(500, last, "generation_error"),
        format!("choice 0 failed: {failed}"),
        "{text}"
    );

    // /health: a 500 naming the failure (a stopped engine is a 503).
    let health = s.get("/health").await;
    let status = health.status().as_u16();
    let body: Value = health.json().await.unwrap();
    assert_eq!(message_of(status, &body, "internal_server_error"), failed);
    // Every later request and admin call.
    let (status, body) = s.post("/v1/completions", &completion(false)).await;
    assert_eq!(message_of(status, &body, "internal_server_error"), failed);
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(message_of(status, &body, "internal_server_error"), failed);
    for call in ["/reset_prefix_cache", "/pause", "/sleep?level=1"] {
        let (status, body) = s.admin(call).await;
        assert_eq!(
            message_of(status, &body, "internal_server_error"),
            failed,
            "{call}"
        );
    }
    let is_paused = s.get("/is_paused").await;
    let status = is_paused.status().as_u16();
    let body: Value = is_paused.json().await.unwrap();
    assert_eq!(message_of(status, &body, "internal_server_error"), failed);
}
