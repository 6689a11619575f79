//! The step driver: one engine step (`schedule` → model → `on_step_output`) written once, for
//! everything that runs the core without the engine thread: tests, `ferry bench scheduler`,
//! and the simulation.
//!
//! The model is anything implementing [`StepModel`]: a fake in the core's tests, an executor
//! with its KV arena in `ferry-model` (`ExecutorModel`). The driver stays sans-IO: no clock,
//! no thread; a caller that wants timings measures around [`StepDriver::step`] (and inside its
//! model). With checks on, block ownership and the queues are verified after `schedule()` (so
//! a broken plan never reaches the model) and after `on_step_output()`.

use crate::connector::StepWork;
use crate::ownership::OwnershipError;
use crate::plan::{ModelOutput, StepPlan};
use crate::scheduler::{OutputError, QueueError, RequestOutput, Scheduler};

/// Whatever computes a plan: an executor, or a stand-in for one.
pub trait StepModel {
    type Error;

    /// Computes `plan` and samples a token for each of its requests whose `sample` is set, in
    /// plan order. `core` is read-only (a fake model may look up request ids).
    fn compute(&mut self, core: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, Self::Error>;

    /// Runs connector work: a stand-in for the connectors' workers. Called with the plan's
    /// work (`StepPlan::connector_work`) before `compute`, also when the plan computes
    /// nothing (a connector-only step), and with the work the step's finishes produced (P's
    /// exports) after the output was fed back. Default: none to run.
    fn run_connector_work(&mut self, work: &[StepWork]) {
        let _ = work;
    }

    /// Takes an output back once the core has read it, so the next `compute` can reuse its
    /// buffers (optional, like `Scheduler::recycle_plan`).
    fn recycle_output(&mut self, output: ModelOutput) {
        drop(output);
    }
}

/// What one step did: the plan it ran and what it produced: first the outputs of requests
/// that finished between steps (`Scheduler::take_outputs`), then the step's, in plan order.
#[derive(Debug)]
pub struct Step {
    pub plan: StepPlan,
    pub outputs: Vec<RequestOutput>,
    /// Connector work the step's finishes produced, run after the output was fed back.
    pub after_work: Vec<StepWork>,
}

/// A step that failed; the core is left as the failing call left it.
#[derive(Debug, thiserror::Error)]
pub enum StepError<E> {
    #[error("model: {0}")]
    Model(E),
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error("ownership: {0}")]
    Ownership(#[from] OwnershipError),
    #[error("queues: {0}")]
    Queues(#[from] QueueError),
    #[error("{n_live} requests still live after {max_steps} steps")]
    NotDrained { max_steps: usize, n_live: usize },
    #[error("the plan breaks a limit: {0}")]
    Limits(String),
}

/// A plan keeps the configured limits: at most `max_num_batched_tokens` tokens and
/// `max_num_seqs` requests, and every planned request computes at least one token.
fn check_limits(sched: &Scheduler, plan: &StepPlan) -> Result<(), String> {
    let config = sched.config();
    if plan.num_tokens() > config.max_num_batched_tokens {
        return Err(format!(
            "{} tokens, the budget is {}",
            plan.num_tokens(),
            config.max_num_batched_tokens
        ));
    }
    if plan.reqs.len() > config.max_num_seqs {
        return Err(format!(
            "{} requests, max_num_seqs is {}",
            plan.reqs.len(),
            config.max_num_seqs
        ));
    }
    match plan.reqs.iter().find(|r| r.tokens.is_empty()) {
        Some(r) => Err(format!("request {:?} computes no token", r.req)),
        None => Ok(()),
    }
}

/// The core and a model, stepped together.
///
/// Both fields are public: between steps, callers add and abort requests and make lifecycle
/// calls on the core directly, as the engine thread does between its steps.
#[derive(Debug)]
pub struct StepDriver<M> {
    pub sched: Scheduler,
    pub model: M,
    check: bool,
}

impl<M: StepModel> StepDriver<M> {
    /// A driver without checks.
    pub fn new(sched: Scheduler, model: M) -> Self {
        Self {
            sched,
            model,
            check: false,
        }
    }

    /// Verifies block ownership and the queues after `schedule()` and after
    /// `on_step_output()` in every step (slow; for tests and `--check` runs).
    pub fn checked(mut self) -> Self {
        self.check = true;
        self
    }

    /// One step: schedule, compute, feed the output back.
    pub fn step(&mut self) -> Result<Step, StepError<M::Error>> {
        self.step_with(|_, _| {})
    }

    /// Like [`step`](Self::step), calling `before_compute` with the plan while the core still
    /// shows the state it was planned from (every planned request still live), e.g. to render it.
    pub fn step_with(
        &mut self,
        before_compute: impl FnOnce(&Scheduler, &StepPlan),
    ) -> Result<Step, StepError<M::Error>> {
        let plan = self.sched.schedule();
        if self.check {
            self.check()?;
            check_limits(&self.sched, &plan).map_err(StepError::Limits)?;
        }
        before_compute(&self.sched, &plan);
        if !plan.connector_work.is_empty() {
            self.model.run_connector_work(&plan.connector_work);
        }
        let output = self
            .model
            .compute(&self.sched, &plan)
            .map_err(StepError::Model)?;
        let step_outputs = self.sched.on_step_output(&plan, &output);
        self.model.recycle_output(output);
        let mut outputs = self.sched.take_outputs();
        outputs.extend(step_outputs?);
        let mut after_work = Vec::new();
        self.sched.take_connector_work(&mut after_work);
        if !after_work.is_empty() {
            self.model.run_connector_work(&after_work);
        }
        if self.check {
            self.check()?;
        }
        Ok(Step {
            plan,
            outputs,
            after_work,
        })
    }

    /// Hands a step's plan back to the core for reuse (optional).
    pub fn recycle(&mut self, step: Step) {
        self.sched.recycle_plan(step.plan);
    }

    /// Steps until no request is live, calling `on_step` after each step; fails if requests
    /// are still live after `max_steps` steps. Returns the number of steps taken.
    pub fn drain(
        &mut self,
        max_steps: usize,
        mut on_step: impl FnMut(&Scheduler, &Step),
    ) -> Result<usize, StepError<M::Error>> {
        for n_steps in 0..max_steps {
            if self.sched.n_live() == 0 && !self.sched.needs_idle_steps() {
                return Ok(n_steps);
            }
            let step = self.step()?;
            on_step(&self.sched, &step);
            self.recycle(step);
        }
        match self.sched.n_live() {
            0 => Ok(max_steps),
            n_live => Err(StepError::NotDrained { max_steps, n_live }),
        }
    }

    /// Block ownership, then the queues.
    pub fn check(&self) -> Result<(), StepError<M::Error>> {
        self.sched.check_ownership()?;
        self.sched.check_queues()?;
        Ok(())
    }
}
