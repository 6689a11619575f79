//! Token sampling from one row of logits, with logprobs from the same logits.
//!
//! Order of operations, as in the usual engines: temperature, then the top-k, top-p and min-p
//! filters, then one random draw from what is left. `temperature <= 0` (or NaN) is greedy:
//! the argmax, ties going to the lowest token id. Logprobs are always those of the *raw*
//! logits (log-softmax before temperature and filters; see [`SampledToken`]).
//!
//! Randomness: with a per-request seed the draw is a function of `(seed, output_idx)` alone
//! (a ChaCha8 stream keyed by the seed, stream number `output_idx`), so a seeded request gives
//! the same tokens whatever else is in its batch and whatever was sampled before. Without a
//! seed the draw uses the engine-level RNG kept in [`SamplerScratch`]; it is seeded from OS
//! entropy by default, or explicitly with [`SamplerScratch::with_seed`] (simulations, replays).
//!
//! Stop token ids are not handled here: the scheduler checks each sampled token against the
//! request's EOS and `stop_token_ids` and finishes the request.
//!
//! Bad numbers never panic: a NaN logit counts as `-inf`, `+inf` as `f32::MAX`, and a row with
//! no finite logit at all is treated as uniform.

use std::cmp::Ordering;

use ferry_core::sampling::SamplerSpec;
use ferry_core::{ReqIdx, SampleSpec, SampledToken, TokenId};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Reusable buffers (and the engine-level RNG) so sampling allocates nothing per token in
/// steady state; only a non-empty `top_logprobs` in the returned token allocates.
#[derive(Debug)]
pub struct SamplerScratch {
    /// Unnormalized probabilities after temperature (the max-logit token has exactly 1.0).
    pub buf: Vec<f32>,
    /// Candidate token ids while filtering, then while selecting the top-n logprobs.
    idx: Vec<u32>,
    /// Draws for requests without a seed.
    rng: ChaCha8Rng,
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

