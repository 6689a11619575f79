//! Offering full blocks to the connectors that store them (an offload tier): the blocks a
//! step computed, and those another connector's load landed. A store holds what it reads
//! under a `Store` hold the connector owns ([`StoreHoldMaker`]).

use super::Scheduler;
use crate::block_pool::BlockPool;
use crate::connector::{ComputedBlocks, StoreHolds};
use crate::holds::{HoldKind, Holder, Holds, Lease};
use crate::ids::{BlockId, ConnectorId, ReqIdx, TransferId};
use crate::plan::StepPlan;
use crate::request::RequestState;

/// Opens `Store` holds for one connector while it is asked about computed blocks
/// (`KvConnector::blocks_computed`), borrowing only what a hold touches. A store's hold has
/// no lease: it ends when the store job does.
struct StoreHoldMaker<'a> {
    pool: &'a mut BlockPool,
    holds: &'a mut Holds,
    holder: Holder,
}

impl StoreHolds for StoreHoldMaker<'_> {
    fn hold(&mut self, blocks: &[BlockId]) -> TransferId {
        self.holds.open_referencing(
            self.pool,
            blocks.to_vec(),
            self.holder,
            HoldKind::Store,
            Lease::Unbounded,
        )
    }
}

impl Scheduler {
    /// Tells the connectors that store blocks (a local tier) which full blocks the step just
    /// computed, before any finish frees them; a store holds its blocks under a `Store` hold.
    /// Requests whose hash chain is not the current weights' and adapter version's (running
    /// across an update or an adapter reload) offer nothing: their KV mixes two versions.
    pub(super) fn offer_computed_blocks(&mut self, plan: &StepPlan) {
        if !self.connectors.iter().any(|c| c.stores_blocks()) {
            return;
        }
        for s in &plan.reqs {
            let running = self
                .request(s.req)
                .is_some_and(|r| r.state == RequestState::Running);
            if running {
                self.offer_blocks(s.req, s.start_pos, s.start_pos + s.tokens.len(), None);
            }
        }
    }

    /// Offers request `r`'s blocks that became full between `n_before` and `n_after` tokens
    /// of KV to every connector that stores blocks, but `skip` (a load's own connector, which
    /// has them). Nothing for a request whose hash chain is not the current weights'.
    pub(super) fn offer_blocks(
        &mut self,
        r: ReqIdx,
        n_before: usize,
        n_after: usize,
        skip: Option<ConnectorId>,
    ) {
        let bs = self.config.block_size;
        if n_after / bs == n_before / bs {
            return;
        }
        for c in 0..self.connectors.len() {
            let id = ConnectorId(c as u32);
            if Some(id) == skip || !self.connectors[c].stores_blocks() {
                continue;
            }
            let Some(req) = self.requests.get(r.0 as usize).and_then(Option::as_ref) else {
                return;
            };
            if !req.chain_is_current(&self.hash_root) {
                return;
            }
            let computed = ComputedBlocks {
                req: r,
                blocks: &req.blocks,
                block_hashes: &req.block_hashes,
                n_before,
                n_after,
            };
            let mut holds = StoreHoldMaker {
                pool: self.kv.pool_mut(),
                holds: &mut self.holds,
                holder: Holder::Connector(id),
            };
            self.connectors[c].blocks_computed(computed, &mut holds);
        }
    }
}
