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
//! The instruction set is chosen once per process ([`Isa::current`]): AVX-512F when the CPU
//! has it (16 lanes per accumulator), else AVX2+FMA (8 lanes), else a portable path. They give
//! different bits, which is fine because a process never mixes them.

mod matmul;

pub use matmul::{matmul, matmul_with};

use std::sync::OnceLock;

/// Which implementation of the kernels this process uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// x86-64 with AVX-512F (detected at run time): 16 lanes per accumulator.
    Avx512,
    /// x86-64 with AVX2 and FMA (detected at run time, not compiled in with `target-cpu`).
    Avx2Fma,
    /// Plain Rust, mul then add; any CPU.
    Portable,
}

impl Isa {
    /// The implementation for this process, detected once.
    pub fn current() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| Isa::available()[0])
    }

    /// Every implementation this CPU can run, best first (tests compare them all).
    pub fn available() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2Fma);
            }
        }
        isas.push(Isa::Portable);
        isas
    }
}

/// Threads the kernels split work over (rayon's pool: the cores, or `RAYON_NUM_THREADS`).
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
    debug_assert_eq!(a.len(), b.len(), "dot of slices of different lengths");
    matmul::dot_with(isa, a, b)
}

/// `out[r] = dot(q, rows[r * stride..][..q.len()])`, each in [`dot`]'s order.
pub fn dot_rows(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    matmul::dot_rows_with(Isa::current(), q, rows, stride, out);
}

/// RMSNorm of each row of `x` (`rows × dim`) into `out`: `x / sqrt(mean(x²) + eps) * weight`,
/// computed as Hugging Face does in f32 (normalize, then scale by the weight).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    debug_assert_eq!(x.len(), out.len());
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        rms_norm_row(xr, weight, eps, or);
    }
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
pub fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (gu, o) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (gate, up) = gu.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

/// `x += y`, element-wise.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
