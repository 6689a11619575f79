//! Stop strings over a stream of text deltas, with hold-back.
//!
//! A stop string can arrive split over several deltas, so text that ends with a proper
//! prefix of some stop string is held back until the next delta shows whether the stop
//! string follows. A match can only start inside the held text or the new delta (anything
//! earlier was emitted because no stop string could start there), so each delta is searched
//! together with what was held, never the whole output.

/// The matcher of one request.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// A match's text keeps the stop string (vLLM's `include_stop_str_in_output`).
    include_stop: bool,
}

/// What to do with a delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Emit this text (possibly empty) and go on.
    Continue(String),
    /// A stop string matched: emit `text` (the output up to the stop string) and stop.
    Stopped { text: String, stop: String },
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any output).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            include_stop: false,
        }
    }

    /// A match's text ends with the stop string instead of before it.
    pub fn including_stop(mut self) -> Self {
        self.include_stop = true;
        self
    }

    /// Feeds a delta in which no stop string may end (the first `min_tokens` tokens' text):
    /// emits what cannot begin a stop string and holds the rest, so that a stop string that
    /// begins here and ends in a later delta still matches.
    pub fn push_unmatched(&mut self, delta: &str) -> String {
        self.held.push_str(delta);
        let keep_from = self.hold_back_start();
        let rest = self.held.split_off(keep_from);
        std::mem::replace(&mut self.held, rest)
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds one delta.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.held.push_str(delta);
        if let Some((at, stop)) = self.earliest_match() {
            let end = if self.include_stop {
                at + stop.len()
            } else {
                at
            };
            self.held.truncate(end);
            return StopOutcome::Stopped {
                text: std::mem::take(&mut self.held),
                stop,
            };
        }
        let keep_from = self.hold_back_start();
        let rest = self.held.split_off(keep_from);
        StopOutcome::Continue(std::mem::replace(&mut self.held, rest))
    }

    /// The held text, once the output has ended without a match.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The first match in the held text; at equal positions the stop listed first.
    fn earliest_match(&self) -> Option<(usize, String)> {
        self.stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at)
            .map(|(at, s)| (at, s.clone()))
    }

    /// Where the longest suffix of the held text that is a proper prefix of a stop string
    /// starts (the length of the text when there is none).
    fn hold_back_start(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let min_start = self.held.len().saturating_sub(longest.saturating_sub(1));
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= min_start)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, Option<String>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for d in deltas {
            match m.push(d) {
                StopOutcome::Continue(t) => out.push(t),
                StopOutcome::Stopped { text, stop } => {
                    out.push(text);
                    return (out, Some(stop));
                }
            }
        }
        out.push(m.flush());
        (out, None)
    }

    #[test]
    fn stop_split_over_deltas_is_held_back_then_cut() {
        let (out, stop) = run(&["END"], &["abc E", "N", "D more"]);
        assert_eq!(out, ["abc ", "", ""]);
        assert_eq!(stop.as_deref(), Some("END"));
    }

    #[test]
    fn held_text_is_released_when_the_stop_does_not_follow() {
        let (out, stop) = run(&["END"], &["abc E", "Nx", "E"]);
        assert_eq!(out, ["abc ", "ENx", "", "E"]);
        assert_eq!(stop, None);
    }

    #[test]
    fn earliest_match_wins_and_multibyte_text_is_never_split() {
        let (out, stop) = run(&["界", "b"], &["a世界b"]);
        assert_eq!(out, ["a世"]);
        assert_eq!(stop.as_deref(), Some("界"));
        let (out, _) = run(&["界x"], &["世界"]);
        assert_eq!(out, ["世", "界"]);
    }

    #[test]
    fn a_stop_string_can_be_kept_in_the_text() {
        let mut m = StopMatcher::new(vec!["END".into()]).including_stop();
        assert_eq!(m.push("abc E"), StopOutcome::Continue("abc ".into()));
        assert_eq!(
            m.push("ND more"),
            StopOutcome::Stopped {
                text: "END".into(),
                stop: "END".into()
            }
        );
    }

    #[test]
    fn unmatched_text_passes_but_a_stop_string_it_begins_still_matches() {
        let mut m = StopMatcher::new(vec!["ab".into()]);
        // `ab` inside the unmatched text does not stop; its trailing `a` is held back.
        assert_eq!(m.push_unmatched("xaba"), "xab");
        assert_eq!(
            m.push("b!"),
            StopOutcome::Stopped {
                text: String::new(),
                stop: "ab".into()
            }
        );
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let (out, stop) = run(&[""], &["ab"]);
        assert_eq!(out, ["ab", ""]);
        assert_eq!(stop, None);
    }
}
