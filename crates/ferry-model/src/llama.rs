//! The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) as an [`Executor`]: one
//! forward over a mixed batch of prefill chunks and decode tokens, with paged attention over
//! the KV arena.
//!
//! Every stage is batch invariant: matmuls compute each output element in a fixed order
//! (see [`crate::kernels`]), norms, rope and activations are per token, and attention reads
//! only the token's own request. So a request's logits have the same bits whatever else is
//! in its batch, and chunked prefill gives the same KV as one-shot prefill.
//!
//! The forward's own pieces are its submodules: paged attention over the arena ([`attention`]),
//! rotary position embeddings ([`rope`]), the MoE block (`llama/moe.rs`) and the LoRA
//! adapters' deltas (`llama/lora.rs`; the adapters themselves: [`crate::lora`]). Its weights, in the layout it reads, are
//! [`crate::weights::llama`]. Weight updates and sleep ([`crate::ModelWeights`]) live in
//! `llama/weight_ops.rs`; the checks and layout conversion that run off the engine thread in
//! [`crate::weights::llama_update`].

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_arena::{KvArena, KvLayout};
use ferry_core::{
    LoraId, ModelOutput, PromptLogprobs, ReqIdx, RoutedExperts, RoutingShape, StepPlan,
};

use crate::config::LlamaConfig;
use crate::error::ExecError;
use crate::executor::Executor;
use crate::kernels::{add_assign, matmul, rms_norm, rms_norm_in_place, rms_norm_row, silu_mul};
use crate::lora::{LoraAdapter, Site};
use crate::profile::{timed, Phase};
use crate::sampler::{prompt_token_logprob, sample_batch, LogprobsMode, SampleRow, SamplerScratch};
use crate::weights::llama::{LayerWeights, LlamaWeights, ModelError};
use crate::weights::store::WeightStore;
use crate::weights::update::WeightResidency;
use attention::{paged_attention, write_kv, AttnQuery};
use rope::Rope;

pub mod attention;
mod lora;
mod moe;
pub mod rope;
mod weight_ops;

/// Positions the rope tables cover from the start (they grow on demand).
const INITIAL_ROPE_POSITIONS: usize = 4096;

/// Prompt positions whose logits are computed at once for prompt logprobs.
const PROMPT_LOGITS_ROWS: usize = 64;

/// Logits of the sampled positions of one step: one row per scheduled request whose
/// `sample` is set, in plan order.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub vocab_size: usize,
    pub reqs: Vec<ReqIdx>,
    /// `reqs.len() × vocab_size`, row-major.
    pub data: Vec<f32>,
}

impl Logits {
    /// The logits row of the `i`-th sampled request.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab_size..(i + 1) * self.vocab_size]
    }
}

/// A Llama-family model ready to run steps.
#[derive(Debug)]
pub struct LlamaModel {
    config: LlamaConfig,
    weights: LlamaWeights,
    rope: Rope,
    sampler_scratch: SamplerScratch,
    /// Activation buffers kept across layers and steps: fresh multi-megabyte vectors would be
    /// mmapped and page-faulted in on every layer, which cost a third of a batch-64 step.
    scratch: Scratch,
    /// Logits rows of [`Executor::execute`], kept across steps (a batch-64 step's are 12 MB).
    logits_buf: Vec<f32>,
    /// The last forward's prompt logprobs, until `execute` returns them.
    prompt_out: Vec<PromptLogprobs>,
    /// The last forward's expert routing, until `execute` returns it.
    routed_out: Vec<RoutedExperts>,
    /// Sleep state of `weights` (see `llama/weight_ops.rs`): steps run only when `Resident`.
    residency: WeightResidency,
    /// The LoRA adapters requests may name ([`Executor::load_lora`]).
    loras: BTreeMap<LoraId, Arc<LoraAdapter>>,
}

