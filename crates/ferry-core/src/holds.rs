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
use crate::ids::{BlockId, TransferId};
use crate::owner::Owner;
pub use crate::owner::{HoldKind, Holder};

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
        let hold = Hold {
            blocks,
            holder,
            kind,
            lease,
        };
        if self.open.insert(id, hold).is_some() {
            panic!(
                "holds: open of {kind} hold {} for {holder}, which is already open",
                id.0
            );
        }
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
        let owner = Owner::Transfer {
            hold: TransferId(self.next_id),
            holder,
            kind,
        };
        for &b in &blocks {
            pool.touch(b, owner);
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

    /// `holder` ends hold `id`, giving its blocks' references back to `pool` tail first.
    /// Panics, naming the hold, if it is not open (a hold ended twice) or another holder
    /// ends it: every caller here learned the id from the table itself, so either is a bug.
    pub(crate) fn release(&mut self, id: TransferId, holder: Holder, pool: &mut BlockPool) {
        match self.open.get(&id) {
            Some(hold) if hold.holder == holder => {}
            Some(hold) => panic!(
                "holds: release by {holder} of {} hold {} (ended by {}): only its holder \
                 ends a hold",
                hold.kind, id.0, hold.holder
            ),
            None => panic!(
                "holds: release by {holder} of hold {}, which is not open: a hold released \
                 twice",
                id.0
            ),
        }
        self.end(id, pool);
    }

    /// Ends hold `id` if it is open, whoever its holder, as [`Holds::release`] does; false if
    /// it is not. Only for a caller that may legitimately name a hold already ended: the
    /// public `Scheduler::release_transfer`, whose caller cannot see that a cache reset (or a
    /// lease running out) released its hold first.
    pub(crate) fn release_if_open(&mut self, id: TransferId, pool: &mut BlockPool) -> bool {
        if !self.open.contains_key(&id) {
            return false;
        }
        self.end(id, pool);
        true
    }

    fn end(&mut self, id: TransferId, pool: &mut BlockPool) {
        let Some(hold) = self.open.remove(&id) else {
            return;
        };
        let owner = Owner::Transfer {
            hold: id,
            holder: hold.holder,
            kind: hold.kind,
        };
        for &b in hold.blocks.iter().rev() {
            pool.release(b, owner);
        }
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
    use crate::ids::ConnectorId;

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
            r.open(vec![BlockId(3)], C, HoldKind::Export, Lease::Until(secs(5))),
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
        let export = holds.open(vec![BlockId(1)], C, HoldKind::Export, Lease::Until(secs(5)));
        let load = holds.open(vec![BlockId(2)], C, HoldKind::Import, Lease::Until(secs(3)));
        let caller = holds.open(
            vec![BlockId(3)],
            Holder::Caller,
            HoldKind::Caller,
            Lease::Until(secs(3)),
        );
        holds.open(vec![BlockId(4)], C, HoldKind::Store, Lease::Unbounded);
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
        holds.release(id, C, &mut pool);
        assert_eq!((pool.ref_cnt(BlockId(1)), pool.ref_cnt(BlockId(2))), (0, 0));
        assert!(holds.is_empty());
        // Where an ended hold may legitimately be named again, it says so and changes nothing.
        assert!(!holds.release_if_open(id, &mut pool), "not open any more");
        let other = holds.open_referencing(
            &mut pool,
            BlockId::list([2]),
            Holder::Caller,
            HoldKind::Caller,
            Lease::Unbounded,
        );
        assert!(holds.release_if_open(other, &mut pool));
        assert_eq!(pool.ref_cnt(BlockId(2)), 0);
    }

    #[test]
    #[should_panic(
        expected = "holds: release by connector 0 of hold 0, which is not open: a \
                               hold released twice"
    )]
    fn a_hold_released_twice_panics() {
        let mut pool = BlockPool::new(8);
        let mut holds = Holds::new();
        let id = holds.open_referencing(
            &mut pool,
            BlockId::list([1]),
            C,
            HoldKind::Store,
            Lease::Unbounded,
        );
        holds.release(id, C, &mut pool);
        holds.release(id, C, &mut pool);
    }

    #[test]
    #[should_panic(expected = "holds: release by the caller of export hold 0 (ended by \
                               connector 0): only its holder ends a hold")]
    fn a_hold_released_by_another_holder_panics() {
        let mut pool = BlockPool::new(8);
        let mut holds = Holds::new();
        let id = holds.open_referencing(
            &mut pool,
            BlockId::list([1]),
            C,
            HoldKind::Export,
            Lease::Unbounded,
        );
        holds.release(id, Holder::Caller, &mut pool);
    }

    #[test]
    #[should_panic(
        expected = "block pool: release by store hold 1 (ended by connector 0) of \
                               block 3, which no one holds: a double free"
    )]
    fn a_hold_over_a_block_it_holds_no_reference_of_panics_naming_the_hold() {
        let mut pool = BlockPool::new(8);
        let mut holds = Holds::new();
        let mut taken = Vec::new();
        pool.take(3, &mut taken, Owner::Request(crate::ids::ReqIdx(0)));
        // Hold 0 takes its own reference; hold 1 is handed block 3 without one, as a
        // connector opening a hold over blocks it was never given would.
        holds.open_referencing(
            &mut pool,
            taken.clone(),
            C,
            HoldKind::Export,
            Lease::Unbounded,
        );
        let bad = holds.open(vec![BlockId(3)], C, HoldKind::Store, Lease::Unbounded);
        for &b in taken.iter().rev() {
            pool.release(b, Owner::Request(crate::ids::ReqIdx(0)));
        }
        holds.release(TransferId(0), C, &mut pool);
        holds.release(bad, C, &mut pool);
    }
}
