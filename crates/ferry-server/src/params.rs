//! Validation: turns the wire fields into engine parameters, refusing every bad value with a
//! 400 naming its field *before* anything reaches the engine.

use ferry_engine::{LogitsParams, SamplerSpec, SamplingParams, TokenId};

use crate::error::ApiError;
use crate::kv_transfer::KvTransferParamsJson;
use crate::request::CommonParams;
use crate::structured::StructuredSpec;

/// Limits that come from the model and the server's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Longest sequence (prompt + output).
    pub max_model_len: usize,
    /// Largest accepted `logprobs` (completions) / `top_logprobs` (chat).
    pub max_top_logprobs: u32,
    /// Largest accepted `n`.
    pub max_n: u32,
    /// Token ids must be below this (None: unchecked).
    pub vocab_size: Option<usize>,
    /// Most stop strings per request.
    pub max_stop_strings: usize,
    /// Most prompts in one batched completions request.
    pub max_batch_prompts: usize,
}

/// Everything a generation route needs besides the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationParams {
    /// `max_tokens` is a placeholder until [`GenerationParams::for_prompt`] resolves it.
    pub sampling: SamplingParams,
    /// The requested output length, and the field it came from (for error messages).
    pub max_tokens: Option<(u32, &'static str)>,
    pub stop: Vec<String>,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// As sent; checked against the batch in [`crate::generate::handle`].
    pub kv_transfer_params: Option<KvTransferParamsJson>,
    /// The structured-output constraint, if any; compiled in [`crate::generate::handle`].
    pub structured: Option<StructuredSpec>,
    /// `max_tokens` when the request has none: `None` is the rest of the context (chat),
    /// completions set 16 (vLLM's and OpenAI's legacy completions default), capped there too.
    pub default_max_tokens: Option<u32>,
    /// With `include_usage`, every streamed chunk carries the usage so far.
    pub continuous_usage: bool,
    /// A matched stop string (or stop token's text) stays in the text.
    pub include_stop_str_in_output: bool,
    /// Special tokens are left out of the text (vLLM's default).
    pub skip_special_tokens: bool,
    /// Logprobs name tokens `token:<id>`.
    pub tokens_as_ids: bool,
    /// Keep only this many of the prompt's tokens: its last, or with `keep_first` its first.
    pub truncate_prompt_tokens: Option<usize>,
    /// `truncation_side: "right"`.
    pub keep_first: bool,
    /// `use_beam_search`: the beam width (`n`) and length penalty.
    pub beam: Option<BeamParams>,
    /// Chat with `--reasoning-parser`: how the answer splits into reasoning and content.
    pub reasoning: Option<crate::reasoning::Reasoning>,
    /// Chat with tools: how the answer's calls are read.
    pub tools: Option<crate::tools::ToolOutput>,
    /// Schemas that must compile though nothing holds the output to them (a tool's
    /// `parameters` under `tool_choice: "auto"`), each with its field.
    pub schema_checks: Vec<(String, ferry_engine::StructuredOutput)>,
    /// Completions' `echo`: each prompt's text, to put before its choices' text.
    pub echo: Option<Vec<String>>,
    /// The first row of `routed_experts` (vLLM's `routed_experts_prompt_start`): at most
    /// each prompt's length ([`GenerationParams::for_prompt`] checks it).
    pub routed_experts_prompt_start: usize,
    /// The LoRA adapter the request's `model` names (`None`: the base model); set by the
    /// route from [`crate::state::AppState::resolve_model`].
    pub lora: Option<std::sync::Arc<str>>,
}

/// Temperatures above this are refused (OpenAI's documented range is [0, 2]).
const MAX_TEMPERATURE: f64 = 2.0;

impl GenerationParams {
    /// Runs the request under the LoRA adapter `lora` names (`None`: the base). Beam search
    /// runs its beams as base-model requests, so it is refused under an adapter.
    pub fn set_lora(&mut self, lora: Option<std::sync::Arc<str>>) -> Result<(), ApiError> {
        if let (Some(name), Some(_)) = (&lora, &self.beam) {
            return Err(ApiError::invalid(
                "use_beam_search",
                format!("beam search is not supported under a LoRA adapter (`{name}`)"),
            ));
        }
        self.lora = lora;
        Ok(())
    }

