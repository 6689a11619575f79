//! vLLM's router (`vllm-router` from PyPI, pinned to [`VERSION`]) in front of unchanged `ferry
//! serve` processes at their shipped defaults, the router at its own but for the mode:
//!
//! * `--policy consistent_hash`: the turns of a session named by `X-Session-ID` (the router's
//!   first hash key) all land on one instance and find the conversation so far cached there,
//!   and every turn's greedy tokens are one engine's;
//! * `--vllm-pd-disaggregation --prefill P --decode D`: the router sends the request to P with
//!   `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true, ...}`, then to D with
//!   P's returned `kv_transfer_params`, as vLLM's NIXL handshake; completions and chat,
//!   streaming and not, give one engine's tokens and logprobs, and D loaded every prompt's KV
//!   from P (`ferry_kv_loads_finished_total`, none failed: D's default policy is `fail`).
//!
//! The router is a Python package with a Rust extension; `scripts/test.sh` installs it with
//! [`INSTALL`] when it is missing. Without it these tests fail, naming that command.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::procs::*;
use super::{bounded, chat};

/// The vllm-router release these tests pin (scripts/test.sh installs the same).
pub const VERSION: &str = "0.1.17";

/// How to install it.
pub const INSTALL: &str = "python3 -m pip install vllm-router==0.1.17";

/// `python3`'s own executable, once it imports vllm-router [`VERSION`]: the router runs as
/// `EXECUTABLE -m vllm_router.launch_router` (what the package's `vllm-router` script runs),
/// so it is this test's child, not a wrapper's (a pyenv shim, a venv's script), and needs no
/// scripts directory on `PATH`. Panics naming [`INSTALL`] when it is missing or another
/// version.
fn router_python() -> String {
    let probe = "import sys, vllm_router; print(sys.executable); print(vllm_router.__version__)";
    let out = Command::new("python3")
        .args(["-c", probe])
        .output()
        .unwrap_or_else(|e| {
            panic!("python3 could not be run ({e}); vllm-router {VERSION} needs it: `{INSTALL}`")
        });
    assert!(
        out.status.success(),
        "vllm-router is not installed for python3 (scripts/test.sh installs it): run \
         `{INSTALL}`\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let (executable, version) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    assert_eq!(
        version, VERSION,
        "python3 has vllm-router {version}, these tests pin {VERSION}: run `{INSTALL}`"
    );
    executable.to_owned()
}

/// A port nothing listens on now (the kernel's pick, handed back).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A running vllm-router, killed when dropped; a test that panics while it runs prints the
/// router's log.
struct Router {
    child: Child,
    url: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Router {
    /// Starts the router on loopback (a free port, and another for its Prometheus listener,
    /// which it opens by default on 29000) with `args`, and waits (at most 60 s) until its
    /// `/health` answers 200: every worker it was given is healthy.
    async fn start(args: &[&str]) -> Router {
        let (port, prometheus) = (free_port().to_string(), free_port().to_string());
        let mut child = Command::new(router_python())
            .args(["-m", "vllm_router.launch_router", "--host", "127.0.0.1"])
            .args(["--port", &port, "--prometheus-port", &prometheus])
            .args(args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting vllm-router");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        collect(stdout, &log);
        collect(stderr, &log);
        let mut router = Router {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = router.child.try_wait().unwrap() {
                panic!(
                    "vllm-router {args:?} exited ({status}):\n{}",
                    router.log_tail(100)
                );
            }
            let health = client()
                .get(format!("{}/health", router.url))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if health.is_ok_and(|r| r.status() == 200) {
                return router;
            }
            assert!(
                Instant::now() < deadline,
                "vllm-router {args:?} was not healthy within 60 s:\n{}",
                router.log_tail(100)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last `n` lines of its stdout and stderr, colours stripped.
    fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().unwrap();
        log[log.len().saturating_sub(n)..]
            .iter()
            .map(|l| strip_ansi(l))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- vllm-router's log (the last 200 lines) ----\n{}",
                self.log_tail(200)
            );
        }
    }
}

/// Appends each line `from` writes to `log`, on a thread of its own.
fn collect(from: impl Read + Send + 'static, log: &Arc<Mutex<Vec<String>>>) {
    let log = Arc::clone(log);
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            log.lock().unwrap().push(line);
        }
    });
}

