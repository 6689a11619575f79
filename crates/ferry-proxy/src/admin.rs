//! The lifecycle admin routes through the proxy (mounted only with
//! `ProxyConfig::enable_admin_api`): every call goes to every instance at once, and the answer
//! reports each instance's result.
//!
//! The paths are the instances' own (vLLM's and SGLang's names, `ferry_server::admin`), so an
//! RL framework drives a P/D fleet as it drives one server. Arguments are the instances' to
//! check: each validates before it acts, so a bad one is the same 400 from all and changes
//! nothing anywhere.
//!
//! When every instance succeeds the answer is an instance's shape, merged ([`merge`]:
//! `is_paused` only when all are, `is_sleeping` when any is, `aborted` summed), plus
//! `instances`, each instance's status and body. When any fails it is an error naming the
//! instances that failed (their common status, else 502), with `instances` too: a fleet where
//! some instances paused or updated and others did not is the caller's to repair, and it
//! must know which.
//!
//! The version reads (`/get_weight_version`, `/weight_info`) never let one instance's version
//! stand for all: when the instances answer different versions the reply is a 409 naming
//! each instance's version, with `instances` and `weight_versions` ([`crate::versions`]).
//!
//! A weight update sets one explicit version everywhere: the proxy makes one when the caller
//! names none, because P and D on different versions would make every transfer fail its
//! version check and recompute.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use ferry_http::error::ApiError;
use ferry_http::extract::{random_id, ApiBytes, RequestId};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::fleet::Instance;
use crate::upstream::{Call, UpstreamError};
use crate::versions::{self, InstanceVersion};
use crate::ProxyState;

/// The admin routes (vLLM's paths, then SGLang's), each fanned out to every instance.
pub fn routes() -> Router<Arc<ProxyState>> {
    Router::new()
        .route("/pause", post(fan_out))
        .route("/resume", post(fan_out))
        .route("/is_paused", get(fan_out))
        .route("/sleep", post(fan_out))
        .route("/wake_up", post(fan_out))
        .route("/is_sleeping", get(fan_out))
        .route("/release_kv_cache_memory", post(fan_out))
        .route("/reset_prefix_cache", post(fan_out))
        .route("/abort_requests", post(fan_out))
        .route("/update_weights", post(push))
        .route("/update_weights_from_disk", post(from_disk))
        .route("/update_weight_version", post(fan_out))
        .route("/weight_info", get(fan_out))
        .route("/pause_generation", post(fan_out))
        .route("/continue_generation", post(fan_out))
        .route("/flush_cache", get(fan_out).post(fan_out))
        .route("/release_memory_occupation", get(fan_out).post(fan_out))
        .route("/resume_memory_occupation", get(fan_out).post(fan_out))
        .route("/get_weight_version", get(fan_out))
}

/// One instance's result.
#[derive(Debug)]
pub struct InstanceResult {
    pub instance: Arc<Instance>,
    pub outcome: Result<(StatusCode, Value), UpstreamError>,
}

impl InstanceResult {
    pub(crate) fn ok(&self) -> bool {
        matches!(&self.outcome, Ok((s, _)) if s.is_success())
    }

    fn to_json(&self) -> Value {
        let mut out = json!({"url": self.instance.url, "role": self.instance.role.as_str()});
        match &self.outcome {
            Ok((status, body)) => {
                out["status"] = json!(status.as_u16());
                out["body"] = body.clone();
            }
            Err(e) => {
                out["status"] = Value::Null;
                out["error"] = json!(e.to_string());
            }
        }
        out
    }

    /// Why it failed, for the error message.
    fn failure(&self) -> Option<String> {
        let who = format!("{} {}", self.instance.role, self.instance.url);
        match &self.outcome {
            Ok((s, _)) if s.is_success() => None,
            Ok((s, body)) => {
                let message = body["error"]["message"]
                    .as_str()
                    .map_or_else(|| body.to_string(), str::to_owned);
                Some(format!("{who} answered {}: {message}", s.as_u16()))
            }
            Err(e) => Some(e.to_string()),
        }
    }
}

/// Sends one call to every instance at once, each with its own body.
async fn broadcast(
    app: &ProxyState,
    method: &Method,
    path_and_query: &str,
    request_id: &str,
    content_type: Option<&HeaderValue>,
    bodies: Vec<reqwest::Body>,
) -> Vec<InstanceResult> {
    let paths = vec![path_and_query.to_owned(); bodies.len()];
    broadcast_to(app, method, &paths, request_id, content_type, bodies).await
}

