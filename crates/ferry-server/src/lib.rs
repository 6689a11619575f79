//! ferry-server: the OpenAI-compatible HTTP server (axum + tokio) in front of the ferry engine.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent
//! events or not), `GET /v1/models`, `GET /health`, `GET /version`, `GET /metrics`
//! (Prometheus text), `POST /tokenize`, `POST /detokenize`; the RL frameworks' native routes
//! ([`native`]: SGLang's `POST /generate` and discovery routes, vLLM's `POST
//! /inference/v1/generate`); with
//! [`ServerConfig::enable_admin_api`], the lifecycle admin API ([`admin`]). With
//! [`ServerConfig::api_key`], every route but `/health` and `/metrics` needs the key
//! ([`auth`]).
//!
//! The key decision: the server validates *everything* it can before it calls the engine
//! ([`params`], [`request::Unsupported`]), so a bad request is a 400 naming the field and
//! never costs the engine anything; the engine's own refusals map by variant (a full queue or
//! a stopped engine is a 503, never a hang). A response body owns its engine streams, so a
//! client that goes away aborts its requests and frees their KV blocks.
//!
//! Modules: [`admin`] (pause, sleep, cache reset, weight updates), [`auth`] (the API key),
//! [`live`] (requests in flight by HTTP id), [`error`] (the OpenAI error, and how the engine's
//! map onto it), [`extract`] (JSON bodies, request ids), [`request`] / [`response`] (wire
//! types), [`params`] (validation), [`chat_template`], [`generate`] (the one handler of both
//! generation routes: engine requests, `n`, usage), [`sse`] (streaming), [`completions`] and
//! [`chat`] (each route's request parsing and wire format), [`native`] (SGLang's and vLLM's
//! native generate routes, as completions requests in those wire formats, and SGLang's
//! discovery routes), [`routes`] (the small routes), [`routed_experts`] (MoE routing in
//! vLLM's and SGLang's encodings), [`metrics`], [`logprobs`], [`state`]. The edge it shares with the P/D proxy (the error
//! type, request ids, the API key, the body limit and [`ferry_http::edge_layers`]) is
//! `ferry-http`'s, re-exported under the paths it had here.

pub mod admin;
pub mod beam;
pub mod chat;
pub mod chat_template;
pub mod completions;
pub mod error;
pub mod extract;
pub mod gbnf;
pub mod generate;
pub mod kv_transfer;
pub mod live;
pub mod logprobs;
pub mod metrics;
pub mod native;
pub mod openapi;
pub mod params;
pub mod pyjson;
pub mod reasoning;
pub mod request;
pub mod response;
pub mod routed_experts;
pub mod routes;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tool_parsers;
pub mod tools;
pub mod uploads;

use std::future::Future;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use ferry_engine::{AllowedPeers, EngineHandle, ModelInfo};

use crate::chat_template::ChatTemplate;
use crate::logprobs::TokenTexts;
use crate::metrics::Metrics;
use crate::params::Limits;
use crate::state::{unix_now, AppState};

/// The API key ([`ApiKey`]) and its middleware: ferry-http's, shared with the proxy.
pub use ferry_http::auth;
pub use ferry_http::ApiKey;
/// Largest request body; ferry-http's, so the proxy takes what the server takes.
pub use ferry_http::MAX_BODY_BYTES;

