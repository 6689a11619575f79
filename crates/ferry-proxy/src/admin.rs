//! The lifecycle admin routes through the proxy (mounted only with
//! `ProxyConfig::enable_admin_api`): every call goes to every instance at once, and the answer
//! reports each instance's result.
//!
//! The routes are the instances' own, from the one table of admin calls (`ferry_admin`:
//! vLLM's and SGLang's names), so an RL framework drives a P/D fleet as it drives one server,
//! and [`routes`] says, by an exhaustive `match`, how each call crosses the fleet: most fan
//! out as they are; a weight push is copied to every instance as it arrives; a reload and an
//! upload get one weight version everywhere; an upload commits in two phases
//! ([`crate::upload`]). The proxy reads every call's arguments as the instances do
//! (`AdminCall::read`): a bad one is the 400 naming it, sent to no instance.
//!
//! Fencing: a call whose arguments may wipe an instance's cache (`Effects::wipes_cache`: a
//! reset, a pause unless `clear_cache=false`, SGLang's `retract`, a sleep or memory release, a
//! weight change) empties that instance's prefix index as soon as it answers, before the proxy
//! answers, so no request is routed by a cache that is gone while its event is on the way. A
//! reset that leaves the offload tier (vLLM's default `reset_external=false`, SGLang's
//! `/flush_cache`) empties only the device's entries: the tier's blocks still serve hits.
//! Each call goes out and its answer comes back through [`crate::broadcast`], which says how
//! the instances' answers become one.
//!
//! A weight update sets one explicit version everywhere: the proxy makes one when the caller
//! names none, because P and D on different versions would make every transfer fail its
//! version check and recompute.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::on;
use axum::{Extension, Router};
use ferry_admin::AdminCall;
use ferry_http::error::ApiError;
use ferry_http::extract::{ApiBytes, RequestId};
use serde_json::{json, Map, Value};

use crate::broadcast::{
    broadcast_to, copies, new_weight_version, read, summarise, tee, Broadcast, Fence,
};
use crate::ProxyState;

/// Every admin call, at its path for its methods, as it crosses the fleet.
pub fn routes() -> Router<Arc<ProxyState>> {
    use crate::upload;
    use AdminCall as C;
    AdminCall::all().fold(Router::new(), |router, call| {
        let decl = call.decl();
        let methods = decl.method_filter();
        let route = match call {
            C::UpdateWeights => on(methods, push),
            C::PushLoraAdapter => on(methods, push_lora),
            C::UpdateWeightsFromDisk => on(methods, from_disk),
            C::BeginUpload => on(methods, upload::begin),
            C::CurrentUpload => on(methods, upload::current),
            C::UploadBucket => on(methods, upload::bucket),
            C::PrepareUpload => on(methods, upload::prepare),
            C::CommitUpload => on(methods, upload::commit),
            C::DiscardUpload => on(methods, upload::discard),
            C::Pause
            | C::Resume
            | C::IsPaused
            | C::Sleep
            | C::WakeUp
            | C::IsSleeping
            | C::ReleaseKvCacheMemory
            | C::ResetPrefixCache
            | C::AbortRequests
            | C::UpdateWeightVersion
            | C::WeightInfo
            | C::InitWeightTransferEngine
            | C::PauseGeneration
            | C::ContinueGeneration
            | C::FlushCache
            | C::ReleaseMemoryOccupation
            | C::ResumeMemoryOccupation
            | C::GetWeightVersion
            | C::AbortRequest
            | C::LoadLoraAdapter
            | C::UnloadLoraAdapter
            | C::SglangLoadLoraAdapter
            | C::SglangUnloadLoraAdapter => {
                on(methods, move |state, id, method, uri, headers, body| {
                    fan_out(call, state, id, method, uri, headers, body)
                })
            }
        };
        router.route(decl.path, route)
    })
}

/// Any admin call whose body is small JSON (or none): the same call to every instance.
async fn fan_out(
    call: AdminCall,
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    let args = match read(call, &uri, Some(&body)) {
        Ok(args) => args,
        Err(refused) => return refused.into_response(),
    };
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let bodies = copies(&body, app.fleet.all().len());
    let results = broadcast_to(
        &app,
        Broadcast {
            method: &method,
            paths: &[path_and_query],
            request_id: &id,
            content_type: headers.get(header::CONTENT_TYPE),
            fence: Fence::of(args.effects()),
        },
        bodies,
    )
    .await;
    summarise(uri.path(), &results)
}

/// `POST /update_weights_from_disk {"model_path", "weight_version"}`: the same reload on
/// every instance, with the caller's version or one the proxy makes.
async fn from_disk(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    uri: Uri,
    ApiBytes(body): ApiBytes,
) -> Response {
    let args = match read(AdminCall::UpdateWeightsFromDisk, &uri, Some(&body)) {
        Ok(args) => args,
        Err(refused) => return refused.into_response(),
    };
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
    let results = broadcast_to(
        &app,
        Broadcast {
            method: &Method::POST,
            paths: &["/update_weights_from_disk".to_owned()],
            request_id: &id,
            content_type: Some(&json_type),
            fence: Fence::of(args.effects()),
        },
        bodies,
    )
    .await;
    summarise("/update_weights_from_disk", &results)
}

/// `POST /update_weights?weight_version=` with a safetensors body: the body is copied to
/// every instance as it arrives (never held whole), with the caller's version or one the
/// proxy makes.
async fn push(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    uri: Uri,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let args = match read(AdminCall::UpdateWeights, &uri, None) {
        Ok(args) => args,
        Err(refused) => return refused.into_response(),
    };
    let query = with_weight_version(raw.as_deref());
    let path_and_query = format!("/update_weights?{query}");
    let fence = Fence::of(args.effects());
    tee_to_all(
        &app,
        &id,
        path_and_query,
        &headers,
        body,
        fence,
        "/update_weights",
    )
    .await
}

/// A streamed body copied to every instance as it arrives, POSTed to `path_and_query` with
/// the caller's `Content-Type` (else octet-stream); the instances' answers summarised as
/// `what`'s.
async fn tee_to_all(
    app: &ProxyState,
    id: &str,
    path_and_query: String,
    headers: &HeaderMap,
    body: Body,
    fence: Fence,
    what: &str,
) -> Response {
    let (feed, bodies) = tee(body, app.fleet.all().len());
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/octet-stream"));
    let paths = [path_and_query];
    let send = broadcast_to(
        app,
        Broadcast {
            method: &Method::POST,
            paths: &paths,
            request_id: id,
            content_type: Some(&content_type),
            fence,
        },
        bodies,
    );
    let ((), results) = tokio::join!(feed, send);
    summarise(what, &results)
}

/// `POST /v1/push_lora_adapter?lora_name=&config=` with a safetensors body: the body is
/// copied to every instance as it arrives, under the caller's query.
async fn push_lora(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let args = match read(AdminCall::PushLoraAdapter, &uri, None) {
        Ok(args) => args,
        Err(refused) => return refused.into_response(),
    };
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let fence = Fence::of(args.effects());
    tee_to_all(&app, &id, path_and_query, &headers, body, fence, uri.path()).await
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
