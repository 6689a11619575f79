//! [`ModelWeights`] for [`LlamaModel`]: installing prepared updates between steps, and the
//! sleep states.
//!
//! The model's weights live in host memory, so sleep level 1 (`offload`) keeps them and only
//! refuses steps until `restore`; level 2 (`drop_weights`) really frees them, along with the
//! activation and logits buffers, which grow back on the first step after a wake-up.

use std::sync::Arc;

use super::{LlamaModel, Scratch};
use crate::executor::ExecError;
use crate::weights::llama::LlamaWeights;
use crate::weights::llama_update::{
    apply_patch, empty_weights, missing, patch_fits, LlamaPayload, LlamaPreparer, LlamaUpdate,
    Patch,
};
use crate::weights::update::{
    self, ModelWeights, PreparedWeights, RetiredWeights, WeightError, WeightPreparer,
    WeightResidency,
};

impl ModelWeights for LlamaModel {
    fn preparer(&self) -> Arc<dyn WeightPreparer> {
        Arc::new(LlamaPreparer::new(self.config.clone()))
    }

    fn install(&mut self, weights: PreparedWeights) -> Result<Option<RetiredWeights>, WeightError> {
        if self.residency == WeightResidency::Reloading {
            return Err(WeightError::Reloading);
        }
        let payload = weights.into_payload::<LlamaPayload>()?;
        if payload.config != self.config {
            return Err(WeightError::WrongExecutor);
        }
        match payload.update {
            LlamaUpdate::Full(weights) => Ok(self.swap_weights(*weights)),
            LlamaUpdate::Partial(patches) => self.patch_weights(patches),
        }
    }

    fn offload(&mut self) {
        self.residency.offload();
    }

    fn drop_weights(&mut self) -> Option<RetiredWeights> {
        if self.residency == WeightResidency::Dropped {
            return None;
        }
        self.residency = WeightResidency::Dropped;
        self.release_step_buffers();
        let old = std::mem::replace(&mut self.weights, empty_weights());
        Some(Box::new(old))
    }

    fn restore(&mut self) -> Result<(), ExecError> {
        update::restore(&mut self.residency)
    }

    /// The weights themselves, to be written over: the scratch buffers stay, as the next
    /// step after the reload needs them again.
    fn lend(&mut self) -> Option<RetiredWeights> {
        if self.residency != WeightResidency::Resident {
            return None;
        }
        self.residency = WeightResidency::Reloading;
        Some(Box::new(std::mem::replace(
            &mut self.weights,
            empty_weights(),
        )))
    }

    fn take_back(&mut self, weights: Option<PreparedWeights>) -> Result<(), WeightError> {
        if self.residency != WeightResidency::Reloading {
            return Err(WeightError::NotLent);
        }
        let Some(weights) = weights else {
            // What was lent is gone: dropped, as sleep level 2 leaves them.
            self.residency = WeightResidency::Dropped;
            self.release_step_buffers();
            return Ok(());
        };
        let payload = weights.into_payload::<LlamaPayload>()?;
        match payload.update {
            LlamaUpdate::Full(weights) if payload.config == self.config => {
                self.weights = *weights;
                self.residency = WeightResidency::Resident;
                Ok(())
            }
            _ => Err(WeightError::WrongExecutor),
        }
    }

    fn residency(&self) -> WeightResidency {
        self.residency
    }

    fn n_bytes(&self) -> usize {
        self.weights.total_bytes()
    }
}

impl LlamaModel {
    /// Frees the buffers sized for the largest step seen (hundreds of megabytes for a big
    /// batch), which grow back on the first step after the weights do: what dropped weights
    /// leave behind.
    fn release_step_buffers(&mut self) {
        // The routing capture is a setting, not a buffer: it stays (its KV layout with it),
        // its step rows go.
        let routing = self.scratch.routing.take().map(|mut r| {
            r.step = Vec::new();
            r
        });
        self.scratch = Scratch {
            routing,
            ..Scratch::default()
        };
        self.logits_buf = Vec::new();
        self.sampler_scratch.release_buffers();
    }

    /// Puts a complete set in place. Weights dropped by sleep come back asleep: a wake-up
    /// (`restore`) makes them usable, as with every executor.
    fn swap_weights(&mut self, weights: LlamaWeights) -> Option<RetiredWeights> {
        let old = std::mem::replace(&mut self.weights, weights);
        if self.residency == WeightResidency::Dropped {
            self.residency.refill();
            // The empty stand-in: nothing worth handing to another thread.
            return None;
        }
        Some(Box::new(old))
    }

    /// Puts every patch in place, after checking that all of them fit, so a refused update
    /// changes nothing. Returns the matrix segments replaced, for the caller to drop.
    fn patch_weights(
        &mut self,
        patches: Vec<Patch>,
    ) -> Result<Option<RetiredWeights>, WeightError> {
        if self.residency == WeightResidency::Dropped {
            let (n_missing, first) = missing(&self.config, patches.iter().map(|p| p.name.as_str()));
            return Err(WeightError::Incomplete { n_missing, first });
        }
        if !patches.iter().all(|p| patch_fits(&mut self.weights, p)) {
            return Err(WeightError::WrongExecutor);
        }
        let mut retired = Vec::new();
        for patch in patches {
            retired.extend(apply_patch(&mut self.weights, patch)?);
        }
        Ok((!retired.is_empty()).then(|| Box::new(retired) as RetiredWeights))
    }
}