    /// Validates the fields both routes share. `max_tokens` is the output-length field and its
    /// name (`max_tokens` or chat's `max_completion_tokens`); `logprobs` the validated top-n.
    pub fn from_common(
        common: &CommonParams,
        max_tokens: (Option<i64>, &'static str),
        logprobs: Option<u32>,
        limits: &Limits,
    ) -> Result<Self, ApiError> {
        let n = check_n(common.n, limits)?;
        let sampling = SamplingParams {
            max_tokens: 1,
            sampler: SamplerSpec {
                temperature: check_temperature(common.temperature)? as f32,
                top_k: check_top_k(common.top_k)?,
                top_p: check_unit("top_p", common.top_p, 1.0, false)? as f32,
                min_p: check_unit("min_p", common.min_p, 0.0, true)? as f32,
                // Negative seeds are valid in OpenAI's API; two's complement keeps them
                // distinct.
                seed: check_seed(common.seed.as_ref())?.map(|s| s as u64),
                seed_stream: 0,
                logprobs,
            },
            ignore_eos: common.ignore_eos.unwrap_or(false),
            stop_token_ids: check_token_ids(
                "stop_token_ids",
                common.stop_token_ids.as_deref().unwrap_or(&[]),
                limits,
            )?,
            cache_salt: check_cache_salt(common.cache_salt.as_deref())?,
            logits: check_logits(common, limits)?,
            prompt_logprobs: common
                .prompt_logprobs
                .map(|v| check_top_n("prompt_logprobs", v, limits))
                .transpose()?,
            lora: None,
        };
        let stop = check_stop(common.stop.clone().map(|s| s.into_vec()), limits)?;
        let max_tokens = match max_tokens.0 {
            None => None,
            Some(v) if v < 1 => {
                return Err(ApiError::invalid(
                    max_tokens.1,
                    format!("`{}` must be at least 1, got {v}", max_tokens.1),
                ))
            }
            Some(v) => Some((u32::try_from(v).unwrap_or(u32::MAX), max_tokens.1)),
        };
        let stream = common.stream.unwrap_or(false);
        let options = common.stream_options.clone().unwrap_or_default();
        if common.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` can only be set when `stream` is true",
            ));
        }
        let include_usage = stream && options.include_usage.unwrap_or(false);
        Ok(Self {
            sampling,
            max_tokens,
            stop,
            n,
            stream,
            include_usage,
            return_token_ids: common.return_token_ids.unwrap_or(false),
            kv_transfer_params: common.kv_transfer_params.clone(),
            structured: None,
            default_max_tokens: None,
            continuous_usage: include_usage && options.continuous_usage_stats.unwrap_or(false),
            include_stop_str_in_output: common.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: common.skip_special_tokens.unwrap_or(true),
            tokens_as_ids: common.return_tokens_as_token_ids.unwrap_or(false),
            truncate_prompt_tokens: check_truncate(common.truncate_prompt_tokens, limits)?,
            keep_first: check_truncation_side(common.truncation_side.as_deref())?,
            beam: check_beam(common, n)?,
            reasoning: None,
            tools: None,
            schema_checks: Vec::new(),
            echo: None,
            routed_experts_prompt_start: check_routed_experts_prompt_start(
                common.routed_experts_prompt_start,
            )?,
            lora: None,
        })
    }

    /// `prompt` cut to `truncate_prompt_tokens` tokens, if the request asks for it: its last
    /// ones, or its first with `truncation_side: "right"`.
    pub fn truncate(&self, mut prompt: Vec<TokenId>) -> Vec<TokenId> {
        if let Some(keep) = self.truncate_prompt_tokens {
            if self.keep_first {
                prompt.truncate(keep);
            } else {
                let cut = prompt.len().saturating_sub(keep);
                prompt.drain(..cut);
            }
        }
        prompt
    }

    /// The sampling parameters for one prompt of `prompt_len` tokens: `max_tokens` defaults to
    /// what fits in the context; a request that cannot fit is refused.
    pub fn for_prompt(
        &self,
        prompt_len: usize,
        limits: &Limits,
    ) -> Result<SamplingParams, ApiError> {
        let room = limits.max_model_len.saturating_sub(prompt_len);
        let max_tokens = match self.max_tokens {
            None => self
                .default_max_tokens
                .map_or(room, |d| room.min(d as usize)),
            Some((v, field)) if v as usize > room => {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "this model's maximum context length is {} tokens; the prompt has {prompt_len} and `{field}` asks for {v} more",
                        limits.max_model_len
                    ),
                ))
            }
            Some((v, _)) => v as usize,
        };
        if self.routed_experts_prompt_start > prompt_len {
            // vLLM's words (`v1/engine/input_processor.py`).
            return Err(ApiError::invalid(
                ROUTED_EXPERTS_PROMPT_START,
                format!(
                    "routed_experts_prompt_start must be between 0 and the prompt length \
                     ({prompt_len}), inclusive."
                ),
            ));
        }
        let min_tokens = self.sampling.logits.min_tokens;
        if min_tokens as usize > max_tokens {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("`min_tokens` ({min_tokens}) must not exceed `max_tokens` ({max_tokens})"),
            ));
        }
        Ok(SamplingParams {
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            ..self.sampling.clone()
        })
    }
}

const ROUTED_EXPERTS_PROMPT_START: &str = "routed_experts_prompt_start";

/// `routed_experts_prompt_start`: not below 0 (vLLM's field is `ge=0`); the prompt's length
/// bounds it from above ([`GenerationParams::for_prompt`]).
fn check_routed_experts_prompt_start(v: Option<i64>) -> Result<usize, ApiError> {
    match v.unwrap_or(0) {
        v if v < 0 => Err(ApiError::invalid(
            ROUTED_EXPERTS_PROMPT_START,
            format!("`{ROUTED_EXPERTS_PROMPT_START}` must be at least 0, got {v}"),
        )),
        v => Ok(usize::try_from(v).unwrap_or(usize::MAX)),
    }
}

/// A prompt's token ids are usable: not empty, shorter than the context (one token must fit
/// after it), and every id inside the vocabulary.
pub fn check_prompt(tokens: &[TokenId], param: &str, limits: &Limits) -> Result<(), ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::invalid(param, format!("`{param}` is empty")));
    }
    if tokens.len() >= limits.max_model_len {
        return Err(ApiError::invalid(
            param,
            format!(
                "`{param}` has {} tokens; this model's maximum context length is {} tokens (the prompt must leave room for one generated token)",
                tokens.len(),
                limits.max_model_len
            ),
        ));
    }
    check_token_ids(param, tokens, limits).map(drop)
}

/// Completions' `logprobs` (an integer top-n).
pub fn check_completion_logprobs(v: Option<i64>, limits: &Limits) -> Result<Option<u32>, ApiError> {
    v.map(|v| check_top_n("logprobs", v, limits)).transpose()
}

/// Chat's `logprobs` (bool) and `top_logprobs` (top-n, only with `logprobs`).
pub fn check_chat_logprobs(
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    limits: &Limits,
) -> Result<Option<u32>, ApiError> {
    match (logprobs.unwrap_or(false), top_logprobs) {
        (false, Some(t)) if t > 0 => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        )),
        (false, _) => Ok(None),
        (true, t) => check_top_n("top_logprobs", t.unwrap_or(0), limits).map(Some),
    }
}

fn check_top_n(field: &str, v: i64, limits: &Limits) -> Result<u32, ApiError> {
    if v < 0 || v > i64::from(limits.max_top_logprobs) {
        return Err(ApiError::invalid(
            field,
            format!(
                "`{field}` must be between 0 and {}, got {v}",
                limits.max_top_logprobs
            ),
        ));
    }
    Ok(v as u32)
}

fn check_n(n: Option<i64>, limits: &Limits) -> Result<u32, ApiError> {
    let n = n.unwrap_or(1);
    if n < 1 || n > i64::from(limits.max_n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {}, got {n}", limits.max_n),
        ));
    }
    Ok(n as u32)
}

fn check_temperature(t: Option<f64>) -> Result<f64, ApiError> {
    let t = t.unwrap_or(1.0);
    if !(0.0..=MAX_TEMPERATURE).contains(&t) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` must be between 0 and {MAX_TEMPERATURE}, got {t}"),
        ));
    }
    Ok(t)
}

