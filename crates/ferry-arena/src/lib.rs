//! ferry-arena: the block-major KV memory and the audited access to it, shared by the model
//! (attention reads and writes it) and the transports and offload copiers (`ferry-kv`, which
//! move its blocks), and the interface of the workers that touch it outside the forward.
//!
//! The [`KvArena`] is block-major: block `b` holds every layer's K and V for its
//! `block_size` tokens in one contiguous byte range, so a transfer or an offload copies a
//! whole block with one copy. Byte-level block access reports bad block ids as a [`KvError`]
//! naming the block; attention uses the typed accessors ([`KvArena::token`],
//! [`KvArena::plane`]).
//!
//! Transports and offload copiers run on their own threads and must not stop the engine thread,
//! so the arena's memory is shared, reference-counted storage: the engine thread keeps its
//! ordinary `&`/`&mut` access, and a worker gets a [`BlockGrant`] over exactly the blocks a
//! transfer hold names ([`KvArena::grant`]). All cross-thread `unsafe` lives in [`access`], whose
//! safety argument is the scheduler's block ledger (a block a transfer holds is never touched by
//! a step, and the reverse); the module checks what it can at run time (ids, lengths, conflicting
//! grants, generations) and keeps released memory alive until the last grant drops.
//!
//! The engine drives a connector's worker through [`WorkerConnector`], which hands it the arena
//! between forwards; the workers themselves (P/D transports, the offload copier) are
//! `ferry-kv`'s. This crate depends on nothing networked and on no async runtime, so the model
//! and the engine core, which build on it, open no socket by construction
//! (`ferry-lint`'s `tests/networked.rs` checks it).

pub mod access;
pub mod arena;
pub mod block;
pub mod resident;
pub mod worker;

pub use access::{BlockGrant, MemoryRegion};
pub use arena::KvArena;
pub use block::{Access, KvError, KvLayout, KvPlane};
pub use resident::resident_bytes;
pub use worker::{Reports, WorkerConnector};
