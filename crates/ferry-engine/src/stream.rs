//! The caller's side of one request: raw engine events in, [`OutputChunk`]s out.
//!
//! Runs on the caller's tokio task, never on the engine thread: it merges every event that
//! has queued up into one chunk, detokenizes incrementally, matches stop strings (aborting the
//! core request on a match) and, when dropped before its finish, aborts the request.
//!
//! A request's expert routing (an engine capturing it) comes with the core's finish; the
//! stream cuts it to the rows of the tokens it reported (every input token: prompt and
//! output but the last). A stop string ends the stream before the core's finish, so there
//! the stream sends the text up to it at once and the finish once the core's (of the abort
//! it asked for) brings the routing: at most one engine step later.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ferry_core::{ExpertRouting, FinishReason, SampledToken, TokenId};
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, watch};

use crate::detok::IncrementalDetokenizer;
use crate::event::{EngineFinish, Event};
use crate::input::{Input, Queued};
use crate::stop::{StopMatcher, StopOutcome};
use crate::{EngineStats, Finish, OutputChunk, StopReason, TokenLogprob};

/// What `generate` knows about the request, for its stream.
#[derive(Debug)]
pub(crate) struct StreamSetup {
    pub request_id: String,
    pub n_prompt_tokens: usize,
    pub prompt_tail: Vec<TokenId>,
    pub want_logprobs: bool,
    /// The request has a structured-output constraint (chunks say which tokens it forced).
    pub constrained: bool,
    pub stop: Vec<String>,
    pub detokenize: bool,
    /// Set when text is needed (detokenize or stop strings).
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Stop strings do not match in the text of the first this many tokens.
    pub min_tokens: u32,
    /// Special tokens stay in the text.
    pub keep_special_tokens: bool,
    /// A matched stop string, and a stop token's text, stay in the text.
    pub include_stop_str_in_output: bool,
    /// The engine captures expert routing: a finish waits for the core's, which has it.
    pub routing: bool,
}

/// Text state: the decoder, the stop matcher, and whether the caller wants the text.
#[derive(Debug)]
struct TextState {
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    emit: bool,
    /// See [`StreamSetup::min_tokens`].
    min_tokens: u32,
    /// See [`StreamSetup::include_stop_str_in_output`].
    include_stop: bool,
}

/// Output of one request. Dropping it before the final chunk aborts the request.
#[derive(Debug)]
pub struct GenerateStream {
    request_id: String,
    events: mpsc::UnboundedReceiver<Event>,
    /// For the abort on a stop string or on drop.
    inputs: mpsc::UnboundedSender<Queued>,
    /// The engine's published stats: if the events end without a finish, its failure (if it
    /// failed) says why.
    stats: watch::Receiver<EngineStats>,
    text: Option<TextState>,
    want_logprobs: bool,
    constrained: bool,
    n_prompt_tokens: usize,
    n_cached_tokens: usize,
    n_output_tokens: usize,
    /// Distinct weight versions of the output tokens, in order.
    weight_versions: Vec<String>,
    lora_versions: Vec<u64>,
    /// The chunk with `finish` has been returned (or built).
    done: bool,
    /// Prompt logprobs received, for the next chunk returned.
    prompt_logprobs: Vec<ferry_core::PromptTokenLogprob>,
    /// See [`StreamSetup::routing`].
    routing: bool,
    /// A stop string matched and the engine captures routing: the finish, waiting for the
    /// core's (which brings the routing); tokens that come meanwhile are past the stop.
    stopping: Option<Finish>,
}

