//! The processes a matrix runs on: one P, one D and the proxy in front (a *trio*), started
//! once per setup (model, offload tier on or off) and reused case after case; the check that a
//! trio is back to a clean state (every engine idle, resumed, awake, every KV block free);
//! and admin calls timed against their bounds.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::procs::{self, metric, metrics_text, Proc};

/// Which model the trio serves.
#[derive(Debug, Clone)]
pub enum Model {
    /// The built-in random-weight model: fast, so the whole matrix runs on it.
    Tiny,
    /// SmolLM2-135M-Instruct (a GGUF file scripts/fetch-model.sh fetches).
    Default(PathBuf),
    /// A random-weight Qwen3-MoE (`ferry make-model moe`: 8 experts, top-3, a dense layer
    /// among its MoE ones) with the tiny model's tokenizer, about as fast as tiny.
    Moe,
}

impl Model {
    pub fn served_name(&self) -> &'static str {
        match self {
            Model::Tiny => "tiny",
            Model::Default(_) => "smol",
            Model::Moe => "moe",
        }
    }

    pub fn label(&self) -> &'static str {
        match self {
            Model::Tiny => "tiny",
            Model::Default(_) => "SmolLM2-135M",
            Model::Moe => "Qwen3-MoE (random)",
        }
    }

    /// Where an in-place reload reads the same weights from.
    pub fn reload_path(&self) -> String {
        match self {
            Model::Tiny => tiny_folder().display().to_string(),
            Model::Default(path) => path.display().to_string(),
            Model::Moe => moe_folder().display().to_string(),
        }
    }

    /// A small random-weight model, fast enough for every case (tiny, or the MoE one).
    pub fn is_small(&self) -> bool {
        !matches!(self, Model::Default(_))
    }
}

/// The tiny model written once as a Hugging Face folder (`ferry make-model tiny`), for
/// reloads from disk.
fn tiny_folder() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| made_folder("matrix-tiny-model", &["tiny"]))
        .clone()
}

/// The MoE model written once as a Hugging Face folder (`ferry make-model moe`), which the
/// trio serves and reloads from.
fn moe_folder() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| made_folder("matrix-moe-model", &["moe", "--arch", "qwen3_moe"]))
        .clone()
}

/// `ferry make-model ARGS` into a folder of the test target's temporary directory.
fn made_folder(name: &str, args: &[&str]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    procs::make_model(args, &dir);
    dir
}

/// D's `--kv-load-failure-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// No flag: `fail`, every flag at its default. A load the lifecycle retracted (an export
    /// P's reset revoked, one of other weights, a load D's reset cut short, a lease that ran
    /// out behind a pause) still never fails a request; only a fault would.
    Default,
    /// `--kv-load-failure-policy recompute`: a fault too is recomputed.
    Recompute,
}

impl Policy {
    pub fn label(self) -> &'static str {
        match self {
            Policy::Default => "fail (default)",
            Policy::Recompute => "recompute",
        }
    }
}

/// A model, whether the offload tier is on (on P and D both), and D's load-failure policy.
#[derive(Debug, Clone)]
pub struct Setup {
    pub model: Model,
    pub tier: bool,
    pub policy: Policy,
}

impl Setup {
    /// P's export lease: short, so exports that no D will pull (a client that left before D
    /// was called, a D request aborted before its load) come back within a case's drain, yet
    /// longer than the bound on a cache-clearing call, so a reset that waited for a lease
    /// instead of revoking the export would miss its bound.
    pub fn lease_seconds(&self) -> u64 {
        match self.model {
            Model::Tiny | Model::Moe => 2,
            Model::Default(_) => 10,
        }
    }

