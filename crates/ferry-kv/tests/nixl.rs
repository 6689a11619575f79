//! The NIXL agent's registrations follow the arena's memory (feature `nixl`, after
//! `scripts/fetch-nixl.sh`): an allocation is registered once, when a read first touches it,
//! and deregistered when it is freed, each time under a new metadata generation, so a peer
//! never keeps metadata that reaches freed memory. One agent in this process, one test.

use ferry_arena::{Access, KvArena, KvLayout};
use ferry_core::BlockId;
use ferry_kv::nixl::{load_library, NixlError, NixlReads};
use ferry_kv::OneSided;

const LAYOUT: KvLayout = KvLayout {
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 8,
    block_size: 4,
    aux_floats: 0,
};

fn lib_dir() -> std::path::PathBuf {
    let cache = std::env::var_os("FERRY_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(&std::env::var_os("HOME").expect("HOME")).join(".cache/ferry")
        });
    cache.join("nixl/1.5.1/lib")
}

#[test]
fn registrations_follow_the_arena_memory() {
    let missing = load_library(Some(std::path::Path::new("/nonexistent")));
    assert_eq!(
        missing,
        Err(NixlError::NoLibrary("/nonexistent/libnixl_capi.so".into()))
    );
    load_library(Some(&lib_dir())).expect("run scripts/fetch-nixl.sh first");
    let reads = NixlReads::new("ferry-kv-test").unwrap();
    let mut arena = KvArena::new(LAYOUT, 4);

    // SAFETY: nothing else touches the arena while the grants live.
    let grant = unsafe { arena.grant(&BlockId::list([0, 2]), Access::Read) }.unwrap();
    let first = reads.expose(&grant, 0).unwrap();
    assert!(first.metadata.as_ref().is_some_and(|m| !m.is_empty()));
    assert_eq!(reads.n_registered(), 1);
    // A peer holding this generation gets no metadata again; the allocation is not
    // registered twice.
    let again = reads.expose(&grant, first.generation).unwrap();
    assert_eq!(again.generation, first.generation);
    assert_eq!(again.metadata, None);
    assert_eq!(reads.n_registered(), 1);
    // A grant's block addresses are inside the registered allocation.
    let region = grant.region();
    let b2 = grant.block_addr(1);
    assert_eq!(b2, region.base + 2 * LAYOUT.block_bytes());
    assert!(b2 + LAYOUT.block_bytes() <= region.base + region.bytes);

    // Released (sleep, KV release): deregistered once the last grant is gone.
    arena.release();
    assert_eq!(reads.n_registered(), 1, "a grant still holds the memory");
    drop(grant);
    assert_eq!(reads.n_registered(), 0, "freed memory is deregistered");

    // Reallocated: the new memory is registered under a new generation, and a peer holding
    // the old one gets the new metadata.
    arena.reallocate();
    // SAFETY: as above.
    let grant = unsafe { arena.grant(&[BlockId(1)], Access::Read) }.unwrap();
    let after = reads.expose(&grant, first.generation).unwrap();
    assert_ne!(after.generation, first.generation);
    assert!(after.metadata.is_some());
    assert_eq!(reads.n_registered(), 1);
    assert_ne!(grant.region().id, region.id);
}
