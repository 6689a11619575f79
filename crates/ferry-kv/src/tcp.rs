//! The TCP transport: D pulls an export's blocks from P's transfer listener.
//!
//! Why tokio and not `std::net` with threads: a fetch must be cancellable at a block boundary
//! and bounded by a timeout on every read and write, and P must serve many connections; async
//! tasks give both (`select!` on a cancel signal, `tokio::time::timeout`) without a thread per
//! connection. The transport owns its runtime (a small multi-thread one), so it works the same
//! from the engine thread, a test thread or inside another runtime, and dropping the transport
//! shuts it down (`shutdown_background`, allowed anywhere).
//!
//! # Protocol (version [`PROTOCOL_VERSION`], all integers little-endian)
//!
//! D opens the connections and sends requests on them, one at a time; a connection serves
//! many requests (see *Connection reuse* below). Strings are a u32 length (at most
//! [`MAX_STRING_BYTES`]) and UTF-8. A *status* is u8 0 (ok); or u8 1 and a string reason (a
//! refusal that is a fault: the form version 1 used, so peers of either version read each
//! other's handshake refusals); or u8 2, a u8 kind and a string reason (a refusal that says who
//! is to blame, [`FetchFailure`]: 0 fault, 1 revoked, 2 expired, 3 invalid). P closes the
//! connection after a refused handshake.
//!
//! The handshake:
//!
//! 1. D → P, the *hello*: `"FERRYKV\0"`, u32 protocol version, u8 1 if KV floats are
//!    little-endian f32, string model id, u32 layers, KV heads, head dim, block size, aux words
//!    per token (version 3: an MoE model's expert routing travels in the blocks, after the
//!    K/V planes, `KvLayout::aux_floats`), u8 1 if D has a fleet secret (else 0), and a 32-byte
//!    nonce `nd` (random with a secret, else zeros).
//! 2. P → D: a status, refused for another protocol version, P at its connection limit, or a
//!    secret on one side only. With secrets, the ok is followed by P's random 32-byte nonce
//!    `np` and P's proof `mac_p`.
//! 3. With secrets, D → P: D's proof `mac_d`, sent only once `mac_p` verified.
//! 4. P → D: a status, refused for another model id, KV layout or byte order, or a `mac_d`
//!    that does not verify.
//!
//! The proofs are keyed BLAKE3 hashes under `key = blake3::derive_key("ferry kv transfer
//! secret v2", secret)`: `mac_X = keyed_hash(key, "ferry kv proof X" ‖ u64 length of the hello
//! ‖ the hello ‖ np)` for X = P, D, so each side proves it holds the key over both fresh
//! nonces and the model id and layout D sent, and nothing secret is on the wire. Both compare
//! in constant time; any mismatch refuses the connection before any request is served.
//!
//! Then requests, which P serves until D closes (or stays idle for `io_timeout`):
//!
//! * *pull*: u8 1, strings engine id, token, weight version, 32-byte prompt hash, u64 first
//!   block, u32 count and that many u32 block ids. P checks it exactly as every transport does
//!   ([`check_pull`]) and answers a status; on ok it streams the blocks, each exactly
//!   `block_bytes` long, straight from its read grant to the socket; D reads them straight
//!   into its write grant's blocks. A refusal says who is to blame: a token P does not serve
//!   is revoked, expired, or invalid (pulled or released already, or never seen) as P's
//!   [`Tombstones`] remember it; a pull that fails [`check_pull`] or races another reader is
//!   invalid; a pull naming another engine id is a fault (P restarted with a new id, or this
//!   is not the P the parameters name).
//! * *read* (one-sided transports only, [`crate::one_sided`]): u8 3, the fields of a pull, then
//!   u64 the metadata generation D holds for this P (0: none). P checks it as a pull, marks
//!   the export *being read* and answers a status; on ok: u64 P's metadata generation, u32
//!   length and the metadata bytes (empty when D holds that generation), u32 P's read timeout
//!   in milliseconds, u32 count and that many u64 block addresses. D reads the blocks with
//!   its network stack, then sends *read done*: u8 4, u8 1 if every byte arrived (else 0). P
//!   answers ok, and ends the export as pulled on a 1 (puts it back on a 0), if *read done*
//!   came within its read timeout; otherwise P has already put the export back or ended it,
//!   and closes the connection, so D counts nothing it read. A P without a one-sided
//!   transport refuses a read as a fault.
//! * *release*: u8 2, strings engine id and token. P stops serving a published export with
//!   that token (and reports `ExportGone`), ignores a token it does not serve, and answers a
//!   status (refused, as a fault, only for another engine id).
//!
//! # Trust
//!
//! D connects only to an IP literal inside `allowed_peers` (no name is ever resolved here; a
//! `remote_host` outside the set fails the fetch as invalid before any connection), and with a
//! fleet secret P and D authenticate each other before any request (`connectors.md`, *Trust*).
//! The stream is not encrypted: the secret keeps peers that do not hold it out, not an
//! attacker who can rewrite packets on an established connection.
//!
//! # What each side learns, and when
//!
//! * P reports `ExportPulled` once the last byte of the last block was written, and the export
//!   is gone. A pull in progress holds its export: an `unpublish` or a release meanwhile ends
//!   it only when the pull ended (`unpublish` reports `ExportGone` then; the in-memory fabric
//!   does the same under its lock). A pull that fails mid-way (D gone, a write timed out) puts
//!   the export back, published until unpublish, release or lease expiry, unless it was
//!   unpublished or released meanwhile: P never waits for anything a reader does. However an
//!   export ended, P remembers how by token, so a late pull hears the right kind.
//! * D reports `FetchDone` once its grant is dropped: `Ok`, or `Err` with the number of whole
//!   blocks that arrived and who is to blame. P's refusal of the pull has the kind P sent; a
//!   failed handshake, a peer that closes or stalls past `io_timeout`, and a cancel (taking
//!   effect at the next block boundary, or at once while waiting or connecting) are faults; a
//!   `remote_host` outside `allowed_peers`, missing, or block counts that do not match are
//!   invalid.
//! * A release is fire-and-forget: D logs its failure at debug level, and P's lease still
//!   bounds the export.
//!
//! # Connection reuse
//!
//! A handshake costs round trips (and, with a secret, two proofs each side), a connect one
//! more: on a link with latency that dominates a small pull. So D keeps, per P address, up to
//! `pool_idle_per_peer` idle connections that finished a request cleanly, and sends the next
//! pull or release to that P on one of them (the most recently used first). Only a clean end
//! returns a connection to the pool: a pull whose last block arrived, a refused pull or a
//! refused release (P serves on after refusing a request it could read), a release answered
//! ok. A cancelled or failed pull, a timeout, a protocol error or a failed handshake drops the
//! connection, since D can no longer tell where in the stream it is.
//!
//! An idle connection is checked before it is reused, so a dead one is never used twice: a
//! non-blocking peek that finds a byte (P sends nothing unasked), an end of stream (P closed
//! it: its idle timeout, a restart) or an error drops it, and so does an age past half of
//! `io_timeout` (P closes a connection idle for its own `io_timeout`, which a fleet sets the
//! same everywhere). A background task drops expired ones, so a P no longer used does not
//! keep sockets open on D. When P closes a connection in the instant D reuses it, the request
//! fails before any byte of P's answer arrived; D then sends it once more on a fresh
//! connection (why that is safe is said at the function `request`). Once any byte of P's answer
//! arrived, D never sends a request again. `pool_idle_per_peer = 0` turns the pool off: one
//! connection per fetch or release, closed after it.
//!
//! Bounds: `max_in_flight_fetches` on D (fetches, and releases separately) and
//! `max_connections` on P are semaphores; a connection over P's limit waits for a slot up to
//! `io_timeout`, then is refused with a reason. An idle pooled connection holds one of P's
//! slots until it is reused, P's idle timeout closes it or D drops it, so P's
//! `max_connections` should cover `pool_idle_per_peer` times the D engines it serves, plus
//! their fetches in flight. A release as a whole is bounded by `io_timeout`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ferry_arena::{BlockGrant, KvLayout, Reports};
use ferry_core::{
    AllowedPeers, BlockId, FetchEnd, FetchError, FetchFailure, PdReport, TransferId, Unpublished,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

use crate::one_sided::{OneSided, OneSidedError, Remote};
use crate::transport::{
    check_destination, check_pull, gone_export, ExportOffer, FetchSpec, ReleaseSpec, Tombstones,
    Transport,
};

/// Bumped on every change of the wire format; peers of another version are refused. (The
/// one-sided *read* requests are additions a P of this version without them refuses as an
/// unknown request, so they did not change it.)
pub const PROTOCOL_VERSION: u32 = 3;
const MAGIC: &[u8; 8] = b"FERRYKV\0";
/// Longest string field accepted from a peer (model ids, tokens, versions, reasons).
pub const MAX_STRING_BYTES: u32 = 64 * 1024;
/// Most blocks one pull may ask for.
const MAX_PULL_BLOCKS: u32 = 1 << 20;
const STATUS_OK: u8 = 0;
/// A refusal that is a fault: a string follows (the only refusal of protocol version 1).
const STATUS_REFUSED: u8 = 1;
/// A refusal that says who is to blame: a kind byte and a string follow.
const STATUS_REFUSED_AS: u8 = 2;
const REQUEST_PULL: u8 = 1;
const REQUEST_RELEASE: u8 = 2;
const REQUEST_READ: u8 = 3;
const REQUEST_READ_DONE: u8 = 4;
/// Longest network-stack metadata accepted from P.
const MAX_METADATA_BYTES: u32 = 16 << 20;
/// Derives the proofs' key from the fleet secret.
const KEY_CONTEXT: &str = "ferry kv transfer secret v2";
const PROOF_P: &[u8; 16] = b"ferry kv proof P";
const PROOF_D: &[u8; 16] = b"ferry kv proof D";
const NONCE_BYTES: usize = 32;
/// Why an authenticated handshake failed, on both sides.
pub const AUTH_FAILED: &str = "transfer authentication failed: the peers' KV transfer secrets \
                               differ (or only one side has one)";

/// How a [`TcpTransport`] is set up.
#[derive(Clone)]
pub struct TcpTransportConfig {
    /// This engine's id: pulls naming another engine are refused.
    pub engine_id: String,
    /// P's transfer listener; port 0 picks a free port ([`TcpTransport::local_addr`]).
    pub listen: SocketAddr,
    /// The arena's layout, checked in every handshake.
    pub layout: KvLayout,
    /// What must be equal on both sides for KV to mean the same thing (model source, vocab,
    /// hidden size, ...), checked in every handshake.
    pub model_id: String,
    pub max_in_flight_fetches: usize,
    pub max_connections: usize,
    /// Bound on every connect, read and write (and on a wait for a connection slot).
    pub io_timeout: Duration,
    /// Where D may connect: a `remote_host` must be an IP address inside this set (no name
    /// is resolved here); anything else fails the fetch as invalid, before any connection.
    pub allowed_peers: AllowedPeers,
    /// The fleet's KV transfer secret: with it, P and D prove to each other that they hold
    /// it before any request is served; every peer must have the same one. `None`: no
    /// authentication (peers with a secret refuse this one). Must not be empty.
    pub secret: Option<Vec<u8>>,
    /// D: most idle connections kept per P address for later pulls and releases (module
    /// doc, *Connection reuse*); 0 turns the pool off (a connection per fetch or release).
    pub pool_idle_per_peer: usize,
    /// D reads blocks one-sided through this network stack (NIXL) instead of receiving them on
    /// the connection, and P serves such reads; `None`: TCP only (a P without it refuses
    /// reads, and serves pulls either way).
    pub one_sided: Option<std::sync::Arc<dyn OneSided>>,
    /// P: how long an export stays *being read* before P stops waiting for the reader's word
    /// (a clearing operation waits at most this long for it); D gives up its read by then.
    pub read_timeout: Duration,
}

/// What `ferry serve` waits for a one-sided read (`--kv-read-timeout-seconds`): seconds, not
/// the lease, so that a pause or cache reset on P never waits long for a reader.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What `ferry serve` keeps idle per P: enough for a burst of parallel loads from one P.
pub const DEFAULT_POOL_IDLE_PER_PEER: usize = 8;

impl std::fmt::Debug for TcpTransportConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransportConfig")
            .field("engine_id", &self.engine_id)
            .field("listen", &self.listen)
            .field("layout", &self.layout)
            .field("model_id", &self.model_id)
            .field("max_in_flight_fetches", &self.max_in_flight_fetches)
            .field("max_connections", &self.max_connections)
            .field("io_timeout", &self.io_timeout)
            .field("allowed_peers", &self.allowed_peers.describe())
            // Never the secret itself.
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("pool_idle_per_peer", &self.pool_idle_per_peer)
            .field("one_sided", &self.one_sided.as_ref().map(|o| o.name()))
            .field("read_timeout", &self.read_timeout)
            .finish()
    }
}

