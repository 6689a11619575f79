//! The AVX2+FMA register tiles of [`super`]: one 8-lane accumulator per output element,
//! chunks of 8 in order, fused multiply-adds, a fixed horizontal sum, then the tail in order.
//!
//! Register tiles: 8×1 (W rows × x rows) for a single activation row (decode at batch 1,
//! where eight independent accumulators hide the FMA latency), 3×4 otherwise (12
//! accumulators + 3 W + 1 x = all 16 registers, 7 loads per 12 FMAs; measured 15-30% faster
//! than 4×2), then leftovers. Every shape computes each element in the same order.
//! Quantized rows at batch 1 take [`kernel_quantized_1`], 4 rows at a time (measured on Zen 1
//! against 6 and 8: fewer registers spilled, 5.4 ns per Q4_1 block against 6.2 and 6.7).
//!
//! Q4_K and Q6_K rows at batch 1 take [`kernel_k_quant_1`], 4 rows at a time, a super-block
//! of 256 decoded in registers per row (the AVX-512 kernels' arithmetic, 8 lanes); batched,
//! the same decoding fills the f32 scratch ([`dequantize_k_rows`]).
//!
//! Weights are dequantized in registers as in the AVX-512 path (see `load`), 8 at a time; a
//! turn of the loop is one block of 32 (four chunks). F16 needs F16C, which every AVX2 CPU has
//! and [`super::Isa`] checks for. Batched steps dequantize a W block once into an f32 scratch
//! ([`dequantize_rows`]) and run the f32 tiles on it.

use std::arch::x86_64::*;

use std::ops::Range;

use super::{block_scales, dtype_code as code, scalar_at, Rows, Tile};
use super::{BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0};
use crate::dtype::WeightDtype;

/// All of `t`, in `t`'s dtype.
#[target_feature(enable = "avx2,fma,f16c")]
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
            _ => unreachable!("{} is read through an f32 scratch on AVX2", t.w.dtype),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_of<const D: u8>(x: &[f32], out: *mut f32, t: &Tile) {
    let xp = x.as_ptr();
    let mut j = t.w_rows.start;
    if matches!(D, Q4_K | Q6_K) {
        // Only batch 1 comes here (`run_part`: batched steps take an f32 scratch).
        assert_eq!(t.x_rows.len(), 1, "K-quant tiles are batch 1");
        let i = t.x_rows.start;
        while j + QROWS <= t.w_rows.end {
            // SAFETY (both calls): row i of x and rows j.. of w lie inside the tile, which
            // the caller checked against the slice lengths.
            unsafe { kernel_k_quant_1::<D, QROWS>(xp, out, t, i, j) };
            j += QROWS;
        }
        while j < t.w_rows.end {
            unsafe { kernel_k_quant_1::<D, 1>(xp, out, t, i, j) };
            j += 1;
        }
        return;
    }
    if t.x_rows.len() == 1 && matches!(D, Q8_0 | Q4_0 | Q4_1) {
        while j + QROWS <= t.w_rows.end {
            // SAFETY: as for the kernel calls below.
            unsafe { kernel_quantized_1::<D, QROWS>(xp, out, t, t.x_rows.start, j) };
            j += QROWS;
        }
    }
    if t.x_rows.len() == 1 {
        while j + 8 <= t.w_rows.end {
            // SAFETY (all kernel calls): rows i..i+C of x and j..j+R of w lie inside the
            // tile, which the caller checked against the slice lengths.
            unsafe { kernel::<D, 8, 1>(xp, out, t, t.x_rows.start, j) };
            j += 8;
        }
    }
    while j + 3 <= t.w_rows.end {
        let mut i = t.x_rows.start;
        while i + 4 <= t.x_rows.end {
            unsafe { kernel::<D, 3, 4>(xp, out, t, i, j) };
            i += 4;
        }
        while i < t.x_rows.end {
            unsafe { kernel::<D, 3, 1>(xp, out, t, i, j) };
            i += 1;
        }
        j += 3;
    }
    while j < t.w_rows.end {
        for i in t.x_rows.clone() {
            unsafe { kernel::<D, 1, 1>(xp, out, t, i, j) };
        }
        j += 1;
    }
}

