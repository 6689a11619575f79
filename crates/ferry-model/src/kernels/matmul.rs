//! `out = x · Wᵀ` for row-major `x` (`m × k`) and a PyTorch-layout weight `W` (`n × k`).
//!
//! Each output element is one dot product in the fixed order described in the parent module,
//! whatever `m` is and whichever register tile computes it, so a request's activations give the
//! same bits alone or in a batch of 64. Speed comes from tiling, not from changing the order:
//! a block of W rows small enough for L2 is multiplied by every activation row before the next
//! block is read, so at batch > 1 each weight crosses the memory bus once per step.

use std::ops::Range;

use rayon::prelude::*;

use super::Isa;

#[cfg(target_arch = "x86_64")]
mod avx512;

/// Activation rows multiplied by one W block before moving on (bounds the x working set).
const X_BLOCK: usize = 64;
/// W rows kept hot while the activation rows stream past.
const W_BLOCK: usize = 24;
/// Below this many multiply-adds a step is not worth handing to other threads.
const SERIAL_FMAS: usize = 1 << 15;

/// Raw output pointer shared by the tasks of one matmul.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes only the output columns of its own W rows (disjoint ranges), and
// the parallel loop ends before the `&mut` borrow of the output does.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[i * n + j] = dot(x[i], w[j])`, on the process's instruction set.
pub fn matmul(x: &[f32], w: &[f32], out: &mut [f32], m: usize, n: usize, k: usize) {
    matmul_with(Isa::current(), x, w, out, m, n, k);
}

/// [`matmul`] with an explicit implementation.
pub fn matmul_with(isa: Isa, x: &[f32], w: &[f32], out: &mut [f32], m: usize, n: usize, k: usize) {
    assert!(
        x.len() >= m * k,
        "matmul: x has {} floats, need {m}×{k}",
        x.len()
    );
    assert!(
        w.len() >= n * k,
        "matmul: w has {} floats, need {n}×{k}",
        w.len()
    );
    assert!(
        out.len() >= m * n,
        "matmul: out has {} floats, need {m}×{n}",
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    let ptr = OutPtr(out.as_mut_ptr());
    if m * n * k <= SERIAL_FMAS {
        run_rows(isa, x, w, ptr, m, n, k, 0..n);
        return;
    }
    let rows = rows_per_task(n);
    (0..n.div_ceil(rows)).into_par_iter().for_each(|t| {
        let r = t * rows..((t + 1) * rows).min(n);
        run_rows(isa, x, w, ptr, m, n, k, r);
    });
}

/// Enough tasks for load balance (a few per thread), each a multiple of 24 rows (every
/// register tile's height divides it).
fn rows_per_task(n: usize) -> usize {
    let tasks = rayon::current_num_threads() * 4;
    n.div_ceil(tasks).next_multiple_of(24).max(24)
}

/// One dot product in the same order as one element of [`matmul_with`], without the tiling
/// (attention calls it per position, so it must be cheap).
pub(super) fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        Isa::Avx512 => unsafe { avx512::dot(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of both features.
        Isa::Avx2Fma => unsafe { avx2::dot(a, b) },
        _ => portable::dot8(a, b),
    }
}

/// `out[r] = dot(q, rows[r * stride..r * stride + q.len()])`: one query against rows spaced
/// `stride` floats apart (K vectors of consecutive slots in a KV block), each in the order of
/// [`dot_with`], several rows at once so the FMA latency is hidden.
pub(super) fn dot_rows_with(isa: Isa, q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let (n, k) = (out.len(), q.len());
    if n == 0 {
        return;
    }
    assert!(
        stride >= k,
        "dot_rows: stride {stride} is shorter than a row ({k})"
    );
    assert!(
        rows.len() >= (n - 1) * stride + k,
        "dot_rows: rows too short"
    );
    let tile = Tile {
        w_stride: stride,
        x_rows: 0..1,
        w_rows: 0..n,
        n,
        k,
    };
    run_tile(isa, q, rows, out.as_mut_ptr(), &tile);
}

/// All activation rows against W rows `w_rows`.
#[allow(clippy::too_many_arguments)]
fn run_rows(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    out: OutPtr,
    m: usize,
    n: usize,
    k: usize,
    w_rows: Range<usize>,
) {
    for x0 in (0..m).step_by(X_BLOCK) {
        let x_rows = x0..(x0 + X_BLOCK).min(m);
        for w0 in w_rows.clone().step_by(W_BLOCK) {
            let wb = w0..(w0 + W_BLOCK).min(w_rows.end);
            let tile = Tile {
                w_stride: k,
                x_rows: x_rows.clone(),
                w_rows: wb,
                n,
                k,
            };
            run_tile(isa, x, w, out.0, &tile);
        }
    }
}

/// One tile on the chosen instruction set. The callers checked that `x` and `w` cover the
/// tile's rows and that `out` covers its `m × n` output.
fn run_tile(isa: Isa, x: &[f32], w: &[f32], out: *mut f32, tile: &Tile) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        Isa::Avx512 => unsafe { avx512::tile(x, w, out, tile) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of both features.
        Isa::Avx2Fma => unsafe { avx2::tile(x, w, out, tile) },
        _ => portable::tile(x, w, out, tile),
    }
}

