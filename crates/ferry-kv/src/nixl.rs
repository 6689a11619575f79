//! One-sided reads through NIXL (feature `nixl`): [`NixlReads`] is the [`OneSided`] that
//! `--kv-transport nixl` gives the TCP transport, one NIXL agent per process with the UCX
//! backend (RDMA where the fabric has it, shared memory on one host, TCP otherwise; pick with
//! `UCX_TLS`).
//!
//! Built with `nixl-sys`'s `stub-api`, so the build needs no NIXL install: the stub looks up
//! `libnixl_capi.so` by bare name on its first call. [`load_library`] loads it by absolute
//! path from `--nixl-lib-dir` first (the dynamic loader matches the bare name to the library
//! already loaded; `LD_LIBRARY_PATH` is read only at process start, so setting it later would
//! not help), and checks that the real library is there before any call, so a missing library
//! is an error message and never the stub's abort. `scripts/fetch-nixl.sh` fetches the
//! libraries from PyPI's `nixl-cu12` wheel.
//!
//! Memory: an arena allocation is registered the first time a read touches it, and
//! deregistered when it is freed (a hook on the allocation, [`BlockGrant::on_region_freed`]),
//! each time with a new metadata generation, so peers load P's metadata again and no read can
//! reach freed memory through a registration. D keeps one loaded metadata per P address and
//! drops the old one when P sends a new generation.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use ferry_arena::{BlockGrant, MemoryRegion};
use nixl_sys::{
    Agent, MemType, MemoryRegion as NixlRegion, NixlDescriptor, RegistrationHandle, XferDescList,
    XferOp, XferStatus,
};

use crate::one_sided::{Exposed, OneSided, OneSidedError, Remote};

/// How long a read is polled without pause, then with short pauses: most reads end within
/// these (a read is polled busily for up to [`BUSY_POLL`], then every 64 polls pauses 20 µs
/// until [`GENTLE_POLL`], and 500 µs after).
const BUSY_POLL: Duration = Duration::from_millis(20);
const GENTLE_POLL: Duration = Duration::from_secs(1);

/// UCX settings [`load_library`] makes unless they are set: UCX's TCP transport moves a
/// one-sided read in segments of this size (8 KiB by default), which held reads over TCP to
/// 0.4–1 GB/s on loopback; with 512 KiB they ran at 3.9 GB/s (`ferry bench transfer
/// --kv-transport nixl`, docs/benchmarks.md). Shared memory and RDMA do not use them.
const UCX_DEFAULTS: [(&str, &str); 2] = [
    ("UCX_TCP_TX_SEG_SIZE", "512k"),
    ("UCX_TCP_RX_SEG_SIZE", "512k"),
];

/// The file the stub loads.
const CAPI: &str = "libnixl_capi.so";

/// Why NIXL could not be set up at start ([`load_library`], [`NixlReads::new`]); `ferry serve`
/// refuses to start with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NixlError {
    /// `--nixl-lib-dir` names a folder without the C API.
    #[error(
        "{} does not exist (--nixl-lib-dir names the folder holding {CAPI}; \
         scripts/fetch-nixl.sh fetches it)",
        .0.display()
    )]
    NoLibrary(PathBuf),
    /// The library's path cannot be given to the loader.
    #[error("{} holds a NUL byte", .0.display())]
    NulInPath(PathBuf),
    /// The dynamic loader refused the library (a missing dependency, another architecture).
    #[error("loading {}: {reason}", path.display())]
    Load { path: PathBuf, reason: String },
    /// Only the stub is there: no folder was given and none is on the library path.
    #[error(
        "{CAPI} was not found: run scripts/fetch-nixl.sh and pass the folder it prints as \
         --nixl-lib-dir (or start with that folder on LD_LIBRARY_PATH)"
    )]
    NotFound,
    /// NIXL failed at `step` (creating the agent, finding or starting the UCX backend).
    #[error("{step}: {reason}")]
    Setup { step: &'static str, reason: String },
    /// The system had no randomness for the first metadata generation.
    #[error("no randomness: {0}")]
    NoRandomness(String),
}

/// A failure of the network stack at `step`, in its own words.
fn stack(step: &'static str) -> impl FnOnce(nixl_sys::NixlError) -> OneSidedError {
    move |e| OneSidedError::Stack {
        step,
        reason: e.to_string(),
    }
}

