//! `ferry serve` as a user runs it: the real binary on a loopback port with the built-in `tiny`
//! model. Ctrl-C (SIGINT) ends in-flight streams with finish_reason `abort` and the process
//! exits cleanly; bad flags are errors that name the flag; the admin API is a 404 unless
//! `--enable-admin-api`, and with it an RL cycle (generate, pause, new weight version,
//! resume, generate) works end to end. The HTTP API itself is tested in
//! `crates/ferry-server/tests`; these tests only cover what the binary adds.

use serde_json::json;

#[allow(dead_code)] // Shared with the proxy tests; this file uses `make_model`.
#[path = "proxy/procs.rs"]
mod procs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// A `ferry serve` child process and the port it reported.
struct Server {
    child: Child,
    port: u16,
    /// Its stderr up to the line with its address.
    startup_log: Vec<String>,
    /// The rest of its stderr, line by line.
    log: mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Server {
    start_with(extra, None, "info")
}

/// [`start`] with `FERRY_API_KEY` set to `api_key` (else removed) and `RUST_LOG` = `log`.
fn start_with(extra: &[&str], api_key: Option<&str>, log: &str) -> Server {
    start_model("tiny", extra, api_key, log)
}

/// [`start_with`] serving `model`.
fn start_model(model: &str, extra: &[&str], api_key: Option<&str>, log: &str) -> Server {
    let mut command = Command::new(FERRY);
    match api_key {
        Some(key) => command.env("FERRY_API_KEY", key),
        None => command.env_remove("FERRY_API_KEY"),
    };
    let mut child = command
        .args(["serve", "--model", model, "--port", "0"])
        .args(extra)
        .env("RUST_LOG", log)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting ferry serve");
    let (tx, log) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // Owned (and killed on drop) before anything below can panic.
    let mut server = Server {
        child,
        port: 0,
        startup_log: Vec::new(),
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.port == 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = server
            .log
            .recv_timeout(left)
            .expect("ferry serve did not report its address within 60 s");
        if let Some(rest) = line.split("serving on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap();
            server.port = addr.rsplit(':').next().unwrap().parse().unwrap();
        }
        server.startup_log.push(line);
    }
    server
}

/// Sends a raw HTTP/1.1 POST and returns the open connection (the response is read by the
/// caller), so a test can act while a stream is still coming.
fn post(port: u16, path: &str, body: &str) -> TcpStream {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        conn,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    conn
}

fn read_all(mut conn: TcpStream) -> String {
    let mut out = String::new();
    conn.read_to_string(&mut out).unwrap();
    out
}

/// The status code and JSON body of a whole HTTP/1.1 response (`Content-Length` bodies).
fn status_and_json(response: &str) -> (u16, serde_json::Value) {
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {response}"));
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response}"));
    (status, json)
}

fn call(port: u16, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    status_and_json(&read_all(conn))
}

#[test]
fn admin_api_is_off_unless_enabled() {
    let server = start(&[]);
    for path in ["/pause", "/update_weights_from_disk", "/flush_cache"] {
        let (status, body) = call(server.port, "POST", path, "");
        assert_eq!(status, 404, "{path}: {body}");
    }
    let help = Command::new(FERRY)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--enable-admin-api"), "{help}");
    assert!(help.contains("trusted network"), "{help}");
}

#[test]
fn admin_api_runs_an_rl_cycle_through_the_binary() {
    let server = start(&["--enable-admin-api"]);
    let port = server.port;
    let generate = || {
        let body = r#"{"prompt": "Hello", "max_tokens": 4, "temperature": 0}"#;
        let (status, out) = call(port, "POST", "/v1/completions", body);
        assert_eq!(status, 200, "{out}");
        out["choices"][0]["weight_versions"].clone()
    };
    assert_eq!(generate(), serde_json::json!(["0"]));
    let (status, out) = call(port, "POST", "/pause?mode=keep", "");
    assert_eq!(
        (status, &out),
        (200, &serde_json::json!({"status": "paused"}))
    );
    assert_eq!(call(port, "GET", "/is_paused", "").1["is_paused"], true);
    let (status, out) = call(
        port,
        "POST",
        "/update_weight_version",
        r#"{"new_version": "v1"}"#,
    );
    assert_eq!(status, 200, "{out}");
    let (status, out) = call(port, "POST", "/resume", "");
    assert_eq!(status, 200, "{out}");
    assert_eq!(generate(), serde_json::json!(["v1"]));
    let (_, info) = call(port, "GET", "/weight_info", "");
    assert_eq!(info["weight_version"], "v1", "{info}");
}