/// A [`Transport`] over TCP: P listens, D connects and pulls. See the module doc.
pub struct TcpTransport {
    inner: Arc<Inner>,
    local_addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("engine_id", &self.inner.config.engine_id)
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

/// What the runtime's tasks share.
struct Inner {
    config: TcpTransportConfig,
    /// The proofs' key, derived from the fleet secret; `None`: no authentication.
    key: Option<[u8; 32]>,
    /// P's exports.
    exports: Mutex<Exports>,
    /// D's fetches in flight by hold: how to cancel them.
    fetches: Mutex<HashMap<TransferId, Arc<Cancel>>>,
    fetch_slots: Arc<Semaphore>,
    release_slots: Arc<Semaphore>,
    connection_slots: Arc<Semaphore>,
    /// D's idle connections to P, by P's address.
    pool: Pool,
    counters: Counters,
}

/// Counts of what a transport's connections did; see [`TcpStats`].
#[derive(Default)]
struct Counters {
    connections_opened: AtomicU64,
    connections_reused: AtomicU64,
    idle_dropped: AtomicU64,
    retries: AtomicU64,
    handshakes_accepted: AtomicU64,
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What a transport's connections did since it started: how often D connected and reused,
/// how often P accepted. For tests, benchmarks and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// D: connections opened (connected and handshaken) for pulls and releases.
    pub connections_opened: u64,
    /// D: requests sent on an idle connection from the pool.
    pub connections_reused: u64,
    /// D: idle connections dropped unused because the health check failed (P closed them,
    /// or they sent something unasked).
    pub idle_dropped: u64,
    /// D: requests sent again on a fresh connection after a reused one failed before any
    /// byte of P's answer arrived.
    pub retries: u64,
    /// P: handshakes its listener completed.
    pub handshakes_accepted: u64,
}

/// D's idle connections, handshaken and between requests, by P's address (module doc,
/// *Connection reuse*).
struct Pool {
    idle: Mutex<HashMap<SocketAddr, Vec<Idle>>>,
    /// Most idle connections per address; 0: the pool is off.
    per_peer: usize,
    /// Older idle connections are dropped, not reused: below P's idle timeout, so P does not
    /// close one just as D reuses it.
    max_age: Duration,
}

struct Idle {
    stream: TcpStream,
    since: Instant,
}

impl Pool {
    fn new(per_peer: usize, io_timeout: Duration) -> Self {
        Self {
            idle: Mutex::default(),
            per_peer,
            max_age: io_timeout / 2,
        }
    }

    /// The most recently used idle connection to `addr` that is young enough and still
    /// open; every one found dead or too old on the way is dropped.
    fn take(&self, addr: SocketAddr, counters: &Counters) -> Option<TcpStream> {
        loop {
            let idle = {
                let mut pool = lock(&self.idle);
                let list = pool.get_mut(&addr)?;
                let idle = list.pop();
                if list.is_empty() {
                    pool.remove(&addr);
                }
                idle?
            };
            if idle.since.elapsed() >= self.max_age {
                // The ones below it are older still: the next `pop` drops them too.
                continue;
            }
            if still_open(&idle.stream) {
                count(&counters.connections_reused);
                return Some(idle.stream);
            }
            count(&counters.idle_dropped);
        }
    }

    /// Keeps a connection whose request ended cleanly; over `per_peer` the oldest goes.
    fn put(&self, addr: SocketAddr, stream: TcpStream) {
        if self.per_peer == 0 {
            return;
        }
        let mut pool = lock(&self.idle);
        let list = pool.entry(addr).or_default();
        list.push(Idle {
            stream,
            since: Instant::now(),
        });
        let excess = list.len().saturating_sub(self.per_peer);
        let dropped: Vec<Idle> = list.drain(..excess).collect();
        drop(pool);
        drop(dropped);
    }

