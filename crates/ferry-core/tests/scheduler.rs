//! Scheduler behaviour at its API: admission errors, stop conditions, aborts, output checks,
//! prefix-cache isolation (weight version, salt), cache reset and transfer holds.

mod common;

use std::convert::Infallible;

use common::{fake_token, prompt, small_config, Harness};
use ferry_core::{
    AddError, AdjustedToken, BlockId, BlockStatus, ConnectorId, FinishReason, HoldKind, Holder,
    LogitsAdjust, LogitsParams, ModelOutput, OutputError, Owner, RequestState, SampledToken,
    SamplingParams, Scheduler, SchedulerConfig, StepDriver, StepModel, StepPlan, TokenId,
    TransferError,
};

#[test]
fn bad_requests_are_rejected_with_their_reason() {
    let mut s = Scheduler::new(SchedulerConfig {
        max_model_len: 64,
        n_blocks: 4, // 3 usable blocks of 16 tokens
        ..small_config()
    })
    .unwrap();
    let g = SamplingParams::greedy;
    assert_eq!(
        s.add_request("e", vec![], g(1)),
        Err(AddError::EmptyPrompt { id: "e".into() })
    );
    assert_eq!(
        s.add_request("l", prompt(1, 64), g(1)),
        Err(AddError::PromptTooLong {
            id: "l".into(),
            prompt_len: 64,
            max_model_len: 64
        })
    );
    assert_eq!(
        s.add_request("z", prompt(1, 3), g(0)),
        Err(AddError::ZeroMaxTokens { id: "z".into() })
    );
    assert_eq!(
        s.add_request("k", prompt(1, 40), g(20)),
        Err(AddError::TooLongForKvCache {
            id: "k".into(),
            n_blocks_needed: 4,
            n_blocks_usable: 3
        })
    );
    // 40 + 9 tokens: the 49th is never computed, so 3 blocks are enough.
    s.add_request("ok", prompt(1, 40), g(9)).unwrap();
    assert_eq!(
        s.add_request("ok", prompt(2, 3), g(1)),
        Err(AddError::DuplicateId { id: "ok".into() })
    );
    let mut no_chunk = Scheduler::new(SchedulerConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 32,
        ..small_config()
    })
    .unwrap();
    assert!(matches!(
        no_chunk.add_request("c", prompt(1, 33), g(1)),
        Err(AddError::PromptExceedsBatch { prompt_len: 33, .. })
    ));
}

/// A model that samples the script's tokens in turn, one per step.
struct Script<'a>(std::slice::Iter<'a, u32>);

impl StepModel for Script<'_> {
    type Error = Infallible;

    fn compute(&mut self, _: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, Infallible> {
        let sampled = plan
            .reqs
            .iter()
            .filter(|r| r.sample.is_some())
            .map(|r| SampledToken {
                req: r.req,
                token: TokenId(*self.0.next().expect("script long enough")),
                logprob: 0.0,
                top_logprobs: vec![],
            })
            .collect();
        Ok(ModelOutput {
            sampled,
            ..ModelOutput::default()
        })
    }
}

/// Runs one request alone with a scripted model and returns its tokens and finish reason.
fn run_scripted(
    config: SchedulerConfig,
    params: SamplingParams,
    script: &[u32],
) -> (Vec<u32>, FinishReason) {
    let mut d = StepDriver::new(Scheduler::new(config).unwrap(), Script(script.iter()));
    d.sched.add_request("r", prompt(1, 5), params).unwrap();
    let mut tokens = Vec::new();
    for _ in script {
        let outs = d.step().unwrap().outputs;
        tokens.push(outs[0].sampled.as_ref().unwrap().token.0);
        if let Some(f) = &outs[0].finished {
            d.sched.check_ownership().unwrap();
            assert_eq!(d.sched.stats().n_blocks_used, 0);
            return (tokens, f.reason);
        }
    }
    panic!("script ran out before the request finished: {tokens:?}");
}

