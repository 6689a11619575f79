//! The instances behind the proxy and the choice among them: each [`Instance`] counts the
//! requests (and prompt blocks) the proxy has in flight on it and keeps its prefix cache as
//! its KV events describe it ([`KvIndex`]); [`Fleet::pick`] takes one of a role by the
//! [`Routing`] policy: by prefix (`kv`: Dynamo's cost, `overlap_weight × blocks to prefill +
//! decode blocks in flight`), the least-loaded one, or in turn. Ties go round-robin, so an idle fleet
//! still spreads requests. `kv` routes by load while any candidate's index is not synced.
//!
//! The counts are the proxy's own, not the instances' `/metrics`: they are exact for traffic
//! that goes through this proxy, cost nothing per request, and never wait on a scrape.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use ferry_core::TokenId;

use crate::kv_index::{KvIndex, Sync};

/// What an instance does in the P/D pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// A plain instance (no `--kv-role`) that computes whole requests (`--instance`).
    Whole,
}

/// A request's prompt as KV routing sees it: its tokens, the tokens it will decode, and the
/// `model` it names (a LoRA adapter's prefix is looked up under that adapter).
pub type Prompt<'a> = (&'a [TokenId], usize, Option<&'a str>);

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Whole => "instance",
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
    /// Blocks the requests in flight here will decode into (the routing cost's load term,
    /// Dynamo's "decode blocks": a prompt's own blocks are the prefill term of its route).
    in_flight_blocks: AtomicUsize,
    n_requests: AtomicU64,
    n_failures: AtomicU64,
    kv: Mutex<KvIndex>,
    /// Requests routed here by prefix, and the prompt tokens predicted cached.
    pub n_kv_routed: AtomicU64,
    pub n_predicted_hit_tokens: AtomicU64,
    /// Requests whose answer reported fewer cached tokens than predicted, and of those the
    /// stale routes (predicted from blocks a wipe had taken more than 100 ms before).
    pub n_kv_misses: AtomicU64,
    pub n_stale_routes: AtomicU64,
    /// Admin calls through the proxy that may have wiped the instance's cache, each of which
    /// emptied its prefix index as the instance answered (`admin::broadcast_to`).
    pub n_fences: AtomicU64,
}

impl Instance {
    pub fn new(url: impl Into<String>, role: Role) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_owned(),
            role,
            in_flight: AtomicUsize::new(0),
            in_flight_blocks: AtomicUsize::new(0),
            n_requests: AtomicU64::new(0),
            n_failures: AtomicU64::new(0),
            kv: Mutex::new(KvIndex::default()),
            n_kv_routed: AtomicU64::new(0),
            n_predicted_hit_tokens: AtomicU64::new(0),
            n_kv_misses: AtomicU64::new(0),
            n_stale_routes: AtomicU64::new(0),
            n_fences: AtomicU64::new(0),
        }
    }

    /// The instance's prefix index.
    pub fn kv(&self) -> MutexGuard<'_, KvIndex> {
        self.kv.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decode blocks in flight here.
    pub fn in_flight_blocks(&self) -> usize {
        self.in_flight_blocks.load(Ordering::Relaxed)
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
    blocks: usize,
    /// What the prefix routing predicted, to check against the answer's `cached_tokens`.
    pub prediction: Option<Prediction>,
}

/// A route by prefix: the cached tokens it expected, under which index generation, when.
#[derive(Debug, Clone, Copy)]
pub struct Prediction {
    pub tokens: usize,
    pub generation: u64,
    /// Seconds since the Unix epoch.
    pub at: f64,
}

/// How long after a wipe's time a route from blocks it took still counts as an ordinary
/// miss (the event's way to the proxy), not a stale route.
pub const STALE_GRACE_S: f64 = 0.1;

impl InFlight {
    fn start(instance: Arc<Instance>, blocks: usize) -> Self {
        instance.in_flight.fetch_add(1, Ordering::Relaxed);
        instance
            .in_flight_blocks
            .fetch_add(blocks, Ordering::Relaxed);
        instance.n_requests.fetch_add(1, Ordering::Relaxed);
        Self {
            instance,
            blocks,
            prediction: None,
        }
    }

