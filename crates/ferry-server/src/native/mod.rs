//! The RL frameworks' native generate routes: SGLang's `POST /generate` ([`sglang`]; slime,
//! miles, AReaL, NeMo-RL) and vLLM's token-in/token-out `POST /inference/v1/generate`
//! ([`vllm`]; prime-rl, SkyRL), with SGLang's discovery routes ([`discovery`]).
//!
//! The key decision: neither route has sampling, stopping or logprobs of its own. Each turns
//! its request into the `/v1/completions` request that asks for the same thing (a token-id
//! prompt, the sampling fields under their completions names: `max_new_tokens` is
//! `max_tokens`, `sampling_seed` is `seed`, `no_stop_trim` is `include_stop_str_in_output`,
//! ...), which the completions route's own parsing and validation read ([`as_completions`]).
//! The engine requests then start through [`crate::generate::start`], as a completion's do,
//! and only the answer is rendered in the framework's shape. So a sampling field the server
//! learns is learned by every route at once, and a field it refuses is refused here with the
//! same 400 (its `param` renamed to where the field sat in this request).

pub mod discovery;
pub mod sglang;
pub mod vllm;

use ferry_engine::TokenId;
use serde_json::{Map, Value};

use crate::completions::Completions;
use crate::error::ApiError;
use crate::generate::{GenerationRoute, Prepared};
use crate::response::finite_logprob;
use crate::state::AppState;

/// Prepares one completions request per prompt (`bodies`: completions JSON objects with a
/// token-id `prompt` each) and joins them as one request of several prompts: their
/// parameters are the same but for `max_tokens`, which each prompt carries in its own
/// sampling parameters. `rename` maps a completions field name in an error about prompt `i`
/// to the name the native request used.
pub fn as_completions(
    app: &AppState,
    bodies: Vec<Map<String, Value>>,
    rename: impl Fn(usize, &str) -> String,
) -> Result<Prepared, ApiError> {
    let mut prompts = Vec::with_capacity(bodies.len());
    let mut params = None;
    for (i, body) in bodies.into_iter().enumerate() {
        let (mut p, this) = Completions::prepare(app, &Value::Object(body)).map_err(|mut e| {
            e.param = e.param.as_deref().map(|p| rename(i, p));
            e
        })?;
        prompts.append(&mut p);
        params.get_or_insert(this);
    }
    let params = params.ok_or_else(|| ApiError::bad_request("the request has no prompt"))?;
    Ok((prompts, params))
}

/// The room a prompt of `prompt_len` tokens leaves in the context (at least 1, so that a
/// prompt too long for the context is refused by the completions checks, naming the prompt).
pub fn room(app: &AppState, prompt_len: usize) -> u64 {
    app.limits.max_model_len.saturating_sub(prompt_len).max(1) as u64
}

/// A logprob as JSON, written as the OpenAI routes write it: the shortest decimal that reads
/// back as the same `f32` (`json!` of an `f32` widens it to `f64` and prints that
/// widening's digits), so the same logprob is the same number on every route. Non-finite
/// values are clamped as everywhere ([`finite_logprob`]).
pub fn logprob_json(v: f32) -> Value {
    let v = finite_logprob(v);
    let shortest: f64 = v.to_string().parse().unwrap_or(f64::from(v));
    serde_json::Number::from_f64(shortest).map_or(Value::Null, Value::Number)
}

/// A JSON value as a list of token ids, or `None` when it is not one.
pub fn token_ids(v: &Value) -> Option<Vec<TokenId>> {
    v.as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).map(TokenId))
        .collect()
}

/// A request body's JSON object, or a 400 saying it must be one.
pub fn object(body: Value) -> Result<Map<String, Value>, ApiError> {
    match body {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
    }
}

/// The value of `key`, with JSON `null` read as absent.
pub fn get<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

/// A 400 for each of `keys` that `map` sets to something other than `null`, `false` or an
/// empty list or object: fields of the native request that ferry does not implement.
pub fn refuse_set(map: &Map<String, Value>, keys: &[&str], prefix: &str) -> Result<(), ApiError> {
    for key in keys {
        let set = match map.get(*key) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
        };
        if set {
            let param = format!("{prefix}{key}");
            return Err(ApiError::invalid(
                param.clone(),
                format!("`{param}` is not supported by this server"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn logprobs_are_written_as_the_openai_routes_write_them() {
        for v in [-5.581_237_f32, -0.1, -1e-10, 0.0, -9999.0] {
            assert_eq!(
                serde_json::to_string(&logprob_json(v)).unwrap(),
                serde_json::to_string(&v).unwrap()
            );
        }
        assert_eq!(logprob_json(f32::NEG_INFINITY), json!(-9999.0));
    }
}
