//! Test helpers shared by the `model_*` tests: hand-built step plans over shuffled,
//! non-contiguous block tables, and a dense naive reference forward in f64.

#![allow(dead_code)]

use ferry_arena::KvArena;
use std::collections::BTreeMap;

use ferry_core::{
    BlockId, LoraId, ReqIdx, SampleSpec, SamplerSpec, ScheduledReq, StepPlan, TokenId,
};
use ferry_model::random_model::SplitMix64;
use ferry_model::{Executor, LlamaConfig, LlamaModel, Logits, RopeScaling, WeightStore};

/// A request as the tests drive it: its tokens, how many have KV, and its block table.
#[derive(Debug, Clone)]
pub struct Seq {
    pub req: ReqIdx,
    pub tokens: Vec<u32>,
    pub computed: usize,
    pub table: Vec<BlockId>,
    /// The LoRA adapter the request runs under.
    pub lora: Option<LoraId>,
}

impl Seq {
    pub fn new(id: u32, tokens: Vec<u32>) -> Self {
        Self {
            req: ReqIdx(id),
            tokens,
            computed: 0,
            table: Vec::new(),
            lora: None,
        }
    }
}

/// Hands out block ids in a seeded random order, never block 0 (the null block).
#[derive(Debug)]
pub struct Pool {
    free: Vec<BlockId>,
    pub block_size: usize,
}

impl Pool {
    pub fn new(n_blocks: usize, block_size: usize, seed: u64) -> Self {
        let mut free: Vec<BlockId> = (1..n_blocks as u32).map(BlockId).collect();
        let mut rng = SplitMix64(seed);
        for i in (1..free.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            free.swap(i, j);
        }
        Self { free, block_size }
    }

    /// Makes `seq`'s table cover `positions` positions.
    pub fn grow(&mut self, seq: &mut Seq, positions: usize) {
        while seq.table.len() * self.block_size < positions {
            seq.table
                .push(self.free.pop().expect("test pool is large enough"));
        }
    }
}

/// One step: `counts[i]` new tokens of `seqs[i]` (0 = not scheduled). A request samples when
/// the step reaches its last known token.
pub fn build_plan(pool: &mut Pool, seqs: &mut [&mut Seq], counts: &[usize]) -> StepPlan {
    let mut plan = StepPlan {
        block_size: pool.block_size,
        ..StepPlan::default()
    };
    for (seq, &count) in seqs.iter_mut().zip(counts) {
        if count == 0 {
            continue;
        }
        let end = seq.computed + count;
        pool.grow(seq, end);
        let t0 = plan.token_ids.len();
        plan.token_ids
            .extend(TokenId::from_raw_slice(&seq.tokens[seq.computed..end]));
        let b0 = plan.block_tables.len();
        plan.block_tables.extend(&seq.table);
        let sample = (end == seq.tokens.len()).then(|| SampleSpec {
            params: SamplerSpec::default(),
            output_idx: 0,
            mask: None,
            adjust: None,
        });
        plan.reqs.push(ScheduledReq {
            lora: seq.lora,
            req: seq.req,
            start_pos: seq.computed,
            tokens: t0..plan.token_ids.len(),
            blocks: b0..plan.block_tables.len(),
            sample,
        });
    }
    plan
}

/// Runs one step through [`LlamaModel::forward`] and marks the tokens computed.
pub fn step(
    model: &mut LlamaModel,
    kv: &mut KvArena,
    pool: &mut Pool,
    seqs: &mut [&mut Seq],
    counts: &[usize],
) -> Logits {
    let plan = build_plan(pool, seqs, counts);
    let logits = model.forward(&plan, kv).expect("valid plan");
    for (seq, &count) in seqs.iter_mut().zip(counts) {
        seq.computed += count;
    }
    logits
}

pub fn arena_for(model: &LlamaModel, n_blocks: usize, block_size: usize) -> KvArena {
    KvArena::new(model.kv_layout(block_size), n_blocks)
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

// ---------------------------------------------------------------------------------------
// Dense naive reference: no paging, no fusion, plain loops in f64, straight from the HF names.

fn t<'a>(w: &'a WeightStore, name: &str) -> &'a [f32] {
    &w.get(name)
        .unwrap_or_else(|| panic!("reference: missing {name}"))
        .data
}

/// `x · Wᵀ (+ b)` with `W` as `[out, in]`.
fn linear(x: &[f64], w: &[f32], b: Option<&[f32]>, out_f: usize) -> Vec<f64> {
    let in_f = x.len();
    (0..out_f)
        .map(|o| {
            let s: f64 = (0..in_f).map(|i| x[i] * w[o * in_f + i] as f64).sum();
            s + b.map_or(0.0, |b| b[o] as f64)
        })
        .collect()
}

/// A LoRA adapter as the reference computes it: by module path
/// (`model.layers.0.self_attn.q_proj`), its `A` (`[r, in]`), `B` (`[out, r]`) and scale.
#[derive(Debug, Clone, Default)]
pub struct RefLora {
    pub modules: BTreeMap<String, (Vec<f32>, Vec<f32>, f64)>,
}

