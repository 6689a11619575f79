//! The 4-bit dtypes' rows in groups of four, the layout a [`crate::Segment`] of Q4_0 or Q4_1
//! holds on a CPU with AVX-512, where the batch-1 kernel reads it with one vector
//! instruction less per block and row than GGUF's own layout (see `avx512::kernel_groups`).
//!
//! In a file, a 4-bit row is blocks of 32 elements, each its f16 scales (Q4_1: d then m;
//! Q4_0: d) and then 16 bytes of nibbles, byte i holding element i (low nibble) and element
//! 16 + i (high nibble). Here every whole group of four rows (rows 4g..4g + 4) holds, for
//! each block b in turn, the four rows' block b in four times the block's bytes:
//!
//! * 64 bytes of nibbles, byte `4i + r` being byte i of row r's nibbles, so one 64-byte load
//!   shifted right by 8r in each 32-bit lane gives row r's nibbles one per lane, the lane's
//!   low 4 bits the element's index into the block's table of 16 values (the file's layout
//!   needs a shift per lane for that, and lanes in a transposed order);
//! * then the four rows' scales, row by row, as in the file.
//!
//! A group's bytes are where its rows' bytes are in the file (four rows' worth), so row
//! ranges of whole groups keep their place and size; the rows after the last whole group
//! keep the file's layout. Only the order of bytes changes, never a value: every reader that
//! wants the file's layout gets it back row by row ([`file_row`]), bit for bit.

use crate::dtype::WeightDtype;
use crate::isa::Isa;

/// Rows per group.
pub const GROUP_ROWS: usize = 4;

/// Whether this process holds `dtype` in row groups: the 4-bit dtypes where the kernels
/// read groups faster (AVX-512; the other instruction sets read the file's layout, and a
/// grouped segment is copied back into it for them, block by block).
///
/// Measured on Intel (a 2-vCPU Xeon); a Zen 5 core, whose loads that cross a cache line
/// (three of a group's four) cost differently, has not run it. `FERRY_ROW_GROUPS=off` keeps
/// every row in the file's layout, for A/B runs on another host. Read once per process;
/// only speed depends on it, never a result.
pub fn held_in_groups(dtype: WeightDtype) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| {
        Isa::current() == Isa::Avx512 && std::env::var("FERRY_ROW_GROUPS").as_deref() != Ok("off")
    });
    on && is_4bit(dtype)
}

fn is_4bit(dtype: WeightDtype) -> bool {
    matches!(dtype, WeightDtype::Q4_0 | WeightDtype::Q4_1)
}

/// Bytes of one block's scales: the block less its 16 bytes of nibbles.
fn scale_bytes(dtype: WeightDtype) -> usize {
    dtype.block_bytes() - NIBBLE_BYTES
}

const NIBBLE_BYTES: usize = 16;

/// The rows of `bytes` (rows of `k` elements of a 4-bit `dtype`, in the file's layout) that
/// fill whole groups, rearranged into groups in place; returns how many rows that is (a
/// multiple of [`GROUP_ROWS`]).
///
/// # Panics
/// When `dtype` is not a 4-bit dtype or `bytes` is not whole rows of it.
pub fn group(dtype: WeightDtype, k: usize, bytes: &mut [u8]) -> usize {
    assert!(is_4bit(dtype), "{dtype} rows are not held in groups");
    let row_bytes = row_bytes(dtype, k);
    if row_bytes == 0 {
        return 0;
    }
    assert_eq!(bytes.len() % row_bytes, 0, "group: not whole rows");
    let (bb, sb) = (dtype.block_bytes(), scale_bytes(dtype));
    let group_bytes = GROUP_ROWS * row_bytes;
    let mut rows = vec![0u8; group_bytes];
    let n_groups = bytes.len() / group_bytes;
    for group in bytes.chunks_exact_mut(group_bytes) {
        rows.copy_from_slice(group);
        for (b, out) in group.chunks_exact_mut(GROUP_ROWS * bb).enumerate() {
            let (nibbles, scales) = out.split_at_mut(4 * NIBBLE_BYTES);
            for r in 0..GROUP_ROWS {
                let block = &rows[r * row_bytes + b * bb..][..bb];
                scales[r * sb..][..sb].copy_from_slice(&block[..sb]);
                for (i, &byte) in block[sb..].iter().enumerate() {
                    nibbles[GROUP_ROWS * i + r] = byte;
                }
            }
        }
    }
    n_groups * GROUP_ROWS
}

