//! `ferry bench model`: prefill and decode throughput of the real model at several batch
//! sizes, printed as one JSON line, held against the machine: decode's weight-read GB/s
//! (weight bytes per step × steps per second) against a measured read bandwidth, and the
//! matmuls' GFLOP/s of decode and prefill against a measured f32 FMA peak. Weights are kept
//! in the file's precision, as `ferry serve` keeps them.
//!
//! Each batch size gets its own arena. Prompts are prefilled in chunks of at most
//! `--prefill-chunk` tokens per step (as the scheduler would), then every request decodes one
//! token per step, the batch sizes taking turns step by step. Times are wall-clock around
//! `Executor::execute`, sampling included, and split by phase ([`ferry_model::profile`]):
//! layer matmuls, head, attention, the rest, and the engine thread's waits for the forward
//! pool's helpers inside the first three.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use ferry_arena::KvArena;
use ferry_core::{
    BlockId, LoraId, ReqIdx, SampleSpec, SamplerSpec, ScheduledReq, StepPlan, TokenId,
};
use ferry_model::profile::PhaseNanos;
use ferry_model::random_model::{random_weights, small_config, smollm2_135m_config, SplitMix64};
use ferry_model::{Executor, LlamaConfig, LlamaModel, WeightStore};
use serde_json::json;

const BLOCK_SIZE: usize = 16;

mod kernels;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, a `.gguf` file, or `tiny`.
    #[arg(long, conflicts_with = "random")]
    pub(crate) model: Option<String>,
    /// Random weights in a known shape instead of a file: `smollm2-135m`, `small`, or
    /// `qwen3-moe` (`ferry make-model moe --size bench`'s shape: 32 experts, top-8).
    #[arg(long)]
    pub(crate) random: Option<String>,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub(crate) batch: Vec<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 128)]
    pub(crate) prompt_len: usize,
    /// Decode steps measured per batch size.
    #[arg(long, default_value_t = 32)]
    pub(crate) decode_steps: usize,
    /// Most prompt tokens computed in one prefill step.
    #[arg(long, default_value_t = 2048)]
    pub(crate) prefill_chunk: usize,
    /// Print only the JSON line (otherwise it is pretty-printed).
    #[arg(long)]
    pub(crate) json: bool,
    /// The cost of `--enable-return-routed-experts` (MoE models): every batch size runs twice
    /// in one process, once capturing the expert routing into the KV blocks and once not,
    /// their steps interleaved (in alternating order) so both meet the same host; the report's
    /// `routed_experts_cost` gives each batch size's rates with over without.
    #[arg(long)]
    pub(crate) routed_experts_cost: bool,
    /// Set by `ferry bench lora`: each batch size runs twice, the second with its requests
    /// spread over these adapters (loaded into the model as ids 0..n).
    #[arg(skip)]
    pub(crate) lora_adapters: usize,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let out = measure(&args, BANDWIDTH_BYTES)?;
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

/// Size of the buffers the bandwidth probes stream through (far above any cache we target).
pub(crate) const BANDWIDTH_BYTES: usize = 256 << 20;

/// Runs every batch size and returns the report.
fn measure(args: &Args, bandwidth_bytes: usize) -> anyhow::Result<serde_json::Value> {
    measure_with(args, bandwidth_bytes, |_, _| Ok(()))
}

