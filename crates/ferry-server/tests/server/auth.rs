//! The API key: with one, every route but `/health` and `/metrics` needs `Authorization:
//! Bearer <key>` (admin routes and unknown paths included); a missing or wrong key is a 401
//! with an OpenAI error body that reaches nothing behind it.

use std::sync::atomic::Ordering;

use serde_json::{json, Value};

use crate::support::{start, Options, Server};

const KEY: &str = "sk-ferry-test-key-0123456789";

/// Every route the server has with the admin API on: (method, path, JSON body).
fn every_route() -> Vec<(&'static str, &'static str, Value)> {
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    vec![
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2}),
        ),
        ("POST", "/v1/chat/completions", chat),
        ("GET", "/v1/models", Value::Null),
        ("GET", "/version", Value::Null),
        ("POST", "/tokenize", json!({"prompt": "hi"})),
        ("POST", "/detokenize", json!({"tokens": [72, 105]})),
        ("GET", "/is_paused", Value::Null),
        ("GET", "/is_sleeping", Value::Null),
        ("GET", "/weight_info", Value::Null),
        ("GET", "/get_weight_version", Value::Null),
        ("POST", "/reset_prefix_cache", Value::Null),
        ("POST", "/flush_cache", Value::Null),
        ("POST", "/abort_requests", json!({"request_ids": ["x"]})),
        (
            "POST",
            "/update_weight_version",
            json!({"new_version": "v9"}),
        ),
        ("POST", "/update_weights", Value::Null),
        ("POST", "/update_weights_from_disk", json!({})),
        ("POST", "/pause", Value::Null),
        ("POST", "/pause_generation", Value::Null),
        ("POST", "/resume", Value::Null),
        ("POST", "/continue_generation", Value::Null),
        ("POST", "/sleep", Value::Null),
        ("POST", "/release_memory_occupation", Value::Null),
        ("POST", "/wake_up", Value::Null),
        ("POST", "/resume_memory_occupation", Value::Null),
        ("POST", "/release_kv_cache_memory", Value::Null),
        ("GET", "/no/such/route", Value::Null),
    ]
}

impl Server {
    /// Sends `method path` with `body` (none when `null`) and an `Authorization` header when
    /// given; the status, the `WWW-Authenticate` header and the JSON body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: &Value,
        authorization: Option<&str>,
    ) -> (u16, Option<String>, Value) {
        let mut req = match method {
            "GET" => self.http.get(self.url(path)),
            _ => self.http.post(self.url(path)),
        };
        if !body.is_null() {
            req = req.json(body);
        }
        if let Some(a) = authorization {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let challenge = resp
            .headers()
            .get("www-authenticate")
            .map(|v| v.to_str().unwrap().to_owned());
        let text = resp.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        (status, challenge, json)
    }
}

async fn keyed_server() -> Server {
    start(Options {
        admin_api: true,
        api_key: Some(KEY.to_owned()),
        ..Options::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_wrong_key_is_a_401_on_every_route_and_reaches_nothing() {
    let s = keyed_server().await;
    let wrong = [
        None,
        Some("Bearer sk-ferry-test-key-012345678"),
        Some("Bearer sk-ferry-test-key-01234567890"),
        Some("Bearer SK-FERRY-TEST-KEY-0123456789"),
        Some("Basic sk-ferry-test-key-0123456789"),
        Some("sk-ferry-test-key-0123456789"),
        Some("Bearer "),
    ];
    for (method, path, body) in every_route() {
        for authorization in wrong {
            let (status, challenge, json) = s.call(method, path, &body, authorization).await;
            assert_eq!(
                status, 401,
                "{method} {path} with {authorization:?}: {json}"
            );
            assert_eq!(challenge.as_deref(), Some("Bearer"), "{method} {path}");
            let err = &json["error"];
            assert_eq!(err["type"], "authentication_error", "{json}");
            assert_eq!(err["code"], 401, "{json}");
            let message = err["message"].as_str().unwrap();
            assert!(!message.contains(KEY), "{message}");
            // A header that is not a bearer token (HTTP drops the trailing space of a bare
            // "Bearer ") counts as none.
            let bearer = authorization.and_then(|a| a.strip_prefix("Bearer "));
            let expected = if bearer.is_some_and(|t| !t.is_empty()) {
                "invalid API key"
            } else {
                "this server needs an API key: send `Authorization: Bearer <key>`"
            };
            assert_eq!(message, expected);
        }
    }
    // Nothing got through: no step ran, nothing was paused, renamed or put to sleep.
    assert_eq!(s.n_steps.load(Ordering::SeqCst), 0);
    assert_eq!(s.engine.stats().n_requests_finished_total, 0);
    assert!(!s.engine.is_paused().await.unwrap());
    assert!(!s.engine.is_sleeping().await.unwrap());
    assert_eq!(s.engine.weight_info().await.unwrap().weight_version, "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_key_opens_every_route_admin_routes_included() {
    let s = keyed_server().await;
    let bearer = format!("Bearer {KEY}");
    for (method, path, body) in every_route() {
        let (status, challenge, json) = s.call(method, path, &body, Some(&bearer)).await;
        assert_ne!(status, 401, "{method} {path}: {json}");
        assert_eq!(challenge, None, "{method} {path}");
        // The request reached its handler, which answered as without a key (a push without
        // safetensors bytes, a reload without a folder and a KV release without a pause are
        // refused for what they are).
        let expected = match path {
            "/update_weights" | "/update_weights_from_disk" => 400,
            "/release_kv_cache_memory" => 409,
            "/no/such/route" => 404,
            _ => 200,
        };
        assert_eq!(status, expected, "{method} {path}: {json}");
    }
    // The scheme is case-insensitive.
    let lower = format!("bearer {KEY}");
    let (status, _, json) = s
        .call("GET", "/v1/models", &Value::Null, Some(&lower))
        .await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(s.engine.stats().n_requests_finished_total, 2);
    assert_eq!(s.engine.weight_info().await.unwrap().weight_version, "v9");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_stay_open() {
    let s = keyed_server().await;
    for path in ["/health", "/metrics"] {
        for authorization in [None, Some("Bearer wrong")] {
            let (status, challenge, _) = s.call("GET", path, &Value::Null, authorization).await;
            assert_eq!(status, 200, "{path} with {authorization:?}");
            assert_eq!(challenge, None);
        }
    }
    // Only those exact paths: a look-alike is not open.
    for path in ["/health/", "/metrics/x", "/healthz"] {
        let (status, _, _) = s.call("GET", path, &Value::Null, None).await;
        assert_eq!(status, 401, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_nothing_asks_for_one() {
    let s = start(Options {
        admin_api: true,
        ..Options::default()
    })
    .await;
    for authorization in [None, Some("Bearer anything")] {
        let (status, _, json) = s
            .call("GET", "/is_paused", &Value::Null, authorization)
            .await;
        assert_eq!(status, 200, "{json}");
        let (status, _, json) = s
            .call(
                "POST",
                "/v1/completions",
                &json!({"prompt": "hi", "max_tokens": 1}),
                authorization,
            )
            .await;
        assert_eq!(status, 200, "{json}");
    }
}
