//! The request bodies of the OpenAI routes, as sent on the wire.
//!
//! Every field is optional here (required ones are checked in [`crate::params`], so a missing
//! field gets a message naming it); unknown fields are ignored, as OpenAI clients send extras.
//! Fields we know but do not implement are captured as raw JSON so that a non-default value
//! is refused with a 400 naming the field, instead of being silently ignored.

use ferry_engine::TokenId;
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::extract::from_value;
use crate::kv_transfer::KvTransferParamsJson;

/// `prompt` of `/v1/completions`: text, token ids, or a batch of either.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    #[schema(value_type = Vec<u32>)]
    Tokens(Vec<TokenId>),
    TextBatch(Vec<String>),
    #[schema(value_type = Vec<Vec<u32>>)]
    TokenBatch(Vec<Vec<TokenId>>),
}

/// One prompt of a batch, before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<TokenId>),
}

impl PromptInput {
    /// The batch as a list (a single prompt is a batch of one).
    pub fn into_batch(self) -> Vec<Prompt> {
        match self {
            Self::Text(t) => vec![Prompt::Text(t)],
            Self::Tokens(t) => vec![Prompt::Tokens(t)],
            Self::TextBatch(b) => b.into_iter().map(Prompt::Text).collect(),
            Self::TokenBatch(b) => b.into_iter().map(Prompt::Tokens).collect(),
        }
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

impl StopInput {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// A last chunk with the request's usage.
    pub include_usage: Option<bool>,
    /// With `include_usage`: every chunk carries the usage so far (vLLM's extension).
    pub continuous_usage_stats: Option<bool>,
}

/// Sampling fields common to both routes.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    /// Read as any JSON number, so a seed outside 64 bits is the bound it breaks, not a type
    /// error (`params::check_seed`).
    #[schema(value_type = Option<i64>)]
    pub seed: Option<serde_json::Number>,
    pub stop: Option<StopInput>,
    #[schema(value_type = Option<Vec<u32>>)]
    pub stop_token_ids: Option<Vec<TokenId>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub return_token_ids: Option<bool>,
    pub cache_salt: Option<String>,
    /// Accepted and ignored: the scheduler is first-come first-served (no priority classes).
    pub priority: Option<i64>,
    /// Accepted and ignored (OpenAI's end-user tag; nothing here is per-user).
    pub user: Option<String>,
    /// P/D disaggregation: `do_remote_decode` on P, P's returned parameters on D.
    pub kv_transfer_params: Option<KvTransferParamsJson>,
    /// Until this many tokens are generated, EOS and `stop_token_ids` cannot be sampled and
    /// stop strings do not match (vLLM's).
    pub min_tokens: Option<i64>,
    /// The matched stop string (or stop token's text) stays at the end of the text.
    pub include_stop_str_in_output: Option<bool>,
    /// Special tokens are left out of the text (default `true`, as vLLM).
    pub skip_special_tokens: Option<bool>,
    /// Logprobs name each token `token:<id>` instead of its text (vLLM's).
    pub return_tokens_as_token_ids: Option<bool>,
    /// Keep only this many of the prompt's tokens (`-1`: the model's maximum length).
    pub truncate_prompt_tokens: Option<i64>,
    /// Beam search (vLLM's): `n` is the beam width; the answer is the `n` best sequences,
    /// best first (`crate::beam`).
    pub use_beam_search: Option<bool>,
    /// Beam search's length penalty: a sequence is ranked by its cumulative logprob over its
    /// length to this power (default 1).
    pub length_penalty: Option<f64>,
    /// Which end `truncate_prompt_tokens` cuts (vLLM's): `"left"` (the default) keeps the last
    /// tokens, `"right"` the first.
    pub truncation_side: Option<String>,
    /// Subtracted once from the logit of every token the output already has (OpenAI's).
    pub presence_penalty: Option<f64>,
    /// Subtracted from a token's logit once per time the output has it (OpenAI's).
    pub frequency_penalty: Option<f64>,
    /// A token of the prompt or output: its logit divided by this when positive, multiplied
    /// when not (vLLM's; `1` is off).
    pub repetition_penalty: Option<f64>,
    /// Token id (a string key) → bias added to its logit, in `[-100, 100]`.
    #[schema(value_type = Option<Object>)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Logprobs of the prompt's tokens, with this many top logprobs each (vLLM's); the
    /// request then takes no prefix-cache hit.
    pub prompt_logprobs: Option<i64>,
    /// `routed_experts` (a server started with `--enable-return-routed-experts`) leaves out
    /// the rows of the prompt's first this many tokens (vLLM's; 0 to the prompt's length).
    pub routed_experts_prompt_start: Option<i64>,
}

/// The structured-output fields (see [`crate::structured`]), raw: their shapes vary, so
/// they are read there, where each error can name the field.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct StructuredFields {
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// Exactly one of `json` (a schema, or a JSON string of one), `regex`, `choice`, `grammar`
    /// (Lark or GBNF), `json_object: true`; with `disable_any_whitespace`.
    #[schema(value_type = Option<Object>)]
    pub structured_outputs: Option<Value>,
    /// A JSON schema (vLLM's older name).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<Value>,
    /// A regular expression (Rust syntax) the whole output matches.
    #[schema(value_type = Option<String>)]
    pub guided_regex: Option<Value>,
    /// The output is one of these strings.
    #[schema(value_type = Option<Vec<String>>)]
    pub guided_choice: Option<Value>,
    /// A Lark or GBNF grammar.
    #[schema(value_type = Option<String>)]
    pub guided_grammar: Option<Value>,
}

