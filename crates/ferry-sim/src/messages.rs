//! What moves between the simulation and its engines: inputs in the engine's queue, the events
//! it tells the outside world, and worker reports on their way back to it.

use std::sync::{Arc, Mutex};

use ferry_core::{
    ConnectorId, FinishReason, KvTransferParams, SamplingParams, TokenId, TransferRequest,
    WorkerReport,
};
use ferry_engine::{Constraint, NewRequest};

use crate::schedule::{OpKind, Side};

/// A worker report on its way to an engine's input queue.
#[derive(Debug)]
pub struct Mail {
    pub side: Side,
    pub incarnation: u32,
    pub connector: ConnectorId,
    pub report: WorkerReport,
}

/// Where every worker's reports go, for the simulation to hand to the right engine.
pub type Mailbox = Arc<Mutex<Vec<Mail>>>;

/// An engine's input, as `ferry-engine`'s input queue carries it.
#[derive(Debug)]
pub enum Input {
    Add(Box<NewRequest>),
    Abort(String),
    Report(ConnectorId, WorkerReport),
    /// A lifecycle call; `op` is the simulation's id for its reply.
    Op {
        op: u64,
        kind: OpKind,
        version: String,
    },
}

impl Input {
    /// A greedy request, as the server's edge hands it to the engine: `kv` is what it asks of
    /// the P/D transfer, `constraint` its structured output, `lora` the adapter it names.
    pub fn add(
        id: &str,
        prompt: &[TokenId],
        max_tokens: u32,
        kv: Option<TransferRequest>,
        constraint: Option<Constraint>,
        lora: Option<&str>,
    ) -> Self {
        Self::Add(Box::new(NewRequest {
            request_id: id.to_owned(),
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(max_tokens),
            transfer: kv,
            constraint,
            lora: lora.map(Into::into),
        }))
    }
}

/// What an engine tells the outside world.
#[derive(Debug)]
pub enum Event {
    Token {
        id: String,
        token: TokenId,
        /// The version of the request's adapter that computed it (`None`: the base model).
        lora_version: Option<u64>,
    },
    Finished {
        id: String,
        reason: FinishReason,
        kv: Option<KvTransferParams>,
        message: Option<String>,
    },
    Refused {
        id: String,
        message: String,
        /// Refused for naming an adapter not loaded (`AddError::UnknownLora`, a 404).
        unknown_lora: bool,
    },
    Reply {
        op: u64,
        result: Result<(), String>,
    },
}