#[test]
fn stop_conditions() {
    let c = small_config(); // EOS is 2
    let p = |max_tokens, ignore_eos, stop: Vec<u32>| SamplingParams {
        max_tokens,
        ignore_eos,
        stop_token_ids: TokenId::list(stop),
        ..SamplingParams::default()
    };
    let script = [5, 2, 9, 4, 8, 8, 8];
    assert_eq!(
        run_scripted(c.clone(), p(10, false, vec![]), &script),
        (vec![5, 2], FinishReason::Stop)
    );
    assert_eq!(
        run_scripted(c.clone(), p(10, true, vec![4]), &script),
        (vec![5, 2, 9, 4], FinishReason::Stop)
    );
    assert_eq!(
        run_scripted(c.clone(), p(3, true, vec![]), &script),
        (vec![5, 2, 9], FinishReason::Length)
    );
    let short = SchedulerConfig {
        max_model_len: 8,
        ..c
    };
    assert_eq!(
        run_scripted(short, p(10, true, vec![]), &script),
        (vec![5, 2, 9], FinishReason::Length)
    );
}

#[test]
fn abort_frees_blocks_and_ignores_unknown_ids() {
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 40), SamplingParams::greedy(10));
    h.add("B", prompt(2, 40), SamplingParams::greedy(10));
    h.step();
    let out = h.sched.abort("A").unwrap();
    let f = out.finished.unwrap();
    assert_eq!(
        (f.request_id.as_str(), f.reason, out.n_output_tokens),
        ("A", FinishReason::Abort, 1)
    );
    assert!(h.sched.abort("A").is_none());
    assert!(h.sched.abort("nope").is_none());
    h.check();
    h.add("C", prompt(3, 40), SamplingParams::greedy(10));
    let all = h.sched.abort_all();
    let ids: Vec<_> = all
        .iter()
        .map(|o| o.finished.as_ref().unwrap().request_id.clone())
        .collect();
    assert_eq!(ids, ["B", "C"]);
    h.check();
    assert_eq!((h.sched.n_live(), h.sched.stats().n_blocks_used), (0, 0));
}

#[test]
fn below_min_tokens_stop_tokens_do_not_stop() {
    let c = small_config(); // EOS is 2
    let p = |min_tokens, stop: Vec<u32>| SamplingParams {
        max_tokens: 10,
        stop_token_ids: TokenId::list(stop),
        logits: LogitsParams {
            min_tokens,
            ..LogitsParams::default()
        },
        ..SamplingParams::default()
    };
    // A model that emits stop tokens anyway (a constraint can force one): below the minimum
    // they are ordinary tokens, from the minimum on they stop as usual.
    let script = [5, 2, 4, 2, 4, 8];
    // As vLLM checks it: the token that makes the output `min_tokens` long may stop it.
    assert_eq!(
        run_scripted(c.clone(), p(4, vec![4]), &script),
        (vec![5, 2, 4, 2], FinishReason::Stop)
    );
    assert_eq!(
        run_scripted(c.clone(), p(3, vec![4]), &script),
        (vec![5, 2, 4], FinishReason::Stop)
    );
    assert_eq!(
        run_scripted(c, p(0, vec![]), &script),
        (vec![5, 2], FinishReason::Stop)
    );
}