/// The routing of every token computed, kept with its KV: in the aux words of the token's
/// arena slot ([`KvLayout::aux_floats`], two u16 ids a word), written by the forward that
/// writes its KV, so a request served from the prefix cache reads its cached positions'
/// routing back from the same blocks ([`ferry_core::RoutingRead`]), and whatever moves,
/// offloads, fences or frees a block's KV does the same to its routing (the P/D transports
/// and the offload tier copy whole blocks).
#[derive(Debug)]
struct RoutingCapture {
    /// A row per decoder layer, as vLLM and SGLang return them: layer `l`'s picks are row
    /// `l` (a dense layer's stays 0).
    shape: RoutingShape,
    /// This step's tokens' routing, `n × width`.
    step: Vec<u16>,
}

/// Per-step activation buffers, grown to the largest step seen.
#[derive(Debug, Default)]
struct Scratch {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    moe: moe::MoeScratch,
    lora: lora::LoraScratch,
    /// Expert routing capture (`--enable-return-routed-experts`), MoE models only: kept
    /// here, beside the buffers the forward writes, as the layers fill it in.
    routing: Option<RoutingCapture>,
}

/// The first `n` floats of `v`, growing it if needed. Contents are stale: every caller
/// overwrites the whole slice.
fn take(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Where each token of a step sits.
struct TokenMeta<'a> {
    queries: Vec<AttnQuery<'a>>,
    /// Arena slot (`block * block_size + offset`) of each token.
    slots: Vec<usize>,
    /// Index into the step's tokens of the last token of each request that samples.
    sample_rows: Vec<usize>,
    sample_reqs: Vec<ReqIdx>,
}

impl LlamaModel {
    /// Builds the model, checking the config and every tensor's presence and shape.
    pub fn new(config: &LlamaConfig, weights: &WeightStore) -> Result<Self, ModelError> {
        let weights = LlamaWeights::from_store(config, weights)?;
        let rope = Rope::new(
            config,
            INITIAL_ROPE_POSITIONS.min(config.max_position_embeddings.max(1)),
        );
        Ok(Self {
            config: config.clone(),
            weights,
            rope,
            sampler_scratch: SamplerScratch::default(),
            scratch: Scratch::default(),
            logits_buf: Vec::new(),
            prompt_out: Vec::new(),
            routed_out: Vec::new(),
            residency: WeightResidency::Resident,
            loras: BTreeMap::new(),
        })
    }

    /// Seeds the engine-level RNG that requests without a seed draw from (`ferry serve
    /// --seed`), so a whole run of unseeded sampled requests can be replayed.
    pub fn with_sampler_seed(mut self, engine_seed: u64) -> Self {
        let mode = self.sampler_scratch.logprobs_mode();
        self.sampler_scratch = SamplerScratch::with_seed(engine_seed);
        self.sampler_scratch.set_logprobs_mode(mode);
        self
    }

    /// Reports logprobs in `mode` (`ferry serve --logprobs-mode`) for every request.
    pub fn with_logprobs_mode(mut self, mode: LogprobsMode) -> Self {
        self.sampler_scratch.set_logprobs_mode(mode);
        self
    }

    /// Captures the expert routing of every token the forward computes and reports it in
    /// [`ModelOutput::routed`] (`ferry serve --enable-return-routed-experts`). A model with
    /// no MoE layers has no routing to capture: an error naming the flag.
    pub fn with_routed_experts(mut self, on: bool) -> Result<Self, ModelError> {
        self.set_routed_experts(on)?;
        Ok(self)
    }