/// Loads NIXL's C API (and, through its run path, NIXL and UCX) and checks it is the real
/// library. With `dir`, from that folder by absolute path, and its `plugins` folder becomes
/// `NIXL_PLUGIN_DIR` unless that is set; without, by the usual library path. Sets UCX's TCP
/// segment size ([`UCX_DEFAULTS`]) unless it is set.
///
/// Call it before any thread starts: it may set an environment variable.
pub fn load_library(dir: Option<&Path>) -> Result<(), NixlError> {
    if let Some(dir) = dir {
        let lib = dir.join(CAPI);
        if !lib.is_file() {
            return Err(NixlError::NoLibrary(lib));
        }
        if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
            std::env::set_var("NIXL_PLUGIN_DIR", dir.join("plugins"));
        }
        let Ok(path) = CString::new(lib.as_os_str().as_encoded_bytes()) else {
            return Err(NixlError::NulInPath(lib));
        };
        // SAFETY: a NUL-terminated path; the handle is kept for the process's lifetime (never
        // closed), so every symbol the stub resolves from it stays valid.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a NUL-terminated string or null, valid until the next
            // dl call on this thread.
            let reason = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    "unknown error".to_owned()
                } else {
                    CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            return Err(NixlError::Load { path: lib, reason });
        }
    }
    for (var, value) in UCX_DEFAULTS {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, value);
        }
    }
    if nixl_sys::is_stub() {
        return Err(NixlError::NotFound);
    }
    Ok(())
}

/// A registered allocation, as NIXL's descriptor types want it.
#[derive(Debug)]
struct Region(MemoryRegion);

