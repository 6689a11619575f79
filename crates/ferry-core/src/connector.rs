//! The scheduler-side connector trait: what the lifecycle needs from anything that holds KV
//! blocks outside the running batch (a P/D transfer, an offload tier).
//!
//! A connector's transfers hold blocks through the scheduler's transfer holds
//! ([`crate::Scheduler::hold_blocks_for_transfer`]); the connector only says which of its
//! transfers ended, and the scheduler frees their blocks. That keeps every block's owner in
//! the scheduler's ledger, so a reset that waits always knows what it waits for.

use crate::ownership::TransferId;

/// The lifecycle's view of a connector. Sans-IO like the rest of the core: a connector records
/// what it must do and its worker side (in `ferry-kv`) does it.
pub trait KvConnector: Send + std::fmt::Debug {
    /// A short name for logs and errors (`"p2p"`, `"offload"`).
    fn name(&self) -> &str;

    /// Ends every transfer: revokes exports (tells readers they are gone), cancels loads in
    /// flight. Blocks come back later through [`KvConnector::take_finished_transfers`], once
    /// nothing can still write into them. Called once per cache reset.
    fn abort_transfers(&mut self);

    /// Transfers that ended since the last call (completed, failed or revoked); the scheduler
    /// frees their blocks.
    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>);

    /// Work that needs the engine to keep stepping even with no request to compute (a flush
    /// set not yet handed to the workers, a revoked transfer not yet acknowledged).
    fn has_pending_work(&self) -> bool;

    /// Drops the connector's own cache (an offload tier's index). Re-entrant: a second call
    /// before the next step only adds to what the first one did.
    fn reset_cache(&mut self);
}
