//! In-place weight updates: pushed or reloaded tensors are checked and converted into an
//! executor's own layout *off the engine thread* ([`WeightPreparer`]), then installed between
//! two steps ([`crate::Executor::install_weights`]), which only swaps or patches memory.
//!
//! The split keeps the engine thread's share of a weight update to a pointer swap (a full
//! reload) or a copy of the pushed bytes (a partial push), so a pause → update → resume cycle
//! costs the time to read the weights and little else.
//!
//! Memory: a reader (a pushed body, [`crate::weights::push::SafetensorsPush`]; a model file,
//! [`crate::load::WeightFiles`]) converts each tensor straight into its place in the new
//! weights ([`WeightSlots`]), so an update holds at most one extra copy of the tensors it
//! replaces, and the weights it replaces give their memory back to the OS when dropped
//! ([`crate::WeightBuf`]).

use std::any::Any;
use std::sync::Arc;

pub use ferry_core::WeightResidency;

use crate::dtype::WeightDtype;
use crate::error::ExecError;
use crate::{LlamaConfig, WeightStore};

/// What is wrong with a weight update; nothing has changed when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WeightError {
    #[error("the update holds no tensors")]
    Empty,
    #[error("unknown tensor `{name}`: this model has no parameter by that name")]
    UnknownTensor { name: String },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    BadShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor `{name}` has unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDtype { name: String, dtype: String },
    /// One upload held a tensor twice (two buckets named it).
    #[error("tensor `{name}` was already sent in an earlier bucket of this upload")]
    Duplicate { name: String },
    #[error("invalid safetensors data: {0}")]
    Malformed(String),
    /// A full set was required (the weights were dropped by sleep level 2, or a reload).
    #[error("the update must hold every parameter; missing {n_missing}, first `{first}`")]
    Incomplete { n_missing: usize, first: String },
    #[error("the new model's config differs from the running one: {field}: running {running}, new {new}")]
    ConfigMismatch {
        field: &'static str,
        running: String,
        new: String,
    },
    #[error("these weights were prepared for another executor")]
    WrongExecutor,
    /// Another update came while the weights were lent to a reload in place.
    #[error("the weights are being reloaded in place (update_weights_from_disk while paused): update them once that reload has returned")]
    Reloading,
    /// Weights handed back to an executor that lent none.
    #[error("no weights are lent to a reload in place")]
    NotLent,
}

/// Weights checked and converted for one executor, ready for
/// [`crate::Executor::install_weights`]. Opaque: only the executor that prepared them reads
/// the payload.
pub struct PreparedWeights {
    /// Tensors in the update.
    pub n_tensors: usize,
    /// Bytes the update holds (f32 values, or tensors in their stored precision).
    pub n_bytes: usize,
    /// Every parameter is present (a partial push leaves the others as they are).
    pub complete: bool,
    payload: Box<dyn Any + Send>,
}

impl std::fmt::Debug for PreparedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedWeights")
            .field("n_tensors", &self.n_tensors)
            .field("n_bytes", &self.n_bytes)
            .field("complete", &self.complete)
            .finish_non_exhaustive()
    }
}

impl PreparedWeights {
    pub fn new(
        n_tensors: usize,
        n_bytes: usize,
        complete: bool,
        payload: Box<dyn Any + Send>,
    ) -> Self {
        Self {
            n_tensors,
            n_bytes,
            complete,
            payload,
        }
    }

    /// The payload, if it is a `T` (else [`WeightError::WrongExecutor`]).
    pub fn into_payload<T: 'static>(self) -> Result<Box<T>, WeightError> {
        self.payload
            .downcast()
            .map_err(|_| WeightError::WrongExecutor)
    }
}

/// The destinations of an update's tensors, from [`WeightPreparer::slots`]: a reader converts
/// each tensor straight into its slot, so no tensor is held twice on its way in, then
/// [`WeightSlots::finish`] makes the update.
pub trait WeightSlots: Send {
    /// The floats of the `idx`-th tensor of the list the slots were made for, row-major. The
    /// reader writes every one of them before `finish`.
    fn slot(&mut self, idx: usize) -> &mut [f32];

