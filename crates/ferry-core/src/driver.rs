//! The step driver: one engine step written once, for everything that steps the core: the
//! engine (`ferry_engine::EngineCore`, which the engine thread, the simulation and the engine's
//! tests drive), the core's own tests and `ferry bench scheduler`.
//!
//! One step is `schedule` → the caller's `before_compute` (masks, admissions) → the requests
//! the schedule finished (a failed KV load) → the connectors' work before the forward → the
//! model → `on_step_output` → the connector work the output produced (P's exports) after it.
//! A plan with nothing at all in it stops after the schedule ([`StepKind::Idle`]); a plan
//! with connector work and no tokens runs the workers and not the model
//! ([`StepKind::ConnectorOnly`]). A failed model call (or an output that does not answer the
//! plan) is recovered from here, the same way for every caller: the blocks the plan was to
//! write leave the prefix cache and every running request is preempted (its KV recomputed
//! later); the failure is reported in [`Step::failure`].
//!
//! The model is anything implementing [`StepModel`]: a fake in the core's tests, an executor
//! with its KV arena and the connectors' workers in the engine. The driver stays sans-IO: no
//! clock, no thread; a caller that wants timings measures around [`StepDriver::step`] (and
//! inside its model). With checks on, block ownership and the queues are verified after
//! `schedule()` (so a broken plan never reaches the model) and at the end of the step.

use crate::connector::StepWork;
use crate::ownership::OwnershipError;
use crate::plan::{ModelOutput, StepPlan};
use crate::scheduler::{OutputError, QueueError, RequestOutput, Scheduler};

/// When connector work runs relative to the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkPhase {
    /// The plan's work (`StepPlan::connector_work`): before the forward, also in a step that
    /// computes nothing.
    BeforeForward,
    /// The work the step's output produced (P's exports of requests that just finished),
    /// after the output was fed back and before any output reaches a client.
    AfterOutput,
}

/// Whatever computes a plan: an executor, or a stand-in for one.
pub trait StepModel {
    type Error;

    /// Computes `plan` and samples a token for each of its requests whose `sample` is set, in
    /// plan order. `core` is read-only (a fake model may look up request ids). Never called
    /// with a plan that schedules no request.
    fn compute(&mut self, core: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, Self::Error>;

    /// Runs connector work: the connectors' workers, or a stand-in for them. Default: none
    /// to run.
    fn run_connector_work(&mut self, work: &[StepWork], phase: WorkPhase) {
        let _ = (work, phase);
    }

    /// Takes an output back once the core has read it, so the next `compute` can reuse its
    /// buffers (optional, like `Scheduler::recycle_plan`).
    fn recycle_output(&mut self, output: ModelOutput) {
        drop(output);
    }
}

/// What a step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Nothing to do: no request and no connector work (e.g. everything paused).
    Idle,
    /// Connector work only: the workers ran, the model did not.
    ConnectorOnly,
    /// The model ran (successfully or not: see [`Step::failure`]).
    Forward,
}

/// Why a step's forward produced no outputs; the driver already recovered (see the module
/// docs).
#[derive(Debug, thiserror::Error)]
pub enum StepFailure<E> {
    #[error("model: {0}")]
    Model(E),
    #[error("the model's output does not answer the plan: {0}")]
    Output(#[from] OutputError),
}

/// What one step did: the plan it ran and what it produced: first the outputs of requests
/// that finished between steps (`Scheduler::take_outputs`), then the step's, in plan order.
#[derive(Debug)]
pub struct Step<E = std::convert::Infallible> {
    pub plan: StepPlan,
    pub kind: StepKind,
    pub outputs: Vec<RequestOutput>,
    /// The first `n_between` of `outputs` are of requests the schedule finished (between
    /// steps: a failed KV load); the rest are the step's own.
    pub n_between: usize,
    /// Connector work the step's output produced, run after the output was fed back.
    pub after_work: Vec<StepWork>,
    /// The forward failed: every running request was preempted.
    pub failure: Option<StepFailure<E>>,
}

/// A step that failed; the core is left as the failing call left it (after the driver's
/// recovery, for a model failure).
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
/// calls on the core directly.
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

