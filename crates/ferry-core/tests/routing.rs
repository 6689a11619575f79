//! Expert routing ("rollout routing replay"): with a routing shape set, every request
//! accumulates one row per position, read back from the blocks it took as prefix-cache hits
//! and computed for the rest, and finishes with exactly the rows of the tokens it had as
//! inputs. The fake model here stores each token's routing beside its KV slot, as an MoE
//! executor does, and computes it as a function of (token, position), so every row a finish
//! carries is checked exactly: through prefix hits (partial and block-aligned, and a hit
//! taken in the same step another request computes the blocks), preemptions, aborts, cache
//! resets and random mixes of them.

mod common;

use std::collections::BTreeMap;

use common::{fake_token, prompt};
use ferry_core::{
    ExpertRouting, FinishReason, ModelOutput, OutputError, RequestOutput, RoutedExperts,
    RoutingRead, RoutingShape, SampledToken, SamplingParams, Scheduler, SchedulerConfig, Step,
    StepDriver, StepModel, StepPlan, TokenId,
};

const SHAPE: RoutingShape = RoutingShape {
    layers: 3,
    top_k: 2,
    num_experts: 40,
};

/// The routing of `token` at `pos`: one row, layer-major then rank.
fn expected_row(token: TokenId, pos: usize) -> Vec<u16> {
    (0..SHAPE.layers)
        .flat_map(|l| {
            (0..SHAPE.top_k).map(move |k| {
                ((token.0 as usize * 7 + pos * 13 + l * 5 + k * 3) % SHAPE.num_experts) as u16
            })
        })
        .collect()
}

/// The routing of the first `n` positions of `tokens`.
fn expected(tokens: &[TokenId], n: usize) -> Vec<u16> {
    tokens[..n]
        .iter()
        .enumerate()
        .flat_map(|(p, &t)| expected_row(t, p))
        .collect()
}

/// A model that samples [`fake_token`]s and routes like an MoE executor: each computed
/// token's row is stored beside its KV slot (every request of the plan first, as KV is
/// written), then each request reports the rows the plan asks it to read back, read from
/// those slots, followed by its computed rows. Reading a slot no forward wrote fails the
/// step.
#[derive(Debug, Default)]
struct RoutingModel {
    slots: BTreeMap<usize, Vec<u16>>,
    /// Positions read back, and those read in the step that computes them.
    n_read: usize,
    n_same_step_reads: usize,
}

impl StepModel for RoutingModel {
    type Error = String;

    fn compute(&mut self, sched: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, String> {
        let mut out = ModelOutput::default();
        let mut written = std::collections::BTreeSet::new();
        for r in &plan.reqs {
            for (i, &token) in plan.tokens_of(r).iter().enumerate() {
                let slot = plan.slot_of(r, r.start_pos + i);
                self.slots
                    .insert(slot, expected_row(token, r.start_pos + i));
                written.insert(slot);
            }
        }
        for (i, r) in plan.reqs.iter().enumerate() {
            let read = plan.routing_reads.iter().find(|read| read.req_pos == i);
            let first = read.map_or(r.start_pos, |read| read.from);
            if let Some(read) = read {
                self.n_read += r.start_pos - read.from;
            }
            let mut ids = Vec::new();
            for pos in first..r.start_pos + r.tokens.len() {
                let slot = plan.slot_of(r, pos);
                if pos < r.start_pos && written.contains(&slot) {
                    self.n_same_step_reads += 1;
                }
                let row = self
                    .slots
                    .get(&slot)
                    .ok_or_else(|| format!("step {}: position {pos} has no routing", plan.step))?;
                ids.extend_from_slice(row);
            }
            out.routed.push(RoutedExperts {
                req: r.req,
                first_pos: first,
                ids,
            });
            if let Some(spec) = r.sample {
                let id = &sched.request(r.req).expect("planned request is live").id;
                out.sampled.push(SampledToken {
                    req: r.req,
                    token: fake_token(id, spec.output_idx, 50),
                    logprob: -0.5,
                    top_logprobs: Vec::new(),
                });
            }
        }
        Ok(out)
    }
}

/// The driver with checks on, and each request's tokens and finish as they come.
struct Run {
    driver: StepDriver<RoutingModel>,
    tokens: BTreeMap<String, Vec<TokenId>>,
    finished: BTreeMap<String, (FinishReason, ExpertRouting)>,
}

impl Run {
    fn new(config: SchedulerConfig) -> Self {
        let mut sched = Scheduler::new(config).unwrap();
        sched.set_routing_shape(Some(SHAPE)).unwrap();
        Self {
            driver: StepDriver::new(sched, RoutingModel::default()).checked(),
            tokens: BTreeMap::new(),
            finished: BTreeMap::new(),
        }
    }

