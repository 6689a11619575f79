//! Tests of the arena: layout arithmetic, typed and byte-level access, release and reallocation.

use super::*;

fn layout() -> KvLayout {
    KvLayout {
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 4,
        block_size: 5,
        aux_floats: 0,
    }
}

/// Fills every float of the arena with its own index, so any offset can be checked by value.
fn indexed_arena(n_blocks: usize) -> KvArena {
    let mut arena = KvArena::new(layout(), n_blocks);
    for (i, x) in arena.as_mut_slice().iter_mut().enumerate() {
        *x = i as f32;
    }
    arena
}

#[test]
fn layout_sizes() {
    let l = layout();
    assert_eq!(l.token_floats(), 8);
    assert_eq!(l.plane_floats(), 40);
    assert_eq!(l.block_floats(), 240);
    assert_eq!(l.block_bytes(), 960);
}

#[test]
fn layout_offsets_follow_layer_plane_slot_head_dim_order() {
    let l = layout();
    assert_eq!(l.plane_offset(0, false), 0);
    assert_eq!(l.plane_offset(0, true), 40);
    assert_eq!(l.plane_offset(2, true), 200);
    assert_eq!(l.token_offset(1, KvPlane::K, 3), 80 + 24);
    assert_eq!(l.token_offset(1, KvPlane::V, 4), 120 + 32);
    assert_eq!(l.head_offset(2, KvPlane::V, 4, 1), 200 + 32 + 4);
}

#[test]
fn typed_accessors_read_the_right_floats() {
    let arena = indexed_arena(4);
    let base = 2 * 240;
    assert_eq!(
        arena.token(BlockId(2), 3, 1, KvPlane::K),
        &[104., 105., 106., 107., 108., 109., 110., 111.].map(|x| x + base as f32)
    );
    assert_eq!(
        arena.head(BlockId(2), 4, 2, KvPlane::V, 1),
        &[236., 237., 238., 239.].map(|x| x + base as f32)
    );
    let plane = arena.plane(BlockId(3), 0, KvPlane::V);
    assert_eq!(plane.len(), 40);
    assert_eq!(plane[0], (3 * 240 + 40) as f32);
    assert_eq!(plane[39], (3 * 240 + 79) as f32);
}

#[test]
fn arena_slots_address_the_same_tokens() {
    let mut arena = indexed_arena(4);
    // Slot 13 = block 2, slot 3 in block (block_size 5).
    assert_eq!(
        arena.token_at(13, 1, KvPlane::V),
        arena.token(BlockId(2), 3, 1, KvPlane::V)
    );
    arena.token_at_mut(13, 1, KvPlane::V).fill(-1.0);
    assert_eq!(arena.token(BlockId(2), 3, 1, KvPlane::V), &[-1.0; 8]);
    assert_eq!(
        arena.token(BlockId(2), 3, 1, KvPlane::K)[0],
        (2 * 240 + 80 + 24) as f32
    );
}

#[test]
fn token_mut_writes_only_that_token() {
    let mut arena = KvArena::new(layout(), 3);
    arena
        .token_mut(BlockId(1), 2, 2, KvPlane::V)
        .copy_from_slice(&[1., 2., 3., 4., 5., 6., 7., 8.]);
    let block = arena.block(BlockId(1));
    let start = layout().token_offset(2, KvPlane::V, 2);
    assert_eq!(&block[start..start + 8], &[1., 2., 3., 4., 5., 6., 7., 8.]);
    let nonzero = arena.as_slice().iter().filter(|&&x| x != 0.0).count();
    assert_eq!(nonzero, 8);
}

#[test]
fn block_bytes_round_trip_between_arenas() {
    let src = indexed_arena(4);
    let mut dst = KvArena::new(layout(), 4);
    let bytes = src.try_block_bytes(BlockId(3)).unwrap().to_vec();
    assert_eq!(bytes.len(), layout().block_bytes());
    dst.write_block_bytes(BlockId(1), &bytes).unwrap();
    assert_eq!(dst.block(BlockId(1)), src.block(BlockId(3)));
    assert!(dst.block(BlockId(0)).iter().all(|&x| x == 0.0));
    assert!(dst.block(BlockId(2)).iter().all(|&x| x == 0.0));
    // Bytes are the native f32 representation.
    let first = f32::from_ne_bytes(bytes[..4].try_into().unwrap());
    assert_eq!(first, (3 * 240) as f32);
}

#[test]
fn copy_block_from_copies_one_block() {
    let src = indexed_arena(4);
    let mut dst = KvArena::new(layout(), 2);
    dst.copy_block_from(BlockId(1), &src, BlockId(2)).unwrap();
    assert_eq!(dst.block(BlockId(1)), src.block(BlockId(2)));
    assert!(dst.block(BlockId(0)).iter().all(|&x| x == 0.0));
}

