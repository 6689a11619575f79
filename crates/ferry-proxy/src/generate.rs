//! The two generation routes through P and D: the request goes to a prefill instance with
//! `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`, then, as the client
//! sent it, with P's returned `kv_transfer_params`, to a decode instance, whose answer (SSE or
//! JSON) goes back to the client as it comes.
//!
//! Both calls carry the client's request id, so `/abort_requests` with it reaches the request
//! on either side. The body is checked only as far as the proxy must read it (a JSON object;
//! how many prompts); everything else is the instances' to validate, and P's refusal (a 400
//! naming the field) is the client's answer before D is called.
//!
//! A batch of prompts goes to D alone (an export holds one prompt's KV, so a batch cannot be
//! split between P and D in one request): D computes it as a plain server would.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use ferry_server::error::ApiError;
use ferry_server::extract::{ApiBytes, RequestId};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::fleet::{InFlight, Role};
use crate::upstream::{bad_gateway, Call, UpstreamError};
use crate::ProxyState;

/// Which generation route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        }
    }
}

/// `POST /v1/completions`.
pub async fn completions(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    ApiBytes(body): ApiBytes,
) -> Response {
    generate(&app, Route::Completions, &id, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    ApiBytes(body): ApiBytes,
) -> Response {
    generate(&app, Route::Chat, &id, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// What ends a generation early: the proxy's own error, or an instance's error answer
/// passed through as it came (a 400 naming the field, a 503 from a full queue).
#[derive(Debug)]
enum Stop {
    Error(ApiError),
    Answer(Response),
}

impl From<ApiError> for Stop {
    fn from(e: ApiError) -> Self {
        Stop::Error(e)
    }
}

impl From<UpstreamError> for Stop {
    fn from(e: UpstreamError) -> Self {
        Stop::Error(e.into())
    }
}

impl IntoResponse for Stop {
    fn into_response(self) -> Response {
        match self {
            Stop::Error(e) => e.into_response(),
            Stop::Answer(r) => r,
        }
    }
}

async fn generate(app: &ProxyState, route: Route, id: &str, body: &[u8]) -> Result<Response, Stop> {
    let request = parse_object(body)?;
    let streaming = request.get("stream").and_then(Value::as_bool) == Some(true);
    let mut decode_request = request.clone();
    if n_prompts(route, &request) == 1 {
        match prefill(app, route, id, request).await? {
            Some(params) => {
                decode_request.insert("kv_transfer_params".into(), params);
            }
            // P exported nothing (its request was aborted): D computes the prompt itself.
            None => {
                decode_request.remove("kv_transfer_params");
            }
        }
    } else {
        decode_request.remove("kv_transfer_params");
    }
    decode(app, route, id, decode_request, streaming).await
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// How many prompts the request holds (chat: one; completions: a string or token list is
/// one, a list of strings or of token lists one each).
fn n_prompts(route: Route, request: &Map<String, Value>) -> usize {
    match (route, request.get("prompt")) {
        (Route::Completions, Some(Value::Array(items))) => {
            if items.iter().all(Value::is_number) {
                1
            } else {
                items.len()
            }
        }
        _ => 1,
    }
}

/// The request P computes: one token, no stream, one choice, no logprobs, and the export
/// asked for. Everything else is the client's, so P refuses what D would.
fn prefill_request(route: Route, mut request: Map<String, Value>) -> Map<String, Value> {
    request.insert("max_tokens".into(), json!(1));
    if route == Route::Chat && request.contains_key("max_completion_tokens") {
        request.insert("max_completion_tokens".into(), json!(1));
    }
    request.insert("stream".into(), json!(false));
    request.insert("n".into(), json!(1));
    for key in ["stream_options", "logprobs", "top_logprobs", "best_of"] {
        request.remove(key);
    }
    request.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false}),
    );
    request
}

/// Runs the request's prompt on the least-loaded prefill instance (the next one when one is
/// unreachable) and returns its `kv_transfer_params`.
async fn prefill(
    app: &ProxyState,
    route: Route,
    id: &str,
    request: Map<String, Value>,
) -> Result<Option<Value>, Stop> {
    let body = Bytes::from(
        serde_json::to_vec(&prefill_request(route, request)).map_err(|e| {
            ApiError::internal(format!("could not encode the prefill request: {e}"))
        })?,
    );
    let mut tried = Vec::new();
    let mut unreachable = Vec::new();
    while let Some(guard) = app.fleet.pick(Role::Prefill, &tried) {
        let instance = Arc::clone(&guard.instance);
        tried.push(instance.url.clone());
        let call = Call {
            method: Method::POST,
            path_and_query: route.path(),
            request_id: Some(id),
            content_type: Some(HeaderValue::from_static("application/json")),
            body: body.clone().into(),
            timeout: Some(app.config.prefill_timeout),
        };
        match app.upstream.send_read(&instance, call).await {
            Ok((status, headers, answer)) if !status.is_success() => {
                return Err(Stop::Answer(passthrough(status, &headers, answer)))
            }
            Ok((_, _, answer)) => {
                drop(guard);
                return exported_params(&instance, &answer).map_err(Stop::from);
            }
            Err(e) if e.nothing_sent() => {
                instance.record_failure();
                tracing::warn!(request_id = id, "{e}");
                unreachable.push(e.to_string());
            }
            Err(e) => {
                instance.record_failure();
                return Err(e.into());
            }
        }
    }
    Err(none_reachable(Role::Prefill, &unreachable).into())
}

/// P's `kv_transfer_params` out of its answer: `None` when it exported nothing.
fn exported_params(
    instance: &crate::fleet::Instance,
    answer: &[u8],
) -> Result<Option<Value>, UpstreamError> {
    let value: Value = serde_json::from_slice(answer)
        .map_err(|e| UpstreamError::broken(instance, format!("its answer is not JSON: {e}")))?;
    match value.get("kv_transfer_params") {
        None | Some(Value::Null) => {
            tracing::warn!(
                url = %instance.url,
                "the prefill instance returned no kv_transfer_params (is it started with \
                 --kv-role kv_producer?); the decode instance computes the prompt"
            );
            Ok(None)
        }
        Some(p @ Value::Object(_)) => Ok(Some(p.clone())),
        Some(other) => Err(UpstreamError::broken(
            instance,
            format!("its kv_transfer_params are not an object: {other}"),
        )),
    }
}

/// Sends the client's request (with P's parameters) to the least-loaded decode instance and
/// answers with what it returns, streamed as it comes.
async fn decode(
    app: &ProxyState,
    route: Route,
    id: &str,
    request: Map<String, Value>,
    streaming: bool,
) -> Result<Response, Stop> {
    let body = Bytes::from(
        serde_json::to_vec(&request)
            .map_err(|e| ApiError::internal(format!("could not encode the request: {e}")))?,
    );
    let mut tried = Vec::new();
    let mut unreachable = Vec::new();
    while let Some(guard) = app.fleet.pick(Role::Decode, &tried) {
        let instance = Arc::clone(&guard.instance);
        tried.push(instance.url.clone());
        let call = Call {
            method: Method::POST,
            path_and_query: route.path(),
            request_id: Some(id),
            content_type: Some(HeaderValue::from_static("application/json")),
            body: body.clone().into(),
            timeout: None,
        };
        match app.upstream.send(&instance, call).await {
            Ok(response) if streaming && response.status().is_success() => {
                return Ok(stream_back(response, guard));
            }
            Ok(response) => {
                let status = response.status();
                let headers = response.headers().clone();
                let answer = response.bytes().await.map_err(|e| {
                    instance.record_failure();
                    UpstreamError::from_reqwest(&instance, None, &e)
                })?;
                return Ok(passthrough(status, &headers, answer));
            }
            Err(e) if e.nothing_sent() => {
                instance.record_failure();
                tracing::warn!(request_id = id, "{e}");
                unreachable.push(e.to_string());
            }
            Err(e) => {
                instance.record_failure();
                return Err(e.into());
            }
        }
    }
    Err(none_reachable(Role::Decode, &unreachable).into())
}

/// A 503 when every instance of a role was unreachable (each named), or there is none.
fn none_reachable(role: Role, reasons: &[String]) -> ApiError {
    if reasons.is_empty() {
        return ApiError::unavailable(format!("the proxy has no {role} instance"));
    }
    ApiError::unavailable(format!(
        "no {role} instance is reachable: {}",
        reasons.join("; ")
    ))
}

/// An instance's whole answer, as it came (status, content type, body).
fn passthrough(status: StatusCode, headers: &axum::http::HeaderMap, body: Bytes) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, ct.clone());
    }
    response
}

