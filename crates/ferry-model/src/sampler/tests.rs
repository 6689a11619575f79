//! Tests of the sampler: greedy, filters, seeded reproducibility, empirical frequencies
//! against softmax, and logprobs against a naive f64 reference.

use super::*;

fn spec(temperature: f32) -> SampleSpec {
    SampleSpec {
        params: SamplerSpec {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            seed_stream: 0,
            logprobs: None,
        },
        output_idx: 0,
        mask: None,
        adjust: None,
    }
}

fn seeded(temperature: f32, seed: u64, output_idx: u32) -> SampleSpec {
    let mut s = spec(temperature);
    s.params.seed = Some(seed);
    s.output_idx = output_idx;
    s
}

/// Deterministic pseudo-random logits in `[-scale, scale)`.
fn random_logits(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| (unit_f64(&mut rng) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

fn token(logits: &[f32], s: &SampleSpec, scratch: &mut SamplerScratch) -> u32 {
    sample(logits, s, ReqIdx(0), scratch).token.0
}

/// Plain f64 softmax of `logits / t`, the reference for frequencies and logprobs.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let exps: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / t).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// Pearson's chi-square statistic of observed counts against expected probabilities.
fn chi_square(counts: &[u32], probs: &[f64]) -> f64 {
    let n: f64 = counts.iter().map(|&c| f64::from(c)).sum();
    counts
        .iter()
        .zip(probs)
        .filter(|(_, &p)| p > 0.0)
        .map(|(&c, &p)| (f64::from(c) - n * p).powi(2) / (n * p))
        .sum()
}

#[test]
fn greedy_is_argmax_with_ties_to_lowest_id() {
    let mut scratch = SamplerScratch::with_seed(0);
    assert_eq!(token(&[1.0, 3.0, 3.0, 2.0], &spec(0.0), &mut scratch), 1);
    assert_eq!(token(&[-0.0, 0.0, -1.0], &spec(0.0), &mut scratch), 0);
    for seed in 0..20 {
        let logits = random_logits(seed, 1000, 5.0);
        let naive = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        assert_eq!(token(&logits, &spec(0.0), &mut scratch), naive);
        assert_eq!(token(&logits, &spec(-1.0), &mut scratch), naive);
        assert_eq!(token(&logits, &spec(f32::NAN), &mut scratch), naive);
    }
}

#[test]
fn top_k_one_equals_greedy() {
    let mut scratch = SamplerScratch::with_seed(1);
    for seed in 0..50 {
        let mut logits = random_logits(seed, 300, 1.0);
        // A tie for the best logit: top-1 must keep the lower id, like greedy.
        logits[250] = 2.0;
        logits[(seed as usize * 7) % 250] = 2.0;
        let greedy = token(&logits, &spec(0.0), &mut scratch);
        let mut s = seeded(1.5, seed, 3);
        s.params.top_k = 1;
        assert_eq!(token(&logits, &s, &mut scratch), greedy);
    }
}

#[test]
fn seeded_draws_depend_only_on_seed_and_output_idx() {
    let logits = random_logits(9, 1000, 0.5);
    let draws = |scratch: &mut SamplerScratch, seed: u64| -> Vec<u32> {
        (0..32)
            .map(|i| token(&logits, &seeded(1.0, seed, i), scratch))
            .collect()
    };
    let mut a = SamplerScratch::with_seed(1);
    let mut b = SamplerScratch::default();
    let first = draws(&mut a, 42);
    // Unrelated unseeded draws in between (other requests of a batch) change nothing.
    for _ in 0..5 {
        token(&logits, &spec(1.0), &mut b);
    }
    assert_eq!(draws(&mut b, 42), first);
    // One output index alone, out of order, gives the same token.
    assert_eq!(token(&logits, &seeded(1.0, 42, 17), &mut a), first[17]);
    // The draws vary along the sequence and between seeds.
    assert!(first.iter().any(|&t| t != first[0]));
    assert_ne!(draws(&mut a, 43), first);
}

/// The first four draws of each seeded stream, as bits (a stream's fingerprint).
fn stream_fingerprint(seed: u64, seed_stream: u32) -> [u64; 4] {
    std::array::from_fn(|i| seeded_draw(seed, seed_stream, i as u32).to_bits())
}

/// An RL loop seeds prompt k with `base + k` and asks for n = 16 samples each: choice i of
/// seed s draws from stream (s, i), so 128 seeds × 16 choices are 2,048 distinct streams.
/// Keyed by `seed + i` instead (vLLM's way, and ferry's before), the same grid reuses
/// streams: only 143 distinct ones.
#[test]
fn seed_streams_are_distinct_across_seeds_and_choices() {
    let keyed_by_pair: std::collections::BTreeSet<[u64; 4]> = (0..128u64)
        .flat_map(|seed| (0..16u32).map(move |i| stream_fingerprint(seed, i)))
        .collect();
    assert_eq!(keyed_by_pair.len(), 2048);
    let keyed_by_sum: std::collections::BTreeSet<[u64; 4]> = (0..128u64)
        .flat_map(|seed| (0..16u64).map(move |i| stream_fingerprint(seed + i, 0)))
        .collect();
    assert_eq!(keyed_by_sum.len(), 143);
    // Stream 0 is the stream a lone seeded request always drew from: ChaCha8 keyed by the
    // seed, stream number `output_idx`.
    for (seed, output_idx) in [(0u64, 0u32), (7, 3), (u64::MAX, 1000)] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(u64::from(output_idx));
        assert_eq!(seeded_draw(seed, 0, output_idx), unit_f64(&mut rng));
    }
    // The sampler draws from the request's seed stream: choice 3 of seed 7 is not seed 10's
    // choice 0, and a spec with seed stream i samples what `seeded_draw(seed, i, _)` says.
    let logits = random_logits(5, 4000, 0.1);
    let tokens = |seed: u64, seed_stream: u32| -> Vec<u32> {
        let mut scratch = SamplerScratch::with_seed(0);
        (0..16)
            .map(|idx| {
                let mut s = seeded(1.0, seed, idx);
                s.params.seed_stream = seed_stream;
                token(&logits, &s, &mut scratch)
            })
            .collect()
    };
    assert_ne!(tokens(7, 3), tokens(10, 0));
    assert_ne!(tokens(7, 3), tokens(7, 0));
    assert_eq!(tokens(7, 3), tokens(7, 3));
}

#[test]
fn unseeded_draws_follow_the_engine_rng() {
    let logits = random_logits(3, 1000, 0.5);
    let run = |engine_seed| {
        let mut scratch = SamplerScratch::with_seed(engine_seed);
        (0..16)
            .map(|_| token(&logits, &spec(1.0), &mut scratch))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

/// 20,000 seeded draws over 8 tokens; the chi-square statistic against softmax(l / T) must
/// stay under 24.32, the 0.1% critical value for 7 degrees of freedom. The seeds are fixed, so
/// the test is deterministic; a sampler off by a few percent on any token fails it.
#[test]
fn temperature_frequencies_match_softmax() {
    let logits = [0.0, 0.5, 1.0, 1.5, -1.0, 2.0, 0.2, -0.5];
    let mut scratch = SamplerScratch::with_seed(0);
    for t in [0.7f32, 1.0, 2.5] {
        let mut counts = [0u32; 8];
        for i in 0..20_000 {
            counts[token(&logits, &seeded(t, 1234, i), &mut scratch) as usize] += 1;
        }
        let chi2 = chi_square(&counts, &softmax(&logits, f64::from(t)));
        assert!(chi2 < 24.32, "T={t}: chi2 {chi2}, counts {counts:?}");
    }
}

#[test]
fn top_k_frequencies_match_the_renormalized_top_tokens() {
    let logits = [0.0, 0.5, 1.0, 1.5, -1.0, 2.0, 0.2, -0.5];
    let mut scratch = SamplerScratch::with_seed(0);
    let mut counts = [0u32; 8];
    for _ in 0..20_000 {
        let mut s = spec(1.0);
        s.params.top_k = 3;
        counts[token(&logits, &s, &mut scratch) as usize] += 1;
    }
    // Top 3: tokens 5, 3, 2; the others must never be drawn.
    let kept = [2usize, 3, 5];
    for (i, &c) in counts.iter().enumerate() {
        assert_eq!(c == 0, !kept.contains(&i), "counts {counts:?}");
    }
    let top: Vec<f32> = kept.iter().map(|&i| logits[i]).collect();
    let kept_counts: Vec<u32> = kept.iter().map(|&i| counts[i]).collect();
    // 2 degrees of freedom: 13.82 at 0.1%.
    let chi2 = chi_square(&kept_counts, &softmax(&top, 1.0));
    assert!(chi2 < 13.82, "chi2 {chi2}, counts {counts:?}");
}

/// The nucleus by a full sort: the smallest best-first prefix whose probability reaches `p`.
fn naive_nucleus(logits: &[f32], t: f64, p: f64) -> Vec<u32> {
    let probs = softmax(logits, t);
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    let mut mass = 0.0;
    let n = order
        .iter()
        .position(|&i| {
            mass += probs[i as usize];
            mass >= p - 1e-9
        })
        .unwrap_or(order.len() - 1);
    order.truncate(n + 1);
    order
}

/// Logits whose probabilities halve from one token to the next: 1/2, 1/4, 1/8, ... (10 tokens).
fn halving_logits() -> Vec<f32> {
    (0..10)
        .map(|i| -(i as f32) * std::f32::consts::LN_2)
        .collect()
}

/// Which of the 10 halving tokens `n_draws` seeded draws (seed `seed`, output indexes
/// `0..n_draws`, temperature 1) produce with the filters `configure` sets.
fn halving_tokens_seen(n_draws: u32, seed: u64, configure: impl Fn(&mut SampleSpec)) -> [bool; 10] {
    let halving = halving_logits();
    let mut scratch = SamplerScratch::with_seed(2);
    let mut seen = [false; 10];
    for i in 0..n_draws {
        let mut s = seeded(1.0, seed, i);
        configure(&mut s);
        seen[token(&halving, &s, &mut scratch) as usize] = true;
    }
    seen
}

#[test]
fn top_p_never_picks_outside_the_nucleus() {
    // p = 0.7 keeps exactly tokens 0 and 1.
    let seen = halving_tokens_seen(2000, 77, |s| s.params.top_p = 0.7);
    assert_eq!(&seen[..2], &[true, true]);
    assert!(
        seen[2..].iter().all(|&s| !s),
        "a token outside the nucleus: {seen:?}"
    );

    let mut scratch = SamplerScratch::with_seed(2);
    for seed in 0..10 {
        let logits = random_logits(seed, 2000, 3.0);
        for (p, t) in [(0.5f32, 1.0f32), (0.9, 0.8), (0.95, 2.0)] {
            let nucleus = naive_nucleus(&logits, f64::from(t), f64::from(p));
            for i in 0..50 {
                let mut s = seeded(t, seed, i);
                s.params.top_p = p;
                let tok = token(&logits, &s, &mut scratch);
                assert!(nucleus.contains(&tok), "p={p} T={t}: token {tok} outside");
            }
        }
    }
}

/// The weighted quickselect finds the same nucleus as a full sort, also when the nucleus is
/// thousands of tokens long (many halving rounds).
#[test]
fn nucleus_len_matches_a_full_sort_on_a_large_vocab() {
    let mut scratch = SamplerScratch::with_seed(0);
    for (seed, scale, p) in [
        (1u64, 0.5f32, 0.9f32),
        (2, 8.0, 0.9),
        (3, 2.0, 0.3),
        (4, 0.1, 0.99),
    ] {
        let logits = random_logits(seed, 49_152, scale);
        let row = RowStats::new(&logits);
        fill_probs(&logits, &row, 1.0, &mut scratch.buf);
        let mut keys = Vec::new();
        row.fill_keys(&logits, &mut keys);
        let n = nucleus_len(&mut keys, &scratch.buf, f64::from(p));
        keys[..n].sort_unstable();
        let idx: Vec<u32> = keys[..n].iter().map(|&k| token_of(k) as u32).collect();
        let naive = naive_nucleus(&logits, 1.0, f64::from(p));
        // f32 probabilities may move the boundary by a token.
        assert!(n.abs_diff(naive.len()) <= 1, "n {n}, naive {}", naive.len());
        let common = n.min(naive.len());
        assert_eq!(&idx[..common], &naive[..common]);
    }
}

#[test]
fn min_p_never_picks_below_the_threshold() {
    // min_p = 0.3 keeps tokens with p >= 0.15 (0 and 1).
    let seen = halving_tokens_seen(2000, 5, |s| s.params.min_p = 0.3);
    assert_eq!(&seen[..2], &[true, true]);
    assert!(
        seen[2..].iter().all(|&s| !s),
        "a token below min_p: {seen:?}"
    );
    // min_p above 1 still keeps the top token.
    let mut s = seeded(1.0, 5, 0);
    s.params.min_p = 3.0;
    let mut scratch = SamplerScratch::with_seed(2);
    assert_eq!(token(&halving_logits(), &s, &mut scratch), 0);
}

#[test]
fn filters_combine() {
    // Unnormalized masses 1, 1/2, 1/4, ...: top_k 5 keeps 0..5 (mass 1.9375), top_p 0.95
    // then keeps 0..4 (1.875 >= 0.95 * 1.9375), min_p 0.2 then keeps 0..3 (p >= 0.2 of the
    // top): only tokens 0, 1, 2 can appear.
    let seen = halving_tokens_seen(3000, 8, |s| {
        s.params.top_k = 5;
        s.params.top_p = 0.95;
        s.params.min_p = 0.2;
    });
    assert_eq!(&seen[..4], &[true, true, true, false]);
    assert!(seen[4..].iter().all(|&s| !s));
}

#[test]
fn logprobs_match_a_naive_reference_and_sum_to_one() {
    let logits = random_logits(11, 500, 6.0);
    let reference: Vec<f64> = softmax(&logits, 1.0).iter().map(|p| p.ln()).collect();
    let mut scratch = SamplerScratch::with_seed(4);
    for t in [0.0f32, 0.5, 1.0] {
        let mut s = seeded(t, 3, 0);
        s.params.logprobs = Some(500);
        let out = sample(&logits, &s, ReqIdx(7), &mut scratch);
        assert_eq!(out.req, ReqIdx(7));
        // Raw logprobs: the temperature does not change them.
        let want = reference[out.token.index()];
        assert!((f64::from(out.logprob) - want).abs() < 1e-5);
        assert_eq!(out.top_logprobs.len(), 500);
        let sum: f64 = out
            .top_logprobs
            .iter()
            .map(|&(_, lp)| f64::from(lp).exp())
            .sum();
        assert!((sum - 1.0).abs() < 1e-5, "sum {sum}");
        for w in out.top_logprobs.windows(2) {
            assert!(w[0].1 >= w[1].1, "not best first: {w:?}");
        }
        for &(tok, lp) in &out.top_logprobs {
            assert!((f64::from(lp) - reference[tok.index()]).abs() < 1e-5);
        }
    }
}

#[test]
fn top_logprobs_are_the_n_best_in_order() {
    let logits = [0.5, 3.0, -1.0, 3.0, 2.0, f32::NAN];
    let mut s = spec(0.0);
    s.params.logprobs = Some(3);
    let out = sample(&logits, &s, ReqIdx(0), &mut SamplerScratch::with_seed(0));
    let ids: Vec<u32> = out.top_logprobs.iter().map(|&(t, _)| t.0).collect();
    assert_eq!(ids, [1, 3, 4]);
    assert_eq!(out.top_logprobs[0].1, out.logprob);
    s.params.logprobs = Some(0);
    let out = sample(&logits, &s, ReqIdx(0), &mut SamplerScratch::with_seed(0));
    assert!(out.top_logprobs.is_empty());
    s.params.logprobs = Some(100);
    let out = sample(&logits, &s, ReqIdx(0), &mut SamplerScratch::with_seed(0));
    assert_eq!(out.top_logprobs.len(), 6);
    assert_eq!(out.top_logprobs[5], (TokenId(5), f32::NEG_INFINITY));
}

#[test]
fn bad_numbers_never_panic() {
    let mut scratch = SamplerScratch::with_seed(0);
    let nan_row = [f32::NAN, 1.0, f32::NAN, 0.5];
    for i in 0..200 {
        let t = token(&nan_row, &seeded(1.0, 1, i), &mut scratch);
        assert!(t == 1 || t == 3, "NaN logit {t} was drawn");
    }
    // No finite logit: uniform.
    let mut s = seeded(1.0, 1, 0);
    s.params.logprobs = Some(1);
    let out = sample(
        &[f32::NAN, f32::NEG_INFINITY, f32::NAN],
        &s,
        ReqIdx(0),
        &mut scratch,
    );
    assert!((out.logprob - (-(3f32).ln())).abs() < 1e-6);
    // +inf dominates.
    let inf_row = [1.0, f32::INFINITY, 2.0];
    for i in 0..50 {
        assert_eq!(token(&inf_row, &seeded(1.0, 2, i), &mut scratch), 1);
    }
    assert_eq!(token(&[], &spec(1.0), &mut scratch), 0);
    let mut s = seeded(f32::INFINITY, 1, 0);
    s.params.top_p = f32::NAN;
    s.params.min_p = f32::NAN;
    assert!(token(&[0.0, 1.0], &s, &mut scratch) < 2);
}

#[test]
fn steady_state_sampling_reuses_its_buffers() {
    let logits = random_logits(1, 4096, 2.0);
    let mut scratch = SamplerScratch::with_seed(0);
    let mut s = seeded(0.8, 1, 0);
    s.params.top_k = 100;
    s.params.top_p = 0.9;
    s.params.logprobs = Some(5);
    sample(&logits, &s, ReqIdx(0), &mut scratch);
    let (buf, idx) = (scratch.buf.as_ptr(), scratch.keys.as_ptr());
    for i in 1..20 {
        s.output_idx = i;
        sample(&logits, &s, ReqIdx(0), &mut scratch);
    }
    assert_eq!(scratch.buf.as_ptr(), buf);
    assert_eq!(scratch.keys.as_ptr(), idx);
}

#[test]
fn order_keys_sort_best_first() {
    let row = RowStats::new(&[0.0]);
    let logits = [
        -1.0,
        2.5,
        f32::NEG_INFINITY,
        -0.0,
        0.0,
        2.5,
        f32::MAX,
        -3.0e-39,
        1.0e-39,
    ];
    let mut keys = Vec::new();
    row.fill_keys(&logits, &mut keys);
    keys.sort_unstable();
    let order: Vec<usize> = keys.iter().map(|&k| token_of(k)).collect();
    assert_eq!(order, [6, 1, 5, 8, 3, 4, 7, 0, 2]);
}

/// The tokens a naive f64 implementation allows after top-k, top-p and min-p, with the top-p
/// and min-p thresholds loosened by `slack` so f32 rounding at a boundary cannot flake.
fn naive_allowed(logits: &[f32], p: &SamplerSpec, slack: f64) -> Vec<u32> {
    let t = f64::from(p.temperature);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f64> = logits
        .iter()
        .map(|&l| ((f64::from(l) - f64::from(max)) / t).exp())
        .collect();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if p.top_k > 0 {
        order.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let total: f64 = order.iter().map(|&i| probs[i as usize]).sum();
        let target = (f64::from(p.top_p) + slack).min(1.0) * total;
        let mut mass = 0.0;
        let n = order
            .iter()
            .position(|&i| {
                mass += probs[i as usize];
                mass >= target
            })
            .map_or(order.len(), |j| j + 1);
        order.truncate(n);
    }
    let min_p = f64::from(p.min_p.min(1.0)) - slack;
    order.retain(|&i| probs[i as usize] >= min_p);
    order
}

proptest::proptest! {
    /// Whatever the parameters, the sampled token is one the filters allow, and its logprob
    /// is the raw log-softmax.
    #[test]
    fn sampled_tokens_respect_every_filter(
        // Half-integer logits, so exact ties are common.
        halves in proptest::collection::vec(-20i32..20, 1..150),
        temperature in 0.05f32..3.0,
        top_k in 0u32..20,
        top_p in 0.05f32..1.2,
        min_p in 0.0f32..1.0,
        seed in proptest::prelude::any::<u64>(),
        output_idx in 0u32..1000,
    ) {
        let logits: Vec<f32> = halves.iter().map(|&h| h as f32 * 0.5).collect();
        let s = SampleSpec {
            params: SamplerSpec { temperature, top_k, top_p, min_p, seed: Some(seed), seed_stream: 0, logprobs: Some(1) },
            output_idx,
            mask: None,
            adjust: None,
        };
        let out = sample(&logits, &s, ReqIdx(0), &mut SamplerScratch::with_seed(0));
        let allowed = naive_allowed(&logits, &s.params, 1e-4);
        proptest::prop_assert!(allowed.contains(&out.token.0), "token {} not in {:?}", out.token, allowed);
        let reference = softmax(&logits, 1.0)[out.token.index()].ln();
        proptest::prop_assert!((f64::from(out.logprob) - reference).abs() < 1e-4);
        let greedy = token(&logits, &spec(0.0), &mut SamplerScratch::with_seed(0));
        proptest::prop_assert_eq!(out.top_logprobs[0].0, TokenId(greedy));
    }
}

/// A mixed batch: greedy, seeded and unseeded rows, filters and logprobs.
fn mixed_batch(n: usize) -> Vec<SampleSpec> {
    (0..n)
        .map(|i| {
            let mut s = match i % 4 {
                0 => spec(0.0),
                1 => seeded(0.8, 40 + i as u64, i as u32),
                _ => spec(0.5 + i as f32 * 0.1),
            };
            s.params.top_k = if i % 5 == 0 { 20 } else { 0 };
            s.params.top_p = if i % 3 == 0 { 0.9 } else { 1.0 };
            s.params.min_p = if i % 7 == 0 { 0.05 } else { 0.0 };
            s.params.logprobs = (i % 2 == 0).then_some(3);
            s
        })
        .collect()
}

#[test]
fn a_batch_samples_exactly_what_row_by_row_sampling_gives() {
    let vocab = 2000;
    // Below and above the parallel threshold.
    for n in [3, PARALLEL_MIN_ROWS, 37] {
        let logits: Vec<f32> = (0..n)
            .flat_map(|i| random_logits(100 + i as u64, vocab, 6.0))
            .collect();
        let specs = mixed_batch(n);
        let rows: Vec<SampleRow<'_>> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| SampleRow::new(s, ReqIdx(i as u32)))
            .collect();
        for engine_seed in [1, 2] {
            let mut serial = SamplerScratch::with_seed(engine_seed);
            let expected: Vec<SampledToken> = rows
                .iter()
                .enumerate()
                .map(|(i, row)| {
                    sample(
                        &logits[i * vocab..(i + 1) * vocab],
                        row.spec,
                        row.req,
                        &mut serial,
                    )
                })
                .collect();
            let mut batch = SamplerScratch::with_seed(engine_seed);
            let got = sample_batch(&logits, vocab, &rows, &mut batch);
            assert_eq!(got, expected, "{n} rows, engine seed {engine_seed}");
            // The engine RNG advanced by exactly the same draws.
            assert_eq!(unit_f64(&mut batch.rng), unit_f64(&mut serial.rng));
        }
    }
}

#[test]
fn logprobs_modes_parse_and_print_as_vllm_names() {
    for mode in LogprobsMode::ALL {
        assert_eq!(mode.to_string().parse::<LogprobsMode>(), Ok(mode));
    }
    assert_eq!(LogprobsMode::default(), LogprobsMode::RawLogprobs);
    assert_eq!(
        "processed_logprobs".parse::<LogprobsMode>(),
        Ok(LogprobsMode::ProcessedLogprobs)
    );
    assert!("processed".parse::<LogprobsMode>().is_err());
}

/// What each mode must report for token `tok`, computed in f64 from the raw logits alone:
/// `allowed` is the set the filters keep (from `naive_allowed`), `t` the temperature.
fn mode_reference(mode: LogprobsMode, logits: &[f32], allowed: &[u32], t: f64, tok: u32) -> f64 {
    let l = f64::from(logits[tok as usize]);
    let lse = |xs: &mut dyn Iterator<Item = f64>| -> f64 {
        let xs: Vec<f64> = xs.collect();
        let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        max + xs.iter().map(|x| (x - max).exp()).sum::<f64>().ln()
    };
    let kept = allowed.contains(&tok);
    match mode {
        LogprobsMode::RawLogprobs => l - lse(&mut logits.iter().map(|&x| f64::from(x))),
        LogprobsMode::RawLogits => l,
        LogprobsMode::ProcessedLogits if kept => l / t,
        LogprobsMode::ProcessedLogprobs if kept => {
            l / t - lse(&mut allowed.iter().map(|&i| f64::from(logits[i as usize]) / t))
        }
        LogprobsMode::ProcessedLogits | LogprobsMode::ProcessedLogprobs => f64::NEG_INFINITY,
    }
}

/// Every mode against its reference from the raw logits: the sampled token's value and every
/// top-n value (the whole vocabulary), sampled with temperature 0.7 and all three filters.
#[test]
fn each_logprobs_mode_matches_a_reference_from_the_raw_logits() {
    let logits = random_logits(21, 400, 4.0);
    let (t, top_k, top_p, min_p) = (0.7f32, 40u32, 0.9f32, 0.02f32);
    let filters = SamplerSpec {
        temperature: t,
        top_k,
        top_p,
        min_p,
        seed: None,
        seed_stream: 0,
        logprobs: Some(400),
    };
    let allowed = naive_allowed(&logits, &filters, 0.0);
    // The filters bite: fewer than top_k survive, more than one does.
    assert!(
        allowed.len() > 1 && allowed.len() < top_k as usize,
        "{allowed:?}"
    );
    for mode in LogprobsMode::ALL {
        let mut scratch = SamplerScratch::with_seed(9);
        scratch.set_logprobs_mode(mode);
        for i in 0..20 {
            let s = SampleSpec {
                params: SamplerSpec {
                    seed: Some(3),
                    ..filters
                },
                output_idx: i,
                mask: None,
                adjust: None,
            };
            let out = sample(&logits, &s, ReqIdx(0), &mut scratch);
            assert!(
                allowed.contains(&out.token.0),
                "{mode}: token {}",
                out.token
            );
            let check = |tok: u32, got: f32| {
                let want = mode_reference(mode, &logits, &allowed, f64::from(t), tok);
                if want == f64::NEG_INFINITY {
                    assert_eq!(got, f32::NEG_INFINITY, "{mode}: token {tok}");
                } else {
                    let err = (f64::from(got) - want).abs();
                    assert!(err < 1e-4, "{mode}: token {tok}: {got} vs {want}");
                }
            };
            check(out.token.0, out.logprob);
            assert_eq!(out.top_logprobs.len(), 400);
            for &(tok, v) in &out.top_logprobs {
                check(tok.0, v);
            }
            // The list is in the raw order whatever the mode: filtered tokens last.
            let ids: Vec<u32> = out.top_logprobs.iter().map(|&(tok, _)| tok.0).collect();
            assert_eq!(&ids[..allowed.len()], &allowed[..], "{mode}");
        }
        // The processed logprobs are a distribution over the survivors.
        if mode == LogprobsMode::ProcessedLogprobs {
            let s = SampleSpec {
                params: SamplerSpec {
                    seed: Some(3),
                    ..filters
                },
                output_idx: 0,
                mask: None,
                adjust: None,
            };
            let out = sample(&logits, &s, ReqIdx(0), &mut scratch);
            let mass: f64 = out
                .top_logprobs
                .iter()
                .map(|&(_, lp)| f64::from(lp).exp())
                .sum();
            assert!((mass - 1.0).abs() < 1e-5, "mass {mass}");
        }
    }
}

/// Temperature 0 is greedy (as in vLLM): nothing is scaled or filtered, so the processed
/// values are the raw ones; without filters at temperature 1, processed equals raw too.
#[test]
fn processed_values_of_greedy_and_unfiltered_requests_are_the_raw_ones() {
    let logits = random_logits(22, 300, 3.0);
    let run = |mode: LogprobsMode, temperature: f32, top_k: u32| {
        let mut scratch = SamplerScratch::with_seed(1);
        scratch.set_logprobs_mode(mode);
        let mut s = seeded(temperature, 4, 0);
        s.params.top_k = top_k;
        s.params.logprobs = Some(300);
        sample(&logits, &s, ReqIdx(0), &mut scratch)
    };
    let close = |a: &SampledToken, b: &SampledToken| {
        assert_eq!(a.token, b.token);
        assert!((a.logprob - b.logprob).abs() < 1e-5);
        for (x, y) in a.top_logprobs.iter().zip(&b.top_logprobs) {
            assert_eq!(x.0, y.0);
            assert!((x.1 - y.1).abs() < 1e-5, "{x:?} {y:?}");
        }
    };
    for top_k in [0, 5] {
        assert_eq!(
            run(LogprobsMode::ProcessedLogprobs, 0.0, top_k),
            run(LogprobsMode::RawLogprobs, 0.0, top_k)
        );
        assert_eq!(
            run(LogprobsMode::ProcessedLogits, 0.0, top_k),
            run(LogprobsMode::RawLogits, 0.0, top_k)
        );
    }
    close(
        &run(LogprobsMode::ProcessedLogprobs, 1.0, 0),
        &run(LogprobsMode::RawLogprobs, 1.0, 0),
    );
    close(
        &run(LogprobsMode::ProcessedLogits, 1.0, 0),
        &run(LogprobsMode::RawLogits, 1.0, 0),
    );
    // With top-k 5 at temperature 1, processed masks all but five tokens.
    let out = run(LogprobsMode::ProcessedLogprobs, 1.0, 5);
    let finite = out
        .top_logprobs
        .iter()
        .filter(|(_, v)| v.is_finite())
        .count();
    assert_eq!(finite, 5);
}

/// A mask allowing exactly `allowed` out of `vocab` tokens.
fn mask_of(vocab: usize, allowed: &[usize]) -> Vec<u32> {
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    for &t in allowed {
        mask[t / 32] |= 1 << (t % 32);
    }
    mask
}

/// The logits a mask leaves: disallowed tokens at `-inf`.
fn masked_by_hand(logits: &[f32], allowed: &[usize]) -> Vec<f32> {
    (0..logits.len())
        .map(|t| {
            if allowed.contains(&t) {
                logits[t]
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

#[test]
fn a_masked_sample_is_the_sample_of_the_masked_logits_with_raw_logprobs() {
    let vocab = 300;
    let logits = random_logits(9, vocab, 5.0);
    // Not the argmax, and spread over several mask words.
    let best = RowStats::new(&logits).argmax;
    let allowed: Vec<usize> = (0..vocab).filter(|t| t % 7 == 3 && *t != best).collect();
    let mask = mask_of(vocab, &allowed);
    let by_hand = masked_by_hand(&logits, &allowed);
    let mut specs = mixed_batch(24);
    specs.iter_mut().for_each(|s| s.params.logprobs = Some(4));
    for mode in LogprobsMode::ALL {
        for (i, s) in specs.iter().enumerate() {
            let row = SampleRow {
                spec: s,
                req: ReqIdx(0),
                mask: Some(&mask),
                adjust: None,
            };
            let mut a = SamplerScratch::with_seed(i as u64);
            a.set_logprobs_mode(mode);
            let got = sample_masked(&logits, row, &mut a);
            assert!(
                allowed.contains(&got.token.index()),
                "{mode} spec {i}: {got:?}"
            );
            // The same draw from logits masked by hand.
            let mut b = SamplerScratch::with_seed(i as u64);
            b.set_logprobs_mode(mode);
            let reference = sample(&by_hand, s, ReqIdx(0), &mut b);
            assert_eq!(got.token, reference.token, "{mode} spec {i}");
            match mode {
                // Raw modes: the model's own values, as without a mask.
                LogprobsMode::RawLogprobs | LogprobsMode::RawLogits => {
                    let raw = RowStats::new(&logits);
                    let want = if mode == LogprobsMode::RawLogprobs {
                        raw.logprob(logits[got.token.index()])
                    } else {
                        logits[got.token.index()]
                    };
                    assert_eq!(got.logprob, want, "{mode} spec {i}");
                    // The top list is the raw top list: the argmax leads though it is masked.
                    assert_eq!(got.top_logprobs[0].0.index(), best, "{mode} spec {i}");
                }
                // Processed modes: the distribution sampled, the mask included.
                _ => {
                    assert_eq!(got.logprob, reference.logprob, "{mode} spec {i}");
                    assert_eq!(got.top_logprobs, reference.top_logprobs, "{mode} spec {i}");
                }
            }
        }
    }
}

#[test]
fn a_mask_that_allows_one_token_forces_it_and_a_batch_with_masks_matches_rows() {
    let vocab = 100;
    let n = 12;
    let logits: Vec<f32> = (0..n)
        .flat_map(|i| random_logits(500 + i as u64, vocab, 8.0))
        .collect();
    let specs = mixed_batch(n);
    let masks: Vec<Vec<u32>> = (0..n)
        .map(|i| mask_of(vocab, &[(i * 13) % vocab]))
        .collect();
    let rows: Vec<SampleRow<'_>> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| SampleRow {
            spec: s,
            req: ReqIdx(i as u32),
            // Every other row unconstrained: both kinds in one batch.
            mask: (i % 2 == 0).then(|| masks[i].as_slice()),
            adjust: None,
        })
        .collect();
    let mut serial = SamplerScratch::with_seed(5);
    let expected: Vec<SampledToken> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| sample_masked(&logits[i * vocab..(i + 1) * vocab], *row, &mut serial))
        .collect();
    let got = sample_batch(&logits, vocab, &rows, &mut SamplerScratch::with_seed(5));
    assert_eq!(got, expected);
    for (i, t) in got.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        assert_eq!(t.token.index(), (i * 13) % vocab, "row {i} is forced");
    }
    // A mask that allows nothing in the row is ignored rather than sampled from.
    let empty = vec![0u32; vocab.div_ceil(32)];
    let s = spec(0.0);
    let row = SampleRow {
        spec: &s,
        req: ReqIdx(0),
        mask: Some(&empty),
        adjust: None,
    };
    let row_logits = &logits[..vocab];
    assert_eq!(
        sample_masked(row_logits, row, &mut SamplerScratch::with_seed(0)),
        sample(row_logits, &s, ReqIdx(0), &mut SamplerScratch::with_seed(0))
    );
}

/// Penalties and biases on a handful of tokens, the best raw token pushed down hard.
fn adjust_for(logits: &[f32]) -> LogitsAdjust {
    let best = RowStats::new(logits).argmax as u32;
    let entry = |token, bias, output_count, seen| ferry_core::AdjustedToken {
        token,
        bias,
        output_count,
        seen,
    };
    let mut tokens = vec![
        entry(TokenId(3), 4.0, 0, false),
        entry(TokenId(10), 0.0, 2, true),
        entry(TokenId(17), 0.0, 0, true),
        entry(TokenId(best), -20.0, 1, true),
    ];
    tokens.sort_by_key(|e| e.token);
    tokens.dedup_by_key(|e| e.token);
    LogitsAdjust {
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.7,
        tokens,
    }
}

#[test]
fn an_adjusted_sample_is_the_sample_of_the_processed_logits_with_raw_logprobs() {
    let vocab = 200;
    let logits = random_logits(21, vocab, 5.0);
    let adjust = adjust_for(&logits);
    let mut by_hand = logits.clone();
    adjust.apply_row(&mut by_hand);
    let mut specs = mixed_batch(24);
    specs.iter_mut().for_each(|s| s.params.logprobs = Some(4));
    for mode in LogprobsMode::ALL {
        for (i, s) in specs.iter().enumerate() {
            let row = SampleRow {
                adjust: Some(&adjust),
                ..SampleRow::new(s, ReqIdx(0))
            };
            let mut a = SamplerScratch::with_seed(i as u64);
            a.set_logprobs_mode(mode);
            let got = sample_masked(&logits, row, &mut a);
            let mut b = SamplerScratch::with_seed(i as u64);
            b.set_logprobs_mode(mode);
            let reference = sample(&by_hand, s, ReqIdx(0), &mut b);
            assert_eq!(got.token, reference.token, "{mode} spec {i}");
            match mode {
                LogprobsMode::RawLogprobs | LogprobsMode::RawLogits => {
                    let mut c = SamplerScratch::with_seed(i as u64);
                    c.set_logprobs_mode(mode);
                    let raw = sample(&logits, s, ReqIdx(0), &mut c);
                    // The raw model's values, whatever was sampled.
                    let raw_row = RowStats::new(&logits);
                    let t = got.token.index();
                    let want = if mode == LogprobsMode::RawLogprobs {
                        raw_row.logprob(logits[t])
                    } else {
                        logits[t]
                    };
                    assert_eq!(got.logprob, want, "{mode} spec {i}");
                    assert_eq!(got.top_logprobs, raw.top_logprobs, "{mode} spec {i}");
                }
                _ => assert_eq!(got, reference, "{mode} spec {i}"),
            }
        }
    }
}

#[test]
fn a_masked_token_stays_out_whatever_its_bias_and_batches_match_rows() {
    let vocab = 96;
    let n = 10;
    let logits: Vec<f32> = (0..n)
        .flat_map(|i| random_logits(900 + i as u64, vocab, 6.0))
        .collect();
    let specs = mixed_batch(n);
    let allowed: Vec<usize> = (0..vocab).filter(|t| t % 5 == 1).collect();
    let mask = mask_of(vocab, &allowed);
    // Token 3 is not allowed (3 % 5 != 1), though its bias pushes it up.
    let adjusts: Vec<LogitsAdjust> = (0..n)
        .map(|i| adjust_for(&logits[i * vocab..(i + 1) * vocab]))
        .collect();
    let rows: Vec<SampleRow<'_>> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| SampleRow {
            spec: s,
            req: ReqIdx(i as u32),
            mask: (i % 2 == 0).then_some(mask.as_slice()),
            adjust: (i % 3 != 2).then(|| &adjusts[i]),
        })
        .collect();
    let mut serial = SamplerScratch::with_seed(8);
    let expected: Vec<SampledToken> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| sample_masked(&logits[i * vocab..(i + 1) * vocab], *row, &mut serial))
        .collect();
    let got = sample_batch(&logits, vocab, &rows, &mut SamplerScratch::with_seed(8));
    assert_eq!(got, expected);
    for (i, t) in got.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        assert!(allowed.contains(&t.token.index()), "row {i}: {t:?}");
    }
}
