//! The simulated network between P and D: an implementation of `ferry_kv::Transport` whose
//! pulls happen when the simulation says, not on threads.
//!
//! The real P/D worker (`ferry_kv::PdWorker`) publishes and fetches through it, and a pull is
//! checked by P's own checks (`ferry_kv::transport::check_pull`) and copies real KV bytes
//! between the two arenas' grants, as the in-memory and TCP transports do. What the
//! simulation adds is *when* and *whether*: each fetch completes at a drawn time (so fetches
//! finish out of order, as independent TCP connections do), and faults make pulls fail: a
//! link that is down, a pull that breaks after some blocks (P keeps its export, as a TCP
//! server whose client vanished does), a pull P served but D never got, a slow pull that
//! outlives D's load bound, a cancel that comes too late (the pull was already copying and
//! finishes), and a peer that crashed (its exports vanish with it).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_arena::{BlockGrant, Reports};
use ferry_core::{FetchError, FetchFailure, PdReport, TransferId, Unpublished};
use ferry_kv::transport::{check_destination, check_pull, gone_export, Tombstones};
use ferry_kv::{ExportOffer, FetchSpec, ReleaseSpec, Transport};

use crate::rng::Rng;

/// A published export.
struct Published {
    offer: ExportOffer,
    reports: Reports,
}

/// A fetch D started and the network has not finished.
struct Fetch {
    /// D's engine id.
    d_engine: String,
    spec: FetchSpec,
    dst: BlockGrant,
    reports: Reports,
    cancelled: bool,
    due: Duration,
    /// Decided when the fetch started (the fault in force then).
    fate: Fate,
}

/// What happens to a fetch when it falls due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Normal,
    BreakAfter(usize),
    LostAfterServe,
}

/// Faults waiting for the next fetches.
#[derive(Debug, Default)]
struct Pending {
    slow: VecDeque<Duration>,
    break_after: Option<usize>,
    lost_after_serve: bool,
}

/// A fault the simulation injected that touched one fetch (or what P said of its export), so
/// the checks can tell a failure it caused from one the engine made up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    /// The pull was slowed to take this long (past D's load bound when long).
    Slow(Duration),
    /// It fell due while the link of P or D was down.
    LinkDown,
    /// It broke after some blocks.
    Broken,
    /// P served it, D's side of the connection dropped.
    Lost,
    /// Its export died with a crashed P.
    PeerDied,
    /// P refused it: the export's lease had run out (no fault injected; the checks ask
    /// whether D was running normally meanwhile).
    LeaseRanOut,
}

/// What one pull did, for the trace.
#[derive(Debug, Clone)]
pub struct PullEvent {
    pub hold: TransferId,
    pub from: String,
    pub to: String,
    pub outcome: Result<usize, String>,
    /// Blocks the pull wrote into D's arena (also on a pull that broke part way, or whose
    /// connection dropped after P served it).
    pub n_written: usize,
}

/// The network's state, shared by every engine's transport endpoint.
pub struct NetState {
    now: Duration,
    rng: Rng,
    /// (engine id, token) → export.
    exports: BTreeMap<(String, String), Published>,
    /// How each engine's ended exports ended (P's memory, as a real transport keeps it).
    ended: BTreeMap<String, Tombstones>,
    fetches: Vec<Fetch>,
    /// Engine id → when its link comes back.
    down_until: BTreeMap<String, Duration>,
    pending: Pending,
    /// Flip one byte of every pulled block (a test of the checks, never drawn by a seed).
    corrupt: bool,
    /// Blocks the last pull wrote before its connection dropped.
    lost_written: usize,
    /// (D's engine id, hold) → what touched that fetch ([`SimNet::touches`]).
    touched: BTreeMap<(String, TransferId), Vec<Touch>>,
    pub n_pulls_ok: u64,
    pub n_pulls_failed: u64,
}

impl std::fmt::Debug for NetState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetState")
            .field("now", &self.now)
            .field("n_exports", &self.exports.len())
            .field("n_fetches", &self.fetches.len())
            .finish_non_exhaustive()
    }
}

