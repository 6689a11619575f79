//! The AVX-512 register tiles of [`super`]: one 16-lane accumulator per output element,
//! chunks of 16 in order, fused multiply-adds, a fixed horizontal sum, then the tail in order.
//!
//! The batched f32 tile is 4×4 (W rows × activation rows, [`kernel_f32`]): 16 accumulators,
//! 4 W vectors and 1 activation vector live, 8 loads per 16 FMAs, one chunk of 16 a turn.
//! (The same tile in 32-element turns, as the quantized dtypes take them, ran ~15% slower at
//! k = 576; 6×4, 4×6, 5×5 and 3×8 tiles spilled accumulators to the stack and ran 10–30%
//! slower than 4×4. Two or three activation rows, attention's query heads of one KV head,
//! take 4×3 and 4×2.) A single activation row (decode at batch 1) uses 8×1 instead, eight
//! independent accumulators to hide the FMA latency while the weights stream from memory.
//! Every shape computes each element in the same order, so the tile an element falls in
//! never changes its bits.
//!
//! From 4 activation rows on, weights in another dtype than f32 go through panels instead
//! ([`pack_rows`], [`packed_tile`]): each block of W rows is dequantized once into panels of
//! 4 rows, the activations come packed the same way, and the same 4×4 tile (the same FMAs
//! in the same order) reads the two panels front to back, each chunk of 16 one aligned cache
//! line. At batch 64 that ran ~20% faster than the tile over separate rows (`kernel_speed`).
//!
//! Weights are loaded 16 at a time in their stored dtype and dequantized in registers with
//! the loader's arithmetic (see `load`); the loop runs 32 elements a turn (one quantization
//! block, two chunks) so a block's scales are read once.
//!
//! Q4_K and Q6_K rows at batch 1 take [`kernel_k_quant_1`]: each super-block of 256 decoded
//! in registers (the loader's values, see there) into the same accumulators in the same
//! order; Q5_0 and Q5_1 rows at batch 1 take [`kernel_five_bit_1`], a block's 32 values
//! looked up in two registers. Batched, they go through an f32 scratch (the parent's
//! `run_rows_dequantized`; the K-quants' filled by [`dequantize_k_rows`]).
//!
//! Q4_0 and Q4_1 rows held in groups of four ([`crate::weights::row_groups`]: how a segment
//! holds them on AVX-512) are read as held by the batch-1 rows ([`kernel_groups`]) and the
//! panels ([`pack_groups`]); `run_rows` hands every other row to these tiles in the file's
//! layout.

use std::arch::x86_64::*;

use std::ops::Range;

use super::{
    block_scales, dtype_code as code, scalar_at, whole_groups, Rows, Tile, GROUP_ROWS, PANEL,
};
use super::{BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0};
use crate::dtype::WeightDtype;

/// W rows of the batched tile (the parent's block sizes, multiples of 24, are multiples of it).
pub(super) const ROWS: usize = 4;

/// All of `t`: `x` rows against `w` rows, written into `out` (`m × n`), in `t`'s dtype.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn tile(x: &[f32], out: *mut f32, t: &Tile) {
    // SAFETY (all arms): as for `tile` itself.
    unsafe {
        match code(t.w.dtype) {
            F32 => tile_of::<F32>(x, out, t),
            F16 => tile_of::<F16>(x, out, t),
            BF16 => tile_of::<BF16>(x, out, t),
            Q8_0 => tile_of::<Q8_0>(x, out, t),
            Q4_0 => tile_of::<Q4_0>(x, out, t),
            Q4_1 => tile_of::<Q4_1>(x, out, t),
            Q4_K => tile_of::<Q4_K>(x, out, t),
            Q6_K => tile_of::<Q6_K>(x, out, t),
            Q5_0 => tile_of::<Q5_0>(x, out, t),
            _ => tile_of::<Q5_1>(x, out, t),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_of<const D: u8>(x: &[f32], out: *mut f32, t: &Tile) {
    let xp = x.as_ptr();
    if matches!(D, Q5_0 | Q5_1) {
        // Only batch 1 comes here (`run_part`: batched steps take an f32 scratch).
        assert_eq!(t.x_rows.len(), 1, "5-bit tiles are batch 1");
        let (i, mut j) = (t.x_rows.start, t.w_rows.start);
        while j + K_ROWS <= t.w_rows.end {
            // SAFETY (both calls): row i of x and rows j.. of w lie inside the tile, which
            // the caller checked.
            unsafe { kernel_five_bit_1::<D, K_ROWS>(xp, out, t, i, j, t.prefetch) };
            j += K_ROWS;
        }
        while j < t.w_rows.end {
            unsafe { kernel_five_bit_1::<D, 1>(xp, out, t, i, j, t.prefetch) };
            j += 1;
        }
        return;
    }
    if matches!(D, Q4_K | Q6_K) {
        // Only batch 1 comes here (`run_part`: batched steps take an f32 scratch).
        assert_eq!(t.x_rows.len(), 1, "K-quant tiles are batch 1");
        let (i, mut j) = (t.x_rows.start, t.w_rows.start);
        // The activation row itself (k floats, checked here).
        let xk = x[i * t.k..(i + 1) * t.k].as_ptr();
        while j + K_ROWS <= t.w_rows.end {
            // SAFETY (both calls): the activation row at `xk` holds k floats, and rows j..
            // of w lie inside the tile, which the caller checked.
            unsafe { kernel_k_quant_1::<D, K_ROWS>(xk, out, t, i, j, t.prefetch) };
            j += K_ROWS;
        }
        while j < t.w_rows.end {
            unsafe { kernel_k_quant_1::<D, 1>(xk, out, t, i, j, t.prefetch) };
            j += 1;
        }
        return;
    }
    if matches!(D, Q4_0 | Q4_1) && t.w.grouped > 0 {
        // Row groups: `run_rows` sends only whole groups here (every other row in the
        // file's layout), and only one to three activation rows (more take the panels).
        assert!(
            whole_groups(&t.w_rows, t.w),
            "a grouped tile is whole groups"
        );
        for i in t.x_rows.clone() {
            // Only the first pass over these W rows reads them from memory.
            let first = t.prefetch && i == t.x_rows.start;
            let mut j = t.w_rows.start;
            while j + 2 * GROUP_ROWS <= t.w_rows.end {
                // SAFETY: groups j.. of w and row i of x lie inside the tile, which the
                // caller checked against the slice lengths.
                unsafe { kernel_groups::<D, 2>(xp, out, t, i, j, first) };
                j += 2 * GROUP_ROWS;
            }
            while j < t.w_rows.end {
                // SAFETY: as above.
                unsafe { kernel_groups::<D, 1>(xp, out, t, i, j, first) };
                j += GROUP_ROWS;
            }
        }
        return;
    }
    let mut j = t.w_rows.start;
    if t.x_rows.len() == 1 {
        while j + 8 <= t.w_rows.end {
            // SAFETY (all kernel calls): rows i..i+C of x and j..j+R of w lie inside the
            // tile, which the caller checked against the slice lengths.
            unsafe { kernel::<D, 8, 1>(xp, out, t, t.x_rows.start, j, t.prefetch) };
            j += 8;
        }
    }
    if D == F32 && t.x_rows.len() >= 2 {
        while j + F32_ROWS <= t.w_rows.end {
            let mut i = t.x_rows.start;
            while i < t.x_rows.end {
                // Only the first pass over these W rows reads them from memory.
                let first = t.prefetch && i == t.x_rows.start;
                // A last group of fewer activation rows still shares each W load (attention's
                // query heads of one KV head come in threes).
                let c = (t.x_rows.end - i).min(F32_COLS);
                // SAFETY: as above.
                unsafe {
                    match c {
                        F32_COLS => kernel_f32::<F32_ROWS, F32_COLS>(xp, out, t, i, j, first),
                        3 => kernel_f32::<F32_ROWS, 3>(xp, out, t, i, j, first),
                        2 => kernel_f32::<F32_ROWS, 2>(xp, out, t, i, j, first),
                        _ => kernel_f32::<F32_ROWS, 1>(xp, out, t, i, j, first),
                    }
                }
                i += c;
            }
            j += F32_ROWS;
        }
    }
    while j + ROWS <= t.w_rows.end {
        let mut i = t.x_rows.start;
        while i + 4 <= t.x_rows.end {
            // Only the first pass over these W rows reads them from memory; the later passes
            // find them in L1, where a prefetch would only take a load slot.
            let first = t.prefetch && i == t.x_rows.start;
            unsafe { kernel::<D, ROWS, 4>(xp, out, t, i, j, first) };
            i += 4;
        }
        while i < t.x_rows.end {
            let first = t.prefetch && i == t.x_rows.start;
            unsafe { kernel::<D, ROWS, 1>(xp, out, t, i, j, first) };
            i += 1;
        }
        j += ROWS;
    }
    while j < t.w_rows.end {
        for i in t.x_rows.clone() {
            unsafe { kernel::<D, 1, 1>(xp, out, t, i, j, false) };
        }
        j += 1;
    }
}

/// R rows of W against C rows of x, one 16-lane accumulator per output element.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn kernel<const D: u8, const R: usize, const C: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, w) = (t.k, t.w);
    let (k16, k32) = (k / 16 * 16, k / 32 * 32);
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    let to_l2 = super::prefetch_to_l2();
    let mut p = 0;
    while p < k32 {
        if prefetch {
            // Fetch the next R rows' bytes of this turn: a row is only a few KiB, too short
            // for the hardware prefetcher to ramp up on before it ends. (A prefetch never
            // faults, so running past the last row is harmless.) Into L2 on Intel (see
            // `prefetch_to_l2`).
            for row in rows {
                let line = row.wrapping_add(R * w.row_bytes + byte_offset::<D>(p));
                super::prefetch_weights(line, to_l2);
                if D == F32 {
                    super::prefetch_weights(line.wrapping_add(64), to_l2);
                }
            }
        }
        if C == 1 && D != F32 && D != F16 && D != BF16 {
            // SAFETY: as for this function.
            return unsafe { kernel_quantized_1::<D, R>(x, out, t, i, j, prefetch) };
        }
        if C == 1 {
            // One activation row: row by row, each block's scales (or 4-bit table) made once
            // and used for both halves while the activation's two chunks stay in registers.
            // Each accumulator still takes its chunks in order.
            // SAFETY: p + 32 <= k inside row i.
            let xv = unsafe { [0, 16].map(|h| _mm512_loadu_ps(x.add(i * k + p + h))) };
            for (r, &row) in rows.iter().enumerate() {
                // SAFETY: p + 32 <= k inside each row.
                let ctx = unsafe { block_ctx::<D>(row, p) };
                for (half, &xh) in xv.iter().enumerate() {
                    // SAFETY: as above.
                    let w = unsafe { load::<D>(row, p, half, ctx) };
                    acc[0][r] = _mm512_fmadd_ps(xh, w, acc[0][r]);
                }
            }
            p += 32;
            continue;
        }
        // SAFETY: p + 32 <= k inside each row.
        let ctx: [__m512; R] = std::array::from_fn(|r| unsafe { block_ctx::<D>(rows[r], p) });
        for half in 0..2 {
            // SAFETY: p + 32 <= k inside each row.
            let wv: [__m512; R] =
                std::array::from_fn(|r| unsafe { load::<D>(rows[r], p, half, ctx[r]) });
            for (c, row) in acc.iter_mut().enumerate() {
                // SAFETY: p + 32 <= k inside row i + c.
                let xv = unsafe { _mm512_loadu_ps(x.add((i + c) * k + p + 16 * half)) };
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, v, *a);
                }
            }
        }
        p += 32;
    }
    // A last chunk of 16: only f32, f16 and bf16 rows (a quantized row is whole blocks).
    if p < k16 {
        // SAFETY: p + 16 <= k inside each row.
        let wv: [__m512; R] =
            std::array::from_fn(|r| unsafe { load::<D>(rows[r], p, 0, _mm512_setzero_ps()) });
        for (c, row) in acc.iter_mut().enumerate() {
            // SAFETY: p + 16 <= k inside row i + c.
            let xv = unsafe { _mm512_loadu_ps(x.add((i + c) * k + p)) };
            for (a, &v) in row.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(xv, v, *a);
            }
        }
    }
    let sums = joint_sums(&acc);
    for (c, row) in sums.iter().enumerate() {
        for (r, &sum) in row.iter().enumerate() {
            let mut s = sum;
            for q in k16..k {
                // SAFETY: q < k inside rows i + c and j + r.
                let (xq, wq) = unsafe { (*x.add((i + c) * k + q), scalar_at(w.dtype, rows[r], q)) };
                s = xq.mul_add(wq, s);
            }
            // SAFETY: (i + c, j + r) is inside the m × n output.
            unsafe { out.add((i + c) * t.n + j + r).write(s) };
        }
    }
}

