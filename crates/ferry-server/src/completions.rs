//! `POST /v1/completions`: text or token-id prompts (single or batched), streaming or not.

use ferry_engine::{OutputChunk, PromptTokenLogprob, TokenId, TokenLogprob};

use crate::error::ApiError;
use crate::generate::{
    lora_versions, response_transfer_params, weight_versions, ChunkFinish, Collected, Generation,
    GenerationRoute, Prepared, PreparedPrompt, StreamBase,
};
use crate::logprobs::{completion_logprobs, echo_logprobs, prompt_logprobs_json, TokenTexts};
use crate::params::{check_completion_logprobs, check_prompt, GenerationParams};
use crate::request::{CompletionRequest, Prompt};
use crate::response::{
    AlwaysPresent, CompletionChoice, CompletionLogprobs, CompletionResponse, Head, Response, Text,
    Usage, COMPLETION_FIELDS,
};
use crate::routed_experts;
use crate::sse::{to_json, ChunkFormatter};
use crate::state::AppState;
use crate::structured::structured_output;
use serde_json::Value;

/// `max_tokens` of a completion that sets none: vLLM's and OpenAI's legacy completions
/// default (chat's is the rest of the context).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// The completions route, for [`crate::generate::handle`].
#[derive(Debug)]
pub struct Completions;

impl GenerationRoute for Completions {
    const PROMPT_PARAM: &'static str = "prompt";
    const ALWAYS_PRESENT: &'static AlwaysPresent = &COMPLETION_FIELDS;
    const STREAMS_BEAMS: bool = false;
    type Formatter = Formatter;
    type Response = CompletionResponse;

    fn prepare(app: &AppState, body: &Value) -> Result<Prepared, ApiError> {
        let req = CompletionRequest::from_json(body)?;
        let lora = app.resolve_model(req.common.model.as_deref())?;
        let logprobs = check_completion_logprobs(req.own.logprobs, &app.limits)?;
        let mut params = GenerationParams::from_common(
            &req.common,
            (req.common.max_tokens, "max_tokens"),
            logprobs,
            &app.limits,
        )?;
        params.structured = structured_output(&req.structured)?;
        params.set_lora(lora)?;
        params.default_max_tokens = Some(COMPLETIONS_DEFAULT_MAX_TOKENS);
        req.unsupported.check(i64::from(params.n))?;
        let echo = req.own.echo.unwrap_or(false);
        if let (true, Some(n)) = (echo, logprobs) {
            // Echoed logprobs cover the prompt: its logprobs, with as many top entries.
            params.sampling.prompt_logprobs.get_or_insert(n);
        }
        let prompts = prepare_prompts(app, req.own.prompt.map(|p| p.into_batch()), &params)?;
        if echo {
            params.echo = Some(echo_texts(app, &prompts)?);
        }
        Ok((prompts, params))
    }

    fn streaming(base: StreamBase, generation: Generation<'_>) -> Formatter {
        let n = generation.params.n as usize;
        let n_choices = generation.prompts.len() * n;
        Formatter {
            base,
            prompts: generation
                .prompts
                .iter()
                .map(|p| p.tokens.clone())
                .collect(),
            n,
            started: vec![false; n_choices],
            text_offsets: vec![0; n_choices],
            echo: generation.params.echo.clone(),
        }
    }

    fn full_response(
        head: Head,
        generation: Generation<'_>,
        collected: Vec<Collected>,
    ) -> CompletionResponse {
        let Generation {
            prompts,
            params,
            texts,
        } = generation;
        let n = params.n as usize;
        let kv_transfer_params = response_transfer_params(&collected);
        let (choices, usage) =
            generation.collect_choices(collected, |c, finish_reason, stop_reason| {
                CompletionChoice {
                    weight_versions: Some(weight_versions(c.finish.as_ref())),
                    lora_versions: lora_versions(c.finish.as_ref()),
                    index: c.index,
                    logprobs: params
                        .sampling
                        .sampler
                        .logprobs
                        .map(|_| match &params.echo {
                            Some(_) => {
                                let prompt = &prompts[c.index / n].tokens;
                                echoed_logprobs(texts, prompt, &c.prompt_logprobs, &c.logprobs).0
                            }
                            None => completion_logprobs(texts, &c.logprobs, 0).0,
                        }),
                    content: Text {
                        text: match &params.echo {
                            Some(echo) => format!("{}{}", echo[c.index / n], c.text),
                            None => c.text,
                        },
                    },
                    finish_reason: Some(finish_reason),
                    stop_reason,
                    prompt_token_ids: params
                        .return_token_ids
                        .then(|| prompts[c.index / n].tokens.clone()),
                    token_ids: params.return_token_ids.then_some(c.token_ids),
                    forced_tokens: params.structured.is_some().then_some(c.forced),
                    prompt_logprobs: params
                        .sampling
                        .prompt_logprobs
                        .map(|_| prompt_logprobs_json(texts, &c.prompt_logprobs)),
                    routed_experts: routed_experts::vllm(
                        c.finish.as_ref(),
                        params.routed_experts_prompt_start,
                    ),
                }
            });
        CompletionResponse {
            kv_transfer_params,
            ..completion_response(&head, choices, Some(usage))
        }
    }
}

