//! Structured outputs: a request's JSON schema, regex, choice list or Lark grammar, compiled
//! by llguidance into a matcher that says, before each sample, which tokens may come next.
//!
//! Where the work happens:
//! * compiling ([`Constraints::compile`]) runs on the caller's task, so an invalid schema or
//!   grammar is refused before the request reaches the engine, and a slow compile never holds
//!   up a step;
//! * the engine thread keeps each constrained request's matcher ([`ConstraintState`]). The
//!   mask for a request's next token is computed as soon as its previous token is known (at
//!   admission for the first one), so it is ready before the request is scheduled again; the
//!   scheduler never sees it: the engine attaches it to the plan's sample between `schedule`
//!   and the forward (`StepPlan::token_masks`), and the sampler takes the token from the
//!   allowed ones. Logprobs stay those of the engine's logprobs mode.
//! * a constraint that can no longer be met (no token allowed, or the matcher failed) ends the
//!   request with `stop` and a [`crate::StopReason::Constraint`] naming why; a grammar that is
//!   complete allows only EOS, so the request stops on EOS as usual (with `ignore_eos`, it
//!   stops there with a constraint stop reason instead).
//!
//! The tokenizer. llguidance needs every token's bytes. `toktrie_hf_tokenizers` would derive
//! them, but it pins an older `tokenizers` than ferry's (a second copy to build), so the
//! bytes come from the tokenizer's own JSON through llguidance's
//! `token_bytes_from_tokenizer_json`, and tokenizing goes through ferry's tokenizer behind
//! toktrie's `TokenizerEnv` trait.

use std::sync::Arc;

use ferry_core::{TokenId, TokenMask};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use tokenizers::Tokenizer;

/// What a request's output must match (OpenAI's `response_format`, vLLM's
/// `structured_outputs` and `guided_*`).
#[derive(Debug, Clone, PartialEq)]
pub enum StructuredOutput {
    /// Valid JSON matching the schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching the regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of the strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect).
    Grammar(String),
    /// Any text up to and including the first `end` (a model's reasoning, closed by
    /// `</think>`), then `inner`: a constraint that starts after the reasoning, as vLLM's does
    /// with a reasoning parser.
    AfterReasoning {
        end: String,
        inner: Box<StructuredOutput>,
    },
}

impl StructuredOutput {
    /// The llguidance grammar.
    fn grammar(&self) -> Result<TopLevelGrammar, ConstraintError> {
        Ok(match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({ "type": "object" }))
            }
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err(ConstraintError::Invalid("the choice list is empty".into()));
                }
                let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            Self::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Self::AfterReasoning { end, inner } => {
                // Two grammars: the free text is a lazy lexeme (it ends at the first `end`),
                // then the inner constraint's own grammar, referenced by name.
                let mut inner = inner.grammar()?;
                if inner.grammars.len() != 1 {
                    return Err(ConstraintError::Invalid(
                        "a constraint after the reasoning must be a single grammar".into(),
                    ));
                }
                let mut body = inner.grammars.remove(0);
                body.name = Some("after_reasoning".into());
                let reasoning = llguidance::api::GrammarWithLexer::from_lark(format!(
                    "start: reasoning @after_reasoning\nreasoning[lazy]: /(.|\\n)*{}/\n",
                    regex_escape(end).replace('/', "\\/")
                ));
                TopLevelGrammar {
                    grammars: vec![reasoning, body],
                    max_tokens: None,
                }
            }
        })
    }
}

/// `text` as a regex that matches exactly it. Written here because llguidance takes a regex
/// string and ferry has no other use for the `regex` crate's `escape`.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The schema, regex, choices or grammar is not one llguidance can compile.
    #[error("{0}")]
    Invalid(String),
    /// This model cannot take constraints (no tokenizer, or one whose token bytes cannot be
    /// derived).
    #[error("structured outputs are not available for this model: {0}")]
    Unavailable(String),
}

