//! GGML's tensor types and block formats: the type ids a GGUF file names ([`GgmlType`]), the
//! elements and bytes of a block, and the exact scalar dequantization of each to f32
//! ([`dequantize_into`]).
//!
//! Below both the GGUF reader (`load/gguf.rs`), which reads these types from a file, and the
//! weight dtypes (`dtype.rs`) and the kernels, which keep and multiply them: "the f32 value of
//! a stored weight" has this one definition.

/// Elements per quantization block of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.
pub const QK: usize = 32;
/// Elements per super-block of the K-quants (Q4_K, Q6_K).
pub const QK_K: usize = 256;
/// Bytes of a Q4_K block: f16 `d` and `dmin`, 12 bytes of packed 6-bit scales and mins,
/// 128 bytes of nibbles.
const Q4_K_BYTES: usize = 4 + 12 + QK_K / 2;
/// Bytes of a Q6_K block: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed
/// scales, f16 `d`.
const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

/// The ggml tensor types ferry knows by name; only some can be dequantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    #[allow(non_camel_case_types)]
    Q4_K,
    #[allow(non_camel_case_types)]
    Q6_K,
    BF16,
    /// Any other ggml type id (other k-quants, i-quants, integers...): readable, not
    /// loadable; named by [`std::fmt::Display`] as ggml names it.
    Other(u32),
}

impl GgmlType {
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4_K => 12,
            Self::Q6_K => 14,
            Self::BF16 => 30,
            Self::Other(id) => id,
        }
    }

    /// Bytes that `n` elements take, or `None` for unsupported types or a partial block.
    pub fn byte_size(self, n: usize) -> Option<usize> {
        let (block, bytes) = self.block()?;
        if !n.is_multiple_of(block) {
            return None;
        }
        (n / block).checked_mul(bytes)
    }
}

impl GgmlType {
    /// (elements, bytes) of one block; `None` for unsupported types.
    pub(crate) fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (QK, 2 + QK / 2),
            Self::Q4_1 => (QK, 4 + QK / 2),
            Self::Q5_0 => (QK, 2 + 4 + QK / 2),
            Self::Q5_1 => (QK, 4 + 4 + QK / 2),
            Self::Q8_0 => (QK, 2 + QK),
            Self::Q4_K => (QK_K, Q4_K_BYTES),
            Self::Q6_K => (QK_K, Q6_K_BYTES),
            Self::Other(_) => return None,
        })
    }
}

/// ggml's name of a type id (`ggml_type` in ggml.h; ids 4, 5 and 31 to 33 were removed
/// from ggml and have none).
fn ggml_type_name(id: u32) -> Option<&'static str> {
    const NAMES: [&str; 40] = [
        "F32", "F16", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K",
        "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
        "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "", "", "", "TQ1_0",
        "TQ2_0", "", "", "", "MXFP4",
    ];
    NAMES
        .get(id as usize)
        .copied()
        .filter(|name| !name.is_empty())
}

/// ggml's name for the type (`Q5_K`), or `ggml type <id>` for an id ggml has no name for.
impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match ggml_type_name(self.id()) {
            Some(name) => f.write_str(name),
            None => write!(f, "ggml type {}", self.id()),
        }
    }
}

/// Dequantizes `n` elements of `dtype` from `bytes` (GGML block formats, block size 32):
/// Q8_0 `d*q`; Q4_0 `d*(q-8)`; Q4_1 `d*q + m`; in a 4-bit block the low nibbles of the 16
/// bytes are elements 0..16 and the high nibbles 16..32. Q5_0 `d*(q-16)` and Q5_1 `d*q + m`
/// are Q4_0/Q4_1 with a fifth bit per element (bit i of the 32-bit `qh` for element i). The
/// K-quants (super-blocks of 256, see [`dequantize_q4_k`] and [`dequantize_q6_k`]) compute
/// as ggml's `dequantize_row_*` and the `gguf` package do, operation for operation, so the
/// values are bit for bit theirs. `None` for other types or when the byte count does not
/// match.
pub fn dequantize(dtype: GgmlType, bytes: &[u8], n: usize) -> Option<Vec<f32>> {
    let mut out = vec![0.0; n];
    dequantize_into(dtype, bytes, &mut out)?;
    Some(out)
}