    /// Drops every idle connection past `max_age`.
    fn expire(&self) {
        let mut expired = Vec::new();
        let mut pool = lock(&self.idle);
        pool.retain(|_, list| {
            let young = list.partition_point(|idle| idle.since.elapsed() >= self.max_age);
            expired.extend(list.drain(..young));
            !list.is_empty()
        });
        drop(pool);
        drop(expired);
    }

    fn clear(&self) {
        let idle = std::mem::take(&mut *lock(&self.idle));
        drop(idle);
    }
}

/// Whether an idle connection can carry a request: nothing to read (P sends nothing unasked)
/// and no end of stream or error pending. Asks the socket itself, not the runtime's cached
/// readiness, so a close that arrived a moment ago is seen.
#[cfg(unix)]
fn still_open(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: the descriptor is the stream's own, open while `stream` is borrowed; the buffer
    // is one byte that outlives the call. MSG_PEEK consumes nothing, MSG_DONTWAIT never
    // blocks.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            std::ptr::from_mut(&mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// Whether an idle connection can carry a request (see the unix version); here through the
/// runtime's readiness, which may miss a close that just arrived (the retry covers it).
#[cfg(not(unix))]
fn still_open(stream: &TcpStream) -> bool {
    matches!(
        stream.try_read(&mut [0u8; 1]),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
    )
}

/// Drops expired idle connections now and then, so sockets to a P no longer used close.
async fn expire_idle(inner: Arc<Inner>) {
    let every = (inner.pool.max_age / 2).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(every).await;
        inner.pool.expire();
    }
}

/// P's exports: the live ones by token, and how ended ones ended.
#[derive(Default)]
struct Exports {
    live: HashMap<String, Slot>,
    ended: Tombstones,
}

/// A published export, as P keeps it.
enum Slot {
    Ready(Published),
    /// A pull has it.
    Pulling {
        hold: TransferId,
        /// Set when it was unpublished (revoked, expired) or released meanwhile: it ends
        /// with the pull, and a later pull is refused as this kind.
        ended: Option<FetchFailure>,
        /// The reports of an unpublish that came meanwhile: `ExportGone` goes there.
        unpublished: Option<Reports>,
    },
}

struct Published {
    offer: ExportOffer,
    reports: Reports,
}

#[derive(Default)]
struct Cancel {
    flag: AtomicBool,
    notify: Notify,
}

impl Cancel {
    fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
        // `notify_one` keeps a permit, so a fetch not waiting yet still sees it.
        self.notify.notify_one();
    }

    fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }
}

impl TcpTransport {
    /// Binds P's listener and starts the transport's runtime.
    pub fn start(config: TcpTransportConfig) -> std::io::Result<Arc<Self>> {
        let key = match &config.secret {
            Some(secret) if secret.is_empty() => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "the KV transfer secret is empty",
                ))
            }
            Some(secret) => Some(blake3::derive_key(KEY_CONTEXT, secret)),
            None => None,
        };
        // Bound with std first: `start` may run inside another runtime, where blocking on this
        // one would panic.
        let listener = std::net::TcpListener::bind(config.listen)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferry-kv-tcp")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = {
            let _context = runtime.enter();
            TcpListener::from_std(listener)
        };
        let listener = match listener {
            Ok(listener) => listener,
            Err(e) => {
                runtime.shutdown_background();
                return Err(e);
            }
        };
        let inner = Arc::new(Inner {
            fetch_slots: Arc::new(Semaphore::new(config.max_in_flight_fetches.max(1))),
            release_slots: Arc::new(Semaphore::new(config.max_in_flight_fetches.max(1))),
            connection_slots: Arc::new(Semaphore::new(config.max_connections.max(1))),
            pool: Pool::new(config.pool_idle_per_peer, config.io_timeout),
            counters: Counters::default(),
            key,
            config,
            exports: Mutex::default(),
            fetches: Mutex::default(),
        });
        runtime.spawn(accept_loop(inner.clone(), listener));
        if inner.pool.per_peer > 0 {
            runtime.spawn(expire_idle(inner.clone()));
        }
        Ok(Arc::new(Self {
            inner,
            local_addr,
            runtime: Some(runtime),
        }))
    }

    /// Where P's listener is bound (the address P advertises, unless it binds 0.0.0.0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Exports published now (a pull in progress counts).
    pub fn n_published(&self) -> usize {
        lock(&self.inner.exports).live.len()
    }

    /// What this transport's connections did since it started.
    pub fn stats(&self) -> TcpStats {
        let c = &self.inner.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        TcpStats {
            connections_opened: get(&c.connections_opened),
            connections_reused: get(&c.connections_reused),
            idle_dropped: get(&c.idle_dropped),
            retries: get(&c.retries),
            handshakes_accepted: get(&c.handshakes_accepted),
        }
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("running until dropped")
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Closes the listener and every connection: their peers see a failed transfer.
        if let Some(runtime) = self.runtime.take() {
            {
                // Idle connections close here, inside the runtime that registered them.
                let _context = runtime.enter();
                self.inner.pool.clear();
            }
            runtime.shutdown_background();
        }
    }
}

impl Transport for TcpTransport {
    fn publish(&self, offer: ExportOffer, reports: Reports) {
        let token = offer.token.clone();
        let mut exports = lock(&self.inner.exports);
        exports
            .live
            .insert(token, Slot::Ready(Published { offer, reports }));
    }

    /// `engine_id` is this transport's own (one transport per engine); holds are unique in it.
    fn unpublish(&self, _engine_id: &str, hold: TransferId, reason: Unpublished, reports: Reports) {
        let mut exports = lock(&self.inner.exports);
        let token = exports
            .live
            .iter()
            .find(|(_, slot)| slot.hold() == hold)
            .map(|(token, _)| token.clone());
        let removed = match token {
            Some(token) => match exports.live.get_mut(&token).expect("found above") {
                Slot::Pulling {
                    ended, unpublished, ..
                } => {
                    // The pull ends the export, and reports `ExportGone`, when it ends.
                    ended.get_or_insert(reason.into());
                    unpublished.get_or_insert(reports);
                    return;
                }
                Slot::Ready(_) => {
                    exports.ended.record(&token, reason.into());
                    exports.live.remove(&token)
                }
            },
            None => None,
        };
        drop(exports);
        // The grant goes before the report: P frees the blocks on it.
        drop(removed);
        reports.send(PdReport::ExportGone { hold });
    }

    fn release(&self, spec: ReleaseSpec) {
        let inner = self.inner.clone();
        self.runtime().spawn(async move {
            if let Err(e) = run_release(&inner, &spec).await {
                tracing::debug!(
                    remote_engine_id = %spec.remote_engine_id,
                    "releasing an export failed (its lease still bounds it): {}",
                    e.reason
                );
            }
        });
    }

    fn fetch(&self, spec: FetchSpec, dst: BlockGrant, reports: Reports) {
        let cancel = Arc::new(Cancel::default());
        lock(&self.inner.fetches).insert(spec.hold, cancel.clone());
        self.runtime()
            .spawn(run_fetch(self.inner.clone(), spec, dst, reports, cancel));
    }

    fn cancel_fetch(&self, hold: TransferId) {
        if let Some(cancel) = lock(&self.inner.fetches).get(&hold) {
            cancel.cancel();
        }
    }
}

impl Slot {
    fn hold(&self) -> TransferId {
        match self {
            Slot::Ready(p) => p.offer.hold,
            Slot::Pulling { hold, .. } => *hold,
        }
    }
}

// ---- errors ----

/// What went wrong on a transfer connection, on either side. `Display` is the reason a log,
/// a refusal on the wire or D's `FetchError` carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The stream failed: the peer closed it, or the system reported an error.
    #[error("{0}")]
    Io(String),
    /// One step (connect, read, write) did not finish within `io_timeout`.
    #[error("{what} timed out after {after:?}")]
    TimedOut { what: &'static str, after: Duration },
    /// The peer does not speak the protocol (another magic or version, a bad string, an
    /// unknown request or status, a pull too large).
    #[error("{0}")]
    Protocol(String),
    /// The peers are not of one fleet: byte order, model, KV layout or engine id differ.
    #[error("{0}")]
    Mismatch(String),
    /// The transfer authentication failed (the secrets differ, or one side has none).
    #[error("{}", AUTH_FAILED)]
    Auth,
    /// The peer refused, naming who is to blame.
    #[error("{reason}")]
    Refused { kind: FetchFailure, reason: String },
    /// D cut its fetch short (`cancel_fetch`).
    #[error("cancelled")]
    Cancelled,
    /// The system had no randomness for a nonce.
    #[error("no randomness for the transfer authentication: {0}")]
    NoRandomness(String),
}

