//! ferry-core: the sans-IO heart of the engine.
//!
//! Scheduling and KV-block bookkeeping are a deterministic state machine: no threads, no
//! clocks (`now` is an argument), no I/O, no tensors. The engine thread feeds it requests and
//! model outputs and gets back [`StepPlan`]s and per-request outputs. Because the same inputs
//! always give the same outputs, the simulation can replay any failing seed exactly.

pub mod plan;
pub mod sampling;

pub use plan::{
    BlockId, ModelOutput, ReqIdx, SampleSpec, SampledToken, ScheduledReq, StepPlan, TokenId,
};
pub use sampling::SamplingParams;
