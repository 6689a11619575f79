//! Which offloaded block makes room for a new one: LRU, or ARC (adaptive replacement: a
//! recency list and a frequency list whose split adapts to hits on recently evicted keys, so
//! one long scan of new prefixes does not flush the prefixes that are used again and again).
//!
//! The policy only orders keys; the connector says which keys may go (a block being stored or
//! loaded never may) and removes them. Recency is a logical clock, never a wall clock, and
//! every order is a `BTreeMap`'s, so eviction is deterministic.

use std::collections::BTreeMap;

use crate::hash::{BlockHash, BlockHashMap};

/// The eviction policy (`--kv-offload-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadPolicy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Adaptive replacement cache (Megiddo and Modha, 2003).
    Arc,
}

impl std::str::FromStr for OffloadPolicy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        match s {
            "lru" => Ok(Self::Lru),
            "arc" => Ok(Self::Arc),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

/// A name that is no [`OffloadPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown offload policy {0:?}: expected lru or arc")]
pub struct UnknownPolicy(pub String);

impl OffloadPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Arc => "arc",
        }
    }
}

/// Keys in recency order (least recent first), on a logical clock.
#[derive(Debug, Default)]
pub(crate) struct Recency {
    order: BTreeMap<u64, BlockHash>,
    /// Only for lookups; never iterated.
    at: BlockHashMap<u64>,
    clock: u64,
}

impl Recency {
    /// Makes `key` the most recent (adding it if absent).
    fn push(&mut self, key: BlockHash) {
        self.remove(&key);
        self.clock += 1;
        self.order.insert(self.clock, key);
        self.at.insert(key, self.clock);
    }

    fn remove(&mut self, key: &BlockHash) -> bool {
        match self.at.remove(key) {
            Some(t) => {
                self.order.remove(&t);
                true
            }
            None => false,
        }
    }

    fn contains(&self, key: &BlockHash) -> bool {
        self.at.contains_key(key)
    }

    fn len(&self) -> usize {
        self.at.len()
    }

    fn pop_oldest(&mut self) -> Option<BlockHash> {
        let (_, key) = self.order.pop_first()?;
        self.at.remove(&key);
        Some(key)
    }

    /// The least recent key `ok` accepts.
    fn oldest(&self, ok: &impl Fn(&BlockHash) -> bool) -> Option<BlockHash> {
        self.order.values().find(|k| ok(k)).copied()
    }

    fn clear(&mut self) {
        self.order.clear();
        self.at.clear();
    }
}

/// ARC's four lists: `t1` resident keys used once, `t2` used more than once, `b1`/`b2` keys
/// recently evicted from each (ghosts, no data); `p` is the target size of `t1`.
#[derive(Debug, Default)]
pub(crate) struct ArcLists {
    t1: Recency,
    t2: Recency,
    b1: Recency,
    b2: Recency,
    p: usize,
    capacity: usize,
}

impl ArcLists {
    fn trim_ghosts(&mut self) {
        while self.t1.len() + self.b1.len() > self.capacity && self.b1.pop_oldest().is_some() {}
        let total = |a: &Self| a.t1.len() + a.t2.len() + a.b1.len() + a.b2.len();
        while total(self) > 2 * self.capacity
            && (self.b2.pop_oldest().is_some() || self.b1.pop_oldest().is_some())
        {}
    }
}

/// One tier's eviction order.
#[derive(Debug)]
pub(crate) enum Policy {
    Lru(Recency),
    Arc(Box<ArcLists>),
}

impl Policy {
    /// A policy for a tier of `capacity` offloaded blocks.
    pub(crate) fn new(kind: OffloadPolicy, capacity: usize) -> Self {
        match kind {
            OffloadPolicy::Lru => Self::Lru(Recency::default()),
            OffloadPolicy::Arc => Self::Arc(Box::new(ArcLists {
                capacity,
                ..ArcLists::default()
            })),
        }
    }

