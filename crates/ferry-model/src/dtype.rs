//! [`WeightDtype`]: the precisions a weight matrix is kept in, as stored in its file (or as a
//! weight update pushed it), and their exact scalar dequantization.
//!
//! The scalar dequantization here *is* the loader's ([`crate::ggml::dequantize_into`]),
//! so "the f32 value of a stored weight" has one definition: the matmul kernels that
//! dequantize in registers are tested bit for bit against it, which is what keeps a model
//! kept in its stored precision bit-identical to the same model dequantized to f32 at load.
//! The same goes for a safetensors tensor's F32, F16 and BF16 bytes (`decode_into`), which
//! the folder loader and the weight updates both convert.

use safetensors::Dtype;

use crate::ggml::{self, GgmlType, QK, QK_K};

/// How one weight matrix is held in memory: its rows are runs of these, row after row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightDtype {
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16 (the upper half of an f32).
    BF16,
    /// GGML blocks of 32: an f16 scale `d`, then 32 signed bytes; `w = d * q`.
    Q8_0,
    /// GGML blocks of 32: an f16 scale `d`, then 16 bytes of nibbles; `w = d * (q - 8)`.
    Q4_0,
    /// GGML blocks of 32: f16 `d` and `m`, then 16 bytes of nibbles; `w = d * q + m`.
    Q4_1,
    /// GGML blocks of 32: f16 `d`, 4 bytes of fifth bits, 16 bytes of nibbles;
    /// `w = d * (q - 16)`.
    Q5_0,
    /// GGML blocks of 32: f16 `d` and `m`, 4 bytes of fifth bits, 16 bytes of nibbles;
    /// `w = d * q + m`.
    Q5_1,
    /// GGML super-blocks of 256 (144 bytes): f16 `d` and `dmin`, eight 6-bit scales and mins,
    /// nibbles; `w = (d * sc) * q - dmin * m` per sub-block of 32.
    #[allow(non_camel_case_types)]
    Q4_K,
    /// GGML super-blocks of 256 (210 bytes): 6-bit values, sixteen i8 scales, f16 `d`;
    /// `w = (d * sc) * (q - 32)` per sub-block of 16.
    #[allow(non_camel_case_types)]
    Q6_K,
}

impl WeightDtype {
    /// Every dtype the matmul kernels read in registers (rows any multiple of 32 long), for
    /// tests and benches that cover them all; [`WeightDtype::BY_ROWS`] are the others.
    pub const ALL: [WeightDtype; 6] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
    ];

    /// The dtypes the matmul's batched steps dequantize a block of rows at a time into an f32
    /// scratch (exactly [`dequantize_into`]'s values) and multiply from there with the f32
    /// kernels: the same bits as f32 weights, in the stored bytes. At batch 1 Q4_K and Q6_K
    /// (and on AVX-512 Q5_0 and Q5_1) are decoded in registers instead (the same bits
    /// again). Q4_K and Q6_K rows are multiples of 256 long.
    pub const BY_ROWS: [WeightDtype; 4] = [Self::Q5_0, Self::Q5_1, Self::Q4_K, Self::Q6_K];

    /// Whether the matmul's batched steps read this dtype through an f32 scratch
    /// ([`WeightDtype::BY_ROWS`]).
    pub fn by_rows(self) -> bool {
        Self::BY_ROWS.contains(&self)
    }

    /// The GGML type with this layout.
    pub fn ggml(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::BF16 => GgmlType::BF16,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q5_0 => GgmlType::Q5_0,
            Self::Q5_1 => GgmlType::Q5_1,
            Self::Q4_K => GgmlType::Q4_K,
            Self::Q6_K => GgmlType::Q6_K,
        }
    }

    /// The dtype a GGML type is kept in; `None` for types ferry cannot compute with.
    pub fn from_ggml(t: GgmlType) -> Option<Self> {
        Some(match t {
            GgmlType::F32 => Self::F32,
            GgmlType::F16 => Self::F16,
            GgmlType::BF16 => Self::BF16,
            GgmlType::Q8_0 => Self::Q8_0,
            GgmlType::Q4_0 => Self::Q4_0,
            GgmlType::Q4_1 => Self::Q4_1,
            GgmlType::Q5_0 => Self::Q5_0,
            GgmlType::Q5_1 => Self::Q5_1,
            GgmlType::Q4_K => Self::Q4_K,
            GgmlType::Q6_K => Self::Q6_K,
            GgmlType::Other(_) => return None,
        })
    }

    /// The dtype of a safetensors tensor (F32, F16, BF16); `None` for the others.
    pub fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::F32 => Some(Self::F32),
            safetensors::Dtype::F16 => Some(Self::F16),
            safetensors::Dtype::BF16 => Some(Self::BF16),
            _ => None,
        }
    }

    /// Elements per block: 256 for the K-quants, 32 for the other GGML quantizations, 1
    /// otherwise. A row's length must be a multiple of it.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 => QK,
            Self::Q4_K | Self::Q6_K => QK_K,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => 2 + QK,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q4_1 => 4 + QK / 2,
            Self::Q5_0 => 6 + QK / 2,
            Self::Q5_1 => 8 + QK / 2,
            Self::Q4_K => 4 + 12 + QK_K / 2,
            Self::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes of a row of `k` elements, or `None` when `k` is not a whole number of blocks.
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        k.is_multiple_of(self.block_elems())
            .then(|| k / self.block_elems() * self.block_bytes())
    }
}