    /// The bytes of the `idx`-th tensor kept in `dtype`, for a reader to write whole in
    /// that dtype's layout, when the executor keeps that tensor in its stored precision (a
    /// matrix); `None` otherwise, and the reader converts into [`WeightSlots::slot`] instead.
    /// Asked again for the same tensor and dtype, answers the same bytes (a reader learns
    /// every tensor's place before it writes any).
    fn stored_slot(&mut self, _idx: usize, _dtype: WeightDtype) -> Option<&mut [u8]> {
        None
    }

    /// The update, once every slot has been written.
    fn finish(self: Box<Self>) -> PreparedWeights;

    /// Takes the slots' memory from the OS now, on every thread of rayon's pool, before a
    /// reader fills them (see [`crate::weights::buf::prefault`]). For a reader that is faster
    /// than the kernel clears fresh pages (a reload from a GGUF file in the page cache; the
    /// safetensors reader takes each tensor's pages on another thread while it reads); a
    /// network reader need not. Does nothing by default.
    fn prefault(&mut self) {}
}

/// Weights an executor gave up (replaced or dropped): the caller drops them, off the engine
/// thread when they are large (freeing hundreds of megabytes takes milliseconds).
pub type RetiredWeights = Box<dyn Any + Send>;

/// Checks and converts tensors for one executor, on any thread. Shares nothing mutable with
/// the executor: it holds a copy of the model's config.
pub trait WeightPreparer: Send + Sync {
    /// Checks every name and shape against the model (nothing is converted before all pass),
    /// then converts the tensors into the executor's layout.
    fn prepare(&self, tensors: WeightStore) -> Result<PreparedWeights, WeightError>;

    /// Checks the names and shapes of an update's tensors (`(name, shape)`, at most once
    /// each; the first failure in name order is the error, and nothing is allocated then) and
    /// makes their destinations in the executor's layout, for a reader to fill.
    fn slots(&self, tensors: &[(String, Vec<usize>)]) -> Result<Box<dyn WeightSlots>, WeightError>;

    /// Slots for every parameter (`tensors`, the complete list) that are the places of
    /// `lent`, the weights [`ModelWeights::lend`] gave up: a reader overwrites them in place
    /// and `finish` makes them a complete update for [`ModelWeights::take_back`]. A matrix
    /// read in another dtype than it holds gets a fresh segment of that dtype, as an update
    /// of fresh weights would. On an error `lent` comes back untouched. An executor that
    /// lends nothing refuses.
    fn slots_in_place(
        &self,
        lent: RetiredWeights,
        tensors: &[(String, Vec<usize>)],
    ) -> Result<Box<dyn WeightSlots>, (WeightError, RetiredWeights)> {
        let _ = tensors;
        Err((WeightError::WrongExecutor, lent))
    }

    /// For a reload from a model folder: the folder's config must describe the same model.
    fn check_config(&self, config: &LlamaConfig) -> Result<(), WeightError>;

    /// The parameters a tensor of another layout holds, and the shape it must have (an MoE
    /// model's experts as transformers 5 holds them in memory, [`crate::config::fused_parts`]);
    /// `None` for a tensor that is one parameter or none.
    fn fused_parts(&self, name: &str) -> Option<(Vec<usize>, Vec<crate::config::FusedPart>)> {
        let _ = name;
        None
    }

    /// Every parameter the model takes (`(name, shape)`); empty for an executor without
    /// weights.
    fn expected(&self) -> Vec<(String, Vec<usize>)> {
        Vec::new()
    }