#[test]
fn serves_a_completion_from_the_built_in_model() {
    let server = start(&[]);
    let body = r#"{"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}"#;
    let response = read_all(post(server.port, "/v1/completions", body));
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains(r#""completion_tokens":5"#), "{response}");
}

#[test]
fn ctrl_c_aborts_in_flight_streams_and_exits_cleanly() {
    let mut server = start(&[]);
    let body = r#"{"model": "tiny", "prompt": "Tell me everything", "max_tokens": 1500,
                   "ignore_eos": true, "temperature": 0, "stream": true}"#;
    let mut conn = BufReader::new(post(server.port, "/v1/completions", body));
    // Wait until tokens are flowing, so the request is really in flight.
    let mut seen = String::new();
    while !seen.contains("data: {") {
        let mut line = String::new();
        assert_ne!(
            conn.read_line(&mut line).unwrap(),
            0,
            "stream ended early: {seen}"
        );
        seen.push_str(&line);
    }
    let pid = server.child.id().to_string();
    let status = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(status.success());

    let mut rest = String::new();
    conn.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains(r#""finish_reason":"abort""#),
        "the in-flight stream did not end with finish_reason abort: {rest}"
    );
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "ferry serve still running 30 s after SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "ferry serve exited with {exit}");
    let log: Vec<String> = server.log.try_iter().collect();
    assert!(log.iter().any(|l| l.contains("stopped")), "{log:?}");
}

/// A raw GET with an optional `Authorization` header; the status and the whole response.
fn get_with(port: u16, path: &str, authorization: Option<&str>) -> (u16, String) {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let auth = authorization.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let response = read_all(conn);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {response}"));
    (status, response)
}

#[test]
fn an_api_key_from_the_environment_guards_the_server_and_is_never_logged() {
    let key = "sk-cli-test-9f8e7d6c5b4a";
    let mut server = start_with(&["--enable-admin-api"], Some(key), "debug");
    let bearer = format!("Bearer {key}");
    let wrong = format!("Bearer {key}x");
    for path in ["/v1/models", "/is_paused"] {
        assert_eq!(get_with(server.port, path, None).0, 401, "{path}");
        assert_eq!(get_with(server.port, path, Some(&wrong)).0, 401, "{path}");
        assert_eq!(get_with(server.port, path, Some(&bearer)).0, 200, "{path}");
    }
    assert_eq!(get_with(server.port, "/health", None).0, 200);
    let (status, body) = get_with(server.port, "/metrics", None);
    assert_eq!(status, 200);
    assert!(!body.contains(key));
    // Everything the server logged at debug level, up to its exit.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let mut log = std::mem::take(&mut server.startup_log);
    log.extend(server.log.iter());
    assert!(
        log.iter().any(|l| l.contains("an API key is required")),
        "{log:?}"
    );
    assert!(log.iter().all(|l| !l.contains(key)), "{log:?}");
    // `--help` names the variable but never shows its value.
    let help = Command::new(FERRY)
        .args(["serve", "--help"])
        .env("FERRY_API_KEY", key)
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--api-key"), "{help}");
    assert!(help.contains("FERRY_API_KEY"), "{help}");
    assert!(!help.contains(key), "{help}");
}

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(FERRY).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["serve", "--model", "tiny", "--max-model-len", "1000000"]);
    assert!(err.contains("--max-model-len"), "{err}");
    let err = run(&["serve", "--model", "/nonexistent/model-folder"]);
    assert!(err.contains("/nonexistent/model-folder"), "{err}");
    let err = run(&["serve", "--model", "tiny", "--kv-cache-bytes", "lots"]);
    assert!(err.contains("lots"), "{err}");
    let err = run(&["serve", "--model", "tiny", "--num-kv-blocks", "1"]);
    assert!(err.contains("--num-kv-blocks"), "{err}");
    let err = run(&["serve", "--model", "tiny", "--num-kv-blocks", "100"]);
    assert!(err.contains("--max-model-len 2048"), "{err}");
    let err = run(&["serve", "--model", "tiny", "--max-num-seqs", "0"]);
    assert!(err.contains("--max-num-seqs 0"), "{err}");
    let err = run(&["serve", "--model", "tiny", "--logprobs-mode", "processed"]);
    assert!(err.contains("--logprobs-mode"), "{err}");
    assert!(err.contains("processed_logprobs"), "{err}");
    let err = run(&["serve", "--model", "tiny", "--api-key", ""]);
    assert!(err.contains("--api-key"), "{err}");
    assert!(err.contains("the API key is empty"), "{err}");
}

