//! `ferry proxy`: one OpenAI endpoint in front of prefill and decode servers (P/D
//! disaggregation), or of plain instances; the proxy itself is `ferry_proxy`. Here only the flags are checked and
//! turned into a [`ProxyConfig`].

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use ferry_cli::RoutingArg;
use ferry_proxy::{InstanceKey, ProxyConfig, Routing};
use ferry_server::ApiKey;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of a prefill server (`ferry serve --kv-role kv_producer`), e.g.
    /// `http://127.0.0.1:8100`; repeat the flag or give several for more.
    #[arg(long, required_unless_present = "instance", num_args = 1..)]
    pub prefill: Vec<String>,
    /// Base URL of a decode server (`ferry serve --kv-role kv_consumer`); repeat or give
    /// several for more.
    #[arg(long, required_unless_present = "instance", num_args = 1..)]
    pub decode: Vec<String>,
    /// Base URL of a plain server (no --kv-role), which computes whole requests; repeat or
    /// give several. Instead of --prefill and --decode.
    #[arg(long, num_args = 1.., conflicts_with_all = ["prefill", "decode"])]
    pub instance: Vec<String>,
    /// How to pick an instance: `kv` (the one holding the longest prefix of the prompt, by
    /// the instances' KV events, weighed against its load; an instance that publishes no
    /// events is routed by load), `least-loaded` or `round-robin`. With P/D, P is picked by
    /// prefix and D by load.
    #[arg(long, value_enum, default_value = "kv")]
    pub routing: RoutingArg,
    /// With `--routing kv`: the cost of a block to prefill against a block in flight
    /// (Dynamo's `overlap_weight × prefill blocks + decode blocks`).
    #[arg(long, default_value_t = 1.0)]
    pub router_overlap_weight: f64,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Mount the lifecycle admin API, each call fanned out to every instance (they need
    /// --enable-admin-api too). Bind the proxy to a trusted network only.
    #[arg(long)]
    pub enable_admin_api: bool,
    /// Require `Authorization: Bearer <key>` from clients on every route but /health and
    /// /metrics. Prefer the environment variable: a flag shows in the process list.
    #[arg(long, env = "FERRY_API_KEY", hide_env_values = true)]
    pub api_key: Option<ApiKey>,
    /// The key the proxy sends to the instances (their --api-key).
    #[arg(long, env = "FERRY_INSTANCE_API_KEY", hide_env_values = true)]
    pub instance_api_key: Option<InstanceKey>,
    /// Seconds to open a connection to an instance before it counts as down.
    #[arg(long, default_value_t = 2.0)]
    pub connect_timeout_seconds: f64,
    /// Seconds to wait for a prefill server's one-token answer.
    #[arg(long, default_value_t = 300.0)]
    pub prefill_timeout_seconds: f64,
    /// Seconds to wait for each instance's answer to an admin call (a draining pause, a
    /// weight reload).
    #[arg(long, default_value_t = 600.0)]
    pub admin_timeout_seconds: f64,
    /// Seconds a streamed answer from an instance may stay silent before the client gets an
    /// error event naming it (a cut link leaves the connection open and quiet; `ferry serve`
    /// sends a keep-alive comment every 2 s of silence, also while paused). A non-streamed
    /// answer over a link that died fails (502) within about as long: TCP keep-alive probes,
    /// which a live instance's kernel answers whatever it computes. 0: neither bound (for
    /// instances that send no keep-alives through long pauses).
    #[arg(long, default_value_t = 30.0)]
    pub stream_idle_timeout_seconds: f64,
}

fn seconds(value: f64, flag: &str) -> anyhow::Result<Duration> {
    if !(value.is_finite() && value > 0.0 && value <= 86_400.0) {
        bail!("{flag} must be between 0 and 86400 seconds, got {value}");
    }
    Ok(Duration::from_secs_f64(value))
}