impl NixlRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.base as *const u8
    }

    fn size(&self) -> usize {
        self.0.bytes
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// D's view of one P: the agent its metadata names, the generation, reads in flight, and
/// whether a read ended without completing (cut short by a cancel, a timeout or an error) since
/// the metadata was loaded. The connection such a read leaves may be stuck (seen after a link
/// cut: the next read on it never ended), so a suspect peer's metadata is dropped and loaded
/// again, which makes a new connection, as soon as no read uses it.
#[derive(Debug)]
struct Peer {
    agent: String,
    generation: u64,
    in_flight: usize,
    suspect: bool,
}

/// The [`OneSided`] of `--kv-transport nixl`; see the module doc.
pub struct NixlReads {
    state: Arc<State>,
}

struct State {
    agent: Agent,
    /// Registered allocations by [`MemoryRegion::id`]; dropping a handle deregisters.
    registered: Mutex<HashMap<u64, RegistrationHandle>>,
    /// Changes whenever registered memory changes; starts random, so a restarted P never
    /// repeats a generation a peer holds.
    generation: AtomicU64,
    /// D: what is loaded for each P address.
    remotes: Mutex<HashMap<SocketAddr, Peer>>,
}

impl std::fmt::Debug for NixlReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlReads")
            .field("agent", &self.state.agent.name())
            .field("generation", &self.state.generation.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl NixlReads {
    /// A NIXL agent named `name` (unique in the fleet: peers key metadata by it) with the UCX
    /// backend. [`load_library`] must have succeeded.
    pub fn new(name: &str) -> Result<Self, NixlError> {
        let setup = |step| {
            move |e: nixl_sys::NixlError| NixlError::Setup {
                step,
                reason: e.to_string(),
            }
        };
        let agent = Agent::new(name).map_err(setup("creating the NIXL agent"))?;
        let (_, params) = agent.get_plugin_params("UCX").map_err(setup(
            "finding the NIXL UCX plugin (is NIXL_PLUGIN_DIR right?)",
        ))?;
        agent
            .create_backend("UCX", &params)
            .map_err(setup("starting the NIXL UCX backend"))?;
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| NixlError::NoRandomness(e.to_string()))?;
        Ok(Self {
            state: Arc::new(State {
                agent,
                registered: Mutex::default(),
                generation: AtomicU64::new(u64::from_le_bytes(seed) | 1),
                remotes: Mutex::default(),
            }),
        })
    }

    /// Allocations registered now (for tests: a freed arena is deregistered).
    pub fn n_registered(&self) -> usize {
        lock(&self.state.registered).len()
    }
}

impl State {
    /// Registers the allocation `grant` is over, once.
    fn register(self: &Arc<Self>, grant: &BlockGrant) -> Result<(), OneSidedError> {
        let region = grant.region();
        let mut registered = lock(&self.registered);
        if registered.contains_key(&region.id) {
            return Ok(());
        }
        let handle = self
            .agent
            .register_memory(&Region(region), None)
            .map_err(stack("registering the KV arena's memory"))?;
        registered.insert(region.id, handle);
        self.generation.fetch_add(1, Ordering::AcqRel);
        drop(registered);
        // Deregistered while the allocation is still there; the hook holds no strong
        // reference, so a dropped transport lets go of everything at once.
        let state: Weak<State> = Arc::downgrade(self);
        grant.on_region_freed(Box::new(move || {
            if let Some(state) = state.upgrade() {
                let handle = lock(&state.registered).remove(&region.id);
                if handle.is_some() {
                    state.generation.fetch_add(1, Ordering::AcqRel);
                }
                drop(handle);
            }
        }));
        Ok(())
    }

    /// Begins a read from `peer`: loads P's metadata when it sent one for a generation not
    /// loaded (or the peer is suspect and idle), dropping what was loaded before; returns the
    /// agent name to read from. Every `Ok` is paired with an [`State::end_read`].
    fn begin_read(&self, peer: SocketAddr, remote: &Remote<'_>) -> Result<String, OneSidedError> {
        let mut remotes = lock(&self.remotes);
        let reload = match remotes.get(&peer) {
            None => true,
            Some(p) if p.generation != remote.generation => true,
            // Reads that began together all get P's metadata; the first loads it, the others
            // find that generation loaded (reloading it would cut the first one's read short).
            Some(p) => p.suspect && p.in_flight == 0,
        };
        if let (Some(metadata), true) = (remote.metadata, reload) {
            if let Some(old) = remotes.remove(&peer) {
                // Stale metadata may name freed memory, a suspect one a stuck connection:
                // never read through it again.
                let _ = self.agent.invalidate_remote_md(&old.agent);
            }
            let agent = self
                .agent
                .load_remote_md(metadata)
                .map_err(stack("loading P's NIXL metadata"))?;
            remotes.insert(
                peer,
                Peer {
                    agent,
                    generation: remote.generation,
                    in_flight: 0,
                    suspect: false,
                },
            );
        }
        match remotes.get_mut(&peer) {
            Some(p) if p.generation == remote.generation => {
                p.in_flight += 1;
                Ok(p.agent.clone())
            }
            _ => Err(OneSidedError::Protocol(
                "P sent no metadata for a generation this reader does not hold".into(),
            )),
        }
    }

    /// Ends a read [`State::begin_read`] began; `completed: false` makes the peer suspect.
    fn end_read(&self, peer: SocketAddr, completed: bool) {
        if let Some(p) = lock(&self.remotes).get_mut(&peer) {
            p.in_flight = p.in_flight.saturating_sub(1);
            p.suspect |= !completed;
        }
    }
}

impl OneSided for NixlReads {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn expose(&self, grant: &BlockGrant, known: u64) -> Result<Exposed, OneSidedError> {
        self.state.register(grant)?;
        let generation = self.state.generation.load(Ordering::Acquire);
        let metadata = if generation == known {
            None
        } else {
            let md = self
                .state
                .agent
                .get_local_md()
                .map_err(stack("this agent's metadata"))?;
            Some(md)
        };
        Ok(Exposed {
            generation,
            metadata,
        })
    }

    /// 0 for a suspect peer, so P sends its metadata again.
    fn known(&self, peer: SocketAddr) -> u64 {
        match lock(&self.state.remotes).get(&peer) {
            Some(p) if !p.suspect => p.generation,
            _ => 0,
        }
    }

    fn read(
        &self,
        peer: SocketAddr,
        remote: Remote<'_>,
        dst: &mut BlockGrant,
        deadline: Instant,
        cancelled: &AtomicBool,
    ) -> Result<(), OneSidedError> {
        let n = dst.blocks().len();
        if remote.addrs.len() != n {
            return Err(OneSidedError::Protocol(format!(
                "{} addresses for {n} blocks",
                remote.addrs.len()
            )));
        }
        // The destination must be registered too (an RDMA write lands in it).
        self.state.register(dst)?;
        let name = self.state.begin_read(peer, &remote)?;
        let read = self.read_from(&name, &remote, dst, deadline, cancelled);
        self.state.end_read(peer, read.is_ok());
        read
    }
}

impl NixlReads {
    /// One read from the agent `name` (see [`OneSided::read`]).
    fn read_from(
        &self,
        name: &str,
        remote: &Remote<'_>,
        dst: &mut BlockGrant,
        deadline: Instant,
        cancelled: &AtomicBool,
    ) -> Result<(), OneSidedError> {
        let block_bytes = dst.layout().block_bytes();
        let descs = || XferDescList::new(MemType::Dram).map_err(stack("describing the read"));
        let (mut local, mut from) = (descs()?, descs()?);
        for (i, &addr) in remote.addrs.iter().enumerate() {
            local.add_desc(dst.block_addr(i), block_bytes, 0);
            from.add_desc(addr as usize, block_bytes, 0);
        }
        let agent = &self.state.agent;
        let request = agent
            .create_xfer_req(XferOp::Read, &local, &from, name, None)
            .map_err(stack("preparing the read"))?;
        let posted = Instant::now();
        let mut in_progress = agent
            .post_xfer_req(&request, None)
            .map_err(stack("posting the read"))?;
        let mut spins = 0u32;
        while in_progress {
            if cancelled.load(Ordering::Acquire) {
                // Dropping the request cancels it before the grant is given back.
                return Err(OneSidedError::Cancelled);
            }
            if Instant::now() >= deadline {
                return Err(OneSidedError::TimedOut);
            }
            in_progress = match agent.get_xfer_status(&request) {
                Ok(XferStatus::InProgress) => true,
                Ok(XferStatus::Success) => false,
                Err(e) => return Err(stack("the read")(e)),
            };
            // Poll busily while the read is young (UCX progresses the read on each poll, and
            // sleeping between polls throttled a read over TCP several-fold), then more and
            // more gently: a long read over a slow link should not burn a core.
            spins = spins.saturating_add(1);
            if in_progress {
                match posted.elapsed() {
                    young if young < BUSY_POLL => std::thread::yield_now(),
                    _ if spins.is_multiple_of(64) => std::thread::sleep(Duration::from_micros(
                        if posted.elapsed() < GENTLE_POLL {
                            20
                        } else {
                            500
                        },
                    )),
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
