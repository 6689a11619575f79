//! Shared by the engine tests: engine construction, a stream collector, and executor
//! wrappers that record, gate or fail steps.

#![allow(dead_code)] // each test binary uses a different subset

use ferry_arena::{KvArena, KvLayout};
use ferry_core::{
    FinishReason, ModelOutput, SampledToken, SamplingParams, SchedulerConfig, StepPlan, TokenId,
};
use ferry_engine::{
    spawn, EngineConfig, EngineHandle, Finish, GenerateRequest, GenerateStream, OutputChunk,
};
use ferry_model::{ChecksumModel, ExecError, Executor, Hooked, ModelWeights, StepHook, Weightless};

pub const VOCAB: usize = 1000;

/// A small scheduler config for the checksum model.
pub fn small_config(n_blocks: u32, max_num_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        n_blocks,
        max_num_seqs,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        // The checksum model's (see `checksum()`).
        weight_version: "v0".into(),
        ..SchedulerConfig::default()
    }
}

pub fn checksum() -> ChecksumModel {
    ChecksumModel::new("v0", VOCAB).unwrap()
}

/// A greedy request for raw token ids.
pub fn request(id: &str, prompt: Vec<TokenId>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_owned(),
        prompt,
        params: SamplingParams::greedy(max_tokens),
        ..GenerateRequest::default()
    }
}

/// What the checksum model generates for `prompt` under `version` with intact KV.
pub fn oracle(version: &str, prompt: &[TokenId], n: usize) -> Vec<TokenId> {
    continue_with(version, prompt, &[], n)
}

/// Output continued under `version` after `done` tokens (all KV recomputed with `version`).
pub fn continue_with(
    version: &str,
    prompt: &[TokenId],
    done: &[TokenId],
    n: usize,
) -> Vec<TokenId> {
    let model = ChecksumModel::new(version, VOCAB).unwrap();
    let mut seq: Vec<TokenId> = prompt.iter().chain(done).copied().collect();
    let mut out = done.to_vec();
    while out.len() < n {
        let t = model.reference_next_token(&seq);
        seq.push(t);
        out.push(t);
    }
    out
}

