//! The simulation's randomness: one seeded ChaCha stream per purpose, so a run is a function
//! of its seed (and schedule) alone. ChaCha8 rather than `StdRng`: its output is fixed by
//! its specification, so a seed replays the same run on every machine and crate version.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded random stream with the few draws the simulation needs.
#[derive(Debug, Clone)]
pub struct Rng(ChaCha8Rng);

impl Rng {
    /// The stream for `purpose` under `seed`: different purposes never share draws, so
    /// removing an action from a schedule does not shift what the network does.
    pub fn new(seed: u64, purpose: u64) -> Self {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&purpose.to_le_bytes());
        Self(ChaCha8Rng::from_seed(key))
    }

    /// Uniform in `0..n` (`n > 0`); the modulo bias is irrelevant at these sizes.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.next_u64() % n.max(1)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// A value from `items`, weighted by its first field.
    pub fn weighted<T: Copy>(&mut self, items: &[(u64, T)]) -> T {
        let total: u64 = items.iter().map(|(w, _)| w).sum();
        let mut x = self.below(total);
        for &(w, item) in items {
            if x < w {
                return item;
            }
            x -= w;
        }
        items[items.len() - 1].1
    }

    pub fn bool(&mut self) -> bool {
        self.0.next_u64() & 1 == 1
    }
}
