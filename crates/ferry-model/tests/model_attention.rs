//! Paged attention equals a plain dense attention over the same K/V: random shapes, GQA
//! ratios 1/2/4, ragged block tables of shuffled non-contiguous blocks, several query tokens
//! per request (a chunked-prefill chunk) and single decode tokens in one call.

mod model_support;

use ferry_arena::{KvArena, KvLayout};
use ferry_core::BlockId;
use ferry_model::llama::attention::{paged_attention, write_kv, AttnQuery};
use ferry_model::random_model::SplitMix64;
use model_support::Pool;

struct Req {
    table: Vec<BlockId>,
    /// `len × n_kv_heads × head_dim`, dense.
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
    /// Query tokens are the last `n_queries` positions.
    n_queries: usize,
}

fn rand_vec(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
}

/// Dense causal attention of one query head vector over positions `0..=pos`, in f64.
fn dense(q: &[f32], r: &Req, pos: usize, kv_head: usize, layout: &KvLayout) -> Vec<f64> {
    let hd = layout.head_dim;
    let tf = layout.token_floats();
    let at = |buf: &[f32], p: usize| -> Vec<f64> {
        buf[p * tf + kv_head * hd..p * tf + (kv_head + 1) * hd]
            .iter()
            .map(|&x| x as f64)
            .collect()
    };
    let scores: Vec<f64> = (0..=pos)
        .map(|p| {
            q.iter()
                .zip(at(&r.k, p))
                .map(|(&a, b)| a as f64 * b)
                .sum::<f64>()
                / (hd as f64).sqrt()
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
    let mut out = vec![0.0; hd];
    for (p, s) in scores.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(at(&r.v, p)) {
            *o += (s - max).exp() / sum * v;
        }
    }
    out
}

fn check_case(seed: u64, n_kv_heads: usize, group: usize, head_dim: usize, block_size: usize) {
    let mut rng = SplitMix64(seed);
    let layout = KvLayout {
        n_layers: 3,
        n_kv_heads,
        head_dim,
        block_size,
        aux_floats: 0,
    };
    let n_heads = n_kv_heads * group;
    let n_blocks = 200;
    let mut kv = KvArena::new(layout, n_blocks);
    let mut pool = Pool::new(n_blocks, block_size, seed);
    let layer = (seed % 3) as usize;
    let tf = layout.token_floats();
    let n_reqs = 1 + (rng.next_u64() % 4) as usize;
    let mut reqs = Vec::new();
    for _ in 0..n_reqs {
        let len = 1 + (rng.next_u64() % 40) as usize;
        let n_queries = if rng.next_u64().is_multiple_of(2) {
            1
        } else {
            1 + (rng.next_u64() % len as u64) as usize
        };
        let mut seq = model_support::Seq::new(0, Vec::new());
        pool.grow(&mut seq, len);
        let r = Req {
            table: seq.table,
            k: rand_vec(&mut rng, len * tf),
            v: rand_vec(&mut rng, len * tf),
            len,
            n_queries,
        };
        for p in 0..len {
            let slot = r.table[p / block_size].index() * block_size + p % block_size;
            write_kv(&mut kv, layer, slot, &r.k[p * tf..], &r.v[p * tf..]);
        }
        reqs.push(r);
    }
    let queries: Vec<AttnQuery<'_>> = reqs
        .iter()
        .flat_map(|r| {
            (r.len - r.n_queries..r.len).map(|pos| AttnQuery {
                pos,
                block_table: &r.table,
            })
        })
        .collect();
    let width = n_heads * head_dim;
    let q = rand_vec(&mut rng, queries.len() * width);
    let mut out = vec![f32::NAN; q.len()];
    paged_attention(&kv, &layout, layer, n_heads, &queries, &q, &mut out);

    let owners = reqs
        .iter()
        .flat_map(|r| std::iter::repeat_n(r, r.n_queries));
    for (t, (query, r)) in queries.iter().zip(owners).enumerate() {
        for h in 0..n_heads {
            let qh = &q[t * width + h * head_dim..t * width + (h + 1) * head_dim];
            let want = dense(qh, r, query.pos, h / group, &layout);
            let got = &out[t * width + h * head_dim..t * width + (h + 1) * head_dim];
            for (d, (&g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() < 1e-5,
                    "seed {seed} kv_heads {n_kv_heads} group {group} hd {head_dim} bs {block_size}: token {t} head {h} dim {d}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn paged_attention_equals_dense_attention() {
    let mut seed = 0;
    for group in [1, 2, 4] {
        for (n_kv_heads, head_dim, block_size) in [(1, 8, 1), (2, 16, 4), (3, 12, 5), (2, 64, 16)] {
            for _ in 0..3 {
                seed += 1;
                check_case(seed, n_kv_heads, group, head_dim, block_size);
            }
        }
    }
}

/// Attention must read through the table: a corrupted slot of one request changes its
/// output, and only its output.
#[test]
fn attention_reads_only_through_the_block_table() {
    let layout = KvLayout {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 8,
        block_size: 2,
        aux_floats: 0,
    };
    let mut kv = KvArena::new(layout, 8);
    let mut rng = SplitMix64(7);
    let (ta, tb): (Vec<BlockId>, Vec<BlockId>) = (BlockId::list([5, 2]), BlockId::list([3, 6]));
    for (table, n) in [(&ta, 4), (&tb, 3)] {
        for p in 0..n {
            let (k, v) = (rand_vec(&mut rng, 8), rand_vec(&mut rng, 8));
            write_kv(&mut kv, 0, table[p / 2].index() * 2 + p % 2, &k, &v);
        }
    }
    let queries = [
        AttnQuery {
            pos: 3,
            block_table: &ta,
        },
        AttnQuery {
            pos: 2,
            block_table: &tb,
        },
    ];
    let q = rand_vec(&mut rng, 16);
    let run = |kv: &KvArena| {
        let mut out = vec![0.0; 16];
        paged_attention(kv, &layout, 0, 1, &queries, &q, &mut out);
        out
    };
    let before = run(&kv);
    // Block 2 slot 1 is position 3 of request A; its V plane starts after the K plane.
    let v_at = 2 * layout.block_floats() + layout.plane_offset(0, true) + layout.token_floats();
    kv.as_mut_slice()[v_at] += 1.0;
    let after = run(&kv);
    assert_ne!(
        before[..8],
        after[..8],
        "A reads its position 3 from block 2"
    );
    assert_eq!(before[8..], after[8..], "B never reads block 2");
}
