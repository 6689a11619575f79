//! `ferry bench weight-sync`: how fast a trainer's weights reach `ferry serve`, against the
//! link itself, in one invocation (JSON with `--json`).
//!
//! This process plays the trainer: it holds the model's tensors in f32 in memory (538 MB for
//! the default model) and pushes them through the bucketed upload (`/weight_uploads`: buckets
//! of about `--bucket-bytes` in safetensors framing, each sent straight from the tensors'
//! memory, then a commit), measuring until the commit returned and a request was served by
//! the new version. Beside it, in the same run and in turns (`--rounds`, medians reported):
//!
//! * the same bytes over a plain loopback socket pair to a sink that reads and drops them:
//!   what the link moves (the upload's goal: at least half of it);
//! * the one-body push (`POST /update_weights` with one safetensors body);
//! * through `ferry proxy` to one P and one D, against this process uploading to P and D
//!   itself at once (the goal: within 1.3× of it), and against the bytes to two plain sinks;
//! * `update_weights_from_disk` of the model's safetensors folder against `cat` of its files
//!   to `/dev/null`: with the server running (read into new weights while the old serve),
//!   and paused, as an RL loop reloads (read over the weights in place; the pause and the
//!   resume timed apart).
//!
//! The server's resident memory is read around each upload (`/proc/<pid>/status`, its peak
//! reset first through `/proc/<pid>/clear_refs`), against the bound of two copies of the
//! weights plus one bucket.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use bytes::Bytes;
use ferry_cli::ByteSize;
use ferry_model::ModelSpec;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use crate::child::{start, strings};
use crate::lifecycle::report::{reset_peak, status_bytes};

/// Bytes per piece of a body, as a network write sends them.
const PIECE_BYTES: usize = 1 << 20;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, a GGUF file or `tiny`; its weights are written as an f32
    /// safetensors folder, which the servers load. Default: the default model.
    #[arg(long)]
    model: Option<String>,
    /// Bytes per bucket of the upload.
    #[arg(long, default_value = "128MiB")]
    bucket_bytes: ByteSize,
    /// Rounds of each measurement (medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Skip the measurement through `ferry proxy` to 1P1D.
    #[arg(long)]
    no_proxy: bool,
    /// Python whose pip fetches the default model.
    #[arg(long, env = "PYTHON", default_value = "python3")]
    python: String,
    /// Print one JSON object instead of a readable summary.
    #[arg(long)]
    json: bool,
}

/// One bucket: its safetensors header (with the length prefix) and its tensors' bytes.
struct Bucket {
    header: Bytes,
    tensors: Vec<Bytes>,
}

impl Bucket {
    fn n_bytes(&self) -> usize {
        self.header.len() + self.tensors.iter().map(Bytes::len).sum::<usize>()
    }

    /// The body in pieces of at most [`PIECE_BYTES`], each a view of the tensors' memory.
    fn pieces(&self) -> Vec<Bytes> {
        let mut out = vec![self.header.clone()];
        for t in &self.tensors {
            let mut at = 0;
            while at < t.len() {
                let end = (at + PIECE_BYTES).min(t.len());
                out.push(t.slice(at..end));
                at = end;
            }
        }
        out
    }
}

fn body_of(pieces: Vec<Bytes>) -> reqwest::Body {
    reqwest::Body::wrap_stream(futures_util::stream::iter(
        pieces.into_iter().map(Ok::<_, std::io::Error>),
    ))
}

/// The safetensors framing of `tensors` (name, shape, bytes): the length prefix and header.
fn header(tensors: &[&(String, Vec<usize>, Bytes)]) -> Bytes {
    let mut map = serde_json::Map::new();
    let mut at = 0;
    for (name, shape, bytes) in tensors {
        map.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes.len()]}),
        );
        at += bytes.len();
    }
    let mut text = Value::Object(map).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    Bytes::from(out)
}

