//! ferry-model: runs a [`ferry_core::StepPlan`] over the KV arena.
//!
//! Two executors share one trait ([`Executor`]): the real Llama-family model and the checksum
//! model (no weights; its next token depends on every KV byte of the sequence, so wrong,
//! missing or stale KV changes the output).

pub mod checksum;
pub mod config;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod executor;
pub mod ggml;
pub mod isa;
pub mod kernels;
pub mod llama;
pub mod load;
pub mod lora;
pub mod profile;
pub mod sampler;
pub mod spec;
pub mod tiny;
pub mod weights;

pub use checksum::{ChecksumConfigError, ChecksumModel};
pub use config::{expected_tensors, ExpertNaming, LlamaConfig, MoeConfig, RopeScaling};
pub use driver::ExecutorModel;
pub use dtype::WeightDtype;
pub use executor::{ExecError, Executor, Hooked, StepHook};
pub use llama::{kv_layout_of, LlamaModel, Logits};
pub use load::{cache_dir, default_model_path};
pub use load::{
    load_model, load_model_stored, load_model_stored_with_progress, load_model_with_progress,
    LoadError, LoadedModel, Precision, Progress, WeightFiles,
};
pub use lora::{LoraAdapter, LoraConfig, LoraError, LoraTensor, TargetModule};
pub use sampler::LogprobsMode;
pub use spec::ModelSpec;
pub use weights::buf::{ByteBuf, WeightBuf};
pub use weights::llama::{LlamaWeights, ModelError};
pub use weights::llama_update::LlamaPreparer;
pub use weights::matrix::{Matrix, Segment};
pub use weights::push::SafetensorsPush;
// Random weights for tests and benchmarks, by the name they have always had here.
pub use weights::random as random_model;
pub use weights::store::{StoredTensor, Tensor, WeightStore};
pub use weights::update::{
    parse_safetensors, ModelWeights, PreparedWeights, RetiredWeights, WeightError, WeightPreparer,
    WeightResidency, WeightSlots, Weightless,
};
pub use weights::upload::{BucketInfo, WeightUpload};
