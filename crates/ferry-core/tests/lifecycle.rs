//! The lifecycle state machine (`scheduler/lifecycle_machine.rs`) driven step by step: every
//! operation and mode, what completes when, what the engine is told to do, and that no request
//! is lost.

mod common;

use std::sync::{Arc, Mutex};

use common::{prompt, small_config, Harness};
use ferry_core::{
    FinishReason, Holder, KvConnector, LifecycleError, LifecycleEvent, OpId, PauseMode,
    RequestState, SamplingParams, SchedulerConfig, SleepLevel, TransferId, WakeTag,
    WeightResidency,
};

fn greedy(n: u32) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    }
}

fn poll(h: &mut Harness) -> Vec<LifecycleEvent> {
    let mut out = Vec::new();
    h.sched.poll_lifecycle(&mut out);
    h.check();
    out
}

fn done(op: u64) -> LifecycleEvent {
    LifecycleEvent::Done(OpId(op))
}

/// Two requests mid-decode: "a" (prompt 40) and "b" (prompt 20), each after `n_steps` steps.
fn busy(n_steps: usize) -> Harness {
    let mut h = Harness::new(small_config());
    h.add("a", prompt(1, 40), greedy(20));
    h.add("b", prompt(2, 20), greedy(20));
    for _ in 0..n_steps {
        h.step();
    }
    h
}

/// The tokens every request generates when nothing interrupts it.
fn reference() -> Harness {
    let mut h = busy(0);
    h.drain(100);
    h
}

#[test]
fn keep_pause_completes_at_once_freezes_and_resume_continues_with_the_same_tokens() {
    let mut h = busy(3);
    assert!(h.sched.pause(OpId(1), PauseMode::Keep, false).is_empty());
    assert_eq!(poll(&mut h), vec![done(1)]);
    assert!(h.sched.lifecycle_status().paused);
    let used = h.sched.stats().n_blocks_used;
    for _ in 0..3 {
        assert!(
            h.step().reqs.is_empty(),
            "a frozen engine schedules nothing"
        );
    }
    assert_eq!(
        h.sched.stats().n_blocks_used,
        used,
        "frozen requests keep their KV"
    );
    // Requests that arrive while paused are queued, not rejected.
    h.add("c", prompt(3, 8), greedy(5));
    h.sched.resume().unwrap();
    assert!(!h.sched.lifecycle_status().paused);
    h.drain(100);
    let r = reference();
    assert_eq!(h.generated["a"], r.generated["a"]);
    assert_eq!(h.generated["b"], r.generated["b"]);
    assert_eq!(h.finished["c"].0, FinishReason::Length);
}

#[test]
fn abort_pause_finishes_every_request_as_aborted_with_its_partial_output() {
    let mut h = busy(3);
    h.add("w", prompt(3, 8), greedy(5));
    let outs = h.sched.pause(OpId(1), PauseMode::Abort, false);
    h.record(&outs);
    let mut ids: Vec<_> = h.finished.keys().cloned().collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "w"]);
    assert!(h.finished.values().all(|f| f.0 == FinishReason::Abort));
    assert_eq!(
        h.generated["a"].len(),
        3,
        "partial output (one token a step) was kept"
    );
    assert_eq!(poll(&mut h), vec![done(1)]);
    assert_eq!(h.sched.stats().n_blocks_used, 0);
}

#[test]
fn wait_pause_drains_admitted_requests_admits_nothing_new_then_completes() {
    let mut h = busy(2);
    h.add("late", prompt(3, 8), greedy(5));
    h.sched.pause(OpId(7), PauseMode::Wait, false);
    assert_eq!(poll(&mut h), vec![], "admitted requests are still running");
    let mut n = 0;
    while h.sched.stats().n_running > 0 {
        let plan = h.step();
        assert!(plan
            .reqs
            .iter()
            .all(|r| h.sched.request(r.req).is_none_or(|q| q.id != "late")));
        n += 1;
        assert!(n < 100);
        if h.sched.stats().n_running > 0 {
            assert_eq!(poll(&mut h), vec![]);
        }
    }
    assert_eq!(poll(&mut h), vec![done(7)]);
    assert!(h.finished.contains_key("a") && h.finished.contains_key("b"));
    assert!(
        !h.finished.contains_key("late"),
        "a queued request is kept, not run or lost"
    );
    assert!(
        h.step().reqs.is_empty(),
        "after the drain the engine is frozen"
    );
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.finished["late"].0, FinishReason::Length);
}

