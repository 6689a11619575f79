//! The caller's side: `spawn` starts the engine thread; [`EngineHandle`] queues inputs and
//! reads the published stats.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use ferry_core::{
    KvEventBatch, OffloadConfig, OffloadConnector, PdConfig, PdConnector, Scheduler,
    SchedulerConfig, StepError,
};
use ferry_kv::{OffloadWorker, PdWorker, Transport};
use ferry_model::ExecError;
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, oneshot, watch, Semaphore, TryAcquireError};

use crate::connector::Connector;
use crate::constraint::{ConstraintError, Constraints};
use crate::engine::EngineLoop;
use crate::input::{AddInput, Input, QueueSlot, Queued, Utility};
use crate::stream::{GenerateStream, StreamSetup};
use crate::{EngineConfig, EngineStats, GenerateError, GenerateRequest, SpawnError, Stopped};

/// Starts the engine thread. It owns the core, the executor and the KV arena (sized from
/// `config.scheduler.n_blocks` and `executor.kv_layout`). The tokenizer (if any) is shared
/// with callers for detokenizing and stop strings.
pub fn spawn(
    config: EngineConfig,
    executor: Box<dyn ferry_model::Executor>,
    tokenizer: Option<Arc<Tokenizer>>,
) -> Result<EngineHandle, SpawnError> {
    spawn_with_connectors(config, executor, tokenizer, Vec::new())
}

/// The connectors ferry-kv's workers serve. Here, with the handle that starts them, not in
/// `connector.rs`: their workers run transports and copier threads, which the engine core
/// and what it imports never name (`ferry-lint`'s `tests/sans_io.rs`).
impl Connector {
    /// The P/D connector over `transport`, both sides.
    pub fn pd(config: PdConfig, transport: Arc<dyn Transport>) -> Self {
        let worker = PdWorker::new(config.engine_id.clone(), transport);
        Self::new(Box::new(PdConnector::new(config)), Box::new(worker))
    }

    /// The CPU offload tier, both sides: its index in the core, its copier thread here.
    /// `config.block_bytes` must be the executor's (`KvLayout::block_bytes`), and the config
    /// valid (`OffloadConfig::validate`); fails only if the copier thread cannot start.
    pub fn offload(config: OffloadConfig) -> std::io::Result<Self> {
        let worker = OffloadWorker::new(config.n_host_blocks(), config.block_bytes)?;
        Ok(Self::new(
            Box::new(OffloadConnector::new(config)),
            Box::new(worker),
        ))
    }
}

/// 32 random bytes from the OS's generator: the secret a P/D connector keys its export tokens
/// with, so a token is unguessable. An OS without a working generator cannot serve P/D safely:
/// that is a panic at start, never a weak secret.
pub fn random_secret() -> [u8; 32] {
    let mut out = [0u8; 32];
    getrandom::fill(&mut out).expect("the operating system's random number generator failed");
    out
}