/// The network, shared by the simulation and every endpoint.
#[derive(Debug, Clone)]
pub struct SimNet(Arc<Mutex<NetState>>);

impl SimNet {
    pub fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(NetState {
            now: Duration::ZERO,
            rng: Rng::new(seed, 2),
            exports: BTreeMap::new(),
            ended: BTreeMap::new(),
            fetches: Vec::new(),
            down_until: BTreeMap::new(),
            pending: Pending::default(),
            corrupt: false,
            lost_written: 0,
            touched: BTreeMap::new(),
            n_pulls_ok: 0,
            n_pulls_failed: 0,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, NetState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An endpoint for the engine `engine_id`.
    pub fn endpoint(&self, engine_id: &str) -> SimTransport {
        SimTransport {
            engine_id: engine_id.to_owned(),
            net: self.clone(),
        }
    }

    pub fn set_now(&self, now: Duration) {
        self.lock().now = now;
    }

    pub fn link_down(&self, engine_id: &str, until: Duration) {
        self.lock().down_until.insert(engine_id.to_owned(), until);
    }

    pub fn heal(&self) {
        let mut s = self.lock();
        s.down_until.clear();
        s.pending = Pending::default();
    }

    pub fn slow(&self, n: usize, each: Duration) {
        self.lock()
            .pending
            .slow
            .extend(std::iter::repeat_n(each, n));
    }

    pub fn break_next_pull(&self, good_blocks: usize) {
        self.lock().pending.break_after = Some(good_blocks);
    }

    pub fn lose_next_pull(&self) {
        self.lock().pending.lost_after_serve = true;
    }

    /// Corrupts every pulled block from now on (for tests that the oracle sees bad KV).
    pub fn corrupt_pulls(&self) {
        self.lock().corrupt = true;
    }

    /// An engine died: its exports vanish (their grants drop), and its own fetches are
    /// gone with it (nobody is left to report to).
    pub fn crash(&self, engine_id: &str) {
        let mut s = self.lock();
        let gone: Vec<String> = s
            .exports
            .keys()
            .filter(|(e, _)| e == engine_id)
            .map(|(_, t)| t.clone())
            .collect();
        // A pull of an export that died with its engine fails as a fault (P is gone), as a
        // real reader's connection would.
        for token in gone {
            s.record_end(engine_id, &token, FetchFailure::Fault);
        }
        s.exports.retain(|(e, _), _| e != engine_id);
        s.fetches.retain(|f| f.d_engine != engine_id);
        // Its next incarnation numbers its holds afresh.
        s.touched.retain(|(d, _), _| d != engine_id);
    }

    /// What touched the fetch of `hold` that `d_engine` made (faults injected on it, or
    /// P's word that its lease ran out), in order.
    pub fn touches(&self, d_engine: &str, hold: TransferId) -> Vec<Touch> {
        self.lock()
            .touched
            .get(&(d_engine.to_owned(), hold))
            .cloned()
            .unwrap_or_default()
    }

    /// Exports published now and fetches in flight.
    pub fn n_outstanding(&self) -> (usize, usize) {
        let s = self.lock();
        (s.exports.len(), s.fetches.len())
    }

    /// Fetches `engine_id` has in flight (as the reader).
    pub fn n_fetches_of(&self, engine_id: &str) -> usize {
        self.lock()
            .fetches
            .iter()
            .filter(|f| f.d_engine == engine_id)
            .count()
    }

    /// The earliest time a fetch falls due.
    pub fn next_due(&self) -> Option<Duration> {
        self.lock().fetches.iter().map(|f| f.due).min()
    }

    pub fn counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.n_pulls_ok, s.n_pulls_failed)
    }