/// `top_k`: `0` or `-1` disable it (vLLM uses `-1`).
fn check_top_k(k: Option<i64>) -> Result<u32, ApiError> {
    match k.unwrap_or(0) {
        -1 | 0 => Ok(0),
        k if k >= 1 && k <= i64::from(u32::MAX) => Ok(k as u32),
        k => Err(ApiError::invalid(
            "top_k",
            format!("`top_k` must be -1 or 0 (disabled) or at least 1, got {k}"),
        )),
    }
}

/// A probability field in `(0, 1]`, or `[0, 1]` when `zero_ok`.
fn check_unit(field: &str, v: Option<f64>, default: f64, zero_ok: bool) -> Result<f64, ApiError> {
    let v = v.unwrap_or(default);
    let low_ok = if zero_ok { v >= 0.0 } else { v > 0.0 };
    if !low_ok || v > 1.0 {
        let range = if zero_ok { "[0, 1]" } else { "(0, 1]" };
        return Err(ApiError::invalid(
            field,
            format!("`{field}` must be in {range}, got {v}"),
        ));
    }
    Ok(v)
}

/// A token id the model does not have, worded as vLLM words it ("Token id N is out of
/// vocabulary"; clients match those words), with the vocabulary's size after them.
pub(crate) fn out_of_vocabulary(id: TokenId, vocab: usize) -> String {
    format!("Token id {id} is out of vocabulary: the model's vocabulary has {vocab} tokens")
}

