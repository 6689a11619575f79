//! The AVX-512 register tiles of [`super`]: one 16-lane accumulator per output element,
//! chunks of 16 in order, fused multiply-adds, a fixed horizontal sum, then the tail in order.
//!
//! 32 zmm registers hold a 6×4 tile (W rows × activation rows): 24 accumulators, 6 W
//! vectors and 1 activation vector, 10 loads per 24 FMAs. A single activation row (decode at
//! batch 1, and attention's strided dots) uses 8×1 instead, eight independent accumulators to
//! hide the FMA latency while the weights stream from memory. Every shape computes each
//! element in the same order, so the tile an element falls in never changes its bits.

use std::arch::x86_64::*;

use super::Tile;

/// W rows of the batched tile (the parent's block sizes are multiples of it).
pub(super) const ROWS: usize = 6;

/// All of `t`: `x` rows against `w` rows, written into `out` (`m × n`).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile(x: &[f32], w: &[f32], out: *mut f32, t: &Tile) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut j = t.w_rows.start;
    if t.x_rows.len() == 1 {
        while j + 8 <= t.w_rows.end {
            // SAFETY (all kernel calls): rows i..i+C of x and j..j+R of w lie inside the
            // tile, which the caller checked against the slice lengths.
            unsafe { kernel::<8, 1>(xp, wp, out, t, t.x_rows.start, j, true) };
            j += 8;
        }
    }
    while j + ROWS <= t.w_rows.end {
        let mut i = t.x_rows.start;
        while i + 4 <= t.x_rows.end {
            // Only the first pass over these W rows reads them from memory; the later passes
            // find them in L1, where a prefetch would only take a load slot.
            let first = i == t.x_rows.start;
            unsafe { kernel::<ROWS, 4>(xp, wp, out, t, i, j, first) };
            i += 4;
        }
        while i < t.x_rows.end {
            let first = i == t.x_rows.start;
            unsafe { kernel::<ROWS, 1>(xp, wp, out, t, i, j, first) };
            i += 1;
        }
        j += ROWS;
    }
    while j < t.w_rows.end {
        for i in t.x_rows.clone() {
            unsafe { kernel::<1, 1>(xp, wp, out, t, i, j, false) };
        }
        j += 1;
    }
}

/// R rows of W against C rows of x, one 16-lane accumulator per output element.
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel<const R: usize, const C: usize>(
    x: *const f32,
    w: *const f32,
    out: *mut f32,
    t: &Tile,
    i: usize,
    j: usize,
    prefetch: bool,
) {
    let (k, ws) = (t.k, t.w_stride);
    let k16 = k / 16 * 16;
    let mut acc = [[_mm512_setzero_ps(); R]; C];
    let mut p = 0;
    while p < k16 {
        if prefetch {
            // Fetch the next R rows' line at this offset: a row is only a few KiB, too short
            // for the hardware prefetcher to ramp up on before it ends. (A prefetch never
            // faults, so running past the last row is harmless.)
            for r in 0..R {
                let line = w.wrapping_add((j + R + r) * ws + p);
                _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
            }
        }
        let mut wv = [_mm512_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            // SAFETY: p + 16 <= k inside row j + r.
            *v = unsafe { _mm512_loadu_ps(w.add((j + r) * ws + p)) };
        }
        for (c, row) in acc.iter_mut().enumerate() {
            // SAFETY: p + 16 <= k inside row i + c.
            let xv = unsafe { _mm512_loadu_ps(x.add((i + c) * k + p)) };
            for (a, &v) in row.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(xv, v, *a);
            }
        }
        p += 16;
    }
    for (c, row) in acc.iter().enumerate() {
        for (r, &a) in row.iter().enumerate() {
            let mut s = hsum(a);
            for q in k16..k {
                // SAFETY: q < k inside rows i + c and j + r.
                let (xq, wq) = unsafe { (*x.add((i + c) * k + q), *w.add((j + r) * ws + q)) };
                s = xq.mul_add(wq, s);
            }
            // SAFETY: (i + c, j + r) is inside the m × n output.
            unsafe { out.add((i + c) * t.n + j + r).write(s) };
        }
    }
}

/// The order of `kernel::<1, 1>` for two slices of equal length.
#[target_feature(enable = "avx512f")]
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

/// Lanes (l, l+8), then (l, l+4), then (0, 2) and (1, 3), then the last pair: a fixed tree.
#[target_feature(enable = "avx512f")]
#[inline]
fn hsum(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}
