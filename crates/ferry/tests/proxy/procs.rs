//! Real `ferry serve` and `ferry proxy` processes on loopback for the proxy tests: each on a
//! port it picks itself (`--port 0`, read back from its log), killed when dropped, and small
//! HTTP helpers with bounded waits.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// Runs `ferry make-model ARGS --out DIR` (`tiny`, or `moe --arch ...`), failing the test
/// with its stderr if it fails.
pub fn make_model(args: &[&str], dir: &std::path::Path) {
    let out = Command::new(FERRY)
        .arg("make-model")
        .args(args)
        .arg("--out")
        .arg(dir)
        .output()
        .expect("running ferry make-model");
    assert!(
        out.status.success(),
        "ferry make-model {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A child process and the port it serves on.
pub struct Proc {
    child: Child,
    pub url: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Kills the process now (SIGKILL: no graceful anything) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) with kill(1).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap();
        assert!(ok.success(), "kill -{signal} {pid}");
    }

    pub fn log(&self) -> String {
        self.log_tail(usize::MAX)
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().unwrap();
        log[log.len().saturating_sub(n)..].join("\n")
    }
}

/// A process started but not yet serving.
pub struct Starting {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
    what: String,
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `ferry` with exactly `args`, no API key inherited from the test's environment, and `env`.
pub fn spawn(args: &[String], env: &[(&str, &str)]) -> Starting {
    spawn_unset(args, env, &[])
}

/// `spawn` that also keeps each variable of `unset` from the test's environment out of the
/// child's (`env` may still set it).
pub fn spawn_unset(args: &[String], env: &[(&str, &str)], unset: &[&str]) -> Starting {
    spawn_in(None, args, env, unset)
}

/// `spawn_unset` inside the network namespace `netns` when given (`ip netns exec`, which
/// becomes `ferry` itself). Such a child is killed when the thread that spawned it ends
/// (`PR_SET_PDEATHSIG`), so a test killed outright leaves no server running in a namespace.
pub fn spawn_in(
    netns: Option<&str>,
    args: &[String],
    env: &[(&str, &str)],
    unset: &[&str],
) -> Starting {
    let mut command = match netns {
        None => Command::new(FERRY),
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, FERRY]);
            #[cfg(target_os = "linux")]
            {
                use std::os::unix::process::CommandExt;
                // SAFETY: `prctl` is async-signal-safe and touches no memory of the parent.
                unsafe {
                    c.pre_exec(|| {
                        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
            c
        }
    };
    command
        .args(args)
        .env_remove("FERRY_API_KEY")
        .env_remove("FERRY_INSTANCE_API_KEY")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for k in unset {
        command.env_remove(k);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("starting ferry");
    let stderr = child.stderr.take().unwrap();
    let (tx, lines) = mpsc::channel();
    let log = Arc::new(Mutex::new(Vec::new()));
    let log_copy = Arc::clone(&log);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            log_copy.lock().unwrap().push(line.clone());
            let _ = tx.send(line);
        }
    });
    Starting {
        child: Some(child),
        lines,
        log,
        what: args.join(" "),
    }
}

impl Starting {
    /// Waits (at most 60 s) for the "serving on http://" line.
    pub fn ready(mut self) -> Proc {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "`ferry {}` did not report its address: {}",
                    self.what,
                    self.log.lock().unwrap().join("\n")
                )
            });
            if let Some(rest) = line.split("serving on http://").nth(1) {
                let addr = rest.split_whitespace().next().unwrap();
                return Proc {
                    child: self.child.take().unwrap(),
                    url: format!("http://{addr}"),
                    log: Arc::clone(&self.log),
                };
            }
        }
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// `ferry serve --model tiny` with the admin API, a small KV cache, and `extra`.
pub fn serve(extra: &[&str]) -> Starting {
    serve_env(extra, &[])
}

pub fn serve_env(extra: &[&str], env: &[(&str, &str)]) -> Starting {
    let mut args = strings(&[
        "serve",
        "--model",
        "tiny",
        "--port",
        "0",
        "--enable-admin-api",
        "--kv-cache-bytes",
        "16MiB",
        "--max-model-len",
        "1024",
    ]);
    args.extend(strings(extra));
    spawn(&args, env)
}

/// A prefill server (`kv_producer`).
pub fn prefill(extra: &[&str]) -> Starting {
    let mut args = vec!["--kv-role", "kv_producer"];
    args.extend_from_slice(extra);
    serve(&args)
}

/// A decode server (`kv_consumer`).
pub fn decode(extra: &[&str]) -> Starting {
    let mut args = vec!["--kv-role", "kv_consumer"];
    args.extend_from_slice(extra);
    serve(&args)
}

/// `ferry proxy` over the given instance URLs, with the admin API and `extra`.
pub fn proxy(prefill: &[&str], decode: &[&str], extra: &[&str]) -> Starting {
    proxy_env(prefill, decode, extra, &[])
}

