//! One-sided reads: D reads an export's blocks straight out of P's memory through a network
//! stack (NIXL over UCX: RDMA where the fabric has it, TCP where it does not), and the TCP
//! transport's authenticated connection (`tcp.rs`, requests *read* and *read done*) only says
//! which blocks, when, and whether the read counts.
//!
//! P cannot see a one-sided read, so the contract's rule applies in full (`tcp.rs` enforces
//! it, the same for every [`OneSided`]): the export's token, version, prompt and block ids are
//! checked before P hands out any address; the export is then *being read* and P keeps its
//! blocks until D says the read ended or P's read timeout passes; a read D finishes counts only
//! if P confirms it still held the blocks. Anything expired or unknown fails closed.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use ferry_arena::BlockGrant;

/// A network stack that lets peers read registered memory without this process.
pub trait OneSided: Send + Sync + 'static {
    /// What `--kv-transport` calls it, for messages.
    fn name(&self) -> &'static str;

    /// P: makes the allocation `grant` reads from readable by peers (registering it once per
    /// allocation), and returns this process's metadata generation, with the metadata a peer
    /// loads to read it when the peer's `known` generation is another one. The generation
    /// changes whenever registered memory changes (an arena released or reallocated), so a
    /// peer never keeps metadata that reaches freed memory.
    fn expose(&self, grant: &BlockGrant, known: u64) -> Result<Exposed, OneSidedError>;

    /// D: the metadata generation it loaded for the peer at `peer` (0: none).
    fn known(&self, peer: SocketAddr) -> u64;

    /// D: reads one block at each of `remote.addrs` on the peer at `peer` into the blocks of
    /// `dst` (in order, each exactly one block), first loading `remote.metadata` when the peer
    /// sent it. Blocking; returns once every byte arrived, the read failed, `deadline` passed
    /// ([`OneSidedError::TimedOut`]) or `cancelled` was set ([`OneSidedError::Cancelled`]).
    /// However it returns, nothing writes `dst` any more.
    fn read(
        &self,
        peer: SocketAddr,
        remote: Remote<'_>,
        dst: &mut BlockGrant,
        deadline: Instant,
        cancelled: &AtomicBool,
    ) -> Result<(), OneSidedError>;
}

/// Why a one-sided read or an exposure failed, said where it failed: the TCP transport counts
/// a load by it (a timeout as timed out, a cancel as cancelled, the rest as broken), never by
/// the message. `Display` is the reason a log or D's `FetchError` carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OneSidedError {
    /// The read had not ended at its deadline (P's read timeout): P no longer counts it.
    #[error("the read outlasted P's read timeout")]
    TimedOut,
    /// The reader's fetch was cancelled while the read ran.
    #[error("cancelled")]
    Cancelled,
    /// What P sent does not describe a read this reader can make (addresses for another
    /// number of blocks, no metadata for a generation it does not hold).
    #[error("{0}")]
    Protocol(String),
    /// The network stack failed at `step` (registering memory, loading a peer's metadata,
    /// posting or completing the read), with its own words.
    #[error("{step}: {reason}")]
    Stack { step: &'static str, reason: String },
}

/// What P answers a read with, besides the block addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exposed {
    pub generation: u64,
    /// `None` when the peer holds this generation already.
    pub metadata: Option<Vec<u8>>,
}

/// Where D reads from.
#[derive(Debug, Clone, Copy)]
pub struct Remote<'a> {
    pub generation: u64,
    pub metadata: Option<&'a [u8]>,
    /// One address per destination block, in P's address space.
    pub addrs: &'a [u64],
}
