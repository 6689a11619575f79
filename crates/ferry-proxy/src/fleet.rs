//! The instances behind the proxy and the choice among them: each [`Instance`] counts the
//! requests the proxy has in flight on it, and [`Fleet::pick`] takes the least-loaded one of a
//! role (ties go round-robin, so an idle fleet still spreads requests).
//!
//! The counts are the proxy's own, not the instances' `/metrics`: they are exact for traffic
//! that goes through this proxy, cost nothing per request, and never wait on a scrape.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// What an instance does in the P/D pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One `ferry serve` behind the proxy.
#[derive(Debug)]
pub struct Instance {
    /// Base URL without a trailing slash (`http://10.0.0.5:8100`).
    pub url: String,
    pub role: Role,
    in_flight: AtomicUsize,
    n_requests: AtomicU64,
    n_failures: AtomicU64,
}

impl Instance {
    pub fn new(url: impl Into<String>, role: Role) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_owned(),
            role,
            in_flight: AtomicUsize::new(0),
            n_requests: AtomicU64::new(0),
            n_failures: AtomicU64::new(0),
        }
    }

    /// Generation requests the proxy has on this instance now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Generation requests sent here since the proxy started.
    pub fn n_requests(&self) -> u64 {
        self.n_requests.load(Ordering::Relaxed)
    }

    /// Requests that could not reach this instance or broke off mid-answer.
    pub fn n_failures(&self) -> u64 {
        self.n_failures.load(Ordering::Relaxed)
    }

    pub fn record_failure(&self) {
        self.n_failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// A request in flight on an instance; dropping it ends the count.
#[derive(Debug)]
pub struct InFlight {
    pub instance: Arc<Instance>,
}

impl InFlight {
    fn start(instance: Arc<Instance>) -> Self {
        instance.in_flight.fetch_add(1, Ordering::Relaxed);
        instance.n_requests.fetch_add(1, Ordering::Relaxed);
        Self { instance }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.instance.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every instance, prefill first.
#[derive(Debug)]
pub struct Fleet {
    instances: Vec<Arc<Instance>>,
    next: AtomicUsize,
}

impl Fleet {
    pub fn new(prefill: &[String], decode: &[String]) -> Self {
        let instances = prefill
            .iter()
            .map(|u| (u, Role::Prefill))
            .chain(decode.iter().map(|u| (u, Role::Decode)))
            .map(|(u, role)| Arc::new(Instance::new(u.clone(), role)))
            .collect();
        Self {
            instances,
            next: AtomicUsize::new(0),
        }
    }

    /// Every instance, prefill first, in the order given.
    pub fn all(&self) -> &[Arc<Instance>] {
        &self.instances
    }

    pub fn of(&self, role: Role) -> impl Iterator<Item = &Arc<Instance>> {
        self.instances.iter().filter(move |i| i.role == role)
    }

    /// The least-loaded instance of `role` not in `tried` (by URL), counted in flight from
    /// now; `None` when every one was tried.
    ///
    /// The counts are read once: other requests start and end concurrently, so a second read
    /// may match none of the first's minimum (which answered "no instance" with one idle).
    pub fn pick(&self, role: Role, tried: &[String]) -> Option<InFlight> {
        let loads: Vec<(usize, &Arc<Instance>)> = self
            .of(role)
            .filter(|i| !tried.contains(&i.url))
            .map(|i| (i.in_flight(), i))
            .collect();
        let least = loads.iter().map(|(n, _)| *n).min()?;
        let tied: Vec<&Arc<Instance>> = loads
            .iter()
            .filter(|(n, _)| *n == least)
            .map(|(_, i)| *i)
            .collect();
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let chosen = tied[turn % tied.len()];
        Some(InFlight::start(Arc::clone(chosen)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn picks_the_least_loaded_and_spreads_ties() {
        let fleet = Fleet::new(&urls(&["http://p0"]), &urls(&["http://d0", "http://d1/"]));
        let a = fleet.pick(Role::Decode, &[]).unwrap();
        let b = fleet.pick(Role::Decode, &[]).unwrap();
        assert_ne!(a.instance.url, b.instance.url, "an idle tie is spread");
        assert_eq!(b.instance.url.trim_end_matches('/'), b.instance.url);
        // One of them takes a second request; the next goes to the other, which has fewer.
        let c = fleet.pick(Role::Decode, &[]).unwrap();
        let d = fleet.pick(Role::Decode, &[]).unwrap();
        assert_ne!(c.instance.url, d.instance.url);
        drop((a, b));
        assert_eq!(
            fleet.pick(Role::Prefill, &[]).unwrap().instance.url,
            "http://p0"
        );
        assert!(fleet.pick(Role::Prefill, &urls(&["http://p0"])).is_none());
    }

    /// Requests start and end on other threads while one picks: a pick with an instance
    /// left to try always gets one.
    #[test]
    fn a_pick_never_misses_while_counts_change() {
        let fleet = Arc::new(Fleet::new(&urls(&["http://p0"]), &urls(&["http://d0"])));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let fleet = Arc::clone(&fleet);
                std::thread::spawn(move || {
                    for _ in 0..50_000 {
                        let guard = fleet.pick(Role::Decode, &[]);
                        assert!(guard.is_some(), "no decode instance, with one to pick");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_dropped_guard_ends_the_count() {
        let fleet = Fleet::new(&urls(&["http://p0"]), &urls(&["http://d0"]));
        let guard = fleet.pick(Role::Prefill, &[]).unwrap();
        let p0 = Arc::clone(&guard.instance);
        assert_eq!(p0.in_flight(), 1);
        drop(guard);
        assert_eq!((p0.in_flight(), p0.n_requests()), (0, 1));
    }
}
