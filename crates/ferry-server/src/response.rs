//! The response bodies of the OpenAI routes (and their streamed chunks), as sent on the wire.
//!
//! `return_token_ids` follows vLLM: completions put `prompt_token_ids` and `token_ids` on each
//! choice; chat puts `prompt_token_ids` on the response and `token_ids` on each choice. When
//! streaming, `prompt_token_ids` comes with a choice's first chunk and `token_ids` carries each
//! chunk's new tokens.

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use utoipa::ToSchema;

use ferry_engine::TokenId;

use crate::kv_transfer::KvTransferParamsJson;

/// The fields every response and streamed chunk of one request repeats.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// `usage`. `prompt_tokens` counts each prompt once, whatever `n`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// A choice's `stop_reason` (vLLM's extension): the stop token id or the stop string.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum StopReasonJson {
    /// The number on the wire (a token id; utoipa needs a type it knows).
    Token(u32),
    Text(String),
}

/// A response of the generation routes, or one streamed chunk: the head, the choices, and
/// the extras. `object` says which (`text_completion`, `chat.completion`,
/// `chat.completion.chunk`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Response<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Chat's prompt ids (vLLM's placement; completions put them on each choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<u32>>)]
    pub prompt_token_ids: Option<Vec<TokenId>>,
    /// P's transfer parameters after an export (vLLM's placement: on the response; when
    /// streaming, on the chunk that finishes the exporting choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParamsJson>,
    /// Chat's prompt logprobs (vLLM's placement; completions put them on each choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub prompt_logprobs: Option<PromptLogprobsJson>,
}

/// vLLM's `prompt_logprobs`: one entry per prompt token, `null` for the first (nothing comes
/// before it), else token id (as a string key) → `{"logprob", "rank", "decoded_token"}` for
/// the prompt token and the top-n.
pub type PromptLogprobsJson = Vec<Option<PromptLogprobMap>>;

/// One position of [`PromptLogprobsJson`]: `(token id, entry)` pairs, the prompt token
/// first, serialized as a JSON object in that order (a token listed twice keeps its first
/// entry).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptLogprobMap(pub Vec<(TokenId, PromptLogprobEntry)>);

/// A token's entry in a [`PromptLogprobMap`] (vLLM's `Logprob`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptLogprobEntry {
    pub logprob: f32,
    pub rank: u32,
    pub decoded_token: String,
}

impl Serialize for PromptLogprobMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seen = std::collections::HashSet::new();
        let entries: Vec<_> = self.0.iter().filter(|(t, _)| seen.insert(*t)).collect();
        let mut map = serializer.serialize_map(Some(entries.len()))?;
        for (token, entry) in entries {
            map.serialize_entry(&token.to_string(), entry)?;
        }
        map.end()
    }
}

impl<C> Response<C> {
    /// A response (or chunk) of `object` with these choices and no extras.
    pub fn new(head: &Head, object: &'static str, choices: Vec<C>) -> Self {
        Self {
            id: head.id.clone(),
            object,
            created: head.created,
            model: head.model.clone(),
            choices,
            usage: None,
            prompt_token_ids: None,
            kv_transfer_params: None,
            prompt_logprobs: None,
        }
    }
}

/// One choice of a response or chunk: its content (`text`, `message` or `delta`, flattened
/// into the choice), its logprobs in the route's format, how it ended, and the extras.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Choice<Content, Logprobs> {
    pub index: usize,
    #[serde(flatten)]
    pub content: Content,
    pub logprobs: Option<Logprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReasonJson>,
    /// Completions' prompt ids (chat puts them on the response).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<u32>>)]
    pub prompt_token_ids: Option<Vec<TokenId>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<u32>>)]
    pub token_ids: Option<Vec<TokenId>>,
    /// With a structured-output constraint, one entry per output token (of this chunk, when
    /// streaming): `true` where the constraint allowed only that token, so the model did not
    /// choose it (non-standard, for RL trainers that mask such tokens out of the loss).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forced_tokens: Option<Vec<bool>>,
    /// The weight versions the choice's tokens were computed with (non-standard; when
    /// streaming, only on the chunk that carries `finish_reason`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_versions: Option<Vec<String>>,
    /// For a choice under a LoRA adapter, the adapter versions its tokens were computed
    /// with, in order (non-standard, beside `weight_versions`; absent for the base model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_versions: Option<Vec<u64>>,
    /// Completions' prompt logprobs (chat puts them on the response); when streaming, on the
    /// choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub prompt_logprobs: Option<PromptLogprobsJson>,
    /// vLLM's: the choice's expert routing, base64 of a `.npy` array of shape
    /// `(prompt + output tokens - 1 - routed_experts_prompt_start, layers, top_k)`
    /// (`crate::routed_experts`), when the server captures it
    /// (`--enable-return-routed-experts`); `null` otherwise. Non-streamed answers only, as
    /// vLLM's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<String>,
}

/// A completion choice's content.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Text {
    pub text: String,
}

/// A chat choice's content.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Message {
    pub message: AssistantMessage,
}

/// A streamed chat choice's content.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct DeltaContent {
    pub delta: Delta,
}

/// `/v1/completions` response, and each streamed chunk.
pub type CompletionResponse = Response<CompletionChoice>;
pub type CompletionChoice = Choice<Text, CompletionLogprobs>;
/// `/v1/chat/completions` response.
pub type ChatResponse = Response<ChatChoice>;
pub type ChatChoice = Choice<Message, ChatLogprobs>;
/// One streamed `chat.completion.chunk`.
pub type ChatChunk = Response<ChatChunkChoice>;
pub type ChatChunkChoice = Choice<DeltaContent, ChatLogprobs>;

