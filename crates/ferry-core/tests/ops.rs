//! Property test: random sequences of add / step / abort / preempt-all / reset / pause /
//! weight update / transfer hold and release. After every operation every block is accounted
//! for and every request sits in the right queue; at the end, after resuming, releasing the
//! transfers and draining, every request finished exactly once and every block is free.

mod common;

use std::collections::BTreeMap;

use common::Harness;
use ferry_core::{Holder, OpId, PauseMode, SamplingParams, SchedulerConfig, TokenId, TransferId};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        base: u8,
        shared: usize,
        len: usize,
        max_tokens: u32,
        ignore_eos: bool,
        salted: bool,
    },
    Step,
    Abort(usize),
    PreemptAll,
    Reset,
    /// A pause with this mode (`wait` or `keep`; no cache clearing), or a resume.
    Pause(Option<PauseMode>),
    WeightVersion(u8),
    Hold(usize),
    HoldOnFinish(usize),
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let pause = prop_oneof![
        Just(None),
        Just(Some(PauseMode::Wait)),
        Just(Some(PauseMode::Keep)),
    ];
    prop_oneof![
        4 => (0u8..3, 0usize..24, 1usize..40, 1u32..12, any::<bool>(), any::<bool>()).prop_map(
            |(base, shared, len, max_tokens, ignore_eos, salted)| Op::Add {
                base, shared, len, max_tokens, ignore_eos, salted,
            }
        ),
        8 => Just(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => Just(Op::PreemptAll),
        1 => Just(Op::Reset),
        1 => pause.prop_map(Op::Pause),
        1 => (0u8..2).prop_map(Op::WeightVersion),
        1 => (0usize..64).prop_map(Op::Hold),
        1 => (0usize..64).prop_map(Op::HoldOnFinish),
        1 => (0usize..64).prop_map(Op::Release),
    ]
}

fn config(chunked: bool) -> SchedulerConfig {
    SchedulerConfig {
        enable_chunked_prefill: chunked,
        block_size: 4,
        n_blocks: 24,
        max_num_seqs: 4,
        max_num_batched_tokens: 24,
        max_model_len: 48,
        eos_token_ids: vec![TokenId(3)],
        ..SchedulerConfig::default()
    }
}

/// A prompt whose first `shared` tokens come from one of a few bases, so prefixes repeat.
fn make_prompt(base: u8, shared: usize, len: usize, n: usize) -> Vec<TokenId> {
    (0..len)
        .map(|p| {
            TokenId(if p < shared {
                u32::from(base) * 100 + p as u32
            } else {
                1000 + (n * 50 + p) as u32
            })
        })
        .collect()
}

struct Run {
    h: Harness,
    added: Vec<String>,
    transfers: Vec<TransferId>,
    /// Op ids of pauses issued (their completions are not looked at here).
    n_pauses: u64,
}

impl Run {
    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add {
                base,
                shared,
                len,
                max_tokens,
                ignore_eos,
                salted,
            } => {
                let id = format!("r{}", self.added.len());
                let params = SamplingParams {
                    max_tokens,
                    ignore_eos,
                    cache_salt: salted.then(|| "s".to_owned()),
                    ..SamplingParams::default()
                };
                let prompt = make_prompt(base, shared, len, self.added.len());
                if self
                    .h
                    .sched
                    .add_request(id.as_str(), prompt, params)
                    .is_ok()
                {
                    self.added.push(id);
                }
            }
            Op::Step => {
                self.h.step();
            }
            Op::Abort(k) => {
                if let Some(id) = self.added.get(k % self.added.len().max(1)) {
                    if let Some(out) = self.h.sched.abort(id) {
                        self.h.record(&[out]);
                    }
                }
            }
            Op::PreemptAll => {
                self.h.sched.preempt_all_running();
            }
            Op::Reset => {
                let held = self.h.sched.stats().n_blocks_used > 0;
                assert_eq!(self.h.sched.reset_prefix_cache(), !held);
                if !held {
                    assert_eq!(self.h.sched.stats().n_blocks_cached, 0);
                }
            }
            Op::Pause(Some(mode)) => {
                self.n_pauses += 1;
                let aborted = self.h.sched.pause(OpId(self.n_pauses), mode, false);
                assert!(aborted.is_empty());
            }
            Op::Pause(None) => self.h.sched.resume().unwrap(),
            Op::WeightVersion(v) => self.h.sched.set_weight_version(v.to_string()),
            Op::Hold(k) => {
                if let Some(id) = self.added.get(k % self.added.len().max(1)) {
                    if let Some(idx) = self.h.sched.request_idx(id) {
                        if let Ok(t) = self.h.sched.hold_blocks_for_transfer(idx, Holder::Caller) {
                            self.transfers.push(t);
                        }
                    }
                }
            }
            Op::HoldOnFinish(k) => {
                if let Some(id) = self.added.get(k % self.added.len().max(1)) {
                    if let Some(idx) = self.h.sched.request_idx(id) {
                        self.h.sched.hold_kv_on_finish(idx).unwrap();
                    }
                }
            }
            Op::Release(k) => {
                if !self.transfers.is_empty() {
                    let t = self.transfers.remove(k % self.transfers.len());
                    assert!(self.h.sched.release_transfer(t));
                }
            }
        }
        self.transfers.append(&mut self.h.exports);
        self.h.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_block_and_request_accounted_for(
        ops in proptest::collection::vec(op(), 1..80),
        chunked in any::<bool>(),
    ) {
        let mut run = Run {
            h: Harness::new(config(chunked)),
            added: Vec::new(),
            transfers: Vec::new(),
            n_pauses: 0,
        };
        run.h.model.vocab = 12; // small vocabulary: EOS (3) comes up often
        for op in &ops {
            run.apply(op);
        }
        run.h.sched.resume().unwrap();
        for t in std::mem::take(&mut run.transfers) {
            prop_assert!(run.h.sched.release_transfer(t));
        }
        run.h.check();
        // Drain; requests finishing now may hand their KV to exports, which a remote reader
        // would pull: release them as they appear.
        for _ in 0..2000 {
            if run.h.sched.n_live() == 0 {
                break;
            }
            run.h.step();
            for t in std::mem::take(&mut run.h.exports) {
                prop_assert!(run.h.sched.release_transfer(t));
            }
        }
        prop_assert_eq!(run.h.sched.n_live(), 0, "not drained: {:?}", run.h.sched.stats());
        run.h.check();
        let counts: BTreeMap<&str, usize> =
            run.h.finished.iter().map(|(id, (_, n))| (id.as_str(), *n)).collect();
        for id in &run.added {
            prop_assert_eq!(counts.get(id.as_str()).copied(), Some(1), "request {} finished", id);
        }
        prop_assert_eq!(counts.len(), run.added.len());
        let s = run.h.sched.stats();
        prop_assert_eq!((s.n_blocks_used, s.n_transfers, s.n_running, s.n_waiting), (0, 0, 0, 0));
        prop_assert!(run.h.sched.reset_prefix_cache());
    }
}