/// W rows and activation rows of the batched f32 tile ([`kernel_f32`]).
const F32_ROWS: usize = 4;
const F32_COLS: usize = 4;

/// [`kernel`] for f32 weights, 16 elements a turn: R W rows against C activation rows, one
/// 16-lane accumulator per output element taking its chunks of 16 in order (the same
/// multiply-adds in the same order as every other tile), R + C loads per R × C FMAs.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn kernel_f32<const R: usize, const C: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, w) = (t.k, t.w);
    let k16 = k / 16 * 16;
    let rows: [*const f32; R] =
        std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes).cast());
    let xs: [*const f32; C] = std::array::from_fn(|c| x.wrapping_add((i + c) * k));
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    let mut p = 0;
    while p < k16 {
        if prefetch {
            // As in `kernel`: the next R rows' line of this turn.
            for row in rows {
                let line = row.wrapping_add(R * w.row_bytes / 4 + p);
                _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
            }
        }
        // SAFETY: p + 16 <= k inside each W row and each activation row.
        let wv: [__m512; R] = std::array::from_fn(|r| unsafe { _mm512_loadu_ps(rows[r].add(p)) });
        for (c, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let xv = unsafe { _mm512_loadu_ps(xs[c].add(p)) };
            for (a, &v) in row.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(xv, v, *a);
            }
        }
        p += 16;
    }
    let sums = joint_sums(&acc);
    for (c, row) in sums.iter().enumerate() {
        for (r, &sum) in row.iter().enumerate() {
            let mut s = sum;
            for q in k16..k {
                // SAFETY: q < k inside rows i + c and j + r.
                s = unsafe { (*xs[c].add(q)).mul_add(*rows[r].add(q), s) };
            }
            // SAFETY: (i + c, j + r) is inside the m × n output.
            unsafe { out.add((i + c) * t.n + j + r).write(s) };
        }
    }
}

/// W rows `rows` as the loader's f32 values in panels of [`PANEL`] rows (the last padded
/// with zeros, so every tile reads whole panels): see [`panel_offset`].
///
/// Rows before `fetch_end` (the caller's last row, past this block) are prefetched a few
/// rows ahead of the ones decoded, across the block's end, so the next block does not start
/// cold (with blocks of 4–12 rows, one in every one to three groups did; with the fetch
/// across blocks, the packing's share of a batch-64 decode step's samples went from
/// 6.6–6.7% to 6.1–6.2% in `perf`).
///
/// # Safety
/// The rows lie inside `w`'s memory.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn pack_rows(
    w: Rows,
    rows: Range<usize>,
    fetch_end: usize,
    k: usize,
    out: &mut [f32],
) {
    // SAFETY (all arms): as for this function.
    unsafe {
        match code(w.dtype) {
            F32 => pack_rows_of::<F32>(w, rows, fetch_end, k, out),
            F16 => pack_rows_of::<F16>(w, rows, fetch_end, k, out),
            BF16 => pack_rows_of::<BF16>(w, rows, fetch_end, k, out),
            Q8_0 => pack_rows_of::<Q8_0>(w, rows, fetch_end, k, out),
            Q4_0 => pack_rows_of::<Q4_0>(w, rows, fetch_end, k, out),
            Q4_1 => pack_rows_of::<Q4_1>(w, rows, fetch_end, k, out),
            _ => unreachable!("{} is packed through an f32 scratch", w.dtype),
        }
    }
}