impl GenerateStream {
    pub(crate) fn new(
        setup: StreamSetup,
        events: mpsc::UnboundedReceiver<Event>,
        inputs: mpsc::UnboundedSender<Queued>,
        stats: watch::Receiver<EngineStats>,
    ) -> Self {
        let text = setup.tokenizer.map(|tokenizer| {
            let detok = IncrementalDetokenizer::new(tokenizer, &setup.prompt_tail);
            TextState {
                detok: if setup.keep_special_tokens {
                    detok.keep_special_tokens()
                } else {
                    detok
                },
                stop: if setup.include_stop_str_in_output {
                    StopMatcher::new(setup.stop).including_stop()
                } else {
                    StopMatcher::new(setup.stop)
                },
                emit: setup.detokenize,
                min_tokens: setup.min_tokens,
                include_stop: setup.include_stop_str_in_output,
            }
        });
        Self {
            request_id: setup.request_id,
            events,
            inputs,
            stats,
            text,
            want_logprobs: setup.want_logprobs,
            constrained: setup.constrained,
            n_prompt_tokens: setup.n_prompt_tokens,
            n_cached_tokens: 0,
            n_output_tokens: 0,
            weight_versions: Vec::new(),
            lora_versions: Vec::new(),
            done: false,
            prompt_logprobs: Vec::new(),
            routing: setup.routing,
            stopping: None,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next chunk; `None` after the chunk that carries `finish`.
    pub async fn next(&mut self) -> Option<OutputChunk> {
        std::future::poll_fn(|cx| self.poll_chunk(cx)).await
    }

    /// Waits for one event, then takes every event already queued, into one chunk.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<OutputChunk>> {
        let mut chunk = OutputChunk::default();
        while !self.done {
            match self.events.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(event)) => self.absorb(event, &mut chunk),
                // Every request gets a finish event unless the engine thread died: end
                // clearly rather than hang, naming its failure (published before it closed
                // any channel) if it failed.
                Poll::Ready(None) => {
                    let stopped =
                        crate::Stopped::from_failure(self.stats.borrow().failure.as_deref());
                    self.finish(
                        EngineFinish {
                            reason: FinishReason::Error,
                            stop_token: None,
                            transfer: None,
                            kv_transfer_params: None,
                            message: Some(stopped.to_string()),
                            constraint_stop: None,
                            routing: None,
                        },
                        &mut chunk,
                    )
                }
            }
            while !self.done {
                let Ok(event) = self.events.try_recv() else {
                    break;
                };
                self.absorb(event, &mut chunk);
            }
            if !chunk.token_ids.is_empty() || chunk.finish.is_some() {
                chunk.prompt_logprobs = std::mem::take(&mut self.prompt_logprobs);
                return Poll::Ready(Some(chunk));
            }
        }
        Poll::Ready(None)
    }

    fn absorb(&mut self, event: Event, chunk: &mut OutputChunk) {
        match event {
            Event::Admitted { n_cached_tokens } => self.n_cached_tokens = n_cached_tokens,
            Event::PromptLogprobs(lps) => self.prompt_logprobs.extend(lps),
            Event::Output {
                sampled,
                finish,
                weight_version,
                lora_version,
                forced,
            } => {
                if let Some(v) = weight_version {
                    if self.weight_versions.last().map(String::as_str) != Some(&*v) {
                        self.weight_versions.push(v.to_string());
                    }
                }
                if let Some(v) = lora_version {
                    if self.lora_versions.last() != Some(&v) {
                        self.lora_versions.push(v);
                    }
                }
                if let Some(s) = sampled.filter(|_| self.stopping.is_none()) {
                    let stop_token = finish.as_ref().and_then(|f| f.stop_token) == Some(s.token);
                    if self.constrained {
                        chunk.forced.push(forced);
                    }
                    self.push_token(s, stop_token, chunk);
                }
                if let Some(f) = finish.filter(|_| !self.done) {
                    self.finish(f, chunk);
                }
            }
        }
    }

    /// Adds one token to the chunk, and its text unless it is the stop token (whose text is
    /// not part of the output, as with OpenAI, unless `include_stop_str_in_output`). A stop
    /// string match finishes the stream; none matches in the text of the first `min_tokens`
    /// tokens (as vLLM: a stop string may still end after them).
    fn push_token(&mut self, s: SampledToken, is_stop_token: bool, chunk: &mut OutputChunk) {
        self.n_output_tokens += 1;
        chunk.token_ids.push(s.token);
        if self.want_logprobs {
            chunk.logprobs.push(TokenLogprob {
                token: s.token,
                logprob: s.logprob,
                top: s.top_logprobs,
            });
        }
        let Some(text) = self.text.as_mut() else {
            return;
        };
        if is_stop_token && !text.include_stop {
            return;
        }
        let delta = text.detok.push(s.token);
        if text.stop.is_empty() {
            if text.emit {
                chunk.text.push_str(&delta);
            }
            return;
        }
        if self.n_output_tokens <= text.min_tokens as usize {
            let t = text.stop.push_unmatched(&delta);
            if text.emit {
                chunk.text.push_str(&t);
            }
            return;
        }
        match text.stop.push(&delta) {
            StopOutcome::Continue(t) => {
                if text.emit {
                    chunk.text.push_str(&t);
                }
            }
            StopOutcome::Stopped { text: t, stop } => {
                if text.emit {
                    chunk.text.push_str(&t);
                }
                self.stop_on_string(stop, chunk);
            }
        }
    }

    /// A stop string matched: abort the core request and finish with `stop` (once the
    /// core's finish brought the routing, when the engine captures it).
    fn stop_on_string(&mut self, stop: String, chunk: &mut OutputChunk) {
        self.send_abort();
        let finish = self.finish_of(FinishReason::Stop, Some(StopReason::String(stop)));
        if self.routing {
            self.stopping = Some(finish);
        } else {
            chunk.finish = Some(finish);
            self.done = true;
        }
    }

    /// The request ended in the engine: flush held text, then finish (the stop string's
    /// finish, if one was waiting for this).
    fn finish(&mut self, f: EngineFinish, chunk: &mut OutputChunk) {
        if let Some(mut finish) = self.stopping.take() {
            finish.routing = self.routing_of(f.routing);
            chunk.finish = Some(finish);
            self.done = true;
            return;
        }
        if let Some(text) = self.text.as_mut() {
            let tail = text.detok.flush();
            let tail = match text.stop.push(&tail) {
                StopOutcome::Continue(t) => t + &text.stop.flush(),
                StopOutcome::Stopped { text: t, stop } => {
                    if text.emit {
                        chunk.text.push_str(&t);
                    }
                    self.stop_on_string(stop, chunk);
                    if let Some(mut finish) = self.stopping.take() {
                        finish.routing = self.routing_of(f.routing);
                        chunk.finish = Some(finish);
                        self.done = true;
                    }
                    return;
                }
            };
            if text.emit {
                chunk.text.push_str(&tail);
            }
        }
        let stop_reason = match f.constraint_stop {
            Some(why) => Some(StopReason::Constraint(why)),
            None => f.stop_token.map(StopReason::Token),
        };
        let mut finish = self.finish_of(f.reason, stop_reason);
        finish.export = f.transfer;
        finish.kv_transfer_params = f.kv_transfer_params.map(|p| *p);
        finish.message = f.message;
        finish.routing = self.routing_of(f.routing);
        chunk.finish = Some(finish);
        self.done = true;
    }

    /// The core's routing cut to the positions that were inputs of the tokens this stream
    /// reported: the prompt and the output but its last token. `None` when it has fewer rows
    /// (aborted before its prompt was computed) or no output token came (vLLM has none then
    /// either).
    fn routing_of(&self, routing: Option<ExpertRouting>) -> Option<ExpertRouting> {
        let mut routing = routing?;
        let n_rows = (self.n_prompt_tokens + self.n_output_tokens).checked_sub(1)?;
        if self.n_output_tokens == 0 || routing.rows() < n_rows {
            return None;
        }
        routing.truncate_rows(n_rows);
        Some(routing)
    }

    fn finish_of(&self, reason: FinishReason, stop_reason: Option<StopReason>) -> Finish {
        Finish {
            reason,
            stop_reason,
            n_prompt_tokens: self.n_prompt_tokens,
            n_output_tokens: self.n_output_tokens,
            n_cached_tokens: self.n_cached_tokens,
            weight_versions: self.weight_versions.clone(),
            lora_versions: self.lora_versions.clone(),
            export: None,
            kv_transfer_params: None,
            message: None,
            routing: None,
        }
    }

    fn send_abort(&self) {
        // A send error means the engine has stopped: nothing left to abort.
        let _ = self.inputs.send(Queued {
            input: Input::Abort(self.request_id.clone()),
            permit: None,
            slot: None,
        });
    }
}

impl futures_core::Stream for GenerateStream {
    type Item = OutputChunk;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<OutputChunk>> {
        self.get_mut().poll_chunk(cx)
    }
}

impl Drop for GenerateStream {
    fn drop(&mut self) {
        if !self.done {
            self.send_abort();
        }
    }
}