/// `echo`'s text of each prompt: its tokens decoded, special tokens included (so a token-id
/// prompt echoes as text too).
fn echo_texts(app: &AppState, prompts: &[PreparedPrompt]) -> Result<Vec<String>, ApiError> {
    let tokenizer = app
        .engine
        .tokenizer()
        .ok_or_else(|| ApiError::invalid("echo", "`echo` needs a model with a tokenizer"))?;
    prompts
        .iter()
        .map(|p| {
            tokenizer
                .decode(TokenId::as_raw_slice(&p.tokens), false)
                .map_err(|e| ApiError::invalid("echo", format!("cannot decode the prompt: {e}")))
        })
        .collect()
}

/// An echoed choice's logprobs: the prompt's, then `output`'s (offsets after the prompt).
fn echoed_logprobs(
    texts: &TokenTexts,
    prompt: &[TokenId],
    prompt_lps: &[PromptTokenLogprob],
    output: &[TokenLogprob],
) -> (CompletionLogprobs, usize) {
    let (head, offset) = echo_logprobs(texts, prompt, prompt_lps);
    let (rest, end) = completion_logprobs(texts, output, offset);
    (head.append(rest), end)
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
            let tokens = params.truncate(tokens);
            check_prompt(&tokens, &param, &app.limits)?;
            let sampling = params.for_prompt(tokens.len(), &app.limits)?;
            Ok(PreparedPrompt { tokens, sampling })
        })
        .collect()
}

/// A `text_completion` response (or streamed chunk) with these choices.
fn completion_response(
    head: &Head,
    choices: Vec<CompletionChoice>,
    usage: Option<Usage>,
) -> CompletionResponse {
    CompletionResponse {
        usage,
        ..Response::new(head, "text_completion", choices)
    }
}

/// Streaming state: per choice, whether its prompt ids went out and its text offset.
#[derive(Debug)]
pub struct Formatter {
    base: StreamBase,
    prompts: Vec<Vec<TokenId>>,
    n: usize,
    started: Vec<bool>,
    text_offsets: Vec<usize>,
    /// `echo`'s prompt texts, one per prompt.
    echo: Option<Vec<String>>,
}

impl ChunkFormatter for Formatter {
    fn start(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn chunk(&mut self, index: usize, chunk: OutputChunk) -> Vec<String> {
        let ChunkFinish {
            finish_reason,
            stop_reason,
            weight_versions,
            lora_versions,
            kv_transfer_params,
            error,
        } = self.base.observe(index, &chunk);
        let first = !std::mem::replace(&mut self.started[index], true);
        // An echo comes with the choice's first chunk.
        let echo = self
            .echo
            .as_ref()
            .filter(|_| first)
            .map(|e| &e[index / self.n]);
        let logprobs = self.base.logprobs.then(|| {
            let (lp, end) = match echo {
                Some(_) => echoed_logprobs(
                    &self.base.texts,
                    &self.prompts[index / self.n],
                    &chunk.prompt_logprobs,
                    &chunk.logprobs,
                ),
                None => {
                    completion_logprobs(&self.base.texts, &chunk.logprobs, self.text_offsets[index])
                }
            };
            self.text_offsets[index] = end;
            lp
        });
        let text = match echo {
            Some(e) => format!("{e}{}", chunk.text),
            None => chunk.text,
        };
        let return_token_ids = self.base.return_token_ids;
        let choice = CompletionChoice {
            index,
            content: Text { text },
            logprobs,
            finish_reason,
            stop_reason,
            prompt_token_ids: (return_token_ids && first)
                .then(|| self.prompts[index / self.n].clone()),
            token_ids: return_token_ids.then_some(chunk.token_ids),
            forced_tokens: self.base.constrained.then_some(chunk.forced),
            weight_versions,
            lora_versions,
            prompt_logprobs: (!chunk.prompt_logprobs.is_empty())
                .then(|| prompt_logprobs_json(&self.base.texts, &chunk.prompt_logprobs)),
            // vLLM's streamed choices have no `routed_experts`.
            routed_experts: None,
        };
        let response = CompletionResponse {
            kv_transfer_params,
            ..completion_response(&self.base.head, vec![choice], self.base.chunk_usage(index))
        };
        std::iter::once(to_json(&response)).chain(error).collect()
    }

    fn end(&mut self) -> Vec<String> {
        match self.base.final_usage() {
            Some(usage) => vec![to_json(&completion_response(
                &self.base.head,
                Vec::new(),
                Some(usage),
            ))],
            None => Vec::new(),
        }
    }
}