/// [`spawn`] with KV connectors (P/D transfer, offload tier), in order: the core drives them,
/// every cache reset waits for their transfers to hand blocks back, and their workers report
/// on the engine's input queue.
pub fn spawn_with_connectors(
    config: EngineConfig,
    executor: Box<dyn ferry_model::Executor>,
    tokenizer: Option<Arc<Tokenizer>>,
    connectors: Vec<Connector>,
) -> Result<EngineHandle, SpawnError> {
    if config.input_queue_capacity == 0 {
        return Err(SpawnError::ZeroQueueCapacity);
    }
    let mut core = Scheduler::new(config.scheduler.clone())?;
    // Checked here, so a shape the core refuses is the caller's error, not a panic on the
    // engine thread (the engine core sets it again, from the same executor).
    let routing_shape = executor.routing_shape();
    core.set_routing_shape(routing_shape)?;
    let vocab_size = executor.vocab_size();
    let (tx, rx) = mpsc::unbounded_channel();
    let (stats_tx, stats_rx) = watch::channel(EngineStats {
        running: true,
        n_blocks_total: config.scheduler.n_blocks as usize,
        weight_version: config.scheduler.weight_version.clone(),
        ..EngineStats::default()
    });
    let weight_preparer = executor.weight_ops().preparer();
    let (kv_tx, kv_rx) = if config.scheduler.kv_events {
        let (tx, rx) = mpsc::unbounded_channel();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let engine = EngineLoop::new(
        core,
        executor,
        rx,
        stats_tx,
        connectors,
        tx.downgrade(),
        kv_tx,
    )
    .map_err(SpawnError::Thread)?;
    let (engine, loras) = engine.with_lora(config.lora.clone());
    let thread = std::thread::Builder::new()
        .name("ferry-engine".into())
        .spawn(move || engine.run())
        .map_err(SpawnError::Thread)?;
    Ok(EngineHandle {
        inner: Arc::new(Inner {
            tx,
            permits: Arc::new(Semaphore::new(config.input_queue_capacity)),
            capacity: config.input_queue_capacity,
            vocab_size,
            routing_shape,
            stats: stats_rx,
            tokenizer,
            scheduler_config: config.scheduler,
            weight_preparer,
            thread: Mutex::new(Some(thread)),
            stopped: AtomicBool::new(false),
            n_queued: Arc::new(AtomicUsize::new(0)),
            constraints: OnceLock::new(),
            kv_events: Mutex::new(kv_rx),
            lora: config.lora,
            loras,
        }),
    })
}

/// Cheap to clone; usable from any tokio task.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

struct Inner {
    tx: mpsc::UnboundedSender<Queued>,
    /// The queue's bound for adds and utility calls (see `input.rs`).
    permits: Arc<Semaphore>,
    capacity: usize,
    /// The executor's: prompt tokens must be below it.
    vocab_size: usize,
    /// The executor's (`Executor::routing_shape`).
    routing_shape: Option<ferry_core::RoutingShape>,
    stats: watch::Receiver<EngineStats>,
    tokenizer: Option<Arc<Tokenizer>>,
    scheduler_config: SchedulerConfig,
    /// Checks and converts weight updates off the engine thread.
    weight_preparer: Arc<dyn ferry_model::WeightPreparer>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Set by the first `shutdown`.
    stopped: AtomicBool,
    /// Inputs queued and not yet taken (see `QueueSlot`).
    n_queued: Arc<AtomicUsize>,
    /// The structured-output compiler, built at its first use (it indexes the vocabulary).
    constraints: OnceLock<Result<Arc<Constraints>, ConstraintError>>,
    /// The engine's KV event batches, for the one publisher that takes them.
    kv_events: Mutex<Option<mpsc::UnboundedReceiver<KvEventBatch>>>,
    /// LoRA adapters: the base and limits (`None`: refused), and those loaded now.
    lora: Option<crate::LoraSettings>,
    loras: crate::lora::LoraTable,
}

/// A request whose `Add` was sent: [`SentAdd::accepted`] awaits the engine's answer.
struct SentAdd {
    handle: EngineHandle,
    setup: StreamSetup,
    events_rx: mpsc::UnboundedReceiver<crate::Event>,
    accepted_rx: oneshot::Receiver<Result<(), ferry_core::AddError>>,
}

impl SentAdd {
    async fn accepted(self) -> Result<GenerateStream, GenerateError> {
        match self.accepted_rx.await {
            Ok(Ok(())) => Ok(self.handle.stream(self.setup, self.events_rx)),
            Ok(Err(e)) => Err(GenerateError::Rejected(e)),
            Err(_) => Err(self.handle.stopped().into()),
        }
    }

    /// Gives the request up: its stream, dropped unread, aborts it (an abort queued behind
    /// the request's `Add` reaches it whether or not it was accepted yet).
    fn abandon(self) {
        drop(self.handle.stream(self.setup, self.events_rx));
    }
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("capacity", &self.inner.capacity)
            .field("has_tokenizer", &self.inner.tokenizer.is_some())
            .field("stopped", &self.inner.stopped.load(Ordering::Relaxed))
            .finish()
    }
}

