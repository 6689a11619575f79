//! The executor trait: what the engine thread calls once per step.
//!
//! An executor reads and writes KV only through the [`KvArena`] and the plan's block tables;
//! it never decides what to schedule. A CUDA backend is another implementation of this trait
//! with its own arena placement (see ARCHITECTURE.md).

use ferry_arena::{KvArena, KvLayout};
use std::sync::Arc;

use ferry_core::{LoraId, ModelOutput, RoutingShape, StepPlan};

pub use crate::error::ExecError;
use crate::lora::LoraAdapter;
use crate::weights::update::ModelWeights;

pub trait Executor: Send {
    /// KV shape per block this executor needs (for a given block size).
    fn kv_layout(&self, block_size: usize) -> KvLayout;

    /// Size of the vocabulary sampled from.
    fn vocab_size(&self) -> usize;

    /// Runs one step: writes the KV of every scheduled token into the arena, and samples the
    /// next token of every request whose `sample` is set (in plan order).
    fn execute(&mut self, plan: &StepPlan, kv: &mut KvArena) -> Result<ModelOutput, ExecError>;

    /// The shape of the expert routing `execute` reports in [`ModelOutput::routed`]; `None`
    /// when it reports none (a dense model, or an MoE model not asked to capture it).
    fn routing_shape(&self) -> Option<RoutingShape> {
        None
    }

    /// The executor's weights, for updates and sleep (see `weights/update.rs`).
    fn weight_ops(&self) -> &dyn ModelWeights;

    fn weight_ops_mut(&mut self) -> &mut dyn ModelWeights;

    /// Holds `adapter` under `id`, for steps whose requests name it
    /// ([`ferry_core::ScheduledReq::lora`]); an adapter already under `id` is replaced (an
    /// in-place reload: the next step computes with the new one). Executors without adapters
    /// refuse.
    fn load_lora(&mut self, id: LoraId, adapter: Arc<LoraAdapter>) -> Result<(), ExecError> {
        let _ = (id, adapter);
        Err(ExecError::LoraUnsupported)
    }

    /// Drops the adapter under `id`; a step naming it afterwards fails.
    fn unload_lora(&mut self, id: LoraId) -> Result<(), ExecError> {
        let _ = id;
        Err(ExecError::LoraUnsupported)
    }
}

/// Boxed and borrowed executors are executors too: wrappers such as [`Hooked`] take the
/// engine's `Box<dyn Executor>`, and a caller can lend its model to a driver for a run.
macro_rules! forward_executor {
    ($($pointer:ty),*) => {$(
        impl<E: Executor + ?Sized> Executor for $pointer {
            fn kv_layout(&self, block_size: usize) -> KvLayout {
                (**self).kv_layout(block_size)
            }
            fn vocab_size(&self) -> usize {
                (**self).vocab_size()
            }
            fn execute(
                &mut self,
                plan: &StepPlan,
                kv: &mut KvArena,
            ) -> Result<ModelOutput, ExecError> {
                (**self).execute(plan, kv)
            }
            fn routing_shape(&self) -> Option<RoutingShape> {
                (**self).routing_shape()
            }
            fn weight_ops(&self) -> &dyn ModelWeights {
                (**self).weight_ops()
            }
            fn weight_ops_mut(&mut self) -> &mut dyn ModelWeights {
                (**self).weight_ops_mut()
            }
            fn load_lora(
                &mut self,
                id: LoraId,
                adapter: Arc<LoraAdapter>,
            ) -> Result<(), ExecError> {
                (**self).load_lora(id, adapter)
            }
            fn unload_lora(&mut self, id: LoraId) -> Result<(), ExecError> {
                (**self).unload_lora(id)
            }
        }
    )*};
}

forward_executor!(Box<E>, &mut E);

/// Runs before each step of a [`Hooked`] executor: tests hold, slow, count or fail steps
/// this way without writing out the whole [`Executor`] again.
pub trait StepHook: Send {
    /// Called with the plan before the inner executor runs it; an error fails the step
    /// instead.
    fn before_step(&mut self, plan: &StepPlan) -> Result<(), ExecError>;
}

/// `inner`, with `hook` called before each of its steps.
#[derive(Debug)]
pub struct Hooked<E, H> {
    pub inner: E,
    pub hook: H,
}

impl<E: Executor, H: StepHook> Executor for Hooked<E, H> {
    fn kv_layout(&self, block_size: usize) -> KvLayout {
        self.inner.kv_layout(block_size)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn execute(&mut self, plan: &StepPlan, kv: &mut KvArena) -> Result<ModelOutput, ExecError> {
        self.hook.before_step(plan)?;
        self.inner.execute(plan, kv)
    }
    fn routing_shape(&self) -> Option<RoutingShape> {
        self.inner.routing_shape()
    }
    fn weight_ops(&self) -> &dyn ModelWeights {
        self.inner.weight_ops()
    }
    fn weight_ops_mut(&mut self) -> &mut dyn ModelWeights {
        self.inner.weight_ops_mut()
    }
    fn load_lora(&mut self, id: LoraId, adapter: Arc<LoraAdapter>) -> Result<(), ExecError> {
        self.inner.load_lora(id, adapter)
    }
    fn unload_lora(&mut self, id: LoraId) -> Result<(), ExecError> {
        self.inner.unload_lora(id)
    }
}
