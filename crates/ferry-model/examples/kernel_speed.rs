//! Matmul speed per weight dtype, on `RAYON_NUM_THREADS` threads (A/B checks of the kernels):
//! `cargo run --release -p ferry-model --example kernel_speed` prints GB/s of batch-1 passes
//! over the default model's layer shapes, GFLOP/s at batch 64, and ns per 32-element block
//! for a matrix that fits in L2 (the kernel's compute cost) and for many that stream from
//! memory (its read cost).

use std::time::Instant;

use ferry_model::dtype::quantize;
use ferry_model::kernels::matmul;
use ferry_model::{ByteBuf, Matrix, Segment, WeightDtype};

fn matrix(dtype: WeightDtype, n: usize, k: usize, seed: u32) -> Matrix {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let values: Vec<f32> = (0..n * k)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) - 0.5
        })
        .collect();
    let bytes = quantize(dtype, &values);
    Matrix::new(
        k,
        vec![Segment::new(dtype, n, k, ByteBuf::from_slice(&bytes)).unwrap()],
    )
}

/// GFLOP/s of `m` activation rows against an `n × k` matrix of `dtype`, best of 5.
fn batched(dtype: WeightDtype, m: usize, n: usize, k: usize) -> f64 {
    let w = matrix(dtype, n, k, 3);
    let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.013).cos()).collect();
    let mut out = vec![0.0f32; m * n];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        matmul(&x, &w, &mut out, m);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * n * k) as f64 / best / 1e9
}

/// [`batched`] over 40 matrices of 2.2M elements each, every one used once a round (more
/// than L3 holds, so the weights stream from memory as in a decode step), best of 3 rounds.
fn batched_cold(dtype: WeightDtype, m: usize) -> f64 {
    let (n, k) = (3840, 576);
    let ws: Vec<Matrix> = (0..40).map(|s| matrix(dtype, n, k, s + 11)).collect();
    let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.013).cos()).collect();
    let mut out = vec![0.0f32; m * n];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        for w in &ws {
            matmul(&x, w, &mut out, m);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * n * k * ws.len()) as f64 / best / 1e9
}

/// GB/s of a batch-1 pass over 30 layers of the default model's matmul shapes (qkv, o,
/// gate_up, down), each its own matrix as in the model: the per-matmul costs (the pool's
/// start, each task's cold row stream) that one large matrix hides. Best of 10 passes.
fn layers_streaming(dtype: WeightDtype) -> f64 {
    let shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
    let ws: Vec<Matrix> = (0..30)
        .flat_map(|l| {
            shapes
                .iter()
                .enumerate()
                .map(move |(i, &(n, k))| matrix(dtype, n, k, (l * 4 + i) as u32 + 100))
        })
        .collect();
    let bytes: usize = ws.iter().map(Matrix::n_bytes).sum();
    let x: Vec<f32> = (0..1536).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0.0f32; 3072];
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let t = Instant::now();
        for w in &ws {
            matmul(&x[..w.k()], w, &mut out[..w.n_rows()], 1);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn main() {
    for dtype in [WeightDtype::Q8_0, WeightDtype::Q4_1] {
        println!(
            "{dtype:>5}: batch 1, model-shaped layers: {:6.2} GB/s",
            layers_streaming(dtype)
        );
    }
    for dtype in [WeightDtype::F32, WeightDtype::Q4_1] {
        for (n, k) in [(1536, 576), (576, 1536), (3072, 576)] {
            println!(
                "{dtype:>5}: batch 64, {n}x{k}: {:6.1} GFLOP/s",
                batched(dtype, 64, n, k)
            );
        }
        println!(
            "{dtype:>5}: batch 64, streaming: {:6.1} GFLOP/s",
            batched_cold(dtype, 64)
        );
    }
    let (n, k) = (1536, 576);
    let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0.0f32; n];
    for dtype in [
        WeightDtype::F32,
        WeightDtype::F16,
        WeightDtype::Q8_0,
        WeightDtype::Q4_1,
    ] {
        let blocks = (n * k / 32) as f64;
        let hot = matrix(dtype, n / 4, k, 1);
        // Best of 20 rounds of 50 products (the kernel's compute cost, without a busy
        // machine's interruptions).
        let mut best = f64::INFINITY;
        for _ in 0..20 {
            let t = Instant::now();
            for _ in 0..50 {
                matmul(&x, &hot, &mut out[..n / 4], 1);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let hot_ns = best * 1e9 / (50.0 * blocks / 4.0);
        let cold: Vec<Matrix> = (0..48).map(|s| matrix(dtype, n, k, s + 2)).collect();
        let bytes: usize = cold.iter().map(Matrix::n_bytes).sum();
        let mut s = f64::INFINITY;
        for _ in 0..6 {
            let t = Instant::now();
            for m in &cold {
                matmul(&x, m, &mut out, 1);
            }
            s = s.min(t.elapsed().as_secs_f64());
        }
        let cold_ns = s * 1e9 / (blocks * cold.len() as f64);
        println!(
            "{dtype:>5}: hot {hot_ns:6.2} ns/block  cold {cold_ns:6.2} ns/block  {:6.2} GB/s",
            bytes as f64 / s / 1e9
        );
    }
}