/// [`measure`], with `prepare` given the built model first (`ferry bench lora` loads its
/// adapters there).
pub(crate) fn measure_with(
    args: &Args,
    bandwidth_bytes: usize,
    prepare: impl FnOnce(&mut LlamaModel, &LlamaConfig) -> anyhow::Result<()>,
) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(args.prompt_len > 0, "--prompt-len must be at least 1");
    anyhow::ensure!(args.prefill_chunk > 0, "--prefill-chunk must be at least 1");
    anyhow::ensure!(
        args.batch.iter().all(|&b| b > 0),
        "--batch sizes must be at least 1"
    );
    let (source, config, weights) = load(args)?;
    let mut model = LlamaModel::new(&config, &weights).context("building the model")?;
    drop(weights);
    prepare(&mut model, &config)?;
    // A batch-1 decode step reads every weight of a dense model, and the active ones
    // (attention, routers, top-k experts, head) of an MoE model.
    let bytes_per_step = model.weights().active_bytes_per_token(&config);
    let memcpy_gb_s = memcpy_bandwidth_gb_s(bandwidth_bytes);
    let isa = ferry_model::kernels::Isa::current();
    let threads = ferry_model::kernels::threads();
    let step_bytes = kernels::step_bytes_by_dtype(model.weights());
    let kernel_probes: Vec<_> = step_bytes
        .keys()
        .map(|&d| (d, kernels::probe_matrix(d, config.hidden_size)))
        .collect();
    let probe = || {
        (
            ferry_model::kernels::fma_peak_gflop_s(isa, threads, PEAK_ITERS),
            read_bandwidth_gb_s(bandwidth_bytes),
            kernel_probes
                .iter()
                .map(|(d, w)| (*d, kernels::kernel_gb_s(w)))
                .collect::<std::collections::BTreeMap<_, _>>(),
        )
    };
    let before = probe();
    ferry_model::profile::set_enabled(true);
    let runs = bench_batches(&mut model, args);
    ferry_model::profile::set_enabled(false);
    let runs = runs?;
    // The probes again after the runs, and the higher of each pair as the machine's: on a
    // shared host a probe that met other tenants' work reads low, and a fraction of it
    // would flatter the runs (one such probe read 227 GFLOP/s where the next read 446).
    let after = probe();
    let kernel_gb_s: std::collections::BTreeMap<_, _> = before
        .2
        .iter()
        .map(|(&d, &r)| (d, r.max(after.2[&d])))
        .collect();
    let kernel_bound_ms = kernels::kernel_bound_ms(&step_bytes, &kernel_gb_s);
    let machine = Machine {
        read_gb_s: before.1.max(after.1),
        peak_gflop_s: before.0.max(after.0),
        kernel_bound_ms,
        bytes_per_step,
        moe: config.moe.is_some(),
        flops_token: model.weights().matmul_flops_per_token(&config, false),
        flops_sampled: model.weights().matmul_flops_per_token(&config, true),
    };
    let (peak_gflop_s, read_gb_s) = (machine.peak_gflop_s, machine.read_gb_s);
    let results: Vec<_> = runs.iter().map(|r| r.report(args, &machine)).collect();
    // Decode at batch 1 reads every weight once per token, so the fastest it can go is the
    // weight bytes over the rate memory can stream them. A copy moves each byte twice (read
    // and write), so the read probe is the fairer bound; both are reported.
    let bound_ms = |gb_s: f64| round2(bytes_per_step as f64 / (gb_s * 1e9) * 1e3);
    let moe = config.moe.as_ref().map(|moe| {
        let batch1 = runs.iter().find(|r| r.batch == 1);
        json!({
            "num_experts": moe.num_experts,
            "top_k": moe.top_k,
            "moe_layers": moe.n_sparse(),
            "weights_bytes_total": model.weights().total_bytes(),
            "active_bytes_per_token": bytes_per_step,
            "batch1_bytes_read_per_token": batch1
                .map(|r| (r.decode_weight_bytes as f64 / args.decode_steps.max(1) as f64).round()),
        })
    });
    Ok(json!({
        "moe": moe,
        // [off, on] per batch size: the ratios are on's rate over off's (1.0: no cost).
        "routed_experts_cost": routed_experts_cost(&runs, args),
        // [base, under adapters] per batch size, as `routed_experts_cost`.
        "lora_cost": (args.lora_adapters > 0).then(|| pair_ratios(&runs, args)),
        "model": source,
        "isa": format!("{isa:?}"),
        "threads": threads,
        "weight_dtypes": weight_dtypes(model.weights()),
        "fma_peak_gflop_s": round2(peak_gflop_s),
        "fma_peak_gflop_s_probes": [round2(before.0), round2(after.0)],
        "load_avg_1m": load_avg(),
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "weights_bytes": model.weights().total_bytes(),
        "weights_bytes_per_step": bytes_per_step,
        "memcpy_gb_s": round2(memcpy_gb_s),
        "read_gb_s": round2(read_gb_s),
        "read_gb_s_probes": [round2(before.1), round2(after.1)],
        "batch1_decode_bound_ms_memcpy": bound_ms(memcpy_gb_s),
        "batch1_decode_bound_ms_read": bound_ms(read_gb_s),
        "kernel_gb_s": by_dtype(&kernel_gb_s),
        "kernel_gb_s_probes": [by_dtype(&before.2), by_dtype(&after.2)],
        // The kernels' bound times every matrix: an MoE step reads only some experts.
        "batch1_decode_bound_ms_kernels": config.moe.is_none().then(|| round2(kernel_bound_ms)),
        "batch1_kernel_gb_s": config
            .moe
            .is_none()
            .then(|| round2(bytes_per_step as f64 / (kernel_bound_ms * 1e6))),
        "results": results,
    }))
}

