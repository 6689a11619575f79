//! Shrinking a failing schedule: delta debugging (ddmin) over its actions. Every subset of a
//! schedule is a schedule (actions name what they act on relative to the state they meet), so
//! chunks are removed while the run still fails the same way, halving the chunk size when no
//! chunk can go, down to single actions.

use crate::schedule::Timed;
use crate::sim::{Outcome, SimConfig};

/// The shortest schedule found that still fails with the failure's kind, and its outcome.
pub fn shrink(config: &SimConfig, schedule: &[Timed], max_runs: usize) -> (Vec<Timed>, Outcome) {
    let quiet = SimConfig {
        trace: false,
        ..config.clone()
    };
    let first = crate::run(&quiet, schedule);
    let Some(kind) = first.failure.as_ref().map(|f| f.kind().to_owned()) else {
        return (schedule.to_vec(), first);
    };
    let fails = |s: &[Timed]| {
        crate::run(&quiet, s)
            .failure
            .is_some_and(|f| f.kind() == kind)
    };
    let mut current = schedule.to_vec();
    let mut runs = 0;
    let mut chunk = current.len().div_ceil(2).max(1);
    while runs < max_runs && !current.is_empty() {
        let mut removed = false;
        let mut start = 0;
        while start < current.len() && runs < max_runs {
            let end = (start + chunk).min(current.len());
            let candidate: Vec<Timed> = current[..start]
                .iter()
                .chain(&current[end..])
                .copied()
                .collect();
            runs += 1;
            if fails(&candidate) {
                current = candidate;
                removed = true;
            } else {
                start = end;
            }
        }
        if !removed {
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
    }
    let outcome = crate::run(config, &current);
    (current, outcome)
}
