//! Test harness: the real engine over the tiny Llama model, the server on a loopback port,
//! and small HTTP helpers (JSON posts, SSE parsing, metric scraping).

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_engine::testing::{tiny_model, FakeMoe, StepThrottle};
use ferry_engine::{
    start_model_with_connectors, AllowedPeers, Connector, EngineHandle, Executor, InMemoryFabric,
    InMemoryTransport, KvCacheSize, KvLoadFailurePolicy, LogprobsMode, ModelEngineConfig, PdConfig,
    PdRole, RoutingShape,
};
use ferry_server::{router, serve, ApiKey, ServerConfig};
use serde_json::Value;

pub const MODEL: &str = "tiny-test";
pub const MAX_MODEL_LEN: usize = 96;

#[derive(Debug, Clone)]
pub struct Options {
    pub chat_template: bool,
    pub queue_capacity: usize,
    pub step_delay: Duration,
    pub admin_api: bool,
    /// `ServerConfig::max_weight_push_bytes` (default: the server's default).
    pub max_weight_push_bytes: Option<usize>,
    /// `ServerConfig::api_key`.
    pub api_key: Option<String>,
    /// `ServerConfig::weight_upload_timeout` (default: the server's default).
    pub weight_upload_timeout: Option<Duration>,
    /// The engine's logprobs mode.
    pub logprobs_mode: LogprobsMode,
    /// `ServerConfig::max_top_logprobs` (default: the server's default).
    pub max_top_logprobs: Option<u32>,
    /// The allowed KV peers, of the server (`ServerConfig::kv_allowed_peers`) and of its P/D
    /// connector alike (default: loopback).
    pub kv_allowed_peers: AllowedPeers,
    /// `ServerConfig::reasoning_parser`.
    pub reasoning_parser: Option<ferry_server::reasoning::ReasoningParser>,
    /// The context length (default [`MAX_MODEL_LEN`]).
    pub max_model_len: Option<usize>,
    /// `--enable-auto-tool-choice --tool-call-parser NAME`.
    pub tool_call_parser: Option<ferry_server::tool_parsers::ToolCallParser>,
    /// The model routes tokens to experts and the engine captures it, as
    /// `--enable-return-routed-experts` on an MoE model: `testing::FakeMoe` of this shape.
    pub moe: Option<RoutingShape>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            chat_template: true,
            queue_capacity: 256,
            step_delay: Duration::ZERO,
            admin_api: false,
            max_weight_push_bytes: None,
            api_key: None,
            weight_upload_timeout: None,
            logprobs_mode: LogprobsMode::default(),
            max_top_logprobs: None,
            kv_allowed_peers: AllowedPeers::default(),
            reasoning_parser: None,
            tool_call_parser: None,
            max_model_len: None,
            moe: None,
        }
    }
}

/// A P/D role for [`start_with`]: a P/D connector over the in-memory transport, on `fabric`
/// (shared by the engines that transfer to each other).
pub struct Pd {
    pub engine_id: &'static str,
    pub role: PdRole,
    pub fabric: Arc<InMemoryFabric>,
    pub policy: KvLoadFailurePolicy,
}