fn load(args: &Args) -> anyhow::Result<(String, LlamaConfig, WeightStore)> {
    match (&args.model, args.random.as_deref()) {
        (_, Some("smollm2-135m")) => {
            let c = smollm2_135m_config();
            let w = random_weights(&c, 0);
            Ok(("random:smollm2-135m".into(), c, w))
        }
        (_, Some("small")) => {
            let c = small_config();
            let w = random_weights(&c, 0);
            Ok(("random:small".into(), c, w))
        }
        (_, Some("qwen3-moe")) => {
            let m = ferry_model::tiny::moe_model(
                "Qwen3MoeForCausalLM",
                ferry_model::tiny::MoeSize::Bench,
                0,
            );
            Ok(("random:qwen3-moe".into(), m.config, m.weights))
        }
        (_, Some(other)) => {
            anyhow::bail!("unknown --random shape {other:?} (smollm2-135m, small, qwen3-moe)")
        }
        (Some(path), None) => {
            let m = ferry_model::ModelSpec::resolve(Some(path), Path::new("."))
                .load_as(ferry_model::Precision::Stored, &mut |_, _, _| {})
                .with_context(|| format!("loading {path}"))?;
            Ok((m.source, m.config, m.weights))
        }
        (None, None) => anyhow::bail!("give --model PATH|tiny or --random smollm2-135m"),
    }
}

/// FMA turns per thread of the peak probe (a few hundred milliseconds).
const PEAK_ITERS: usize = 20_000_000;

/// What the rates are held against: the machine's read bandwidth and f32 FMA peak, and the
/// model's weight bytes per decode step and matmul work per token.
struct Machine {
    read_gb_s: f64,
    peak_gflop_s: f64,
    /// Milliseconds the step's matrices take at the batch-1 kernels' rates from cache
    /// ([`kernels`]).
    kernel_bound_ms: f64,
    bytes_per_step: usize,
    /// A mixture of experts: a step reads the experts its tokens use, not every weight.
    moe: bool,
    /// Matmul FLOPs of a token that does not sample, and of one that does (the head too).
    flops_token: u64,
    flops_sampled: u64,
}