    /// One update from the buckets of an upload ([`crate::WeightUpload`]), each prepared by
    /// this preparer from tensors no other bucket held. Buckets that together hold every
    /// parameter make a complete update (installable after sleep level 2 dropped the
    /// weights); moving, not copying, their tensors. An executor whose updates cannot be
    /// combined takes a single bucket only.
    fn merge(&self, mut parts: Vec<PreparedWeights>) -> Result<PreparedWeights, WeightError> {
        match parts.len() {
            0 => Err(WeightError::Empty),
            1 => Ok(parts.remove(0)),
            _ => Err(WeightError::Malformed(
                "this model takes an upload in one bucket".to_owned(),
            )),
        }
    }
}

/// An executor's weights as the lifecycle drives them: updates (between steps) and sleep.
/// Wrapping executors (test gates) forward [`crate::Executor::weight_ops`] to the inner one.
pub trait ModelWeights: Send {
    /// Checks and converts weight updates for this executor on any thread.
    fn preparer(&self) -> Arc<dyn WeightPreparer>;

    /// Installs prepared weights between steps: a complete set replaces the weights (also
    /// after sleep level 2 dropped them), a partial one patches the named tensors in place.
    /// Nothing changes on error. Returns what was replaced, for the caller to drop.
    fn install(&mut self, weights: PreparedWeights) -> Result<Option<RetiredWeights>, WeightError>;

    /// The weight version the weights now installed are known by. The checksum model's KV
    /// depends on it; a real model ignores it.
    fn set_version(&mut self, _version: &str) {}

    /// Sleep level 1: moves the weights to a host copy. A CPU executor's weights already live
    /// in host memory, so this only marks them unusable until `restore`.
    fn offload(&mut self);

    /// Sleep level 2: drops the weights, returning them for the caller to drop.
    fn drop_weights(&mut self) -> Option<RetiredWeights>;

    /// Wake-up: makes offloaded weights usable again. Fails with `WeightsUnloaded` when they
    /// were dropped and no complete install came since.
    fn restore(&mut self) -> Result<(), ExecError>;

    /// Lends the resident weights to a reload in place, which writes the new weights over
    /// them with no fresh memory ([`WeightPreparer::slots_in_place`]): the executor holds
    /// none ([`WeightResidency::Reloading`]) and refuses steps until
    /// [`ModelWeights::take_back`]. `None`, changing nothing, when they are not resident or
    /// this executor does not reload in place.
    fn lend(&mut self) -> Option<RetiredWeights> {
        None
    }

    /// Ends a reload in place: `Some` is the complete update its slots finished, made of the
    /// lent weights, which become the weights, resident; `None` means the read failed midway
    /// (the lent weights, part old and part new, were dropped): the weights stay dropped, as
    /// sleep level 2 leaves them. Refused, changing nothing, unless the weights are lent.
    fn take_back(&mut self, weights: Option<PreparedWeights>) -> Result<(), WeightError> {
        let _ = weights;
        Err(WeightError::WrongExecutor)
    }

    fn residency(&self) -> WeightResidency;

    /// Bytes of the weights held, each tensor in its stored dtype (0 once dropped, and for
    /// executors without weights).
    fn n_bytes(&self) -> usize {
        0
    }
}

/// The weights of an executor that has none (the checksum model, test scripts): it accepts
/// only an empty update, which stands for "new weights" (the version says which), and models
/// the sleep states so lifecycle tests see what a real model would do.
#[derive(Debug, Clone, Copy, Default)]
pub struct Weightless {
    residency: WeightResidency,
}

impl ModelWeights for Weightless {
    fn preparer(&self) -> Arc<dyn WeightPreparer> {
        Arc::new(WeightlessPreparer)
    }

    fn install(&mut self, weights: PreparedWeights) -> Result<Option<RetiredWeights>, WeightError> {
        if self.residency == WeightResidency::Reloading {
            return Err(WeightError::Reloading);
        }
        weights.into_payload::<WeightlessPreparer>()?;
        self.residency.refill();
        Ok(None)
    }

    fn offload(&mut self) {
        self.residency.offload();
    }

    fn drop_weights(&mut self) -> Option<RetiredWeights> {
        self.residency = WeightResidency::Dropped;
        None
    }

    fn restore(&mut self) -> Result<(), ExecError> {
        restore(&mut self.residency)
    }

