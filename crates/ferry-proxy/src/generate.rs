//! The generation routes through P and D: the request goes to a prefill instance with
//! `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`, then, as the client
//! sent it, with P's returned `kv_transfer_params`, to a decode instance, whose answer (SSE or
//! JSON) goes back to the client as it comes. The OpenAI routes and the RL frameworks' native
//! ones (SGLang's `/generate`, vLLM's `/inference/v1/generate`, whose `max_new_tokens` or
//! `max_tokens` sits in `sampling_params`) take the same path; [`Route`] knows where each
//! keeps its fields.
//!
//! Both calls carry the client's request id, so `/abort_requests` with it reaches the request
//! on either side. The body is checked only as far as the proxy must read it (a JSON object;
//! how many prompts); everything else is the instances' to validate, and P's refusal (a 400
//! naming the field) is the client's answer before D is called.
//!
//! A batch of prompts goes to D alone (an export holds one prompt's KV, so a batch cannot be
//! split between P and D in one request): D computes it as a plain server would.
//!
//! A request P ends as aborted (an `abort_requests` or an aborting pause reached it while P
//! held it) is the client's abort: the client gets `finish_reason: abort`, streamed when it
//! asked for a stream, and D never sees the request. Sending it on to D would undo the abort
//! (D computes the whole request, after the caller was told it was aborted).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use ferry_core::TokenId;
use ferry_http::error::ApiError;
use ferry_http::extract::{ApiBytes, RequestId};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::fleet::{InFlight, Prompt, Role};
use crate::upstream::{bad_gateway, Call, UpstreamError};
use crate::ProxyState;

/// Which generation route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
    /// SGLang's native `/generate`.
    Sglang,
    /// vLLM's token-in/token-out `/inference/v1/generate`.
    Vllm,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
            Route::Sglang => "/generate",
            Route::Vllm => "/inference/v1/generate",
        }
    }

    /// Whether the sampling fields sit in `sampling_params` (the native routes).
    fn native(self) -> bool {
        matches!(self, Route::Sglang | Route::Vllm)
    }
}

