//! Test harness: the step driver with a fake model, invariants checked in every step, and a
//! record and text log of what happened.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write;
use std::ops::{Deref, DerefMut};

use ferry_core::{
    FinishReason, ModelOutput, RequestOutput, SampledToken, SamplingParams, Scheduler,
    SchedulerConfig, Step, StepDriver, StepModel, StepPlan, TokenId, TransferId,
};

/// The fake model's token for a request: a function of its id and output index, so runs are
/// reproducible and independent of batching.
pub fn fake_token(id: &str, output_idx: u32, vocab: u32) -> TokenId {
    let seed = id
        .bytes()
        .fold(17u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    TokenId(seed.wrapping_add(output_idx.wrapping_mul(7)) % vocab + 1)
}

/// `n` prompt tokens unique to `seed`.
pub fn prompt(seed: u32, n: usize) -> Vec<TokenId> {
    (0..n as u32).map(|p| TokenId(seed * 10_000 + p)).collect()
}

/// The fake model: every sampled token is [`fake_token`] of the request's id.
#[derive(Debug)]
pub struct FakeModel {
    pub vocab: u32,
}

impl StepModel for FakeModel {
    type Error = Infallible;

    fn compute(&mut self, sched: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, Infallible> {
        let mut out = ModelOutput::default();
        for r in &plan.reqs {
            let Some(spec) = r.sample else { continue };
            let id = &sched.request(r.req).expect("planned request is live").id;
            out.sampled.push(SampledToken {
                req: r.req,
                token: fake_token(id, spec.output_idx, self.vocab),
                logprob: -0.5,
                top_logprobs: Vec::new(),
            });
        }
        Ok(out)
    }
}

/// The step driver with the fake model and checks on, plus a record of what every step
/// produced. Derefs to the driver, so tests reach the core as `h.sched` and the model as
/// `h.model`.
#[derive(Debug)]
pub struct Harness {
    pub driver: StepDriver<FakeModel>,
    /// Every finished request with how it finished, and how many times (must be once).
    pub finished: BTreeMap<String, (FinishReason, usize)>,
    /// Generated tokens per request id.
    pub generated: BTreeMap<String, Vec<TokenId>>,
    /// Transfer holds that finished requests handed their KV to.
    pub exports: Vec<TransferId>,
    /// The message of every finish that carried one (an `error` finish says why).
    pub messages: BTreeMap<String, String>,
}

impl Deref for Harness {
    type Target = StepDriver<FakeModel>;
    fn deref(&self) -> &Self::Target {
        &self.driver
    }
}

impl DerefMut for Harness {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.driver
    }
}

impl Harness {
    pub fn new(config: SchedulerConfig) -> Self {
        let sched = Scheduler::new(config).expect("valid test config");
        Self {
            driver: StepDriver::new(sched, FakeModel { vocab: 32_000 }).checked(),
            finished: BTreeMap::new(),
            generated: BTreeMap::new(),
            exports: Vec::new(),
            messages: BTreeMap::new(),
        }
    }

    pub fn add(&mut self, id: &str, prompt: Vec<TokenId>, params: SamplingParams) {
        self.sched
            .add_request(id, prompt, params)
            .expect("valid test request");
    }

    /// One step (invariants checked after scheduling and after the output), recorded.
    /// Returns the plan.
    pub fn step(&mut self) -> StepPlan {
        self.step_outputs().plan
    }

    /// Like `step`, returning the step's outputs too.
    pub fn step_outputs(&mut self) -> Step {
        let step = self.driver.step().unwrap_or_else(|e| panic!("step: {e}"));
        self.record(&step.outputs);
        step
    }

    /// Like `step`, rendering the plan and what finished as text.
    pub fn step_text(&mut self) -> String {
        let mut text = String::new();
        let step = self
            .driver
            .step_with(|sched, plan| text = sched.render_plan(plan))
            .unwrap_or_else(|e| panic!("step: {e}"));
        for o in &step.outputs {
            if let Some(f) = &o.finished {
                let _ = writeln!(text, "  {} finished: {}", f.request_id, f.reason.as_str());
            }
        }
        self.record(&step.outputs);
        text
    }

    pub fn steps_text(&mut self, n: usize) -> String {
        (0..n)
            .map(|i| format!("step {i}\n{}", self.step_text()))
            .collect()
    }

    /// The fake model's output for `plan`, for tests that feed it back by hand.
    pub fn run_model(&mut self, plan: &StepPlan) -> ModelOutput {
        let Ok(out) = self.driver.model.compute(&self.driver.sched, plan);
        out
    }

    pub fn record(&mut self, outs: &[RequestOutput]) {
        let (driver, mut recorder) = self.split();
        recorder.add(&driver.sched, outs);
    }

    /// The driver and the record, borrowed apart, so `drain`'s callback can record while the
    /// driver steps.
    fn split(&mut self) -> (&mut StepDriver<FakeModel>, Recorder<'_>) {
        let Self {
            driver,
            finished,
            generated,
            exports,
            messages,
        } = self;
        let recorder = Recorder {
            finished,
            generated,
            exports,
            messages,
        };
        (driver, recorder)
    }

    pub fn check(&self) {
        if let Err(e) = self.driver.check() {
            panic!("{e}");
        }
    }

    /// Steps until nothing is live; panics after `max_steps`.
    pub fn drain(&mut self, max_steps: usize) {
        let (driver, mut recorder) = self.split();
        let drained = driver.drain(max_steps, |sched, step| recorder.add(sched, &step.outputs));
        if let Err(e) = drained {
            panic!("{e}: {:?}", self.sched.stats());
        }
    }
}

/// A harness's record, borrowed.
struct Recorder<'a> {
    finished: &'a mut BTreeMap<String, (FinishReason, usize)>,
    generated: &'a mut BTreeMap<String, Vec<TokenId>>,
    exports: &'a mut Vec<TransferId>,
    messages: &'a mut BTreeMap<String, String>,
}

impl Recorder<'_> {
    fn add(&mut self, sched: &Scheduler, outs: &[RequestOutput]) {
        for o in outs {
            if let Some(s) = &o.sampled {
                let id = sched
                    .request(o.req)
                    .map(|r| r.id.clone())
                    .or_else(|| o.finished.as_ref().map(|f| f.request_id.clone()))
                    .expect("output names a request");
                self.generated.entry(id).or_default().push(s.token);
            }
            if let Some(f) = &o.finished {
                self.exports.extend(f.transfer);
                if let Some(m) = &f.message {
                    self.messages.insert(f.request_id.clone(), m.clone());
                }
                let e = self
                    .finished
                    .entry(f.request_id.clone())
                    .or_insert((f.reason, 0));
                e.1 += 1;
            }
        }
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
        eos_token_ids: vec![TokenId(2)],
        ..SchedulerConfig::default()
    }
}
