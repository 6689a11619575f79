//! ferry-kv: where KV bytes live and how they move.
//!
//! The [`KvArena`] is block-major: block `b` holds every layer's K and V for its
//! `block_size` tokens in one contiguous byte range, so a transfer or an offload copies a
//! whole block with one copy. Worker-side connectors and transports (later issues) build on
//! its byte-level block access, which reports bad block ids as a [`KvError`] naming the block;
//! attention uses the typed accessors ([`KvArena::token`], [`KvArena::plane`]).
//!
//! Transports and offload copiers run on their own threads and must not stop the engine thread,
//! so the arena's memory is shared, reference-counted storage: the engine thread keeps its
//! ordinary `&`/`&mut` access, and a worker gets a [`BlockGrant`] over exactly the blocks a
//! transfer hold names ([`KvArena::grant`]). All cross-thread `unsafe` lives in [`access`], whose
//! safety argument is the scheduler's block ledger (a block a transfer holds is never touched by
//! a step, and the reverse); the module checks what it can at run time (ids, lengths, conflicting
//! grants, generations) and keeps released memory alive until the last grant drops.

pub mod access;
pub mod arena;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod offload;
pub mod one_sided;
pub mod resident;
pub mod tcp;
pub mod transport;
pub mod worker;

pub use access::{Access, BlockGrant, MemoryRegion};
pub use arena::{KvArena, KvError, KvLayout, KvPlane};
pub use offload::{CopyJob, HostMemory, OffloadWorker};
pub use one_sided::{Exposed, OneSided, Remote};
pub use resident::resident_bytes;
pub use tcp::{
    TcpStats, TcpTransport, TcpTransportConfig, TransportError, DEFAULT_POOL_IDLE_PER_PEER,
    DEFAULT_READ_TIMEOUT,
};
pub use transport::{
    ExportOffer, FetchSpec, InMemoryFabric, InMemoryTransport, ReleaseSpec, Transport,
};
pub use worker::{PdWorker, Reports, WorkerConnector};
