//! Token sampling from one row of logits, with logprobs from the same logits.
//!
//! Order of operations, as in the usual engines: temperature, then the top-k, top-p and min-p
//! filters, then one random draw from what is left. `temperature <= 0` (or NaN) is greedy:
//! the argmax, ties going to the lowest token id. By default logprobs are those of the *raw*
//! logits (log-softmax before temperature and filters; see [`SampledToken`]); an engine-wide
//! [`LogprobsMode`] (vLLM's `--logprobs-mode`) reports the distribution actually sampled from,
//! or logits, instead.
//!
//! Randomness: with a per-request seed the draw is a function of `(seed, seed_stream,
//! output_idx)` alone (a ChaCha8 stream keyed by the seed, stream number `seed_stream << 32 |
//! output_idx`; see [`seeded_draw`]), so a seeded request gives the same tokens whatever else
//! is in its batch and whatever was sampled before, and the `n` choices of one seeded request
//! (seed streams `0..n`) never share draws with another seed's choices. Without a
//! seed the draw uses the engine-level RNG kept in [`SamplerScratch`]; it is seeded from OS
//! entropy by default, or explicitly with [`SamplerScratch::with_seed`] (simulations, replays).
//!
//! A step's rows are sampled together by [`sample_batch`], spread over rayon's threads: the
//! engine RNG's draws are taken first in row order, so the result is exactly that of sampling
//! row by row.
//!
//! Logits processing: a row may come with a `ferry_core::LogitsAdjust` (the request's
//! penalties, `logit_bias` and `min_tokens`, turned by the scheduler into a short list of the
//! tokens they change). It is applied to a copy of the raw logits first, in vLLM's order and
//! arithmetic; everything after (temperature, filters, the draw, the processed logprobs) reads
//! the processed row, while the raw modes still report the model's own logits. The list is a
//! function of the request's own tokens, so a request's sample never depends on its batch.
//!
//! Constraints: a row may come with a token mask (a structured-output constraint; see
//! `ferry_core::TokenMask`). The sample, greedy or drawn, is then taken from the allowed
//! tokens alone (the others count as `-inf`), while the reported logprobs stay in the
//! engine's mode: the raw modes report the model's own distribution, as without a mask, and
//! the processed modes the distribution actually sampled, the mask included.
//!
//! Stop token ids are not handled here: the scheduler checks each sampled token against the
//! request's EOS and `stop_token_ids` and finishes the request.
//!
//! Bad numbers never panic: a NaN logit counts as `-inf`, `+inf` as `f32::MAX`, and a row with
//! no finite logit at all is treated as uniform.

use std::fmt;
use std::str::FromStr;

use ferry_core::sampling::SamplerSpec;
use ferry_core::{
    mask_allows, LogitsAdjust, PromptTokenLogprob, ReqIdx, SampleSpec, SampledToken, TokenId,
};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::kernels::{clean_logit, clean_max, exp_scaled, exp_sum};

/// What the sampler reports as a token's logprob, for the sampled token and its top-n alike:
/// vLLM's `--logprobs-mode`, one setting for the whole engine.
///
/// "Processed" is the distribution the token was actually drawn from: the logits after the
/// request's logits processing (penalties, bias, `min_tokens`) and its mask, divided by
/// the temperature, then every token the top-k, top-p and min-p filters removed set to
/// `-inf` (ferry applies them in that order). A greedy request (temperature 0) is not scaled
/// or filtered, as in vLLM, where temperature 0 means greedy and resets the filters: its
/// processed values are those of its processed logits (its raw ones when it has no logits
/// processing and no mask). Top-n lists are best first (ties to the lower id) by the logits
/// behind the reported values: the raw logits in the raw modes, the processed logits before
/// temperature and filters in the processed ones (filtered tokens come last).
/// Logits are reported as the sampler sees them: NaN as `-inf`, `+inf` as `f32::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogprobsMode {
    /// Log-softmax of the model's logits, before temperature and filters (the default).
    #[default]
    RawLogprobs,
    /// Log-softmax of the processed logits: the logprobs of the sampling policy.
    ProcessedLogprobs,
    /// The model's logits.
    RawLogits,
    /// The processed logits: `logit / temperature`, filtered tokens at `-inf`.
    ProcessedLogits,
}

impl LogprobsMode {
    /// Every mode, in the order of vLLM's documentation.
    pub const ALL: [Self; 4] = [
        Self::RawLogprobs,
        Self::ProcessedLogprobs,
        Self::RawLogits,
        Self::ProcessedLogits,
    ];

