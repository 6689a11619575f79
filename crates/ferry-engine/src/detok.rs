//! Incremental detokenization: text deltas from a growing token sequence.
//!
//! Decoding each token alone is wrong in two ways: a byte-level token can hold part of a
//! UTF-8 character (emoji, CJK take 3–4 bytes over several tokens), and SentencePiece-style
//! decoders change a token's text depending on what precedes it (a leading space). So the
//! decoder keeps two offsets into the ids: `prefix_offset` (start of a short window of
//! context) and `read_offset` (end of what has been emitted). Each new token decodes the
//! window with and without the new ids; the difference is the delta, emitted only once it
//! does not end in U+FFFD (an incomplete character). The window then slides forward, so the
//! cost per token stays bounded by the window, not the sequence.
//!
//! Written by hand: `tokenizers` offers a `DecodeStream`, but it has no way to seed the
//! window with prompt context and decides on its own when to skip special tokens; this is
//! small and we test it against full decodes.

use std::sync::Arc;

use ferry_core::TokenId;
use tokenizers::Tokenizer;

/// Ids kept before the window are dropped once there are this many (bounded memory).
const COMPACT_AT: usize = 256;

/// The incremental decoder of one sequence. Special tokens are skipped unless
/// [`IncrementalDetokenizer::keep_special_tokens`] says otherwise.
#[derive(Debug)]
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<TokenId>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// A decoder whose first delta is decoded after `context` (e.g. the prompt's last few
    /// tokens); the context's own text is never emitted.
    pub fn new(tokenizer: Arc<Tokenizer>, context: &[TokenId]) -> Self {
        Self {
            tokenizer,
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special_tokens: true,
        }
    }

    /// Special tokens are decoded into the text too (vLLM's `skip_special_tokens: false`).
    pub fn keep_special_tokens(mut self) -> Self {
        self.skip_special_tokens = false;
        self
    }

    /// Adds one token; returns the text it completes (often empty while a multibyte
    /// character is incomplete, sometimes several tokens' worth).
    pub fn push(&mut self, token: TokenId) -> String {
        self.ids.push(token);
        let prefix_text = self.decode(self.prefix_offset, self.read_offset);
        let new_text = self.decode(self.prefix_offset, self.ids.len());
        if new_text.len() <= prefix_text.len() || new_text.ends_with(char::REPLACEMENT_CHARACTER) {
            return String::new();
        }
        let delta = suffix_after(&new_text, &prefix_text).to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        delta
    }

    /// Everything not emitted yet, incomplete characters included (as U+FFFD): the sequence
    /// has ended, so nothing will complete them.
    pub fn flush(&mut self) -> String {
        let prefix_text = self.decode(self.prefix_offset, self.read_offset);
        let new_text = self.decode(self.prefix_offset, self.ids.len());
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if new_text.len() <= prefix_text.len() {
            return String::new();
        }
        suffix_after(&new_text, &prefix_text).to_owned()
    }

    fn decode(&self, start: usize, end: usize) -> String {
        if start >= end {
            return String::new();
        }
        match self.tokenizer.decode(
            TokenId::as_raw_slice(&self.ids[start..end]),
            self.skip_special_tokens,
        ) {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!("cannot decode tokens {:?}: {e}", &self.ids[start..end]);
                String::new()
            }
        }
    }

    fn compact(&mut self) {
        if self.prefix_offset >= COMPACT_AT {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

/// The part of `text` after `prefix`. Normally `prefix` is a prefix of `text`; when it is not
/// (the context itself ended inside a character, which the new token completed), the part
/// after their longest common prefix, cut on a character boundary.
fn suffix_after<'a>(text: &'a str, prefix: &str) -> &'a str {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest;
    }
    let common = text
        .char_indices()
        .zip(prefix.chars())
        .find(|((_, a), b)| a != b)
        .map_or(text.len().min(prefix.len()), |((i, _), _)| i);
    let mut cut = common;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    &text[cut..]
}

#[cfg(test)]
mod tests {
    use super::suffix_after;

    #[test]
    fn suffix_after_a_changed_character_starts_at_the_change() {
        assert_eq!(suffix_after("abc", "ab"), "c");
        assert_eq!(suffix_after("a\u{e9}x", "a\u{fffd}"), "\u{e9}x");
        assert_eq!(suffix_after("abc", "abc"), "");
    }
}
