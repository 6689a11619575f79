//! Beam search (`use_beam_search`, with vLLM 0.34's semantics): `n` is the beam width, each
//! step extends every live beam by one token, and the answer is the `n` best sequences, best
//! first.
//!
//! Each step asks the engine for one token of every live beam with its `2 × n` best
//! logprobs (greedy, so the sampled token is the best one; raw logprobs, as vLLM scores
//! them). A candidate is a beam and one of those tokens, scored by its cumulative logprob; an
//! EOS candidate (unless `ignore_eos`) is a finished beam, the others compete, and the `n`
//! best go on. After `max_tokens` steps (or once no beam is live), the finished and the live
//! beams are ranked by `cumulative logprob / max(generated tokens, 1) ^ length_penalty`, the
//! EOS step counted, the prompt not. A finished beam ends with `stop` (its `stop_reason` the
//! EOS id, as vLLM reports it), a live one with `length`.
//!
//! The steps are ordinary engine requests, so beams share their prompt's (and each other's)
//! KV blocks through the prefix cache, and the logprobs are batch-invariant like every
//! other. Sampling fields (temperature, top-k/p, penalties, seed, stop strings) do not apply,
//! as in vLLM; vLLM also adds, at a temperature above 0, one randomly sampled candidate per
//! beam, which ferry does not (its beams are deterministic at every temperature).
//!
//! [`BeamSearch`] is the search itself, without I/O; [`run`] drives it on the engine.

use std::sync::Arc;

use ferry_engine::{
    EngineHandle, Finish, FinishReason, GenerateRequest, SamplingParams, StopReason, TokenId,
    TokenLogprob,
};

/// One sequence of the search: its generated tokens, each step's logprobs, its score.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Beam {
    pub tokens: Vec<TokenId>,
    /// One per step: the token taken and the step's best alternatives.
    pub steps: Vec<TokenLogprob>,
    /// The sum of the taken tokens' logprobs.
    pub cumulative_logprob: f64,
    /// The EOS token that finished it.
    pub eos: Option<TokenId>,
}

impl Beam {
    /// vLLM's ranking score: `cumulative / max(steps, 1) ^ length_penalty`.
    pub fn score(&self, length_penalty: f64) -> f64 {
        let len = self.steps.len().max(1) as f64;
        self.cumulative_logprob / len.powf(length_penalty)
    }
}

/// The search (see the module docs), fed one step of logprobs at a time.
#[derive(Debug, Clone)]
pub struct BeamSearch {
    width: usize,
    length_penalty: f64,
    eos: Vec<TokenId>,
    ignore_eos: bool,
    live: Vec<Beam>,
    finished: Vec<Beam>,
}

impl BeamSearch {
    pub fn new(width: usize, length_penalty: f64, eos: Vec<TokenId>, ignore_eos: bool) -> Self {
        Self {
            width,
            length_penalty,
            eos,
            ignore_eos,
            live: vec![Beam::default()],
            finished: Vec::new(),
        }
    }

    /// The beams to extend next, in order; none once the search is over.
    pub fn live(&self) -> &[Beam] {
        &self.live
    }

    /// One step: `steps[i]` is the logprobs of live beam `i`'s next token (its best
    /// alternatives in `top`, best first).
    pub fn advance(&mut self, steps: Vec<TokenLogprob>) {
        assert_eq!(steps.len(), self.live.len(), "one step per live beam");
        let mut candidates = Vec::new();
        for (beam, step) in std::mem::take(&mut self.live).iter().zip(&steps) {
            let mut seen = Vec::with_capacity(step.top.len() + 1);
            let tokens =
                std::iter::once((step.token, step.logprob)).chain(step.top.iter().copied());
            for (token, logprob) in tokens {
                if seen.contains(&token) {
                    continue;
                }
                seen.push(token);
                let mut next = beam.clone();
                next.tokens.push(token);
                next.steps.push(TokenLogprob {
                    token,
                    logprob,
                    top: step.top.clone(),
                });
                next.cumulative_logprob += f64::from(logprob);
                if !self.ignore_eos && self.eos.contains(&token) {
                    next.eos = Some(token);
                    self.finished.push(next);
                } else {
                    candidates.push(next);
                }
            }
        }
        // The best `width` by cumulative logprob; a stable sort keeps ties in beam order.
        candidates.sort_by(|a, b| b.cumulative_logprob.total_cmp(&a.cumulative_logprob));
        candidates.truncate(self.width);
        self.live = candidates;
    }

