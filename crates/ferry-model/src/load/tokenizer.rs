//! Tokenizers and chat templates: `tokenizer.json` / `tokenizer_config.json` of a Hugging Face
//! folder, and byte-level BPE tokenizers built from a vocabulary and merges (GGUF metadata and
//! the `tiny` fixture). Everything goes through the `tokenizers` crate; nothing touches the
//! network.

use std::path::Path;

use serde_json::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use super::LoadError;

/// Reads `tokenizer.json` from `dir`; `None` when the folder has none.
pub fn read_hf_tokenizer(dir: &Path) -> Result<Option<Tokenizer>, LoadError> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| LoadError::Tokenizer {
            path,
            message: e.to_string(),
        })
}

/// The chat template from `tokenizer_config.json` (a string, or the list form
/// `[{"name": "default", "template": ...}, ...]`), or from a `chat_template.jinja` file next to
/// it (newer transformers write it there).
pub fn read_chat_template(dir: &Path) -> Result<Option<String>, LoadError> {
    let config_path = dir.join("tokenizer_config.json");
    if config_path.exists() {
        let json = super::config_json::read_json(&config_path)?;
        if let Some(template) = chat_template_of(&json, &config_path)? {
            return Ok(Some(template));
        }
    }
    let jinja_path = dir.join("chat_template.jinja");
    if jinja_path.exists() {
        let text =
            std::fs::read_to_string(&jinja_path).map_err(|e| LoadError::io(&jinja_path, e))?;
        return Ok(Some(text));
    }
    Ok(None)
}

/// The `chat_template` field of a parsed `tokenizer_config.json`.
pub fn chat_template_of(json: &Value, path: &Path) -> Result<Option<String>, LoadError> {
    let bad = || {
        LoadError::field(
            path,
            "chat_template",
            "expected a string or a list of {name, template}",
        )
    };
    match json.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(items)) => {
            let named = |want: &str| {
                items
                    .iter()
                    .find(|item| item.get("name").and_then(Value::as_str) == Some(want))
            };
            let chosen = named("default").or_else(|| items.first()).ok_or_else(bad)?;
            let template = chosen
                .get("template")
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            Ok(Some(template.to_owned()))
        }
        Some(_) => Err(bad()),
    }
}

/// How text is split into words before BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2's regex split (what `ByteLevel` with `use_regex` does).
    Gpt2,
    /// GPT-2's split with every digit its own word (SmolLM's tokenizer.json, llama.cpp's
    /// `smollm` pre-tokenizer).
    Gpt2IndividualDigits,
    /// Qwen2's split (Qwen2/2.5/3's tokenizer.json, llama.cpp's `qwen2` pre-tokenizer):
    /// [`QWEN2_SPLIT`], then the byte-level mapping without GPT-2's regex.
    Qwen2,
}

/// The regex of Qwen2's `Split` pre-tokenizer (its tokenizer.json, `Isolated`): letters
/// with one leading non-letter, each digit alone, punctuation runs, newlines.
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a byte-level BPE tokenizer is built from.
#[derive(Debug, Clone)]
pub struct ByteLevelBpeSpec {
    /// Tokens in id order, spelled in the GPT-2 byte alphabet (space is `Ġ`).
    pub tokens: Vec<String>,
    /// Merges in priority order.
    pub merges: Vec<(String, String)>,
    /// Ids of tokens matched whole in text and marked special (skipped by
    /// `decode(.., skip_special_tokens = true)`).
    pub special_ids: Vec<u32>,
    /// Ids of tokens matched whole but not special.
    pub added_ids: Vec<u32>,
    /// Prepended when encoding with special tokens.
    pub bos_id: Option<u32>,
    pub pre_tokenizer: PreTokenizerKind,
}

/// Builds a byte-level BPE tokenizer (BPE model, `ByteLevel` pre-tokenizer and decoder).
pub fn byte_level_bpe(spec: &ByteLevelBpeSpec) -> Result<Tokenizer, String> {
    let vocab: Vocab = spec
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let model = BPE::builder()
        .vocab_and_merges(vocab, spec.merges.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let mut tokenizer = Tokenizer::new(model);
    let byte_level = ByteLevel::default()
        .add_prefix_space(false)
        .trim_offsets(false)
        .use_regex(true);
    let pre: PreTokenizerWrapper = match spec.pre_tokenizer {
        PreTokenizerKind::Gpt2 => byte_level.into(),
        PreTokenizerKind::Gpt2IndividualDigits => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
        PreTokenizerKind::Qwen2 => {
            let split = Split::new(
                SplitPattern::Regex(QWEN2_SPLIT.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| e.to_string())?;
            Sequence::new(vec![split.into(), byte_level.use_regex(false).into()]).into()
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    if let Some(bos) = spec.bos_id {
        tokenizer.with_post_processor(Some(bos_processor(&spec.tokens, bos)?));
    }
    let token = |id: &u32| -> Result<String, String> {
        spec.tokens
            .get(*id as usize)
            .cloned()
            .ok_or_else(|| format!("special token id {id} is outside the vocabulary"))
    };
    let special = spec
        .special_ids
        .iter()
        .map(|id| Ok(AddedToken::from(token(id)?, true).normalized(false)))
        .collect::<Result<Vec<_>, String>>()?;
    let added = spec
        .added_ids
        .iter()
        .map(|id| Ok(AddedToken::from(token(id)?, false).normalized(false)))
        .collect::<Result<Vec<_>, String>>()?;
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| e.to_string())?;
    tokenizer.add_tokens(added).map_err(|e| e.to_string())?;
    Ok(tokenizer)
}

/// A post-processor that prepends BOS (llama.cpp's `add_bos_token`).
fn bos_processor(tokens: &[String], bos: u32) -> Result<TemplateProcessing, String> {
    let bos_token = tokens
        .get(bos as usize)
        .ok_or_else(|| format!("BOS id {bos} is outside the vocabulary"))?;
    TemplateProcessing::builder()
        .try_single(format!("{bos_token}:0 $A:0"))
        .map_err(|e| e.to_string())?
        .try_pair(format!("{bos_token}:0 $A:0 {bos_token}:1 $B:1"))
        .map_err(|e| e.to_string())?
        .special_tokens(vec![(bos_token.clone(), bos)])
        .build()
        .map_err(|e| e.to_string())
}

/// GPT-2's byte → printable character table: bytes that are printable Latin-1 map to
/// themselves, the rest to U+0100 onwards in byte order. (The `tokenizers` crate keeps its copy
/// private; this is the published 10-line table, not an algorithm worth a dependency.)
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let b = byte as u32;
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let code = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// Spells raw text in the byte alphabet (how a byte-level vocabulary stores it).
pub fn to_byte_alphabet(text: &str, table: &[char; 256]) -> String {
    text.bytes().map(|b| table[b as usize]).collect()
}
