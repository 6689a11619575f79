//! The small routes: models, version, tokenize/detokenize round trips, metrics that parse and
//! move, unknown routes.

use serde_json::json;

use crate::support::{ids, metric, start, Options, MAX_MODEL_LEN, MODEL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_version_and_unknown_routes() {
    let s = start(Options::default()).await;
    let models = s.get_json("/v1/models").await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(
        models["data"][0]["max_model_len"].as_u64(),
        Some(MAX_MODEL_LEN as u64)
    );
    let version = s.get_json("/version").await;
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));
    let resp = s.get("/v1/nope").await;
    assert_eq!(resp.status().as_u16(), 404);
    assert!(resp.headers().contains_key("x-request-id"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let s = start(Options::default()).await;
    let text = "hello there, the end";
    let t = s
        .ok(
            "/tokenize",
            &json!({"model": MODEL, "prompt": text, "return_token_strs": true}),
        )
        .await;
    assert_eq!(t["max_model_len"].as_u64(), Some(MAX_MODEL_LEN as u64));
    let tokens = ids(&t["tokens"]);
    assert_eq!(t["count"].as_u64(), Some(tokens.len() as u64));
    assert!(tokens.len() < text.len(), "merges should apply: {tokens:?}");
    assert_eq!(t["token_strs"].as_array().unwrap().len(), tokens.len());
    let d = s.ok("/detokenize", &json!({"tokens": t["tokens"]})).await;
    assert_eq!(d["prompt"], text);
    assert_eq!(
        s.ok("/tokenize", &json!({"prompt": text})).await["token_strs"],
        json!(null)
    );
    // Chat messages with and without the generation prompt.
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let with = s.ok("/tokenize", &json!({"messages": msgs})).await;
    let without = s
        .ok(
            "/tokenize",
            &json!({"messages": msgs, "add_generation_prompt": false}),
        )
        .await;
    assert!(with["count"].as_u64() > without["count"].as_u64());
    // Errors name the field.
    s.expect_error("/tokenize", &json!({}), 400, Some("prompt"))
        .await;
    s.expect_error(
        "/tokenize",
        &json!({"prompt": "x", "model": "other"}),
        404,
        Some("model"),
    )
    .await;
    s.expect_error(
        "/detokenize",
        &json!({"tokens": [1, 100000]}),
        400,
        Some("tokens[1]"),
    )
    .await;
    s.expect_error(
        "/detokenize",
        &json!({"tokens": "abc"}),
        400,
        Some("tokens"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_move() {
    // Slow steps, so that chunks arrive one token at a time and inter-token latency moves.
    let s = start(Options {
        step_delay: std::time::Duration::from_millis(2),
        ..Options::default()
    })
    .await;
    let before = s.metrics().await;
    assert!(before.ends_with("# EOF\n"));
    assert_eq!(metric(&before, "ferry_generation_tokens_total"), 0.0);
    assert_eq!(
        metric(&before, "ferry_time_to_first_token_seconds_count"),
        0.0
    );
    s.ok(
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 5, "ignore_eos": true, "stream": false}),
    )
    .await;
    let body = json!({"prompt": "hello", "max_tokens": 5, "ignore_eos": true, "stream": true});
    s.stream("/v1/completions", &body).await;
    // Every non-comment line is `name value` with a number.
    let after = s.metrics().await;
    for line in after.lines().filter(|l| !l.starts_with('#')) {
        let (_, v) = line.rsplit_once(' ').unwrap();
        v.parse::<f64>().unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    assert_eq!(metric(&after, "ferry_generation_tokens_total"), 10.0);
    assert_eq!(metric(&after, "ferry_requests_finished_total"), 2.0);
    assert_eq!(
        metric(&after, "ferry_time_to_first_token_seconds_count"),
        2.0
    );
    assert_eq!(metric(&after, "ferry_request_latency_seconds_count"), 2.0);
    let itl = metric(&after, "ferry_inter_token_latency_seconds_count");
    assert!((1.0..=8.0).contains(&itl), "{itl}");
    assert!(
        metric(&after, "ferry_engine_step_seconds_total")
            >= metric(&after, "ferry_engine_forward_seconds_total")
    );
    assert!(metric(&after, "ferry_engine_forward_seconds_total") > 0.0);
    assert!(metric(&after, "ferry_engine_steps_total") >= 5.0);
    assert_eq!(metric(&after, "ferry_kv_blocks_used"), 0.0);
    assert_eq!(metric(&after, "ferry_kv_blocks_total"), 512.0);
    // The second "hello" prompt hit the prefix cache? Too short for a full block of 4 tokens
    // plus one to compute, so the rate stays within [0, 1].
    let rate = metric(&after, "ferry_prefix_cache_hit_rate");
    assert!((0.0..=1.0).contains(&rate));
}