/// R rows of W against C rows of x, one 8-lane accumulator per output element.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kernel<const D: u8, const R: usize, const C: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
) {
    let (k, w) = (t.k, t.w);
    let (k8, k32) = (k / 8 * 8, k / 32 * 32);
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let mut acc = [[_mm256_setzero_ps(); R]; C];
    let mut p = 0;
    while p < k32 {
        // Fetch the next R rows' bytes of this turn: a row is only a few KiB, too short for
        // the hardware prefetcher to ramp up on before it ends. (A prefetch never faults, so
        // running past the last row is harmless.)
        if t.prefetch {
            for row in rows {
                let line = row.wrapping_add(R * w.row_bytes + byte_offset::<D>(p));
                _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
                if D == F32 {
                    _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(64).cast::<i8>());
                }
            }
        }
        for quarter in 0..4 {
            // SAFETY: p + 32 <= k inside each row.
            let wv: [__m256; R] =
                std::array::from_fn(|r| unsafe { load::<D>(rows[r], p, quarter) });
            fma_chunk(&mut acc, &wv, x, k, i, p + 8 * quarter);
        }
        p += 32;
    }
    // Chunks of 8 past the last whole 32: only f32, f16 and bf16 rows.
    while p < k8 {
        // SAFETY: p + 8 <= k inside each row; `load` at quarter 0 reads elements p..p+8.
        let wv: [__m256; R] = std::array::from_fn(|r| unsafe { load::<D>(rows[r], p, 0) });
        fma_chunk(&mut acc, &wv, x, k, i, p);
        p += 8;
    }
    for (c, row) in acc.iter().enumerate() {
        for (r, &a) in row.iter().enumerate() {
            let mut s = hsum(a);
            for q in k8..k {
                // SAFETY: q < k inside rows i + c and j + r.
                let (xq, wq) = unsafe { (*x.add((i + c) * k + q), scalar_at(w.dtype, rows[r], q)) };
                s = xq.mul_add(wq, s);
            }
            // SAFETY: (i + c, j + r) is inside the m × n output.
            unsafe { out.add((i + c) * t.n + j + r).write(s) };
        }
    }
}

/// W rows of the batch-1 kernel for quantized rows: four accumulators' chains of dependent
/// multiply-adds are enough to hide their latency behind the decoding, and the four
/// activation chunks of a block stay in registers beside them.
const QROWS: usize = 4;
/// [`kernel`] for one activation row against R rows of a quantized dtype: the same
/// multiply-adds in the same order, with less work per block. The blocks' f16 scales are
/// looked up by their bits in [`super::f16_table`] and broadcast from it (loads only; the
/// grouped conversion this replaced stored the halves one by one and read them back as one
/// vector, which cannot forward from the stores: on one Intel core, L2-hot, best of 4
/// interleaved runs, a block row went from 2.13 to 1.92 ns for Q4_1, 2.14 to 1.73 for Q8_0,
/// 2.25 to 2.02 for Q4_0); a block's 16 bytes are widened twice (low and high nibbles come from
/// the same 8 bytes); and a Q4_1 value is one fused multiply-add, `q * d + m`, which gives
/// the loader's `d * q + m` because `d * q` is exact in f32 (an 11-bit f16 significand
/// times a 4-bit integer).
///
/// # Safety
/// As for [`kernel`]: rows j..j+R of the tile and row i of x.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kernel_quantized_1<const D: u8, const R: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
) {
    let (k, w) = (t.k, t.w);
    assert_eq!(k % 32, 0, "a quantized row is whole blocks");
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let xr = x.wrapping_add(i * k);
    let f16 = super::f16_table();
    let mut acc = [_mm256_setzero_ps(); R];
    for p in (0..k).step_by(32) {
        if t.prefetch {
            // As in `kernel`: the next R rows' bytes of this block.
            for row in rows {
                let line = row.wrapping_add(R * w.row_bytes + byte_offset::<D>(p));
                _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
            }
        }
        // SAFETY: p + 32 <= k inside row i.
        let xv: [__m256; 4] =
            std::array::from_fn(|q| unsafe { _mm256_loadu_ps(xr.add(p + 8 * q)) });
        for (r, &row) in rows.iter().enumerate() {
            let block = row.wrapping_add(byte_offset::<D>(p));
            // SAFETY (both): the block at p lies inside the row.
            let [d, m] = unsafe { block_scales(f16, block, D == Q4_1) }.map(|v| _mm256_set1_ps(v));
            let wv = unsafe { decode_block::<D>(block, d, m) };
            for (&xq, &wq) in xv.iter().zip(&wv) {
                acc[r] = _mm256_fmadd_ps(xq, wq, acc[r]);
            }
        }
    }
    for (r, &a) in acc.iter().enumerate() {
        // SAFETY: (i, j + r) is inside the m × n output.
        unsafe { out.add(i * t.n + j + r).write(hsum(a)) };
    }
}

