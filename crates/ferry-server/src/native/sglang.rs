//! SGLang's native `POST /generate` (SGLang's `GenerateReqInput` in, its output dicts out),
//! as slime, miles, AReaL and NeMo-RL call it.
//!
//! Request: `input_ids` (one list of ids, or a list of lists) or `text` (a string or a list;
//! tokenized with special tokens, as SGLang does), `sampling_params` (one object for every
//! prompt), `return_logprob`, `top_logprobs_num`, `return_text_in_logprobs`, `stream`.
//! Response, per choice: `{"text", "output_ids", "meta_info": {"id", "finish_reason",
//! "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
//! "output_token_logprobs": [[logprob, id, text|null], ...], "output_top_logprobs"}}`; one
//! object for one prompt with `n` 1, else a list (prompt `p`'s sample `i` at `p * n + i`).
//!
//! A stream sends SGLang's default (non-incremental) form: each event is the choice's
//! output so far (cumulative `text`, `output_ids` and logprobs; `finish_reason` null until
//! the last), with `index` when the request has several choices, then `data: [DONE]`.
//!
//! `finish_reason` is SGLang's: `{"type": "stop", "matched": id | "string"}` (the EOS token
//! or a stop token id, or the stop string), `{"type": "length", "length": n}`, or
//! `{"type": "abort", "message": ...}`. Sampling runs through the completions request these
//! fields translate to ([`super::as_completions`]).
//!
//! `return_routed_experts` (a server started with `--enable-return-routed-experts`; a 400
//! otherwise) adds `meta_info.routed_experts` to a finished choice: base64 of its expert
//! routing as little-endian `int32`, rows `routed_experts_start_len..` of the
//! `prompt + output - 1` input tokens, `layers × top_k` ids each
//! ([`crate::routed_experts`]; SGLang's `GenerateReqInput` fields and detokenizer encoding).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_engine::{Finish, FinishReason, OutputChunk, StopReason, TokenId, TokenLogprob};
use serde_json::{json, Map, Value};

use super::{as_completions, get, logprob_json, object, refuse_set, room, token_ids};
use crate::error::ApiError;
use crate::extract::{ApiJson, RequestId};
use crate::generate::{check_failed_choices, start, ChoiceStream, Collected};
use crate::logprobs::TokenTexts;
use crate::response::Head;
use crate::routed_experts;
use crate::sse::{sse_response, to_json, ChunkFormatter};
use crate::state::AppState;

/// SGLang's default `max_new_tokens` (its `SamplingParams`); like SGLang, a default that does
/// not fit in the context is cut to what does.
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// Sampling fields SGLang and completions name alike.
const SAME: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "n",
    "logit_bias",
];

/// Sampling fields SGLang names otherwise: (SGLang's name, completions' name).
const RENAMED: &[(&str, &str)] = &[
    ("max_new_tokens", "max_tokens"),
    ("min_new_tokens", "min_tokens"),
    ("sampling_seed", "seed"),
];

