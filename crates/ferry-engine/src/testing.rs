//! Test support for crates that drive a real engine (the server's tests, examples): the
//! built-in tiny model, an executor wrapper that holds, slows or fails a step, and one that
//! routes tokens to experts as an MoE model capturing its routing would ([`FakeMoe`]).
//! Behind the `testing` feature, so the serving build carries none of it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_arena::{KvArena, KvLayout};
use ferry_core::block_pool::BlockPool;
use ferry_core::{ModelOutput, Owner, ReqIdx, RoutedExperts, RoutingShape, StepPlan, TokenId};
use ferry_model::{ExecError, Executor, Hooked, LoadError, LoadedModel, ModelWeights, StepHook};

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

/// The expert routing [`FakeMoe`] gives `token` at position `pos`: one row of
/// `shape.width()` ids, layer-major then rank, a function of the two alone (as a real
/// router's is of the prefix, which a prefix-cache hit shares).
pub fn fake_routing_row(shape: RoutingShape, token: TokenId, pos: usize) -> Vec<u16> {
    (0..shape.layers)
        .flat_map(|layer| {
            (0..shape.top_k).map(move |rank| {
                let id = (token.0 as usize).wrapping_mul(31) + pos * 17 + layer * 7 + rank * 3;
                (id % shape.num_experts) as u16
            })
        })
        .collect()
}

/// `inner` with the routing an MoE executor capturing it reports ([`Executor::routing_shape`],
/// `ModelOutput::routed`): each computed token's row ([`fake_routing_row`]) is stored beside
/// its KV slot, every request of the plan first (as KV is written), then each request reports
/// the rows the plan asks it to read back (`StepPlan::routing_reads`), from those slots,
/// followed by the rows it computed. Reading a slot no forward stored fails the step.
#[derive(Debug)]
pub struct FakeMoe<E> {
    pub inner: E,
    pub shape: RoutingShape,
    /// Routing by arena slot (`block * block_size + offset`).
    slots: HashMap<usize, Vec<u16>>,
}

impl<E> FakeMoe<E> {
    pub fn new(inner: E, shape: RoutingShape) -> Self {
        Self {
            inner,
            shape,
            slots: HashMap::new(),
        }
    }

    fn routed(&mut self, plan: &StepPlan) -> Result<Vec<RoutedExperts>, ExecError> {
        for r in &plan.reqs {
            for (i, &token) in plan.tokens_of(r).iter().enumerate() {
                let pos = r.start_pos + i;
                let row = fake_routing_row(self.shape, token, pos);
                self.slots.insert(plan.slot_of(r, pos), row);
            }
        }
        let mut routed = Vec::with_capacity(plan.reqs.len());
        for (i, r) in plan.reqs.iter().enumerate() {
            let first = plan
                .routing_reads
                .iter()
                .find(|read| read.req_pos == i)
                .map_or(r.start_pos, |read| read.from);
            let mut ids = Vec::new();
            for pos in first..r.start_pos + r.tokens.len() {
                let row = self.slots.get(&plan.slot_of(r, pos)).ok_or_else(|| {
                    ExecError::InvalidPlan(format!(
                        "routing of position {pos} of {:?} read back, but no forward stored it",
                        r.req
                    ))
                })?;
                ids.extend_from_slice(row);
            }
            routed.push(RoutedExperts {
                req: r.req,
                first_pos: first,
                ids,
            });
        }
        Ok(routed)
    }
}

impl FakeMoe<Box<dyn Executor>> {
    /// The wrapper for [`crate::start_model_with`], around whatever `wrap` makes (a
    /// [`StepThrottle`]'s, say).
    pub fn wrap(
        shape: RoutingShape,
        wrap: impl FnOnce(Box<dyn Executor>) -> Box<dyn Executor>,
    ) -> impl FnOnce(Box<dyn Executor>) -> Box<dyn Executor> {
        move |inner| Box::new(FakeMoe::new(wrap(inner), shape))
    }
}

impl<E: Executor> Executor for FakeMoe<E> {
    fn kv_layout(&self, block_size: usize) -> KvLayout {
        self.inner.kv_layout(block_size)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn execute(&mut self, plan: &StepPlan, kv: &mut KvArena) -> Result<ModelOutput, ExecError> {
        let mut out = self.inner.execute(plan, kv)?;
        out.routed = self.routed(plan)?;
        Ok(out)
    }
    fn routing_shape(&self) -> Option<RoutingShape> {
        Some(self.shape)
    }
    fn weight_ops(&self) -> &dyn ModelWeights {
        self.inner.weight_ops()
    }
    fn weight_ops_mut(&mut self) -> &mut dyn ModelWeights {
        self.inner.weight_ops_mut()
    }
}