/// [`kernel`] for one activation row against R rows of a K-quant (Q4_K, Q6_K): each 8-lane
/// accumulator takes its row's chunks of 8 in order with fused multiply-adds, so the bits of
/// the f32 tiles over the loader's values. The weights are decoded in registers a
/// super-block at a time ([`q4_k_super_block`], [`q6_k_super_block`]; the arithmetic is the
/// AVX-512 kernels', see there), each activation chunk loaded once for the R rows, whose
/// independent chains of multiply-adds interleave.
///
/// # Safety
/// Rows j..j+R of the tile and row i of x lie inside their slices; `k` is a multiple of 256.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kernel_k_quant_1<const D: u8, const R: usize>(
    x: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
) {
    let (k, w) = (t.k, t.w);
    assert_eq!(k % 256, 0, "a K-quant row is whole super-blocks");
    let block_bytes = w.dtype.block_bytes();
    let rows: [*const u8; R] = std::array::from_fn(|r| w.ptr.wrapping_add((j + r) * w.row_bytes));
    let xr = x.wrapping_add(i * k);
    let f16 = super::f16_table();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..k / 256 {
        let at = b * block_bytes;
        if t.prefetch {
            // As in `kernel`: the next R rows' bytes of this super-block.
            for row in rows {
                let line = row.wrapping_add(R * w.row_bytes + at);
                for off in [0, 64, 128, block_bytes - 1] {
                    _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(off).cast::<i8>());
                }
            }
        }
        let blocks = rows.map(|row| row.wrapping_add(at));
        let xb = xr.wrapping_add(256 * b);
        // SAFETY: each super-block lies inside its row, its 256 activations inside row i.
        unsafe {
            if D == Q4_K {
                q4_k_super_block(f16, xb, &blocks, &mut acc);
            } else {
                q6_k_super_block(f16, xb, &blocks, &mut acc);
            }
        }
    }
    for (r, &a) in acc.iter().enumerate() {
        // SAFETY: (i, j + r) is inside the m × n output.
        unsafe { out.add(i * t.n + j + r).write(hsum(a)) };
    }
}