fn check_token_ids(
    field: &str,
    ids: &[TokenId],
    limits: &Limits,
) -> Result<Vec<TokenId>, ApiError> {
    if let Some(vocab) = limits.vocab_size {
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id.index() >= vocab) {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                out_of_vocabulary(*id, vocab),
            ));
        }
    }
    Ok(ids.to_vec())
}

/// vLLM's range of `presence_penalty` and `frequency_penalty`.
const MAX_PENALTY: f64 = 2.0;

/// vLLM's range of a `logit_bias` value: larger ones are clamped to it.
const MAX_LOGIT_BIAS: f64 = 100.0;

/// The penalties, `logit_bias` and `min_tokens`, with vLLM's ranges.
fn check_logits(common: &CommonParams, limits: &Limits) -> Result<LogitsParams, ApiError> {
    let penalty = |field: &str, v: Option<f64>| -> Result<f32, ApiError> {
        let v = v.unwrap_or(0.0);
        if !(-MAX_PENALTY..=MAX_PENALTY).contains(&v) {
            return Err(ApiError::invalid(
                field,
                format!("`{field}` must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}"),
            ));
        }
        Ok(v as f32)
    };
    let repetition = common.repetition_penalty.unwrap_or(1.0);
    if !(repetition > 0.0 && repetition.is_finite()) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("`repetition_penalty` must be a positive number, got {repetition}"),
        ));
    }
    let min_tokens = match common.min_tokens.unwrap_or(0) {
        m if m < 0 => {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("`min_tokens` must be at least 0, got {m}"),
            ))
        }
        m => u32::try_from(m).unwrap_or(u32::MAX),
    };
    let mut logit_bias = Vec::new();
    for (key, value) in common.logit_bias.iter().flatten() {
        let field = format!("logit_bias.{key}");
        let token = key.parse().map(TokenId).map_err(|_| {
            ApiError::invalid(
                field.clone(),
                format!("`logit_bias` keys are token ids, got `{key}`"),
            )
        })?;
        if let Some(vocab) = limits.vocab_size.filter(|&v| token.index() >= v) {
            return Err(ApiError::invalid(field, out_of_vocabulary(token, vocab)));
        }
        let bias = value.as_f64().filter(|b| b.is_finite()).ok_or_else(|| {
            ApiError::invalid(
                field.clone(),
                format!("`logit_bias` values are numbers, got {value}"),
            )
        })?;
        logit_bias.push((token, bias.clamp(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) as f32));
    }
    Ok(LogitsParams {
        presence_penalty: penalty("presence_penalty", common.presence_penalty)?,
        frequency_penalty: penalty("frequency_penalty", common.frequency_penalty)?,
        repetition_penalty: repetition as f32,
        logit_bias,
        min_tokens,
    })
}

/// `seed`: a signed 64-bit integer, as vLLM bounds it; outside, the bound it breaks in the
/// words of vLLM's validation (`greater_than_equal`, `less_than_equal`), which clients match.
fn check_seed(seed: Option<&serde_json::Number>) -> Result<Option<i64>, ApiError> {
    let Some(seed) = seed else {
        return Ok(None);
    };
    if let Some(s) = seed.as_i64() {
        return Ok(Some(s));
    }
    // Past i64: a u64 above its maximum, or a float (JSON has no other big numbers).
    let value = seed.as_f64().unwrap_or(f64::INFINITY);
    if value.fract() != 0.0 {
        return Err(ApiError::invalid(
            "seed",
            format!("`seed` should be an integer, got {seed}"),
        ));
    }
    let (kind, relation, bound) = if value < 0.0 {
        ("greater_than_equal", "greater than or equal to", i64::MIN)
    } else {
        ("less_than_equal", "less than or equal to", i64::MAX)
    };
    Err(ApiError::invalid(
        "seed",
        format!("{kind}: `seed` should be {relation} {bound}, got {seed}"),
    ))
}

