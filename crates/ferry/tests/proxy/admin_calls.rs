//! Every admin call the table declares (`ferry_admin::AdminCall`), with every method it
//! accepts, through `ferry proxy` to two plain instances publishing KV events: the proxy
//! fences an instance's prefix index exactly for the calls that may wipe its cache (a reset,
//! a clearing pause or sleep, a memory release, a weight change), before it answers, and the
//! instances' own caches show those are the calls that do wipe them.
//!
//! Each case states its own expectation (an exhaustive `match` on the calls: one added to the
//! table does not build here until it has cases), and checks the table agrees with it
//! (`Args::effects`). For each case both instances first cache a prompt's prefix and the
//! proxy's index follows it; then the call goes through the proxy (after what it needs
//! first: a pause, an upload), and as soon as the proxy answers:
//! * the instances' fence counts (`ferry_proxy_kv_fences_total`) moved by one for a wiping
//!   call, by none otherwise, and a fenced index is empty: the instances' own events, which
//!   would empty it too, cannot make this pass;
//! * after the engines are put back as they were (resume, wake-up, ...), the prefix is sent
//!   to each instance directly: a wiping call left nothing cached, any other all of it.

use std::time::Duration;

use ferry_admin::{AdminCall, Method};
use serde_json::{json, Value};

use super::procs::*;

const BLOCK: usize = 16;
/// Blocks of the prompt's prefix (its last, partial block is never cached).
const N_BLOCKS: usize = 3;

/// The prompt both instances cache before each case.
fn prompt() -> Vec<u32> {
    let mut p: Vec<u32> = (0..(N_BLOCKS * BLOCK) as u32)
        .map(|i| 7 + i * 3 % 180)
        .collect();
    p.extend([201, 202, 9]);
    p
}

/// What a call needs before it, through the proxy (none of it wipes a cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Before {
    Nothing,
    /// `pause?mode=keep&clear_cache=false`.
    Pause,
    /// `sleep?level=0` (a pause, as a sleep).
    SleepLevel0,
    /// An upload begun.
    Upload,
    /// An upload begun, with one bucket staged.
    UploadWithBucket,
}

/// What puts the engines back after the call, through the proxy, before every case's
/// wake-up and resume (both do nothing to an engine that runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    Nothing,
    /// The weights a sleep of level 2 dropped: a reload.
    Reload,
    /// The upload the case began, discarded.
    Discard,
}

/// One call with its arguments and what it must do.
#[derive(Debug, Clone)]
struct Case {
    query: &'static str,
    body: Body,
    /// It may wipe the instances' caches (and, here, does).
    wipes: bool,
    /// The proxy's answer.
    status: u16,
    before: Before,
    after: After,
}