/// The multiply-adds of one Q4_K super-block of each of R rows against the 256 activations
/// at `x`, each row's 32 chunks of 8 in order: each value `q * d1 + (-m1)` fused, the
/// loader's `(d * sc) * q - dmin * m` (`d1 * q` is exact in f32).
///
/// # Safety
/// Each super-block's 144 bytes and the 256 floats at `x` are readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_k_super_block<const R: usize>(
    f16: &[f32; 1 << 16],
    x: *const f32,
    blocks: &[*const u8; R],
    acc: &mut [__m256; R],
) {
    // Each row's d * sc (8) then -(dmin * m) (8), read back as broadcasts.
    let mut scales = [[0.0f32; 16]; R];
    for (out, &block) in scales.iter_mut().zip(blocks) {
        // SAFETY: the super-block's first 16 bytes.
        unsafe { q4_k_scales(f16, block, out) };
    }
    let scales = std::hint::black_box(&scales);
    let low = _mm256_set1_epi32(0x0f);
    for sub in 0..8 {
        // Sub-block `sub`: the low (even) or high (odd) nibbles of the pair's 32 bytes.
        // SAFETY (every read): inside the activations or the super-blocks.
        let xv: [__m256; 4] =
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(x.add(32 * sub + 8 * c)) });
        for r in 0..R {
            let (d1, m1) = (
                _mm256_set1_ps(scales[r][sub]),
                _mm256_set1_ps(scales[r][8 + sub]),
            );
            let qs = blocks[r].wrapping_add(16 + 32 * (sub / 2));
            for (c, &xc) in xv.iter().enumerate() {
                let b = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8 * c).cast())) };
                let q = if sub % 2 == 0 {
                    _mm256_and_si256(b, low)
                } else {
                    _mm256_srli_epi32::<4>(b)
                };
                let w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d1, m1);
                acc[r] = _mm256_fmadd_ps(xc, w, acc[r]);
            }
        }
    }
}

/// [`q4_k_super_block`] for Q6_K super-blocks: element `e` is the loader's
/// `(d * sc[e / 16]) * (q - 32)`, the 6-bit values put together 32 at a time in bytes (see
/// the AVX-512 `q6_k_super_block`), then widened 8 at a time.
///
/// # Safety
/// Each super-block's 210 bytes and the 256 floats at `x` are readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k_super_block<const R: usize>(
    f16: &[f32; 1 << 16],
    x: *const f32,
    blocks: &[*const u8; R],
    acc: &mut [__m256; R],
) {
    let mut dsc = [[0.0f32; 16]; R];
    for (out, &block) in dsc.iter_mut().zip(blocks) {
        // SAFETY: inside the super-block.
        unsafe { q6_k_scales(f16, block, out) };
    }
    let dsc = std::hint::black_box(&dsc);
    let mut q = [[0i8; 128]; R];
    for half in 0..2 {
        for (q, &block) in q.iter_mut().zip(blocks) {
            // SAFETY: inside the super-block.
            unsafe { q6_k_bytes(block, half, q) };
        }
        let q = std::hint::black_box(&q);
        for c in 0..16 {
            // SAFETY (every read): inside the activations, or the rows' 128 bytes.
            let xv = unsafe { _mm256_loadu_ps(x.add(128 * half + 8 * c)) };
            for r in 0..R {
                let v = unsafe { _mm_loadl_epi64(q[r].as_ptr().add(8 * c).cast()) };
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                let w = _mm256_mul_ps(_mm256_set1_ps(dsc[r][8 * half + c / 2]), v);
                acc[r] = _mm256_fmadd_ps(xv, w, acc[r]);
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
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_k_scales(f16: &[f32; 1 << 16], block: *const u8, out: &mut [f32; 16]) {
    // SAFETY (every read): the super-block's first 16 bytes, as the caller promised.
    unsafe {
        let [d, dmin] = block_scales(f16, block, true);
        let packed = super::q4_k_scales_mins(block);
        let bytes = _mm_loadu_si128(packed.as_ptr().cast());
        let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(bytes)));
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(d), sc));
        let neg_m1 = _mm256_mul_ps(_mm256_set1_ps(-dmin), m);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), neg_m1);
    }
}

/// A Q6_K super-block's `d * sc` for its 16 sub-blocks into `out`.
///
/// # Safety
/// The super-block's 210 bytes are readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k_scales(f16: &[f32; 1 << 16], block: *const u8, out: &mut [f32; 16]) {
    // SAFETY (every read): the scales and d, inside the super-block.
    unsafe {
        let [d, _] = block_scales(f16, block.add(208), false);
        for h in 0..2 {
            let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(192 + 8 * h).cast()));
            let v = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sc));
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * h), v);
        }
    }
}