/// Where chunk `q` (16 elements) of row `r` of a block packed by [`pack_rows`] starts: panel
/// `r / PANEL` at `r / PANEL * PANEL * k16`, and in it each chunk its rows' 16 floats in turn.
fn panel_offset(r: usize, q: usize, k16: usize) -> usize {
    (r / PANEL) * PANEL * k16 + q * 16 * PANEL + (r % PANEL) * 16
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_rows_of<const D: u8>(
    w: Rows,
    rows: Range<usize>,
    fetch_end: usize,
    k: usize,
    out: &mut [f32],
) {
    let (k16, k32) = (k / 16 * 16, k / 32 * 32);
    let n = rows.len();
    let panels = n.div_ceil(PANEL);
    assert!(
        out.len() >= panels * PANEL * k16,
        "pack_rows: out too short"
    );
    let dst = out.as_mut_ptr();
    if matches!(D, Q4_0 | Q4_1) && w.grouped > 0 {
        // SAFETY: as for this function; `out` holds the panels (checked above).
        return unsafe { pack_groups::<D>(w, rows, fetch_end, k, dst) };
    }
    let quantized = matches!(D, Q8_0 | Q4_0 | Q4_1);
    for (r, j) in rows.clone().enumerate() {
        let row = w.ptr.wrapping_add(j * w.row_bytes);
        let at = |q: usize| panel_offset(r, q, k16);
        // The row a panel later, fetched while this one is decoded (the rows stream from
        // memory once per step, and a row is too short for the hardware prefetcher).
        let ahead = row.wrapping_add(PANEL * w.row_bytes);
        let mut p = 0;
        if quantized {
            // The scales 16 blocks at a time, as the batch-1 kernel takes them.
            let mut scales = [[0.0f32; 2 * GROUP]];
            let n_blocks = k / 32;
            let mut b0 = 0;
            while b0 < n_blocks {
                let nb = GROUP.min(n_blocks - b0);
                // SAFETY: blocks b0..b0 + nb lie inside the row.
                unsafe { group_scales::<D, 1>(&[row], b0, nb, &mut scales) };
                for b in 0..nb {
                    let p = (b0 + b) * 32;
                    if j + PANEL < fetch_end {
                        let line = ahead.wrapping_add(byte_offset::<D>(p));
                        _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
                    }
                    let [d, m] = [0, 1].map(|h| _mm512_set1_ps(scales[0][2 * b + h]));
                    let ctx = ctx_of::<D>(d, m);
                    // SAFETY: block b0 + b lies inside the row; both chunks' places lie
                    // inside `out` (checked above).
                    unsafe {
                        _mm512_storeu_ps(dst.add(at(p / 16)), load::<D>(row, p, 0, ctx));
                        _mm512_storeu_ps(dst.add(at(p / 16 + 1)), load::<D>(row, p, 1, ctx));
                    }
                }
                b0 += nb;
            }
            p = k32;
        }
        while p < k32 {
            // SAFETY: p + 32 <= k inside the row; both chunks' places lie inside `out`.
            unsafe {
                let ctx = block_ctx::<D>(row, p);
                _mm512_storeu_ps(dst.add(at(p / 16)), load::<D>(row, p, 0, ctx));
                _mm512_storeu_ps(dst.add(at(p / 16 + 1)), load::<D>(row, p, 1, ctx));
            }
            p += 32;
        }
        if p < k16 {
            // SAFETY: p + 16 <= k (f32, f16 and bf16 rows only).
            unsafe {
                let v = load::<D>(row, p, 0, _mm512_setzero_ps());
                _mm512_storeu_ps(dst.add(at(p / 16)), v);
            }
        }
    }
    for r in n..panels * PANEL {
        for q in 0..k16 / 16 {
            let at = panel_offset(r, q, k16);
            out[at..at + 16].fill(0.0);
        }
    }
}

/// [`pack_rows`] for rows held in row groups ([`crate::weights::row_groups`]), whole groups
/// only (`run_rows` sends the other rows through the file's layout): a group is a panel, each
/// row's values made as [`kernel_groups`] makes them, a block of the group's four rows at a
/// time so its nibbles are loaded once and the panel is written in order (row by row, the
/// packing's share of a batch-64 decode step's `perf` samples was 5.5–5.7% against
/// 4.8–5.0% so, in three interleaved pairs).
///
/// # Safety
/// The rows are whole groups inside `w`; `out` holds their panels.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn pack_groups<const D: u8>(
    w: Rows,
    rows: Range<usize>,
    fetch_end: usize,
    k: usize,
    out: *mut f32,
) {
    assert!(whole_groups(&rows, w), "packed groups are whole groups");
    let f16 = super::f16_table();
    for (g, j) in rows.clone().step_by(GROUP_ROWS).enumerate() {
        let group = w.ptr.wrapping_add(j * w.row_bytes);
        for p in (0..k).step_by(32) {
            let block = group.wrapping_add(GROUP_ROWS * byte_offset::<D>(p));
            if j + GROUP_ROWS < fetch_end {
                // The next group's block, fetched while this one is decoded (as the file
                // layout's packing fetches the row a panel later).
                let ahead = block.wrapping_add(GROUP_ROWS * w.row_bytes);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast::<i8>());
            }
            // The group's four rows of this block in turn: one load of its nibbles, and the
            // panel's two chunks written front to back (its rows side by side).
            for lane in 0..GROUP_ROWS {
                // SAFETY: the group's block lies inside `w`; both chunks' places lie inside
                // `out` (a 4-bit row has k16 = k).
                unsafe {
                    let values = group_values::<D>(f16, block, lane);
                    let at = |q: usize| out.add(panel_offset(GROUP_ROWS * g + lane, q, k));
                    _mm512_storeu_ps(at(p / 16), values[0]);
                    _mm512_storeu_ps(at(p / 16 + 1), values[1]);
                }
            }
        }
    }
}

/// The loader's f32 values of row `lane`'s block in a group's block at `block`
/// ([`crate::weights::row_groups`]), as its two chunks of 16: the block's 16-value table
/// ([`ctx_of`] of its scales, looked up as [`kernel_quantized_1`] does) indexed by the
/// row's nibbles, the group's 64 nibble bytes shifted right by `8 * lane` in each 32-bit
/// lane (the low nibbles then as they are, `vpermps` reading an index's low 4 bits; the high
/// ones four bits further).
///
/// The same 64-byte load at the group's block for every row, so a caller that takes the
/// four rows in turn loads it once (the compiler keeps one load and seven shifts a group).
/// A load at byte `lane` instead, no shift, took one vector instruction less per row but
/// split over two cache lines for rows 1–3 (and for row 0 too where the group's block does
/// not start a line, three times in four at k = 576): on a 2-vCPU Xeon, twelve interleaved
/// pairs of `ferry bench model --batch 1` on the Q4_1 file took the layer matmuls from
/// 2337–2731 (median 2497) to 2231–2655 µs per step (median 2378; the pair's ratio a median
/// 0.95, 9 pairs of 12 faster), batch 64 within noise.
///
/// # Safety
/// The group's block at `block` (four blocks' bytes: 64 of nibbles, then each row's
/// scales) is readable, and `lane` < 4.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn group_values<const D: u8>(
    f16: &[f32; 1 << 16],
    block: *const u8,
    lane: usize,
) -> [__m512; 2] {
    let scale_bytes = byte_offset::<D>(32) - 16;
    // SAFETY: inside the group's block, as the caller promised.
    let (scales, whole) = unsafe {
        (
            block_scales(f16, block.add(64 + lane * scale_bytes), D == Q4_1),
            _mm512_loadu_si512(block.cast()),
        )
    };
    let low = match lane {
        0 => whole,
        1 => _mm512_srli_epi32::<8>(whole),
        2 => _mm512_srli_epi32::<16>(whole),
        _ => _mm512_srli_epi32::<24>(whole),
    };
    let [d, m] = scales.map(|v| _mm512_set1_ps(v));
    let table = ctx_of::<D>(d, m);
    let high = _mm512_srli_epi32::<4>(low);
    [low, high].map(|idx| _mm512_permutexvar_ps(idx, table))
}

/// One tile of packed panels: W's (`panel`, the rows, the first row's number, how many of
/// the panel's [`PANEL`] rows are real) and the activations' (the same, `c` ≤ [`PANEL`]
/// rows, the panel holding exactly those), with the output's row length and `k`.
pub(in crate::kernels) struct Panels<'a> {
    pub(in crate::kernels) w: (&'a [f32], Rows, usize, usize),
    pub(in crate::kernels) x: (&'a [f32], &'a [f32], usize, usize),
    pub(in crate::kernels) n: usize,
    pub(in crate::kernels) k: usize,
}

