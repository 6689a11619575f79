//! What `ferry bench serve` sends: one [`RequestSpec`] per request, from length distributions
//! (`128`, `uniform:64:256`) with seeded random prompts and Poisson arrivals, or from a JSONL
//! trace file.
//!
//! Everything here is deterministic for a seed, so two runs with the same flags send the same
//! prompts at the same offsets.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

/// Token ids drawn for random prompts lie in `[FIRST_PROMPT_TOKEN, FIRST_PROMPT_TOKEN + n)`:
/// low ids are special tokens in most vocabularies, and a prompt full of BOS/EOS is unusual.
const FIRST_PROMPT_TOKEN: u32 = 100;

/// The largest arrival offset or timeout accepted (about 11 days): far beyond any benchmark,
/// and small enough that adding it to an `Instant` cannot overflow.
pub const MAX_SECONDS: f64 = 1e6;

/// Errors in the workload flags or the trace file.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("length distribution {text:?}: expected N or uniform:LO:HI with 1 <= LO <= HI")]
    BadLenDist { text: String },
    #[error("reading trace {path}: {source}")]
    ReadTrace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("trace {path} line {line}: {source}")]
    ParseTrace {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
    #[error("trace {path} line {line}: {what}")]
    BadTraceLine {
        path: PathBuf,
        line: usize,
        what: &'static str,
    },
    #[error("--vocab-size must be larger than {FIRST_PROMPT_TOKEN}, got {0}")]
    VocabTooSmall(u32),
}

/// A distribution of token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LenDist {
    Fixed(u32),
    /// Uniform over `lo..=hi`.
    Uniform {
        lo: u32,
        hi: u32,
    },
}

impl FromStr for LenDist {
    type Err = WorkloadError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || WorkloadError::BadLenDist {
            text: text.to_owned(),
        };
        let dist = match text.strip_prefix("uniform:") {
            None => LenDist::Fixed(text.parse().map_err(|_| bad())?),
            Some(range) => {
                let (lo, hi) = range.split_once(':').ok_or_else(bad)?;
                let lo = lo.parse().map_err(|_| bad())?;
                let hi = hi.parse().map_err(|_| bad())?;
                LenDist::Uniform { lo, hi }
            }
        };
        match dist {
            LenDist::Fixed(n) if n >= 1 => Ok(dist),
            LenDist::Uniform { lo, hi } if 1 <= lo && lo <= hi => Ok(dist),
            _ => Err(bad()),
        }
    }
}

impl LenDist {
    fn sample(self, rng: &mut ChaCha8Rng) -> u32 {
        match self {
            LenDist::Fixed(n) => n,
            // The modulo bias is below 2^-32 for any u32 span: irrelevant for a benchmark.
            LenDist::Uniform { lo, hi } => lo + (rng.next_u64() % (u64::from(hi - lo) + 1)) as u32,
        }
    }
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub prompt: Vec<u32>,
    pub output_len: u32,
    /// Seconds after the start of the run at which to send it.
    pub arrival_s: f64,
}

/// How requests are generated when there is no trace.
#[derive(Debug, Clone)]
pub struct SyntheticWorkload {
    pub n_requests: usize,
    pub prompt_len: LenDist,
    pub output_len: LenDist,
    /// Requests per second (Poisson arrivals); `None` sends them all at once.
    pub request_rate: Option<f64>,
    pub vocab_size: u32,
    pub seed: u64,
}