/// The tensors cut into buckets of about `bucket_bytes`, in name order.
fn buckets(tensors: &[(String, Vec<usize>, Bytes)], bucket_bytes: usize) -> Vec<Bucket> {
    let mut groups: Vec<Vec<&(String, Vec<usize>, Bytes)>> = vec![Vec::new()];
    let mut size = 0;
    for t in tensors {
        let last = groups.last_mut().expect("one group");
        if !last.is_empty() && size + t.2.len() > bucket_bytes {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().expect("one group").push(t);
        size += t.2.len();
    }
    groups
        .into_iter()
        .map(|g| Bucket {
            header: header(&g),
            tensors: g.iter().map(|t| t.2.clone()).collect(),
        })
        .collect()
}

pub fn run(args: Args, ferry: &Path) -> anyhow::Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let bucket_bytes = usize::try_from(args.bucket_bytes.0).context("--bucket-bytes")?;
    ensure!(bucket_bytes > 0, "--bucket-bytes must be positive");
    let tmp = tempfile::tempdir().context("creating a temporary folder")?;
    let (folder, tensors) = f32_model(&args, tmp.path())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let report = runtime.block_on(measure(&args, ferry, bucket_bytes, &folder, &tensors))?;
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// The model as an f32 safetensors folder in `tmp` (what the servers load and the reloads
/// read), and its tensors as this process holds them: (name, shape, f32 bytes).
#[allow(clippy::type_complexity)]
fn f32_model(
    args: &Args,
    tmp: &Path,
) -> anyhow::Result<(PathBuf, Vec<(String, Vec<usize>, Bytes)>)> {
    let loaded = match ferry_cli::resolve_model(args.model.as_deref(), &args.python)? {
        ModelSpec::Tiny => ferry_model::tiny::tiny_model(),
        ModelSpec::Path(path) => {
            ferry_model::load_model(&path).with_context(|| format!("loading {}", path.display()))?
        }
    };
    let folder = tmp.join("f32");
    ferry_model::tiny::write_hf_folder(&loaded, &folder)
        .with_context(|| format!("writing {}", folder.display()))?;
    let tensors = loaded
        .weights
        .tensors
        .iter()
        .map(|(name, t)| {
            let bytes: Vec<u8> = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), t.shape.clone(), Bytes::from(bytes))
        })
        .collect();
    Ok((folder, tensors))
}

fn serve_args(folder: &Path, extra: &[&str]) -> Vec<String> {
    let folder = folder.display().to_string();
    let mut args = strings(&[
        "serve",
        "--model",
        &folder,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--enable-admin-api",
        "--kv-cache-bytes",
        "64MiB",
        "--max-model-len",
        "1024",
    ]);
    args.extend(strings(extra));
    args
}

fn median(xs: Vec<f64>) -> f64 {
    quantile(xs, 0.5)
}

/// The `q` quantile of `xs` (nearest rank, from the low end).
fn quantile(mut xs: Vec<f64>, q: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    let rank = ((xs.len() as f64) * q) as usize;
    xs[rank.min(xs.len() - 1)]
}