/// Sends one call to every instance at once, each at its own path (in fleet order) with its
/// own body.
pub(crate) async fn broadcast_to(
    app: &ProxyState,
    method: &Method,
    paths: &[String],
    request_id: &str,
    content_type: Option<&HeaderValue>,
    bodies: Vec<reqwest::Body>,
) -> Vec<InstanceResult> {
    let calls = app.fleet.all().iter().zip(paths).zip(bodies).map(
        |((instance, path_and_query), body)| async move {
            let call = Call {
                method: method.clone(),
                path_and_query,
                request_id: Some(request_id),
                content_type: content_type.cloned(),
                body,
                timeout: Some(app.config.admin_timeout),
            };
            let outcome = app
                .upstream
                .send_read(instance, call)
                .await
                .map(|(status, _, body)| (status, parse_body(&body)));
            // A call that may have wiped the instance's cache fences its prefix index at
            // once, before the instance's own event arrives (whatever it answered: a failed
            // call may have cleared part of it).
            if method == Method::POST && clears_cache(path_and_query) {
                instance.kv().wipe(crate::fleet::unix_now());
            }
            InstanceResult {
                instance: Arc::clone(instance),
                outcome,
            }
        },
    );
    futures_util::future::join_all(calls).await
}

/// Whether an admin call may clear the instance's prefix cache: a reset, a sleep or memory
/// release, a weight change, and a pause unless `clear_cache=false`.
fn clears_cache(path_and_query: &str) -> bool {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    match path {
        "/reset_prefix_cache"
        | "/flush_cache"
        | "/sleep"
        | "/release_kv_cache_memory"
        | "/release_memory_occupation"
        | "/update_weights"
        | "/update_weights_from_disk"
        | "/update_weight_version" => true,
        "/pause" => !form_pairs(query).any(|(k, v)| k == "clear_cache" && v == "false"),
        _ => path.starts_with("/weight_uploads/") && path.ends_with("/commit"),
    }
}

/// An instance's JSON answer; one that is not JSON is kept as a string.
pub(crate) fn parse_body(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// The routes that read the instances' weight version: through the proxy, a 409 when the
/// instances answer different ones, never one instance's version standing for all.
pub const VERSION_READS: [&str; 2] = ["/get_weight_version", "/weight_info"];

/// The answer to the caller: the merged body when every instance succeeded, else an error
/// naming the ones that failed. A version read ([`VERSION_READS`]) whose instances answered
/// different versions is a 409 naming each instance's version, with `instances` and
/// `weight_versions` (each instance's URL, role and version).
pub fn summarise(path: &str, results: &[InstanceResult]) -> Response {
    summarise_noting(path, results, None)
}

/// [`summarise`], with `note` (what became of the operation) after a failure's message.
pub(crate) fn summarise_noting(
    path: &str,
    results: &[InstanceResult],
    note: Option<&str>,
) -> Response {
    let failures: Vec<String> = results.iter().filter_map(InstanceResult::failure).collect();
    if failures.is_empty() && VERSION_READS.contains(&path) {
        let versions: Vec<InstanceVersion<'_>> = results
            .iter()
            .map(|r| InstanceVersion {
                instance: &r.instance,
                version: r
                    .outcome
                    .as_ref()
                    .ok()
                    .and_then(|(_, b)| versions::from_body(b)),
            })
            .collect();
        if versions::skewed(&versions) {
            let error = ApiError::conflict(format!(
                "{path}: the instances run different weight versions ({}); set one version \
                 on every instance (a weight update or /update_weight_version through the \
                 proxy)",
                versions::describe(&versions)
            ));
            let mut response = with_instances(&error, results);
            if let Some(body) = response.1.as_object_mut() {
                body.insert("weight_versions".into(), versions::to_json(&versions));
            }
            return response.into_response();
        }
    }
    if failures.is_empty() {
        return Json(Value::Object(merged(results))).into_response();
    }
    let failed: Vec<&(StatusCode, Value)> = results
        .iter()
        .filter(|r| !r.ok())
        .filter_map(|r| r.outcome.as_ref().ok())
        .collect();
    let n_ok = results.len() - failures.len();
    let mut message = format!(
        "{path} failed on {} of {} instances ({n_ok} succeeded): {}",
        failures.len(),
        results.len(),
        failures.join("; ")
    );
    if let Some(note) = note {
        message = format!("{message}; {note}");
    }
    // Every failed instance answered, with one status: that status, and the first one's
    // field at fault (a bad argument is the same 400 from all). Else (one unreachable, or
    // answers that differ) a 502.
    let error = match failed.first() {
        Some((status, body))
            if failed.len() == failures.len() && failed.iter().all(|(s, _)| s == status) =>
        {
            ApiError {
                status: *status,
                message,
                kind: kind_of(*status),
                param: body["error"]["param"].as_str().map(str::to_owned),
            }
        }
        _ => crate::upstream::bad_gateway(message),
    };
    with_instances(&error, results).into_response()
}

/// The instances' answers merged ([`merge`]), with `instances` (each instance's URL, role,
/// status and body): the reply when every instance succeeded.
pub(crate) fn merged(results: &[InstanceResult]) -> Map<String, Value> {
    let bodies: Vec<&Value> = results
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok().map(|(_, b)| b))
        .collect();
    let mut body = merge(&bodies);
    body.insert("instances".into(), instances_json(results));
    body
}