/// Structured-output fields: (SGLang's name, the key under completions'
/// `structured_outputs`).
const STRUCTURED: &[(&str, &str)] = &[
    ("json_schema", "json"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
];

/// Sampling fields accepted and ignored: `custom_params` feed SGLang's custom logit
/// processors (none here), `stream_interval` paces SGLang's stream (ferry streams each chunk
/// as the engine makes it).
const IGNORED: &[&str] = &["custom_params", "stream_interval"];

/// Sampling fields ferry does not implement: refused when set.
const REFUSED_SAMPLING: &[&str] = &["stop_regex", "structural_tag"];

/// Request fields ferry does not implement: refused when set (multimodal inputs,
/// hidden states, custom logit processors, per-token logprobs of given ids, sessions).
const REFUSED: &[&str] = &[
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "return_hidden_states",
    "custom_logit_processor",
    "token_ids_logprob",
    "session_params",
];

/// `POST /generate`'s body, for the OpenAPI document (the handler reads the JSON itself, so
/// that each field's error names it as SGLang's client sent it).
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
pub struct SglangGenerateRequest {
    /// One prompt's token ids, or a list of prompts' (a batch).
    #[schema(value_type = Option<Object>)]
    pub input_ids: Option<Value>,
    /// One prompt as text, or a list of them (tokenized with special tokens).
    #[schema(value_type = Option<Object>)]
    pub text: Option<Value>,
    /// SGLang's `SamplingParams`: `max_new_tokens` (default 128), `temperature`, `top_p`,
    /// `top_k`, `min_p`, `stop`, `stop_token_ids`, `ignore_eos`, `n`, `sampling_seed`,
    /// `no_stop_trim`, `skip_special_tokens`, `spaces_between_special_tokens`,
    /// `json_schema`, `regex`, `ebnf`, penalties, `logit_bias`, `min_new_tokens`.
    #[schema(value_type = Option<Object>)]
    pub sampling_params: Option<Value>,
    /// `meta_info.output_token_logprobs` (and `output_top_logprobs` with
    /// `top_logprobs_num`).
    pub return_logprob: Option<bool>,
    pub top_logprobs_num: Option<u32>,
    /// The third element of each logprob triple is the token's text (else null).
    pub return_text_in_logprobs: Option<bool>,
    /// Server-sent events of each choice's cumulative output, then `data: [DONE]`.
    pub stream: Option<bool>,
    /// ferry's P/D transfer parameters, as on `/v1/completions`.
    #[schema(value_type = Option<Object>)]
    pub kv_transfer_params: Option<Value>,
    /// `meta_info.routed_experts` on each finished choice (a server started with
    /// `--enable-return-routed-experts`).
    pub return_routed_experts: Option<bool>,
    /// The first row of `meta_info.routed_experts`: 0 to the prompt's length (default 0).
    pub routed_experts_start_len: Option<i64>,
}

/// What the request asks of the answer.
#[derive(Debug, Clone)]
struct Shape {
    /// A list comes back (several prompts, or `n` > 1).
    list: bool,
    logprobs: bool,
    top_logprobs: usize,
    text_in_logprobs: bool,
    prompt_lens: Vec<usize>,
    n: usize,
    /// `return_routed_experts`: the first row of `meta_info.routed_experts`.
    routed_experts: Option<usize>,
}

/// The prompts: token ids, and whether the request sent a list of them.
fn prompts(
    app: &AppState,
    req: &Map<String, Value>,
) -> Result<(Vec<Vec<TokenId>>, bool), ApiError> {
    match (get(req, "input_ids"), get(req, "text")) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "input_ids",
            "send either `input_ids` or `text`, not both",
        )),
        (None, None) => Err(ApiError::invalid(
            "input_ids",
            "`input_ids` or `text` is required",
        )),
        (Some(ids), None) => {
            if let Some(one) = token_ids(ids) {
                return Ok((vec![one], false));
            }
            let batch = ids.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
                ApiError::invalid(
                    "input_ids",
                    "`input_ids` must be a list of token ids or of lists of them",
                )
            })?;
            let batch = batch
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    token_ids(p).ok_or_else(|| {
                        ApiError::invalid(
                            format!("input_ids[{i}]"),
                            "each prompt must be a list of token ids",
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
            Ok((batch, true))
        }
        (None, Some(Value::String(t))) => Ok((vec![app.tokenize(t, true, "text")?], false)),
        (None, Some(Value::Array(texts))) if !texts.is_empty() => {
            let batch = texts
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let param = format!("text[{i}]");
                    let t = t
                        .as_str()
                        .ok_or_else(|| ApiError::invalid(param.clone(), "must be a string"))?;
                    app.tokenize(t, true, &param)
                })
                .collect::<Result<_, _>>()?;
            Ok((batch, true))
        }
        (None, Some(_)) => Err(ApiError::invalid(
            "text",
            "`text` must be a string or a list of strings",
        )),
    }
}

