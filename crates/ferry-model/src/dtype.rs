//! [`WeightDtype`]: the precisions a weight matrix is kept in, as stored in its file (or as a
//! weight update pushed it), and their exact scalar dequantization.
//!
//! The scalar dequantization here *is* the loader's ([`crate::load::gguf::dequantize_into`]),
//! so "the f32 value of a stored weight" has one definition: the matmul kernels that
//! dequantize in registers are tested bit for bit against it, which is what keeps a model
//! kept in its stored precision bit-identical to the same model dequantized to f32 at load.

use crate::load::gguf::{self, GgmlType, QK};

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
}

impl WeightDtype {
    /// Every dtype, for tests that cover them all.
    pub const ALL: [WeightDtype; 6] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
    ];

    /// The GGML type with this layout.
    pub fn ggml(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::BF16 => GgmlType::BF16,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
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

    /// Elements per block: 32 for the GGML quantizations, 1 otherwise. A row's length must be
    /// a multiple of it.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 => QK,
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
    gguf::dequantize_into(dtype.ggml(), bytes, out).unwrap_or_else(|| {
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
    }
    out
}

/// Elements 0..16 of a block in the low nibbles of its 16 bytes, 16..32 in the high ones.
fn put_nibbles(out: &mut Vec<u8>, block: &[f32], q: impl Fn(f32) -> u8) {
    let (low, high) = block.split_at(QK / 2);
    out.extend(low.iter().zip(high).map(|(&l, &h)| q(l) | (q(h) << 4)));
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
            };
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} became {b}");
            }
        }
    }
}