async fn measure(
    args: &Args,
    ferry: &Path,
    bucket_bytes: usize,
    folder: &Path,
    tensors: &[(String, Vec<usize>, Bytes)],
) -> anyhow::Result<Value> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(900))
        .build()?;
    let parts = buckets(tensors, bucket_bytes);
    let n_bytes: usize = parts.iter().map(Bucket::n_bytes).sum();
    let largest = parts.iter().map(Bucket::n_bytes).max().unwrap_or(0);
    let whole = {
        let all: Vec<_> = tensors.iter().collect();
        Bucket {
            header: header(&all),
            tensors: tensors.iter().map(|t| t.2.clone()).collect(),
        }
    };

    let server = start(ferry, &serve_args(folder, &[]), None)?;
    let pid = server.child.id().to_string();
    let weight_bytes = client
        .get(format!("{}/weight_info", server.url))
        .send()
        .await?
        .json::<Value>()
        .await?["weight_bytes"]
        .as_u64()
        .unwrap_or(0);
    let (mut plain, mut upload, mut push, mut memory) = (vec![], vec![], vec![], vec![]);
    let (mut cat, mut reload, mut paused) = (vec![], vec![], vec![]);
    for round in 0..args.rounds {
        plain.push(plain_socket(&[&parts], 1).await?);
        let before = status_bytes(&pid, "VmRSS")?;
        reset_peak(&pid)?;
        let times = upload_to(&client, &server.url, &parts, &format!("upload-{round}")).await?;
        let peak = status_bytes(&pid, "VmHWM")?;
        let after = status_bytes(&pid, "VmRSS")?;
        memory.push(json!({"before": before, "peak": peak, "after": after}));
        upload.push(times);
        push.push(push_to(&client, &server.url, &whole, &format!("push-{round}")).await?);
        cat.push(cat_files(folder)?);
        reload.push(reload_from(&client, &server.url, folder, &format!("disk-{round}")).await?);
        paused.push(reload_paused(&client, &server.url, folder, &format!("paused-{round}")).await?);
    }
    drop(server);

    let proxy = if args.no_proxy {
        Value::Null
    } else {
        let p = start(
            ferry,
            &serve_args(folder, &["--kv-role", "kv_producer"]),
            None,
        )?;
        let d = start(
            ferry,
            &serve_args(folder, &["--kv-role", "kv_consumer"]),
            None,
        )?;
        let proxy = start(
            ferry,
            &strings(&[
                "proxy",
                "--port",
                "0",
                "--host",
                "127.0.0.1",
                "--enable-admin-api",
                "--prefill",
                &p.url,
                "--decode",
                &d.url,
            ]),
            None,
        )?;
        let (mut through, mut direct, mut plain2, mut ratios) = (vec![], vec![], vec![], vec![]);
        let mut rounds = vec![];
        for round in 0..args.rounds {
            plain2.push(plain_socket(&[&parts], 2).await?);
            // The client's own fan-out (the same upload to P and to D at once, no proxy) and
            // the upload through the proxy, in alternating order: a pair per round, since the
            // four processes on the machine's cores make each time vary more than the pair.
            let fan_out = || async {
                let started = Instant::now();
                let version = format!("direct-{round}");
                let (to_p, to_d) = tokio::join!(
                    upload_to(&client, &p.url, &parts, &version),
                    upload_to(&client, &d.url, &parts, &version)
                );
                let (to_p, to_d) = (to_p?, to_d?);
                anyhow::Ok((started.elapsed().as_secs_f64(), to_p, to_d))
            };
            let via_proxy = || async {
                let version = format!("fleet-{round}");
                upload_to(&client, &proxy.url, &parts, &version).await
            };
            let ((d_s, to_p, to_d), t) = if round % 2 == 0 {
                let d = fan_out().await?;
                (d, via_proxy().await?)
            } else {
                let t = via_proxy().await?;
                (fan_out().await?, t)
            };
            ensure!(
                t.spliced,
                "the proxy copied a bucket instead of splicing it (docs/proxy.md)"
            );
            direct.push(d_s);
            through.push(t.served_s);
            ratios.push(t.served_s / d_s);
            rounds.push(json!({
                "proxy_s": t.served_s,
                "direct_s": d_s,
                "proxy": t.to_json(),
                "direct_to_p": to_p.to_json(),
                "direct_to_d": to_d.to_json(),
            }));
        }
        drop((proxy, p, d));
        json!({
            "upload_s": median(through),
            "direct_fanout_s": median(direct),
            "upload_over_direct_fanout": median(ratios.clone()),
            // The rounds vary far more than the median (docs/weight-sync.md says why).
            "upload_over_direct_fanout_quartiles": [
                quantile(ratios.clone(), 0.25),
                quantile(ratios, 0.75),
            ],
            "plain_sockets_to_two_sinks_s": median(plain2),
            "rounds": rounds,
        })
    };

    let served = median(upload.iter().map(|t| t.served_s).collect());
    let of_plain = median(
        plain
            .iter()
            .zip(&upload)
            .map(|(p, u)| p / u.served_s)
            .collect(),
    );
    let plain_s = median(plain);
    let peak = memory
        .iter()
        .filter_map(|m| m["peak"].as_u64())
        .max()
        .unwrap_or(0);
    let rss_before = memory[0]["before"].as_u64().unwrap_or(0);
    let (cat_s, reload_s) = (median(cat), median(reload));
    let paused_s = median(paused.iter().map(|p| p.reload_s).collect());
    let cycle_s = median(paused.iter().map(|p| p.cycle_s).collect());
    let gb = |s: f64| n_bytes as f64 / s / 1e9;
    Ok(json!({
        "model": args.model.as_deref().unwrap_or("default"),
        "weight_bytes_pushed": n_bytes,
        "n_tensors": tensors.len(),
        "bucket_bytes": bucket_bytes,
        "n_buckets": parts.len(),
        "rounds": args.rounds,
        "plain_socket_s": plain_s,
        "plain_socket_gb_s": gb(plain_s),
        "upload": {
            "served_s": served,
            "buckets_s": median(upload.iter().map(|t| t.buckets_s).collect()),
            "commit_s": median(upload.iter().map(|t| t.commit_s).collect()),
            "gb_s": gb(served),
            "of_plain_socket": of_plain,
        },
        "one_body_push_s": median(push),
        "server_memory": {
            "weight_bytes": weight_bytes,
            "rss_before": rss_before,
            "rss_after_last": memory.last().and_then(|m| m["after"].as_u64()),
            "peak": peak,
            "bound": rss_before + weight_bytes + largest as u64 + (weight_bytes + largest as u64) / 20,
            "peak_over_bound": peak as f64
                / (rss_before + weight_bytes + largest as u64 + (weight_bytes + largest as u64) / 20) as f64,
            "rounds": memory,
        },
        "from_disk": {
            "cat_s": cat_s,
            "reload_s": reload_s,
            "reload_over_cat": reload_s / cat_s,
            "paused_reload_s": paused_s,
            "paused_reload_over_cat": paused_s / cat_s,
            "pause_reload_resume_s": cycle_s,
        },
        "proxy_1p1d": proxy,
    }))
}