/// [`dequantize`] into `out`, whose length is the element count.
pub fn dequantize_into(dtype: GgmlType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    if dtype.byte_size(out.len())? != bytes.len() {
        return None;
    }
    let f16_at = |b: &[u8], i: usize| half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match dtype {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_at(c, 0);
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, block) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(2 + QK)) {
                let d = f16_at(block, 0);
                for (o, &q) in o.iter_mut().zip(&block[2..]) {
                    *o = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, block) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(2 + QK / 2)) {
                let d = f16_at(block, 0);
                put_nibbles(o, &block[2..], |q| d * (f32::from(q) - 8.0));
            }
        }
        GgmlType::Q4_1 => {
            for (o, block) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(4 + QK / 2)) {
                let (d, m) = (f16_at(block, 0), f16_at(block, 2));
                put_nibbles(o, &block[4..], |q| d * f32::from(q) + m);
            }
        }
        GgmlType::Q5_0 => {
            for (o, block) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(6 + QK / 2)) {
                let d = f16_at(block, 0);
                put_five_bits(o, &block[2..], |q| d * (f32::from(q) - 16.0));
            }
        }
        GgmlType::Q5_1 => {
            for (o, block) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(8 + QK / 2)) {
                let (d, m) = (f16_at(block, 0), f16_at(block, 2));
                put_five_bits(o, &block[4..], |q| d * f32::from(q) + m);
            }
        }
        GgmlType::Q4_K => {
            for (o, block) in out
                .chunks_exact_mut(QK_K)
                .zip(bytes.chunks_exact(Q4_K_BYTES))
            {
                dequantize_q4_k(block, o);
            }
        }
        GgmlType::Q6_K => {
            for (o, block) in out
                .chunks_exact_mut(QK_K)
                .zip(bytes.chunks_exact(Q6_K_BYTES))
            {
                dequantize_q6_k(block, o);
            }
        }
        GgmlType::Other(_) => return None,
    }
    Some(())
}

/// A Q5 block (`qh`: 4 bytes, bit i the fifth bit of element i; then 16 bytes of nibbles as
/// in [`put_nibbles`]) into `out`, each 5-bit value through `f`.
fn put_five_bits(out: &mut [f32], block: &[u8], f: impl Fn(u8) -> f32) {
    let qh = u32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    let high = |i: usize| (((qh >> i) & 1) as u8) << 4;
    let (low_half, high_half) = out.split_at_mut(QK / 2);
    for (j, ((l, h), &b)) in low_half
        .iter_mut()
        .zip(high_half)
        .zip(&block[4..])
        .enumerate()
    {
        *l = f((b & 0x0f) | high(j));
        *h = f((b >> 4) | high(j + QK / 2));
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block's 12 packed bytes
/// (ggml's `get_scale_min_k4`).
pub(crate) fn q4_k_scale_min(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// One Q4_K block: 8 sub-blocks of 32, sub-block `j` worth `(d * sc_j) * q - (dmin * m_j)`;
/// each 32 bytes of nibbles hold sub-block `2i` in their low nibbles, `2i + 1` in the high.
fn dequantize_q4_k(block: &[u8], out: &mut [f32]) {
    let f16_at = |i: usize| half::f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
    let (d, dmin) = (f16_at(0), f16_at(2));
    let (scales, qs) = (&block[4..16], &block[16..]);
    for (pair, (o, q)) in out
        .chunks_exact_mut(64)
        .zip(qs.chunks_exact(32))
        .enumerate()
    {
        let (low, high) = o.split_at_mut(32);
        for (half, (o, shift)) in [(low, 0), (high, 4)].into_iter().enumerate() {
            let (sc, m) = q4_k_scale_min(2 * pair + half, scales);
            let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
            for (o, &b) in o.iter_mut().zip(q) {
                *o = d1 * f32::from((b >> shift) & 0x0f) - m1;
            }
        }
    }
}

/// One Q6_K block: 16 sub-blocks of 16, element `e` worth `(d * scales[e / 16]) * (q - 32)`
/// with its 6-bit `q` split into a nibble of `ql` and two bits of `qh`: in each half of 128
/// elements, element `32g + l` (g in 0..4) takes the low (g even) or high nibble of
/// `ql[l + 32 (g & 1)]` and bits `2g..2g+2` of `qh[l]`.
fn dequantize_q6_k(block: &[u8], out: &mut [f32]) {
    let (ql, rest) = block.split_at(QK_K / 2);
    let (qh, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(QK_K / 16);
    let d = half::f16::from_le_bytes([d[0], d[1]]).to_f32();
    for (e, o) in out.iter_mut().enumerate() {
        let (half, g, l) = (e / 128, e % 128 / 32, e % 32);
        let low = (ql[half * 64 + l + 32 * (g & 1)] >> (4 * (g / 2))) & 0x0f;
        let high = (qh[half * 32 + l] >> (2 * g)) & 3;
        let q = ((low | (high << 4)) as i8) - 32;
        *o = (d * f32::from(scales[e / 16] as i8)) * f32::from(q);
    }
}

/// Low nibbles first (elements 0..16), then high nibbles (16..32), into one block's `out`.
fn put_nibbles(out: &mut [f32], qs: &[u8], f: impl Fn(u8) -> f32) {
    let (low, high) = out.split_at_mut(qs.len());
    for ((l, h), &b) in low.iter_mut().zip(high).zip(qs) {
        *l = f(b & 0x0f);
        *h = f(b >> 4);
    }
}
