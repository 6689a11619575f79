//! Weight updates leave resident memory where it was: full pushes (streamed in network-sized
//! pieces, as the admin API sends them), reloads from disk and bucketed uploads (four
//! buckets staged, then one commit), one after another, each leave
//! the process's resident memory within a few percent of the weights' size of where it was
//! before the first, and none takes more than one extra copy of the weights while it runs.
//!
//! Alone in its test binary, one test, so no other test allocates while resident memory is
//! measured. The model is the SmolLM2-135M shape cut to 8 layers and an 8192-token
//! vocabulary (132 MB of f32): its layer matrices (0.4 to 3.5 MB each) are the sizes a
//! malloc arena keeps after they are freed, which is how updates used to leak a copy of the
//! weights each.

#![cfg(target_os = "linux")]

mod support;

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use ferry_engine::EngineHandle;
use ferry_model::random_model::{random_weights, smollm2_135m_config};
use ferry_model::{LlamaConfig, LlamaModel, LoadedModel};

const MIB: u64 = 1 << 20;
/// Updates of each kind (pushes, reloads).
const N_UPDATES: usize = 5;
/// Bucketed uploads, after them.
const N_UPLOADS: usize = 50;
/// Buckets per upload.
const N_BUCKETS: usize = 4;
/// A network piece of a pushed body.
const PIECE_BYTES: usize = 64 << 10;

/// `key:` of `/proc/self/status` (`VmRSS`, `VmHWM`), in bytes.
fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))
        .unwrap_or_else(|| panic!("no {key} in /proc/self/status"));
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn rss() -> u64 {
    status_bytes("VmRSS")
}

/// Resets `VmHWM` to the current resident memory (Linux ≥ 4.0), so the next reading of it
/// is the peak since now.
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM");
}

/// A body delivered in `PIECE_BYTES` pieces, as a server reads one off the network.
struct Pieces<'a> {
    body: &'a [u8],
}

impl futures_core::Stream for Pieces<'_> {
    type Item = Result<Vec<u8>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.body.is_empty() {
            return Poll::Ready(None);
        }
        let (piece, rest) = self.body.split_at(PIECE_BYTES.min(self.body.len()));
        self.body = rest;
        Poll::Ready(Some(Ok(piece.to_vec())))
    }
}

/// Runs one update and returns (resident memory after it, its peak over what was resident
/// just before it).
async fn measured(update: impl std::future::Future<Output = ()>) -> (u64, u64) {
    let before = rss();
    reset_peak();
    update.await;
    let peak = status_bytes("VmHWM");
    (rss(), peak.saturating_sub(before))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_and_reloads_leave_resident_memory_where_it_was() {
    let config = LlamaConfig {
        vocab_size: 8192,
        num_hidden_layers: 8,
        ..smollm2_135m_config()
    };
    let dir = tempfile::tempdir().unwrap();
    let (engine, n_weight_bytes) = {
        let weights = random_weights(&config, 7);
        let model = LlamaModel::new(&config, &weights).unwrap();
        let loaded = LoadedModel {
            config: config.clone(),
            weights,
            tokenizer: None,
            chat_template: None,
            source: "random".into(),
        };
        ferry_model::tiny::write_hf_folder(&loaded, dir.path()).unwrap();
        let n = model.weights().total_bytes() as u64;
        (support::engine(model, support::small_config(16, 4)), n)
    };
    assert!(n_weight_bytes > 120 * MIB, "{} MiB", n_weight_bytes / MIB);
    // The pushed body stays resident through the test: it is the trainer's, not the update's.
    let body = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let push = |engine: &EngineHandle| {
        let (engine, body) = (engine.clone(), &body);
        async move {
            let mut pieces = Pieces { body };
            let info = engine
                .update_weights_from_safetensors_stream(&mut pieces, None)
                .await
                .unwrap();
            assert!(info.complete);
        }
    };
    // The same weights as `N_BUCKETS` safetensors bodies, by turns of name.
    let buckets: Vec<Vec<u8>> = {
        let weights = random_weights(&config, 7);
        let raw: Vec<(String, Vec<usize>, Vec<u8>)> = weights
            .tensors
            .iter()
            .map(|(name, t)| {
                let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                (name.clone(), t.shape.clone(), bytes)
            })
            .collect();
        (0..N_BUCKETS)
            .map(|b| {
                let views = raw
                    .iter()
                    .skip(b)
                    .step_by(N_BUCKETS)
                    .map(|(n, shape, bytes)| {
                        let view = safetensors::tensor::TensorView::new(
                            safetensors::Dtype::F32,
                            shape.clone(),
                            bytes,
                        )
                        .unwrap();
                        (n.clone(), view)
                    });
                safetensors::serialize(views, None).unwrap()
            })
            .collect()
    };
    let largest_bucket = buckets.iter().map(Vec::len).max().unwrap() as u64;
    let upload = |engine: &EngineHandle| {
        let (engine, buckets) = (engine.clone(), &buckets);
        async move {
            let mut upload = engine.weight_upload();
            for b in buckets {
                let mut pieces = Pieces { body: b };
                engine
                    .upload_bucket(&mut upload, &mut pieces)
                    .await
                    .unwrap();
            }
            let prepared = engine.finish_upload(upload).await.unwrap();
            assert!(prepared.complete);
            engine.install_upload(prepared, None).await.unwrap();
        }
    };
    let reload = |engine: &EngineHandle| {
        let (engine, path) = (engine.clone(), dir.path().to_owned());
        async move {
            let info = engine.update_weights_from_disk(path, None).await.unwrap();
            assert!(info.complete);
        }
    };

    let before = rss();
    let mut rows = Vec::new();
    for i in 0..2 * N_UPDATES + N_UPLOADS {
        let (after, peak) = if i < N_UPDATES {
            measured(push(&engine)).await
        } else if i < 2 * N_UPDATES {
            measured(reload(&engine)).await
        } else {
            measured(upload(&engine)).await
        };
        rows.push((i, after, peak));
    }
    let report: Vec<String> = rows
        .iter()
        .map(|(i, after, peak)| {
            let kind = match *i {
                i if i < N_UPDATES => "push",
                i if i < 2 * N_UPDATES => "reload",
                _ => "upload",
            };
            format!(
                "{kind} {i}: rss {:+} MiB, peak +{} MiB",
                (*after as i64 - before as i64) / MIB as i64,
                peak / MIB
            )
        })
        .collect();
    let report = format!(
        "weights {} MiB, rss before {} MiB\n{}",
        n_weight_bytes / MIB,
        before / MIB,
        report.join("\n")
    );
    eprintln!("{report}");
    for &(_, after, peak) in &rows {
        // Replaced weights are given back: what the update left is a few megabytes of
        // allocator and header state, well under a tenth of the weights (a leak is a copy).
        assert!(
            after < before + n_weight_bytes / 10,
            "resident memory grew across updates:\n{report}"
        );
        // The new weights while the old still serve, and pieces in flight: one extra copy
        // (for an upload, its staged buffers; never a bucket's body whole, but allowed one).
        assert!(
            peak < n_weight_bytes + n_weight_bytes / 8 + largest_bucket,
            "an update held more than one extra copy of the weights:\n{report}"
        );
    }
    engine.shutdown().await.unwrap();
}