/// A [`Panels`] tile into `out`: the same multiply-adds in the same order as
/// [`kernel_f32`] (each element one 16-lane accumulator taking its chunks in order, then
/// the fixed tree and the scalar tail from the unpacked rows), two sequential streams.
///
/// # Safety
/// The panels hold `k / 16 * 16` floats per row; the rows lie inside their matrices and
/// the tile's output elements inside `out`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn packed_tile(t: &Panels<'_>, out: *mut f32) {
    // SAFETY (all arms): as for this function.
    unsafe {
        match t.x.3 {
            4 => packed_kernel::<4>(t, out),
            3 => packed_kernel::<3>(t, out),
            2 => packed_kernel::<2>(t, out),
            _ => packed_kernel::<1>(t, out),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn packed_kernel<const C: usize>(t: &Panels<'_>, out: *mut f32) {
    let ((wp, w, j0, nr), (xp, x, i0, _)) = (t.w, t.x);
    let (n, k) = (t.n, t.k);
    let k16 = k / 16 * 16;
    assert!(
        wp.len() >= PANEL * k16 && xp.len() >= C * k16,
        "packed_tile: short panels"
    );
    let mut acc = [[_mm512_setzero_ps(); PANEL]; C];
    let (mut wq, mut xq) = (wp.as_ptr(), xp.as_ptr());
    for _ in 0..k16 / 16 {
        // SAFETY: one chunk of the PANEL W rows and of the C activation rows, inside the
        // panels (checked above).
        let wv: [__m512; PANEL] =
            std::array::from_fn(|r| unsafe { _mm512_loadu_ps(wq.add(16 * r)) });
        for (c, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let xv = unsafe { _mm512_loadu_ps(xq.add(16 * c)) };
            for (a, &v) in row.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(xv, v, *a);
            }
        }
        wq = wq.wrapping_add(16 * PANEL);
        xq = xq.wrapping_add(16 * C);
    }
    let sums = joint_sums(&acc);
    for (c, row) in sums.iter().enumerate() {
        for (r, &sum) in row.iter().enumerate().take(nr) {
            let mut s = sum;
            let wrow = w.ptr.wrapping_add((j0 + r) * w.row_bytes);
            for q in k16..k {
                // SAFETY: q < k inside W row j0 + r, as the caller promised.
                s = x[(i0 + c) * k + q].mul_add(unsafe { scalar_at(w.dtype, wrow, q) }, s);
            }
            // SAFETY: (i0 + c, j0 + r) is inside the m × n output.
            unsafe { out.add((i0 + c) * n + j0 + r).write(s) };
        }
    }
}

/// Blocks whose scales [`group_scales`] converts at once.
const GROUP: usize = 16;

/// [`kernel`] for one activation row against R rows of a quantized dtype in the file's
/// layout (Q8_0; the 4-bit dtypes where they are not held in row groups, which
/// [`kernel_groups`] reads): the same multiply-adds in the same order, decoded with fewer
/// vector instructions than [`load`] takes.
///
/// * Every block's f16 scales (Q4_1: d and m) are looked up in [`super::f16_table`] by their
///   bits and broadcast straight from the table: loads only, where a conversion
///   (`vpbroadcastw` and `vcvtph2ps`, or [`group_scales`]'s permutes) took the vector
///   ports the multiply-adds need. On Intel, whose AVX-512 runs on two ports, that made the
///   batch-1 kernels 13-20% faster on one core (a block row, L2-hot, best of 4 interleaved
///   runs: Q4_1 1.31 → 1.05 ns at k = 576 and 1.21 → 1.06 at k = 1536, Q8_0 1.48 → 1.29).
/// * Q4_0 and Q4_1: each block's 16-value table is one multiply-add of the broadcast scales
///   ([`ctx_of`]), and its nibbles are read without widening them: the block's 16 bytes
///   broadcast to the four 128-bit lanes, lane `4a + b` shifted to byte `a` of dword `b`.
///   That puts element `4b + a` (and `16 + 4b + a` four bits up) in lane `4a + b`: each
///   chunk's lanes transposed as a 4×4 matrix. The activations are loaded transposed the
///   same way, so each accumulator lane still takes its element's products in order, and the
///   accumulators are transposed back before the fixed tree: the same bits as [`load`]'s
///   order. (`vpmovzxbd` made the loop three shuffles per block and row; this makes it two.)
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn kernel_quantized_1<const D: u8, const R: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, w) = (t.k, t.w);
    assert_eq!(k % 32, 0, "a quantized row is whole blocks");
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let nibbles_at = if D == Q4_1 { 4 } else { 2 };
    let f16 = super::f16_table();
    let to_l2 = super::prefetch_to_l2();
    let mut acc = [_mm512_setzero_ps(); R];
    // Its own inverse.
    let transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let byte_shift = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    for p in (0..k).step_by(32) {
        if prefetch {
            // As in `kernel`, this block's bytes some rows ahead: for Q8_0 four groups of
            // R rows (about as many bytes ahead as f32's one group; one group left Q8_0
            // at 24 GB/s where f32 streams 42, measured with `kernel_speed`), for the
            // 4-bit dtypes, whose blocks take longer to decode per byte, two groups (one
            // group streamed Q4_1 on one core at 1.2 ns per block, two at 1.0); into L2 on
            // Intel (see `prefetch_to_l2`).
            let ahead = if D == Q8_0 { 4 * R } else { 2 * R };
            for row in rows {
                let line = row.wrapping_add(ahead * w.row_bytes + byte_offset::<D>(p));
                super::prefetch_weights(line, to_l2);
            }
        }
        // SAFETY: p + 32 <= k inside row i.
        let xv = unsafe { [0, 16].map(|h| _mm512_loadu_ps(x.add(i * k + p + h))) };
        if D == Q8_0 {
            for (r, &row) in rows.iter().enumerate() {
                // SAFETY: the block at p lies inside the row.
                let [d, _] = unsafe { block_scales(f16, row.add(byte_offset::<D>(p)), false) };
                let d = _mm512_set1_ps(d);
                for (half, &xh) in xv.iter().enumerate() {
                    // SAFETY: the block at p lies inside the row.
                    let v = unsafe { load::<D>(row, p, half, d) };
                    acc[r] = _mm512_fmadd_ps(xh, v, acc[r]);
                }
            }
            continue;
        }
        let xv = xv.map(|v| _mm512_permutexvar_ps(transpose, v));
        for (r, &row) in rows.iter().enumerate() {
            let block = row.wrapping_add(byte_offset::<D>(p));
            // SAFETY: the block at p lies inside the row.
            let [d, m] = unsafe { block_scales(f16, block, D == Q4_1) }.map(|v| _mm512_set1_ps(v));
            let table = ctx_of::<D>(d, m);
            let qs = block.wrapping_add(nibbles_at);
            // SAFETY: the block's 16 bytes of nibbles lie inside the row.
            let bytes = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(qs.cast()) });
            // `vpermps` reads an index's low 4 bits: the nibble at the lane's shift.
            let low = _mm512_srlv_epi32(bytes, byte_shift);
            let high = _mm512_srli_epi32::<4>(low);
            acc[r] = _mm512_fmadd_ps(xv[0], _mm512_permutexvar_ps(low, table), acc[r]);
            acc[r] = _mm512_fmadd_ps(xv[1], _mm512_permutexvar_ps(high, table), acc[r]);
        }
    }
    if D != Q8_0 {
        acc = acc.map(|a| _mm512_permutexvar_ps(transpose, a));
    }
    let [sums] = joint_sums(&[acc]);
    for (r, &sum) in sums.iter().enumerate() {
        // SAFETY: (i, j + r) is inside the m × n output.
        unsafe { out.add(i * t.n + j + r).write(sum) };
    }
}

/// W rows of the batch-1 K-quant kernel ([`kernel_k_quant_1`]).
const K_ROWS: usize = 8;

