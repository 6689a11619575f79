//! Engine logprobs in the two OpenAI shapes: the legacy completions lists (`tokens`,
//! `token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` entries (`token`,
//! `logprob`, `bytes`, `top_logprobs`). A token's text is the tokenizer's decoding of that one
//! token (special tokens included), as vLLM reports it.

use std::sync::Arc;

use ferry_engine::TokenId;
use ferry_engine::{PromptTokenLogprob, TokenLogprob};
use tokenizers::Tokenizer;

use crate::response::{
    finite_logprob, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs,
    PromptLogprobEntry, PromptLogprobMap, PromptLogprobsJson, TopLogprobMap,
};

/// Token id → text, for logprobs.
#[derive(Debug, Clone)]
pub struct TokenTexts {
    tokenizer: Option<Arc<Tokenizer>>,
    /// Every token is named `token:<id>` (vLLM's `return_tokens_as_token_ids`).
    as_ids: bool,
}

impl TokenTexts {
    pub fn new(tokenizer: Option<Arc<Tokenizer>>) -> Self {
        Self {
            tokenizer,
            as_ids: false,
        }
    }

    /// These texts, naming each token `token:<id>` when `as_ids` (the form AReaL and other
    /// RL clients parse back into ids, unambiguous where two tokens decode alike).
    pub fn with_token_ids(&self, as_ids: bool) -> Self {
        Self {
            tokenizer: self.tokenizer.clone(),
            as_ids,
        }
    }

    /// The token's text; `token:<id>` when asked; without a tokenizer, `token_id:<id>`
    /// (vLLM's token-id form).
    pub fn text(&self, id: TokenId) -> String {
        if self.as_ids {
            return format!("token:{id}");
        }
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id.0], false).ok())
            .unwrap_or_else(|| format!("token_id:{id}"))
    }
}

/// Completions logprobs for `lps`; offsets count characters from `offset` (the length of the
/// choice's text before these tokens). Returns the offset after the last token as well.
pub fn completion_logprobs(
    texts: &TokenTexts,
    lps: &[TokenLogprob],
    mut offset: usize,
) -> (CompletionLogprobs, usize) {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        let text = texts.text(lp.token);
        out.text_offset.push(offset);
        offset += text.chars().count();
        out.top_logprobs
            .push(Some(top_map(texts, &lp.top, &text, lp.logprob)));
        out.token_logprobs.push(Some(finite_logprob(lp.logprob)));
        out.tokens.push(text);
    }
    (out, offset)
}

/// A token's `top_logprobs` entry: its top alternatives, then the token itself (`text`, its
/// `logprob`), as the OpenAI completions format lists them.
fn top_map(texts: &TokenTexts, top: &[(TokenId, f32)], text: &str, logprob: f32) -> TopLogprobMap {
    let mut map: Vec<(String, f32)> = top
        .iter()
        .map(|&(id, l)| (texts.text(id), finite_logprob(l)))
        .collect();
    map.push((text.to_owned(), finite_logprob(logprob)));
    TopLogprobMap(map)
}

/// An echoed prompt's part of completions logprobs (it comes before the output's): each
/// prompt token with its prompt logprob, the first with none; offsets from 0. Returns the
/// offset after the prompt as well.
pub fn echo_logprobs(
    texts: &TokenTexts,
    prompt: &[TokenId],
    lps: &[PromptTokenLogprob],
) -> (CompletionLogprobs, usize) {
    let mut out = CompletionLogprobs::default();
    let mut offset = 0;
    for (i, &token) in prompt.iter().enumerate() {
        let text = texts.text(token);
        out.text_offset.push(offset);
        offset += text.chars().count();
        let lp = i.checked_sub(1).and_then(|j| lps.get(j));
        out.token_logprobs
            .push(lp.map(|lp| finite_logprob(lp.logprob)));
        out.top_logprobs
            .push(lp.map(|lp| top_map(texts, &lp.top, &text, lp.logprob)));
        out.tokens.push(text);
    }
    (out, offset)
}

impl CompletionLogprobs {
    /// `self` followed by `rest`.
    pub fn append(mut self, rest: Self) -> Self {
        self.tokens.extend(rest.tokens);
        self.token_logprobs.extend(rest.token_logprobs);
        self.top_logprobs.extend(rest.top_logprobs);
        self.text_offset.extend(rest.text_offset);
        self
    }
}

/// Chat logprobs for `lps`.
pub fn chat_logprobs(texts: &TokenTexts, lps: &[TokenLogprob]) -> ChatLogprobs {
    let content = lps
        .iter()
        .map(|lp| {
            let token = texts.text(lp.token);
            ChatTokenLogprob {
                bytes: token.as_bytes().to_vec(),
                logprob: finite_logprob(lp.logprob),
                top_logprobs: lp
                    .top
                    .iter()
                    .map(|&(id, l)| {
                        let token = texts.text(id);
                        ChatTopLogprob {
                            bytes: token.as_bytes().to_vec(),
                            logprob: finite_logprob(l),
                            token,
                        }
                    })
                    .collect(),
                token,
            }
        })
        .collect();
    ChatLogprobs { content }
}

/// vLLM's `prompt_logprobs` for `lps` (the logprobs of prompt positions 1..): `null` for the
/// first token, then per token its own entry and the top-n's, keyed by token id.
pub fn prompt_logprobs_json(texts: &TokenTexts, lps: &[PromptTokenLogprob]) -> PromptLogprobsJson {
    let entry = |token: TokenId, logprob: f32, rank: u32| {
        (
            token,
            PromptLogprobEntry {
                logprob: finite_logprob(logprob),
                rank,
                decoded_token: texts.text(token),
            },
        )
    };
    std::iter::once(None)
        .chain(lps.iter().map(|lp| {
            let own = entry(lp.token, lp.logprob, lp.rank);
            let top = lp
                .top
                .iter()
                .zip(1u32..)
                .map(|(&(t, l), rank)| entry(t, l, rank));
            Some(PromptLogprobMap(std::iter::once(own).chain(top).collect()))
        }))
        .collect()
}
