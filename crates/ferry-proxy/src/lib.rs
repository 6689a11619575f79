//! ferry-proxy: one OpenAI-compatible endpoint in front of ferry prefill (P) and decode (D)
//! servers (`ferry serve --kv-role kv_producer | kv_consumer`), or of plain servers
//! (`--instance`), as `ferry proxy` runs it.
//!
//! A generation request (`/v1/completions`, `/v1/chat/completions`, SGLang's `/generate`,
//! vLLM's `/inference/v1/generate`) goes to a P with `max_tokens: 1` and
//! `kv_transfer_params: {"do_remote_decode": true}`, then, unchanged but for P's returned
//! `kv_transfer_params`, to the least-loaded D, whose answer streams back ([`generate`]); with
//! plain instances it goes whole to one. P (or the plain instance) is picked by prefix: the one
//! whose prefix cache, as its KV events describe it, holds most of the prompt, weighed against
//! its load ([`fleet`], [`kv_index`], [`kv_sub`]). The
//! lifecycle admin routes go to every instance and report each one's result ([`admin`],
//! [`broadcast`]);
//! `/health` and `/metrics` summarise the fleet (`/health` with `version_skew`: whether the
//! instances run different weight versions, [`versions`]), and `/v1/models`, `/tokenize`,
//! `/detokenize`, `/version` and SGLang's discovery routes (`/server_info`, `/model_info`,
//! `/health_generate`, ...) are answered by one instance ([`routes`]).
//!
//! The key decisions: the proxy holds no state but its in-flight counts and the prefix
//! indexes it rebuilds from the instances' events (replayed at start; dropped on every wipe,
//! so they never predict a hit on a cache that is gone), so it can be restarted or run twice
//! at will; it validates only what it must read (a JSON
//! object, how many prompts), so every refusal is the instances' own 400 naming the field;
//! and every call to an instance has a connect timeout, so an instance that is down is a 503
//! naming it, never a hang ([`upstream`]).
//!
//! It speaks HTTP, and ZMQ for the events (`ferry-kv-events`): `ferry-http` gives it the wire
//! shapes it shares with the instances
//! (the OpenAI error body, the request id rules, the API key check, the body limit), and it
//! depends on nothing of the engine behind them: building the proxy builds no model.

pub mod admin;
pub mod broadcast;
pub mod fleet;
pub mod front;
pub mod generate;
pub mod kv_index;
pub mod kv_sub;
pub mod metrics;
pub mod routes;
#[cfg(target_os = "linux")]
pub mod splice;
pub mod upload;
pub mod upstream;
pub mod versions;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use ferry_http::ApiKey;

use crate::fleet::Fleet;
pub use crate::fleet::Routing;
pub use crate::upstream::InstanceKey;
use crate::upstream::Upstream;

/// Everything the proxy needs; built by the binary from its flags.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Base URLs of the prefill instances (`http://host:port`).
    pub prefill: Vec<String>,
    /// Base URLs of the decode instances.
    pub decode: Vec<String>,
    /// Base URLs of plain instances (no `--kv-role`), each computing whole requests; instead
    /// of P and D.
    pub instances: Vec<String>,
    /// How instances are picked (`--routing`); by prefix by default, which routes by load
    /// while an instance publishes no KV events.
    pub routing: Routing,
    /// Mount the lifecycle admin routes, fanned out to every instance.
    pub enable_admin_api: bool,
    /// The key clients must send (every route but `/health` and `/metrics`), as
    /// `ferry serve --api-key`.
    pub api_key: Option<ApiKey>,
    /// The key the proxy sends to its instances.
    pub instance_api_key: Option<InstanceKey>,
    /// Bound on opening a connection to an instance: past it the instance counts as down.
    pub connect_timeout: Duration,
    /// Bound on P's one-token answer.
    pub prefill_timeout: Duration,
    /// Bound on each instance's answer to an admin call (a pause that waits for requests to
    /// drain, a weight reload) and to forwarded calls.
    pub admin_timeout: Duration,
    /// Bound on each instance's `/health` and `/metrics` answer.
    pub health_timeout: Duration,
    /// How long a streamed answer from an instance may stay silent before the client gets
    /// an error event naming the instance (`None`: forever). `ferry serve` sends keep-alive
    /// comments well within the default, also while a pause holds the request.
    pub stream_idle_timeout: Option<Duration>,
}

