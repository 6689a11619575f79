//! `POST /v1/chat/completions`: messages rendered through the model's chat template, then
//! generated like a completion; streaming or not.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_engine::OutputChunk;

use crate::error::ApiError;
use crate::extract::{ApiJson, RequestId};
use crate::generate::{finish_fields, launch, Collected, LaunchSpec, PreparedPrompt, UsageTally};
use crate::logprobs::{chat_logprobs, TokenTexts};
use crate::params::{check_chat_logprobs, check_prompt, GenerationParams};
use crate::request::{ChatFields, ChatRequest};
use crate::response::{
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatResponse, Delta, Usage,
};
use crate::sse::{sse_response, to_json, ChunkFormatter};
use crate::state::{unix_now, AppState};
use serde_json::Value;

pub async fn chat_completions(
    State(app): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let req = ChatRequest::from_json(&body)?;
    app.check_model(req.common.model.as_deref())?;
    let logprobs = check_chat_logprobs(req.own.logprobs, req.own.top_logprobs, &app.limits)?;
    // `max_completion_tokens` replaces the deprecated `max_tokens`; either is accepted.
    let max_tokens = match req.own.max_completion_tokens {
        Some(v) => (Some(v), "max_completion_tokens"),
        None => (req.common.max_tokens, "max_tokens"),
    };
    let params = GenerationParams::from_common(&req.common, max_tokens, logprobs, &app.limits)?;
    req.unsupported.check(i64::from(params.n))?;
    let prompt = render_prompt(&app, &req.own)?;
    let prompts = [PreparedPrompt {
        sampling: params.for_prompt(prompt.len(), &app.limits)?,
        tokens: prompt,
    }];
    let spec = LaunchSpec {
        request_id: &request_id,
        n: params.n,
        stop: &params.stop,
        prompt_param: "messages",
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

/// The messages through the chat template, tokenized (without adding special tokens: the
/// template writes them) and checked against the context.
pub fn render_prompt(app: &AppState, req: &ChatFields) -> Result<Vec<u32>, ApiError> {
    let messages = req
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    let text = app.template()?.render(
        messages,
        req.add_generation_prompt.unwrap_or(true),
        req.chat_template_kwargs.as_ref(),
    )?;
    let tokens = app.tokenize(&text, false, "messages")?;
    check_prompt(&tokens, "messages", &app.limits)?;
    Ok(tokens)
}

#[derive(Debug, Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn chunk(&self, choices: Vec<ChatChunkChoice>) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            prompt_token_ids: None,
        }
    }
}

fn full_response(
    head: Head,
    prompts: &[PreparedPrompt],
    params: &GenerationParams,
    texts: &TokenTexts,
    collected: Vec<Collected>,
) -> ChatResponse {
    let mut usage = UsageTally::new(prompts, params.n);
    let choices = collected
        .into_iter()
        .map(|c| {
            usage.add(c.index, &c.token_ids, c.finish.as_ref());
            let (finish_reason, stop_reason) = finish_fields(c.finish.as_ref());
            ChatChoice {
                index: c.index,
                logprobs: params
                    .sampling
                    .logprobs
                    .map(|_| chat_logprobs(texts, &c.logprobs)),
                message: AssistantMessage {
                    role: "assistant",
                    content: c.text,
                },
                finish_reason: Some(finish_reason),
                stop_reason,
                token_ids: params.return_token_ids.then_some(c.token_ids),
            }
        })
        .collect();
    ChatResponse {
        id: head.id,
        object: "chat.completion",
        created: head.created,
        model: head.model,
        choices,
        usage: usage.usage(),
        prompt_token_ids: params.return_token_ids.then(|| prompts[0].tokens.clone()),
    }
}

/// Streaming state.
struct Formatter {
    head: Head,
    prompt: Vec<u32>,
    n_choices: usize,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    texts: TokenTexts,
    usage: UsageTally,
}

impl Formatter {
    fn new(
        head: Head,
        prompts: &[PreparedPrompt],
        params: &GenerationParams,
        texts: TokenTexts,
    ) -> Self {
        Self {
            head,
            prompt: prompts[0].tokens.clone(),
            n_choices: params.n as usize,
            logprobs: params.sampling.logprobs.is_some(),
            return_token_ids: params.return_token_ids,
            include_usage: params.include_usage,
            texts,
            usage: UsageTally::new(prompts, params.n),
        }
    }
}

impl ChunkFormatter for Formatter {
    /// One role delta per choice, as OpenAI streams start; the first carries the prompt ids.
    fn start(&mut self) -> Vec<String> {
        (0..self.n_choices)
            .map(|index| {
                let mut chunk = self.head.chunk(vec![ChatChunkChoice {
                    index,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                    token_ids: self.return_token_ids.then(Vec::new),
                }]);
                if index == 0 && self.return_token_ids {
                    chunk.prompt_token_ids = Some(self.prompt.clone());
                }
                to_json(&chunk)
            })
            .collect()
    }

    fn chunk(&mut self, index: usize, chunk: OutputChunk) -> Vec<String> {
        self.usage
            .add(index, &chunk.token_ids, chunk.finish.as_ref());
        let (finish_reason, stop_reason) = match &chunk.finish {
            Some(f) => {
                let (r, s) = finish_fields(Some(f));
                (Some(r), s)
            }
            None => (None, None),
        };
        let choice = ChatChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: (!chunk.text.is_empty() || chunk.finish.is_none()).then_some(chunk.text),
            },
            logprobs: self
                .logprobs
                .then(|| chat_logprobs(&self.texts, &chunk.logprobs)),
            finish_reason,
            stop_reason,
            token_ids: self.return_token_ids.then_some(chunk.token_ids),
        };
        vec![to_json(&self.head.chunk(vec![choice]))]
    }

    fn end(&mut self) -> Vec<String> {
        if !self.include_usage {
            return Vec::new();
        }
        let mut chunk = self.head.chunk(Vec::new());
        chunk.usage = Some(Usage::clone(&self.usage.usage()));
        vec![to_json(&chunk)]
    }
}