impl From<std::io::Error> for TransportError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Self::Io("the peer closed the connection".into()),
            _ => Self::Io(e.to_string()),
        }
    }
}

impl TransportError {
    /// D's view of this error after `good_blocks` whole blocks: the reason is `context: self`;
    /// a refusal keeps its kind (and moved no block), anything else is a fault, counted as
    /// timed out, cancelled or failed.
    fn at(self, good_blocks: usize, context: impl std::fmt::Display) -> FetchError {
        let reason = format!("{context}: {self}");
        match self {
            Self::Refused { kind, .. } => FetchError::refused(kind, reason),
            Self::TimedOut { .. } => FetchError::timed_out(good_blocks, reason),
            Self::Cancelled => FetchError::cancelled(good_blocks),
            Self::Io(_)
            | Self::Protocol(_)
            | Self::Mismatch(_)
            | Self::Auth
            | Self::NoRandomness(_) => FetchError::fault(good_blocks, reason),
        }
    }
}

// ---- D: fetching and releasing ----

fn cancelled(good_blocks: usize) -> FetchError {
    TransportError::Cancelled.at(good_blocks, "")
}

async fn run_fetch(
    inner: Arc<Inner>,
    spec: FetchSpec,
    mut dst: BlockGrant,
    reports: Reports,
    cancel: Arc<Cancel>,
) {
    let result = fetch_blocks(&inner, &spec, &mut dst, &cancel).await;
    // Nothing writes the blocks once the grant is gone: only then is it reported.
    drop(dst);
    lock(&inner.fetches).remove(&spec.hold);
    match &result {
        // A broken or stalled transfer is news for an operator whatever the policy makes of
        // it (under `recompute` the request succeeds and this line is the only trace).
        Err(e) if matches!(e.end, FetchEnd::Failed | FetchEnd::TimedOut) => tracing::warn!(
            hold = spec.hold.0,
            good_blocks = e.good_blocks,
            kind = e.kind.as_str(),
            "KV fetch failed: {}",
            e.reason
        ),
        // Cancels and refusals follow the lifecycle (resets, leases): routine.
        Err(e) => tracing::debug!(
            hold = spec.hold.0,
            good_blocks = e.good_blocks,
            kind = e.kind.as_str(),
            "KV fetch ended: {}",
            e.reason
        ),
        Ok(()) => {}
    }
    reports.send(PdReport::FetchDone {
        hold: spec.hold,
        result,
    });
}

async fn fetch_blocks(
    inner: &Inner,
    spec: &FetchSpec,
    dst: &mut BlockGrant,
    cancel: &Cancel,
) -> Result<(), FetchError> {
    let config = &inner.config;
    check_destination(spec, dst.blocks().len())?;
    if dst.layout() != config.layout {
        return Err(FetchError::fault(
            0,
            format!(
                "the destination arena's layout {:?} is not the transport's {:?}",
                dst.layout(),
                config.layout
            ),
        ));
    }
    // Before anything touches the network: a peer outside the fleet is never connected to.
    let addr = peer_addr(config, spec.remote_host.as_deref(), spec.remote_port)?;
    let _slot = tokio::select! {
        slot = inner.fetch_slots.acquire() => slot.expect("never closed"),
        () = cancel.notify.notified() => return Err(cancelled(0)),
    };
    if cancel.is_cancelled() {
        return Err(cancelled(0));
    }
    if let Some(one_sided) = &config.one_sided {
        return read_blocks(inner, one_sided.as_ref(), spec, dst, cancel, addr).await;
    }
    let t = config.io_timeout;
    let mut msg = Vec::new();
    write_pull(&mut msg, spec);
    // Dropped on a cancel, with its connection: a connection the cancel interrupted is never
    // pooled.
    let opened = request(inner, addr, &msg, "pull");
    let mut stream = tokio::select! {
        stream = opened => stream?,
        () = cancel.notify.notified() => return Err(cancelled(0)),
    };
    for j in 0..dst.blocks().len() {
        if cancel.is_cancelled() {
            return Err(cancelled(j));
        }
        let block = dst
            .block_bytes_mut(j)
            .map_err(|e| FetchError::fault(j, e.to_string()))?;
        tokio::select! {
            read = timed(t, "read", stream.read_exact(block)) => {
                read.map_err(|e| e.at(j, format_args!("reading block {j} from {addr}")))?;
            }
            () = cancel.notify.notified() => return Err(cancelled(j)),
        }
    }
    // The last block arrived: P is waiting for the next request on this connection.
    inner.pool.put(addr, stream);
    Ok(())
}

/// A fetch by one-sided read (module doc, *read*): P checks the pull and says where the blocks
/// are; the network stack reads them; P confirms it held them throughout.
async fn read_blocks(
    inner: &Inner,
    one_sided: &dyn OneSided,
    spec: &FetchSpec,
    dst: &mut BlockGrant,
    cancel: &Cancel,
    addr: SocketAddr,
) -> Result<(), FetchError> {
    let t = inner.config.io_timeout;
    let mut msg = vec![REQUEST_READ];
    put_pull_fields(&mut msg, spec);
    msg.extend_from_slice(&one_sided.known(addr).to_le_bytes());
    let opened = request(inner, addr, &msg, "read");
    let mut stream = tokio::select! {
        stream = opened => stream?,
        () = cancel.notify.notified() => return Err(cancelled(0)),
    };
    let fault = |e: TransportError| e.at(0, format_args!("the read's answer from {addr}"));
    let answer = async {
        let generation = stream.read_u64_le().await?;
        let n_metadata = stream.read_u32_le().await?;
        if n_metadata > MAX_METADATA_BYTES {
            return Err(TransportError::Protocol(format!(
                "{n_metadata} bytes of metadata (at most {MAX_METADATA_BYTES})"
            )));
        }
        let mut metadata = vec![0u8; n_metadata as usize];
        stream.read_exact(&mut metadata).await?;
        let timeout_ms = stream.read_u32_le().await?;
        let n = stream.read_u32_le().await?;
        if n as usize != dst.blocks().len() {
            return Err(TransportError::Protocol(format!(
                "P sent {n} block addresses for {} blocks",
                dst.blocks().len()
            )));
        }
        let mut addrs = Vec::with_capacity(n as usize);
        for _ in 0..n {
            addrs.push(stream.read_u64_le().await?);
        }
        Ok::<_, TransportError>((generation, metadata, timeout_ms, addrs))
    };
    let (generation, metadata, timeout_ms, addrs) =
        timed(t, "read", answer).await.map_err(fault)?;
    let started = Instant::now();
    // P stops waiting at its read timeout: a read still running then cannot count.
    let deadline = started + Duration::from_millis(u64::from(timeout_ms));
    let remote = Remote {
        generation,
        metadata: (!metadata.is_empty()).then_some(&metadata[..]),
        addrs: &addrs,
    };
    // The network stack's calls block: off the runtime's async workers for their duration.
    let read =
        tokio::task::block_in_place(|| one_sided.read(addr, remote, dst, deadline, &cancel.flag));
    if let Err(e) = read {
        // P hears at once that nothing was read (it puts the export back); its answer is not
        // awaited (the link may be what failed), so the connection is not kept.
        let _ = timed(t, "write", stream.write_all(&[REQUEST_READ_DONE, 0])).await;
        drop(stream);
        if cancel.is_cancelled() {
            return Err(cancelled(0));
        }
        let reason = format!(
            "{} read of {} blocks from {addr}: {e}",
            one_sided.name(),
            addrs.len()
        );
        return Err(match e {
            OneSidedError::TimedOut => FetchError::timed_out(0, reason),
            OneSidedError::Cancelled => cancelled(0),
            OneSidedError::Protocol(_) | OneSidedError::Stack { .. } => {
                FetchError::fault(0, reason)
            }
        });
    }
    // The read counts only if P still held the blocks: its ok says so.
    let confirmed = async {
        timed(t, "write", stream.write_all(&[REQUEST_READ_DONE, 1])).await?;
        read_status(&mut stream, t).await
    }
    .await;
    match confirmed {
        Ok(()) => {
            inner.pool.put(addr, stream);
            Ok(())
        }
        Err(e) => Err(e.at(
            0,
            format_args!(
                "P at {addr} did not confirm the read (it may have let the blocks go: its read \
                 timeout is {timeout_ms} ms, the read took {:?})",
                started.elapsed()
            ),
        )),
    }
}