impl std::fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// `bytes` (whole blocks of `dtype`) dequantized into `out`, exactly as the loader does.
///
/// # Panics
/// When `bytes` is not `out.len()` elements of `dtype`.
pub fn dequantize_into(dtype: WeightDtype, bytes: &[u8], out: &mut [f32]) {
    ggml::dequantize_into(dtype.ggml(), bytes, out).unwrap_or_else(|| {
        panic!(
            "{} bytes are not {} elements of {dtype}",
            bytes.len(),
            out.len()
        )
    });
}

/// `values` in `dtype`, rounded to nearest (ties to even for F16/BF16). For the quantized
/// types this follows llama.cpp's reference quantizers (`quantize_row_q8_0_ref` and
/// friends), so tests and benches can make a model in any dtype; it needs not be bit-equal
/// to llama.cpp, only deterministic.
///
/// # Panics
/// When `values.len()` is not a whole number of blocks.
pub fn quantize(dtype: WeightDtype, values: &[f32]) -> Vec<u8> {
    let n_bytes = dtype
        .row_bytes(values.len())
        .unwrap_or_else(|| panic!("{} values are not whole {dtype} blocks", values.len()));
    let mut out = Vec::with_capacity(n_bytes);
    let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
    match dtype {
        WeightDtype::F32 => values.iter().for_each(|x| out.extend(x.to_le_bytes())),
        WeightDtype::F16 => values.iter().for_each(|&x| out.extend(f16(x))),
        WeightDtype::BF16 => values
            .iter()
            .for_each(|&x| out.extend(half::bf16::from_f32(x).to_le_bytes())),
        WeightDtype::Q8_0 => {
            for block in values.chunks_exact(QK) {
                let amax = block.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(f16(d));
                out.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
            }
        }
        WeightDtype::Q4_0 => {
            for block in values.chunks_exact(QK) {
                // The value of largest magnitude, with its sign, maps to -8.
                let max = block
                    .iter()
                    .fold(0.0f32, |a, &x| if x.abs() > a.abs() { x } else { a });
                let d = max / -8.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                let q = |x: f32| ((x * id + 8.5) as u8).min(15);
                out.extend(f16(d));
                put_nibbles(&mut out, block, q);
            }
        }
        WeightDtype::Q4_1 => {
            for block in values.chunks_exact(QK) {
                let min = block.iter().fold(f32::INFINITY, |a, &x| a.min(x));
                let max = block.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let d = (max - min) / 15.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                let q = |x: f32| (((x - min) * id + 0.5) as u8).min(15);
                out.extend(f16(d));
                out.extend(f16(min));
                put_nibbles(&mut out, block, q);
            }
        }
        WeightDtype::Q5_0 => {
            for block in values.chunks_exact(QK) {
                // As Q4_0: the value of largest magnitude, with its sign, maps to -16.
                let max = block
                    .iter()
                    .fold(0.0f32, |a, &x| if x.abs() > a.abs() { x } else { a });
                let d = max / -16.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(f16(d));
                put_five_bits(&mut out, block, |x| ((x * id + 16.5) as u8).min(31));
            }
        }
        WeightDtype::Q5_1 => {
            for block in values.chunks_exact(QK) {
                let min = block.iter().fold(f32::INFINITY, |a, &x| a.min(x));
                let max = block.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let d = (max - min) / 31.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(f16(d));
                out.extend(f16(min));
                put_five_bits(&mut out, block, |x| (((x - min) * id + 0.5) as u8).min(31));
            }
        }
        WeightDtype::Q4_K => values
            .chunks_exact(QK_K)
            .for_each(|b| quantize_q4_k(b, &mut out)),
        WeightDtype::Q6_K => values
            .chunks_exact(QK_K)
            .for_each(|b| quantize_q6_k(b, &mut out)),
    }
    out
}

