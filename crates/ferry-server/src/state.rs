//! The state every handler shares: the engine handle, the configuration, the compiled chat
//! template and the metrics.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_engine::EngineHandle;
use ferry_engine::TokenId;

use crate::chat_template::ChatTemplate;
use crate::error::ApiError;
use crate::live::LiveRequests;
use crate::logprobs::TokenTexts;
use crate::metrics::Metrics;
use crate::params::Limits;
use crate::uploads::Uploads;
use crate::ServerConfig;

#[derive(Debug)]
pub struct AppState {
    pub engine: EngineHandle,
    pub config: ServerConfig,
    pub limits: Limits,
    /// The compiled template, or why there is none (said in the 400 of every chat request).
    pub template: Result<ChatTemplate, String>,
    pub metrics: Arc<Metrics>,
    pub texts: TokenTexts,
    /// Generation requests in flight, by HTTP request id (for `/abort_requests`).
    pub live: Arc<LiveRequests>,
    /// When the server started (the model card's `created`).
    pub started_unix_s: u64,
    /// The open bucketed weight upload, if any (`crate::admin::upload` drives it).
    pub uploads: Uploads,
}

impl AppState {
    /// Refuses a `model` other than the served name with a 404, as OpenAI and vLLM answer
    /// (an absent `model` is fine).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.config.served_model_name => Err(ApiError::not_found(
                Some("model"),
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    self.config.served_model_name
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Text to token ids. `param` names the field for errors.
    pub fn tokenize(
        &self,
        text: &str,
        add_special_tokens: bool,
        param: &str,
    ) -> Result<Vec<TokenId>, ApiError> {
        let tokenizer = self.engine.tokenizer().ok_or_else(|| {
            ApiError::invalid(
                param,
                "this model has no tokenizer: send token ids instead of text",
            )
        })?;
        let encoding = tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| ApiError::invalid(param, format!("could not tokenize `{param}`: {e}")))?;
        Ok(TokenId::from_raw_slice(encoding.get_ids()).to_vec())
    }

    pub fn template(&self) -> Result<&ChatTemplate, ApiError> {
        self.template
            .as_ref()
            .map_err(|why| ApiError::bad_request(why.clone()))
    }
}

/// Seconds since the Unix epoch (the responses' `created`).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
