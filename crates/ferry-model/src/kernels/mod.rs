//! Hand-written CPU kernels for the forward pass.
//!
//! Why not a BLAS or candle: batch invariance must be *bitwise* (RL needs a request's tokens
//! not to depend on what else is in its batch), and a gemm library picks its kernel and its
//! split of the K dimension by the number of rows M. Here every dot product over K is computed
//! in one fixed order whatever M is: one vector accumulator per output element (8 lanes, 16
//! with AVX-512), chunks of the lane width in order, fused multiply-adds, a fixed horizontal
//! sum, then the tail in order. Parallelism is only over output features (rows of W), never
//! over K.
//!
//! The instruction set is chosen once per process ([`Isa::current`]): AVX-512 (F and BW)
//! when the CPU has it (16 lanes per accumulator), else AVX2+FMA (8 lanes), else a portable
//! path. They give different bits, which is fine because a process never mixes them.

mod exp;
mod matmul;
mod peak;
pub mod pool;

pub use exp::{
    clean_logit, clean_max, exp_scaled, exp_sum, silu_mul_row, softmax_in_place,
    softmax_in_place_with,
};
pub use matmul::{matmul, matmul_f32_with, matmul_with};
pub use peak::fma_peak_gflop_s;
// Chosen in `isa.rs`, below the kernels: the weights lay out their rows for it too.
pub use crate::isa::Isa;

/// Rows at which the per-row helpers below go parallel (a decode step at batch 1 stays on
/// one thread, where handing work to the pool would cost more than it saves).
const PAR_ROWS: usize = 4;

/// Threads the kernels split work over: the cores, or `RAYON_NUM_THREADS` (the forward's
/// [`pool`] takes the same count as rayon's, which the sampler uses).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// Dot product of two equal-length slices, in the kernels' fixed order (the same order the
/// matmul uses for each output element).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(Isa::current(), a, b)
}

/// [`dot`] with an explicit implementation (tests compare them).
pub fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of slices of different lengths");
    matmul::dot_with(isa, a, b)
}

/// `out[r] = dot(q, rows[r * stride..][..q.len()])`, each in [`dot`]'s order.
pub fn dot_rows(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    matmul::dot_rows_with(Isa::current(), q, rows, stride, out);
}

/// `out[i * out_stride + j] = dot(q_i, rows[j * stride..][..k])` for each `k`-float row `q_i`
/// of `q` and `n` rows spaced `stride` floats apart, each in [`dot`]'s order: many queries
/// against the same K vectors at once (a prefill chunk's tokens), on the matmul's tiles.
#[allow(clippy::too_many_arguments)]
pub fn dot_tile(
    q: &[f32],
    k: usize,
    rows: &[f32],
    stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    matmul::dot_tile_with(Isa::current(), q, k, rows, stride, n, out, out_stride);
}

/// RMSNorm of each row of `x` (`rows × dim`) into `out`: `x / sqrt(mean(x²) + eps) * weight`,
/// computed as Hugging Face does in f32 (normalize, then scale by the weight).
/// Rows are independent, so they run in parallel with the same bits as one by one.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert_eq!(x.len(), out.len(), "rms_norm: input and output lengths");
    if x.len() < PAR_ROWS * dim {
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            rms_norm_row(xr, weight, eps, or);
        }
        return;
    }
    pool::for_each_chunk_mut(out, dim, &|i, or| {
        rms_norm_row(&x[i * dim..(i + 1) * dim], weight, eps, or);
    });
}

/// RMSNorm of one row (also used in place per head for Qwen3's q/k norm).
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(x, eps);
    for ((o, &xi), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (xi * inv);
    }
}