/// A beam search's parameters (`use_beam_search`, [`crate::beam`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamParams {
    /// The beam width: the request's `n`.
    pub width: usize,
    pub length_penalty: f64,
}

/// `use_beam_search` with its `length_penalty` (finite; default 1): the beam width is `n`.
/// `length_penalty` without beam search means nothing, as in vLLM, and is ignored.
fn check_beam(common: &CommonParams, n: u32) -> Result<Option<BeamParams>, ApiError> {
    if common.use_beam_search != Some(true) {
        return Ok(None);
    }
    let length_penalty = common.length_penalty.unwrap_or(1.0);
    if !length_penalty.is_finite() {
        return Err(ApiError::invalid(
            "length_penalty",
            format!("`length_penalty` must be a finite number, got {length_penalty}"),
        ));
    }
    Ok(Some(BeamParams {
        width: n as usize,
        length_penalty,
    }))
}

/// `truncation_side`: `"left"` (the default: keep the last tokens) or `"right"` (keep the
/// first). True for `"right"`.
fn check_truncation_side(side: Option<&str>) -> Result<bool, ApiError> {
    match side {
        None | Some("left") => Ok(false),
        Some("right") => Ok(true),
        Some(other) => Err(ApiError::invalid(
            "truncation_side",
            format!("`truncation_side` must be \"left\" or \"right\", got {other:?}"),
        )),
    }
}

/// `truncate_prompt_tokens`: at least 1, at most the model's length; `-1` is that length less
/// one, as vLLM has it for generation (room for one output token).
fn check_truncate(v: Option<i64>, limits: &Limits) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(-1) => Ok(Some(limits.max_model_len.saturating_sub(1).max(1))),
        Some(k) if k >= 1 && k as u64 <= limits.max_model_len as u64 => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!(
                "`truncate_prompt_tokens` must be -1 or between 1 and {}, got {k}",
                limits.max_model_len
            ),
        )),
    }
}

fn check_cache_salt(salt: Option<&str>) -> Result<Option<String>, ApiError> {
    match salt {
        Some("") => Err(ApiError::invalid(
            "cache_salt",
            "`cache_salt` must not be empty",
        )),
        other => Ok(other.map(str::to_owned)),
    }
}