    /// The instance answered with `cached` prompt tokens computed from its cache: a route by
    /// prefix that expected more is a miss, and a stale route if a wipe explains it.
    pub fn check_cached(&self, cached: usize) {
        let Some(p) = self.prediction else { return };
        if cached >= p.tokens {
            return;
        }
        self.instance.n_kv_misses.fetch_add(1, Ordering::Relaxed);
        if self
            .instance
            .kv()
            .was_stale(p.generation, p.at, STALE_GRACE_S)
        {
            self.instance.n_stale_routes.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                instance = %self.instance.url,
                predicted = p.tokens,
                cached,
                "a stale route: the prefix index still held blocks a wipe had taken"
            );
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.instance.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.instance
            .in_flight_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// How the proxy picks among the instances of a role.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// By prefix (where every candidate's KV events are synced; else by load), with the
    /// weight of a block to prefill against a block in flight.
    Kv {
        overlap_weight: f64,
    },
    LeastLoaded,
    RoundRobin,
}

/// Every instance, prefill first.
#[derive(Debug)]
pub struct Fleet {
    instances: Vec<Arc<Instance>>,
    next: AtomicUsize,
    pub routing: Routing,
}

impl Fleet {
    pub fn new(prefill: &[String], decode: &[String]) -> Self {
        Self::with_instances(prefill, decode, &[])
    }

    /// P and D instances, and plain ones (`--instance`).
    pub fn with_instances(prefill: &[String], decode: &[String], whole: &[String]) -> Self {
        let instances = prefill
            .iter()
            .map(|u| (u, Role::Prefill))
            .chain(decode.iter().map(|u| (u, Role::Decode)))
            .chain(whole.iter().map(|u| (u, Role::Whole)))
            .map(|(u, role)| Arc::new(Instance::new(u.clone(), role)))
            .collect();
        Self {
            instances,
            next: AtomicUsize::new(0),
            routing: Routing::LeastLoaded,
        }
    }

    /// The instances that compute prompts: P, or the plain instances.
    pub fn prompt_role(&self) -> Role {
        if self.of(Role::Whole).next().is_some() {
            Role::Whole
        } else {
            Role::Prefill
        }
    }

    /// Whether routing `role` by prefix needs the prompt's tokens now: the policy is `kv` and
    /// every candidate's index is synced.
    pub fn routes_by_prefix(&self, role: Role) -> bool {
        matches!(self.routing, Routing::Kv { .. })
            && role != Role::Decode
            && self.of(role).all(|i| i.kv().sync == Sync::Synced)
    }

    /// [`pick`](Self::pick) by prefix when the prompt's `tokens` (and the tokens the request
    /// will decode there) are given and [`routes_by_prefix`](Self::routes_by_prefix),
    /// recording the prediction and the provisional blocks. The cost of an instance is
    /// `overlap_weight × the prompt's blocks it would prefill + the decode blocks in flight
    /// there`; the lowest wins, then the one with fewer requests in flight, then in turn.
    pub fn pick_for(
        &self,
        role: Role,
        tried: &[String],
        prompt: Option<Prompt<'_>>,
    ) -> Option<InFlight> {
        let (Some((tokens, n_decode, model)), Routing::Kv { overlap_weight }) =
            (prompt, self.routing)
        else {
            return self.pick(role, tried);
        };
        if !self.routes_by_prefix(role) {
            return self.pick(role, tried);
        }
        let now = Instant::now();
        let scored: Vec<Score<'_>> = self
            .candidates(role, tried)
            .map(|instance| {
                let kv = instance.kv();
                let bs = kv.block_size.max(1);
                let overlap = kv.overlap(tokens, kv.root_of(model), now);
                let to_prefill = tokens.len().div_ceil(bs).saturating_sub(overlap);
                Score {
                    cost: overlap_weight * to_prefill as f64 + instance.in_flight_blocks() as f64,
                    in_flight: instance.in_flight(),
                    hit_tokens: overlap * bs,
                    decode_blocks: n_decode.div_ceil(bs),
                    instance,
                }
            })
            .collect();
        let best = scored
            .iter()
            .map(|s| (s.cost, s.in_flight))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))?;
        let tied: Vec<&Score<'_>> = scored
            .iter()
            .filter(|s| (s.cost, s.in_flight) == best)
            .collect();
        let &&Score {
            hit_tokens: hit,
            decode_blocks: blocks,
            instance: chosen,
            ..
        } = self.in_turn(&tied)?;
        let generation = {
            let mut kv = chosen.kv();
            let root = kv.root_of(model);
            kv.add_provisional(tokens, root, now);
            kv.generation()
        };
        chosen.n_kv_routed.fetch_add(1, Ordering::Relaxed);
        chosen
            .n_predicted_hit_tokens
            .fetch_add(hit as u64, Ordering::Relaxed);
        let mut guard = InFlight::start(Arc::clone(chosen), blocks);
        guard.prediction = (hit > 0).then(|| Prediction {
            tokens: hit,
            generation,
            at: unix_now(),
        });
        Some(guard)
    }

    /// The instance of `role` (not in `tried`) that session `key` belongs to: the highest
    /// of a hash of the key and each instance's URL (rendezvous hashing). No state is kept
    /// per session, every proxy in front of the same fleet picks the same instance, and an
    /// instance that leaves (or fails, so it is `tried`) moves only its own sessions, each to
    /// its next-highest instance.
    pub fn pick_session(&self, role: Role, tried: &[String], key: &str) -> Option<InFlight> {
        let chosen = self
            .candidates(role, tried)
            .max_by_key(|i| session_rank(key, &i.url))?;
        Some(InFlight::start(Arc::clone(chosen), 0))
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
        let candidates: Vec<&Arc<Instance>> = self.candidates(role, tried).collect();
        let chosen: &Arc<Instance> = if self.routing == Routing::RoundRobin {
            *self.in_turn(&candidates)?
        } else {
            let loads: Vec<usize> = candidates.iter().map(|i| i.in_flight()).collect();
            let least = *loads.iter().min()?;
            let tied: Vec<&Arc<Instance>> = candidates
                .iter()
                .zip(&loads)
                .filter(|(_, &n)| n == least)
                .map(|(i, _)| *i)
                .collect();
            *self.in_turn(&tied)?
        };
        Some(InFlight::start(Arc::clone(chosen), 0))
    }

    /// The instances of `role` not in `tried` (by URL).
    fn candidates<'a>(
        &'a self,
        role: Role,
        tried: &'a [String],
    ) -> impl Iterator<Item = &'a Arc<Instance>> + 'a {
        self.of(role).filter(move |i| !tried.contains(&i.url))
    }

    /// The next of `tied` in turn (the fleet's one counter, so ties spread over requests).
    fn in_turn<'a, T>(&self, tied: &'a [T]) -> Option<&'a T> {
        if tied.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Some(&tied[turn % tied.len()])
    }
}

