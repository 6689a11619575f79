//! The contract's matrix (`../shared/design/lifecycle.md`, "The matrix that must pass, under
//! load"), one [`Case`] per row: pauses, sleeps and wake-ups, KV release and weight reloads.
//! The resets, aborts and faults are in [`crate::faults`].
//!
//! Every case follows one shape: a wave of streaming requests through the proxy, the
//! operation once D is mid-decode (its reply time measured against its bound), a second wave
//! sent while the engine is paused or asleep (queued, never refused), the way back (resume,
//! wake-up), then every request judged against the reference. Whatever a case leaves behind
//! the runner's drain check then sees: every engine idle and every KV block free.

use serde_json::json;

use crate::ctx::{Allow, Ctx};
use crate::faults;
use crate::fleet::Target;
use crate::load::End;

/// A pause or sleep mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Abort,
    Wait,
    Keep,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Abort => "abort",
            Mode::Wait => "wait",
            Mode::Keep => "keep",
        }
    }
}

/// One row of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    Pause {
        target: Target,
        mode: Mode,
        clear_cache: bool,
    },
    Sleep {
        level: u8,
        mode: Mode,
    },
    /// Sleep level 1, then wake-up one tag at a time.
    WakeTags {
        weights_first: bool,
    },
    AbortAll,
    AbortByIds,
    AbortQueuedOnP {
        by_pause: bool,
    },
    ResetPrefixCache {
        running: bool,
    },
    ReleaseKvCache,
    Reload {
        mode: Mode,
    },
    DisconnectMidStream,
    DisconnectMidTransfer,
    ResumeWhileResetPending,
    ResumeWhileSleepPending,
    TwoResets,
    ResetWithStoreInFlight,
}

impl Case {
    /// Every case, in the order a trio runs them.
    pub fn all() -> Vec<Case> {
        let mut cases = Vec::new();
        for mode in [Mode::Abort, Mode::Wait, Mode::Keep] {
            for target in [Target::P, Target::D, Target::Both] {
                // vLLM's default clears the cache; a keep pause is the one that must not wait.
                let clear_cache = mode != Mode::Keep;
                cases.push(Case::Pause {
                    target,
                    mode,
                    clear_cache,
                });
            }
        }
        for target in [Target::P, Target::D, Target::Both] {
            cases.push(Case::Pause {
                target,
                mode: Mode::Keep,
                clear_cache: true,
            });
        }
        // And the other two modes without clearing (the RL loop that keeps its prefix cache
        // across a pause: weight versions already keep stale KV from being hit).
        for mode in [Mode::Abort, Mode::Wait] {
            cases.push(Case::Pause {
                target: Target::Both,
                mode,
                clear_cache: false,
            });
        }
        for level in 0..=2 {
            for mode in [Mode::Abort, Mode::Wait] {
                cases.push(Case::Sleep { level, mode });
            }
        }
        cases.extend([
            Case::WakeTags {
                weights_first: true,
            },
            Case::WakeTags {
                weights_first: false,
            },
            Case::AbortAll,
            Case::AbortByIds,
            Case::AbortQueuedOnP { by_pause: false },
            Case::AbortQueuedOnP { by_pause: true },
            Case::ResetPrefixCache { running: false },
            Case::ResetPrefixCache { running: true },
            Case::ReleaseKvCache,
            Case::Reload { mode: Mode::Abort },
            Case::Reload { mode: Mode::Wait },
            Case::Reload { mode: Mode::Keep },
            Case::DisconnectMidStream,
            Case::DisconnectMidTransfer,
            Case::ResumeWhileResetPending,
            Case::ResumeWhileSleepPending,
            Case::TwoResets,
            Case::ResetWithStoreInFlight,
        ]);
        cases
    }

