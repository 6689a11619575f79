//! What crosses from callers to the engine thread: the closed input enum and its queue (the
//! per-request events that come back are `event.rs`'s).
//!
//! The queue. Inputs travel on one unbounded tokio channel, and the *bound* is a semaphore of
//! `input_queue_capacity` permits: an add takes a permit with `try_acquire` (none left:
//! `Overloaded`, at once) and carries it until the engine thread takes it off the queue.
//! Aborts and utility calls (lifecycle calls, waits, checks, shutdown: each awaited by its
//! caller, so bounded by their number) take none. This keeps three properties a plain bounded channel plus a
//! side channel for aborts would make subtle:
//! * one queue, so every input, aborts included, is handled in arrival order;
//! * an abort is never refused or lost, even when the queue is full (a dropped stream must
//!   free its blocks); aborts are bounded anyway, at most one per stream drop or client call;
//! * the engine thread blocks on one receiver when idle (until an input or the core's next
//!   deadline), so no wake-up can be missed; connectors' workers report on the same queue;
//! * an abort by id sent before an add with the same id (a client retrying with its own
//!   request id after a disconnect) is always handled before that add, so it can never
//!   abort the newer request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferry_core::{
    AddError, ConnectorId, SamplingParams, StepError, TokenId, TransferRequest, WorkerReport,
};
use ferry_model::ExecError;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};

use crate::engine_core::{Call, CallResult};
use crate::event::Event;

/// A call's reply. The engine thread never sends "stopped": a reply it drops unanswered (it
/// stopped, or panicked) reads as [`crate::Stopped`] on the caller's side.
pub(crate) type Reply<T> = oneshot::Sender<T>;

/// One queued input with the permit it holds (none for aborts).
#[derive(Debug)]
pub(crate) struct Queued {
    pub input: Input,
    pub permit: Option<OwnedSemaphorePermit>,
    /// Counts the input as queued until the engine thread takes it (none for the aborts a
    /// dropped stream sends).
    pub slot: Option<QueueSlot>,
}

/// One queued input in [`crate::EngineHandle::n_queued_inputs`]'s count, for as long as it
/// lives (like a permit, but for every input, permit or not).
#[derive(Debug)]
pub(crate) struct QueueSlot(Arc<AtomicUsize>);

impl QueueSlot {
    pub fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Everything that can change the engine thread's state.
#[derive(Debug)]
pub(crate) enum Input {
    Add(AddInput),
    /// Requests added between the same two steps, in order (the `n` choices of one prompt:
    /// one message, so the engine thread cannot run a step between them).
    AddAll(Vec<AddInput>),
    /// Abort a live request by id; unknown or finished ids are ignored.
    Abort(String),
    Utility(Utility),
    /// A connector's worker reported (a transfer ended, a load landed): sent by transport and
    /// copier threads, so their results wake the engine and reach the core in order.
    Connector(ConnectorId, WorkerReport),
}

/// A request to add, with where its outputs go.
#[derive(Debug)]
pub(crate) struct AddInput {
    pub request_id: String,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    pub events: mpsc::UnboundedSender<Event>,
    /// Answered once the core accepted or refused the request. If the caller has gone by
    /// then, the engine aborts the request at once.
    pub accepted: oneshot::Sender<Result<(), AddError>>,
    /// What the request asks of the P/D transfer, for the connectors
    /// (`KvConnector::on_new_request`). Boxed: most requests ask nothing, and every input is
    /// as large as the largest.
    pub transfer: Option<Box<TransferRequest>>,
    /// The structured-output constraint (boxed for the same reason).
    pub constraint: Option<Box<crate::Constraint>>,
    /// The LoRA adapter it names (`GenerateRequest::lora`).
    pub lora: Option<std::sync::Arc<str>>,
}

/// Calls that carry their typed reply. A reply may be deferred until the engine reaches a
/// state (see `engine::Deferred`); a deferred reply always completes, with success or an
/// error.
#[derive(Debug)]
pub(crate) enum Utility {
    /// Abort everything, stop the loop; answered as the thread's last act.
    Shutdown(oneshot::Sender<()>),
    /// Answered once no request is live (deferred).
    WaitIdle(Reply<()>),
    /// The core's block-ownership and queue checks, for tests and debugging.
    CheckInvariants(oneshot::Sender<Result<(), StepError<ExecError>>>),
    /// A lifecycle call (takes no queue permit: they must get through a full queue), with
    /// where its answer goes.
    Lifecycle(Call, Reply<CallResult>),
}
