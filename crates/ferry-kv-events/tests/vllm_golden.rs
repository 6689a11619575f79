//! ferry's KV event batches against vLLM's own code: `golden/vllm-V.json` holds the batches of
//! `golden/cases.json` as vLLM V's `kv_events.py` (taken from its wheel) encoded and published
//! them, and its replay's frames; `scripts/golden/make_kv_events.py` makes them, and checks
//! there that vLLM's own decoder reads every batch ferry writes, its extra fields included.
//!
//! Here: ferry's encoder writes the same bytes as vLLM 0.34.0 for every batch ferry publishes;
//! ferry's decoder reads every batch of both pinned versions (0.34.0's tagged maps and 0.11.0's
//! arrays, ferry's and vLLM's own); ferry's publisher answers a replay with vLLM 0.34.0's
//! frames; ferry's subscriber reads the replays of both.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{KvEvent, KvEventBatch, Medium, TokenId};
use ferry_kv_events::wire::{self, Decoded};
use ferry_kv_events::{KvEventsConfig, Publisher, Subscriber};
use serde_json::Value;
use zeromq::{DealerSocket, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The version ferry writes, and every version it reads.
const WRITES: &str = "0.34.0";
const READS: [&str; 2] = ["0.34.0", "0.11.0"];

fn json(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn cases() -> Vec<Value> {
    json("cases.json")["cases"].as_array().unwrap().clone()
}

fn golden(version: &str) -> Value {
    let g = json(&format!("vllm-{version}.json"));
    assert_eq!(g["vllm"], version);
    g
}

fn hex(s: &Value) -> Vec<u8> {
    let s = s.as_str().unwrap();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn payload(golden: &Value, case: &Value) -> Vec<u8> {
    hex(&golden["cases"][case["name"].as_str().unwrap()])
}

/// A hash of cases.json: an int, or bytes in hex, which vLLM turns into their low 64 bits.
fn hash(v: &Value) -> u64 {
    match v.as_str() {
        Some(_) => hex(v)
            .iter()
            .rev()
            .take(8)
            .rev()
            .fold(0, |h, &b| h << 8 | u64::from(b)),
        None => v.as_u64().unwrap(),
    }
}

fn medium(v: &Value) -> Medium {
    match v.as_str() {
        None | Some("GPU") => Medium::Primary,
        Some(_) => Medium::Tier,
    }
}

/// What a case says, as ferry's batch: the events' hashes, parents, tokens and media, the
/// primary tier's block size, and ferry's fields (none: an empty version, epoch 0).
fn expected(case: &Value) -> Decoded {
    let (mut primary_size, mut any_size) = (None, 0);
    let events = case["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let hashes = || {
                e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(hash)
                    .collect()
            };
            match e["type"].as_str().unwrap() {
                "BlockStored" => {
                    let size = e["block_size"].as_u64().unwrap() as usize;
                    any_size = size;
                    if medium(&e["medium"]) == Medium::Primary {
                        primary_size = Some(size);
                    }
                    KvEvent::Stored {
                        hashes: hashes(),
                        parent: (!e["parent_block_hash"].is_null())
                            .then(|| hash(&e["parent_block_hash"])),
                        tokens: e["token_ids"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|t| ferry_core::TokenId(t.as_u64().unwrap() as u32))
                            .collect(),
                        medium: medium(&e["medium"]),
                        lora: None,
                    }
                }
                "BlockRemoved" => KvEvent::Removed {
                    hashes: hashes(),
                    medium: medium(&e["medium"]),
                },
                "AllBlocksCleared" => KvEvent::AllCleared,
                other => panic!("cases.json: event type {other}"),
            }
        })
        .collect();
    let ferry = &case["ferry"];
    Decoded {
        ts: case["ts"].as_f64().unwrap(),
        batch: KvEventBatch {
            events,
            block_size: primary_size.unwrap_or(any_size),
            weight_version: Arc::from(ferry["weight_version"].as_str().unwrap_or("")),
            epoch: ferry["epoch"].as_u64().unwrap_or(0),
        },
    }
}

fn ferry_cases() -> Vec<Value> {
    cases()
        .into_iter()
        .filter(|c| c["ferry"].is_object())
        .collect()
}

#[test]
fn ferry_writes_each_batch_as_vllm_0_34_writes_it_byte_for_byte() {
    let g = golden(WRITES);
    let cases = ferry_cases();
    assert_eq!(cases.len(), 3);
    for case in &cases {
        let want = expected(case);
        assert_eq!(
            wire::encode(&want.batch, want.ts),
            payload(&g, case),
            "{}",
            case["name"]
        );
    }
}

#[test]
fn ferry_reads_every_batch_of_vllm_0_34_and_0_11_ferrys_and_vllms_own() {
    for version in READS {
        let g = golden(version);
        for case in cases() {
            let got = wire::decode(&payload(&g, &case))
                .unwrap_or_else(|e| panic!("vLLM {version} {}: {e}", case["name"]));
            assert_eq!(got, expected(&case), "vLLM {version} {}", case["name"]);
        }
    }
    // vLLM's own batch: bytes hashes, LoRA, extra keys, another group, STORAGE, a medium of
    // none, no ferry fields.
    let only = cases()
        .into_iter()
        .find(|c| c["name"] == "vllm-only")
        .unwrap();
    let got = wire::decode(&payload(&golden(WRITES), &only)).unwrap();
    assert_eq!(got.batch.weight_version.as_ref(), "");
    assert_eq!(
        got.batch.events[0],
        KvEvent::Stored {
            hashes: vec![0xd15d_6c15_b0f0_0a08],
            parent: None,
            tokens: TokenId::list([10, 11, 12, 13]),
            medium: Medium::Primary,
            lora: None,
        }
    );
    assert!(matches!(
        got.batch.events[1],
        KvEvent::Stored {
            medium: Medium::Tier,
            ..
        }
    ));
}

/// The frames of a replay answer, from the first after the identity.
fn frames(m: ZmqMessage) -> Vec<Bytes> {
    m.into_vec()
}

fn seq_of(frame: &[u8]) -> i64 {
    i64::from_be_bytes(frame.try_into().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferrys_publisher_answers_a_replay_with_vllm_0_34s_frames() {
    let g = golden(WRITES);
    let config = KvEventsConfig::parse(
        r#"{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv",
            "replay_endpoint": "tcp://127.0.0.1:0"}"#,
    )
    .unwrap();
    assert_eq!(g["topic"], "kv");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let publisher = Publisher::start(&config, "tcp://127.0.0.1:0", rx)
        .await
        .unwrap();
    let cases = ferry_cases();
    for case in &cases {
        tx.send(expected(case).batch).unwrap();
    }
    let endpoint = publisher.replay_endpoint.unwrap();
    // Every batch from sequence 1, once the publisher's task has taken them all.
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut dealer = DealerSocket::new();
            dealer.connect(&endpoint).await.unwrap();
            let mut request = ZmqMessage::from(Bytes::new());
            request.push_back(Bytes::copy_from_slice(&1u64.to_be_bytes()));
            dealer.send(request).await.unwrap();
            let mut answer = Vec::new();
            loop {
                let f = frames(dealer.recv().await.unwrap());
                let end = seq_of(&f[f.len() - 2]) == -1;
                answer.push(f);
                if end {
                    break;
                }
            }
            if answer.len() == cases.len() {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the replay did not answer with every batch");

    // vLLM's answer to the same request, less the batches ferry does not publish (those of
    // the cases without ferry fields, which come after).
    let vllm: Vec<Vec<Vec<u8>>> = g["replay_from_1"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_array().unwrap().iter().map(hex).collect())
        .filter(|f: &Vec<Vec<u8>>| {
            let seq = seq_of(&f[f.len() - 2]);
            seq == -1 || (seq as usize) < cases.len()
        })
        .collect();
    assert_eq!(answer.len(), vllm.len());
    for (ours, theirs) in answer.iter().zip(&vllm) {
        assert_eq!(ours.len(), theirs.len(), "frames of one message");
        let n = ours.len();
        // Delimiter, topic, sequence number: the same bytes.
        for i in 0..n - 1 {
            assert_eq!(ours[i][..], theirs[i][..], "frame {i}");
        }
        // The batch: the same bytes but for the stamp, which ferry's publisher sets.
        if theirs[n - 1].is_empty() {
            assert!(ours[n - 1].is_empty(), "the end marker's last frame");
        } else {
            let mine = wire::decode(&ours[n - 1]).unwrap();
            let vllms = wire::decode(&theirs[n - 1]).unwrap();
            assert_eq!(wire::encode(&vllms.batch, mine.ts), ours[n - 1][..]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferrys_subscriber_reads_the_replays_of_vllm_0_34_and_0_11() {
    for version in READS {
        let g = golden(version);
        let mut publisher = PubSocket::new();
        let pub_endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut router = RouterSocket::new();
        let router_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap();
        let answer: Vec<Vec<Bytes>> = g["replay_from_1"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                m.as_array()
                    .unwrap()
                    .iter()
                    .map(|f| hex(f).into())
                    .collect()
            })
            .collect();
        // vLLM's publisher, as its replay socket answers a request from sequence 1.
        let serve = tokio::spawn(async move {
            let request = router.recv().await.unwrap().into_vec();
            assert_eq!(request.last().unwrap()[..], 1u64.to_be_bytes());
            for message in answer {
                let mut m = ZmqMessage::from(request[0].clone());
                for f in message {
                    m.push_back(f);
                }
                router.send(m).await.unwrap();
            }
            router
        });
        let sub = Subscriber::connect(
            &pub_endpoint.to_string(),
            Some(router_endpoint.to_string()),
            "kv",
        )
        .await
        .unwrap();
        let got = sub.replay(1, Duration::from_secs(10)).await.unwrap();
        let want: Vec<(u64, Decoded)> = cases()
            .iter()
            .enumerate()
            .skip(1)
            .map(|(seq, c)| (seq as u64, expected(c)))
            .collect();
        assert_eq!(got, want, "vLLM {version}");
        drop(serve.await.unwrap());
        drop(publisher);
    }
}
