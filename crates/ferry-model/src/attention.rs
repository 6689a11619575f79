//! Paged attention on CPU: each query token attends causally to positions `0..=pos` of its
//! own request, reading K/V through the request's block table in the KV arena.
//!
//! Written by hand because no Rust crate has a CPU paged-attention kernel. The step's own K/V
//! are written into the arena first ([`write_kv`]) and then read back like any earlier
//! position, so a prefill chunk and a decode token are one code path. Softmax is two-pass in
//! f32 over positions in order, so a token's output depends only on its request's KV, never on
//! the rest of the batch.

use ferry_core::BlockId;
use ferry_kv::KvLayout;
use rayon::prelude::*;

use crate::kernels::{axpy_rows, dot_rows};

/// One query token: where it sits in its request and how to find its request's KV.
#[derive(Debug, Clone, Copy)]
pub struct AttnQuery<'a> {
    /// Absolute position of this token; it sees positions `0..=pos`.
    pub pos: usize,
    /// The request's block table (covers at least `pos + 1` positions).
    pub block_table: &'a [BlockId],
}

/// Float offset in the arena of the K (`v = false`) or V vector of `slot_pos` in `block`.
fn token_offset(
    layout: &KvLayout,
    layer: usize,
    v: bool,
    block: BlockId,
    slot_pos: usize,
) -> usize {
    block as usize * layout.block_floats()
        + layout.plane_offset(layer, v)
        + slot_pos * layout.token_floats()
}

/// Writes one token's K and V (`n_kv_heads × head_dim` floats each) of layer `layer` into
/// the arena at arena slot `slot` (`block * block_size + offset`).
pub fn write_kv(
    arena: &mut [f32],
    layout: &KvLayout,
    layer: usize,
    slot: usize,
    k: &[f32],
    v: &[f32],
) {
    let (block, off) = (
        (slot / layout.block_size) as BlockId,
        slot % layout.block_size,
    );
    let tf = layout.token_floats();
    let ko = token_offset(layout, layer, false, block, off);
    arena[ko..ko + tf].copy_from_slice(&k[..tf]);
    let vo = token_offset(layout, layer, true, block, off);
    arena[vo..vo + tf].copy_from_slice(&v[..tf]);
}

/// Attention of every query of one layer: `q` is `queries.len() × n_heads × head_dim`, and so
/// is `out`. Query head `h` reads KV head `h / (n_heads / n_kv_heads)` (GQA).
pub fn paged_attention(
    arena: &[f32],
    layout: &KvLayout,
    layer: usize,
    n_heads: usize,
    queries: &[AttnQuery<'_>],
    q: &[f32],
    out: &mut [f32],
) {
    let width = n_heads * layout.head_dim;
    assert_eq!(
        q.len(),
        queries.len() * width,
        "q has the wrong size for the queries"
    );
    assert_eq!(out.len(), q.len(), "out has the wrong size for the queries");
    let one = |(query, (qt, ot)): (&AttnQuery<'_>, (&[f32], &mut [f32]))| {
        attend_token(arena, layout, layer, n_heads, query, qt, ot);
    };
    // A token is the unit of work: its heads share the same K/V rows, which stay in cache.
    if queries.len() == 1 {
        queries
            .iter()
            .zip(q.chunks(width).zip(out.chunks_mut(width)))
            .for_each(one);
    } else {
        queries
            .par_iter()
            .zip(q.par_chunks(width).zip(out.par_chunks_mut(width)))
            .for_each(one);
    }
}

/// One token, all heads. Query heads that share a KV head are done together so each K and
/// V row is fetched once per group; each score and each output element is still computed in
/// the same order as for one head alone.
fn attend_token(
    arena: &[f32],
    layout: &KvLayout,
    layer: usize,
    n_heads: usize,
    query: &AttnQuery<'_>,
    q: &[f32],
    out: &mut [f32],
) {
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let n_pos = query.pos + 1;
    let mut scores = vec![0.0f32; group * n_pos];
    for kv_head in 0..layout.n_kv_heads {
        let heads = kv_head * group..(kv_head + 1) * group;
        // Scores a block at a time: the K vectors of a block's slots are evenly spaced.
        for p0 in (0..n_pos).step_by(layout.block_size) {
            let n = layout.block_size.min(n_pos - p0);
            let o = kv_offset(layout, layer, false, query.block_table, p0) + kv_head * hd;
            let rows = &arena[o..o + (n - 1) * layout.token_floats() + hd];
            for (g, h) in heads.clone().enumerate() {
                let s = &mut scores[g * n_pos + p0..g * n_pos + p0 + n];
                dot_rows(&q[h * hd..(h + 1) * hd], rows, layout.token_floats(), s);
                s.iter_mut().for_each(|v| *v *= scale);
            }
        }
        scores.chunks_exact_mut(n_pos).for_each(softmax_in_place);
        let out_group = &mut out[heads.start * hd..heads.end * hd];
        out_group.fill(0.0);
        // V sums a block at a time too; each output element still adds positions in order.
        for p0 in (0..n_pos).step_by(layout.block_size) {
            let n = layout.block_size.min(n_pos - p0);
            let o = kv_offset(layout, layer, true, query.block_table, p0) + kv_head * hd;
            let rows = &arena[o..o + (n - 1) * layout.token_floats() + hd];
            for (g, oh) in out_group.chunks_exact_mut(hd).enumerate() {
                let w = &scores[g * n_pos + p0..g * n_pos + p0 + n];
                axpy_rows(w, rows, layout.token_floats(), oh);
            }
        }
    }
}

/// Offset of position `pos`'s K or V vector (all KV heads) through a block table.
fn kv_offset(layout: &KvLayout, layer: usize, v: bool, table: &[BlockId], pos: usize) -> usize {
    let bs = layout.block_size;
    token_offset(layout, layer, v, table[pos / bs], pos % bs)
}

/// Softmax in f32, max-subtracted, summed in position order.
fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}