    /// `key` entered the tier.
    pub(crate) fn inserted(&mut self, key: BlockHash) {
        match self {
            Self::Lru(r) => r.push(key),
            Self::Arc(a) => {
                if a.b1.remove(&key) {
                    // Evicted from the recency side and wanted again: give recency more room.
                    let step = (a.b2.len() / (a.b1.len() + 1)).max(1);
                    a.p = (a.p + step).min(a.capacity);
                    a.t2.push(key);
                } else if a.b2.remove(&key) {
                    let step = (a.b1.len() / (a.b2.len() + 1)).max(1);
                    a.p = a.p.saturating_sub(step);
                    a.t2.push(key);
                } else {
                    a.t1.push(key);
                }
                a.trim_ghosts();
            }
        }
    }

    /// `key` was used again (a hit, or a store of a block the tier already has).
    pub(crate) fn touched(&mut self, key: BlockHash) {
        match self {
            Self::Lru(r) => {
                if r.contains(&key) {
                    r.push(key);
                }
            }
            Self::Arc(a) => {
                if a.t1.remove(&key) || a.t2.remove(&key) {
                    a.t2.push(key);
                }
            }
        }
    }

    /// `key` left the tier without an eviction (a store that failed).
    pub(crate) fn removed(&mut self, key: &BlockHash) {
        match self {
            Self::Lru(r) => {
                r.remove(key);
            }
            Self::Arc(a) => {
                let _ = a.t1.remove(key) || a.t2.remove(key);
            }
        }
    }

    /// The key to evict next among those `evictable` accepts.
    pub(crate) fn victim(&self, evictable: impl Fn(&BlockHash) -> bool) -> Option<BlockHash> {
        match self {
            Self::Lru(r) => r.oldest(&evictable),
            Self::Arc(a) => {
                let (first, second) = if a.t1.len() > 0 && a.t1.len() > a.p {
                    (&a.t1, &a.t2)
                } else {
                    (&a.t2, &a.t1)
                };
                first
                    .oldest(&evictable)
                    .or_else(|| second.oldest(&evictable))
            }
        }
    }

    /// `key` (a [`victim`](Self::victim)) was evicted.
    pub(crate) fn evicted(&mut self, key: BlockHash) {
        match self {
            Self::Lru(r) => {
                r.remove(&key);
            }
            Self::Arc(a) => {
                if a.t1.remove(&key) {
                    a.b1.push(key);
                } else if a.t2.remove(&key) {
                    a.b2.push(key);
                }
                a.trim_ghosts();
            }
        }
    }