/// `--enable-return-routed-experts` needs a mixture-of-experts model: the dense `tiny` is
/// refused naming the flag.
#[test]
fn routed_experts_need_an_moe_model() {
    let out = Command::new(FERRY)
        .args(["serve", "--model", "tiny", "--port", "0"])
        .args(["--enable-return-routed-experts"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--enable-return-routed-experts"), "{err}");
    assert!(err.contains("no mixture-of-experts layers"), "{err}");
}

/// The routing of `tokens` (one prefill) as the model in `dir` computes it in process.
fn routing_in_process(dir: &std::path::Path, tokens: &[u32]) -> Vec<u16> {
    use ferry_core::{BlockId, ReqIdx, ScheduledReq, StepPlan, TokenId};
    use ferry_model::Executor;
    let m = ferry_model::load_model(dir).unwrap();
    let mut model = ferry_model::LlamaModel::new(&m.config, &m.weights)
        .unwrap()
        .with_routed_experts(true)
        .unwrap();
    let (bs, n) = (16, tokens.len());
    let blocks = n.div_ceil(bs);
    let mut kv = ferry_arena::KvArena::new(model.kv_layout(bs), blocks + 1);
    let plan = StepPlan {
        block_size: bs,
        reqs: vec![ScheduledReq {
            lora: None,
            req: ReqIdx(0),
            start_pos: 0,
            tokens: 0..n,
            blocks: 0..blocks,
            sample: None,
        }],
        token_ids: TokenId::from_raw_slice(tokens).to_vec(),
        block_tables: (1..=blocks as u32).map(BlockId).collect(),
        ..StepPlan::default()
    };
    model.execute(&plan, &mut kv).unwrap().routed[0].ids.clone()
}

/// An MoE model from `ferry make-model moe` served with `--enable-return-routed-experts`:
/// the routing each route returns (vLLM's `.npy` on `/v1/completions`, SGLang's `int32`
/// on `/generate`), for the prompt and the generated tokens, is the model's own in process,
/// also when the prompt comes from the prefix cache the second time.
#[test]
fn an_moe_model_returns_the_routing_its_forward_computed() {
    use base64::Engine as _;
    let b64 = |v: &serde_json::Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_else(|| panic!("not a string: {v}")))
            .unwrap()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("moe");
    procs::make_model(&["moe", "--arch", "qwen3_moe"], &dir);
    let server = start_model(
        dir.to_str().unwrap(),
        &["--enable-return-routed-experts"],
        None,
        "info",
    );
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 300).collect();
    let config = ferry_model::load_model(&dir).unwrap().config;
    let width = config.num_hidden_layers * config.moe.unwrap().top_k;
    for round in 0..2 {
        let body = json!({"input_ids": prompt, "return_routed_experts": true,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0}});
        let (status, out) = call(server.port, "POST", "/generate", &body.to_string());
        assert_eq!(status, 200, "{out}");
        let output: Vec<u32> = out["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let mut tokens = prompt.clone();
        tokens.extend(&output[..output.len() - 1]);
        let want = routing_in_process(&dir, &tokens);
        let got: Vec<u16> = b64(&out["meta_info"]["routed_experts"])
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u16)
            .collect();
        assert_eq!(got, want, "round {round}: SGLang's routed_experts");

        let body = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0});
        let (status, out) = call(server.port, "POST", "/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{out}");
        let npy = b64(&out["choices"][0]["routed_experts"]);
        let header = String::from_utf8_lossy(&npy[..npy.len() - want.len()]).into_owned();
        assert!(
            header.contains(&format!(
                "'shape': ({}, {}, 3)",
                tokens.len(),
                config.num_hidden_layers
            )),
            "{header}"
        );
        assert!(header.contains("'descr': '|u1'"), "{header}");
        let rows: Vec<u16> = npy[npy.len() - want.len()..]
            .iter()
            .map(|&b| u16::from(b))
            .collect();
        assert_eq!(rows, want, "round {round}: vLLM's routed_experts");
        assert_eq!(want.len(), tokens.len() * width);
    }
}