/// One upload's times, from its start.
struct UploadTimes {
    /// Every bucket sent and staged.
    buckets_s: f64,
    /// The commit (from the last bucket).
    commit_s: f64,
    /// Until a request was served by the new version.
    served_s: f64,
    /// No bucket was answered `"spliced": false` (only the proxy answers it).
    spliced: bool,
}

impl UploadTimes {
    fn to_json(&self) -> Value {
        json!({
            "buckets_s": self.buckets_s,
            "commit_s": self.commit_s,
            "served_s": self.served_s,
        })
    }
}

async fn ok_json(response: reqwest::Response, what: &str) -> anyhow::Result<Value> {
    let status = response.status();
    let body: Value = response.json().await.with_context(|| what.to_owned())?;
    ensure!(status.is_success(), "{what}: {status}: {body}");
    Ok(body)
}

async fn upload_to(
    client: &reqwest::Client,
    base: &str,
    parts: &[Bucket],
    version: &str,
) -> anyhow::Result<UploadTimes> {
    let started = Instant::now();
    let begun = client
        .post(format!("{base}/weight_uploads"))
        .json(&json!({"weight_version": version}))
        .send()
        .await?;
    let id = ok_json(begun, "beginning an upload").await?["upload_id"]
        .as_str()
        .context("no upload_id")?
        .to_owned();
    let mut spliced = true;
    for (i, b) in parts.iter().enumerate() {
        let sent = client
            .post(format!("{base}/weight_uploads/{id}/buckets"))
            .header("content-type", "application/octet-stream")
            .header("content-length", b.n_bytes())
            .body(body_of(b.pieces()))
            .send()
            .await?;
        let answer = ok_json(sent, &format!("bucket {i}")).await?;
        // Only the proxy says (its zero-copy path needs the length up front).
        if let Some(s) = answer["spliced"].as_bool() {
            spliced &= s;
        }
    }
    let buckets_s = started.elapsed().as_secs_f64();
    let committed = client
        .post(format!("{base}/weight_uploads/{id}/commit"))
        .json(&json!({}))
        .send()
        .await?;
    ok_json(committed, "the commit").await?;
    let commit_s = started.elapsed().as_secs_f64() - buckets_s;
    served_by(client, base, version).await?;
    Ok(UploadTimes {
        buckets_s,
        commit_s,
        served_s: started.elapsed().as_secs_f64(),
        spliced,
    })
}

/// A one-token request, checked to be served by `version`.
async fn served_by(client: &reqwest::Client, base: &str, version: &str) -> anyhow::Result<()> {
    let answer = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}))
        .send()
        .await?;
    let answer = ok_json(answer, "the request after the update").await?;
    let versions = &answer["choices"][0]["weight_versions"];
    ensure!(
        *versions == json!([version]),
        "served by {versions}, not {version}"
    );
    Ok(())
}

async fn push_to(
    client: &reqwest::Client,
    base: &str,
    whole: &Bucket,
    version: &str,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let pushed = client
        .post(format!("{base}/update_weights?weight_version={version}"))
        .header("content-type", "application/octet-stream")
        .header("content-length", whole.n_bytes())
        .body(body_of(whole.pieces()))
        .send()
        .await?;
    ok_json(pushed, "the one-body push").await?;
    served_by(client, base, version).await?;
    Ok(started.elapsed().as_secs_f64())
}

