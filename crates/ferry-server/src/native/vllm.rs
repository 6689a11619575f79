//! vLLM's token-in/token-out `POST /inference/v1/generate` (vLLM's
//! `entrypoints/serve/disagg/protocol.py`), as prime-rl's renderers client and SkyRL's
//! `RemoteInferenceClient` call it.
//!
//! Request: `{"model", "token_ids", "sampling_params": {vLLM's SamplingParams fields},
//! "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params"}`; an
//! `X-Session-ID` header (SkyRL's, for session-affine routers) is accepted and ignored: one
//! server has nothing to route. Response: `{"request_id", "choices": [{"index", "token_ids",
//! "finish_reason", "logprobs": {"content": [{"token": "token_id:<id>", "logprob", "bytes",
//! "top_logprobs"}]}, "routed_experts"}], "prompt_logprobs", "kv_transfer_params", "usage"}`;
//! a stream sends each choice's new `token_ids` as they come (vLLM's
//! `GenerateStreamResponse`), the usage chunk when `stream_options.include_usage` asks for
//! it, then `data: [DONE]`. `routed_experts` (a server capturing expert routing;
//! [`crate::routed_experts`]) is on every choice, `null` without routing, and in a stream
//! on every chunk, set on a choice's last (vLLM 0.34's
//! `entrypoints/scale_out/token_in_token_out`).
//!
//! `top_logprobs` lists the sampled token first, then the best others (without repeating
//! it), `max(logprobs, 1)` in all, as vLLM's dict of them iterates. `max_tokens` defaults to
//! the rest of the context, as vLLM's route sets it. Everything else is the completions
//! request these fields are ([`super::as_completions`]): its sampling, its checks, its 400s.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_engine::{OutputChunk, TokenId, TokenLogprob};
use serde_json::{json, Map, Value};

use super::{as_completions, get, logprob_json, object, refuse_set, room, token_ids};
use crate::error::ApiError;
use crate::extract::{ApiJson, RequestId};
use crate::generate::{
    check_failed_choices, finish_fields, response_transfer_params, start, ChoiceStream, StreamBase,
    UsageTally,
};
use crate::logprobs::prompt_logprobs_json;
use crate::routed_experts;
use crate::sse::{sse_response, to_json, ChunkFormatter};
use crate::state::AppState;

/// `POST /inference/v1/generate`'s body, for the OpenAPI document (the handler reads the
/// JSON itself, so that each field's error names it as vLLM's client sent it).
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
pub struct VllmGenerateRequest {
    pub model: Option<String>,
    /// The prompt's token ids.
    pub token_ids: Option<Vec<u32>>,
    /// vLLM's `SamplingParams`: the completions sampling fields under the same names
    /// (`max_tokens` defaults to the rest of the context).
    #[schema(value_type = Option<Object>)]
    pub sampling_params: Option<Value>,
    pub stream: Option<bool>,
    #[schema(value_type = Option<Object>)]
    pub stream_options: Option<Value>,
    pub cache_salt: Option<String>,
    pub priority: Option<i64>,
    #[schema(value_type = Option<Object>)]
    pub kv_transfer_params: Option<Value>,
}

/// vLLM `SamplingParams` fields that are completions fields of the same name.
const SAME: &[&str] = &[
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "routed_experts_prompt_start",
    "structured_outputs",
    "guided_decoding",
    "logit_bias",
];

/// `SamplingParams` fields that change nothing a client sees here: `detokenize` and
/// `output_kind` are how vLLM's engine builds its outputs (this route returns token ids, and
/// streams deltas, either way), `flat_logprobs` a storage form, `skip_clone` a copy it
/// skips, `extra_args` arguments for custom processors (none here).
const IGNORED: &[&str] = &[
    "detokenize",
    "output_kind",
    "flat_logprobs",
    "skip_clone",
    "extra_args",
];

/// `SamplingParams` fields ferry does not implement: refused when set.
const REFUSED_SAMPLING: &[&str] = &[
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "thinking_token_budget",
    "repetition_detection",
];

