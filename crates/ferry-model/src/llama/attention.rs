//! Paged attention on CPU: each query token attends causally to positions `0..=pos` of its
//! own request, reading K/V through the request's block table in the KV arena.
//!
//! Written by hand because no Rust crate has a CPU paged-attention kernel. The step's own K/V
//! are written into the arena first ([`write_kv`]) and then read back like any earlier
//! position, so a prefill chunk and a decode token are one code path. Softmax is two-pass in
//! f32 over positions in order, so a token's output depends only on its request's KV, never on
//! the rest of the batch.

use ferry_arena::{KvArena, KvLayout, KvPlane};
use ferry_core::BlockId;

use std::ops::Range;

use crate::kernels::pool::SharedMut;
use crate::kernels::{axpy_rows, axpy_rows_n, dot_tile, prefetch, softmax_in_place, split_rows};

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
/// blocks a transfer holds may be in use on another thread (`ferry_arena::access`).
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
    // The unit of work is a run of consecutive tokens of one request (a prefill chunk, cut
    // into pieces of RUN_TOKENS), or one token: a run's tokens share the same K/V rows,
    // which stay in cache, and its scores are register tiles of many queries at once.
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, query) in queries.iter().enumerate() {
        match runs.last_mut() {
            Some(r)
                if r.len() < RUN_TOKENS
                    && std::ptr::eq(queries[r.end - 1].block_table, query.block_table)
                    && queries[r.end - 1].pos + 1 == query.pos =>
            {
                r.end = i + 1
            }
            _ => runs.push(i..i + 1),
        }
    }
    // A decode step of few requests has fewer runs than threads: its single-token runs are
    // cut further, one unit per KV head (a head's scores, softmax and V sums need no other
    // head), so a batch-1 step's attention runs on every thread instead of one.
    let n_kv = layout.n_kv_heads;
    let split = runs.len() < SPLIT_BELOW;
    let units: Vec<(usize, Range<usize>)> = runs
        .iter()
        .enumerate()
        .flat_map(|(u, r)| {
            let cut = split && r.len() == 1;
            let heads = if cut { n_kv } else { 1 };
            (0..heads).map(move |h| (u, if cut { h..h + 1 } else { 0..n_kv }))
        })
        .collect();
    let group = n_heads / n_kv;
    let base = SharedMut(out.as_mut_ptr());
    let one = |unit: usize| {
        let (u, ref kv_heads) = units[unit];
        let r = runs[u].clone();
        let qt = &q[r.start * width..r.end * width];
        if kv_heads.len() < n_kv {
            // SAFETY: the unit's heads of its one token, which no other unit writes; `out`
            // stays borrowed until the pool returns.
            let ot = unsafe {
                let at = r.start * width + kv_heads.start * group * layout.head_dim;
                let len = kv_heads.len() * group * layout.head_dim;
                std::slice::from_raw_parts_mut(base.get().add(at), len)
            };
            let query = &queries[r.start];
            return attend_token(
                arena,
                layout,
                layer,
                n_heads,
                query,
                qt,
                ot,
                kv_heads.clone(),
            );
        }
        // SAFETY: the runs are disjoint ranges of tokens, so each task writes its own rows of
        // `out`, which stays borrowed until the pool returns.
        let ot = unsafe {
            std::slice::from_raw_parts_mut(base.get().add(r.start * width), r.len() * width)
        };
        attend_run(arena, layout, layer, n_heads, &queries[r], qt, ot);
    };
    crate::kernels::pool::run(units.len(), &one);
}

/// Below this many runs, a step's single-token runs are split by KV head (see
/// [`paged_attention`]).
const SPLIT_BELOW: usize = 8;

/// Tokens in one unit of attention work: enough queries for the 4×4 register tiles, few
/// enough that a prefill chunk still splits over the threads.
const RUN_TOKENS: usize = 16;

