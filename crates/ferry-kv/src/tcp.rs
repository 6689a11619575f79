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
//! One TCP connection per fetch, opened by D. First the handshake, checked by P:
//! `"FERRYKV\0"`, u32 protocol version, u8 1 if KV floats are little-endian f32, string model
//! id, u32 layers, KV heads, head dim, block size. P answers a *status*: u8 0 (ok), or u8 1
//! and a string reason, after which it closes. Then pulls (P serves them until D closes):
//! u8 1, strings engine id, token, weight version, 32-byte prompt hash, u64 first block,
//! u32 count and that many u32 block ids. P checks them exactly as every transport does
//! ([`check_pull`]), answers a status, and on ok streams the blocks, each exactly
//! `block_bytes` long, straight from its read grant to the socket; D reads them straight into
//! its write grant's blocks. Strings are a u32 length (at most [`MAX_STRING_BYTES`]) and UTF-8.
//!
//! # What each side learns, and when
//!
//! * P reports `ExportPulled` once the last byte of the last block was written, and the export
//!   is gone. A pull in progress holds its export: an `unpublish` meanwhile reports
//!   `ExportGone` only when the pull ended (the in-memory fabric does the same under its lock).
//!   A pull that fails mid-way (D gone, a write timed out) puts the export back, published until
//!   unpublish or lease expiry: P never waits for anything a reader does.
//! * D reports `FetchDone` once its grant is dropped: `Ok`, or `Err` with the number of whole
//!   blocks that arrived. A refused pull, a failed handshake, a peer that closes or stalls past
//!   `io_timeout`, and a cancel (taking effect at the next block boundary, or at once while
//!   waiting) are all failed loads.
//!
//! Bounds: `max_in_flight_fetches` on D and `max_connections` on P are semaphores; a connection
//! over P's limit waits for a slot up to `io_timeout`, then is refused with a reason.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::{FetchError, TransferId, WorkerReport};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

use crate::access::BlockGrant;
use crate::arena::KvLayout;
use crate::transport::{
    check_destination, check_pull, no_export, ExportOffer, FetchSpec, Transport,
};
use crate::worker::Reports;

/// Bumped on every change of the wire format; peers of another version are refused.
pub const PROTOCOL_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"FERRYKV\0";
/// Longest string field accepted from a peer (model ids, tokens, versions, reasons).
pub const MAX_STRING_BYTES: u32 = 64 * 1024;
/// Most blocks one pull may ask for.
const MAX_PULL_BLOCKS: u32 = 1 << 20;
const STATUS_OK: u8 = 0;
const STATUS_REFUSED: u8 = 1;
const REQUEST_PULL: u8 = 1;

/// How a [`TcpTransport`] is set up.
#[derive(Debug, Clone)]
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
    /// P's exports by token.
    exports: Mutex<HashMap<String, Slot>>,
    /// D's fetches in flight by hold: how to cancel them.
    fetches: Mutex<HashMap<TransferId, Arc<Cancel>>>,
    fetch_slots: Arc<Semaphore>,
    connection_slots: Arc<Semaphore>,
}