/// `line` without its terminal colour sequences (the router colours its log whatever
/// `NO_COLOR` says).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ parameters final-letter
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `ferry serve --model tiny --port 0` and `extra`: every other flag at its shipped default.
fn plain(extra: &[&str]) -> Starting {
    let args: Vec<String> = ["serve", "--model", "tiny", "--port", "0"]
        .iter()
        .chain(extra)
        .map(|s| (*s).to_owned())
        .collect();
    spawn(&args, &[])
}

// ---- consistent_hash ----

const BLOCK: u64 = 16;

/// Session `s`'s conversation after `turns` turns: a prompt of its own, grown a block and a
/// half each turn (as sessions.rs's).
fn conversation(s: u64, turns: u64) -> Vec<u64> {
    (0..(3 + turns * 3) * BLOCK / 2)
        .map(|i| 3 + (i * 7 + s * 13) % 190)
        .collect()
}

/// A greedy turn of session `s`, its token ids in the answer.
fn turn_body(s: u64, t: u64) -> Value {
    json!({"model": "tiny", "prompt": conversation(s, t), "max_tokens": 6, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

/// The requests each instance has finished.
async fn finished(urls: &[&str]) -> Vec<f64> {
    let mut out = Vec::new();
    for u in urls {
        out.push(metric(
            &metrics_text(u).await,
            "ferry_requests_finished_total",
        ));
    }
    out
}

/// Which instance finished one more request than `before` says (waiting a little: an instance
/// counts a request as its engine finishes it, which a client may see after the answer).
async fn landed(urls: &[&str], before: &[f64]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = finished(urls).await;
        let grew: Vec<usize> = (0..urls.len()).filter(|&i| now[i] > before[i]).collect();
        if grew.len() == 1 && now[grew[0]] == before[grew[0]] + 1.0 {
            return grew[0];
        }
        assert!(
            grew.is_empty() && Instant::now() < deadline,
            "one request counted as {before:?} -> {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_vllm_routers_consistent_hash_a_sessions_turns_stay_on_one_ferry() {
    bounded(async {
        let (single, a, b) = (plain(&[]), plain(&[]), plain(&[]));
        let (single, a, b) = (single.ready(), a.ready(), b.ready());
        let router = Router::start(&[
            "--worker-urls",
            &a.url,
            &b.url,
            "--policy",
            "consistent_hash",
        ])
        .await;
        let urls = [a.url.as_str(), b.url.as_str()];
        let target = url(&router.url, "/v1/completions");

        // Sessions of three turns each, at least eight, until both instances hold some (the
        // ring's split depends on the ports the instances got; 32 sessions on one of two
        // instances would be a broken hash).
        let mut homes: Vec<usize> = Vec::new();
        for s in 0..32u64 {
            if s >= 8 && homes.contains(&0) && homes.contains(&1) {
                break;
            }
            let key = format!("session-{s}");
            let mut home = None;
            for t in 0..3 {
                let body = turn_body(s, t);
                let before = finished(&urls).await;
                let (status, got, _) = call(
                    reqwest::Method::POST,
                    &target,
                    Some(&body),
                    &[("X-Session-ID", &key)],
                )
                .await;
                assert_eq!(status, 200, "session {s} turn {t}: {got}");
                let at = landed(&urls, &before).await;
                assert_eq!(*home.get_or_insert(at), at, "session {s} turn {t} moved");

                // One engine's greedy tokens.
                let (status, one) = post(&url(&single.url, "/v1/completions"), &body).await;
                assert_eq!(status, 200, "{one}");
                let ids = &got["choices"][0]["token_ids"];
                assert_eq!(ids.as_array().map(Vec::len), Some(6), "{got}");
                assert_eq!(*ids, one["choices"][0]["token_ids"], "session {s} turn {t}");
                assert_eq!(got["choices"][0]["text"], one["choices"][0]["text"]);

                // Each turn after the first finds the conversation so far cached there.
                if t > 0 {
                    let earlier = conversation(s, t - 1).len() as u64;
                    let cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap();
                    assert!(
                        cached >= earlier / BLOCK * BLOCK,
                        "session {s} turn {t}: {cached} cached"
                    );
                }
            }
            homes.push(home.unwrap());
        }
        assert!(
            homes.contains(&0) && homes.contains(&1),
            "every session on one instance: {homes:?}"
        );
    })
    .await;
}

// ---- --vllm-pd-disaggregation ----

/// The token ids of a streamed choice 0, joined from its chunks.
fn streamed_ids(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["token_ids"].as_array())
        .flatten()
        .cloned()
        .collect()
}

/// D's finished loads, once P has counted as many pulls (P counts a pull once its worker
/// reports it, a step at most after D has it); no load failed.
async fn loads(p: &str, d: &str, n: f64) {
    let text = metrics_text(d).await;
    assert_eq!(
        metric(&text, "ferry_kv_loads_finished_total"),
        n,
        "D loaded no KV from P: {text}"
    );
    assert_eq!(metric(&text, "ferry_kv_loads_failed_total"), 0.0, "{text}");
    assert!(
        metric(&text, "ferry_kv_transfer_bytes_total") > 0.0,
        "{text}"
    );
    wait_metrics(p, Duration::from_secs(5), |t| {
        metric(t, "ferry_kv_exports_pulled_total") == n
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_vllm_routers_pd_disaggregation_ferry_p_and_d_give_one_engines_tokens() {
    bounded(async {
        let (single, p, d) = (
            plain(&[]),
            plain(&["--kv-role", "kv_producer"]),
            plain(&["--kv-role", "kv_consumer"]),
        );
        let (single, p, d) = (single.ready(), p.ready(), d.ready());
        let router = Router::start(&[
            "--vllm-pd-disaggregation",
            "--prefill",
            &p.url,
            "--decode",
            &d.url,
        ])
        .await;
        let (one_url, via) = (single.url.as_str(), router.url.as_str());

        // A completion: text, token ids and logprobs are one engine's.
        let body = with(completion(PROMPT, 12), "return_token_ids", json!(true));
        let (status, one) = post(&url(one_url, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{one}");
        let (status, got) = post(&url(via, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{got}");
        for field in ["text", "token_ids", "logprobs"] {
            assert_eq!(
                got["choices"][0][field], one["choices"][0][field],
                "{field}: {got}"
            );
        }
        assert_eq!(got["usage"]["completion_tokens"], 12, "{got}");
        loads(&p.url, &d.url, 1.0).await;

        // Streaming (the router sends P `stream: false` without `stream_options`, and D the
        // client's request): D's events pass through.
        let other = "A second prompt, so D has to load it from P as well.";
        let body = with(completion(other, 10), "return_token_ids", json!(true));
        let (status, one) = post(&url(one_url, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{one}");
        let body = with(body, "stream", json!(true));
        let body = with(body, "stream_options", json!({"include_usage": true}));
        let (status, events, done) = stream(&url(via, "/v1/completions"), &body).await;
        assert!(status == 200 && done, "{status}: {events:?}");
        assert_eq!(
            streamed_text(&events, false),
            one["choices"][0]["text"].as_str().unwrap()
        );
        assert_eq!(
            json!(streamed_ids(&events)),
            one["choices"][0]["token_ids"],
            "{events:?}"
        );
        assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 10);
        loads(&p.url, &d.url, 2.0).await;

        // Chat, not streaming and streaming.
        let content = "Tell me about the river crossing.";
        let body = with(chat(content, 9), "return_token_ids", json!(true));
        let (status, one) = post(&url(one_url, "/v1/chat/completions"), &body).await;
        assert_eq!(status, 200, "{one}");
        let (status, got) = post(&url(via, "/v1/chat/completions"), &body).await;
        assert_eq!(status, 200, "{got}");
        for field in ["message", "token_ids", "logprobs"] {
            assert_eq!(
                got["choices"][0][field], one["choices"][0][field],
                "{field}: {got}"
            );
        }
        loads(&p.url, &d.url, 3.0).await;

        let (status, events, done) = stream(
            &url(via, "/v1/chat/completions"),
            &with(body, "stream", json!(true)),
        )
        .await;
        assert!(status == 200 && done, "{status}: {events:?}");
        assert_eq!(
            streamed_text(&events, true),
            one["choices"][0]["message"]["content"].as_str().unwrap()
        );
        assert_eq!(
            json!(streamed_ids(&events)),
            one["choices"][0]["token_ids"],
            "{events:?}"
        );
        loads(&p.url, &d.url, 4.0).await;
    })
    .await;
}
