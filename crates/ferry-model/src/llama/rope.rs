//! Rotary position embeddings in Hugging Face's "rotate_half" layout (the first and second
//! halves of a head are the two coordinates of each rotated pair), with Llama 3 and linear
//! scaling of the frequencies.
//!
//! GGUF files store Q/K permuted for interleaved pairs; the loader undoes that, so only the
//! HF convention lives here. Tables are computed in f64 and stored in f32, and grow on demand
//! up to the largest position a step needs.

use crate::config::{LlamaConfig, RopeScaling};

/// cos/sin tables, `half = head_dim / 2` entries per position.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    n_positions: usize,
}

impl Rope {
    /// Tables for `config`, precomputed for the first `initial_positions` positions.
    pub fn new(config: &LlamaConfig, initial_positions: usize) -> Self {
        let inv_freq = inv_freq(
            config.head_dim,
            f64::from(config.rope_theta),
            config.rope_scaling.as_ref(),
        );
        let mut rope = Self {
            inv_freq,
            cos: Vec::new(),
            sin: Vec::new(),
            n_positions: 0,
        };
        rope.ensure(initial_positions);
        rope
    }

    fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// Makes the tables cover positions `0..n_positions`.
    pub fn ensure(&mut self, n_positions: usize) {
        if n_positions <= self.n_positions {
            return;
        }
        // Grow geometrically so a long decode does not recompute the table every step.
        let target = n_positions.max(self.n_positions * 2);
        for pos in self.n_positions..target {
            for &f in &self.inv_freq {
                let angle = pos as f64 * f;
                self.cos.push(angle.cos() as f32);
                self.sin.push(angle.sin() as f32);
            }
        }
        self.n_positions = target;
    }

    /// Rotates one head vector (`head_dim` floats) for position `pos`, in place.
    /// The tables must cover `pos` ([`Rope::ensure`]).
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let half = self.half();
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// Frequencies `1 / theta^(2i / d)`, scaled as the config asks.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    match scaling {
        None => base,
        // Linear interpolation divides positions by the factor: the same as dividing freqs.
        Some(RopeScaling::Linear { factor }) => {
            base.iter().map(|f| f / f64::from(*factor)).collect()
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => base
            .iter()
            .map(|&f| {
                llama3_scale(
                    f,
                    f64::from(*factor),
                    f64::from(*low_freq_factor),
                    f64::from(*high_freq_factor),
                    *original_max_position_embeddings as f64,
                )
            })
            .collect(),
        Some(RopeScaling::Factors { factors }) => base
            .iter()
            .zip(factors)
            .map(|(f, &d)| f / f64::from(d))
            .collect(),
    }
}

/// Llama 3 frequency scaling, as Hugging Face's `_compute_llama3_parameters`: long wavelengths
/// are divided by `factor`, short ones kept, the band between blended smoothly.
fn llama3_scale(freq: f64, factor: f64, low: f64, high: f64, old_ctx: f64) -> f64 {
    let low_freq_wavelen = old_ctx / low;
    let high_freq_wavelen = old_ctx / high;
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    if wavelen > low_freq_wavelen {
        freq / factor
    } else if wavelen < high_freq_wavelen {
        freq
    } else {
        let smooth = (old_ctx / wavelen - low) / (high - low);
        (1.0 - smooth) * freq / factor + smooth * freq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_divides_low_and_blends_between() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let base = inv_freq(128, 500000.0, None);
        let scaled = inv_freq(128, 500000.0, Some(&s));
        // Highest frequency: wavelength 2π < 8192/4, unchanged.
        assert_eq!(scaled[0], base[0]);
        // Lowest frequency: wavelength far above 8192, divided by 8.
        assert_eq!(scaled[63], base[63] / 8.0);
        // Somewhere in between a blend strictly between the two.
        let mid = (0..64)
            .find(|&i| {
                let wl = 2.0 * std::f64::consts::PI / base[i];
                wl > 2048.0 && wl < 8192.0
            })
            .expect("a medium frequency exists for these parameters");
        assert!(scaled[mid] < base[mid] && scaled[mid] > base[mid] / 8.0);
    }

    #[test]
    fn rotation_matches_rotate_half_formula() {
        let mut cfg = crate::weights::random::small_config();
        cfg.head_dim = 4;
        cfg.rope_theta = 10000.0;
        let rope = Rope::new(&cfg, 8);
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope.apply(&mut h, 3);
        let f = [1.0f64, 1.0 / 100.0];
        let expect = [
            1.0 * (3.0 * f[0]).cos() - 3.0 * (3.0 * f[0]).sin(),
            2.0 * (3.0 * f[1]).cos() - 4.0 * (3.0 * f[1]).sin(),
            3.0 * (3.0 * f[0]).cos() + 1.0 * (3.0 * f[0]).sin(),
            4.0 * (3.0 * f[1]).cos() + 2.0 * (3.0 * f[1]).sin(),
        ];
        for (a, b) in h.iter().zip(expect) {
            assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
        }
    }
}
