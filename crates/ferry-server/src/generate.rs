//! Running one HTTP generation request on the engine: `n` engine requests per prompt (distinct
//! ids; with a seed, choice `i` draws from the seed's stream `i`), each wrapped in a [`ChoiceStream`] that records latency metrics as
//! chunks arrive; then either collected (non-streaming) or merged (streaming). [`handle`] is
//! the one handler of both generation routes; each route supplies only its request parsing
//! and its wire format through [`GenerationRoute`].
//!
//! Dropping a [`ChoiceStream`] drops its `GenerateStream`, which aborts the engine request:
//! that is how a client disconnect frees its KV blocks.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_engine::{
    AddError, Constraint, EngineHandle, Finish, FinishReason, GenerateError, GenerateRequest,
    GenerateStream, OutputChunk, PromptTokenLogprob, SamplingParams, TokenId, TokenLogprob,
    TransferRequest,
};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde::Serialize;
use serde_json::Value;

use crate::error::{ApiError, EngineFailure};
use crate::extract::{next_engine_seq, ApiJson, RequestId};
use crate::kv_transfer::{check_remote_host, KvTransferParamsJson, TransferLimits};
use crate::live::{LiveRequests, Registration};
use crate::logprobs::TokenTexts;
use crate::metrics::Metrics;
use crate::params::GenerationParams;
use crate::response::{Head, StopReasonJson, Usage};
use crate::sse::{sse_response, to_json, ChunkFormatter};
use crate::state::{unix_now, AppState};
use crate::structured::{compile, StructuredSpec};

/// One prompt, tokenized and validated, with its resolved sampling parameters.
#[derive(Debug, Clone)]
pub struct PreparedPrompt {
    pub tokens: Vec<TokenId>,
    pub sampling: SamplingParams,
}

/// What the launcher needs besides the prompts.
#[derive(Debug)]
pub struct LaunchSpec<'a> {
    /// The HTTP request id; engine ids extend it with a process-wide sequence number.
    pub request_id: &'a str,
    pub n: u32,
    pub stop: &'a [String],
    /// The request field that holds the prompt (`prompt` or `messages`), for error messages.
    pub prompt_param: &'static str,
    /// When the HTTP request arrived (time to first token counts from here).
    pub arrival: Instant,
    /// What the request asks of the P/D transfer, parsed and checked (one prompt only).
    pub transfer: Option<&'a TransferRequest>,
    /// The compiled structured-output constraint: each choice gets its own copy.
    pub constraint: Option<&'a Constraint>,
    /// Special tokens stay in the text (`skip_special_tokens: false`).
    pub keep_special_tokens: bool,
    /// The matched stop string stays in the text.
    pub include_stop_str_in_output: bool,
    /// The LoRA adapter the choices run under, by name (`None`: the base model).
    pub lora: Option<Arc<str>>,
}

/// One choice's engine output, with latency bookkeeping.
#[derive(Debug)]
pub struct ChoiceStream {
    pub index: usize,
    stream: GenerateStream,
    arrival: Instant,
    last_chunk_at: Option<Instant>,
    metrics: Arc<Metrics>,
    /// Shared by the request's choices: the last one dropped unregisters the request.
    _live: Arc<Registration>,
}

impl ChoiceStream {
    /// The next chunk; `None` once the chunk carrying `finish` was returned.
    pub async fn next(&mut self) -> Option<OutputChunk> {
        let chunk = self.stream.next().await?;
        let now = Instant::now();
        if !chunk.token_ids.is_empty() {
            match self.last_chunk_at {
                None => self
                    .metrics
                    .observe_ttft((now - self.arrival).as_secs_f64()),
                Some(last) => self.metrics.observe_itl((now - last).as_secs_f64()),
            }
            self.last_chunk_at = Some(now);
        }
        if chunk.finish.is_some() {
            self.metrics
                .observe_request((now - self.arrival).as_secs_f64());
        }
        Some(chunk)
    }