/// [`kernel`] for one activation row against R rows of a K-quant (Q4_K, Q6_K; super-blocks
/// of 256 elements, rows in the file's layout): each 16-lane accumulator takes its row's
/// chunks of 16 in order with fused multiply-adds, then the fixed tree, so the bits of the
/// f32 tiles over the loader's values ([`crate::dtype::dequantize_into`]). The weights are
/// decoded in registers a super-block at a time ([`q4_k_super_block`],
/// [`q6_k_super_block`]), each activation chunk loaded once for the R rows, whose
/// multiply-adds interleave: the R accumulators are independent chains, so the FMA latency
/// hides behind them. (One row's 16 chunks in a row, one chain, ran at the FMA latency: the
/// layer matmuls of a Q4_K_M decode step took 8.2 ms against 3.5 here.)
///
/// # Safety
/// Rows j..j+R of the tile and row i of x lie inside their slices; `k` is a multiple of 256.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn kernel_k_quant_1<const D: u8, const R: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, w) = (t.k, t.w);
    assert_eq!(k % 256, 0, "a K-quant row is whole super-blocks");
    let block_bytes = w.dtype.block_bytes();
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let f16 = super::f16_table();
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..k / 256 {
        let at = b * block_bytes;
        if prefetch {
            // As in `kernel_quantized_1`: this super-block's bytes (144 or 210, three or four
            // lines) two steps of R rows ahead, into L2 on every vendor: these kernels are
            // bound by their instructions, and on Zen 4 a prefetch into L1 held the fill
            // buffers their own loads need (decode of the Q4_K_M file in
            // `docs/model-benchmarks.md`: 126-128 tok/s into L1, 138-146 into L2, three
            // interleaved pairs of `ferry bench model`; one group ahead and four measured
            // within noise of two).
            for row in rows {
                let line = row.wrapping_add(2 * R * w.row_bytes + at);
                for off in [0, 64, 128, block_bytes - 1] {
                    super::prefetch_weights(line.wrapping_add(off), true);
                }
            }
        }
        let blocks = rows.map(|row| row.wrapping_add(at));
        let xb = x.wrapping_add(256 * b);
        // SAFETY: each super-block lies inside its row, its 256 activations inside x.
        unsafe {
            if D == Q4_K {
                q4_k_super_block(f16, xb, &blocks, &mut acc);
            } else {
                q6_k_super_block(f16, xb, &blocks, &mut acc);
            }
        }
    }
    let [sums] = joint_sums(&[acc]);
    for (r, &sum) in sums.iter().enumerate() {
        // SAFETY: (i, j + r) is inside the m × n output.
        unsafe { out.add(i * t.n + j + r).write(sum) };
    }
}

/// The multiply-adds of one Q4_K super-block of each of R rows (`blocks`) against the 256
/// activations at `x`, each row's 16 chunks in order into its accumulator. Sub-block `s`'s
/// value for nibble `q` is the loader's `(d * sc_s) * q - dmin * m_s`: `d * sc_s` and
/// `dmin * m_s` are made 8 at a time (the same single roundings), and each sub-block's 16
/// values are one fused multiply-add, `q * d1 + (-m1)`, which gives the loader's bits
/// because `d1 * q` is exact in f32 (an 11-bit f16 significand times a 6-bit and a 4-bit
/// integer); the nibbles index that table (`vpermps` reads the low 4 bits). Each 32 bytes of
/// nibbles hold sub-block `2i` in their low nibbles and `2i + 1` in the high ones.
///
/// # Safety
/// Each super-block's 144 bytes and the 256 floats at `x` are readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q4_k_super_block<const R: usize>(
    f16: &[f32; 1 << 16],
    x: *const f32,
    blocks: &[*const u8; R],
    acc: &mut [__m512; R],
) {
    // Each row's d * sc (8) then -(dmin * m) (8), read back as broadcasts.
    let mut scales = [[0.0f32; 16]; R];
    for (s, &block) in scales.iter_mut().zip(blocks) {
        // SAFETY: inside the super-block, as the caller promised.
        unsafe { q4_k_scales(f16, block, s) };
    }
    let scales = std::hint::black_box(&scales);
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    for pair in 0..4 {
        // SAFETY (every read): inside the activations or the super-blocks.
        let xv: [__m512; 4] =
            std::array::from_fn(|c| unsafe { _mm512_loadu_ps(x.add(64 * pair + 16 * c)) });
        for r in 0..R {
            let s = &scales[r];
            let table = [2 * pair, 2 * pair + 1]
                .map(|q| _mm512_fmadd_ps(iota, _mm512_set1_ps(s[q]), _mm512_set1_ps(s[8 + q])));
            let qs = blocks[r].wrapping_add(16 + 32 * pair);
            // SAFETY: 16 of the super-block's nibble bytes each.
            let b =
                [0, 16].map(|h| unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.add(h).cast())) });
            let idx = [
                b[0],
                b[1],
                _mm512_srli_epi32::<4>(b[0]),
                _mm512_srli_epi32::<4>(b[1]),
            ];
            for c in 0..4 {
                let w = _mm512_permutexvar_ps(idx[c], table[c / 2]);
                acc[r] = _mm512_fmadd_ps(xv[c], w, acc[r]);
            }
        }
    }
}

/// [`kernel`] for one activation row against R rows of Q5_0 or Q5_1 (blocks of 32: f16 `d`
/// (and `m`), 32 bits of fifth bits, 16 bytes of nibbles): each 16-lane accumulator takes its
/// row's chunks of 16 in order with fused multiply-adds, the rows' chains interleaved block
/// by block. A block's 32 possible values are two registers, the loader's `d * (q - 16)`
/// (Q5_0: the same multiplication) or `d * q + m` (Q5_1: one fused multiply-add, exact
/// because `d * q` is: an 11-bit significand times a 5-bit integer), looked up with
/// `vpermt2ps`, whose index takes 5 bits: the nibble, and 16 where the element's fifth bit
/// (a mask register straight from the block's 32 bits) is set.
///
/// # Safety
/// Rows j..j+R of the tile and row i of x lie inside their slices; `k` is a multiple of 32.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn kernel_five_bit_1<const D: u8, const R: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, w) = (t.k, t.w);
    assert_eq!(k % 32, 0, "a 5-bit row is whole blocks");
    let block_bytes = w.dtype.block_bytes();
    // The fifth bits after the scales, then the nibbles.
    let qh_at = if D == Q5_1 { 4 } else { 2 };
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let xr = x.wrapping_add(i * k);
    let f16 = super::f16_table();
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    // q for the two halves of the table (Q5_0: q - 16, exact).
    let q = if D == Q5_0 {
        [_mm512_sub_ps(iota, _mm512_set1_ps(16.0)), iota]
    } else {
        [iota, _mm512_add_ps(iota, _mm512_set1_ps(16.0))]
    };
    let low4 = _mm512_set1_epi32(0x0f);
    let fifth = _mm512_set1_epi32(0x10);
    let mut acc = [_mm512_setzero_ps(); R];
    for p in (0..k).step_by(32) {
        let at = p / 32 * block_bytes;
        if prefetch {
            // As in `kernel_k_quant_1`: this block's bytes two steps of R rows ahead, into L2.
            for row in rows {
                let line = row.wrapping_add(2 * R * w.row_bytes + at);
                super::prefetch_weights(line, true);
                super::prefetch_weights(line.wrapping_add(block_bytes - 1), true);
            }
        }
        // SAFETY: p + 32 <= k inside row i.
        let xv = unsafe { [0, 16].map(|h| _mm512_loadu_ps(xr.add(p + h))) };
        for (a, &row) in acc.iter_mut().zip(&rows) {
            let block = row.wrapping_add(at);
            // SAFETY (every read): the block lies inside the row.
            let ([d, m], qh, bytes) = unsafe {
                (
                    block_scales(f16, block, D == Q5_1),
                    block.add(qh_at).cast::<u32>().read_unaligned(),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(qh_at + 4).cast())),
                )
            };
            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
            let table = q.map(|q| {
                if D == Q5_0 {
                    _mm512_mul_ps(d, q)
                } else {
                    _mm512_fmadd_ps(q, d, m)
                }
            });
            let low = _mm512_and_si512(bytes, low4);
            let high = _mm512_srli_epi32::<4>(bytes);
            // Elements 0..16 take bits 0..16 of qh, 16..32 the rest.
            let idx = [
                _mm512_mask_or_epi32(low, qh as u16, low, fifth),
                _mm512_mask_or_epi32(high, (qh >> 16) as u16, high, fifth),
            ];
            for (&xh, idx) in xv.iter().zip(idx) {
                let v = _mm512_permutex2var_ps(table[0], idx, table[1]);
                *a = _mm512_fmadd_ps(xh, v, *a);
            }
        }
    }
    let [sums] = joint_sums(&[acc]);
    for (r, &sum) in sums.iter().enumerate() {
        // SAFETY: (i, j + r) is inside the m × n output.
        unsafe { out.add(i * t.n + j + r).write(sum) };
    }
}

