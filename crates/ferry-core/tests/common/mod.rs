//! Test harness: a scheduler driven by a fake model, with invariants checked after every step
//! and a text log of what happened.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write;

use ferry_core::{
    FinishReason, ModelOutput, RequestOutput, SampledToken, SamplingParams, Scheduler,
    SchedulerConfig, StepPlan, TokenId, TransferId,
};

/// The fake model's token for a request: a function of its id and output index, so runs are
/// reproducible and independent of batching.
pub fn fake_token(id: &str, output_idx: u32, vocab: u32) -> TokenId {
    let seed = id
        .bytes()
        .fold(17u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    seed.wrapping_add(output_idx.wrapping_mul(7)) % vocab + 1
}

/// `n` prompt tokens unique to `seed`.
pub fn prompt(seed: u32, n: usize) -> Vec<TokenId> {
    (0..n as u32).map(|p| seed * 10_000 + p).collect()
}

#[derive(Debug)]
pub struct Harness {
    pub sched: Scheduler,
    pub vocab: u32,
    /// Every finished request with how it finished, and how many times (must be once).
    pub finished: BTreeMap<String, (FinishReason, usize)>,
    /// Generated tokens per request id.
    pub generated: BTreeMap<String, Vec<TokenId>>,
    /// Transfer holds that finished requests handed their KV to.
    pub exports: Vec<TransferId>,
}

impl Harness {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            sched: Scheduler::new(config).expect("valid test config"),
            vocab: 32_000,
            finished: BTreeMap::new(),
            generated: BTreeMap::new(),
            exports: Vec::new(),
        }
    }

    pub fn add(&mut self, id: &str, prompt: Vec<TokenId>, params: SamplingParams) {
        self.sched
            .add_request(id, prompt, params)
            .expect("valid test request");
    }

    /// One step: schedule, fake model, feed back, check invariants. Returns the plan.
    pub fn step(&mut self) -> StepPlan {
        let plan = self.sched.schedule();
        self.check();
        let output = self.run_model(&plan);
        let outs = self
            .sched
            .on_step_output(&plan, &output)
            .expect("output matches plan");
        self.record(&outs);
        self.check();
        plan
    }

    /// Like `step`, rendering the plan and what finished as text.
    pub fn step_text(&mut self) -> String {
        let plan = self.sched.schedule();
        self.check();
        let mut text = self.sched.render_plan(&plan);
        let output = self.run_model(&plan);
        let outs = self
            .sched
            .on_step_output(&plan, &output)
            .expect("output matches plan");
        for o in &outs {
            if let Some(f) = &o.finished {
                let _ = writeln!(text, "  {} finished: {}", f.request_id, f.reason.as_str());
            }
        }
        self.record(&outs);
        self.check();
        text
    }

    pub fn steps_text(&mut self, n: usize) -> String {
        (0..n)
            .map(|i| format!("step {i}\n{}", self.step_text()))
            .collect()
    }

    pub fn run_model(&self, plan: &StepPlan) -> ModelOutput {
        let mut out = ModelOutput::default();
        for r in &plan.reqs {
            let Some(spec) = r.sample else { continue };
            let id = &self
                .sched
                .request(r.req)
                .expect("planned request is live")
                .id;
            out.sampled.push(SampledToken {
                req: r.req,
                token: fake_token(id, spec.output_idx, self.vocab),
                logprob: -0.5,
                top_logprobs: Vec::new(),
            });
        }
        out
    }

    pub fn record(&mut self, outs: &[RequestOutput]) {
        for o in outs {
            if let Some(s) = &o.sampled {
                let id = self
                    .sched
                    .request(o.req)
                    .map(|r| r.id.clone())
                    .or_else(|| o.finished.as_ref().map(|f| f.request_id.clone()))
                    .expect("output names a request");
                self.generated.entry(id).or_default().push(s.token);
            }
            if let Some(f) = &o.finished {
                self.exports.extend(f.transfer);
                let e = self
                    .finished
                    .entry(f.request_id.clone())
                    .or_insert((f.reason, 0));
                e.1 += 1;
            }
        }
    }

    pub fn check(&self) {
        if let Err(e) = self.sched.check_ownership() {
            panic!("ownership: {e}");
        }
        if let Err(e) = self.sched.check_queues() {
            panic!("queues: {e}");
        }
    }

    /// Steps until nothing is live; panics after `max_steps`.
    pub fn drain(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if self.sched.n_live() == 0 {
                return;
            }
            self.step();
        }
        panic!(
            "not drained after {max_steps} steps: {:?}",
            self.sched.stats()
        );
    }
}

/// A small config for trace tests: block size 16, 64 blocks, budget 128 tokens.
pub fn small_config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 16,
        n_blocks: 64,
        max_num_seqs: 4,
        max_num_batched_tokens: 128,
        max_model_len: 1024,
        eos_token_ids: vec![2],
        ..SchedulerConfig::default()
    }
}