    /// The default model's subset: one of each kind of reset, the sleep that drops weights,
    /// a reload of the real weights, an abort.
    pub fn default_model_subset() -> Vec<Case> {
        vec![
            Case::Pause {
                target: Target::Both,
                mode: Mode::Keep,
                clear_cache: true,
            },
            Case::Pause {
                target: Target::D,
                mode: Mode::Abort,
                clear_cache: true,
            },
            Case::Sleep {
                level: 2,
                mode: Mode::Wait,
            },
            Case::Reload { mode: Mode::Keep },
            Case::ResetPrefixCache { running: true },
            Case::AbortAll,
        ]
    }

    /// Whether the case means anything with the tier on or off.
    pub fn applies(self, tier: bool) -> bool {
        self != Case::ResetWithStoreInFlight || tier
    }

    pub fn name(self) -> String {
        match self {
            Case::Pause {
                target,
                mode,
                clear_cache,
            } => format!(
                "pause {} on {}{}",
                mode.name(),
                target.name(),
                if clear_cache { ", clear_cache" } else { "" }
            ),
            Case::Sleep { level, mode } => format!("sleep level {level}, {}", mode.name()),
            Case::WakeTags { weights_first } => format!(
                "wake_up {}",
                if weights_first {
                    "weights, then kv_cache"
                } else {
                    "kv_cache, then weights"
                }
            ),
            Case::AbortAll => "abort_requests (all)".into(),
            Case::AbortByIds => "abort_requests (by id)".into(),
            Case::AbortQueuedOnP { by_pause: false } => {
                "abort_requests, queued on a paused P".into()
            }
            Case::AbortQueuedOnP { by_pause: true } => {
                "pause abort on P, queued on a paused P".into()
            }
            Case::ResetPrefixCache { running } => format!(
                "reset_prefix_cache{}",
                if running {
                    ", reset_running_requests"
                } else {
                    ""
                }
            ),
            Case::ReleaseKvCache => "release_kv_cache_memory".into(),
            Case::Reload { mode } => format!("weight reload under {}", mode.name()),
            Case::DisconnectMidStream => "client disconnects mid-stream".into(),
            Case::DisconnectMidTransfer => "client disconnects mid-transfer".into(),
            Case::ResumeWhileResetPending => "resume while a reset is pending".into(),
            Case::ResumeWhileSleepPending => "resume while a sleep is pending".into(),
            Case::TwoResets => "two resets back to back".into(),
            Case::ResetWithStoreInFlight => "reset with an offload store in flight".into(),
        }
    }

    pub async fn run(self, ctx: &Ctx<'_>) {
        match self {
            Case::Pause {
                target,
                mode,
                clear_cache,
            } => pause(ctx, target, mode, clear_cache).await,
            Case::Sleep { level, mode } => sleep(ctx, level, mode).await,
            Case::WakeTags { weights_first } => wake_tags(ctx, weights_first).await,
            Case::ReleaseKvCache => release(ctx).await,
            Case::Reload { mode } => reload(ctx, mode).await,
            Case::AbortAll => faults::abort_all(ctx).await,
            Case::AbortByIds => faults::abort_by_ids(ctx).await,
            Case::AbortQueuedOnP { by_pause } => faults::abort_queued_on_p(ctx, by_pause).await,
            Case::ResetPrefixCache { running } => faults::reset_prefix_cache(ctx, running).await,
            Case::DisconnectMidStream => faults::disconnect_mid_stream(ctx).await,
            Case::DisconnectMidTransfer => faults::disconnect_mid_transfer(ctx).await,
            Case::ResumeWhileResetPending => faults::resume_while_pending(ctx, false).await,
            Case::ResumeWhileSleepPending => faults::resume_while_pending(ctx, true).await,
            Case::TwoResets => faults::two_resets(ctx).await,
            Case::ResetWithStoreInFlight => faults::reset_with_store_in_flight(ctx).await,
        }
    }
}

/// The bound on a pause or sleep call in `mode`.
fn pause_bound(ctx: &Ctx<'_>, mode: Mode, clears: bool) -> std::time::Duration {
    match (mode, clears) {
        (Mode::Wait, _) => ctx.bounds.draining,
        (_, true) => ctx.bounds.clearing,
        (_, false) => ctx.bounds.instant,
    }
}