/// `POST /generate` (SGLang's).
pub async fn sglang(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    generate(&app, Route::Sglang, &id, session_key(&headers), &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /inference/v1/generate` (vLLM's).
pub async fn vllm(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    generate(&app, Route::Vllm, &id, session_key(&headers), &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    generate(&app, Route::Completions, &id, session_key(&headers), &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    generate(&app, Route::Chat, &id, session_key(&headers), &body)
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

/// The headers that name a conversation (vllm-router's and SkyRL's, SGLang's gateway's): its
/// turns go to one instance, which holds its KV ([`crate::fleet::Fleet::pick_session`]).
pub const SESSION_HEADERS: [&str; 2] = ["x-session-id", "x-smg-routing-key"];

/// The request's session key, if a header names one.
fn session_key(headers: &HeaderMap) -> Option<String> {
    SESSION_HEADERS
        .iter()
        .find_map(|h| headers.get(*h)?.to_str().ok())
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
}

async fn generate(
    app: &ProxyState,
    route: Route,
    id: &str,
    session: Option<String>,
    body: &[u8],
) -> Result<Response, Stop> {
    let request = parse_object(body)?;
    let streaming = request.get("stream").and_then(Value::as_bool) == Some(true);
    let role = app.fleet.prompt_role();
    let one_prompt = n_prompts(route, &request) == 1;
    // A session on plain instances goes where its conversation is: no need to read its
    // prompt's tokens for a route by prefix (under P/D, P is still picked by prefix).
    let by_prefix = app.fleet.routes_by_prefix(role) && !(role == Role::Whole && session.is_some());
    let tokens = if one_prompt && by_prefix {
        prompt_tokens(app, route, &request, role).await
    } else {
        None
    };
    // The adapter a request names (`model`; SGLang's `lora_path`), for its prefix's lookup.
    let model = request
        .get(if route == Route::Sglang {
            "lora_path"
        } else {
            "model"
        })
        .and_then(Value::as_str)
        .map(str::to_owned);
    let model = model.as_deref();
    if role == Role::Whole {
        let n_decode = decode_budget(route, &request);
        let prompt = tokens.as_deref().map(|t| (t, n_decode, model));
        let pick = Pick {
            role: Role::Whole,
            prompt,
            session: session.as_deref(),
        };
        return decode(app, route, id, request, streaming, pick).await;
    }
    let mut decode_request = request.clone();
    if one_prompt {
        match prefill(
            app,
            route,
            id,
            request,
            tokens.as_deref().map(|t| (t, 1, model)),
        )
        .await?
        {
            Prefilled::Exported(params) => {
                decode_request.insert("kv_transfer_params".into(), params);
            }
            Prefilled::Nothing => {
                decode_request.remove("kv_transfer_params");
            }
            Prefilled::Aborted(answer) => {
                return Ok(aborted_answer(route, &decode_request, answer));
            }
        }
    } else {
        decode_request.remove("kv_transfer_params");
    }
    // Under P/D a session's affinity picks D, which holds the conversation's decode KV; P
    // is chosen as any prompt's.
    let pick = Pick {
        role: Role::Decode,
        prompt: None,
        session: session.as_deref(),
    };
    decode(app, route, id, decode_request, streaming, pick).await
}

/// How [`decode`] picks its instance: of `role`, by the session if the request names one,
/// else by the prompt's tokens when given (a route by prefix), else by load.
#[derive(Debug, Clone, Copy)]
struct Pick<'a> {
    role: Role,
    prompt: Option<Prompt<'a>>,
    session: Option<&'a str>,
}

/// The tokens a whole instance will decode for the request: what it asks for (vLLM's default
/// for a completion without a bound, 16, stands in for a chat's and a token-in/token-out
/// request's; SGLang's own default is 128).
fn decode_budget(route: Route, request: &Map<String, Value>) -> usize {
    let (fields, keys, default): (Option<&Map<String, Value>>, &[&str], u64) = match route {
        Route::Completions | Route::Chat => {
            (Some(request), &["max_tokens", "max_completion_tokens"], 16)
        }
        Route::Sglang => (
            request.get("sampling_params").and_then(Value::as_object),
            &["max_new_tokens"],
            128,
        ),
        Route::Vllm => (
            request.get("sampling_params").and_then(Value::as_object),
            &["max_tokens"],
            16,
        ),
    };
    fields
        .and_then(|f| keys.iter().find_map(|k| f.get(*k)?.as_u64()))
        .unwrap_or(default) as usize
}

/// The prompt's token ids, for routing by prefix: given in the request, or from an
/// instance's `/tokenize` (as the instance will tokenize it: a completion's text with its
/// special tokens, a chat's messages through the template). `None` (routed by load) when
/// they cannot be had quickly.
async fn prompt_tokens(
    app: &ProxyState,
    route: Route,
    request: &Map<String, Value>,
    role: Role,
) -> Option<Vec<TokenId>> {
    let ids = |v: &Value| -> Option<Vec<TokenId>> {
        v.as_array()?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).map(TokenId))
            .collect()
    };
    let body = match route {
        Route::Completions => match request.get("prompt")? {
            Value::String(s) => json!({ "prompt": s }),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => json!({ "prompt": a[0] }),
            Value::Array(a) if a.len() == 1 && a[0].is_array() => return ids(&a[0]),
            p => return ids(p),
        },
        Route::Vllm => return ids(request.get("token_ids")?),
        Route::Sglang => match (request.get("input_ids"), request.get("text")) {
            (Some(p), _) if !p.is_null() => match p {
                Value::Array(a) if a.len() == 1 && a[0].is_array() => return ids(&a[0]),
                p => return ids(p),
            },
            (_, Some(Value::String(s))) => json!({ "prompt": s }),
            (_, Some(Value::Array(a))) if a.len() == 1 && a[0].is_string() => {
                json!({ "prompt": a[0] })
            }
            _ => return None,
        },
        Route::Chat => {
            let mut body = json!({
                "messages": request.get("messages")?,
                "add_generation_prompt": request.get("add_generation_prompt").unwrap_or(&json!(true)),
            });
            // Whatever changes the rendering: the instance renders the chat with them.
            for field in [
                "chat_template_kwargs",
                "chat_template",
                "continue_final_message",
                "tools",
            ] {
                if let Some(v) = request.get(field) {
                    body[field] = v.clone();
                }
            }
            body
        }
    };
    let instance = app.fleet.of(role).next()?;
    let call = Call {
        method: Method::POST,
        path_and_query: "/tokenize",
        request_id: None,
        content_type: Some(HeaderValue::from_static("application/json")),
        body: serde_json::to_vec(&body).ok()?.into(),
        timeout: Some(Duration::from_secs(2)),
    };
    match app.upstream.send_read(instance, call).await {
        Ok((status, _, answer)) if status.is_success() => {
            ids(&serde_json::from_slice::<Value>(&answer).ok()?["tokens"])
        }
        _ => None,
    }
}

/// The prompt tokens a JSON answer says were cached: its
/// `usage.prompt_tokens_details.cached_tokens` (SGLang's: `meta_info.cached_tokens`).
fn cached_tokens(route: Route, answer: &[u8]) -> Option<usize> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    let cached = match route {
        Route::Sglang => &v["meta_info"]["cached_tokens"],
        _ => &v["usage"]["prompt_tokens_details"]["cached_tokens"],
    };
    cached.as_u64().map(|n| n as usize)
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

/// How many prompts the request holds (chat and token-in/token-out: one; completions: a
/// string or token list is one, a list of strings or of token lists one each; SGLang's
/// `input_ids` or `text` likewise).
fn n_prompts(route: Route, request: &Map<String, Value>) -> usize {
    let prompt = match route {
        Route::Completions => request.get("prompt"),
        Route::Sglang => request
            .get("input_ids")
            .filter(|v| !v.is_null())
            .or_else(|| request.get("text")),
        Route::Chat | Route::Vllm => None,
    };
    match prompt {
        Some(Value::Array(items)) if !items.iter().all(Value::is_number) => items.len(),
        _ => 1,
    }
}

/// The request P computes: one token, no stream, one choice, no logprobs, and the export
/// asked for. Everything else is the client's, so P refuses what D would.
fn prefill_request(route: Route, mut request: Map<String, Value>) -> Map<String, Value> {
    if route.native() {
        // The native routes keep their sampling fields in `sampling_params`.
        let mut sampling = match request.remove("sampling_params") {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        let max = if route == Route::Sglang {
            "max_new_tokens"
        } else {
            "max_tokens"
        };
        sampling.insert(max.into(), json!(1));
        sampling.insert("n".into(), json!(1));
        for key in ["logprobs", "prompt_logprobs"] {
            sampling.remove(key);
        }
        request.insert("sampling_params".into(), Value::Object(sampling));
        request.insert("stream".into(), json!(false));
        for key in [
            "stream_options",
            "return_logprob",
            "top_logprobs_num",
            "return_text_in_logprobs",
        ] {
            request.remove(key);
        }
        request.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false}),
        );
        return request;
    }
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

/// What P's answer says about the prompt.
#[derive(Debug, PartialEq)]
enum Prefilled {
    /// Its KV is exported under these `kv_transfer_params`.
    Exported(Value),
    /// P exported nothing (a P without `--kv-role kv_producer`): D computes the prompt.
    Nothing,
    /// P ended the request as aborted (this is P's answer): so does the client's request.
    Aborted(Value),
}

/// Runs the request's prompt on the least-loaded prefill instance (the next one when one is
/// unreachable) and returns what it made of it.
async fn prefill(
    app: &ProxyState,
    route: Route,
    id: &str,
    request: Map<String, Value>,
    prompt: Option<Prompt<'_>>,
) -> Result<Prefilled, Stop> {
    let body = Bytes::from(
        serde_json::to_vec(&prefill_request(route, request)).map_err(|e| {
            ApiError::internal(format!("could not encode the prefill request: {e}"))
        })?,
    );
    let mut tried = Vec::new();
    let mut unreachable = Vec::new();
    while let Some(guard) = app.fleet.pick_for(Role::Prefill, &tried, prompt) {
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
                if let Some(cached) = cached_tokens(route, &answer) {
                    guard.check_cached(cached);
                }
                drop(guard);
                return prefilled(route, &instance, &answer).map_err(Stop::from);
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

/// P's `kv_transfer_params` out of its answer, or that it aborted the request or exported
/// nothing.
fn prefilled(
    route: Route,
    instance: &crate::fleet::Instance,
    answer: &[u8],
) -> Result<Prefilled, UpstreamError> {
    let value: Value = serde_json::from_slice(answer)
        .map_err(|e| UpstreamError::broken(instance, format!("its answer is not JSON: {e}")))?;
    let finish = match route {
        Route::Sglang => &value["meta_info"]["finish_reason"]["type"],
        _ => &value["choices"][0]["finish_reason"],
    };
    if finish == "abort" {
        return Ok(Prefilled::Aborted(value));
    }
    match value.get("kv_transfer_params") {
        None | Some(Value::Null) => {
            tracing::warn!(
                url = %instance.url,
                "the prefill instance returned no kv_transfer_params (is it started with \
                 --kv-role kv_producer?); the decode instance computes the prompt"
            );
            Ok(Prefilled::Nothing)
        }
        Some(p @ Value::Object(_)) => Ok(Prefilled::Exported(p.clone())),
        Some(other) => Err(UpstreamError::broken(
            instance,
            format!("its kv_transfer_params are not an object: {other}"),
        )),
    }
}

/// The client's answer to a request P aborted, built from P's answer: each of the `n`
/// choices the client asked for ends with `finish_reason: abort` and no output (P aborts
/// before its one token, else the request had finished there), as one JSON body or, for a
/// stream, one chunk per choice (and the usage chunk if asked for) then `[DONE]`.
fn aborted_answer(route: Route, request: &Map<String, Value>, p_answer: Value) -> Response {
    let fields = if route.native() {
        request.get("sampling_params").and_then(Value::as_object)
    } else {
        Some(request)
    };
    let n = fields
        .and_then(|f| f.get("n"))
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .max(1);
    let streaming = request.get("stream").and_then(Value::as_bool) == Some(true);
    if route == Route::Sglang {
        return sglang_aborted(n, streaming, p_answer);
    }
    if !streaming {
        let mut answer = p_answer;
        let choice = answer["choices"][0].clone();
        answer["choices"] = (0..n)
            .map(|i| {
                let mut c = choice.clone();
                c["index"] = json!(i);
                c
            })
            .collect();
        return axum::Json(answer).into_response();
    }
    let object = match route {
        Route::Completions => "text_completion",
        Route::Chat => "chat.completion.chunk",
        Route::Sglang | Route::Vllm => "",
    };
    let chunk = |choices: Value| {
        json!({"id": p_answer["id"], "object": object, "created": p_answer["created"],
               "model": p_answer["model"], "choices": choices})
    };
    let mut body = String::new();
    for i in 0..n {
        let choice = match route {
            Route::Completions => json!({"index": i, "text": "", "logprobs": null,
                                         "finish_reason": "abort", "stop_reason": null}),
            Route::Chat => json!({"index": i, "delta": {}, "logprobs": null,
                                  "finish_reason": "abort", "stop_reason": null}),
            Route::Sglang | Route::Vllm => json!({"index": i, "token_ids": [], "logprobs": null,
                                  "finish_reason": "abort"}),
        };
        let event = if route == Route::Vllm {
            json!({"request_id": p_answer["request_id"], "choices": [choice]})
        } else {
            chunk(json!([choice]))
        };
        body.push_str(&format!("data: {event}\n\n"));
    }
    let include_usage = request
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true);
    if include_usage {
        let mut usage = chunk(json!([]));
        usage["usage"] = p_answer["usage"].clone();
        body.push_str(&format!("data: {usage}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    sse_body(body)
}

/// An SGLang client's answer to a request P aborted: P's output dict (no tokens,
/// `finish_reason` `abort`) for each of the `n` choices (a list when `n` > 1), or, for a
/// stream, one event each (with its `index` when `n` > 1), then `[DONE]`.
fn sglang_aborted(n: u64, streaming: bool, p_answer: Value) -> Response {
    let outputs: Vec<Value> = (0..n)
        .map(|i| {
            let mut out = p_answer.clone();
            if let Value::Object(o) = &mut out {
                o.remove("kv_transfer_params");
                if n > 1 {
                    o.insert("index".into(), json!(i));
                }
            }
            out
        })
        .collect();
    if !streaming {
        return if n > 1 {
            axum::Json(Value::Array(outputs)).into_response()
        } else {
            axum::Json(outputs.into_iter().next().unwrap_or_default()).into_response()
        };
    }
    let mut body: String = outputs.iter().map(|o| format!("data: {o}\n\n")).collect();
    body.push_str("data: [DONE]\n\n");
    sse_body(body)
}

/// A complete server-sent-event body.
fn sse_body(body: String) -> Response {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Sends the client's request (with P's parameters) to a decode instance (or the whole
/// request to a plain one, picked by its prompt's `tokens` when given) and answers with what
/// it returns, streamed as it comes.
async fn decode(
    app: &ProxyState,
    route: Route,
    id: &str,
    request: Map<String, Value>,
    streaming: bool,
    pick: Pick<'_>,
) -> Result<Response, Stop> {
    let Pick {
        role,
        prompt,
        session,
    } = pick;
    let body = Bytes::from(
        serde_json::to_vec(&request)
            .map_err(|e| ApiError::internal(format!("could not encode the request: {e}")))?,
    );
    let mut tried = Vec::new();
    let mut unreachable = Vec::new();
    let next = |tried: &[String]| match session {
        Some(key) => app.fleet.pick_session(role, tried, key),
        None => app.fleet.pick_for(role, tried, prompt),
    };
    while let Some(guard) = next(&tried) {
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
                return Ok(stream_back(response, guard, app.config.stream_idle_timeout));
            }
            Ok(response) => {
                let status = response.status();
                let headers = response.headers().clone();
                let answer = response.bytes().await.map_err(|e| {
                    instance.record_failure();
                    UpstreamError::from_reqwest(&instance, None, &e)
                })?;
                if let Some(cached) = cached_tokens(route, &answer).filter(|_| status.is_success())
                {
                    guard.check_cached(cached);
                }
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
    Err(none_reachable(role, &unreachable).into())
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
/// connection, and D aborts the request). A connection to D that breaks mid-stream, or stays
/// silent for `idle` (a cut link leaves the TCP connection open and quiet; `ferry serve` sends
/// a keep-alive comment on an idle stream every 2 s (`ferry_server::sse::SSE_KEEP_ALIVE`), a paused
/// one included), ends the client's stream with an error event naming D, then `[DONE]`; the
/// connection to D is dropped with the stream.
fn stream_back(response: reqwest::Response, guard: InFlight, idle: Option<Duration>) -> Response {
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    let pieces = response.bytes_stream().boxed();
    let stream = futures_util::stream::unfold(Some((pieces, guard)), move |state| async move {
        let (mut pieces, guard) = state?;
        let next = match idle {
            None => pieces.next().await.map(|p| p.map_err(Broke::Error)),
            Some(t) => match tokio::time::timeout(t, pieces.next()).await {
                Ok(next) => next.map(|p| p.map_err(Broke::Error)),
                Err(_) => Some(Err(Broke::Silent(t))),
            },
        };
        match next {
            None => None,
            Some(Ok(bytes)) => Some((
                Ok::<_, std::convert::Infallible>(bytes),
                Some((pieces, guard)),
            )),
            Some(Err(why)) => {
                let instance = &guard.instance;
                instance.record_failure();
                let e = match why {
                    Broke::Error(e) => UpstreamError::from_reqwest(instance, None, &e),
                    Broke::Silent(t) => UpstreamError::broken(
                        instance,
                        format!(
                            "its stream sent nothing for {:.1} s (--stream-idle-timeout-seconds): \
                             the connection is taken as dead",
                            t.as_secs_f64()
                        ),
                    ),
                };
                tracing::warn!("{e}");
                let body = bad_gateway(e.to_string()).body();
                let json = serde_json::to_string(&body).unwrap_or_default();
                // The guard and D's connection go with this last piece.
                Some((
                    Ok(Bytes::from(format!("data: {json}\n\ndata: [DONE]\n\n"))),
                    None,
                ))
            }
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

/// Why D's stream ended early.
enum Broke {
    Error(reqwest::Error),
    /// Nothing arrived for this long.
    Silent(Duration),
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
    fn native_prefills_set_their_fields_in_sampling_params() {
        let request = object(json!({"input_ids": [1, 2], "stream": true,
            "return_logprob": true, "top_logprobs_num": 2, "return_text_in_logprobs": true,
            "sampling_params": {"max_new_tokens": 50, "n": 3, "temperature": 0}}));
        assert_eq!(
            Value::Object(prefill_request(Route::Sglang, request)),
            json!({"input_ids": [1, 2], "stream": false,
                "sampling_params": {"max_new_tokens": 1, "n": 1, "temperature": 0},
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}})
        );
        let request = object(json!({"model": "m", "token_ids": [3], "stream": true,
            "stream_options": {"include_usage": true},
            "sampling_params": {"max_tokens": 9, "logprobs": 2, "prompt_logprobs": 1}}));
        assert_eq!(
            Value::Object(prefill_request(Route::Vllm, request)),
            json!({"model": "m", "token_ids": [3], "stream": false,
                "sampling_params": {"max_tokens": 1, "n": 1},
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}})
        );
        let budget = |route, v: Value| decode_budget(route, &object(v));
        assert_eq!(budget(Route::Sglang, json!({})), 128);
        assert_eq!(
            budget(
                Route::Sglang,
                json!({"sampling_params": {"max_new_tokens": 7}})
            ),
            7
        );
        assert_eq!(budget(Route::Vllm, json!({"sampling_params": {}})), 16);
        assert_eq!(budget(Route::Completions, json!({"max_tokens": 5})), 5);
        let n = |v: Value| n_prompts(Route::Sglang, &object(v));
        assert_eq!(n(json!({"input_ids": [1, 2]})), 1);
        assert_eq!(n(json!({"input_ids": [[1], [2]]})), 2);
        assert_eq!(n(json!({"input_ids": null, "text": ["a", "b", "c"]})), 3);
        assert_eq!(n(json!({"text": "a"})), 1);
        assert_eq!(
            n_prompts(Route::Vllm, &object(json!({"token_ids": [1, 2]}))),
            1
        );
        let instance = crate::fleet::Instance::new("http://p0", Role::Prefill);
        let aborted = json!({"text": "", "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort", "message": "aborted"}}});
        assert_eq!(
            prefilled(
                Route::Sglang,
                &instance,
                &serde_json::to_vec(&aborted).unwrap()
            )
            .unwrap(),
            Prefilled::Aborted(aborted)
        );
        let exported = json!({"meta_info": {"finish_reason": {"type": "length", "length": 1}},
                              "kv_transfer_params": {"do_remote_prefill": true}});
        assert_eq!(
            prefilled(
                Route::Sglang,
                &instance,
                &serde_json::to_vec(&exported).unwrap()
            )
            .unwrap(),
            Prefilled::Exported(json!({"do_remote_prefill": true}))
        );
        let answer = json!({"meta_info": {"cached_tokens": 8}});
        assert_eq!(
            cached_tokens(Route::Sglang, &serde_json::to_vec(&answer).unwrap()),
            Some(8)
        );
    }

    #[tokio::test]
    async fn an_aborted_sglang_answer_is_one_output_per_choice() {
        let p_answer = json!({"text": "", "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort", "message": "aborted"}},
            "kv_transfer_params": {"x": 1}});
        let body = |r: Response| async move {
            let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
            String::from_utf8(bytes.to_vec()).unwrap()
        };
        let request = object(json!({"input_ids": [1], "sampling_params": {"n": 2}}));
        let plain: Value = serde_json::from_str(
            &body(aborted_answer(Route::Sglang, &request, p_answer.clone())).await,
        )
        .unwrap();
        assert_eq!(plain.as_array().unwrap().len(), 2, "{plain}");
        assert_eq!(plain[1]["index"], 1);
        assert_eq!(plain[1]["meta_info"]["finish_reason"]["type"], "abort");
        assert!(plain[0].get("kv_transfer_params").is_none(), "{plain}");
        let request = object(json!({"input_ids": [1], "stream": true}));
        let events = body(aborted_answer(Route::Sglang, &request, p_answer)).await;
        let events: Vec<&str> = events
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(events[1], "[DONE]");
        let first: Value = serde_json::from_str(events[0]).unwrap();
        assert_eq!(first["meta_info"]["finish_reason"]["type"], "abort");
        assert!(first.get("index").is_none());
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
    fn an_answer_p_aborted_is_the_clients_abort() {
        let instance = crate::fleet::Instance::new("http://p0", Role::Prefill);
        let aborted = json!({"id": "cmpl-1", "object": "text_completion", "created": 7,
            "model": "m", "choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}});
        let answer = serde_json::to_vec(&aborted).unwrap();
        assert_eq!(
            prefilled(Route::Completions, &instance, &answer).unwrap(),
            Prefilled::Aborted(aborted.clone())
        );
        let exported = json!({"choices": [{"finish_reason": "length"}],
                              "kv_transfer_params": {"do_remote_prefill": true}});
        let answer = serde_json::to_vec(&exported).unwrap();
        assert_eq!(
            prefilled(Route::Completions, &instance, &answer).unwrap(),
            Prefilled::Exported(json!({"do_remote_prefill": true}))
        );
        let answer = serde_json::to_vec(&json!({"choices": [{"finish_reason": "length"}]}));
        assert_eq!(
            prefilled(Route::Completions, &instance, &answer.unwrap()).unwrap(),
            Prefilled::Nothing
        );
    }

    #[tokio::test]
    async fn an_aborted_answer_has_the_shape_the_client_asked_for() {
        let p_answer = json!({"id": "cmpl-1", "object": "text_completion", "created": 7,
            "model": "m", "choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}});
        let body = |r: Response| async move {
            let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
            String::from_utf8(bytes.to_vec()).unwrap()
        };
        let request = object(json!({"prompt": "a", "n": 2}));
        let plain = body(aborted_answer(
            Route::Completions,
            &request,
            p_answer.clone(),
        ))
        .await;
        let plain: Value = serde_json::from_str(&plain).unwrap();
        assert_eq!(plain["choices"][1]["index"], 1, "{plain}");
        assert_eq!(plain["choices"][1]["finish_reason"], "abort", "{plain}");

        let request = object(json!({"messages": [], "stream": true,
                                    "stream_options": {"include_usage": true}}));
        let response = aborted_answer(Route::Chat, &request, p_answer);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/event-stream"
        );
        let events: Vec<String> = body(response)
            .await
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
            .collect();
        assert_eq!(events.len(), 3, "{events:?}");
        let first: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["id"], "cmpl-1");
        assert_eq!(first["choices"][0]["delta"], json!({}));
        assert_eq!(first["choices"][0]["finish_reason"], "abort");
        let usage: Value = serde_json::from_str(&events[1]).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens"], 5, "{usage}");
        assert_eq!(events[2], "[DONE]");
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
