//! `tiny`: a deterministic random-weight Llama with a working byte-level BPE tokenizer and a
//! ChatML chat template, built in memory (no files needed) and writable as a Hugging Face
//! folder (`ferry make-model tiny --out DIR`), which `transformers` loads to produce golden
//! logits.
//!
//! Sizes are small enough that a full forward takes microseconds, yet every feature the forward
//! must get right is exercised: grouped-query attention (4 query heads over 2 KV heads), an
//! untied `lm_head`, norm weights that are not all 1.0 (a forgotten norm weight shows up).

use ferry_core::TokenId;
use std::path::Path;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, View};

use crate::config::expected_tensors;
use crate::load::config_json::to_hf_config_json;
use crate::load::tokenizer::{byte_level_bpe, byte_to_char, ByteLevelBpeSpec, PreTokenizerKind};
use crate::load::{LoadError, LoadedModel};
use crate::{LlamaConfig, Tensor, WeightStore};

/// Seed of the weights. Changing it (or the draw order) changes the committed golden logits.
const SEED: [u8; 32] = *b"ferry tiny model weights seed v1";
/// Standard deviation of every matrix and embedding entry (uniform distribution).
const WEIGHT_STD: f32 = 0.05;
/// Norm weights are `1.0 ± NORM_SPREAD` (uniform).
const NORM_SPREAD: f32 = 0.1;

/// Merges over the GPT-2 byte alphabet (`Ġ` is a space), in priority order: common English
/// pairs, so ordinary text encodes to fewer tokens than bytes and merging is exercised.
const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġ", "a"),
    ("i", "n"),
    ("Ġt", "he"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġ", "o"),
    ("i", "s"),
    ("Ġ", "c"),
    ("e", "s"),
    ("a", "n"),
    ("Ġ", "b"),
    ("i", "t"),
    ("Ġ", "f"),
    ("Ġ", "m"),
    ("a", "r"),
    ("Ġ", "p"),
    ("in", "g"),
    ("Ġ", "d"),
    ("a", "l"),
    ("o", "u"),
    ("l", "l"),
    ("Ġ", "h"),
    ("e", "d"),
    ("Ġa", "n"),
    ("Ġan", "d"),
    ("Ġ", "i"),
    ("Ġo", "f"),
    ("Ġt", "o"),
    ("Ġi", "s"),
    ("Ġ", "l"),
    ("l", "e"),
    ("s", "t"),
    ("Ġ", "n"),
];

/// Special tokens, after the bytes and the merges.
pub const ENDOFTEXT: &str = "<|endoftext|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";
const SPECIAL: [&str; 3] = [ENDOFTEXT, IM_START, IM_END];

/// ChatML, as SmolLM2 and Qwen use it (without a default system prompt).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + \
message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Tokens in id order: the 256 bytes (id = byte value), the merges, then the special tokens.
pub fn tiny_tokens() -> Vec<String> {
    let table = byte_to_char();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.extend(SPECIAL.iter().map(|s| (*s).to_owned()));
    tokens
}

fn special_id(name: &str) -> u32 {
    let idx = SPECIAL.iter().position(|s| *s == name).unwrap_or(0);
    (256 + MERGES.len() + idx) as u32
}

/// The configuration: hidden 64, intermediate 128, 2 layers, 4 heads over 2 KV heads.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        architecture: "LlamaForCausalLM".into(),
        vocab_size: 256 + MERGES.len() + SPECIAL.len(),
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: false,
        attention_bias: false,
        o_proj_bias: false,
        qk_norm: false,
        qk_norm_whole: false,
        clip_qkv: None,
        moe: None,
        bos_token_id: Some(TokenId(special_id(ENDOFTEXT))),
        eos_token_ids: vec![TokenId(special_id(IM_END))],
    }
}

/// The tokenizer's description (byte-level BPE, GPT-2 split, no BOS added).
pub fn tiny_tokenizer_spec() -> ByteLevelBpeSpec {
    ByteLevelBpeSpec {
        tokens: tiny_tokens(),
        merges: MERGES
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect(),
        special_ids: SPECIAL.iter().map(|s| special_id(s)).collect(),
        added_ids: Vec::new(),
        bos_id: None,
        pre_tokenizer: PreTokenizerKind::Gpt2,
    }
}

/// Weights drawn from a fixed-seed ChaCha8 stream in [`expected_tensors`] order.
pub fn tiny_weights(config: &LlamaConfig) -> WeightStore {
    let mut rng = ChaCha8Rng::from_seed(SEED);
    // Uniform on [-1, 1) from 24 random bits: exact in f32, and independent of how any `rand`
    // version maps bits to floats, so the weights never change under a dependency update.
    let mut uniform = move || ((rng.next_u32() >> 8) as f32 / (1u32 << 23) as f32) - 1.0;
    let matrix_scale = WEIGHT_STD * 3f32.sqrt();
    let mut store = WeightStore::default();
    for (name, shape) in expected_tensors(config) {
        let n: usize = shape.iter().product();
        let is_norm = name.ends_with("norm.weight");
        let data = (0..n)
            .map(|_| {
                let u = uniform();
                if is_norm {
                    1.0 + NORM_SPREAD * u
                } else {
                    matrix_scale * u
                }
            })
            .collect();
        store.insert(name, Tensor::new(shape, data));
    }
    store
}

