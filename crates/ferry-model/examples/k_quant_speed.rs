//! Batch-1 speed of the K-quant and 5-bit kernels against Q4_1 and Q8_0, on `RAYON_NUM_THREADS`
//! threads: `cargo run --release -p ferry-model --example k_quant_speed` prints GB/s and ns
//! per 256 elements of repeated passes over a 512 × 2048 matrix of each dtype (1.1–2.2 MB,
//! in L2 on one core: the kernels' compute cost), then GFLOP/s at batch 8 (the batched steps,
//! whose K-quant and 5-bit rows are dequantized into an f32 scratch).

use std::time::Instant;

use ferry_model::dtype::quantize;
use ferry_model::kernels::matmul;
use ferry_model::{ByteBuf, Matrix, Segment, WeightDtype};

const DTYPES: [WeightDtype; 6] = [
    WeightDtype::Q4_K,
    WeightDtype::Q6_K,
    WeightDtype::Q5_0,
    WeightDtype::Q5_1,
    WeightDtype::Q4_1,
    WeightDtype::Q8_0,
];

/// Best of 7 rounds of `reps` products, in seconds per product.
fn best(w: &Matrix, x: &[f32], out: &mut [f32], m: usize, reps: usize) -> f64 {
    for _ in 0..reps {
        matmul(x, w, out, m);
    }
    let mut best = f64::INFINITY;
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..reps {
            matmul(x, w, out, m);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    best / reps as f64
}

fn main() {
    let (n, k) = (512, 2048);
    for dtype in DTYPES {
        let values: Vec<f32> = (0..n * k).map(|i| ((i as f32) * 0.7).sin()).collect();
        let bytes = quantize(dtype, &values);
        let w = Matrix::new(
            k,
            vec![Segment::new(dtype, n, k, ByteBuf::from_slice(&bytes)).unwrap()],
        );
        let x: Vec<f32> = (0..8 * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = vec![0.0f32; 8 * n];
        let t1 = best(&w, &x, &mut out, 1, 200);
        let t8 = best(&w, &x, &mut out, 8, 20);
        println!(
            "{dtype}: batch 1 {:.2} GB/s, {:.2} ns per 256 elements; batch 8 {:.1} GFLOP/s",
            w.n_bytes() as f64 / t1 / 1e9,
            t1 / (n * k / 256) as f64 * 1e9,
            2.0 * (8 * n * k) as f64 / t8 / 1e9,
        );
    }
}
