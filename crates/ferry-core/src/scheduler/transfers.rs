//! Lifecycle primitives on the scheduler: aborts, preempting everything, prefix-cache reset,
//! and transfer holds.
//!
//! These are what the lifecycle state machine (`control.rs`, which holds every piece of
//! lifecycle state) and P/D exports are built from. Each is immediate and holds no state of
//! its own beyond the holds.

use super::{RequestOutput, Scheduler};
use crate::connector::{ConnectorId, HoldKind, Holder};
use crate::ownership::TransferId;
use crate::plan::{BlockId, ReqIdx};
use crate::request::{FinishReason, RequestState};

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

/// A transfer hold: the blocks it keeps allocated, and who frees them.
#[derive(Debug)]
pub(crate) struct Hold {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) holder: Holder,
    pub(crate) kind: HoldKind,
    /// When the hold's lease runs out (exports); `None`: until its holder frees it (or its
    /// lease already ran out and its connector was told).
    pub(crate) expires_at: Option<std::time::Duration>,
}

/// Makes `Store` holds for one connector while it is asked about computed blocks
/// (`KvConnector::blocks_computed`), borrowing only what a hold touches.
pub(crate) struct HoldMaker<'a> {
    pub(crate) kv: &'a mut crate::kv_cache::KvCacheManager,
    pub(crate) transfers: &'a mut std::collections::BTreeMap<TransferId, Hold>,
    pub(crate) next_transfer: &'a mut u64,
    pub(crate) holder: Holder,
}

impl crate::connector::StoreHolds for HoldMaker<'_> {
    fn hold(&mut self, blocks: &[BlockId]) -> TransferId {
        for &b in blocks {
            self.kv.pool_mut().touch(b);
        }
        let id = TransferId(*self.next_transfer);
        *self.next_transfer += 1;
        self.transfers.insert(
            id,
            Hold {
                blocks: blocks.to_vec(),
                holder: self.holder,
                kind: HoldKind::Store,
                expires_at: None,
            },
        );
        id
    }
}

impl Scheduler {
    /// Finishes a live request as aborted, freeing its blocks (transfers holding some of them
    /// keep theirs). Unknown or finished ids are ignored (`None`).
    pub fn abort(&mut self, id: &str) -> Option<RequestOutput> {
        let idx = self.request_idx(id)?;
        self.remove_from_queues(idx);
        Some(self.aborted_output(idx))
    }

    /// Aborts every live request: running ones first, then waiting ones, each in queue order.
    pub fn abort_all(&mut self) -> Vec<RequestOutput> {
        let order: Vec<ReqIdx> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        order.into_iter().map(|r| self.aborted_output(r)).collect()
    }

    pub(super) fn remove_from_queues(&mut self, idx: ReqIdx) {
        match self.request(idx).map(|r| &r.state) {
            Some(RequestState::Running) => self.running.retain(|&r| r != idx),
            Some(
                RequestState::Waiting
                | RequestState::Preempted { .. }
                | RequestState::WaitingForRemoteKv { .. },
            ) => self.waiting.retain(|&r| r != idx),
            _ => {}
        }
    }

    fn aborted_output(&mut self, idx: ReqIdx) -> RequestOutput {
        let n_output_tokens = self.request(idx).map_or(0, |r| r.n_output_tokens());
        RequestOutput {
            req: idx,
            sampled: None,
            n_output_tokens,
            finished: Some(self.release_request(idx, FinishReason::Abort)),
        }
    }

    /// Preempts every running request (they recompute later), keeping queue order: they go
    /// back to the head of the waiting queue in admission order. Returns how many.
    pub fn preempt_all_running(&mut self) -> usize {
        let n = self.running.len();
        // Latest-admitted first, each pushed to the head: the earliest ends up first.
        while let Some(r) = self.running.pop() {
            self.preempt(r);
        }
        n
    }

    /// Drops every cached block hash. Returns false, changing nothing, while any block is held
    /// (by a running request or a transfer); never fails otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.pool_mut().reset_cache()
    }

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
        for &b in &blocks {
            self.kv.pool_mut().touch(b);
        }
        let kind = match holder {
            Holder::Caller => HoldKind::Caller,
            Holder::Connector(_) => HoldKind::Export,
        };
        Ok(self.new_transfer(blocks, holder, kind, None))
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

    /// Registers `blocks` (whose references the caller hands over) as a new transfer hold.
    pub(super) fn new_transfer(
        &mut self,
        blocks: Vec<BlockId>,
        holder: Holder,
        kind: HoldKind,
        expires_at: Option<std::time::Duration>,
    ) -> TransferId {
        let id = self.peek_transfer_id();
        self.next_transfer += 1;
        self.transfers.insert(
            id,
            Hold {
                blocks,
                holder,
                kind,
                expires_at,
            },
        );
        id
    }

    /// The id the next transfer hold will get.
    pub(super) fn peek_transfer_id(&self) -> TransferId {
        TransferId(self.next_transfer)
    }

    /// Ends a transfer hold, freeing its blocks tail first. False if `id` is not held.
    pub fn release_transfer(&mut self, id: TransferId) -> bool {
        let Some(hold) = self.transfers.remove(&id) else {
            return false;
        };
        for &b in hold.blocks.iter().rev() {
            self.kv.pool_mut().release(b);
        }
        true
    }

    /// The blocks a transfer holds, in block-table order.
    pub fn transfer_blocks(&self, id: TransferId) -> Option<&[BlockId]> {
        self.transfers.get(&id).map(|h| &h.blocks[..])
    }

    /// Who frees a transfer hold.
    pub fn transfer_holder(&self, id: TransferId) -> Option<Holder> {
        self.transfers.get(&id).map(|h| h.holder)
    }

    /// Transfer holds, in id order.
    pub fn transfer_ids(&self) -> impl Iterator<Item = TransferId> + '_ {
        self.transfers.keys().copied()
    }

    /// Drops the given blocks from the prefix cache (their KV is bad, e.g. a failed load).
    pub fn evict_blocks(&mut self, blocks: &[BlockId]) {
        self.kv.evict_blocks(blocks);
    }
}
