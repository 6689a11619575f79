//! The matrix rows about aborts, cache resets and faults: `abort_requests`,
//! `reset_prefix_cache` with and without running requests, clients that leave mid-stream and
//! mid-transfer, a resume that cancels a pending reset or sleep, two resets back to back, and
//! a reset while the offload tier has stores in flight.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::ctx::{Allow, Ctx};
use crate::fleet::{admin_post, Target};
use crate::load::{End, Load};
use crate::procs::{metric, metrics_text, post, wait_metrics, Proc};

/// `abort_requests` with no ids, through the proxy: what D runs ends as aborted.
pub async fn abort_all(ctx: &Ctx<'_>) {
    let mut load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let reply = ctx
        .post_json(
            Target::Both,
            "/abort_requests",
            &json!({}),
            ctx.bounds.instant,
            200,
        )
        .await;
    let n = reply.body["aborted"].as_u64().unwrap_or(0);
    assert!(n >= 2, "aborted {n}: {}", reply.body);
    // Sent after the abort: untouched.
    load.extend(ctx.send(2));
    let ends = ctx
        .finish(
            load,
            Allow {
                abort: true,
                fail: false,
            },
        )
        .await;
    assert!(Ctx::count(&ends, End::Aborted) >= 2, "{ends:?}");
    let last = &ends[ends.len() - 2..];
    assert!(last.iter().all(|(_, e)| *e == End::Finished), "{last:?}");
}

/// Requests queued on a paused P (the proxy waits on P's answer before it calls D), then
/// `abort_requests` with no ids through the proxy, or (`by_pause`) an aborting pause of P:
/// the requests were aborted, so each client gets `finish_reason: abort`, and D never
/// computes them.
pub async fn abort_queued_on_p(ctx: &Ctx<'_>, by_pause: bool) {
    ctx.post(
        Target::P,
        "/pause?mode=keep&clear_cache=false",
        ctx.bounds.instant,
        200,
    )
    .await;
    let load = ctx.send(2);
    wait_metrics(&ctx.trio.p.url, Duration::from_secs(10), |t| {
        metric(t, "ferry_num_requests_waiting") >= 2.0
    })
    .await;
    let d_before = metric(
        &metrics_text(&ctx.trio.d.url).await,
        "ferry_requests_finished_total",
    );
    ctx.next_is_main();
    if by_pause {
        ctx.post(
            Target::P,
            "/pause?mode=abort&clear_cache=true",
            ctx.bounds.clearing,
            200,
        )
        .await;
    } else {
        let reply = ctx
            .post_json(
                Target::Both,
                "/abort_requests",
                &json!({}),
                ctx.bounds.instant,
                200,
            )
            .await;
        assert_eq!(reply.body["aborted"], 2, "{}", reply.body);
    }
    let ends = ctx
        .finish(
            load,
            Allow {
                abort: true,
                fail: false,
            },
        )
        .await;
    assert_eq!(Ctx::count(&ends, End::Aborted), 2, "{ends:?}");
    let d_after = metric(
        &metrics_text(&ctx.trio.d.url).await,
        "ferry_requests_finished_total",
    );
    assert_eq!(d_before, d_after, "D computed requests the client aborted");
    ctx.post(Target::P, "/resume", ctx.bounds.instant, 200)
        .await;
}

/// `abort_requests` naming every other request by its `X-Request-Id`: those end as aborted
/// (or had finished), the others finish untouched.
pub async fn abort_by_ids(ctx: &Ctx<'_>) {
    let load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let ids: Vec<String> = (0..load.len()).map(|i| load.id(i).to_owned()).collect();
    let named: Vec<&String> = ids.iter().step_by(2).collect();
    let reply = ctx
        .post_json(
            Target::Both,
            "/abort_requests",
            &json!({"request_ids": named}),
            ctx.bounds.instant,
            200,
        )
        .await;
    assert!(
        reply.body["aborted"].as_u64().unwrap_or(0) >= 1,
        "{}",
        reply.body
    );
    let ends = ctx
        .finish(
            load,
            Allow {
                abort: true,
                fail: false,
            },
        )
        .await;
    for (o, end) in &ends {
        if named.contains(&&o.id) {
            assert!(matches!(end, End::Aborted | End::Finished), "{o:?}");
        } else {
            assert_eq!(*end, End::Finished, "not named, yet: {o:?}");
        }
    }
    assert!(Ctx::count(&ends, End::Aborted) >= 1, "{ends:?}");
}

