//! P/D disaggregation through the HTTP API: two servers over two engines whose P/D connectors
//! share one in-memory fabric. P computes the prompt (`max_tokens: 1`, `do_remote_decode`)
//! and returns its `kv_transfer_params`; D, sent the original request with them, loads P's KV
//! and generates what a single engine generates. Bad parameters are a 400 naming the key;
//! forged ones fail closed under either load-failure policy, while an export the lifecycle
//! revoked is computed by D; a `remote_host` outside D's allowed KV peers is a 400.

use std::time::{Duration, Instant};

use ferry_engine::{AllowedPeers, InMemoryFabric, KvLoadFailurePolicy, PdRole};
use serde_json::{json, Value};

use crate::support::{ids, metric, start, start_with, Options, Pd, Server, MODEL};

const PROMPT: &str = "the quick brown fox and the lazy dog";

async fn pd_server(
    engine_id: &'static str,
    role: PdRole,
    fabric: &std::sync::Arc<InMemoryFabric>,
    policy: KvLoadFailurePolicy,
) -> Server {
    let pd = Pd {
        engine_id,
        role,
        fabric: fabric.clone(),
        policy,
    };
    start_with(Options::default(), Some(pd)).await
}

fn completion(max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

/// P's half: the request with `max_tokens: 1` and `do_remote_decode`; P's parameters.
async fn prefill(p: &Server, path: &str, body: &Value) -> Value {
    let mut body = body.clone();
    body["max_tokens"] = json!(1);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = p.ok(path, &body).await;
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    r["kv_transfer_params"].clone()
}

/// `body` with `kv_transfer_params`.
fn with_params(body: &Value, params: &Value) -> Value {
    let mut body = body.clone();
    body["kv_transfer_params"] = params.clone();
    body
}

/// Waits until `server`'s metric `name` reaches `want` (transfer ends arrive as worker
/// reports, after the responses).
async fn until_metric(server: &Server, name: &str, want: f64) {
    let started = Instant::now();
    loop {
        let text = server.metrics().await;
        if metric(&text, name) == want {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{name} != {want}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_generates_what_a_single_engine_generates() {
    let fabric = InMemoryFabric::new();
    let p = pd_server("P", PdRole::Producer, &fabric, KvLoadFailurePolicy::Fail).await;
    let d = pd_server("D", PdRole::Consumer, &fabric, KvLoadFailurePolicy::Fail).await;
    let single = start(Options::default()).await;

    // Completions, not streaming.
    let body = completion(12);
    let reference = single.ok("/v1/completions", &body).await;
    let params = prefill(&p, "/v1/completions", &body).await;
    let n_prompt = reference["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    assert_eq!(params["do_remote_decode"], false, "{params}");
    assert_eq!(params["remote_engine_id"], "P", "{params}");
    assert_eq!(params["remote_host"], "127.0.0.1", "{params}");
    assert_eq!(params["remote_port"], 1, "{params}");
    assert_eq!(params["n_tokens"].as_u64(), Some(n_prompt), "{params}");
    assert_eq!(
        ids(&params["remote_block_ids"]).len() as u64,
        n_prompt.div_ceil(4),
        "{params}"
    );
    let out = d.ok("/v1/completions", &with_params(&body, &params)).await;
    assert_eq!(
        ids(&out["choices"][0]["token_ids"]),
        ids(&reference["choices"][0]["token_ids"])
    );
    assert_eq!(out["choices"][0]["text"], reference["choices"][0]["text"]);
    assert!(out["kv_transfer_params"].is_null(), "{out}");
    // P counts an export's blocks once pulled (the bytes give one block's size); D counts
    // the blocks it fetched, which may leave out what it computes anyway.
    let n_blocks_1 = n_prompt.div_ceil(4) as f64;
    until_metric(&p, "ferry_kv_exports_pulled_total", 1.0).await;
    until_metric(&d, "ferry_kv_loads_finished_total", 1.0).await;
    let block_bytes = metric(&p.metrics().await, "ferry_kv_transfer_bytes_total") / n_blocks_1;
    assert!(
        block_bytes > 0.0 && block_bytes.fract() == 0.0,
        "{block_bytes}"
    );
    let bytes_1 = metric(&d.metrics().await, "ferry_kv_transfer_bytes_total");
    assert!(
        bytes_1 > 0.0 && bytes_1 <= n_blocks_1 * block_bytes,
        "{bytes_1}"
    );
    assert_eq!((bytes_1 / block_bytes).fract(), 0.0, "{bytes_1}");

    // Chat: P streaming (its parameters come on the finishing chunk), D with n = 2 (the
    // export is loaded once; the second choice takes prefix hits on it).
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let reference = single.ok("/v1/chat/completions", &chat).await;
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["max_tokens"] = json!(1);
    streamed["kv_transfer_params"] = json!({"do_remote_decode": true});
    let events = p.stream("/v1/chat/completions", &streamed).await;
    let with: Vec<&Value> = events
        .iter()
        .filter(|e| e.get("kv_transfer_params").is_some())
        .collect();
    assert_eq!(with.len(), 1, "{events:?}");
    assert_eq!(with[0]["choices"][0]["finish_reason"], "length");
    let params = with[0]["kv_transfer_params"].clone();
    let n_blocks_2 = ids(&params["remote_block_ids"]).len() as f64;
    let mut two = with_params(&chat, &params);
    two["n"] = json!(2);
    let out = d.ok("/v1/chat/completions", &two).await;
    let want = &reference["choices"][0]["message"]["content"];
    for i in 0..2 {
        assert_eq!(&out["choices"][i]["message"]["content"], want, "{out}");
    }

    // Two exports, both pulled; two loads, both landed.
    until_metric(&p, "ferry_kv_exports_started_total", 2.0).await;
    until_metric(&p, "ferry_kv_exports_pulled_total", 2.0).await;
    until_metric(&d, "ferry_kv_loads_finished_total", 2.0).await;
    let text = d.metrics().await;
    assert_eq!(metric(&text, "ferry_kv_loads_started_total"), 2.0);
    assert_eq!(metric(&text, "ferry_kv_loads_failed_total"), 0.0);
    let d_bytes = metric(&text, "ferry_kv_transfer_bytes_total");
    assert!(
        d_bytes > bytes_1 && d_bytes <= bytes_1 + n_blocks_2 * block_bytes,
        "{text}"
    );
    let p_bytes = metric(&p.metrics().await, "ferry_kv_transfer_bytes_total");
    assert_eq!(p_bytes, (n_blocks_1 + n_blocks_2) * block_bytes);
    assert_eq!(
        metric(&p.metrics().await, "ferry_kv_exports_expired_total"),
        0.0
    );
}

/// Forged parameters are invalid input: they fail closed under either policy, with a 500
/// that says why (streaming: the choice ends with `error`, then an error event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_parameters_fail_closed_under_either_policy() {
    let fabric = InMemoryFabric::new();
    let p = pd_server("P", PdRole::Producer, &fabric, KvLoadFailurePolicy::Fail).await;
    let d_fail = pd_server("D1", PdRole::Consumer, &fabric, KvLoadFailurePolicy::Fail).await;
    let d_recompute = pd_server(
        "D2",
        PdRole::Consumer,
        &fabric,
        KvLoadFailurePolicy::Recompute,
    )
    .await;
    let body = completion(8);
    let mut forged = prefill(&p, "/v1/completions", &body).await;
    forged["export_token"] = json!("0000000000000000000000000000000000000000000000000000");
    let forged_body = with_params(&body, &forged);

    // Not streaming: the whole request fails with a 500 that says why, under either policy.
    for d in [&d_fail, &d_recompute] {
        let (status, err) = d.post("/v1/completions", &forged_body).await;
        assert_eq!(status, 500, "{err}");
        assert_eq!(err["error"]["type"], "generation_error", "{err}");
        assert_eq!(err["error"]["code"], 500, "{err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("choice 0 failed: "), "{message}");
        assert!(message.contains("invalid"), "{message}");
    }

    // Streaming: the choice ends with `finish_reason: "error"`, then an error event.
    let mut streamed = forged_body.clone();
    streamed["stream"] = json!(true);
    let events = d_fail.stream("/v1/completions", &streamed).await;
    let (last, rest) = events.split_last().unwrap();
    assert_eq!(last["error"]["type"], "generation_error", "{events:?}");
    assert_eq!(last["error"]["code"], 500, "{events:?}");
    assert_eq!(
        rest.last().unwrap()["choices"][0]["finish_reason"],
        "error",
        "{events:?}"
    );
    assert_eq!(
        ids(&rest.last().unwrap()["choices"][0]["token_ids"]),
        Vec::<u64>::new()
    );
    // D cannot tell a forged token from a real one; P refuses the pull.
    until_metric(&d_recompute, "ferry_kv_loads_failed_total", 1.0).await;
    let text = d_recompute.metrics().await;
    assert_eq!(metric(&text, "ferry_kv_loads_started_total"), 1.0);
    assert_eq!(metric(&text, "ferry_kv_loads_finished_total"), 0.0);
    assert_eq!(metric(&text, "ferry_kv_transfer_bytes_total"), 0.0);
}

/// An export the lifecycle retracted (P's clearing pause revoked it) never fails a request:
/// D computes the prompt, under `fail` too, and gives one engine's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_export_is_computed_under_fail() {
    let fabric = InMemoryFabric::new();
    let admin = Options {
        admin_api: true,
        ..Options::default()
    };
    let pd = Pd {
        engine_id: "P",
        role: PdRole::Producer,
        fabric: fabric.clone(),
        policy: KvLoadFailurePolicy::Fail,
    };
    let p = start_with(admin, Some(pd)).await;
    let d = pd_server("D", PdRole::Consumer, &fabric, KvLoadFailurePolicy::Fail).await;
    let single = start(Options::default()).await;
    let body = completion(8);
    let reference = single.ok("/v1/completions", &body).await;
    let params = prefill(&p, "/v1/completions", &body).await;
    p.ok("/pause?mode=keep&clear_cache=true", &json!({})).await;
    p.ok("/resume", &json!({})).await;

    let out = d.ok("/v1/completions", &with_params(&body, &params)).await;
    assert_eq!(out["choices"][0]["finish_reason"], "length", "{out}");
    assert_eq!(
        ids(&out["choices"][0]["token_ids"]),
        ids(&reference["choices"][0]["token_ids"])
    );
    until_metric(&d, "ferry_kv_loads_failed_total", 1.0).await;
    assert_eq!(
        metric(&d.metrics().await, "ferry_kv_loads_finished_total"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_kv_transfer_params_are_a_400_naming_the_key() {
    let fabric = InMemoryFabric::new();
    let d = pd_server("D", PdRole::Consumer, &fabric, KvLoadFailurePolicy::Fail).await;
    let plain = start(Options::default()).await;
    let path = "/v1/completions";
    let with = |params: Value| with_params(&completion(4), &params);

    // Types, read with the rest of the body.
    for (params, key) in [
        (json!(5), "kv_transfer_params"),
        (
            json!({"remote_block_ids": "1,2"}),
            "kv_transfer_params.remote_block_ids",
        ),
        (
            json!({"remote_block_ids": [1, -1]}),
            "kv_transfer_params.remote_block_ids[1]",
        ),
        (
            json!({"remote_port": 70000}),
            "kv_transfer_params.remote_port",
        ),
        (
            json!({"do_remote_prefill": "yes"}),
            "kv_transfer_params.do_remote_prefill",
        ),
    ] {
        d.expect_error(path, &with(params), 400, Some(key)).await;
    }
    // Shapes.
    let good = json!({"do_remote_prefill": true, "remote_engine_id": "P",
                      "remote_block_ids": [1, 2], "export_token": "t",
                      "weight_version": "0", "n_tokens": 5});
    let mut missing = good.clone();
    missing.as_object_mut().unwrap().remove("export_token");
    let mut zero = good.clone();
    zero["n_tokens"] = json!(0);
    let mut empty = good;
    empty["remote_engine_id"] = json!("");
    for (params, key) in [
        (missing, "kv_transfer_params.export_token"),
        (zero, "kv_transfer_params.n_tokens"),
        (empty, "kv_transfer_params.remote_engine_id"),
        (json!({"remote_port": 0}), "kv_transfer_params.remote_port"),
    ] {
        d.expect_error(path, &with(params), 400, Some(key)).await;
    }
    // One prompt per export.
    let mut batch = with(json!({"do_remote_decode": true}));
    batch["prompt"] = json!(["a b", "c d"]);
    d.expect_error(path, &batch, 400, Some("kv_transfer_params"))
        .await;
    // Chat reads them the same way.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2, "kv_transfer_params": {"n_tokens": -3}});
    d.expect_error(
        "/v1/chat/completions",
        &chat,
        400,
        Some("kv_transfer_params.n_tokens"),
    )
    .await;
    // A consumer refuses to export: the connector refuses the request.
    d.expect_error(
        path,
        &with(json!({"do_remote_decode": true})),
        400,
        Some("kv_transfer_params"),
    )
    .await;
    // A server without --kv-role refuses transfers, and takes inactive parameters.
    plain
        .expect_error(
            path,
            &with(json!({"do_remote_decode": true})),
            400,
            Some("kv_transfer_params.do_remote_decode"),
        )
        .await;
    let out = plain
        .ok(path, &with(json!({"do_remote_decode": false, "x": 1})))
        .await;
    assert!(out["kv_transfer_params"].is_null(), "{out}");
}

/// D refuses a load from a `remote_host` outside its allowed KV peers before anything
/// connects (a 400 naming the key); a name inside them is resolved once and its address is
/// what the engine connects to (the connector itself takes addresses only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_host_must_be_an_allowed_kv_peer() {
    let fabric = InMemoryFabric::new();
    let p = pd_server("P", PdRole::Producer, &fabric, KvLoadFailurePolicy::Fail).await;
    let only_2 = Options {
        kv_allowed_peers: AllowedPeers::parse("127.0.0.2").unwrap(),
        ..Options::default()
    };
    let pd = Pd {
        engine_id: "D",
        role: PdRole::Consumer,
        fabric: fabric.clone(),
        policy: KvLoadFailurePolicy::Fail,
    };
    let d = start_with(only_2, Some(pd)).await;
    let body = completion(6);
    let params = prefill(&p, "/v1/completions", &body).await;
    assert_eq!(params["remote_host"], "127.0.0.1", "{params}");
    let (status, err) = d
        .post("/v1/completions", &with_params(&body, &params))
        .await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(
        err["error"]["param"], "kv_transfer_params.remote_host",
        "{err}"
    );
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("not an allowed KV peer"), "{message}");
    assert!(message.contains("--kv-allowed-peers"), "{message}");
    // Refused at the edge: the engine never started a load.
    let text = d.metrics().await;
    assert_eq!(metric(&text, "ferry_kv_loads_started_total"), 0.0, "{text}");

    // A D with the default peers (loopback), sent P's parameters with a name for the host:
    // it loads (the connector would refuse a name), and generates one engine's tokens.
    let d = pd_server("D2", PdRole::Consumer, &fabric, KvLoadFailurePolicy::Fail).await;
    let single = start(Options::default()).await;
    let reference = single.ok("/v1/completions", &body).await;
    let mut named = params;
    named["remote_host"] = json!("localhost");
    let out = d.ok("/v1/completions", &with_params(&body, &named)).await;
    assert_eq!(
        ids(&out["choices"][0]["token_ids"]),
        ids(&reference["choices"][0]["token_ids"])
    );
    until_metric(&d, "ferry_kv_loads_finished_total", 1.0).await;
}
