//! Tests of cross-thread arena access: workers and the engine thread on disjoint blocks, copies
//! between arenas, refused grants, release under an outstanding grant, stale generations.
//!
//! Also meant for Miri (Stacked and Tree Borrows), which checks the module's safety argument
//! rather than just the results; sizes shrink under Miri:
//! `MIRIFLAGS=-Zmiri-tree-borrows cargo +nightly miri test -p ferry-arena --lib -- access`.

use std::sync::mpsc;
use std::thread;

use super::*;
use crate::block::KvPlane;

/// Rounds of concurrent writes; each round rewrites every block involved.
const N_ROUNDS: usize = if cfg!(miri) { 2 } else { 300 };

fn layout() -> KvLayout {
    KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
        block_size: 4,
        aux_floats: 0,
    }
}

/// One block's bytes, different for every `(block, round)` and every byte position.
fn pattern(block: BlockId, round: usize) -> Vec<u8> {
    (0..layout().block_bytes())
        .map(|k| (k as u8) ^ (block.0 as u8).wrapping_mul(37) ^ (round as u8).wrapping_mul(101))
        .collect()
}

/// What the engine thread writes into every float of `block` in `round`.
fn engine_value(block: BlockId, round: usize) -> f32 {
    (block.index() * 1000 + round) as f32
}

/// Fills every float of the arena with its own index.
fn indexed_arena(n_blocks: usize) -> KvArena {
    let mut arena = KvArena::new(layout(), n_blocks);
    for (i, x) in arena.as_mut_slice().iter_mut().enumerate() {
        *x = i as f32;
    }
    arena
}

#[test]
fn grants_and_the_arena_can_cross_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<BlockGrant>();
    assert_send_sync::<KvArena>();
}

#[test]
fn workers_use_granted_blocks_while_the_engine_writes_the_others() {
    let layout = layout();
    let mut arena = KvArena::new(layout, 8);
    arena
        .block_bytes_mut(BlockId(0))
        .copy_from_slice(&pattern(BlockId(0), 0));
    let other = indexed_arena(8);
    // SAFETY: below, the engine thread reads and writes only blocks 2, 4, 6 while the grants
    // live (through block- and token-level accessors, never a whole-arena slice), and it reads
    // the granted blocks only after both workers dropped their grants.
    let (mut writer, reader) = unsafe {
        (
            arena
                .grant(&BlockId::list([1, 3, 5, 7]), Access::Write)
                .unwrap(),
            arena.grant(&[BlockId(0)], Access::Read).unwrap(),
        )
    };
    assert_eq!(arena.n_outstanding_grants(), 2);

    let writer = thread::spawn(move || {
        for round in 0..N_ROUNDS {
            for i in 0..writer.blocks().len() {
                let block = writer.blocks()[i];
                if round % 2 == 0 {
                    writer.write_block(i, &pattern(block, round)).unwrap();
                } else {
                    let bytes = writer.block_bytes_mut(i).unwrap();
                    bytes.copy_from_slice(&pattern(block, round));
                }
            }
        }
    });
    let reader = thread::spawn(move || {
        let mut host = vec![0u8; layout.block_bytes()];
        for _ in 0..N_ROUNDS {
            reader.read_block_into(0, &mut host).unwrap();
            assert_eq!(host, pattern(BlockId(0), 0));
            assert_eq!(reader.block_bytes(0), &host[..]);
        }
    });

    for round in 0..N_ROUNDS {
        for block in [2, 4] {
            for slot in 0..layout.block_size {
                for layer in 0..layout.n_layers {
                    for plane in [KvPlane::K, KvPlane::V] {
                        arena
                            .token_mut(BlockId(block), slot, layer, plane)
                            .fill(engine_value(BlockId(block), round));
                    }
                }
            }
        }
        arena
            .block_mut(BlockId(6))
            .fill(engine_value(BlockId(6), round));
        // The byte-level engine paths too, on blocks no grant holds.
        arena
            .copy_block_from(BlockId(6), &other, BlockId(3))
            .unwrap();
        let bytes = arena.block_bytes(BlockId(6)).to_vec();
        arena.write_block_bytes(BlockId(6), &bytes).unwrap();
        assert_eq!(
            arena.token(BlockId(6), 1, 1, KvPlane::V),
            other.token(BlockId(3), 1, 1, KvPlane::V)
        );
        arena
            .block_mut(BlockId(6))
            .fill(engine_value(BlockId(6), round));
        assert_eq!(
            arena.head(BlockId(4), 3, 1, KvPlane::K, 1)[0],
            engine_value(BlockId(4), round)
        );
        assert_eq!(
            arena.plane(BlockId(2), 0, KvPlane::V)[0],
            engine_value(BlockId(2), round)
        );
    }
    writer.join().unwrap();
    reader.join().unwrap();
    assert_eq!(arena.n_outstanding_grants(), 0);

    let last = N_ROUNDS - 1;
    assert_eq!(arena.block_bytes(BlockId(0)), &pattern(BlockId(0), 0)[..]);
    for block in [1, 3, 5, 7] {
        assert_eq!(
            arena.block_bytes(BlockId(block)),
            &pattern(BlockId(block), last)[..],
            "block {block}"
        );
    }
    for block in [2, 4, 6] {
        let want = engine_value(BlockId(block), last);
        assert!(
            arena.block(BlockId(block)).iter().all(|&x| x == want),
            "block {block}"
        );
    }
}

