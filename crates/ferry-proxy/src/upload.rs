//! Bucketed weight uploads through the proxy: one upload on every instance, each bucket
//! copied to all of them as it arrives, and a two-phase commit.
//!
//! The routes are the instances' own (`ferry_admin`'s table, mounted by
//! [`crate::admin::routes`]). The proxy's upload id
//! names one upload on each instance (their ids kept in fleet order); it makes the weight
//! version when the caller names none, so every instance commits the same one.
//!
//! The commit is two-phase: every instance first prepares (joins its buckets and checks the
//! update can be installed); only when all have does any commit. If a prepare fails, nothing
//! commits, every instance's upload is discarded, and the error names the instance. An
//! instance that fails between its prepare and its commit (it died) stays on its old version,
//! which the error names and the proxy's version-skew reporting shows
//! ([`crate::versions`]). A failed bucket, on any instance, discards the upload everywhere:
//! the instances must hold the same tensors.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_admin::AdminCall;
use ferry_http::error::ApiError;
use ferry_http::extract::{random_id, ApiBytes, RequestId};
use serde_json::{json, Map, Value};

use crate::broadcast::{
    broadcast_to, copies, merged, new_weight_version, parse_body, read, summarise_noting, tee,
    Broadcast, Fence, InstanceResult,
};
use crate::front::SpliceSource;
use crate::ProxyState;

/// The proxy's one open upload.
#[derive(Debug, Default)]
pub struct Uploads {
    open: Mutex<Option<Open>>,
}

#[derive(Debug, Clone)]
struct Open {
    id: String,
    /// Each instance's upload id, in fleet order.
    ids: Vec<String>,
    n_buckets: usize,
    prepared: bool,
    /// The last call through the proxy on it.
    touched: Instant,
    /// How long the instances keep an upload no call touches (their `timeout_seconds`; the
    /// shortest): past it they have discarded theirs, and the proxy forgets its own, so a
    /// client gone midway never blocks the next upload.
    timeout: Duration,
}

impl Open {
    /// An upload whose instances' ids are `ids` (none yet while they begin), kept until the
    /// instances say how long they keep theirs.
    fn new(id: &str, ids: Vec<String>) -> Self {
        Self {
            id: id.to_owned(),
            ids,
            n_buckets: 0,
            prepared: false,
            touched: Instant::now(),
            timeout: Duration::MAX,
        }
    }
}

impl Uploads {
    /// The open upload, forgotten first if the instances have discarded theirs.
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Open>> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if open
            .as_ref()
            .is_some_and(|u| !u.ids.is_empty() && u.touched.elapsed() > u.timeout)
        {
            *open = None;
        }
        open
    }

    fn get(&self, id: &str) -> Result<Open, ApiError> {
        let mut open = self.lock();
        match open.as_mut() {
            Some(u) if u.id == id => {
                u.touched = Instant::now();
                Ok(u.clone())
            }
            _ => Err(ApiError::not_found(
                Some("upload_id"),
                format!(
                    "no open weight upload `{id}` on the proxy (it was committed, discarded \
                     after an error, or never begun; start one with POST /weight_uploads)"
                ),
            )),
        }
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut Open)) {
        if let Some(u) = self.lock().as_mut().filter(|u| u.id == id) {
            u.touched = Instant::now();
            f(u);
        }
    }

    fn end(&self, id: &str) {
        let mut open = self.lock();
        if open.as_ref().is_some_and(|u| u.id == id) {
            *open = None;
        }
    }
}

fn json_type() -> HeaderValue {
    HeaderValue::from_static("application/json")
}

fn json_bodies(body: &Value, n: usize) -> Vec<reqwest::Body> {
    copies(&axum::body::Bytes::from(body.to_string()), n)
}

fn paths(open: &Open, suffix: &str) -> Vec<String> {
    open.ids
        .iter()
        .map(|id| format!("/weight_uploads/{id}{suffix}"))
        .collect()
}

/// The body as a JSON object (none: an empty one).
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(Value::Null) => Ok(Map::new()),
        _ => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
    }
}

/// Discards the upload on every instance (best effort: an instance that lost it already
/// answers 404) and forgets it.
async fn discard_everywhere(app: &ProxyState, open: &Open, request_id: &str) {
    let n = open.ids.len();
    broadcast_to(
        app,
        Broadcast {
            method: &Method::DELETE,
            paths: &paths(open, ""),
            request_id,
            content_type: None,
            fence: Fence::Nothing,
        },
        copies(&axum::body::Bytes::new(), n),
    )
    .await;
    app.uploads.end(&open.id);
}