/// `POST /inference/v1/generate`.
pub async fn generate(
    State(app): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    if let Some(session) = headers.get("x-session-id") {
        tracing::debug!(
            request_id,
            ?session,
            "X-Session-ID (ignored: one server routes nothing)"
        );
    }
    let req = object(body)?;
    refuse_set(&req, &["features"], "")?;
    let ids = match get(&req, "token_ids") {
        None => return Err(ApiError::invalid("token_ids", "`token_ids` is required")),
        Some(v) => token_ids(v).ok_or_else(|| {
            ApiError::invalid("token_ids", "`token_ids` must be a list of token ids")
        })?,
    };
    let mut out = completion_fields(&req)?;
    if !out.contains_key("max_tokens") {
        out.insert("max_tokens".into(), json!(room(&app, ids.len())));
    }
    out.insert("prompt".into(), json!(ids));
    for key in [
        "model",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
    ] {
        if let Some(v) = get(&req, key) {
            out.insert(key.into(), v.clone());
        }
    }
    let (prompts, params) = as_completions(&app, vec![out], |_, p| rename(p))?;
    let top_n = params.sampling.sampler.logprobs;
    let routed_start = params.routed_experts_prompt_start;
    let (head, choices) = start(&app, request_id, &prompts, &params, "token_ids", arrival).await?;
    if params.stream {
        let base = StreamBase::new(head, &prompts, &params, app.texts.clone());
        let streams = choices.into_iter().map(ChoiceStream::into_stream);
        let formatter = Formatter {
            base,
            top_n,
            routed_start,
        };
        return Ok(sse_response(streams, formatter));
    }
    let collected = futures_util::future::join_all(choices.into_iter().map(|c| c.collect())).await;
    check_failed_choices(&collected)?;
    let mut usage = UsageTally::new(&prompts, params.n);
    let choices: Vec<Value> = collected
        .iter()
        .map(|c| {
            usage.add(c.index, &c.token_ids, c.finish.as_ref());
            let (finish_reason, _) =
                finish_fields(c.finish.as_ref(), &params.sampling.stop_token_ids);
            json!({
                "index": c.index,
                "token_ids": c.token_ids,
                "finish_reason": finish_reason,
                "logprobs": top_n.map(|k| logprobs(&c.logprobs, k)),
                "routed_experts": routed_experts::vllm(c.finish.as_ref(), routed_start),
            })
        })
        .collect();
    Ok(Json(json!({
        "request_id": head.id,
        "choices": choices,
        // One list per request, as vLLM's (every choice computed the same prompt).
        "prompt_logprobs": params.sampling.prompt_logprobs.and_then(|_| {
            collected
                .first()
                .map(|c| prompt_logprobs_json(&app.texts, &c.prompt_logprobs))
        }),
        "kv_transfer_params": response_transfer_params(&collected),
        "usage": usage.usage(),
    }))
    .into_response())
}

/// `sampling_params` as completions fields.
fn completion_fields(req: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let sp = match get(req, "sampling_params") {
        None => return Ok(Map::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::invalid(
                "sampling_params",
                "`sampling_params` must be an object",
            ))
        }
    };
    refuse_set(sp, REFUSED_SAMPLING, "sampling_params.")?;
    let mut out = Map::new();
    for (key, value) in sp {
        if value.is_null() || IGNORED.contains(&key.as_str()) {
            continue;
        }
        if SAME.contains(&key.as_str()) {
            out.insert(key.clone(), value.clone());
        } else if !REFUSED_SAMPLING.contains(&key.as_str()) {
            let param = format!("sampling_params.{key}");
            return Err(ApiError::invalid(
                param.clone(),
                format!("`{param}` is not a vLLM sampling parameter"),
            ));
        }
    }
    Ok(out)
}