/// Pause `target` in `mode` under load, queue a wave, resume. An abort pause that reaches D
/// aborts what D holds (at least one request: D is mid-decode); one on P aborts what P holds
/// then (P computes a prompt in a step, so rarely anything; `abort_requests, queued on a
/// paused P` shows a P-side abort reaching the client).
async fn pause(ctx: &Ctx<'_>, target: Target, mode: Mode, clear_cache: bool) {
    let mut load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let path = format!("/pause?mode={}&clear_cache={clear_cache}", mode.name());
    ctx.post(target, &path, pause_bound(ctx, mode, clear_cache), 200)
        .await;
    ctx.assert_paused(target, true).await;
    let queued = ctx.queued_while_paused(target).await;
    ctx.post(target, "/resume", ctx.bounds.instant, 200).await;
    ctx.assert_paused(target, false).await;
    load.extend(queued);
    let ends = ctx
        .finish(
            load,
            Allow {
                abort: mode == Mode::Abort,
                fail: false,
            },
        )
        .await;
    if mode == Mode::Abort && target.includes_d() {
        assert!(Ctx::count(&ends, End::Aborted) >= 1, "nothing was aborted");
        let last_wave = &ends[ends.len() - 2..];
        assert!(
            last_wave.iter().all(|(_, e)| *e == End::Finished),
            "requests sent while paused were aborted: {last_wave:?}"
        );
    }
}

/// Sleep both engines at `level` in `mode` under load, queue a wave, (level 2: reload the
/// weights), wake up.
async fn sleep(ctx: &Ctx<'_>, level: u8, mode: Mode) {
    let mut load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let path = format!("/sleep?level={level}&mode={}", mode.name());
    ctx.post(Target::Both, &path, pause_bound(ctx, mode, level >= 1), 200)
        .await;
    let residency = match level {
        0 => "resident",
        1 => "offloaded",
        _ => "dropped",
    };
    for base in [&ctx.trio.p.url, &ctx.trio.d.url] {
        let (_, info) = crate::procs::get(&format!("{base}/weight_info")).await;
        assert_eq!(info["residency"], residency, "{base}: {info}");
        let (_, sleeping) = crate::procs::get(&format!("{base}/is_sleeping")).await;
        assert_eq!(sleeping["is_sleeping"], true, "{base}: {sleeping}");
    }
    let queued = ctx.queued_while_paused(Target::Both).await;
    if level == 2 {
        // Dropped weights cannot wake: a clear 409, and nothing changes.
        let refused = ctx
            .post(
                Target::Both,
                "/wake_up?tags=weights",
                ctx.bounds.instant,
                409,
            )
            .await;
        let message = refused.body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("reload"), "{}", refused.body);
        let (_, in_place) = ctx.reload().await;
        assert!(!in_place, "dropped weights are read into new memory");
    }
    let woken = ctx
        .post(Target::Both, "/wake_up", ctx.bounds.clearing, 200)
        .await;
    assert_eq!(woken.body["is_sleeping"], false, "{}", woken.body);
    ctx.assert_paused(Target::Both, false).await;
    load.extend(queued);
    let aborts = mode == Mode::Abort;
    let ends = ctx
        .finish(
            load,
            Allow {
                abort: aborts,
                fail: false,
            },
        )
        .await;
    if aborts {
        assert!(Ctx::count(&ends, End::Aborted) >= 1, "nothing was aborted");
    }
}