    pub fn tier_label(&self) -> &'static str {
        if self.tier {
            "on"
        } else {
            "off"
        }
    }

    /// The tier and the policy, for request ids and weight versions (two trios may run at
    /// once).
    pub fn id_label(&self) -> String {
        match self.policy {
            Policy::Default => self.tier_label().to_owned(),
            Policy::Recompute => format!("{}-recompute", self.tier_label()),
        }
    }

    /// `ferry serve` for `role` (`None`: the plain reference engine, no tier).
    pub fn serve_args(&self, role: Option<&str>) -> Vec<String> {
        let (model, cache, len) = match &self.model {
            Model::Tiny => ("tiny".to_owned(), "16MiB", "2048"),
            Model::Moe => (moe_folder().display().to_string(), "16MiB", "2048"),
            Model::Default(path) => (path.display().to_string(), "64MiB", "256"),
        };
        let mut args: Vec<String> = [
            "serve",
            "--model",
            &model,
            "--served-model-name",
            self.model.served_name(),
            "--port",
            "0",
            "--enable-admin-api",
            "--kv-cache-bytes",
            cache,
            "--max-model-len",
            len,
        ]
        .map(str::to_owned)
        .to_vec();
        if matches!(self.model, Model::Moe) {
            // Routing rides in the KV blocks: every case moves, offloads and resets it too.
            args.push("--enable-return-routed-experts".to_owned());
        }
        let lease = self.lease_seconds().to_string();
        let extra: &[&str] = match role {
            None => &[],
            Some("kv_producer") => &["--kv-role", "kv_producer", "--kv-lease-seconds", &lease],
            // A bounded batch on D keeps some requests queued there (their loads not started,
            // or landed and waiting), the states a reset must recompute. Exports P's reset
            // revokes are recomputed under either policy, never a failed request.
            Some(_) => &["--kv-role", "kv_consumer", "--max-num-seqs", "4"],
        };
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        if role == Some("kv_consumer") && self.policy == Policy::Recompute {
            args.extend(["--kv-load-failure-policy", "recompute"].map(str::to_owned));
        }
        if self.tier && role.is_some() {
            // Small enough that the tier evicts within a run.
            args.extend(["--kv-offload-bytes", "2MiB"].map(str::to_owned));
        }
        args
    }
}

/// One P, one D, the proxy.
pub struct Trio {
    pub p: Proc,
    pub d: Proc,
    pub proxy: Proc,
}

impl Trio {
    pub fn start(setup: &Setup) -> Trio {
        let p = procs::spawn(&setup.serve_args(Some("kv_producer")), &[]);
        let d = procs::spawn(&setup.serve_args(Some("kv_consumer")), &[]);
        let (p, d) = (p.ready(), d.ready());
        let proxy = procs::proxy(&[&p.url], &[&d.url], &[]).ready();
        Trio { p, d, proxy }
    }

    pub fn url(&self, target: Target) -> &str {
        match target {
            Target::P => &self.p.url,
            Target::D => &self.d.url,
            Target::Both => &self.proxy.url,
        }
    }

    /// The last lines of P's and D's logs, for a failure's message.
    pub fn log_tail(&self) -> String {
        let tail = |log: String| {
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        };
        format!(
            "P log:\n{}\nD log:\n{}",
            tail(self.p.log()),
            tail(self.d.log())
        )
    }