/// Rows `rows` of K-quant `w` (Q4_K, Q6_K) dequantized into `out` (`rows.len() × k`): the
/// loader's values, decoded as the batch-1 kernels decode them and stored, for the batched
/// steps' f32 scratch (the loader's scalar code took 162 ns per Q4_K super-block and 581 per
/// Q6_K one on a Zen 4 core; this takes a few).
///
/// # Safety
/// The rows lie inside `w`'s memory, `k` is a multiple of 256, and `out` holds the rows.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn dequantize_k_rows(w: Rows, rows: Range<usize>, k: usize, out: &mut [f32]) {
    assert!(
        k.is_multiple_of(256) && out.len() >= rows.len() * k,
        "dequantize_k_rows: shapes"
    );
    let f16 = super::f16_table();
    let block_bytes = w.dtype.block_bytes();
    for (j, o) in rows.zip(out.chunks_exact_mut(k)) {
        let row = w.ptr.wrapping_add(j * w.row_bytes);
        for b in 0..k / 256 {
            // SAFETY: the super-block lies inside the row, its 256 places inside `o`.
            unsafe {
                let (block, dst) = (row.add(b * block_bytes), o.as_mut_ptr().add(256 * b));
                match w.dtype {
                    WeightDtype::Q4_K => q4_k_values(f16, block, dst),
                    _ => q6_k_values(f16, block, dst),
                }
            }
        }
    }
}

/// One Q4_K super-block's 256 values into `dst`, made as [`q4_k_super_block`] makes them.
///
/// # Safety
/// The super-block's 144 bytes are readable and 256 floats at `dst` writable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q4_k_values(f16: &[f32; 1 << 16], block: *const u8, dst: *mut f32) {
    let mut s = [0.0f32; 16];
    // SAFETY (every access): inside the super-block or `dst`, as the caller promised.
    unsafe {
        q4_k_scales(f16, block, &mut s);
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        for pair in 0..4 {
            let table = [2 * pair, 2 * pair + 1]
                .map(|q| _mm512_fmadd_ps(iota, _mm512_set1_ps(s[q]), _mm512_set1_ps(s[8 + q])));
            let qs = block.add(16 + 32 * pair);
            let b = [0, 16].map(|h| _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.add(h).cast())));
            let idx = [
                b[0],
                b[1],
                _mm512_srli_epi32::<4>(b[0]),
                _mm512_srli_epi32::<4>(b[1]),
            ];
            for (c, &idx) in idx.iter().enumerate() {
                let v = _mm512_permutexvar_ps(idx, table[c / 2]);
                _mm512_storeu_ps(dst.add(64 * pair + 16 * c), v);
            }
        }
    }
}

/// One Q6_K super-block's 256 values into `dst`, made as [`q6_k_super_block`] makes them.
///
/// # Safety
/// The super-block's 210 bytes are readable and 256 floats at `dst` writable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q6_k_values(f16: &[f32; 1 << 16], block: *const u8, dst: *mut f32) {
    // SAFETY (every access): inside the super-block or `dst`, as the caller promised.
    unsafe {
        let [d, _] = block_scales(f16, block.add(208), false);
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(192).cast())));
        let mut dsc = [0.0f32; 16];
        _mm512_storeu_ps(dsc.as_mut_ptr(), _mm512_mul_ps(_mm512_set1_ps(d), sc));
        let mut q = [0i8; 128];
        for half in 0..2 {
            q6_k_bytes(block, half, &mut q);
            for c in 0..8 {
                let v = _mm_loadu_si128(q.as_ptr().add(16 * c).cast());
                let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
                let w = _mm512_mul_ps(_mm512_set1_ps(dsc[8 * half + c]), v);
                _mm512_storeu_ps(dst.add(128 * half + 16 * c), w);
            }
        }
    }
}

/// A Q4_K super-block's `d * sc` for its 8 sub-blocks into `out[..8]` and `-(dmin * m)`
/// into `out[8..]` (`-dmin * m`: rounding is symmetric in sign), the 6-bit scales and mins
/// unpacked as ggml does.
///
/// # Safety
/// The super-block's first 16 bytes are readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q4_k_scales(f16: &[f32; 1 << 16], block: *const u8, out: &mut [f32; 16]) {
    // SAFETY (every read): the super-block's first 16 bytes, as the caller promised.
    unsafe {
        let [d, dmin] = block_scales(f16, block, true);
        let packed = super::q4_k_scales_mins(block);
        let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
            packed.as_ptr().cast(),
        )));
        let dv = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin));
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(dv, v));
    }
}

/// [`q4_k_super_block`] for Q6_K super-blocks (128 bytes of low nibbles, 64 of 2-bit highs,
/// 16 i8 scales, f16 `d`): element `e` is the loader's `(d * sc[e / 16]) * (q - 32)`, each
/// chunk of 16 one sub-block. The 6-bit values are put together 64 at a time in bytes (each
/// half of 128 elements: its 64 bytes of `ql` give elements 0..64 by their low nibbles and
/// 64..128 by their high ones, and its 32 bytes of `qh`, in both 256-bit halves, the two
/// high bits of each), then widened chunk by chunk and multiplied by the chunk's `d * sc`
/// (made 16 at a time, the loader's rounding).
///
/// # Safety
/// Each super-block's 210 bytes and the 256 floats at `x` are readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q6_k_super_block<const R: usize>(
    f16: &[f32; 1 << 16],
    x: *const f32,
    blocks: &[*const u8; R],
    acc: &mut [__m512; R],
) {
    let mut dsc = [[0.0f32; 16]; R];
    for (out, &block) in dsc.iter_mut().zip(blocks) {
        // SAFETY (both reads): the scales and d, inside the super-block.
        unsafe {
            let [d, _] = block_scales(f16, block.add(208), false);
            let sc =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(192).cast())));
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(_mm512_set1_ps(d), sc));
        }
    }
    let dsc = std::hint::black_box(&dsc);
    let mut q = [[0i8; 128]; R];
    for half in 0..2 {
        for (q, &block) in q.iter_mut().zip(blocks) {
            // SAFETY: inside the super-block.
            unsafe { q6_k_bytes(block, half, q) };
        }
        let q = std::hint::black_box(&q);
        for c in 0..8 {
            // SAFETY (every read): inside the activations, or the rows' 128 bytes.
            let xv = unsafe { _mm512_loadu_ps(x.add(128 * half + 16 * c)) };
            for r in 0..R {
                let v = unsafe { _mm_loadu_si128(q[r].as_ptr().add(16 * c).cast()) };
                let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
                let w = _mm512_mul_ps(_mm512_set1_ps(dsc[r][8 * half + c]), v);
                acc[r] = _mm512_fmadd_ps(xv, w, acc[r]);
            }
        }
    }
}

/// The 6-bit values `q - 32` of half `half` (128 elements) of the Q6_K super-block at
/// `block`, as i8 in element order into `q`: its 64 bytes of `ql` give elements 0..64 by
/// their low nibbles and 64..128 by their high ones, its 32 bytes of `qh` (in both 256-bit
/// halves) the two high bits of each: elements 0..32 bits 0-1, 32..64 bits 2-3, 64..96 bits
/// 4-5, 96..128 bits 6-7, each moved to bits 4-5 (16-bit shifts: the mask drops what
/// crossed a byte).
///
/// # Safety
/// The super-block's 210 bytes are readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q6_k_bytes(block: *const u8, half: usize, q: &mut [i8; 128]) {
    let low4 = _mm512_set1_epi8(0x0f);
    let bits45 = _mm512_set1_epi8(0x30);
    let bias = _mm512_set1_epi8(32);
    // Bytes 32..64: the second 32 elements of each 64.
    let upper: __mmask64 = 0xffff_ffff_0000_0000;
    // SAFETY (every access): inside the super-block, as the caller promised, or `q`.
    unsafe {
        let ql = _mm512_loadu_si512(block.add(64 * half).cast());
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(128 + 32 * half).cast()));
        let high_a = _mm512_mask_blend_epi8(
            upper,
            _mm512_slli_epi16::<4>(qh),
            _mm512_slli_epi16::<2>(qh),
        );
        let high_b = _mm512_mask_blend_epi8(upper, qh, _mm512_srli_epi16::<2>(qh));
        let a = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(high_a, bits45));
        let b = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4),
            _mm512_and_si512(high_b, bits45),
        );
        _mm512_storeu_si512(q.as_mut_ptr().cast(), _mm512_sub_epi8(a, bias));
        _mm512_storeu_si512(q.as_mut_ptr().add(64).cast(), _mm512_sub_epi8(b, bias));
    }
}