/// An instance's base URL, checked: `http://host:port` with no path, query or credentials.
fn instance_url(raw: &str, flag: &str) -> anyhow::Result<String> {
    let url = reqwest::Url::parse(raw).with_context(|| format!("{flag} {raw:?} is not a URL"))?;
    if url.scheme() != "http" {
        bail!("{flag} {raw:?}: only http:// URLs are supported");
    }
    if url.host_str().is_none() || url.cannot_be_a_base() {
        bail!("{flag} {raw:?} has no host");
    }
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        bail!("{flag} {raw:?}: give the server's base URL (http://host:port), without a path");
    }
    if !url.username().is_empty() || url.password().is_some() {
        bail!("{flag} {raw:?}: credentials go in --instance-api-key, not the URL");
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

fn config(args: &Args) -> anyhow::Result<ProxyConfig> {
    let urls = |raw: &[String], flag: &str| -> anyhow::Result<Vec<String>> {
        let urls = raw
            .iter()
            .map(|u| instance_url(u, flag))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(urls)
    };
    let prefill = urls(&args.prefill, "--prefill")?;
    let decode = urls(&args.decode, "--decode")?;
    let instances = urls(&args.instance, "--instance")?;
    let mut seen = std::collections::BTreeSet::new();
    for url in prefill.iter().chain(&decode).chain(&instances) {
        if !seen.insert(url) {
            bail!(
                "{url} is given twice (--prefill/--decode/--instance): each instance has one role"
            );
        }
    }
    let w = args.router_overlap_weight;
    if !(w.is_finite() && w >= 0.0) {
        bail!("--router-overlap-weight must be a number of at least 0, got {w}");
    }
    let routing = match args.routing {
        RoutingArg::Kv => Routing::Kv { overlap_weight: w },
        RoutingArg::LeastLoaded => Routing::LeastLoaded,
        RoutingArg::RoundRobin => Routing::RoundRobin,
    };
    Ok(ProxyConfig {
        enable_admin_api: args.enable_admin_api,
        api_key: args.api_key.clone(),
        instance_api_key: args.instance_api_key.clone(),
        connect_timeout: seconds(args.connect_timeout_seconds, "--connect-timeout-seconds")?,
        prefill_timeout: seconds(args.prefill_timeout_seconds, "--prefill-timeout-seconds")?,
        admin_timeout: seconds(args.admin_timeout_seconds, "--admin-timeout-seconds")?,
        stream_idle_timeout: match args.stream_idle_timeout_seconds {
            0.0 => None,
            t => Some(seconds(t, "--stream-idle-timeout-seconds")?),
        },
        instances,
        routing,
        ..ProxyConfig::new(prefill, decode)
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = config(&args)?;
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("--host {:?} --port {}", args.host, args.port))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let (n_prefill, n_decode) = (config.prefill.len(), config.decode.len());
        let n_instances = config.instances.len();
        let routing = config.routing;
        let admin = config.enable_admin_api;
        let keyed = config.api_key.is_some();
        let router = ferry_proxy::router(config)?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        if admin && !keyed {
            tracing::warn!(
                "the lifecycle admin API is on (--enable-admin-api): any client that reaches \
                 this proxy can pause every instance and replace their weights"
            );
        }
        tracing::info!(
            n_prefill,
            n_decode,
            n_instances,
            ?routing,
            "proxy serving on http://{}",
            listener.local_addr()?
        );
        ferry_proxy::serve(listener, router, crate::serve::shutdown_signal())
            .await
            .context("HTTP server")?;
        tracing::info!("stopped");
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_urls_are_base_urls() {
        assert_eq!(
            instance_url("http://127.0.0.1:8100/", "--prefill").unwrap(),
            "http://127.0.0.1:8100"
        );
        for bad in [
            "127.0.0.1:8100",
            "https://h:1",
            "http://h:1/v1",
            "http://u:p@h:1",
            "x",
        ] {
            let err = instance_url(bad, "--decode").unwrap_err().to_string();
            assert!(err.contains("--decode"), "{bad}: {err}");
        }
    }
}
