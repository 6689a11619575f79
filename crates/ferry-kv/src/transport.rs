//! Transports: how an export's blocks get from P's arena into D's.
//!
//! The trait is shaped for a one-sided transport (NIXL, RDMA reads P never sees): D pulls;
//! everything P must learn (a pull finished, an export gone) arrives as a report
//! (`PdReport::ExportPulled`, `ExportGone`) through the [`Reports`] it published with,
//! never as a side effect of serving bytes that P's engine thread would have to wait for.
//!
//! P's checks live with the export (they are the same for every transport): a pull must
//! present the export's token, weight version and prompt hash, and name exactly the
//! export's block ids at the positions it asks for; an export is pulled once. Anything else
//! fails closed (`FetchError`), and D recomputes or fails per its policy.
//!
//! [`InMemoryTransport`] moves blocks between engines in one process (tests, the P/D bench):
//! a shared [`InMemoryFabric`] maps engine ids to their published exports, and each fetch
//! runs on its own thread, copying block to block between the two arenas' grants.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use ferry_arena::{BlockGrant, Reports};
use ferry_core::{BlockId, FetchError, FetchFailure, PdReport, TransferId, Unpublished};

/// An export P offers: its blocks (a read grant over the hold's blocks) and what a reader
/// must present.
pub struct ExportOffer {
    pub engine_id: String,
    pub hold: TransferId,
    pub token: String,
    pub weight_version: String,
    pub prompt_hash: [u8; 32],
    pub n_tokens: usize,
    pub grant: BlockGrant,
}

impl std::fmt::Debug for ExportOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportOffer")
            .field("engine_id", &self.engine_id)
            .field("hold", &self.hold)
            .field("weight_version", &self.weight_version)
            .field("n_tokens", &self.n_tokens)
            .field("blocks", &self.grant.blocks())
            .finish_non_exhaustive()
    }
}

/// What D asks for.
#[derive(Debug, Clone)]
pub struct FetchSpec {
    pub hold: TransferId,
    pub remote_engine_id: String,
    pub remote_host: Option<String>,
    pub remote_port: Option<u16>,
    pub token: String,
    pub weight_version: String,
    pub prompt_hash: [u8; 32],
    /// Index in the export's blocks of `src_blocks[0]`.
    pub first_block: usize,
    pub src_blocks: Vec<BlockId>,
}

/// D tells P it will not pull an export (`WorkerJob::Release`): the token proves it may.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseSpec {
    pub remote_engine_id: String,
    pub remote_host: Option<String>,
    pub remote_port: Option<u16>,
    pub token: String,
}

/// Moves exports between engines. Every method returns at once; results are reports.
pub trait Transport: Send + Sync {
    /// P: serve `offer` until it is pulled (report `ExportPulled`), unpublished or released.
    fn publish(&self, offer: ExportOffer, reports: Reports);

    /// P: stop serving `hold`; once no pull of it is in progress any more, report
    /// `ExportGone` (also if it was pulled already: the connector ignores a second end). A
    /// later pull of it is refused as `reason` says (revoked or expired), so D can tell a
    /// retraction by the lifecycle from a fault.
    fn unpublish(&self, engine_id: &str, hold: TransferId, reason: Unpublished, reports: Reports);

    /// D: tell P that the export `spec.token` names will not be pulled; P stops serving it
    /// and reports `ExportGone`, so its blocks come back before the lease ends. Best effort
    /// and fire-and-forget: nothing comes back to D, and P's lease still bounds the export.
    fn release(&self, spec: ReleaseSpec);

    /// D: copy the export's blocks into `dst` (a write grant over the hold's blocks), then
    /// report `FetchDone` with the outcome. The grant is dropped before the report.
    fn fetch(&self, spec: FetchSpec, dst: BlockGrant, reports: Reports);

    /// D: cut the fetch of `hold` short; its `FetchDone` still comes, once nothing writes
    /// its blocks.
    fn cancel_fetch(&self, hold: TransferId);
}

/// A published export, as a transport keeps it.
struct Published {
    offer: ExportOffer,
    reports: Reports,
}

/// P's checks on a pull, the same for every transport (the token is checked by looking the
/// export up by it): the weight version, the prompt hash, and exactly the export's block ids
/// at the asked positions. `Ok` names the blocks to read (positions in the offer's grant).
/// Public so that every transport, the simulation's too, checks pulls with this code.
/// Every `Err` is invalid input (`FetchFailure::Invalid`).
pub fn check_pull(
    offer: &ExportOffer,
    spec: &FetchSpec,
) -> Result<std::ops::Range<usize>, PullError> {
    if spec.weight_version != offer.weight_version {
        return Err(PullError::WeightVersion {
            export: offer.weight_version.clone(),
            reader: spec.weight_version.clone(),
        });
    }
    if spec.prompt_hash != offer.prompt_hash {
        return Err(PullError::Prompt);
    }
    let range = spec.first_block..spec.first_block.saturating_add(spec.src_blocks.len());
    if offer.grant.blocks().get(range.clone()) != Some(&spec.src_blocks[..]) {
        return Err(PullError::Blocks);
    }
    Ok(range)
}

