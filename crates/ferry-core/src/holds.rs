//! Transfer holds: KV blocks kept allocated for something other than a running request (an
//! export a remote reader pulls, an import or a tier load being written, a tier store being
//! read, a caller's hold), with who ends each, what it is for, and how long it may live.
//!
//! Every block a transfer touches is held through a hold opened here, under an id the table
//! hands out when it opens it. The blocks stay allocated until the hold's holder ends it
//! ([`Holder`]): a connector can never free or reuse a block itself, and a reset that waits
//! always knows what it waits for (the ownership ledger shows each hold as an owner).
//!
//! A hold may have a `Lease`: an export's lifetime (`SchedulerConfig::export_lease`) or a
//! load's bound (`SchedulerConfig::kv_load_timeout`). When it runs out the holder is told,
//! once (`Holds::expire`, from `Scheduler::advance_time`); a connector hands the blocks
//! back once its worker let go of them (a reader may be copying them right now), a caller's
//! hold is released at once. The earliest lease still running is the core's next deadline
//! but for the lifecycle's own (`Holds::next_deadline`).
//!
//! Sans-IO like the rest of the core: time is an argument, and the block references a hold
//! takes or gives back are counted by the pool it is handed.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::block_pool::BlockPool;
use crate::ids::{BlockId, ConnectorId, TransferId};

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

/// What a transfer hold is for; the ownership ledger shows it with the holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HoldKind {
    /// A finished request's KV, kept for a remote reader (P of P/D).
    Export,
    /// Blocks a remote load writes (D of P/D).
    Import,
    /// Blocks a store job reads (offload tier).
    Store,
    /// Blocks a local tier's load writes (offload tier).
    Load,
    /// A hold made by the caller (`Scheduler::hold_blocks_for_transfer`).
    Caller,
}

/// How long a hold lives before its holder is told its time ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lease {
    /// No deadline: the hold lives until its holder ends it (a tier's store, a caller's hold,
    /// an export made with `Scheduler::hold_blocks_for_transfer`).
    Unbounded,
    /// Runs out at this time on the core's clock: an export's lease, a load's bound.
    Until(Duration),
    /// Ran out, and the holder was told; the hold lives on until the holder ends it.
    RanOut,
}

impl Lease {
    /// When the lease runs out, while it has not yet.
    fn deadline(self) -> Option<Duration> {
        match self {
            Self::Until(t) => Some(t),
            Self::Unbounded | Self::RanOut => None,
        }
    }
}

/// One transfer hold: the blocks it keeps allocated (one reference each), who ends it, what
/// it is for and its lease.
#[derive(Debug)]
pub(crate) struct Hold {
    /// In block-table order.
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) holder: Holder,
    pub(crate) kind: HoldKind,
    pub(crate) lease: Lease,
}

/// Every open hold, in id order, and the id the next one gets. Ids are handed out in order
/// and never reused.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    open: BTreeMap<TransferId, Hold>,
    next_id: u64,
}

impl Holds {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Opens a hold over `blocks`, whose references the caller hands over (a finished
    /// request's blocks going to its export: no reference count changes). Returns its id.
    pub(crate) fn open(
        &mut self,
        blocks: Vec<BlockId>,
        holder: Holder,
        kind: HoldKind,
        lease: Lease,
    ) -> TransferId {
        let id = TransferId(self.next_id);
        self.next_id += 1;
        self.open.insert(
            id,
            Hold {
                blocks,
                holder,
                kind,
                lease,
            },
        );
        id
    }

    /// Opens a hold over `blocks` that takes one more reference of each in `pool`: they stay
    /// allocated until the holder ends the hold, whatever happens to the request that has
    /// them. Returns its id.
    pub(crate) fn open_referencing(
        &mut self,
        pool: &mut BlockPool,
        blocks: Vec<BlockId>,
        holder: Holder,
        kind: HoldKind,
        lease: Lease,
    ) -> TransferId {
        for &b in &blocks {
            pool.touch(b);
        }
        self.open(blocks, holder, kind, lease)
    }

    /// Sets the next id aside for a hold that may be opened (a finished request's export,
    /// once a connector asks for it): the connectors are told the id first, and no other
    /// hold can be opened while the reservation lives. Dropped unopened, it leaves the id to
    /// the next hold.
    pub(crate) fn reserve(&mut self) -> Reservation<'_> {
        Reservation { holds: self }
    }

    /// Ends hold `id`, giving its blocks' references back to `pool` tail first. False if `id`
    /// is not open.
    pub(crate) fn release(&mut self, id: TransferId, pool: &mut BlockPool) -> bool {
        let Some(hold) = self.open.remove(&id) else {
            return false;
        };
        for &b in hold.blocks.iter().rev() {
            pool.release(b);
        }
        true
    }

    /// Every hold whose lease ran out by `now`, in id order, with its holder, appended to
    /// `out`. Each is reported once: its lease is marked run out.
    pub(crate) fn expire(&mut self, now: Duration, out: &mut Vec<(TransferId, Holder)>) {
        for (&id, hold) in &mut self.open {
            if hold.lease.deadline().is_some_and(|t| t <= now) {
                hold.lease = Lease::RanOut;
                out.push((id, hold.holder));
            }
        }
    }