    /// Reads the whole output (non-streaming requests).
    pub async fn collect(mut self) -> Collected {
        let mut out = Collected {
            index: self.index,
            ..Collected::default()
        };
        while let Some(chunk) = self.next().await {
            out.token_ids.extend_from_slice(&chunk.token_ids);
            out.forced.extend_from_slice(&chunk.forced);
            out.logprobs.extend(chunk.logprobs);
            out.prompt_logprobs.extend(chunk.prompt_logprobs);
            out.text.push_str(&chunk.text);
            if chunk.finish.is_some() {
                out.finish = chunk.finish;
            }
        }
        out
    }

    /// As a `Stream` of `(choice index, chunk)`, for merging.
    pub fn into_stream(self) -> BoxStream<'static, (usize, OutputChunk)> {
        stream::unfold(self, |mut c| async move {
            let chunk = c.next().await?;
            Some(((c.index, chunk), c))
        })
        .boxed()
    }
}

/// A choice's whole output.
#[derive(Debug, Default)]
pub struct Collected {
    pub index: usize,
    pub token_ids: Vec<TokenId>,
    /// Per token, for a constrained request: the constraint allowed only that token.
    pub forced: Vec<bool>,
    pub logprobs: Vec<TokenLogprob>,
    /// The prompt's logprobs, when the request asked for them.
    pub prompt_logprobs: Vec<PromptTokenLogprob>,
    pub text: String,
    /// `None` only if the engine went away without a final chunk.
    pub finish: Option<Finish>,
}

/// Where launched requests are recorded: latency metrics, and the requests in flight by
/// HTTP id (for `/abort_requests`).
#[derive(Debug, Clone, Copy)]
pub struct Recorders<'a> {
    pub metrics: &'a Arc<Metrics>,
    pub live: &'a Arc<LiveRequests>,
}

/// Starts `n` engine requests per prompt; choice `p * n + i` is prompt `p`'s `i`-th sample.
/// Any failure drops (and so aborts) the requests already started.
pub async fn launch(
    engine: &EngineHandle,
    recorders: Recorders<'_>,
    prompts: &[PreparedPrompt],
    spec: &LaunchSpec<'_>,
) -> Result<Vec<ChoiceStream>, ApiError> {
    let Recorders { metrics, live } = recorders;
    let seq = next_engine_seq();
    let n = spec.n as usize;
    let engine_id = |index: usize| format!("{}-{seq}-{index}", spec.request_id);
    // Registered before any request starts, so an abort by HTTP id never misses one.
    let registration = Arc::new(live.register(
        spec.request_id,
        (0..prompts.len() * n).map(engine_id).collect(),
    ));
    tracing::debug!(
        request_id = spec.request_id,
        seq,
        n_prompts = prompts.len(),
        n,
        "starting engine requests"
    );
    // All the choices are queued at once, so the engine takes them between the same two
    // steps (the choices of a P/D prompt share one load: `generate_all`).
    let mut reqs = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for i in 0..n {
            reqs.push(GenerateRequest {
                request_id: engine_id(reqs.len()),
                prompt: prompt.tokens.clone(),
                params: choice_params(&prompt.sampling, i as u32),
                stop: spec.stop.to_vec(),
                detokenize: engine.tokenizer().is_some(),
                transfer: choice_transfer(spec.transfer, i),
                constraint: spec.constraint.cloned(),
                keep_special_tokens: spec.keep_special_tokens,
                include_stop_str_in_output: spec.include_stop_str_in_output,
                lora: spec.lora.clone(),
            });
        }
    }
    let streams = engine
        .generate_all(reqs)
        .await
        .map_err(|(_, e)| generate_error(e, spec.prompt_param))?;
    let mut choices = Vec::with_capacity(streams.len());
    for (index, stream) in streams.into_iter().enumerate() {
        metrics.add_prompt_tokens(prompts[index / n].tokens.len());
        choices.push(ChoiceStream {
            index,
            stream,
            arrival: spec.arrival,
            last_chunk_at: None,
            metrics: Arc::clone(metrics),
            _live: Arc::clone(&registration),
        });
    }
    Ok(choices)
}

/// Choice `i`'s transfer. A load (D) goes to every choice: the core imports the export once
/// and the other choices take prefix hits on what arrived. An export (P) is asked of the first
/// choice only: a reader pulls one export, so the other choices' would only wait for their
/// lease to run out.
fn choice_transfer(transfer: Option<&TransferRequest>, i: usize) -> Option<TransferRequest> {
    match transfer? {
        TransferRequest::Export if i > 0 => None,
        TransferRequest::ImportThenExport(spec) if i > 0 => {
            Some(TransferRequest::Import(spec.clone()))
        }
        t => Some(t.clone()),
    }
}