    /// Nothing to lend but the state, so lifecycle tests see a reload in place as a real
    /// model goes through it.
    fn lend(&mut self) -> Option<RetiredWeights> {
        (self.residency == WeightResidency::Resident).then(|| {
            self.residency = WeightResidency::Reloading;
            Box::new(WeightlessPreparer) as RetiredWeights
        })
    }

    fn take_back(&mut self, weights: Option<PreparedWeights>) -> Result<(), WeightError> {
        if self.residency != WeightResidency::Reloading {
            return Err(WeightError::NotLent);
        }
        self.residency = match weights {
            Some(weights) => {
                weights.into_payload::<WeightlessPreparer>()?;
                WeightResidency::Resident
            }
            None => WeightResidency::Dropped,
        };
        Ok(())
    }

    fn residency(&self) -> WeightResidency {
        self.residency
    }
}

/// [`ModelWeights::restore`] for an executor that tracks its residency: the error names why.
pub fn restore(residency: &mut WeightResidency) -> Result<(), ExecError> {
    if residency.restore() {
        Ok(())
    } else {
        Err(ExecError::WeightsUnloaded)
    }
}

#[derive(Debug, Clone, Copy)]
struct WeightlessPreparer;

impl WeightPreparer for WeightlessPreparer {
    fn prepare(&self, tensors: WeightStore) -> Result<PreparedWeights, WeightError> {
        if let Some(name) = tensors.tensors.keys().next() {
            return Err(WeightError::UnknownTensor { name: name.clone() });
        }
        Ok(PreparedWeights::new(
            0,
            0,
            true,
            Box::new(WeightlessPreparer),
        ))
    }

    fn slots(&self, tensors: &[(String, Vec<usize>)]) -> Result<Box<dyn WeightSlots>, WeightError> {
        match tensors.iter().map(|(name, _)| name).min() {
            Some(name) => Err(WeightError::UnknownTensor { name: name.clone() }),
            None => Ok(Box::new(WeightlessPreparer)),
        }
    }

    fn check_config(&self, _config: &LlamaConfig) -> Result<(), WeightError> {
        Ok(())
    }

    fn slots_in_place(
        &self,
        lent: RetiredWeights,
        tensors: &[(String, Vec<usize>)],
    ) -> Result<Box<dyn WeightSlots>, (WeightError, RetiredWeights)> {
        match self.slots(tensors) {
            Ok(slots) => Ok(slots),
            Err(e) => Err((e, lent)),
        }
    }
}

/// No tensor, no slot: only an empty update gets this far.
impl WeightSlots for WeightlessPreparer {
    fn slot(&mut self, idx: usize) -> &mut [f32] {
        unreachable!("a weightless update has no tensor {idx}")
    }

    fn finish(self: Box<Self>) -> PreparedWeights {
        PreparedWeights::new(0, 0, true, Box::new(WeightlessPreparer))
    }
}

/// Reads safetensors bytes (a tensor push) into f32 tensors by name. Every tensor's dtype is
/// checked before any is converted, so an error names the first bad tensor and costs nothing.
pub fn parse_safetensors(bytes: &[u8]) -> Result<WeightStore, WeightError> {
    let tensors = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| WeightError::Malformed(e.to_string()))?;
    let mut views = tensors.tensors();
    // Sorted, so errors and conversion order do not depend on the header's order.
    views.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in &views {
        if crate::dtype::to_f32(view.dtype(), &[]).is_none() {
            return Err(WeightError::UnsupportedDtype {
                name: name.clone(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
    }
    let mut store = WeightStore::default();
    for (name, view) in views {
        let data = crate::dtype::to_f32(view.dtype(), view.data())
            .ok_or_else(|| WeightError::Malformed(format!("tensor `{name}`: bad data")))?;
        store.insert(name, crate::Tensor::new(view.shape().to_vec(), data));
    }
    if store.tensors.is_empty() {
        return Err(WeightError::Empty);
    }
    Ok(store)
}
