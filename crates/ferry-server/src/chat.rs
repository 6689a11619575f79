//! `POST /v1/chat/completions`: messages rendered through the model's chat template, then
//! generated like a completion; streaming or not.

use ferry_engine::OutputChunk;
use ferry_engine::TokenId;

use crate::chat_template::{continue_final, ChatTemplate};
use crate::error::ApiError;
use crate::generate::{
    response_transfer_params, weight_versions, ChunkFinish, Collected, Generation, GenerationRoute,
    Prepared, PreparedPrompt, StreamBase,
};
use crate::logprobs::{chat_logprobs, prompt_logprobs_json};
use crate::params::{check_chat_logprobs, check_prompt, GenerationParams};
use crate::reasoning::{Reasoning, Splitter};
use crate::request::{ChatFields, ChatRequest, MessageContent};
use crate::response::{
    AlwaysPresent, AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatResponse, Delta,
    DeltaContent, Head, Message, Response, CHAT_FIELDS,
};
use crate::sse::{to_json, ChunkFormatter};
use crate::state::AppState;
use crate::structured::structured_output;
use serde_json::Value;

/// The chat route, for [`crate::generate::handle`].
#[derive(Debug)]
pub struct Chat;

impl GenerationRoute for Chat {
    const PROMPT_PARAM: &'static str = "messages";
    const ALWAYS_PRESENT: &'static AlwaysPresent = &CHAT_FIELDS;
    const STREAMS_BEAMS: bool = true;
    type Formatter = Formatter;
    type Response = ChatResponse;

    fn prepare(app: &AppState, body: &Value) -> Result<Prepared, ApiError> {
        let req = ChatRequest::from_json(body)?;
        app.check_model(req.common.model.as_deref())?;
        let logprobs = check_chat_logprobs(req.own.logprobs, req.own.top_logprobs, &app.limits)?;
        // `max_completion_tokens` replaces the deprecated `max_tokens`; either is accepted.
        let max_tokens = match req.own.max_completion_tokens {
            Some(v) => (Some(v), "max_completion_tokens"),
            None => (req.common.max_tokens, "max_tokens"),
        };
        let mut params =
            GenerationParams::from_common(&req.common, max_tokens, logprobs, &app.limits)?;
        params.structured = structured_output(&req.structured)?;
        if let Some(parser) = app.config.reasoning_parser {
            if params.structured.is_some() {
                // vLLM starts the constraint after the reasoning; ferry's constraints apply
                // to the whole output, which would hold the reasoning to the schema too.
                return Err(ApiError::invalid(
                    "response_format",
                    "structured outputs together with --reasoning-parser are not supported yet: \
                     the constraint would apply to the reasoning too",
                ));
            }
            let thinking = req
                .own
                .chat_template_kwargs
                .as_ref()
                .and_then(|k| k.get("enable_thinking"))
                .and_then(Value::as_bool)
                .unwrap_or(true);
            params.reasoning = Some(Reasoning { parser, thinking });
        }
        req.unsupported.check(i64::from(params.n))?;
        let prompt = params.truncate(render_tokens(app, &req.own)?);
        check_prompt(&prompt, "messages", &app.limits)?;
        let prompts = vec![PreparedPrompt {
            sampling: params.for_prompt(prompt.len(), &app.limits)?,
            tokens: prompt,
        }];
        Ok((prompts, params))
    }

    fn streaming(base: StreamBase, generation: Generation<'_>) -> Formatter {
        let n_choices = generation.params.n as usize;
        Formatter {
            base,
            prompt: generation.prompts[0].tokens.clone(),
            n_choices,
            splitters: (0..n_choices)
                .map(|_| generation.params.reasoning.map(Reasoning::splitter))
                .collect(),
        }
    }

    fn full_response(
        head: Head,
        generation: Generation<'_>,
        collected: Vec<Collected>,
    ) -> ChatResponse {
        let Generation {
            prompts,
            params,
            texts,
        } = generation;
        let kv_transfer_params = response_transfer_params(&collected);
        // One prompt: every choice computed the same prompt logprobs.
        let prompt_lps = collected
            .first()
            .map(|c| c.prompt_logprobs.clone())
            .unwrap_or_default();
        let (choices, usage) =
            generation.collect_choices(collected, |c, finish_reason, stop_reason| ChatChoice {
                weight_versions: Some(weight_versions(c.finish.as_ref())),
                index: c.index,
                logprobs: params
                    .sampling
                    .sampler
                    .logprobs
                    .map(|_| chat_logprobs(texts, &c.logprobs)),
                content: Message {
                    message: assistant_message(c.text, params.reasoning),
                },
                finish_reason: Some(finish_reason),
                stop_reason,
                prompt_token_ids: None,
                token_ids: params.return_token_ids.then_some(c.token_ids),
                forced_tokens: params.structured.is_some().then_some(c.forced),
                prompt_logprobs: None,
            });
        ChatResponse {
            prompt_logprobs: params
                .sampling
                .prompt_logprobs
                .map(|_| prompt_logprobs_json(texts, &prompt_lps)),
            usage: Some(usage),
            prompt_token_ids: params.return_token_ids.then(|| prompts[0].tokens.clone()),
            kv_transfer_params,
            ..Response::new(&head, "chat.completion", choices)
        }
    }
}

/// A finished answer's message: its text, or with a reasoning parser its reasoning (under both
/// names) and the content after it (`null` when none).
fn assistant_message(text: String, reasoning: Option<Reasoning>) -> AssistantMessage {
    let Some(r) = reasoning else {
        return AssistantMessage {
            role: "assistant",
            content: Some(text),
            reasoning: None,
            reasoning_content: None,
        };
    };
    let (reasoning, content) = r.split(&text);
    AssistantMessage {
        role: "assistant",
        content,
        reasoning_content: reasoning.clone(),
        reasoning,
    }
}