/// A JSON object of one value per dtype, rounded.
fn by_dtype(v: &std::collections::BTreeMap<ferry_model::WeightDtype, f64>) -> serde_json::Value {
    v.iter()
        .map(|(d, &x)| (d.to_string(), json!(round2(x))))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// How many matrix segments of each dtype the model holds, e.g. `{"Q4_1": 180, "Q8_0": 31}`.
fn weight_dtypes(w: &ferry_model::LlamaWeights) -> serde_json::Value {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for m in std::iter::once(&w.embed)
        .chain(w.lm_head.as_ref())
        .chain(w.layer_matrices())
    {
        for s in m.segments() {
            *counts.entry(s.dtype().to_string()).or_default() += 1;
        }
    }
    json!(counts)
}

/// One request of the benchmark.
struct BenchReq {
    tokens: Vec<TokenId>,
    computed: usize,
    table: Vec<BlockId>,
}

/// One batch size's requests and their arena.
pub(crate) struct BatchRun {
    batch: usize,
    /// Whether this run's steps capture the expert routing (`--routed-experts-cost`).
    routed: bool,
    /// The adapter each request runs under (`ferry bench lora`'s second run of a pair).
    loras: Vec<Option<LoraId>>,
    kv: KvArena,
    reqs: Vec<BenchReq>,
    prefill_steps: usize,
    prefill_s: f64,
    decode_s: f64,
    /// CPU time all of the process's threads spent in decode steps (None off Linux).
    decode_cpu_s: Option<f64>,
    /// Time the decode steps spent in each phase of the forward.
    decode_phases: PhaseNanos,
    /// Weight bytes the decode steps' matmuls read, as the kernels counted them.
    decode_weight_bytes: u64,
}

impl BatchRun {
    fn new(model: &LlamaModel, batch: usize, side: Side, args: &Args) -> Self {
        let routed = side == Side::Routed;
        // Request i under adapter i mod n: every adapter interleaved through the batch.
        let loras = (0..batch)
            .map(|i| match side {
                Side::Lora(n) => Some(LoraId((i % n) as u32)),
                _ => None,
            })
            .collect();
        let positions = args.prompt_len + args.decode_steps;
        let blocks_per_req = positions.div_ceil(BLOCK_SIZE);
        let kv = KvArena::new(model.kv_layout(BLOCK_SIZE), 1 + batch * blocks_per_req);
        let mut rng = SplitMix64(batch as u64);
        let vocab = model.vocab_size() as u64;
        let reqs = (0..batch)
            .map(|i| BenchReq {
                tokens: (0..args.prompt_len)
                    .map(|_| TokenId((rng.next_u64() % vocab) as u32))
                    .collect(),
                computed: 0,
                table: (0..blocks_per_req)
                    .map(|b| BlockId((1 + i * blocks_per_req + b) as u32))
                    .collect(),
            })
            .collect();
        Self {
            batch,
            routed,
            loras,
            kv,
            reqs,
            prefill_steps: 0,
            prefill_s: 0.0,
            decode_s: 0.0,
            decode_cpu_s: Some(0.0),
            decode_phases: PhaseNanos::default(),
            decode_weight_bytes: 0,
        }
    }

    fn prefilled(&self, args: &Args) -> bool {
        self.reqs.iter().all(|r| r.computed == args.prompt_len)
    }

    /// One prefill step, timed: the prompts' next tokens, at most `prefill_chunk` in all
    /// (nothing once every prompt is computed).
    fn prefill_step(&mut self, model: &mut LlamaModel, args: &Args) -> anyhow::Result<()> {
        if self.prefilled(args) {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut budget = args.prefill_chunk;
        let counts: Vec<usize> = self
            .reqs
            .iter()
            .map(|r| {
                let n = (args.prompt_len - r.computed).min(budget);
                budget -= n;
                n
            })
            .collect();
        run_step(model, &mut self.kv, &mut self.reqs, &counts, &self.loras)?;
        self.prefill_steps += 1;
        self.prefill_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// One decode step of every request, timed.
    fn decode_step(&mut self, model: &mut LlamaModel) -> anyhow::Result<()> {
        let cpu0 = process_cpu_s();
        let phases0 = PhaseNanos::now();
        let bytes0 = ferry_model::profile::weight_bytes_read();
        let t = Instant::now();
        run_step(
            model,
            &mut self.kv,
            &mut self.reqs,
            &vec![1; self.batch],
            &self.loras,
        )?;
        self.decode_s += t.elapsed().as_secs_f64();
        self.decode_weight_bytes += ferry_model::profile::weight_bytes_read() - bytes0;
        self.decode_phases += PhaseNanos::now().since(&phases0);
        self.decode_cpu_s = match (self.decode_cpu_s, cpu0, process_cpu_s()) {
            (Some(sum), Some(a), Some(b)) => Some(sum + (b - a)),
            _ => None,
        };
        Ok(())
    }

    fn report(&self, args: &Args, m: &Machine) -> serde_json::Value {
        let prefill_tokens = self.batch * args.prompt_len;
        let steps = args.decode_steps.max(1) as f64;
        let step_s = self.decode_s / steps;
        // A dense model reads every weight once per decode step, whatever the batch; an MoE
        // model the experts its tokens were routed to, as the kernels counted them.
        let measured_bytes = self.decode_weight_bytes as f64 / steps;
        let step_bytes = if m.moe {
            measured_bytes
        } else {
            m.bytes_per_step as f64
        };
        let weight_read_gb_s = step_bytes / step_s / 1e9;
        let decode_gflop_s = (self.batch as u64 * m.flops_sampled) as f64 / step_s / 1e9;
        // Every prompt token's layers, and the head once per request (its last chunk samples).
        let prefill_flops = prefill_tokens as u64 * m.flops_token
            + self.batch as u64 * (m.flops_sampled - m.flops_token);
        let prefill_gflop_s = prefill_flops as f64 / self.prefill_s / 1e9;
        json!({
            "decode_weight_read_gb_s": round2(weight_read_gb_s),
            "decode_read_bandwidth_fraction": round2(weight_read_gb_s / m.read_gb_s),
            // Only batch 1 runs the batch-1 kernels the bound is of.
            "decode_kernel_bound_fraction": (self.batch == 1 && !m.moe)
                .then(|| round2(m.kernel_bound_ms / (step_s * 1e3))),
            "decode_gflop_s": round2(decode_gflop_s),
            "decode_peak_fraction": round2(decode_gflop_s / m.peak_gflop_s),
            "prefill_gflop_s": round2(prefill_gflop_s),
            "prefill_peak_fraction": round2(prefill_gflop_s / m.peak_gflop_s),
            "batch": self.batch,
            "routed_experts": self.routed,
            "lora_adapters": self.loras.iter().flatten().collect::<std::collections::BTreeSet<_>>().len(),
            "prefill_tokens": prefill_tokens,
            "prefill_steps": self.prefill_steps,
            "prefill_tok_s": round2(prefill_tokens as f64 / self.prefill_s),
            "decode_tok_s": round2((self.batch * args.decode_steps) as f64 / self.decode_s),
            "decode_ms_per_step": round2(self.decode_s * 1e3 / steps),
            "decode_weight_bytes_per_step": measured_bytes.round(),
            "decode_cpu_ms_per_step": self.decode_cpu_s.map(|c| round2(c * 1e3 / steps)),
            "decode_phase_us_per_step": phase_us(&self.decode_phases, self.decode_s, steps),
        })
    }
}

/// Prefills every batch size, then decodes them round-robin, one step each in turn: on a
/// shared machine the load drifts, and interleaving gives every batch size the same
/// conditions, so their ratios mean something even when the absolute numbers move.
///
/// With `--routed-experts-cost` every batch size has a second run that captures the routing
/// (its arena has the layout with routing words), right after the plain one; the model is
/// switched to each run's setting before its steps, and each step the pairs go in the other
/// order, so neither side is always the one after the other's cache traffic.
pub(crate) fn bench_batches(model: &mut LlamaModel, args: &Args) -> anyhow::Result<Vec<BatchRun>> {
    let sides: Vec<Side> = if args.routed_experts_cost {
        vec![Side::Plain, Side::Routed]
    } else if args.lora_adapters > 0 {
        vec![Side::Plain, Side::Lora(args.lora_adapters)]
    } else {
        vec![Side::Plain]
    };
    let mut runs = Vec::new();
    for &b in &args.batch {
        for &side in &sides {
            set_routing(model, side == Side::Routed)?;
            runs.push(BatchRun::new(model, b, side, args));
        }
    }
    // Each batch size's prefill, then the decode steps of all, step by step in turn (a pair
    // of runs takes its steps together, prefill's too).
    for pair in runs.chunks_mut(sides.len()) {
        let mut step = 0;
        while !pair.iter().all(|r| r.prefilled(args)) {
            each_in_turn(pair, step, |run| {
                set_routing(model, run.routed)?;
                run.prefill_step(model, args)
            })?;
            step += 1;
        }
    }
    for step in 0..args.decode_steps {
        for pair in runs.chunks_mut(sides.len()) {
            each_in_turn(pair, step, |run| {
                set_routing(model, run.routed)?;
                run.decode_step(model)
            })?;
        }
    }
    set_routing(model, false)?;
    Ok(runs)
}

/// What a run of a pair adds to the plain forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Plain,
    /// Captures the expert routing (`--routed-experts-cost`).
    Routed,
    /// Its requests run under this many adapters, in turn (`ferry bench lora`).
    Lora(usize),
}

/// `f` on each run of `pair`, in order on even steps and the other way round on odd ones.
fn each_in_turn(
    pair: &mut [BatchRun],
    step: usize,
    mut f: impl FnMut(&mut BatchRun) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let n = pair.len();
    for i in 0..n {
        let at = if step.is_multiple_of(2) { i } else { n - 1 - i };
        f(&mut pair[at])?;
    }
    Ok(())
}

fn set_routing(model: &mut LlamaModel, on: bool) -> anyhow::Result<()> {
    if !on && model.routing_shape().is_none() {
        return Ok(());
    }
    model
        .set_routed_experts(on)
        .context("--routed-experts-cost needs a mixture-of-experts model")
}

/// `--routed-experts-cost`: each batch size's rates capturing the routing over not, from the
/// interleaved pair of runs.
fn routed_experts_cost(runs: &[BatchRun], args: &Args) -> Option<serde_json::Value> {
    if !args.routed_experts_cost {
        return None;
    }
    Some(pair_ratios(runs, args))
}

/// Each interleaved pair's rates, the second run's over the first's (1.0: no cost).
pub(crate) fn pair_ratios(runs: &[BatchRun], args: &Args) -> serde_json::Value {
    let steps = args.decode_steps.max(1) as f64;
    let pairs: Vec<_> = runs
        .chunks(2)
        .map(|pair| {
            let (off, on) = (&pair[0], &pair[1]);
            json!({
                "batch": off.batch,
                "decode_ms_per_step": [round2(off.decode_s * 1e3 / steps), round2(on.decode_s * 1e3 / steps)],
                "decode_tok_s_ratio": round4(off.decode_s / on.decode_s),
                "prefill_tok_s_ratio": round4(off.prefill_s / on.prefill_s),
            })
        })
        .collect();
    json!(pairs)
}

/// Microseconds per step in each phase of the forward; `other` is the rest of the step
/// (norms, rope, the KV writes, sampling), and `pool_wait` lies inside the first three.
fn phase_us(p: &PhaseNanos, total_s: f64, steps: f64) -> serde_json::Value {
    let us = |ns: u64| ns as f64 / 1e3 / steps;
    let timed = p.layer_matmuls + p.head + p.attention;
    json!({
        "layer_matmuls": round2(us(p.layer_matmuls)),
        "head": round2(us(p.head)),
        "attention": round2(us(p.attention)),
        "other": round2((total_s * 1e6 / steps - us(timed)).max(0.0)),
        "pool_wait": round2(us(p.pool_wait)),
    })
}

/// Schedules `counts[i]` tokens of request `i`; a request that reaches its last known token
/// samples, and its sampled token is appended.
fn run_step(
    model: &mut LlamaModel,
    kv: &mut KvArena,
    reqs: &mut [BenchReq],
    counts: &[usize],
    loras: &[Option<LoraId>],
) -> anyhow::Result<()> {
    let mut plan = StepPlan {
        block_size: BLOCK_SIZE,
        ..StepPlan::default()
    };
    for (i, (r, &n)) in reqs.iter().zip(counts).enumerate() {
        if n == 0 {
            continue;
        }
        let end = r.computed + n;
        let t0 = plan.token_ids.len();
        plan.token_ids.extend(&r.tokens[r.computed..end]);
        let b0 = plan.block_tables.len();
        plan.block_tables.extend(&r.table);
        plan.reqs.push(ScheduledReq {
            lora: loras[i],
            req: ReqIdx(i as u32),
            start_pos: r.computed,
            tokens: t0..plan.token_ids.len(),
            blocks: b0..plan.block_tables.len(),
            sample: (end == r.tokens.len()).then(|| SampleSpec {
                params: SamplerSpec::default(),
                output_idx: 0,
                mask: None,
                adjust: None,
            }),
        });
    }
    let out = model.execute(&plan, kv)?;
    for (r, &n) in reqs.iter_mut().zip(counts) {
        r.computed += n;
    }
    for s in out.sampled {
        reqs[s.req.0 as usize].tokens.push(s.token);
    }
    Ok(())
}

/// Copy bandwidth (bytes copied per second, in GB/s) of a `bytes` buffer, split across the
/// threads the model uses, best of 5 after a warm-up.
fn memcpy_bandwidth_gb_s(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(ferry_model::kernels::threads());
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    bytes as f64 / best / 1e9
}

/// Read bandwidth (GB/s): every thread sums its share of a `bytes` buffer, best of 5 after a
/// warm-up. Integer sums so the compiler vectorizes them (float sums are order-bound). The
/// buffer is the weights' kind of memory (a `ByteBuf`, on 2 MiB pages where the kernel gives
/// them), so the weights' read fraction compares like with like: on 4 KiB pages this probe
/// read 21–28 GB/s on a host where it now reads 31–35, and F32 weights streamed at 1.3 of it.
fn read_bandwidth_gb_s(bytes: usize) -> f64 {
    let words = bytes / 4;
    let mut mem = ferry_model::ByteBuf::zeroed(words * 4);
    // SAFETY: every bit pattern is a u32, and a `ByteBuf` starts on a page boundary, so the
    // whole buffer is the aligned middle.
    let (head, buf, _) = unsafe { mem.align_to_mut::<u32>() };
    assert!(head.is_empty(), "a ByteBuf is page-aligned");
    buf.iter_mut().zip(0u32..).for_each(|(w, i)| *w = i);
    let buf: &[u32] = buf;
    let chunk = words.div_ceil(ferry_model::kernels::threads());
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        let t = Instant::now();
        let total = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|c| s.spawn(move || c.iter().fold(0u32, |a, &b| a.wrapping_add(b))))
                .collect();
            handles
                .into_iter()
                .fold(0u32, |a, h| a.wrapping_add(h.join().unwrap_or(0)))
        });
        std::hint::black_box(total);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (words * 4) as f64 / best / 1e9
}