    /// [`Self::with_routed_experts`] on a built model (`ferry bench model
    /// --routed-experts-cost` turns it on and off between steps). The KV layout changes with
    /// it ([`Self::kv_layout`]): each setting needs an arena of its own layout.
    pub fn set_routed_experts(&mut self, on: bool) -> Result<(), ModelError> {
        if !on {
            self.scratch.routing = None;
            return Ok(());
        }
        let Some(moe) = &self.config.moe else {
            return Err(ModelError::InvalidConfig {
                field: "--enable-return-routed-experts",
                message: format!(
                    "{} has no mixture-of-experts layers, so no routing to return",
                    self.config.architecture
                ),
            });
        };
        self.scratch.routing = Some(RoutingCapture {
            shape: RoutingShape {
                layers: self.config.num_hidden_layers,
                top_k: moe.top_k,
                num_experts: moe.num_experts,
            },
            step: Vec::new(),
        });
        Ok(())
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn weights(&self) -> &LlamaWeights {
        &self.weights
    }

    /// Replaces the weights in place (same architecture); on error the old weights stay.
    /// Like a complete install, weights dropped by sleep come back asleep until `restore`.
    pub fn replace_weights(&mut self, weights: &WeightStore) -> Result<(), ModelError> {
        self.weights = LlamaWeights::from_store(&self.config, weights)?;
        self.residency.refill();
        Ok(())
    }

    /// Runs the step: writes every scheduled token's KV into the arena and returns the logits
    /// of the requests that sample.
    pub fn forward(&mut self, plan: &StepPlan, kv: &mut KvArena) -> Result<Logits, ExecError> {
        let mut data = Vec::new();
        let reqs = self.forward_into(plan, kv, &mut data)?;
        Ok(Logits {
            vocab_size: self.config.vocab_size,
            reqs,
            data,
        })
    }

    /// [`Self::forward`] writing the logits rows into the front of `data` (grown if needed,
    /// so a caller that keeps it across steps does not fault in megabytes every step).
    /// Returns the requests the rows belong to.
    fn forward_into(
        &mut self,
        plan: &StepPlan,
        kv: &mut KvArena,
        data: &mut Vec<f32>,
    ) -> Result<Vec<ReqIdx>, ExecError> {
        if self.residency != WeightResidency::Resident {
            return Err(ExecError::WeightsUnloaded);
        }
        self.check_arena(plan, kv)?;
        let meta = self.token_meta(plan, kv.n_blocks())?;
        let loras = self.lora_groups(plan)?;
        let max_pos = meta.queries.iter().map(|q| q.pos + 1).max().unwrap_or(0);
        self.rope.ensure(max_pos);
        let h = self.config.hidden_size;
        let mut x = vec![0.0f32; plan.num_tokens() * h];
        for (row, &t) in x.chunks_exact_mut(h).zip(&plan.token_ids) {
            let t = t.index();
            self.weights.embed.row_into(t, row);
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        if let Some(r) = &mut scratch.routing {
            r.step.clear();
            r.step.resize(plan.num_tokens() * r.shape.width(), 0);
        }
        for (l, lw) in self.weights.layers.iter().enumerate() {
            self.layer(l, lw, (&meta, &loras), kv, &mut x, &mut scratch);
        }
        if let Some(r) = &mut scratch.routing {
            self.routed_out = r.record(plan, &meta.slots, kv);
        }
        self.scratch = scratch;
        self.logits(&meta.sample_rows, &x, data);
        self.prompt_out = self.prompt_logprobs(plan, &x);
        Ok(meta.sample_reqs)
    }

    /// The plan's prompt logprobs, from the residual stream `x` of the step's tokens: the
    /// head runs on the scored positions in chunks of [`PROMPT_LOGITS_ROWS`] (a long prompt's
    /// every row of logits at once would take gigabytes), apart from the sampled rows'.
    fn prompt_logprobs(&self, plan: &StepPlan, x: &[f32]) -> Vec<PromptLogprobs> {
        let vocab = self.config.vocab_size;
        let mut buf = Vec::new();
        plan.prompt_logprobs
            .iter()
            .filter_map(|w| {
                let r = plan.reqs.get(w.req_pos)?;
                let n = w.targets.len().min(r.tokens.len());
                let rows: Vec<usize> = (r.tokens.start..r.tokens.start + n).collect();
                let mut tokens = Vec::with_capacity(n);
                for (rows, targets) in rows
                    .chunks(PROMPT_LOGITS_ROWS)
                    .zip(w.targets.chunks(PROMPT_LOGITS_ROWS))
                {
                    self.logits(rows, x, &mut buf);
                    for (row, &t) in buf.chunks_exact(vocab).zip(targets) {
                        tokens.push(prompt_token_logprob(row, t, w.top_n as usize));
                    }
                }
                Some(PromptLogprobs {
                    req: r.req,
                    first_target: r.start_pos + 1,
                    tokens,
                })
            })
            .collect()
    }

    fn check_arena(&self, plan: &StepPlan, kv: &KvArena) -> Result<(), ExecError> {
        if !kv.is_allocated() {
            return Err(ExecError::ArenaReleased);
        }
        let want = self.kv_layout(plan.block_size);
        if kv.layout() != want {
            return Err(ExecError::InvalidPlan(format!(
                "arena layout {:?} does not match the model's {want:?} at block size {}",
                kv.layout(),
                plan.block_size
            )));
        }
        Ok(())
    }

    /// Validates the plan against the arena and the vocabulary, and lays out its tokens.
    fn token_meta<'p>(
        &self,
        plan: &'p StepPlan,
        n_blocks: usize,
    ) -> Result<TokenMeta<'p>, ExecError> {
        let bad = |m: String| Err(ExecError::InvalidPlan(m));
        let n = plan.num_tokens();
        if let Some(&t) = plan
            .token_ids
            .iter()
            .find(|&&t| t.index() >= self.config.vocab_size)
        {
            return bad(format!(
                "token id {t} is outside the vocabulary ({})",
                self.config.vocab_size
            ));
        }
        let mut meta = TokenMeta {
            queries: Vec::with_capacity(n),
            slots: Vec::with_capacity(n),
            sample_rows: Vec::new(),
            sample_reqs: Vec::new(),
        };
        let mut next_token = 0;
        for r in &plan.reqs {
            if r.tokens.start != next_token || r.tokens.end < r.tokens.start || r.tokens.end > n {
                return bad(format!(
                    "request {:?}: tokens {:?} are not the next range of the {n} step tokens",
                    r.req, r.tokens
                ));
            }
            next_token = r.tokens.end;
            if r.blocks.start > r.blocks.end || r.blocks.end > plan.block_tables.len() {
                return bad(format!(
                    "request {:?}: block range {:?} is out of range",
                    r.req, r.blocks
                ));
            }
            let table = plan.block_table_of(r);
            let end_pos = r.start_pos + r.tokens.len();
            if table.len() * plan.block_size < end_pos {
                return bad(format!(
                    "request {:?}: {} blocks cannot hold {end_pos} positions",
                    r.req,
                    table.len()
                ));
            }
            if end_pos > self.config.max_position_embeddings {
                return bad(format!(
                    "request {:?}: position {} is past the model's context ({})",
                    r.req,
                    end_pos - 1,
                    self.config.max_position_embeddings
                ));
            }
            let used = end_pos.div_ceil(plan.block_size);
            if let Some(&b) = table[..used].iter().find(|&&b| b.index() >= n_blocks) {
                return bad(format!(
                    "request {:?}: block {b} is outside the arena ({n_blocks})",
                    r.req
                ));
            }
            for pos in r.start_pos..end_pos {
                meta.queries.push(AttnQuery {
                    pos,
                    block_table: table,
                });
                meta.slots.push(plan.slot_of(r, pos));
            }
            if r.sample.is_some() {
                if r.tokens.is_empty() {
                    return bad(format!(
                        "request {:?} samples but has no token this step",
                        r.req
                    ));
                }
                meta.sample_rows.push(r.tokens.end - 1);
                meta.sample_reqs.push(r.req);
            }
        }
        if next_token != n {
            return bad(format!(
                "the requests cover {next_token} of the {n} step tokens"
            ));
        }
        Ok(meta)
    }