/// A published export, as P keeps it.
enum Slot {
    Ready(Published),
    /// A pull has it; `unpublished` holds the reports of an unpublish that came meanwhile.
    Pulling {
        hold: TransferId,
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
            connection_slots: Arc::new(Semaphore::new(config.max_connections.max(1))),
            config,
            exports: Mutex::default(),
            fetches: Mutex::default(),
        });
        runtime.spawn(accept_loop(inner.clone(), listener));
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
        lock(&self.inner.exports).len()
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("running until dropped")
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Closes the listener and every connection: their peers see a failed transfer.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Transport for TcpTransport {
    fn publish(&self, offer: ExportOffer, reports: Reports) {
        let token = offer.token.clone();
        lock(&self.inner.exports).insert(token, Slot::Ready(Published { offer, reports }));
    }

    /// `engine_id` is this transport's own (one transport per engine); holds are unique in it.
    fn unpublish(&self, _engine_id: &str, hold: TransferId, reports: Reports) {
        let mut exports = lock(&self.inner.exports);
        let key = exports
            .iter()
            .find(|(_, slot)| slot.hold() == hold)
            .map(|(k, _)| k.clone());
        let removed = match key {
            Some(key) => match exports.get_mut(&key).expect("found above") {
                Slot::Pulling { unpublished, .. } => {
                    // The pull reports `ExportGone` when it ends.
                    *unpublished = Some(reports);
                    return;
                }
                Slot::Ready(_) => exports.remove(&key),
            },
            None => None,
        };
        drop(exports);
        // The grant goes before the report: P frees the blocks on it.
        drop(removed);
        reports.send(WorkerReport::ExportGone { hold });
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

// ---- D: fetching ----

/// Why a fetch failed, and how many whole blocks arrived before.
struct Failed {
    good_blocks: usize,
    reason: String,
}

impl Failed {
    fn at(good_blocks: usize) -> impl FnOnce(String) -> Self {
        move |reason| Self {
            good_blocks,
            reason,
        }
    }
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
    if let Err(e) = &result {
        tracing::debug!(
            hold = spec.hold.0,
            good_blocks = e.good_blocks,
            "fetch failed: {}",
            e.reason
        );
    }
    reports.send(WorkerReport::FetchDone {
        hold: spec.hold,
        result: result.map_err(|e| FetchError {
            good_blocks: e.good_blocks,
            reason: e.reason,
        }),
    });
}

async fn fetch_blocks(
    inner: &Inner,
    spec: &FetchSpec,
    dst: &mut BlockGrant,
    cancel: &Cancel,
) -> Result<(), Failed> {
    let config = &inner.config;
    check_destination(spec, dst.blocks().len()).map_err(Failed::at(0))?;
    if dst.layout() != config.layout {
        return Err(Failed::at(0)(format!(
            "the destination arena's layout {:?} is not the transport's {:?}",
            dst.layout(),
            config.layout
        )));
    }
    let (Some(host), Some(port)) = (&spec.remote_host, spec.remote_port) else {
        return Err(Failed::at(0)(
            "the transfer parameters carry no remote_host and remote_port".into(),
        ));
    };
    let _slot = tokio::select! {
        slot = inner.fetch_slots.acquire() => slot.expect("never closed"),
        () = cancel.notify.notified() => return Err(Failed::at(0)("cancelled".into())),
    };
    if cancel.is_cancelled() {
        return Err(Failed::at(0)("cancelled".into()));
    }
    let t = config.io_timeout;
    let addr = format!("{host}:{port}");
    let mut stream = timed(t, "connect", TcpStream::connect(&addr))
        .await
        .map_err(|e| Failed::at(0)(format!("P's transfer listener {addr}: {e}")))?;
    stream.set_nodelay(true).ok();
    // The pull waits for the handshake's answer: P closes a connection it refuses, and unread
    // bytes on close would reset it before its reason arrives.
    let mut msg = Vec::new();
    write_handshake(&mut msg, config);
    timed(t, "write", stream.write_all(&msg))
        .await
        .map_err(Failed::at(0))?;
    read_status(&mut stream, t)
        .await
        .map_err(|e| Failed::at(0)(format!("handshake with {addr} refused: {e}")))?;
    msg.clear();
    write_pull(&mut msg, spec);
    timed(t, "write", stream.write_all(&msg))
        .await
        .map_err(Failed::at(0))?;
    read_status(&mut stream, t)
        .await
        .map_err(|e| Failed::at(0)(format!("pull refused by {addr}: {e}")))?;
    for j in 0..dst.blocks().len() {
        if cancel.is_cancelled() {
            return Err(Failed::at(j)("cancelled".into()));
        }
        let block = dst
            .block_bytes_mut(j)
            .map_err(|e| Failed::at(j)(e.to_string()))?;
        tokio::select! {
            read = timed(t, "read", stream.read_exact(block)) => {
                read.map_err(|e| Failed::at(j)(format!("reading block {j} from {addr}: {e}")))?;
            }
            () = cancel.notify.notified() => return Err(Failed::at(j)("cancelled".into())),
        }
    }
    Ok(())
}

/// Reads a status; `Err` is the peer's reason, or why there was none.
async fn read_status(stream: &mut TcpStream, t: Duration) -> Result<(), String> {
    match timed(t, "read", stream.read_u8()).await? {
        STATUS_OK => Ok(()),
        STATUS_REFUSED => Err(timed(t, "read", read_string(stream)).await??),
        other => Err(format!("unknown status {other}")),
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
            refuse(&mut stream, t, &reason).await;
            return;
        }
    };
    if let Err(reason) = check_handshake(&mut stream, &inner.config).await {
        tracing::debug!(%peer, "transfer handshake refused: {reason}");
        refuse(&mut stream, t, &reason).await;
        return;
    }
    if timed(t, "write", stream.write_u8(STATUS_OK)).await.is_err() {
        return;
    }
    loop {
        // An idle connection is closed after `io_timeout`, like any stalled read.
        match timed(t, "read", stream.read_u8()).await {
            Ok(REQUEST_PULL) => {}
            Ok(other) => {
                refuse(&mut stream, t, &format!("unknown request {other}")).await;
                break;
            }
            Err(_) => break,
        }
        let spec = match timed(t, "read", read_pull(&mut stream)).await {
            Ok(Ok(spec)) => spec,
            Ok(Err(reason)) | Err(reason) => {
                refuse(&mut stream, t, &reason).await;
                break;
            }
        };
        if let Err(e) = serve_pull(&inner, &mut stream, &spec).await {
            tracing::debug!(%peer, "pull ended early: {e}");
            break;
        }
    }
    drop(slot);
}

/// Checks a pull, streams its blocks and settles the export. `Err` means the connection is
/// unusable.
async fn serve_pull(inner: &Inner, stream: &mut TcpStream, spec: &FetchSpec) -> Result<(), String> {
    let t = inner.config.io_timeout;
    let published = match take_for_pull(inner, spec) {
        Ok(published) => published,
        Err(reason) => {
            // A refused pull consumes nothing; the connection stays usable.
            let mut msg = vec![STATUS_REFUSED];
            put_string(&mut msg, &reason);
            return timed(t, "write", stream.write_all(&msg)).await;
        }
    };
    let range = check_pull(&published.offer, spec).expect("checked in take_for_pull");
    let sent = stream_blocks(stream, &published.offer.grant, range, t).await;
    settle(inner, published, sent.is_ok());
    sent
}

async fn stream_blocks(
    stream: &mut TcpStream,
    grant: &BlockGrant,
    range: std::ops::Range<usize>,
    t: Duration,
) -> Result<(), String> {
    timed(t, "write", stream.write_u8(STATUS_OK)).await?;
    for i in range {
        timed(t, "write", stream.write_all(grant.block_bytes(i))).await?;
    }
    timed(t, "write", stream.flush()).await
}

/// Looks the export up by token and checks the pull; on success the export is marked pulled.
fn take_for_pull(inner: &Inner, spec: &FetchSpec) -> Result<Published, String> {
    let engine_id = &inner.config.engine_id;
    if spec.remote_engine_id != *engine_id {
        return Err(format!(
            "this transfer listener serves engine {engine_id:?}, not {:?}",
            spec.remote_engine_id
        ));
    }
    let mut exports = lock(&inner.exports);
    let Some(slot) = exports.get_mut(&spec.token) else {
        return Err(no_export(engine_id));
    };
    let Slot::Ready(published) = slot else {
        return Err("the export is being pulled by another reader".into());
    };
    check_pull(&published.offer, spec)?;
    let hold = published.offer.hold;
    match std::mem::replace(
        slot,
        Slot::Pulling {
            hold,
            unpublished: None,
        },
    ) {
        Slot::Ready(published) => Ok(published),
        Slot::Pulling { .. } => unreachable!("matched above"),
    }
}

/// After a pull: a complete one ends the export (`ExportPulled`); a failed one puts it back,
/// unless it was unpublished meanwhile (`ExportGone`).
fn settle(inner: &Inner, published: Published, complete: bool) {
    let token = published.offer.token.clone();
    let hold = published.offer.hold;
    let mut exports = lock(&inner.exports);
    let unpublished = match exports.remove(&token) {
        Some(Slot::Pulling { unpublished, .. }) => unpublished,
        other => unreachable!(
            "a pulled export stays Pulling: {:?}",
            other.map(|s| s.hold())
        ),
    };
    if !complete && unpublished.is_none() {
        exports.insert(token, Slot::Ready(published));
        return;
    }
    drop(exports);
    let reports = published.reports;
    // The grant goes before the reports: P frees the blocks on them.
    drop(published.offer);
    if complete {
        reports.send(WorkerReport::ExportPulled { hold });
    }
    if let Some(reports) = unpublished {
        reports.send(WorkerReport::ExportGone { hold });
    }
}

/// Sends a refusal before the connection closes. Best effort: the peer may be gone already.
async fn refuse(stream: &mut TcpStream, t: Duration, reason: &str) {
    let mut msg = vec![STATUS_REFUSED];
    put_string(&mut msg, reason);
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

// ---- wire format ----

fn write_handshake(buf: &mut Vec<u8>, config: &TcpTransportConfig) {
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    buf.push(u8::from(cfg!(target_endian = "little")));
    put_string(buf, &config.model_id);
    put_layout(buf, config.layout);
}

fn put_layout(buf: &mut Vec<u8>, layout: KvLayout) {
    for n in [
        layout.n_layers,
        layout.n_kv_heads,
        layout.head_dim,
        layout.block_size,
    ] {
        buf.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
    }
}

/// Reads D's handshake and compares it with P's own; `Err` is the reason to send back.
async fn check_handshake(
    stream: &mut TcpStream,
    config: &TcpTransportConfig,
) -> Result<(), String> {
    let t = config.io_timeout;
    let mut magic = [0u8; 8];
    timed(t, "read", stream.read_exact(&mut magic)).await?;
    if &magic != MAGIC {
        return Err("not a ferry KV transfer connection".into());
    }
    let version = timed(t, "read", stream.read_u32_le()).await?;
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {version}, this listener speaks {PROTOCOL_VERSION}"
        ));
    }
    let little_endian = timed(t, "read", stream.read_u8()).await? == 1;
    let model_id = timed(t, "read", read_string(stream)).await??;
    let mut dims = [0u32; 4];
    for d in &mut dims {
        *d = timed(t, "read", stream.read_u32_le()).await?;
    }
    if little_endian != cfg!(target_endian = "little") {
        return Err("the peers store KV floats in different byte orders".into());
    }
    if model_id != config.model_id {
        return Err(format!(
            "model mismatch: the reader has {model_id:?}, this engine {:?}",
            config.model_id
        ));
    }
    let mut ours = Vec::new();
    put_layout(&mut ours, config.layout);
    let theirs: Vec<u8> = dims.iter().flat_map(|d| d.to_le_bytes()).collect();
    if ours != theirs {
        let l = config.layout;
        return Err(format!(
            "KV layout mismatch: the reader has n_layers {}, n_kv_heads {}, head_dim {}, block_size {}; \
             this engine n_layers {}, n_kv_heads {}, head_dim {}, block_size {}",
            dims[0], dims[1], dims[2], dims[3], l.n_layers, l.n_kv_heads, l.head_dim, l.block_size
        ));
    }
    Ok(())
}

