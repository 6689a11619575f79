//! [`Matrix`]: a weight matrix kept in the precision it was stored in, as a stack of row
//! [`Segment`]s, each with its own [`WeightDtype`].
//!
//! Why segments: the model fuses q/k/v (and gate/up) into one matrix so a layer runs one
//! matmul per fused group, but each part is its own tensor in the file and in a weight update,
//! with its own dtype (a trainer's bf16 push of `q_proj` into a Q4_1 model makes that part
//! bf16 and leaves k and v as they were). One segment per tensor keeps both: the kernels
//! stream each segment in its dtype into the right output columns, and an update replaces a
//! segment whole, whatever its dtype.

use crate::dtype::{dequantize_into, WeightDtype};
use crate::weights::buf::ByteBuf;
use crate::weights::row_groups;

/// Rows of one dtype, `k` elements each, row after row: in the file's layout, except that on
/// AVX-512 the 4-bit dtypes hold their first `grouped` rows in groups of four
/// ([`crate::weights::row_groups`]), which the batch-1 kernel reads faster.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    dtype: WeightDtype,
    rows: usize,
    bytes: ByteBuf,
    grouped: usize,
}

/// What is wrong with a segment's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{rows} rows of {k} {dtype} elements need {expected:?} bytes (None: not whole blocks), got {got}")]
pub struct SegmentError {
    pub dtype: WeightDtype,
    pub rows: usize,
    pub k: usize,
    /// `None` when `k` is not a whole number of the dtype's blocks.
    pub expected: Option<usize>,
    pub got: usize,
}

impl Segment {
    /// `rows` rows of `k` elements of `dtype` in `bytes` (the file's layout), checked, and
    /// arranged for this process's kernels ([`Segment::arrange`]).
    pub fn new(
        dtype: WeightDtype,
        rows: usize,
        k: usize,
        bytes: ByteBuf,
    ) -> Result<Self, SegmentError> {
        let expected = dtype.row_bytes(k).and_then(|r| r.checked_mul(rows));
        if expected != Some(bytes.len()) {
            return Err(SegmentError {
                dtype,
                rows,
                k,
                expected,
                got: bytes.len(),
            });
        }
        let mut segment = Self {
            dtype,
            rows,
            bytes,
            grouped: 0,
        };
        segment.arrange();
        Ok(segment)
    }

    /// Rows written in the file's layout (by [`Segment::new`], or by a reader into
    /// [`Segment::zeroed`]'s bytes) put in the layout this process's kernels read fastest:
    /// the whole groups of four rows of a 4-bit dtype on AVX-512 ([`crate::weights::row_groups`]).
    /// Only the order of the bytes changes. Arranging twice does nothing.
    pub fn arrange(&mut self) {
        if self.grouped == 0 && self.rows > 0 && row_groups::held_in_groups(self.dtype) {
            let k = self.k();
            self.grouped = row_groups::group(self.dtype, k, &mut self.bytes);
        }
    }

    /// Rows held in groups of four ([`crate::weights::row_groups`]); 0 when every row is in the
    /// file's layout.
    pub fn grouped_rows(&self) -> usize {
        self.grouped
    }

    /// Elements per row.
    fn k(&self) -> usize {
        let row_bytes = self.bytes.len().checked_div(self.rows).unwrap_or(0);
        row_bytes / self.dtype.block_bytes() * self.dtype.block_elems()
    }

    /// Row `r` in the file's layout, into `out`.
    fn file_row(&self, r: usize, out: &mut [u8]) {
        row_groups::file_row(self.dtype, self.k(), &self.bytes, self.grouped, r, out);
    }

    /// f32 rows, `values.len() / k` of them.
    pub fn from_f32(k: usize, values: &[f32]) -> Self {
        let rows = values.len().checked_div(k).unwrap_or(0);
        let mut bytes = ByteBuf::zeroed(size_of_val(values));
        for (b, v) in bytes.chunks_exact_mut(4).zip(values) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        Self {
            dtype: WeightDtype::F32,
            rows,
            bytes,
            grouped: 0,
        }
    }

    /// Zeros of `dtype` (every dtype's all-zero bytes are the value 0) in the file's layout,
    /// for a reader to fill and then [`Segment::arrange`].
    pub fn zeroed(dtype: WeightDtype, rows: usize, k: usize) -> Result<Self, SegmentError> {
        match dtype.row_bytes(k).and_then(|r| r.checked_mul(rows)) {
            Some(n_bytes) => Ok(Self {
                dtype,
                rows,
                bytes: ByteBuf::zeroed(n_bytes),
                grouped: 0,
            }),
            None => Err(SegmentError {
                dtype,
                rows,
                k,
                expected: None,
                got: 0,
            }),
        }
    }

    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The bytes as held (see [`Segment::grouped_rows`]).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The bytes as held, to write in place: a reader filling [`Segment::zeroed`] in the
    /// file's layout, or a copy from a segment held the same way.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    /// The bytes, to be written over whole in the file's layout (a reload in place): the
    /// segment counts them as not arranged, so [`Segment::arrange`] arranges the new rows.
    pub fn overwrite_mut(&mut self) -> &mut [u8] {
        self.grouped = 0;
        &mut self.bytes
    }
}