#[test]
fn the_plan_carries_each_samples_logits_processing() {
    let mut h = Harness::new(small_config()); // EOS is 2
    let params = SamplingParams {
        max_tokens: 8,
        stop_token_ids: vec![TokenId(9)],
        logits: LogitsParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 1.5,
            logit_bias: vec![(TokenId(7), 3.0), (TokenId(40), -1.0)],
            min_tokens: 2,
        },
        ..SamplingParams::default()
    };
    h.add("P", TokenId::list([7, 7, 3]), params);
    h.add("plain", TokenId::list([1, 2, 3]), SamplingParams::greedy(4));
    let entry = |token, bias, output_count, seen| AdjustedToken {
        token,
        bias,
        output_count,
        seen,
    };
    let mut outputs: Vec<u32> = Vec::new();
    for step in 0..3 {
        let plan = h.sched.schedule();
        let specs: Vec<_> = plan.reqs.iter().filter_map(|r| r.sample).collect();
        assert_eq!(specs.len(), 2);
        // Only the request with processing has any; its list is built from its own tokens.
        assert_eq!(specs[1].adjust, None);
        let adjust = plan.adjust_of(&specs[0]).unwrap();
        assert_eq!(
            (
                adjust.presence_penalty,
                adjust.frequency_penalty,
                adjust.repetition_penalty
            ),
            (0.5, 0.25, 1.5)
        );
        let mut want = match step {
            // Before any output: the prompt's tokens, the biases, EOS and the stop token held
            // back (min_tokens 2).
            0 => vec![
                entry(TokenId(2), f32::NEG_INFINITY, 0, false),
                entry(TokenId(3), 0.0, 0, true),
                entry(TokenId(7), 3.0, 0, true),
                entry(TokenId(9), f32::NEG_INFINITY, 0, false),
                entry(TokenId(40), -1.0, 0, false),
            ],
            _ => Vec::new(),
        };
        if step > 0 {
            let count = |t: u32| outputs.iter().filter(|&&o| o == t).count() as u32;
            let mut ids: Vec<u32> = [2, 3, 7, 9, 40]
                .into_iter()
                .chain(outputs.clone())
                .collect();
            ids.sort_unstable();
            ids.dedup();
            for t in ids {
                let held = outputs.len() < 2 && (t == 2 || t == 9);
                let bias = match t {
                    _ if held => f32::NEG_INFINITY,
                    7 => 3.0,
                    40 => -1.0,
                    _ => 0.0,
                };
                let seen = [3, 7].contains(&t) || count(t) > 0;
                if bias != 0.0 || seen {
                    want.push(entry(TokenId(t), bias, count(t), seen));
                }
            }
        }
        assert_eq!(adjust.tokens, want, "step {step}");
        let out = h.run_model(&plan);
        outputs.push(out.sampled[0].token.0);
        h.sched.on_step_output(&plan, &out).unwrap();
    }
}

#[test]
fn logits_processing_follows_vllms_order() {
    let adjust = LogitsAdjust {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        repetition_penalty: 2.0,
        tokens: Vec::new(),
    };
    let e = |bias, output_count, seen| AdjustedToken {
        token: TokenId(0),
        bias,
        output_count,
        seen,
    };
    // Bias first, then the repetition penalty by sign, then frequency and presence.
    assert_eq!(adjust.apply(&e(1.0, 0, true), 3.0), 2.0);
    assert_eq!(adjust.apply(&e(-5.0, 0, true), 3.0), -4.0);
    assert_eq!(adjust.apply(&e(0.0, 2, true), 3.0), 1.5 - 0.5 - 0.5);
    assert_eq!(adjust.apply(&e(0.0, 0, false), 3.0), 3.0);
    assert_eq!(
        adjust.apply(&e(f32::NEG_INFINITY, 1, true), 3.0),
        f32::NEG_INFINITY
    );
    let mut row = vec![1.0, 2.0, -1.0];
    LogitsAdjust {
        tokens: vec![AdjustedToken {
            token: TokenId(2),
            ..e(0.0, 1, true)
        }],
        ..adjust
    }
    .apply_row(&mut row);
    assert_eq!(row, [1.0, 2.0, -2.0 - 0.25 - 0.5]);
}

