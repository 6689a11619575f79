//! The copier against a real arena: bytes go to host memory and come back into other
//! blocks, a flush waits for every job handed over, grants are gone before reports.

use std::sync::mpsc;

use ferry_arena::{KvArena, KvLayout, Reports, WorkerConnector};
use ferry_core::{BlockId, HostCopy, TierJob, TierReport, TransferId, WorkerJob, WorkerReport};

use super::OffloadWorker;

fn layout() -> KvLayout {
    KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 8,
        block_size: 4,
        aux_floats: 0,
    }
}

fn copies(pairs: &[(u32, u32)]) -> Vec<HostCopy> {
    pairs
        .iter()
        .map(|&(block, host_block)| HostCopy {
            block: BlockId(block),
            host_block,
        })
        .collect()
}

fn reports() -> (Reports, mpsc::Receiver<WorkerReport>) {
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    (
        Reports::new(move |r| {
            let _ = tx.lock().unwrap().send(r);
        }),
        rx,
    )
}

#[test]
fn stored_blocks_load_back_byte_for_byte_into_other_blocks() {
    let mut arena = KvArena::new(layout(), 8);
    for b in 1..3u32 {
        for (i, x) in arena.block_mut(BlockId(b)).iter_mut().enumerate() {
            *x = (b * 1000 + i as u32) as f32;
        }
    }
    let mut w = OffloadWorker::new(4, layout().block_bytes()).unwrap();
    let (sink, rx) = reports();
    let store = WorkerJob::Tier(TierJob::Store {
        hold: TransferId(1),
        epoch: 3,
        copies: copies(&[(1, 2), (2, 3)]),
    });
    w.after_forward(&[store], &mut arena, &sink);
    w.before_forward(
        &[WorkerJob::Tier(TierJob::Flush {
            holds: vec![TransferId(1)],
        })],
        &mut arena,
        &sink,
    );
    // The flush returned: the job is done and its grant gone.
    assert_eq!(arena.n_outstanding_grants(), 0);
    assert_eq!(
        rx.try_recv().unwrap(),
        WorkerReport::Tier(TierReport::StoreDone {
            hold: TransferId(1),
            epoch: 3,
            ok: true
        })
    );
    assert_eq!(w.host_bytes(), 4 * layout().block_bytes() as u64);
    let load = WorkerJob::Tier(TierJob::Load {
        hold: TransferId(2),
        epoch: 3,
        copies: copies(&[(5, 2), (6, 3)]),
    });
    w.before_forward(&[load], &mut arena, &sink);
    w.wait_idle();
    assert!(matches!(
        rx.try_recv().unwrap(),
        WorkerReport::Tier(TierReport::LoadDone {
            hold: TransferId(2),
            epoch: 3,
            result: Ok(())
        })
    ));
    assert_eq!(arena.block(BlockId(5)), arena.block(BlockId(1)));
    assert_eq!(arena.block(BlockId(6)), arena.block(BlockId(2)));
    // Released, the memory comes back empty: a load now reads zeros.
    w.release_memory();
    assert_eq!(w.host_bytes(), 0);
    let load = WorkerJob::Tier(TierJob::Load {
        hold: TransferId(3),
        epoch: 4,
        copies: copies(&[(5, 2)]),
    });
    w.before_forward(&[load], &mut arena, &sink);
    w.wait_idle();
    assert!(arena.block(BlockId(5)).iter().all(|&x| x == 0.0));
}

#[test]
fn a_bad_job_fails_with_a_report_and_holds_nothing() {
    let mut arena = KvArena::new(layout(), 8);
    let mut w = OffloadWorker::new(2, layout().block_bytes()).unwrap();
    let (sink, rx) = reports();
    let jobs = [
        // Host block out of range.
        WorkerJob::Tier(TierJob::Store {
            hold: TransferId(1),
            epoch: 0,
            copies: copies(&[(1, 2)]),
        }),
        // Arena block out of range: refused at the grant.
        WorkerJob::Tier(TierJob::Load {
            hold: TransferId(2),
            epoch: 0,
            copies: copies(&[(99, 0)]),
        }),
    ];
    w.before_forward(&jobs, &mut arena, &sink);
    w.wait_idle();
    let mut got: Vec<WorkerReport> = rx.try_iter().collect();
    got.sort_by_key(|r| match r {
        WorkerReport::Tier(TierReport::StoreDone { hold, .. })
        | WorkerReport::Tier(TierReport::LoadDone { hold, .. }) => *hold,
        _ => unreachable!(),
    });
    assert!(matches!(
        got[0],
        WorkerReport::Tier(TierReport::StoreDone { ok: false, .. })
    ));
    assert!(matches!(
        &got[1],
        WorkerReport::Tier(TierReport::LoadDone { result: Err(_), .. })
    ));
    assert_eq!(arena.n_outstanding_grants(), 0);
}