/// Tells P that the export `spec.token` names will not be pulled. Bounded by `io_timeout`
/// as a whole; `Err` is only logged.
async fn run_release(inner: &Inner, spec: &ReleaseSpec) -> Result<(), FetchError> {
    let config = &inner.config;
    let addr = peer_addr(config, spec.remote_host.as_deref(), spec.remote_port)?;
    let t = config.io_timeout;
    let release = async {
        let _slot = inner.release_slots.acquire().await.expect("never closed");
        let mut msg = vec![REQUEST_RELEASE];
        put_string(&mut msg, &spec.remote_engine_id);
        put_string(&mut msg, &spec.token);
        let stream = request(inner, addr, &msg, "release").await?;
        inner.pool.put(addr, stream);
        Ok(())
    };
    match tokio::time::timeout(t, release).await {
        Ok(result) => result,
        Err(_) => Err(FetchError::timed_out(
            0,
            format!("releasing at {addr} timed out after {t:?}"),
        )),
    }
}

/// Sends `msg`, one whole request, to P at `addr` and reads P's status: on an idle connection
/// from the pool when a healthy one is there, else on a new one. `Ok`: P answered ok, and the
/// stream is where the answer's body (a pull's blocks) starts; the caller pools it once the
/// request is done. A refusal pools the connection here (P serves on after refusing a
/// request it could read); any other failure drops it.
///
/// A reused connection that fails before any byte of P's answer arrived (the write fails, or
/// the status read meets an end of stream or a reset) carries the request once more, on a
/// fresh connection. That is safe because P has not served the request, or cannot serve it
/// twice:
///
/// * a P that closed the connection without reading the request (its idle timeout fired, it
///   restarted) took nothing;
/// * a P whose process died after reading it holds nothing any more: a restarted P does not
///   know the token and refuses the retry as invalid, which is what D would report anyway;
/// * a P that took an export for the pull and then failed to write its status puts the
///   export back (a failed pull ends nothing), so the retry pulls it as the first would have;
///   if the retry comes before P noticed, P refuses it (being pulled by another reader):
///   a failed load with no block, as the first attempt would have been without the retry;
/// * a release is idempotent: P ignores a token it no longer serves.
///
/// D never loads a block from a connection whose status it did not read, so a retry cannot
/// load twice. Once a byte of P's answer arrived P served the request, and D never sends it
/// again (a timeout, too, may be a P that is slow, not gone: no retry). A fresh connection
/// is not retried either: its failure is P's or the link's, not the pool's.
async fn request(
    inner: &Inner,
    addr: SocketAddr,
    msg: &[u8],
    what: &str,
) -> Result<TcpStream, FetchError> {
    let t = inner.config.io_timeout;
    let (mut stream, mut reused) = match inner.pool.take(addr, &inner.counters) {
        Some(stream) => (stream, true),
        None => (open(inner, addr).await?, false),
    };
    loop {
        let failed = match exchange(&mut stream, msg, t).await {
            Ok(()) => return Ok(stream),
            Err(failed) => failed,
        };
        if reused && failed.unserved() {
            tracing::debug!(%addr, "an idle transfer connection failed ({}): retrying on a new one", failed.error());
            count(&inner.counters.retries);
            stream = open(inner, addr).await?;
            reused = false;
            continue;
        }
        if failed.is_refusal() {
            inner.pool.put(addr, stream);
        }
        return Err(failed.at(what, addr));
    }
}

/// A new connection to P at `addr`, handshaken.
async fn open(inner: &Inner, addr: SocketAddr) -> Result<TcpStream, FetchError> {
    let mut stream = connect(addr, inner.config.io_timeout).await?;
    handshake(inner, &mut stream, addr).await?;
    count(&inner.counters.connections_opened);
    Ok(stream)
}

/// How a request on a connection failed.
enum Exchange {
    /// Writing the request failed.
    Send(TransportError),
    /// Reading P's status failed, or P refused; `answered` once a byte of it arrived.
    Status {
        error: TransportError,
        answered: bool,
    },
}

impl Exchange {
    fn error(&self) -> &TransportError {
        match self {
            Self::Send(error) | Self::Status { error, .. } => error,
        }
    }

    /// P cannot have served the request: the connection broke (not timed out) before any
    /// byte of P's answer arrived.
    fn unserved(&self) -> bool {
        match self {
            Self::Send(error) => matches!(error, TransportError::Io(_)),
            Self::Status { error, answered } => !answered && matches!(error, TransportError::Io(_)),
        }
    }

    /// P refused the request and serves on: the connection is still in step.
    fn is_refusal(&self) -> bool {
        matches!(
            self,
            Self::Status {
                error: TransportError::Refused { .. },
                ..
            }
        )
    }

    fn at(self, what: &str, addr: SocketAddr) -> FetchError {
        match self {
            Self::Send(e) => e.at(0, format_args!("sending the {what} to {addr}")),
            Self::Status { error, .. } => error.at(0, format_args!("{what} refused by {addr}")),
        }
    }
}

/// Writes a request and reads P's status.
async fn exchange(stream: &mut TcpStream, msg: &[u8], t: Duration) -> Result<(), Exchange> {
    timed(t, "write", stream.write_all(msg))
        .await
        .map_err(Exchange::Send)?;
    let first = timed(t, "read", stream.read_u8())
        .await
        .map_err(|error| Exchange::Status {
            error,
            answered: false,
        })?;
    status_after(stream, t, first)
        .await
        .map_err(|error| Exchange::Status {
            error,
            answered: true,
        })
}

/// Where to connect: `host` must be an IP address inside `allowed_peers` (never a name to
/// resolve); anything else is invalid input.
fn peer_addr(
    config: &TcpTransportConfig,
    host: Option<&str>,
    port: Option<u16>,
) -> Result<SocketAddr, FetchError> {
    let (Some(host), Some(port)) = (host, port) else {
        return Err(FetchError::invalid(
            "the transfer parameters carry no remote_host and remote_port",
        ));
    };
    let ip = config
        .allowed_peers
        .check_host(host)
        .map_err(|e| FetchError::invalid(e.to_string()))?;
    Ok(SocketAddr::new(ip, port))
}

async fn connect(addr: SocketAddr, t: Duration) -> Result<TcpStream, FetchError> {
    let stream = timed(t, "connect", TcpStream::connect(addr))
        .await
        .map_err(|e| e.at(0, format_args!("P's transfer listener {addr}")))?;
    stream.set_nodelay(true).ok();
    Ok(stream)
}

/// D's side of the handshake (steps 1 to 4 in the module doc). Every failure is a fault,
/// whatever kind P's refusal names: a handshake is about the peers, not an export.
async fn handshake(
    inner: &Inner,
    stream: &mut TcpStream,
    addr: SocketAddr,
) -> Result<(), FetchError> {
    let t = inner.config.io_timeout;
    let failed = |e: TransportError| e.at(0, format_args!("handshake with {addr}"));
    // A refusal of the handshake is a fault, whatever kind it names.
    let refused = |e: TransportError| FetchError {
        kind: FetchFailure::Fault,
        ..e.at(0, format_args!("handshake with {addr} refused"))
    };
    let nonce_d = match inner.key {
        Some(_) => nonce().map_err(failed)?,
        None => [0; NONCE_BYTES],
    };
    let mut hello = Vec::new();
    Hello::ours(&inner.config, inner.key.is_some(), nonce_d).encode(&mut hello);
    // Each step waits for P's answer: P closes a connection it refuses, and unread bytes on
    // close would reset it before its reason arrives.
    timed(t, "write", stream.write_all(&hello))
        .await
        .map_err(failed)?;
    read_status(stream, t).await.map_err(refused)?;
    if let Some(key) = &inner.key {
        let mut nonce_p = [0u8; NONCE_BYTES];
        let mut mac_p = [0u8; 32];
        timed(t, "read", stream.read_exact(&mut nonce_p))
            .await
            .map_err(failed)?;
        timed(t, "read", stream.read_exact(&mut mac_p))
            .await
            .map_err(failed)?;
        // Constant time (`blake3::Hash`'s equality).
        if proof(key, PROOF_P, &hello, &nonce_p) != mac_p {
            return Err(failed(TransportError::Auth));
        }
        let mac_d = proof(key, PROOF_D, &hello, &nonce_p);
        timed(t, "write", stream.write_all(mac_d.as_bytes()))
            .await
            .map_err(failed)?;
    }
    read_status(stream, t).await.map_err(refused)
}

