//! The scheduler-side connector trait: what the lifecycle needs from anything that holds KV
//! blocks outside the running batch (a P/D transfer, an offload tier).
//!
//! A connector's transfers hold blocks through the scheduler's transfer holds
//! ([`crate::Scheduler::hold_blocks_for_transfer`], and exports made when a request finishes,
//! [`crate::Scheduler::hold_kv_on_finish`]), each owned by one [`Holder`]; the connector only
//! says which of *its* transfers ended, and the scheduler frees their blocks. That keeps every
//! block's owner in the scheduler's ledger, so a reset that waits always knows what it waits
//! for: holds a connector owns come back when it reports them, holds the caller owns (no
//! connector reads them) are released at once.

use crate::ownership::TransferId;

/// Names a registered connector: its index in registration order (`Scheduler::add_connector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnectorId(pub u32);

/// Who frees a transfer hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Holder {
    /// Whoever made the hold frees it with `Scheduler::release_transfer`; a cache reset
    /// releases it at once (no connector reads or writes its blocks).
    Caller,
    /// The connector frees it by reporting it in `take_finished_transfers`; a cache reset
    /// asks it to (`abort_transfers`) and waits.
    Connector(ConnectorId),
}

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
    /// frees their blocks. Only holds this connector owns are freed; other ids are ignored.
    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>);

    /// A request whose KV this connector asked to export (`Scheduler::hold_kv_on_finish`)
    /// finished: `transfer` now holds its blocks, owned by this connector, until it reports
    /// `transfer` finished (its reader pulled it, or `abort_transfers` revoked it).
    fn export_held(&mut self, transfer: TransferId, request_id: &str);

    /// Work that needs the engine to keep stepping even with no request to compute (a flush
    /// set not yet handed to the workers, a revoked transfer not yet acknowledged).
    fn has_pending_work(&self) -> bool;

    /// Drops the connector's own cache (an offload tier's index). Re-entrant: a second call
    /// before the next step only adds to what the first one did.
    fn reset_cache(&mut self);
}