/// A Q5 block's fifth bits (`qh`, bit i for element i) then its low nibbles as
/// [`put_nibbles`] lays them, each element's 5-bit value from `q`.
fn put_five_bits(out: &mut Vec<u8>, block: &[f32], q: impl Fn(f32) -> u8) {
    let qs: Vec<u8> = block.iter().map(|&x| q(x)).collect();
    let qh = qs
        .iter()
        .enumerate()
        .fold(0u32, |h, (i, &v)| h | (u32::from(v >> 4) << i));
    out.extend(qh.to_le_bytes());
    let (low, high) = qs.split_at(QK / 2);
    out.extend(
        low.iter()
            .zip(high)
            .map(|(&l, &h)| (l & 0x0f) | ((h & 0x0f) << 4)),
    );
}

/// `x / step` rounded to nearest and clamped to `0..=max`; 0 where `step` is 0.
fn level(x: f32, step: f32, max: u8) -> u8 {
    if step == 0.0 {
        0
    } else {
        (x / step).round().clamp(0.0, f32::from(max)) as u8
    }
}

/// One Q4_K super-block (a plain min/max fit per sub-block of 32, not llama.cpp's search):
/// each sub-block's step `(max - min) / 15` and offset `-min` (min at most 0) become 6-bit
/// multiples of the f16 `d` and `dmin`, then each value the nibble nearest to it.
fn quantize_q4_k(block: &[f32], out: &mut Vec<u8>) {
    let f16 = |x: f32| half::f16::from_f32(x);
    let subs: Vec<(f32, f32)> = block
        .chunks_exact(32)
        .map(|s| {
            let min = s.iter().fold(0.0f32, |a, &x| a.min(x));
            let max = s.iter().fold(min, |a, &x| a.max(x));
            ((max - min) / 15.0, -min)
        })
        .collect();
    let d = f16(subs.iter().fold(0.0f32, |a, s| a.max(s.0)) / 63.0);
    let dmin = f16(subs.iter().fold(0.0f32, |a, s| a.max(s.1)) / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let ls: Vec<u8> = subs.iter().map(|s| level(s.0, df, 63)).collect();
    let lm: Vec<u8> = subs.iter().map(|s| level(s.1, dminf, 63)).collect();
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = ls[j];
            scales[j + 4] = lm[j];
        } else {
            scales[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            scales[j - 4] |= (ls[j] >> 4) << 6;
            scales[j] |= (lm[j] >> 4) << 6;
        }
    }
    let q: Vec<u8> = block
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let (sc, m) = (df * f32::from(ls[i / 32]), dminf * f32::from(lm[i / 32]));
            level(x + m, sc, 15)
        })
        .collect();
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(scales);
    for pair in q.chunks_exact(64) {
        let (low, high) = pair.split_at(32);
        out.extend(low.iter().zip(high).map(|(&l, &h)| l | (h << 4)));
    }
}

/// One Q6_K super-block: each sub-block of 16 gets the step `amax / 31` as an i8 multiple
/// of the f16 `d`, each value the 6-bit level (`q - 32` in -32..=31) nearest to it.
fn quantize_q6_k(block: &[f32], out: &mut Vec<u8>) {
    let steps: Vec<f32> = block
        .chunks_exact(16)
        .map(|s| s.iter().fold(0.0f32, |a, &x| a.max(x.abs())) / 31.0)
        .collect();
    let d = half::f16::from_f32(steps.iter().fold(0.0f32, |a, &s| a.max(s)) / 127.0);
    let df = d.to_f32();
    let sc: Vec<i8> = steps.iter().map(|&s| level(s, df, 127) as i8).collect();
    let q: Vec<u8> = block
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let step = df * f32::from(sc[i / 16]);
            let v = if step == 0.0 { 0.0 } else { (x / step).round() };
            (v.clamp(-32.0, 31.0) as i8 + 32) as u8
        })
        .collect();
    let (mut ql, mut qh) = ([0u8; QK_K / 2], [0u8; QK_K / 4]);
    for half in 0..2 {
        for l in 0..32 {
            let at = |g: usize| q[half * 128 + 32 * g + l];
            ql[half * 64 + l] = (at(0) & 0x0f) | ((at(2) & 0x0f) << 4);
            ql[half * 64 + l + 32] = (at(1) & 0x0f) | ((at(3) & 0x0f) << 4);
            qh[half * 32 + l] = (0..4).fold(0, |h, g| h | ((at(g) >> 4) << (2 * g)));
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend(d.to_le_bytes());
}

/// Elements 0..16 of a block in the low nibbles of its 16 bytes, 16..32 in the high ones.
fn put_nibbles(out: &mut Vec<u8>, block: &[f32], q: impl Fn(f32) -> u8) {
    let (low, high) = block.split_at(QK / 2);
    out.extend(low.iter().zip(high).map(|(&l, &h)| q(l) | (q(h) << 4)));
}

/// Little-endian F32/F16/BF16 bytes → f32; `None` for other dtypes. The bytes of a mapped
/// file need not be aligned, so values are decoded from byte chunks, not cast in place.
pub(crate) fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let width = f32_source_width(dtype)?;
    let mut out = vec![0.0; bytes.len() / width];
    decode_into(dtype, &bytes[..out.len() * width], &mut out);
    Some(out)
}