/// One activation row against G groups of four 4-bit rows held in row groups
/// ([`crate::weights::row_groups`]), from row `j` (a group's first): the multiply-adds of
/// [`kernel`] in its order, so the same bits, with under seven vector instructions per block
/// and row where [`kernel_quantized_1`] takes seven and transposes.
///
/// Each row's 16-value table is one multiply-add of its scales, looked up as there; row r's
/// nibbles are the group's block's 64 nibble bytes shifted right by 8r in each lane, a
/// nibble in the low 4 bits of each lane in element order (the low nibbles, read by
/// `vpermps` as they are; the high nibbles four bits further), one load for all four rows
/// ([`group_values`]). On a 2-vCPU Xeon, batch-1 decode of the Q4_1 file went from
/// 177–195 to 199–203 tok/s (4 interleaved pairs of `ferry bench model`, the layout switched
/// within one build; the layer matmuls 3.66–3.96 → 3.38–3.46 ms per step), and from 0.97–0.98
/// to 1.02–1.09 of llama.cpp's decode (`scripts/bench-llamacpp.py`).
///
/// # Safety
/// Rows `j..j + 4 * G` are whole groups inside the tile; row `i` of x is inside x.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn kernel_groups<const D: u8, const G: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, w) = (t.k, t.w);
    let groups: [*const u8; G] =
        std::array::from_fn(|g| w.ptr.wrapping_add((j + GROUP_ROWS * g) * w.row_bytes));
    let f16 = super::f16_table();
    let to_l2 = super::prefetch_to_l2();
    let mut acc = [[_mm512_setzero_ps(); GROUP_ROWS]; G];
    for p in (0..k).step_by(32) {
        let at = GROUP_ROWS * byte_offset::<D>(p);
        if prefetch {
            // As in `kernel_quantized_1`: this block's bytes two steps of G groups ahead,
            // both lines a group's block may span.
            for group in groups {
                let line = group.wrapping_add(2 * G * GROUP_ROWS * w.row_bytes + at);
                super::prefetch_weights(line, to_l2);
                super::prefetch_weights(line.wrapping_add(64), to_l2);
            }
        }
        // SAFETY: p + 32 <= k inside row i.
        let xv = unsafe { [0, 16].map(|h| _mm512_loadu_ps(x.add(i * k + p + h))) };
        for (acc, &group) in acc.iter_mut().zip(&groups) {
            let block = group.wrapping_add(at);
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: the group's block lies inside the segment, and r < 4.
                let w = unsafe { group_values::<D>(f16, block, r) };
                *acc = _mm512_fmadd_ps(xv[0], w[0], *acc);
                *acc = _mm512_fmadd_ps(xv[1], w[1], *acc);
            }
        }
    }
    // All G groups' sums at once (eight and more share their shuffles).
    for (g, sums) in joint_sums(&acc).iter().enumerate() {
        for (r, &sum) in sums.iter().enumerate() {
            // SAFETY: (i, j + 4g + r) is inside the m × n output.
            unsafe { out.add(i * t.n + j + GROUP_ROWS * g + r).write(sum) };
        }
    }
}

/// The scales of blocks `b0..b0 + nb` (`nb` ≤ 16) of a row of quantized dtype `D` into
/// `out`, as f32 pairs [d, m] (Q4_1; the other dtypes repeat d): the group's bytes loaded a
/// register at a time (masked at the group's end, so nothing past it is read), each block's
/// f16 words picked out 128 bytes at a time by two-register word permutes, and converted
/// exactly (`vcvtph2ps`, as [`scale`] does one at a time), for the batched packing
/// ([`pack_rows`]). A gather of the blocks' first bytes was slow on Zen 5, whose gathers load
/// element by element. The batch-1 kernel looks its scales up in a table instead
/// ([`kernel_quantized_1`]): these permutes and conversions took the vector ports its
/// multiply-adds need.
///
/// # Safety
/// The blocks lie inside each row.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn group_scales<const D: u8, const R: usize>(
    rows: &[*const u8; R],
    b0: usize,
    nb: usize,
    out: &mut [[f32; 2 * GROUP]; R],
) {
    let block_bytes = byte_offset::<D>(32);
    let layout = match D {
        Q4_1 => &Q4_1_SCALES,
        Q8_0 => &Q8_0_SCALES,
        _ => &Q4_0_SCALES,
    };
    // SAFETY: 32 words.
    let index = unsafe { _mm512_loadu_si512(layout.words.as_ptr().cast()) };
    let start = b0 * block_bytes;
    let bytes = nb * block_bytes;
    // Only the windows that hold a scale: the last block's last word is in the last one.
    let n_windows = usize::from(layout.words[2 * nb - 1]) / 64 + 1;
    // The group's 64-byte registers, each with the mask of its bytes inside the group.
    let masks: [u64; 2 * MAX_WINDOWS] = std::array::from_fn(|j| {
        let n = bytes.saturating_sub(64 * j).min(64);
        if n == 64 {
            !0
        } else {
            (1u64 << n) - 1
        }
    });
    for (row, out) in rows.iter().zip(out) {
        let base = row.wrapping_add(start);
        // SAFETY: each mask covers only the group's bytes, inside the row.
        let load = |j: usize| unsafe {
            _mm512_maskz_loadu_epi8(masks[j], base.wrapping_add(64 * j).cast())
        };
        let mut v = _mm512_setzero_si512();
        for (window, &mine) in layout.windows.iter().enumerate().take(n_windows) {
            let picked = _mm512_permutex2var_epi16(load(2 * window), index, load(2 * window + 1));
            v = _mm512_mask_mov_epi16(v, mine, picked);
        }
        let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
        let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v));
        // SAFETY: `out` holds 32 floats.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr(), lo);
            _mm512_storeu_ps(out.as_mut_ptr().add(GROUP), hi);
        }
    }
}

/// Windows of 128 bytes a group of [`GROUP`] blocks spans at most (Q8_0's 34-byte blocks).
const MAX_WINDOWS: usize = (GROUP * 34).div_ceil(128);

/// Where [`group_scales`] finds a dtype's scales in a group of blocks: `words[2b]` is the
/// word of block b's d, its first; `words[2b + 1]` that of its m, the second (Q4_1), or d
/// again; `windows[w]` the result's words whose word lies in window w (words 64w..64w + 64,
/// two registers: `vpermt2w` takes an index's low 6 bits, the register of the two, then the
/// word in it).
struct ScaleLayout {
    words: [u16; 2 * GROUP],
    windows: [__mmask32; MAX_WINDOWS],
}

const fn scale_layout(block_bytes: usize, with_m: bool) -> ScaleLayout {
    let mut l = ScaleLayout {
        words: [0; 2 * GROUP],
        windows: [0; MAX_WINDOWS],
    };
    let mut q = 0;
    while q < 2 * GROUP {
        let word = (q / 2) * block_bytes / 2 + if with_m && q % 2 == 1 { 1 } else { 0 };
        l.words[q] = word as u16;
        l.windows[word / 64] |= 1 << q;
        q += 1;
    }
    l
}

const Q8_0_SCALES: ScaleLayout = scale_layout(34, false);
const Q4_0_SCALES: ScaleLayout = scale_layout(18, false);
const Q4_1_SCALES: ScaleLayout = scale_layout(20, true);

/// Where element `p` (a multiple of 32) of a row of dtype `D` starts, in bytes.
#[inline(always)]
fn byte_offset<const D: u8>(p: usize) -> usize {
    match D {
        F32 => 4 * p,
        F16 | BF16 => 2 * p,
        Q8_0 => p / 32 * 34,
        Q4_0 => p / 32 * 18,
        _ => p / 32 * 20,
    }
}

/// What a block of 32 elements of dtype `D` at element `p` of `row` needs to decode: its
/// scale broadcast (Q8_0), or the 16 values its nibbles stand for (Q4_0: `d * (q - 8)`; Q4_1:
/// `d * q + m`, made with one fused multiply-add, which gives the loader's bits because
/// `d * q` is exact in f32: an 11-bit f16 significand times a 4-bit integer); nothing for
/// f32, f16 and bf16.
///
/// # Safety
/// The block lies inside the row.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn block_ctx<const D: u8>(row: *const u8, p: usize) -> __m512 {
    let block = row.wrapping_add(byte_offset::<D>(p));
    // SAFETY (every read): the block's scales, inside the row as the caller promised.
    unsafe {
        match D {
            Q8_0 | Q4_0 => ctx_of::<D>(scale(block), _mm512_setzero_ps()),
            Q4_1 => ctx_of::<D>(scale(block), scale(block.add(2))),
            _ => _mm512_setzero_ps(),
        }
    }
}