/// `sampling_params` as completions fields (without the prompt and `max_tokens`), and the
/// `max_new_tokens` asked for, if any.
fn sampling_fields(
    req: &Map<String, Value>,
) -> Result<(Map<String, Value>, Option<Value>), ApiError> {
    let sp = match get(req, "sampling_params") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "sampling_params",
                "one `sampling_params` object for every prompt is supported, not a list",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "sampling_params",
                "`sampling_params` must be an object",
            ))
        }
    };
    refuse_set(&sp, REFUSED_SAMPLING, "sampling_params.")?;
    let mut out = Map::new();
    let mut structured = Map::new();
    let mut max_new_tokens = None;
    for (key, value) in sp {
        if value.is_null() {
            continue;
        }
        if SAME.contains(&key.as_str()) {
            out.insert(key, value);
        } else if key == "max_new_tokens" {
            max_new_tokens = Some(value);
        } else if let Some((_, to)) = RENAMED.iter().find(|(from, _)| *from == key) {
            out.insert((*to).to_owned(), value);
        } else if let Some((_, to)) = STRUCTURED.iter().find(|(from, _)| *from == key) {
            structured.insert((*to).to_owned(), value);
        } else if key == "no_stop_trim" {
            // Keeping the matched stop string in `text` is completions'
            // `include_stop_str_in_output`; without stop strings there is none to keep (the
            // stop token is in `output_ids` either way), so it then asks nothing.
            out.insert("no_stop_trim".to_owned(), value);
        } else if !IGNORED.contains(&key.as_str()) && !REFUSED_SAMPLING.contains(&key.as_str()) {
            let param = format!("sampling_params.{key}");
            return Err(ApiError::invalid(
                param.clone(),
                format!("`{param}` is not a sampling parameter SGLang or ferry knows"),
            ));
        }
    }
    if let Some(keep) = out.remove("no_stop_trim") {
        let has_stop = match out.get("stop") {
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            _ => false,
        };
        if has_stop {
            out.insert("include_stop_str_in_output".to_owned(), keep);
        }
    }
    if !structured.is_empty() {
        out.insert("structured_outputs".to_owned(), Value::Object(structured));
    }
    Ok((out, max_new_tokens))
}

/// A completions field name in an error, as this request named it (`prompt` is `prompt`,
/// the request's `input_ids` or `text` field, with its index in a batch).
fn rename(param: &str, prompt: &str) -> String {
    let (head, tail) = match param.find('[') {
        Some(i) => param.split_at(i),
        None => (param, ""),
    };
    let sglang = match head {
        "prompt" => return format!("{prompt}{tail}"),
        "logprobs" => return "top_logprobs_num".to_owned(),
        "max_tokens" => "max_new_tokens",
        "min_tokens" => "min_new_tokens",
        "seed" => "sampling_seed",
        "include_stop_str_in_output" => "no_stop_trim",
        "structured_outputs" => "json_schema",
        "kv_transfer_params" => return param.to_owned(),
        "routed_experts_prompt_start" => return "routed_experts_start_len".to_owned(),
        "model" => return "lora_path".to_owned(),
        other => other,
    };
    format!("sampling_params.{sglang}{tail}")
}

/// The LoRA adapter `lora_path` names (SGLang's field holds a loaded adapter's name): a
/// string, or for a batch one per prompt, all the same (ferry runs one adapter per HTTP
/// request: send prompts of different adapters as requests of their own). `null` entries
/// are the base model.
fn lora_path(
    req: &serde_json::Map<String, Value>,
    n_prompts: usize,
) -> Result<Option<String>, ApiError> {
    let invalid = |why: &str| ApiError::invalid("lora_path", why.to_owned());
    match get(req, "lora_path") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(name)) => Ok(Some(name.clone())),
        Some(Value::Array(names)) => {
            if names.len() != n_prompts {
                return Err(invalid("`lora_path` as a list needs one entry per prompt"));
            }
            let first = names.first().cloned().unwrap_or(Value::Null);
            if names.iter().any(|n| *n != first) {
                return Err(invalid(
                    "the prompts of one request must share their adapter: send prompts of \
                     different adapters as separate requests",
                ));
            }
            match first {
                Value::Null => Ok(None),
                Value::String(name) => Ok(Some(name)),
                _ => Err(invalid("`lora_path` entries must be adapter names or null")),
            }
        }
        Some(_) => Err(invalid(
            "`lora_path` must be an adapter's name, or a list of them (one per prompt)",
        )),
    }
}