async fn reload_from(
    client: &reqwest::Client,
    base: &str,
    folder: &Path,
    version: &str,
) -> anyhow::Result<f64> {
    Ok(post_reload(client, base, folder, version).await?.0)
}

/// `update_weights_from_disk` of `folder`: its time and the reply.
async fn post_reload(
    client: &reqwest::Client,
    base: &str,
    folder: &Path,
    version: &str,
) -> anyhow::Result<(f64, Value)> {
    let started = Instant::now();
    let reloaded = client
        .post(format!("{base}/update_weights_from_disk"))
        .json(&json!({"model_path": folder, "weight_version": version}))
        .send()
        .await?;
    let body = ok_json(reloaded, "the reload from disk").await?;
    Ok((started.elapsed().as_secs_f64(), body))
}

/// A reload while paused, as an RL loop makes it.
struct PausedReload {
    /// `update_weights_from_disk` alone.
    reload_s: f64,
    /// Pause, reload, resume.
    cycle_s: f64,
}

/// Pauses (`keep`), reloads the folder (read over the weights in place, which the reply must
/// say), resumes.
async fn reload_paused(
    client: &reqwest::Client,
    base: &str,
    folder: &Path,
    version: &str,
) -> anyhow::Result<PausedReload> {
    let started = Instant::now();
    let paused = client
        .post(format!("{base}/pause?mode=keep&clear_cache=false"))
        .send()
        .await?;
    ok_json(paused, "the pause").await?;
    let (reload_s, body) = post_reload(client, base, folder, version).await?;
    ensure!(
        body["in_place"] == true,
        "a reload while paused is read in place: {body}"
    );
    let resumed = client.post(format!("{base}/resume")).send().await?;
    ok_json(resumed, "the resume").await?;
    Ok(PausedReload {
        reload_s,
        cycle_s: started.elapsed().as_secs_f64(),
    })
}

/// `cat` of the folder's safetensors files to /dev/null, timed.
fn cat_files(folder: &Path) -> anyhow::Result<f64> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let started = Instant::now();
    let status = Command::new("cat")
        .args(&files)
        .stdout(std::process::Stdio::null())
        .status()
        .context("running cat")?;
    ensure!(status.success(), "cat failed");
    Ok(started.elapsed().as_secs_f64())
}

/// Every bucket's bytes over `n_sinks` plain loopback connections at once (each connection
/// carrying all of them, as a fan-out to `n_sinks` servers), to sinks that read and drop
/// them; the time until every sink has read everything.
async fn plain_socket(parts: &[&[Bucket]], n_sinks: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n_sinks {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let sink = std::thread::spawn(move || -> std::io::Result<u64> {
            let (mut conn, _) = listener.accept()?;
            std::io::copy(&mut conn, &mut std::io::sink())
        });
        let pieces: Vec<Bytes> = parts
            .iter()
            .flat_map(|ps| ps.iter().flat_map(Bucket::pieces))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut conn = tokio::net::TcpStream::connect(addr).await?;
            for p in pieces {
                conn.write_all(&p).await?;
            }
            conn.shutdown().await?;
            drop(conn);
            tokio::task::spawn_blocking(move || sink.join())
                .await
                .map_err(std::io::Error::other)?
                .map_err(|_| std::io::Error::other("the sink panicked"))?
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, n: usize) -> (String, Vec<usize>, Bytes) {
        (name.to_owned(), vec![n], Bytes::from(vec![1u8; n * 4]))
    }

    #[test]
    fn buckets_hold_every_tensor_once_within_the_size_and_parse_as_safetensors() {
        let tensors: Vec<_> = (0..7).map(|i| tensor(&format!("t{i}"), 100 + i)).collect();
        let parts = buckets(&tensors, 1000);
        assert!(parts.len() > 1);
        let mut names = Vec::new();
        for b in &parts {
            let body: Vec<u8> = b.pieces().iter().flat_map(|p| p.to_vec()).collect();
            assert_eq!(body.len(), b.n_bytes());
            let file = safetensors::SafeTensors::deserialize(&body).unwrap();
            // A bucket goes past the size only with its first tensor.
            assert!(file.len() == 1 || b.n_bytes() - b.header.len() <= 1000);
            names.extend(file.names().into_iter().map(str::to_owned));
        }
        names.sort();
        let want: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
        assert_eq!(names, want);
    }
}
