//! The kernels against an f64 reference, each other, and themselves at every batch size;
//! weights of every dtype against the same weights dequantized to f32, bit for bit.

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
            matmul_f32_with(isa, &x, &w, &mut out, m, n, k);
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
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
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
            matmul_f32_with(isa, xi, &w, oi, 1, n, k);
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for m in [2, 3, 5, 64, 70] {
            let mut out = vec![0.0; m * n];
            matmul_f32_with(isa, &x[..m * k], &w, &mut out, m, n, k);
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

/// A prefill-sized batch against f32 weights (the panels, the activations in blocks that
/// stay in L2: at k = 4103 a block is 64 rows) gives each row the bits it has alone.
#[test]
fn f32_panels_in_activation_blocks_keep_each_rows_bits() {
    let (m, n, k) = (300, 29, 4103);
    let (x, w) = (pseudo(m * k, 11), pseudo(n * k, 12));
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for isa in isas() {
        let mut batch = vec![0.0; m * n];
        matmul_f32_with(isa, &x, &w, &mut batch, m, n, k);
        for (i, row) in batch.chunks_exact(n).enumerate() {
            let mut alone = vec![0.0; n];
            matmul_f32_with(isa, &x[i * k..(i + 1) * k], &w, &mut alone, 1, n, k);
            assert_eq!(bits(row), bits(&alone), "{isa:?} row {i}");
        }
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

/// `rows × k` weights in `dtype`, one segment per entry of `parts`, from pseudo-random
/// values; and the same matrix dequantized to f32 (the loader's values).
fn stored(dtype: WeightDtype, parts: &[usize], k: usize, seed: u32) -> (Matrix, Vec<f32>) {
    let parts: Vec<_> = parts.iter().map(|&rows| (dtype, rows)).collect();
    stored_mixed(&parts, k, seed)
}

/// [`stored`] with each segment in its own dtype.
fn stored_mixed(parts: &[(WeightDtype, usize)], k: usize, seed: u32) -> (Matrix, Vec<f32>) {
    use crate::dtype::quantize;
    use crate::weights::buf::ByteBuf;
    use crate::weights::matrix::Segment;
    let (mut segments, mut f32s) = (Vec::new(), Vec::new());
    for (s, &(dtype, rows)) in parts.iter().enumerate() {
        let values = pseudo(rows * k, seed + s as u32);
        let bytes = quantize(dtype, &values);
        // The loader's values, from the file's layout (whatever layout the segment holds).
        let mut loaded = vec![0.0; rows * k];
        crate::dtype::dequantize_into(dtype, &bytes, &mut loaded);
        f32s.extend(loaded);
        let segment = Segment::new(dtype, rows, k, ByteBuf::from_slice(&bytes)).unwrap();
        // The 4-bit dtypes' whole groups of rows are held as the AVX-512 kernels read them.
        let groups = crate::weights::row_groups::held_in_groups(dtype);
        assert_eq!(
            segment.grouped_rows(),
            if groups { rows / 4 * 4 } else { 0 }
        );
        segments.push(segment);
    }
    let matrix = Matrix::new(k, segments);
    assert_eq!(matrix.to_f32(), f32s, "a segment's values are the loader's");
    (matrix, f32s)
}

/// The heart of keeping weights in their stored precision: for every dtype and every
/// instruction set here, each output element has the bits of the same dot product over the
/// weights dequantized to f32, at every batch size (so every register tile is covered),
/// across segment boundaries that cut through tiles.
#[test]
fn every_dtype_gives_the_bits_of_its_f32_dequantization() {
    for dtype in WeightDtype::ALL {
        // k = 150 leaves a chunk of 16 and a scalar tail (f32/f16/bf16 only); 160 = 5 blocks;
        // 1184 = 37 blocks, two whole groups of the batch-1 kernel's scales and a part one.
        let ks: &[usize] = if dtype.block_elems() == 1 {
            &[150, 160]
        } else {
            &[96, 160, 1184]
        };
        for &k in ks {
            let (w, w32) = stored(dtype, &[37, 9, 131], k, 7);
            let n = w.n_rows();
            let x = pseudo(70 * k, 8);
            for isa in isas() {
                for m in [1, 2, 5, 64, 70] {
                    let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
                    matmul_with(isa, &x[..m * k], &w, &mut got, m);
                    matmul_f32_with(isa, &x[..m * k], &w32, &mut want, m, n, k);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{dtype} {isa:?} k={k} m={m}");
                }
            }
        }
    }
}

/// The same for the dtypes read through an f32 scratch ([`WeightDtype::BY_ROWS`]), at every
/// batch size (the AVX-512 f32 panels from 256 activation rows included), and beside a
/// register-kernel segment in one matrix.
#[test]
fn by_rows_dtypes_give_the_bits_of_their_f32_dequantization() {
    for dtype in WeightDtype::BY_ROWS {
        let ks: &[usize] = if dtype.block_elems() == 32 {
            &[96, 512]
        } else {
            &[256, 768]
        };
        for &k in ks {
            let (w, w32) = stored(dtype, &[37, 9, 31], k, 7);
            let n = w.n_rows();
            let x = pseudo(260 * k, 8);
            for isa in isas() {
                for m in [1, 2, 5, 64, 260] {
                    let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
                    matmul_with(isa, &x[..m * k], &w, &mut got, m);
                    matmul_f32_with(isa, &x[..m * k], &w32, &mut want, m, n, k);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{dtype} {isa:?} k={k} m={m}");
                }
            }
        }
    }
    let k = 256;
    let parts = [
        (WeightDtype::Q4_K, 21),
        (WeightDtype::Q4_1, 12),
        (WeightDtype::Q6_K, 7),
        (WeightDtype::Q5_0, 30),
        (WeightDtype::Q5_1, 5),
    ];
    let (w, w32) = stored_mixed(&parts, k, 40);
    let n = w.n_rows();
    let x = pseudo(66 * k, 9);
    for isa in isas() {
        for m in [1, 4, 66] {
            let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
            matmul_with(isa, &x[..m * k], &w, &mut got, m);
            matmul_f32_with(isa, &x[..m * k], &w32, &mut want, m, n, k);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "mixed {isa:?} m={m}");
        }
    }
}

/// A matrix whose segments differ in dtype (a bf16 push into part of a Q4_1 model's fused
/// matrix, say) gives each row the bits of its f32 dequantization at every batch size: the
/// batched steps send the f32 segment through the row tiles and the others through panels.
#[test]
fn mixed_dtype_segments_give_the_bits_of_their_f32_dequantization() {
    let k = 160;
    let parts = [
        (WeightDtype::Q4_1, 21),
        (WeightDtype::F32, 10),
        (WeightDtype::BF16, 7),
        (WeightDtype::Q8_0, 30),
    ];
    let (w, w32) = stored_mixed(&parts, k, 40);
    let n = w.n_rows();
    let x = pseudo(66 * k, 9);
    for isa in isas() {
        for m in [1, 4, 7, 66] {
            let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
            matmul_with(isa, &x[..m * k], &w, &mut got, m);
            matmul_f32_with(isa, &x[..m * k], &w32, &mut want, m, n, k);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{isa:?} m={m}");
        }
    }
}

/// The dequantization is not trivially right: every dtype but f32 changes the values (so the
/// test above compares kernels that really decode), and a matrix of zeros gives zeros.
#[test]
fn stored_weights_really_differ_from_their_source() {
    let k = 64;
    let source = pseudo(4 * k, 7);
    for dtype in WeightDtype::ALL {
        let (_, w32) = stored(dtype, &[4], k, 7);
        assert_eq!(w32 == source, dtype == WeightDtype::F32, "{dtype}");
    }
}

/// Elements whose value needs the scale's full f16 precision and the Q4_1 offset: a product
/// rounded before the offset is added, and f16 scales that are subnormal.
#[test]
fn extreme_scales_dequantize_exactly() {
    use crate::weights::buf::ByteBuf;
    use crate::weights::matrix::Segment;
    let k = 64;
    let mut bytes = Vec::new();
    for (d, m) in [
        (0x0001u16, 0x8001u16),
        (0x3c01, 0xbc00),
        (0x7bff, 0x0400),
        (0x1234, 0x5678),
    ] {
        bytes.extend(d.to_le_bytes());
        bytes.extend(m.to_le_bytes());
        bytes.extend((0..16u8).map(|b| b.wrapping_mul(37)));
    }
    let w = Matrix::new(
        k,
        vec![Segment::new(WeightDtype::Q4_1, 2, k, ByteBuf::from_slice(&bytes)).unwrap()],
    );
    let w32 = w.to_f32();
    let x = pseudo(3 * k, 9);
    for isa in isas() {
        // One activation row (the batch-1 kernel) and three (the batched tiles).
        for m in [1, 3] {
            let (mut got, mut want) = (vec![0.0; 2 * m], vec![0.0; 2 * m]);
            matmul_with(isa, &x[..m * k], &w, &mut got, m);
            matmul_f32_with(isa, &x[..m * k], &w32, &mut want, m, 2, k);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{isa:?} m={m}");
        }
    }
}

/// The K-quant and 5-bit kernels read every bit of a block as the loader does: rows of
/// arbitrary bytes (all six bits of Q4_K's packed scales and mins, Q6_K's negative i8
/// scales and every 6-bit value, every fifth bit), with f16 scales that are negative,
/// subnormal, large or zero, give the bits of their f32 dequantization at batch 1 (the
/// register kernels, 8 and 4 rows at a time and single rows after them) and batched (the
/// f32 scratch, filled by the same decoding on AVX-512).
#[test]
fn by_rows_blocks_of_any_bits_give_the_bits_of_their_f32_dequantization() {
    use crate::weights::buf::ByteBuf;
    use crate::weights::matrix::Segment;
    let scales: [u16; 8] = [
        0x3c00, 0xb800, 0x0001, 0x03ff, 0x7bff, 0x0000, 0x8000, 0x2e66,
    ];
    for dtype in WeightDtype::BY_ROWS {
        for (k, rows) in [(256, 13), (768, 37)] {
            let n_bytes = dtype.row_bytes(k).unwrap() * rows;
            let mut bytes: Vec<u8> = pseudo(n_bytes, 21 + k as u32)
                .iter()
                .map(|v| ((v + 0.5) * 255.99) as u8)
                .collect();
            // Finite f16 scales (random bytes would hold NaNs, whose payloads are not the point).
            for (b, block) in bytes.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                let (d, dmin) = (scales[b % 8], scales[(b / 8 + 3 * b) % 8]);
                match dtype {
                    WeightDtype::Q4_K | WeightDtype::Q5_1 => {
                        block[..2].copy_from_slice(&d.to_le_bytes());
                        block[2..4].copy_from_slice(&dmin.to_le_bytes());
                    }
                    WeightDtype::Q6_K => block[208..].copy_from_slice(&d.to_le_bytes()),
                    _ => block[..2].copy_from_slice(&d.to_le_bytes()),
                }
            }
            let segment = Segment::new(dtype, rows, k, ByteBuf::from_slice(&bytes)).unwrap();
            let w = Matrix::new(k, vec![segment]);
            let w32 = w.to_f32();
            assert!(w32.iter().all(|v| v.is_finite()), "{dtype}: finite values");
            let x = pseudo(3 * k, 22);
            for isa in isas() {
                for m in [1, 3] {
                    let (mut got, mut want) = (vec![0.0; m * rows], vec![0.0; m * rows]);
                    matmul_with(isa, &x[..m * k], &w, &mut got, m);
                    matmul_f32_with(isa, &x[..m * k], &w32, &mut want, m, rows, k);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{dtype} {isa:?} k={k} m={m}");
                }
            }
        }
    }
}
