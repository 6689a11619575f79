//! KV events from `ferry serve`, read by a Python subscriber written as vLLM's consumers write
//! one (`tests/kv_events/subscriber.py`: pyzmq, msgspec structs in the field order of vLLM
//! 0.11.0's `kv_events.py`; `scripts/test.sh` installs both). The events name exactly the
//! blocks the engine cached, a reset and a weight change on an idle engine are announced at
//! once (not after the next forward), and a subscriber that missed batches replays them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::bounded;
use super::procs::*;

/// How long an idle engine may take to announce a wipe: the reply and the event are one
/// engine turn apart; this leaves room for a loaded CI machine.
const WIPE_BOUND: Duration = Duration::from_secs(2);

/// The Python subscriber, killed when dropped: its stdin, and its output lines.
struct Subscriber {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Subscriber {
    fn start(command: &mut Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take().unwrap();
        Self {
            child,
            stdin,
            lines,
        }
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The subscriber's next batch (a JSON line with `events`), within `within`.
fn next_batch(sub: &Subscriber, within: Duration) -> Value {
    let line = sub
        .lines
        .recv_timeout(within)
        .unwrap_or_else(|_| panic!("no KV event batch within {within:?}"));
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_subscriber_sees_stored_blocks_every_wipe_at_once_and_replays() {
    bounded(async {
        let config = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0",
            "topic": "kv",
        });
        let server = serve(&["--kv-events-config", &config.to_string()]).ready();
        let (status, info) = get(&format!("{}/kv_events_info", server.url)).await;
        assert_eq!(status, 200, "{info}");
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
        let mut sub = Subscriber::start(&mut python);
        let ready = sub.lines.recv_timeout(Duration::from_secs(30)).expect(
            "the subscriber did not start (pyzmq and msgspec: scripts/test.sh installs them)",
        );
        assert_eq!(ready, r#"{"ready": true}"#);

        // A prompt of two and a half blocks: its two full blocks are cached, in one chain.
        let prompt: Vec<u32> = (0..(2 * block_size + block_size / 2) as u32)
            .map(|i| 5 + i * 7 % 200)
            .collect();
        let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0});
        let (status, answer) = post(&format!("{}/v1/completions", server.url), &body).await;
        assert_eq!(status, 200, "{answer}");
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
            let (status, answer) = post(&format!("{}{path}", server.url), &body).await;
            assert_eq!(status, 200, "{path}: {answer}");
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
        writeln!(sub.stdin, "replay 0").unwrap();
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
        writeln!(sub.stdin, "quit").unwrap();
    })
    .await;
}