    /// Completes every fetch due by `now`, in a drawn order; reports go to their engines'
    /// [`Reports`] (the simulation's mailboxes).
    pub fn fire_due(&self) -> Vec<PullEvent> {
        let mut s = self.lock();
        let now = s.now;
        let mut due = Vec::new();
        let mut i = 0;
        while i < s.fetches.len() {
            if s.fetches[i].due <= now {
                due.push(s.fetches.swap_remove(i));
            } else {
                i += 1;
            }
        }
        // Due fetches are independent connections: any order is possible.
        let mut events = Vec::new();
        while !due.is_empty() {
            let k = s.rng.below(due.len() as u64) as usize;
            let fetch = due.swap_remove(k);
            events.push(s.complete(fetch));
        }
        events
    }
}

impl NetState {
    fn record_end(&mut self, engine_id: &str, token: &str, how: FetchFailure) {
        self.ended
            .entry(engine_id.to_owned())
            .or_default()
            .record(token, how);
    }

    fn touch(&mut self, d_engine: &str, hold: TransferId, touch: Touch) {
        self.touched
            .entry((d_engine.to_owned(), hold))
            .or_default()
            .push(touch);
    }

    fn is_down(&self, engine_id: &str) -> bool {
        self.down_until
            .get(engine_id)
            .is_some_and(|&t| t > self.now)
    }

    fn complete(&mut self, fetch: Fetch) -> PullEvent {
        let Fetch {
            d_engine,
            spec,
            mut dst,
            reports,
            cancelled,
            due: _,
            fate,
        } = fetch;
        let fail = |good_blocks: usize, reason: String| FetchError::fault(good_blocks, reason);
        let result = if cancelled {
            Err(FetchError::cancelled(0))
        } else if self.is_down(&spec.remote_engine_id) || self.is_down(&d_engine) {
            self.touch(&d_engine, spec.hold, Touch::LinkDown);
            Err(fail(0, "connection refused: the link is down".into()))
        } else {
            self.pull(&d_engine, &spec, &mut dst, fate)
        };
        // The grant goes before the report: nothing writes the blocks once the hold ends.
        drop(dst);
        match &result {
            Ok(()) => self.n_pulls_ok += 1,
            Err(_) => self.n_pulls_failed += 1,
        }
        let n_written = match &result {
            Ok(()) => spec.src_blocks.len(),
            Err(e) => e.good_blocks.max(std::mem::take(&mut self.lost_written)),
        };
        let event = PullEvent {
            hold: spec.hold,
            from: spec.remote_engine_id.clone(),
            to: d_engine,
            outcome: result
                .as_ref()
                .map(|()| spec.src_blocks.len())
                .map_err(|e| e.reason.clone()),
            n_written,
        };
        reports.send(PdReport::FetchDone {
            hold: spec.hold,
            result,
        });
        event
    }

    /// One pull, checked as P's worker checks it, the bytes copied block by block.
    fn pull(
        &mut self,
        d_engine: &str,
        spec: &FetchSpec,
        dst: &mut BlockGrant,
        fate: Fate,
    ) -> Result<(), FetchError> {
        let fail = |good_blocks: usize, reason: String| FetchError::fault(good_blocks, reason);

        let key = (spec.remote_engine_id.clone(), spec.token.clone());
        let Some(published) = self.exports.get(&key) else {
            let ended = self
                .ended
                .get(&spec.remote_engine_id)
                .and_then(|t| t.get(&spec.token));
            match ended {
                // The export died with its engine: P is gone, a fault.
                Some(FetchFailure::Fault) => {
                    self.touch(d_engine, spec.hold, Touch::PeerDied);
                    return Err(fail(
                        0,
                        format!(
                            "engine {:?} died with the export (a crashed peer)",
                            spec.remote_engine_id
                        ),
                    ));
                }
                Some(FetchFailure::Expired) => {
                    self.touch(d_engine, spec.hold, Touch::LeaseRanOut);
                }
                _ => {}
            }
            return Err(gone_export(&spec.remote_engine_id, ended));
        };
        check_destination(spec, dst.blocks().len())?;
        let range = check_pull(&published.offer, spec)?;
        let n = range.len();
        let n_copy = match fate {
            Fate::BreakAfter(good) => good.min(n),
            _ => n,
        };
        for (j, i) in range.take(n_copy).enumerate() {
            published
                .offer
                .grant
                .copy_into(i, dst, j)
                .map_err(|e| fail(j, e.to_string()))?;
            if self.corrupt {
                let bytes = dst.block_bytes_mut(j).map_err(|e| fail(j, e.to_string()))?;
                bytes[0] ^= 1;
            }
        }
        match fate {
            Fate::BreakAfter(good) if good < n => {
                self.touch(d_engine, spec.hold, Touch::Broken);
                return Err(fail(good, "connection reset by peer mid-pull".into()));
            }
            _ => {}
        }
        let published = self.exports.remove(&key).expect("looked up above");
        self.record_end(&key.0, &key.1, FetchFailure::Invalid);
        published.reports.send(PdReport::ExportPulled {
            hold: published.offer.hold,
        });
        if fate == Fate::LostAfterServe {
            // The blocks were written; D is told none is good.
            self.lost_written = n;
            self.touch(d_engine, spec.hold, Touch::Lost);
            return Err(fail(
                0,
                "the connection dropped after P served the pull".into(),
            ));
        }
        Ok(())
    }
}