/// `reset_prefix_cache` under load (the connectors' caches too when the tier is on): a
/// boolean at once, never an error; with `reset_running_requests` running requests are
/// preempted and recompute. Once drained, a reset succeeds everywhere.
pub async fn reset_prefix_cache(ctx: &Ctx<'_>, running: bool) {
    let load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let path = format!(
        "/reset_prefix_cache?reset_running_requests={running}&reset_external={}",
        ctx.setup.tier
    );
    let preempted_before = ctx.metric_pd("ferry_preemptions_total").await;
    let reply = ctx.post(Target::Both, &path, ctx.bounds.instant, 200).await;
    ctx.note(format!("under load: {}", instance_results(&reply.body)));
    ctx.finish(load, Allow::default()).await;
    if running {
        let preempted = ctx.metric_pd("ferry_preemptions_total").await - preempted_before;
        ctx.note(format!("{preempted} preemptions"));
    }
    ctx.trio.wait_clean(Duration::from_secs(15)).await;
    let reply = ctx.post(Target::Both, &path, ctx.bounds.instant, 200).await;
    assert_eq!(reply.body["success"], true, "idle: {}", reply.body);
    // What it cleared, on every instance: the offload tier too, as asked, when it is on.
    let cleared = if ctx.setup.tier {
        json!(["device", "offload"])
    } else {
        json!(["device"])
    };
    assert_eq!(reply.body["cleared"], cleared, "idle: {}", reply.body);
}

/// Each instance's `success`, for the notes.
fn instance_results(body: &Value) -> String {
    body["instances"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| format!("{} success={}", i["role"], i["body"]["success"]))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_else(|| body.to_string())
}

/// Clients that leave: some after a few events (mid-decode on D), some a few milliseconds
/// after sending (while P computes or D loads). The rest finish; nothing stays held.
pub async fn disconnect_mid_stream(ctx: &Ctx<'_>) {
    let url = format!("{}/v1/completions", ctx.trio.proxy.url);
    let mut load = Load::default();
    for (i, after) in [Some(1), Some(8), Some(40), None, None, None]
        .into_iter()
        .enumerate()
    {
        let mut send = ctx.request(&url, i);
        send.disconnect_after = after;
        load.push(send);
    }
    for (i, ms) in [1u64, 3, 6].into_iter().enumerate() {
        let send = ctx.request(&url, 6 + i);
        load.push_abandoned(send, Duration::from_millis(ms));
    }
    let ends = ctx.finish(load, Allow::default()).await;
    assert!(Ctx::count(&ends, End::Disconnected) >= 3, "{ends:?}");
    assert!(Ctx::count(&ends, End::Finished) >= 3, "{ends:?}");
}

/// Sends SIGCONT when dropped, so a stopped P never outlives a failed case's assertion.
struct Stopped<'a>(&'a Proc);

impl<'a> Stopped<'a> {
    fn new(p: &'a Proc) -> Self {
        p.signal("STOP");
        Stopped(p)
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.signal("CONT");
    }
}