    /// Forgets everything (a reset drops the index).
    pub(crate) fn clear(&mut self) {
        match self {
            Self::Lru(r) => r.clear(),
            Self::Arc(a) => {
                a.t1.clear();
                a.t2.clear();
                a.b1.clear();
                a.b2.clear();
                a.p = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> BlockHash {
        BlockHash([n; 32])
    }

    /// The victims, in order, of a policy emptied one eviction at a time.
    fn drain(p: &mut Policy) -> Vec<BlockHash> {
        let mut out = Vec::new();
        while let Some(k) = p.victim(|_| true) {
            p.evicted(k);
            out.push(k);
        }
        out
    }

    #[test]
    fn policy_names_parse_and_print() {
        for p in [OffloadPolicy::Lru, OffloadPolicy::Arc] {
            assert_eq!(p.as_str().parse::<OffloadPolicy>(), Ok(p));
        }
        assert_eq!(OffloadPolicy::Lru.as_str(), "lru");
        assert_eq!(OffloadPolicy::Arc.as_str(), "arc");
        assert_eq!(
            "fifo".parse::<OffloadPolicy>(),
            Err(UnknownPolicy("fifo".into()))
        );
    }

    /// LRU: a touch makes a key the most recent; a touch of a key the tier does not hold adds
    /// nothing.
    #[test]
    fn lru_evicts_least_recent_and_ignores_touches_of_absent_keys() {
        let mut p = Policy::new(OffloadPolicy::Lru, 4);
        for n in 1..=3 {
            p.inserted(key(n));
        }
        p.touched(key(1));
        p.touched(key(9));
        assert_eq!(drain(&mut p), [key(2), key(3), key(1)]);
    }

    /// ARC: a key wanted again soon after its eviction (a ghost hit) grows the recency side's
    /// target, so the next victim comes from the recency list while it is over that target.
    #[test]
    fn arc_adapts_to_a_ghost_hit() {
        let mut p = Policy::new(OffloadPolicy::Arc, 4);
        p.inserted(key(1));
        assert_eq!(p.victim(|_| true), Some(key(1)));
        p.evicted(key(1));
        // Back soon after: a ghost hit, so it is frequent now and p = 1.
        p.inserted(key(1));
        p.inserted(key(2));
        p.inserted(key(3));
        // t1 = [2, 3] is over its target of 1: its oldest goes first, not the frequent 1.
        assert_eq!(p.victim(|_| true), Some(key(2)));
    }

    /// `clear` forgets every key, and `removed` takes a key out of the resident lists,
    /// whichever it is in.
    #[test]
    fn clear_and_removed_forget_keys() {
        for kind in [OffloadPolicy::Lru, OffloadPolicy::Arc] {
            let mut p = Policy::new(kind, 4);
            p.inserted(key(1));
            p.inserted(key(2));
            p.touched(key(2)); // ARC: 2 is in t2, 1 in t1
            p.removed(&key(2));
            assert_eq!(drain(&mut p), [key(1)], "{kind:?}");
            p.inserted(key(3));
            p.clear();
            assert_eq!(p.victim(|_| true), None, "{kind:?}");
            // Nothing of before the clear is remembered: 1 comes back as new.
            p.inserted(key(1));
            p.inserted(key(4));
            assert_eq!(drain(&mut p), [key(1), key(4)], "{kind:?}");
        }
    }

    /// ARC's ghosts are bounded: a key evicted long ago (its ghost trimmed) comes back as new,
    /// not as a ghost hit.
    #[test]
    fn arc_forgets_old_ghosts() {
        let mut p = Policy::new(OffloadPolicy::Arc, 2);
        p.inserted(key(1));
        p.evicted(key(1)); // b1 = [1]
        p.inserted(key(2));
        p.inserted(key(3)); // t1 + b1 = 3 > 2: the ghost of 1 is trimmed
        p.evicted(key(2)); // b1 = [2], t1 = [3]
        p.inserted(key(1)); // new again: t1 = [3, 1], p = 0
        assert_eq!(p.victim(|_| true), Some(key(3)));
    }

    /// ARC against a model written from the paper's rules with plain vectors (oldest first),
    /// over random operations as the tier makes them (an insert into a full tier evicts
    /// first; some keys are never evictable, as blocks being copied): the four lists, their
    /// order and the target `p` agree after every operation, and the bounds hold (`p` at
    /// most the capacity, ghosts at most twice it, no key in two lists).
    mod arc_model {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Default)]
        struct Model {
            t1: Vec<u8>,
            t2: Vec<u8>,
            b1: Vec<u8>,
            b2: Vec<u8>,
            p: usize,
            c: usize,
        }

        fn take(list: &mut Vec<u8>, k: u8) -> bool {
            let found = list.iter().position(|&x| x == k);
            found.map(|i| list.remove(i)).is_some()
        }

        impl Model {
            fn trim(&mut self) {
                while self.t1.len() + self.b1.len() > self.c && !self.b1.is_empty() {
                    self.b1.remove(0);
                }
                while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > 2 * self.c {
                    if !self.b2.is_empty() {
                        self.b2.remove(0);
                    } else if !self.b1.is_empty() {
                        self.b1.remove(0);
                    } else {
                        break;
                    }
                }
            }

            fn inserted(&mut self, k: u8) {
                if take(&mut self.b1, k) {
                    let step = (self.b2.len() / (self.b1.len() + 1)).max(1);
                    self.p = (self.p + step).min(self.c);
                    self.t2.push(k);
                } else if take(&mut self.b2, k) {
                    let step = (self.b1.len() / (self.b2.len() + 1)).max(1);
                    self.p = self.p.saturating_sub(step);
                    self.t2.push(k);
                } else {
                    take(&mut self.t1, k);
                    self.t1.push(k);
                }
                self.trim();
            }

            fn touched(&mut self, k: u8) {
                if take(&mut self.t1, k) || take(&mut self.t2, k) {
                    self.t2.push(k);
                }
            }

            fn removed(&mut self, k: u8) {
                let _ = take(&mut self.t1, k) || take(&mut self.t2, k);
            }

            fn victim(&self, ok: impl Fn(u8) -> bool) -> Option<u8> {
                let (first, second) = if !self.t1.is_empty() && self.t1.len() > self.p {
                    (&self.t1, &self.t2)
                } else {
                    (&self.t2, &self.t1)
                };
                let pick = |l: &Vec<u8>| l.iter().copied().find(|&k| ok(k));
                pick(first).or_else(|| pick(second))
            }

            fn evicted(&mut self, k: u8) {
                if take(&mut self.t1, k) {
                    self.b1.push(k);
                } else if take(&mut self.t2, k) {
                    self.b2.push(k);
                }
                self.trim();
            }

            fn resident(&self) -> usize {
                self.t1.len() + self.t2.len()
            }
        }

        #[derive(Debug, Clone)]
        enum Op {
            Store(u8),
            Hit(u8),
            Fail(u8),
            Evict,
            Clear,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => (0u8..24).prop_map(Op::Store),
                4 => (0u8..24).prop_map(Op::Hit),
                1 => (0u8..24).prop_map(Op::Fail),
                2 => Just(Op::Evict),
                1 => Just(Op::Clear),
            ]
        }

        fn keys(r: &Recency) -> Vec<u8> {
            r.order.values().map(|h| h.0[0]).collect()
        }

        /// Blocks being copied: never a victim.
        fn evictable(k: u8) -> bool {
            !k.is_multiple_of(5)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            #[test]
            fn arc_follows_the_model(cap in 1usize..8, ops in proptest::collection::vec(op(), 1..200)) {
                let mut p = Policy::new(OffloadPolicy::Arc, cap);
                let mut m = Model { c: cap, ..Model::default() };
                for op in ops {
                    match op {
                        Op::Store(k) => {
                            let resident = m.t1.contains(&k) || m.t2.contains(&k);
                            if resident {
                                p.touched(key(k));
                                m.touched(k);
                            } else {
                                if m.resident() == cap {
                                    let v = m.victim(evictable);
                                    prop_assert_eq!(p.victim(|h| evictable(h.0[0])), v.map(key));
                                    let Some(v) = v else { continue };
                                    p.evicted(key(v));
                                    m.evicted(v);
                                }
                                p.inserted(key(k));
                                m.inserted(k);
                            }
                        }
                        Op::Hit(k) => {
                            p.touched(key(k));
                            m.touched(k);
                        }
                        Op::Fail(k) => {
                            p.removed(&key(k));
                            m.removed(k);
                        }
                        Op::Evict => {
                            let v = m.victim(evictable);
                            prop_assert_eq!(p.victim(|h| evictable(h.0[0])), v.map(key));
                            if let Some(v) = v {
                                p.evicted(key(v));
                                m.evicted(v);
                            }
                        }
                        Op::Clear => {
                            p.clear();
                            m = Model { c: cap, ..Model::default() };
                        }
                    }
                    let Policy::Arc(a) = &p else { unreachable!() };
                    prop_assert_eq!(keys(&a.t1), m.t1.clone());
                    prop_assert_eq!(keys(&a.t2), m.t2.clone());
                    prop_assert_eq!(keys(&a.b1), m.b1.clone());
                    prop_assert_eq!(keys(&a.b2), m.b2.clone());
                    prop_assert_eq!(a.p, m.p);
                    prop_assert!(a.p <= cap);
                    prop_assert!(m.resident() <= cap);
                    prop_assert!(m.resident() + m.b1.len() + m.b2.len() <= 2 * cap);
                    for list in [&a.t1, &a.t2, &a.b1, &a.b2] {
                        prop_assert_eq!(list.order.len(), list.at.len());
                    }
                    let mut all: Vec<u8> = [&m.t1, &m.t2, &m.b1, &m.b2].into_iter().flatten().copied().collect();
                    let n = all.len();
                    all.sort_unstable();
                    all.dedup();
                    prop_assert_eq!(all.len(), n, "a key in two lists");
                }
            }
        }
    }
}