#[test]
fn byte_access_errors_name_the_block() {
    let mut arena = indexed_arena(4);
    assert_eq!(
        arena.try_block_bytes(BlockId(4)).unwrap_err(),
        KvError::BlockOutOfRange {
            block: BlockId(4),
            n_blocks: 4
        }
    );
    let err = arena.write_block_bytes(BlockId(2), &[0u8; 7]).unwrap_err();
    assert_eq!(
        err,
        KvError::WrongLength {
            block: BlockId(2),
            expected: 960,
            actual: 7
        }
    );
    assert_eq!(
        err.to_string(),
        "KV block 2: got 7 bytes, a block holds 960"
    );
    // A failed write leaves the block as it was.
    assert_eq!(arena.block(BlockId(2))[0], 480.0);

    let other = KvArena::new(
        KvLayout {
            head_dim: 8,
            ..layout()
        },
        4,
    );
    assert!(matches!(
        arena.copy_block_from(BlockId(0), &other, BlockId(1)),
        Err(KvError::LayoutMismatch {
            block: BlockId(1),
            ..
        })
    ));
    assert_eq!(
        arena.copy_block_from(BlockId(0), &other, BlockId(9)),
        Err(KvError::LayoutMismatch {
            block: BlockId(9),
            src: other.layout(),
            dst: layout()
        })
    );

    arena.release();
    assert_eq!(
        arena.try_block_bytes(BlockId(1)).unwrap_err(),
        KvError::Released { block: BlockId(1) }
    );
    assert_eq!(
        arena
            .write_block_bytes(BlockId(1), &[0u8; 960])
            .unwrap_err(),
        KvError::Released { block: BlockId(1) }
    );
    let src = indexed_arena(4);
    assert_eq!(
        arena
            .copy_block_from(BlockId(0), &src, BlockId(1))
            .unwrap_err(),
        KvError::Released { block: BlockId(0) }
    );
    assert_eq!(
        arena.check_block(BlockId(7)).unwrap_err(),
        KvError::BlockOutOfRange {
            block: BlockId(7),
            n_blocks: 4
        }
    );
}

#[test]
fn release_frees_and_reallocate_gives_zeroed_memory() {
    let mut arena = indexed_arena(4);
    assert_eq!(arena.bytes(), 4 * 960);
    assert!(arena.is_allocated());
    arena.release();
    assert_eq!(arena.bytes(), 0);
    assert!(!arena.is_allocated());
    assert!(arena.as_slice().is_empty());
    arena.reallocate();
    assert!(arena.is_allocated());
    assert_eq!(arena.bytes(), 4 * 960);
    assert!(arena.as_slice().iter().all(|&x| x == 0.0));
    // Reallocating an allocated arena keeps its contents.
    arena.block_mut(BlockId(1))[0] = 7.0;
    arena.reallocate();
    assert_eq!(arena.block(BlockId(1))[0], 7.0);
}

/// This process's resident set size in bytes (`VmRSS`, read by `resident.rs`).
#[cfg(target_os = "linux")]
fn rss_bytes() -> usize {
    crate::resident_bytes().expect("VmRSS") as usize
}

/// Releasing really gives the memory back to the OS (a 256 MiB allocation is mmap'd by the
/// allocator, so freeing it unmaps it), and reallocating does not touch pages until written.
#[cfg(target_os = "linux")]
#[test]
fn release_returns_memory_to_the_os() {
    const MIB: usize = 1 << 20;
    let layout = KvLayout {
        n_layers: 4,
        n_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        aux_floats: 0,
    };
    let n_blocks = 256 * MIB / layout.block_bytes();
    let mut arena = KvArena::new(layout, n_blocks);
    assert_eq!(arena.bytes(), 256 * MIB);
    // Touch every page so it is resident.
    for (i, x) in arena.as_mut_slice().iter_mut().enumerate().step_by(1024) {
        *x = i as f32;
    }
    let before = rss_bytes();
    arena.release();
    let after = rss_bytes();
    assert!(
        before.saturating_sub(after) > 200 * MIB,
        "RSS went from {before} to {after} bytes"
    );
    arena.reallocate();
    let reallocated = rss_bytes();
    assert!(
        reallocated < after + 32 * MIB,
        "RSS grew from {after} to {reallocated} bytes on an untouched reallocation"
    );
    assert_eq!(arena.bytes(), 256 * MIB);
}

/// The `VmFlags` of the mapping that holds `addr`, from `/proc/self/smaps`.
#[cfg(target_os = "linux")]
fn vm_flags_at(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'));
        if let Some((start, end)) = range {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                inside = (start..end).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.trim().to_string());
            }
        }
    }
    None
}

/// A large arena is advised for 2 MiB pages (the `hg` flag of its mapping), so attention's
/// reads of K and V scattered over it do not take a TLB miss every 4 KiB; a small one is left
/// alone. Where the kernel has no transparent huge pages the advice cannot take, so there is
/// nothing to check.
#[cfg(target_os = "linux")]
#[test]
fn a_large_arena_is_advised_for_huge_pages() {
    const MIB: usize = 1 << 20;
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
    if thp.map_or(true, |s| s.contains("[never]")) {
        return;
    }
    let layout = KvLayout {
        n_layers: 4,
        n_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        aux_floats: 0,
    };
    let arena = KvArena::new(layout, 64 * MIB / layout.block_bytes());
    let start = arena.block(BlockId(0)).as_ptr() as usize;
    let middle = (start + 4 * MIB) & !(2 * MIB - 1);
    let flags = vm_flags_at(middle).expect("the arena's mapping");
    assert!(
        flags.split_whitespace().any(|f| f == "hg"),
        "arena mapping flags: {flags}"
    );
    let small = KvArena::new(layout, MIB / layout.block_bytes());
    let flags =
        vm_flags_at(small.block(BlockId(0)).as_ptr() as usize).expect("the small arena's mapping");
    assert!(
        !flags.split_whitespace().any(|f| f == "hg"),
        "small arena mapping flags: {flags}"
    );
}
