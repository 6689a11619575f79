//! The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral), composed from the
//! dense layer's kernels: the router is a matmul, each expert is the dense MLP's two
//! matmuls and `silu_mul` over the rows of the tokens routed to it.
//!
//! Routing as transformers computes it: softmax of the router logits in f32, the top-k
//! probabilities (best first; equal probabilities go to the lowest expert id, as
//! `torch.topk` picks them), renormalised to sum to 1 when `norm_topk_prob` says so. Each
//! token's output is the sum, from 0.0 in ascending expert id (the order transformers'
//! `index_add_` loop adds them in), of each picked expert's output times its weight.
//!
//! Batch invariance: the router row and each expert row are the same dot products whatever
//! other rows share the matmul (see [`crate::kernels`]), and a token's sum has one order, so
//! a token's output has the same bits alone, in a batch, or in any chunk of its prompt.

use crate::config::MoeConfig;
use crate::kernels::{matmul, silu_mul};
use crate::profile::{timed, Phase};
use crate::weights::llama::LayerWeights;

/// Buffers of the MoE block, kept across layers and steps.
#[derive(Debug, Default)]
pub(super) struct MoeScratch {
    logits: Vec<f32>,
    /// One token's router probabilities ([`route`]).
    probs: Vec<f32>,
    /// Per token, its `top_k` picks `(expert, weight)`, best first.
    picks: Vec<(u32, f32)>,
    /// Every pick as `(token, weight)`, grouped by expert (tokens ascending in each), and
    /// where each expert's group starts (`n_experts + 1` offsets).
    by_expert: Vec<(usize, f32)>,
    starts: Vec<usize>,
    /// The rows routed to one expert.
    rows: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
    shared: Vec<f32>,
    shared_gate: Vec<f32>,
}

/// Where the block writes each token's picks: `ids[t * width + row * top_k ..][..top_k]`
/// (`row`: the layer's, [`ferry_core::RoutingShape`]).
pub(super) struct RoutingOut<'a> {
    pub ids: &'a mut [u16],
    pub width: usize,
    pub row: usize,
}