/// A client of D that leaves while D pulls the prompt's KV from P: P is stopped after it
/// exported (so the pull hangs mid-transfer), D's request starts its load, the client goes
/// away, then P continues. D must end the request and free its blocks once the transfer
/// ends; P's export comes back (pulled, or by its lease). Streaming load through the proxy
/// runs the whole time (stalled on P while it is stopped).
pub async fn disconnect_mid_transfer(ctx: &Ctx<'_>) {
    let load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    // P's export for a fresh (salted) prompt, asked of P as the proxy would.
    let mut direct = ctx.request(&format!("{}/v1/completions", ctx.trio.d.url), 0);
    let mut prefill = direct.body.clone();
    prefill["stream"] = json!(false);
    prefill["max_tokens"] = json!(1);
    prefill["cache_salt"] = json!(direct.id.clone());
    prefill["kv_transfer_params"] = json!({"do_remote_decode": true});
    prefill.as_object_mut().unwrap().remove("stream_options");
    let (status, out) = post(&format!("{}/v1/completions", ctx.trio.p.url), &prefill).await;
    assert_eq!(status, 200, "{out}");
    let params = out["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{out}");
    direct.body["cache_salt"] = json!(direct.id.clone());
    direct.body["kv_transfer_params"] = params;

    let loads = |t: &str| metric(t, "ferry_kv_loads_started_total");
    let started_before = loads(&metrics_text(&ctx.trio.d.url).await);
    let stopped = Stopped::new(&ctx.trio.p);
    let mut leaving = Load::default();
    leaving.push(direct);
    wait_metrics(&ctx.trio.d.url, Duration::from_secs(10), |t| {
        loads(t) > started_before
    })
    .await;
    let left_at = Instant::now();
    leaving.abandon();
    // D lets the request go while P is still stopped (its fetch waits on P).
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(stopped);
    ctx.note(format!(
        "P stopped for {} ms with D's pull in flight",
        left_at.elapsed().as_millis()
    ));
    ctx.finish(load, Allow::default()).await;
}

