//! The portable order: 8 lanes, mul then add, the same horizontal sum as the AVX2 path. Any
//! CPU; weights of every dtype are dequantized a row at a time with the loader's own code.

use super::Tile;

pub(super) fn tile(x: &[f32], out: *mut f32, t: &Tile) {
    let mut row = vec![0.0f32; t.k];
    for j in t.w_rows.clone() {
        // SAFETY: row j lies inside the weights the caller checked.
        let bytes =
            unsafe { std::slice::from_raw_parts(t.w.ptr.add(j * t.w.row_bytes), row_len(t)) };
        crate::dtype::dequantize_into(t.w.dtype, bytes, &mut row);
        for i in t.x_rows.clone() {
            let s = dot8(&x[i * t.k..(i + 1) * t.k], &row);
            // SAFETY: (i, j) is inside the m × n output checked by the caller.
            unsafe { out.add(i * t.n + j).write(s) };
        }
    }
}

/// Bytes of one row's `k` elements (less than the stride for K rows in the arena).
fn row_len(t: &Tile) -> usize {
    t.w.dtype.row_bytes(t.k).expect("a row holds whole blocks")
}

pub(super) fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += xa[l] * xb[l];
        }
    }
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    let mut s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for (&p, &q) in ca.remainder().iter().zip(cb.remainder()) {
        s += p * q;
    }
    s
}
