//! The basic ids every other module names: tokens, KV blocks, live requests, transfer holds
//! and connectors.
//!
//! They are here, in a module that imports nothing, so that any module can name them without
//! importing the module whose job they serve (and so without an import loop: the plan, the
//! ownership ledger, the connectors and requests all name blocks and holds).

pub type TokenId = u32;

/// Index of a KV block in the arena. Block 0 is the null block: never allocated to a request,
/// used as padding.
pub type BlockId = u32;

/// Handle of a live request inside the core (a slab index). Valid from `add_request` until the
/// request's finished output has been returned; then the slot may be reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReqIdx(pub u32);

/// Identifies a transfer hold (an export for a remote reader, or an import being written);
/// handed out by the holds table when it opens the hold (`holds.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferId(pub u64);

/// Names a registered connector: its index in registration order (`Scheduler::add_connector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnectorId(pub u32);