/// Draws the requests of a synthetic workload.
pub fn synthetic(w: &SyntheticWorkload) -> Result<Vec<RequestSpec>, WorkloadError> {
    if w.vocab_size <= FIRST_PROMPT_TOKEN {
        return Err(WorkloadError::VocabTooSmall(w.vocab_size));
    }
    // Separate streams so that changing the rate does not change the prompts.
    let mut len_rng = ChaCha8Rng::seed_from_u64(w.seed);
    let mut token_rng = ChaCha8Rng::seed_from_u64(w.seed ^ 0x746f_6b65_6e73);
    let arrivals = match w.request_rate {
        Some(rate) => poisson_arrivals(w.n_requests, rate, w.seed),
        None => vec![0.0; w.n_requests],
    };
    let span = u64::from(w.vocab_size - FIRST_PROMPT_TOKEN);
    let specs = arrivals
        .into_iter()
        .map(|arrival_s| {
            let prompt_len = w.prompt_len.sample(&mut len_rng);
            let output_len = w.output_len.sample(&mut len_rng);
            let prompt = (0..prompt_len)
                .map(|_| FIRST_PROMPT_TOKEN + (token_rng.next_u64() % span) as u32)
                .collect();
            RequestSpec {
                prompt,
                output_len,
                arrival_s,
            }
        })
        .collect();
    Ok(specs)
}

/// Arrival offsets (seconds, non-decreasing, the first after one gap) of a Poisson process
/// with `rate` events per second: gaps are exponential with mean `1 / rate`.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6172_7269_7661_6c73);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            // Inverse CDF of the exponential; `1 - u` is in (0, 1], so the log is finite.
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / rate;
            t
        })
        .collect()
}

/// One line of a trace file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    prompt_len: Option<u32>,
    prompt: Option<Vec<u32>>,
    output_len: u32,
    arrival_s: Option<f64>,
}