/// Sleep level 1 (wait), then wake one tag: still asleep, nothing computed; then the other.
async fn wake_tags(ctx: &Ctx<'_>, weights_first: bool) {
    let mut load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    ctx.post(
        Target::Both,
        "/sleep?level=1&mode=wait",
        ctx.bounds.draining,
        200,
    )
    .await;
    let queued = ctx.queued_while_paused(Target::Both).await;
    let (first, second) = if weights_first {
        ("weights", "kv_cache")
    } else {
        ("kv_cache", "weights")
    };
    let half = ctx
        .post(
            Target::Both,
            &format!("/wake_up?tags={first}"),
            ctx.bounds.clearing,
            200,
        )
        .await;
    assert_eq!(half.body["is_sleeping"], true, "{}", half.body);
    // Still asleep: the queued wave waits on P, D computes nothing.
    let still = ctx.queued_while_paused(Target::Both).await;
    let whole = ctx
        .post(
            Target::Both,
            &format!("/wake_up?tags={second}"),
            ctx.bounds.clearing,
            200,
        )
        .await;
    assert_eq!(whole.body["is_sleeping"], false, "{}", whole.body);
    ctx.assert_paused(Target::Both, false).await;
    load.extend(queued);
    load.extend(still);
    ctx.finish(load, Allow::default()).await;
}

/// Release the KV cache memory after a keep pause: refused before the pause (a clear 409);
/// kept requests recompute after the KV cache wakes.
async fn release(ctx: &Ctx<'_>) {
    let refused = ctx
        .post(
            Target::Both,
            "/release_kv_cache_memory",
            ctx.bounds.instant,
            409,
        )
        .await;
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("pause")),
        "{}",
        refused.body
    );
    let mut load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    ctx.post(
        Target::Both,
        "/pause?mode=keep&clear_cache=false",
        ctx.bounds.instant,
        200,
    )
    .await;
    ctx.next_is_main();
    ctx.post(
        Target::Both,
        "/release_kv_cache_memory",
        ctx.bounds.clearing,
        200,
    )
    .await;
    let queued = ctx.queued_while_paused(Target::Both).await;
    ctx.post(
        Target::Both,
        "/wake_up?tags=kv_cache",
        ctx.bounds.clearing,
        200,
    )
    .await;
    // The client's pause is the client's: waking the KV cache does not resume.
    ctx.assert_paused(Target::Both, true).await;
    ctx.post(Target::Both, "/resume", ctx.bounds.instant, 200)
        .await;
    load.extend(queued);
    ctx.finish(load, Allow::default()).await;
}

/// Pause in `mode`, reload the same weights from disk under a new version, resume: what
/// follows reports the new version.
async fn reload(ctx: &Ctx<'_>, mode: Mode) {
    let mut load = ctx.send(ctx.wave_size());
    ctx.decoding(2).await;
    let clear_cache = mode != Mode::Keep;
    let path = format!("/pause?mode={}&clear_cache={clear_cache}", mode.name());
    ctx.post(
        Target::Both,
        &path,
        pause_bound(ctx, mode, clear_cache),
        200,
    )
    .await;
    let (version, in_place) = ctx.reload().await;
    // A folder is read over the paused engine's weights; a GGUF file into new ones.
    assert_eq!(in_place, ctx.setup.model.is_small(), "{mode:?}");
    for base in [&ctx.trio.p.url, &ctx.trio.d.url] {
        let (_, info) = crate::procs::get(&format!("{base}/weight_info")).await;
        assert_eq!(info["weight_version"], version.as_str(), "{base}: {info}");
    }
    let queued = ctx.queued_while_paused(Target::Both).await;
    ctx.post(Target::Both, "/resume", ctx.bounds.instant, 200)
        .await;
    load.extend(queued);
    let ends = ctx
        .finish(
            load,
            Allow {
                abort: mode == Mode::Abort,
                fail: false,
            },
        )
        .await;
    assert!(Ctx::count(&ends, End::Finished) >= 2, "{ends:?}");
    // A request after the update carries the new version (from P's transfer and D's decode).
    let mut after = ctx.request(&format!("{}/v1/completions", ctx.trio.proxy.url), 0);
    after.body["stream"] = json!(false);
    after.body.as_object_mut().unwrap().remove("stream_options");
    let (status, out) = crate::procs::post(&after.url, &after.body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["choices"][0]["weight_versions"],
        json!([version]),
        "{out}"
    );
}