/// Compiles constraints for one model's tokenizer; shared by every request.
pub struct Constraints {
    factory: ParserFactory,
}

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraints")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl Constraints {
    /// The compiler for `tokenizer`, whose EOS is `eos` (the token a complete constraint
    /// allows), over the model's `model_vocab` rows (tokens the tokenizer does not know are
    /// never allowed).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        eos: TokenId,
        model_vocab: usize,
    ) -> Result<Self, ConstraintError> {
        let unavailable = |why: String| ConstraintError::Unavailable(why);
        let json: serde_json::Value = tokenizer
            .to_string(false)
            .map_err(|e| unavailable(format!("could not serialize the tokenizer: {e}")))
            .and_then(|s| {
                serde_json::from_str(&s)
                    .map_err(|e| unavailable(format!("could not read the tokenizer's JSON: {e}")))
            })?;
        // llguidance asserts on some vocabularies it does not expect: a panic there is an
        // unavailable feature, not a dead server.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| {
                unavailable("the tokenizer's vocabulary is not one llguidance reads".into())
            })?
            .map_err(|e| unavailable(format!("could not derive the tokens' bytes: {e}")))?;
        let mut words = words;
        let vocab = words.len().max(model_vocab).max(eos.index() + 1);
        words.resize(vocab, Vec::new());
        let info = TokRxInfo::new(vocab as u32, eos.0);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(FerryTokEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| unavailable(format!("could not build the token index: {e}")))?;
        // Warnings go to the request's error, never to stderr.
        factory.quiet();
        Ok(Self { factory })
    }

    /// Compiles `spec` into a fresh constraint, or says what is wrong with it.
    pub fn compile(&self, spec: &StructuredOutput) -> Result<Constraint, ConstraintError> {
        let grammar = spec.grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Invalid(e));
        }
        Ok(Constraint { matcher })
    }
}

/// llguidance's view of ferry's tokenizer.
struct FerryTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for FerryTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Not a tokenizer's full job for bytes that are not UTF-8, but llguidance only uses
        // this for text it forces (literals of the grammar), which is UTF-8.
        let text = String::from_utf8_lossy(s);
        self.tokenizer
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

/// One request's compiled constraint, at its start. `Clone` gives an independent copy (for
/// the `n` choices of one request).
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").finish_non_exhaustive()
    }
}

impl Constraint {
    /// Whether `tokens` are a whole output this constraint accepts (for tests and
    /// diagnostics: the engine feeds tokens one by one as they are sampled).
    pub fn accepts(&self, tokens: &[TokenId]) -> bool {
        let mut matcher = self.matcher.deep_clone();
        matcher
            .consume_tokens(TokenId::as_raw_slice(tokens))
            .is_ok()
            && matcher.is_accepting().unwrap_or(false)
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }
}

/// A constrained request on the engine thread: its matcher and the mask of its next token.
pub(crate) struct ConstraintState {
    matcher: Matcher,
    /// The tokens the next sample may take.
    mask: TokenMask,
    /// The mask allows exactly one token.
    forced: bool,
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintState")
            .field("forced", &self.forced)
            .finish_non_exhaustive()
    }
}

/// What the constraint says after a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    /// The next mask is ready.
    Continue,
    /// The request must end with `stop`, for this reason.
    Stop(String),
}

impl ConstraintState {
    /// The state before the first output token, with its mask, or [`Next::Stop`] if no
    /// token can start the output.
    pub(crate) fn start(constraint: Constraint) -> (Self, Next) {
        let mut state = Self {
            matcher: constraint.matcher,
            mask: Vec::new(),
            forced: false,
        };
        let next = state.compute_mask();
        (state, next)
    }

    /// The mask of the next sample.
    pub(crate) fn mask(&self) -> &TokenMask {
        &self.mask
    }

    /// The mask of the next sample allows exactly one token.
    pub(crate) fn forced(&self) -> bool {
        self.forced
    }

    /// Feeds the sampled `token` and computes the next mask.
    pub(crate) fn advance(&mut self, token: TokenId) -> Next {
        if self.is_complete() {
            // The mask allowed only EOS, and the request goes on past it (`ignore_eos`):
            // the constraint has nothing more to allow.
            return Next::Stop("constraint: the output is complete".into());
        }
        if let Err(e) = self.matcher.consume_token(token.0) {
            return Next::Stop(format!("constraint: token {token} was not allowed: {e}"));
        }
        self.compute_mask()
    }

    /// The output matches the constraint and nothing more can follow.
    fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    fn compute_mask(&mut self) -> Next {
        if self.matcher.is_error() {
            let why = self.matcher.get_error().unwrap_or_default();
            return Next::Stop(format!("constraint: {why}"));
        }
        // Complete: only EOS may follow, so the request ends as any other does on EOS.
        match self.matcher.compute_mask_or_eos() {
            Ok(vob) => {
                let n = vob.num_set();
                self.mask.clear();
                self.mask.extend_from_slice(vob.as_slice());
                self.forced = n == 1;
                if n == 0 {
                    Next::Stop("constraint: no token can continue the output".into())
                } else {
                    Next::Continue
                }
            }
            Err(e) => Next::Stop(format!("constraint: {e}")),
        }
    }
}
