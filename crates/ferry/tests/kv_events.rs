//! KV events from `ferry serve`, read by a Python subscriber written as vLLM's consumers write
//! one (`tests/kv_events/subscriber.py`: pyzmq, msgspec structs in the field order of vLLM
//! 0.11.0's `kv_events.py`; `scripts/test.sh` installs both). The events name exactly the
//! blocks the engine cached, a reset and a weight change on an idle engine are announced at
//! once (not after the next forward), and a subscriber that missed batches replays them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
/// How long an idle engine may take to announce a wipe: the reply and the event are one
/// engine turn apart; this leaves room for a loaded CI machine.
const WIPE_BOUND: Duration = Duration::from_secs(2);

/// A child process killed when dropped, with its output lines on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    stdin: Option<ChildStdin>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(command: &mut Command, stdout: bool) -> Proc {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
    let (tx, lines) = mpsc::channel();
    let out: Box<dyn Read + Send> = if stdout {
        Box::new(child.stdout.take().unwrap())
    } else {
        Box::new(child.stderr.take().unwrap())
    };
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stdin = child.stdin.take();
    Proc {
        child,
        lines,
        stdin,
    }
}

fn call(port: u16, method: &str, path: &str, body: &Value) -> Value {
    let body = body.to_string();
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
    let mut response = String::new();
    conn.read_to_string(&mut response).unwrap();
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "{method} {path}: {response}"
    );
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response}"))
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The subscriber's next batch (a JSON line with `events`), within `within`.
fn next_batch(sub: &Proc, within: Duration) -> Value {
    let line = sub
        .lines
        .recv_timeout(within)
        .unwrap_or_else(|_| panic!("no KV event batch within {within:?}"));
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

#[test]
fn a_python_subscriber_sees_stored_blocks_every_wipe_at_once_and_replays() {
    let config = json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": "kv",
    });
    let mut ferry = Command::new(FERRY);
    ferry
        .args([
            "serve",
            "--model",
            "tiny",
            "--port",
            "0",
            "--enable-admin-api",
        ])
        .args(["--kv-events-config", &config.to_string()])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1");
    let server = spawn(&mut ferry, false);
    let deadline = Instant::now() + Duration::from_secs(60);
    let port: u16 = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = server
            .lines
            .recv_timeout(left)
            .expect("ferry serve did not start");
        if let Some(rest) = line.split("serving on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap();
            break addr.rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    let info = call(port, "GET", "/kv_events_info", &json!({}));
    assert_eq!(info["enabled"], true, "{info}");
    let block_size = info["block_size"].as_u64().unwrap() as usize;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_events/subscriber.py");
    let mut python = Command::new("python3");
    python.args([
        script,
        info["endpoint"].as_str().unwrap(),
        info["replay_endpoint"].as_str().unwrap(),
        info["topic"].as_str().unwrap(),
    ]);
    let mut sub = spawn(&mut python, true);
    let ready = sub
        .lines
        .recv_timeout(Duration::from_secs(30))
        .expect("the subscriber did not start (pyzmq and msgspec: scripts/test.sh installs them)");
    assert_eq!(ready, r#"{"ready": true}"#);

    // A prompt of two and a half blocks: its two full blocks are cached, in one chain.
    let prompt: Vec<u32> = (0..(2 * block_size + block_size / 2) as u32)
        .map(|i| 5 + i * 7 % 200)
        .collect();
    let models = call(port, "GET", "/v1/models", &json!({}));
    let model = models["data"][0]["id"].as_str().unwrap().to_owned();
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    call(port, "POST", "/v1/completions", &body);
    let mut live = Vec::new();
    let mut stored = Vec::new();
    while stored.len() < 2 * block_size {
        let batch = next_batch(&sub, Duration::from_secs(10));
        assert_eq!(
            (batch["epoch"].as_u64(), batch["weight_version"].as_str()),
            (Some(0), Some("0"))
        );
        for e in batch["events"].as_array().unwrap() {
            assert_eq!(e["type"], "BlockStored", "{batch}");
            assert_eq!(e["medium"], "GPU");
            assert_eq!(e["block_size"].as_u64(), Some(block_size as u64));
            assert_eq!(
                e["parent_block_hash"],
                Value::Null,
                "one chain from the first block"
            );
            assert_eq!(
                e["block_hashes"].as_array().unwrap().len() * block_size,
                e["token_ids"].as_array().unwrap().len()
            );
            stored.extend(
                e["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32),
            );
        }
        live.push(batch);
    }
    assert_eq!(
        stored,
        prompt[..2 * block_size],
        "the cached blocks' tokens are the prompt's"
    );

    // Idle now: a reset, then a new weight version, are each announced at once.
    let epoch = |b: &Value| b["epoch"].as_u64().unwrap();
    for (path, body, version) in [
        ("/reset_prefix_cache", json!({}), "0"),
        ("/update_weight_version", json!({"new_version": "w1"}), "w1"),
    ] {
        call(port, "POST", path, &body);
        let replied = now();
        let batch = next_batch(&sub, WIPE_BOUND);
        assert!(batch["recv"].as_f64().unwrap() - replied < WIPE_BOUND.as_secs_f64());
        assert_eq!(
            batch["events"],
            json!([{"type": "AllBlocksCleared"}]),
            "{path}: {batch}"
        );
        assert_eq!(epoch(&batch), epoch(live.last().unwrap()) + 1, "{path}");
        assert_eq!(batch["weight_version"], version, "{path}");
        live.push(batch);
    }

    // A subscriber that missed everything replays it, from sequence 0, byte for byte.
    writeln!(sub.stdin.as_mut().unwrap(), "replay 0").unwrap();
    let replayed = next_batch(&sub, Duration::from_secs(10));
    let strip = |b: &Value| {
        json!([
            b["seq"],
            b["ts"],
            b["events"],
            b["weight_version"],
            b["epoch"]
        ])
    };
    let replayed: Vec<Value> = replayed["replayed"]
        .as_array()
        .unwrap()
        .iter()
        .map(strip)
        .collect();
    assert_eq!(replayed, live.iter().map(strip).collect::<Vec<_>>());
    assert_eq!(live[0]["seq"], 0);
    writeln!(sub.stdin.as_mut().unwrap(), "quit").unwrap();
}