/// The whole `tiny` model, in memory.
pub fn tiny_model() -> LoadedModel {
    let config = tiny_config();
    let weights = tiny_weights(&config);
    // The spec is a compile-time constant: building it cannot fail short of a bug, which
    // the tests catch; an `expect` here would be the one panic, so degrade to no tokenizer.
    let tokenizer = byte_level_bpe(&tiny_tokenizer_spec()).ok();
    LoadedModel {
        config,
        weights,
        tokenizer,
        chat_template: Some(CHATML_TEMPLATE.to_owned()),
        source: "tiny".into(),
    }
}

/// The size of a [`moe_model`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeSize {
    /// [`crate::random_model::small_moe_config`]'s shape: hidden 64, 3 layers, 8 experts.
    Small,
    /// A Qwen3-MoE-shaped model whose experts leave the caches: hidden 1024, 8 layers, 16
    /// heads over 4 KV heads, 32 experts of 256 rows, top-8 (224M parameters, 28M active).
    Bench,
}

/// A random-weight MoE model of `architecture` (a pure function of `seed`) with the tiny
/// model's tokenizer and chat template, so it can be served: `ferry make-model moe`.
pub fn moe_model(architecture: &str, size: MoeSize, seed: u64) -> LoadedModel {
    let tiny = tiny_model();
    let mut config = crate::random_model::small_moe_config(architecture);
    config.vocab_size = tiny.config.vocab_size;
    config.bos_token_id = tiny.config.bos_token_id;
    config.eos_token_ids = tiny.config.eos_token_ids.clone();
    config.max_position_embeddings = tiny.config.max_position_embeddings;
    if size == MoeSize::Bench {
        config.hidden_size = 1024;
        config.num_attention_heads = 16;
        config.num_key_value_heads = 4;
        config.head_dim = 64;
        config.num_hidden_layers = 8;
        config.intermediate_size = 2048;
        if let Some(moe) = &mut config.moe {
            moe.num_experts = 32;
            moe.top_k = 8;
            moe.expert_intermediate_size = 256;
            moe.sparse_layers = vec![true; 8];
            if moe.shared_expert_intermediate_size.is_some() {
                moe.shared_expert_intermediate_size = Some(512);
            }
            if matches!(moe.naming, crate::ExpertNaming::Mixtral)
                || architecture == "OlmoeForCausalLM"
            {
                config.intermediate_size = moe.expert_intermediate_size;
            }
        }
    }
    LoadedModel {
        weights: crate::random_model::random_weights(&config, seed),
        config,
        tokenizer: tiny.tokenizer,
        chat_template: tiny.chat_template,
        source: format!("random:{architecture}"),
    }
}

/// Writes `model` as a Hugging Face folder: config.json, generation_config.json,
/// model.safetensors (F32), tokenizer.json and tokenizer_config.json (with the chat template).
/// `load_model(dir)` gives the same model back.
pub fn write_hf_folder(model: &LoadedModel, dir: &Path) -> Result<(), LoadError> {
    std::fs::create_dir_all(dir).map_err(|e| LoadError::io(dir, e))?;
    write_json(&dir.join("config.json"), &to_hf_config_json(&model.config))?;
    write_json(
        &dir.join("generation_config.json"),
        &serde_json::json!({
            "bos_token_id": model.config.bos_token_id,
            "eos_token_id": model.config.eos_token_ids,
        }),
    )?;
    write_safetensors(&dir.join("model.safetensors"), &model.weights)?;
    if let Some(tokenizer) = &model.tokenizer {
        let path = dir.join("tokenizer.json");
        tokenizer
            .save(&path, false)
            .map_err(|e| LoadError::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
    }
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config(model))
}

fn tokenizer_config(model: &LoadedModel) -> serde_json::Value {
    let token = |id: Option<TokenId>| {
        let tokenizer = model.tokenizer.as_ref()?;
        tokenizer.id_to_token(id?.0)
    };
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": model.chat_template,
        "bos_token": token(model.config.bos_token_id),
        "eos_token": token(model.config.eos_token_ids.first().copied()),
        "add_bos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": model.config.max_position_embeddings,
    })
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), LoadError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| LoadError::Json {
        path: path.to_owned(),
        source,
    })?;
    std::fs::write(path, text + "\n").map_err(|e| LoadError::io(path, e))
}

/// An f32 tensor viewed as little-endian bytes, converted only when the writer asks for
/// them: a model's worth of bytes is never held at once, only one tensor's.
struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl View for &F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        size_of_val(self.data)
    }
}

fn write_safetensors(path: &Path, weights: &WeightStore) -> Result<(), LoadError> {
    let views: Vec<(&str, F32View<'_>)> = weights
        .tensors
        .iter()
        .map(|(name, t)| {
            let view = F32View {
                shape: &t.shape,
                data: &t.data,
            };
            (name.as_str(), view)
        })
        .collect();
    let metadata = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(views.iter().map(|(n, v)| (*n, v)), Some(metadata), path)
        .map_err(|e| LoadError::invalid(path, format!("writing safetensors: {e}")))
}