#[test]
fn wait_pause_readmits_preempted_requests_since_they_were_admitted() {
    let mut h = busy(2);
    h.sched.preempt_all_running();
    h.add("late", prompt(3, 8), greedy(5));
    h.sched.pause(OpId(1), PauseMode::Wait, false);
    let mut events = Vec::new();
    for _ in 0..100 {
        h.step();
        events = poll(&mut h);
        if !events.is_empty() {
            break;
        }
    }
    assert_eq!(events, vec![done(1)]);
    assert_eq!(h.finished["a"].0, FinishReason::Length);
    assert_eq!(h.finished["b"].0, FinishReason::Length);
    assert!(!h.finished.contains_key("late"));
    let r = reference();
    assert_eq!(
        h.generated["a"], r.generated["a"],
        "recomputed after preemption"
    );
}

#[test]
fn keep_pause_with_clear_cache_resets_once_idle_and_frozen_requests_recompute() {
    let mut h = busy(3);
    assert!(h.sched.stats().n_blocks_cached > 0);
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    assert_eq!(poll(&mut h), vec![done(1)]);
    let s = h.sched.stats();
    assert_eq!((s.n_blocks_used, s.n_blocks_cached, s.n_running), (0, 0, 0));
    assert_eq!(s.n_waiting, 2, "frozen requests were kept, preempted");
    h.sched.resume().unwrap();
    h.drain(100);
    let r = reference();
    assert_eq!(h.generated["a"], r.generated["a"]);
    assert_eq!(h.generated["b"], r.generated["b"]);
}

#[test]
fn back_to_back_resets_both_complete_and_a_second_round_works_too() {
    let mut h = busy(3);
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    h.sched.pause(OpId(2), PauseMode::Keep, true);
    assert_eq!(poll(&mut h), vec![done(1), done(2)]);
    assert!(h.sched.reset_caches(false, true));
    assert!(h.sched.reset_caches(true, true));
    h.sched.pause(OpId(3), PauseMode::Abort, true);
    assert_eq!(poll(&mut h), vec![done(3)]);
    h.sched.resume().unwrap();
    h.drain(100);
}

#[test]
fn resume_fails_a_pending_reset_with_a_clear_error_and_loses_no_request() {
    let mut h = busy(2);
    h.sched.pause(OpId(1), PauseMode::Wait, true);
    assert_eq!(poll(&mut h), vec![], "still draining");
    h.sched.resume().unwrap();
    assert_eq!(
        poll(&mut h),
        vec![LifecycleEvent::Failed(
            OpId(1),
            LifecycleError::CancelledByResume
        )]
    );
    h.drain(100);
    let r = reference();
    assert_eq!(h.generated, r.generated);
}