fn check_stop(stop: Option<Vec<String>>, limits: &Limits) -> Result<Vec<String>, ApiError> {
    let stop = stop.unwrap_or_default();
    if stop.len() > limits.max_stop_strings {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {} stop strings are accepted, got {}",
                limits.max_stop_strings,
                stop.len()
            ),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            format!("stop[{i}]"),
            "stop strings must not be empty",
        ));
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::parse_json;

    fn limits() -> Limits {
        Limits {
            max_model_len: 100,
            max_top_logprobs: 20,
            max_n: 8,
            vocab_size: Some(50),
            max_stop_strings: 4,
            max_batch_prompts: 8,
        }
    }

    fn parse(body: &str) -> Result<GenerationParams, ApiError> {
        let c: CommonParams = parse_json(body.as_bytes()).unwrap();
        GenerationParams::from_common(&c, (c.max_tokens, "max_tokens"), None, &limits())
    }

    fn field(body: &str) -> String {
        parse(body).unwrap_err().param.unwrap()
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        assert_eq!(field(r#"{"max_tokens": 0}"#), "max_tokens");
        assert_eq!(field(r#"{"max_tokens": -5}"#), "max_tokens");
        assert_eq!(field(r#"{"temperature": -0.1}"#), "temperature");
        assert_eq!(field(r#"{"temperature": 2.5}"#), "temperature");
        assert_eq!(field(r#"{"top_p": 0}"#), "top_p");
        assert_eq!(field(r#"{"top_p": 1.5}"#), "top_p");
        assert_eq!(field(r#"{"top_k": -2}"#), "top_k");
        assert_eq!(field(r#"{"min_p": 2}"#), "min_p");
        assert_eq!(field(r#"{"n": 0}"#), "n");
        assert_eq!(field(r#"{"n": 9}"#), "n");
        assert_eq!(field(r#"{"stop": ["a", ""]}"#), "stop[1]");
        assert_eq!(field(r#"{"stop": ["a", "b", "c", "d", "e"]}"#), "stop");
        assert_eq!(field(r#"{"stop_token_ids": [1, 50]}"#), "stop_token_ids[1]");
        assert_eq!(field(r#"{"cache_salt": ""}"#), "cache_salt");
    }

    #[test]
    fn defaults_and_conversions() {
        let p = parse(r#"{"top_k": -1, "seed": -1, "stop": "x", "stream": true, "stream_options": {"include_usage": true}}"#).unwrap();
        assert_eq!(p.sampling.sampler.top_k, 0);
        assert_eq!(p.sampling.sampler.seed, Some(u64::MAX));
        assert_eq!(p.sampling.sampler.temperature, 1.0);
        assert_eq!(p.stop, vec!["x".to_owned()]);
        assert!(p.include_usage);
        assert_eq!(p.n, 1);
        assert!(!p.sampling.ignore_eos);
        assert!(!p.return_token_ids);
        let p = parse(r#"{"ignore_eos": true, "stop_token_ids": [3, 4], "min_p": 0.1, "cache_salt": "s", "return_token_ids": true}"#).unwrap();
        assert!(p.sampling.ignore_eos);
        assert!(p.return_token_ids);
        assert_eq!(p.sampling.stop_token_ids, TokenId::list([3, 4]));
        assert_eq!(p.sampling.sampler.min_p, 0.1);
        assert_eq!(p.sampling.cache_salt.as_deref(), Some("s"));
        // stream_options only go with a stream (vLLM refuses them otherwise).
        assert_eq!(
            field(r#"{"stream_options": {"include_usage": true}}"#),
            "stream_options"
        );
    }

    #[test]
    fn routed_experts_prompt_start_is_bounded_by_zero_and_the_prompt() {
        let err = parse(r#"{"routed_experts_prompt_start": -1}"#).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("routed_experts_prompt_start"));
        let p = parse(r#"{"routed_experts_prompt_start": 30}"#).unwrap();
        assert_eq!(p.routed_experts_prompt_start, 30);
        assert!(p.for_prompt(30, &limits()).is_ok());
        let err = p.for_prompt(29, &limits()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("routed_experts_prompt_start"));
        assert!(
            err.message.contains("the prompt length (29)"),
            "{}",
            err.message
        );
    }

    #[test]
    fn max_tokens_defaults_to_the_room_left_and_refuses_overflow() {
        let p = parse("{}").unwrap();
        assert_eq!(p.for_prompt(30, &limits()).unwrap().max_tokens, 70);
        let p = parse(r#"{"max_tokens": 71}"#).unwrap();
        assert_eq!(
            p.for_prompt(30, &limits()).unwrap_err().param.as_deref(),
            Some("max_tokens")
        );
        assert_eq!(p.for_prompt(29, &limits()).unwrap().max_tokens, 71);
        let p = parse(r#"{"max_tokens": 99999999999}"#).unwrap();
        assert!(p.for_prompt(1, &limits()).is_err());
    }

    #[test]
    fn prompts_are_checked() {
        let l = limits();
        assert_eq!(
            check_prompt(&[], "prompt", &l)
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt")
        );
        assert!(check_prompt(&TokenId::list([1; 99]), "prompt", &l).is_ok());
        assert!(check_prompt(&TokenId::list([1; 100]), "prompt", &l).is_err());
        assert_eq!(
            check_prompt(&TokenId::list([1, 60]), "prompt", &l)
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt[1]")
        );
    }

    #[test]
    fn logprob_fields() {
        let l = limits();
        assert_eq!(check_completion_logprobs(Some(5), &l).unwrap(), Some(5));
        assert_eq!(
            check_completion_logprobs(Some(21), &l)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
        assert_eq!(
            check_completion_logprobs(Some(-1), &l)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
        assert_eq!(check_chat_logprobs(Some(true), None, &l).unwrap(), Some(0));
        assert_eq!(
            check_chat_logprobs(Some(true), Some(3), &l).unwrap(),
            Some(3)
        );
        assert_eq!(check_chat_logprobs(None, None, &l).unwrap(), None);
        assert_eq!(
            check_chat_logprobs(None, Some(2), &l)
                .unwrap_err()
                .param
                .as_deref(),
            Some("top_logprobs")
        );
        assert_eq!(
            check_chat_logprobs(Some(true), Some(30), &l)
                .unwrap_err()
                .param
                .as_deref(),
            Some("top_logprobs")
        );
    }
}