/// Each instance's URL, role, status and body.
fn instances_json(results: &[InstanceResult]) -> Value {
    Value::Array(results.iter().map(InstanceResult::to_json).collect())
}

/// `error`'s OpenAI body with `instances`, logged.
fn with_instances(error: &ApiError, results: &[InstanceResult]) -> (StatusCode, Json<Value>) {
    tracing::warn!("{}", error.message);
    let mut body = serde_json::to_value(error.body()).unwrap_or_else(|_| json!({}));
    body["instances"] = instances_json(results);
    (error.status, Json(body))
}

/// The OpenAI error type of an instance's status, as the instances name it.
fn kind_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        409 => "conflict_error",
        503 => "service_unavailable_error",
        504 => "timeout_error",
        _ => "instance_error",
    }
}

/// The instances' bodies as one: a key every body has with one value keeps it; where they
/// differ, `is_paused` and `success` hold only when all are true, `is_sleeping` when any is,
/// `aborted` is the sum, and anything else is the first instance's.
pub fn merge(bodies: &[&Value]) -> Map<String, Value> {
    let mut out = Map::new();
    let Some(Value::Object(first)) = bodies.first() else {
        return out;
    };
    for (key, value) in first {
        let values: Vec<&Value> = bodies.iter().filter_map(|b| b.get(key)).collect();
        let merged = match key.as_str() {
            "is_paused" | "success" => json!(values.iter().all(|v| v.as_bool() == Some(true))),
            "is_sleeping" => json!(values.iter().any(|v| v.as_bool() == Some(true))),
            "aborted" => json!(values.iter().filter_map(|v| v.as_u64()).sum::<u64>()),
            _ => value.clone(),
        };
        out.insert(key.clone(), merged);
    }
    out
}

/// Any admin call whose body is small JSON (or none): the same call to every instance.
async fn fan_out(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let bodies = copies(&body, app.fleet.all().len());
    let results = broadcast(
        &app,
        &method,
        &path_and_query,
        &id,
        headers.get(header::CONTENT_TYPE),
        bodies,
    )
    .await;
    summarise(uri.path(), &results)
}

/// `n` bodies, each `body`.
pub(crate) fn copies(body: &Bytes, n: usize) -> Vec<reqwest::Body> {
    (0..n).map(|_| reqwest::Body::from(body.clone())).collect()
}

/// A weight version for an update whose caller named none: the same on every instance,
/// unique to this update.
pub(crate) fn new_weight_version() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("proxy-{secs}-{}", &random_id()[..12])
}

/// `POST /update_weights_from_disk {"model_path", "weight_version"}`: the same reload on
/// every instance, with the caller's version or one the proxy makes.
async fn from_disk(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    ApiBytes(body): ApiBytes,
) -> Response {
    let mut request = if body.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(m)) => m,
            _ => {
                return ApiError::bad_request("the request body must be a JSON object")
                    .into_response()
            }
        }
    };
    match request.get("weight_version") {
        None | Some(Value::Null) => {
            request.insert("weight_version".into(), json!(new_weight_version()));
        }
        Some(_) => {}
    }
    let body = Bytes::from(Value::Object(request).to_string());
    let bodies = copies(&body, app.fleet.all().len());
    let json_type = HeaderValue::from_static("application/json");
    let results = broadcast(
        &app,
        &Method::POST,
        "/update_weights_from_disk",
        &id,
        Some(&json_type),
        bodies,
    )
    .await;
    summarise("/update_weights_from_disk", &results)
}