/// The messages through the chat template, tokenized (without adding special tokens: the
/// template writes them) and checked against the context.
pub fn render_prompt(app: &AppState, req: &ChatFields) -> Result<Vec<TokenId>, ApiError> {
    let tokens = render_tokens(app, req)?;
    check_prompt(&tokens, "messages", &app.limits)?;
    Ok(tokens)
}

/// The messages through the chat template, tokenized, not checked yet (a request may cut
/// them with `truncate_prompt_tokens` first).
fn render_tokens(app: &AppState, req: &ChatFields) -> Result<Vec<TokenId>, ApiError> {
    let text = render_text(app, req)?;
    app.tokenize(&text, false, "messages")
}

/// The messages through the request's chat template (or the server's), continuing the last
/// message with `continue_final_message`.
pub fn render_text(app: &AppState, req: &ChatFields) -> Result<String, ApiError> {
    let messages = req
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let continuing = req.continue_final_message.unwrap_or(false);
    if continuing && add_generation_prompt {
        // vLLM's rule (its `add_generation_prompt` defaults to true too).
        return Err(ApiError::invalid(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    let own;
    let template = match &req.chat_template {
        Some(source) => {
            own = ChatTemplate::new(source, &app.config.bos_token, &app.config.eos_token).map_err(
                |e| {
                    let crate::chat_template::TemplateError::Compile(why) = e;
                    ApiError::invalid(
                        "chat_template",
                        format!("`chat_template` does not compile: {why}"),
                    )
                },
            )?;
            &own
        }
        None => app.template()?,
    };
    let mut text = template.render(
        messages,
        add_generation_prompt,
        req.chat_template_kwargs.as_ref(),
    )?;
    if continuing {
        let last = messages.last().and_then(|m| m.content.as_ref());
        let final_text = match last {
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .rev()
                .find_map(|p| p.text.clone())
                .unwrap_or_default(),
            None => String::new(),
        };
        text = continue_final(&text, &final_text)?;
    }
    Ok(text)
}

impl Formatter {
    /// Choice `index`'s delta for `text`: its content, or with a reasoning parser its split
    /// (what could be a cut `<think>` marker waits for the next chunk, or the last).
    fn delta(&mut self, index: usize, text: String, last: bool) -> Delta {
        let Some(splitter) = self.splitters.get_mut(index).and_then(Option::as_mut) else {
            return Delta {
                content: (!text.is_empty() || !last).then_some(text),
                ..Delta::default()
            };
        };
        let mut split = splitter.push(&text);
        if last {
            let rest = splitter.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        let some = |t: String| (!t.is_empty()).then_some(t);
        let reasoning = some(split.reasoning);
        Delta {
            content: some(split.content),
            reasoning_content: reasoning.clone(),
            reasoning,
            ..Delta::default()
        }
    }
}

/// A `chat.completion.chunk` with these choices.
fn chat_chunk(head: &Head, choices: Vec<ChatChunkChoice>) -> ChatChunk {
    Response::new(head, "chat.completion.chunk", choices)
}

/// Streaming state.
#[derive(Debug)]
pub struct Formatter {
    base: StreamBase,
    prompt: Vec<TokenId>,
    n_choices: usize,
    /// Per choice, with a reasoning parser: its split so far.
    splitters: Vec<Option<Splitter>>,
}

impl ChunkFormatter for Formatter {
    /// One role delta per choice, as OpenAI streams start; the first carries the prompt ids.
    fn start(&mut self) -> Vec<String> {
        let return_token_ids = self.base.return_token_ids;
        (0..self.n_choices)
            .map(|index| {
                let token_ids = return_token_ids.then(Vec::new);
                let mut chunk = chat_chunk(
                    &self.base.head,
                    vec![ChatChunkChoice::role_delta(index, token_ids)],
                );
                if index == 0 && return_token_ids {
                    chunk.prompt_token_ids = Some(self.prompt.clone());
                }
                chunk.usage = self.base.chunk_usage(index);
                to_json(&chunk)
            })
            .collect()
    }

    fn chunk(&mut self, index: usize, out: OutputChunk) -> Vec<String> {
        let ChunkFinish {
            finish_reason,
            stop_reason,
            weight_versions,
            kv_transfer_params,
            error,
        } = self.base.observe(index, &out);
        let choice = ChatChunkChoice {
            index,
            content: DeltaContent {
                delta: self.delta(index, out.text, out.finish.is_some()),
            },
            logprobs: self
                .base
                .logprobs
                .then(|| chat_logprobs(&self.base.texts, &out.logprobs)),
            finish_reason,
            stop_reason,
            prompt_token_ids: None,
            token_ids: self.base.return_token_ids.then_some(out.token_ids),
            forced_tokens: self.base.constrained.then_some(out.forced),
            weight_versions,
            prompt_logprobs: None,
        };
        let chunk = ChatChunk {
            prompt_logprobs: (!out.prompt_logprobs.is_empty())
                .then(|| prompt_logprobs_json(&self.base.texts, &out.prompt_logprobs)),
            kv_transfer_params,
            usage: self.base.chunk_usage(index),
            ..chat_chunk(&self.base.head, vec![choice])
        };
        std::iter::once(to_json(&chunk)).chain(error).collect()
    }

    fn end(&mut self) -> Vec<String> {
        let Some(usage) = self.base.final_usage() else {
            return Vec::new();
        };
        let mut chunk = chat_chunk(&self.base.head, Vec::new());
        chunk.usage = Some(usage);
        vec![to_json(&chunk)]
    }
}
