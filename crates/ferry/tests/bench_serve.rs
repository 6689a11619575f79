//! End to end: `ferry bench serve` against a fake OpenAI server on a loopback port that
//! streams `max_tokens` chunks, refuses one request, breaks one stream, and exports the two
//! engine time counters. Checks the report's counts, failures and overhead exactly, and that
//! `--concurrency` bounds the requests in flight.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream;
use serde_json::{json, Value};

/// A prompt starting with this token is refused with HTTP 400.
const REFUSED_TOKEN: u64 = 13;
/// A prompt starting with this token gets an error event in the middle of its stream.
const BROKEN_TOKEN: u64 = 14;

#[derive(Debug, Default)]
struct Fake {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Streams served to the end; the fake engine "spends" 1 s per stream, 0.75 s of it in
    /// the forward.
    n_served: AtomicUsize,
    /// Requests seen, in arrival order: (cache salt, JSON schema), each `null` when absent.
    variants: std::sync::Mutex<Vec<(Value, Value)>>,
}

/// Decrements the in-flight count when the response body is dropped (done or abandoned).
#[derive(Debug)]
struct InFlight(Arc<Fake>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
}

async fn metrics(State(fake): State<Arc<Fake>>) -> String {
    let n = fake.n_served.load(Ordering::SeqCst) as f64;
    format!(
        "# TYPE ferry_engine_step_seconds_total counter\n\
         ferry_engine_step_seconds_total {n}\n\
         ferry_engine_forward_seconds_total{{engine=\"0\"}} {}\n",
        n * 0.75
    )
}

fn bad_request(message: String) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error"}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

/// What a benchmark request must look like; `Err` names the first field that is wrong.
fn check_body(body: &Value) -> Result<(), String> {
    let want = [
        ("model", json!("fake-model")),
        ("stream", json!(true)),
        ("ignore_eos", json!(true)),
        ("temperature", json!(0.0)),
        ("stream_options", json!({"include_usage": true})),
    ];
    for (field, value) in want {
        if body[field] != value {
            return Err(format!("{field}: expected {value}, got {}", body[field]));
        }
    }
    let prompt_ok = body["prompt"]
        .as_array()
        .is_some_and(|p| !p.is_empty() && p.iter().all(Value::is_u64));
    if !prompt_ok || !body["max_tokens"].is_u64() {
        return Err("prompt or max_tokens".into());
    }
    let constraint_ok = match &body["structured_outputs"] {
        Value::Null => true,
        v => v
            .as_object()
            .is_some_and(|o| o.len() == 1 && o["json"].is_object()),
    };
    if !constraint_ok || !(body["cache_salt"].is_null() || body["cache_salt"].is_string()) {
        return Err("structured_outputs or cache_salt".into());
    }
    Ok(())
}

async fn completions(State(fake): State<Arc<Fake>>, Json(body): Json<Value>) -> Response {
    if let Err(e) = check_body(&body) {
        return bad_request(e);
    }
    fake.variants.lock().unwrap().push((
        body["cache_salt"].clone(),
        body["structured_outputs"]["json"].clone(),
    ));
    let first = body["prompt"][0].as_u64().unwrap_or(0);
    if first == REFUSED_TOKEN {
        return bad_request(format!("prompt: token {REFUSED_TOKEN} is not allowed"));
    }
    let n_prompt = body["prompt"].as_array().map_or(0, Vec::len);
    let n_out = body["max_tokens"].as_u64().unwrap_or(0) as usize;
    let mut events: Vec<String> = (0..n_out)
        .map(|i| {
            json!({"choices": [{"index": 0, "text": format!("t{i} "), "finish_reason": null}]})
                .to_string()
        })
        .collect();
    if first == BROKEN_TOKEN {
        events.truncate(1);
        events.push(json!({"error": {"message": "engine died", "code": 500}}).to_string());
    } else {
        events.push(
            json!({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}).to_string(),
        );
        events.push(json!({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}).to_string());
        events.push("[DONE]".to_owned());
    }
    let now = fake.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    fake.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let guard = InFlight(fake.clone());
    let n_events = events.len();
    let body = stream::unfold(
        (events.into_iter().enumerate(), guard),
        move |(mut it, guard)| async move {
            let (i, data) = it.next()?;
            // Tokens take a little while, so that requests overlap.
            tokio::time::sleep(Duration::from_millis(3)).await;
            if i + 1 == n_events && data == "[DONE]" {
                guard.0.n_served.fetch_add(1, Ordering::SeqCst);
            }
            let frame = format!("data: {data}\n\n");
            Some((Ok::<_, std::io::Error>(frame), (it, guard)))
        },
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| bad_request(e.to_string()))
}

