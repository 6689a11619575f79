//! `POST /v1/completions`: text or token-id prompts (single or batched), streaming or not.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_engine::OutputChunk;

use crate::error::ApiError;
use crate::extract::{ApiJson, RequestId};
use crate::generate::{finish_fields, launch, Collected, LaunchSpec, PreparedPrompt, UsageTally};
use crate::logprobs::{completion_logprobs, TokenTexts};
use crate::params::{check_completion_logprobs, check_prompt, GenerationParams};
use crate::request::{CompletionRequest, Prompt};
use crate::response::{CompletionChoice, CompletionResponse};
use crate::sse::{sse_response, to_json, ChunkFormatter};
use crate::state::{unix_now, AppState};
use serde_json::Value;

pub async fn completions(
    State(app): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req = CompletionRequest::from_json(&body)?;
    app.check_model(req.common.model.as_deref())?;
    let logprobs = check_completion_logprobs(req.own.logprobs, &app.limits)?;
    let params = GenerationParams::from_common(
        &req.common,
        (req.common.max_tokens, "max_tokens"),
        logprobs,
        &app.limits,
    )?;
    req.unsupported.check(i64::from(params.n))?;
    let prompts = prepare_prompts(&app, req.own.prompt.map(|p| p.into_batch()), &params)?;
    let spec = LaunchSpec {
        request_id: &request_id,
        n: params.n,
        stop: &params.stop,
        prompt_param: "prompt",
        arrival,
    };
    let choices = launch(&app.engine, &app.metrics, &prompts, &spec).await?;
    let head = Head {
        id: request_id,
        created: unix_now(),
        model: app.config.served_model_name.clone(),
    };
    if params.stream {
        let formatter = Formatter::new(head, &prompts, &params, app.texts.clone());
        return Ok(sse_response(choices, formatter));
    }
    let collected = futures_util::future::join_all(choices.into_iter().map(|c| c.collect())).await;
    Ok(Json(full_response(
        head, &prompts, &params, &app.texts, collected,
    ))
    .into_response())
}

/// Tokenizes and validates every prompt of the batch.
fn prepare_prompts(
    app: &AppState,
    batch: Option<Vec<Prompt>>,
    params: &GenerationParams,
) -> Result<Vec<PreparedPrompt>, ApiError> {
    let batch = batch.ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    if batch.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` is empty"));
    }
    if batch.len() > app.limits.max_batch_prompts {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "a batch holds at most {} prompts, got {}",
                app.limits.max_batch_prompts,
                batch.len()
            ),
        ));
    }
    let single = batch.len() == 1;
    batch
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let param = if single {
                "prompt".to_owned()
            } else {
                format!("prompt[{i}]")
            };
            let tokens = match p {
                Prompt::Text(t) if t.is_empty() => {
                    return Err(ApiError::invalid(
                        param.clone(),
                        format!("`{param}` is empty"),
                    ))
                }
                Prompt::Text(t) => app.tokenize(&t, true, &param)?,
                Prompt::Tokens(t) => t,
            };
            check_prompt(&tokens, &param, &app.limits)?;
            let sampling = params.for_prompt(tokens.len(), &app.limits)?;
            Ok(PreparedPrompt { tokens, sampling })
        })
        .collect()
}

/// The fields every chunk and response repeats.
#[derive(Debug, Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn response(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<crate::response::Usage>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

fn full_response(
    head: Head,
    prompts: &[PreparedPrompt],
    params: &GenerationParams,
    texts: &TokenTexts,
    collected: Vec<Collected>,
) -> CompletionResponse {
    let mut usage = UsageTally::new(prompts, params.n);
    let n = params.n as usize;
    let choices = collected
        .into_iter()
        .map(|c| {
            usage.add(c.index, &c.token_ids, c.finish.as_ref());
            let (finish_reason, stop_reason) = finish_fields(c.finish.as_ref());
            CompletionChoice {
                index: c.index,
                logprobs: params
                    .sampling
                    .logprobs
                    .map(|_| completion_logprobs(texts, &c.logprobs, 0).0),
                text: c.text,
                finish_reason: Some(finish_reason),
                stop_reason,
                prompt_token_ids: params
                    .return_token_ids
                    .then(|| prompts[c.index / n].tokens.clone()),
                token_ids: params.return_token_ids.then_some(c.token_ids),
            }
        })
        .collect();
    head.response(choices, Some(usage.usage()))
}

/// Streaming state: per choice, whether its prompt ids went out and its text offset.
struct Formatter {
    head: Head,
    prompts: Vec<Vec<u32>>,
    n: usize,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    texts: TokenTexts,
    started: Vec<bool>,
    text_offsets: Vec<usize>,
    usage: UsageTally,
}

impl Formatter {
    fn new(
        head: Head,
        prompts: &[PreparedPrompt],
        params: &GenerationParams,
        texts: TokenTexts,
    ) -> Self {
        let n_choices = prompts.len() * params.n as usize;
        Self {
            head,
            prompts: prompts.iter().map(|p| p.tokens.clone()).collect(),
            n: params.n as usize,
            logprobs: params.sampling.logprobs.is_some(),
            return_token_ids: params.return_token_ids,
            include_usage: params.include_usage,
            texts,
            started: vec![false; n_choices],
            text_offsets: vec![0; n_choices],
            usage: UsageTally::new(prompts, params.n),
        }
    }
}

impl ChunkFormatter for Formatter {
    fn start(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn chunk(&mut self, index: usize, chunk: OutputChunk) -> Vec<String> {
        self.usage
            .add(index, &chunk.token_ids, chunk.finish.as_ref());
        let first = !std::mem::replace(&mut self.started[index], true);
        let logprobs = self.logprobs.then(|| {
            let (lp, end) =
                completion_logprobs(&self.texts, &chunk.logprobs, self.text_offsets[index]);
            self.text_offsets[index] = end;
            lp
        });
        let (finish_reason, stop_reason) = match &chunk.finish {
            Some(f) => {
                let (r, s) = finish_fields(Some(f));
                (Some(r), s)
            }
            None => (None, None),
        };
        let choice = CompletionChoice {
            index,
            text: chunk.text,
            logprobs,
            finish_reason,
            stop_reason,
            prompt_token_ids: (self.return_token_ids && first)
                .then(|| self.prompts[index / self.n].clone()),
            token_ids: self.return_token_ids.then_some(chunk.token_ids),
        };
        vec![to_json(&self.head.response(vec![choice], None))]
    }

    fn end(&mut self) -> Vec<String> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![to_json(
            &self.head.response(Vec::new(), Some(self.usage.usage())),
        )]
    }
}