/// CPU time (seconds) of every thread of this process so far, from the nanosecond counters
/// in `/proc/self/task/*/schedstat` (Linux only). On a machine shared with other work, wall
/// time also counts the time slices others took; CPU time does not.
fn process_cpu_s() -> Option<f64> {
    let mut ns: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// The 1-minute load average, so a reader can tell a contended run (Linux only).
fn load_avg() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn round4(v: f64) -> f64 {
    (v * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_every_batch_size_with_positive_rates() {
        let args = Args {
            model: None,
            random: Some("small".into()),
            batch: vec![1, 3],
            prompt_len: 5,
            decode_steps: 2,
            prefill_chunk: 4,
            routed_experts_cost: false,
            lora_adapters: 0,
            json: true,
        };
        let out = measure(&args, 1 << 20).unwrap();
        let results = out["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        assert_eq!(results[1]["batch"], 3);
        // 15 prompt tokens in chunks of at most 4.
        assert_eq!(results[1]["prefill_steps"], 4);
        for r in results {
            for key in [
                "decode_tok_s",
                "prefill_tok_s",
                "decode_weight_read_gb_s",
                "decode_gflop_s",
                "prefill_gflop_s",
            ] {
                assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
            }
        }
        for r in results {
            // Every phase the small model runs took time, and they fit in the step.
            let p = &r["decode_phase_us_per_step"];
            let us = |k: &str| p[k].as_f64().unwrap_or_else(|| panic!("{k}: {p}"));
            for key in ["layer_matmuls", "head", "attention"] {
                assert!(us(key) > 0.0, "{key}: {p}");
            }
            let step = r["decode_ms_per_step"].as_f64().unwrap() * 1e3;
            let phases = us("layer_matmuls") + us("head") + us("attention");
            assert!(phases <= step + 10.0, "{p} in a {step} us step");
            assert!(us("other") >= 0.0 && us("pool_wait") >= 0.0, "{p}");
        }
        assert!(out["fma_peak_gflop_s"].as_f64().unwrap() > 0.0);
        // The machine is the higher of the probes before and after the runs.
        let higher = |probes: &serde_json::Value| {
            let p = probes.as_array().unwrap();
            assert_eq!(p.len(), 2, "{probes}");
            p[0].as_f64().unwrap().max(p[1].as_f64().unwrap())
        };
        assert_eq!(
            out["fma_peak_gflop_s"].as_f64().unwrap(),
            higher(&out["fma_peak_gflop_s_probes"])
        );
        assert_eq!(
            out["read_gb_s"].as_f64().unwrap(),
            higher(&out["read_gb_s_probes"])
        );
        // The kernels' rate of each dtype the matrices hold (f32 here), the higher probe's,
        // and the step's bound from it; only batch 1 is held against that bound.
        let kernel = out["kernel_gb_s"].as_object().unwrap();
        assert_eq!(kernel.keys().collect::<Vec<_>>(), ["F32"], "{out}");
        let probes = &out["kernel_gb_s_probes"];
        assert_eq!(
            kernel["F32"].as_f64().unwrap(),
            probes[0]["F32"]
                .as_f64()
                .unwrap()
                .max(probes[1]["F32"].as_f64().unwrap())
        );
        assert!(out["batch1_decode_bound_ms_kernels"].as_f64().unwrap() >= 0.0);
        assert!(out["batch1_kernel_gb_s"].as_f64().unwrap() > 0.0);
        // A number at batch 1 (the small model's matrices are a sliver of its step, so it
        // may round to 0).
        assert!(results[0]["decode_kernel_bound_fraction"].as_f64().unwrap() >= 0.0);
        assert!(results[1]["decode_kernel_bound_fraction"].is_null());
        // 2 layers of 7 segments (q, k, v, o, gate, up, down), the embedding and the head.
        assert_eq!(out["weight_dtypes"]["F32"], 16, "random weights are f32");
        assert!(out["weights_bytes_per_step"].as_u64().unwrap() > 0);
        assert!(out["read_gb_s"].as_f64().unwrap() > 0.0);
    }

    /// A small random Qwen3-MoE model written as a Hugging Face folder (kept while the
    /// returned directory lives), and the model itself.
    fn small_moe_folder() -> (tempfile::TempDir, ferry_model::LoadedModel) {
        let tmp = tempfile::tempdir().unwrap();
        let m = ferry_model::tiny::moe_model(
            "Qwen3MoeForCausalLM",
            ferry_model::tiny::MoeSize::Small,
            1,
        );
        ferry_model::tiny::write_hf_folder(&m, tmp.path()).unwrap();
        (tmp, m)
    }

    /// An MoE model's batch-1 decode reads exactly the active weights' matrices (attention,
    /// routers, the top-k experts, dense layers, head), as the kernels count them.
    #[test]
    fn an_moe_model_reads_only_its_routed_experts_per_decoded_token() {
        let (tmp, m) = small_moe_folder();
        let args = Args {
            model: Some(tmp.path().display().to_string()),
            random: None,
            batch: vec![1, 4],
            prompt_len: 5,
            decode_steps: 3,
            prefill_chunk: 8,
            json: true,
            routed_experts_cost: false,
            lora_adapters: 0,
        };
        let out = measure(&args, 1 << 20).unwrap();
        let w = LlamaModel::new(&m.config, &m.weights).unwrap();
        let w = w.weights();
        let matrices: usize = w.layer_matrices().map(ferry_model::Matrix::n_bytes).sum();
        let vectors = w.bytes_read_per_step() - matrices - w.head().n_bytes();
        let active = w.active_bytes_per_token(&m.config);
        let moe = &out["moe"];
        assert_eq!(moe["top_k"], 3);
        assert_eq!(moe["active_bytes_per_token"], active);
        assert_eq!(
            moe["batch1_bytes_read_per_token"],
            (active - vectors) as f64
        );
        let experts: usize = w
            .layers
            .iter()
            .flat_map(|l| &l.experts)
            .map(|e| e.gate_up.n_bytes() + e.down.n_bytes())
            .sum();
        // Two MoE layers, each reading 3 of its 8 experts.
        assert_eq!(w.bytes_read_per_step() - active, experts * 5 / 8);
        // And computing with them: the decode rates' FLOPs count the routed experts only.
        let elems = |m: &ferry_model::Matrix| m.n_rows() * m.k();
        let all: usize = w.layer_matrices().map(elems).sum();
        let expert_elems: usize = w
            .layers
            .iter()
            .flat_map(|l| &l.experts)
            .map(|e| elems(&e.gate_up) + elems(&e.down))
            .sum();
        assert_eq!(
            w.matmul_flops_per_token(&m.config, false),
            2 * (all - expert_elems * 5 / 8) as u64
        );
        let results = out["results"].as_array().unwrap();
        let b4 = results[1]["decode_weight_bytes_per_step"].as_f64().unwrap();
        assert!(
            b4 > (active - vectors) as f64,
            "4 tokens use more experts than 1"
        );
    }

    /// `--routed-experts-cost` runs each batch size twice, the second capturing the routing
    /// into an arena with routing words; both compute the same tokens, and a dense model is
    /// refused naming the flag.
    #[test]
    fn the_routed_experts_cost_runs_each_batch_with_and_without_the_capture() {
        let (tmp, m) = small_moe_folder();
        let args = Args {
            model: Some(tmp.path().display().to_string()),
            random: None,
            batch: vec![1, 3],
            prompt_len: 5,
            decode_steps: 3,
            prefill_chunk: 8,
            json: true,
            routed_experts_cost: true,
            lora_adapters: 0,
        };
        let mut model = LlamaModel::new(&m.config, &m.weights).unwrap();
        let runs = bench_batches(&mut model, &args).unwrap();
        let shape: Vec<_> = runs.iter().map(|r| (r.batch, r.routed)).collect();
        assert_eq!(shape, [(1, false), (1, true), (3, false), (3, true)]);
        for pair in runs.chunks(2) {
            assert_eq!(pair[0].kv.layout().aux_floats, 0);
            assert!(pair[1].kv.layout().aux_floats > 0);
            let tokens = |r: &BatchRun| r.reqs.iter().map(|q| q.tokens.clone()).collect::<Vec<_>>();
            assert_eq!(tokens(&pair[0]), tokens(&pair[1]));
            // The prompt, the token its prefill sampled, one a decode step.
            assert_eq!(pair[0].reqs[0].tokens.len(), 5 + 1 + 3);
        }
        // The model is left as it was built: not capturing.
        assert_eq!(model.kv_layout(BLOCK_SIZE).aux_floats, 0);
        let out = measure(&args, 1 << 20).unwrap();
        let cost = out["routed_experts_cost"].as_array().unwrap();
        assert_eq!(cost.len(), 2);
        assert_eq!(
            (cost[0]["batch"].as_u64(), cost[1]["batch"].as_u64()),
            (Some(1), Some(3))
        );
        assert!(cost
            .iter()
            .all(|c| c["decode_tok_s_ratio"].as_f64().unwrap() > 0.0));
        assert_eq!(out["results"].as_array().unwrap().len(), 4);

        let dense = Args {
            model: None,
            random: Some("small".into()),
            ..args
        };
        let err = measure(&dense, 1 << 20).unwrap_err();
        assert!(
            format!("{err:#}").contains("--routed-experts-cost"),
            "{err:#}"
        );
    }

    #[test]
    fn unknown_random_shape_is_an_error() {
        let args = Args {
            model: None,
            random: Some("gpt-5".into()),
            batch: vec![1],
            prompt_len: 1,
            decode_steps: 1,
            prefill_chunk: 1,
            json: true,
            routed_experts_cost: false,
            lora_adapters: 0,
        };
        let err = measure(&args, 1 << 20).unwrap_err();
        assert!(err.to_string().contains("unknown --random shape"), "{err}");
    }
}
