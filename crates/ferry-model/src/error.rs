//! [`ExecError`]: why an executor could not run a step. Below the executor trait
//! (`executor.rs`), which returns it, and the weights (`weights/update.rs`), whose wake-up
//! fails with it when they are not there.

/// Why an executor could not run a step (or, waking its weights, restore them).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("KV arena is released (sleeping); wake it before running a step")]
    ArenaReleased,
    #[error("weights are asleep (sleep level 1 offloaded them, level 2 dropped them); wake them, after a reload for level 2, before running a step")]
    WeightsUnloaded,
    #[error("invalid step plan: {0}")]
    InvalidPlan(String),
    /// A step names an adapter the executor does not hold, or one is unloaded that is not
    /// loaded.
    #[error("LoRA adapter {0:?} is not loaded")]
    LoraNotLoaded(ferry_core::LoraId),
    /// The executor serves the base model only.
    #[error("this executor does not serve LoRA adapters")]
    LoraUnsupported,
    /// An adapter made for another base model than this executor's.
    #[error("LoRA adapter {id:?} does not fit this model: {message}")]
    LoraMismatch {
        id: ferry_core::LoraId,
        message: String,
    },
}
