//! Shared by the engine tests: engine construction, a stream collector, and executor
//! wrappers that record, gate or fail steps.

#![allow(dead_code)] // each test binary uses a different subset

use ferry_core::{FinishReason, SchedulerConfig, TokenId};
use ferry_engine::{spawn, EngineConfig, EngineHandle, Finish, GenerateStream, OutputChunk};
use ferry_model::{ChecksumModel, Executor};

pub const VOCAB: usize = 1000;

/// A small scheduler config for the checksum model.
pub fn small_config(n_blocks: u32, max_num_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        n_blocks,
        max_num_seqs,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        ..SchedulerConfig::default()
    }
}

pub fn checksum() -> ChecksumModel {
    ChecksumModel::new("v0", VOCAB).unwrap()
}

pub fn engine(executor: impl Executor + 'static, config: SchedulerConfig) -> EngineHandle {
    let config = EngineConfig {
        scheduler: config,
        input_queue_capacity: 64,
    };
    spawn(config, Box::new(executor), None).unwrap()
}

/// Everything one stream produced.
#[derive(Debug, Default)]
pub struct Collected {
    pub chunks: Vec<OutputChunk>,
    pub tokens: Vec<TokenId>,
    pub text: String,
    pub finish: Option<Finish>,
}

impl Collected {
    pub fn reason(&self) -> FinishReason {
        self.finish
            .as_ref()
            .expect("stream ended without a finish")
            .reason
    }
}

/// Reads a stream to its end; checks that exactly the last chunk carries the finish.
pub async fn collect(mut stream: GenerateStream) -> Collected {
    let mut c = Collected::default();
    while let Some(chunk) = stream.next().await {
        assert!(c.finish.is_none(), "a chunk after the finish");
        c.tokens.extend_from_slice(&chunk.token_ids);
        c.text.push_str(&chunk.text);
        c.finish = chunk.finish.clone();
        c.chunks.push(chunk);
    }
    assert!(c.finish.is_some(), "stream ended without a finish");
    c
}