#[test]
fn output_must_answer_the_latest_plan() {
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 10), SamplingParams::greedy(5));
    h.add("B", prompt(2, 10), SamplingParams::greedy(5));
    let plan = h.sched.schedule();
    let good = h.run_model(&plan);
    let (a, b) = (good.sampled[0].clone(), good.sampled[1].clone());
    let err = |sampled: Vec<SampledToken>| {
        let mut s2 = Harness::new(small_config());
        s2.add("A", prompt(1, 10), SamplingParams::greedy(5));
        s2.add("B", prompt(2, 10), SamplingParams::greedy(5));
        let plan = s2.sched.schedule();
        s2.sched
            .on_step_output(
                &plan,
                &ModelOutput {
                    sampled,
                    ..ModelOutput::default()
                },
            )
            .unwrap_err()
    };
    assert_eq!(
        err(vec![a.clone()]),
        OutputError::Missing { missing: b.req }
    );
    assert_eq!(
        err(vec![b.clone(), a.clone()]),
        OutputError::WrongRequest {
            expected: a.req,
            got: b.req
        }
    );
    assert_eq!(
        err(vec![a.clone(), b.clone(), a.clone()]),
        OutputError::Unexpected { got: a.req }
    );
    let _next = h.sched.schedule();
    assert_eq!(
        h.sched.on_step_output(&plan, &good),
        Err(OutputError::StalePlan { got: 0, latest: 1 })
    );
}

/// Runs A to completion, then B with the same prompt; returns B's prefix-hit tokens.
fn second_request_hit(
    change: impl FnOnce(&mut Harness),
    salt_a: Option<&str>,
    salt_b: Option<&str>,
) -> usize {
    let mut h = Harness::new(small_config());
    let p = prompt(1, 40);
    let with_salt = |s: Option<&str>| SamplingParams {
        cache_salt: s.map(str::to_owned),
        ..SamplingParams::greedy(1)
    };
    h.add("A", p.clone(), with_salt(salt_a));
    h.drain(10);
    change(&mut h);
    h.add("B", p, with_salt(salt_b));
    h.step();
    let hit = h.sched.stats().prefix_hit_tokens as usize;
    h.drain(10);
    hit
}

#[test]
fn same_weights_hit_and_a_new_weight_version_never_does() {
    assert_eq!(second_request_hit(|_| {}, None, None), 32);
    assert_eq!(
        second_request_hit(|h| h.sched.set_weight_version("1"), None, None),
        0
    );
    // Switching back to a version string used before never finds the old chain: each change
    // is a new weight load, and the string alone cannot prove the weights are the same.
    assert_eq!(
        second_request_hit(
            |h| {
                h.sched.set_weight_version("1");
                h.sched.set_weight_version("0");
            },
            None,
            None
        ),
        0
    );
}

#[test]
fn cache_salt_isolates_tenants() {
    assert_eq!(second_request_hit(|_| {}, Some("t1"), Some("t1")), 32);
    assert_eq!(second_request_hit(|_| {}, Some("t1"), Some("t2")), 0);
    assert_eq!(second_request_hit(|_| {}, None, Some("t1")), 0);
}

#[test]
fn reset_prefix_cache_drops_hits_once_nothing_is_held() {
    assert_eq!(
        second_request_hit(|h| assert!(h.sched.reset_prefix_cache()), None, None),
        0
    );
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 40), SamplingParams::greedy(3));
    h.step();
    assert!(!h.sched.reset_prefix_cache(), "A still holds blocks");
    assert!(h.sched.stats().n_blocks_cached > 0);
}

#[test]
fn weight_version_change_while_waiting_rehashes_on_admission() {
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 40), SamplingParams::greedy(1));
    h.drain(10);
    h.add("B", prompt(1, 40), SamplingParams::greedy(1)); // hashed under "0" at add
    h.sched.set_weight_version("1");
    h.step();
    assert_eq!(h.sched.stats().prefix_hit_tokens, 0);
    h.add("C", prompt(1, 40), SamplingParams::greedy(1));
    h.step();
    assert_eq!(
        h.sched.stats().prefix_hit_tokens,
        32,
        "C hits B's blocks, cached under \"1\""
    );
}

