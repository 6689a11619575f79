//! The batch-1 matmul kernels' own speed per weight dtype, with the weights in cache: the
//! rate at which a decode step could consume its weights if memory cost nothing.
//!
//! Batch-1 decode reads every weight once per token, so its speed is bounded twice: by the
//! rate memory streams the bytes (the read probe) and by the rate the kernels turn them into
//! multiply-adds. For f32 and f16 the kernels outrun memory; a 4-bit block costs a table
//! build, nibble shifts and lookups per row in registers (the bits must be those of the
//! f32-dequantized model, so there is no integer dot product to fall back on), and on a
//! 2-vCPU Xeon the Q4_1 kernel consumed its bytes from L2 no faster than from memory
//! (`kernel_speed`: 1.06 against 1.02 ns per block on one thread). The probe below makes
//! that bound part of every `ferry bench model` report, next to the read bandwidth.

use std::collections::BTreeMap;
use std::time::Instant;

use ferry_model::dtype::quantize;
use ferry_model::kernels::matmul;
use ferry_model::random_model::SplitMix64;
use ferry_model::{ByteBuf, LlamaWeights, Matrix, Segment, WeightDtype};

/// Bytes of the probe's matrix: each thread's share (half of it on two threads) stays in
/// one core's L2 on every machine here (512 KiB on Zen 1, 1–2 MiB since).
const PROBE_BYTES: usize = 768 << 10;

/// Rows of the probe's matrix are a multiple of this: whole groups of four 4-bit rows, and
/// whole tasks of 24 rows.
const PROBE_ROWS: usize = 48;

/// Shortest time one timed round of products lasts.
const ROUND_S: f64 = 0.002;

/// Bytes of each dtype a decode step reads from the matrices: every layer's and the head.
pub(super) fn step_bytes_by_dtype(w: &LlamaWeights) -> BTreeMap<WeightDtype, usize> {
    let mut bytes = BTreeMap::new();
    for m in w.layer_matrices().chain(std::iter::once(w.head())) {
        for s in m.segments() {
            *bytes.entry(s.dtype()).or_default() += s.bytes().len();
        }
    }
    bytes
}

/// The probe's matrix of `dtype`: about [`PROBE_BYTES`] with rows of `k` elements (rounded
/// up to the dtype's blocks), held as the model holds its own (`Segment::new` arranges it
/// for this machine's kernels). Made once per run and timed by [`kernel_gb_s`] before and
/// after the batches.
pub(super) fn probe_matrix(dtype: WeightDtype, k: usize) -> Matrix {
    let k = k.max(1).next_multiple_of(dtype.block_elems());
    let row_bytes = dtype.row_bytes(k).expect("k is whole blocks");
    let n = (PROBE_BYTES / row_bytes / PROBE_ROWS * PROBE_ROWS).max(PROBE_ROWS);
    let mut rng = SplitMix64(0x6b65_726e);
    let values: Vec<f32> = (0..n * k).map(|_| rng.next_f32() - 0.5).collect();
    let segment = Segment::new(dtype, n, k, ByteBuf::from_slice(&quantize(dtype, &values)))
        .expect("the probe's bytes are whole rows");
    Matrix::new(k, vec![segment])
}

/// GB/s at which batch-1 products consume the weights of `w` (a [`probe_matrix`]) while
/// they sit in cache: `w` multiplied by one activation row over and over on the forward's
/// threads, each product with its start on the pool as in a decode step; best of five
/// rounds after a warm-up.
pub(super) fn kernel_gb_s(w: &Matrix) -> f64 {
    let (n, k) = (w.n_rows(), w.k());
    let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0.0f32; n];
    // The warm-up brings the matrix into cache and wakes the pool's helpers, and counts how
    // many products fill a round.
    let mut reps = 0usize;
    let t = Instant::now();
    while reps < 4 || t.elapsed().as_secs_f64() < ROUND_S {
        matmul(&x, w, &mut out, 1);
        reps += 1;
    }
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            matmul(&x, w, &mut out, 1);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    (w.n_bytes() * reps) as f64 / best / 1e9
}

/// Milliseconds the step's matrices take at the kernels' rates alone (`bytes` of each dtype
/// at `gb_s` of it): the fastest batch-1 decode these kernels allow with free memory.
pub(super) fn kernel_bound_ms(
    bytes: &BTreeMap<WeightDtype, usize>,
    gb_s: &BTreeMap<WeightDtype, f64>,
) -> f64 {
    bytes
        .iter()
        .map(|(d, &b)| b as f64 / (gb_s[d] * 1e9) * 1e3)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_model::random_model::{random_weights, small_config};
    use ferry_model::LlamaModel;

    /// The probe runs every dtype, and the step's bytes by dtype are the matrices' bytes.
    #[test]
    fn every_dtype_has_a_positive_rate_and_the_bytes_add_up() {
        for d in WeightDtype::ALL {
            let gb_s = kernel_gb_s(&probe_matrix(d, 64));
            assert!(gb_s.is_finite() && gb_s > 0.0, "{d}: {gb_s}");
        }
        let config = small_config();
        let model = LlamaModel::new(&config, &random_weights(&config, 0)).unwrap();
        let w = model.weights();
        let bytes = step_bytes_by_dtype(w);
        let matrices: usize = w
            .layers
            .iter()
            .map(|l| l.qkv.n_bytes() + l.o_proj.n_bytes() + l.gate_up.n_bytes() + l.down.n_bytes())
            .sum::<usize>()
            + w.head().n_bytes();
        assert_eq!(bytes.values().sum::<usize>(), matrices);
        assert_eq!(
            bytes.keys().copied().collect::<Vec<_>>(),
            [WeightDtype::F32]
        );
        // At 1 GB/s, a million bytes take a millisecond.
        let one = BTreeMap::from([
            (WeightDtype::Q4_1, 1_000_000),
            (WeightDtype::F32, 2_000_000),
        ]);
        let rates = BTreeMap::from([(WeightDtype::Q4_1, 1.0), (WeightDtype::F32, 4.0)]);
        assert!((kernel_bound_ms(&one, &rates) - 1.5).abs() < 1e-9);
    }
}
