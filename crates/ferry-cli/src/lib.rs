//! What the `ferry` command line's crates share: the binary (`crates/ferry`: `serve`, `proxy`,
//! `fetch-model`, `make-model`) and its benchmarks (`ferry-bench`, `ferry bench ...`) take some
//! of the same flags and set up some of the same things, and each of those has one home here.
//!
//! Like the binary, this is the edge where flags and the environment are read; its errors go
//! to the person at the terminal (`anyhow`, with the flag at fault named), never matched on.

mod byte_size;
mod fetch;
mod nixl;

pub use byte_size::ByteSize;
pub use fetch::{cache_dir, ensure_default_model, resolve_model};
pub use nixl::{load_nixl_library, nixl_reads, KvTransportArg};

/// `--routing` of `ferry proxy`, and the policies `ferry bench route` compares (each started as
/// `ferry proxy --routing <name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingArg {
    Kv,
    LeastLoaded,
    RoundRobin,
}