/// What the server needs besides the engine; built by the binary from the model folder.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// The `model` name clients must use (and `/v1/models` lists).
    pub served_model_name: String,
    /// Where the model was loaded from (a folder, a GGUF file, `tiny`): SGLang's
    /// `model_path` and `tokenizer_path` in `/server_info` and `/model_info`. `None` reports
    /// the served name.
    pub model_path: Option<String>,
    /// The model's Jinja chat template; without one, chat requests are a 400 saying so.
    pub chat_template: Option<String>,
    /// `bos_token` / `eos_token` as the chat template sees them.
    pub bos_token: String,
    pub eos_token: String,
    /// Largest `logprobs` (completions) or `top_logprobs` (chat).
    pub max_top_logprobs: u32,
    /// `--reasoning-parser`: chat answers split into reasoning and content
    /// ([`reasoning`]); `None` leaves the text whole.
    pub reasoning_parser: Option<reasoning::ReasoningParser>,
    /// `--tool-call-parser`: how `tool_choice: "auto"` finds calls in an answer
    /// ([`tool_parsers`]); it takes effect with `enable_auto_tool_choice`.
    pub tool_call_parser: Option<tool_parsers::ToolCallParser>,
    /// `--enable-auto-tool-choice`: requests may leave the calls to the model
    /// (`tool_choice: "auto"`, the default with `tools`).
    pub enable_auto_tool_choice: bool,
    /// Largest `n`.
    pub max_n: u32,
    /// Most stop strings per request.
    pub max_stop_strings: usize,
    /// Most prompts in one batched `/v1/completions` request.
    pub max_batch_prompts: usize,
    /// The model's vocabulary size: token ids in prompts and `stop_token_ids` must be below
    /// it. `None` uses the tokenizer's size (with added tokens), or checks nothing without one.
    pub vocab_size: Option<usize>,
    /// Mount the lifecycle admin API ([`admin`]). Off by default: any client that reaches it
    /// can pause the engine and replace its weights.
    pub enable_admin_api: bool,
    /// Largest safetensors body `POST /update_weights` accepts (and each bucket of an
    /// upload).
    pub max_weight_push_bytes: usize,
    /// A bucketed weight upload no call touches for this long is discarded, and a bucket
    /// whose body sends nothing for this long fails its upload (default 300 s).
    pub weight_upload_timeout: std::time::Duration,
    /// Whether the engine runs a P/D connector (`ferry serve --kv-role`): without one, a
    /// request asking for a transfer (`kv_transfer_params.do_remote_*`) is a 400.
    pub kv_connector: bool,
    /// The peers a load may connect to (`ferry serve --kv-allowed-peers`; default loopback
    /// only): with a P/D connector, a load's `kv_transfer_params.remote_host` is resolved once,
    /// refused with a 400 outside this set, and replaced by the checked address
    /// ([`kv_transfer::check_remote_host`]). The engine's connector holds the same set.
    pub kv_allowed_peers: AllowedPeers,
    /// With a key, every route but `/health` and `/metrics` needs `Authorization: Bearer
    /// <key>` ([`auth`]); its `Debug` is redacted.
    pub api_key: Option<ApiKey>,
    /// Where this engine publishes its KV events (`ferry serve --kv-events-config`), for
    /// `GET /kv_events_info`; none: it publishes none.
    pub kv_events: Option<KvEventsInfo>,
}

/// Where an engine's KV events can be subscribed to (`GET /kv_events_info`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KvEventsInfo {
    /// The ZMQ PUB socket (`tcp://host:port`, the address it bound).
    pub endpoint: String,
    /// The ROUTER socket that replays buffered batches from a sequence number.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub block_size: usize,
}

/// The default push limit: 16 GiB (whole checkpoints of mid-sized models), capped at the
/// address space on 32-bit targets.
#[allow(clippy::cast_possible_truncation)]
pub const DEFAULT_MAX_WEIGHT_PUSH_BYTES: usize = if usize::BITS >= 64 {
    (16u64 << 30) as usize
} else {
    usize::MAX
};

/// How long an untouched weight upload lives: `--weight-upload-timeout-seconds`'s default.
pub const DEFAULT_WEIGHT_UPLOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

impl ServerConfig {
    /// What tool calling the server does.
    pub fn tool_server(&self) -> tools::ToolServer {
        tools::ToolServer {
            auto: self
                .tool_call_parser
                .filter(|_| self.enable_auto_tool_choice),
        }
    }