/// Reads a status; `Err` is the peer's refusal (who is to blame, and its reason), or why
/// there was none.
async fn read_status(stream: &mut TcpStream, t: Duration) -> Result<(), TransportError> {
    let first = timed(t, "read", stream.read_u8()).await?;
    status_after(stream, t, first).await
}

/// The rest of a status whose first byte was `first`.
async fn status_after(
    stream: &mut TcpStream,
    t: Duration,
    first: u8,
) -> Result<(), TransportError> {
    let refused = |kind, reason| Err(TransportError::Refused { kind, reason });
    match first {
        STATUS_OK => Ok(()),
        STATUS_REFUSED => refused(
            FetchFailure::Fault,
            timed(t, "read", read_string(stream)).await??,
        ),
        STATUS_REFUSED_AS => {
            let kind = timed(t, "read", stream.read_u8()).await?;
            let reason = timed(t, "read", read_string(stream)).await??;
            match kind_from_wire(kind) {
                Some(kind) => refused(kind, reason),
                None => refused(
                    FetchFailure::Fault,
                    format!("{reason} (an unknown refusal kind {kind})"),
                ),
            }
        }
        other => Err(TransportError::Protocol(format!("unknown status {other}"))),
    }
}

// ---- P: serving ----

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tokio::spawn(serve_connection(inner.clone(), stream, peer));
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("transfer listener: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(inner: Arc<Inner>, mut stream: TcpStream, peer: SocketAddr) {
    let t = inner.config.io_timeout;
    stream.set_nodelay(true).ok();
    let slot = match tokio::time::timeout(t, inner.connection_slots.clone().acquire_owned()).await {
        Ok(slot) => slot.expect("never closed"),
        Err(_) => {
            let reason = format!(
                "the transfer listener serves its maximum of {} connections",
                inner.config.max_connections
            );
            refuse(&mut stream, t, FetchFailure::Fault, &reason).await;
            return;
        }
    };
    if let Err(e) = accept_handshake(&inner, &mut stream).await {
        let reason = e.to_string();
        tracing::debug!(%peer, "transfer handshake refused: {reason}");
        refuse(&mut stream, t, FetchFailure::Fault, &reason).await;
        return;
    }
    count(&inner.counters.handshakes_accepted);
    loop {
        // An idle connection is closed after `io_timeout`, like any stalled read.
        let served = match timed(t, "read", stream.read_u8()).await {
            Ok(REQUEST_PULL) => match timed(t, "read", read_pull(&mut stream)).await {
                Ok(Ok(spec)) => serve_pull(&inner, &mut stream, &spec).await,
                Ok(Err(e)) | Err(e) => {
                    refuse(&mut stream, t, FetchFailure::Invalid, &e.to_string()).await;
                    break;
                }
            },
            Ok(REQUEST_READ) => match timed(t, "read", read_read(&mut stream)).await {
                Ok(Ok((spec, known))) => serve_read(&inner, &mut stream, &spec, known).await,
                Ok(Err(e)) | Err(e) => {
                    refuse(&mut stream, t, FetchFailure::Invalid, &e.to_string()).await;
                    break;
                }
            },
            Ok(REQUEST_RELEASE) => match timed(t, "read", read_release(&mut stream)).await {
                Ok(Ok((engine_id, token))) => {
                    serve_release(&inner, &mut stream, &engine_id, &token).await
                }
                Ok(Err(e)) | Err(e) => {
                    refuse(&mut stream, t, FetchFailure::Invalid, &e.to_string()).await;
                    break;
                }
            },
            Ok(other) => {
                let reason = format!("unknown request {other}");
                refuse(&mut stream, t, FetchFailure::Fault, &reason).await;
                break;
            }
            Err(_) => break,
        };
        if let Err(e) = served {
            tracing::debug!(%peer, "transfer connection ended early: {e}");
            break;
        }
    }
    drop(slot);
}

/// P's side of the handshake (steps 1 to 4 in the module doc). `Err` is the reason to refuse
/// the connection with.
async fn accept_handshake(inner: &Inner, stream: &mut TcpStream) -> Result<(), TransportError> {
    let config = &inner.config;
    let t = config.io_timeout;
    let hello = timed(t, "reading the hello", read_hello(stream)).await?;
    if hello.has_secret() != inner.key.is_some() {
        return Err(TransportError::Auth);
    }
    let mut reply = vec![STATUS_OK];
    if let Some(key) = &inner.key {
        let mut hello_bytes = Vec::new();
        hello.encode(&mut hello_bytes);
        let nonce_p = nonce()?;
        reply.extend_from_slice(&nonce_p);
        reply.extend_from_slice(proof(key, PROOF_P, &hello_bytes, &nonce_p).as_bytes());
        timed(t, "write", stream.write_all(&reply)).await?;
        let mut mac_d = [0u8; 32];
        timed(t, "read", stream.read_exact(&mut mac_d)).await?;
        // Constant time (`blake3::Hash`'s equality).
        if proof(key, PROOF_D, &hello_bytes, &nonce_p) != mac_d {
            return Err(TransportError::Auth);
        }
    } else {
        timed(t, "write", stream.write_all(&reply)).await?;
    }
    check_hello(&hello, config)?;
    timed(t, "write", stream.write_u8(STATUS_OK)).await
}

/// Checks a pull, streams its blocks and settles the export. `Err` means the connection is
/// unusable.
async fn serve_pull(
    inner: &Inner,
    stream: &mut TcpStream,
    spec: &FetchSpec,
) -> Result<(), TransportError> {
    let t = inner.config.io_timeout;
    let published = match take_for_pull(inner, spec) {
        Ok(published) => published,
        Err((kind, reason)) => {
            // A refused pull consumes nothing; the connection stays usable.
            let mut msg = Vec::new();
            put_refusal(&mut msg, kind, &reason);
            return timed(t, "write", stream.write_all(&msg)).await;
        }
    };
    let range = check_pull(&published.offer, spec).expect("checked in take_for_pull");
    let sent = stream_blocks(stream, &published.offer.grant, range, t).await;
    settle(inner, published, sent.is_ok());
    sent
}