impl RefLora {
    /// From PEFT-named tensors (`base_model.model.{path}.lora_A.weight`), each module's scale
    /// given by `scale(path, rank)`.
    pub fn from_peft(
        tensors: &[(String, ferry_model::Tensor)],
        scale: impl Fn(&str, usize) -> f64,
    ) -> Self {
        let mut modules = BTreeMap::new();
        for (name, a) in tensors {
            let Some(path) = name
                .strip_prefix("base_model.model.")
                .and_then(|n| n.strip_suffix(".lora_A.weight"))
            else {
                continue;
            };
            let b_name = format!("base_model.model.{path}.lora_B.weight");
            let (_, b) = tensors.iter().find(|(n, _)| *n == b_name).unwrap();
            let s = scale(path, a.shape[0]);
            modules.insert(path.to_owned(), (a.data.clone(), b.data.clone(), s));
        }
        Self { modules }
    }
}

/// [`linear`] of the module at `path`, plus its adapter's `scale · B·(A·x)` when it has one.
fn adapted(
    lora: &RefLora,
    path: &str,
    x: &[f64],
    (w, b): (&[f32], Option<&[f32]>),
    out_f: usize,
) -> Vec<f64> {
    let mut y = linear(x, w, b, out_f);
    if let Some((a, bm, scale)) = lora.modules.get(path) {
        let r = a.len() / x.len();
        let t = linear(x, a, None, r);
        let d = linear(&t, bm, None, out_f);
        y.iter_mut().zip(&d).for_each(|(y, d)| *y += scale * d);
    }
    y
}

fn rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &w)| v * inv * w as f64).collect()
}