    fn add(&mut self, id: &str, prompt: Vec<TokenId>, max_tokens: u32) -> bool {
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        };
        let added = self
            .driver
            .sched
            .add_request(id, prompt.clone(), params)
            .is_ok();
        if added {
            self.tokens.insert(id.to_owned(), prompt);
        }
        added
    }

    fn step(&mut self) -> Step<String> {
        let step = self.driver.step().unwrap_or_else(|e| panic!("step: {e}"));
        self.record(&step.outputs);
        step
    }

    fn record(&mut self, outs: &[RequestOutput]) {
        for o in outs {
            let id = self
                .driver
                .sched
                .request(o.req)
                .map(|r| r.id.clone())
                .or_else(|| o.finished.as_ref().map(|f| f.request_id.clone()))
                .unwrap();
            if let Some(s) = &o.sampled {
                self.tokens.get_mut(&id).unwrap().push(s.token);
            }
            if let Some(f) = &o.finished {
                let routing = f.routing.clone().expect("a finish carries routing");
                assert!(self.finished.insert(id, (f.reason, routing)).is_none());
            }
        }
    }

    fn drain(&mut self) {
        for _ in 0..500 {
            if self.driver.sched.n_live() == 0 {
                return;
            }
            self.step();
        }
        panic!("not drained: {:?}", self.driver.sched.stats());
    }

    /// Every finished request's routing: one row per input token, each the model's.
    fn check_finishes(&self) {
        for (id, (reason, routing)) in &self.finished {
            let tokens = &self.tokens[id];
            assert_eq!(routing.shape, SHAPE);
            if *reason == FinishReason::Abort {
                // Whatever it had when aborted, each row right.
                let n = routing.rows();
                assert!(
                    n < tokens.len(),
                    "{id}: {n} rows of {} tokens",
                    tokens.len()
                );
                assert_eq!(routing.ids, expected(tokens, n), "{id}");
            } else {
                assert_eq!(routing.rows(), tokens.len() - 1, "{id}");
                assert_eq!(routing.ids, expected(tokens, tokens.len() - 1), "{id}");
            }
        }
    }
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        n_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        ..SchedulerConfig::default()
    }
}

#[test]
fn a_prefix_hit_reads_back_the_routing_of_its_blocks_partial_or_block_aligned() {
    for (prompt_len, n_hit) in [(10, 8), (12, 8), (13, 12)] {
        let mut run = Run::new(config());
        assert!(run.add("a", prompt(1, prompt_len), 3));
        run.drain();
        assert!(run.add("b", prompt(1, prompt_len), 3));
        let step = run.step();
        assert_eq!(step.plan.reqs[0].start_pos, n_hit, "prompt {prompt_len}");
        assert_eq!(
            step.plan.routing_reads,
            [RoutingRead {
                req_pos: 0,
                from: 0
            }]
        );
        run.drain();
        assert_eq!(run.driver.model.n_read, n_hit);
        run.check_finishes();
        let (a, b) = (&run.finished["a"].1, &run.finished["b"].1);
        assert_eq!(b.rows(), prompt_len + 2);
        let n = prompt_len * SHAPE.width();
        assert_eq!(b.ids[..n], a.ids[..n], "the same prompt, the same routing");
    }
}