/// Row `j` in the file's layout, into `out` (one row's bytes): from `bytes`, rows of `k`
/// elements of `dtype` whose first `grouped` rows are in groups ([`group`]).
///
/// # Panics
/// When row `j` is not inside `bytes` or `out` is not one row long.
pub fn file_row(
    dtype: WeightDtype,
    k: usize,
    bytes: &[u8],
    grouped: usize,
    j: usize,
    out: &mut [u8],
) {
    let row_bytes = row_bytes(dtype, k);
    assert_eq!(out.len(), row_bytes, "file_row: out must hold one row");
    let row = &bytes[j * row_bytes..(j + 1) * row_bytes];
    if j >= grouped {
        return out.copy_from_slice(row);
    }
    let (bb, sb) = (dtype.block_bytes(), scale_bytes(dtype));
    let group = &bytes[j / GROUP_ROWS * GROUP_ROWS * row_bytes..][..GROUP_ROWS * row_bytes];
    let r = j % GROUP_ROWS;
    for (held, block) in group
        .chunks_exact(GROUP_ROWS * bb)
        .zip(out.chunks_exact_mut(bb))
    {
        block[..sb].copy_from_slice(&held[4 * NIBBLE_BYTES + r * sb..][..sb]);
        for (i, byte) in block[sb..].iter_mut().enumerate() {
            *byte = held[GROUP_ROWS * i + r];
        }
    }
}

fn row_bytes(dtype: WeightDtype, k: usize) -> usize {
    dtype
        .row_bytes(k)
        .unwrap_or_else(|| panic!("{k} elements are not whole {dtype} blocks"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes that differ everywhere, so a byte out of place shows.
    fn distinct(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 131 + i / 256) as u8).collect()
    }

    /// Grouping moves every byte of the whole groups and none of the rows after them, and
    /// each row comes back in the file's layout, bit for bit, for both 4-bit dtypes.
    #[test]
    fn rows_come_back_in_the_file_layout() {
        for dtype in [WeightDtype::Q4_0, WeightDtype::Q4_1] {
            let k = 96;
            let rb = dtype.row_bytes(k).unwrap();
            for rows in [0, 3, 4, 9, 12] {
                let file = distinct(rows * rb);
                let mut held = file.clone();
                let grouped = group(dtype, k, &mut held);
                assert_eq!(grouped, rows / 4 * 4, "{dtype} {rows} rows");
                assert_eq!(held[grouped * rb..], file[grouped * rb..], "the tail stays");
                if grouped > 0 {
                    assert_ne!(held[..grouped * rb], file[..grouped * rb], "groups moved");
                }
                let mut sorted = (held.clone(), file.clone());
                sorted.0.sort_unstable();
                sorted.1.sort_unstable();
                assert_eq!(sorted.0, sorted.1, "only the order changes");
                let mut row = vec![0; rb];
                for j in 0..rows {
                    file_row(dtype, k, &held, grouped, j, &mut row);
                    assert_eq!(row, file[j * rb..(j + 1) * rb], "{dtype} row {j}");
                }
            }
        }
    }

    /// The layout the kernels rely on: row r's nibble byte i of block b at `4i + r` of the
    /// block's 64 bytes, its scales after them.
    #[test]
    fn a_group_block_is_nibbles_interleaved_then_scales() {
        let (dtype, k) = (WeightDtype::Q4_1, 64);
        let rb = dtype.row_bytes(k).unwrap();
        let file = distinct(4 * rb);
        let mut held = file.clone();
        group(dtype, k, &mut held);
        for b in 0..2 {
            let block = &held[b * 80..(b + 1) * 80];
            for r in 0..4 {
                let src = &file[r * rb + b * 20..][..20];
                assert_eq!(block[64 + 4 * r..][..4], src[..4], "scales of row {r}");
                for i in 0..16 {
                    assert_eq!(block[4 * i + r], src[4 + i], "block {b} row {r} byte {i}");
                }
            }
        }
    }
}
