//! P/D with `--kv-transport nixl` (a build with the `nixl` feature, after
//! `scripts/fetch-nixl.sh`): `ferry serve --model tiny` processes on loopback, each with its one
//! NIXL agent, reading KV one-sided over UCX on TCP (`UCX_TLS=tcp,self`, as between machines
//! without RDMA). Greedy tokens and logprobs equal the TCP transport's and a single engine's;
//! an expired export fails closed; a P killed while D loads loses no request under `recompute`;
//! the RL loop of the defaults issue loses nothing, with its clearing pauses as fast as with
//! TCP; and the transport's start-up errors name what is missing.
//!
//! NIXL's agents live in the servers, one per process, so the tests need no lock for NIXL;
//! they run one at a time anyway (each starts several servers on few cores).

#[allow(dead_code)] // Shared with the proxy tests; not every helper is used here.
#[path = "proxy/procs.rs"]
mod procs;
#[path = "rl_loop/common.rs"]
mod rl_loop;

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use procs::{Proc, FERRY};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn bounded<F: std::future::Future<Output = ()>>(bound: Duration, body: F) {
    let _turn = SERIAL.lock().await;
    tokio::time::timeout(bound, body)
        .await
        .expect("the test ran past its bound");
}

const SECRET: &str = "pd-nixl-test-fleet-secret";

/// The environment of every server: the fleet secret and UCX over TCP.
const ENV: &[(&str, &str)] = &[
    ("FERRY_KV_TRANSFER_SECRET", SECRET),
    ("UCX_TLS", "tcp,self"),
];

/// NIXL's libraries, where scripts/fetch-nixl.sh puts them (and ferry looks by default).
fn nixl_lib_dir() -> std::path::PathBuf {
    let cache = std::env::var_os("FERRY_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(&std::env::var_os("HOME").expect("HOME")).join(".cache/ferry")
        });
    let dir = cache.join("nixl/1.5.1/lib");
    assert!(
        dir.join("libnixl_capi.so").is_file(),
        "{} has no libnixl_capi.so: run scripts/fetch-nixl.sh first",
        dir.display()
    );
    dir
}

/// `ferry serve --model tiny --kv-role <role>` with `transport` and `extra`.
fn server(role: &str, transport: &str, extra: &[&str]) -> procs::Starting {
    let mut args = vec!["--kv-role", role, "--kv-transport", transport];
    args.extend_from_slice(extra);
    procs::serve_env(&args, ENV)
}

struct Fleet {
    proxy: Proc,
    p: Proc,
    d: Proc,
}

fn fleet(transport: &str, p_extra: &[&str], d_extra: &[&str]) -> Fleet {
    let (p, d) = (
        server("kv_producer", transport, p_extra),
        server("kv_consumer", transport, d_extra),
    );
    let (p, d) = (p.ready(), d.ready());
    let proxy = procs::proxy(&[&p.url], &[&d.url], &[]).ready();
    Fleet { proxy, p, d }
}

async fn metric(base: &str, name: &str) -> f64 {
    procs::metric(&procs::metrics_text(base).await, name)
}

/// Several blocks of prompt (the tiny model's blocks are 16 tokens), different per `i`.
fn long_prompt(i: usize) -> String {
    format!(
        "Request {i}. {}",
        "The ferry crossed the wide river at dawn, carrying twelve cars and a dog. ".repeat(3 + i)
    )
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true, "logprobs": 1})
}

/// Token ids and their logprobs, what must be equal between transports.
fn tokens_and_logprobs(out: &Value) -> (Value, Value) {
    let choice = &out["choices"][0];
    (
        choice["token_ids"].clone(),
        choice["logprobs"]["token_logprobs"].clone(),
    )
}