#[test]
fn requests_without_a_hit_read_nothing_back() {
    let mut run = Run::new(config());
    assert!(run.add("a", prompt(1, 9), 4));
    assert!(run.add("b", prompt(2, 9), 4));
    while run.driver.sched.n_live() > 0 {
        assert!(run.step().plan.routing_reads.is_empty());
    }
    assert_eq!(run.driver.model.n_read, 0);
    run.check_finishes();
}

/// The choices of an `n` > 1 request are requests with one prompt, queued together: the
/// later ones take the first one's blocks as hits in the step it computes them, and read
/// their routing back after it stored it.
#[test]
fn choices_queued_together_read_the_first_ones_prompt_routing_in_the_same_step() {
    let mut run = Run::new(config());
    for id in ["c0", "c1", "c2"] {
        assert!(run.add(id, prompt(3, 14), 5));
    }
    let step = run.step();
    let starts: Vec<usize> = step.plan.reqs.iter().map(|r| r.start_pos).collect();
    assert_eq!(starts, [0, 12, 12]);
    assert_eq!(
        step.plan.routing_reads,
        [
            RoutingRead {
                req_pos: 1,
                from: 0
            },
            RoutingRead {
                req_pos: 2,
                from: 0
            }
        ]
    );
    run.drain();
    assert_eq!(run.driver.model.n_same_step_reads, 24);
    run.check_finishes();
    for id in ["c0", "c1", "c2"] {
        assert_eq!(run.finished[id].1.rows(), 18);
    }
}

/// A preempted request keeps its rows; its readmission hits its own cached blocks (no read:
/// it has their rows) and recomputes the rest over its old rows.
#[test]
fn a_preempted_request_keeps_its_rows_and_recomputes_over_them() {
    let mut run = Run::new(config());
    assert!(run.add("a", prompt(4, 10), 8));
    for _ in 0..4 {
        run.step();
    }
    let sched = &run.driver.sched;
    let rows = |sched: &Scheduler| {
        let a = sched.request(sched.request_idx("a").unwrap()).unwrap();
        a.routing().len() / SHAPE.width()
    };
    assert_eq!(rows(sched), 13, "the prompt's 10 and 3 decodes");
    assert_eq!(run.driver.sched.preempt_all_running(), 1);
    assert_eq!(rows(&run.driver.sched), 13);
    let step = run.step();
    assert_eq!(step.plan.reqs[0].start_pos, 12, "its full blocks are hits");
    assert!(step.plan.routing_reads.is_empty());
    run.drain();
    assert_eq!(run.driver.model.n_read, 0);
    run.check_finishes();
}

#[test]
fn an_abort_takes_the_rows_computed_so_far() {
    let mut run = Run::new(SchedulerConfig {
        max_num_batched_tokens: 8,
        ..config()
    });
    assert!(run.add("a", prompt(6, 20), 5));
    run.step();
    run.step();
    let out = run.driver.sched.abort("a").unwrap();
    run.record(&[out]);
    let (reason, routing) = &run.finished["a"];
    assert_eq!(*reason, FinishReason::Abort);
    assert_eq!(routing.rows(), 16);
    run.check_finishes();
}

