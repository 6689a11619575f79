//! Who may fill D's KV cache (`connectors.md`, *Trust*), on real `ferry serve --kv-role`
//! processes over loopback (the built-in `tiny` model): a `remote_host` outside D's
//! `--kv-allowed-peers` is a 400 before anything connects to it, host names in the flag are
//! resolved at start, and P and D with different fleet secrets (`FERRY_KV_TRANSFER_SECRET`)
//! move no KV, while the same secret gives one engine's tokens from P's KV.

#[allow(dead_code)] // Shared with the proxy tests; not every helper is used here.
#[path = "proxy/procs.rs"]
mod procs;

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use procs::{Proc, FERRY};

/// One test at a time: each starts several servers, on few cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs a test body under the lock, within a bound.
async fn bounded<F: std::future::Future<Output = ()>>(body: F) {
    let _turn = SERIAL.lock().await;
    tokio::time::timeout(Duration::from_secs(120), body)
        .await
        .expect("the test ran past its bound");
}

const PROMPT: &str = "The ferry crossed the wide river at dawn, carrying twelve cars, a bicycle \
                      and a dog that barked at every gull it saw.";

/// `ferry serve --model tiny` on a port of its own with a small KV cache, `args`, and the
/// environment `env` (no key or secret inherited from the test's environment); waits until it
/// serves.
fn serve(args: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut all: Vec<String> =
        "serve --model tiny --port 0 --kv-cache-bytes 16MiB --max-model-len 1024"
            .split(' ')
            .map(String::from)
            .collect();
    all.extend(args.iter().map(|a| (*a).to_owned()));
    procs::spawn_unset(&all, env, &["FERRY_KV_TRANSFER_SECRET"]).ready()
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    procs::post(&format!("{base}{path}"), body).await
}

/// The sum of a metric's samples in `base`'s `/metrics`.
async fn metric(base: &str, name: &str) -> f64 {
    procs::metric(&procs::metrics_text(base).await, name)
}