    /// Waits (at most `within`) until the trio is clean: the proxy has nothing in flight, and
    /// each engine runs nothing, queues nothing, is resumed and awake, and has every KV block
    /// free (`ferry_kv_blocks_used` counts blocks a request or a transfer holds; cached
    /// blocks with no holder are free, so free is total less the null block).
    pub async fn wait_clean(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let state = self.dirt().await;
            let Some(dirt) = state else { return };
            assert!(
                Instant::now() < deadline,
                "the trio was not clean {} s after the case: {dirt}\n{}",
                within.as_secs(),
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What is not clean yet, if anything.
    async fn dirt(&self) -> Option<String> {
        let proxy = metrics_text(&self.proxy.url).await;
        let in_flight = metric(&proxy, "ferry_proxy_in_flight_requests");
        if in_flight != 0.0 {
            return Some(format!("the proxy has {in_flight} requests in flight"));
        }
        for (name, base) in [("P", &self.p.url), ("D", &self.d.url)] {
            let m = metrics_text(base).await;
            let running = metric(&m, "ferry_num_requests_running");
            let waiting = metric(&m, "ferry_num_requests_waiting");
            let used = metric(&m, "ferry_kv_blocks_used");
            let free = metric(&m, "ferry_kv_blocks_free");
            let total = metric(&m, "ferry_kv_blocks_total");
            if running + waiting != 0.0 || used != 0.0 || free + 1.0 != total {
                return Some(format!(
                    "{name}: {running} running, {waiting} waiting, KV blocks {used} used, \
                     {free} free of {total}"
                ));
            }
            let (_, paused) = procs::get(&format!("{base}/is_paused")).await;
            let (_, sleeping) = procs::get(&format!("{base}/is_sleeping")).await;
            if paused["is_paused"] != false || sleeping["is_sleeping"] != false {
                return Some(format!("{name}: {paused} {sleeping}"));
            }
        }
        None
    }
}

/// Where an admin call goes: one engine directly, or both through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    P,
    D,
    Both,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::P => "P",
            Target::D => "D",
            Target::Both => "both",
        }
    }

    pub fn includes_d(self) -> bool {
        matches!(self, Target::D | Target::Both)
    }

    pub fn includes_p(self) -> bool {
        matches!(self, Target::P | Target::Both)
    }
}

/// An admin call's answer and how long it took.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    /// Milliseconds, to a tenth.
    pub ms: f64,
}

/// `POST base+path` with an optional JSON body, timed.
pub async fn admin_post(base: &str, path: &str, body: Option<&Value>) -> Reply {
    let started = Instant::now();
    let (status, body, _) =
        procs::call(reqwest::Method::POST, &format!("{base}{path}"), body, &[]).await;
    Reply {
        status,
        body,
        ms: millis(started.elapsed()),
    }
}

/// A duration in milliseconds, to a tenth (loopback replies take well under one).
pub fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}

/// The transfer and tier counters a case moves, as (name in the summary, engine, metric).
const COUNTERS: [(&str, Engine, &str); 10] = [
    (
        "p_exports_started",
        Engine::P,
        "ferry_kv_exports_started_total",
    ),
    (
        "p_exports_pulled",
        Engine::P,
        "ferry_kv_exports_pulled_total",
    ),
    (
        "p_exports_expired",
        Engine::P,
        "ferry_kv_exports_expired_total",
    ),
    ("d_loads_started", Engine::D, "ferry_kv_loads_started_total"),
    ("d_loads_landed", Engine::D, "ferry_kv_loads_finished_total"),
    ("d_loads_failed", Engine::D, "ferry_kv_loads_failed_total"),
    ("preemptions", Engine::Both, "ferry_preemptions_total"),
    ("tier_stores", Engine::Both, "ferry_kv_offload_stores_total"),
    ("tier_loads", Engine::Both, "ferry_kv_offload_loads_total"),
    (
        "tier_flushes",
        Engine::Both,
        "ferry_kv_offload_flushes_total",
    ),
];

#[derive(Debug, Clone, Copy)]
enum Engine {
    P,
    D,
    Both,
}

/// The counters' values now.
pub type Counters = BTreeMap<&'static str, f64>;

impl Trio {
    pub async fn counters(&self) -> Counters {
        let p = metrics_text(&self.p.url).await;
        let d = metrics_text(&self.d.url).await;
        COUNTERS
            .iter()
            .map(|&(name, engine, metric_name)| {
                let v = match engine {
                    Engine::P => metric(&p, metric_name),
                    Engine::D => metric(&d, metric_name),
                    Engine::Both => metric(&p, metric_name) + metric(&d, metric_name),
                };
                (name, v)
            })
            .collect()
    }
}
