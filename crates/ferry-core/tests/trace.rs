//! Text traces of scheduling decisions: a few requests, a few steps, and the expected plans.

mod common;

use common::{prompt, small_config, Harness};
use expect_test::expect;
use ferry_core::{OpId, PauseMode, SamplingParams, SchedulerConfig};

#[test]
fn two_requests_chunked_prefill_then_decode() {
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 40), SamplingParams::greedy(2));
    h.add("B", prompt(2, 100), SamplingParams::greedy(2));
    expect![[r#"
        step 0
        A: pos 0..40 blocks [1, 2, 3] sample
        B: pos 0..88 blocks [4, 5, 6, 7, 8, 9]
        step 1
        A: pos 40..41 blocks [1, 2, 3] sample
        B: pos 88..100 blocks [4, 5, 6, 7, 8, 9, 10] sample
          A finished: length
        step 2
        B: pos 100..101 blocks [4, 5, 6, 7, 8, 9, 10] sample
          B finished: length
        step 3
        (nothing scheduled)
    "#]]
    .assert_eq(&h.steps_text(4));
}

#[test]
fn later_request_hits_shared_prefix_and_recomputes_last_token() {
    let mut h = Harness::new(small_config());
    let shared = prompt(1, 48);
    h.add("A", shared.clone(), SamplingParams::greedy(1));
    let mut b = shared.clone();
    b.extend(prompt(2, 10));
    h.add("B", b, SamplingParams::greedy(1));
    // C is exactly A's prompt: a hit must leave one token, so only 2 of its 3 blocks hit.
    h.add("C", shared, SamplingParams::greedy(1));
    expect![[r#"
        step 0
        A: pos 0..48 blocks [1, 2, 3] sample
        B: pos 48..58 blocks [1, 2, 3, 4] sample
        C: pos 32..48 blocks [1, 2, 5] sample
          A finished: length
          B finished: length
          C finished: length
        step 1
        (nothing scheduled)
    "#]]
    .assert_eq(&h.steps_text(2));
    let s = h.sched.stats();
    assert_eq!(
        (s.prefix_hit_tokens, s.prefix_query_tokens),
        (48 + 32, 48 + 58 + 48)
    );
}

#[test]
fn budget_and_seats_limit_admission_in_order() {
    let mut h = Harness::new(SchedulerConfig {
        max_num_seqs: 2,
        max_num_batched_tokens: 32,
        ..small_config()
    });
    h.add("A", prompt(1, 20), SamplingParams::greedy(3));
    h.add("B", prompt(2, 20), SamplingParams::greedy(3));
    h.add("C", prompt(3, 5), SamplingParams::greedy(1));
    expect![[r#"
        step 0
        A: pos 0..20 blocks [1, 2] sample
        B: pos 0..12 blocks [3]
        step 1
        A: pos 20..21 blocks [1, 2] sample
        B: pos 12..20 blocks [3, 4] sample
        step 2
        A: pos 21..22 blocks [1, 2] sample
        B: pos 20..21 blocks [3, 4] sample
          A finished: length
        step 3
        B: pos 21..22 blocks [3, 4] sample
        C: pos 0..5 blocks [5] sample
          B finished: length
          C finished: length
        step 4
        (nothing scheduled)
        step 5
        (nothing scheduled)
    "#]]
    .assert_eq(&h.steps_text(6));
}

#[test]
fn preemption_recomputes_latest_admitted_and_keeps_order() {
    // 7 usable blocks of 4 tokens; A and B each grow past what both can hold.
    let mut h = Harness::new(SchedulerConfig {
        block_size: 4,
        n_blocks: 8,
        max_num_batched_tokens: 64,
        ..small_config()
    });
    h.add("A", prompt(1, 11), SamplingParams::greedy(8));
    h.add("B", prompt(2, 11), SamplingParams::greedy(8));
    h.add("C", prompt(3, 3), SamplingParams::greedy(1));
    expect![[r#"
        step 0
        A: pos 0..11 blocks [1, 2, 3] sample
        B: pos 0..11 blocks [4, 5, 6] sample
        C: pos 0..3 blocks [7] sample
          C finished: length
        step 1
        A: pos 11..12 blocks [1, 2, 3] sample
        B: pos 11..12 blocks [4, 5, 6] sample
        step 2
        A: pos 12..13 blocks [1, 2, 3, 7] sample
        step 3
        A: pos 13..14 blocks [1, 2, 3, 7] sample
        step 4
        A: pos 14..15 blocks [1, 2, 3, 7] sample
        step 5
        A: pos 15..16 blocks [1, 2, 3, 7] sample
        step 6
        A: pos 16..17 blocks [1, 2, 3, 7, 6] sample
        step 7
        A: pos 17..18 blocks [1, 2, 3, 7, 6] sample
          A finished: length
        step 8
        B: pos 8..13 blocks [4, 5, 6, 7] sample
        step 9
        B: pos 13..14 blocks [4, 5, 6, 7] sample
    "#]]
    .assert_eq(&h.steps_text(10));
    assert_eq!(h.sched.stats().n_preemptions, 1);
    h.drain(100);
    assert_eq!(h.finished.len(), 3);
}

#[test]
fn pause_states_gate_admission_and_compute() {
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 20), SamplingParams::greedy(3));
    h.step();
    h.sched.pause(OpId(1), PauseMode::Wait, false);
    h.add("B", prompt(2, 20), SamplingParams::greedy(1));
    let no_admit = h.step_text();
    h.sched.pause(OpId(2), PauseMode::Keep, false);
    let frozen = h.step_text();
    h.sched.resume().unwrap();
    let resumed = h.step_text();
    expect![[r#"
        no-admit:
        A: pos 20..21 blocks [1, 2] sample
        frozen:
        (nothing scheduled)
        resumed:
        A: pos 21..22 blocks [1, 2] sample
        B: pos 0..20 blocks [3, 4] sample
          A finished: length
          B finished: length
    "#]]
    .assert_eq(&format!(
        "no-admit:\n{no_admit}frozen:\n{frozen}resumed:\n{resumed}"
    ));
}

#[test]
fn preempt_all_running_requeues_in_order_and_recomputes_outputs() {
    let mut h = Harness::new(SchedulerConfig {
        max_num_seqs: 2,
        ..small_config()
    });
    h.add("A", prompt(1, 20), SamplingParams::greedy(4));
    h.add("B", prompt(2, 20), SamplingParams::greedy(4));
    h.add("C", prompt(3, 20), SamplingParams::greedy(1));
    h.step();
    h.step();
    assert_eq!(h.sched.preempt_all_running(), 2);
    h.check();
    assert!(
        h.sched.reset_prefix_cache(),
        "nothing is held after preempting everything"
    );
    // A and B come back first, in order, recomputing prompt + 2 generated tokens from 0.
    expect![[r#"
        step 0
        A: pos 0..22 blocks [5, 6] sample
        B: pos 0..22 blocks [7, 8] sample
        step 1
        A: pos 22..23 blocks [5, 6] sample
        B: pos 22..23 blocks [7, 8] sample
          A finished: length
          B finished: length
    "#]]
    .assert_eq(&h.steps_text(2));
}

#[test]
fn without_chunked_prefill_a_prompt_waits_for_a_whole_step_in_order() {
    let mut h = Harness::new(SchedulerConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 32,
        ..small_config()
    });
    h.add("A", prompt(1, 20), SamplingParams::greedy(2));
    h.add("B", prompt(2, 30), SamplingParams::greedy(1));
    h.add("C", prompt(3, 5), SamplingParams::greedy(1));
    expect![[r#"
        step 0
        A: pos 0..20 blocks [1, 2] sample
        step 1
        A: pos 20..21 blocks [1, 2] sample
        B: pos 0..30 blocks [3, 4] sample
          A finished: length
          B finished: length
        step 2
        C: pos 0..5 blocks [5] sample
          C finished: length
    "#]]
    .assert_eq(&h.steps_text(3));
}

#[test]
fn without_chunked_prefill_a_preempted_request_recomputes_in_chunks() {
    let mut h = Harness::new(SchedulerConfig {
        enable_chunked_prefill: false,
        enable_prefix_caching: false,
        block_size: 4,
        n_blocks: 8,
        max_num_batched_tokens: 12,
        ..small_config()
    });
    h.add("A", prompt(1, 12), SamplingParams::greedy(10));
    h.step();
    h.step();
    h.sched.preempt_all_running();
    // A now has 14 tokens to recompute, more than one step holds.
    expect![[r#"
        step 0
        A: pos 0..12 blocks [5, 6, 7]
        step 1
        A: pos 12..14 blocks [5, 6, 7, 4] sample
        step 2
        A: pos 14..15 blocks [5, 6, 7, 4] sample
    "#]]
    .assert_eq(&h.steps_text(3));
}