/// Reads a JSONL trace: one object per request with `prompt_len` (a random prompt of that
/// many tokens is drawn) or `prompt` (token ids), `output_len`, and optional `arrival_s`
/// (default: at the start).
pub fn read_trace(
    path: &Path,
    vocab_size: u32,
    seed: u64,
) -> Result<Vec<RequestSpec>, WorkloadError> {
    if vocab_size <= FIRST_PROMPT_TOKEN {
        return Err(WorkloadError::VocabTooSmall(vocab_size));
    }
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::ReadTrace {
        path: path.to_owned(),
        source,
    })?;
    let mut token_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x746f_6b65_6e73);
    let span = u64::from(vocab_size - FIRST_PROMPT_TOKEN);
    let mut specs = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line = idx + 1;
        let bad = |what| WorkloadError::BadTraceLine {
            path: path.to_owned(),
            line,
            what,
        };
        let t: TraceLine =
            serde_json::from_str(raw).map_err(|source| WorkloadError::ParseTrace {
                path: path.to_owned(),
                line,
                source,
            })?;
        let prompt = match (t.prompt, t.prompt_len) {
            (Some(p), None) if !p.is_empty() => p,
            (None, Some(n)) if n > 0 => (0..n)
                .map(|_| FIRST_PROMPT_TOKEN + (token_rng.next_u64() % span) as u32)
                .collect(),
            (Some(_), Some(_)) => return Err(bad("give either prompt or prompt_len, not both")),
            _ => return Err(bad("needs a non-empty prompt or a positive prompt_len")),
        };
        let arrival_s = t.arrival_s.unwrap_or(0.0);
        if !(0.0..=MAX_SECONDS).contains(&arrival_s) {
            return Err(bad("arrival_s must be between 0 and 1e6"));
        }
        if t.output_len == 0 {
            return Err(bad("output_len must be at least 1"));
        }
        specs.push(RequestSpec {
            prompt,
            output_len: t.output_len,
            arrival_s,
        });
    }
    // Sent in arrival order; the sort is stable, so equal arrivals keep file order.
    specs.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn len_dist_parses_fixed_and_uniform_and_rejects_the_rest() {
        assert_eq!("128".parse::<LenDist>().unwrap(), LenDist::Fixed(128));
        assert_eq!(
            "uniform:64:256".parse::<LenDist>().unwrap(),
            LenDist::Uniform { lo: 64, hi: 256 }
        );
        for bad in [
            "0",
            "-1",
            "uniform:5:4",
            "uniform:0:4",
            "uniform:4",
            "normal:1:2",
            "",
        ] {
            assert!(bad.parse::<LenDist>().is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn uniform_lengths_cover_the_range_and_stay_inside_it() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let d = LenDist::Uniform { lo: 3, hi: 6 };
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[(d.sample(&mut rng) - 3) as usize] += 1;
        }
        // Each of the 4 values expects 1000 draws; 800 is more than 6 sigma below.
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate_and_exponential_spread() {
        let rate = 4.0;
        let t = poisson_arrivals(20_000, rate, 7);
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        let gaps: Vec<f64> = std::iter::once(t[0])
            .chain(t.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let n = gaps.len() as f64;
        let mean = gaps.iter().sum::<f64>() / n;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n;
        // Exponential(rate): mean 1/rate = 0.25 and standard deviation equal to the mean
        // (a uniform or fixed spacing would fail the second check).
        assert!((mean - 0.25).abs() < 0.01, "mean gap {mean}");
        assert!((var.sqrt() - 0.25).abs() < 0.015, "gap sd {}", var.sqrt());
        // P(gap > 1/rate) = e^-1 for the exponential.
        let above = gaps.iter().filter(|&&g| g > 0.25).count() as f64 / n;
        assert!((above - (-1.0f64).exp()).abs() < 0.015, "{above}");
    }

    #[test]
    fn poisson_arrivals_repeat_for_a_seed_and_differ_across_seeds() {
        assert_eq!(poisson_arrivals(5, 2.0, 3), poisson_arrivals(5, 2.0, 3));
        assert_ne!(poisson_arrivals(5, 2.0, 3), poisson_arrivals(5, 2.0, 4));
    }

    #[test]
    fn synthetic_workload_has_the_asked_lengths_and_token_range() {
        let w = SyntheticWorkload {
            n_requests: 50,
            prompt_len: LenDist::Uniform { lo: 2, hi: 9 },
            output_len: LenDist::Fixed(5),
            request_rate: None,
            vocab_size: 120,
            seed: 0,
        };
        let specs = synthetic(&w).unwrap();
        assert_eq!(specs.len(), 50);
        for s in &specs {
            assert!((2..=9).contains(&s.prompt.len()));
            assert!(s.prompt.iter().all(|&t| (100..120).contains(&t)));
            assert_eq!(s.output_len, 5);
            assert_eq!(s.arrival_s, 0.0);
        }
        assert_eq!(specs, synthetic(&w).unwrap());
        // Adding a rate changes arrivals only.
        let timed = synthetic(&SyntheticWorkload {
            request_rate: Some(10.0),
            ..w.clone()
        })
        .unwrap();
        assert!(timed.iter().zip(&specs).all(|(a, b)| a.prompt == b.prompt));
        assert!(timed[0].arrival_s > 0.0);
    }

    #[test]
    fn trace_lines_give_prompts_lengths_and_sorted_arrivals() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        std::fs::write(
            &path,
            "{\"prompt\": [1, 2, 3], \"output_len\": 4, \"arrival_s\": 0.5}\n\n\
             {\"prompt_len\": 6, \"output_len\": 2}\n",
        )
        .unwrap();
        let specs = read_trace(&path, 1000, 0).unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].prompt.len(), 6);
        assert_eq!(specs[0].arrival_s, 0.0);
        assert_eq!(specs[1].prompt, vec![1, 2, 3]);
        assert_eq!((specs[1].output_len, specs[1].arrival_s), (4, 0.5));
    }

    #[test]
    fn bad_trace_lines_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        for (text, want) in [
            ("{\"output_len\": 4}", "line 1: needs a non-empty prompt"),
            (
                "{\"prompt_len\": 2, \"output_len\": 1}\n{\"prompt_len\": 2}",
                "line 2: missing field `output_len`",
            ),
            (
                "{\"prompt_len\": 2, \"output_len\": 0}",
                "line 1: output_len",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = read_trace(&path, 1000, 0).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }
}
