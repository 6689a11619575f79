//! The offload tier's host memory really goes back to the OS on release (sleep, KV release),
//! and comes back empty and untouched. Alone in its binary: resident memory is per process.

use std::sync::mpsc;

use ferry_arena::{resident_bytes, KvArena, KvLayout, Reports, WorkerConnector};
use ferry_core::{BlockId, HostCopy, TierJob, TransferId, WorkerJob};
use ferry_kv::OffloadWorker;

#[cfg(target_os = "linux")]
#[test]
fn release_gives_the_tier_memory_back() {
    const MIB: u64 = 1 << 20;
    let layout = KvLayout {
        n_layers: 4,
        n_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        aux_floats: 0,
    };
    let block_bytes = layout.block_bytes();
    let n_host_blocks = (128 * MIB) as usize / block_bytes;
    let mut arena = KvArena::new(layout, 4);
    arena.block_mut(BlockId(1)).fill(1.5);
    let mut w = OffloadWorker::new(n_host_blocks, block_bytes).unwrap();
    let (tx, _rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let sink = Reports::new(move |r| {
        let _ = tx.lock().unwrap().send(r);
    });
    let rss = || resident_bytes().expect("VmRSS");
    let empty = rss();
    // Every host block written (one read grant may name a block many times).
    let copies = (0..n_host_blocks as u32)
        .map(|host_block| HostCopy {
            block: BlockId(1),
            host_block,
        })
        .collect();
    let store = WorkerJob::Tier(TierJob::Store {
        hold: TransferId(1),
        epoch: 0,
        copies,
    });
    w.after_forward(&[store], &mut arena, &sink);
    w.wait_idle();
    let full = rss();
    assert!(full > empty + 100 * MIB, "RSS went from {empty} to {full}");
    w.release_memory();
    let released = rss();
    assert!(
        full.saturating_sub(released) > 100 * MIB,
        "RSS went from {full} to {released} on release"
    );
    assert_eq!(w.host_bytes(), 0);
}