/// `POST /generate`.
pub async fn generate(
    State(app): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req = object(body)?;
    refuse_set(&req, REFUSED, "")?;
    let flag = |key: &str| -> Result<bool, ApiError> {
        match get(&req, key) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
        }
    };
    let logprobs = flag("return_logprob")?;
    let routed_experts = flag("return_routed_experts")?;
    if routed_experts && app.engine.routing_shape().is_none() {
        return Err(ApiError::invalid(
            "return_routed_experts",
            "this server does not capture expert routing: start it with \
             --enable-return-routed-experts (a mixture-of-experts model)",
        ));
    }
    let text_in_logprobs = flag("return_text_in_logprobs")?;
    let stream = flag("stream")?;
    let top_logprobs = match get(&req, "top_logprobs_num") {
        None => 0,
        Some(v) => v.as_u64().ok_or_else(|| {
            ApiError::invalid(
                "top_logprobs_num",
                "`top_logprobs_num` must be a non-negative integer",
            )
        })?,
    };
    if logprobs
        && get(&req, "logprob_start_len")
            .and_then(Value::as_i64)
            .is_some_and(|s| s >= 0)
    {
        return Err(ApiError::invalid(
            "logprob_start_len",
            "prompt logprobs (`logprob_start_len` >= 0) are not supported by this server; \
             output logprobs need no `logprob_start_len`",
        ));
    }
    let (prompts, batch) = prompts(&app, &req)?;
    let lora = lora_path(&req, prompts.len())?;
    let (sampling, max_new_tokens) = sampling_fields(&req)?;
    let bodies = prompts
        .iter()
        .map(|ids| {
            let mut body = sampling.clone();
            let max_tokens = max_new_tokens
                .clone()
                .unwrap_or_else(|| json!(DEFAULT_MAX_NEW_TOKENS.min(room(&app, ids.len()))));
            body.insert("max_tokens".into(), max_tokens);
            body.insert("prompt".into(), json!(ids));
            body.insert("stream".into(), json!(stream));
            if logprobs {
                body.insert("logprobs".into(), json!(top_logprobs));
            }
            if let Some(p) = get(&req, "kv_transfer_params") {
                body.insert("kv_transfer_params".into(), p.clone());
            }
            if let Some(start) = get(&req, "routed_experts_start_len") {
                body.insert("routed_experts_prompt_start".into(), start.clone());
            }
            if let Some(name) = &lora {
                body.insert("model".into(), json!(name));
            }
            body
        })
        .collect();
    let field = if get(&req, "text").is_some() {
        "text"
    } else {
        "input_ids"
    };
    let (prepared, params) = as_completions(&app, bodies, |i, param| {
        let prompt = if batch {
            format!("{field}[{i}]")
        } else {
            field.to_owned()
        };
        rename(param, &prompt)
    })?;
    let n = params.n as usize;
    let shape = Shape {
        list: batch || n > 1,
        logprobs,
        top_logprobs: top_logprobs as usize,
        text_in_logprobs,
        prompt_lens: prepared.iter().map(|p| p.tokens.len()).collect(),
        n,
        routed_experts: routed_experts.then_some(params.routed_experts_prompt_start),
    };
    let (head, choices) = start(&app, request_id, &prepared, &params, "input_ids", arrival).await?;
    if stream {
        let version = current_version(&app).await;
        let formatter = Formatter {
            shape: shape.clone(),
            head,
            texts: app.texts.clone(),
            arrival,
            version,
            so_far: (0..choices.len())
                .map(|index| Collected {
                    index,
                    ..Collected::default()
                })
                .collect(),
        };
        let streams = choices.into_iter().map(ChoiceStream::into_stream);
        return Ok(sse_response(streams, formatter));
    }
    let collected = futures_util::future::join_all(choices.into_iter().map(|c| c.collect())).await;
    check_failed_choices(&collected)?;
    // Asked of the engine only when a choice computed no token to report it.
    let version = if collected.iter().all(|c| {
        c.finish
            .as_ref()
            .is_some_and(|f| !f.weight_versions.is_empty())
    }) {
        String::new()
    } else {
        current_version(&app).await
    };
    let kv_transfer_params = crate::generate::response_transfer_params(&collected);
    let outputs: Vec<Value> = collected
        .iter()
        .map(|c| output(&shape, &head, &app.texts, c, &version, arrival))
        .collect();
    let mut answer = if shape.list {
        Value::Array(outputs)
    } else {
        outputs.into_iter().next().unwrap_or(Value::Null)
    };
    // ferry's P/D: P's transfer parameters, for the proxy to hand to D.
    if let (Some(p), Value::Object(o)) = (kv_transfer_params, &mut answer) {
        o.insert("kv_transfer_params".into(), json!(p));
    }
    Ok(Json(answer).into_response())
}

