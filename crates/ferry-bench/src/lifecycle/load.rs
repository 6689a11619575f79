//! The request load the lifecycle benchmark runs under: greedy requests streamed through an
//! in-process engine, each read by its own task that timestamps what arrives.
//!
//! Times are taken when a reader task sees a chunk. The benchmark runs on a current-thread
//! tokio runtime, where tasks woken by the engine thread run in the order they were woken; a
//! lifecycle call whose reply is awaited in a spawned task (see `timed_call`) is therefore
//! observed after every output the engine sent before the reply. A reader that gets the CPU
//! late (a loaded machine) stamps its output late, which can only make the "after the step in
//! flight" figures smaller, never the call-to-reply ones.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry_core::{FinishReason, SamplingParams, TokenId};
use ferry_engine::{EngineHandle, GenerateRequest, GenerateStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Longest the benchmark waits for the load to reach a state: far above a drain on two cores,
/// low enough that a stuck engine ends the run with an error rather than a hang.
pub const WAIT_LIMIT: Duration = Duration::from_secs(900);

/// What to send.
#[derive(Debug, Clone, Copy)]
pub struct LoadSpec {
    pub n_requests: usize,
    pub prompt_len: usize,
    pub output_len: u32,
    /// Makes this load's prompts differ from every other load's (no prefix-cache hits).
    pub salt: usize,
    pub vocab_size: usize,
}

/// What the readers have seen so far.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Output tokens per request, in request order.
    pub n_tokens: Vec<u64>,
    pub finished: Vec<bool>,
    pub last_token: Option<Instant>,
    pub last_finish: Option<Instant>,
    /// The first request that ended other than by reaching `max_tokens`.
    pub bad_finish: Option<String>,
}

impl Snapshot {
    pub fn n_tokens_total(&self) -> u64 {
        self.n_tokens.iter().sum()
    }

    /// Every request has finished or produced a token since `earlier`.
    fn all_advanced_since(&self, earlier: &Snapshot) -> bool {
        (0..self.n_tokens.len()).all(|i| {
            self.finished[i] || self.n_tokens[i] > earlier.n_tokens.get(i).copied().unwrap_or(0)
        })
    }
}

#[derive(Debug, Default)]
struct Tracker {
    seen: Mutex<Snapshot>,
    progress: Notify,
}

impl Tracker {
    fn seen(&self) -> MutexGuard<'_, Snapshot> {
        // A reader that panicked leaves counts that are still meaningful.
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running load: its requests and their readers.
#[derive(Debug)]
pub struct Load {
    tracker: Arc<Tracker>,
    readers: Vec<JoinHandle<()>>,
}

impl Load {
    /// Queues every request (each is accepted before the next is sent) and starts its reader.
    pub async fn start(engine: &EngineHandle, spec: LoadSpec) -> anyhow::Result<Self> {
        let tracker = Arc::new(Tracker::default());
        {
            let mut seen = tracker.seen();
            seen.n_tokens = vec![0; spec.n_requests];
            seen.finished = vec![false; spec.n_requests];
        }
        let mut readers = Vec::with_capacity(spec.n_requests);
        for i in 0..spec.n_requests {
            let request_id = format!("bench-{}-{i}", spec.salt);
            let stream = engine
                .generate(GenerateRequest {
                    request_id: request_id.clone(),
                    prompt: prompt(&spec, i),
                    params: SamplingParams::greedy(spec.output_len),
                    stop: Vec::new(),
                    detokenize: false,
                    transfer: None,
                    constraint: None,
                    ..GenerateRequest::default()
                })
                .await
                .with_context(|| format!("queueing request {request_id}"))?;
            readers.push(tokio::spawn(read(stream, i, tracker.clone())));
        }
        Ok(Self { tracker, readers })
    }

    pub fn snapshot(&self) -> Snapshot {
        self.tracker.seen().clone()
    }

    /// Waits until every request has produced a token since `earlier` (or finished).
    pub async fn wait_all_advanced(&self, earlier: &Snapshot, what: &str) -> anyhow::Result<()> {
        let wait = async {
            loop {
                // Created before the check, so a chunk seen in between still wakes us.
                let progressed = self.tracker.progress.notified();
                if self.snapshot().all_advanced_since(earlier) {
                    return;
                }
                progressed.await;
            }
        };
        tokio::time::timeout(WAIT_LIMIT, wait)
            .await
            .with_context(|| format!("timed out after {WAIT_LIMIT:?} waiting for {what}"))
    }

    /// Waits for every request to finish; fails if one ended other than by `max_tokens`.
    pub async fn finish(self) -> anyhow::Result<Snapshot> {
        let join = async {
            for reader in self.readers {
                reader.await.context("a request reader task failed")?;
            }
            anyhow::Ok(())
        };
        tokio::time::timeout(WAIT_LIMIT, join)
            .await
            .with_context(|| format!("timed out after {WAIT_LIMIT:?} waiting for the load"))??;
        let seen = self.tracker.seen().clone();
        if let Some(bad) = &seen.bad_finish {
            bail!("{bad}");
        }
        Ok(seen)
    }
}

/// Prompt `i` of a load: distinct token ids per request and per load, below the vocabulary.
fn prompt(spec: &LoadSpec, i: usize) -> Vec<TokenId> {
    let vocab = spec.vocab_size.max(1);
    (0..spec.prompt_len)
        .map(|j| TokenId(((spec.salt * 104_729 + i * 7919 + j * 31 + 1) % vocab) as u32))
        .collect()
}

/// Reads one request's stream to its end, recording when each chunk arrived.
async fn read(mut stream: GenerateStream, i: usize, tracker: Arc<Tracker>) {
    while let Some(chunk) = stream.next().await {
        let now = Instant::now();
        {
            let mut seen = tracker.seen();
            if !chunk.token_ids.is_empty() {
                seen.n_tokens[i] += chunk.token_ids.len() as u64;
                seen.last_token = Some(now);
            }
            if let Some(finish) = &chunk.finish {
                seen.finished[i] = true;
                seen.last_finish = Some(now);
                if finish.reason != FinishReason::Length && seen.bad_finish.is_none() {
                    seen.bad_finish = Some(format!(
                        "request {} finished with `{}` after {} tokens; the benchmark expects \
                         every request to reach its max_tokens",
                        stream.request_id(),
                        finish.reason.as_str(),
                        finish.n_output_tokens
                    ));
                }
            }
        }
        tracker.progress.notify_waiters();
    }
}
