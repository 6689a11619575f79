//! How the engines of a run are set up: the scheduler's limits and the offload tier, drawn
//! per seed.

use std::time::Duration;

use ferry_core::{KvLoadFailurePolicy, OffloadPolicy, SchedulerConfig};

/// How the engines of a run are set up (drawn per seed).
#[derive(Debug, Clone)]
pub struct EngineSetup {
    pub sched: SchedulerConfig,
    /// The offload tier's capacity in engine blocks (none: no tier).
    pub tier_blocks: Option<usize>,
    pub tier_blocks_per_slot: usize,
    pub tier_policy: OffloadPolicy,
    /// Register the tier before the P/D connector (`--kv-connector offload,pd`).
    pub tier_first: bool,
}

impl EngineSetup {
    pub fn scheduler_config(
        block_size: usize,
        n_blocks: u32,
        policy: KvLoadFailurePolicy,
    ) -> SchedulerConfig {
        SchedulerConfig {
            block_size,
            n_blocks,
            max_num_seqs: 6,
            max_num_batched_tokens: 32,
            max_model_len: 64,
            weight_version: "w0".into(),
            export_lease: Duration::from_millis(1500),
            kv_load_timeout: Duration::from_millis(500),
            lifecycle_wait_timeout: Duration::from_millis(1000),
            kv_load_failure_policy: policy,
            ..SchedulerConfig::default()
        }
    }
}