/// D's event stream, passed through as it arrives; the request counts as in flight on D until
/// the stream ends or the client goes away (which drops the stream and so closes D's
/// connection, and D aborts the request). A connection to D that breaks mid-stream ends the
/// client's stream with an error event naming D, then `[DONE]`.
fn stream_back(response: reqwest::Response, guard: InFlight) -> Response {
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    let instance = Arc::clone(&guard.instance);
    let mut failed = false;
    let stream = response.bytes_stream().map(move |piece| {
        let _in_flight = &guard;
        match piece {
            Ok(bytes) => Ok::<_, std::convert::Infallible>(bytes),
            Err(e) if !failed => {
                failed = true;
                instance.record_failure();
                let e = UpstreamError::from_reqwest(&instance, None, &e);
                tracing::warn!("{e}");
                let body = bad_gateway(e.to_string()).body();
                let json = serde_json::to_string(&body).unwrap_or_default();
                Ok(Bytes::from(format!("data: {json}\n\ndata: [DONE]\n\n")))
            }
            Err(_) => Ok(Bytes::new()),
        }
    });
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = status;
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or_else(|| HeaderValue::from_static("text/event-stream")),
    );
    out.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    out
}

/// Default bound on P's answer.
pub const DEFAULT_PREFILL_TIMEOUT: Duration = Duration::from_secs(300);

#[cfg(test)]
mod tests {
    use super::*;

    fn object(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn prefill_asks_for_one_token_and_an_export() {
        let request = object(
            json!({"model": "m", "messages": [], "max_completion_tokens": 50,
            "stream": true, "stream_options": {"include_usage": true}, "n": 3, "logprobs": true,
            "top_logprobs": 2, "temperature": 0, "kv_transfer_params": {"x": 1}}),
        );
        let p = prefill_request(Route::Chat, request);
        assert_eq!(
            Value::Object(p),
            json!({"model": "m", "messages": [], "max_completion_tokens": 1, "max_tokens": 1,
                "stream": false, "n": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}})
        );
    }

    #[test]
    fn counts_prompts_as_the_server_reads_them() {
        let n = |v: Value| n_prompts(Route::Completions, &object(v));
        assert_eq!(n(json!({"prompt": "a"})), 1);
        assert_eq!(n(json!({"prompt": [1, 2, 3]})), 1);
        assert_eq!(n(json!({"prompt": ["a", "b"]})), 2);
        assert_eq!(n(json!({"prompt": [[1], [2], [3]]})), 3);
        assert_eq!(
            n_prompts(Route::Chat, &object(json!({"prompt": ["a", "b"]}))),
            1
        );
    }

    #[test]
    fn bodies_that_are_not_objects_are_400s() {
        assert_eq!(
            parse_object(b"[1]").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            parse_object(b"{").unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert!(parse_object(b"{}").is_ok());
    }
}
