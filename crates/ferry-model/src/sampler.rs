//! Token sampling from one row of logits, with logprobs from the same logits.
//!
//! (Skeleton: greedy only. The full sampler replaces the body, keeping the signature.)

use ferry_core::{ReqIdx, SampleSpec, SampledToken};

/// Reusable buffers so sampling allocates nothing per token in steady state.
#[derive(Debug, Default)]
pub struct SamplerScratch {
    pub buf: Vec<f32>,
}

/// Samples one token for `req` from `logits` (length = vocab size).
pub fn sample(
    logits: &[f32],
    spec: &SampleSpec,
    req: ReqIdx,
    _scratch: &mut SamplerScratch,
) -> SampledToken {
    let _ = spec;
    let (token, _) =
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &l)| {
                if l > best.1 {
                    (i, l)
                } else {
                    best
                }
            });
    SampledToken {
        req,
        token: token as u32,
        logprob: 0.0,
        top_logprobs: Vec::new(),
    }
}