    pub fn new(served_model_name: impl Into<String>) -> Self {
        Self {
            served_model_name: served_model_name.into(),
            model_path: None,
            chat_template: None,
            bos_token: String::new(),
            eos_token: String::new(),
            max_top_logprobs: 20,
            reasoning_parser: None,
            tool_call_parser: None,
            enable_auto_tool_choice: false,
            max_n: 16,
            max_stop_strings: 16,
            max_batch_prompts: 1024,
            vocab_size: None,
            enable_admin_api: false,
            max_weight_push_bytes: DEFAULT_MAX_WEIGHT_PUSH_BYTES,
            weight_upload_timeout: DEFAULT_WEIGHT_UPLOAD_TIMEOUT,
            kv_connector: false,
            kv_allowed_peers: AllowedPeers::default(),
            api_key: None,
            kv_events: None,
        }
    }

    /// [`ServerConfig::new`] with what the model brings: where it came from, its chat
    /// template, the special tokens the template sees, and its vocabulary size.
    pub fn for_model(served_model_name: impl Into<String>, model: &ModelInfo) -> Self {
        Self {
            model_path: Some(model.source.clone()),
            chat_template: model.chat_template.clone(),
            bos_token: model.bos_token.clone(),
            eos_token: model.eos_token.clone(),
            vocab_size: Some(model.vocab_size),
            ..Self::new(served_model_name)
        }
    }
}

/// The server's routes over `engine`.
pub fn router(engine: EngineHandle, config: ServerConfig) -> Router {
    let admin = config.enable_admin_api;
    let api_key = config.api_key.clone();
    let state = Arc::new(app_state(engine, config));
    let routes = Router::new()
        .route(
            "/v1/completions",
            post(generate::handle::<completions::Completions>),
        )
        .route("/v1/chat/completions", post(generate::handle::<chat::Chat>))
        .route("/v1/models", get(routes::models))
        .route("/health", get(routes::health))
        .route("/version", get(routes::version))
        .route("/kv_events_info", get(routes::kv_events_info))
        .route("/metrics", get(routes::metrics))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/generate", post(native::sglang::generate))
        .route("/inference/v1/generate", post(native::vllm::generate))
        .route("/server_info", get(native::discovery::server_info))
        .route("/get_server_info", get(native::discovery::server_info))
        .route("/model_info", get(native::discovery::model_info))
        .route("/get_model_info", get(native::discovery::model_info))
        .route("/health_generate", get(native::discovery::health_generate))
        .route("/get_world_size", get(native::discovery::world_size));
    let routes = if admin {
        routes.merge(admin::routes())
    } else {
        routes
    };
    let routes = routes.fallback(routes::not_found);
    // The key (unknown paths need it too), the body limit and the request id, as on the proxy.
    ferry_http::edge_layers(routes, api_key).with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits for open requests
/// (shut the engine down first so streams end with `abort` rather than run to completion).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

fn app_state(engine: EngineHandle, config: ServerConfig) -> AppState {
    let vocab_size = config
        .vocab_size
        .or_else(|| engine.tokenizer().map(|t| t.get_vocab_size(true)));
    let limits = Limits {
        max_model_len: engine.scheduler_config().max_model_len,
        max_top_logprobs: config.max_top_logprobs,
        max_n: config.max_n,
        vocab_size,
        max_stop_strings: config.max_stop_strings,
        max_batch_prompts: config.max_batch_prompts,
    };
    let template = match &config.chat_template {
        None => Err("this model has no chat template, so /v1/chat/completions cannot be used; use /v1/completions".to_owned()),
        Some(src) => ChatTemplate::new(src, &config.bos_token, &config.eos_token).map_err(|e| {
            tracing::warn!("{e}");
            e.to_string()
        }),
    };
    let stats_engine = engine.clone();
    let metrics = Arc::new(Metrics::new(move || stats_engine.stats()));
    AppState {
        texts: TokenTexts::new(engine.tokenizer().cloned()),
        engine,
        config,
        limits,
        template,
        metrics,
        live: Arc::default(),
        started_unix_s: unix_now(),
        uploads: Default::default(),
    }
}