/// The engine's weight version now: the `weight_version` of a choice that computed no token
/// (a stream asks for it up front, as its events are written as they come).
async fn current_version(app: &AppState) -> String {
    app.engine
        .weight_info()
        .await
        .map(|i| i.weight_version)
        .unwrap_or_default()
}

/// SGLang's `finish_reason` object.
pub fn finish_reason(finish: Option<&Finish>, n_tokens: usize) -> Value {
    let Some(f) = finish else {
        return json!({"type": "abort", "message": "the engine went away"});
    };
    match f.reason {
        FinishReason::Stop => {
            let matched = match &f.stop_reason {
                Some(StopReason::Token(t)) => json!(t),
                Some(StopReason::String(s) | StopReason::Constraint(s)) => json!(s),
                None => Value::Null,
            };
            json!({"type": "stop", "matched": matched})
        }
        FinishReason::Length => json!({"type": "length", "length": n_tokens}),
        FinishReason::Abort | FinishReason::Error => json!({
            "type": "abort",
            "message": f.message.clone().unwrap_or_else(|| "aborted".to_owned()),
        }),
    }
}

/// `[logprob, token id, text or null]`, SGLang's logprob triple.
fn triple(texts: &TokenTexts, id: TokenId, logprob: f32, with_text: bool) -> Value {
    let text = with_text.then(|| texts.text(id));
    json!([logprob_json(logprob), id, text])
}

/// One choice's SGLang output dict (its output so far, in a stream).
fn output(
    shape: &Shape,
    head: &Head,
    texts: &TokenTexts,
    c: &Collected,
    version: &str,
    arrival: Instant,
) -> Value {
    let id = if shape.list {
        format!("{}-{}", head.id, c.index)
    } else {
        head.id.clone()
    };
    let prompt_tokens = shape
        .prompt_lens
        .get(c.index / shape.n)
        .copied()
        .unwrap_or(0);
    let weight_version = c
        .finish
        .as_ref()
        .and_then(|f| f.weight_versions.last().cloned())
        .unwrap_or_else(|| version.to_owned());
    let mut meta = json!({
        "id": id,
        "finish_reason": c.finish.as_ref().map(|_| finish_reason(c.finish.as_ref(), c.token_ids.len())),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": c.token_ids.len(),
        "cached_tokens": c.finish.as_ref().map_or(0, |f| f.n_cached_tokens),
        "weight_version": weight_version,
        "e2e_latency": arrival.elapsed().as_secs_f64(),
    });
    if shape.logprobs {
        let lps: &[TokenLogprob] = &c.logprobs;
        meta["output_token_logprobs"] = lps
            .iter()
            .map(|lp| triple(texts, lp.token, lp.logprob, shape.text_in_logprobs))
            .collect();
        if shape.top_logprobs > 0 {
            meta["output_top_logprobs"] = lps
                .iter()
                .map(|lp| {
                    lp.top
                        .iter()
                        .map(|&(id, l)| triple(texts, id, l, shape.text_in_logprobs))
                        .collect::<Value>()
                })
                .collect();
        }
    }
    if let Some(start) = shape.routed_experts {
        if let Some(routing) = routed_experts::sglang(c.finish.as_ref(), start) {
            meta["routed_experts"] = json!(routing);
        }
    }
    let mut out = json!({"text": c.text, "output_ids": c.token_ids, "meta_info": meta});
    if shape.list {
        out["index"] = json!(c.index);
    }
    out
}