    /// The step's rows under each adapter the plan names, by ascending id; an error naming
    /// the first adapter not loaded.
    fn lora_groups(&self, plan: &StepPlan) -> Result<Vec<lora::LoraGroup>, ExecError> {
        let mut groups: BTreeMap<LoraId, Vec<usize>> = BTreeMap::new();
        for r in &plan.reqs {
            if let Some(id) = r.lora {
                groups.entry(id).or_default().extend(r.tokens.clone());
            }
        }
        if let Some(&id) = groups.keys().find(|id| !self.loras.contains_key(id)) {
            return Err(ExecError::LoraNotLoaded(id));
        }
        groups
            .into_iter()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(id, mut rows)| {
                let adapter = self.loras.get(&id).ok_or(ExecError::LoraNotLoaded(id))?;
                rows.sort_unstable();
                Ok(lora::LoraGroup {
                    adapter: Arc::clone(adapter),
                    rows,
                })
            })
            .collect()
    }

    /// One decoder layer over all the step's tokens, updating the residual stream `x`.
    fn layer(
        &self,
        l: usize,
        lw: &LayerWeights,
        (meta, loras): (&TokenMeta<'_>, &[lora::LoraGroup]),
        arena: &mut KvArena,
        x: &mut [f32],
        s: &mut Scratch,
    ) {
        let layout = arena.layout();
        let c = &self.config;
        let (h, hd, n) = (c.hidden_size, c.head_dim, meta.slots.len());
        let (q_w, kv_w) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let qkv_w = q_w + 2 * kv_w;

        let normed = take(&mut s.normed, n * h);
        rms_norm(x, &lw.input_norm, c.rms_norm_eps, normed);
        let qkv = take(&mut s.qkv, n * qkv_w);
        timed(Phase::LayerMatmuls, || matmul(normed, &lw.qkv, qkv, n));
        if let Some(bias) = &lw.qkv_bias {
            qkv.chunks_exact_mut(qkv_w)
                .for_each(|row| add_assign(row, bias));
        }
        lora::add_deltas(loras, l, Site::Qkv, (normed, h), (qkv, qkv_w), &mut s.lora);
        let q = take(&mut s.q, n * q_w);
        self.position_tokens(lw, meta, qkv, q, (q_w, qkv_w));
        for (row, &slot) in qkv.chunks_exact(qkv_w).zip(&meta.slots) {
            let (k, v) = row[q_w..].split_at(kv_w);
            write_kv(arena, l, slot, k, v);
        }
        let attn = take(&mut s.attn, n * q_w);
        timed(Phase::Attention, || {
            paged_attention(
                arena,
                &layout,
                l,
                c.num_attention_heads,
                &meta.queries,
                q,
                attn,
            )
        });
        let proj = take(&mut s.proj, n * h);
        timed(Phase::LayerMatmuls, || matmul(attn, &lw.o_proj, proj, n));
        if let Some(bias) = &lw.o_bias {
            proj.chunks_exact_mut(h)
                .for_each(|row| add_assign(row, bias));
        }
        lora::add_deltas(loras, l, Site::O, (attn, q_w), (proj, h), &mut s.lora);
        add_assign(x, proj);

        let normed = take(&mut s.normed, n * h);
        rms_norm(x, &lw.post_norm, c.rms_norm_eps, normed);
        if let Some(moe) = c.sparse_layer(l) {
            let proj = take(&mut s.proj, n * h);
            let out = s.routing.as_mut().map(|r| moe::RoutingOut {
                width: r.shape.width(),
                ids: &mut r.step,
                row: l,
            });
            moe::moe_block(moe, lw, normed, h, &mut s.moe, proj, out);
            add_assign(x, proj);
            return;
        }
        let inter = c.intermediate_size;
        let gate_up = take(&mut s.gate_up, n * 2 * inter);
        timed(Phase::LayerMatmuls, || {
            matmul(normed, &lw.gate_up, gate_up, n)
        });
        lora::add_deltas(
            loras,
            l,
            Site::GateUp,
            (normed, h),
            (gate_up, 2 * inter),
            &mut s.lora,
        );
        let act = take(&mut s.act, n * inter);
        silu_mul(gate_up, inter, act);
        let proj = take(&mut s.proj, n * h);
        timed(Phase::LayerMatmuls, || matmul(act, &lw.down, proj, n));
        lora::add_deltas(loras, l, Site::Down, (act, inter), (proj, h), &mut s.lora);
        add_assign(x, proj);
    }

    /// [`Self::position_heads`] on every token's qkv row, copying its q heads into `q`. Tokens
    /// are independent, so a batch runs them in parallel with the bits of one at a time.
    fn position_tokens(
        &self,
        lw: &LayerWeights,
        meta: &TokenMeta<'_>,
        qkv: &mut [f32],
        q: &mut [f32],
        (q_w, qkv_w): (usize, usize),
    ) {
        let one = |i: usize, row: &mut [f32]| {
            self.position_heads(lw, row, meta.queries[i].pos, q_w);
        };
        if meta.queries.len() < 4 {
            qkv.chunks_exact_mut(qkv_w)
                .enumerate()
                .for_each(|(i, row)| one(i, row));
        } else {
            crate::kernels::pool::for_each_chunk_mut(qkv, qkv_w, &one);
        }
        for (row, qt) in qkv.chunks_exact(qkv_w).zip(q.chunks_exact_mut(q_w)) {
            qt.copy_from_slice(&row[..q_w]);
        }
    }

    /// The q/k RMSNorm (Qwen3's per head, OLMoE's over the whole projection, then its
    /// `clip_qkv` on q, k and v), then rope on every q and k head of one token's qkv row.
    fn position_heads(&self, lw: &LayerWeights, row: &mut [f32], pos: usize, q_w: usize) {
        let c = &self.config;
        let hd = c.head_dim;
        let kv_end = q_w + c.num_key_value_heads * hd;
        let eps = c.rms_norm_eps;
        if c.qk_norm_whole {
            let (q, k) = row[..kv_end].split_at_mut(q_w);
            for (part, norm) in [(q, &lw.q_norm), (k, &lw.k_norm)] {
                if let Some(w) = norm {
                    rms_norm_in_place(part, w, eps);
                }
            }
            if let Some(clip) = c.clip_qkv {
                row.iter_mut().for_each(|v| *v = v.clamp(-clip, clip));
            }
        }
        for (i, head) in row[..kv_end].chunks_exact_mut(hd).enumerate() {
            if !c.qk_norm_whole {
                let norm = if i * hd < q_w { &lw.q_norm } else { &lw.k_norm };
                if let Some(w) = norm {
                    rms_norm_in_place(head, w, eps);
                }
            }
            self.rope.apply(head, pos);
        }
    }

    /// Final norm and head on the step tokens `rows` only (the sampled ones, or scored
    /// prompt positions), into the front of `data`.
    fn logits(&self, rows: &[usize], x: &[f32], data: &mut Vec<f32>) {
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let m = rows.len();
        let mut last = vec![0.0f32; m * h];
        for (dst, &t) in last.chunks_exact_mut(h).zip(rows) {
            rms_norm_row(
                &x[t * h..(t + 1) * h],
                &self.weights.norm,
                self.config.rms_norm_eps,
                dst,
            );
        }
        let data = take(data, m * vocab);
        timed(Phase::Head, || matmul(&last, self.weights.head(), data, m));
    }
}