#[test]
fn a_worker_copies_between_arenas_byte_exactly() {
    let mut src = indexed_arena(4);
    // Bit patterns a float round trip could change: a signalling NaN, a negative zero.
    src.block_bytes_mut(BlockId(2))[..8].copy_from_slice(&[0x01, 0x00, 0x80, 0x7f, 0, 0, 0, 0x80]);
    let dst = KvArena::new(layout(), 6);
    // SAFETY: the engine thread touches neither arena until the worker is joined.
    let (from, mut to) = unsafe {
        (
            src.grant(&BlockId::list([2, 0]), Access::Read).unwrap(),
            dst.grant(&BlockId::list([5, 1, 3]), Access::Write).unwrap(),
        )
    };
    let worker = thread::spawn(move || {
        from.copy_into(0, &mut to, 0).unwrap();
        from.copy_into(1, &mut to, 1).unwrap();
        // Through a host buffer, as an offload store and load would.
        let mut host = vec![0u8; from.layout().block_bytes()];
        from.read_block_into(0, &mut host).unwrap();
        to.write_block(2, &host).unwrap();
    });
    worker.join().unwrap();

    assert_eq!(dst.block_bytes(BlockId(5)), src.block_bytes(BlockId(2)));
    assert_eq!(dst.block_bytes(BlockId(1)), src.block_bytes(BlockId(0)));
    assert_eq!(dst.block_bytes(BlockId(3)), src.block_bytes(BlockId(2)));
    for block in [0, 2, 4] {
        assert!(
            dst.block(BlockId(block)).iter().all(|&x| x == 0.0),
            "block {block}"
        );
    }

    // Within one arena: a read grant and a write grant over different blocks.
    let before = src.block_bytes(BlockId(1)).to_vec();
    // SAFETY: the engine thread does not touch `src` while the grants live.
    let (from, mut to) = unsafe {
        (
            src.grant(&[BlockId(1)], Access::Read).unwrap(),
            src.grant(&[BlockId(3)], Access::Write).unwrap(),
        )
    };
    thread::spawn(move || from.copy_into(0, &mut to, 0).unwrap())
        .join()
        .unwrap();
    assert_eq!(src.block_bytes(BlockId(3)), &before[..]);
    assert_eq!(src.n_outstanding_grants(), 0);
}