#[derive(Debug, Clone)]
enum Body {
    None,
    Json(Value),
    /// Safetensors bytes.
    Bytes(Vec<u8>),
    /// `{"model_path": <the tiny model's folder>}` / `{"weight_dir": ...}`.
    ModelPath(&'static str),
}

fn case(wipes: bool) -> Case {
    Case {
        query: "",
        body: Body::None,
        wipes,
        status: 200,
        before: Before::Nothing,
        after: After::Nothing,
    }
}

/// The cases of `call` (the same for each of its methods).
fn cases(call: AdminCall) -> Vec<Case> {
    use AdminCall as C;
    let json_body = |v: Value| Body::Json(v);
    match call {
        C::Pause => vec![
            Case {
                query: "mode=keep&clear_cache=false",
                ..case(false)
            },
            Case {
                query: "mode=keep",
                ..case(true)
            },
            Case { ..case(true) },
        ],
        C::Resume | C::ContinueGeneration => vec![Case {
            before: Before::Pause,
            ..case(false)
        }],
        C::IsPaused | C::IsSleeping | C::WeightInfo | C::GetWeightVersion | C::CurrentUpload => {
            vec![case(false)]
        }
        C::Sleep => vec![
            Case {
                query: "level=0",
                ..case(false)
            },
            Case { ..case(true) },
            Case {
                body: json_body(json!({"level": 2, "mode": "wait"})),
                after: After::Reload,
                ..case(true)
            },
        ],
        C::WakeUp => vec![Case {
            before: Before::SleepLevel0,
            query: "tags=weights&tags=kv_cache",
            ..case(false)
        }],
        C::ReleaseKvCacheMemory => vec![Case {
            before: Before::Pause,
            ..case(true)
        }],
        C::ResetPrefixCache => vec![Case {
            query: "reset_external=true",
            ..case(true)
        }],
        C::FlushCache => vec![case(true)],
        C::AbortRequests => vec![Case {
            body: json_body(json!({})),
            ..case(false)
        }],
        C::AbortRequest => vec![Case {
            body: json_body(json!({"abort_all": true})),
            ..case(false)
        }],
        C::UpdateWeights => vec![
            Case {
                body: Body::Bytes(norm_push(1.25)),
                ..case(true)
            },
            Case {
                body: Body::ModelPath("weight_dir"),
                ..case(true)
            },
        ],
        C::UpdateWeightsFromDisk => vec![Case {
            body: Body::ModelPath("model_path"),
            ..case(true)
        }],
        C::UpdateWeightVersion => vec![Case {
            body: json_body(json!({"new_version": "renamed"})),
            ..case(true)
        }],
        C::InitWeightTransferEngine => vec![Case {
            status: 400,
            ..case(false)
        }],
        // The instances serve no adapters (no --enable-lora): refused, nothing changes.
        C::LoadLoraAdapter | C::SglangLoadLoraAdapter => vec![Case {
            body: json_body(json!({"lora_name": "a", "lora_path": "/nonexistent"})),
            status: 400,
            ..case(false)
        }],
        C::PushLoraAdapter => vec![Case {
            query: "lora_name=a&config=%7B%22r%22%3A8%7D&load_inplace=true",
            body: Body::Bytes(norm_push(0.5)),
            status: 400,
            ..case(false)
        }],
        C::UnloadLoraAdapter | C::SglangUnloadLoraAdapter => vec![Case {
            body: json_body(json!({"lora_name": "a"})),
            status: 400,
            ..case(false)
        }],
        C::BeginUpload => vec![Case {
            after: After::Discard,
            ..case(false)
        }],
        C::UploadBucket => vec![Case {
            before: Before::Upload,
            body: Body::Bytes(norm_push(0.75)),
            after: After::Discard,
            ..case(false)
        }],
        C::PrepareUpload => vec![Case {
            before: Before::UploadWithBucket,
            after: After::Discard,
            ..case(false)
        }],
        C::CommitUpload => vec![Case {
            before: Before::UploadWithBucket,
            ..case(true)
        }],
        C::DiscardUpload => vec![Case {
            before: Before::Upload,
            ..case(false)
        }],
        C::PauseGeneration => vec![
            Case {
                body: json_body(json!({"mode": "retract"})),
                ..case(true)
            },
            Case {
                body: json_body(json!({"mode": "in_place"})),
                ..case(false)
            },
            Case { ..case(false) },
        ],
        C::ReleaseMemoryOccupation => vec![
            Case { ..case(true) },
            Case {
                body: json_body(json!({"tags": ["cuda_graph"]})),
                ..case(false)
            },
        ],
        C::ResumeMemoryOccupation => vec![case(false)],
    }
}

/// The proxy under test, its two instances, and the tiny model's folder for reloads.
struct Fleet {
    proxy: Proc,
    instances: [Proc; 2],
    model: String,
    http: reqwest::Client,
}

impl Fleet {
    async fn send(&self, method: Method, path: &str, query: &str, body: &Body) -> (u16, Value) {
        let url = format!("{}{path}?{query}", self.proxy.url);
        let req = match method {
            Method::Get => self.http.get(url),
            Method::Post => self.http.post(url),
            Method::Delete => self.http.delete(url),
        };
        let req = match body {
            Body::None => req,
            Body::Json(v) => req.json(v),
            Body::Bytes(b) => req
                .header("content-type", "application/octet-stream")
                .body(b.clone()),
            Body::ModelPath(field) => req.json(&json!({ *field: self.model })),
        };
        let response = req.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// A call that must succeed.
    async fn ok(&self, method: Method, path: &str, query: &str, body: Body) -> Value {
        let (status, out) = self.send(method, path, query, &body).await;
        assert_eq!(status, 200, "{} {path}?{query}: {out}", method.as_str());
        out
    }

    /// The tokens of `prompt()` each instance has cached, asked of it directly.
    async fn cached(&self) -> [u64; 2] {
        let body = json!({"model": "tiny", "prompt": prompt(), "max_tokens": 1, "temperature": 0});
        let mut out = [0; 2];
        for (i, instance) in self.instances.iter().enumerate() {
            let (status, answer) = post(&url(&instance.url, "/v1/completions"), &body).await;
            assert_eq!(status, 200, "{answer}");
            out[i] = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("no cached_tokens: {answer}"));
        }
        out
    }

    /// Both instances cache the prefix, and the proxy's index holds it for both.
    async fn prime(&self) {
        self.cached().await;
        let urls: Vec<String> = self.instances.iter().map(|i| i.url.clone()).collect();
        wait_metrics(&self.proxy.url, Duration::from_secs(20), |m| {
            urls.iter()
                .all(|u| instance_metric(m, "ferry_proxy_kv_index_blocks", u) >= N_BLOCKS as f64)
        })
        .await;
    }

    /// Each instance's fence count and index size, as the proxy reports them.
    async fn fences(&self) -> [(f64, f64); 2] {
        let m = metrics_text(&self.proxy.url).await;
        let at = |i: &Proc| {
            (
                instance_metric(&m, "ferry_proxy_kv_fences_total", &i.url),
                instance_metric(&m, "ferry_proxy_kv_index_blocks", &i.url),
            )
        };
        [at(&self.instances[0]), at(&self.instances[1])]
    }