/// Known fields we do not implement. Each is refused when it has a non-default value.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Unsupported {
    pub best_of: Option<Value>,
    pub suffix: Option<Value>,
    /// Refused on `/v1/completions`; chat reads it (the tools module) and clears it here.
    pub tools: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
}

/// A field's name, its value, and whether that value is the default.
type FieldCheck<'a> = (&'static str, &'a Option<Value>, &'a dyn Fn(&Value) -> bool);

impl Unsupported {
    /// Refuses the first field set to something other than its OpenAI default. `n` is the
    /// request's `n` (`best_of` equal to `n` is the default).
    pub fn check(&self, n: i64) -> Result<(), ApiError> {
        let empty = |v: &Value| match v {
            Value::String(s) => s.is_empty(),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            _ => false,
        };
        let best_of_n = |v: &Value| v.as_i64().is_some_and(|b| b <= n);
        let checks: [FieldCheck<'_>; 5] = [
            ("best_of", &self.best_of, &best_of_n),
            ("suffix", &self.suffix, &empty),
            ("tools", &self.tools, &empty),
            ("functions", &self.functions, &empty),
            ("function_call", &self.function_call, &|v| v == "none"),
        ];
        for (name, value, is_default) in checks {
            match value {
                None | Some(Value::Null) => {}
                Some(v) if is_default(v) => {}
                Some(v) => {
                    return Err(ApiError::invalid(
                        name,
                        format!("`{name}` is not supported by this server (got {v})"),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompletionRequest {
    pub own: CompletionFields,
    pub common: CommonParams,
    pub structured: StructuredFields,
    pub unsupported: Unsupported,
}

/// The fields only `/v1/completions` has.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct CompletionFields {
    pub prompt: Option<PromptInput>,
    /// Top-n count (legacy completions format); `0` returns only the sampled token's logprob.
    pub logprobs: Option<i64>,
    /// The text (and, with `logprobs`, the logprobs) starts with the prompt's.
    pub echo: Option<bool>,
}

impl CompletionRequest {
    pub fn from_json(v: &Value) -> Result<Self, ApiError> {
        Ok(Self {
            own: from_value(v)?,
            common: from_value(v)?,
            structured: from_value(v)?,
            unsupported: from_value(v)?,
        })
    }
}

/// A message's `content`: a string or a list of parts (only text parts are supported).
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// One chat message: what a chat template reads of it.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: Option<String>,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    /// An assistant's calls: `[{"id", "type": "function", "function": {"name", "arguments":
    /// "<JSON string>"}}]`, checked by the tools module.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's answer to this call.
    pub tool_call_id: Option<String>,
    /// An assistant's reasoning (vLLM's field), for templates that render past reasoning.
    pub reasoning: Option<String>,
    /// The same under its older name (SGLang's).
    pub reasoning_content: Option<String>,
}

/// The request's tool fields, as sent.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct ToolFields {
    /// OpenAI function tools: `[{"type": "function", "function": {"name", "description",
    /// "parameters"}}]`, rendered by the chat template (its `tools` variable).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// `"none"`, `"auto"` (the default with tools), `"required"`, or
    /// `{"type": "function", "function": {"name": ...}}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// `false`: at most one call.
    pub parallel_tool_calls: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    pub own: ChatFields,
    pub tools: ToolFields,
    pub common: CommonParams,
    pub structured: StructuredFields,
    pub unsupported: Unsupported,
}

impl ChatRequest {
    pub fn from_json(v: &Value) -> Result<Self, ApiError> {
        Ok(Self {
            own: from_value(v)?,
            tools: from_value(v)?,
            common: from_value(v)?,
            structured: from_value(v)?,
            unsupported: from_value(v)?,
        })
    }
}

/// The fields only `/v1/chat/completions` has.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, ToSchema)]
pub struct ChatFields {
    pub messages: Option<Vec<ChatMessage>>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub add_generation_prompt: Option<bool>,
    /// Extra variables for the chat template (e.g. `enable_thinking`).
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// A Jinja chat template for this request, instead of the server's (vLLM's).
    pub chat_template: Option<String>,
    /// The last message (an assistant's, as a prefill) is continued, not closed: the prompt
    /// ends with its text (transformers' and vLLM's; needs `add_generation_prompt: false`).
    pub continue_final_message: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::parse_json;

    fn parse(body: &str) -> CompletionRequest {
        CompletionRequest::from_json(&parse_json(body.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn prompt_shapes_parse() {
        let p = |s: &str| parse(s).own.prompt.unwrap().into_batch();
        assert_eq!(p(r#"{"prompt": "hi"}"#), vec![Prompt::Text("hi".into())]);
        assert_eq!(
            p(r#"{"prompt": [1, 2]}"#),
            vec![Prompt::Tokens(TokenId::list([1, 2]))]
        );
        assert_eq!(
            p(r#"{"prompt": ["a", "b"]}"#),
            vec![Prompt::Text("a".into()), Prompt::Text("b".into())]
        );
        assert_eq!(
            p(r#"{"prompt": [[1], [2, 3]]}"#),
            vec![
                Prompt::Tokens(TokenId::list([1])),
                Prompt::Tokens(TokenId::list([2, 3]))
            ]
        );
    }

    #[test]
    fn type_errors_in_shared_fields_name_the_field() {
        let v: Value = parse_json(br#"{"prompt": "x", "max_tokens": "ten"}"#).unwrap();
        let e = CompletionRequest::from_json(&v).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let v: Value = parse_json(br#"{"messages": [{"role": "user", "content": 5}]}"#).unwrap();
        let e = ChatRequest::from_json(&v).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let v: Value =
            parse_json(br#"{"prompt": "x", "kv_transfer_params": {"remote_block_ids": [1, -2]}}"#)
                .unwrap();
        let e = CompletionRequest::from_json(&v).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("kv_transfer_params.remote_block_ids[1]")
        );
        let v: Value =
            parse_json(br#"{"messages": [], "kv_transfer_params": {"remote_port": 70000}}"#)
                .unwrap();
        let e = ChatRequest::from_json(&v).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params.remote_port"));
    }

    #[test]
    fn unknown_fields_are_ignored_and_flattened_fields_parse() {
        let v: Value = parse_json(
            br#"{"messages": [{"role": "user", "content": "x", "name": "bob"}],
                 "max_tokens": 3, "whatever": {"a": 1}, "presence_penalty": 0}"#,
        )
        .unwrap();
        let r = ChatRequest::from_json(&v).unwrap();
        assert_eq!(r.common.max_tokens, Some(3));
        let m = &r.own.messages.as_ref().unwrap()[0];
        assert_eq!(m.name.as_deref(), Some("bob"));
        assert!(r.unsupported.check(1).is_ok());
    }

    #[test]
    fn unsupported_fields_with_values_are_named() {
        let err = |body: &str| {
            let r = parse(body);
            r.unsupported
                .check(r.common.n.unwrap_or(1))
                .unwrap_err()
                .param
        };
        assert_eq!(
            err(r#"{"functions": [{"name": "f"}]}"#).as_deref(),
            Some("functions")
        );
        assert_eq!(err(r#"{"best_of": 3, "n": 2}"#).as_deref(), Some("best_of"));
        assert_eq!(err(r#"{"suffix": "x"}"#).as_deref(), Some("suffix"));
        assert_eq!(
            err(r#"{"tools": [{"type": "function"}]}"#).as_deref(),
            Some("tools")
        );
        let ok = parse(r#"{"best_of": 2, "n": 2, "suffix": ""}"#);
        assert!(ok.unsupported.check(2).is_ok());
    }
}