#[test]
fn bad_grants_are_refused_with_errors_naming_the_block() {
    let mut arena = indexed_arena(4);
    let block_2 = arena.block_bytes(BlockId(2)).to_vec();
    // SAFETY (every grant in this test): the engine thread only reads through its own `&` while
    // no write grant lives, and the grants are used on this thread only.
    unsafe {
        assert_eq!(
            arena
                .grant(&BlockId::list([0, 9]), Access::Read)
                .unwrap_err(),
            KvError::BlockOutOfRange {
                block: BlockId(9),
                n_blocks: 4
            }
        );
        let err = arena
            .grant(&BlockId::list([1, 2, 1]), Access::Write)
            .unwrap_err();
        assert_eq!(err, KvError::DuplicateBlock { block: BlockId(1) });
        assert_eq!(
            err.to_string(),
            "KV block 1 appears more than once in one write grant"
        );
        // Reading a block twice in one grant is fine.
        drop(
            arena
                .grant(&BlockId::list([1, 2, 1]), Access::Read)
                .unwrap(),
        );

        let mut writer = arena.grant(&BlockId::list([2, 3]), Access::Write).unwrap();
        let err = arena.grant(&[BlockId(3)], Access::Write).unwrap_err();
        assert_eq!(
            err,
            KvError::BlockBusy {
                block: BlockId(3),
                held: Access::Write
            }
        );
        assert_eq!(
            err.to_string(),
            "KV block 3 is already granted to another worker (Write)"
        );
        assert_eq!(
            arena
                .grant(&BlockId::list([0, 2]), Access::Read)
                .unwrap_err(),
            KvError::BlockBusy {
                block: BlockId(2),
                held: Access::Write
            }
        );
        let reader = arena.grant(&[BlockId(1)], Access::Read).unwrap();
        let second_reader = arena.grant(&BlockId::list([1, 0]), Access::Read).unwrap();
        assert_eq!(
            arena.grant(&[BlockId(0)], Access::Write).unwrap_err(),
            KvError::BlockBusy {
                block: BlockId(0),
                held: Access::Read
            }
        );
        // Refused grants claimed nothing and are not counted.
        assert_eq!(arena.n_outstanding_grants(), 3);
        assert_eq!(arena.memory().n_claimed_blocks(), 4);

        let err = writer.write_block(0, &[0u8; 7]).unwrap_err();
        assert_eq!(
            err,
            KvError::WrongLength {
                block: BlockId(2),
                expected: 512,
                actual: 7
            }
        );
        assert_eq!(
            reader.read_block_into(0, &mut [0u8; 513]).unwrap_err(),
            KvError::WrongLength {
                block: BlockId(1),
                expected: 512,
                actual: 513
            }
        );
        // A failed write leaves the block as it was.
        assert_eq!(writer.block_bytes(0), &block_2[..]);

        let mut reader = reader;
        let err = reader.write_block(0, &[0u8; 512]).unwrap_err();
        assert_eq!(err, KvError::ReadOnlyGrant { block: BlockId(1) });
        assert_eq!(err.to_string(), "KV block 1: the grant is read-only");
        assert_eq!(
            reader.block_bytes_mut(0).unwrap_err(),
            KvError::ReadOnlyGrant { block: BlockId(1) }
        );
        let mut second_reader = second_reader;
        assert_eq!(
            writer.copy_into(1, &mut second_reader, 1).unwrap_err(),
            KvError::ReadOnlyGrant { block: BlockId(0) }
        );

        let other = KvArena::new(
            KvLayout {
                head_dim: 8,
                ..layout()
            },
            4,
        );
        let mut foreign = other.grant(&[BlockId(0)], Access::Write).unwrap();
        assert_eq!(
            reader.copy_into(0, &mut foreign, 0).unwrap_err(),
            KvError::LayoutMismatch {
                block: BlockId(1),
                src: layout(),
                dst: other.layout()
            }
        );

        drop((writer, reader, second_reader, foreign));
        assert_eq!(arena.n_outstanding_grants(), 0);
        assert_eq!(arena.memory().n_claimed_blocks(), 0);
        drop(
            arena
                .grant(&BlockId::list([0, 1, 2, 3]), Access::Write)
                .unwrap(),
        );

        arena.release();
        assert_eq!(
            arena
                .grant(&BlockId::list([3, 1]), Access::Read)
                .unwrap_err(),
            KvError::Released { block: BlockId(3) }
        );
        assert_eq!(
            arena
                .grant(&BlockId::list([4, 3]), Access::Read)
                .unwrap_err(),
            KvError::BlockOutOfRange {
                block: BlockId(4),
                n_blocks: 4
            }
        );
    }
}

/// A worker that writes after the engine released the arena writes into memory the grant keeps
/// alive. The arena is big enough that the allocator maps it on its own (glibc maps anything
/// above 32 MiB), so a write into freed memory would hit an unmapped page and crash the test.
#[test]
fn a_release_keeps_an_outstanding_grants_memory_until_it_drops() {
    let (layout, n_blocks, n_iterations) = if cfg!(miri) {
        (layout(), 4, 2)
    } else {
        let layout = KvLayout {
            n_layers: 4,
            n_kv_heads: 4,
            head_dim: 64,
            block_size: 16,
            aux_floats: 0,
        };
        (layout, (64 << 20) / layout.block_bytes(), 20)
    };
    let last = n_blocks as u32 - 1;
    for iteration in 0..n_iterations {
        let mut arena = KvArena::new(layout, n_blocks);
        let storage = arena.memory().storage_weak();
        // SAFETY: the engine thread never touches blocks 1 and `last` after granting them.
        let mut grant = unsafe {
            arena
                .grant(&[BlockId(1), BlockId(last)], Access::Write)
                .unwrap()
        };
        let (released_tx, released_rx) = mpsc::channel();
        let worker = thread::spawn(move || {
            released_rx.recv().unwrap();
            for i in 0..2 {
                let bytes = grant.block_bytes_mut(i).unwrap();
                for (k, b) in bytes.iter_mut().enumerate() {
                    *b = (k + i + iteration) as u8;
                }
            }
            for i in 0..2 {
                let ok = grant
                    .block_bytes(i)
                    .iter()
                    .enumerate()
                    .all(|(k, &b)| b == (k + i + iteration) as u8);
                assert!(ok, "block {} lost the worker's writes", grant.blocks()[i]);
            }
        });

        arena.release();
        assert_eq!(arena.bytes(), 0);
        assert_eq!(arena.n_outstanding_grants(), 1);
        assert_eq!(
            storage.strong_count(),
            1,
            "the grant keeps the memory alive"
        );
        released_tx.send(()).unwrap();
        // Something else allocating meanwhile must not receive the worker's memory.
        let other = vec![0xEEu8; layout.block_bytes() * 2];
        worker.join().unwrap();
        assert!(other.iter().all(|&b| b == 0xEE));
        assert_eq!(arena.n_outstanding_grants(), 0);
        assert_eq!(
            storage.strong_count(),
            0,
            "freed when the last grant dropped"
        );
    }
}

