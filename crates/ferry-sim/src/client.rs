//! Clients and the proxy between them and the engines: where each request is, and how it
//! ended. The proxy's rules are `ferry-proxy`'s (`generate.rs`): prefill on P with
//! `max_tokens: 1` and an export asked for, then decode on D with P's parameters; P aborted
//! the request: the client's answer is that abort; P exported nothing otherwise: D computes
//! the prompt itself; an engine that is down or dies answers the client with an error.

use std::time::Duration;

use ferry_core::{FinishReason, TokenId, TransferId, TransferRequest};

use crate::schedule::{Route, Side};

/// Lengths of the shared prompt prefixes (index 0: none); not all block-aligned.
pub const PREFIX_LENS: [usize; 4] = [0, 8, 13, 20];

/// Where a request is now.
#[derive(Debug, Clone)]
pub enum Stage {
    /// On an engine (`incarnation` of `side`), as the request of this client.
    On {
        side: Side,
        incarnation: u32,
    },
    /// Between P and D, in the proxy, until `due`.
    Proxy {
        due: Duration,
        /// P's returned parameters, parsed as D's edge parses them.
        kv: Option<TransferRequest>,
    },
    Ended,
}

/// How the client's request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Finished(FinishReason),
    /// An error answer (engine down or dead, a failed load under `fail`, a refusal).
    Failed(String),
    /// The client went away first.
    Disconnected,
}

/// One client request.
#[derive(Debug, Clone)]
pub struct Client {
    pub id: String,
    pub route: Route,
    pub prompt: Vec<TokenId>,
    pub max_tokens: u32,
    /// Under the structured-output constraint, on every engine it reaches.
    pub constrained: bool,
    /// The LoRA adapter it names, on every engine it reaches (each resolves the name itself).
    pub lora: Option<&'static str>,
    pub stage: Stage,
    pub tokens: Vec<TokenId>,
    pub end: Option<End>,
    /// Per engine, the count of abort causes (abort calls, aborting pauses and sleeps) when
    /// the request reached it: an abort with no cause since is a lost request.
    pub abort_causes_at_add: [u64; 2],
    /// The holds D loaded this request's prompt through (P/D imports and tier loads): what
    /// the network says touched them tells a fault it injected from one the engine made up.
    pub d_holds: Vec<TransferId>,
    /// D's pauses (pause and sleep calls) when the request reached D, and whether D was
    /// paused then: an export whose lease ran out while D ran normally is a fault, one that
    /// ran out while the request waited behind a pause is the lifecycle's (it computes).
    pub d_pauses_at_add: u64,
    pub d_paused_at_add: bool,
}

impl Client {
    /// The prompt for a client `n`: a shared prefix, then tokens of its own.
    pub fn prompt(n: usize, prefix: u8, extra: u8) -> Vec<TokenId> {
        let k = usize::from(prefix) % PREFIX_LENS.len();
        let mut prompt: Vec<TokenId> = (0..PREFIX_LENS[k] as u32)
            .map(|i| TokenId(1_000 * k as u32 + i))
            .collect();
        prompt
            .extend((0..u32::from(extra)).map(|i| TokenId(20_000 + (n as u32 * 13 + i) % 29_000)));
        prompt
    }

    pub fn is_live(&self) -> bool {
        self.end.is_none()
    }

    /// The engine the request is on, if any.
    pub fn engine(&self) -> Option<(Side, u32)> {
        match self.stage {
            Stage::On { side, incarnation } => Some((side, incarnation)),
            _ => None,
        }
    }

    /// Whether `side`'s answer is the client's (D's, or a direct request's engine), rather
    /// than P's prefill.
    pub fn answers_from(&self, side: Side) -> bool {
        match self.route {
            Route::Disaggregated => side == Side::D,
            Route::Direct(s) => s == side,
        }
    }
}
