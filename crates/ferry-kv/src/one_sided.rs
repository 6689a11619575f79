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

use crate::access::BlockGrant;

/// A network stack that lets peers read registered memory without this process.
pub trait OneSided: Send + Sync + 'static {
    /// What `--kv-transport` calls it, for messages.
    fn name(&self) -> &'static str;

    /// P: makes the allocation `grant` reads from readable by peers (registering it once per
    /// allocation), and returns this process's metadata generation, with the metadata a peer
    /// loads to read it when the peer's `known` generation is another one. The generation
    /// changes whenever registered memory changes (an arena released or reallocated), so a
    /// peer never keeps metadata that reaches freed memory.
    fn expose(&self, grant: &BlockGrant, known: u64) -> Result<Exposed, String>;

    /// D: the metadata generation it loaded for the peer at `peer` (0: none).
    fn known(&self, peer: SocketAddr) -> u64;

    /// D: reads one block at each of `remote.addrs` on the peer at `peer` into the blocks of
    /// `dst` (in order, each exactly one block), first loading `remote.metadata` when the peer
    /// sent it. Blocking; returns once every byte arrived, the read failed, `deadline` passed
    /// or `cancelled` was set. However it returns, nothing writes `dst` any more.
    fn read(
        &self,
        peer: SocketAddr,
        remote: Remote<'_>,
        dst: &mut BlockGrant,
        deadline: Instant,
        cancelled: &AtomicBool,
    ) -> Result<(), String>;
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