/// [`block_ctx`] from a quantized block's scale `d` and (Q4_1) offset `m`, broadcast.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn ctx_of<const D: u8>(d: __m512, m: __m512) -> __m512 {
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    match D {
        Q4_0 => _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0))),
        Q4_1 => _mm512_fmadd_ps(iota, d, m),
        _ => d,
    }
}

/// Elements `p + 16 * half .. + 16` of the row at `row` (`p` a multiple of 32 for the
/// quantized dtypes; `ctx` from [`block_ctx`]), as the loader's f32 values: f16 converted
/// exactly (`vcvtph2ps`), bf16 shifted into the upper half, `d * q` for Q8_0 (exact), and for
/// Q4_0 / Q4_1 the block's table looked up by nibble (`vpermps` reads the low 4 bits of each
/// index, so the low nibbles need no mask). Low nibbles are elements 0..16 of a block, high
/// nibbles 16..32.
///
/// # Safety
/// The 16 elements lie inside the row.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn load<const D: u8>(row: *const u8, p: usize, half: usize, ctx: __m512) -> __m512 {
    let e = p + 16 * half;
    // SAFETY (every read): inside the row, as the caller promised; unaligned loads.
    unsafe {
        match D {
            F32 => _mm512_loadu_ps(row.add(4 * e).cast()),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * e).cast())),
            BF16 => {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.add(2 * e).cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
            }
            Q8_0 => {
                let block = row.add(p / 32 * 34);
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(2 + 16 * half).cast()));
                _mm512_mul_ps(ctx, _mm512_cvtepi32_ps(q))
            }
            Q4_0 => _mm512_permutexvar_ps(nibbles(row.add(p / 32 * 18 + 2), half), ctx),
            _ => _mm512_permutexvar_ps(nibbles(row.add(p / 32 * 20 + 4), half), ctx),
        }
    }
}

/// The f16 at `at`, converted exactly and broadcast.
///
/// # Safety
/// Two readable bytes at `at`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn scale(at: *const u8) -> __m512 {
    // SAFETY: two bytes at `at`, read unaligned.
    let bits = unsafe { at.cast::<u16>().read_unaligned() };
    _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16))
}

/// The 16 bytes at `qs` as table indices: the low nibbles (`half` 0; the high ones ride along
/// in bits `vpermps` ignores) or the high nibbles (`half` 1).
///
/// # Safety
/// Sixteen readable bytes at `qs`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn nibbles(qs: *const u8, half: usize) -> __m512i {
    // SAFETY: sixteen bytes at `qs`, read unaligned.
    let b = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(qs.cast()) });
    if half == 0 {
        b
    } else {
        _mm512_srli_epi32::<4>(b)
    }
}

/// The order of `kernel::<F32, 1, 1>` for two slices of equal length.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len().min(b.len());
    let k16 = k / 16 * 16;
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut p = 0;
    while p < k16 {
        // SAFETY: p + 16 <= k <= both lengths.
        let (av, bv) = unsafe { (_mm512_loadu_ps(ap.add(p)), _mm512_loadu_ps(bp.add(p))) };
        acc = _mm512_fmadd_ps(av, bv, acc);
        p += 16;
    }
    let mut s = hsum(acc);
    for q in k16..k {
        s = a[q].mul_add(b[q], s);
    }
    s
}

/// Every accumulator's fixed-tree sum ([`hsum`]), sixteen and then eight at a time where the
/// tile has them (the same additions, fewer shuffles than one at a time), the rest one by one.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn joint_sums<const R: usize, const C: usize>(acc: &[[__m512; R]; C]) -> [[f32; R]; C] {
    let mut sums = [[0.0f32; R]; C];
    let flat = sums.as_flattened_mut();
    let at = |q: usize| acc[q / R][q % R];
    let mut q = 0;
    while q + 16 <= R * C {
        let v: [__m512; 16] = std::array::from_fn(|u| at(q + u));
        // SAFETY: `flat` holds R * C floats, q + 16 of them.
        unsafe { _mm512_storeu_ps(flat.as_mut_ptr().add(q), hsum16(v)) };
        q += 16;
    }
    while q + 8 <= R * C {
        let v: [__m512; 8] = std::array::from_fn(|u| at(q + u));
        // SAFETY: as above, q + 8 of them.
        unsafe { _mm256_storeu_ps(flat.as_mut_ptr().add(q), hsum8(v)) };
        q += 8;
    }
    for (u, s) in flat.iter_mut().enumerate().skip(q) {
        *s = hsum(at(u));
    }
    sums
}

/// [`hsum`] of 16 vectors at once, lane `q` of the result the sum of `v[q]`: the same
/// additions of the same pairs (so the same bits), four rounds of two shuffles and one add
/// per pair of vectors instead of eight instructions per vector.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn hsum16(v: [__m512; 16]) -> __m512 {
    // The rounds leave sum q in lane 4 * (q % 4) + q / 4: feed the vectors transposed.
    let t: [__m512; 16] = std::array::from_fn(|q| v[(q % 4) * 4 + q / 4]);
    let p: [__m512; 8] = std::array::from_fn(|q| fold8(t[2 * q], t[2 * q + 1]));
    let q: [__m512; 4] = std::array::from_fn(|q| fold4(p[2 * q], p[2 * q + 1]));
    fold1(fold2(q[0], q[1]), fold2(q[2], q[3]))
}

/// [`hsum`] of 8 vectors at once, lane `q` of the result the sum of `v[q]` (see [`hsum16`]).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn hsum8(v: [__m512; 8]) -> __m256 {
    let p: [__m512; 4] = std::array::from_fn(|q| fold8(v[2 * q], v[2 * q + 1]));
    let r = fold2(fold4(p[0], p[1]), fold4(p[2], p[3]));
    // Lane 4j of fold1(r, r) holds the sum of v[j], lane 4j + 1 that of v[4 + j].
    let s = fold1(r, r);
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s))
}

/// Round 1 of [`hsum`] for two vectors: `[a[l] + a[l + 8] (l < 8), b[l] + b[l + 8]]`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn fold8(a: __m512, b: __m512) -> __m512 {
    let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
    let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
    _mm512_add_ps(lo, hi)
}

/// Round 2 for four 8-lane sums (two in `a`, two in `b`): each one's lanes (l, l + 4), one
/// 128-bit quarter per sum, in the order a's, then b's.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn fold4(a: __m512, b: __m512) -> __m512 {
    let even = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
    let odd = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
    _mm512_add_ps(even, odd)
}

/// Round 3 for eight 4-lane sums (a quarter each of `a` and `b`): in each quarter, lanes
/// (0, 2) and (1, 3) of a's, then of b's.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn fold2(a: __m512, b: __m512) -> __m512 {
    let lo = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
    let hi = _mm512_shuffle_ps::<0b11_10_11_10>(a, b);
    _mm512_add_ps(lo, hi)
}

/// Round 4 for sixteen 2-lane sums (pairs in each quarter of `a` and `b`): each pair's two
/// lanes added, in each quarter a's two pairs, then b's.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn fold1(a: __m512, b: __m512) -> __m512 {
    let first = _mm512_shuffle_ps::<0b10_00_10_00>(a, b);
    let second = _mm512_shuffle_ps::<0b11_01_11_01>(a, b);
    _mm512_add_ps(first, second)
}

/// Lanes (l, l+8), then (l, l+4), then (0, 2) and (1, 3), then the last pair: a fixed tree.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn hsum(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The joint sums give each vector's [`hsum`] bits, in order (values of mixed
    /// magnitudes, so a different pairing would round differently).
    #[test]
    fn joint_sums_are_the_single_sums() {
        if !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("avx512bw") {
            return;
        }
        let lanes: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 10f32.powi(i % 7 - 3))
            .collect();
        // SAFETY: AVX-512F was detected above; every load reads 16 of the 256 floats.
        unsafe {
            let v: [__m512; 16] =
                std::array::from_fn(|q| _mm512_loadu_ps(lanes[16 * q..].as_ptr()));
            let single: Vec<u32> = v.iter().map(|&a| hsum(a).to_bits()).collect();
            let mut joint = [0.0f32; 16];
            _mm512_storeu_ps(joint.as_mut_ptr(), hsum16(v));
            assert_eq!(joint.map(f32::to_bits).to_vec(), single);
            let mut joint8 = [0.0f32; 8];
            _mm256_storeu_ps(
                joint8.as_mut_ptr(),
                hsum8(std::array::from_fn(|q| v[q + 3])),
            );
            assert_eq!(joint8.map(f32::to_bits).to_vec(), single[3..11]);
        }
    }
}