/// The response's `kv_transfer_params`: those of the first choice that has any (P's export).
pub fn response_transfer_params(collected: &[Collected]) -> Option<KvTransferParamsJson> {
    collected
        .iter()
        .find_map(|c| c.finish.as_ref()?.kv_transfer_params.as_ref())
        .map(KvTransferParamsJson::from)
}

/// A choice that finished with an explained `error` (a failed KV load under the `fail`
/// policy) fails a non-streaming request as a whole, as vLLM does: a 500 whose message says
/// why, since a partial set of choices would read as a complete answer.
pub fn check_failed_choices(collected: &[Collected]) -> Result<(), ApiError> {
    match collected
        .iter()
        .find_map(|c| failure(c.index, c.finish.as_ref()?))
    {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// Choice `index`'s explained `error` finish as an error (an unexplained one, such as a failed
/// step, stays a plain `finish_reason: "error"`).
fn failure(index: usize, finish: &Finish) -> Option<ApiError> {
    let message = finish.message.as_deref()?;
    (finish.reason == FinishReason::Error)
        .then(|| ApiError::generation_failed(format!("choice {index} failed: {message}")))
}

/// The sampling parameters of a prompt's choice `choice`: with a seed, the choice draws from
/// the seed's stream `choice` (not from seed + `choice`, which would replay choice 0 of a
/// later seed, so that prompts seeded base + k would share random draws); choice 0 draws what
/// a lone request with that seed draws.
pub fn choice_params(prompt: &SamplingParams, choice: u32) -> SamplingParams {
    let mut params = prompt.clone();
    params.sampler.seed_stream = choice;
    params
}

/// A refused generation as an HTTP error: a full queue or a stopped engine is a 503 (retry
/// later); a refused request is the client's 400, naming `prompt_param` (`prompt` or
/// `messages`) when the prompt is at fault.
pub fn generate_error(e: GenerateError, prompt_param: &str) -> ApiError {
    match e {
        GenerateError::Overloaded { .. } => ApiError::unavailable(e.to_string()),
        GenerateError::Stopped(e) => e.into_api_error(),
        GenerateError::NoTokenizer => ApiError::invalid("stop", e.to_string()),
        GenerateError::TokenOutOfVocabulary { .. } => {
            ApiError::invalid(prompt_param, e.to_string())
        }
        GenerateError::Rejected(add) => match add {
            AddError::ZeroMaxTokens { .. } => ApiError::invalid("max_tokens", add.to_string()),
            AddError::EmptyPrompt { .. }
            | AddError::PromptTooLong { .. }
            | AddError::TooLongForKvCache { .. }
            | AddError::PromptExceedsBatch { .. } => {
                ApiError::invalid(prompt_param, add.to_string())
            }
            AddError::DuplicateId { .. } => ApiError::internal(add.to_string()),
            AddError::KvTransfer { .. } => ApiError::invalid("kv_transfer_params", add.to_string()),
            // An adapter is named by the request's model, as in vLLM.
            AddError::Lora { .. } => ApiError::invalid("model", add.to_string()),
            // vLLM's answer to a model it does not serve: a 404.
            AddError::UnknownLora { .. } => ApiError::not_found(Some("model"), add.to_string()),
        },
    }
}

/// Adds up `usage` over a request's choices: each prompt counted once whatever `n`, cached
/// tokens as reported for each prompt's first choice; and each choice's own, for
/// `continuous_usage_stats` (vLLM counts a streamed chunk's usage per choice: its prompt and
/// its tokens so far).
#[derive(Debug, Clone)]
pub struct UsageTally {
    prompt_lens: Vec<usize>,
    n: usize,
    /// Per choice (`p * n + i`): its tokens so far, and its cached prompt tokens once it
    /// finished. The request's usage is their sum.
    per_choice: Vec<(usize, usize)>,
}

impl UsageTally {
    pub fn new(prompts: &[PreparedPrompt], n: u32) -> Self {
        Self {
            prompt_lens: prompts.iter().map(|p| p.tokens.len()).collect(),
            n: n as usize,
            per_choice: vec![(0, 0); prompts.len() * n as usize],
        }
    }

    pub fn add(&mut self, index: usize, token_ids: &[TokenId], finish: Option<&Finish>) {
        let Some(own) = self.per_choice.get_mut(index) else {
            return;
        };
        own.0 += token_ids.len();
        if let Some(f) = finish {
            own.1 = f.n_cached_tokens;
        }
    }

    /// Choice `index`'s own usage so far: its prompt, its tokens.
    pub fn choice_usage(&self, index: usize) -> Usage {
        let prompt = self
            .prompt_lens
            .get(index / self.n.max(1))
            .copied()
            .unwrap_or(0);
        let (tokens, cached) = self.per_choice.get(index).copied().unwrap_or((0, 0));
        Usage::new(prompt, tokens, cached)
    }

    /// The request's usage: every choice's tokens; each prompt and its cached tokens once
    /// (as its first choice reported them), whatever `n`.
    pub fn usage(&self) -> Usage {
        let tokens = self.per_choice.iter().map(|c| c.0).sum();
        let cached = self
            .per_choice
            .iter()
            .step_by(self.n.max(1))
            .map(|c| c.1)
            .sum();
        Usage::new(self.prompt_lens.iter().sum(), tokens, cached)
    }
}

/// A choice's `lora_versions`: the LoRA adapter versions its tokens were computed with;
/// `None` for the base model.
pub fn lora_versions(finish: Option<&Finish>) -> Option<Vec<u64>> {
    finish
        .map(|f| f.lora_versions.clone())
        .filter(|v| !v.is_empty())
}

/// A choice's `weight_versions`: the weight versions its tokens were computed with (see
/// `weight_versions`); empty for a stream that ended without a final chunk.
pub fn weight_versions(finish: Option<&Finish>) -> Vec<String> {
    finish
        .map(|f| f.weight_versions.clone())
        .unwrap_or_default()
}

/// A finish as the wire's `finish_reason` and `stop_reason`. A stream that ended without a
/// final chunk (the engine went away) reads as `abort`.
///
/// `stop_reason` is set, as vLLM sets it, only for a stop string or a hit of one of the
/// request's `stop_token_ids`: a model that stopped on its own EOS token has a `null`
/// `stop_reason` (the engine reports the EOS id, which is no stop the client asked for).
pub fn finish_fields(
    finish: Option<&Finish>,
    stop_token_ids: &[TokenId],
) -> (&'static str, Option<StopReasonJson>) {
    use ferry_engine::StopReason;
    match finish {
        None => ("abort", None),
        Some(f) => (
            f.reason.as_str(),
            f.stop_reason.as_ref().and_then(|r| match r {
                StopReason::Token(t) => stop_token_ids
                    .contains(t)
                    .then_some(StopReasonJson::Token(t.0)),
                StopReason::String(s) | StopReason::Constraint(s) => {
                    Some(StopReasonJson::Text(s.clone()))
                }
            }),
        ),
    }
}

/// A request's tokenized prompts and their parameters, as [`GenerationRoute::prepare`] reads
/// them.
pub type Prepared = (Vec<PreparedPrompt>, GenerationParams);

/// One generation request once parsed and validated: its prompts and parameters, and the
/// token texts its logprobs need.
#[derive(Debug, Clone, Copy)]
pub struct Generation<'a> {
    pub prompts: &'a [PreparedPrompt],
    pub params: &'a GenerationParams,
    pub texts: &'a TokenTexts,
}

/// What a generation route adds to [`handle`]: how it reads a request, and its wire format
/// (a streaming formatter and a whole response).
pub trait GenerationRoute {
    /// The request field that holds the prompt (`prompt` or `messages`), for engine refusals.
    const PROMPT_PARAM: &'static str;
    /// The fields vLLM's non-streamed response always carries ([`crate::response::fill_nulls`]).
    const ALWAYS_PRESENT: &'static crate::response::AlwaysPresent;
    /// Beam search may stream (each sequence whole, in one chunk): chat, as vLLM's; vLLM's
    /// completions refuse it.
    const STREAMS_BEAMS: bool;
    type Formatter: ChunkFormatter;
    type Response: Serialize;

    /// Parses and validates the request body into tokenized prompts and their parameters.
    fn prepare(app: &AppState, body: &Value) -> Result<Prepared, ApiError>;

    /// The streaming formatter, around the state every route's stream keeps.
    fn streaming(base: StreamBase, generation: Generation<'_>) -> Self::Formatter;

    /// The whole response once every choice is collected.
    fn full_response(
        head: Head,
        generation: Generation<'_>,
        collected: Vec<Collected>,
    ) -> Self::Response;
}

/// The handler of a generation route: prepares the request, starts its engine requests, then
/// streams `R`'s chunks or collects `R`'s whole response.
pub async fn handle<R: GenerationRoute>(
    State(app): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let (prompts, params) = R::prepare(&app, &body)?;
    if let Some(beam) = params.beam {
        return beam_search::<R>(&app, request_id, &prompts, &params, beam).await;
    }
    let (head, choices) = start(
        &app,
        request_id,
        &prompts,
        &params,
        R::PROMPT_PARAM,
        arrival,
    )
    .await?;
    let texts = app.texts.with_token_ids(params.tokens_as_ids);
    let generation = Generation {
        prompts: &prompts,
        params: &params,
        texts: &texts,
    };
    if params.stream {
        let base = StreamBase::new(head, &prompts, &params, texts.clone());
        let streams = choices.into_iter().map(ChoiceStream::into_stream);
        return Ok(sse_response(streams, R::streaming(base, generation)));
    }
    let collected = futures_util::future::join_all(choices.into_iter().map(|c| c.collect())).await;
    check_failed_choices(&collected)?;
    full_response::<R>(head, generation, collected)
}

/// The whole response, with every field vLLM's always carries.
fn full_response<R: GenerationRoute>(
    head: Head,
    generation: Generation<'_>,
    collected: Vec<Collected>,
) -> Result<Response, ApiError> {
    let response = R::full_response(head, generation, collected);
    // Through its text, not `to_value`: a value's numbers are f64, and an f32 logprob
    // widened would print as `-4.882621765136719` where its text says `-4.882622`. Parsed
    // back exactly (serde_json's `float_roundtrip`), each prints as the same shortest text.
    let mut json: Value = serde_json::to_string(&response)
        .and_then(|text| serde_json::from_str(&text))
        .map_err(|e| ApiError::internal(format!("serializing the response: {e}")))?;
    crate::response::fill_nulls(&mut json, R::ALWAYS_PRESENT);
    Ok(Json(json).into_response())
}

/// A `use_beam_search` request ([`crate::beam`]): the searches run to the end, then their
/// sequences are the route's choices, whole or (chat) streamed one chunk each.
async fn beam_search<R: GenerationRoute>(
    app: &AppState,
    request_id: String,
    prompts: &[PreparedPrompt],
    params: &GenerationParams,
    beam: crate::params::BeamParams,
) -> Result<Response, ApiError> {
    if params.stream && !R::STREAMS_BEAMS {
        // vLLM's words.
        return Err(ApiError::invalid(
            "stream",
            "Streaming is not currently supported with beam search",
        ));
    }
    if params.structured.is_some() {
        return Err(ApiError::invalid(
            "use_beam_search",
            "a structured-output constraint does not apply to beam search",
        ));
    }
    if params.kv_transfer_params.is_some() {
        return Err(ApiError::invalid(
            "kv_transfer_params",
            "a P/D transfer does not apply to beam search",
        ));
    }
    let searches: Vec<crate::beam::Search<'_>> = prompts
        .iter()
        .map(|p| crate::beam::Search {
            prompt: &p.tokens,
            sampling: &p.sampling,
        })
        .collect();
    let ranked = crate::beam::run(
        &app.engine,
        &request_id,
        &searches,
        beam.width,
        beam.length_penalty,
    )
    .await
    .map_err(|e| match e {
        crate::beam::SearchError::Generate(e) => generate_error(e, R::PROMPT_PARAM),
        crate::beam::SearchError::Ended(why) => ApiError::internal(why),
    })?;
    let tokenizer = app.engine.tokenizer();
    let mut collected = Vec::with_capacity(prompts.len() * beam.width);
    for (p, (prompt, ranked)) in prompts.iter().zip(ranked).enumerate() {
        for (rank, b) in ranked.beams.into_iter().enumerate() {
            let (token_ids, logprobs, text, reason, stop_reason) = crate::beam::choice_of(
                b,
                tokenizer,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
                prompt.sampling.sampler.logprobs,
            );
            collected.push(Collected {
                index: p * beam.width + rank,
                finish: Some(Finish {
                    reason,
                    stop_reason,
                    n_prompt_tokens: prompt.tokens.len(),
                    n_output_tokens: token_ids.len(),
                    n_cached_tokens: 0,
                    weight_versions: ranked.weight_versions.clone(),
                    lora_versions: Vec::new(),
                    export: None,
                    kv_transfer_params: None,
                    message: None,
                    routing: None,
                }),
                token_ids,
                logprobs,
                text,
                ..Collected::default()
            });
        }
    }
    let head = Head {
        id: request_id,
        created: unix_now(),
        model: app.config.served_model_name.clone(),
    };
    let texts = app.texts.with_token_ids(params.tokens_as_ids);
    let generation = Generation {
        prompts,
        params,
        texts: &texts,
    };
    if params.stream {
        let base = StreamBase::new(head, prompts, params, texts.clone());
        let streams = collected.into_iter().map(|c| {
            let chunk = OutputChunk {
                token_ids: c.token_ids,
                logprobs: c.logprobs,
                text: c.text,
                forced: c.forced,
                prompt_logprobs: c.prompt_logprobs,
                finish: c.finish,
            };
            stream::iter([(c.index, chunk)]).boxed()
        });
        return Ok(sse_response(streams, R::streaming(base, generation)));
    }
    full_response::<R>(head, generation, collected)
}

/// Starts a prepared request on the engine: checks its P/D transfer (and where a load would
/// connect), compiles its structured-output constraint, and launches its choices. Every
/// generation route goes through here (the OpenAI routes through [`handle`], SGLang's and
/// vLLM's native routes through [`crate::native`]), so they share one path to the engine.
pub async fn start(
    app: &AppState,
    request_id: String,
    prompts: &[PreparedPrompt],
    params: &GenerationParams,
    prompt_param: &'static str,
    arrival: Instant,
) -> Result<(Head, Vec<ChoiceStream>), ApiError> {
    let transfer = params
        .kv_transfer_params
        .clone()
        .map(|p| {
            let limits = TransferLimits {
                kv_connector: app.config.kv_connector,
                max_model_len: app.limits.max_model_len,
            };
            p.check(limits, prompts.len())
        })
        .transpose()?
        .flatten();
    // Where a load would connect: refused here unless it is an allowed KV peer, before any
    // connection (only a server with a P/D connector takes a load at all).
    let transfer = match transfer {
        Some(t) if app.config.kv_connector => {
            Some(check_remote_host(t, &app.config.kv_allowed_peers).await?)
        }
        other => other,
    };
    for (param, output) in &params.schema_checks {
        let spec = StructuredSpec {
            output: output.clone(),
            param: "tools",
        };
        compile(&app.engine, spec).await.map_err(|mut e| {
            e.message = e.message.replace("`tools`", &format!("`{param}`"));
            e.param = Some(param.clone());
            e
        })?;
    }
    let constraint = match params.structured.clone() {
        Some(spec) => Some(compile(&app.engine, spec).await?),
        None => None,
    };
    let spec = LaunchSpec {
        request_id: &request_id,
        n: params.n,
        stop: &params.stop,
        prompt_param,
        arrival,
        transfer: transfer.as_ref(),
        constraint: constraint.as_ref(),
        keep_special_tokens: !params.skip_special_tokens,
        include_stop_str_in_output: params.include_stop_str_in_output,
        lora: params.lora.clone(),
    };
    let recorders = Recorders {
        metrics: &app.metrics,
        live: &app.live,
    };
    let choices = launch(&app.engine, recorders, prompts, &spec).await?;
    let head = Head {
        id: request_id,
        created: unix_now(),
        model: app.model_name(params.lora.as_deref()),
    };
    Ok((head, choices))
}

impl Generation<'_> {
    /// Maps every collected choice through `choice` (given its `finish_reason` and
    /// `stop_reason`), adding up the request's usage on the way.
    pub fn collect_choices<C>(
        self,
        collected: Vec<Collected>,
        mut choice: impl FnMut(Collected, &'static str, Option<StopReasonJson>) -> C,
    ) -> (Vec<C>, Usage) {
        let mut usage = UsageTally::new(self.prompts, self.params.n);
        let choices = collected
            .into_iter()
            .map(|c| {
                usage.add(c.index, &c.token_ids, c.finish.as_ref());
                let (finish_reason, stop_reason) =
                    finish_fields(c.finish.as_ref(), &self.params.sampling.stop_token_ids);
                choice(c, finish_reason, stop_reason)
            })
            .collect();
        (choices, usage.usage())
    }
}

/// A streamed chunk's finish fields: set only on a choice's last chunk.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChunkFinish {
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReasonJson>,
    /// The weight versions the choice's tokens were computed with.
    pub weight_versions: Option<Vec<String>>,
    /// The LoRA adapter versions they were computed with (under an adapter).
    pub lora_versions: Option<Vec<u64>>,
    /// P's transfer parameters, for the chunk's `kv_transfer_params`.
    pub kv_transfer_params: Option<KvTransferParamsJson>,
    /// An explained `error` finish: the error event that follows the chunk.
    pub error: Option<String>,
}

/// What every route's streaming formatter keeps: the head, the output options, the token
/// texts and the usage so far.
#[derive(Debug, Clone)]
pub struct StreamBase {
    pub head: Head,
    pub logprobs: bool,
    pub return_token_ids: bool,
    /// The request has a structured-output constraint (chunks carry `forced_tokens`).
    pub constrained: bool,
    pub texts: TokenTexts,
    include_usage: bool,
    /// Every chunk carries the usage so far (`continuous_usage_stats`).
    continuous_usage: bool,
    usage: UsageTally,
    /// The request's `stop_token_ids` (see [`finish_fields`]).
    stop_token_ids: Vec<TokenId>,
}

impl StreamBase {
    pub fn new(
        head: Head,
        prompts: &[PreparedPrompt],
        params: &GenerationParams,
        texts: TokenTexts,
    ) -> Self {
        Self {
            head,
            logprobs: params.sampling.sampler.logprobs.is_some(),
            return_token_ids: params.return_token_ids,
            constrained: params.structured.is_some(),
            texts,
            include_usage: params.include_usage,
            continuous_usage: params.continuous_usage,
            usage: UsageTally::new(prompts, params.n),
            stop_token_ids: params.sampling.stop_token_ids.clone(),
        }
    }

    /// Counts choice `index`'s chunk into the usage; returns the chunk's finish fields (all
    /// absent but on a choice's last chunk).
    pub fn observe(&mut self, index: usize, chunk: &OutputChunk) -> ChunkFinish {
        self.usage
            .add(index, &chunk.token_ids, chunk.finish.as_ref());
        match &chunk.finish {
            Some(f) => {
                let (reason, stop_reason) = finish_fields(Some(f), &self.stop_token_ids);
                ChunkFinish {
                    finish_reason: Some(reason),
                    stop_reason,
                    weight_versions: Some(f.weight_versions.clone()),
                    lora_versions: lora_versions(Some(f)),
                    kv_transfer_params: f.kv_transfer_params.as_ref().map(Into::into),
                    error: failure(index, f).map(|e| to_json(&e.body())),
                }
            }
            None => ChunkFinish::default(),
        }
    }

    /// The usage for the stream's last chunk, if the client asked for it.
    pub fn final_usage(&self) -> Option<Usage> {
        self.include_usage.then(|| self.usage.usage())
    }

    /// Choice `index`'s usage so far, for its chunk, if the client asked for it on every
    /// chunk (vLLM's `continuous_usage_stats`: per choice, the role chunk too); read after
    /// [`StreamBase::observe`].
    pub fn chunk_usage(&self, index: usize) -> Option<Usage> {
        self.continuous_usage
            .then(|| self.usage.choice_usage(index))
    }
}