    /// The `width` best of the finished and the live beams, best first.
    pub fn finish(self) -> Vec<Beam> {
        let penalty = self.length_penalty;
        let mut all = self.finished;
        all.extend(self.live);
        all.sort_by(|a, b| b.score(penalty).total_cmp(&a.score(penalty)));
        all.truncate(self.width);
        all
    }
}

/// One prompt's search: its tokens and its sampling fields (`max_tokens`, `ignore_eos`,
/// `cache_salt` apply; the rest do not, as in vLLM).
#[derive(Debug, Clone, Copy)]
pub struct Search<'a> {
    pub prompt: &'a [TokenId],
    pub sampling: &'a SamplingParams,
}

/// One prompt's result: its best sequences, best first, and the weight versions that
/// computed them.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    pub beams: Vec<Beam>,
    pub weight_versions: Vec<String>,
}

/// Why a search stopped short.
#[derive(Debug)]
pub enum SearchError {
    /// The engine refused a step's request.
    Generate(ferry_engine::GenerateError),
    /// A step's request ended without its token (aborted, or failed).
    Ended(String),
}

/// Runs one beam search of `width` per prompt on the engine.
pub async fn run(
    engine: &EngineHandle,
    request_id: &str,
    searches: &[Search<'_>],
    width: usize,
    length_penalty: f64,
) -> Result<Vec<Ranked>, SearchError> {
    let eos = engine.scheduler_config().eos_token_ids.clone();
    let mut out = Vec::with_capacity(searches.len());
    for (p, search) in searches.iter().enumerate() {
        let mut beams = BeamSearch::new(
            width,
            length_penalty,
            eos.clone(),
            search.sampling.ignore_eos,
        );
        let mut versions: Vec<String> = Vec::new();
        for step in 0..search.sampling.max_tokens {
            if beams.live().is_empty() {
                break;
            }
            let requests = beams.live().iter().enumerate().map(|(i, b)| {
                let mut tokens = search.prompt.to_vec();
                tokens.extend_from_slice(&b.tokens);
                let id = format!("{request_id}-beam{p}-{step}-{i}");
                step_logprobs(engine, id, tokens, width, search.sampling)
            });
            let steps = futures_util::future::try_join_all(requests).await?;
            let mut logprobs = Vec::with_capacity(steps.len());
            for (logprob, finish) in steps {
                for v in finish.weight_versions {
                    if !versions.contains(&v) {
                        versions.push(v);
                    }
                }
                logprobs.push(logprob);
            }
            beams.advance(logprobs);
        }
        out.push(Ranked {
            beams: beams.finish(),
            weight_versions: versions,
        });
    }
    Ok(out)
}

/// One step of one beam: the logprobs of its next token, and how the step's request ended.
async fn step_logprobs(
    engine: &EngineHandle,
    request_id: String,
    prompt: Vec<TokenId>,
    width: usize,
    of: &SamplingParams,
) -> Result<(TokenLogprob, Finish), SearchError> {
    let mut params = SamplingParams::greedy(1);
    params.sampler.logprobs = Some(2 * width as u32);
    params.cache_salt = of.cache_salt.clone();
    let req = GenerateRequest {
        request_id,
        prompt,
        params,
        stop: Vec::new(),
        detokenize: false,
        transfer: None,
        constraint: None,
        keep_special_tokens: false,
        include_stop_str_in_output: false,
        // Refused with an adapter (`GenerationParams::lora`): beams run on the base.
        lora: None,
    };
    let stream = engine.generate(req).await.map_err(SearchError::Generate)?;
    let mut logprob = None;
    let mut finish = None;
    futures_util::pin_mut!(stream);
    while let Some(chunk) = futures_util::StreamExt::next(&mut stream).await {
        if logprob.is_none() {
            logprob = chunk.logprobs.into_iter().next();
        }
        if chunk.finish.is_some() {
            finish = chunk.finish;
        }
    }
    match (logprob, finish) {
        (Some(l), Some(f))
            if f.reason != FinishReason::Error && f.reason != FinishReason::Abort =>
        {
            Ok((l, f))
        }
        (_, f) => Err(SearchError::Ended(format!(
            "a beam search step ended without its token: {}",
            f.and_then(|f| f.message)
                .unwrap_or_else(|| "aborted or failed".into())
        ))),
    }
}

/// A finished sequence as a choice shows it: the tokens (its EOS kept only with
/// `include_stop_str_in_output`), each token's logprobs with the top `top_n` alternatives,
/// the text (never the EOS), and how it ended (`stop` on EOS, with the EOS as its reason).
pub fn choice_of(
    beam: Beam,
    tokenizer: Option<&Arc<tokenizers::Tokenizer>>,
    skip_special_tokens: bool,
    include_stop_str_in_output: bool,
    top_n: Option<u32>,
) -> (
    Vec<TokenId>,
    Vec<TokenLogprob>,
    String,
    FinishReason,
    Option<StopReason>,
) {
    let Beam {
        mut tokens,
        mut steps,
        eos,
        ..
    } = beam;
    let text_tokens = match eos {
        Some(_) => &tokens[..tokens.len() - 1],
        None => &tokens[..],
    };
    let text = tokenizer
        .map(|t| {
            t.decode(TokenId::as_raw_slice(text_tokens), skip_special_tokens)
                .unwrap_or_default()
        })
        .unwrap_or_default();
    if eos.is_some() && !include_stop_str_in_output {
        tokens.pop();
        steps.pop();
    }
    let logprobs = match top_n {
        Some(k) => steps
            .into_iter()
            .map(|mut s| {
                s.top.truncate(k as usize);
                s
            })
            .collect(),
        None => Vec::new(),
    };
    let (reason, stop_reason) = match eos {
        Some(t) => (FinishReason::Stop, Some(StopReason::Token(t))),
        None => (FinishReason::Length, None),
    };
    (tokens, logprobs, text, reason, stop_reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(alternatives: &[(u32, f32)]) -> TokenLogprob {
        let top: Vec<(TokenId, f32)> = alternatives.iter().map(|&(t, l)| (TokenId(t), l)).collect();
        TokenLogprob {
            token: top[0].0,
            logprob: top[0].1,
            top,
        }
    }

    /// Two beams over a hand-made tree: the best candidates go on, an EOS candidate finishes
    /// a beam, and the length penalty decides between a short finished beam and a long one.
    #[test]
    fn beams_keep_the_best_candidates_and_rank_by_the_length_penalty() {
        let eos = TokenId(0);
        let mut s = BeamSearch::new(2, 1.0, vec![eos], false);
        s.advance(vec![step(&[(1, -0.1), (0, -0.5), (2, -0.7), (3, -3.0)])]);
        // EOS after one step finished a beam; 1 and 2 go on.
        let live: Vec<Vec<TokenId>> = s.live().iter().map(|b| b.tokens.clone()).collect();
        assert_eq!(live, [TokenId::list([1]), TokenId::list([2])]);
        s.advance(vec![
            step(&[(4, -1.0), (5, -2.0), (0, -2.5), (6, -4.0)]),
            step(&[(7, -0.2), (8, -0.3), (0, -3.0), (9, -4.0)]),
        ]);
        let live: Vec<Vec<TokenId>> = s.live().iter().map(|b| b.tokens.clone()).collect();
        // 2,7: -0.9; 2,8: -1.0; 1,4: -1.1.
        assert_eq!(live, [TokenId::list([2, 7]), TokenId::list([2, 8])]);
        let ranked = s.clone().finish();
        // Scores: [0] -0.5/1; [2,7] -0.9/2 = -0.45; [2,8] -0.5.
        assert_eq!(ranked[0].tokens, TokenId::list([2, 7]));
        assert_eq!(
            ranked[1].eos,
            Some(eos),
            "a tie keeps the finished beam first"
        );
        // Without a length penalty the short finished beam wins.
        let mut flat = s;
        flat.length_penalty = 0.0;
        let ranked = flat.finish();
        assert_eq!(ranked[0].tokens, TokenId::list([0]));
        assert_eq!(ranked[0].eos, Some(eos));
    }
}