#[test]
fn routing_that_does_not_answer_the_plan_is_refused() {
    let mut sched = Scheduler::new(config()).unwrap();
    sched.set_routing_shape(Some(SHAPE)).unwrap();
    sched
        .add_request("a", prompt(1, 5), SamplingParams::greedy(2))
        .unwrap();
    let plan = sched.schedule();
    let sampled = vec![SampledToken {
        req: plan.reqs[0].req,
        token: TokenId(1),
        logprob: 0.0,
        top_logprobs: Vec::new(),
    }];
    let feed = |routed: Vec<RoutedExperts>| {
        let mut s = Scheduler::new(config()).unwrap();
        s.set_routing_shape(Some(SHAPE)).unwrap();
        s.add_request("a", prompt(1, 5), SamplingParams::greedy(2))
            .unwrap();
        let plan = s.schedule();
        s.on_step_output(
            &plan,
            &ModelOutput {
                sampled: sampled.clone(),
                routed,
                ..ModelOutput::default()
            },
        )
    };
    let req = plan.reqs[0].req;
    let good = expected(&prompt(1, 5), 5);
    assert!(feed(vec![RoutedExperts {
        req,
        first_pos: 0,
        ids: good.clone()
    }])
    .is_ok());
    assert_eq!(
        feed(Vec::new()).unwrap_err(),
        OutputError::RoutingCount {
            expected: 1,
            got: 0
        }
    );
    assert!(matches!(
        feed(vec![RoutedExperts {
            req,
            first_pos: 0,
            ids: good[..good.len() - 1].to_vec()
        }])
        .unwrap_err(),
        OutputError::RoutingRange { .. }
    ));
    let mut bad = good.clone();
    bad[3] = 40;
    assert_eq!(
        feed(vec![RoutedExperts {
            req,
            first_pos: 0,
            ids: bad
        }])
        .unwrap_err(),
        OutputError::RoutingExpert {
            req,
            id: 40,
            num_experts: 40
        }
    );
    // Without a shape, a request finishes without routing.
    let mut plain = Scheduler::new(config()).unwrap();
    plain
        .add_request("a", prompt(1, 5), SamplingParams::greedy(1))
        .unwrap();
    let plan = plain.schedule();
    let outs = plain
        .on_step_output(
            &plan,
            &ModelOutput {
                sampled,
                ..ModelOutput::default()
            },
        )
        .unwrap();
    assert_eq!(outs[0].finished.as_ref().unwrap().routing, None);
}

#[test]
fn a_shape_with_nothing_to_route_is_refused() {
    let mut sched = Scheduler::new(config()).unwrap();
    for bad in [
        RoutingShape { layers: 0, ..SHAPE },
        RoutingShape { top_k: 0, ..SHAPE },
        RoutingShape {
            num_experts: 70_000,
            ..SHAPE
        },
    ] {
        assert!(sched.set_routing_shape(Some(bad)).is_err());
    }
}

/// A small xorshift generator: the seeds below replay exactly.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Random mixes of requests sharing prefixes (some queued together, as choices are), steps,
/// aborts, preemptions and cache resets, in a pool small enough to preempt: every finish's
/// routing is the model's, row for row. Over the seeds, every way a row can come about
/// happens.
#[test]
fn random_runs_finish_every_request_with_the_routing_of_its_tokens() {
    let mut seen = (0, 0, 0);
    for seed in 1..=200u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut run = Run::new(SchedulerConfig {
            block_size: 4,
            n_blocks: 14,
            max_num_seqs: 4,
            max_num_batched_tokens: 12,
            max_model_len: 40,
            ..SchedulerConfig::default()
        });
        let mut n_added = 0;
        for _ in 0..60 {
            match rng.below(10) {
                0..=2 => {
                    let base = rng.below(3) as u32;
                    let shared = rng.below(20);
                    let len = 1 + rng.below(24);
                    let copies = 1 + rng.below(3);
                    let max_tokens = 1 + rng.below(8) as u32;
                    let mut p = prompt(base, len);
                    for (i, t) in p.iter_mut().enumerate().skip(shared) {
                        *t = TokenId(90_000 + (n_added * 40 + i) as u32);
                    }
                    for _ in 0..copies {
                        run.add(&format!("r{n_added}"), p.clone(), max_tokens);
                        n_added += 1;
                    }
                }
                3 => {
                    let id = format!("r{}", rng.below(n_added.max(1)));
                    if let Some(out) = run.driver.sched.abort(&id) {
                        run.record(&[out]);
                    }
                }
                4 => {
                    run.driver.sched.preempt_all_running();
                    seen.0 += 1;
                }
                5 => {
                    run.driver.sched.reset_caches(true, false);
                }
                _ => {
                    run.step();
                }
            }
        }
        run.drain();
        run.check_finishes();
        let m = &run.driver.model;
        seen.1 += m.n_read;
        seen.2 += m.n_same_step_reads;
        assert_eq!(run.finished.len(), run.tokens.len());
    }
    let (n_preempt, n_read, n_same_step) = seen;
    assert!(
        n_preempt > 0 && n_read > 0 && n_same_step > 0,
        "not every case came up: {seen:?}"
    );
}