/// Starts the fake server; `with_metrics: false` leaves out `/metrics` (and `/v1/models`).
async fn start_fake(with_metrics: bool) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let mut app = Router::new().route("/v1/completions", post(completions));
    if with_metrics {
        app = app
            .route("/v1/models", get(models))
            .route("/metrics", get(metrics));
    }
    let app = app.with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, fake)
}

/// Runs the real binary (blocking, so off the runtime's workers); returns its last line
/// (the JSON report) parsed, and the whole of its output.
async fn bench(args: Vec<String>) -> (Value, String) {
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["bench", "serve"])
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ferry bench serve failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap();
    (report, stdout.into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_run_reports_counts_failures_and_overhead() {
    let (url, fake) = start_fake(true).await;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let lines = [
        json!({"prompt": [1, 2, 3], "output_len": 5}),
        json!({"prompt": [REFUSED_TOKEN, 2], "output_len": 5}),
        json!({"prompt_len": 7, "output_len": 1, "arrival_s": 0.02}),
        json!({"prompt": [BROKEN_TOKEN], "output_len": 5, "arrival_s": 0.01}),
        json!({"prompt": [4, 5], "output_len": 8}),
        json!({"prompt_len": 3, "output_len": 6, "arrival_s": 0.03}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&trace, text).unwrap();

    let (r, _) = bench(vec![
        "--url".into(),
        url.clone(),
        "--trace".into(),
        trace.display().to_string(),
        "--concurrency".into(),
        "2".into(),
        "--json".into(),
    ])
    .await;

    assert_eq!(r["model"], "fake-model");
    assert_eq!(r["n_requests"], 6);
    assert_eq!(r["n_completed"], 4);
    assert_eq!(r["n_failed"], 2);
    // Sorted by arrival: [1,2,3], [13,2], [4,5], [14] (0.01 s), 7 tokens (0.02 s), 3 (0.03 s).
    let failures = r["failures"].as_array().unwrap();
    assert_eq!(failures[0]["request_idx"], 1);
    assert_eq!(
        failures[0]["error"],
        "HTTP status 400: prompt: token 13 is not allowed"
    );
    assert_eq!(failures[1]["request_idx"], 3);
    assert_eq!(
        failures[1]["error"],
        "server sent an error in the stream: engine died"
    );
    assert_eq!(r["total_input_tokens"], 3 + 2 + 7 + 3);
    assert_eq!(r["total_output_tokens"], 5 + 8 + 1 + 6);
    assert_eq!(r["n_output_len_mismatch"], 0);
    assert!(r["duration_s"].as_f64().unwrap() >= 0.03);
    let overhead = r["engine_overhead_fraction"].as_f64().unwrap();
    assert!((overhead - 0.25).abs() < 1e-12, "{overhead}");
    for field in ["ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"] {
        let p50 = r[field]["p50"].as_f64().unwrap();
        assert!(
            p50 > 0.0 && p50 <= r[field]["p99"].as_f64().unwrap(),
            "{field}"
        );
    }
    assert!(fake.max_in_flight.load(Ordering::SeqCst) <= 2);
    assert_eq!(fake.n_served.load(Ordering::SeqCst), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_run_without_metrics_reports_null_overhead_and_a_summary() {
    // No /metrics here: a server without the counters must give a null overhead.
    let (bare, fake) = start_fake(false).await;

    let (r, stdout) = bench(
        [
            "--url",
            &bare,
            "--model",
            "fake-model",
            "--num-requests",
            "5",
            "--prompt-len",
            "uniform:2:4",
            "--output-len",
            "3",
            "--request-rate",
            "200",
            "--seed",
            "3",
        ]
        .map(str::to_owned)
        .to_vec(),
    )
    .await;
    assert_eq!(
        (r["n_completed"].as_u64(), r["n_failed"].as_u64()),
        (Some(5), Some(0))
    );
    assert_eq!(r["total_output_tokens"], 15);
    let input = r["total_input_tokens"].as_u64().unwrap();
    assert!((10..=20).contains(&input), "{input}");
    assert!(r["engine_overhead_fraction"].is_null());
    assert_eq!(r["request_rate"], 200.0);
    assert_eq!(fake.n_served.load(Ordering::SeqCst), 5);
    // Without --json the readable summary comes first.
    assert!(
        stdout.contains("requests              5 completed, 0 failed"),
        "{stdout}"
    );
    assert!(
        stdout.contains("tokens                ") && stdout.contains(" in, 15 out"),
        "{stdout}"
    );
    assert!(stdout.contains("engine overhead       - "), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_runs_the_workload_twice_and_reports_the_ratio() {
    let (url, fake) = start_fake(true).await;
    let schema = json!({"type": "array", "items": {"type": "integer"}, "minItems": 100});
    let (r, _) = bench(
        [
            "--url",
            &url,
            "--num-requests",
            "4",
            "--prompt-len",
            "3",
            "--output-len",
            "5",
            "--seed",
            "1",
            "--json",
            "--json-schema",
            &schema.to_string(),
        ]
        .map(str::to_owned)
        .to_vec(),
    )
    .await;
    for run in ["unconstrained", "constrained"] {
        assert_eq!(r[run]["n_completed"], 4, "{run}: {r}");
        assert_eq!(r[run]["total_output_tokens"], 20, "{run}: {r}");
    }
    let ratio = r["constrained_output_throughput_ratio"].as_f64().unwrap();
    assert!(ratio > 0.0, "{r}");
    // First every request unconstrained, then every one with the schema; each run under
    // one salt of its own.
    let seen = fake.variants.lock().unwrap().clone();
    assert_eq!(seen.len(), 8);
    let (plain, constrained) = seen.split_at(4);
    assert!(plain
        .iter()
        .all(|(salt, s)| s.is_null() && salt == &plain[0].0));
    assert!(constrained
        .iter()
        .all(|(salt, s)| s == &schema && salt == &constrained[0].0));
    assert!(plain[0].0.is_string() && plain[0].0 != constrained[0].0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baseline_run_reports_both_and_the_ttft_the_target_adds() {
    let (target, target_fake) = start_fake(true).await;
    let (baseline, baseline_fake) = start_fake(true).await;
    let (r, stdout) = bench(
        [
            "--url",
            &target,
            "--baseline-url",
            &baseline,
            "--num-requests",
            "4",
            "--rounds",
            "2",
            "--prompt-len",
            "3",
            "--output-len",
            "2",
        ]
        .map(str::to_owned)
        .to_vec(),
    )
    .await;
    assert_eq!(r["target"]["url"], target.as_str());
    assert_eq!(r["baseline"]["url"], baseline.as_str());
    // Two rounds, each side's requests pooled.
    for side in ["target", "baseline"] {
        assert_eq!(r[side]["n_completed"], 8, "{side}: {r}");
    }
    assert_eq!(target_fake.n_served.load(Ordering::SeqCst), 8);
    assert_eq!(baseline_fake.n_served.load(Ordering::SeqCst), 8);
    for stat in ["mean", "p50", "p99"] {
        let added = r["ttft_added_ms"][stat].as_f64().unwrap();
        let expected = r["target"]["ttft_ms"][stat].as_f64().unwrap()
            - r["baseline"]["ttft_ms"][stat].as_f64().unwrap();
        assert!((added - expected).abs() < 1e-9, "{stat}: {r}");
        assert!(r["e2e_added_ms"][stat].is_number(), "{r}");
    }
    assert!(stdout.contains("TTFT added (ms)"), "{stdout}");
}