/// [`rms_norm_row`] in place (Qwen3's per-head q/k norm), with the same arithmetic.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let inv = rms_inv(x, eps);
    for (xi, &w) in x.iter_mut().zip(weight) {
        *xi = w * (*xi * inv);
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let mean_sq = dot(x, x) / x.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]` where each row of `gate_up` is `[gate | up]`.
/// Rows run in parallel (the `exp`s are a few percent of a batched step).
pub fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    let row = |(gu, o): (&[f32], &mut [f32])| {
        let (gate, up) = gu.split_at(inter);
        silu_mul_row(gate, up, o);
    };
    if out.len() < PAR_ROWS * inter {
        gate_up
            .chunks_exact(2 * inter)
            .zip(out.chunks_exact_mut(inter))
            .for_each(row);
        return;
    }
    pool::for_each_chunk_mut(out, inter, &|i, o| {
        row((&gate_up[i * 2 * inter..(i + 1) * 2 * inter], o));
    });
}

/// `out += w[r] * rows[r * stride..][..out.len()]` for each `r` in order, each a multiply then
/// an add (never fused), so every instruction set gives the bits of the plain loop; only the
/// vector width changes. Attention's V sums use it, one KV block of one head per call.
pub fn axpy_rows(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let d = out.len();
    if w.is_empty() {
        return;
    }
    assert!(
        stride >= d && rows.len() >= (w.len() - 1) * stride + d,
        "axpy_rows: {} rows of {d} floats at stride {stride} do not fit in {}",
        w.len(),
        rows.len()
    );
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx512 {
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        return unsafe { axpy_rows_n_avx512([w], rows, stride, [out]) };
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx2Fma {
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of AVX2.
        return unsafe { axpy_rows_avx2(w, rows, stride, out) };
    }
    axpy_rows_plain(w, rows, stride, out);
}

/// [`axpy_rows`] for `Q` outputs at once, each with its own weights over the same rows (the
/// query heads that share a KV head, over one KV block): the rows are read once for all of
/// them, and every output element takes the multiplies and adds [`axpy_rows`] gives it
/// alone, in the same order.
pub fn axpy_rows_n<const Q: usize>(
    w: [&[f32]; Q],
    rows: &[f32],
    stride: usize,
    out: [&mut [f32]; Q],
) {
    if Q == 0 {
        return;
    }
    let (n, d) = (w[0].len(), out[0].len());
    assert!(
        w.iter().all(|w| w.len() == n) && out.iter().all(|o| o.len() == d),
        "axpy_rows_n: the weight rows and the outputs must have equal lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx512 && n > 0 {
        assert!(
            stride >= d && rows.len() >= (n - 1) * stride + d,
            "axpy_rows_n: {n} rows of {d} floats at stride {stride} do not fit in {}",
            rows.len()
        );
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        return unsafe { axpy_rows_n_avx512(w, rows, stride, out) };
    }
    for (w, o) in w.into_iter().zip(out) {
        axpy_rows(w, rows, stride, o);
    }
}

/// Asks the cache for every 64-byte line of `data` ahead of use (a hint: no fault, no
/// effect on results), into L2 or L1 as the weights' prefetches go (`prefetch_to_l2` in
/// `matmul.rs`). Attention calls it on the next KV block, whose address the hardware
/// prefetcher cannot guess since the blocks of a sequence lie anywhere in the arena.
pub fn prefetch(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let to_l2 = matmul::prefetch_to_l2();
        for line in data.chunks(16) {
            matmul::prefetch_weights(line.as_ptr().cast(), to_l2);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `buf` cut into its first `Q` rows of `d` floats, as `Q` separate slices.
pub fn split_rows<const Q: usize>(mut buf: &mut [f32], d: usize) -> [&mut [f32]; Q] {
    std::array::from_fn(|_| {
        let (row, rest) = std::mem::take(&mut buf).split_at_mut(d);
        buf = rest;
        row
    })
}

/// [`axpy_rows_n`] with 512-bit vectors (and [`axpy_rows`]' own, as one output): up to 64
/// columns of the outputs (4Q registers) at a time while the rows stream past, each row's
/// vectors loaded once for all outputs, a multiply then an add per element and row in order
/// (so the plain loop's bits); the last `d % 16` columns by the plain loop, per output.
/// Compiled from the plain loop, the outputs went through the stack for every row, and
/// attention's V sums took a tenth of a batch-64 decode step on Zen 5.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn axpy_rows_n_avx512<const Q: usize>(
    w: [&[f32]; Q],
    rows: &[f32],
    stride: usize,
    mut out: [&mut [f32]; Q],
) {
    let d = out[0].len();
    let d16 = d / 16 * 16;
    let o: [*mut f32; Q] = out.each_mut().map(|o| o.as_mut_ptr());
    let mut c0 = 0;
    while c0 < d16 {
        // SAFETY (each arm): columns c0..c0 + 16N lie inside every output and every row (the
        // caller checked the rows against `d`).
        unsafe {
            match (d16 - c0) / 16 {
                1 => axpy_rows_cols::<Q, 1>(&w, rows, stride, o, c0),
                2 => axpy_rows_cols::<Q, 2>(&w, rows, stride, o, c0),
                3 => axpy_rows_cols::<Q, 3>(&w, rows, stride, o, c0),
                _ => axpy_rows_cols::<Q, 4>(&w, rows, stride, o, c0),
            }
        }
        c0 += 64.min(d16 - c0);
    }
    if d16 < d {
        for (w, o) in w.into_iter().zip(out) {
            axpy_rows_plain(w, &rows[d16..], stride, &mut o[d16..]);
        }
    }
}

/// Columns `c0..c0 + 16N` of [`axpy_rows_n_avx512`], the Q × N accumulators in registers
/// (constant Q and N, so the compiler need not index them at run time, which put them on the
/// stack).
///
/// # Safety
/// AVX-512F; the columns lie inside the outputs and inside each of the `w[0].len()` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_rows_cols<const Q: usize, const N: usize>(
    w: &[&[f32]; Q],
    rows: &[f32],
    stride: usize,
    o: [*mut f32; Q],
    c0: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); N]; Q];
    for (a, &oq) in acc.iter_mut().zip(&o) {
        for (v, a) in a.iter_mut().enumerate() {
            // SAFETY: inside output q, as the caller promised.
            *a = unsafe { _mm512_loadu_ps(oq.add(c0 + 16 * v)) };
        }
    }
    let base = rows.as_ptr();
    // `r` indexes the weight rows and the V rows together.
    #[allow(clippy::needless_range_loop)]
    for r in 0..w[0].len() {
        let wv: [__m512; Q] = std::array::from_fn(|q| _mm512_set1_ps(w[q][r]));
        // SAFETY: inside row r, as the caller promised.
        let x: [__m512; N] =
            std::array::from_fn(|v| unsafe { _mm512_loadu_ps(base.add(r * stride + c0 + 16 * v)) });
        for (a, &wq) in acc.iter_mut().zip(&wv) {
            for (a, &xv) in a.iter_mut().zip(&x) {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(wq, xv));
            }
        }
    }
    for (a, &oq) in acc.iter().zip(&o) {
        for (v, a) in a.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(oq.add(c0 + 16 * v), *a) };
        }
    }
}

/// Sixteen outputs at a time held in a local array (one vector register once compiled for
/// AVX-512) while the rows stream past, rather than a load and store of `out` per row; the
/// order each element adds the rows in is the same.
fn axpy_rows_plain(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    const LANES: usize = 16;
    let mut c0 = 0;
    while c0 < out.len() {
        let width = LANES.min(out.len() - c0);
        let mut acc = [0.0f32; LANES];
        acc[..width].copy_from_slice(&out[c0..c0 + width]);
        for (r, &wr) in w.iter().enumerate() {
            let v = &rows[r * stride + c0..r * stride + c0 + width];
            for (a, &vi) in acc.iter_mut().zip(v) {
                *a += wr * vi;
            }
        }
        out[c0..c0 + width].copy_from_slice(&acc[..width]);
        c0 += width;
    }
}

/// [`axpy_rows_plain`]'s arithmetic with 256-bit vectors: up to 64 outputs held in eight
/// registers while the rows stream past once (a multiply, then an add, per element and row in
/// order, so the same bits), the last `d % 8` outputs by the plain loop. Compiled from the
/// plain loop, the 16 outputs lived on the stack (a load, add and store per row), and
/// attention's V sums took a tenth of a 512-token prefill on Zen 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn axpy_rows_avx2(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    const WIDE: usize = 64;
    let d8 = out.len() / 8 * 8;
    let mut c0 = 0;
    while c0 < d8 {
        let width = WIDE.min(d8 - c0);
        let n_vec = width / 8;
        let o = out[c0..c0 + width].as_mut_ptr();
        let mut acc = [_mm256_setzero_ps(); WIDE / 8];
        for (v, a) in acc.iter_mut().enumerate().take(n_vec) {
            // SAFETY: 8 floats at c0 + 8v lie inside `out`.
            *a = unsafe { _mm256_loadu_ps(o.add(8 * v)) };
        }
        for (r, &wr) in w.iter().enumerate() {
            let wv = _mm256_set1_ps(wr);
            let row = rows[r * stride + c0..r * stride + c0 + width].as_ptr();
            for (v, a) in acc.iter_mut().enumerate().take(n_vec) {
                // SAFETY: 8 floats at 8v lie inside the row's `width` (checked by the slice).
                let x = unsafe { _mm256_loadu_ps(row.add(8 * v)) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, x));
            }
        }
        for (v, a) in acc.iter().enumerate().take(n_vec) {
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(o.add(8 * v), *a) };
        }
        c0 += width;
    }
    if d8 < out.len() {
        axpy_rows_plain(w, &rows[d8..], stride, &mut out[d8..]);
    }
}

/// `x += y`, element-wise.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector path of `axpy_rows` gives the plain loop's bits (odd length: a vector
    /// tail too; a stride longer than a row, as in the KV arena).
    #[test]
    fn axpy_rows_matches_the_plain_loop_bitwise() {
        let (d, stride, n) = (67, 80, 5);
        let rows: Vec<f32> = (0..(n - 1) * stride + d)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let w: Vec<f32> = (0..n).map(|i| 0.3 + i as f32 * 0.17).collect();
        let y0: Vec<f32> = (0..d).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut fast, mut plain) = (y0.clone(), y0.clone());
        axpy_rows(&w, &rows, stride, &mut fast);
        axpy_rows_plain(&w, &rows, stride, &mut plain);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&plain));
        assert_ne!(bits(&fast), bits(&y0), "axpy_rows must change out");
    }

    /// Four outputs at once give the bits of each alone, for widths below one vector, with
    /// a 64-wide tile and vectors left over, and a scalar tail.
    #[test]
    fn axpy_rows_n_gives_the_bits_of_each_output_alone() {
        for d in [7usize, 16, 64, 80, 133] {
            let n = 11;
            let stride = d + 3;
            let rows: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.37).sin()).collect();
            let ws: Vec<Vec<f32>> = (0..4)
                .map(|q| (0..n).map(|r| ((q * n + r) as f32 * 0.61).cos()).collect())
                .collect();
            let start: Vec<Vec<f32>> = (0..4)
                .map(|q| (0..d).map(|c| ((q * d + c) as f32 * 0.13).sin()).collect())
                .collect();
            let mut together = start.clone();
            let [a, b, c, e] = &mut together[..] else {
                unreachable!()
            };
            axpy_rows_n(
                [0, 1, 2, 3].map(|q| &ws[q][..]),
                &rows,
                stride,
                [&mut a[..], &mut b[..], &mut c[..], &mut e[..]],
            );
            for q in 0..4 {
                let mut alone = start[q].clone();
                axpy_rows(&ws[q], &rows, stride, &mut alone);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&together[q]), bits(&alone), "d {d}, output {q}");
                assert_ne!(bits(&alone), bits(&start[q]), "d {d}: nothing added");
            }
        }
    }
}