    /// Begins an upload through the proxy (with one bucket staged): its id.
    async fn upload(&self, bucket: bool) -> String {
        let begun = self
            .ok(Method::Post, "/weight_uploads", "", Body::None)
            .await;
        let id = begun["upload_id"].as_str().unwrap().to_owned();
        if bucket {
            let path = format!("/weight_uploads/{id}/buckets");
            self.ok(Method::Post, &path, "", Body::Bytes(norm_push(0.5)))
                .await;
        }
        id
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_call_through_the_proxy_fences_exactly_the_caches_it_may_wipe() {
    let _turn = super::SERIAL.lock().await;
    // Longer than the other tests' bound: some forty cases, each priming two caches.
    tokio::time::timeout(Duration::from_secs(300), async {
        let model_dir = tempfile::tempdir().unwrap();
        let model = model_dir.path().join("tiny");
        make_model(&["tiny"], &model);
        let (proxy, instances) = kv_fleet(&[], &["--enable-admin-api"]).await;
        let fleet = Fleet {
            proxy,
            instances,
            model: model.to_str().unwrap().to_owned(),
            http: client(),
        };

        let mut n_cases = 0;
        for call in AdminCall::all() {
            let decl = call.decl();
            for &method in decl.methods {
                for case in cases(call) {
                    n_cases += 1;
                    run_case(&fleet, call, method, &case).await;
                }
            }
        }
        assert!(n_cases >= 35, "{n_cases} cases");
    })
    .await
    .expect("the test ran past its bound");
}

async fn run_case(fleet: &Fleet, call: AdminCall, method: Method, case: &Case) {
    let decl = call.decl();
    let what = format!(
        "{} {}?{} {:?}",
        method.as_str(),
        decl.path,
        case.query,
        case.body
    );
    fleet.prime().await;
    let upload = match case.before {
        Before::Nothing => None,
        Before::Pause => {
            let q = "mode=keep&clear_cache=false";
            fleet.ok(Method::Post, "/pause", q, Body::None).await;
            None
        }
        Before::SleepLevel0 => {
            fleet
                .ok(Method::Post, "/sleep", "level=0", Body::None)
                .await;
            None
        }
        Before::Upload => Some(fleet.upload(false).await),
        Before::UploadWithBucket => Some(fleet.upload(true).await),
    };
    let path = match &upload {
        Some(id) => decl.path.replace("{upload_id}", id),
        None => decl.path.to_owned(),
    };

    // The table agrees with the case.
    let body_bytes = match &case.body {
        Body::None => Some(Vec::new()),
        Body::Json(v) => Some(v.to_string().into_bytes()),
        Body::ModelPath(field) => Some(json!({ *field: fleet.model }).to_string().into_bytes()),
        Body::Bytes(_) => None,
    };
    let args = call
        .read(ferry_admin::Request {
            path: &path,
            query: Some(case.query),
            body: body_bytes.as_deref(),
        })
        .unwrap_or_else(|e| panic!("{what}: the table refuses the case: {e:?}"));
    assert_eq!(
        args.effects().wipes_cache(),
        case.wipes,
        "{what}: the table"
    );

    let before = fleet.fences().await;
    let (status, out) = fleet.send(method, &path, case.query, &case.body).await;
    let after = fleet.fences().await;
    assert_eq!(status, case.status, "{what}: {out}");
    for i in 0..2 {
        let fenced = after[i].0 - before[i].0;
        assert_eq!(
            fenced,
            f64::from(u8::from(case.wipes)),
            "{what}: instance {i} fenced {fenced} times (index {} → {} blocks)",
            before[i].1,
            after[i].1
        );
        if case.wipes {
            // The call may have let in new stores since (a provisional route does not
            // count): nothing of the prefix it wiped is left.
            assert!(after[i].1 < N_BLOCKS as f64, "{what}: index {}", after[i].1);
        } else {
            assert!(
                after[i].1 >= N_BLOCKS as f64,
                "{what}: index {}",
                after[i].1
            );
        }
    }

    match case.after {
        After::Nothing => {}
        After::Reload => {
            let body = Body::ModelPath("model_path");
            fleet
                .ok(Method::Post, "/update_weights_from_disk", "", body)
                .await;
        }
        After::Discard => {
            let id = match upload {
                Some(id) => id,
                None => out["upload_id"].as_str().unwrap().to_owned(),
            };
            let path = format!("/weight_uploads/{id}");
            fleet.ok(Method::Delete, &path, "", Body::None).await;
        }
    }
    fleet.ok(Method::Post, "/wake_up", "", Body::None).await;
    fleet.ok(Method::Post, "/resume", "", Body::None).await;
    // What the instances' caches say: the call wiped them, or left the prefix.
    let cached = fleet.cached().await;
    let want = if case.wipes {
        0
    } else {
        (N_BLOCKS * BLOCK) as u64
    };
    assert_eq!(cached, [want, want], "{what}: tokens cached after it");
}
