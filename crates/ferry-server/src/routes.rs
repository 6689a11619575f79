//! The small routes: `/v1/models`, `/health`, `/version`, `/metrics`, `/tokenize`,
//! `/detokenize` (the last two in vLLM's request and response shapes).

use ferry_engine::TokenId;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::chat::render_prompt;
use crate::error::{api_error, ApiError};
use crate::extract::ApiJson;
use crate::request::{ChatFields, ChatMessage};
use crate::response::{ModelCard, ModelList};
use crate::state::AppState;

/// The served model, then each loaded LoRA adapter with the base as its `parent` (vLLM's
/// cards: an adapter's `root` is where it was read from, or its name when pushed).
pub async fn models(State(app): State<Arc<AppState>>) -> Json<ModelList> {
    let name = app.config.served_model_name.clone();
    let card = |id: String, root: String, parent: Option<String>| ModelCard {
        id,
        object: "model",
        created: app.started_unix_s,
        owned_by: "ferry",
        root,
        parent,
        max_model_len: app.limits.max_model_len,
    };
    let mut data = vec![card(name.clone(), name.clone(), None)];
    for lora in app.engine.loras() {
        let root = lora.source.unwrap_or_else(|| lora.name.clone());
        data.push(card(lora.name, root, Some(name.clone())));
    }
    Json(ModelList {
        object: "list",
        data,
    })
}

/// 200 while the engine runs; 503 once it has stopped.
pub async fn health(State(app): State<Arc<AppState>>) -> Response {
    let stats = app.engine.stats();
    if stats.running {
        StatusCode::OK.into_response()
    } else {
        // A 500 naming the failure if the engine failed, a 503 if it was shut down.
        api_error(ferry_engine::Stopped::from_failure(
            stats.failure.as_deref(),
        ))
        .into_response()
    }
}

/// Where the engine publishes its KV events: `{"enabled": false}` when it does not; else the
/// endpoints, the topic and the block size a subscriber needs (the format: vLLM 0.34's
/// `kv_events.py`, `ferry_kv_events::wire::FORMAT`).
pub async fn kv_events_info(State(app): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(match &app.config.kv_events {
        None => serde_json::json!({ "enabled": false }),
        Some(info) => serde_json::json!({
            "enabled": true,
            "publisher": "zmq",
            "endpoint": info.endpoint,
            "replay_endpoint": info.replay_endpoint,
            "topic": info.topic,
            "block_size": info.block_size,
            "format": "vllm-0.34",
        }),
    })
}

pub async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    match app.metrics.render() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError::internal(format!("could not render metrics: {e}")).into_response(),
    }
}

/// `POST /tokenize`: a `prompt` (special tokens added by default) or chat `messages`
/// (rendered through the chat template; special tokens not added by default).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// As chat's: a template for this request, and the last message continued.
    pub chat_template: Option<String>,
    pub continue_final_message: Option<bool>,
    /// As chat's: tools for the template.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<serde_json::Value>,
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<TokenId>,
    pub token_strs: Option<Vec<String>>,
}

pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    ApiJson(mut req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    app.check_model(req.model.as_deref())?;
    let tokens = match (req.prompt.take(), req.messages.take()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "send either `prompt` or `messages`, not both",
            ))
        }
        (Some(prompt), None) => {
            app.tokenize(&prompt, req.add_special_tokens.unwrap_or(true), "prompt")?
        }
        (None, Some(messages)) => tokenize_chat(&app, messages, &req)?,
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` or `messages` is required",
            ))
        }
    };
    let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| {
                app.engine
                    .tokenizer()
                    .and_then(|t| t.id_to_token(id.0))
                    .unwrap_or_default()
            })
            .collect()
    });
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: app.limits.max_model_len,
        tokens,
        token_strs,
    }))
}

/// Chat messages for /tokenize: the same rendering as /v1/chat/completions, so the ids equal
/// the prompt ids that `return_token_ids` reports.
fn tokenize_chat(
    app: &AppState,
    messages: Vec<ChatMessage>,
    req: &TokenizeRequest,
) -> Result<Vec<TokenId>, ApiError> {
    crate::tools::check_messages(&messages)?;
    // The tools as chat checks them; no `tool_choice` here: they are only rendered.
    let tools = crate::request::ToolFields {
        tools: req.tools.clone(),
        tool_choice: Some("none".into()),
        parallel_tool_calls: None,
    }
    .read(app.config.tool_server())?
    .map(|t| t.tools);
    let chat = ChatFields {
        messages: Some(messages),
        add_generation_prompt: req.add_generation_prompt,
        chat_template_kwargs: req.chat_template_kwargs.clone(),
        chat_template: req.chat_template.clone(),
        continue_final_message: req.continue_final_message,
        ..ChatFields::default()
    };
    if req.add_special_tokens == Some(true) {
        let text = crate::chat::render_text(app, &chat, tools.as_deref())?;
        return app.tokenize(&text, true, "messages");
    }
    render_prompt(app, &chat, tools.as_deref())
}

/// `POST /detokenize`.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    #[schema(value_type = Option<Vec<u32>>)]
    pub tokens: Option<Vec<TokenId>>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    app.check_model(req.model.as_deref())?;
    let tokens = req
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
    let tokenizer = app
        .engine
        .tokenizer()
        .ok_or_else(|| ApiError::invalid("tokens", "this model has no tokenizer"))?;
    if let Some(vocab) = app.limits.vocab_size {
        if let Some((i, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id.index() >= vocab)
        {
            return Err(ApiError::invalid(
                format!("tokens[{i}]"),
                crate::params::out_of_vocabulary(*id, vocab),
            ));
        }
    }
    let prompt = tokenizer
        .decode(TokenId::as_raw_slice(&tokens), false)
        .map_err(|e| ApiError::invalid("tokens", format!("could not detokenize: {e}")))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// Unknown routes get an OpenAI-shaped 404.
pub async fn not_found() -> ApiError {
    ApiError::not_found(None, "no such route")
}
