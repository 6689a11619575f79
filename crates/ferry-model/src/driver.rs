//! An executor and its KV arena as the model of `ferry_core::StepDriver`, so tests and tools
//! run real steps through the same driver as the core's own tests.

use ferry_arena::KvArena;
use ferry_core::{ModelOutput, Scheduler, SchedulerConfig, StepModel, StepPlan};

use crate::executor::{ExecError, Executor};

/// An executor with the arena its plans address.
#[derive(Debug)]
pub struct ExecutorModel<E> {
    pub executor: E,
    pub arena: KvArena,
}

impl<E: Executor> ExecutorModel<E> {
    /// An arena of `config.n_blocks` blocks of `config.block_size` slots, shaped for `executor`.
    pub fn new(executor: E, config: &SchedulerConfig) -> Self {
        let arena = KvArena::new(
            executor.kv_layout(config.block_size),
            config.n_blocks as usize,
        );
        Self { executor, arena }
    }
}

impl<E: Executor> StepModel for ExecutorModel<E> {
    type Error = ExecError;

    fn compute(&mut self, _: &Scheduler, plan: &StepPlan) -> Result<ModelOutput, ExecError> {
        self.executor.execute(plan, &mut self.arena)
    }
}