#[test]
fn transfer_hold_outlives_the_request_and_blocks_reset() {
    let mut h = Harness::new(small_config());
    h.add("P", prompt(1, 40), SamplingParams::greedy(1));
    let plan = h.sched.schedule();
    let idx = plan.reqs[0].req;
    // P/D export: hold the prompt's KV before the final output frees the request.
    let t = h
        .sched
        .hold_blocks_for_transfer(idx, Holder::Caller)
        .unwrap();
    let out = h.run_model(&plan);
    let outs = h.sched.on_step_output(&plan, &out).unwrap();
    h.record(&outs);
    h.check();
    assert_eq!(h.finished["P"].0, FinishReason::Length);
    assert_eq!(
        h.sched.transfer_blocks(t),
        Some(&BlockId::list([1, 2, 3])[..])
    );
    let ledger = h.sched.block_ledger().unwrap();
    assert_eq!(
        ledger[1],
        BlockStatus::Held(vec![Owner::Transfer {
            hold: t,
            holder: Holder::Caller,
            kind: HoldKind::Caller
        }])
    );
    assert_eq!(ledger[4], BlockStatus::Free { cached: false });
    assert!(
        !h.sched.reset_prefix_cache(),
        "the export still holds blocks"
    );
    assert!(h.sched.release_transfer(t));
    assert!(!h.sched.release_transfer(t));
    h.check();
    assert!(h.sched.reset_prefix_cache());
    assert_eq!(
        h.sched.hold_blocks_for_transfer(idx, Holder::Caller),
        Err(TransferError::UnknownRequest(idx))
    );
}

#[test]
fn a_hold_for_a_connector_that_does_not_exist_is_refused() {
    let mut h = Harness::new(small_config());
    h.add("A", prompt(1, 20), SamplingParams::greedy(4));
    h.step();
    let idx = h.sched.request_idx("A").unwrap();
    assert_eq!(
        h.sched
            .hold_blocks_for_transfer(idx, Holder::Connector(ConnectorId(3))),
        Err(TransferError::UnknownConnector(ConnectorId(3)))
    );
    assert_eq!(h.sched.stats().n_transfers, 0);
}

/// Runs a one-token request to its end; returns the prefix-hit tokens counted so far.
fn run_one(h: &mut Harness, id: &str, prompt: Vec<TokenId>) -> u64 {
    h.add(id, prompt, SamplingParams::greedy(1));
    h.drain(10);
    h.sched.stats().prefix_hit_tokens
}

/// Switching the weights back to a version string seen before still starts a new chain: KV
/// computed under the first use of that version is never hit.
#[test]
fn a_weight_version_seen_before_does_not_bring_back_its_old_cache() {
    let mut h = Harness::new(small_config());
    assert_eq!(h.sched.weight_version(), small_config().weight_version);
    h.sched.set_weight_version("b");
    assert_eq!(h.sched.weight_version(), "b");
    run_one(&mut h, "x", prompt(1, 40));
    let hits = run_one(&mut h, "same", prompt(1, 40));
    assert!(hits > 0, "the same weights hit the cache");
    h.sched.set_weight_version("c");
    h.sched.set_weight_version("b");
    assert_eq!(h.sched.weight_version(), "b");
    assert_eq!(
        run_one(&mut h, "y", prompt(1, 40)),
        hits,
        "no hit across the updates"
    );
}

#[test]
fn evicted_blocks_are_not_hit_again() {
    let mut h = Harness::new(small_config());
    // 200 tokens take two steps of at most 128: the first 8 blocks are known after one.
    h.add("x", prompt(1, 200), SamplingParams::greedy(1));
    h.step();
    let x = h.sched.request_idx("x").unwrap();
    let blocks = h.sched.request(x).unwrap().blocks.clone();
    assert_eq!(blocks.len(), 8);
    h.drain(10);
    let hits = run_one(&mut h, "same", prompt(1, 200));
    assert!(hits > 0, "the same prompt hits the cache");
    h.sched.evict_blocks(&blocks);
    assert_eq!(
        run_one(&mut h, "y", prompt(1, 200)),
        hits,
        "the chain's head is gone"
    );
}

