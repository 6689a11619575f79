//! Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`, vLLM 0.34's names): a chat
//! answer's text between `<think>` and `</think>` is its reasoning (`message.reasoning`, and
//! `reasoning_content`, the older name SGLang and many clients read), the rest its content.
//!
//! Both parsers start in the reasoning (the models' templates open the `<think>` block, or
//! the model does: a `<think>` in the reasoning is dropped, as vLLM's `qwen3` drops it) and
//! switch to the content at the first `</think>`; an answer cut off before it is all
//! reasoning. (vLLM's `deepseek_r1` also drops whatever came before a `<think>` when it
//! splits a whole answer, but not when it streams one; ferry keeps it, both ways.) `qwen3` follows the request's
//! `chat_template_kwargs.enable_thinking` (default on; off: all content, as Qwen3's template
//! then closes the block in the prompt) and drops a repeated `</think>` in the content;
//! `deepseek_r1` keeps the content as it came. The split runs on text as it streams
//! ([`Splitter`]): a marker cut between two chunks is held back until it is known, so the
//! streamed deltas join to the non-streamed answer exactly.

use std::str::FromStr;

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

/// Which parser (vLLM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    Qwen3,
    DeepseekR1,
}

impl FromStr for ReasoningParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3" => Ok(Self::Qwen3),
            "deepseek_r1" => Ok(Self::DeepseekR1),
            other => Err(format!(
                "unknown reasoning parser {other:?}: ferry has qwen3 and deepseek_r1"
            )),
        }
    }
}

/// A chat request's reasoning split: the server's parser, and the request's
/// `chat_template_kwargs.enable_thinking` (default on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reasoning {
    pub parser: ReasoningParser,
    pub thinking: bool,
}

impl Reasoning {
    pub fn splitter(self) -> Splitter {
        Splitter::new(self.parser, self.thinking)
    }

    /// The answer starts in the reasoning (so a constraint starts after its `</think>`).
    pub fn starts_in_reasoning(self) -> bool {
        self.parser == ReasoningParser::DeepseekR1 || self.thinking
    }

    /// The marker that ends the reasoning.
    pub const END: &'static str = THINK_END;

    /// A whole answer's `(reasoning, content)`.
    pub fn split(self, text: &str) -> (Option<String>, Option<String>) {
        split(self.parser, self.thinking, text)
    }
}

/// A piece of the answer's text, split.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// Splits an answer's text into reasoning and content as it arrives.
#[derive(Debug, Clone)]
pub struct Splitter {
    parser: ReasoningParser,
    in_reasoning: bool,
    /// Text that may be the start of a marker, held back.
    pending: String,
}

impl Splitter {
    /// For a request; `thinking` is its `chat_template_kwargs.enable_thinking` (default
    /// on), which only `qwen3` reads.
    pub fn new(parser: ReasoningParser, thinking: bool) -> Self {
        let in_reasoning = Reasoning { parser, thinking }.starts_in_reasoning();
        Self {
            parser,
            in_reasoning,
            pending: String::new(),
        }
    }

    /// The split of `text`, the next piece of the answer (what could be a cut marker is
    /// held back for the next piece or [`Self::finish`]).
    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut out = Split::default();
        while let Some((at, marker)) = self.marker() {
            let before: String = self.pending.drain(..at).collect();
            self.pending.drain(..marker.len());
            self.emit(&before, &mut out);
            // `<think>` in the reasoning is dropped; the first `</think>` ends it; in the
            // content, qwen3 drops a repeated `</think>` (deepseek_r1 looks for none).
            if marker == THINK_END {
                self.in_reasoning = false;
            }
        }
        // No marker here: all of it goes out, but a tail that could begin one.
        let keep = partial_marker_len(&self.pending, self.markers());
        let ready = self.pending.len() - keep;
        let text: String = self.pending.drain(..ready).collect();
        self.emit(&text, &mut out);
        out
    }

    /// The split of the next piece, and with `last` of what was held back too.
    pub fn feed(&mut self, text: &str, last: bool) -> Split {
        let mut split = self.push(text);
        if last {
            let rest = self.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        split
    }

    /// What was held back, once the answer is complete.
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let rest = std::mem::take(&mut self.pending);
        self.emit(&rest, &mut out);
        out
    }

    /// The markers that mean something now.
    fn markers(&self) -> &'static [&'static str] {
        match (self.in_reasoning, self.parser) {
            (true, _) => &[THINK_START, THINK_END],
            (false, ReasoningParser::Qwen3) => &[THINK_END],
            (false, ReasoningParser::DeepseekR1) => &[],
        }
    }

    /// The first marker in the pending text, and where.
    fn marker(&self) -> Option<(usize, &'static str)> {
        self.markers()
            .iter()
            .filter_map(|m| self.pending.find(m).map(|at| (at, *m)))
            .min_by_key(|&(at, _)| at)
    }

    fn emit(&self, text: &str, out: &mut Split) {
        if self.in_reasoning {
            out.reasoning.push_str(text);
        } else {
            out.content.push_str(text);
        }
    }
}