fn write_pull(buf: &mut Vec<u8>, spec: &FetchSpec) {
    buf.push(REQUEST_PULL);
    put_string(buf, &spec.remote_engine_id);
    put_string(buf, &spec.token);
    put_string(buf, &spec.weight_version);
    buf.extend_from_slice(&spec.prompt_hash);
    buf.extend_from_slice(&(spec.first_block as u64).to_le_bytes());
    buf.extend_from_slice(&(spec.src_blocks.len() as u32).to_le_bytes());
    for b in &spec.src_blocks {
        buf.extend_from_slice(&b.to_le_bytes());
    }
}

/// Reads a pull request after its kind byte. The hold is P's business, not the reader's: 0.
async fn read_pull(stream: &mut TcpStream) -> Result<Result<FetchSpec, String>, String> {
    let remote_engine_id = read_string(stream).await?;
    let token = read_string(stream).await?;
    let weight_version = read_string(stream).await?;
    let (remote_engine_id, token, weight_version) = match (remote_engine_id, token, weight_version)
    {
        (Ok(e), Ok(t), Ok(w)) => (e, t, w),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return Ok(Err(e)),
    };
    let mut prompt_hash = [0u8; 32];
    stream
        .read_exact(&mut prompt_hash)
        .await
        .map_err(io_reason)?;
    let first_block = stream.read_u64_le().await.map_err(io_reason)?;
    let n = stream.read_u32_le().await.map_err(io_reason)?;
    if n > MAX_PULL_BLOCKS {
        return Ok(Err(format!(
            "a pull of {n} blocks (at most {MAX_PULL_BLOCKS})"
        )));
    }
    let mut src_blocks = Vec::with_capacity(n as usize);
    for _ in 0..n {
        src_blocks.push(stream.read_u32_le().await.map_err(io_reason)?);
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

fn put_string(buf: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(MAX_STRING_BYTES as usize)];
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Outer `Err`: the stream failed. Inner `Err`: the peer sent a bad string (the stream is
/// still in step: its bytes were consumed).
async fn read_string<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<Result<String, String>, String> {
    let n = stream.read_u32_le().await.map_err(io_reason)?;
    if n > MAX_STRING_BYTES {
        return Err(format!(
            "a string of {n} bytes (at most {MAX_STRING_BYTES})"
        ));
    }
    let mut bytes = vec![0u8; n as usize];
    stream.read_exact(&mut bytes).await.map_err(io_reason)?;
    Ok(String::from_utf8(bytes).map_err(|_| "a string that is not UTF-8".to_owned()))
}

fn io_reason(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the peer closed the connection".into(),
        _ => e.to_string(),
    }
}

/// `f` bounded by `t`; errors as reasons.
async fn timed<T, E: IntoReason>(
    t: Duration,
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(t, f).await {
        Ok(r) => r.map_err(IntoReason::into_reason),
        Err(_) => Err(format!("{what} timed out after {t:?}")),
    }
}

trait IntoReason {
    fn into_reason(self) -> String;
}

impl IntoReason for std::io::Error {
    fn into_reason(self) -> String {
        io_reason(self)
    }
}

impl IntoReason for String {
    fn into_reason(self) -> String {
        self
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
#[path = "tcp_tests.rs"]
mod tests;
