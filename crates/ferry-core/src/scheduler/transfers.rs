//! The scheduler's transfer holds, as its callers see them: holding a request's blocks for a
//! transfer, releasing a hold, asking about one, and ending every transfer (part of a cache
//! reset). The holds themselves, their ids and leases, are `crate::holds`.

use super::Scheduler;
use crate::holds::{HoldKind, Holder, Lease};
use crate::ids::{BlockId, ConnectorId, ReqIdx, TransferId};

/// Why a transfer hold could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    #[error("no live request {0:?} to hold blocks of")]
    UnknownRequest(ReqIdx),
    #[error("request {id:?} holds no KV blocks to transfer")]
    NoBlocks { id: String },
    #[error("no connector {0:?} is registered to own the hold")]
    UnknownConnector(ConnectorId),
}

impl Scheduler {
    /// Holds a live request's blocks for a transfer (an export for a remote reader): the blocks
    /// stay allocated after the request finishes or is preempted, until `holder` frees them
    /// (see [`Holder`]). Call it before the request's final output is fed back (its handle is
    /// freed then).
    pub fn hold_blocks_for_transfer(
        &mut self,
        req: ReqIdx,
        holder: Holder,
    ) -> Result<TransferId, TransferError> {
        self.check_holder(holder)?;
        let r = self
            .request(req)
            .ok_or(TransferError::UnknownRequest(req))?;
        if r.blocks.is_empty() {
            return Err(TransferError::NoBlocks { id: r.id.clone() });
        }
        let blocks = r.blocks.clone();
        let kind = match holder {
            Holder::Caller => HoldKind::Caller,
            Holder::Connector(_) => HoldKind::Export,
        };
        let pool = self.kv.pool_mut();
        Ok(self
            .holds
            .open_referencing(pool, blocks, holder, kind, Lease::Unbounded))
    }

    fn check_holder(&self, holder: Holder) -> Result<(), TransferError> {
        match holder {
            Holder::Connector(c) if c.0 as usize >= self.connectors.len() => {
                Err(TransferError::UnknownConnector(c))
            }
            _ => Ok(()),
        }
    }

    /// Marks a live request so that when it finishes (other than by abort) its blocks go to a
    /// new transfer hold the caller frees (`release_transfer`) instead of being freed;
    /// `Finished::transfer` names the hold. Connectors export through
    /// `KvConnector::request_finished` instead.
    pub fn hold_kv_on_finish(&mut self, req: ReqIdx) -> Result<(), TransferError> {
        let r = self
            .requests
            .get_mut(req.0 as usize)
            .and_then(Option::as_mut)
            .ok_or(TransferError::UnknownRequest(req))?;
        r.export_on_finish = true;
        Ok(())
    }

    /// Ends a transfer hold, freeing its blocks tail first. False, changing nothing, if `id`
    /// is not held: not a bug here, since a cache reset releases a caller's holds itself (and a
    /// caller's hold whose lease ran out is released at once), so a caller may name a hold
    /// that has already ended. Within the core, holds are ended by [`Scheduler::end_transfer`],
    /// which takes such a second release for the bug it is there.
    pub fn release_transfer(&mut self, id: TransferId) -> bool {
        self.holds.release_if_open(id, self.kv.pool_mut())
    }

    /// `holder` ends hold `id`, which the core itself found open and held by `holder` (a
    /// connector's report, a reset, a lease): panics, naming the hold, if it is not.
    pub(crate) fn end_transfer(&mut self, id: TransferId, holder: Holder) {
        self.holds.release(id, holder, self.kv.pool_mut());
    }

    /// The blocks a transfer holds, in block-table order.
    pub fn transfer_blocks(&self, id: TransferId) -> Option<&[BlockId]> {
        self.holds.get(id).map(|h| &h.blocks[..])
    }

    /// Who frees a transfer hold.
    pub fn transfer_holder(&self, id: TransferId) -> Option<Holder> {
        self.holds.get(id).map(|h| h.holder)
    }

    /// Transfer holds, in id order.
    pub fn transfer_ids(&self) -> impl Iterator<Item = TransferId> + '_ {
        self.holds.iter().map(|(id, _)| id)
    }

    /// Asks every connector to end its transfers (`abort_transfers`); their blocks come back
    /// as the connectors report them ended. Holds the caller owns ([`Holder::Caller`]) have
    /// no connector to report them and no reader a connector could tell, so they are
    /// released at once. Touches only KV that transfers hold.
    pub fn release_transfer_kv(&mut self) {
        for id in self.holds.held_by(Holder::Caller) {
            self.end_transfer(id, Holder::Caller);
        }
        for c in &mut self.connectors {
            c.abort_transfers();
        }
    }
}