/// Serves a one-sided read (module doc, *read*): checks it as a pull, says where the blocks
/// are, and keeps the export *being read* until the reader's *read done* or the read timeout.
/// `Err` means the connection is unusable (and is closed, so a late *read done* counts
/// nothing).
async fn serve_read(
    inner: &Inner,
    stream: &mut TcpStream,
    spec: &FetchSpec,
    known: u64,
) -> Result<(), TransportError> {
    let t = inner.config.io_timeout;
    let refusal = |kind, reason: &str| {
        let mut msg = Vec::new();
        put_refusal(&mut msg, kind, reason);
        msg
    };
    let Some(one_sided) = &inner.config.one_sided else {
        let msg = refusal(
            FetchFailure::Fault,
            "this engine serves KV over TCP only (--kv-transport tcp): its readers must use \
             the same transport",
        );
        return timed(t, "write", stream.write_all(&msg)).await;
    };
    let published = match take_for_pull(inner, spec) {
        Ok(published) => published,
        Err((kind, reason)) => {
            return timed(t, "write", stream.write_all(&refusal(kind, &reason))).await;
        }
    };
    let range = check_pull(&published.offer, spec).expect("checked in take_for_pull");
    let exposed = match one_sided.expose(&published.offer.grant, known) {
        Ok(exposed) => exposed,
        Err(e) => {
            settle(inner, published, false);
            let reason = format!("{}: {e}", one_sided.name());
            return timed(
                t,
                "write",
                stream.write_all(&refusal(FetchFailure::Fault, &reason)),
            )
            .await;
        }
    };
    let read_timeout = inner.config.read_timeout;
    let mut msg = vec![STATUS_OK];
    msg.extend_from_slice(&exposed.generation.to_le_bytes());
    let metadata = exposed.metadata.unwrap_or_default();
    msg.extend_from_slice(&(metadata.len() as u32).to_le_bytes());
    msg.extend_from_slice(&metadata);
    let timeout_ms = u32::try_from(read_timeout.as_millis()).unwrap_or(u32::MAX);
    msg.extend_from_slice(&timeout_ms.to_le_bytes());
    msg.extend_from_slice(&(range.len() as u32).to_le_bytes());
    for i in range {
        msg.extend_from_slice(&(published.offer.grant.block_addr(i) as u64).to_le_bytes());
    }
    let started = Instant::now();
    if let Err(e) = timed(t, "write", stream.write_all(&msg)).await {
        settle(inner, published, false);
        return Err(e);
    }
    // The export is being read: P keeps its blocks until the reader's word, or its timeout.
    let left = read_timeout.saturating_sub(started.elapsed());
    let done = async {
        match stream.read_u8().await? {
            REQUEST_READ_DONE => Ok(stream.read_u8().await? == 1),
            other => Err(TransportError::Protocol(format!(
                "request {other} while a read was in progress"
            ))),
        }
    };
    match timed(left, "waiting for the reader's end of a read", done).await {
        Ok(complete) => {
            settle(inner, published, complete);
            timed(t, "write", stream.write_u8(STATUS_OK)).await
        }
        Err(e) => {
            // Whatever the reader still reads is not confirmed: the connection closes.
            settle(inner, published, false);
            Err(e)
        }
    }
}

async fn stream_blocks(
    stream: &mut TcpStream,
    grant: &BlockGrant,
    range: std::ops::Range<usize>,
    t: Duration,
) -> Result<(), TransportError> {
    timed(t, "write", stream.write_u8(STATUS_OK)).await?;
    for i in range {
        timed(t, "write", stream.write_all(grant.block_bytes(i))).await?;
    }
    timed(t, "write", stream.flush()).await
}

/// Looks the export up by token and checks the pull; on success the export is marked pulled.
/// `Err`: who is to blame, and why.
fn take_for_pull(inner: &Inner, spec: &FetchSpec) -> Result<Published, (FetchFailure, String)> {
    let engine_id = &inner.config.engine_id;
    if spec.remote_engine_id != *engine_id {
        // Not an export question: P restarted under a new id, or this is another P.
        return Err((
            FetchFailure::Fault,
            format!(
                "this transfer listener serves engine {engine_id:?}, not {:?}",
                spec.remote_engine_id
            ),
        ));
    }
    let mut exports = lock(&inner.exports);
    let exports = &mut *exports;
    let Some(slot) = exports.live.get_mut(&spec.token) else {
        let gone = gone_export(engine_id, exports.ended.get(&spec.token));
        return Err((gone.kind, gone.reason));
    };
    let Slot::Ready(published) = slot else {
        return Err((
            FetchFailure::Invalid,
            "the export is being pulled by another reader".into(),
        ));
    };
    check_pull(&published.offer, spec).map_err(|e| (FetchFailure::Invalid, e.to_string()))?;
    let hold = published.offer.hold;
    match std::mem::replace(
        slot,
        Slot::Pulling {
            hold,
            ended: None,
            unpublished: None,
        },
    ) {
        Slot::Ready(published) => Ok(published),
        Slot::Pulling { .. } => unreachable!("matched above"),
    }
}

/// After a pull: a complete one ends the export (`ExportPulled`); a failed one puts it back,
/// unless it was unpublished (`ExportGone` to the unpublish's reports) or released
/// (`ExportGone` to the export's) meanwhile. Either way P remembers how it ended.
fn settle(inner: &Inner, published: Published, complete: bool) {
    let token = published.offer.token.clone();
    let hold = published.offer.hold;
    let mut exports = lock(&inner.exports);
    let (ended, unpublished) = match exports.live.remove(&token) {
        Some(Slot::Pulling {
            ended, unpublished, ..
        }) => (ended, unpublished),
        other => unreachable!(
            "a pulled export stays Pulling: {:?}",
            other.map(|s| s.hold())
        ),
    };
    let how = match (complete, ended) {
        // Pulled: a second pull is a replay.
        (true, _) => FetchFailure::Invalid,
        (false, Some(how)) => how,
        (false, None) => {
            exports.live.insert(token, Slot::Ready(published));
            return;
        }
    };
    exports.ended.record(&token, how);
    drop(exports);
    let reports = published.reports;
    // The grant goes before the reports: P frees the blocks on them.
    drop(published.offer);
    if complete {
        reports.send(PdReport::ExportPulled { hold });
    }
    match unpublished {
        Some(unpublished) => unpublished.send(PdReport::ExportGone { hold }),
        // Released while pulled, and the pull failed: the export ends here.
        None if !complete => reports.send(PdReport::ExportGone { hold }),
        None => {}
    }
}

/// Answers a release: a published export with this token ends now, one being pulled ends
/// with its pull, an unknown token is ignored. `Err` means the connection is unusable.
async fn serve_release(
    inner: &Inner,
    stream: &mut TcpStream,
    engine_id: &str,
    token: &str,
) -> Result<(), TransportError> {
    let t = inner.config.io_timeout;
    let mut msg = Vec::new();
    match release_export(inner, engine_id, token) {
        Ok(()) => msg.push(STATUS_OK),
        Err(e) => put_refusal(&mut msg, FetchFailure::Fault, &e.to_string()),
    }
    timed(t, "write", stream.write_all(&msg)).await
}

fn release_export(inner: &Inner, engine_id: &str, token: &str) -> Result<(), TransportError> {
    let ours = &inner.config.engine_id;
    if engine_id != ours {
        return Err(TransportError::Mismatch(format!(
            "this transfer listener serves engine {ours:?}, not {engine_id:?}"
        )));
    }
    let mut exports = lock(&inner.exports);
    let published = match exports.live.get_mut(token) {
        None => return Ok(()),
        Some(Slot::Pulling { ended, .. }) => {
            ended.get_or_insert(FetchFailure::Invalid);
            return Ok(());
        }
        Some(Slot::Ready(_)) => match exports.live.remove(token) {
            Some(Slot::Ready(published)) => published,
            _ => unreachable!("matched above"),
        },
    };
    // Released: a later pull is a replay.
    exports.ended.record(token, FetchFailure::Invalid);
    drop(exports);
    let hold = published.offer.hold;
    let reports = published.reports;
    // The grant goes before the report: P frees the blocks on it.
    drop(published.offer);
    reports.send(PdReport::ExportGone { hold });
    Ok(())
}

/// Sends a refusal before the connection closes. Best effort: the peer may be gone already.
async fn refuse(stream: &mut TcpStream, t: Duration, kind: FetchFailure, reason: &str) {
    let mut msg = Vec::new();
    put_refusal(&mut msg, kind, reason);
    if timed(t, "write", stream.write_all(&msg)).await.is_err() {
        return;
    }
    let _ = timed(t, "shutdown", stream.shutdown()).await;
    // Closing with unread bytes would reset the connection and could drop the reason on its
    // way: read what the peer still sends until it closes (bounded by `t`).
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(t, async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

// ---- authentication ----

/// A fresh nonce from the operating system's random source.
fn nonce() -> Result<[u8; NONCE_BYTES], TransportError> {
    let mut nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|e| TransportError::NoRandomness(e.to_string()))?;
    Ok(nonce)
}

/// `mac_P` or `mac_D`: the side's label, D's hello and P's nonce, keyed by the fleet's key.
fn proof(
    key: &[u8; 32],
    label: &[u8; 16],
    hello: &[u8],
    nonce_p: &[u8; NONCE_BYTES],
) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(label);
    h.update(&(hello.len() as u64).to_le_bytes());
    h.update(hello);
    h.update(nonce_p);
    h.finalize()
}

// ---- wire format ----

/// D's hello after the magic and the protocol version, as D sends it and as P read it:
/// raw bytes, so P re-encodes exactly what D sent for the proofs.
struct Hello {
    little_endian: u8,
    model_id: String,
    dims: [u32; 5],
    has_secret: u8,
    nonce: [u8; NONCE_BYTES],
}