#[test]
fn reset_prefix_cache_is_false_while_blocks_are_held_and_never_fails() {
    let mut h = busy(3);
    let cached = h.sched.stats().n_blocks_cached;
    assert!(
        !h.sched.reset_caches(false, false),
        "running requests hold blocks"
    );
    assert_eq!(h.sched.stats().n_blocks_cached, cached, "nothing changed");
    assert!(
        h.sched.reset_caches(true, false),
        "preempted first, then reset"
    );
    assert_eq!(h.sched.stats().n_blocks_cached, 0);
    assert_eq!(h.sched.stats().n_waiting, 2);
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

#[test]
fn release_kv_cache_memory_needs_a_completed_pause() {
    let mut h = busy(2);
    assert_eq!(
        h.sched.release_kv_cache_memory(OpId(1)),
        Err(LifecycleError::NotPaused)
    );
    h.sched.pause(OpId(2), PauseMode::Wait, false);
    assert_eq!(
        h.sched.release_kv_cache_memory(OpId(3)),
        Err(LifecycleError::NotPaused),
        "a wait pause still draining is not complete"
    );
    h.sched.resume().unwrap();
    let _ = poll(&mut h);
    h.sched.pause(OpId(4), PauseMode::Keep, false);
    assert_eq!(poll(&mut h), vec![done(4)]);
    h.sched.release_kv_cache_memory(OpId(5)).unwrap();
    assert_eq!(poll(&mut h), vec![LifecycleEvent::ReleaseKvMemory, done(5)]);
    assert!(h.sched.lifecycle_status().sleeping);
    assert_eq!(
        h.sched.resume(),
        Err(LifecycleError::Asleep { what: "KV cache" })
    );
    h.sched.wake_up(&[WakeTag::KvCache]);
    assert!(
        h.sched.lifecycle_status().paused,
        "release after a pause: resume is explicit"
    );
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

#[test]
fn sleep_levels_release_memory_in_order_and_a_full_wake_up_resumes() {
    for (level, weights_event, weights_state) in [
        (
            SleepLevel::L1,
            LifecycleEvent::OffloadWeights,
            WeightResidency::Offloaded,
        ),
        (
            SleepLevel::L2,
            LifecycleEvent::DropWeights,
            WeightResidency::Dropped,
        ),
    ] {
        let mut h = busy(3);
        h.sched.sleep(OpId(1), level, PauseMode::Keep);
        assert_eq!(
            poll(&mut h),
            vec![LifecycleEvent::ReleaseKvMemory, weights_event, done(1)]
        );
        let s = h.sched.lifecycle_status();
        assert!(s.sleeping && s.paused && s.kv_released);
        assert_eq!(s.weights, weights_state);
        assert_eq!(h.sched.stats().n_blocks_cached, 0);
        h.sched.wake_up(&[WakeTag::Weights]);
        assert!(
            h.sched.lifecycle_status().sleeping,
            "kv_cache is still asleep"
        );
        assert!(
            h.step().reqs.is_empty(),
            "no scheduling until everything is back"
        );
        h.sched.wake_up(&[WakeTag::KvCache]);
        let s = h.sched.lifecycle_status();
        assert!(!s.sleeping && !s.paused);
        h.drain(100);
        assert_eq!(h.generated, reference().generated);
    }
}

#[test]
fn sleep_level_0_only_pauses_and_abort_mode_aborts() {
    let mut h = busy(2);
    let outs = h.sched.sleep(OpId(1), SleepLevel::L0, PauseMode::Abort);
    assert_eq!(outs.len(), 2);
    h.record(&outs);
    assert_eq!(poll(&mut h), vec![done(1)]);
    assert!(h.sched.lifecycle_status().sleeping);
    h.sched.wake_up(&[]);
    assert!(!h.sched.lifecycle_status().paused);
}

#[test]
fn wake_up_cancels_a_pending_sleep() {
    let mut h = busy(2);
    h.sched.sleep(OpId(1), SleepLevel::L1, PauseMode::Wait);
    assert_eq!(poll(&mut h), vec![]);
    h.sched.wake_up(&[]);
    assert_eq!(
        poll(&mut h),
        vec![LifecycleEvent::Failed(
            OpId(1),
            LifecycleError::CancelledByWakeUp
        )]
    );
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

/// A connector whose transfers end `delay` polls after `abort_transfers`, shared with the test.
#[derive(Debug, Default)]
struct SlowTransfers {
    held: Vec<TransferId>,
    aborted: bool,
    polls_left: u32,
    n_resets: u32,
}

#[derive(Debug, Clone)]
struct Conn(Arc<Mutex<SlowTransfers>>);

impl KvConnector for Conn {
    fn name(&self) -> &str {
        "slow"
    }
    fn abort_transfers(&mut self) {
        self.0.lock().unwrap().aborted = true;
    }
    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>) {
        let mut s = self.0.lock().unwrap();
        if s.aborted && s.polls_left > 0 {
            s.polls_left -= 1;
        } else if s.aborted {
            out.append(&mut s.held);
        }
    }
    fn has_pending_work(&self) -> bool {
        let s = self.0.lock().unwrap();
        s.aborted && !s.held.is_empty()
    }
    fn reset_cache(&mut self) {
        self.0.lock().unwrap().n_resets += 1;
    }
}

#[test]
fn a_reset_waits_for_transfers_to_hand_their_blocks_back_then_resets_connectors() {
    let mut h = busy(3);
    let shared = Arc::new(Mutex::new(SlowTransfers {
        polls_left: 3,
        ..SlowTransfers::default()
    }));
    let conn = h.sched.add_connector(Box::new(Conn(shared.clone())));
    let a = h.sched.request_idx("a").unwrap();
    let t = h
        .sched
        .hold_blocks_for_transfer(a, Holder::Connector(conn))
        .unwrap();
    shared.lock().unwrap().held.push(t);
    assert!(
        !h.sched.reset_caches(true, false),
        "a transfer still holds blocks"
    );
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    let mut polls = 0;
    let events = loop {
        let e = poll(&mut h);
        if !e.is_empty() {
            break e;
        }
        assert!(h.sched.needs_idle_steps(), "the engine must keep stepping");
        polls += 1;
        assert!(polls < 10);
    };
    assert_eq!(events, vec![done(1)]);
    assert!(polls >= 2, "the reset waited for the transfer");
    assert!(shared.lock().unwrap().aborted);
    assert_eq!(shared.lock().unwrap().n_resets, 1);
    let s = h.sched.stats();
    assert_eq!(
        (s.n_blocks_used, s.n_transfers, s.n_blocks_cached),
        (0, 0, 0)
    );
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

#[test]
fn a_running_request_caches_no_blocks_after_a_weight_update() {
    let mut h = Harness::new(small_config());
    h.add("a", prompt(1, 20), greedy(40));
    h.step();
    h.sched.set_weight_version("v2");
    let cached = h.sched.stats().n_blocks_cached;
    h.drain(100);
    // It filled two more blocks after the update: their KV mixes both weights.
    assert_eq!(h.sched.stats().n_blocks_cached, cached);
}

#[test]
fn a_wake_up_keeps_a_pause_the_client_made_before_the_sleep() {
    let mut h = busy(2);
    h.sched.pause(OpId(1), PauseMode::Keep, false);
    h.sched.sleep(OpId(2), SleepLevel::L1, PauseMode::Keep);
    assert_eq!(
        poll(&mut h),
        vec![
            done(1),
            LifecycleEvent::ReleaseKvMemory,
            LifecycleEvent::OffloadWeights,
            done(2)
        ]
    );
    h.sched.wake_up(&[]);
    let s = h.sched.lifecycle_status();
    assert!(
        !s.sleeping && s.paused,
        "the client's pause outlives the sleep"
    );
    assert!(h.step().reqs.is_empty());
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

#[test]
fn a_reset_cancelled_by_a_wake_up_starts_over_next_time() {
    let mut h = busy(3);
    let shared = Arc::new(Mutex::new(SlowTransfers {
        polls_left: 2,
        ..SlowTransfers::default()
    }));
    let conn = h.sched.add_connector(Box::new(Conn(shared.clone())));
    let a = h.sched.request_idx("a").unwrap();
    let t = h
        .sched
        .hold_blocks_for_transfer(a, Holder::Connector(conn))
        .unwrap();
    shared.lock().unwrap().held.push(t);
    // The sleep's reset starts (requests preempted, transfers asked to end), then a wake-up
    // cancels it before the transfer hands its blocks back.
    h.sched.sleep(OpId(1), SleepLevel::L1, PauseMode::Keep);
    assert_eq!(poll(&mut h), vec![]);
    h.sched.wake_up(&[]);
    assert_eq!(
        poll(&mut h),
        vec![LifecycleEvent::Failed(
            OpId(1),
            LifecycleError::CancelledByWakeUp
        )]
    );
    assert!(!h.sched.lifecycle_status().paused);
    // Requests run again and hold blocks; a later reset must preempt them afresh.
    h.step();
    assert!(h.sched.stats().n_running > 0);
    h.sched.pause(OpId(2), PauseMode::Keep, true);
    let mut events = Vec::new();
    for _ in 0..10 {
        events = poll(&mut h);
        if !events.is_empty() {
            break;
        }
    }
    assert_eq!(events, vec![done(2)]);
    let s = h.sched.stats();
    assert_eq!((s.n_blocks_used, s.n_running, s.n_blocks_cached), (0, 0, 0));
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

/// Polls until the lifecycle has something to say, at most `max` times.
fn poll_until_events(h: &mut Harness, max: usize) -> Vec<LifecycleEvent> {
    for _ in 0..max {
        let events = poll(h);
        if !events.is_empty() {
            return events;
        }
    }
    Vec::new()
}

#[test]
fn a_reset_releases_at_once_holds_no_connector_owns_even_with_a_connector() {
    let mut h = busy(3);
    let shared = Arc::new(Mutex::new(SlowTransfers::default()));
    h.sched.add_connector(Box::new(Conn(shared.clone())));
    let a = h.sched.request_idx("a").unwrap();
    h.sched.hold_blocks_for_transfer(a, Holder::Caller).unwrap();
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    assert_eq!(
        poll_until_events(&mut h, 5),
        vec![done(1)],
        "no connector reports the caller's hold: the reset releases it"
    );
    let s = h.sched.stats();
    assert_eq!(
        (s.n_blocks_used, s.n_transfers, s.n_blocks_cached),
        (0, 0, 0)
    );
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

#[test]
fn a_connector_frees_only_the_holds_it_owns() {
    let mut h = busy(3);
    let shared = Arc::new(Mutex::new(SlowTransfers::default()));
    h.sched.add_connector(Box::new(Conn(shared.clone())));
    let a = h.sched.request_idx("a").unwrap();
    let t = h.sched.hold_blocks_for_transfer(a, Holder::Caller).unwrap();
    // A connector reporting a hold it does not own changes nothing.
    shared.lock().unwrap().held.push(t);
    shared.lock().unwrap().aborted = true;
    h.step();
    assert_eq!(h.sched.transfer_holder(t), Some(Holder::Caller));
    assert!(h.sched.release_transfer(t));
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

/// A connector whose reset leaves a flush set for its workers: pending work until the next
/// turn of the engine (a step, or a poll when idle) hands it over.
#[derive(Debug, Default)]
struct Flush {
    n_resets: u32,
    undelivered: bool,
}

#[derive(Debug)]
struct FlushConn(Arc<Mutex<Flush>>);

impl KvConnector for FlushConn {
    fn name(&self) -> &str {
        "flush"
    }
    fn abort_transfers(&mut self) {}
    fn take_finished_transfers(&mut self, _out: &mut Vec<TransferId>) {
        self.0.lock().unwrap().undelivered = false;
    }
    fn has_pending_work(&self) -> bool {
        self.0.lock().unwrap().undelivered
    }
    fn reset_cache(&mut self) {
        let mut s = self.0.lock().unwrap();
        s.n_resets += 1;
        s.undelivered = true;
    }
}

#[test]
fn memory_is_released_and_the_reply_sent_only_after_the_reset_flush_reached_the_workers() {
    let mut h = busy(3);
    let shared = Arc::new(Mutex::new(Flush::default()));
    h.sched.add_connector(Box::new(FlushConn(shared.clone())));
    h.sched.sleep(OpId(1), SleepLevel::L1, PauseMode::Keep);
    let events = poll(&mut h);
    assert_eq!(
        shared.lock().unwrap().n_resets,
        1,
        "the connectors were reset"
    );
    assert_eq!(
        events,
        vec![],
        "neither memory nor a reply in the poll that reset the connectors"
    );
    assert!(
        h.sched.needs_idle_steps(),
        "the engine must turn once more so the flush reaches the workers"
    );
    assert!(h.step().reqs.is_empty());
    assert_eq!(
        poll(&mut h),
        vec![
            LifecycleEvent::ReleaseKvMemory,
            LifecycleEvent::OffloadWeights,
            done(1)
        ]
    );
    assert_eq!(shared.lock().unwrap().n_resets, 1);
    assert!(!h.sched.needs_idle_steps());
    h.sched.wake_up(&[]);
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

/// A paused engine whose `release_kv_cache_memory` (op 2) waits for a slow transfer holding
/// request "a"'s blocks.
fn pending_kv_release() -> (Harness, Arc<Mutex<SlowTransfers>>) {
    let mut h = busy(3);
    let shared = Arc::new(Mutex::new(SlowTransfers {
        polls_left: 1000,
        ..SlowTransfers::default()
    }));
    let conn = h.sched.add_connector(Box::new(Conn(shared.clone())));
    let a = h.sched.request_idx("a").unwrap();
    let t = h
        .sched
        .hold_blocks_for_transfer(a, Holder::Connector(conn))
        .unwrap();
    shared.lock().unwrap().held.push(t);
    h.sched.pause(OpId(1), PauseMode::Keep, false);
    assert_eq!(poll(&mut h), vec![done(1)]);
    h.sched.release_kv_cache_memory(OpId(2)).unwrap();
    assert_eq!(poll(&mut h), vec![], "the release waits for the transfer");
    (h, shared)
}

#[test]
fn a_wake_up_of_the_kv_cache_cancels_a_pending_kv_release() {
    let (mut h, shared) = pending_kv_release();
    h.sched.wake_up(&[WakeTag::KvCache]);
    assert_eq!(
        poll(&mut h),
        vec![LifecycleEvent::Failed(
            OpId(2),
            LifecycleError::CancelledByWakeUp
        )]
    );
    // The transfer ends later: nothing is released after the wake-up.
    shared.lock().unwrap().polls_left = 0;
    for _ in 0..5 {
        assert_eq!(poll(&mut h), vec![]);
    }
    let s = h.sched.lifecycle_status();
    assert!(!s.kv_released && s.paused && !s.sleeping);
    assert_eq!(h.sched.stats().n_transfers, 0);
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

/// Only a wake-up of the KV cache cancels a pending KV release: one of the weights alone
/// leaves it to finish once the transfer ends.
#[test]
fn a_wake_up_of_the_weights_alone_leaves_a_pending_kv_release() {
    let (mut h, shared) = pending_kv_release();
    h.sched.wake_up(&[WakeTag::Weights]);
    assert_eq!(poll(&mut h), vec![], "still waiting");
    shared.lock().unwrap().polls_left = 0;
    let mut events = Vec::new();
    for _ in 0..5 {
        events.extend(poll(&mut h));
    }
    assert_eq!(
        events,
        vec![LifecycleEvent::ReleaseKvMemory, done(2)],
        "the engine frees the arena, then the release replies"
    );
    assert!(h.sched.lifecycle_status().kv_released);
}

#[test]
fn a_wake_up_keeps_a_pause_the_client_made_during_the_sleep() {
    let mut h = busy(2);
    h.sched.sleep(OpId(1), SleepLevel::L1, PauseMode::Keep);
    assert_eq!(
        poll(&mut h),
        vec![
            LifecycleEvent::ReleaseKvMemory,
            LifecycleEvent::OffloadWeights,
            done(1)
        ]
    );
    h.sched.pause(OpId(2), PauseMode::Keep, false);
    assert_eq!(poll(&mut h), vec![done(2)]);
    h.sched.wake_up(&[]);
    let s = h.sched.lifecycle_status();
    assert!(
        !s.sleeping && s.paused,
        "the client's pause outlives the sleep"
    );
    assert!(h.step().reqs.is_empty());
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);
}

/// A connector whose flush never reaches its workers, holding no blocks.
#[derive(Debug)]
struct NeverFlushed;

impl KvConnector for NeverFlushed {
    fn name(&self) -> &str {
        "stuck"
    }
    fn abort_transfers(&mut self) {}
    fn take_finished_transfers(&mut self, _: &mut Vec<TransferId>) {}
    fn has_pending_work(&self) -> bool {
        true
    }
    fn reset_cache(&mut self) {}
}

/// A reset that times out with no hold out but connector work pending names just that work.
#[test]
fn a_reset_timeout_names_connector_work_when_no_hold_is_out() {
    let mut h = busy(3);
    h.sched.add_connector(Box::new(NeverFlushed));
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    assert_eq!(h.sched.next_deadline(), None, "the reset has not started");
    assert_eq!(poll(&mut h), vec![]);
    let timeout = h.sched.config().lifecycle_wait_timeout;
    assert_eq!(
        h.sched.next_deadline(),
        Some(timeout),
        "counted from its start"
    );
    h.sched.advance_time(timeout);
    assert_eq!(
        poll(&mut h),
        vec![LifecycleEvent::Failed(
            OpId(1),
            LifecycleError::Timeout {
                waited: timeout,
                waiting_for: "connector work (a flush or revocation) to reach the workers of \
                              stuck"
                    .into(),
            }
        )]
    );
    assert!(h.sched.lifecycle_status().paused, "stays paused");
    assert_eq!(h.sched.next_deadline(), None, "nothing waits any more");
}

/// With `reset_connector`, a cache reset waits for connector work that has not reached its
/// workers, even with no transfer out; without it, the prefix cache resets.
#[test]
fn a_connector_reset_refuses_while_connector_work_is_pending() {
    let mut h = busy(3);
    h.sched.add_connector(Box::new(NeverFlushed));
    h.sched.pause(OpId(1), PauseMode::Keep, false);
    assert_eq!(poll(&mut h), vec![done(1)]);
    assert_eq!(h.sched.stats().n_transfers, 0);
    assert!(!h.sched.reset_caches(true, true));
    assert!(h.sched.reset_caches(true, false));
}

/// A draining pause waits for requests preempted during the drain too: it completes only
/// once every admitted request has finished.
#[test]
fn a_draining_pause_waits_for_requests_preempted_during_the_drain() {
    // 4 usable blocks of 16 tokens; each request grows to 60 tokens (4 blocks) alone.
    let mut h = Harness::new(SchedulerConfig {
        n_blocks: 5,
        max_model_len: 64,
        ..small_config()
    });
    h.add("a", prompt(1, 20), greedy(40));
    h.add("b", prompt(2, 20), greedy(40));
    while h.sched.stats().n_preemptions == 0 {
        h.step();
    }
    let b = h.sched.request_idx("b").unwrap();
    assert!(matches!(
        h.sched.request(b).unwrap().state,
        RequestState::Preempted { .. }
    ));
    h.sched.pause(OpId(1), PauseMode::Wait, false);
    let mut events = Vec::new();
    for _ in 0..200 {
        events.extend(poll(&mut h));
        if !events.is_empty() {
            break;
        }
        h.step();
    }
    assert_eq!(events, vec![done(1)]);
    assert_eq!(h.finished["a"].0, FinishReason::Length);
    assert_eq!(
        h.finished["b"].0,
        FinishReason::Length,
        "b was readmitted and finished"
    );
}

#[test]
fn weights_lend_only_to_a_completed_pause_and_hold_resume_and_sleep_until_they_return() {
    // Running, or a `wait` pause still draining: not lent.
    let mut h = busy(3);
    assert!(!h.sched.lend_weights(), "running");
    h.sched.pause(OpId(1), PauseMode::Wait, false);
    assert!(!h.sched.lend_weights(), "a wait pause still pending");
    assert_eq!(
        h.sched.lifecycle_status().weights,
        WeightResidency::Resident
    );

    // A keep pause completed: lent; nothing computes, resume and sleep are refused.
    let mut h = busy(3);
    h.sched.pause(OpId(1), PauseMode::Keep, false);
    assert_eq!(poll(&mut h), vec![done(1)]);
    assert!(h.sched.lend_weights());
    assert!(!h.sched.lend_weights(), "lent once");
    let s = h.sched.lifecycle_status();
    assert_eq!(s.weights, WeightResidency::Reloading);
    assert!(s.paused && s.sleeping);
    assert_eq!(h.sched.resume(), Err(LifecycleError::Reloading));
    h.sched.sleep(OpId(2), SleepLevel::L2, PauseMode::Keep);
    assert_eq!(
        poll(&mut h),
        vec![LifecycleEvent::Failed(OpId(2), LifecycleError::Reloading)]
    );
    assert!(h.step().reqs.is_empty(), "nothing computes while lent");
    // Back with new weights: the pause stays until the client's resume; nothing was lost.
    h.sched.weights_returned(true);
    let s = h.sched.lifecycle_status();
    assert_eq!(s.weights, WeightResidency::Resident);
    assert!(s.paused && !s.sleeping);
    h.sched.resume().unwrap();
    h.drain(100);
    assert_eq!(h.generated, reference().generated);

    // A read that failed midway: dropped, as after sleep level 2; a wake-up of the weights
    // (after a complete install) brings them back, and the client's resume continues.
    let mut h = busy(3);
    h.sched.pause(OpId(1), PauseMode::Abort, false);
    assert_eq!(poll(&mut h), vec![done(1)]);
    assert!(h.sched.lend_weights());
    h.sched.weights_returned(false);
    let s = h.sched.lifecycle_status();
    assert_eq!(s.weights, WeightResidency::Dropped);
    assert!(s.sleeping && s.paused);
    assert_eq!(
        h.sched.resume(),
        Err(LifecycleError::Asleep { what: "weights" })
    );
    h.sched.weights_returned(true);
    assert_eq!(
        h.sched.lifecycle_status().weights,
        WeightResidency::Dropped,
        "only lent weights come back"
    );
    h.sched.wake_up(&[WakeTag::Weights]);
    assert!(
        h.sched.lifecycle_status().paused,
        "the client's pause stays"
    );
    h.sched.resume().unwrap();
    assert!(!h.sched.lifecycle_status().sleeping);
}