/// Default of [`ProxyConfig::stream_idle_timeout`].
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

impl ProxyConfig {
    pub fn new(prefill: Vec<String>, decode: Vec<String>) -> Self {
        Self {
            prefill,
            decode,
            instances: Vec::new(),
            routing: Routing::Kv {
                overlap_weight: 1.0,
            },
            enable_admin_api: false,
            api_key: None,
            instance_api_key: None,
            connect_timeout: Duration::from_secs(2),
            prefill_timeout: generate::DEFAULT_PREFILL_TIMEOUT,
            admin_timeout: Duration::from_secs(600),
            health_timeout: Duration::from_secs(2),
            stream_idle_timeout: Some(DEFAULT_STREAM_IDLE_TIMEOUT),
        }
    }
}

/// What every handler shares.
#[derive(Debug)]
pub struct ProxyState {
    pub config: ProxyConfig,
    pub fleet: Fleet,
    pub upstream: Arc<Upstream>,
    /// The open bucketed weight upload, across the instances ([`upload`]).
    pub uploads: upload::Uploads,
}

/// Why the proxy could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(
        "the proxy needs at least one prefill and one decode instance, or plain instances \
         (--instance), not both"
    )]
    NoInstances,
    #[error("could not build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// The proxy's routes.
pub fn router(config: ProxyConfig) -> Result<Router, ProxyError> {
    let pd = !config.prefill.is_empty() && !config.decode.is_empty();
    let whole = !config.instances.is_empty();
    if pd == whole || (whole && !(config.prefill.is_empty() && config.decode.is_empty())) {
        return Err(ProxyError::NoInstances);
    }
    let upstream = Arc::new(Upstream::new(
        config.connect_timeout,
        config.stream_idle_timeout,
        config.instance_api_key.clone(),
    )?);
    let mut fleet = Fleet::with_instances(&config.prefill, &config.decode, &config.instances);
    fleet.routing = config.routing;
    // The instances that compute prompts are followed through their KV events (outside a
    // runtime, as in some tests, the proxy routes by load).
    if matches!(config.routing, Routing::Kv { .. }) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            for i in fleet.of(fleet.prompt_role()) {
                rt.spawn(kv_sub::follow(Arc::clone(i), Arc::clone(&upstream)));
            }
        }
    }
    let admin = config.enable_admin_api;
    let api_key = config.api_key.clone();
    let state = Arc::new(ProxyState {
        config,
        fleet,
        upstream,
        uploads: upload::Uploads::default(),
    });
    let routes = Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat))
        .route("/generate", post(generate::sglang))
        .route("/inference/v1/generate", post(generate::vllm))
        .route("/server_info", get(routes::forward))
        .route("/get_server_info", get(routes::forward))
        .route("/model_info", get(routes::forward))
        .route("/get_model_info", get(routes::forward))
        .route("/health_generate", get(routes::forward))
        .route("/get_world_size", get(routes::forward))
        .route("/v1/models", get(routes::forward))
        .route("/version", get(routes::forward))
        .route("/tokenize", post(routes::forward))
        .route("/detokenize", post(routes::forward))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics));
    let routes = if admin {
        routes.merge(admin::routes())
    } else {
        routes
    };
    let routes = routes.fallback(routes::not_found);
    Ok(ferry_http::edge_layers(routes, api_key).with_state(state))
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits for open requests
/// ([`front`]: a weight bucket's body goes to the instances without a copy through the
/// proxy).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    front::serve(listener, router, shutdown).await
}