/// The longest tail of `text` that is a proper prefix of one of `markers`.
fn partial_marker_len(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .flat_map(|m| (1..m.len()).rev().filter(move |&n| text.ends_with(&m[..n])))
        .max()
        .unwrap_or(0)
}

/// A whole answer's split: `(reasoning, content)`, each `None` when empty (vLLM's).
pub fn split(
    parser: ReasoningParser,
    thinking: bool,
    text: &str,
) -> (Option<String>, Option<String>) {
    let mut s = Splitter::new(parser, thinking);
    let mut all = s.push(text);
    let rest = s.finish();
    all.reasoning.push_str(&rest.reasoning);
    all.content.push_str(&rest.content);
    let some = |t: String| (!t.is_empty()).then_some(t);
    (some(all.reasoning), some(all.content))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ReasoningParser::{DeepseekR1, Qwen3};

    fn s(t: &str) -> Option<String> {
        Some(t.to_owned())
    }

    #[test]
    fn whole_answers_split_as_vllms_parsers_split_them() {
        type Case = (
            ReasoningParser,
            bool,
            &'static str,
            Option<String>,
            Option<String>,
        );
        let cases: &[Case] = &[
            (
                Qwen3,
                true,
                "<think>\nabc\n</think>\n\nhello",
                s("\nabc\n"),
                s("\n\nhello"),
            ),
            (
                DeepseekR1,
                true,
                "<think>\nabc\n</think>\n\nhello",
                s("\nabc\n"),
                s("\n\nhello"),
            ),
            // The template opened the block: no leading marker.
            (DeepseekR1, true, "abc</think>hello", s("abc"), s("hello")),
            (Qwen3, true, "abc</think>hello", s("abc"), s("hello")),
            // Cut off while thinking: all reasoning.
            (Qwen3, true, "<think>still going", s("still going"), None),
            (DeepseekR1, true, "still going", s("still going"), None),
            // Nothing after the block.
            (Qwen3, true, "<think>abc</think>", s("abc"), None),
            // Qwen3 without thinking: all content, markers and all as they come.
            (Qwen3, false, "hello <think>", None, s("hello <think>")),
            // A repeated end: qwen3 drops it, deepseek_r1 keeps it.
            (Qwen3, true, "a</think>b</think>c", s("a"), s("bc")),
            (
                DeepseekR1,
                true,
                "a</think>b</think>c",
                s("a"),
                s("b</think>c"),
            ),
            // A `<think>` in the reasoning is dropped wherever it is.
            (DeepseekR1, true, "x<think>y</think>z", s("xy"), s("z")),
            (Qwen3, true, "x<think>y</think>z", s("xy"), s("z")),
            (Qwen3, true, "", None, None),
        ];
        for (parser, thinking, text, reasoning, content) in cases {
            assert_eq!(
                split(*parser, *thinking, text),
                (reasoning.clone(), content.clone()),
                "{parser:?} {thinking} {text:?}"
            );
        }
    }

    /// Streamed in pieces of every size, the deltas join to the whole answer's split.
    #[test]
    fn streamed_pieces_join_to_the_whole_split() {
        let texts = [
            "<think>\nabc\n</think>\n\nhello",
            "abc</think>hel<lo</",
            "<thi",
            "a</think>b</think>c<",
            "x<think>y</think>z",
        ];
        for parser in [Qwen3, DeepseekR1] {
            for text in texts {
                let whole = split(parser, true, text);
                for size in 1..=text.len() {
                    let mut s = Splitter::new(parser, true);
                    let mut joined = Split::default();
                    let bytes = text.as_bytes();
                    for piece in bytes.chunks(size) {
                        let part = s.push(std::str::from_utf8(piece).unwrap());
                        joined.reasoning.push_str(&part.reasoning);
                        joined.content.push_str(&part.content);
                    }
                    let rest = s.finish();
                    joined.reasoning.push_str(&rest.reasoning);
                    joined.content.push_str(&rest.content);
                    let some = |t: String| (!t.is_empty()).then_some(t);
                    assert_eq!(
                        (some(joined.reasoning), some(joined.content)),
                        whole,
                        "{parser:?} {text:?} in pieces of {size}"
                    );
                }
            }
        }
    }
}
