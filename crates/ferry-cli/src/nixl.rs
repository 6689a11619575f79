//! `--kv-transport` and loading NIXL, shared by `ferry serve` and `ferry bench transfer`:
//! both read KV one-sided through a NIXL agent of this process, named the same way, from the
//! same library folder. Without the `nixl` feature every NIXL call is an error saying how to
//! build with it.

use std::sync::Arc;

#[cfg(feature = "nixl")]
use anyhow::anyhow;
#[cfg(not(feature = "nixl"))]
use anyhow::bail;

/// `--kv-transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvTransportArg {
    Tcp,
    Nixl,
}

/// This process's NIXL agent (the library was loaded at start, [`load_nixl_library`]), named
/// after the engine id and a random suffix: peers key P's metadata by the name.
#[cfg(feature = "nixl")]
pub fn nixl_reads(engine_id: &str) -> anyhow::Result<Arc<dyn ferry_kv::OneSided>> {
    let suffix: String = ferry_engine::random_secret()[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let reads = ferry_kv::nixl::NixlReads::new(&format!("ferry-{engine_id}-{suffix}"))
        .map_err(|e| anyhow!("--kv-transport nixl: {e}"))?;
    Ok(Arc::new(reads))
}

#[cfg(not(feature = "nixl"))]
pub fn nixl_reads(_engine_id: &str) -> anyhow::Result<Arc<dyn ferry_kv::OneSided>> {
    bail!("{NO_NIXL}")
}

#[cfg(not(feature = "nixl"))]
const NO_NIXL: &str = "--kv-transport nixl: this ferry was built without NIXL (build it with \
                       `cargo build --release --features nixl`; see the README, P/D with NIXL)";

/// Where scripts/fetch-nixl.sh unpacks NIXL's libraries: `nixl/<version>/lib` in the model
/// cache folder (`$FERRY_CACHE`, else `~/.cache/ferry`).
#[cfg(feature = "nixl")]
fn nixl_cache_dir() -> Option<std::path::PathBuf> {
    crate::cache_dir()
        .ok()
        .map(|cache| cache.join("nixl").join(NIXL_VERSION).join("lib"))
}

/// The `nixl-cu12` wheel scripts/fetch-nixl.sh fetches (and `nixl-sys` 1.5.x binds).
#[cfg(feature = "nixl")]
const NIXL_VERSION: &str = "1.5.1";

/// Loads NIXL's library from `lib_dir` (`--nixl-lib-dir`), else the fetch script's folder when
/// it exists, else the usual library path; an error says what is missing.
#[cfg(feature = "nixl")]
pub fn load_nixl_library(lib_dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    let dir = lib_dir
        .map(std::path::Path::to_path_buf)
        .or_else(|| nixl_cache_dir().filter(|d| d.join("libnixl_capi.so").is_file()));
    ferry_kv::nixl::load_library(dir.as_deref()).map_err(|e| anyhow!("--kv-transport nixl: {e}"))
}

#[cfg(not(feature = "nixl"))]
pub fn load_nixl_library(_lib_dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    bail!("{NO_NIXL}");
}