/// Whole-arena slices would race with a worker (module doc, point 2); an assert catches them,
/// in release builds too.
#[test]
fn whole_arena_slices_are_refused_while_a_grant_is_outstanding() {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    let mut arena = KvArena::new(layout(), 4);
    // SAFETY: the grant is used on this thread only, and the engine never touches block 1.
    let grant = unsafe { arena.grant(&[BlockId(1)], Access::Read).unwrap() };
    let err = catch_unwind(AssertUnwindSafe(|| arena.as_mut_slice().len())).unwrap_err();
    let message = err.downcast_ref::<String>().unwrap();
    assert_eq!(
        message,
        "KV arena: a whole-arena mutable KV slice while workers hold 1 grants over the arena \
         races with them"
    );
    assert!(catch_unwind(AssertUnwindSafe(|| arena.as_slice().len())).is_err());
    // Block-level access to the other blocks is fine.
    arena.block_mut(BlockId(2))[0] = 1.0;
    drop(grant);
    assert_eq!(arena.as_slice().len(), 4 * layout().block_floats());

    // A grant over released memory does not cover the new memory.
    // SAFETY: as above.
    let stale = unsafe { arena.grant(&[BlockId(1)], Access::Write).unwrap() };
    arena.release();
    arena.reallocate();
    arena.as_mut_slice()[0] = 1.0;
    drop(stale);
}

#[test]
fn grants_from_before_a_release_are_stale() {
    let mut arena = KvArena::new(layout(), 4);
    assert_eq!(arena.generation(), 0);
    // SAFETY: the engine thread never touches block 1 of the first allocation again, and reads
    // block 1 of the second only while the grant over it is dropped.
    let mut stale = unsafe { arena.grant(&[BlockId(1)], Access::Write).unwrap() };
    assert!(stale.is_current(&arena));
    assert_eq!(stale.generation(), 0);
    assert_eq!(stale.access(), Access::Write);
    assert_eq!(stale.blocks(), &[BlockId(1)]);

    arena.release();
    assert!(!stale.is_current(&arena));
    assert_eq!(arena.generation(), 0);
    arena.reallocate();
    assert_eq!(arena.generation(), 1);
    assert!(!stale.is_current(&arena));
    // Reallocating an allocated arena allocates nothing and keeps the generation.
    arena.reallocate();
    assert_eq!(arena.generation(), 1);

    // The stale grant's claim is on the old memory: the new memory's block 1 is free to grant,
    // and the stale grant's writes never reach it.
    // SAFETY: as above.
    let fresh = unsafe { arena.grant(&[BlockId(1)], Access::Write).unwrap() };
    assert!(fresh.is_current(&arena));
    assert_eq!(fresh.generation(), 1);
    stale.write_block(0, &pattern(BlockId(1), 0)).unwrap();
    drop(fresh);
    assert!(arena.block(BlockId(1)).iter().all(|&x| x == 0.0));
    assert_eq!(arena.n_outstanding_grants(), 1);
    drop(stale);
    assert_eq!(arena.n_outstanding_grants(), 0);

    arena.release();
    arena.reallocate();
    assert_eq!(arena.generation(), 2);
    let other = KvArena::new(layout(), 4);
    // SAFETY: nothing touches `other`.
    let foreign = unsafe { other.grant(&[BlockId(0)], Access::Read).unwrap() };
    assert!(!foreign.is_current(&arena));
}

/// A dropped grant gives back exactly the claims it made; a registry that lost one no longer
/// knows who reads or writes the block, and says so, in release builds too.
#[test]
#[should_panic(
    expected = "KV arena: end of a Read grant over block 2, which the registry \
                           claims as nothing"
)]
fn a_grant_whose_claim_is_gone_panics_when_dropped() {
    let arena = KvArena::new(layout(), 4);
    // SAFETY: the engine touches nothing while the grant lives.
    let grant = unsafe { arena.grant(&[BlockId(2)], Access::Read).unwrap() };
    arena.memory().forget_claims();
    drop(grant);
}