/// The 6-bit values `q - 32` of half `half` (128 elements) of the Q6_K super-block at
/// `block`, as i8 in element order into `q`: elements 32g..32g + 32 take nibble g / 2 of the
/// half's `ql[32 (g % 2)..]` and bits 2g, 2g + 1 of its `qh`, moved to bits 4-5 (16-bit
/// shifts: the mask drops what crossed a byte).
///
/// # Safety
/// The super-block's 210 bytes are readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k_bytes(block: *const u8, half: usize, q: &mut [i8; 128]) {
    let low4 = _mm256_set1_epi8(0x0f);
    let bits45 = _mm256_set1_epi8(0x30);
    let bias = _mm256_set1_epi8(32);
    // SAFETY (every access): inside the super-block, as the caller promised, or `q`.
    unsafe {
        let ql = [0, 32].map(|o| _mm256_loadu_si256(block.add(64 * half + o).cast()));
        let qh = _mm256_loadu_si256(block.add(128 + 32 * half).cast());
        let highs = [
            _mm256_slli_epi16::<4>(qh),
            _mm256_slli_epi16::<2>(qh),
            qh,
            _mm256_srli_epi16::<2>(qh),
        ];
        for (g, &high) in highs.iter().enumerate() {
            let nibble = if g < 2 {
                ql[g]
            } else {
                _mm256_srli_epi16::<4>(ql[g - 2])
            };
            let v = _mm256_or_si256(
                _mm256_and_si256(nibble, low4),
                _mm256_and_si256(high, bits45),
            );
            _mm256_storeu_si256(q.as_mut_ptr().add(32 * g).cast(), _mm256_sub_epi8(v, bias));
        }
    }
}

/// Rows `rows` of K-quant `w` (Q4_K, Q6_K) dequantized into `out` (`rows.len() × k`): the
/// loader's values, decoded as the batch-1 kernels decode them and stored, for the batched
/// steps' f32 scratch.
///
/// # Safety
/// The rows lie inside `w`'s memory, `k` is a multiple of 256, and `out` holds the rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_k_rows(w: Rows, rows: Range<usize>, k: usize, out: &mut [f32]) {
    assert!(
        k.is_multiple_of(256) && out.len() >= rows.len() * k,
        "dequantize_k_rows: shapes"
    );
    let f16 = super::f16_table();
    let block_bytes = w.dtype.block_bytes();
    let low = _mm256_set1_epi32(0x0f);
    let mut s = [0.0f32; 16];
    let mut q = [0i8; 128];
    for (j, o) in rows.zip(out.chunks_exact_mut(k)) {
        let row = w.ptr.wrapping_add(j * w.row_bytes);
        for b in 0..k / 256 {
            // SAFETY: the super-block lies inside the row, its 256 places inside `o`.
            unsafe {
                let (block, dst) = (row.add(b * block_bytes), o.as_mut_ptr().add(256 * b));
                if w.dtype == WeightDtype::Q4_K {
                    q4_k_scales(f16, block, &mut s);
                    for sub in 0..8 {
                        let (d1, m1) = (_mm256_set1_ps(s[sub]), _mm256_set1_ps(s[8 + sub]));
                        let qs = block.add(16 + 32 * (sub / 2));
                        for c in 0..4 {
                            let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8 * c).cast()));
                            let q = if sub % 2 == 0 {
                                _mm256_and_si256(b, low)
                            } else {
                                _mm256_srli_epi32::<4>(b)
                            };
                            let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d1, m1);
                            _mm256_storeu_ps(dst.add(32 * sub + 8 * c), v);
                        }
                    }
                } else {
                    q6_k_scales(f16, block, &mut s);
                    for half in 0..2 {
                        q6_k_bytes(block, half, &mut q);
                        for c in 0..16 {
                            let v = _mm_loadl_epi64(q.as_ptr().add(8 * c).cast());
                            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                            let v = _mm256_mul_ps(_mm256_set1_ps(s[8 * half + c / 2]), v);
                            _mm256_storeu_ps(dst.add(128 * half + 8 * c), v);
                        }
                    }
                }
            }
        }
    }
}