    /// When the earliest lease still running runs out; `None` if none is.
    pub(crate) fn next_deadline(&self) -> Option<Duration> {
        self.open.values().filter_map(|h| h.lease.deadline()).min()
    }

    pub(crate) fn get(&self, id: TransferId) -> Option<&Hold> {
        self.open.get(&id)
    }

    pub(crate) fn contains(&self, id: TransferId) -> bool {
        self.open.contains_key(&id)
    }

    /// Open holds, in id order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (TransferId, &Hold)> {
        self.open.iter().map(|(&id, h)| (id, h))
    }

    /// The ids of the holds `holder` ends, in id order.
    pub(crate) fn held_by(&self, holder: Holder) -> Vec<TransferId> {
        self.iter()
            .filter(|(_, h)| h.holder == holder)
            .map(|(id, _)| id)
            .collect()
    }

    /// How many holds are open.
    pub(crate) fn len(&self) -> usize {
        self.open.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Block references the open holds keep, over all of them.
    pub(crate) fn n_blocks(&self) -> usize {
        self.open.values().map(|h| h.blocks.len()).sum()
    }
}

/// The id the next hold gets, set aside ([`Holds::reserve`]): opening through it uses exactly
/// that id, and while it lives nothing else can open a hold.
pub(crate) struct Reservation<'a> {
    holds: &'a mut Holds,
}

impl Reservation<'_> {
    /// The id a hold opened through this reservation gets.
    pub(crate) fn id(&self) -> TransferId {
        TransferId(self.holds.next_id)
    }

    /// [`Holds::open`] under the reserved id.
    pub(crate) fn open(
        self,
        blocks: Vec<BlockId>,
        holder: Holder,
        kind: HoldKind,
        lease: Lease,
    ) -> TransferId {
        self.holds.open(blocks, holder, kind, lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: Holder = Holder::Connector(ConnectorId(0));

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn ids_follow_the_order_of_opening_and_a_reservation_uses_the_next_one() {
        let mut pool = BlockPool::new(8);
        let mut holds = Holds::new();
        let a = holds.open_referencing(
            &mut pool,
            BlockId::list([1, 2]),
            C,
            HoldKind::Store,
            Lease::Unbounded,
        );
        assert_eq!(a, TransferId(0));
        assert_eq!((pool.ref_cnt(BlockId(1)), pool.ref_cnt(BlockId(2))), (1, 1));
        // A reservation dropped unopened leaves its id to the next hold.
        let unused = holds.reserve().id();
        assert_eq!(unused, TransferId(1));
        let r = holds.reserve();
        let id = r.id();
        assert_eq!(id, TransferId(1));
        assert_eq!(
            r.open(
                BlockId::list([3]),
                C,
                HoldKind::Export,
                Lease::Until(secs(5))
            ),
            id
        );
        let b = holds.open(vec![], Holder::Caller, HoldKind::Caller, Lease::Unbounded);
        assert_eq!(b, TransferId(2));
        assert_eq!(holds.len(), 3);
        assert_eq!(holds.n_blocks(), 3);
        assert_eq!(holds.held_by(Holder::Caller), vec![b]);
        assert_eq!(holds.held_by(C), vec![a, id]);
    }

    #[test]
    fn a_lease_is_reported_once_when_it_runs_out_and_the_next_deadline_follows() {
        let mut holds = Holds::new();
        let export = holds.open(
            BlockId::list([1]),
            C,
            HoldKind::Export,
            Lease::Until(secs(5)),
        );
        let load = holds.open(
            BlockId::list([2]),
            C,
            HoldKind::Import,
            Lease::Until(secs(3)),
        );
        let caller = holds.open(
            BlockId::list([3]),
            Holder::Caller,
            HoldKind::Caller,
            Lease::Until(secs(3)),
        );
        holds.open(BlockId::list([4]), C, HoldKind::Store, Lease::Unbounded);
        assert_eq!(holds.next_deadline(), Some(secs(3)));
        let mut out = Vec::new();
        holds.expire(secs(2), &mut out);
        assert!(out.is_empty());
        holds.expire(secs(3), &mut out);
        assert_eq!(out, vec![(load, C), (caller, Holder::Caller)]);
        assert_eq!(holds.get(load).map(|h| h.lease), Some(Lease::RanOut));
        assert_eq!(holds.next_deadline(), Some(secs(5)));
        out.clear();
        holds.expire(secs(9), &mut out);
        assert_eq!(out, vec![(export, C)], "each lease is reported once");
        assert_eq!(holds.next_deadline(), None);
        // A hold whose lease ran out lives on until its holder ends it.
        assert!(holds.contains(export));
    }

    #[test]
    fn release_gives_the_references_back_once() {
        let mut pool = BlockPool::new(8);
        let mut holds = Holds::new();
        let id = holds.open_referencing(
            &mut pool,
            BlockId::list([1, 2]),
            C,
            HoldKind::Load,
            Lease::Unbounded,
        );
        assert_eq!(
            holds.get(id).map(|h| h.blocks.clone()),
            Some(BlockId::list([1, 2]))
        );
        assert!(holds.release(id, &mut pool));
        assert_eq!((pool.ref_cnt(BlockId(1)), pool.ref_cnt(BlockId(2))), (0, 0));
        assert!(!holds.release(id, &mut pool), "not open any more");
        assert!(holds.is_empty());
    }
}
