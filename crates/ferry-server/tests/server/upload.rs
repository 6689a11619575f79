//! Bucketed weight uploads (`/weight_uploads`): buckets staged as they arrive, one commit
//! installing every tensor at once; the result equals a one-body push bit for bit; every
//! failure (a bad or repeated tensor, a body cut off or stalled, an idle upload, an incomplete
//! set after sleep level 2) installs nothing and frees the upload; readers never see a mix.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::admin::{admin_server, bounded, weight_info};
use crate::support::{start, Options, Server};

/// One f32 tensor of the tiny model.
#[derive(Clone)]
struct Tensor {
    name: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// The tiny model's tensors, as its safetensors file holds them.
fn tiny_tensors() -> Vec<Tensor> {
    let dir = tempfile::tempdir().unwrap();
    ferry_engine::testing::write_tiny_folder(dir.path()).unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<Tensor> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let data = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            Tensor {
                name,
                shape: view.shape().to_vec(),
                data,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Other weights: every value scaled, so the output changes.
fn scaled(tensors: &[Tensor], by: f32) -> Vec<Tensor> {
    tensors
        .iter()
        .map(|t| Tensor {
            data: t.data.iter().map(|v| v * by).collect(),
            ..t.clone()
        })
        .collect()
}

fn body(tensors: &[Tensor]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors.iter().zip(&bytes).map(|(t, b)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.shape.clone(), b)
                .unwrap();
        (t.name.clone(), view)
    });
    safetensors::serialize(views, None).unwrap()
}

/// The tensors as `n` bucket bodies, by turns.
fn buckets(tensors: &[Tensor], n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let part: Vec<Tensor> = tensors.iter().skip(i).step_by(n).cloned().collect();
            body(&part)
        })
        .collect()
}

impl Server {
    async fn begin_upload(&self) -> String {
        let reply = self.admin_json_ok("/weight_uploads", &json!({})).await;
        reply["upload_id"].as_str().unwrap().to_owned()
    }

    async fn send_bucket(&self, id: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let req = self
            .http
            .post(self.url(&format!("/weight_uploads/{id}/buckets")))
            .header("content-type", "application/octet-stream")
            .body(body);
        bounded("bucket", self.send_json(req)).await
    }

    async fn commit(&self, id: &str, version: &str) -> (u16, Value) {
        let path = format!("/weight_uploads/{id}/commit");
        bounded(
            "commit",
            self.post(&path, &json!({"weight_version": version})),
        )
        .await
    }

    /// Uploads `tensors` in `n` buckets and commits them as `version`.
    async fn upload(&self, tensors: &[Tensor], n: usize, version: &str) -> Value {
        let id = self.begin_upload().await;
        for b in buckets(tensors, n) {
            let (status, reply) = self.send_bucket(&id, b).await;
            assert_eq!(status, 200, "{reply}");
        }
        let (status, reply) = self.commit(&id, version).await;
        assert_eq!(status, 200, "{reply}");
        reply
    }

    async fn open_upload(&self) -> Value {
        self.admin_get("/weight_uploads").await["upload"].clone()
    }
}

const PROMPT: &str = "the weights change here";

/// A greedy completion's token ids, logprobs and weight versions.
async fn greedy(s: &Server) -> (Value, Value, Value) {
    let req = json!({"prompt": PROMPT, "max_tokens": 6, "ignore_eos": true, "temperature": 0,
                     "logprobs": 1, "return_token_ids": true});
    let out = bounded("generate", s.ok("/v1/completions", &req)).await;
    let c = &out["choices"][0];
    (
        c["token_ids"].clone(),
        c["logprobs"]["token_logprobs"].clone(),
        c["weight_versions"].clone(),
    )
}