/// One block of the output: activation rows × W rows.
struct Tile {
    /// Floats between consecutive W rows (`k` for a matrix; more for K rows in the arena).
    w_stride: usize,
    x_rows: Range<usize>,
    w_rows: Range<usize>,
    n: usize,
    k: usize,
}

/// The portable order: 8 lanes, mul then add, the same horizontal sum as the AVX2 path.
mod portable {
    use super::Tile;

    pub(super) fn tile(x: &[f32], w: &[f32], out: *mut f32, t: &Tile) {
        for i in t.x_rows.clone() {
            let xi = &x[i * t.k..(i + 1) * t.k];
            for j in t.w_rows.clone() {
                let s = dot8(xi, &w[j * t.w_stride..j * t.w_stride + t.k]);
                // SAFETY: (i, j) is inside the m × n output checked by the caller.
                unsafe { out.add(i * t.n + j).write(s) };
            }
        }
    }

    pub(super) fn dot8(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0.0f32; 8];
        let mut ca = a.chunks_exact(8);
        let mut cb = b.chunks_exact(8);
        for (xa, xb) in (&mut ca).zip(&mut cb) {
            for l in 0..8 {
                acc[l] += xa[l] * xb[l];
            }
        }
        let s4 = [
            acc[0] + acc[4],
            acc[1] + acc[5],
            acc[2] + acc[6],
            acc[3] + acc[7],
        ];
        let mut s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
        for (&p, &q) in ca.remainder().iter().zip(cb.remainder()) {
            s += p * q;
        }
        s
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Tile;