/// Bytes per element of a dtype that converts to f32 (F32, F16, BF16); `None` for others.
pub(crate) fn f32_source_width(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        _ => None,
    }
}

/// Decodes little-endian `dtype` values from `bytes` into `out`, one per element
/// (`bytes.len()` is `out.len()` times the dtype's width; a dtype [`f32_source_width`]
/// refuses writes nothing).
pub(crate) fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_counts_whole_blocks_only() {
        assert_eq!(WeightDtype::F32.row_bytes(7), Some(28));
        assert_eq!(WeightDtype::BF16.row_bytes(7), Some(14));
        assert_eq!(WeightDtype::Q8_0.row_bytes(64), Some(68));
        assert_eq!(WeightDtype::Q4_0.row_bytes(64), Some(36));
        assert_eq!(WeightDtype::Q4_1.row_bytes(96), Some(60));
        assert_eq!(WeightDtype::Q4_1.row_bytes(48), None);
    }

    /// Quantizing then dequantizing stays within half a step of each value, and the f32,
    /// f16 and bf16 round trips are exact on values they can hold.
    #[test]
    fn quantize_round_trips_within_a_step() {
        let values: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.0) / 16.0)
            .collect();
        for dtype in WeightDtype::ALL {
            let bytes = quantize(dtype, &values);
            assert_eq!(Some(bytes.len()), dtype.row_bytes(values.len()));
            let mut back = vec![0.0; values.len()];
            dequantize_into(dtype, &bytes, &mut back);
            let tol = match dtype {
                WeightDtype::F32 | WeightDtype::F16 | WeightDtype::BF16 => 0.0,
                WeightDtype::Q8_0 => 2.0 / 127.0,
                WeightDtype::Q4_0 | WeightDtype::Q4_1 => 2.0 / 7.0,
                other => panic!("{other} is not in ALL"),
            };
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} became {b}");
            }
        }
    }

    /// The dtypes read by rows: quantizing then dequantizing stays within about half a step
    /// (the K-quants' scales are 6- and 8-bit multiples of an f16, which adds a little).
    #[test]
    fn by_rows_dtypes_round_trip_within_a_step() {
        let values: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 64) as f32 - 31.0) / 16.0 * (1.0 + (i / 64) as f32 / 8.0))
            .collect();
        for dtype in WeightDtype::BY_ROWS {
            let bytes = quantize(dtype, &values);
            assert_eq!(Some(bytes.len()), dtype.row_bytes(values.len()));
            let mut back = vec![0.0; values.len()];
            dequantize_into(dtype, &bytes, &mut back);
            // Values reach ±3.9: half a step is 0.12 for the 5-bit types, 0.26 for Q4_K's
            // 15 levels over a sub-block's range, 0.06 for Q6_K.
            let tol = match dtype {
                WeightDtype::Q5_0 | WeightDtype::Q5_1 => 0.15,
                WeightDtype::Q4_K => 0.4,
                _ => 0.1,
            };
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} became {b}");
            }
        }
        assert_eq!(WeightDtype::Q4_K.row_bytes(256), Some(144));
        assert_eq!(WeightDtype::Q6_K.row_bytes(512), Some(420));
        assert_eq!(WeightDtype::Q6_K.row_bytes(96), None);
        assert_eq!(WeightDtype::Q5_0.row_bytes(64), Some(44));
        assert_eq!(WeightDtype::Q5_1.row_bytes(64), Some(48));
    }
}