impl RoutingCapture {
    /// Stores this step's routing in each token's KV slot (its aux words) and returns each request's
    /// rows: those the plan reads back from its blocks, then those it computed.
    fn record(&mut self, plan: &StepPlan, slots: &[usize], kv: &mut KvArena) -> Vec<RoutedExperts> {
        let width = self.shape.width();
        for (row, &slot) in self.step.chunks_exact(width).zip(slots) {
            pack_ids(row, kv.aux_at_mut(slot));
        }
        plan.reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let from = plan
                    .routing_reads
                    .iter()
                    .find(|read| read.req_pos == i)
                    .map_or(r.start_pos, |read| read.from.min(r.start_pos));
                let mut ids = Vec::with_capacity((r.start_pos - from + r.tokens.len()) * width);
                for pos in from..r.start_pos {
                    unpack_ids(kv.aux_at(plan.slot_of(r, pos)), width, &mut ids);
                }
                ids.extend_from_slice(&self.step[r.tokens.start * width..r.tokens.end * width]);
                RoutedExperts {
                    req: r.req,
                    first_pos: from,
                    ids,
                }
            })
            .collect()
    }
}

/// Aux words a token's routing of `width` ids takes: two u16 a word.
fn routing_words(width: usize) -> usize {
    width.div_ceil(2)
}