/// Chunks of the pushed body in flight per instance: a slow instance slows the push (the
/// body is never held whole), bounded memory.
const PUSH_QUEUE_CHUNKS: usize = 8;
/// Bytes per piece the proxy sends an instance of a pushed body.
const PUSH_PIECE_BYTES: usize = 1 << 20;

/// `POST /update_weights?weight_version=` with a safetensors body: the body is copied to
/// every instance as it arrives (never held whole), with the caller's version or one the
/// proxy makes.
async fn push(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let query = with_weight_version(raw.as_deref());
    let path_and_query = format!("/update_weights?{query}");
    let (feed, bodies) = tee(body, app.fleet.all().len());
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/octet-stream"));
    let send = broadcast(
        &app,
        &Method::POST,
        &path_and_query,
        &id,
        Some(&content_type),
        bodies,
    );
    let ((), results) = tokio::join!(feed, send);
    summarise("/update_weights", &results)
}

/// `body` copied to `n` bodies as it arrives (never held whole): the future feeds them, a
/// slow reader slowing all (bounded memory). A reader that stopped (its instance refused the
/// body) is skipped; a failed read ends every copy with the error.
pub(crate) fn tee(
    body: Body,
    n: usize,
) -> (impl std::future::Future<Output = ()>, Vec<reqwest::Body>) {
    let mut senders = Vec::with_capacity(n);
    let mut bodies = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) =
            tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(PUSH_QUEUE_CHUNKS);
        senders.push(tx);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|piece| (piece, rx))
        });
        bodies.push(reqwest::Body::wrap_stream(stream));
    }
    let feed = async move {
        let send = |piece: Result<Bytes, String>| {
            let senders = &senders;
            async move {
                for tx in senders {
                    let copy = piece.clone().map_err(std::io::Error::other);
                    let _ = tx.send(copy).await;
                }
            }
        };
        // The network's pieces (often a few kilobytes) gathered into pieces of
        // `PUSH_PIECE_BYTES`: a copy through the cache costs less than a channel hand-off
        // and a write to every instance per small piece.
        let mut data = body.into_data_stream();
        let mut pending: Vec<u8> = Vec::new();
        while let Some(piece) = data.next().await {
            match piece {
                Ok(b) if pending.is_empty() && b.len() >= PUSH_PIECE_BYTES => send(Ok(b)).await,
                Ok(b) => {
                    pending.extend_from_slice(&b);
                    if pending.len() >= PUSH_PIECE_BYTES {
                        send(Ok(Bytes::from(std::mem::take(&mut pending)))).await;
                    }
                }
                Err(e) => {
                    send(Err(e.to_string())).await;
                    return;
                }
            }
        }
        if !pending.is_empty() {
            send(Ok(Bytes::from(pending))).await;
        }
    };
    (feed, bodies)
}

/// The push's query with `weight_version` set: the caller's, else a new one.
fn with_weight_version(raw: Option<&str>) -> String {
    let raw = raw.unwrap_or("");
    let has_version = form_pairs(raw).any(|(k, v)| k == "weight_version" && !v.is_empty());
    if has_version {
        return raw.to_owned();
    }
    let kept: Vec<&str> = raw
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("weight_version="))
        .filter(|p| *p != "weight_version")
        .collect();
    let mut query = kept.join("&");
    if !query.is_empty() {
        query.push('&');
    }
    query.push_str("weight_version=");
    query.push_str(&new_weight_version());
    query
}

