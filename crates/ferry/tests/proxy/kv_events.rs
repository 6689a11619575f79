//! KV events from `ferry serve`, read over libzmq by a Python subscriber that connects as
//! vLLM's consumers do (`tests/kv_events/subscriber.py`: pyzmq SUB and DEALER, in vLLM
//! 0.34.0's replay framing; `scripts/test.sh` installs pyzmq). Every batch it receives is what
//! ferry's encoder writes for the events it carries, byte for byte, and that encoder writes
//! what vLLM 0.34.0's own `kv_events.py` writes (`ferry-kv-events/tests/vllm_golden.rs`,
//! against batches vLLM's code published), so vLLM's consumers read them; the events name
//! exactly the blocks the engine cached, a reset and a weight change on an idle engine are
//! announced at once (not after the next forward), and a subscriber that missed batches
//! replays them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_core::{KvEvent, Medium, TokenId};
use ferry_kv_events::wire::{self, Decoded};
use serde_json::{json, Value};

use super::bounded;
use super::procs::*;

/// How long an idle engine may take to announce a wipe: the reply and the event are one
/// engine turn apart; this leaves room for a loaded CI machine.
const WIPE_BOUND: Duration = Duration::from_secs(2);

/// The Python subscriber, killed when dropped: its stdin, and its output lines.
pub(super) struct Subscriber {
    child: Child,
    pub(super) stdin: ChildStdin,
    pub(super) lines: mpsc::Receiver<String>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Subscriber {
    pub(super) fn start(command: &mut Command) -> Self {
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

/// The subscriber's next line (a batch, or a replay's batches), within `within`.
pub(super) fn next_line(sub: &Subscriber, within: Duration) -> Value {
    let line = sub
        .lines
        .recv_timeout(within)
        .unwrap_or_else(|_| panic!("no KV event batch within {within:?}"));
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// The Python subscriber, subscribed to the publisher `/kv_events_info` describes.
pub(super) fn subscribe(info: &Value) -> Subscriber {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_events/subscriber.py");
    let mut python = Command::new("python3");
    python.args([
        script,
        info["endpoint"].as_str().unwrap(),
        info["replay_endpoint"].as_str().unwrap(),
        info["topic"].as_str().unwrap(),
    ]);
    let sub = Subscriber::start(&mut python);
    let ready = sub
        .lines
        .recv_timeout(Duration::from_secs(30))
        .expect("the subscriber did not start (pyzmq: scripts/test.sh installs it)");
    assert_eq!(ready, r#"{"ready": true}"#);
    sub
}

/// A batch as the subscriber received it: its sequence number and what it says, checked to
/// be the bytes ferry's encoder writes for that (vLLM 0.34.0's layout: see the module docs).
pub(super) fn batch_of(received: &Value) -> (u64, Decoded) {
    let hex = received["payload"].as_str().unwrap();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let decoded = wire::decode(&bytes).unwrap_or_else(|e| panic!("{e}: {received}"));
    assert_eq!(
        wire::encode(&decoded.batch, decoded.ts),
        bytes,
        "a batch not in the layout ferry's encoder writes: {received}"
    );
    (received["seq"].as_u64().unwrap(), decoded)
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
        assert_eq!(info["format"], wire::FORMAT, "{info}");
        let block_size = info["block_size"].as_u64().unwrap() as usize;
        let mut sub = subscribe(&info);

        // A prompt of two and a half blocks: its two full blocks are cached, in one chain.
        let prompt: Vec<u32> = (0..(2 * block_size + block_size / 2) as u32)
            .map(|i| 5 + i * 7 % 200)
            .collect();
        let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0});
        let (status, answer) = post(&format!("{}/v1/completions", server.url), &body).await;
        assert_eq!(status, 200, "{answer}");
        let mut live: Vec<(u64, Decoded)> = Vec::new();
        let mut stored = Vec::new();
        while stored.len() < 2 * block_size {
            let (seq, batch) = batch_of(&next_line(&sub, Duration::from_secs(10)));
            assert_eq!(
                (batch.batch.epoch, batch.batch.weight_version.as_ref()),
                (0, "0")
            );
            assert_eq!(batch.batch.block_size, block_size);
            for e in &batch.batch.events {
                let KvEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    medium,
                    ..
                } = e
                else {
                    panic!("not a BlockStored: {e:?}");
                };
                assert_eq!(*medium, Medium::Primary);
                assert_eq!(*parent, None, "one chain from the first block");
                assert_eq!(hashes.len() * block_size, tokens.len());
                stored.extend_from_slice(tokens);
            }
            live.push((seq, batch));
        }
        assert_eq!(
            stored,
            TokenId::from_raw_slice(&prompt[..2 * block_size]),
            "the cached blocks' tokens are the prompt's"
        );

        // Idle now: a reset, then a new weight version, are each announced at once.
        for (path, body, version) in [
            ("/reset_prefix_cache", json!({}), "0"),
            ("/update_weight_version", json!({"new_version": "w1"}), "w1"),
        ] {
            let (status, answer) = post(&format!("{}{path}", server.url), &body).await;
            assert_eq!(status, 200, "{path}: {answer}");
            let replied = now();
            let line = next_line(&sub, WIPE_BOUND);
            assert!(line["recv"].as_f64().unwrap() - replied < WIPE_BOUND.as_secs_f64());
            let (seq, batch) = batch_of(&line);
            assert_eq!(batch.batch.events, [KvEvent::AllCleared], "{path}: {line}");
            let last = &live.last().unwrap().1.batch;
            assert_eq!(batch.batch.epoch, last.epoch + 1, "{path}");
            assert_eq!(batch.batch.weight_version.as_ref(), version, "{path}");
            live.push((seq, batch));
        }

        // A subscriber that missed everything replays it, from sequence 0, byte for byte.
        writeln!(sub.stdin, "replay 0").unwrap();
        let replayed = next_line(&sub, Duration::from_secs(10));
        let replayed: Vec<(u64, Decoded)> = replayed["replayed"]
            .as_array()
            .unwrap()
            .iter()
            .map(batch_of)
            .collect();
        assert_eq!(replayed, live);
        assert_eq!(live[0].0, 0);
        writeln!(sub.stdin, "quit").unwrap();
    })
    .await;
}