pub fn engine(executor: impl Executor + 'static, config: SchedulerConfig) -> EngineHandle {
    let config = EngineConfig {
        scheduler: config,
        input_queue_capacity: 64,
        lora: None,
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

pub fn engine_with_capacity(
    executor: impl Executor + 'static,
    config: SchedulerConfig,
    capacity: usize,
) -> EngineHandle {
    let config = EngineConfig {
        scheduler: config,
        input_queue_capacity: capacity,
        lora: None,
    };
    spawn(config, Box::new(executor), None).unwrap()
}

/// What a gated executor saw in one step: per scheduled request, its first token this step
/// and how many tokens it computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    pub step: u64,
    pub reqs: Vec<(TokenId, usize)>,
}

/// Wraps an executor: announces each step on `entered` (with what it holds), then waits for
/// a release before running it. Once the test drops the release sender, steps run freely.
/// The engine thread is a plain thread, so blocking here is allowed; the test side awaits.
pub type Gated<E> = Hooked<E, GateHook>;

/// The engine's side of a [`Gated`] executor.
pub struct GateHook {
    entered: tokio::sync::mpsc::UnboundedSender<StepRecord>,
    release: tokio::sync::mpsc::UnboundedReceiver<()>,
}

/// The test's side of a [`Gated`] executor.
pub struct Gate {
    pub entered: tokio::sync::mpsc::UnboundedReceiver<StepRecord>,
    release: Option<tokio::sync::mpsc::UnboundedSender<()>>,
}

impl Gate {
    /// Waits until the engine is inside a step (blocked before the forward).
    pub async fn next_step(&mut self) -> StepRecord {
        self.entered.recv().await.expect("engine gone")
    }

    /// Lets the step the engine is in run.
    pub fn release(&self) {
        if let Some(tx) = &self.release {
            let _ = tx.send(());
        }
    }

    /// Lets every step run from now on.
    pub fn open(&mut self) {
        self.release = None;
    }
}

pub fn gated<E: Executor>(inner: E) -> (Gated<E>, Gate) {
    let (entered_tx, entered_rx) = tokio::sync::mpsc::unbounded_channel();
    let (release_tx, release_rx) = tokio::sync::mpsc::unbounded_channel();
    (
        Hooked {
            inner,
            hook: GateHook {
                entered: entered_tx,
                release: release_rx,
            },
        },
        Gate {
            entered: entered_rx,
            release: Some(release_tx),
        },
    )
}

impl StepHook for GateHook {
    fn before_step(&mut self, plan: &StepPlan) -> Result<(), ExecError> {
        let record = StepRecord {
            step: plan.step,
            reqs: plan
                .reqs
                .iter()
                .map(|r| (plan.tokens_of(r)[0], r.tokens.len()))
                .collect(),
        };
        let _ = self.entered.send(record);
        // `None`: the gate is open (or the test is gone); run freely.
        let _ = self.release.blocking_recv();
        Ok(())
    }
}

/// `inner`, failing the calls whose number (from 0) `fail` says.
pub fn failing<E: Executor>(inner: E, fail: fn(u64) -> bool) -> Hooked<E, FailHook> {
    Hooked {
        inner,
        hook: FailHook { n_calls: 0, fail },
    }
}

pub struct FailHook {
    n_calls: u64,
    fail: fn(u64) -> bool,
}

impl StepHook for FailHook {
    fn before_step(&mut self, _plan: &StepPlan) -> Result<(), ExecError> {
        let n = self.n_calls;
        self.n_calls += 1;
        if (self.fail)(n) {
            return Err(ExecError::InvalidPlan(format!("injected failure {n}")));
        }
        Ok(())
    }
}

/// An executor that answers a fixed token script: the `i`-th generated token of every
/// request is `script[i % len]`, with logprob 0. It writes no KV. For text tests where the
/// exact output (and so every token boundary) must be known.
pub struct Scripted {
    pub script: Vec<TokenId>,
    pub vocab_size: usize,
    pub weights: Weightless,
}

impl Executor for Scripted {
    fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 1,
            block_size,
            aux_floats: 0,
        }
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn weight_ops(&self) -> &dyn ModelWeights {
        &self.weights
    }

    fn weight_ops_mut(&mut self) -> &mut dyn ModelWeights {
        &mut self.weights
    }

    fn execute(&mut self, plan: &StepPlan, _kv: &mut KvArena) -> Result<ModelOutput, ExecError> {
        let sampled = plan
            .reqs
            .iter()
            .filter_map(|r| Some((r.req, r.sample?)))
            .map(|(req, spec)| {
                let token = self.script[spec.output_idx as usize % self.script.len()];
                let top = spec
                    .params
                    .logprobs
                    .map_or(Vec::new(), |_| vec![(token, 0.0)]);
                SampledToken {
                    req,
                    token,
                    logprob: 0.0,
                    top_logprobs: top,
                }
            })
            .collect();
        Ok(ModelOutput {
            sampled,
            ..ModelOutput::default()
        })
    }
}

/// Starts a reader task per request, the first alone; returns once the engine is held in
/// that request's first step with every other add queued behind it (so all of them are in
/// the engine at once when the gate opens).
pub async fn spawn_held(
    engine: &EngineHandle,
    gate: &mut Gate,
    reqs: Vec<GenerateRequest>,
) -> Vec<tokio::task::JoinHandle<Collected>> {
    let n = reqs.len();
    let mut tasks = Vec::new();
    for req in reqs {
        let e = engine.clone();
        tasks.push(tokio::spawn(async move {
            collect(e.generate(req).await.unwrap()).await
        }));
        if tasks.len() == 1 {
            gate.next_step().await;
        }
    }
    while engine.n_queued_inputs() < n - 1 {
        tokio::task::yield_now().await;
    }
    tasks
}