/// The stream's state: each choice's output so far.
#[derive(Debug)]
struct Formatter {
    shape: Shape,
    head: Head,
    texts: TokenTexts,
    arrival: Instant,
    version: String,
    so_far: Vec<Collected>,
}

impl ChunkFormatter for Formatter {
    fn start(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn chunk(&mut self, index: usize, chunk: OutputChunk) -> Vec<String> {
        let Some(c) = self.so_far.get_mut(index) else {
            return Vec::new();
        };
        c.token_ids.extend_from_slice(&chunk.token_ids);
        c.logprobs.extend(chunk.logprobs);
        c.text.push_str(&chunk.text);
        // An explained `error` finish: an error event follows the choice's last output.
        let error = chunk
            .finish
            .as_ref()
            .filter(|f| f.reason == FinishReason::Error)
            .and_then(|f| f.message.clone())
            .map(|m| {
                let e = ApiError::generation_failed(format!("choice {index} failed: {m}"));
                to_json(&e.body())
            });
        if chunk.finish.is_some() {
            c.finish = chunk.finish;
        }
        let event = output(
            &self.shape,
            &self.head,
            &self.texts,
            c,
            &self.version,
            self.arrival,
        );
        std::iter::once(to_json(&event)).chain(error).collect()
    }

    fn end(&mut self) -> Vec<String> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(v: Value) -> Result<(Map<String, Value>, Option<Value>), ApiError> {
        sampling_fields(&object(json!({"sampling_params": v})).unwrap())
    }

    #[test]
    fn sampling_params_take_their_completions_names() {
        let (out, max) = sampling(json!({"max_new_tokens": 7, "sampling_seed": 3,
            "min_new_tokens": 2, "temperature": 0.5, "stop": null, "custom_params": {"a": 1},
            "no_stop_trim": true, "regex": "a+"}))
        .unwrap();
        assert_eq!(max, Some(json!(7)));
        assert_eq!(
            Value::Object(out),
            json!({"seed": 3, "min_tokens": 2, "temperature": 0.5,
                   "structured_outputs": {"regex": "a+"}})
        );
        let (out, _) = sampling(json!({"no_stop_trim": true, "stop": ["x"]})).unwrap();
        assert_eq!(out["include_stop_str_in_output"], json!(true));
        let e = sampling(json!({"bogus": 1})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.bogus"));
        let e = sampling(json!({"stop_regex": "x"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.stop_regex"));
    }

    #[test]
    fn completions_errors_are_renamed() {
        assert_eq!(
            rename("max_tokens", "input_ids"),
            "sampling_params.max_new_tokens"
        );
        assert_eq!(rename("prompt", "input_ids[2]"), "input_ids[2]");
        assert_eq!(rename("prompt[0]", "text"), "text[0]");
        assert_eq!(rename("stop[1]", "text"), "sampling_params.stop[1]");
        assert_eq!(rename("temperature", "text"), "sampling_params.temperature");
    }
}
