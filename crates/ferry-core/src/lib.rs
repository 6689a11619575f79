//! ferry-core: the sans-IO heart of the engine.
//!
//! Scheduling and KV-block bookkeeping are a deterministic state machine: no threads, no
//! clocks (`now` is an argument), no I/O, no tensors. The engine thread feeds it requests and
//! model outputs and gets back [`StepPlan`]s and per-request outputs. Because the same inputs
//! always give the same outputs, the simulation can replay any failing seed exactly.
//!
//! The key decision: every KV block has an owner you can name ([`Owner`]: a request or a
//! transfer) or is free, and [`Scheduler::check_ownership`] proves it. Lifecycle operations
//! (cache reset, P/D exports, pauses) are built on that ledger, so "reset failed because some
//! block is still held" always names who holds it.
//!
//! Modules, bottom up, each importing only modules before it (`ferry-lint`'s
//! `tests/import_rings.rs` checks that no module imports one that imports it back): [`ids`] (the basic ids),
//! [`lora`] (the adapter a request names), [`sampling`], [`hash`] (chained blake3 block hashes), [`peers`], [`lifecycle`] (the
//! lifecycle's public types), [`owner`] (who holds a block: a request or a transfer hold),
//! [`block_pool`] (ref counts, LRU free queue, prefix-cache index; every block-state change
//! asserts its precondition, in release builds too), [`holds`] (transfer holds: holder, kind, lease), [`ownership`] (the ledger and its
//! checker), [`request`], [`kv_cache`] (per-request block arithmetic), [`connector`] (the
//! connector trait), [`plan`] (the step plan), [`config`], the connectors [`pd`] and
//! [`offload`], [`scheduler`]; [`driver`] runs one step against a model (tests, benches,
//! simulation).
//!
//! One step, with a stand-in for the executor:
//!
//! ```
//! use ferry_core::{ModelOutput, SampledToken, SamplingParams, Scheduler, SchedulerConfig, TokenId};
//!
//! let mut core = Scheduler::new(SchedulerConfig::default()).unwrap();
//! core.add_request("a", TokenId::list([1, 2, 3]), SamplingParams::greedy(1)).unwrap();
//! let plan = core.schedule();
//! let sampled = plan
//!     .reqs
//!     .iter()
//!     .filter(|r| r.sample.is_some())
//!     .map(|r| SampledToken { req: r.req, token: TokenId(42), logprob: 0.0, top_logprobs: vec![] })
//!     .collect();
//! let outputs = core.on_step_output(&plan, &ModelOutput { sampled, ..ModelOutput::default() }).unwrap();
//! assert_eq!(outputs[0].finished.as_ref().unwrap().request_id, "a");
//! core.recycle_plan(plan);
//! assert!(core.check_ownership().is_ok());
//! ```

pub mod block_pool;
pub mod config;
pub mod connector;
pub mod driver;
pub mod hash;
pub mod holds;
pub mod ids;
pub mod kv_cache;
pub mod kv_events;
pub mod lifecycle;
pub mod lora;
pub mod offload;
pub mod owner;
pub mod ownership;
pub mod pd;
pub mod peers;
pub mod plan;
pub mod request;
pub mod sampling;
pub mod scheduler;

pub use config::{ConfigError, SchedulerConfig};
pub use connector::{
    prompt_hash, AllocatedLoad, ComputedBlocks, ExternalMatch, ExternalQuery, FetchCancel,
    FetchEnd, FetchError, FetchFailure, FinishedRequest, HostCopy, ImportSpec, KvConnector,
    KvLoadFailurePolicy, KvTransferParams, LoadOutcome, LoadResult, MissingParam, NewRequest,
    PdJob, PdReport, StepWork, StoreHolds, TierJob, TierReport, TierStats, TransferParamsError,
    TransferRequest, Unpublished, WorkerJob, WorkerReport,
};
pub use driver::{Step, StepDriver, StepError, StepFailure, StepKind, StepModel, WorkPhase};
pub use holds::{HoldKind, Holder};
pub use ids::{BlockId, ConnectorId, LoraId, ReqIdx, TokenId, TransferId};
pub use kv_events::{KvEvent, KvEventBatch, Medium};
pub use lifecycle::{
    LifecycleError, LifecycleEvent, LifecycleStatus, OpId, PauseMode, SleepLevel, WakeTag,
    WeightResidency,
};
pub use lora::{LoraError, LoraKey, LoraRef, LoraTag};
pub use offload::{
    OffloadConfig, OffloadConfigError, OffloadConnector, OffloadPolicy, UnknownPolicy,
};
pub use ownership::{BlockStatus, Owner, OwnershipError};
pub use pd::{PdConfig, PdConnector, PdRole};
pub use peers::{ip_literal, AllowedPeers, IpNet, PeerError};
pub use plan::{
    mask_allows, AdjustedToken, ExpertRouting, LogitsAdjust, ModelOutput, PromptLogprobs,
    PromptLogprobsWork, PromptTokenLogprob, RoutedExperts, RoutingRead, RoutingShape, SampleSpec,
    SampledToken, ScheduledReq, StepPlan, TokenMask,
};
pub use request::{AddError, FinishReason, Request, RequestState};
pub use sampling::{LogitsParams, SamplerSpec, SamplingParams};
pub use scheduler::{
    Cleared, Finished, OutputError, QueueError, RequestOutput, Scheduler, SchedulerStats,
    TransferError,
};
