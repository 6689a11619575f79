//! The kernels built on `exp`: attention's softmax and the MLP's SwiGLU, each in one fixed
//! order for a given length on a given instruction set, so a row gets the same bits
//! whichever batch, run or chunk it is computed in.
//!
//! With AVX-512 the exponentials are a vector polynomial ([`avx512::exp16`], within 2 ulp of
//! the exact value) and softmax's sum runs in 16 lanes with a fixed horizontal tree, instead
//! of `expf` one element at a time (softmax's feeding one serial sum), which together took
//! about a tenth of a 512-token prefill. Every element of a row, in a full chunk of 16 or
//! in the masked tail, goes through the same lane-wise arithmetic. Other instruction sets
//! keep the scalar loops; a process never mixes the two.

use super::Isa;

/// `x[i] = exp(x[i] - max) / Σ exp(x[j] - max)`.
pub fn softmax_in_place(x: &mut [f32]) {
    softmax_in_place_with(Isa::current(), x);
}

/// [`softmax_in_place`] on an explicit instruction set (tests compare them).
pub fn softmax_in_place_with(isa: Isa, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        return unsafe { avx512::softmax(x) };
    }
    let _ = isa;
    softmax_plain(x);
}

/// SwiGLU of one row: `out[i] = silu(gate[i]) * up[i]`, `silu(g) = g / (1 + exp(-g))`.
pub fn silu_mul_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == out.len() && up.len() == out.len(),
        "silu_mul_row: gate {}, up {}, out {}",
        gate.len(),
        up.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx512 {
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F; the lengths
        // are equal.
        return unsafe { avx512::silu_mul(gate, up, out) };
    }
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// The sampler's view of a logit: NaN counts as `-inf`, `+inf` as `f32::MAX`, and `-0.0`
/// as `0.0`, so every value is ordered and finite above `-inf`.
pub fn clean_logit(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else if l == f32::INFINITY {
        f32::MAX
    } else {
        l + 0.0
    }
}

/// The largest [`clean_logit`] of `x` and the first index holding it; `None` when every
/// value is `-inf` or NaN (or there is none).
pub fn clean_max(x: &[f32]) -> Option<(f32, usize)> {
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx512 {
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        return unsafe { avx512::clean_max(x) };
    }
    clean_max_plain(x)
}

/// `Σ exp(clean_logit(x[i]) - max)` in f64, each term exactly 0 where the value is `-inf` or
/// NaN: the sampler's normalizer (`max` the row's [`clean_max`]). With AVX-512 the terms
/// come from the vector `exp` and are summed in 16 f64 lanes (two vectors of 8) reduced by a
/// fixed tree, so a row's sum depends only on the row.
pub fn exp_sum(x: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx512 {
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F.
        return unsafe { avx512::exp_sum(x, max) };
    }
    x.iter()
        .map(|&l| f64::from((clean_logit(l) - max).exp()))
        .sum()
}

/// `out[i] = exp((clean_logit(x[i]) - max) / t)`, exactly 0 where the value is `-inf` or NaN
/// (also for an infinite `t`, where the quotient would be NaN): the sampler's unnormalized
/// probabilities at temperature `t`, the row's max getting exactly 1.
pub fn exp_scaled(x: &[f32], max: f32, t: f32, out: &mut Vec<f32>) {
    out.clear();
    #[cfg(target_arch = "x86_64")]
    if Isa::current() == Isa::Avx512 {
        out.resize(x.len(), 0.0);
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F; `out` holds
        // `x.len()` floats.
        return unsafe { avx512::exp_scaled(x, max, t, out) };
    }
    out.extend(x.iter().map(|&l| {
        let d = clean_logit(l) - max;
        if d == f32::NEG_INFINITY {
            0.0
        } else {
            (d / t).exp()
        }
    }));
}

/// [`clean_max`] one element at a time (strictly greater, so ties keep the first index).
fn clean_max_plain(x: &[f32]) -> Option<(f32, usize)> {
    let mut best = (f32::NEG_INFINITY, 0);
    for (i, &l) in x.iter().enumerate() {
        let l = clean_logit(l);
        if l > best.0 {
            best = (l, i);
        }
    }
    (best.0 > f32::NEG_INFINITY).then_some(best)
}