fn form_pairs(raw: &str) -> impl Iterator<Item = (&str, &str)> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Role;

    fn result(url: &str, outcome: Result<(u16, Value), UpstreamError>) -> InstanceResult {
        InstanceResult {
            instance: Arc::new(Instance::new(url, Role::Decode)),
            outcome: outcome.map(|(s, b)| (StatusCode::from_u16(s).unwrap(), b)),
        }
    }

    #[test]
    fn merges_flags_and_counts_across_instances() {
        let a = json!({"is_paused": true, "is_sleeping": false, "aborted": 2, "x": "a"});
        let b = json!({"is_paused": false, "is_sleeping": true, "aborted": 3, "x": "b"});
        let merged = merge(&[&a, &b]);
        assert_eq!(
            Value::Object(merged),
            json!({"is_paused": false, "is_sleeping": true, "aborted": 5, "x": "a"})
        );
        let merged = merge(&[&a, &a]);
        assert_eq!(merged["is_paused"], true);
    }

    #[test]
    fn a_partial_failure_is_an_error_naming_the_instance() {
        let ok = result("http://p0", Ok((200, json!({"status": "paused"}))));
        let refused = result(
            "http://d0",
            Ok((409, json!({"error": {"message": "the engine is asleep"}}))),
        );
        let response = summarise("/pause", &[ok, refused]);
        assert_eq!(response.status(), StatusCode::CONFLICT);
        let down = result(
            "http://d1",
            Err(UpstreamError::Unreachable {
                role: "decode",
                url: "http://d1".into(),
                reason: "connection refused".into(),
            }),
        );
        let ok = result("http://p0", Ok((200, json!({}))));
        assert_eq!(
            summarise("/pause", &[ok, down]).status(),
            StatusCode::BAD_GATEWAY
        );
    }

    #[tokio::test]
    async fn the_same_refusal_from_every_instance_names_the_field() {
        let refusal = || {
            json!({"error": {"message": "`new_version` is required",
            "type": "invalid_request_error", "param": "new_version", "code": 400}})
        };
        let both = [
            result("http://p0", Ok((400, refusal()))),
            result("http://d0", Ok((400, refusal()))),
        ];
        let response = summarise("/update_weight_version", &both);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["param"], "new_version", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(body["instances"].as_array().unwrap().len(), 2, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("http://p0") && message.contains("http://d0"),
            "{message}"
        );
    }

    fn at(url: &str, role: Role, version: &str) -> InstanceResult {
        InstanceResult {
            instance: Arc::new(Instance::new(url, role)),
            outcome: Ok((StatusCode::OK, json!({"weight_version": version}))),
        }
    }

    async fn json_of(response: Response) -> (StatusCode, Value) {
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn a_version_read_whose_instances_differ_is_a_409_naming_each() {
        for path in VERSION_READS {
            let results = [
                at("http://p0", Role::Prefill, "v1"),
                at("http://d0", Role::Decode, "v2"),
            ];
            let (status, body) = json_of(summarise(path, &results)).await;
            assert_eq!(status, StatusCode::CONFLICT, "{body}");
            assert_eq!(body["error"]["type"], "conflict_error", "{body}");
            assert_eq!(body["error"]["code"], 409, "{body}");
            let message = body["error"]["message"].as_str().unwrap();
            for part in [
                path,
                "prefill http://p0 runs \"v1\"",
                "decode http://d0 runs \"v2\"",
            ] {
                assert!(message.contains(part), "{part}: {message}");
            }
            assert_eq!(body["instances"][1]["body"]["weight_version"], "v2");
            assert_eq!(body["instances"][1]["status"], 200);
            assert_eq!(
                body["weight_versions"],
                json!([{"url": "http://p0", "role": "prefill", "version": "v1"},
                       {"url": "http://d0", "role": "decode", "version": "v2"}])
            );
            assert!(body.get("weight_version").is_none(), "{body}");
        }
    }

    #[tokio::test]
    async fn a_version_read_whose_instances_agree_is_their_version() {
        let results = [
            at("http://p0", Role::Prefill, "v1"),
            at("http://d0", Role::Decode, "v1"),
            at("http://d1", Role::Decode, "v1"),
        ];
        let (status, body) = json_of(summarise("/get_weight_version", &results)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["weight_version"], "v1", "{body}");
        assert_eq!(body["instances"].as_array().unwrap().len(), 3, "{body}");
        // Only the version reads compare versions.
        let results = [
            at("http://p0", Role::Prefill, "v1"),
            at("http://d0", Role::Decode, "v2"),
        ];
        let (status, _) = json_of(summarise("/is_paused", &results)).await;
        assert_eq!(status, StatusCode::OK);
        // A failure is still the failure, naming the instance, skew or not.
        let down = result(
            "http://d1",
            Err(UpstreamError::Unreachable {
                role: "decode",
                url: "http://d1".into(),
                reason: "connection refused".into(),
            }),
        );
        let results = [
            at("http://p0", Role::Prefill, "v1"),
            at("http://d0", Role::Decode, "v2"),
            down,
        ];
        let (status, body) = json_of(summarise("/weight_info", &results)).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("http://d1"), "{message}");
    }

    #[test]
    fn a_push_without_a_version_gets_one() {
        assert_eq!(
            with_weight_version(Some("weight_version=v7")),
            "weight_version=v7"
        );
        let q = with_weight_version(None);
        assert!(q.starts_with("weight_version=proxy-"), "{q}");
        let q = with_weight_version(Some("a=1&weight_version="));
        assert!(q.starts_with("a=1&weight_version=proxy-"), "{q}");
        assert_ne!(with_weight_version(None), with_weight_version(None));
    }
}