/// `ids` into aux words, two a word (low half first), as raw bits.
fn pack_ids(ids: &[u16], words: &mut [f32]) {
    for (w, pair) in words.iter_mut().zip(ids.chunks(2)) {
        let hi = pair.get(1).copied().unwrap_or(0);
        *w = f32::from_bits(u32::from(pair[0]) | u32::from(hi) << 16);
    }
}

/// The `width` ids of aux words packed by [`pack_ids`], appended to `out`.
fn unpack_ids(words: &[f32], width: usize, out: &mut Vec<u16>) {
    let start = out.len();
    for w in words {
        let bits = w.to_bits();
        out.extend([bits as u16, (bits >> 16) as u16]);
    }
    out.truncate(start + width);
}

/// The KV layout of a Llama-family model of `config` (what its [`Executor::kv_layout`]
/// gives), known before the model is built: the connectors size and compare blocks with it.
/// `routed_experts`: the model captures expert routing (an MoE model with
/// [`LlamaModel::with_routed_experts`]), which each token keeps in aux words of its block.
pub fn kv_layout_of(config: &LlamaConfig, block_size: usize, routed_experts: bool) -> KvLayout {
    let width = match &config.moe {
        Some(moe) if routed_experts => config.num_hidden_layers * moe.top_k,
        _ => 0,
    };
    KvLayout {
        n_layers: config.num_hidden_layers,
        n_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        block_size,
        aux_floats: routing_words(width),
    }
}