/// Scalar softmax: `expf` per element, summed in position order.
fn softmax_plain(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Lanes up to `n` of a 16-lane chunk (`n` < 16 for a tail).
    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            !0
        } else {
            (1u16 << n) - 1
        }
    }

    /// Three passes over `x`: the max (exact in any order), `exp(x - max)` written back and
    /// summed into 16 lane accumulators (a tail chunk masked, its missing lanes adding 0),
    /// reduced by a fixed tree, then the division.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax(x: &mut [f32]) {
        let n = x.len();
        if n == 0 {
            return;
        }
        let p = x.as_mut_ptr();
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: the masked lanes lie inside `x`; the others are not read.
            let v = unsafe { _mm512_mask_loadu_ps(mx, m, p.add(i)) };
            mx = _mm512_max_ps(mx, v);
            i += 16;
        }
        let max = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: as above, for reads and writes.
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, p.add(i));
                let e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(v, max)));
                _mm512_mask_storeu_ps(p.add(i), m, e);
                sum = _mm512_add_ps(sum, e);
            }
            i += 16;
        }
        // A fixed tree over the lanes: (l, l + 8), (l, l + 4), (l, l + 2), (0, 1).
        let lo = _mm512_castps512_ps256(sum);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sum)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        let total = _mm512_set1_ps(_mm_cvtss_f32(s1));
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: as above.
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, p.add(i));
                _mm512_mask_storeu_ps(p.add(i), m, _mm512_div_ps(v, total));
            }
            i += 16;
        }
    }

    /// [`super::clean_logit`] of 16 lanes.
    #[target_feature(enable = "avx512f")]
    fn clean16(v: __m512) -> __m512 {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let v = _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(f32::NEG_INFINITY));
        _mm512_add_ps(
            _mm512_min_ps(v, _mm512_set1_ps(f32::MAX)),
            _mm512_setzero_ps(),
        )
    }

    /// [`super::clean_max`]: the max over 16 lanes (exact in any order), then the first
    /// element equal to it.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn clean_max(x: &[f32]) -> Option<(f32, usize)> {
        let (n, p) = (x.len(), x.as_ptr());
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut mx = ninf;
        let mut i = 0;
        while i < n {
            // SAFETY: the masked lanes lie inside `x`; the others are not read.
            let v = unsafe { _mm512_mask_loadu_ps(ninf, mask(n - i), p.add(i)) };
            mx = _mm512_max_ps(mx, clean16(v));
            i += 16;
        }
        let max = _mm512_reduce_max_ps(mx);
        if max == f32::NEG_INFINITY {
            return None;
        }
        let target = _mm512_set1_ps(max);
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: as above.
            let v = unsafe { _mm512_mask_loadu_ps(ninf, m, p.add(i)) };
            let hit = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(m, clean16(v), target);
            if hit != 0 {
                return Some((max, i + hit.trailing_zeros() as usize));
            }
            i += 16;
        }
        unreachable!("the max is one of the elements")
    }

    /// `exp(clean(v) - max)` of 16 lanes, 0 in the lanes outside `m` and where the value is
    /// `-inf`.
    #[target_feature(enable = "avx512f")]
    fn exp_terms(v: __m512, m: __mmask16, max: __m512, t: Option<__m512>) -> __m512 {
        let c = clean16(v);
        let live = _mm512_mask_cmp_ps_mask::<_CMP_NEQ_OQ>(m, c, _mm512_set1_ps(f32::NEG_INFINITY));
        let d = _mm512_sub_ps(c, max);
        let d = match t {
            Some(t) => _mm512_div_ps(d, t),
            None => d,
        };
        _mm512_maskz_mov_ps(live, exp16(d))
    }

    /// [`super::exp_sum`]: terms in 16 lanes, widened to f64 and summed lane by lane in row
    /// order, then `_mm512_reduce_add_pd` of the two halves' sum.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_sum(x: &[f32], max: f32) -> f64 {
        let (n, p) = (x.len(), x.as_ptr());
        let max = _mm512_set1_ps(max);
        let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: the masked lanes lie inside `x`; the others are not read.
            let v = unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) };
            let e = exp_terms(v, m, max, None);
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            let upper = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(upper));
            i += 16;
        }
        _mm512_reduce_add_pd(_mm512_add_pd(lo, hi))
    }

    /// [`super::exp_scaled`] 16 lanes at a time, the tail masked.
    ///
    /// # Safety
    /// `out` holds `x.len()` floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_scaled(x: &[f32], max: f32, t: f32, out: &mut [f32]) {
        let (n, p, o) = (x.len(), x.as_ptr(), out.as_mut_ptr());
        let (max, t) = (_mm512_set1_ps(max), _mm512_set1_ps(t));
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: the masked lanes lie inside `x` and `out`.
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, p.add(i));
                _mm512_mask_storeu_ps(o.add(i), m, exp_terms(v, m, max, Some(t)));
            }
            i += 16;
        }
    }

    /// [`super::silu_mul_row`] 16 lanes at a time, the tail masked.
    ///
    /// # Safety
    /// `gate`, `up` and `out` have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let (g, u, o) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: the masked lanes lie inside the three slices of length n.
            unsafe {
                let gv = _mm512_maskz_loadu_ps(m, g.add(i));
                let uv = _mm512_maskz_loadu_ps(m, u.add(i));
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(o.add(i), m, _mm512_mul_ps(s, uv));
            }
            i += 16;
        }
    }

    /// `exp` of 16 lanes: `x = n ln 2 + r` with `|r| ≤ ln 2 / 2` (ln 2 in two parts, so `r`
    /// is exact to f32 rounding), `e^r` by a degree-7 polynomial (Cephes' `expf`
    /// coefficients), then scaled by `2^n` with `vscalefps`, which gives 0 for inputs far
    /// below the smallest f32 and infinity above the largest. Within 2 ulp of the exact
    /// value where the result is a normal f32 (tested against f64).
    #[target_feature(enable = "avx512f")]
    pub(super) fn exp16(x: __m512) -> __m512 {
        // Beyond these, e^x is 0 or infinite in f32; clamping keeps `n` finite.
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-104.0)),
            _mm512_set1_ps(89.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let c = [
            1.987_569_1e-4,
            1.398_2e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ];
        let mut y = _mm512_set1_ps(c[0]);
        for &ci in &c[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ci));
        }
        // e^r ≈ 1 + r + r² y.
        let r2 = _mm512_mul_ps(r, r);
        let e = _mm512_add_ps(_mm512_fmadd_ps(y, r2, r), _mm512_set1_ps(1.0));
        _mm512_scalef_ps(e, n)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The vector exp against f64 over softmax's range and past both ends.
        #[test]
        fn exp16_is_within_two_ulp() {
            if !is_x86_feature_detected!("avx512f") {
                return;
            }
            let xs: Vec<f32> = (0..200_000)
                .map(|i| -110.0 + i as f32 * 0.001)
                .chain([0.0, -0.0, 1e-30, -1e-30, 88.0, 88.7, 89.5, -87.0, f32::MIN])
                .collect();
            for chunk in xs.chunks(16) {
                let mut lanes = [0.0f32; 16];
                lanes[..chunk.len()].copy_from_slice(chunk);
                let mut got = [0.0f32; 16];
                // SAFETY: AVX-512F was detected above; 16 floats each.
                unsafe {
                    _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(lanes.as_ptr())))
                };
                for (&x, &g) in lanes.iter().zip(&got) {
                    let want = (x as f64).exp();
                    if want < f32::MIN_POSITIVE as f64 {
                        // Subnormal or zero: absolute error below the smallest normal.
                        assert!((g as f64 - want).abs() < f32::MIN_POSITIVE as f64, "{x}");
                    } else if want > f32::MAX as f64 {
                        assert_eq!(g, f32::INFINITY, "{x}");
                    } else {
                        let ulp = (want as f32).to_bits().abs_diff(g.to_bits());
                        assert!(ulp <= 2, "exp({x}) = {g}, want {want} ({ulp} ulp)");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set's softmax sums to one and is within a few f32 rounding steps
    /// of an f64 softmax, on lengths with and without a tail and on scores far apart.
    #[test]
    fn matches_f64_softmax() {
        for isa in Isa::available() {
            for n in [1usize, 5, 16, 17, 100, 511] {
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
                    .collect();
                let max = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
                let total: f64 = e.iter().sum();
                let mut got = x.clone();
                softmax_in_place_with(isa, &mut got);
                for ((g, w), &v) in got.iter().zip(&e).zip(&x) {
                    let w = w / total;
                    // A few roundings of the result, plus exp's sensitivity to the f32
                    // rounding of its argument (relative error |x - max| ulp).
                    let rel = (8.0 + (v as f64 - max).abs()) * f32::EPSILON as f64;
                    assert!(
                        (*g as f64 - w).abs() <= rel * w + 1e-30,
                        "{isa:?} n={n}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// SwiGLU within a few roundings of f64, over gates where `exp(-g)` under- and
    /// overflows too, and each element's bits the same wherever it sits in the row.
    #[test]
    fn silu_mul_matches_f64_and_its_own_elements() {
        let gate: Vec<f32> = (0..53).map(|i| (i as f32 - 26.0) * 4.1).collect();
        let up: Vec<f32> = (0..53).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut out = vec![0.0f32; 53];
        silu_mul_row(&gate, &up, &mut out);
        for ((&o, &g), &u) in out.iter().zip(&gate).zip(&up) {
            let want = g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64;
            assert!(
                (o as f64 - want).abs() <= 8.0 * f32::EPSILON as f64 * want.abs() + 1e-30,
                "silu({g}) * {u} = {o}, want {want}"
            );
        }
        for i in [0, 17, 52] {
            let mut one = [0.0f32];
            silu_mul_row(&gate[i..i + 1], &up[i..i + 1], &mut one);
            assert_eq!(one[0].to_bits(), out[i].to_bits(), "element {i}");
        }
    }

    /// Rows with NaN, infinities, signed zeros, ties and tails of every length.
    fn awkward_rows() -> Vec<Vec<f32>> {
        let mut rows: Vec<Vec<f32>> = [1usize, 3, 16, 17, 33, 1000]
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.21)
                    .collect()
            })
            .collect();
        let mut odd = vec![-3.0f32; 40];
        odd[2] = f32::NAN;
        odd[5] = f32::NEG_INFINITY;
        odd[20] = 7.5;
        odd[37] = 7.5;
        rows.push(odd);
        let mut inf = vec![1.0f32; 20];
        inf[18] = f32::INFINITY;
        inf[19] = f32::MAX;
        rows.push(inf);
        rows.push(vec![-0.0, 0.0, -0.0]);
        rows.push(vec![f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]);
        rows.push(Vec::new());
        rows
    }

    /// The vector max and first argmax are the scalar loop's, exactly.
    #[test]
    fn clean_max_is_the_first_largest_clean_value() {
        for row in awkward_rows() {
            let got = clean_max(&row);
            let want = clean_max_plain(&row);
            assert_eq!(
                got.map(|(m, i)| (m.to_bits(), i)),
                want.map(|(m, i)| (m.to_bits(), i)),
                "{row:?}"
            );
        }
        let mut tie = vec![0.0f32; 50];
        tie[31] = 2.0;
        tie[47] = 2.0;
        assert_eq!(clean_max(&tie), Some((2.0, 31)));
        assert_eq!(clean_max(&[f32::NAN, f32::NEG_INFINITY]), None);
    }

    /// The normalizer and the scaled terms within a few roundings of f64, `-inf` and NaN
    /// contributing exactly 0 and the max exactly 1.
    #[test]
    fn exp_sum_and_scaled_match_f64() {
        for row in awkward_rows() {
            let Some((max, argmax)) = clean_max(&row) else {
                continue;
            };
            for t in [1.0f32, 0.7, 2.5, f32::INFINITY] {
                let mut probs = Vec::new();
                exp_scaled(&row, max, t, &mut probs);
                assert_eq!(probs.len(), row.len());
                assert_eq!(probs[argmax], 1.0);
                let mut total = 0.0f64;
                for (&l, &p) in row.iter().zip(&probs) {
                    let d = f64::from(clean_logit(l)) - f64::from(max);
                    if d == f64::NEG_INFINITY {
                        assert_eq!(p.to_bits(), 0, "exp(-inf / {t})");
                        continue;
                    }
                    let want = (d / f64::from(t)).exp();
                    let rel = (8.0 + (d / f64::from(t)).abs()) * f64::from(f32::EPSILON);
                    assert!(
                        (f64::from(p) - want).abs() <= rel * want + 1e-38,
                        "{l}/{t}: {p}"
                    );
                    if t == 1.0 {
                        total += want;
                    }
                }
                if t == 1.0 {
                    let got = exp_sum(&row, max);
                    assert!((got - total).abs() <= 1e-6 * total, "{got} vs {total}");
                }
            }
        }
    }

    /// The same row gives the same bits every time (no state, no dependence on alignment).
    #[test]
    fn same_row_same_bits() {
        let x: Vec<f32> = (0..77).map(|i| (i as f32 * 0.71).sin() * 9.0).collect();
        let mut a = x.clone();
        softmax_in_place(&mut a);
        let mut buf = vec![0.0f32; 78];
        buf[1..].copy_from_slice(&x);
        softmax_in_place(&mut buf[1..]);
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            buf[1..].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