    /// Verifies block ownership and the queues after `schedule()` and at the end of every
    /// step (slow; for tests, the simulation and `--check` runs).
    pub fn checked(mut self) -> Self {
        self.check = true;
        self
    }

    /// Whether the checks are on.
    pub fn is_checked(&self) -> bool {
        self.check
    }

    /// One step: schedule, compute, feed the output back. A failed forward is an error here
    /// (the driver recovered first; see the module docs).
    pub fn step(&mut self) -> Result<Step<M::Error>, StepError<M::Error>> {
        self.step_with(|_, _| {})
    }

    /// Like [`step`](Self::step), calling `before_compute` with the plan while the core still
    /// shows the state it was planned from (every planned request still live), e.g. to render
    /// it or to attach token masks.
    pub fn step_with(
        &mut self,
        before_compute: impl FnOnce(&Scheduler, &mut StepPlan),
    ) -> Result<Step<M::Error>, StepError<M::Error>> {
        let mut step = self.try_step_with(before_compute)?;
        match step.failure.take() {
            None => Ok(step),
            Some(StepFailure::Model(e)) => Err(StepError::Model(e)),
            Some(StepFailure::Output(e)) => Err(StepError::Output(e)),
        }
    }

    /// The step itself: like [`step_with`](Self::step_with), but a failed forward is part of
    /// the step ([`Step::failure`]), with the outputs the step produced before it (requests
    /// the schedule finished). `Err` only for a broken check.
    pub fn try_step_with(
        &mut self,
        before_compute: impl FnOnce(&Scheduler, &mut StepPlan),
    ) -> Result<Step<M::Error>, StepError<M::Error>> {
        let mut plan = self.sched.schedule();
        if self.check {
            self.check()?;
            check_limits(&self.sched, &plan).map_err(StepError::Limits)?;
        }
        before_compute(&self.sched, &mut plan);
        let outputs = self.sched.take_outputs();
        let mut step = Step {
            n_between: outputs.len(),
            outputs,
            plan,
            kind: StepKind::Idle,
            after_work: Vec::new(),
            failure: None,
        };
        if step.plan.is_idle() {
            return Ok(step);
        }
        if !step.plan.connector_work.is_empty() {
            self.model
                .run_connector_work(&step.plan.connector_work, WorkPhase::BeforeForward);
        }
        if step.plan.is_empty() {
            step.kind = StepKind::ConnectorOnly;
            if self.check {
                self.check()?;
            }
            return Ok(step);
        }
        step.kind = StepKind::Forward;
        let fed = match self.model.compute(&self.sched, &step.plan) {
            Ok(output) => {
                let fed = self.sched.on_step_output(&step.plan, &output);
                self.model.recycle_output(output);
                fed.map_err(StepFailure::Output)
            }
            Err(e) => Err(StepFailure::Model(e)),
        };
        match fed {
            Ok(outputs) => {
                step.outputs.extend(outputs);
                self.sched.take_connector_work(&mut step.after_work);
                if !step.after_work.is_empty() {
                    self.model
                        .run_connector_work(&step.after_work, WorkPhase::AfterOutput);
                }
            }
            Err(failure) => {
                self.recover(&step.plan);
                step.failure = Some(failure);
            }
        }
        if self.check {
            self.check()?;
        }
        Ok(step)
    }

    /// After a failed forward: the core already advanced its computed counts for the plan;
    /// `Scheduler::recover_failed_step` undoes what the plan assumed written.
    fn recover(&mut self, plan: &StepPlan) {
        self.sched.recover_failed_step(plan);
    }

    /// Hands a step's plan back to the core for reuse (optional).
    pub fn recycle(&mut self, step: Step<M::Error>) {
        self.sched.recycle_plan(step.plan);
    }

    /// Steps until no request is live, calling `on_step` after each step; fails if requests
    /// are still live after `max_steps` steps. Returns the number of steps taken.
    pub fn drain(
        &mut self,
        max_steps: usize,
        mut on_step: impl FnMut(&Scheduler, &Step<M::Error>),
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