/// D's own check before a pull: one destination block per source block.
pub fn check_destination(spec: &FetchSpec, n_dst: usize) -> Result<(), PullError> {
    if n_dst != spec.src_blocks.len() {
        return Err(PullError::Destination {
            n_dst,
            n_src: spec.src_blocks.len(),
        });
    }
    Ok(())
}

/// A pull that does not match its export ([`check_pull`], on P) or its destination
/// ([`check_destination`], on D): invalid input, refused before any block moves. `Display` is
/// the reason the refusal carries (on the wire, for the TCP transport).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    #[error("the export holds KV of weights {export:?}, the reader expects {reader:?}")]
    WeightVersion { export: String, reader: String },
    #[error("the reader's prompt is not the exported one")]
    Prompt,
    #[error("remote_block_ids are not the export's blocks")]
    Blocks,
    #[error("{n_dst} destination blocks for {n_src} source blocks")]
    Destination { n_dst: usize, n_src: usize },
}

impl From<PullError> for FetchError {
    fn from(e: PullError) -> Self {
        FetchError::invalid(e.to_string())
    }
}

/// The message of a pull whose token names no export.
pub fn no_export(engine_id: &str) -> String {
    format!("no export with this token on engine {engine_id:?} (unknown or already pulled)")
}

/// Why a pull of a token that names no live export is refused: what P remembers of the
/// token's end ([`Tombstones`]: revoked, expired, pulled or released, or gone with a crashed
/// engine, a fault), or, for a token P never served or forgot, `Invalid`: an unknown token
/// fails closed whatever the policy (P cannot tell a forged token from one of its own earlier
/// runs; with the default random engine id a restarted P has another id, which is a fault).
pub fn gone_export(engine_id: &str, ended: Option<FetchFailure>) -> FetchError {
    let (kind, reason) = match ended {
        Some(FetchFailure::Revoked) => (
            FetchFailure::Revoked,
            format!("engine {engine_id:?} revoked the export (a cache reset, sleep or KV release)"),
        ),
        Some(FetchFailure::Expired) => (
            FetchFailure::Expired,
            format!("the export's lease on engine {engine_id:?} ran out before it was pulled"),
        ),
        Some(FetchFailure::Invalid) => (
            FetchFailure::Invalid,
            format!("the export on engine {engine_id:?} was pulled or released already"),
        ),
        Some(FetchFailure::Fault) => (
            FetchFailure::Fault,
            format!("engine {engine_id:?} is gone, and its exports with it (P crashed)"),
        ),
        None => (FetchFailure::Invalid, no_export(engine_id)),
    };
    FetchError::refused(kind, reason)
}

/// P's memory of exports that ended, by token, so a late pull hears why (revoked, expired,
/// pulled or released: [`gone_export`]). Bounded: the oldest are forgotten first (a token
/// forgotten reads as unknown, which fails closed).
#[derive(Debug, Default)]
pub struct Tombstones {
    order: VecDeque<String>,
    by_token: HashMap<String, FetchFailure>,
}

impl Tombstones {
    /// How many ended exports P remembers.
    pub const CAPACITY: usize = 1 << 16;

    /// Records how the export `token` ended: `Revoked`, `Expired`, `Invalid` for one pulled
    /// or released (a second pull is a replay), `Fault` for one gone with a crashed engine.
    pub fn record(&mut self, token: &str, how: FetchFailure) {
        if self.by_token.insert(token.to_owned(), how).is_none() {
            self.order.push_back(token.to_owned());
            if self.order.len() > Self::CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.by_token.remove(&old);
                }
            }
        }
    }

    pub fn get(&self, token: &str) -> Option<FetchFailure> {
        self.by_token.get(token).copied()
    }
}

/// The exports of every engine in one process, shared by their [`InMemoryTransport`]s.
#[derive(Default)]
pub struct InMemoryFabric {
    /// (engine id, token) → export. A pull copies under this lock, so an unpublish that
    /// takes it waits for a pull in progress.
    exports: Mutex<HashMap<(String, String), Published>>,
    /// How ended exports ended, by (engine id, token).
    ended: Mutex<HashMap<String, Tombstones>>,
    /// Fetches in flight, by (D's engine id, hold): their cancel flags.
    fetches: Mutex<HashMap<(String, TransferId), Arc<AtomicBool>>>,
}

impl InMemoryFabric {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Exports published now, over every engine.
    pub fn n_published(&self) -> usize {
        lock(&self.exports).len()
    }