fn all_ok(results: &[InstanceResult]) -> bool {
    results.iter().all(InstanceResult::ok)
}

/// `POST /weight_uploads {"weight_version"?}`: an upload on every instance, under one
/// version (the caller's, else one the proxy makes). If any instance refuses, the others'
/// uploads are discarded.
pub(crate) async fn begin(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(rid)): Extension<RequestId>,
    uri: Uri,
    ApiBytes(body): ApiBytes,
) -> Response {
    if let Err(refused) = read(AdminCall::BeginUpload, &uri, Some(&body)) {
        return refused.into_response();
    }
    let mut request = match object(&body) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    if matches!(request.get("weight_version"), None | Some(Value::Null)) {
        request.insert("weight_version".into(), json!(new_weight_version()));
    }
    let version = request["weight_version"].clone();
    let id = format!("upload-{}", &random_id()[..16]);
    {
        let mut open = app.uploads.lock();
        if let Some(u) = open.as_ref() {
            return ApiError::conflict(format!(
                "weight upload `{}` is open on the proxy: commit or discard it first",
                u.id
            ))
            .into_response();
        }
        // Held while the instances begin, so a second begin is refused meanwhile.
        *open = Some(Open::new(&id, Vec::new()));
    }
    let n = app.fleet.all().len();
    let results = broadcast_to(
        &app,
        Broadcast {
            method: &Method::POST,
            paths: &vec!["/weight_uploads".to_owned(); n],
            request_id: &rid,
            content_type: Some(&json_type()),
            fence: Fence::Nothing,
        },
        json_bodies(&Value::Object(request), n),
    )
    .await;
    let ids: Vec<Option<String>> = results
        .iter()
        .map(|r| match &r.outcome {
            Ok((s, b)) if s.is_success() => b["upload_id"].as_str().map(str::to_owned),
            _ => None,
        })
        .collect();
    if ids.iter().any(Option::is_none) || !all_ok(&results) {
        // Discard what did begin.
        let begun = Open::new(
            &id,
            ids.iter().map(|i| i.clone().unwrap_or_default()).collect(),
        );
        discard_everywhere(&app, &begun, &rid).await;
        return summarise_noting(
            "/weight_uploads",
            &results,
            Some("no upload was begun on any instance"),
        );
    }
    let ids: Vec<String> = ids.into_iter().flatten().collect();
    let timeout = results
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok())
        .filter_map(|(_, b)| b["timeout_seconds"].as_f64())
        .filter(|s| s.is_finite() && *s > 0.0)
        .fold(f64::INFINITY, f64::min);
    app.uploads.update(&id, |u| {
        u.ids = ids.clone();
        if timeout.is_finite() {
            u.timeout = Duration::from_secs_f64(timeout);
        }
    });
    let instances: Vec<Value> = app
        .fleet
        .all()
        .iter()
        .zip(&ids)
        .map(|(i, uid)| json!({"url": i.url, "role": i.role.as_str(), "upload_id": uid}))
        .collect();
    Json(json!({
        "upload_id": id,
        "weight_version": version,
        "instances": instances,
    }))
    .into_response()
}

/// `GET /weight_uploads`: the proxy's open upload, or null.
pub(crate) async fn current(State(app): State<Arc<ProxyState>>) -> Response {
    let upload = app.uploads.lock().as_ref().map(|u| {
        json!({"upload_id": u.id, "n_buckets": u.n_buckets, "prepared": u.prepared,
               "instance_upload_ids": u.ids})
    });
    Json(json!({ "upload": upload })).into_response()
}