    /// vLLM's name for the mode (`raw_logprobs`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RawLogprobs => "raw_logprobs",
            Self::ProcessedLogprobs => "processed_logprobs",
            Self::RawLogits => "raw_logits",
            Self::ProcessedLogits => "processed_logits",
        }
    }
}

impl fmt::Display for LogprobsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of [`LogprobsMode::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown logprobs mode `{0}` (expected raw_logprobs, processed_logprobs, raw_logits or processed_logits)")]
pub struct UnknownLogprobsMode(pub String);

impl FromStr for LogprobsMode {
    type Err = UnknownLogprobsMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| UnknownLogprobsMode(s.to_owned()))
    }
}

/// Reusable buffers (and the engine-level RNG) so sampling on the caller's thread allocates
/// nothing per token in steady state; only a non-empty `top_logprobs` in the returned token
/// allocates (and, in a parallel batch, each helper thread's buffers, once per call).
#[derive(Debug)]
pub struct SamplerScratch {
    /// Unnormalized probabilities after temperature (the max-logit token has exactly 1.0).
    pub buf: Vec<f32>,
    /// Candidates as order keys (see `order_key`) while filtering, then while selecting the
    /// top-n logprobs.
    keys: Vec<u64>,
    /// A processed row's logits (see `process_logits`): its logits processing applied, the
    /// tokens its mask disallows at `-inf`.
    masked: Vec<f32>,
    /// Draws for requests without a seed.
    rng: ChaCha8Rng,
    /// What logprobs report (engine-wide).
    logprobs_mode: LogprobsMode,
}

impl Default for SamplerScratch {
    /// Engine RNG seeded from OS entropy, so engines started together do not draw alike.
    fn default() -> Self {
        Self::with_rng(ChaCha8Rng::from_os_rng())
    }
}

impl SamplerScratch {
    /// Engine RNG seeded with `engine_seed`: unseeded requests become reproducible too (given
    /// the same sequence of calls), which simulations and replays need.
    pub fn with_seed(engine_seed: u64) -> Self {
        Self::with_rng(ChaCha8Rng::seed_from_u64(engine_seed))
    }

    /// Reports logprobs in `mode` from now on.
    pub fn set_logprobs_mode(&mut self, mode: LogprobsMode) {
        self.logprobs_mode = mode;
    }

    pub fn logprobs_mode(&self) -> LogprobsMode {
        self.logprobs_mode
    }

    /// Frees the buffers (sleep level 2), keeping the RNG's place in its stream; they grow
    /// back on the next sample.
    pub fn release_buffers(&mut self) {
        self.buf = Vec::new();
        self.keys = Vec::new();
        self.masked = Vec::new();
    }

    fn with_rng(rng: ChaCha8Rng) -> Self {
        Self {
            buf: Vec::new(),
            keys: Vec::new(),
            masked: Vec::new(),
            rng,
            logprobs_mode: LogprobsMode::default(),
        }
    }
}

/// Samples one token for `req` from `logits` (length = vocab size).
pub fn sample(
    logits: &[f32],
    spec: &SampleSpec,
    req: ReqIdx,
    scratch: &mut SamplerScratch,
) -> SampledToken {
    sample_masked(logits, SampleRow::new(spec, req), scratch)
}

/// [`sample`], held to `row.mask` when it has one.
pub fn sample_masked(
    logits: &[f32],
    row: SampleRow<'_>,
    scratch: &mut SamplerScratch,
) -> SampledToken {
    let draw = engine_draw(row.spec, &mut scratch.rng);
    let mode = scratch.logprobs_mode;
    let mut bufs = Buffers {
        probs: &mut scratch.buf,
        keys: &mut scratch.keys,
        masked: &mut scratch.masked,
    };
    sample_with_draw(logits, row, (draw, mode), &mut bufs)
}

/// One row of a batch to sample: its spec, its request, the tokens it may take (`None`:
/// any; see `ferry_core::TokenMask`) and its logits processing (`None`: none; see
/// `ferry_core::LogitsAdjust`).
#[derive(Debug, Clone, Copy)]
pub struct SampleRow<'a> {
    pub spec: &'a SampleSpec,
    pub req: ReqIdx,
    pub mask: Option<&'a [u32]>,
    pub adjust: Option<&'a LogitsAdjust>,
}

impl<'a> SampleRow<'a> {
    /// A row with no constraint and no logits processing.
    pub fn new(spec: &'a SampleSpec, req: ReqIdx) -> Self {
        Self {
            spec,
            req,
            mask: None,
            adjust: None,
        }
    }
}

/// The sampler's working buffers for one row at a time.
struct Buffers<'a> {
    probs: &'a mut Vec<f32>,
    keys: &'a mut Vec<u64>,
    masked: &'a mut Vec<f32>,
}

/// Below this many rows a batch is sampled on the calling thread: splitting costs more than
/// it saves.
const PARALLEL_MIN_ROWS: usize = 8;

/// Samples one token per row of `logits` (`rows.len()` rows of `vocab` logits each), giving
/// exactly what calling [`sample`] row by row in order gives, but with the rows spread over
/// rayon's threads. The engine RNG's draws for unseeded requests are taken first, in row
/// order, so the parallel split never changes which draw a request gets. Threads other than
/// the caller's allocate their own buffers once per call.
pub fn sample_batch(
    logits: &[f32],
    vocab: usize,
    rows: &[SampleRow<'_>],
    scratch: &mut SamplerScratch,
) -> Vec<SampledToken> {
    let draws: Vec<Option<f64>> = rows
        .iter()
        .map(|row| engine_draw(row.spec, &mut scratch.rng))
        .collect();
    let row_logits = |i: usize| logits.get(i * vocab..(i + 1) * vocab).unwrap_or(&[]);
    let mode = scratch.logprobs_mode;
    if rows.len() < PARALLEL_MIN_ROWS {
        let mut bufs = Buffers {
            probs: &mut scratch.buf,
            keys: &mut scratch.keys,
            masked: &mut scratch.masked,
        };
        return rows
            .iter()
            .zip(&draws)
            .enumerate()
            .map(|(i, (row, &draw))| sample_with_draw(row_logits(i), *row, (draw, mode), &mut bufs))
            .collect();
    }
    rows.par_iter()
        .zip(&draws)
        .enumerate()
        .map_init(
            || (Vec::new(), Vec::new(), Vec::new()),
            |(probs, keys, masked), (i, (row, &draw))| {
                let mut bufs = Buffers {
                    probs,
                    keys,
                    masked,
                };
                sample_with_draw(row_logits(i), *row, (draw, mode), &mut bufs)
            },
        )
        .collect()
}

/// The engine RNG's draw a request consumes: one for a sampled (non-greedy) request without
/// its own seed, none otherwise.
fn engine_draw(spec: &SampleSpec, rng: &mut ChaCha8Rng) -> Option<f64> {
    let params = &spec.params;
    (!is_greedy(params) && params.seed.is_none()).then(|| unit_f64(rng))
}

/// [`sample`] with the engine draw already taken (`None` for greedy or seeded requests) and
/// the engine's logprobs mode.
fn sample_with_draw(
    raw_logits: &[f32],
    SampleRow {
        spec,
        req,
        mask,
        adjust,
    }: SampleRow<'_>,
    (engine_draw, mode): (Option<f64>, LogprobsMode),
    bufs: &mut Buffers<'_>,
) -> SampledToken {
    let Buffers {
        probs,
        keys,
        masked,
    } = bufs;
    if raw_logits.is_empty() {
        // Nothing to sample from (a zero vocabulary): answer rather than panic.
        return SampledToken {
            req,
            token: TokenId(0),
            logprob: f32::NEG_INFINITY,
            top_logprobs: Vec::new(),
        };
    }
    // A row with logits processing samples from the processed logits; a constrained row from
    // its allowed tokens alone (a mask that allows none of this row's tokens, which the engine
    // never sends, is ignored rather than sampled from).
    let processed = process_logits(raw_logits, adjust, mask, masked);
    let logits = if processed {
        masked.as_slice()
    } else {
        raw_logits
    };
    let row = RowStats::new(logits);
    let params = &spec.params;
    let (token, survivors) = if is_greedy(params) {
        (row.argmax, None)
    } else {
        let u = match (params.seed, engine_draw) {
            (Some(seed), _) => seeded_draw(seed, params.seed_stream, spec.output_idx),
            (None, Some(u)) => u,
            // Not reachable: `engine_draw` gives a draw to every unseeded sampled request.
            (None, None) => 0.0,
        };
        let token = draw(logits, &row, params, u, probs, keys);
        // Read before `top_logprobs` reuses `keys`; only processed modes need it.
        let survivors = matches!(
            mode,
            LogprobsMode::ProcessedLogprobs | LogprobsMode::ProcessedLogits
        )
        .then(|| Survivors::new(keys, probs, params.temperature));
        (token, survivors)
    };
    // The raw modes report the model's own distribution, mask or not.
    let raw_row;
    let (reported_logits, reported_row) = match mode {
        LogprobsMode::RawLogprobs | LogprobsMode::RawLogits if processed => {
            raw_row = RowStats::new(raw_logits);
            (raw_logits, &raw_row)
        }
        _ => (logits, &row),
    };
    let reported = Reported {
        logits: reported_logits,
        row: reported_row,
        mode,
        survivors,
    };
    let n_top = params.logprobs.map_or(0, |n| n as usize);
    SampledToken {
        req,
        token: TokenId(token as u32),
        logprob: reported.value(token),
        top_logprobs: top_logprobs(&reported, n_top, keys),
    }
}

/// Fills `out` with the processed `logits`: `adjust`'s processing first (bias, `min_tokens`,
/// penalties), then every token `mask` does not allow at `-inf`. False (and `out`
/// unspecified) when there is nothing to do: no processing, and no mask or one that allows
/// none of the tokens.
fn process_logits(
    logits: &[f32],
    adjust: Option<&LogitsAdjust>,
    mask: Option<&[u32]>,
    out: &mut Vec<f32>,
) -> bool {
    let mask = mask.filter(|mask| (0..logits.len()).any(|t| mask_allows(mask, TokenId(t as u32))));
    if adjust.is_none() && mask.is_none() {
        return false;
    }
    out.clear();
    match mask {
        Some(mask) => out.extend(logits.iter().enumerate().map(|(t, &l)| {
            if mask_allows(mask, TokenId(t as u32)) {
                l
            } else {
                f32::NEG_INFINITY
            }
        })),
        None => out.extend_from_slice(logits),
    }
    if let Some(adjust) = adjust {
        // Masked tokens stay at `-inf` whatever the processing does to them.
        for e in &adjust.tokens {
            let allowed = mask.is_none_or(|mask| mask_allows(mask, e.token));
            if let (Some(l), true) = (out.get_mut(e.token.index()), allowed) {
                *l = adjust.apply(e, *l);
            }
        }
    }
    true
}

/// The uniform draw in `[0, 1)` of a seeded request: ChaCha8 keyed by `seed`, on stream
/// `seed_stream << 32 | output_idx`. Every `(seed, seed_stream, output_idx)` has a stream of
/// its own (ChaCha's stream number is 64 bits wide), and seed stream 0 is the stream
/// `output_idx` alone, which a seeded request has always drawn from.
pub fn seeded_draw(seed: u64, seed_stream: u32, output_idx: u32) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream((u64::from(seed_stream) << 32) | u64::from(output_idx));
    unit_f64(&mut rng)
}

/// What survived the filters of a sampled (non-greedy) draw, for processed logprobs.
#[derive(Debug, Clone, Copy)]
struct Survivors {
    /// The worst surviving order key: the survivors are a best-first prefix of the order
    /// (top-k, the nucleus and min-p each keep one), so a token survived iff its key is at
    /// most this.
    cutoff_key: u64,
    /// `ln` of the survivors' unnormalized mass in `probs` (what the draw picked from).
    ln_mass: f64,
    temperature: f32,
}

impl Survivors {
    fn new(keys: &[u64], probs: &[f32], temperature: f32) -> Self {
        let mass: f64 = keys.iter().map(|&k| f64::from(probs[token_of(k)])).sum();
        Self {
            cutoff_key: keys.iter().copied().max().unwrap_or(u64::MAX),
            ln_mass: mass.ln(),
            temperature,
        }
    }
}

/// A row's reported values in the engine's [`LogprobsMode`].
#[derive(Debug)]
struct Reported<'a> {
    logits: &'a [f32],
    row: &'a RowStats,
    mode: LogprobsMode,
    /// `None` for a greedy request, whose processed values are its raw ones.
    survivors: Option<Survivors>,
}

impl Reported<'_> {
    fn value(&self, token: usize) -> f32 {
        let clean = self.row.clean(self.logits[token]);
        let processed = match (self.mode, self.survivors) {
            (LogprobsMode::RawLogprobs, _) => return self.row.logprob(self.logits[token]),
            (LogprobsMode::RawLogits, _) => return clean,
            (LogprobsMode::ProcessedLogprobs, None) => return self.row.logprob(self.logits[token]),
            (LogprobsMode::ProcessedLogits, None) => return clean,
            (_, Some(s)) => s,
        };
        let x = clean - self.row.max;
        if order_key(clean, token as u32) > processed.cutoff_key || x == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        if self.mode == LogprobsMode::ProcessedLogits {
            clean / processed.temperature
        } else {
            // The same `x / t` that `fill_probs` exponentiated for the draw.
            (f64::from(x / processed.temperature) - processed.ln_mass) as f32
        }
    }
}

/// Greedy when the temperature is not positive (NaN included).
fn is_greedy(params: &SamplerSpec) -> bool {
    params.temperature.is_nan() || params.temperature <= 0.0
}

/// What every path needs from the raw row: its max, argmax and log-sum-exp.
#[derive(Debug)]
struct RowStats {
    max: f32,
    argmax: usize,
    /// `ln(sum(exp(l)))` of the cleaned logits (terms in f32, accumulated in f64).
    lse: f64,
    /// No finite logit anywhere: every token counts as logit 0.
    uniform: bool,
}

impl RowStats {
    fn new(logits: &[f32]) -> Self {
        match clean_max(logits) {
            // Each term is in (0, 1] after subtracting the max, so f32 `exp` loses nothing
            // that matters (relative error ~1e-7); the f64 sum keeps 50k small terms exact
            // enough. Both passes are vector kernels: at batch 64 the scalar `expf` loop took
            // ~7% of a decode step of the default model.
            Some((max, argmax)) => Self {
                max,
                argmax,
                lse: f64::from(max) + exp_sum(logits, max).ln(),
                uniform: false,
            },
            // Every cleaned logit is 0: the max is 0 and each of the n terms is 1.
            None => Self {
                max: 0.0,
                argmax: 0,
                lse: (logits.len() as f64).ln(),
                uniform: true,
            },
        }
    }

    /// The logit as the sampler sees it: never NaN or `+inf`, and `-0.0` folded into `0.0` so
    /// order keys agree with `>`.
    fn clean(&self, l: f32) -> f32 {
        if self.uniform {
            0.0
        } else {
            clean_logit(l)
        }
    }

    fn logprob(&self, l: f32) -> f32 {
        (f64::from(self.clean(l)) - self.lse) as f32
    }

    /// Fills `keys` with one [`order_key`] per token.
    fn fill_keys(&self, logits: &[f32], keys: &mut Vec<u64>) {
        keys.clear();
        keys.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| order_key(self.clean(l), i as u32)),
        );
    }
}

/// A `u64` whose ascending order is "best first": higher logit, then lower token id. Sorting
/// and selecting plain integers is several times faster than a float comparator, and it is a
/// total order, so every selection below is deterministic. The token id is the low half.
fn order_key(clean_logit: f32, token: u32) -> u64 {
    let bits = clean_logit.to_bits();
    // The usual float-to-ordered-integer map (ascending with the float), then inverted so the
    // highest logit gets the smallest key.
    let ordered = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ordered) << 32) | u64::from(token)
}

fn token_of(key: u64) -> usize {
    key as u32 as usize
}

/// A uniform draw in `[0, 1)` with 53 random bits.
fn unit_f64(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Temperature, the filters, then the token at `u` (in `[0, 1)`) of the survivors' mass.
fn draw(
    logits: &[f32],
    row: &RowStats,
    params: &SamplerSpec,
    u: f64,
    probs: &mut Vec<f32>,
    keys: &mut Vec<u64>,
) -> usize {
    fill_probs(logits, row, params.temperature, probs);
    row.fill_keys(logits, keys);

    let top_k = params.top_k as usize;
    if top_k > 0 && top_k < keys.len() {
        keys.select_nth_unstable(top_k - 1);
        keys.truncate(top_k);
    }
    // `NaN < 1.0` is false: a NaN top_p disables the filter.
    if params.top_p < 1.0 {
        let n = nucleus_len(keys, probs, f64::from(params.top_p));
        keys.truncate(n);
    }
    if params.min_p > 0.0 {
        // Relative to the top token's probability, which is exactly 1.0 in `probs`; capped at
        // 1.0 so the top token always survives.
        let threshold = params.min_p.min(1.0);
        keys.retain(|&k| probs[token_of(k)] >= threshold);
    }
    pick(keys, probs, u)
}

/// `probs[i] = exp((l_i - max) / t)`, unnormalized (the argmax gets exactly 1.0).
fn fill_probs(logits: &[f32], row: &RowStats, t: f32, probs: &mut Vec<f32>) {
    if row.uniform {
        probs.clear();
        probs.resize(logits.len(), 1.0);
    } else {
        exp_scaled(logits, row.max, t, probs);
    }
}

/// Below this many candidates the nucleus search just sorts.
const NUCLEUS_SORT_LEN: usize = 64;

/// Reorders `keys` so that its first `n` entries are the nucleus (the smallest best-first set
/// whose mass reaches `top_p` of the total) and returns `n` (at least 1).
///
/// A weighted quickselect instead of a full sort: halve the candidate range with
/// `select_nth_unstable`, keep the better half if its mass already reaches the target, else
/// take it whole and continue in the worse half. Linear time, which matters when the nucleus
/// is thousands of tokens of a 50k vocabulary (a flat, high-temperature distribution).
fn nucleus_len(keys: &mut [u64], probs: &[f32], top_p: f64) -> usize {
    let mass = |ks: &[u64]| -> f64 { ks.iter().map(|&k| f64::from(probs[token_of(k)])).sum() };
    let target = top_p * mass(keys);
    // Invariant: keys[..lo] are better than keys[lo..] and their mass `taken` is < target
    // (or lo == 0); the answer lies in lo + 1..=hi.
    let (mut lo, mut hi, mut taken) = (0, keys.len(), 0.0);
    while hi - lo > NUCLEUS_SORT_LEN {
        let mid = lo + (hi - lo) / 2;
        keys[lo..hi].select_nth_unstable(mid - lo);
        let half = mass(&keys[lo..mid]);
        if taken + half >= target {
            hi = mid;
        } else {
            taken += half;
            lo = mid;
        }
    }
    keys[lo..hi].sort_unstable();
    for (j, &k) in keys.iter().enumerate().take(hi).skip(lo) {
        taken += f64::from(probs[token_of(k)]);
        if taken >= target {
            return j + 1;
        }
    }
    hi.max(1)
}

/// The candidate where the running mass first exceeds `u * total`.
fn pick(keys: &[u64], probs: &[f32], u: f64) -> usize {
    let total: f64 = keys.iter().map(|&k| f64::from(probs[token_of(k)])).sum();
    let target = u * total;
    let mut mass = 0.0;
    let mut last_nonzero = keys.first().map_or(0, |&k| token_of(k));
    for &k in keys {
        let p = f64::from(probs[token_of(k)]);
        if p > 0.0 {
            last_nonzero = token_of(k);
        }
        mass += p;
        if mass > target {
            return token_of(k);
        }
    }
    // Only reachable through rounding when `u` is within an ulp of 1.
    last_nonzero
}

/// The logprob of the prompt token `token` under `logits` (the row of the position before
/// it): raw log-softmax, whatever the engine's logprobs mode (vLLM reports prompt logprobs
/// so), its rank (the number of tokens whose logit is at least its own, itself included, as
/// vLLM counts it: 1 for the best) and the `top_n` best tokens.
pub fn prompt_token_logprob(logits: &[f32], token: TokenId, top_n: usize) -> PromptTokenLogprob {
    let row = RowStats::new(logits);
    let Some(&l) = logits.get(token.index()) else {
        return PromptTokenLogprob {
            token,
            logprob: f32::NEG_INFINITY,
            rank: 0,
            top: Vec::new(),
        };
    };
    let clean = row.clean(l);
    let at_least = logits.iter().filter(|&&o| row.clean(o) >= clean).count();
    let reported = Reported {
        logits,
        row: &row,
        mode: LogprobsMode::RawLogprobs,
        survivors: None,
    };
    let mut keys = Vec::new();
    PromptTokenLogprob {
        token,
        logprob: row.logprob(l),
        rank: u32::try_from(at_least).unwrap_or(u32::MAX),
        top: top_logprobs(&reported, top_n, &mut keys),
    }
}

/// The `n` best tokens of the raw logits, best first (ties: lower id), with their values.
fn top_logprobs(reported: &Reported<'_>, n: usize, keys: &mut Vec<u64>) -> Vec<(TokenId, f32)> {
    let logits = reported.logits;
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    reported.row.fill_keys(logits, keys);
    if n < keys.len() {
        keys.select_nth_unstable(n - 1);
    }
    keys[..n].sort_unstable();
    keys[..n]
        .iter()
        .map(|&k| (TokenId(k as u32), reported.value(token_of(k))))
        .collect()
}

#[cfg(test)]
mod tests;