    /// Runs one pull: checks, copies, takes the export off the fabric. `Ok`: P's reports and
    /// its hold, to tell P the export was pulled.
    fn pull(
        &self,
        spec: &FetchSpec,
        dst: &mut BlockGrant,
    ) -> Result<(Reports, TransferId), FetchError> {
        let key = (spec.remote_engine_id.clone(), spec.token.clone());
        let mut exports = lock(&self.exports);
        let Some(published) = exports.get(&key) else {
            let ended = lock(&self.ended)
                .get(&spec.remote_engine_id)
                .and_then(|t| t.get(&spec.token));
            return Err(gone_export(&spec.remote_engine_id, ended));
        };
        check_destination(spec, dst.blocks().len())?;
        let range = check_pull(&published.offer, spec)?;
        for (j, i) in range.enumerate() {
            published
                .offer
                .grant
                .copy_into(i, dst, j)
                .map_err(|e| FetchError::fault(j, e.to_string()))?;
        }
        let published = exports.remove(&key).expect("looked up above");
        self.record_end(&key.0, &key.1, FetchFailure::Invalid);
        Ok((published.reports, published.offer.hold))
    }
}

impl InMemoryFabric {
    fn record_end(&self, engine_id: &str, token: &str, how: FetchFailure) {
        lock(&self.ended)
            .entry(engine_id.to_owned())
            .or_default()
            .record(token, how);
    }
}

impl std::fmt::Debug for InMemoryFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryFabric")
            .field("n_published", &self.n_published())
            .finish()
    }
}

/// One engine's endpoint on an [`InMemoryFabric`].
#[derive(Debug, Clone)]
pub struct InMemoryTransport {
    engine_id: String,
    fabric: Arc<InMemoryFabric>,
}

impl InMemoryTransport {
    pub fn new(engine_id: impl Into<String>, fabric: Arc<InMemoryFabric>) -> Self {
        Self {
            engine_id: engine_id.into(),
            fabric,
        }
    }
}

impl Transport for InMemoryTransport {
    fn publish(&self, offer: ExportOffer, reports: Reports) {
        let key = (offer.engine_id.clone(), offer.token.clone());
        lock(&self.fabric.exports).insert(key, Published { offer, reports });
    }

    fn unpublish(&self, engine_id: &str, hold: TransferId, reason: Unpublished, reports: Reports) {
        let mut exports = lock(&self.fabric.exports);
        let mut gone = Vec::new();
        exports.retain(|(e, t), p| {
            let keep = !(e == engine_id && p.offer.hold == hold);
            if !keep {
                gone.push(t.clone());
            }
            keep
        });
        drop(exports);
        for token in gone {
            self.fabric.record_end(engine_id, &token, reason.into());
        }
        reports.send(PdReport::ExportGone { hold });
    }

    fn release(&self, spec: ReleaseSpec) {
        let key = (spec.remote_engine_id, spec.token);
        let removed = lock(&self.fabric.exports).remove(&key);
        if let Some(published) = removed {
            self.fabric
                .record_end(&key.0, &key.1, FetchFailure::Invalid);
            let hold = published.offer.hold;
            let reports = published.reports;
            // The grant goes before the report: P frees the blocks on it.
            drop(published.offer);
            reports.send(PdReport::ExportGone { hold });
        }
    }

    fn fetch(&self, spec: FetchSpec, mut dst: BlockGrant, reports: Reports) {
        let cancelled = Arc::new(AtomicBool::new(false));
        let key = (self.engine_id.clone(), spec.hold);
        lock(&self.fabric.fetches).insert(key.clone(), cancelled.clone());
        let fabric = self.fabric.clone();
        let hold = spec.hold;
        let reports_on_failure = reports.clone();
        // One thread per fetch: in-process copies are short, and a fetch must never run on
        // the engine thread.
        let spawned = std::thread::Builder::new()
            .name("ferry-kv-fetch".into())
            .spawn(move || {
                let result = if cancelled.load(Ordering::Acquire) {
                    Err(FetchError::cancelled(0))
                } else {
                    fabric.pull(&spec, &mut dst)
                };
                // Nothing writes the blocks once the grant is gone: only then is it reported.
                drop(dst);
                lock(&fabric.fetches).remove(&key);
                let result = result.map(|(p_reports, p_hold)| {
                    p_reports.send(PdReport::ExportPulled { hold: p_hold });
                });
                reports.send(PdReport::FetchDone {
                    hold: spec.hold,
                    result,
                });
            });
        if let Err(e) = spawned {
            // The closure (and its grant) is dropped with the error.
            lock(&self.fabric.fetches).remove(&(self.engine_id.clone(), hold));
            reports_on_failure.send(PdReport::FetchDone {
                hold,
                result: Err(FetchError::fault(
                    0,
                    format!("cannot start a fetch thread: {e}"),
                )),
            });
        }
    }

    fn cancel_fetch(&self, hold: TransferId) {
        if let Some(flag) = lock(&self.fabric.fetches).get(&(self.engine_id.clone(), hold)) {
            flag.store(true, Ordering::Release);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