/// A completions field name in an error, as this request named it.
fn rename(param: &str) -> String {
    let head = param.split(['[', '.']).next().unwrap_or(param);
    match head {
        "prompt" => param.replacen("prompt", "token_ids", 1),
        "model" | "stream" | "stream_options" | "cache_salt" | "priority"
        | "kv_transfer_params" => param.to_owned(),
        _ => format!("sampling_params.{param}"),
    }
}

/// vLLM's token-id logprobs (`ChatCompletionLogProbs`, each token as `token_id:<id>`).
fn logprobs(lps: &[TokenLogprob], top_n: u32) -> Value {
    let name = |id: TokenId| format!("token_id:{id}");
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let sampled = json!({"token": name(lp.token), "logprob": logprob_json(lp.logprob), "bytes": null});
            let top = std::iter::once(sampled)
                .chain(
                    lp.top
                        .iter()
                        .filter(|(id, _)| *id != lp.token)
                        .map(|&(id, l)| json!({"token": name(id), "logprob": logprob_json(l), "bytes": null})),
                )
                .take(top_n.max(1) as usize)
                .collect::<Vec<_>>();
            json!({
                "token": name(lp.token),
                "logprob": logprob_json(lp.logprob),
                "bytes": null,
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content })
}

/// Streaming: each chunk's new token ids (and their logprobs), per choice.
#[derive(Debug)]
struct Formatter {
    base: StreamBase,
    top_n: Option<u32>,
    /// `routed_experts_prompt_start`.
    routed_start: usize,
}

impl ChunkFormatter for Formatter {
    fn start(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn chunk(&mut self, index: usize, chunk: OutputChunk) -> Vec<String> {
        let finish = self.base.observe(index, &chunk);
        let event = json!({
            "request_id": self.base.head.id,
            "choices": [{
                "index": index,
                "logprobs": self.top_n.map(|k| logprobs(&chunk.logprobs, k)),
                "finish_reason": finish.finish_reason,
                "token_ids": chunk.token_ids,
                "routed_experts": routed_experts::vllm(chunk.finish.as_ref(), self.routed_start),
            }],
        });
        std::iter::once(to_json(&event))
            .chain(finish.error)
            .collect()
    }

    fn end(&mut self) -> Vec<String> {
        match self.base.final_usage() {
            Some(usage) => vec![to_json(
                &json!({"request_id": self.base.head.id, "choices": [], "usage": usage}),
            )],
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprobs_list_the_sampled_token_first_once() {
        let lp = TokenLogprob {
            token: TokenId(5),
            logprob: -0.5,
            top: vec![(TokenId(7), -0.2), (TokenId(5), -0.5), (TokenId(9), -3.0)],
        };
        let v = logprobs(std::slice::from_ref(&lp), 2);
        assert_eq!(v["content"][0]["token"], "token_id:5");
        let top: Vec<&str> = v["content"][0]["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["token"].as_str().unwrap())
            .collect();
        assert_eq!(top, ["token_id:5", "token_id:7"]);
        let v = logprobs(std::slice::from_ref(&lp), 0);
        assert_eq!(v["content"][0]["top_logprobs"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn sampling_params_pass_under_their_names_and_unknown_ones_are_refused() {
        let req = object(
            json!({"sampling_params": {"max_tokens": 3, "detokenize": false,
            "logprobs": 1, "seed": null}}),
        )
        .unwrap();
        assert_eq!(
            Value::Object(completion_fields(&req).unwrap()),
            json!({"max_tokens": 3, "logprobs": 1})
        );
        let req = object(json!({"sampling_params": {"allowed_token_ids": [1]}})).unwrap();
        assert_eq!(
            completion_fields(&req).unwrap_err().param.as_deref(),
            Some("sampling_params.allowed_token_ids")
        );
        let req = object(json!({"sampling_params": {"nope": 1}})).unwrap();
        assert_eq!(
            completion_fields(&req).unwrap_err().param.as_deref(),
            Some("sampling_params.nope")
        );
        assert_eq!(rename("prompt[3]"), "token_ids[3]");
        assert_eq!(rename("max_tokens"), "sampling_params.max_tokens");
        assert_eq!(rename("model"), "model");
    }
}
