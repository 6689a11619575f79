//! Decode attention alone, at the default model's shapes (30 layers, 9 query heads on 3 KV
//! heads of 64): `cargo run --release -p ferry-model --example attn_speed` prints ms per
//! step and GB/s of K and V read for 64 sequences of 144 positions each, their blocks
//! interleaved over the arena as decode appends them, and the same step with every sequence
//! reading one sequence's blocks (its KV stays in cache: the compute cost alone).

use ferry_core::BlockId;
use std::time::Instant;

use ferry_arena::{KvArena, KvLayout};
use ferry_model::llama::attention::{paged_attention, AttnQuery};

const SEQS: usize = 64;
const CONTEXT: usize = 144;
const N_HEADS: usize = 9;

/// Best of 8 steps (every layer once), in seconds.
fn step_s(arena: &KvArena, layout: &KvLayout, tables: &[Vec<BlockId>]) -> f64 {
    let queries: Vec<AttnQuery<'_>> = tables
        .iter()
        .map(|t| AttnQuery {
            pos: CONTEXT - 1,
            block_table: t,
        })
        .collect();
    let width = N_HEADS * layout.head_dim;
    let q: Vec<f32> = (0..SEQS * width).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut out = vec![0.0f32; SEQS * width];
    let mut best = f64::INFINITY;
    for _ in 0..8 {
        let t = Instant::now();
        for layer in 0..layout.n_layers {
            paged_attention(arena, layout, layer, N_HEADS, &queries, &q, &mut out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let layout = KvLayout {
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        aux_floats: 0,
    };
    let per_seq = CONTEXT.div_ceil(layout.block_size);
    let mut arena = KvArena::new(layout, SEQS * per_seq);
    let mut s = 1u32;
    for b in 0..SEQS * per_seq {
        for v in arena.block_mut(BlockId(b as u32)) {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            *v = (s as f32 / u32::MAX as f32) - 0.5;
        }
    }
    let bytes = (SEQS * CONTEXT * layout.n_layers * 2 * layout.token_floats() * 4) as f64;
    let report = |what: &str, tables: &[Vec<BlockId>]| {
        let s = step_s(&arena, &layout, tables);
        println!(
            "{what}: {:6.2} ms per step, {:5.1} GB/s of K and V",
            s * 1e3,
            bytes / s / 1e9
        );
    };
    let own: Vec<Vec<BlockId>> = (0..SEQS)
        .map(|q| {
            (0..per_seq)
                .map(|b| BlockId((b * SEQS + q) as u32))
                .collect()
        })
        .collect();
    report("64 sequences, each its own blocks", &own);
    let shared: Vec<Vec<BlockId>> = (0..SEQS)
        .map(|_| BlockId::list(0..per_seq as u32))
        .collect();
    report("64 sequences, one's blocks (cached)", &shared);
}
