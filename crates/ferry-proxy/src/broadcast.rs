//! One admin call sent to every instance at once, and the caller's answer made from each
//! instance's result: what the admin routes ([`crate::admin`]) and the bucketed uploads
//! ([`crate::upload`]) both send through.
//!
//! A call whose arguments may wipe an instance's cache (`Broadcast::fence`) empties that
//! instance's prefix index as soon as it answers, before the proxy answers.
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

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_admin::{AdminCall, Args};
use ferry_http::error::ApiError;
use ferry_http::extract::random_id;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::fleet::Instance;
use crate::upstream::{Call, UpstreamError};
use crate::versions::{self, InstanceVersion};
use crate::ProxyState;

/// `call`'s arguments, read from its request as the instances read them (`body`: `None` for
/// a body streamed past the reading).
pub(crate) fn read(call: AdminCall, uri: &Uri, body: Option<&[u8]>) -> Result<Args, ApiError> {
    call.read(ferry_admin::Request {
        path: uri.path(),
        query: uri.query(),
        body,
    })
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

/// What a broadcast sends: the method, each instance's path (in fleet order; one path for
/// all when there is one), the request id and the body's type.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Broadcast<'a> {
    pub method: &'a Method,
    pub paths: &'a [String],
    pub request_id: &'a str,
    pub content_type: Option<&'a HeaderValue>,
    /// What the call may wipe of the instances' caches: each instance's prefix index forgets
    /// it as the instance answers.
    pub fence: Fence,
}

/// What a call may have wiped of an instance's caches, given its arguments, and so what the
/// instance's prefix index forgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fence {
    Nothing,
    /// The device's prefix cache: the offload tier's blocks still load (a reset with vLLM's
    /// `reset_external=false`, SGLang's `/flush_cache`).
    Device,
    /// Every cache.
    All,
}

impl Fence {
    pub(crate) fn of(effects: ferry_admin::Effects) -> Self {
        if effects.wipes_offload() {
            Self::All
        } else if effects.wipes_cache() {
            Self::Device
        } else {
            Self::Nothing
        }
    }
}

/// Sends one call to every instance at once, each with its own body.
pub(crate) async fn broadcast_to(
    app: &ProxyState,
    call: Broadcast<'_>,
    bodies: Vec<reqwest::Body>,
) -> Vec<InstanceResult> {
    let Broadcast {
        method,
        paths,
        request_id,
        content_type,
        fence,
    } = call;
    let one = paths.len() == 1;
    let calls =
        app.fleet
            .all()
            .iter()
            .enumerate()
            .zip(bodies)
            .map(|((i, instance), body)| async move {
                let path_and_query = &paths[if one { 0 } else { i }];
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
                let now = crate::fleet::unix_now();
                match fence {
                    Fence::Nothing => {}
                    Fence::Device => instance.kv().wipe_device(now),
                    Fence::All => instance.kv().wipe(now),
                }
                if fence != Fence::Nothing {
                    instance
                        .n_fences
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                InstanceResult {
                    instance: Arc::clone(instance),
                    outcome,
                }
            });
    futures_util::future::join_all(calls).await
}

/// An instance's JSON answer; one that is not JSON is kept as a string.
pub(crate) fn parse_body(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// The answer to the caller: the merged body when every instance succeeded, else an error
/// naming the ones that failed. A version read (`CallDecl::reads_weight_version`) whose
/// instances answered
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
    let reads_version = AdminCall::all()
        .filter(|c| c.decl().reads_weight_version)
        .any(|c| c.decl().path == path);
    if failures.is_empty() && reads_version {
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
/// `aborted` is the sum, `cleared` (a cache reset's) names what every instance cleared (each
/// instance's own is in `instances`), and anything else is the first instance's.
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
            "cleared" => {
                let names = |v: &Value| -> Vec<Value> { v.as_array().cloned().unwrap_or_default() };
                let mut all = names(value);
                all.retain(|n| {
                    bodies
                        .iter()
                        .all(|b| b.get(key).is_some_and(|v| names(v).contains(n)))
                });
                Value::Array(all)
            }
            _ => value.clone(),
        };
        out.insert(key.clone(), merged);
    }
    out
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

/// Chunks of the pushed body in flight per instance: a slow instance slows the push (the
/// body is never held whole), bounded memory.
const PUSH_QUEUE_CHUNKS: usize = 8;
/// Bytes per piece the proxy sends an instance of a pushed body.
const PUSH_PIECE_BYTES: usize = 1 << 20;

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

    /// A decode instance that refused the connection.
    fn unreachable(url: &str) -> InstanceResult {
        let e = UpstreamError::Unreachable {
            role: "decode",
            url: url.into(),
            reason: "connection refused".into(),
        };
        result(url, Err(e))
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
        // A reset: what every instance cleared (one had no offload tier to clear).
        let p = json!({"success": true, "cleared": ["device", "offload"]});
        let d = json!({"success": true, "cleared": ["device"]});
        assert_eq!(merge(&[&p, &d])["cleared"], json!(["device"]));
        assert_eq!(merge(&[&p, &p])["cleared"], json!(["device", "offload"]));
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
        let down = unreachable("http://d1");
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
        for path in ["/get_weight_version", "/weight_info"] {
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
        let down = unreachable("http://d1");
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
}
