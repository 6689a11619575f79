//! The machine's f32 fused-multiply-add peak, measured: what `ferry bench model` holds the
//! batched matmuls' GFLOP/s against. Each thread runs independent FMA chains (enough to cover
//! the FMA latency on every port) on the process's instruction set, registers only.

use std::time::Instant;

use super::Isa;

/// Independent accumulators per thread: latency 4 × 2 ports needs 8; 12 leaves slack.
const CHAINS: usize = 12;

/// f32 GFLOP/s (a fused multiply-add counts 2) of `n_threads` threads running FMA chains
/// for about `iters` turns each, best of 3.
pub fn fma_peak_gflop_s(isa: Isa, n_threads: usize, iters: usize) -> f64 {
    let lanes = match isa {
        Isa::Avx512 => 16,
        Isa::Avx2Fma => 8,
        Isa::Portable => 1,
    };
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..n_threads.max(1) {
                s.spawn(move || std::hint::black_box(chains(isa, iters)));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    let flops = 2.0 * (CHAINS * lanes * iters * n_threads.max(1)) as f64;
    flops / best / 1e9
}

/// `iters` turns of `CHAINS` FMAs; returns a value the optimizer cannot drop.
fn chains(isa: Isa, iters: usize) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        Isa::Avx512 => unsafe { x86::chains512(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of AVX2, FMA and F16C.
        Isa::Avx2Fma => unsafe { x86::chains256(iters) },
        _ => {
            let mut acc = [1.0f32; CHAINS];
            for _ in 0..iters {
                for a in &mut acc {
                    *a = a.mul_add(0.999_999, 1e-7);
                }
            }
            acc.iter().sum()
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHAINS;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chains512(iters: usize) -> f32 {
        let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, m, c);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chains256(iters: usize) -> f32 {
        let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, m, c);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a));
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_isa_reports_a_positive_peak() {
        for isa in Isa::available() {
            let g = fma_peak_gflop_s(isa, 1, 10_000);
            assert!(g.is_finite() && g > 0.0, "{isa:?}: {g}");
        }
    }
}