#[test]
fn the_clock_is_the_latest_time_given() {
    let mut s = Scheduler::new(small_config()).unwrap();
    assert_eq!(s.now(), std::time::Duration::ZERO);
    s.advance_time(std::time::Duration::from_millis(1500));
    assert_eq!(s.now(), std::time::Duration::from_millis(1500));
}

#[test]
fn waiting_request_has_no_blocks_to_hold() {
    let mut h = Harness::new(small_config());
    h.add("W", prompt(1, 4), SamplingParams::greedy(1));
    let idx = h.sched.request_idx("W").unwrap();
    assert_eq!(
        h.sched.hold_blocks_for_transfer(idx, Holder::Caller),
        Err(TransferError::NoBlocks { id: "W".into() })
    );
}

#[test]
fn many_requests_drain_with_exact_outputs() {
    let mut h = Harness::new(SchedulerConfig {
        n_blocks: 20,
        ..small_config()
    });
    for i in 0..12u32 {
        h.add(
            &format!("r{i}"),
            prompt(i % 3, 10 + 9 * i as usize),
            SamplingParams::greedy(3 + i),
        );
    }
    h.drain(500);
    for i in 0..12u32 {
        let id = format!("r{i}");
        let want: Vec<TokenId> = (0..3 + i)
            .map(|k| fake_token(&id, k, h.model.vocab))
            .collect();
        assert_eq!(h.generated[&id], want, "{id}");
        assert_eq!(h.finished[&id], (FinishReason::Length, 1));
    }
    let s = h.sched.stats();
    assert!(
        s.n_preemptions > 0,
        "20 blocks were meant to force preemption"
    );
    assert_eq!((s.n_blocks_used, s.n_running, s.n_waiting), (0, 0, 0));
}

/// Each request counts its own preemptions: a preempted request says how often it was
/// preempted, and those counts add up to the scheduler's total.
#[test]
fn every_preemption_is_counted_on_its_request() {
    // 8 usable blocks of 16 tokens for four requests that each grow to 5 blocks.
    let mut h = Harness::new(SchedulerConfig {
        n_blocks: 9,
        ..small_config()
    });
    let ids: Vec<String> = (0..4).map(|i| format!("r{i}")).collect();
    for (i, id) in (0u32..).zip(&ids) {
        h.add(id, prompt(i, 16), SamplingParams::greedy(60));
    }
    let mut most = std::collections::BTreeMap::<&str, u32>::new();
    for _ in 0..500 {
        if h.sched.n_live() == 0 {
            break;
        }
        h.step();
        for id in &ids {
            let Some(r) = h.sched.request_idx(id) else {
                continue;
            };
            if let RequestState::Preempted { n_preemptions } = h.sched.request(r).unwrap().state {
                let n = most.entry(id).or_default();
                assert!(
                    n_preemptions >= (*n).max(1),
                    "{id}: counted, and never less"
                );
                *n = n_preemptions;
            }
        }
    }
    assert_eq!(h.sched.n_live(), 0);
    let total: u64 = most.values().map(|&n| u64::from(n)).sum();
    assert_eq!(total, h.sched.stats().n_preemptions);
    assert!(
        most.values().any(|&n| n >= 2),
        "some request was preempted twice: {most:?}"
    );
}

#[test]
fn lru_evicts_a_freed_chain_tail_first() {
    let mut h = Harness::new(SchedulerConfig {
        n_blocks: 7, // 6 usable blocks of 16 tokens
        ..small_config()
    });
    let a = prompt(1, 48);
    h.add("A", a.clone(), SamplingParams::greedy(1));
    h.drain(5); // A held blocks 1,2,3, freed tail first: the queue is 4,5,6,3,2,1
    h.add("B", prompt(2, 50), SamplingParams::greedy(1)); // needs 4 blocks
    let plan = h.step();
    assert_eq!(plan.block_tables, BlockId::list([4, 5, 6, 3]));
    h.add("C", a, SamplingParams::greedy(1));
    h.step();
    assert_eq!(
        h.sched.stats().prefix_hit_tokens,
        32,
        "A's head blocks 1 and 2 survived; only its tail block 3 was evicted"
    );
}