/// P's export of `body`, asked as the proxy does.
async fn export(p: &Proc, body: &Value) -> Value {
    let mut ask = body.clone();
    ask["max_tokens"] = json!(1);
    ask["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, out) = procs::post(&procs::url(&p.url, "/v1/completions"), &ask).await;
    assert_eq!(status, 200, "{out}\n{}", p.log_tail(20));
    out["kv_transfer_params"].clone()
}

fn with_params(body: &Value, params: &Value) -> Value {
    let mut body = body.clone();
    body["kv_transfer_params"] = params.clone();
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_over_nixl_equal_tcp_and_a_single_engine() {
    bounded(Duration::from_secs(180), async {
        let _ = nixl_lib_dir();
        let nixl = fleet("nixl", &[], &[]);
        let tcp = fleet("tcp", &[], &[]);
        let single = procs::serve(&[]).ready();
        let url = |base: &str| procs::url(base, "/v1/completions");
        // Six reads at once from a fresh D: they all begin before D holds P's metadata.
        let concurrent: Vec<_> = (0..6)
            .map(|i| {
                let (target, body) = (url(&nixl.proxy.url), completion(&long_prompt(i), 12));
                tokio::spawn(async move { procs::post(&target, &body).await })
            })
            .collect();
        let mut over_nixl = Vec::new();
        for task in concurrent {
            over_nixl.push(task.await.unwrap());
        }
        for (i, (s1, over_nixl)) in over_nixl.iter().enumerate() {
            let body = completion(&long_prompt(i), 12);
            let (s2, over_tcp) = procs::post(&url(&tcp.proxy.url), &body).await;
            let (s3, alone) = procs::post(&url(&single.url), &body).await;
            assert_eq!(
                (*s1, s2, s3),
                (200, 200, 200),
                "{over_nixl}\n{over_tcp}\n{alone}"
            );
            let reference = tokens_and_logprobs(&alone);
            assert_eq!(
                tokens_and_logprobs(over_nixl),
                reference,
                "prompt {i} over NIXL"
            );
            assert_eq!(
                tokens_and_logprobs(&over_tcp),
                reference,
                "prompt {i} over TCP"
            );
        }
        // Sleep gives the KV arenas back and waking allocates new ones: P registers the new
        // memory under a new metadata generation, D loads it, and reads go on.
        for call in ["/sleep?level=1&mode=wait", "/wake_up"] {
            let (status, out) = procs::post(&procs::url(&nixl.proxy.url, call), &json!(null)).await;
            assert_eq!(status, 200, "{call}: {out}");
        }
        let body = completion(&long_prompt(7), 12);
        let (status, after) = procs::post(&url(&nixl.proxy.url), &body).await;
        assert_eq!(status, 200, "after the arenas were reallocated: {after}");
        let (_, alone) = procs::post(&url(&single.url), &body).await;
        assert_eq!(tokens_and_logprobs(&after), tokens_and_logprobs(&alone));
        // The KV crossed by NIXL: D loaded every prompt, and no load failed.
        let loads = metric(&nixl.d.url, "ferry_kv_loads_finished_total").await;
        let failed = metric(&nixl.d.url, "ferry_kv_loads_failed_total").await;
        assert!(
            loads >= 7.0 && failed == 0.0,
            "loads {loads}, failed {failed}\n{}",
            nixl.d.log_tail(20)
        );
        let pulled = metric(&nixl.p.url, "ferry_kv_exports_pulled_total").await;
        assert!(pulled >= 7.0, "P's exports pulled: {pulled}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_export_fails_closed_and_p_frees_its_blocks() {
    bounded(Duration::from_secs(120), async {
        let _ = nixl_lib_dir();
        let p = server("kv_producer", "nixl", &["--kv-lease-seconds", "1"]).ready();
        let d = server("kv_consumer", "nixl", &[]).ready();
        let body = completion(&long_prompt(1), 8);
        let params = export(&p, &body).await;
        assert_eq!(metric(&p.url, "ferry_kv_exports_started_total").await, 1.0);
        // The lease runs out before D asks: D's read is refused before any address is handed
        // out, and under the default `fail` the request says why.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let (status, out) = procs::post(
            &procs::url(&d.url, "/v1/completions"),
            &with_params(&body, &params),
        )
        .await;
        let text = out.to_string();
        assert!(status != 200 || text.contains("error"), "{status} {text}");
        assert!(text.contains("lease"), "the error names the lease: {text}");
        assert_eq!(metric(&p.url, "ferry_kv_exports_expired_total").await, 1.0);
        assert_eq!(metric(&d.url, "ferry_kv_loads_finished_total").await, 0.0);
        // Both free every block (D's failed request lets its blocks go a step after its answer).
        for base in [&p.url, &d.url] {
            procs::wait_metrics(base, Duration::from_secs(10), |t| {
                procs::metric(t, "ferry_kv_blocks_used") == 0.0
            })
            .await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_killed_while_d_loads_loses_no_request_under_recompute() {
    bounded(Duration::from_secs(120), async {
        let _ = nixl_lib_dir();
        let mut p = server("kv_producer", "nixl", &[]).ready();
        let d = server(
            "kv_consumer",
            "nixl",
            &[
                "--kv-load-failure-policy",
                "recompute",
                "--kv-load-timeout-seconds",
                "10",
            ],
        )
        .ready();
        let bodies: Vec<Value> = (0..8).map(|i| completion(&long_prompt(i), 6)).collect();
        let mut params = Vec::new();
        for body in &bodies {
            params.push(export(&p, body).await);
        }
        // Every load starts, and P dies under them: some read, some find P gone.
        let loads: Vec<_> = bodies
            .iter()
            .zip(&params)
            .map(|(body, params)| {
                let (url, body) = (
                    procs::url(&d.url, "/v1/completions"),
                    with_params(body, params),
                );
                tokio::spawn(async move { procs::post(&url, &body).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
        p.kill();
        let mut answers = Vec::new();
        for load in loads {
            answers.push(load.await.unwrap());
        }
        for (i, (body, (status, out))) in bodies.iter().zip(&answers).enumerate() {
            assert_eq!(*status, 200, "request {i}: {out}");
            let (s, alone) = procs::post(&procs::url(&d.url, "/v1/completions"), body).await;
            assert_eq!(s, 200);
            assert_eq!(
                tokens_and_logprobs(out),
                tokens_and_logprobs(&alone),
                "request {i}"
            );
        }
        let d_text = procs::wait_metrics(&d.url, Duration::from_secs(10), |t| {
            procs::metric(t, "ferry_kv_blocks_used") == 0.0
        })
        .await;
        let started = procs::metric(&d_text, "ferry_kv_loads_started_total");
        let ended = procs::metric(&d_text, "ferry_kv_loads_finished_total")
            + procs::metric(&d_text, "ferry_kv_loads_failed_total");
        assert_eq!(started, ended, "every load ended\n{d_text}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rl_loop_over_nixl_loses_nothing_and_pauses_as_fast_as_tcp() {
    bounded(Duration::from_secs(400), async {
        let _ = nixl_lib_dir();
        let tcp = rl_loop::run_rl_loop(&[], ENV).await;
        let nixl = rl_loop::run_rl_loop(&["--kv-transport", "nixl"], ENV).await;
        assert!(nixl.d_loads > 0.0, "D loaded over NIXL: {nixl:?}");
        let p90 = |pauses: &[Duration]| {
            let mut sorted = pauses.to_vec();
            sorted.sort();
            sorted[sorted.len() * 9 / 10]
        };
        let (tcp_p90, nixl_p90) = (p90(&tcp.keep_pauses), p90(&nixl.keep_pauses));
        eprintln!(
            "clearing keep pauses, p90: TCP {tcp_p90:?}, NIXL {nixl_p90:?} ({} and {} requests, \
             {} and {} loads)",
            tcp.n_sent, nixl.n_sent, tcp.d_loads, nixl.d_loads
        );
        // As fast as TCP: within twice TCP's p90 and 100 ms of scheduling noise, far below
        // the 5 s read timeout a pause could wait for a read in flight.
        assert!(
            nixl_p90 <= tcp_p90 * 2 + Duration::from_millis(100),
            "NIXL's pause p90 {nixl_p90:?} against TCP's {tcp_p90:?}"
        );
    })
    .await;
}

#[test]
fn nixl_needs_the_fleet_secret_and_finds_a_missing_library_at_start() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = Command::new(FERRY);
        command
            .args([
                "serve",
                "--model",
                "tiny",
                "--port",
                "0",
                "--kv-role",
                "kv_producer",
            ])
            .args(["--kv-transport", "nixl"])
            .args(args)
            .env_remove("FERRY_KV_TRANSFER_SECRET")
            .env("RUST_BACKTRACE", "0");
        for (k, v) in env {
            command.env(k, v);
        }
        let out = command.output().unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&[], &[]);
    assert!(e.contains("needs the fleet secret"), "{e}");
    let e = run(
        &["--nixl-lib-dir", "/nonexistent/nixl"],
        &[("FERRY_KV_TRANSFER_SECRET", SECRET)],
    );
    assert!(
        e.contains("/nonexistent/nixl/libnixl_capi.so does not exist"),
        "{e}"
    );
    assert!(e.contains("fetch-nixl.sh"), "{e}");
    // A folder without NIXL and no library on the usual path: an error, not the stub's abort.
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("libnixl_capi.so"), b"not a library").unwrap();
    let e = run(
        &["--nixl-lib-dir", empty.path().to_str().unwrap()],
        &[("FERRY_KV_TRANSFER_SECRET", SECRET)],
    );
    assert!(
        e.contains("loading") && e.contains("libnixl_capi.so"),
        "{e}"
    );
}