/// The 32 values of the quantized block at `block`, in chunks of 8 in element order, as the
/// loader's f32 values: `d * q` (Q8_0), `d * (q - 8)` (Q4_0), `q * d + m` fused (Q4_1, see
/// [`kernel_quantized_1`]).
///
/// # Safety
/// The whole block is readable at `block`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode_block<const D: u8>(block: *const u8, d: __m256, m: __m256) -> [__m256; 4] {
    // SAFETY (every read): inside the block, as the caller promised; unaligned loads.
    unsafe {
        if D == Q8_0 {
            return std::array::from_fn(|q| {
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(2 + 8 * q).cast()));
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(v))
            });
        }
        let qs = block.add(if D == Q4_0 { 2 } else { 4 });
        // Bytes 0..8 and 8..16, widened once: their low nibbles are elements 0..16, their
        // high nibbles 16..32.
        let b = [0, 8].map(|h| _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(h).cast())));
        let low = _mm256_set1_epi32(0x0f);
        let q = [
            _mm256_and_si256(b[0], low),
            _mm256_and_si256(b[1], low),
            _mm256_srli_epi32::<4>(b[0]),
            _mm256_srli_epi32::<4>(b[1]),
        ];
        q.map(|q| {
            if D == Q4_0 {
                let q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(q))
            } else {
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m)
            }
        })
    }
}

/// `acc[c][r] += x[i + c][p..p + 8] * wv[r]`, fused.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fma_chunk<const R: usize, const C: usize>(
    acc: &mut [[__m256; R]; C],
    wv: &[__m256; R],
    x: *const f32,
    k: usize,
    i: usize,
    p: usize,
) {
    for (c, row) in acc.iter_mut().enumerate() {
        // SAFETY: the kernel's callers keep p + 8 <= k inside row i + c.
        let xv = unsafe { _mm256_loadu_ps(x.add((i + c) * k + p)) };
        for (a, &v) in row.iter_mut().zip(wv) {
            *a = _mm256_fmadd_ps(xv, v, *a);
        }
    }
}

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

/// Elements `p + 8 * quarter .. + 8` of the row at `row` (`p` a multiple of 32 for the
/// quantized dtypes), as the loader's f32 values; see the AVX-512 `load` for the arithmetic.
/// In a 4-bit block, quarters 0 and 1 are the low nibbles of bytes 0..8 and 8..16, quarters 2
/// and 3 their high nibbles.
///
/// # Safety
/// The 8 elements lie inside the row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load<const D: u8>(row: *const u8, p: usize, quarter: usize) -> __m256 {
    let e = p + 8 * quarter;
    // SAFETY (every read): inside the row, as the caller promised; unaligned loads.
    unsafe {
        match D {
            F32 => _mm256_loadu_ps(row.add(4 * e).cast()),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * e).cast())),
            BF16 => {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(2 * e).cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
            }
            Q8_0 => {
                let block = row.add(p / 32 * 34);
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(2 + 8 * quarter).cast()));
                _mm256_mul_ps(scale(block), _mm256_cvtepi32_ps(q))
            }
            Q4_0 => {
                let block = row.add(p / 32 * 18);
                let q = nibbles(block.add(2), quarter);
                let q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                _mm256_mul_ps(scale(block), _mm256_cvtepi32_ps(q))
            }
            _ => {
                let block = row.add(p / 32 * 20);
                let q = _mm256_cvtepi32_ps(nibbles(block.add(4), quarter));
                _mm256_add_ps(_mm256_mul_ps(scale(block), q), scale(block.add(2)))
            }
        }
    }
}

/// The f16 at `at`, converted exactly and broadcast.
///
/// # Safety
/// Two readable bytes at `at`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scale(at: *const u8) -> __m256 {
    // SAFETY: two bytes at `at`, read unaligned.
    let bits = unsafe { at.cast::<u16>().read_unaligned() };
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

