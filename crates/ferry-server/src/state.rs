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
    /// Refuses a `model` that is neither the served name nor a loaded LoRA adapter with a
    /// 404, as OpenAI and vLLM answer (an absent `model` is fine).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        self.resolve_model(model).map(drop)
    }

    /// The LoRA adapter a request's `model` names: `None` for the base model (its served
    /// name, or no `model`), the adapter's name for a loaded adapter, else a 404. The engine
    /// resolves the name again when it takes the request (an adapter unloaded in between is
    /// a 404 then).
    pub fn resolve_model(&self, model: Option<&str>) -> Result<Option<Arc<str>>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.config.served_model_name => Ok(None),
            Some(m) if self.engine.lora(m).is_some() => Ok(Some(m.into())),
            Some(m) => Err(ApiError::not_found(
                Some("model"),
                format!(
                    "the model `{m}` does not exist; this server serves `{}`{}",
                    self.config.served_model_name,
                    self.adapters_named()
                ),
            )),
        }
    }

    /// The `model` a response names: the adapter's, or the served name.
    pub fn model_name(&self, lora: Option<&str>) -> String {
        lora.unwrap_or(&self.config.served_model_name).to_owned()
    }

    /// ` and the LoRA adapters `a`, `b`` when any is loaded (for the 404).
    fn adapters_named(&self) -> String {
        let loras = self.engine.loras();
        if loras.is_empty() {
            return String::new();
        }
        let names: Vec<String> = loras.iter().map(|l| format!("`{}`", l.name)).collect();
        format!(" and the LoRA adapters {}", names.join(", "))
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