impl EngineHandle {
    /// Queues the request and resolves once the engine thread has accepted it (between two
    /// steps) or refused it. Errors: `Overloaded` (queue full, immediate), `Rejected`,
    /// `NoTokenizer`, `TokenOutOfVocabulary`, `Stopped`.
    ///
    /// A prompt token outside the executor's vocabulary never reaches the engine (the
    /// executor would fail the whole batch's step): `TokenOutOfVocabulary`.
    pub async fn generate(&self, req: GenerateRequest) -> Result<GenerateStream, GenerateError> {
        self.queue(req)?.accepted().await
    }

    /// [`Self::generate`] for several requests that belong together (the `n` choices of one
    /// prompt): all are checked, then sent as one message, so the engine thread takes them
    /// between the same two steps. That is what lets the choices of a P/D prompt share one
    /// KV load: a choice added after another had loaded and finished would find the export
    /// pulled already. A request refused before sending sends none (the error comes with
    /// its index); one the engine refuses aborts the others.
    pub async fn generate_all(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateStream>, (usize, GenerateError)> {
        let mut adds = Vec::with_capacity(reqs.len());
        let mut sent = Vec::with_capacity(reqs.len());
        let mut permit: Option<tokio::sync::OwnedSemaphorePermit> = None;
        for (i, req) in reqs.into_iter().enumerate() {
            // Nothing was sent yet: a refused request drops the others unsent.
            let (add, p, s) = self.prepare(req).map_err(|e| (i, e))?;
            match &mut permit {
                Some(all) => all.merge(p),
                None => permit = Some(p),
            }
            adds.push(add);
            sent.push(s);
        }
        // One message: the engine thread takes every choice between the same two steps,
        // however the threads are scheduled (sent one by one, a loaded machine let the engine
        // run a step, and the first choice's KV load, between two of them).
        self.send(Input::AddAll(adds), permit)
            .map_err(|e| (0, e.into()))?;
        let mut streams = Vec::with_capacity(sent.len());
        let mut failed = None;
        for (i, q) in sent.into_iter().enumerate() {
            if failed.is_some() {
                q.abandon();
                continue;
            }
            match q.accepted().await {
                Ok(stream) => streams.push(stream),
                Err(e) => failed = Some((i, e)),
            }
        }
        match failed {
            None => Ok(streams),
            Some(e) => Err(e),
        }
    }

    /// Checks and sends the request's `Add`; [`SentAdd::accepted`] awaits the engine's answer.
    fn queue(&self, req: GenerateRequest) -> Result<SentAdd, GenerateError> {
        let (add, permit, sent) = self.prepare(req)?;
        self.send(Input::Add(add), Some(permit))?;
        Ok(sent)
    }

    /// Checks the request and makes its `Add` (with its queue permit) and the receiving end,
    /// sending nothing.
    fn prepare(
        &self,
        req: GenerateRequest,
    ) -> Result<(AddInput, tokio::sync::OwnedSemaphorePermit, SentAdd), GenerateError> {
        let needs_text = req.detokenize || !req.stop.is_empty();
        if needs_text && self.inner.tokenizer.is_none() {
            return Err(GenerateError::NoTokenizer);
        }
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (accepted_tx, accepted_rx) = oneshot::channel();
        let setup = StreamSetup {
            request_id: req.request_id.clone(),
            n_prompt_tokens: req.prompt.len(),
            prompt_tail: prompt_tail(&req.prompt),
            want_logprobs: req.params.sampler.logprobs.is_some(),
            constrained: req.constraint.is_some(),
            stop: req.stop,
            detokenize: req.detokenize,
            tokenizer: self.inner.tokenizer.clone().filter(|_| needs_text),
            min_tokens: req.params.logits.min_tokens,
            keep_special_tokens: req.keep_special_tokens,
            include_stop_str_in_output: req.include_stop_str_in_output,
            routing: self.inner.routing_shape.is_some(),
        };
        if self.inner.tx.is_closed() || self.inner.permits.is_closed() {
            return Err(self.stopped().into());
        }
        let vocab_size = self.inner.vocab_size;
        if let Some(&token) = req.prompt.iter().find(|&&t| t.index() >= vocab_size) {
            return Err(GenerateError::TokenOutOfVocabulary { token, vocab_size });
        }
        let permit = self.permit()?;
        let add = AddInput {
            request_id: req.request_id,
            prompt: req.prompt,
            params: req.params,
            events: events_tx,
            accepted: accepted_tx,
            transfer: req.transfer.map(Box::new),
            constraint: req.constraint.map(Box::new),
            lora: req.lora,
        };
        let sent = SentAdd {
            handle: self.clone(),
            setup,
            events_rx,
            accepted_rx,
        };
        Ok((add, permit, sent))
    }

    fn stream(
        &self,
        setup: StreamSetup,
        events_rx: mpsc::UnboundedReceiver<crate::Event>,
    ) -> GenerateStream {
        GenerateStream::new(
            setup,
            events_rx,
            self.inner.tx.clone(),
            self.inner.stats.clone(),
        )
    }

    /// Aborts a live request (finish reason `abort`); unknown or finished ids are ignored.
    /// Never refused for a full queue.
    pub async fn abort(&self, request_id: &str) -> Result<(), Stopped> {
        self.send(Input::Abort(request_id.to_owned()), None)
    }

    /// The latest published snapshot (no round trip to the engine thread).
    /// The engine's KV event batches, in the order the cache changed: once, for the
    /// publisher; `None` if the engine was started without `SchedulerConfig::kv_events` or
    /// they were taken already.
    pub fn take_kv_events(&self) -> Option<mpsc::UnboundedReceiver<KvEventBatch>> {
        self.inner
            .kv_events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// The base and limits adapters are loaded under (`None`: this engine serves none).
    pub fn lora_settings(&self) -> Option<&crate::LoraSettings> {
        self.inner.lora.as_ref()
    }

    pub(crate) fn lora_table(&self) -> &crate::lora::LoraTable {
        &self.inner.loras
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.stats.borrow().clone()
    }

    /// The engine thread's failure (the message of its panic), once it failed: every call
    /// then fails with [`Stopped::Failed`] naming it.
    pub fn failure(&self) -> Option<String> {
        self.inner.stats.borrow().failure.clone()
    }

    /// What a call that found the engine thread gone returns: its failure, if it failed
    /// (published before it closed any channel), else that it was shut down.
    pub(crate) fn stopped(&self) -> Stopped {
        Stopped::from_failure(self.inner.stats.borrow().failure.as_deref())
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.inner.tokenizer.as_ref()
    }

    /// The structured-output compiler for this engine's tokenizer, built on the first call
    /// (tens of milliseconds for a 50k vocabulary: call it off the async threads). An error
    /// says why this model cannot take constraints (no tokenizer, no EOS token, a vocabulary
    /// llguidance does not read).
    pub fn constraints(&self) -> Result<Arc<Constraints>, ConstraintError> {
        self.inner
            .constraints
            .get_or_init(|| {
                let tokenizer = self.inner.tokenizer.clone().ok_or_else(|| {
                    ConstraintError::Unavailable("the model has no tokenizer".into())
                })?;
                let eos = *self
                    .inner
                    .scheduler_config
                    .eos_token_ids
                    .first()
                    .ok_or_else(|| {
                        ConstraintError::Unavailable("the model has no EOS token".into())
                    })?;
                Constraints::new(tokenizer, eos, self.inner.vocab_size).map(Arc::new)
            })
            .clone()
    }

    /// The shape of the expert routing every finish carries ([`crate::Finish::routing`]),
    /// when the executor captures it (`ferry serve --enable-return-routed-experts` on an
    /// MoE model).
    pub fn routing_shape(&self) -> Option<ferry_core::RoutingShape> {
        self.inner.routing_shape
    }

    /// The resolved scheduler config (block_size, max_model_len, eos ids, ...).
    pub fn scheduler_config(&self) -> &SchedulerConfig {
        &self.inner.scheduler_config
    }

    /// Inputs sent through a handle (adds, aborts, utility and lifecycle calls) and not yet
    /// taken by the engine thread.
    pub fn n_queued_inputs(&self) -> usize {
        self.inner.n_queued.load(Ordering::SeqCst)
    }

    /// Resolves once no request is live (a deferred reply). `Stopped` if the engine stops
    /// first. Like lifecycle calls, it takes no queue permit.
    pub async fn wait_idle(&self) -> Result<(), Stopped> {
        let (tx, rx) = oneshot::channel();
        self.send(Input::Utility(Utility::WaitIdle(tx)), None)?;
        rx.await.map_err(|_| self.stopped())
    }

    /// Runs the core's block-ownership and queue checks on the engine thread (between
    /// steps); the error names what is wrong. For tests and debugging.
    /// Takes no queue permit.
    pub async fn check_invariants(&self) -> Result<Result<(), StepError<ExecError>>, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.send(Input::Utility(Utility::CheckInvariants(tx)), None)?;
        rx.await.map_err(|_| self.stopped())
    }

    /// Aborts every live request (their streams end with `abort`), stops the engine thread
    /// and waits for it. Later calls return `Stopped`.
    pub async fn shutdown(&self) -> Result<(), Stopped> {
        if self.inner.stopped.swap(true, Ordering::SeqCst) {
            return Err(self.stopped());
        }
        // New adds fail with `Stopped` from now on.
        self.inner.permits.close();
        let (tx, rx) = oneshot::channel();
        // Shutdown takes no permit: it must get through a full queue.
        let sent = self.send(Input::Utility(Utility::Shutdown(tx)), None);
        if sent.is_ok() {
            // An error means the thread ended anyway (it drops the reply only by exiting).
            let _ = rx.await;
        }
        let thread = self
            .inner
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(thread) = thread {
            // The reply is the thread's last act, so this join does not block for long.
            if thread.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
        Ok(())
    }

    pub(crate) fn weight_preparer(&self) -> Arc<dyn ferry_model::WeightPreparer> {
        self.inner.weight_preparer.clone()
    }

    /// Queues an input that takes no permit (aborts, lifecycle calls, shutdown).
    pub(crate) fn send_utility_unbounded(&self, input: Input) -> Result<(), Stopped> {
        self.send(input, None)
    }

    fn permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, GenerateError> {
        self.inner
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|e| match e {
                TryAcquireError::NoPermits => GenerateError::Overloaded {
                    capacity: self.inner.capacity,
                },
                TryAcquireError::Closed => self.stopped().into(),
            })
    }

    fn send(
        &self,
        input: Input,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<(), Stopped> {
        self.inner
            .tx
            .send(Queued {
                input,
                permit,
                slot: Some(QueueSlot::new(&self.inner.n_queued)),
            })
            .map_err(|_| self.stopped())
    }
}

/// Prompt tokens given to the detokenizer as context, so the first output token decodes as
/// it would after the prompt (SentencePiece drops a leading space at the start of a text).
fn prompt_tail(prompt: &[ferry_core::TokenId]) -> Vec<ferry_core::TokenId> {
    const N_CONTEXT: usize = 6;
    prompt[prompt.len().saturating_sub(N_CONTEXT)..].to_vec()
}
