//! The engine's time outside the model forward, from two counters the server exports on
//! `GET /metrics` (Prometheus text format), scraped before and after a run.

/// Seconds the engine spent in the model forward.
pub const FORWARD_SECONDS: &str = "ferry_engine_forward_seconds_total";
/// Seconds the engine spent in whole steps (schedule, forward, outputs).
pub const STEP_SECONDS: &str = "ferry_engine_step_seconds_total";

/// The two counters at one moment; `None` for one the server does not export.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineTime {
    pub forward_s: Option<f64>,
    pub step_s: Option<f64>,
}

impl EngineTime {
    /// Reads the counters from a Prometheus text exposition. Samples with labels are summed
    /// (one series per engine, should there be several).
    pub fn parse(text: &str) -> Self {
        Self {
            forward_s: sum_samples(text, FORWARD_SECONDS),
            step_s: sum_samples(text, STEP_SECONDS),
        }
    }
}

/// `1 − Δforward / Δstep` between two scrapes; `None` when a counter is missing or no step
/// time passed.
pub fn overhead_fraction(before: EngineTime, after: EngineTime) -> Option<f64> {
    let forward = after.forward_s? - before.forward_s?;
    let step = after.step_s? - before.step_s?;
    (step > 0.0).then(|| 1.0 - forward / step)
}

/// Sum of the values of every sample of metric `name`; `None` when there is none.
/// Written by hand: two counters need a line filter, not a Prometheus parser crate.
fn sum_samples(text: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in text.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name value [timestamp]` or `name{labels} value [timestamp]`; another metric whose
        // name merely starts with `name` has neither a space nor a brace next.
        let rest = match rest.chars().next() {
            Some('{') => match rest.find('}') {
                Some(end) => &rest[end + 1..],
                None => continue,
            },
            Some(' ' | '\t') => rest,
            _ => continue,
        };
        if let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *total.get_or_insert(0.0) += value;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# HELP ferry_engine_step_seconds_total Step time.\n\
        # TYPE ferry_engine_step_seconds_total counter\n\
        ferry_engine_step_seconds_total 10\n\
        ferry_engine_step_seconds_total_created 1.7e9\n\
        ferry_engine_forward_seconds_total{engine=\"0\"} 6\n\
        ferry_engine_forward_seconds_total{engine=\"1\"} 3 1700000000\n";

    #[test]
    fn parses_labelled_and_plain_samples_and_skips_lookalikes() {
        assert_eq!(
            EngineTime::parse(BEFORE),
            EngineTime {
                forward_s: Some(9.0),
                step_s: Some(10.0)
            }
        );
        assert_eq!(EngineTime::parse("other 1\n"), EngineTime::default());
    }

    #[test]
    fn overhead_is_the_share_of_step_time_outside_the_forward() {
        let before = EngineTime::parse(BEFORE);
        let after = EngineTime {
            forward_s: Some(9.0 + 9.5),
            step_s: Some(10.0 + 10.0),
        };
        assert!((overhead_fraction(before, after).unwrap() - 0.05).abs() < 1e-12);
        assert_eq!(overhead_fraction(before, before), None);
        let missing = EngineTime {
            forward_s: None,
            ..after
        };
        assert_eq!(overhead_fraction(before, missing), None);
    }
}