#[test]
fn same_inputs_give_the_same_plans() {
    let run = || {
        let mut h = Harness::new(SchedulerConfig {
            n_blocks: 24,
            ..small_config()
        });
        for i in 0..10u32 {
            h.add(
                &format!("q{i}"),
                prompt(i % 2, 17 + 13 * i as usize),
                SamplingParams::greedy(2 + i),
            );
        }
        let mut plans = Vec::new();
        while h.sched.n_live() > 0 && plans.len() < 500 {
            plans.push(h.step());
        }
        plans
    };
    let first = run();
    assert!(first.len() > 10);
    assert_eq!(first, run());
}

#[test]
fn hold_kv_on_finish_hands_blocks_to_a_transfer() {
    let mut h = Harness::new(small_config());
    h.add("P", prompt(1, 40), SamplingParams::greedy(2));
    h.add("X", prompt(2, 20), SamplingParams::greedy(5));
    for id in ["P", "X"] {
        let idx = h.sched.request_idx(id).unwrap();
        h.sched.hold_kv_on_finish(idx).unwrap();
    }
    let mut transfer = None;
    for _ in 0..3 {
        for o in h.step_outputs().outputs {
            if let Some(f) = &o.finished {
                assert_eq!(f.request_id, "P");
                transfer = f.transfer;
            }
        }
    }
    let t = transfer.expect("P finished with its KV held");
    assert_eq!(
        h.sched.transfer_blocks(t),
        Some(&BlockId::list([1, 2, 3])[..])
    );
    assert_eq!(
        h.sched.block_ledger().unwrap()[2],
        BlockStatus::Held(vec![Owner::Transfer {
            hold: t,
            holder: Holder::Caller,
            kind: HoldKind::Caller
        }])
    );
    // An aborted request exports nothing.
    let aborted = h.sched.abort("X").unwrap().finished.unwrap();
    assert_eq!(aborted.transfer, None);
    assert_eq!(h.sched.stats().n_blocks_used, 3);
    assert!(h.sched.release_transfer(t));
    h.check();
    assert_eq!(h.sched.stats().n_blocks_used, 0);
}

/// A connector that tells every finished request's client `remote_engine_id = name`.
#[derive(Debug)]
struct Labeller(&'static str);

impl ferry_core::KvConnector for Labeller {
    fn name(&self) -> &str {
        self.0
    }
    fn request_finished(
        &mut self,
        _req: ferry_core::FinishedRequest<'_>,
    ) -> Option<ferry_core::KvTransferParams> {
        Some(ferry_core::KvTransferParams {
            remote_engine_id: Some(self.0.to_owned()),
            ..ferry_core::KvTransferParams::default()
        })
    }
    fn abort_transfers(&mut self) {}
    fn take_finished_transfers(&mut self, _: &mut Vec<ferry_core::TransferId>) {}
    fn has_pending_work(&self) -> bool {
        false
    }
    fn reset_cache(&mut self) {}
}

/// Two connectors that give one key different values: an error naming the key, in every
/// build (it was a `debug_assert`, so a release build sent the client the first value).
#[test]
fn two_connectors_giving_one_key_different_values_fail_the_request_naming_the_key() {
    let mut h = Harness::new(small_config());
    h.sched.add_connector(Box::new(Labeller("a")));
    h.sched.add_connector(Box::new(Labeller("b")));
    h.add("x", prompt(1, 8), SamplingParams::greedy(1));
    let s = h.step_outputs();
    let fin = s
        .outputs
        .iter()
        .find_map(|o| o.finished.clone())
        .expect("x finished");
    assert_eq!(fin.reason, FinishReason::Error);
    assert_eq!(
        fin.kv_transfer_params, None,
        "no parameters a reader could misuse"
    );
    let m = fin.message.unwrap_or_default();
    assert!(m.contains("remote_engine_id"), "names the key: {m}");
}