/// `POST /weight_uploads/{upload_id}/buckets`: the body copied to every instance's upload as it
/// arrives. A failure on any instance discards the upload everywhere.
///
/// Through the proxy's front door ([`crate::front`]) the body is still on the caller's
/// connection ([`SpliceSource`]) and goes to the instances with splice, never through the
/// proxy's memory ([`crate::splice`]); the answer's `spliced` says which way it went.
pub(crate) async fn bucket(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(rid)): Extension<RequestId>,
    Path(id): Path<String>,
    uri: Uri,
    source: Option<Extension<SpliceSource>>,
    body: Body,
) -> Result<Response, Response> {
    read(AdminCall::UploadBucket, &uri, None).map_err(IntoResponse::into_response)?;
    let open = app.uploads.get(&id).map_err(IntoResponse::into_response)?;
    if open.ids.is_empty() {
        return Err(
            ApiError::conflict(format!("upload `{id}` is still beginning")).into_response(),
        );
    }
    let targets = paths(&open, "/buckets");
    let (results, spliced) = match source {
        Some(Extension(source)) => match spliced(&app, &source, &targets, &rid).await {
            Some(results) => (results, true),
            None => (
                copied(&app, &targets, &rid, source.into_body()).await,
                false,
            ),
        },
        None => (copied(&app, &targets, &rid, body).await, false),
    };
    if !all_ok(&results) {
        discard_everywhere(&app, &open, &rid).await;
        return Err(summarise_noting(
            "/weight_uploads/buckets",
            &results,
            Some(&format!("upload `{id}` was discarded on every instance")),
        ));
    }
    app.uploads.update(&id, |u| u.n_buckets += 1);
    let mut body = answer(&results, &id);
    body.insert("spliced".into(), json!(spliced));
    Ok(Json(Value::Object(body)).into_response())
}

/// The body read by the proxy and copied to every instance as it arrives.
async fn copied(
    app: &ProxyState,
    targets: &[String],
    rid: &str,
    body: Body,
) -> Vec<InstanceResult> {
    let (feed, bodies) = tee(body, targets.len());
    let content_type = HeaderValue::from_static("application/octet-stream");
    let send = broadcast_to(
        app,
        Broadcast {
            method: &Method::POST,
            paths: targets,
            request_id: rid,
            content_type: Some(&content_type),
            fence: Fence::Nothing,
        },
        bodies,
    );
    let ((), results) = tokio::join!(feed, send);
    results
}

