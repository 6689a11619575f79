//! [`Isa`]: which implementation of the kernels this process uses, chosen once
//! ([`Isa::current`]).
//!
//! Below the kernels (`kernels/`), which run it, and the weights (`weights/row_groups.rs`),
//! which lay out a matrix's rows for it, so that both can name it.

use std::sync::OnceLock;

/// Which implementation of the kernels this process uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// x86-64 with AVX-512F and BW (detected at run time): 16 lanes per accumulator.
    Avx512,
    /// x86-64 with AVX2, FMA and F16C (detected at run time, not compiled in with
    /// `target-cpu`).
    Avx2Fma,
    /// Plain Rust, mul then add; any CPU.
    Portable,
}

impl Isa {
    /// The implementation for this process, detected once.
    pub fn current() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| Isa::available()[0])
    }

    /// Every implementation this CPU can run, best first (tests compare them all).
    pub fn available() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                isas.push(Isa::Avx512);
            }
            // F16C converts f16 weights; every CPU with AVX2 has it.
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                isas.push(Isa::Avx2Fma);
            }
        }
        isas.push(Isa::Portable);
        isas
    }
}
