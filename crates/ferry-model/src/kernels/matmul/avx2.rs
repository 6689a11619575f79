//! The AVX2+FMA register tiles of [`super`]: one 8-lane accumulator per output element,
//! chunks of 8 in order, fused multiply-adds, a fixed horizontal sum, then the tail in order.
//!
//! Register tiles: 8×1 (W rows × x rows) for a single activation row (decode at batch 1,
//! where eight independent accumulators hide the FMA latency), 3×4 otherwise (12
//! accumulators + 3 W + 1 x = all 16 registers, 7 loads per 12 FMAs; measured 15-30% faster
//! than 4×2), then leftovers. Every shape computes each element in the same order.
//!
//! Weights are dequantized in registers as in the AVX-512 path (see `load`), 8 at a time; a
//! turn of the loop is one block of 32 (four chunks). F16 needs F16C, which every AVX2 CPU has
//! and [`super::Isa`] checks for.

use std::arch::x86_64::*;

use super::{dtype_code as code, scalar_at, Tile};
use super::{BF16, F16, F32, Q4_0, Q4_1, Q8_0};

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
            _ => tile_of::<Q4_1>(x, out, t),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_of<const D: u8>(x: &[f32], out: *mut f32, t: &Tile) {
    let xp = x.as_ptr();
    let mut j = t.w_rows.start;
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
        for row in rows {
            let line = row.wrapping_add(R * w.row_bytes + byte_offset::<D>(p));
            _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
            if D == F32 {
                _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(64).cast::<i8>());
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
