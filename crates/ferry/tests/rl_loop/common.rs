//! The RL loop through `ferry proxy` in front of one P and one D, shared by `rl_loop_pd` (the
//! TCP transport) and `pd_nixl` (NIXL beside TCP); see `rl_loop_pd.rs` for what it checks.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::procs::{self, client, metric, metrics_text, FERRY};

/// Weight-update cycles the trainer runs.
const N_CYCLES: usize = 40;
/// Client tasks sending completions all along.
const N_CLIENTS: usize = 8;
/// Client answers the trainer waits for after each resume before its next pause (bounded by
/// `CYCLE_TRAFFIC_WAIT`), so every cycle has traffic around it.
const ANSWERS_PER_CYCLE: usize = 8;
const CYCLE_TRAFFIC_WAIT: Duration = Duration::from_secs(5);
/// The whole test, processes started to blocks checked.
const TEST_BOUND: Duration = Duration::from_secs(120);

/// A shared opening, so prompts share prefix blocks on P (and D's prefix cache).
const SHARED: &str = "The ferry crossed the wide river at dawn, carrying twelve cars, a bicycle \
                      and a dog that barked at every gull it saw.";

/// A POST: status and body (a non-JSON body as a string); a transport error is status 0.
async fn post(client: &reqwest::Client, url: &str, body: &Value, id: Option<&str>) -> (u16, Value) {
    let mut req = client.post(url).json(body);
    if let Some(id) = id {
        req = req.header("X-Request-Id", id);
    }
    let response = match req.send().await {
        Ok(r) => r,
        Err(e) => return (0, Value::String(format!("{url}: {e}"))),
    };
    let status = response.status().as_u16();
    let text = response
        .text()
        .await
        .unwrap_or_else(|e| format!("<body: {e}>"));
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

/// Why an engine's KV is not all free yet (None: every block is free, no request is live, and
/// every transfer it started has ended).
fn kv_not_free(text: &str, role: &str) -> Option<String> {
    let m = |name: &str| metric(text, name);
    let mut why = Vec::new();
    // `kv_blocks_used`: blocks with an owner (a request or a transfer); `kv_blocks_free`:
    // blocks in the free queue, cached or not; the pool's block 0 is the null block, never
    // handed out, so a pool at rest has `total - 1` free.
    let (used, free, total) = (
        m("ferry_kv_blocks_used"),
        m("ferry_kv_blocks_free"),
        m("ferry_kv_blocks_total"),
    );
    if used != 0.0 || free + 1.0 != total {
        why.push(format!("blocks used {used}, free {free} of {total}"));
    }
    for name in ["ferry_num_requests_running", "ferry_num_requests_waiting"] {
        if m(name) != 0.0 {
            why.push(format!("{name} {}", m(name)));
        }
    }
    if role == "P" {
        // Every export published is pulled or has come back (expired or revoked).
        let started = m("ferry_kv_exports_started_total");
        let ended = m("ferry_kv_exports_pulled_total") + m("ferry_kv_exports_expired_total");
        if started != ended {
            why.push(format!(
                "exports started {started}, pulled or expired {ended}"
            ));
        }
    } else {
        let started = m("ferry_kv_loads_started_total");
        let ended = m("ferry_kv_loads_finished_total") + m("ferry_kv_loads_failed_total");
        if started != ended {
            why.push(format!(
                "loads started {started}, finished or failed {ended}"
            ));
        }
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// The figures worth printing from a `/metrics` text.
fn kv_figures(text: &str) -> String {
    text.lines()
        .filter(|l| {
            !l.starts_with('#')
                && (l.starts_with("ferry_kv_")
                    || l.starts_with("ferry_num_requests")
                    || l.starts_with("ferry_engine_paused")
                    || l.starts_with("ferry_weight_version"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Client `c`'s `n`-th prompt: short and long, unique and sharing `SHARED` (some whole
/// prompts repeat across clients, so P and D see prefix-cache hits).
fn prompt(c: usize, n: usize) -> String {
    match (c + n) % 5 {
        0 => format!("Client {c} asks question {n}."),
        1 => format!("{SHARED} Then client {c} said {n}."),
        2 => format!("{SHARED} And then?"),
        3 => format!("{} Client {c}, turn {n}.", SHARED.repeat(1 + n % 4)),
        _ => format!(
            "{} {SHARED}",
            "Numbers: 1 2 3 4 5 6 7 8 9. ".repeat(1 + (c + n) % 6)
        ),
    }
}

/// A request that did not end as asked.
#[derive(Debug)]
struct Lost {
    id: String,
    /// The trainer's step when the request was sent and when its answer came (see `Step`).
    sent: String,
    answered: String,
    status: u16,
    body: Value,
}

/// Where the trainer is: the cycle (0 before the first) and its last admin call begun,
/// for placing a lost request in the loop.
#[derive(Default)]
struct Step(Mutex<(usize, &'static str, Option<Instant>)>);

impl Step {
    fn set(&self, cycle: usize, call: &'static str) {
        *self.0.lock().unwrap() = (cycle, call, Some(Instant::now()));
    }

    fn now(&self) -> String {
        match *self.0.lock().unwrap() {
            (cycle, call, Some(at)) => {
                format!("cycle {cycle} {call} +{}ms", at.elapsed().as_millis())
            }
            _ => "before the first cycle".to_owned(),
        }
    }
}

/// Client `c`: completions through the proxy until `stop`; returns how many it sent.
async fn run_client(
    c: usize,
    proxy: String,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    lost: Arc<Mutex<Vec<Lost>>>,
    step: Arc<Step>,
) -> usize {
    let http = client();
    let target = format!("{proxy}/v1/completions");
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        let max_tokens = 4 + (c * 5 + n * 3) % 13;
        let body = json!({"model": "tiny", "prompt": prompt(c, n), "max_tokens": max_tokens,
                          "temperature": 0, "return_token_ids": true});
        let id = format!("rl-loop-c{c}-{n}");
        let sent = step.now();
        let (status, out) = post(&http, &target, &body, Some(&id)).await;
        n += 1;
        let choice = &out["choices"][0];
        let finish = choice["finish_reason"].as_str().unwrap_or("");
        let tokens = choice["token_ids"].as_array().map_or(0, Vec::len);
        let ok = status == 200
            && matches!(finish, "length" | "stop")
            && tokens >= 1
            && tokens <= max_tokens
            && (finish == "stop" || tokens == max_tokens)
            && choice["weight_versions"]
                .as_array()
                .is_some_and(|v| !v.is_empty());
        if !ok {
            lost.lock().unwrap().push(Lost {
                id,
                sent,
                answered: step.now(),
                status,
                body: out,
            });
        }
        answered.fetch_add(1, Ordering::SeqCst);
    }
    n
}

/// One admin call through the proxy: a failure (not a 200, or an instance that did not
/// answer 200) is recorded in `failures`.
async fn admin(
    http: &reqwest::Client,
    proxy: &str,
    (step, cycle): (&Step, usize),
    path: &'static str,
    body: Value,
    failures: &mut Vec<String>,
) -> Value {
    step.set(cycle, path);
    let started = Instant::now();
    let (status, out) = post(http, &format!("{proxy}{path}"), &body, None).await;
    let instances_ok = out["instances"]
        .as_array()
        .is_some_and(|a| a.len() == 2 && a.iter().all(|i| i["status"] == 200));
    if status != 200 || !instances_ok {
        failures.push(format!(
            "cycle {cycle}: {path} after {:?}: {status} {out}",
            started.elapsed()
        ));
    }
    out
}

/// What one run of the loop measured.
#[derive(Debug)]
pub struct RlLoopReport {
    pub n_sent: usize,
    /// How long each clearing keep pause (`/pause?mode=keep&clear_cache=true`) took through
    /// the proxy.
    pub keep_pauses: Vec<Duration>,
    /// How many KV loads D finished (the transfers the loop made).
    pub d_loads: f64,
}

/// The whole test: makes the tiny model, starts P and D (`ferry serve --model tiny --port 0
/// --enable-admin-api --kv-role ...` and `serve_extra`, with `env`) and the proxy, runs the
/// loop, and panics naming every request lost, admin call failed or block not freed.
pub async fn run_rl_loop(serve_extra: &[&str], env: &[(&str, &str)]) -> RlLoopReport {
    let started = Instant::now();
    let model_dir = tempfile::tempdir().unwrap();
    let model_path = model_dir.path().join("tiny");
    let made = Command::new(FERRY)
        .args(["make-model", "tiny", "--out"])
        .arg(&model_path)
        .output()
        .expect("running ferry make-model");
    assert!(
        made.status.success(),
        "ferry make-model tiny: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let model_path = model_path.to_str().unwrap().to_owned();

    // P and D start together, every flag at its default but the admin API (D's
    // `--kv-load-failure-policy` is `fail`).
    let serve = |role: &str| {
        let args = format!("serve --model tiny --port 0 --enable-admin-api --kv-role {role}");
        let mut args: Vec<String> = args.split(' ').map(String::from).collect();
        args.extend(serve_extra.iter().map(|a| (*a).to_owned()));
        procs::spawn(&args, env)
    };
    let (p, d) = (serve("kv_producer"), serve("kv_consumer"));
    let (p, d) = (p.ready(), d.ready());
    // `ferry proxy --port 0 --enable-admin-api --prefill <P> --decode <D>`.
    let proxy = procs::proxy(&[&p.url], &[&d.url], &[]).ready();
    let boot = started.elapsed();

    let outcome = tokio::time::timeout(TEST_BOUND, rl_loop(&proxy.url, &model_path)).await;
    let (n_sent, lost, admin_failures, n_weight_updates, loop_time, keep_pauses) = match outcome {
        Ok(o) => o,
        Err(_) => panic!(
            "the RL loop ran past {TEST_BOUND:?}\nP:\n{}\nD:\n{}\nproxy:\n{}",
            p.log_tail(40),
            d.log_tail(40),
            proxy.log_tail(40)
        ),
    };

    // After the last answer an export's pull or release can still be landing on P (its
    // counters follow by a step): every block free on both within 5 s.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut not_free;
    loop {
        not_free = Vec::new();
        for (role, engine) in [("P", &p), ("D", &d)] {
            let text = metrics_text(&engine.url).await;
            if let Some(why) = kv_not_free(&text, role) {
                not_free.push(format!(
                    "{role} ({}): {why}\n{}",
                    engine.url,
                    kv_figures(&text)
                ));
            }
        }
        if not_free.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "rl_loop_pd: {n_sent} requests from {N_CLIENTS} clients over {N_CYCLES} cycles \
         ({n_weight_updates} weight updates): {} lost, {} admin failures; start {boot:?}, \
         loop {loop_time:?}, total {:?}",
        lost.len(),
        admin_failures.len(),
        started.elapsed()
    );

    let mut problems = Vec::new();
    if !lost.is_empty() {
        let listed: Vec<String> = lost
            .iter()
            .map(|l| {
                format!(
                    "  {} (sent {}, answered {}) → {} {}",
                    l.id, l.sent, l.answered, l.status, l.body
                )
            })
            .collect();
        problems.push(format!(
            "{} of {n_sent} requests lost (nobody asked for an abort):\n{}",
            lost.len(),
            listed.join("\n")
        ));
    }
    if !admin_failures.is_empty() {
        problems.push(format!(
            "{} admin calls failed:\n  {}",
            admin_failures.len(),
            admin_failures.join("\n  ")
        ));
    }
    if n_sent < 200 {
        problems.push(format!(
            "only {n_sent} requests were sent (want at least 200)"
        ));
    }
    if n_weight_updates != N_CYCLES {
        problems.push(format!(
            "{n_weight_updates} of {N_CYCLES} weight updates set one version on P and D"
        ));
    }
    if !not_free.is_empty() {
        problems.push(format!(
            "KV not all free 5 s after the last answer:\n{}",
            not_free.join("\n")
        ));
    }
    if !problems.is_empty() {
        let logs: Vec<String> = [("P", &p), ("D", &d), ("proxy", &proxy)]
            .iter()
            .map(|(role, proc)| format!("--- {role} log tail ---\n{}", proc.log_tail(30)))
            .collect();
        panic!("{}\n{}", problems.join("\n\n"), logs.join("\n"));
    }
    let d_loads = metric(&metrics_text(&d.url).await, "ferry_kv_loads_finished_total");
    RlLoopReport {
        n_sent,
        keep_pauses,
        d_loads,
    }
}

/// The clients and the trainer: (requests sent, lost requests, admin failures, weight updates
/// that set one version on both, the loop's wall time).
async fn rl_loop(
    proxy: &str,
    model_path: &str,
) -> (
    usize,
    Vec<Lost>,
    Vec<String>,
    usize,
    Duration,
    Vec<Duration>,
) {
    let started = Instant::now();
    let http = client();
    // One answer through the proxy before the load starts: P, D and the transfer work.
    let (status, out) = post(
        &http,
        &format!("{proxy}/v1/completions"),
        &json!({"model": "tiny", "prompt": SHARED, "max_tokens": 4, "temperature": 0}),
        None,
    )
    .await;
    assert_eq!(status, 200, "{out}");

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(Mutex::new(Vec::new()));
    let step = Arc::new(Step::default());
    let clients: Vec<_> = (0..N_CLIENTS)
        .map(|c| {
            tokio::spawn(run_client(
                c,
                proxy.to_owned(),
                Arc::clone(&stop),
                Arc::clone(&answered),
                Arc::clone(&lost),
                Arc::clone(&step),
            ))
        })
        .collect();

    let mut failures = Vec::new();
    let mut n_weight_updates = 0;
    let mut keep_pauses = Vec::new();
    for cycle in 1..=N_CYCLES {
        // Traffic between two cycles: some answers since the last resume, and a pause that
        // lands at a different point of the requests' lives each time.
        let since = answered.load(Ordering::SeqCst);
        let wait_until = Instant::now() + CYCLE_TRAFFIC_WAIT;
        while answered.load(Ordering::SeqCst) < since + ANSWERS_PER_CYCLE
            && Instant::now() < wait_until
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis((cycle as u64 * 7) % 23)).await;

        let paused = Instant::now();
        admin(
            &http,
            proxy,
            (&step, cycle),
            "/pause?mode=keep&clear_cache=true",
            json!(null),
            &mut failures,
        )
        .await;
        keep_pauses.push(paused.elapsed());
        let updated = admin(
            &http,
            proxy,
            (&step, cycle),
            "/update_weights_from_disk",
            json!({"model_path": model_path}),
            &mut failures,
        )
        .await;
        let version = updated["weight_version"].as_str().unwrap_or("");
        // Paused, each instance reads the folder over its weights in place.
        let same_on_both = updated["instances"].as_array().is_some_and(|a| {
            a.len() == 2
                && a.iter().all(|i| {
                    i["body"]["weight_version"] == version && i["body"]["in_place"] == true
                })
        });
        if updated["success"] == true && version.starts_with("proxy-") && same_on_both {
            n_weight_updates += 1;
        } else {
            failures.push(format!(
                "cycle {cycle}: the weight update set no one version in place: {updated}"
            ));
        }
        if cycle % 5 == 0 {
            let reset = admin(
                &http,
                proxy,
                (&step, cycle),
                "/reset_prefix_cache",
                json!(null),
                &mut failures,
            )
            .await;
            // Paused after a clearing pause, nothing holds a block: the reset succeeds.
            if reset["success"] != true {
                failures.push(format!(
                    "cycle {cycle}: /reset_prefix_cache did nothing: {reset}"
                ));
            }
        }
        if cycle % 7 == 0 {
            admin(
                &http,
                proxy,
                (&step, cycle),
                "/pause?mode=wait&clear_cache=true",
                json!(null),
                &mut failures,
            )
            .await;
        }
        admin(
            &http,
            proxy,
            (&step, cycle),
            "/resume",
            json!(null),
            &mut failures,
        )
        .await;
        step.set(cycle, "resumed");
    }

    // The trainer is done: the clients finish the request they are on and stop.
    stop.store(true, Ordering::SeqCst);
    let mut n_sent = 0;
    for c in clients {
        n_sent += c.await.unwrap();
    }
    let lost = std::mem::take(&mut *lost.lock().unwrap());
    (
        n_sent,
        lost,
        failures,
        n_weight_updates,
        started.elapsed(),
        keep_pauses,
    )
}
