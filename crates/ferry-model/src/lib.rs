//! ferry-model: runs a [`ferry_core::StepPlan`] over the KV arena.
//!
//! Two executors share one trait ([`Executor`]): the real Llama-family model and the checksum
//! model (no weights; its next token depends on every KV byte of the sequence, so wrong,
//! missing or stale KV changes the output).

pub mod attention;
pub mod checksum;
pub mod config;
pub mod driver;
pub mod dtype;
pub mod executor;
pub mod kernels;
pub mod llama;
pub mod llama_update;
pub mod llama_weights;
pub mod load;
pub mod matrix;
pub mod profile;
pub mod random_model;
pub mod rope;
pub mod row_groups;
pub mod sampler;
pub mod tiny;
pub mod weight_buf;
pub mod weight_push;
pub mod weight_update;
pub mod weights;

pub use checksum::{ChecksumConfigError, ChecksumModel};
pub use config::{LlamaConfig, RopeScaling};
pub use driver::ExecutorModel;
pub use dtype::WeightDtype;
pub use executor::{ExecError, Executor, Hooked, StepHook};
pub use llama::{LlamaModel, Logits};
pub use llama_update::LlamaPreparer;
pub use llama_weights::{LlamaWeights, ModelError};
pub use load::{cache_dir, default_model_path, expected_tensors, ModelSpec};
pub use load::{
    load_model, load_model_stored, load_model_stored_with_progress, load_model_with_progress,
    LoadError, LoadedModel, Precision, Progress, WeightFiles,
};
pub use matrix::{Matrix, Segment};
pub use sampler::LogprobsMode;
pub use weight_buf::{ByteBuf, WeightBuf};
pub use weight_push::SafetensorsPush;
pub use weight_update::{
    parse_safetensors, ModelWeights, PreparedWeights, RetiredWeights, WeightError, WeightPreparer,
    WeightResidency, WeightSlots, Weightless,
};
pub use weights::{StoredTensor, Tensor, WeightStore};