    fn with_rng(rng: ChaCha8Rng) -> Self {
        Self {
            buf: Vec::new(),
            idx: Vec::new(),
            rng,
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
    if logits.is_empty() {
        // Nothing to sample from (a zero vocabulary): answer rather than panic.
        return SampledToken {
            req,
            token: 0,
            logprob: f32::NEG_INFINITY,
            top_logprobs: Vec::new(),
        };
    }
    let row = RowStats::new(logits);
    let params = &spec.params;
    let token = if is_greedy(params) {
        row.argmax
    } else {
        let u = match params.seed {
            Some(seed) => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(u64::from(spec.output_idx));
                unit_f64(&mut rng)
            }
            None => unit_f64(&mut scratch.rng),
        };
        draw(logits, &row, params, u, scratch)
    };
    let n_top = params.logprobs.map_or(0, |n| n as usize);
    SampledToken {
        req,
        token: token as TokenId,
        logprob: row.logprob(logits[token]),
        top_logprobs: top_logprobs(logits, &row, n_top, &mut scratch.idx),
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
    /// `ln(sum(exp(l)))` of the cleaned logits, accumulated in f64.
    lse: f64,
    /// No finite logit anywhere: every token counts as logit 0.
    uniform: bool,
}

impl RowStats {
    fn new(logits: &[f32]) -> Self {
        let mut stats = Self {
            max: f32::NEG_INFINITY,
            argmax: 0,
            lse: 0.0,
            uniform: false,
        };
        for (i, &l) in logits.iter().enumerate() {
            let l = stats.clean(l);
            // Strictly greater: ties keep the lowest id.
            if l > stats.max {
                stats.max = l;
                stats.argmax = i;
            }
        }
        if stats.max == f32::NEG_INFINITY {
            stats.uniform = true;
            stats.max = 0.0;
        }
        let max = f64::from(stats.max);
        let sum: f64 = logits
            .iter()
            .map(|&l| (f64::from(stats.clean(l)) - max).exp())
            .sum();
        stats.lse = max + sum.ln();
        stats
    }

    /// The logit as the sampler sees it: never NaN or `+inf`, and `-0.0` folded into `0.0` so
    /// comparisons agree with `>`.
    fn clean(&self, l: f32) -> f32 {
        if self.uniform {
            0.0
        } else if l.is_nan() {
            f32::NEG_INFINITY
        } else if l == f32::INFINITY {
            f32::MAX
        } else {
            l + 0.0
        }
    }

    fn logprob(&self, l: f32) -> f32 {
        (f64::from(self.clean(l)) - self.lse) as f32
    }

    /// Best first: higher logit, then lower token id (a total order, so every selection and
    /// sort below is deterministic).
    fn better(&self, logits: &[f32], a: u32, b: u32) -> Ordering {
        let (la, lb) = (
            self.clean(logits[a as usize]),
            self.clean(logits[b as usize]),
        );
        lb.partial_cmp(&la)
            .unwrap_or(Ordering::Equal)
            .then(a.cmp(&b))
    }
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
    scratch: &mut SamplerScratch,
) -> usize {
    let SamplerScratch {
        buf: probs, idx, ..
    } = scratch;
    fill_probs(logits, row, f64::from(params.temperature), probs);
    idx.clear();
    idx.extend(0..logits.len() as u32);
    let better = |a: &u32, b: &u32| row.better(logits, *a, *b);

    let top_k = params.top_k as usize;
    if top_k > 0 && top_k < idx.len() {
        idx.select_nth_unstable_by(top_k - 1, better);
        idx.truncate(top_k);
    }
    // `NaN < 1.0` is false: a NaN top_p disables the filter.
    if params.top_p < 1.0 {
        let n = nucleus_len(idx, probs, f64::from(params.top_p), better);
        idx.truncate(n);
    }
    if params.min_p > 0.0 {
        // Relative to the top token's probability, which is exactly 1.0 in `probs`; capped at
        // 1.0 so the top token always survives.
        let threshold = params.min_p.min(1.0);
        idx.retain(|&i| probs[i as usize] >= threshold);
    }
    pick(idx, probs, u)
}

/// `probs[i] = exp((l_i - max) / t)`, unnormalized (the argmax gets exactly 1.0).
fn fill_probs(logits: &[f32], row: &RowStats, t: f64, probs: &mut Vec<f32>) {
    probs.clear();
    probs.extend(logits.iter().map(|&l| {
        let x = row.clean(l) - row.max;
        if x == f32::NEG_INFINITY {
            // Also avoids `-inf / inf = NaN` for an infinite temperature.
            0.0
        } else {
            (f64::from(x) / t).exp() as f32
        }
    }));
}

/// Sorts `idx` best-first just far enough to find the smallest prefix whose mass reaches
/// `top_p` of the total, and returns its length (at least 1).
///
/// The nucleus is usually small next to a 50k vocabulary, so instead of sorting everything
/// this selects and sorts chunks of growing size (64, 256, ...) until the mass is reached.
fn nucleus_len(
    idx: &mut [u32],
    probs: &[f32],
    top_p: f64,
    mut better: impl FnMut(&u32, &u32) -> Ordering,
) -> usize {
    let total: f64 = idx.iter().map(|&i| f64::from(probs[i as usize])).sum();
    let target = top_p * total;
    let (mut sorted, mut chunk, mut mass) = (0, 64, 0.0);
    while sorted < idx.len() {
        let end = (sorted + chunk).min(idx.len());
        if end < idx.len() {
            idx[sorted..].select_nth_unstable_by(end - sorted - 1, &mut better);
        }
        idx[sorted..end].sort_unstable_by(&mut better);
        for (j, &i) in idx.iter().enumerate().take(end).skip(sorted) {
            mass += f64::from(probs[i as usize]);
            if mass >= target {
                return j + 1;
            }
        }
        sorted = end;
        chunk *= 4;
    }
    idx.len()
}

/// The candidate where the running mass first exceeds `u * total`.
fn pick(idx: &[u32], probs: &[f32], u: f64) -> usize {
    let total: f64 = idx.iter().map(|&i| f64::from(probs[i as usize])).sum();
    let target = u * total;
    let mut mass = 0.0;
    let mut last_nonzero = idx.first().copied().unwrap_or(0);
    for &i in idx {
        let p = f64::from(probs[i as usize]);
        if p > 0.0 {
            last_nonzero = i;
        }
        mass += p;
        if mass > target {
            return i as usize;
        }
    }
    // Only reachable through rounding when `u` is within an ulp of 1.
    last_nonzero as usize
}

/// The `n` best `(token, logprob)` pairs of the raw logits, best first (ties: lower id).
fn top_logprobs(
    logits: &[f32],
    row: &RowStats,
    n: usize,
    idx: &mut Vec<u32>,
) -> Vec<(TokenId, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    idx.clear();
    idx.extend(0..logits.len() as u32);
    let better = |a: &u32, b: &u32| row.better(logits, *a, *b);
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, better);
    }
    idx[..n].sort_unstable_by(better);
    idx[..n]
        .iter()
        .map(|&i| (i, row.logprob(logits[i as usize])))
        .collect()
}

#[cfg(test)]
#[path = "sampler_tests.rs"]
mod tests;