/// A `ferry make-model moe` folder (Qwen3-MoE, a dense layer among its MoE ones).
fn moe_folder() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("moe");
    procs::make_model(&["moe", "--arch", "qwen3_moe"], &dir);
    (tmp, dir)
}

/// A greedy completion of `prompt` from the server on `port`: its tokens (prompt and output
/// but the last, the inputs that have routing) and the rows of its `routed_experts` (the
/// `.npy` data after its header: `u1` ids, for at most 256 experts).
fn routed_completion(port: u16, prompt: &[u32]) -> (Vec<u32>, Vec<u16>) {
    use base64::Engine as _;
    let body =
        json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": true});
    let (status, out) = call(port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{out}");
    let choice = &out["choices"][0];
    let output: Vec<u32> = choice["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {choice}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let mut tokens = prompt.to_vec();
    tokens.extend(&output[..output.len() - 1]);
    let npy = base64::engine::general_purpose::STANDARD
        .decode(choice["routed_experts"].as_str().unwrap())
        .unwrap();
    let header_len = 10 + usize::from(u16::from_le_bytes([npy[8], npy[9]]));
    (
        tokens,
        npy[header_len..].iter().map(|&b| u16::from(b)).collect(),
    )
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// P/D with routing: P computes the prompt's KV and its routing, D loads both in the same
/// blocks (the routing rides in each block's aux words over the transport) and generates;
/// the routing D returns through the proxy is the model's own in process, prompt rows
/// included. P and D must agree: a D capturing routing and a P not is refused by the
/// transport's handshake, naming the flag, and the request fails rather than lose routing.
#[test]
fn routing_moves_with_the_kv_from_p_to_d() {
    let (_tmp, dir) = moe_folder();
    let model = dir.to_str().unwrap();
    let routed = [
        "--enable-return-routed-experts",
        "--kv-cache-bytes",
        "16MiB",
    ];
    let p = start_model(
        model,
        &[&["--kv-role", "kv_producer"][..], &routed].concat(),
        None,
        "info",
    );
    let d = start_model(
        model,
        &[&["--kv-role", "kv_consumer"][..], &routed].concat(),
        None,
        "info",
    );
    let url = |port: u16| format!("http://127.0.0.1:{port}");
    let proxy = procs::proxy(&[&url(p.port)], &[&url(d.port)], &[]).ready();
    let prompt: Vec<u32> = (0..45).map(|i| (i * 11 + 5) % 300).collect();
    let (tokens, rows) = routed_completion(port_of(&proxy.url), &prompt);
    assert_eq!(rows, routing_in_process(&dir, &tokens));
    let loaded = get_with(d.port, "/metrics", None).1;
    assert!(
        metric(&loaded, "ferry_kv_loads_finished_total") > 0.0,
        "D loaded the prompt from P:\n{loaded}"
    );

    // A P without routing: its blocks have no aux words; D's handshake is refused.
    let plain_p = start_model(
        model,
        &["--kv-role", "kv_producer", "--kv-cache-bytes", "16MiB"],
        None,
        "info",
    );
    let proxy = procs::proxy(&[&url(plain_p.port)], &[&url(d.port)], &[]).ready();
    let body = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0});
    let (status, out) = call(
        port_of(&proxy.url),
        "POST",
        "/v1/completions",
        &body.to_string(),
    );
    assert!(status >= 500, "{status}: {out}");
    assert!(
        out.to_string().contains("--enable-return-routed-experts"),
        "the refusal names the flag: {out}"
    );
}

/// The offload tier with routing: a prefix lost from the KV cache and loaded back from the
/// tier brings its routing with it (the tier copies whole blocks, aux words included).
#[test]
fn routing_comes_back_from_the_offload_tier_with_the_kv() {
    let (_tmp, dir) = moe_folder();
    let server = start_model(
        dir.to_str().unwrap(),
        &[
            "--enable-return-routed-experts",
            "--enable-admin-api",
            "--block-size",
            "4",
            "--kv-offload-bytes",
            "16MiB",
        ],
        None,
        "info",
    );
    let port = server.port;
    let prompt: Vec<u32> = (0..30).map(|i| (i * 13 + 1) % 300).collect();
    let (tokens, first) = routed_completion(port, &prompt);
    assert_eq!(first, routing_in_process(&dir, &tokens));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !call(port, "POST", "/reset_prefix_cache", "").1["success"]
        .as_bool()
        .unwrap()
    {
        assert!(Instant::now() < deadline, "the reset never succeeded");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (again, second) = routed_completion(port, &prompt);
    assert_eq!(again, tokens);
    let text = get_with(port, "/metrics", None).1;
    assert_eq!(metric(&text, "ferry_kv_offload_hits_total"), 1.0, "{text}");
    assert_eq!(second, first, "the routing of the tier's blocks");
}

#[test]
fn bad_kv_flags_are_errors_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(FERRY)
            .args(["serve", "--model", "tiny", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--kv-role", "sideways"]);
    assert!(err.contains("--kv-role"), "{err}");
    assert!(
        err.contains("kv_producer"),
        "the accepted values are listed: {err}"
    );
    let err = run(&["--kv-role", "producer", "--host", "0.0.0.0"]);
    assert!(err.contains("--kv-transfer-host is required"), "{err}");
    let err = run(&["--kv-role", "kv_both", "--host", "::"]);
    assert!(err.contains("--kv-transfer-host is required"), "{err}");
    let err = run(&["--kv-role", "consumer", "--host", "localhost"]);
    assert!(err.contains("--host \"localhost\""), "{err}");
    let err = run(&["--kv-role", "both", "--kv-transfer-host", ""]);
    assert!(err.contains("--kv-transfer-host"), "{err}");
    let err = run(&["--kv-role", "both", "--kv-engine-id", "a b"]);
    assert!(err.contains("--kv-engine-id"), "{err}");
    let err = run(&["--kv-role", "both", "--kv-transfer-port", "70000"]);
    assert!(err.contains("--kv-transfer-port"), "{err}");
    for bad in ["0", "-1", "soon", "inf"] {
        for flag in ["--kv-load-timeout-seconds", "--kv-io-timeout-seconds"] {
            let err = run(&["--kv-role", "both", &format!("{flag}={bad}")]);
            assert!(
                err.contains(flag) && err.contains(bad),
                "{flag} {bad}: {err}"
            );
        }
    }
    let err = run(&["--kv-lease-seconds", "0"]);
    assert!(
        err.contains("--kv-lease-seconds must be at least 1"),
        "{err}"
    );
    let err = run(&["--kv-load-failure-policy", "maybe"]);
    assert!(err.contains("--kv-load-failure-policy"), "{err}");
    // The transfer flags mean nothing without a role.
    for flag in [
        ["--kv-transfer-port", "9000"],
        ["--kv-transfer-host", "10.0.0.1"],
        ["--kv-engine-id", "p0"],
    ] {
        let err = run(&flag);
        assert!(err.contains("--kv-role"), "{flag:?}: {err}");
    }
}

#[test]
fn bad_offload_flags_are_errors_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(FERRY)
            .args(["serve", "--model", "tiny", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--kv-offload-bytes", "lots"]);
    assert!(err.contains("--kv-offload-bytes"), "{err}");
    let err = run(&["--kv-offload-bytes", "0"]);
    assert!(
        err.contains("--kv-offload-bytes must be more than 0"),
        "{err}"
    );
    let err = run(&["--kv-offload-bytes", "1"]);
    assert!(
        err.contains("--kv-offload-bytes 1: 1 bytes hold no offloaded block"),
        "{err}"
    );
    let err = run(&["--kv-offload-bytes", "1GiB", "--kv-offload-policy", "fifo"]);
    assert!(err.contains("--kv-offload-policy"), "{err}");
    let err = run(&[
        "--kv-offload-bytes",
        "1GiB",
        "--kv-offload-block-size",
        "24",
    ]);
    assert!(err.contains("--kv-offload-block-size 24"), "{err}");
    let err = run(&["--kv-offload-policy", "arc"]);
    assert!(err.contains("--kv-offload-bytes"), "{err}");
    let err = run(&["--kv-connector", "offload"]);
    assert!(
        err.contains("--kv-connector lists offload, which needs --kv-offload-bytes"),
        "{err}"
    );
    let err = run(&[
        "--kv-offload-bytes",
        "1GiB",
        "--kv-connector",
        "offload,nixl",
    ]);
    assert!(err.contains("--kv-connector"), "{err}");
}

/// `name value` lines of a `/metrics` text: the value of `name`.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

#[test]
fn the_offload_tier_serves_a_prefix_the_kv_cache_lost_and_shows_it_on_metrics() {
    let server = start(&[
        "--enable-admin-api",
        "--block-size",
        "4",
        "--kv-offload-bytes",
        "16MiB",
        "--kv-offload-policy",
        "arc",
        "--kv-connector",
        "offload",
    ]);
    let port = server.port;
    let generate = || {
        let body = r#"{"prompt": "The offload tier keeps this prompt's KV blocks in host memory", "max_tokens": 6, "temperature": 0, "logprobs": 1}"#;
        let (status, out) = call(port, "POST", "/v1/completions", body);
        assert_eq!(status, 200, "{out}");
        out["choices"][0]["logprobs"].clone()
    };
    let metrics = || get_with(port, "/metrics", None).1;
    // Resets answer false while a store still holds blocks: retry for a bounded time.
    let reset = |external: bool| {
        let path = format!("/reset_prefix_cache?reset_external={external}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !call(port, "POST", &path, "").1["success"]
            .as_bool()
            .unwrap()
        {
            assert!(Instant::now() < deadline, "the reset never succeeded");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let first = generate();
    reset(false);
    assert!(metric(&metrics(), "ferry_kv_offload_bytes_used") > 0.0);
    let second = generate();
    assert_eq!(
        first, second,
        "tokens and logprobs from the tier equal the computed ones"
    );
    let text = metrics();
    assert_eq!(metric(&text, "ferry_kv_offload_hits_total"), 1.0, "{text}");
    assert_eq!(
        metric(&text, "ferry_kv_offload_bytes_capacity"),
        16.0 * 1024.0 * 1024.0
    );
    reset(true);
    assert_eq!(metric(&metrics(), "ferry_kv_offload_bytes_used"), 0.0);
}

/// `--chat-template`: a Jinja file (or the template itself) replaces the model's; a path that
/// is neither, or a template that does not compile, stops the server at start naming the flag.
#[test]
fn the_chat_template_flag_reads_a_file_or_refuses_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.jinja");
    std::fs::write(
        &path,
        "{% for m in messages %}[{{ m.content }}]{% endfor %}",
    )
    .unwrap();
    let server = start(&["--chat-template", path.to_str().unwrap()]);
    let (status, chat) = call(
        server.port,
        "POST",
        "/tokenize",
        r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
    );
    assert_eq!(status, 200, "{chat}");
    let (_, text) = call(
        server.port,
        "POST",
        "/tokenize",
        r#"{"prompt": "[hi]", "add_special_tokens": false}"#,
    );
    assert_eq!(chat["tokens"], text["tokens"]);
    for bad in ["/no/such/template.jinja", "{% for %}"] {
        let out = Command::new(FERRY)
            .args([
                "serve",
                "--model",
                "tiny",
                "--port",
                "0",
                "--chat-template",
                bad,
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--chat-template"), "{bad}: {err}");
    }
}