/// A run of consecutive tokens of one request (positions `pos, pos + 1, ...`): each gets the
/// bits [`attend_token`] gives it alone (the same dot products, softmax and V sums in the same
/// order), with the scores of all its queries against a K block computed as one tile.
fn attend_run(
    arena: &KvArena,
    layout: &KvLayout,
    layer: usize,
    n_heads: usize,
    queries: &[AttnQuery<'_>],
    q: &[f32],
    out: &mut [f32],
) {
    let width = n_heads * layout.head_dim;
    if queries.len() < 4 {
        for (i, query) in queries.iter().enumerate() {
            let (qt, ot) = (
                &q[i * width..(i + 1) * width],
                &mut out[i * width..(i + 1) * width],
            );
            attend_token(
                arena,
                layout,
                layer,
                n_heads,
                query,
                qt,
                ot,
                0..layout.n_kv_heads,
            );
        }
        return;
    }
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let first = queries[0].pos;
    let n_pos = queries[queries.len() - 1].pos + 1;
    let table = queries[0].block_table;
    // Row (t, g) of `xs` is token t's query head g of the KV head at hand, rows back to back
    // as the tile reads them; its scores are row (t, g) of `scores`, `n_pos` wide.
    let rows = queries.len() * group;
    let mut xs = vec![0.0f32; rows * hd];
    let mut scores = vec![0.0f32; rows * n_pos];
    for kv_head in 0..layout.n_kv_heads {
        let heads = kv_head * group..(kv_head + 1) * group;
        for (t, x) in xs.chunks_exact_mut(group * hd).enumerate() {
            x.copy_from_slice(&q[t * width + heads.start * hd..t * width + heads.end * hd]);
        }
        for p0 in (0..n_pos).step_by(layout.block_size) {
            let n = layout.block_size.min(n_pos - p0);
            let k_rows = kv_rows(arena, layout, layer, KvPlane::K, table, p0, n);
            // Tokens before p0 see none of this block (they come first: positions ascend).
            let t0 = p0.saturating_sub(first).min(queries.len());
            dot_tile(
                &xs[t0 * group * hd..],
                hd,
                &k_rows[kv_head * hd..],
                layout.token_floats(),
                n,
                &mut scores[t0 * group * n_pos + p0..],
                n_pos,
            );
        }
        for (t, query) in queries.iter().enumerate() {
            for g in 0..group {
                let s = &mut scores[(t * group + g) * n_pos..][..query.pos + 1];
                s.iter_mut().for_each(|v| *v *= scale);
                softmax_in_place(s);
            }
        }
        // V sums, rows (t, g) four at a time so each V row is read once for the four: the
        // positions all four see together, then each one's last few alone. Every output
        // element still adds its positions in order, as for the token alone.
        let rows_of = |r: usize| (r / group, heads.start + r % group);
        let mut r0 = 0;
        while r0 < rows {
            let quad = rows - r0 >= 4;
            let r_end = if quad { r0 + 4 } else { r0 + 1 };
            let seen: Vec<usize> = (r0..r_end).map(|r| queries[rows_of(r).0].pos + 1).collect();
            // Output offsets ascend with r (t, then the head), so the slices split in order.
            let mut outs: Vec<&mut [f32]> = Vec::with_capacity(4);
            let mut rest = &mut out[..];
            let mut at = 0;
            for r in r0..r_end {
                let (t, h) = rows_of(r);
                let start = t * width + h * hd;
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
                let (o, tail) = tail.split_at_mut(hd);
                o.fill(0.0);
                outs.push(o);
                rest = tail;
                at = start + hd;
            }
            let common = *seen.iter().min().expect("a row");
            let last = *seen.iter().max().expect("a row");
            for p0 in (0..last).step_by(layout.block_size) {
                let n = layout.block_size.min(last - p0);
                let v_rows = kv_rows(arena, layout, layer, KvPlane::V, table, p0, n);
                let v_rows = &v_rows[kv_head * hd..];
                let both = common.saturating_sub(p0).min(n);
                let weights = |i: usize, span: Range<usize>| &scores[(r0 + i) * n_pos + p0..][span];
                let mut done = 0;
                if quad && both > 0 {
                    let [a, b, c, d] = &mut outs[..] else {
                        unreachable!("four outputs")
                    };
                    axpy_rows_n(
                        [0, 1, 2, 3].map(|i| weights(i, 0..both)),
                        v_rows,
                        layout.token_floats(),
                        [&mut **a, &mut **b, &mut **c, &mut **d],
                    );
                    done = both;
                }
                for (i, o) in outs.iter_mut().enumerate() {
                    let end = seen[i].saturating_sub(p0).min(n);
                    if end > done {
                        axpy_rows(
                            weights(i, done..end),
                            &v_rows[done * layout.token_floats()..],
                            layout.token_floats(),
                            o,
                        );
                    }
                }
            }
            r0 = r_end;
        }
    }
}

/// One token, the query heads of KV heads `kv_heads` (all of them, or a unit of a split
/// step): `q` is the token's whole query row, `out` the output of those heads only. Query
/// heads that share a KV head are done together so each K and V row is fetched once per
/// group; each score and each output element is still computed in the same order as for one
/// head alone, so a split gives the bits of the whole.
#[allow(clippy::too_many_arguments)]
fn attend_token(
    arena: &KvArena,
    layout: &KvLayout,
    layer: usize,
    n_heads: usize,
    query: &AttnQuery<'_>,
    q: &[f32],
    out: &mut [f32],
    kv_heads: Range<usize>,
) {
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let n_pos = query.pos + 1;
    let tf = layout.token_floats();
    // The first query head this call computes; heads are numbered from it below.
    let first = kv_heads.start * group;
    let n_local = kv_heads.len() * group;
    // Row h of `scores` is query head first + h's, n_pos wide. Blocks outside, KV heads
    // inside: a block's K (then V) vectors of every KV head are contiguous, so each is read
    // from memory once, in order, rather than once per KV head at a stride.
    let mut scores = vec![0.0f32; n_local * n_pos];
    let bs = layout.block_size;
    // The next block's vectors (K, then V from the first), fetched while this one is used,
    // piece `i` of `parts` before KV head `i`'s work: a whole block's lines in one burst
    // stalled the core on its limit of misses in flight (batch-64 decode attention took ~6%
    // longer that way). A call for some KV heads fetches only their vectors.
    let all = kv_heads.len() == layout.n_kv_heads;
    let parts = layout.n_kv_heads;
    let next = |plane: KvPlane, p0: usize| {
        (p0 < n_pos).then(|| {
            kv_rows(
                arena,
                layout,
                layer,
                plane,
                query.block_table,
                p0,
                bs.min(n_pos - p0),
            )
        })
    };
    let ahead = |next: Option<&[f32]>, i: usize| {
        if let Some(rows) = next {
            if all {
                let piece = rows.len().div_ceil(parts).next_multiple_of(16);
                let start = (i * piece).min(rows.len());
                prefetch(&rows[start..(start + piece).min(rows.len())]);
            } else {
                rows.chunks_exact(tf)
                    .for_each(|v| prefetch(&v[i * hd..(i + 1) * hd]));
            }
        }
    };
    for p0 in (0..n_pos).step_by(bs) {
        let n = bs.min(n_pos - p0);
        let rows = kv_rows(arena, layout, layer, KvPlane::K, query.block_table, p0, n);
        let following = if p0 + bs < n_pos {
            next(KvPlane::K, p0 + bs)
        } else {
            next(KvPlane::V, 0)
        };
        for kv_head in kv_heads.clone() {
            ahead(following, kv_head);
            // The group's query heads (back to back in `q`) are one tile against the block.
            let heads = kv_head * group..(kv_head + 1) * group;
            dot_tile(
                &q[heads.start * hd..heads.end * hd],
                hd,
                &rows[kv_head * hd..],
                tf,
                n,
                &mut scores[(heads.start - first) * n_pos + p0..],
                n_pos,
            );
        }
    }
    for s in scores.chunks_exact_mut(n_pos) {
        s.iter_mut().for_each(|v| *v *= scale);
        softmax_in_place(s);
    }
    out[..n_local * hd].fill(0.0);
    // V sums a block at a time too, a group's heads together (up to four at once); each
    // output element still adds positions in order.
    for p0 in (0..n_pos).step_by(bs) {
        let n = bs.min(n_pos - p0);
        let block = kv_rows(arena, layout, layer, KvPlane::V, query.block_table, p0, n);
        let following = next(KvPlane::V, p0 + bs);
        for kv_head in kv_heads.clone() {
            ahead(following, kv_head);
            let rows = &block[kv_head * hd..];
            let w = |h: usize| &scores[h * n_pos + p0..h * n_pos + p0 + n];
            for g0 in (0..group).step_by(4) {
                // Local head numbers: row of `scores`, and place in `out`.
                let h0 = kv_head * group + g0 - first;
                let end = ((kv_head + 1) * group - first).min(h0 + 4);
                let outs = &mut out[h0 * hd..end * hd];
                match group - g0 {
                    1 => axpy_rows(w(h0), rows, tf, outs),
                    2 => axpy_rows_n([0, 1].map(|g| w(h0 + g)), rows, tf, split_rows(outs, hd)),
                    3 => axpy_rows_n([0, 1, 2].map(|g| w(h0 + g)), rows, tf, split_rows(outs, hd)),
                    _ => axpy_rows_n(
                        [0, 1, 2, 3].map(|g| w(h0 + g)),
                        rows,
                        tf,
                        split_rows(outs, hd),
                    ),
                }
            }
        }
    }
}

/// The K or V vectors (all KV heads) of the `n` positions from `p0` (a block boundary) on,
/// back to back, from the one block that holds them: slices never span blocks, since blocks a
/// transfer holds may be in use on another thread (`ferry_arena::access`).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefill run (scores as tiles of many queries) gives every token the bits it gets
    /// alone, for runs cut at block boundaries and not, and GQA groups of 1 and 3.
    #[test]
    fn a_run_of_tokens_gives_the_bits_of_each_token_alone() {
        // Head sizes 8 (below one vector) and 80 (vectors of 16 and a 64-wide tile, with
        // columns left over); groups of 3 and 1, so V sums run four rows at a time and alone.
        // Tokens `stride` positions apart: 1 makes runs; more, or one token, makes a decode
        // step's single-token runs, which few enough are split by KV head.
        for (n_heads, n_kv_heads, first, len, head_dim, stride) in [
            (6, 2, 0usize, 21usize, 8usize, 1usize),
            (4, 4, 5, 16, 8, 1),
            (6, 2, 11, 37, 8, 1),
            (6, 2, 3, 19, 80, 1),
            (4, 4, 0, 9, 80, 1),
            (6, 2, 17, 1, 8, 1),
            (6, 2, 9, 1, 80, 1),
            (6, 2, 2, 3, 80, 7),
            (4, 4, 0, 5, 8, 3),
            (4, 1, 6, 2, 8, 5),
        ] {
            let layout = KvLayout {
                n_layers: 1,
                n_kv_heads,
                head_dim,
                block_size: 4,
                aux_floats: 0,
            };
            let positions: Vec<usize> = (0..len).map(|t| first + t * stride).collect();
            let n_pos = positions[len - 1] + 1;
            let n_blocks = n_pos.div_ceil(4);
            let mut arena = KvArena::new(layout, n_blocks + 3);
            // Blocks out of order, as a real table has them.
            let table: Vec<BlockId> = (0..n_blocks)
                .rev()
                .map(|b| BlockId((b + 2) as u32))
                .collect();
            let mut s = 7u32;
            let mut next = || {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) - 0.5
            };
            let tf = layout.token_floats();
            for p in 0..n_pos {
                let slot = table[p / 4].index() * 4 + p % 4;
                let (k, v): (Vec<f32>, Vec<f32>) = (0..tf).map(|_| (next(), next())).unzip();
                write_kv(&mut arena, 0, slot, &k, &v);
            }
            let width = n_heads * head_dim;
            let q: Vec<f32> = (0..len * width).map(|_| next()).collect();
            let queries: Vec<AttnQuery<'_>> = positions
                .iter()
                .map(|&pos| AttnQuery {
                    pos,
                    block_table: &table,
                })
                .collect();
            let mut together = vec![0.0f32; len * width];
            paged_attention(&arena, &layout, 0, n_heads, &queries, &q, &mut together);
            for (t, query) in queries.iter().enumerate() {
                let mut alone = vec![0.0f32; width];
                let qt = &q[t * width..(t + 1) * width];
                let all = 0..n_kv_heads;
                attend_token(&arena, &layout, 0, n_heads, query, qt, &mut alone, all);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&together[t * width..(t + 1) * width]),
                    bits(&alone),
                    "heads {n_heads}/{n_kv_heads} of {head_dim}, token {t} of {len} from {first} by {stride}"
                );
                assert!(alone.iter().any(|&v| v != 0.0));
            }
        }
    }
}