/// Session `key`'s rank of the instance at `url` (rendezvous hashing): SipHash with fixed
/// keys (std's `DefaultHasher::new()`), so every run and every proxy of one build ranks alike.
fn session_rank(key: &str, url: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    url.hash(&mut h);
    h.finish()
}

/// One candidate of a route by prefix.
struct Score<'a> {
    /// `overlap_weight × blocks to prefill + decode blocks in flight`.
    cost: f64,
    in_flight: usize,
    /// Prompt tokens predicted cached there.
    hit_tokens: usize,
    /// The blocks this request will decode into there.
    decode_blocks: usize,
    instance: &'a Arc<Instance>,
}

/// Seconds since the Unix epoch, as KV event batches stamp them.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    /// A session stays on one instance whatever the load; sessions spread; an instance that
    /// leaves moves only its own sessions.
    #[test]
    fn a_session_keeps_its_instance_and_losing_one_moves_only_its_sessions() {
        let d = urls(&["http://d0", "http://d1", "http://d2"]);
        let fleet = Fleet::new(&urls(&["http://p0"]), &d);
        let keys: Vec<String> = (0..60).map(|k| format!("session-{k}")).collect();
        let home = |tried: &[String], key: &str| {
            fleet
                .pick_session(Role::Decode, tried, key)
                .unwrap()
                .instance
                .url
                .clone()
        };
        let before: Vec<String> = keys.iter().map(|k| home(&[], k)).collect();
        // Load does not move a session.
        let _busy: Vec<InFlight> = (0..5)
            .map(|_| fleet.pick_session(Role::Decode, &[], &keys[0]).unwrap())
            .collect();
        assert_eq!(home(&[], &keys[0]), before[0]);
        for url in &d {
            let n = before.iter().filter(|u| *u == url).count();
            assert!(n >= 10, "{url} holds {n} of 60 sessions");
        }
        // d1 leaves: its sessions move, the others stay.
        let gone = [d[1].clone()];
        for (k, was) in keys.iter().zip(&before) {
            let now = home(&gone, k);
            if *was == d[1] {
                assert_ne!(now, d[1]);
            } else {
                assert_eq!(&now, was, "{k} moved though its instance stayed");
            }
        }
        assert!(fleet.pick_session(Role::Decode, &d, "s").is_none());
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
