//! Paged attention on CPU: each query token attends causally to positions `0..=pos` of its
//! own request, reading K/V through the request's block table in the KV arena.
//!
//! Written by hand because no Rust crate has a CPU paged-attention kernel. The step's own K/V
//! are written into the arena first ([`write_kv`]) and then read back like any earlier
//! position, so a prefill chunk and a decode token are one code path. Softmax is two-pass in
//! f32 over positions in order, so a token's output depends only on its request's KV, never on
//! the rest of the batch.

use ferry_core::BlockId;
use ferry_kv::{KvArena, KvLayout, KvPlane};

use crate::kernels::{axpy_rows, dot_rows};

/// One query token: where it sits in its request and how to find its request's KV.
#[derive(Debug, Clone, Copy)]
pub struct AttnQuery<'a> {
    /// Absolute position of this token; it sees positions `0..=pos`.
    pub pos: usize,
    /// The request's block table (covers at least `pos + 1` positions).
    pub block_table: &'a [BlockId],
}

/// Writes one token's K and V (`n_kv_heads × head_dim` floats each) of layer `layer` into
/// the arena at arena slot `slot` (`block * block_size + offset`). Touches only that block:
/// blocks a transfer holds may be in use on another thread (`ferry_kv::access`).
pub fn write_kv(arena: &mut KvArena, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
    let tf = arena.layout().token_floats();
    arena
        .token_at_mut(slot, layer, KvPlane::K)
        .copy_from_slice(&k[..tf]);
    arena
        .token_at_mut(slot, layer, KvPlane::V)
        .copy_from_slice(&v[..tf]);
}

/// Attention of every query of one layer: `q` is `queries.len() × n_heads × head_dim`, and so
/// is `out`. Query head `h` reads KV head `h / (n_heads / n_kv_heads)` (GQA).
pub fn paged_attention(
    arena: &KvArena,
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
    let one = |i: usize, ot: &mut [f32]| {
        let qt = &q[i * width..(i + 1) * width];
        attend_token(arena, layout, layer, n_heads, &queries[i], qt, ot);
    };
    // A token is the unit of work: its heads share the same K/V rows, which stay in cache.
    if queries.len() == 1 {
        one(0, out);
    } else {
        crate::kernels::pool::for_each_chunk_mut(out, width, &one);
    }
}

/// One token, all heads. Query heads that share a KV head are done together so each K and
/// V row is fetched once per group; each score and each output element is still computed in
/// the same order as for one head alone.
fn attend_token(
    arena: &KvArena,
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
            let rows = kv_rows(arena, layout, layer, KvPlane::K, query.block_table, p0, n);
            let rows = &rows[kv_head * hd..];
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
            let rows = kv_rows(arena, layout, layer, KvPlane::V, query.block_table, p0, n);
            let rows = &rows[kv_head * hd..];
            for (g, oh) in out_group.chunks_exact_mut(hd).enumerate() {
                let w = &scores[g * n_pos + p0..g * n_pos + p0 + n];
                axpy_rows(w, rows, layout.token_floats(), oh);
            }
        }
    }
}

/// The K or V vectors (all KV heads) of the `n` positions from `p0` (a block boundary) on,
/// back to back, from the one block that holds them: slices never span blocks, since blocks a
/// transfer holds may be in use on another thread (`ferry_kv::access`).
fn kv_rows<'a>(
    arena: &'a KvArena,
    layout: &KvLayout,
    layer: usize,
    plane: KvPlane,
    table: &[BlockId],
    p0: usize,
    n: usize,
) -> &'a [f32] {
    assert_eq!(
        p0 % layout.block_size,
        0,
        "a KV block slice starts at a block boundary"
    );
    let start = layout.token_offset(layer, plane, 0);
    &arena.block(table[p0 / layout.block_size])[start..start + n * layout.token_floats()]
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
