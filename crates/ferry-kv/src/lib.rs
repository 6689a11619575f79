//! ferry-kv: where KV bytes live and how they move.
//!
//! The [`KvArena`] is block-major: block `b` holds every layer's K and V for its
//! `block_size` tokens in one contiguous byte range, so a transfer or an offload copies a
//! whole block with one copy. Worker-side connectors and transports (later issues) build on
//! byte-level block access.

pub mod arena;

pub use arena::{KvArena, KvError, KvLayout, KvPlane};