/// A row-major weight matrix (`n_rows × k`, PyTorch layout) as segments stacked row-wise.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Matrix {
    k: usize,
    segments: Vec<Segment>,
}

impl Matrix {
    /// Segments stacked in order; each was checked against `k` when it was made, except
    /// that `k` must agree, which the caller guarantees by making them for this `k`.
    pub fn new(k: usize, segments: Vec<Segment>) -> Self {
        Self { k, segments }
    }

    /// One f32 segment of `values.len() / k` rows.
    pub fn from_f32(k: usize, values: &[f32]) -> Self {
        Self::new(k, vec![Segment::from_f32(k, values)])
    }

    /// Elements per row.
    pub fn k(&self) -> usize {
        self.k
    }

    pub fn n_rows(&self) -> usize {
        self.segments.iter().map(|s| s.rows).sum()
    }

    /// Bytes held (what one pass over the matrix reads).
    pub fn n_bytes(&self) -> usize {
        self.segments.iter().map(|s| s.bytes.len()).sum()
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Every segment, to be filled in place.
    pub fn segments_mut(&mut self) -> &mut [Segment] {
        &mut self.segments
    }

    /// Segment `idx`, to be filled in place by a reader.
    pub fn segment_mut(&mut self, idx: usize) -> Option<&mut Segment> {
        self.segments.get_mut(idx)
    }

    /// Puts `segment` in place of segment `idx` and returns the old one, if the row counts
    /// agree (the new one may be of any dtype).
    pub fn replace_segment(&mut self, idx: usize, segment: Segment) -> Result<Segment, Segment> {
        match self.segments.get_mut(idx) {
            Some(old) if old.rows == segment.rows => Ok(std::mem::replace(old, segment)),
            _ => Err(segment),
        }
    }

    /// Row `r` dequantized into `out` (`k` floats): the embedding lookup.
    ///
    /// # Panics
    /// When `r` is out of range or `out` is not `k` long.
    pub fn row_into(&self, mut r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.k, "row_into: out must hold one row");
        for s in &self.segments {
            if r < s.rows {
                let row_bytes = s.bytes.len() / s.rows;
                if r < s.grouped {
                    let mut row = vec![0; row_bytes];
                    s.file_row(r, &mut row);
                    dequantize_into(s.dtype, &row, out);
                } else {
                    dequantize_into(s.dtype, &s.bytes[r * row_bytes..(r + 1) * row_bytes], out);
                }
                return;
            }
            r -= s.rows;
        }
        panic!("row_into: row out of range");
    }

    /// Every row dequantized (tests compare matrices this way).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.n_rows() * self.k];
        let mut at = 0;
        for s in &self.segments {
            let n = s.rows * self.k;
            if s.grouped == 0 {
                dequantize_into(s.dtype, &s.bytes, &mut out[at..at + n]);
            } else {
                let mut row = vec![0; s.bytes.len() / s.rows];
                for (r, values) in out[at..at + n].chunks_exact_mut(self.k).enumerate() {
                    s.file_row(r, &mut row);
                    dequantize_into(s.dtype, &row, values);
                }
            }
            at += n;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::quantize;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5)
            .collect()
    }

    #[test]
    fn rows_come_back_from_mixed_segments() {
        let (k, a, b) = (64, values(3 * 64), values(2 * 64));
        let q = ByteBuf::from_slice(&quantize(WeightDtype::Q4_1, &b));
        let m = Matrix::new(
            k,
            vec![
                Segment::from_f32(k, &a),
                Segment::new(WeightDtype::Q4_1, 2, k, q).unwrap(),
            ],
        );
        assert_eq!((m.n_rows(), m.n_bytes()), (5, 3 * 256 + 2 * 40));
        let all = m.to_f32();
        let mut row = vec![0.0; k];
        for r in 0..5 {
            m.row_into(r, &mut row);
            assert_eq!(row, all[r * k..(r + 1) * k], "row {r}");
        }
        assert_eq!(all[..3 * k], a[..]);
    }

    #[test]
    fn segments_check_their_bytes_and_replacements_their_rows() {
        let err = Segment::new(WeightDtype::Q8_0, 2, 64, ByteBuf::zeroed(100)).unwrap_err();
        assert_eq!((err.expected, err.got), (Some(136), 100));
        assert_eq!(
            Segment::zeroed(WeightDtype::Q8_0, 1, 48)
                .unwrap_err()
                .expected,
            None
        );
        let mut m = Matrix::from_f32(32, &values(64));
        let bf16 = Segment::zeroed(WeightDtype::BF16, 2, 32).unwrap();
        let old = m.replace_segment(0, bf16).unwrap();
        assert_eq!(
            (old.dtype(), m.segments()[0].dtype()),
            (WeightDtype::F32, WeightDtype::BF16)
        );
        assert!(m.to_f32().iter().all(|&x| x == 0.0));
        assert!(m
            .replace_segment(0, Segment::zeroed(WeightDtype::F32, 3, 32).unwrap())
            .is_err());
    }
}