    /// Register tiles: 8×1 (W rows × x rows) for a single activation row (decode at batch 1,
    /// where eight independent accumulators hide the FMA latency), 3×4 otherwise (12
    /// accumulators + 3 W + 1 x = all 16 registers, 7 loads per 12 FMAs; measured 15-30% faster
    /// than 4×2), then leftovers. Every shape computes each element in the same order.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile(x: &[f32], w: &[f32], out: *mut f32, t: &Tile) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut j = t.w_rows.start;
        if t.x_rows.len() == 1 {
            while j + 8 <= t.w_rows.end {
                // SAFETY (all kernel calls): rows i..i+C of x and j..j+R of w lie inside the
                // tile, which the caller checked against the slice lengths.
                unsafe { kernel::<8, 1>(xp, wp, out, t, t.x_rows.start, j) };
                j += 8;
            }
        }
        while j + 3 <= t.w_rows.end {
            let mut i = t.x_rows.start;
            while i + 4 <= t.x_rows.end {
                unsafe { kernel::<3, 4>(xp, wp, out, t, i, j) };
                i += 4;
            }
            while i < t.x_rows.end {
                unsafe { kernel::<3, 1>(xp, wp, out, t, i, j) };
                i += 1;
            }
            j += 3;
        }
        while j < t.w_rows.end {
            for i in t.x_rows.clone() {
                unsafe { kernel::<1, 1>(xp, wp, out, t, i, j) };
            }
            j += 1;
        }
    }

    /// R rows of W against C rows of x, one 8-lane accumulator per output element.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn kernel<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        out: *mut f32,
        t: &Tile,
        i: usize,
        j: usize,
    ) {
        let (k, ws) = (t.k, t.w_stride);
        let k8 = k / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        let mut p = 0;
        while p < k8 {
            if p % 16 == 0 {
                // Fetch the next R rows' line at this offset: a row is only a few KiB, too
                // short for the hardware prefetcher to ramp up on before it ends. (A prefetch
                // never faults, so running past the last row is harmless.)
                for r in 0..R {
                    let line = w.wrapping_add((j + R + r) * ws + p);
                    _mm_prefetch::<_MM_HINT_T0>(line.cast::<i8>());
                }
            }
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                // SAFETY: p + 8 <= k inside row j + r.
                *v = unsafe { _mm256_loadu_ps(w.add((j + r) * ws + p)) };
            }
            for (c, row) in acc.iter_mut().enumerate() {
                // SAFETY: p + 8 <= k inside row i + c.
                let xv = unsafe { _mm256_loadu_ps(x.add((i + c) * k + p)) };
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, v, *a);
                }
            }
            p += 8;
        }
        for (c, row) in acc.iter().enumerate() {
            for (r, &a) in row.iter().enumerate() {
                let mut s = hsum(a);
                for q in k8..k {
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
    #[target_feature(enable = "avx2,fma")]
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
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    fn naive(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|p| x[i * k + p] as f64 * w[j * k + p] as f64)
                    .sum();
            }
        }
        out
    }

    /// Every implementation this CPU can run, so the AVX-512 tiles are tested where the
    /// machine has them and the fallbacks everywhere.
    fn isas() -> Vec<Isa> {
        Isa::available()
    }

    #[test]
    fn matches_f64_reference_on_odd_shapes() {
        for isa in isas() {
            for &(m, n, k) in &[
                (1, 1, 1),
                (1, 13, 7),
                (3, 9, 17),
                (5, 37, 64),
                (67, 70, 129),
            ] {
                let x = pseudo(m * k, 1);
                let w = pseudo(n * k, 2);
                let mut out = vec![0.0; m * n];
                matmul_with(isa, &x, &w, &mut out, m, n, k);
                for (a, b) in out.iter().zip(naive(&x, &w, m, n, k)) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-4,
                        "{isa:?} {m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// On a CPU with AVX-512 the process uses it, so the model tests run the 16-lane tiles.
    #[test]
    fn current_isa_is_the_best_available() {
        let best = Isa::available()[0];
        assert_eq!(Isa::current(), best);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            assert_eq!(best, Isa::Avx512);
        }
    }

    /// The heart of batch invariance: a row's result has the same bits whatever M is and
    /// whichever register tile (8×1, 6×4, 6×1, 3×4, 3×1, 1×1) computed it.
    #[test]
    fn row_bits_do_not_depend_on_batch_size() {
        // k = 150 has a scalar tail after the vector chunks (of 8 and of 16); k = 160 has
        // none, the shape of real models.
        for k in [150, 160] {
            row_bits_do_not_depend_on_batch_size_at(k);
        }
    }

    fn row_bits_do_not_depend_on_batch_size_at(k: usize) {
        let n = 203;
        let w = pseudo(n * k, 3);
        for isa in isas() {
            let x = pseudo(70 * k, 4);
            // Each row alone (m = 1), then every row of each batch against its row alone, so
            // every slot of every register tile is checked.
            let mut alone = vec![0.0; 70 * n];
            for (xi, oi) in x.chunks_exact(k).zip(alone.chunks_exact_mut(n)) {
                matmul_with(isa, xi, &w, oi, 1, n, k);
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for m in [2, 3, 5, 64, 70] {
                let mut out = vec![0.0; m * n];
                matmul_with(isa, &x[..m * k], &w, &mut out, m, n, k);
                for i in 0..m {
                    let row = i * n..(i + 1) * n;
                    assert_eq!(
                        bits(&alone[row.clone()]),
                        bits(&out[row]),
                        "{isa:?} k={k} m={m} row {i}"
                    );
                }
            }
            // A dot on its own is the same computation too.
            assert_eq!(
                super::super::dot_with(isa, &x[..k], &w[k..2 * k]).to_bits(),
                alone[1].to_bits()
            );
        }
    }

    #[test]
    fn strided_rows_give_the_bits_of_single_dots() {
        let (k, stride, n) = (20, 27, 13);
        let q = pseudo(k, 5);
        let rows = pseudo((n - 1) * stride + k, 6);
        for isa in isas() {
            let mut out = vec![0.0; n];
            dot_rows_with(isa, &q, &rows, stride, &mut out);
            for (r, o) in out.iter().enumerate() {
                let single = dot_with(isa, &q, &rows[r * stride..r * stride + k]);
                assert_eq!(o.to_bits(), single.to_bits(), "{isa:?} row {r}");
            }
        }
    }
}