/// The MoE MLP of layer weights `lw` on the normed rows `normed` (`n × hidden`), into `out`
/// (`n × hidden`, overwritten); each token's picks into `routing` when given.
pub(super) fn moe_block(
    moe: &MoeConfig,
    lw: &LayerWeights,
    normed: &[f32],
    hidden: usize,
    s: &mut MoeScratch,
    out: &mut [f32],
    routing: Option<RoutingOut<'_>>,
) {
    let n = normed.len() / hidden;
    let (n_experts, k) = (moe.num_experts, moe.top_k);
    let router = lw.router.as_ref().expect("an MoE layer has a router");
    let logits = super::take(&mut s.logits, n * n_experts);
    timed(Phase::LayerMatmuls, || matmul(normed, router, logits, n));
    s.picks.clear();
    for row in logits.chunks_exact(n_experts) {
        route(row, k, moe.norm_topk_prob, &mut s.probs, &mut s.picks);
    }
    if let Some(r) = routing {
        for (t, picks) in s.picks.chunks_exact(k).enumerate() {
            let dst = &mut r.ids[t * r.width + r.row * k..][..k];
            for (d, &(e, _)) in dst.iter_mut().zip(picks) {
                *d = e as u16;
            }
        }
    }

    group_by_expert(&s.picks, k, n_experts, &mut s.starts, &mut s.by_expert);
    out.fill(0.0);
    let inter = moe.expert_intermediate_size;
    for (e, expert) in lw.experts.iter().enumerate() {
        let tokens = &s.by_expert[s.starts[e]..s.starts[e + 1]];
        let m = tokens.len();
        if m == 0 {
            continue;
        }
        let rows = super::take(&mut s.rows, m * hidden);
        for (dst, &(t, _)) in rows.chunks_exact_mut(hidden).zip(tokens) {
            dst.copy_from_slice(&normed[t * hidden..(t + 1) * hidden]);
        }
        let gate_up = super::take(&mut s.gate_up, m * 2 * inter);
        let act = super::take(&mut s.act, m * inter);
        let y = super::take(&mut s.y, m * hidden);
        timed(Phase::LayerMatmuls, || {
            matmul(rows, &expert.gate_up, gate_up, m);
            silu_mul(gate_up, inter, act);
            matmul(act, &expert.down, y, m);
        });
        for (y_row, &(t, w)) in y.chunks_exact(hidden).zip(tokens) {
            for (o, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(y_row) {
                *o += v * w;
            }
        }
    }

    // Qwen2-MoE: out + sigmoid(shared_gate · x) · shared_expert(x).
    if let (Some(gate), Some(s_inter)) = (&lw.shared_gate, moe.shared_expert_intermediate_size) {
        let gate_up = super::take(&mut s.gate_up, n * 2 * s_inter);
        let act = super::take(&mut s.act, n * s_inter);
        let shared = super::take(&mut s.shared, n * hidden);
        let g = super::take(&mut s.shared_gate, n);
        timed(Phase::LayerMatmuls, || {
            matmul(normed, &lw.gate_up, gate_up, n);
            silu_mul(gate_up, s_inter, act);
            matmul(act, &lw.down, shared, n);
            matmul(normed, gate, g, n);
        });
        for ((o_row, s_row), &g) in out
            .chunks_exact_mut(hidden)
            .zip(shared.chunks_exact(hidden))
            .zip(g.iter())
        {
            let scale = 1.0 / (1.0 + (-g).exp());
            for (o, &v) in o_row.iter_mut().zip(s_row) {
                *o += scale * v;
            }
        }
    }
}

/// Every token's picks (`k` a token) as `(token, weight)` grouped by expert, tokens
/// ascending in each group (a counting sort: one pass to count, one to place), into
/// `by_expert`, with expert `e`'s group at `starts[e]..starts[e + 1]`.
fn group_by_expert(
    picks: &[(u32, f32)],
    k: usize,
    n_experts: usize,
    starts: &mut Vec<usize>,
    by_expert: &mut Vec<(usize, f32)>,
) {
    starts.clear();
    starts.resize(n_experts + 1, 0);
    for &(e, _) in picks {
        starts[e as usize + 1] += 1;
    }
    for e in 0..n_experts {
        starts[e + 1] += starts[e];
    }
    by_expert.clear();
    by_expert.resize(picks.len(), (0, 0.0));
    let mut next = starts[..n_experts].to_vec();
    for (t, token_picks) in picks.chunks_exact(k).enumerate() {
        for &(e, w) in token_picks {
            by_expert[next[e as usize]] = (t, w);
            next[e as usize] += 1;
        }
    }
}

/// One token's routing: appends its `k` picks `(expert, weight)`, best first, to `picks`
/// (`probs`: a buffer for its router probabilities).
pub(crate) fn route(
    logits: &[f32],
    k: usize,
    normalise: bool,
    probs: &mut Vec<f32>,
    picks: &mut Vec<(u32, f32)>,
) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    probs.clear();
    probs.extend(logits.iter().map(|&l| (l - max).exp()));
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    let start = picks.len();
    for _ in 0..k {
        // The highest probability not yet picked; the first (lowest id) of equal ones.
        let mut best: Option<(usize, f32)> = None;
        for (e, &p) in probs.iter().enumerate() {
            let taken = picks[start..].iter().any(|&(q, _)| q as usize == e);
            if !taken && best.is_none_or(|(_, b)| p > b) {
                best = Some((e, p));
            }
        }
        let (e, p) = best.expect("top_k is at most the number of experts");
        picks.push((e as u32, p));
    }
    if normalise {
        let total: f32 = picks[start..].iter().map(|p| p.1).sum();
        for p in &mut picks[start..] {
            p.1 /= total;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routing_picks_the_highest_probabilities_and_breaks_ties_to_the_lowest_id() {
        let mut picks = Vec::new();
        route(
            &[0.5, 2.0, 2.0, -1.0, 3.0],
            3,
            false,
            &mut Vec::new(),
            &mut picks,
        );
        let ids: Vec<u32> = picks.iter().map(|p| p.0).collect();
        assert_eq!(ids, [4, 1, 2]);
        let sum: f32 = [0.5f32, 2.0, 2.0, -1.0, 3.0]
            .iter()
            .map(|l| (l - 3.0).exp())
            .sum();
        assert_eq!(picks[0].1, 1.0 / sum);
        assert_eq!(picks[1].1, (-1.0f32).exp() / sum);

        let mut normed = Vec::new();
        route(
            &[0.5, 2.0, 2.0, -1.0, 3.0],
            2,
            true,
            &mut Vec::new(),
            &mut normed,
        );
        let total = picks[0].1 + picks[1].1;
        assert_eq!(normed, [(4, picks[0].1 / total), (1, picks[1].1 / total)]);
    }
}