/// The body moved from the caller's socket to every instance's with splice; `None` (the body
/// untouched) where an instance is not at a plain `http://` address.
#[cfg(target_os = "linux")]
async fn spliced(
    app: &ProxyState,
    source: &SpliceSource,
    targets: &[String],
    rid: &str,
) -> Option<Vec<InstanceResult>> {
    use crate::upstream::UpstreamError;
    use std::os::fd::AsRawFd;

    let instances = app.fleet.all();
    let mut legs = Vec::with_capacity(targets.len());
    for (instance, path) in instances.iter().zip(targets) {
        let url = reqwest::Url::parse(&instance.url).ok()?;
        if url.scheme() != "http" {
            return None;
        }
        let host = url.host_str()?;
        let port = url.port_or_known_default()?;
        let mut head = format!(
            "POST {}{path} HTTP/1.1\r\nhost: {host}:{port}\r\n\
             content-type: application/octet-stream\r\ncontent-length: {}\r\n\
             connection: close\r\n",
            url.path().trim_end_matches('/'),
            source.len()
        )
        .into_bytes();
        if HeaderValue::from_str(rid).is_ok() {
            head.extend_from_slice(format!("x-request-id: {rid}\r\n").as_bytes());
        }
        if let Some(key) = app.upstream.authorization() {
            head.extend_from_slice(b"authorization: ");
            head.extend_from_slice(key.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        legs.push(crate::splice::Target {
            addr: format!("{host}:{port}"),
            head,
        });
    }
    let raw = source.take()?;
    let (connect, within) = (app.config.connect_timeout, app.config.admin_timeout);
    let fanned = tokio::task::spawn_blocking(move || {
        crate::splice::fan_out(
            raw.socket.as_raw_fd(),
            &raw.prefix,
            raw.in_socket,
            raw.expect_continue,
            &legs,
            crate::splice::Limits {
                connect,
                stall: within,
                answer_within: within,
            },
        )
    })
    .await
    .ok()?;
    if fanned.body.is_ok() {
        source.read_all();
    }
    let results = instances
        .iter()
        .zip(fanned.answers)
        .map(|(instance, answer)| {
            let (role, url) = (instance.role.as_str(), instance.url.clone());
            let outcome = match answer {
                Ok((status, body)) => Ok((
                    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                    parse_body(&body),
                )),
                Err(crate::splice::Failure::Unreachable(reason)) => {
                    Err(UpstreamError::Unreachable { role, url, reason })
                }
                Err(crate::splice::Failure::Timeout) => Err(UpstreamError::Timeout {
                    role,
                    url,
                    seconds: within.as_secs(),
                }),
                Err(crate::splice::Failure::Broken(reason)) => {
                    Err(UpstreamError::Broken { role, url, reason })
                }
            };
            InstanceResult {
                instance: Arc::clone(instance),
                outcome,
            }
        })
        .collect();
    Some(results)
}

/// Without splice, every body is copied.
#[cfg(not(target_os = "linux"))]
async fn spliced(
    _: &ProxyState,
    _: &SpliceSource,
    _: &[String],
    _: &str,
) -> Option<Vec<InstanceResult>> {
    None
}

/// The instances' answers merged, with the proxy's upload id.
fn answer(results: &[InstanceResult], id: &str) -> Map<String, Value> {
    let mut body = merged(results);
    body.insert("upload_id".into(), json!(id));
    body
}

fn reply(results: &[InstanceResult], id: &str) -> Response {
    Json(Value::Object(answer(results, id))).into_response()
}

/// The prepare phase on every instance: `Ok` when all prepared, else the error response
/// (the upload discarded everywhere, nothing committed).
async fn prepare_all(app: &ProxyState, open: &Open, rid: &str) -> Result<Response, Response> {
    let n = open.ids.len();
    let results = broadcast_to(
        app,
        Broadcast {
            method: &Method::POST,
            paths: &paths(open, "/prepare"),
            request_id: rid,
            content_type: Some(&json_type()),
            fence: Fence::Nothing,
        },
        json_bodies(&json!({}), n),
    )
    .await;
    if !all_ok(&results) {
        discard_everywhere(app, open, rid).await;
        return Err(summarise_noting(
            "/weight_uploads/prepare",
            &results,
            Some(&format!(
                "nothing was committed: upload `{}` was discarded on every instance",
                open.id
            )),
        ));
    }
    app.uploads.update(&open.id, |u| u.prepared = true);
    Ok(reply(&results, &open.id))
}

/// `POST /weight_uploads/{upload_id}/prepare`: the first phase on every instance.
pub(crate) async fn prepare(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(rid)): Extension<RequestId>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Response, Response> {
    read(AdminCall::PrepareUpload, &uri, Some(b"")).map_err(IntoResponse::into_response)?;
    let open = app.uploads.get(&id).map_err(IntoResponse::into_response)?;
    prepare_all(&app, &open, &rid).await
}

/// `POST /weight_uploads/{upload_id}/commit {"weight_version"?}`: every instance prepares (unless
/// all did), and only then every instance commits.
pub(crate) async fn commit(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(rid)): Extension<RequestId>,
    Path(id): Path<String>,
    uri: Uri,
    ApiBytes(body): ApiBytes,
) -> Result<Response, Response> {
    let fence = Fence::of(
        read(AdminCall::CommitUpload, &uri, Some(&body))
            .map_err(IntoResponse::into_response)?
            .effects(),
    );
    let request = object(&body).map_err(IntoResponse::into_response)?;
    let open = app.uploads.get(&id).map_err(IntoResponse::into_response)?;
    if !open.prepared {
        prepare_all(&app, &open, &rid).await?;
    }
    let n = open.ids.len();
    let results = broadcast_to(
        &app,
        Broadcast {
            method: &Method::POST,
            paths: &paths(&open, "/commit"),
            request_id: &rid,
            content_type: Some(&json_type()),
            fence,
        },
        json_bodies(&Value::Object(request), n),
    )
    .await;
    app.uploads.end(&id);
    if !all_ok(&results) {
        return Err(summarise_noting(
            "/weight_uploads/commit",
            &results,
            Some(
                "the instances that failed after preparing keep their old weights and version \
                 (see /health's version_skew)",
            ),
        ));
    }
    Ok(reply(&results, &id))
}

/// `DELETE /weight_uploads/{upload_id}`: discarded on every instance.
pub(crate) async fn discard(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(rid)): Extension<RequestId>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Response, Response> {
    read(AdminCall::DiscardUpload, &uri, Some(b"")).map_err(IntoResponse::into_response)?;
    let open = app.uploads.get(&id).map_err(IntoResponse::into_response)?;
    discard_everywhere(&app, &open, &rid).await;
    Ok(Json(json!({"upload_id": id, "discarded": true})).into_response())
}