/// Rope frequencies written out again from the HF formulas (not the crate's code).
fn ref_inv_freq(c: &LlamaConfig) -> Vec<f64> {
    let d = c.head_dim as f64;
    let base: Vec<f64> = (0..c.head_dim / 2)
        .map(|i| (c.rope_theta as f64).powf(-(2.0 * i as f64) / d))
        .collect();
    match &c.rope_scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / *factor as f64).collect(),
        Some(RopeScaling::Factors { factors }) => base
            .iter()
            .zip(factors)
            .map(|(f, &d)| f / d as f64)
            .collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let (factor, lo, hi, old) = (
                *factor as f64,
                *low_freq_factor as f64,
                *high_freq_factor as f64,
                *original_max_position_embeddings as f64,
            );
            base.iter()
                .map(|&f| {
                    let wl = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wl > old / lo { f / factor } else { f };
                    let smooth = (old / wl - lo) / (hi - lo);
                    let medium = wl >= old / hi && wl <= old / lo;
                    if medium {
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}

fn ref_rope(head: &mut [f64], pos: usize, inv_freq: &[f64]) {
    let half = head.len() / 2;
    let orig = head.to_vec();
    for i in 0..half {
        let (c, s) = (
            (pos as f64 * inv_freq[i]).cos(),
            (pos as f64 * inv_freq[i]).sin(),
        );
        head[i] = orig[i] * c - orig[i + half] * s;
        head[i + half] = orig[i + half] * c + orig[i] * s;
    }
}

/// Logits (f64) at every position of `tokens`, computed densely.
pub fn reference_logits(c: &LlamaConfig, w: &WeightStore, tokens: &[u32]) -> Vec<Vec<f64>> {
    reference_logits_lora(c, w, &RefLora::default(), tokens)
}

/// [`reference_logits`] with the adapter `lora` (an empty one: the base model).
pub fn reference_logits_lora(
    c: &LlamaConfig,
    w: &WeightStore,
    lora: &RefLora,
    tokens: &[u32],
) -> Vec<Vec<f64>> {
    let (h, hd, nh, nkv) = (
        c.hidden_size,
        c.head_dim,
        c.num_attention_heads,
        c.num_key_value_heads,
    );
    let eps = c.rms_norm_eps as f64;
    let inv_freq = ref_inv_freq(c);
    let embed = t(w, "model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&tok| {
            embed[tok as usize * h..(tok as usize + 1) * h]
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let bias = |m: &str| {
            c.attention_bias
                .then(|| t(w, &format!("{p}.self_attn.{m}.bias")))
        };
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let n = rms(x, t(w, &format!("{p}.input_layernorm.weight")), eps);
            let proj = |m: &str, out_f: usize| {
                let path = format!("{p}.self_attn.{m}");
                let weight = t(w, &format!("{path}.weight"));
                adapted(lora, &path, &n, (weight, bias(m)), out_f)
            };
            let mut q = proj("q_proj", nh * hd);
            let mut k = proj("k_proj", nkv * hd);
            let v = proj("v_proj", nkv * hd);
            if c.qk_norm_whole {
                for (part, norm) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                    let normed = rms(part, t(w, &format!("{p}.self_attn.{norm}.weight")), eps);
                    part.copy_from_slice(&normed);
                }
            }
            let mut v = v;
            if let Some(clip) = c.clip_qkv {
                for part in [&mut q, &mut k, &mut v] {
                    part.iter_mut()
                        .for_each(|x| *x = x.clamp(-clip as f64, clip as f64));
                }
            }
            for (heads, norm) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                for head in heads.chunks_mut(hd) {
                    if c.qk_norm && !c.qk_norm_whole {
                        let normed = rms(head, t(w, &format!("{p}.self_attn.{norm}.weight")), eps);
                        head.copy_from_slice(&normed);
                    }
                    ref_rope(head, pos, &inv_freq);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0.0f64; nh * hd];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let q = &qs[pos][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][g * hd..(g + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for d in 0..hd {
                        attn[head * hd + d] += ej / sum * vs[j][g * hd + d];
                    }
                }
            }
            let o = adapted(
                lora,
                &format!("{p}.self_attn.o_proj"),
                &attn,
                (
                    t(w, &format!("{p}.self_attn.o_proj.weight")),
                    c.o_proj_bias
                        .then(|| t(w, &format!("{p}.self_attn.o_proj.bias"))),
                ),
                h,
            );
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let n = rms(
                x,
                t(w, &format!("{p}.post_attention_layernorm.weight")),
                eps,
            );
            let d = match c.sparse_layer(l) {
                None => ref_mlp_lora(
                    w,
                    lora,
                    &n,
                    &format!("{p}.mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                ),
                Some(moe) => ref_moe(w, &n, &p, moe),
            };
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    let head = if c.tie_word_embeddings {
        embed
    } else {
        t(w, "lm_head.weight")
    };
    xs.iter()
        .map(|x| {
            linear(
                &rms(x, t(w, "model.norm.weight"), eps),
                head,
                None,
                c.vocab_size,
            )
        })
        .collect()
}

/// A SiLU-gated MLP whose gate, up and down projections are `{prefix}.{names}.weight`.
fn ref_mlp(w: &WeightStore, n: &[f64], prefix: &str, names: [&str; 3]) -> Vec<f64> {
    ref_mlp_lora(w, &RefLora::default(), n, prefix, names)
}

/// [`ref_mlp`] with the adapter `lora` on its projections.
fn ref_mlp_lora(
    w: &WeightStore,
    lora: &RefLora,
    n: &[f64],
    prefix: &str,
    names: [&str; 3],
) -> Vec<f64> {
    let [g, u, d] = names.map(|m| format!("{prefix}.{m}"));
    let inter = w.get(&format!("{g}.weight")).unwrap().shape[0];
    let proj = |path: &str, x: &[f64], out_f: usize| {
        adapted(
            lora,
            path,
            x,
            (t(w, &format!("{path}.weight")), None),
            out_f,
        )
    };
    let gate = proj(&g, n, inter);
    let up = proj(&u, n, inter);
    let act: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    proj(&d, &act, n.len())
}

/// The MoE block from the formulas: softmax over the router logits, the top-k experts
/// (renormalised when asked), their MLPs weighted and summed, plus Qwen2-MoE's gated
/// shared expert.
fn ref_moe(w: &WeightStore, n: &[f64], p: &str, moe: &ferry_model::MoeConfig) -> Vec<f64> {
    let (block, hidden) = (moe.naming.block(), n.len());
    let logits = linear(
        n,
        t(w, &format!("{p}.{block}.gate.weight")),
        None,
        moe.num_experts,
    );
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut order: Vec<usize> = (0..moe.num_experts).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    let picked = &order[..moe.top_k];
    let total: f64 = picked.iter().map(|&x| e[x] / sum).sum();
    let mut out = vec![0.0; hidden];
    for &x in picked {
        let mut weight = e[x] / sum;
        if moe.norm_topk_prob {
            weight /= total;
        }
        let names = moe.naming.expert(x);
        let [g, u, d] = names.map(|name| name.rsplit_once(".weight").unwrap().0.to_string());
        let g = g.rsplit('.').next().unwrap().to_string();
        let u = u.rsplit('.').next().unwrap().to_string();
        let d = d.rsplit('.').next().unwrap().to_string();
        let y = ref_mlp(w, n, &format!("{p}.{block}.experts.{x}"), [&g, &u, &d]);
        out.iter_mut().zip(&y).for_each(|(o, y)| *o += weight * y);
    }
    if moe.shared_expert_intermediate_size.is_some() {
        let y = ref_mlp(
            w,
            n,
            &format!("{p}.mlp.shared_expert"),
            ["gate_proj", "up_proj", "down_proj"],
        );
        let g = linear(
            n,
            t(w, &format!("{p}.mlp.shared_expert_gate.weight")),
            None,
            1,
        )[0];
        let scale = 1.0 / (1.0 + (-g).exp());
        out.iter_mut().zip(&y).for_each(|(o, y)| *o += scale * y);
    }
    out
}

/// `|got - want| <= tol * max|want|` over a row: relative to the row's scale, so near-zero
/// logits do not demand impossible precision.
pub fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / scale;
        assert!(
            err <= tol,
            "{what}: index {i}: got {g}, want {w} (relative error {err:e} > {tol:e})"
        );
    }
}