impl Hello {
    fn ours(config: &TcpTransportConfig, has_secret: bool, nonce: [u8; NONCE_BYTES]) -> Self {
        Self {
            little_endian: u8::from(cfg!(target_endian = "little")),
            model_id: config.model_id.clone(),
            dims: layout_dims(config.layout),
            has_secret: u8::from(has_secret),
            nonce,
        }
    }

    fn has_secret(&self) -> bool {
        self.has_secret == 1
    }

    fn encode(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        buf.push(self.little_endian);
        put_string(buf, &self.model_id);
        for d in self.dims {
            buf.extend_from_slice(&d.to_le_bytes());
        }
        buf.push(self.has_secret);
        buf.extend_from_slice(&self.nonce);
    }
}

fn layout_dims(layout: KvLayout) -> [u32; 5] {
    [
        layout.n_layers,
        layout.n_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.aux_floats,
    ]
    .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// Reads D's hello; `Err` is the reason to refuse with. Another protocol version is refused
/// before the rest is read (its fields may differ).
async fn read_hello(stream: &mut TcpStream) -> Result<Hello, TransportError> {
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(TransportError::Protocol(
            "not a ferry KV transfer connection".into(),
        ));
    }
    let version = stream.read_u32_le().await?;
    if version != PROTOCOL_VERSION {
        return Err(TransportError::Protocol(format!(
            "protocol version {version}, this listener speaks {PROTOCOL_VERSION}"
        )));
    }
    let little_endian = stream.read_u8().await?;
    let model_id = read_string(stream).await??;
    let mut dims = [0u32; 5];
    for d in &mut dims {
        *d = stream.read_u32_le().await?;
    }
    let has_secret = stream.read_u8().await?;
    if has_secret > 1 {
        return Err(TransportError::Protocol(format!(
            "a secret flag of {has_secret}"
        )));
    }
    let mut nonce = [0u8; NONCE_BYTES];
    stream.read_exact(&mut nonce).await?;
    Ok(Hello {
        little_endian,
        model_id,
        dims,
        has_secret,
        nonce,
    })
}

/// Compares D's hello with P's own; `Err` is the reason to send back.
fn check_hello(hello: &Hello, config: &TcpTransportConfig) -> Result<(), TransportError> {
    let mismatch = |reason: String| Err(TransportError::Mismatch(reason));
    if hello.little_endian != u8::from(cfg!(target_endian = "little")) {
        return mismatch("the peers store KV floats in different byte orders".into());
    }
    if hello.model_id != config.model_id {
        return mismatch(format!(
            "model mismatch: the reader has {:?}, this engine {:?}",
            hello.model_id, config.model_id
        ));
    }
    if hello.dims != layout_dims(config.layout) {
        let [n_layers, n_kv_heads, head_dim, block_size, aux] = hello.dims;
        let l = config.layout;
        return mismatch(format!(
            "KV layout mismatch: the reader has n_layers {n_layers}, n_kv_heads {n_kv_heads}, \
             head_dim {head_dim}, block_size {block_size}, aux words per token {aux}; this \
             engine n_layers {}, n_kv_heads {}, head_dim {}, block_size {}, aux words per \
             token {} (aux words carry an MoE model's expert routing: both engines capture \
             it, `--enable-return-routed-experts`, or neither)",
            l.n_layers, l.n_kv_heads, l.head_dim, l.block_size, l.aux_floats
        ));
    }
    Ok(())
}

fn write_pull(buf: &mut Vec<u8>, spec: &FetchSpec) {
    buf.push(REQUEST_PULL);
    put_pull_fields(buf, spec);
}

/// A pull's fields after its request byte (a *read* carries them too).
fn put_pull_fields(buf: &mut Vec<u8>, spec: &FetchSpec) {
    put_string(buf, &spec.remote_engine_id);
    put_string(buf, &spec.token);
    put_string(buf, &spec.weight_version);
    buf.extend_from_slice(&spec.prompt_hash);
    buf.extend_from_slice(&(spec.first_block as u64).to_le_bytes());
    buf.extend_from_slice(&(spec.src_blocks.len() as u32).to_le_bytes());
    for b in &spec.src_blocks {
        buf.extend_from_slice(&b.0.to_le_bytes());
    }
}

/// Reads a pull request after its kind byte. The hold is P's business, not the reader's: 0.
async fn read_pull(
    stream: &mut TcpStream,
) -> Result<Result<FetchSpec, TransportError>, TransportError> {
    let remote_engine_id = read_string(stream).await?;
    let token = read_string(stream).await?;
    let weight_version = read_string(stream).await?;
    let (remote_engine_id, token, weight_version) = match (remote_engine_id, token, weight_version)
    {
        (Ok(e), Ok(t), Ok(w)) => (e, t, w),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return Ok(Err(e)),
    };
    let mut prompt_hash = [0u8; 32];
    stream.read_exact(&mut prompt_hash).await?;
    let first_block = stream.read_u64_le().await?;
    let n = stream.read_u32_le().await?;
    if n > MAX_PULL_BLOCKS {
        return Ok(Err(TransportError::Protocol(format!(
            "a pull of {n} blocks (at most {MAX_PULL_BLOCKS})"
        ))));
    }
    let mut src_blocks = Vec::with_capacity(n as usize);
    for _ in 0..n {
        src_blocks.push(BlockId(stream.read_u32_le().await?));
    }
    Ok(Ok(FetchSpec {
        hold: TransferId(0),
        remote_engine_id,
        remote_host: None,
        remote_port: None,
        token,
        weight_version,
        prompt_hash,
        first_block: usize::try_from(first_block).unwrap_or(usize::MAX),
        src_blocks,
    }))
}

/// Reads a release request after its kind byte: engine id and token.
/// A read's fields: a pull's, then the metadata generation D holds.
async fn read_read(
    stream: &mut TcpStream,
) -> Result<Result<(FetchSpec, u64), TransportError>, TransportError> {
    let spec = match read_pull(stream).await? {
        Ok(spec) => spec,
        Err(e) => return Ok(Err(e)),
    };
    let known = stream.read_u64_le().await?;
    Ok(Ok((spec, known)))
}

async fn read_release(
    stream: &mut TcpStream,
) -> Result<Result<(String, String), TransportError>, TransportError> {
    let engine_id = read_string(stream).await?;
    let token = read_string(stream).await?;
    Ok(engine_id.and_then(|e| token.map(|t| (e, t))))
}

/// A refusal: a fault in the form every protocol version reads, any other kind with its byte.
fn put_refusal(buf: &mut Vec<u8>, kind: FetchFailure, reason: &str) {
    match kind {
        FetchFailure::Fault => buf.push(STATUS_REFUSED),
        kind => buf.extend_from_slice(&[STATUS_REFUSED_AS, kind_to_wire(kind)]),
    }
    put_string(buf, reason);
}

fn kind_to_wire(kind: FetchFailure) -> u8 {
    match kind {
        FetchFailure::Fault => 0,
        FetchFailure::Revoked => 1,
        FetchFailure::Expired => 2,
        FetchFailure::Invalid => 3,
    }
}

fn kind_from_wire(byte: u8) -> Option<FetchFailure> {
    Some(match byte {
        0 => FetchFailure::Fault,
        1 => FetchFailure::Revoked,
        2 => FetchFailure::Expired,
        3 => FetchFailure::Invalid,
        _ => return None,
    })
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(MAX_STRING_BYTES as usize)];
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Outer `Err`: the stream failed. Inner `Err`: the peer sent a bad string (the stream is
/// still in step: its bytes were consumed).
async fn read_string<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<Result<String, TransportError>, TransportError> {
    let n = stream.read_u32_le().await?;
    if n > MAX_STRING_BYTES {
        return Err(TransportError::Protocol(format!(
            "a string of {n} bytes (at most {MAX_STRING_BYTES})"
        )));
    }
    let mut bytes = vec![0u8; n as usize];
    stream.read_exact(&mut bytes).await?;
    Ok(String::from_utf8(bytes)
        .map_err(|_| TransportError::Protocol("a string that is not UTF-8".into())))
}

/// `f` bounded by `t`.
async fn timed<T, E: Into<TransportError>>(
    t: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, TransportError> {
    match tokio::time::timeout(t, f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(TransportError::TimedOut { what, after: t }),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
#[path = "tcp_tests.rs"]
mod tests;
