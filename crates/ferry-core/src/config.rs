//! Scheduler configuration, resolved once by the caller and validated here.

use std::time::Duration;

use crate::connector::KvLoadFailurePolicy;
use crate::ids::TokenId;

/// Everything the scheduler needs to know up front. Immutable after `Scheduler::new`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool, the null block (block 0) included.
    pub n_blocks: u32,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Most tokens computed in one step, over all requests.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Split long prefills over several steps; when off, a prompt is computed in one step.
    pub enable_chunked_prefill: bool,
    /// Tokens that end generation unless a request sets `ignore_eos`.
    pub eos_token_ids: Vec<TokenId>,
    /// The weight version at start: it seeds every prefix-cache hash chain until the first
    /// update. The current version lives with the rest of the lifecycle state
    /// (`Scheduler::weight_version`, `Scheduler::set_weight_version`).
    pub weight_version: String,
    /// How long an export (a finished request's KV held for a remote reader) lives: the
    /// lease of its hold (`holds.rs`). Once the engine's `now` passes it, the scheduler tells
    /// its connector (`KvConnector::hold_expired`), which stops serving it and hands its
    /// blocks back. A reader that never comes costs no more.
    pub export_lease: Duration,
    /// How long an asynchronous KV load may take before it counts as failed (its connector
    /// cancels it; `kv_load_failure_policy` decides for the request).
    pub kv_load_timeout: Duration,
    /// How long a clearing lifecycle operation (pause with `clear_cache`, sleep >= 1, KV
    /// release) waits for transfers to hand their blocks back and for connector work (a
    /// flush) to reach the workers; past it the operation fails with
    /// `LifecycleError::Timeout`, the engine stays paused, and the reset can be asked again.
    /// A `wait` pause's drain of running requests is not bounded by it.
    pub lifecycle_wait_timeout: Duration,
    /// What a failed (or refused) KV load does to its request: recompute from the first bad
    /// block, or finish it with an error (the default, as in vLLM). A load cut short by a
    /// reset is neither: the request recomputes after the resume.
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Journal the prefix cache's changes for KV events (`Scheduler::take_kv_events`).
    pub kv_events: bool,
    /// Most LoRA adapters computed in one step (`--max-loras`): requests of further adapters
    /// wait for a seat, which an adapter holds while any request of it runs; base requests
    /// need none. `None`: no limit (at least 1 when set).
    pub max_loras: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            n_blocks: 1024,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 8192,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            eos_token_ids: Vec::new(),
            weight_version: "0".to_owned(),
            export_lease: Duration::from_secs(30),
            kv_load_timeout: Duration::from_secs(30),
            lifecycle_wait_timeout: Duration::from_secs(60),
            kv_load_failure_policy: KvLoadFailurePolicy::Fail,
            kv_events: false,
            max_loras: None,
        }
    }
}

/// A configuration value the scheduler cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    #[error("n_blocks is {0}: need the null block and at least one usable block")]
    TooFewBlocks(u32),
    #[error("n_blocks is {0}: block ids from u32::MAX up are reserved")]
    TooManyBlocks(u32),
    #[error("max_num_seqs must be at least 1")]
    ZeroMaxNumSeqs,
    #[error("max_num_batched_tokens must be at least 1")]
    ZeroMaxNumBatchedTokens,
    #[error("max_loras is 0: a step must be able to compute at least one adapter (leave it unset for no limit)")]
    ZeroMaxLoras,
    #[error("max_model_len is {0}: must be at least 2 (one prompt token, one generated)")]
    MaxModelLenTooSmall(usize),
    #[error(
        "expert routing of {0:?}: needs at least one MoE layer, a top_k and an expert, and at \
         most {max} experts (ids are 16-bit)",
        max = u32::from(u16::MAX) + 1
    )]
    RoutingShape(crate::plan::RoutingShape),
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.n_blocks < 2 {
            return Err(ConfigError::TooFewBlocks(self.n_blocks));
        }
        if self.n_blocks == u32::MAX {
            return Err(ConfigError::TooManyBlocks(self.n_blocks));
        }
        if self.max_num_seqs == 0 {
            return Err(ConfigError::ZeroMaxNumSeqs);
        }
        if self.max_num_batched_tokens == 0 {
            return Err(ConfigError::ZeroMaxNumBatchedTokens);
        }
        if self.max_model_len < 2 {
            return Err(ConfigError::MaxModelLenTooSmall(self.max_model_len));
        }
        if self.max_loras == Some(0) {
            return Err(ConfigError::ZeroMaxLoras);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_bad_values_are_named() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
        let bad = |f: fn(&mut SchedulerConfig)| {
            let mut c = SchedulerConfig::default();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert_eq!(bad(|c| c.block_size = 0), ConfigError::ZeroBlockSize);
        assert_eq!(bad(|c| c.n_blocks = 1), ConfigError::TooFewBlocks(1));
        assert_eq!(bad(|c| c.max_num_seqs = 0), ConfigError::ZeroMaxNumSeqs);
        assert_eq!(
            bad(|c| c.max_num_batched_tokens = 0),
            ConfigError::ZeroMaxNumBatchedTokens
        );
        assert_eq!(
            bad(|c| c.max_model_len = 1),
            ConfigError::MaxModelLenTooSmall(1)
        );
        assert_eq!(bad(|c| c.max_loras = Some(0)), ConfigError::ZeroMaxLoras);
    }
}