fn upload_server(timeout: Option<Duration>) -> impl std::future::Future<Output = Server> {
    start(Options {
        admin_api: true,
        weight_upload_timeout: timeout,
        ..Options::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_give_the_tokens_and_logprobs_of_a_one_body_push_bit_for_bit() {
    let new = scaled(&tiny_tensors(), 1.25);
    let (pushed, uploaded) = (admin_server().await, admin_server().await);
    let before = greedy(&uploaded).await;
    let (status, reply) = bounded(
        "push",
        pushed.send_json(
            pushed
                .http
                .post(pushed.url("/update_weights?weight_version=v1"))
                .header("content-type", "application/octet-stream")
                .body(body(&new)),
        ),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    let reply = uploaded.upload(&new, 3, "v1").await;
    assert_eq!(reply["weight_version"], "v1", "{reply}");
    assert_eq!(reply["complete"], true, "{reply}");
    assert_eq!(reply["n_buckets"], 3, "{reply}");
    assert_eq!(reply["n_tensors"].as_u64(), Some(new.len() as u64));
    let (want, got) = (greedy(&pushed).await, greedy(&uploaded).await);
    assert_eq!(
        got, want,
        "a bucketed upload computes other weights than a push"
    );
    assert_eq!(got.2, json!(["v1"]));
    assert_ne!(
        got.1, before.1,
        "the new weights did not change the logprobs"
    );
    assert_eq!(uploaded.open_upload().await, Value::Null);
    assert_eq!(weight_info(&uploaded).await["n_weight_updates"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_upload_prepares_then_commits_and_takes_no_bucket_once_prepared() {
    let s = admin_server().await;
    let tensors = tiny_tensors();
    let id = s.begin_upload().await;
    let parts = buckets(&scaled(&tensors, 0.5), 4);
    for b in &parts[..2] {
        let (status, reply) = s.send_bucket(&id, b.clone()).await;
        assert_eq!(status, 200, "{reply}");
    }
    let open = s.open_upload().await;
    assert_eq!(
        (&open["stage"], &open["n_buckets"]),
        (&json!("staging"), &json!(2))
    );
    let prepared = s
        .admin_json_ok(&format!("/weight_uploads/{id}/prepare"), &json!({}))
        .await;
    assert_eq!(prepared["complete"], false, "{prepared}");
    assert_eq!(s.open_upload().await["stage"], "prepared");
    let (status, reply) = s.send_bucket(&id, parts[2].clone()).await;
    assert_eq!(status, 409, "{reply}");
    // Nothing installed before the commit.
    assert_eq!(weight_info(&s).await["n_weight_updates"], 0);
    let (status, reply) = s.commit(&id, "half").await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        (&reply["complete"], &reply["weight_version"]),
        (&json!(false), &json!("half"))
    );
    assert_eq!(greedy(&s).await.2, json!(["half"]));
    // The upload ended with its commit.
    let (status, reply) = s.commit(&id, "again").await;
    assert_eq!(status, 404, "{reply}");
    assert_eq!(reply["error"]["param"], "upload_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_upload_at_a_time_and_a_bad_or_repeated_tensor_discards_it() {
    let s = admin_server().await;
    let before = greedy(&s).await;
    let tensors = tiny_tensors();
    let id = s.begin_upload().await;
    let (status, second) = bounded("second", s.post("/weight_uploads", &json!({}))).await;
    assert_eq!(status, 409, "{second}");
    assert!(
        second["error"]["message"].as_str().unwrap().contains(&id),
        "{second}"
    );
    // A tensor the model lacks: a 400 naming it, and the upload is gone.
    let (status, reply) = s
        .send_bucket(
            &id,
            body(&[Tensor {
                name: "model.nope.weight".into(),
                ..tensors[0].clone()
            }]),
        )
        .await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "model.nope.weight");
    assert!(reply["error"]["message"]
        .as_str()
        .unwrap()
        .contains("discarded"));
    assert_eq!(s.open_upload().await, Value::Null);
    let (status, _) = s.send_bucket(&id, body(&tensors[..1])).await;
    assert_eq!(status, 404);
    // A tensor sent in two buckets.
    let id = s.begin_upload().await;
    let (status, reply) = s.send_bucket(&id, body(&tensors[..2])).await;
    assert_eq!(status, 200, "{reply}");
    let (status, reply) = s.send_bucket(&id, body(&tensors[1..3])).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(
        reply["error"]["param"].as_str(),
        Some(tensors[1].name.as_str())
    );
    assert_eq!(s.open_upload().await, Value::Null);
    // Nothing was installed: the old version serves the old tokens.
    assert_eq!(weight_info(&s).await["n_weight_updates"], 0);
    assert_eq!(greedy(&s).await, before);
    // And a new upload can start.
    let id = s.begin_upload().await;
    let discarded = bounded(
        "discard",
        s.send_json(s.http.delete(s.url(&format!("/weight_uploads/{id}")))),
    )
    .await;
    assert_eq!(discarded.0, 200, "{}", discarded.1);
    assert_eq!(s.open_upload().await, Value::Null);
}

/// A body that sends `bytes`, then ends as `end` says.
fn cut_body(bytes: Vec<u8>, end: Option<std::io::Error>, hold: Duration) -> reqwest::Body {
    let head = futures_util::stream::iter([Ok::<_, std::io::Error>(bytes)]);
    let tail = futures_util::stream::once(async move {
        tokio::time::sleep(hold).await;
        Err(end.unwrap_or_else(|| std::io::Error::other("held")))
    });
    reqwest::Body::wrap_stream(futures_util::StreamExt::chain(head, tail))
}

/// Polls until the server holds no upload, within the bound.
async fn until_no_upload(s: &Server) {
    let start = Instant::now();
    while s.open_upload().await != Value::Null {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the upload lives on"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_cut_off_or_stalled_midway_or_an_idle_upload_installs_nothing() {
    let s = upload_server(Some(Duration::from_secs(1))).await;
    let before = greedy(&s).await;
    let tensors = tiny_tensors();
    let whole = body(&tensors);
    let half = whole[..whole.len() / 2].to_vec();

    // The connection drops mid-bucket (the client's body fails after half the bytes).
    let id = s.begin_upload().await;
    let (status, reply) = s.send_bucket(&id, body(&tensors[..2])).await;
    assert_eq!(status, 200, "{reply}");
    let req = s
        .http
        .post(s.url(&format!("/weight_uploads/{id}/buckets")))
        .body(cut_body(
            half.clone(),
            Some(std::io::Error::other("cut")),
            Duration::ZERO,
        ));
    assert!(
        req.send().await.map_or(true, |r| !r.status().is_success()),
        "a cut bucket was accepted"
    );
    until_no_upload(&s).await;

    // The body stalls midway: after the timeout with no byte, a 408 and the upload is gone.
    let id = s.begin_upload().await;
    let started = Instant::now();
    let (status, reply) = s
        .send_bucket(&id, cut_body(half, None, Duration::from_secs(5)))
        .await;
    assert_eq!(status, 408, "{reply}");
    assert!(reply["error"]["message"]
        .as_str()
        .unwrap()
        .contains("stalled"));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(s.open_upload().await, Value::Null);

    // An upload nobody touches expires with what it staged.
    let id = s.begin_upload().await;
    let (status, reply) = s.send_bucket(&id, body(&tensors)).await;
    assert_eq!(status, 200, "{reply}");
    until_no_upload(&s).await;
    let (status, reply) = s.commit(&id, "late").await;
    assert_eq!(status, 404, "{reply}");

    assert_eq!(weight_info(&s).await["n_weight_updates"], 0);
    assert_eq!(greedy(&s).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_sleep_level_2_an_upload_must_hold_every_parameter() {
    let s = admin_server().await;
    let before = greedy(&s).await;
    let tensors = tiny_tensors();
    s.admin_ok("/sleep?level=2").await;
    let id = s.begin_upload().await;
    let (status, reply) = s.send_bucket(&id, body(&tensors[1..])).await;
    assert_eq!(status, 200, "{reply}");
    let (status, reply) = bounded(
        "prepare",
        s.post(&format!("/weight_uploads/{id}/prepare"), &json!({})),
    )
    .await;
    assert_eq!(status, 400, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains(&tensors[0].name), "{message}");
    assert_eq!(s.open_upload().await, Value::Null);
    // Every parameter, in buckets: the weights come back, the same as before the sleep.
    let reply = s.upload(&tensors, 3, "back").await;
    assert_eq!(reply["complete"], true, "{reply}");
    s.admin_ok("/wake_up").await;
    let after = greedy(&s).await;
    assert_eq!((&after.0, &after.1), (&before.0, &before.1));
    assert_eq!(after.2, json!(["back"]));
}

/// Requests running while an upload is staged and committed: each one computed by a single
/// version equals that version's reference exactly (a staged bucket never leaks into the
/// running weights, and the commit never shows a half-installed set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_during_an_upload_see_one_whole_version() {
    let new = scaled(&tiny_tensors(), 1.25);
    let s = start(Options {
        admin_api: true,
        step_delay: Duration::from_millis(2),
        ..Options::default()
    })
    .await;
    let reference_new = admin_server().await;
    let reference_old = greedy(&reference_new).await;
    reference_new.upload(&new, 1, "v1").await;
    let reference_new = greedy(&reference_new).await;
    assert_ne!(reference_old.1, reference_new.1);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (base, stop) = (s.base.clone(), stop.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut outs = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let req = json!({"prompt": PROMPT, "max_tokens": 6, "ignore_eos": true,
                                     "temperature": 0, "logprobs": 1, "return_token_ids": true});
                    let out: Value = client
                        .post(format!("{base}/v1/completions"))
                        .json(&req)
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    let c = &out["choices"][0];
                    outs.push((
                        c["token_ids"].clone(),
                        c["logprobs"]["token_logprobs"].clone(),
                        c["weight_versions"].clone(),
                    ));
                }
                outs
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let id = s.begin_upload().await;
    for b in buckets(&new, 4) {
        let (status, reply) = s.send_bucket(&id, b).await;
        assert_eq!(status, 200, "{reply}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, reply) = s.commit(&id, "v1").await;
    assert_eq!(status, 200, "{reply}");
    tokio::time::sleep(Duration::from_millis(150)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut n_old, mut n_new, mut n_both) = (0, 0, 0);
    for reader in readers {
        for out in reader.await.unwrap() {
            if out.2 == json!(["0"]) {
                assert_eq!(out, reference_old, "a request on the old version");
                n_old += 1;
            } else if out.2 == json!(["v1"]) {
                assert_eq!(out, reference_new, "a request on the new version");
                n_new += 1;
            } else {
                assert_eq!(out.2, json!(["0", "v1"]), "{out:?}");
                n_both += 1;
            }
        }
    }
    assert!(
        n_old > 0 && n_new > 0,
        "old {n_old}, new {n_new}, both {n_both}"
    );
}