pub struct Server {
    pub base: String,
    pub engine: EngineHandle,
    pub http: reqwest::Client,
    pub gate: Arc<Mutex<()>>,
    pub n_steps: Arc<AtomicUsize>,
    /// Set: the next step fails the engine with a double free (`StepThrottle::double_free`).
    pub double_free: Arc<AtomicBool>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

pub async fn start(opts: Options) -> Server {
    start_with(opts, None).await
}

/// [`start`], with a P/D connector when `pd` is given.
pub async fn start_with(opts: Options, pd: Option<Pd>) -> Server {
    let mut config = ModelEngineConfig {
        block_size: 4,
        kv_cache: KvCacheSize::Blocks(512),
        max_num_seqs: 32,
        max_num_batched_tokens: 512,
        max_model_len: Some(opts.max_model_len.unwrap_or(MAX_MODEL_LEN)),
        input_queue_capacity: opts.queue_capacity,
        logprobs_mode: opts.logprobs_mode,
        ..ModelEngineConfig::default()
    };
    let throttle = StepThrottle {
        delay: opts.step_delay,
        ..StepThrottle::default()
    };
    let mut model = tiny_model();
    if !opts.chat_template {
        model.chat_template = None;
    }
    let connectors = match &pd {
        None => Vec::new(),
        Some(pd) => {
            config.kv_load_failure_policy = pd.policy;
            let pd_config = PdConfig {
                role: pd.role,
                engine_id: pd.engine_id.to_owned(),
                host: Some("127.0.0.1".to_owned()),
                port: Some(1),
                secret: ferry_engine::random_secret(),
                block_size: config.block_size,
                allowed_peers: opts.kv_allowed_peers.clone(),
            };
            let transport = InMemoryTransport::new(pd.engine_id, pd.fabric.clone());
            vec![Connector::pd(pd_config, Arc::new(transport))]
        }
    };
    type Wrap = Box<dyn FnOnce(Box<dyn Executor>) -> Box<dyn Executor>>;
    let wrap: Wrap = match opts.moe {
        Some(shape) => Box::new(FakeMoe::wrap(shape, throttle.wrap())),
        None => Box::new(throttle.wrap()),
    };
    let started = start_model_with_connectors(model, &config, wrap, connectors).unwrap();
    let engine = started.handle;
    let defaults = ServerConfig::for_model(MODEL, &started.model);
    let server_config = ServerConfig {
        enable_admin_api: opts.admin_api,
        api_key: opts.api_key.map(|k| ApiKey::new(k).unwrap()),
        max_top_logprobs: opts.max_top_logprobs.unwrap_or(defaults.max_top_logprobs),
        max_weight_push_bytes: opts
            .max_weight_push_bytes
            .unwrap_or(ferry_server::DEFAULT_MAX_WEIGHT_PUSH_BYTES),
        kv_connector: pd.is_some(),
        kv_allowed_peers: opts.kv_allowed_peers.clone(),
        reasoning_parser: opts.reasoning_parser,
        tool_call_parser: opts.tool_call_parser,
        enable_auto_tool_choice: opts.tool_call_parser.is_some(),
        weight_upload_timeout: opts
            .weight_upload_timeout
            .unwrap_or(ferry_server::DEFAULT_WEIGHT_UPLOAD_TIMEOUT),
        ..defaults
    };
    let app = router(engine.clone(), server_config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, app, async move {
        let _ = rx.await;
    }));
    Server {
        base,
        engine,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
        gate: throttle.gate,
        n_steps: throttle.n_steps,
        double_free: throttle.double_free,
        shutdown: Some(tx),
    }
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` as JSON; the raw response.
    pub async fn send_post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// GETs `path`; the raw response.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(self.url(path)).send().await.unwrap()
    }

    /// GETs `path`; its JSON body.
    pub async fn get_json(&self, path: &str) -> Value {
        self.get(path).await.json().await.unwrap()
    }

    /// POSTs `body` from a task of its own (so the test can go on while it waits); the task
    /// returns the status.
    pub fn spawn_post(&self, path: &str, body: &Value) -> tokio::task::JoinHandle<u16> {
        let request = self.http.post(self.url(path)).json(body);
        tokio::spawn(async move { request.send().await.unwrap().status().as_u16() })
    }

    /// POSTs `body`; returns the status and the JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.send_post(path, body).await;
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, json)
    }

    /// POSTs `body`, expecting 200.
    pub async fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, json) = self.post(path, body).await;
        assert_eq!(status, 200, "{json}");
        json
    }

    /// POSTs a streaming request; returns the data events (JSON), checking the `[DONE]` end.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let resp = self.send_post(path, body).await;
        assert_eq!(resp.status().as_u16(), 200);
        let ctype = resp.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(ctype.starts_with("text/event-stream"), "{ctype}");
        parse_sse(&resp.text().await.unwrap())
    }

    /// Expects a 400 (or `status`) whose error names `param`.
    pub async fn expect_error(&self, path: &str, body: &Value, status: u16, param: Option<&str>) {
        let (got, json) = self.post(path, body).await;
        assert_eq!(got, status, "{body} -> {json}");
        let err = &json["error"];
        assert_eq!(err["param"].as_str(), param, "{body} -> {json}");
        assert!(!err["message"].as_str().unwrap().is_empty());
        assert_eq!(err["code"].as_u64(), Some(u64::from(status)));
        if status == 400 {
            assert_eq!(err["type"], "invalid_request_error");
        }
    }

    /// Sends `req`; returns the status and the JSON body (`null` for an empty body).
    pub async fn send_json(&self, req: reqwest::RequestBuilder) -> (u16, Value) {
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        if text.is_empty() {
            return (status, Value::Null);
        }
        let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, json)
    }

    /// POSTs to an admin route with no body (arguments in the query string).
    pub async fn admin(&self, path_and_query: &str) -> (u16, Value) {
        self.send_json(self.http.post(self.url(path_and_query)))
            .await
    }

    pub async fn metrics(&self) -> String {
        self.get("/metrics").await.text().await.unwrap()
    }
}

/// The `data:` payloads of an SSE body; the last must be `[DONE]` (dropped from the result).
pub fn parse_sse(body: &str) -> Vec<Value> {
    let data: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"))
        })
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// A sample's value in Prometheus text (`name` includes any labels).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == name).then(|| v.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// A streamed request's usage (`streamed`) against the same request's non-streaming usage
/// (`full`), run first: the same counts, except that the second run found the prompt in the
/// prefix cache (all but the last token, which is always computed, rounded down to whole
/// blocks of 4).
pub fn assert_usage_after_cached_rerun(streamed: &Value, full: &Value) {
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(streamed[k], full[k], "{k}");
    }
    assert_eq!(full["prompt_tokens_details"]["cached_tokens"], 0);
    let n_prompt = full["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        streamed["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((n_prompt - 1) / 4 * 4)
    );
}

/// Token ids of a JSON array.
pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}
