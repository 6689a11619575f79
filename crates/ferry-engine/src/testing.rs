//! Test support for crates that drive a real engine (the server's tests, examples): the
//! built-in tiny model, and an executor wrapper that holds, slows or fails a step. Behind the
//! `testing` feature, so the serving build carries none of it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::block_pool::BlockPool;
use ferry_core::{Owner, ReqIdx, StepPlan};
use ferry_model::{ExecError, Executor, Hooked, LoadError, LoadedModel, StepHook};

/// The deterministic random-weight model built into ferry (`--model tiny`).
pub fn tiny_model() -> LoadedModel {
    ferry_model::tiny::tiny_model()
}

/// Writes the tiny model as a Hugging Face folder (config, F32 safetensors, tokenizer) that
/// loads back to the same model: a target for weight reloads and pushes.
pub fn write_tiny_folder(dir: &Path) -> Result<(), LoadError> {
    ferry_model::tiny::write_hf_folder(&tiny_model(), dir)
}

/// Holds, slows or fails an engine's steps from a test: while a test holds
/// [`StepThrottle::gate`], every step blocks before its forward; each step also sleeps
/// `delay` (to make a stream slow enough to disconnect from mid-way) and counts itself in
/// `n_steps`; the first step after a test sets `double_free` fails the engine (see
/// [`plant_double_free`]).
#[derive(Debug, Clone, Default)]
pub struct StepThrottle {
    pub gate: Arc<Mutex<()>>,
    pub delay: Duration,
    pub n_steps: Arc<AtomicUsize>,
    pub double_free: Arc<AtomicBool>,
}

impl StepThrottle {
    /// The wrapper for [`crate::start_model_with`].
    pub fn wrap(&self) -> impl FnOnce(Box<dyn Executor>) -> Box<dyn Executor> {
        let hook = self.clone();
        move |inner| Box::new(Hooked { inner, hook })
    }
}

impl StepHook for StepThrottle {
    fn before_step(&mut self, _plan: &StepPlan) -> Result<(), ExecError> {
        self.n_steps.fetch_add(1, Ordering::SeqCst);
        drop(self.gate.lock().unwrap_or_else(|e| e.into_inner()));
        std::thread::sleep(self.delay);
        if self.double_free.swap(false, Ordering::SeqCst) {
            plant_double_free();
        }
        Ok(())
    }
}

/// A double free, as a bug in the core's block bookkeeping would make one: request #0 gives
/// block 1 back twice. The block pool's assert panics naming them, in every build; on the
/// engine thread, that panic is the engine's failure.
pub fn plant_double_free() {
    let owner = Owner::Request(ReqIdx(0));
    let mut pool = BlockPool::new(2);
    let mut taken = Vec::new();
    pool.take(1, &mut taken, owner);
    pool.release(taken[0], owner);
    pool.release(taken[0], owner);
}

/// What [`plant_double_free`] panics with: the block pool's message.
pub const DOUBLE_FREE: &str = "block pool: release by request #0 of block 1, which no one \
                               holds: a double free (its reference count would go below zero)";