/// The legacy completions logprobs format: parallel lists, one entry per output token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// `null` only for an echoed prompt's first token (nothing comes before it).
    pub token_logprobs: Vec<Option<f32>>,
    /// `{token text: logprob}` per token, best first (`null` where `token_logprobs` is).
    #[schema(value_type = Vec<Option<std::collections::HashMap<String, f32>>>)]
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// `{token text: logprob}`, best first. Serialized as a JSON object that keeps this order
/// (a `BTreeMap` would sort by text); a token text seen twice keeps its first (best) entry.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seen = std::collections::HashSet::new();
        let entries: Vec<_> = self.0.iter().filter(|(t, _)| seen.insert(t)).collect();
        let mut map = serializer.serialize_map(Some(entries.len()))?;
        for (token, logprob) in entries {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when a reasoning parser left nothing after the reasoning.
    pub content: Option<String>,
    /// With `--reasoning-parser`: the text of the `<think>` block (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// The same, under its older name (SGLang's, and what many clients read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// With tools: the calls the answer makes (left out when none, as vLLM leaves it).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<crate::tools::ToolCall>,
}

/// Chat logprobs: one entry per output token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatChunkChoice {
    /// A stream's opening chunk for choice `index`: the assistant role and empty content.
    pub fn role_delta(index: usize, token_ids: Option<Vec<TokenId>>) -> Self {
        Self {
            index,
            content: DeltaContent {
                delta: Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..Delta::default()
                },
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
            prompt_token_ids: None,
            token_ids,
            forced_tokens: None,
            weight_versions: None,
            lora_versions: None,
            prompt_logprobs: None,
            routed_experts: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// With `--reasoning-parser`: this chunk's part of the reasoning (and under its older
    /// name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// With tools: pieces of the calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<crate::tools::DeltaToolCall>>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: String,
    /// A LoRA adapter's base model (vLLM's); `null` for the base itself.
    pub parent: Option<String>,
    pub max_model_len: usize,
}

/// Logprobs as JSON numbers: a `-inf` logprob (a token the filters removed) has no JSON form,
/// so it is clamped like vLLM does.
pub fn finite_logprob(v: f32) -> f32 {
    if v.is_finite() {
        v
    } else if v.is_nan() {
        -9999.0
    } else {
        v.clamp(-9999.0, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprob_map_keeps_order_and_first_duplicate() {
        let m = TopLogprobMap(vec![
            ("b".into(), -0.1),
            ("a".into(), -0.5),
            ("b".into(), -0.7),
        ]);
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"b":-0.1,"a":-0.5}"#);
    }

    #[test]
    fn infinite_logprobs_are_clamped() {
        assert_eq!(finite_logprob(f32::NEG_INFINITY), -9999.0);
        assert_eq!(finite_logprob(-1.5), -1.5);
    }

    #[test]
    fn stream_chunk_skips_absent_extras_but_keeps_nulls() {
        let head = Head {
            id: "x".into(),
            created: 1,
            model: "m".into(),
        };
        let c: ChatChunk = Response::new(
            &head,
            "chat.completion.chunk",
            vec![ChatChunkChoice::role_delta(0, None)],
        );
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null,"stop_reason":null}]}"#
        );
    }
}

/// The fields vLLM's non-streamed responses always carry (`null` when unset: its server dumps
/// every field of its response models, `vllm/entrypoints/openai/*/protocol.py` at 0.34), by
/// where they sit. Clients read them as attributes (`choice.prompt_logprobs`) and fail on a
/// missing one; [`fill_nulls`] adds each that ferry's answer lacks, as `null`.
#[derive(Debug)]
pub struct AlwaysPresent {
    pub response: &'static [&'static str],
    pub choice: &'static [&'static str],
    /// Chat's `message`.
    pub message: &'static [&'static str],
    pub usage: &'static [&'static str],
}

/// vLLM's `CompletionResponse`, `CompletionResponseChoice` and `UsageInfo`.
pub const COMPLETION_FIELDS: AlwaysPresent = AlwaysPresent {
    response: &[
        "service_tier",
        "system_fingerprint",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ],
    choice: &[
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ],
    message: &[],
    usage: &["completion_tokens_details"],
};

/// vLLM's `ChatCompletionResponse`, `ChatCompletionResponseChoice`, `ChatMessage` and
/// `UsageInfo` (an empty `tool_calls` it leaves out, as ferry does).
pub const CHAT_FIELDS: AlwaysPresent = AlwaysPresent {
    response: &[
        "service_tier",
        "system_fingerprint",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ],
    choice: &[
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
    ],
    message: &["refusal", "audio", "function_call", "reasoning"],
    usage: &["completion_tokens_details"],
};

/// Adds each of `fields` that `response` (a serialized non-streamed response) lacks, as
/// `null`; what it has stays as it is.
pub fn fill_nulls(response: &mut serde_json::Value, fields: &AlwaysPresent) {
    fn fill(object: Option<&mut serde_json::Value>, keys: &[&str]) {
        if let Some(serde_json::Value::Object(map)) = object {
            for key in keys {
                map.entry(*key).or_insert(serde_json::Value::Null);
            }
        }
    }
    fill(Some(&mut *response), fields.response);
    fill(response.get_mut("usage"), fields.usage);
    if let Some(serde_json::Value::Array(choices)) = response.get_mut("choices") {
        for choice in choices {
            fill(choice.get_mut("message"), fields.message);
            fill(Some(choice), fields.choice);
        }
    }
}