/// One engine's endpoint on the [`SimNet`].
#[derive(Debug, Clone)]
pub struct SimTransport {
    engine_id: String,
    net: SimNet,
}

impl Transport for SimTransport {
    fn publish(&self, offer: ExportOffer, reports: Reports) {
        let key = (offer.engine_id.clone(), offer.token.clone());
        let mut s = self.net.lock();
        s.exports.insert(key, Published { offer, reports });
    }

    fn unpublish(&self, engine_id: &str, hold: TransferId, reason: Unpublished, reports: Reports) {
        let mut s = self.net.lock();
        let gone: Vec<String> = s
            .exports
            .iter()
            .filter(|((e, _), p)| e == engine_id && p.offer.hold == hold)
            .map(|((_, t), _)| t.clone())
            .collect();
        for token in gone {
            s.exports.remove(&(engine_id.to_owned(), token.clone()));
            s.record_end(engine_id, &token, reason.into());
        }
        drop(s);
        reports.send(PdReport::ExportGone { hold });
    }

    fn release(&self, spec: ReleaseSpec) {
        let mut s = self.net.lock();
        let key = (spec.remote_engine_id, spec.token);
        // A release crosses the link like a pull: it is lost while either side is down (P's
        // lease then bounds the export).
        if s.is_down(&key.0) || s.is_down(&self.engine_id) {
            return;
        }
        if let Some(published) = s.exports.remove(&key) {
            s.record_end(&key.0, &key.1, FetchFailure::Invalid);
            drop(s);
            let hold = published.offer.hold;
            let reports = published.reports;
            drop(published.offer);
            reports.send(PdReport::ExportGone { hold });
        }
    }

    fn fetch(&self, spec: FetchSpec, dst: BlockGrant, reports: Reports) {
        let mut s = self.net.lock();
        let latency = match s.pending.slow.pop_front() {
            Some(slow) => {
                s.touch(&self.engine_id, spec.hold, Touch::Slow(slow));
                slow
            }
            None => Duration::from_millis(s.rng.range(1, 80)),
        };
        let fate = if let Some(good) = s.pending.break_after.take() {
            Fate::BreakAfter(good)
        } else if std::mem::take(&mut s.pending.lost_after_serve) {
            Fate::LostAfterServe
        } else {
            Fate::Normal
        };
        let due = s.now + latency;
        s.fetches.push(Fetch {
            d_engine: self.engine_id.clone(),
            spec,
            dst,
            reports,
            cancelled: false,
            due,
            fate,
        });
    }

    fn cancel_fetch(&self, hold: TransferId) {
        let mut s = self.net.lock();
        // A cancel is advisory: a pull already copying may finish anyway (and report
        // success) at its own time; otherwise the reader stops at the next block, soon.
        let too_late = s.rng.chance(1, 2);
        let soon = s.now + Duration::from_millis(1);
        for f in &mut s.fetches {
            if f.d_engine == self.engine_id && f.spec.hold == hold && !too_late {
                f.cancelled = true;
                f.due = f.due.min(soon);
            }
        }
    }
}