/// The request the client sends (greedy, so one engine's tokens are the reference).
fn completion(max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

/// P's export of `body`'s prompt, asked as the proxy does: `max_tokens: 1` and
/// `do_remote_decode`; P's returned `kv_transfer_params`.
async fn export(p: &Proc, body: &Value) -> Value {
    let mut ask = body.clone();
    ask["max_tokens"] = json!(1);
    ask["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, out) = post(&p.url, "/v1/completions", &ask).await;
    assert_eq!(status, 200, "{out}\n{}", p.log());
    let params = out["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{out}");
    params
}

fn with_params(body: &Value, params: &Value) -> Value {
    let mut body = body.clone();
    body["kv_transfer_params"] = params.clone();
    body
}

/// Parameters of a load that pass every shape check, from `host:port`.
fn load_from(host: &str, port: u16) -> Value {
    json!({"do_remote_prefill": true, "remote_engine_id": "p", "remote_block_ids": [0, 1],
           "remote_request_id": "r", "remote_host": host, "remote_port": port,
           "weight_version": "0", "export_token": "0123456789abcdef", "n_tokens": 20})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_host_outside_the_allowed_peers_is_a_400_and_never_connected_to() {
    bounded(async {
        let d = serve(
            &[
                "--kv-role",
                "kv_consumer",
                "--kv-allowed-peers",
                "127.0.0.2",
            ],
            &[],
        );
        // A listener the forged parameters point at: D must never connect to it.
        let bait = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        bait.set_nonblocking(true).unwrap();
        let port = bait.local_addr().unwrap().port();

        for host in ["127.0.0.1", "localhost"] {
            let body = with_params(&completion(4), &load_from(host, port));
            let (status, err) = post(&d.url, "/v1/completions", &body).await;
            assert_eq!(status, 400, "{host}: {err}");
            assert_eq!(
                err["error"]["param"], "kv_transfer_params.remote_host",
                "{err}"
            );
            assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
            let message = err["error"]["message"].as_str().unwrap();
            assert!(message.contains("not an allowed KV peer"), "{message}");
            assert!(message.contains("--kv-allowed-peers"), "{message}");
            // Chat is checked the same way.
            let chat = json!({"model": "tiny", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}],
                              "kv_transfer_params": load_from(host, port)});
            let (status, err) = post(&d.url, "/v1/chat/completions", &chat).await;
            assert_eq!(status, 400, "{err}");
            assert_eq!(err["error"]["param"], "kv_transfer_params.remote_host");
        }
        match bait.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("D connected to a host it does not allow: {other:?}"),
        }
        // Refused at the edge: the engine never started a load.
        assert_eq!(metric(&d.url, "ferry_kv_loads_started_total").await, 0.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_in_the_allowed_peers_is_resolved_at_start() {
    bounded(async {
        // `localhost` is 127.0.0.1 (and ::1), never 127.0.0.2, though that is loopback too.
        let d = serve(
            &[
                "--kv-role",
                "kv_consumer",
                "--kv-allowed-peers",
                "localhost",
            ],
            &[],
        );
        let bait = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = bait.local_addr().unwrap().port();
        let body = with_params(&completion(4), &load_from("127.0.0.2", port));
        let (status, err) = post(&d.url, "/v1/completions", &body).await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], "kv_transfer_params.remote_host");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains("127.0.0.1/32"), "{message}");
        assert!(
            d.log().contains("allowed_peers=127.0.0.1/32"),
            "{}",
            d.log()
        );
    })
    .await;
}

#[test]
fn bad_allowed_peers_and_an_empty_secret_are_refused_before_loading() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = Command::new(FERRY);
        command
            .args(["serve", "--model", "tiny", "--port", "0"])
            .args(args)
            .env_remove("FERRY_KV_TRANSFER_SECRET")
            .env("RUST_BACKTRACE", "0")
            .env("RUST_LIB_BACKTRACE", "0");
        for (k, v) in env {
            command.env(k, v);
        }
        let out = command.output().unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let consumer = ["--kv-role", "kv_consumer"];
    let e = run(
        &[&consumer[..], &["--kv-allowed-peers", "10.0.0.0/33"]].concat(),
        &[],
    );
    assert!(e.contains("--kv-allowed-peers"), "{e}");
    let e = run(
        &[
            &consumer[..],
            &["--kv-allowed-peers", "no-such-host.invalid"],
        ]
        .concat(),
        &[],
    );
    assert!(e.contains("--kv-allowed-peers"), "{e}");
    assert!(e.contains("no-such-host.invalid"), "{e}");
    // The flag means nothing without a P/D role.
    let e = run(&["--kv-allowed-peers", "127.0.0.1"], &[]);
    assert!(e.contains("--kv-role"), "{e}");
    let e = run(&consumer, &[("FERRY_KV_TRANSFER_SECRET", "")]);
    assert!(e.contains("secret is empty"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_and_d_move_kv_only_with_the_same_fleet_secret() {
    bounded(async {
        let secret = |s| [("FERRY_KV_TRANSFER_SECRET", s)];
        let p = serve(&["--kv-role", "kv_producer"], &secret("fleet-alpha"));
        let d_other = serve(&["--kv-role", "kv_consumer"], &secret("fleet-beta"));
        let d_same = serve(&["--kv-role", "kv_consumer"], &secret("fleet-alpha"));
        let single = serve(&[], &[]);

        let body = completion(12);
        let (status, reference) = post(&single.url, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{reference}");

        // Another secret: the transfer connection fails its authentication, which under D's
        // default policy (`fail`) is an explained error, and no KV arrives.
        let params = export(&p, &body).await;
        let (status, err) = post(
            &d_other.url,
            "/v1/completions",
            &with_params(&body, &params),
        )
        .await;
        assert_eq!(status, 500, "{err}\n{}", d_other.log());
        assert_eq!(err["error"]["type"], "generation_error", "{err}");
        let message = err["error"]["message"].as_str().unwrap().to_lowercase();
        assert!(
            message.contains("authentication") && message.contains("secret"),
            "{message}"
        );
        assert_eq!(
            metric(&d_other.url, "ferry_kv_loads_finished_total").await,
            0.0
        );
        assert_eq!(
            metric(&d_other.url, "ferry_kv_transfer_bytes_total").await,
            0.0
        );
        // Nothing of the prompt landed in D's cache: the same prompt computed plainly on D
        // finds no cached token.
        let (status, plain) = post(&d_other.url, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{plain}");
        assert_eq!(
            plain["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{plain}"
        );
        assert_eq!(
            plain["choices"][0]["token_ids"],
            reference["choices"][0]["token_ids"]
        );

        // The same secret: D loads P's KV (a P/D import counts as cached) and generates one
        // engine's tokens.
        let params = export(&p, &body).await;
        let (status, out) =
            post(&d_same.url, "/v1/completions", &with_params(&body, &params)).await;
        assert_eq!(status, 200, "{out}\n{}", d_same.log());
        let cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached > 0, "{out}");
        assert_eq!(
            out["choices"][0]["token_ids"],
            reference["choices"][0]["token_ids"]
        );
        assert_eq!(out["choices"][0]["text"], reference["choices"][0]["text"]);
        assert_eq!(
            metric(&d_same.url, "ferry_kv_loads_finished_total").await,
            1.0
        );
        assert!(metric(&d_same.url, "ferry_kv_transfer_bytes_total").await > 0.0);
    })
    .await;
}
