//! LoRA in the forward: after each fused matmul (and its bias), the rows of requests under an
//! adapter get `scale · B·(A·x)` added to the columns of each module the adapter targets,
//! composed from the dense layer's kernel ([`matmul`] over f32 matrices).
//!
//! The step's rows are grouped by adapter (ascending [`ferry_core::LoraId`], rows ascending), so each
//! adapter's `A` and `B` are read once per matmul per step whatever the number of its rows;
//! `A·x` for every part of a fused site is one matmul over the stacked `A`s.
//!
//! Batch invariance: every element of `A·x` and `B·t` is one dot product in the kernels'
//! fixed order, whatever other rows share the matmul, and each output element then takes one
//! multiply (by the scale) and one add. So a row's bits depend on its own activations and
//! adapter only: alone, in a batch mixing adapters, or in any chunk of its prompt. Rows
//! without an adapter are not touched.

use std::sync::Arc;

use crate::kernels::matmul;
use crate::lora::{LoraAdapter, Site};
use crate::profile::{timed, Phase};

/// The rows of one step computed under one adapter.
#[derive(Debug)]
pub(super) struct LoraGroup {
    pub adapter: Arc<LoraAdapter>,
    /// Step token indexes, ascending.
    pub rows: Vec<usize>,
}

/// Buffers of the LoRA additions, kept across layers and steps.
#[derive(Debug, Default)]
pub(super) struct LoraScratch {
    /// A group's activation rows, gathered.
    x: Vec<f32>,
    /// `A·x` for the site's stacked `A`.
    t: Vec<f32>,
    /// One part's columns of `t`.
    t_part: Vec<f32>,
    /// `B·t` of one part.
    u: Vec<f32>,
}

/// Adds every group's adapter delta at `site` of layer `layer` to `y` (`n × out_w`, the
/// site's fused output after its bias), from the site's input `x` (`n × in_w`).
pub(super) fn add_deltas(
    groups: &[LoraGroup],
    layer: usize,
    site: Site,
    (x, in_w): (&[f32], usize),
    (y, out_w): (&mut [f32], usize),
    s: &mut LoraScratch,
) {
    if !groups.is_empty() {
        timed(Phase::LayerMatmuls, || {
            each_group(groups, layer, site, (x, in_w), (y, out_w), s)
        });
    }
}

fn each_group(
    groups: &[LoraGroup],
    layer: usize,
    site: Site,
    (x, in_w): (&[f32], usize),
    (y, out_w): (&mut [f32], usize),
    s: &mut LoraScratch,
) {
    for g in groups {
        let Some(lora) = g.adapter.site(layer, site) else {
            continue;
        };
        let m = g.rows.len();
        let first = g.rows[0];
        let xs: &[f32] = if g.rows[m - 1] - first + 1 == m {
            // One contiguous run (a single request): read it in place.
            &x[first * in_w..(first + m) * in_w]
        } else {
            let xs = super::take(&mut s.x, m * in_w);
            for (dst, &r) in xs.chunks_exact_mut(in_w).zip(&g.rows) {
                dst.copy_from_slice(&x[r * in_w..(r + 1) * in_w]);
            }
            xs
        };
        let ranks = lora.a.n_rows();
        let t = super::take(&mut s.t, m * ranks);
        matmul(xs, &lora.a, t, m);
        for part in &lora.parts {
            let t_part: &[f32] = if part.rank == ranks {
                t
            } else {
                let tp = super::take(&mut s.t_part, m * part.rank);
                for (dst, src) in tp.chunks_exact_mut(part.rank).zip(t.chunks_exact(ranks)) {
                    dst.copy_from_slice(&src[part.rank_start..part.rank_start + part.rank]);
                }
                tp
            };
            let w = part.b.n_rows();
            let u = super::take(&mut s.u, m * w);
            matmul(t_part, &part.b, u, m);
            for (u_row, &r) in u.chunks_exact(w).zip(&g.rows) {
                let y_row = &mut y[r * out_w + part.out_start..][..w];
                for (o, &d) in y_row.iter_mut().zip(u_row) {
                    *o += d * part.scale;
                }
            }
        }
    }
}