impl Executor for LlamaModel {
    fn kv_layout(&self, block_size: usize) -> KvLayout {
        kv_layout_of(&self.config, block_size, self.scratch.routing.is_some())
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn execute(&mut self, plan: &StepPlan, kv: &mut KvArena) -> Result<ModelOutput, ExecError> {
        let mut data = std::mem::take(&mut self.logits_buf);
        let reqs = self.forward_into(plan, kv, &mut data);
        let vocab = self.config.vocab_size;
        let specs = plan.reqs.iter().filter_map(|r| r.sample.as_ref());
        let sampled = reqs.map(|reqs| {
            let rows: Vec<_> = specs
                .zip(reqs)
                .map(|(spec, req)| SampleRow {
                    spec,
                    req,
                    mask: plan.mask_of(spec),
                    adjust: plan.adjust_of(spec),
                })
                .collect();
            sample_batch(&data, vocab, &rows, &mut self.sampler_scratch)
        });
        self.logits_buf = data;
        Ok(ModelOutput {
            sampled: sampled?,
            prompt_logprobs: std::mem::take(&mut self.prompt_out),
            routed: std::mem::take(&mut self.routed_out),
        })
    }

    fn routing_shape(&self) -> Option<RoutingShape> {
        self.scratch.routing.as_ref().map(|r| r.shape)
    }

    fn weight_ops(&self) -> &dyn crate::ModelWeights {
        self
    }

    fn weight_ops_mut(&mut self) -> &mut dyn crate::ModelWeights {
        self
    }

    /// Checks that the adapter was made for this model's dimensions, then holds it.
    fn load_lora(&mut self, id: LoraId, adapter: Arc<LoraAdapter>) -> Result<(), ExecError> {
        adapter
            .check_base(&self.config)
            .map_err(|message| ExecError::LoraMismatch { id, message })?;
        self.loras.insert(id, adapter);
        Ok(())
    }

    fn unload_lora(&mut self, id: LoraId) -> Result<(), ExecError> {
        self.loras
            .remove(&id)
            .map(drop)
            .ok_or(ExecError::LoraNotLoaded(id))
    }
}

#[cfg(test)]
mod tests;
