//! ferry-kv: how KV bytes move. The P/D transports (in memory, TCP, one-sided reads through
//! NIXL) and the offload copier run the jobs the scheduler's connectors plan, as workers
//! ([`PdWorker`], [`OffloadWorker`]) the engine drives through `ferry-arena`'s
//! `WorkerConnector`, on `ferry-arena`'s `KvArena`.
//!
//! Transports and copiers run on their own threads and never stop the engine thread: the engine
//! hands a worker a `BlockGrant` over exactly the blocks a transfer hold names, and the worker
//! reports back through `Reports` when it is done with them. All cross-thread access to the
//! arena goes through grants (`ferry_arena::access`, the one audited module); a worker's one
//! `unsafe` for it is the call to `KvArena::grant`, for the blocks of the job's hold.

#[cfg(feature = "nixl")]
pub mod nixl;
pub mod offload;
pub mod one_sided;
pub mod tcp;
pub mod transport;
pub mod worker;

pub use offload::{CopyError, CopyJob, HostMemory, OffloadWorker};
pub use one_sided::{Exposed, OneSided, OneSidedError, Remote};
pub use tcp::{
    TcpStats, TcpTransport, TcpTransportConfig, TransportError, DEFAULT_POOL_IDLE_PER_PEER,
    DEFAULT_READ_TIMEOUT,
};
pub use transport::{
    ExportOffer, FetchSpec, InMemoryFabric, InMemoryTransport, PullError, ReleaseSpec, Transport,
};
pub use worker::PdWorker;