pub fn proxy_env(
    prefill: &[&str],
    decode: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> Starting {
    let mut args = strings(&["proxy", "--port", "0", "--enable-admin-api"]);
    for p in prefill {
        args.push("--prefill".into());
        args.push((*p).to_owned());
    }
    for d in decode {
        args.push("--decode".into());
        args.push((*d).to_owned());
    }
    args.extend(strings(extra));
    spawn(&args, env)
}

/// One P, one D and the proxy in front, started together.
pub struct PdFleet {
    pub proxy: Proc,
    pub p: Proc,
    pub d: Proc,
}

pub fn pd_fleet(p_extra: &[&str], d_extra: &[&str]) -> PdFleet {
    let (p, d) = (prefill(p_extra), decode(d_extra));
    let (p, d) = (p.ready(), d.ready());
    let proxy = proxy(&[&p.url], &[&d.url], &[]).ready();
    PdFleet { proxy, p, d }
}

/// `ferry proxy` in front of plain instances (`--instance`), with `extra` after them.
pub fn whole_proxy(instances: &[&str], extra: &[&str]) -> Starting {
    let mut args = strings(&["proxy", "--port", "0"]);
    for url in instances {
        args.extend(strings(&["--instance", url]));
    }
    args.extend(strings(extra));
    spawn(&args, &[])
}

/// KV events on free ports, with replay: what a proxy routing by cache subscribes to.
pub const KV_EVENTS: &str = r#"{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#;

/// Two plain instances publishing KV events (`serve_extra` after the defaults) and a proxy in
/// front of both (`proxy_extra` after its instances), returned once the proxy's index has
/// synced with both.
pub async fn kv_fleet(serve_extra: &[&str], proxy_extra: &[&str]) -> (Proc, [Proc; 2]) {
    let args: Vec<&str> = ["--kv-events-config", KV_EVENTS]
        .into_iter()
        .chain(serve_extra.iter().copied())
        .collect();
    let (a, b) = (serve(&args), serve(&args));
    let (a, b) = (a.ready(), b.ready());
    let proxy = whole_proxy(&[&a.url, &b.url], proxy_extra).ready();
    wait_metrics(&proxy.url, Duration::from_secs(30), |m| {
        metric(m, "ferry_proxy_kv_synced") == 2.0
    })
    .await;
    (proxy, [a, b])
}

/// One instance's sample of a proxy metric (labelled `instance="URL"`).
pub fn instance_metric(text: &str, name: &str, url: &str) -> f64 {
    let label = format!("instance=\"{url}\"");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A URL nothing listens on (a port the kernel just gave out and took back).
pub fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A JSON call: status, body (a non-JSON body as a string) and the response headers.
pub async fn call(
    method: reqwest::Method,
    url: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut req = client().request(method, url);
    if let Some(b) = body {
        req = req.json(b);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let response = req.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body, headers)
}

pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let (s, b, _) = call(reqwest::Method::POST, url, Some(body), &[]).await;
    (s, b)
}

pub async fn get(url: &str) -> (u16, Value) {
    let (s, b, _) = call(reqwest::Method::GET, url, None, &[]).await;
    (s, b)
}

/// A streaming request's events (the JSON of each `data:` line before `[DONE]`), and whether
/// `[DONE]` came.
pub async fn stream(url: &str, body: &Value) -> (u16, Vec<Value>, bool) {
    let response = client().post(url).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let mut events = Vec::new();
    let mut done = false;
    for line in text.lines() {
        match line.strip_prefix("data: ") {
            Some("[DONE]") => done = true,
            Some(json) => events.push(serde_json::from_str(json).unwrap()),
            None => {}
        }
    }
    (status, events, done)
}

/// A streamed completion's text, joined from its chunks.
pub fn streamed_text(events: &[Value], chat: bool) -> String {
    events
        .iter()
        .filter_map(|e| {
            let choice = &e["choices"][0];
            if chat {
                choice["delta"]["content"].as_str()
            } else {
                choice["text"].as_str()
            }
        })
        .collect()
}

/// The sum of a metric's samples in a `/metrics` text (every label set).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub async fn metrics_text(base: &str) -> String {
    match get(&format!("{base}/metrics")).await {
        (200, Value::String(text)) => text,
        other => panic!("{base}/metrics: {other:?}"),
    }
}

/// Polls `/metrics` of `base` until `cond` holds on it, at most `within`.
pub async fn wait_metrics(base: &str, within: Duration, cond: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + within;
    loop {
        let text = metrics_text(base).await;
        if cond(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{base}/metrics never met the condition:\n{text}"
        );
        // Often: a state like "three requests decoding" lasts only tens of milliseconds
        // on the tiny model.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

// ---- requests the tests send ----

/// A prompt of a few dozen tokens for the tiny model.
pub const PROMPT: &str =
    "The ferry crossed the wide river at dawn, carrying twelve cars, a bicycle \
                      and a dog that barked at every gull it saw.";

/// A greedy completion with logprobs that runs `max_tokens` whatever the model says.
pub fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "logprobs": 2, "ignore_eos": true})
}

pub fn with(mut body: Value, key: &str, value: Value) -> Value {
    body[key] = value;
    body
}

pub fn url(base: &str, path: &str) -> String {
    format!("{base}{path}")
}

/// A safetensors body replacing the tiny model's final norm with `value` everywhere.
pub fn norm_push(value: f32) -> Vec<u8> {
    vector_push("model.norm.weight", value)
}

/// A safetensors body setting the vector `name` (64 values, as the tiny model's norms) to
/// `value` everywhere.
pub fn vector_push(name: &str, value: f32) -> Vec<u8> {
    f32_vector_body(name, 64, value)
}

/// A safetensors body holding one F32 vector `name` of `n` values, each `value`.
pub fn f32_vector_body(name: &str, n: usize, value: f32) -> Vec<u8> {
    let header = format!(
        r#"{{"{name}":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#,
        n * 4
    );
    let mut header = header.into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.reserve(n * 4);
    for _ in 0..n {
        out.extend(value.to_le_bytes());
    }
    out
}

/// `POST /update_weights` with safetensors bytes.
pub async fn push(base: &str, query: &str, body: Vec<u8>) -> (u16, Value) {
    let response = client()
        .post(url(base, &format!("/update_weights{query}")))
        .header("content-type", "application/octet-stream")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}
