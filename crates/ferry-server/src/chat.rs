//! `POST /v1/chat/completions`: messages rendered through the model's chat template, then
//! generated like a completion; streaming or not.

use ferry_engine::OutputChunk;
use ferry_engine::TokenId;

use crate::chat_template::{continue_final, ChatTemplate};
use crate::error::ApiError;
use crate::generate::{
    lora_versions, response_transfer_params, weight_versions, ChunkFinish, Collected, Generation,
    GenerationRoute, Prepared, PreparedPrompt, StreamBase,
};
use crate::logprobs::{chat_logprobs, prompt_logprobs_json};
use crate::params::{check_chat_logprobs, check_prompt, GenerationParams};
use crate::reasoning::{Reasoning, Splitter};
use crate::request::{ChatFields, ChatRequest, MessageContent};
use crate::response::{
    AlwaysPresent, AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatResponse, Delta,
    DeltaContent, Head, Message, Response, CHAT_FIELDS,
};
use crate::routed_experts;
use crate::sse::{to_json, ChunkFormatter};
use crate::state::AppState;
use crate::structured::{structured_output, StructuredSpec};
use crate::tools::{check_messages, ToolOutput, ToolStream};
use ferry_engine::StructuredOutput;
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
        let mut req = ChatRequest::from_json(body)?;
        let lora = app.resolve_model(req.common.model.as_deref())?;
        let logprobs = check_chat_logprobs(req.own.logprobs, req.own.top_logprobs, &app.limits)?;
        // `max_completion_tokens` replaces the deprecated `max_tokens`; either is accepted.
        let max_tokens = match req.own.max_completion_tokens {
            Some(v) => (Some(v), "max_completion_tokens"),
            None => (req.common.max_tokens, "max_tokens"),
        };
        let mut params =
            GenerationParams::from_common(&req.common, max_tokens, logprobs, &app.limits)?;
        params.structured = structured_output(&req.structured)?;
        params.set_lora(lora)?;
        let server = app.config.tool_server();
        let tools = req.tools.read(server)?;
        if let Some(messages) = &req.own.messages {
            check_messages(messages)?;
        }
        if let Some(tools) = &tools {
            if let Some(forced) = tools.constraint() {
                if let Some(own) = &params.structured {
                    // vLLM's rule: a named function's constraint and the request's cannot
                    // both hold (ferry refuses `required` with one too, for the same reason).
                    return Err(ApiError::invalid(
                        own.param,
                        "You can only either use constraints for structured outputs or tools \
                         (`tool_choice` required or a named function), not both.",
                    ));
                }
                params.structured = Some(forced);
            }
            params.schema_checks = tools.schemas();
            params.tools = tools.output(server.auto);
            if params
                .tools
                .as_ref()
                .is_some_and(ToolOutput::reads_model_format)
            {
                // The call markers are special tokens in some vocabularies (Llama's
                // `<|python_tag|>`): the parser must see them, as vLLM's parsers ask for.
                params.skip_special_tokens = false;
            }
        }
        if let Some(parser) = app.config.reasoning_parser {
            let thinking = req
                .own
                .chat_template_kwargs
                .as_ref()
                .and_then(|k| k.get("enable_thinking"))
                .and_then(Value::as_bool)
                .unwrap_or(true);
            let reasoning = Reasoning { parser, thinking };
            // A constraint holds the content: it starts after the reasoning, as vLLM's does.
            if reasoning.starts_in_reasoning() {
                params.structured = params.structured.take().map(|s| StructuredSpec {
                    output: StructuredOutput::AfterReasoning {
                        end: Reasoning::END.to_owned(),
                        inner: Box::new(s.output),
                    },
                    param: s.param,
                });
            }
            params.reasoning = Some(reasoning);
        }
        // Chat reads `tools` itself; the shared check refuses it on completions.
        req.unsupported.tools = None;
        req.unsupported.check(i64::from(params.n))?;
        let template_tools = tools.as_ref().map(|t| t.tools.as_slice());
        let prompt = params.truncate(render_tokens(app, &req.own, template_tools)?);
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
            tool_streams: (0..n_choices)
                .map(|_| generation.params.tools.as_ref().map(ToolOutput::stream))
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
            generation.collect_choices(collected, |c, finish_reason, stop_reason| {
                let message = assistant_message(c.text, params.reasoning, params.tools.as_ref());
                let finish_reason = match &params.tools {
                    Some(t) => t.finish_reason(!message.tool_calls.is_empty(), finish_reason),
                    None => finish_reason,
                };
                ChatChoice {
                    weight_versions: Some(weight_versions(c.finish.as_ref())),
                    lora_versions: lora_versions(c.finish.as_ref()),
                    index: c.index,
                    logprobs: params
                        .sampling
                        .sampler
                        .logprobs
                        .map(|_| chat_logprobs(texts, &c.logprobs)),
                    content: Message { message },
                    finish_reason: Some(finish_reason),
                    stop_reason,
                    prompt_token_ids: None,
                    token_ids: params.return_token_ids.then_some(c.token_ids),
                    forced_tokens: params.structured.is_some().then_some(c.forced),
                    prompt_logprobs: None,
                    routed_experts: routed_experts::vllm(
                        c.finish.as_ref(),
                        params.routed_experts_prompt_start,
                    ),
                }
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
/// names) and the content after it (`null` when none); with tools, the calls read from the
/// content.
fn assistant_message(
    text: String,
    reasoning: Option<Reasoning>,
    tools: Option<&ToolOutput>,
) -> AssistantMessage {
    let (reasoning, content) = match reasoning {
        None => (None, Some(text)),
        Some(r) => r.split(&text),
    };
    let (content, tool_calls) = match tools {
        None => (content, Vec::new()),
        Some(t) => t.parse(content),
    };
    AssistantMessage {
        role: "assistant",
        content,
        reasoning_content: reasoning.clone(),
        reasoning,
        tool_calls,
    }
}

/// The messages through the chat template, tokenized (without adding special tokens: the
/// template writes them) and checked against the context.
pub fn render_prompt(
    app: &AppState,
    req: &ChatFields,
    tools: Option<&[Value]>,
) -> Result<Vec<TokenId>, ApiError> {
    let tokens = render_tokens(app, req, tools)?;
    check_prompt(&tokens, "messages", &app.limits)?;
    Ok(tokens)
}

/// The messages through the chat template, tokenized, not checked yet (a request may cut
/// them with `truncate_prompt_tokens` first).
fn render_tokens(
    app: &AppState,
    req: &ChatFields,
    tools: Option<&[Value]>,
) -> Result<Vec<TokenId>, ApiError> {
    let text = render_text(app, req, tools)?;
    app.tokenize(&text, false, "messages")
}

/// The messages through the request's chat template (or the server's), continuing the last
/// message with `continue_final_message`.
pub fn render_text(
    app: &AppState,
    req: &ChatFields,
    tools: Option<&[Value]>,
) -> Result<String, ApiError> {
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
        tools,
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
    /// (what could be a cut `<think>` marker waits for the next chunk, or the last); with
    /// tools, the content goes through the choice's [`ToolStream`], which holds back call
    /// text and sends the calls when the answer ends.
    fn delta(&mut self, index: usize, text: String, last: bool) -> Delta {
        let splitter = self.splitters.get_mut(index).and_then(Option::as_mut);
        let tools = self.tool_streams.get_mut(index).and_then(Option::as_mut);
        if splitter.is_none() && tools.is_none() {
            // Without parsers every chunk but an empty last one carries its content.
            return Delta {
                content: (!text.is_empty() || !last).then_some(text),
                ..Delta::default()
            };
        }
        let (reasoning, content) = match splitter {
            None => (String::new(), text),
            Some(splitter) => {
                let split = splitter.feed(&text, last);
                (split.reasoning, split.content)
            }
        };
        let (content, tool_calls) = match tools {
            None => (content, Vec::new()),
            Some(tools) => {
                let out = tools.feed(&content, last);
                (out.content, out.calls)
            }
        };
        let some = |t: String| (!t.is_empty()).then_some(t);
        let reasoning = some(reasoning);
        Delta {
            content: some(content),
            reasoning_content: reasoning.clone(),
            reasoning,
            tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
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
    /// Per choice, with tools: its calls so far.
    tool_streams: Vec<Option<ToolStream>>,
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
            lora_versions,
            kv_transfer_params,
            error,
        } = self.base.observe(index, &out);
        let mut delta = self.delta(index, out.text, out.finish.is_some());
        let finish_reason = match (finish_reason, self.tool_streams.get(index)) {
            (Some(reason), Some(Some(tools))) => Some(tools.finish_reason(reason)),
            (reason, _) => reason,
        };
        // Each piece of a call goes in a chunk of its own after this one (OpenAI's order:
        // a call's index, id and name, then its argument text), and the last chunk carries
        // the finish.
        let calls = delta.tool_calls.take().unwrap_or_default();
        let mut finish = Some(ChunkFinish {
            finish_reason,
            stop_reason,
            weight_versions,
            lora_versions,
            kv_transfer_params,
            error: None,
        });
        let mut finish_here = |last: bool| {
            if last {
                finish.take().unwrap_or_default()
            } else {
                ChunkFinish::default()
            }
        };
        let main = finish_here(calls.is_empty());
        let choice = ChatChunkChoice {
            index,
            content: DeltaContent { delta },
            logprobs: self
                .base
                .logprobs
                .then(|| chat_logprobs(&self.base.texts, &out.logprobs)),
            finish_reason: main.finish_reason,
            stop_reason: main.stop_reason,
            prompt_token_ids: None,
            token_ids: self.base.return_token_ids.then_some(out.token_ids),
            forced_tokens: self.base.constrained.then_some(out.forced),
            weight_versions: main.weight_versions,
            lora_versions: main.lora_versions,
            prompt_logprobs: None,
            routed_experts: None,
        };
        let usage = self.base.chunk_usage(index);
        let chunk = ChatChunk {
            prompt_logprobs: (!out.prompt_logprobs.is_empty())
                .then(|| prompt_logprobs_json(&self.base.texts, &out.prompt_logprobs)),
            kv_transfer_params: main.kv_transfer_params,
            usage: usage.clone(),
            ..chat_chunk(&self.base.head, vec![choice])
        };
        let mut events = vec![to_json(&chunk)];
        let n_calls = calls.len();
        for (k, call) in calls.into_iter().enumerate() {
            let f = finish_here(k + 1 == n_calls);
            let choice = ChatChunkChoice {
                index,
                content: DeltaContent {
                    delta: Delta {
                        tool_calls: Some(vec![call]),
                        ..Delta::default()
                    },
                },
                logprobs: None,
                finish_reason: f.finish_reason,
                stop_reason: f.stop_reason,
                prompt_token_ids: None,
                token_ids: self.base.return_token_ids.then(Vec::new),
                forced_tokens: None,
                weight_versions: f.weight_versions,
                lora_versions: f.lora_versions,
                prompt_logprobs: None,
                routed_experts: None,
            };
            let chunk = ChatChunk {
                kv_transfer_params: f.kv_transfer_params,
                usage: usage.clone(),
                ..chat_chunk(&self.base.head, vec![choice])
            };
            events.push(to_json(&chunk));
        }
        events.extend(error);
        events
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