/// A pause (`clear_cache`, `wait`) or a sleep (level 1, `wait`) of D is pending while D drains
/// its running requests; a resume cancels it: the pending call answers 409 saying so, within
/// the bound after the resume, and no request is lost.
///
/// The tiny model drains a wave in tens of milliseconds, so the drain can end before the
/// resume arrives; then nothing was pending, the attempt proves nothing, and the case judges
/// that wave (no request lost), puts D back to running and sends another, up to
/// [`PENDING_ATTEMPTS`] times. Nothing is loosened: the checks run on an attempt where the
/// call was pending when the resume came.
pub async fn resume_while_pending(ctx: &Ctx<'_>, sleep: bool) {
    let path = if sleep {
        "/sleep?level=1&mode=wait"
    } else {
        "/pause?mode=wait&clear_cache=true"
    };
    let d = ctx.trio.d.url.clone();
    for attempt in 1..=PENDING_ATTEMPTS {
        let load = ctx.send(ctx.wave_size());
        ctx.decoding(3).await;
        let pending = {
            let d = d.clone();
            tokio::spawn(async move { admin_post(&d, path, None).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        let resumed_at = Instant::now();
        let resume = admin_post(&d, "/resume", None).await;
        let pending = pending.await.unwrap();
        let after_resume_ms = resumed_at.elapsed().as_millis();
        if pending.status == 200 {
            // The drain ended first: the call completed and the resume found nothing
            // pending (a sleeping D refuses it until woken).
            if resume.status == 409 {
                ctx.post(Target::D, "/wake_up", ctx.bounds.clearing, 200)
                    .await;
                ctx.post(Target::D, "/resume", ctx.bounds.instant, 200)
                    .await;
            }
            ctx.finish(load, Allow::default()).await;
            ctx.note(format!(
                "attempt {attempt}: {path} completed before the resume; another wave"
            ));
            continue;
        }
        ctx.op("/resume on D", ctx.bounds.instant, 200, async { resume })
            .await;
        let pending = ctx
            .op(
                format!("{path} on D, pending when resumed"),
                ctx.bounds.draining,
                409,
                async { pending },
            )
            .await;
        ctx.note(format!(
            "attempt {attempt}: answered {after_resume_ms} ms after the resume"
        ));
        assert!(
            after_resume_ms <= ctx.bounds.instant.as_millis(),
            "the cancelled call answered {after_resume_ms} ms after the resume"
        );
        let message = pending.body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("resume"), "{}", pending.body);
        ctx.assert_paused(Target::D, false).await;
        ctx.finish(load, Allow::default()).await;
        return;
    }
    panic!("{path}: in {PENDING_ATTEMPTS} waves the drain always ended before the resume");
}

/// Waves [`resume_while_pending`] sends before it gives up finding its call pending.
const PENDING_ATTEMPTS: usize = 20;

/// Two cache resets with nothing between them (sent together, so the engine takes both
/// between the same two steps), then a clearing pause with a reset right behind it: every
/// call answers, no engine asserts, every request finishes.
pub async fn two_resets(ctx: &Ctx<'_>) {
    let load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let path = format!(
        "/reset_prefix_cache?reset_running_requests=true&reset_external={}",
        ctx.setup.tier
    );
    let proxy = ctx.trio.proxy.url.clone();
    let (a, b) = tokio::join!(
        admin_post(&proxy, &path, None),
        admin_post(&proxy, &path, None)
    );
    ctx.op(
        "reset_prefix_cache twice at once on both",
        ctx.bounds.instant,
        200,
        async {
            if a.ms >= b.ms {
                a.clone()
            } else {
                b.clone()
            }
        },
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.body);
    let (paused, reset) = tokio::join!(
        admin_post(&proxy, "/pause?mode=keep&clear_cache=true", None),
        admin_post(&proxy, &path, None),
    );
    ctx.op(
        "pause keep, clear_cache on both",
        ctx.bounds.clearing,
        200,
        async { paused },
    )
    .await;
    ctx.op(
        "reset_prefix_cache behind it",
        ctx.bounds.clearing,
        200,
        async { reset },
    )
    .await;
    ctx.post(Target::Both, "/resume", ctx.bounds.instant, 200)
        .await;
    ctx.finish(load, Allow::default()).await;
}

/// With the tier on: a clearing pause while stores are in flight. The tier's flush counter
/// says a reset found jobs in flight (it moves them to the flush set the workers wait for);
/// the case retries the reset, a bounded number of times, until one did. Every reset runs
/// under load: a wave that ended between two resets is finished (its requests judged like any
/// other) and a new one sent, since a fast forward can end a wave before a reset lands in a
/// store.
pub async fn reset_with_store_in_flight(ctx: &Ctx<'_>) {
    const MAX_ATTEMPTS: usize = 60;
    let flushes = || ctx.metric_pd("ferry_kv_offload_flushes_total");
    // Two threads that keep the machine's cores busy for the case, so the engines' copier
    // threads wait for a core as on a loaded host and a store stays in flight long enough
    // for a reset to meet it (on an idle machine a tiny model's store takes microseconds).
    let _burners = Burners::start(2);
    let wave = ctx.wave_size();
    let mut load = ctx.send(wave);
    ctx.decoding(2).await;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let before = flushes().await;
        ctx.post(
            Target::Both,
            "/pause?mode=keep&clear_cache=true",
            ctx.bounds.clearing,
            200,
        )
        .await;
        ctx.post(Target::Both, "/resume", ctx.bounds.instant, 200)
            .await;
        let flushed = flushes().await - before;
        if flushed > 0.0 {
            ctx.note(format!("{flushed} flushes on attempt {attempts}"));
            break;
        }
        assert!(
            attempts < MAX_ATTEMPTS,
            "no reset found a store in flight in {attempts} attempts"
        );
        if load.n_ended() == load.len() {
            ctx.finish(load, Allow::default()).await;
            load = ctx.send(wave);
            ctx.decoding(2).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ctx.finish(load, Allow::default()).await;
}

/// Threads that spin until dropped (also when a case fails), to keep the cores busy.
struct Burners {
    busy: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Burners {
    fn start(n: usize) -> Self {
        let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let threads = (0..n)
            .map(|_| {
                let busy = std::sync::Arc::clone(&busy);
                std::thread::spawn(move || {
                    while busy.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { busy, threads }
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        self.busy.store(false, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