/// Quarter `quarter` of a 4-bit block's 32 values from its 16 bytes at `qs`, as 8 integers.
///
/// # Safety
/// Sixteen readable bytes at `qs`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles(qs: *const u8, quarter: usize) -> __m256i {
    // SAFETY: bytes 0..8 or 8..16 of the sixteen at `qs`, read unaligned.
    let b = unsafe { _mm_loadl_epi64(qs.add(8 * (quarter & 1)).cast()) };
    let b = _mm256_cvtepu8_epi32(b);
    if quarter < 2 {
        _mm256_and_si256(b, _mm256_set1_epi32(0x0f))
    } else {
        _mm256_srli_epi32::<4>(b)
    }
}

/// Rows `rows` of `w` dequantized into `out` (`rows.len() × k`): the f32 values the
/// kernels decode (the loader's), 8 at a time, and the loader's scalar values for a tail.
///
/// # Safety
/// The rows lie inside `w`'s memory and `out` holds `rows.len() × k` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_rows(w: Rows, rows: Range<usize>, k: usize, out: &mut [f32]) {
    // SAFETY (all arms): as for this function.
    unsafe {
        match code(w.dtype) {
            F32 => dequantize_rows_of::<F32>(w, rows, k, out),
            F16 => dequantize_rows_of::<F16>(w, rows, k, out),
            BF16 => dequantize_rows_of::<BF16>(w, rows, k, out),
            Q8_0 => dequantize_rows_of::<Q8_0>(w, rows, k, out),
            Q4_0 => dequantize_rows_of::<Q4_0>(w, rows, k, out),
            Q4_1 => dequantize_rows_of::<Q4_1>(w, rows, k, out),
            _ => unreachable!("{} is dequantized by the loader's code", w.dtype),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_rows_of<const D: u8>(w: Rows, rows: Range<usize>, k: usize, out: &mut [f32]) {
    let quantized = matches!(D, Q8_0 | Q4_0 | Q4_1);
    let k8 = if quantized { k / 32 * 32 } else { k / 8 * 8 };
    for (j, o) in rows.zip(out.chunks_exact_mut(k)) {
        let row = w.ptr.wrapping_add(j * w.row_bytes);
        let dst = o.as_mut_ptr();
        let mut p = 0;
        while p < k8 {
            // SAFETY: p + 32 (quantized) or p + 8 <= k inside the row and inside `o`.
            unsafe {
                if quantized {
                    let block = row.add(byte_offset::<D>(p));
                    let m = if D == Q4_1 {
                        scale(block.add(2))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for (q, v) in decode_block::<D>(block, scale(block), m)
                        .into_iter()
                        .enumerate()
                    {
                        _mm256_storeu_ps(dst.add(p + 8 * q), v);
                    }
                    p += 32;
                } else {
                    _mm256_storeu_ps(dst.add(p), load::<D>(row, p, 0));
                    p += 8;
                }
            }
        }
        for (q, v) in o.iter_mut().enumerate().skip(k8) {
            // SAFETY: q < k inside the row.
            *v = unsafe { scalar_at(w.dtype, row, q) };
        }
    }
}

/// The order of `kernel::<F32, 1, 1>` for two slices of equal length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len().min(b.len());
    let k8 = k / 8 * 8;
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm256_setzero_ps();
    let mut p = 0;
    while p < k8 {
        // SAFETY: p + 8 <= k <= both lengths.
        let (av, bv) = unsafe { (_mm256_loadu_ps(ap.add(p)), _mm256_loadu_ps(bp.add(p))) };
        acc = _mm256_fmadd_ps(av, bv, acc);
        p += 8;
    }
    let mut s = hsum(acc);
    for q in k8..k {
        s = a[q].mul_add(b[q], s);
    }
    s
}

/// Lanes (l, l+4), then (0, 2) and (1, 3), then the last pair: a fixed tree.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}
