//! GGUF loading, with small GGUF files written by a minimal writer in this test: metadata of
//! every value type, alignment, dequantization of each supported type against hand-computed
//! values, q/k un-permutation, name mapping, metadata → config, the tokenizer from metadata,
//! and errors naming the tensor.

use ferry_core::TokenId;
use std::path::Path;

use ferry_model::load::gguf::{GgmlType, GgufFile, GgufValue};
use ferry_model::load::gguf_model::{hf_tensor_name, unpermute_rows};
use ferry_model::load::WeightFiles;
use ferry_model::{load_model, load_model_with_progress, LlamaConfig, LoadError};
use ferry_model::{PreparedWeights, WeightSlots};

// ---------------------------------------------------------------------------------------------
// A minimal GGUF writer (the format as the GGUF spec describes it).

#[derive(Debug, Clone)]
enum Meta {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(&'static str),
    Array(u32, Vec<Meta>),
}

impl Meta {
    fn type_id(&self) -> u32 {
        match self {
            Meta::U8(_) => 0,
            Meta::I8(_) => 1,
            Meta::U16(_) => 2,
            Meta::I16(_) => 3,
            Meta::U32(_) => 4,
            Meta::I32(_) => 5,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) => 8,
            Meta::Array(..) => 9,
            Meta::U64(_) => 10,
            Meta::I64(_) => 11,
            Meta::F64(_) => 12,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Meta::U8(v) => out.extend(v.to_le_bytes()),
            Meta::I8(v) => out.extend(v.to_le_bytes()),
            Meta::U16(v) => out.extend(v.to_le_bytes()),
            Meta::I16(v) => out.extend(v.to_le_bytes()),
            Meta::U32(v) => out.extend(v.to_le_bytes()),
            Meta::I32(v) => out.extend(v.to_le_bytes()),
            Meta::U64(v) => out.extend(v.to_le_bytes()),
            Meta::I64(v) => out.extend(v.to_le_bytes()),
            Meta::F32(v) => out.extend(v.to_le_bytes()),
            Meta::F64(v) => out.extend(v.to_le_bytes()),
            Meta::Bool(v) => out.push(u8::from(*v)),
            Meta::Str(s) => write_str(out, s),
            Meta::Array(ty, items) => {
                out.extend(ty.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    item.write(out);
                }
            }
        }
    }
}

fn strs(items: &[&'static str]) -> Meta {
    Meta::Array(8, items.iter().map(|s| Meta::Str(s)).collect())
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

struct GgufTensor {
    name: String,
    /// GGUF order: innermost first.
    dims: Vec<u64>,
    ty: u32,
    bytes: Vec<u8>,
}

fn f32_tensor(name: &str, shape: &[usize], data: &[f32]) -> GgufTensor {
    GgufTensor {
        name: name.into(),
        dims: shape.iter().rev().map(|&d| d as u64).collect(),
        ty: 0,
        bytes: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn gguf_bytes(
    version: u32,
    alignment: usize,
    kv: &[(&str, Meta)],
    tensors: &[GgufTensor],
) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (key, value) in kv {
        write_str(&mut out, key);
        out.extend(value.type_id().to_le_bytes());
        value.write(&mut out);
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for t in tensors {
        offsets.push(offset);
        offset = (offset + t.bytes.len()).div_ceil(alignment) * alignment;
    }
    for (t, off) in tensors.iter().zip(&offsets) {
        write_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ty.to_le_bytes());
        out.extend((*off as u64).to_le_bytes());
    }
    out.resize(out.len().div_ceil(alignment) * alignment, 0);
    let data_start = out.len();
    for (t, off) in tensors.iter().zip(&offsets) {
        out.resize(data_start + off, 0);
        out.extend(&t.bytes);
    }
    out
}

fn write_gguf(path: &Path, kv: &[(&str, Meta)], tensors: &[GgufTensor]) {
    std::fs::write(path, gguf_bytes(3, 32, kv, tensors)).unwrap();
}

fn f16(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

// ---------------------------------------------------------------------------------------------
// Reader and dequantization.

/// One block per quantized type, with the expected values written out by hand from the GGML
/// formulas (Q8_0 `d*q`, Q4_0 `d*(q-8)`, Q4_1 `d*q + m`; low nibbles are elements 0..16).
fn quant_tensors() -> (Vec<GgufTensor>, Vec<Vec<f32>>) {
    // Q8_0, d = 0.5: q = [-128, -1, 0, 1, 127, then 2..29].
    let mut q8 = f16(0.5).to_vec();
    let q8_values: Vec<i8> = [-128i8, -1, 0, 1, 127].into_iter().chain(2..29).collect();
    q8.extend(q8_values.iter().map(|q| *q as u8));
    let mut q8_expected = vec![-64.0, -0.5, 0.0, 0.5, 63.5];
    q8_expected.extend((2..29).map(|q| q as f32 * 0.5));

    // Q4_0, d = 2.0: byte j = (hi = j, lo = 15 - j), so element j = 2*(15-j-8), element 16+j = 2*(j-8).
    let mut q4_0 = f16(2.0).to_vec();
    q4_0.extend((0..16u8).map(|j| (j << 4) | (15 - j)));
    let q4_0_expected = [
        14.0, 12.0, 10.0, 8.0, 6.0, 4.0, 2.0, 0.0, -2.0, -4.0, -6.0, -8.0, -10.0, -12.0, -14.0,
        -16.0, -16.0, -14.0, -12.0, -10.0, -8.0, -6.0, -4.0, -2.0, 0.0, 2.0, 4.0, 6.0, 8.0, 10.0,
        12.0, 14.0,
    ]
    .to_vec();

    // Q4_1, d = 0.25, m = -1.0: the same nibbles; element = 0.25*q - 1.
    let mut q4_1 = f16(0.25).to_vec();
    q4_1.extend(f16(-1.0));
    q4_1.extend((0..16u8).map(|j| (j << 4) | (15 - j)));
    let q4_1_expected = [
        2.75, 2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, 0.25, 0.0, -0.25, -0.5, -0.75, -1.0,
        -1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75,
    ]
    .to_vec();

    let f16_bytes: Vec<u8> = [1.5f32, -0.125, 65504.0]
        .iter()
        .flat_map(|x| f16(*x))
        .collect();
    let bf16_bytes: Vec<u8> = [0x3fc0u16, 0xc2f7]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    let t = |name: &str, dims: Vec<u64>, ty: u32, bytes: Vec<u8>| GgufTensor {
        name: name.into(),
        dims,
        ty,
        bytes,
    };
    let tensors = vec![
        t("q8", vec![32], 8, q8),
        t("q4_0", vec![32], 2, q4_0),
        t("q4_1", vec![32], 3, q4_1),
        t("f16", vec![3], 1, f16_bytes),
        t("bf16", vec![2], 30, bf16_bytes),
        f32_tensor("f32", &[2, 1], &[3.25, -7.5]),
    ];
    let expected = vec![
        q8_expected,
        q4_0_expected,
        q4_1_expected,
        vec![1.5, -0.125, 65504.0],
        vec![1.5, -123.5],
        vec![3.25, -7.5],
    ];
    (tensors, expected)
}

#[test]
fn dequantizes_every_supported_type_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("q.gguf");
    let (tensors, expected) = quant_tensors();
    write_gguf(&path, &[], &tensors);
    let gguf = GgufFile::open(&path).unwrap();
    let types: Vec<GgmlType> = gguf.tensors.iter().map(|t| t.dtype).collect();
    use GgmlType::*;
    assert_eq!(types, vec![Q8_0, Q4_0, Q4_1, F16, BF16, F32]);
    for (info, want) in gguf.tensors.iter().zip(&expected) {
        assert_eq!(&gguf.dequantize(info).unwrap(), want, "{}", info.name);
    }
    // Written with PyTorch shape [2, 1]: GGUF lists it innermost-first.
    let info = gguf.tensor_info("f32").unwrap();
    assert_eq!((info.dims.clone(), info.shape()), (vec![1, 2], vec![2, 1]));
}

#[test]
fn metadata_of_every_value_type_and_custom_alignment() {
    let kv = vec![
        ("general.alignment", Meta::U32(64)),
        ("u8", Meta::U8(200)),
        ("i8", Meta::I8(-5)),
        ("u16", Meta::U16(60000)),
        ("i16", Meta::I16(-300)),
        ("i32", Meta::I32(-70000)),
        ("u64", Meta::U64(1 << 40)),
        ("i64", Meta::I64(-(1 << 40))),
        ("f32", Meta::F32(0.5)),
        ("f64", Meta::F64(-2.25)),
        ("bool", Meta::Bool(true)),
        ("str", Meta::Str("héllo")),
        (
            "nested",
            Meta::Array(9, vec![Meta::Array(5, vec![Meta::I32(1), Meta::I32(-2)])]),
        ),
    ];
    let tensors = [
        f32_tensor("a", &[3], &[1.0, 2.0, 3.0]),
        f32_tensor("b", &[2], &[4.0, 5.0]),
    ];
    for version in [2, 3] {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m.gguf");
        std::fs::write(&path, gguf_bytes(version, 64, &kv, &tensors)).unwrap();
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.version, version);
        let m = |k: &str| g.get(k).unwrap().clone();
        assert_eq!(m("u8"), GgufValue::U8(200));
        assert_eq!(m("i8"), GgufValue::I8(-5));
        assert_eq!(m("u16"), GgufValue::U16(60000));
        assert_eq!(m("i16"), GgufValue::I16(-300));
        assert_eq!(m("i32"), GgufValue::I32(-70000));
        assert_eq!(m("u64"), GgufValue::U64(1 << 40));
        assert_eq!(m("i64"), GgufValue::I64(-(1 << 40)));
        assert_eq!(m("f32"), GgufValue::F32(0.5));
        assert_eq!(m("f64"), GgufValue::F64(-2.25));
        assert_eq!(m("bool"), GgufValue::Bool(true));
        assert_eq!(m("str"), GgufValue::String("héllo".into()));
        let inner = GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(-2)]);
        assert_eq!(m("nested"), GgufValue::Array(vec![inner]));
        // With 64-byte alignment, "b" starts 64 bytes into the data section.
        assert_eq!(g.tensor_info("b").unwrap().offset, 64);
        let b = g.tensor_info("b").unwrap();
        assert_eq!(g.dequantize(b).unwrap(), vec![4.0, 5.0]);
    }
}

#[test]
fn corrupt_files_are_errors_not_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.gguf");
    let (tensors, _) = quant_tensors();
    let good = gguf_bytes(3, 32, &[("k", strs(&["a", "b"]))], &tensors);
    // Every truncation of the file fails cleanly.
    for len in (0..good.len()).step_by(7) {
        std::fs::write(&path, &good[..len]).unwrap();
        assert!(GgufFile::open(&path).is_err(), "truncated at {len}");
    }
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    std::fs::write(&path, &bad_magic).unwrap();
    assert!(GgufFile::open(&path)
        .unwrap_err()
        .to_string()
        .contains("bad magic"));
    let mut v1 = good.clone();
    v1[4] = 1;
    std::fs::write(&path, &v1).unwrap();
    assert!(GgufFile::open(&path)
        .unwrap_err()
        .to_string()
        .contains("version 1"));
}

// ---------------------------------------------------------------------------------------------
// A whole llama model in GGUF.

const N_HEADS: usize = 2;
const N_KV_HEADS: usize = 1;
const HEAD_DIM: usize = 4;
const HIDDEN: usize = N_HEADS * HEAD_DIM;
const INTER: usize = 12;
const TOKENS: &[&str] = &["<unk>", "a", "b", "ab", "Ġ", "<|end|>", "<think>"];

/// The llama.cpp converter's permutation (`reshape(n_head, 2, half, in).swapaxes(1, 2)`):
/// GGUF row `h*hd + 2*i + s` holds HF row `h*hd + s*half + i`.
fn permute(hf: &[f32], n_heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let hd = rows / n_heads;
    let half = hd / 2;
    let mut out = vec![0.0; hf.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for s in 0..2 {
                let src = h * hd + s * half + i;
                let dst = h * hd + 2 * i + s;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Value of element (row, col) of a tensor numbered `k`: distinct everywhere.
fn pattern(k: usize, rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| (k * 1000 + (i / cols) * 10 + i % cols) as f32)
        .collect()
}

/// HF name, HF shape, GGUF name, and the HF-layout values of every tensor of a 1-layer model.
fn model_tensors(tied: bool) -> Vec<(String, Vec<usize>, String, Vec<f32>)> {
    let vocab = TOKENS.len();
    let kv_dim = N_KV_HEADS * HEAD_DIM;
    let mut spec = vec![
        (
            "model.embed_tokens.weight",
            vec![vocab, HIDDEN],
            "token_embd.weight",
        ),
        (
            "model.layers.0.input_layernorm.weight",
            vec![HIDDEN],
            "blk.0.attn_norm.weight",
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            vec![HIDDEN, HIDDEN],
            "blk.0.attn_q.weight",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            vec![kv_dim, HIDDEN],
            "blk.0.attn_k.weight",
        ),
        (
            "model.layers.0.self_attn.v_proj.weight",
            vec![kv_dim, HIDDEN],
            "blk.0.attn_v.weight",
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            vec![HIDDEN, HIDDEN],
            "blk.0.attn_output.weight",
        ),
        (
            "model.layers.0.post_attention_layernorm.weight",
            vec![HIDDEN],
            "blk.0.ffn_norm.weight",
        ),
        (
            "model.layers.0.mlp.gate_proj.weight",
            vec![INTER, HIDDEN],
            "blk.0.ffn_gate.weight",
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            vec![INTER, HIDDEN],
            "blk.0.ffn_up.weight",
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            vec![HIDDEN, INTER],
            "blk.0.ffn_down.weight",
        ),
        ("model.norm.weight", vec![HIDDEN], "output_norm.weight"),
    ];
    if !tied {
        spec.push(("lm_head.weight", vec![vocab, HIDDEN], "output.weight"));
    }
    spec.into_iter()
        .enumerate()
        .map(|(k, (hf, shape, gguf))| {
            let rows = shape[0];
            let cols = shape.get(1).copied().unwrap_or(1);
            (
                hf.to_owned(),
                shape,
                gguf.to_owned(),
                pattern(k, rows, cols),
            )
        })
        .collect()
}

fn model_metadata() -> Vec<(&'static str, Meta)> {
    vec![
        ("general.architecture", Meta::Str("llama")),
        ("llama.context_length", Meta::U32(4096)),
        ("llama.embedding_length", Meta::U32(HIDDEN as u32)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(INTER as u32)),
        ("llama.attention.head_count", Meta::U32(N_HEADS as u32)),
        (
            "llama.attention.head_count_kv",
            Meta::U32(N_KV_HEADS as u32),
        ),
        ("llama.rope.freq_base", Meta::F32(100000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ("tokenizer.ggml.pre", Meta::Str("smollm")),
        ("tokenizer.ggml.tokens", strs(TOKENS)),
        ("tokenizer.ggml.merges", strs(&["a b"])),
        (
            "tokenizer.ggml.token_type",
            Meta::Array(
                5,
                [2, 1, 1, 1, 1, 3, 4].into_iter().map(Meta::I32).collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id", Meta::U32(5)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(5)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(true)),
        ("tokenizer.chat_template", Meta::Str("{{ messages }}")),
    ]
}

/// Writes the model with q/k permuted as llama.cpp stores them; `edit` may change tensors.
fn write_model(path: &Path, tied: bool, edit: impl Fn(&mut Vec<GgufTensor>)) {
    let mut tensors = model_gguf_tensors(tied);
    edit(&mut tensors);
    write_gguf(path, &model_metadata(), &tensors);
}

/// The model's tensors as llama.cpp stores them (q/k permuted).
fn model_gguf_tensors(tied: bool) -> Vec<GgufTensor> {
    model_tensors(tied)
        .into_iter()
        .map(|(hf, shape, gguf, data)| {
            let data = match hf.as_str() {
                "model.layers.0.self_attn.q_proj.weight" => {
                    permute(&data, N_HEADS, shape[0], shape[1])
                }
                "model.layers.0.self_attn.k_proj.weight" => {
                    permute(&data, N_KV_HEADS, shape[0], shape[1])
                }
                _ => data,
            };
            f32_tensor(&gguf, &shape, &data)
        })
        .collect()
}

/// A pre-tokenizer ferry does not implement is refused at load, naming it: splitting its text
/// the GPT-2 way would tokenize it wrongly without a word. GPT-2's own names load.
#[test]
fn an_unknown_pre_tokenizer_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    for (pre, ok) in [
        ("llama-bpe", false),
        ("deepseek-llm", false),
        ("gpt-2", true),
        ("default", true),
    ] {
        let meta: Vec<(&str, Meta)> = model_metadata()
            .into_iter()
            .map(|(k, v)| match k {
                "tokenizer.ggml.pre" => (k, Meta::Str(pre)),
                _ => (k, v),
            })
            .collect();
        let p = tmp.path().join(format!("{pre}.gguf"));
        write_gguf(&p, &meta, &model_gguf_tensors(true));
        match load_model(&p) {
            Ok(_) => assert!(ok, "{pre} loaded"),
            Err(e) => {
                assert!(!ok, "{pre}: {e}");
                let e = e.to_string();
                assert!(e.contains("tokenizer.ggml.pre") && e.contains(pre), "{e}");
            }
        }
    }
}

#[test]
fn llama_gguf_loads_with_hf_names_and_unpermuted_qk() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_model(&path, false, |_| {});
    let model = load_model(&path).unwrap();
    let expected = model_tensors(false);
    assert_eq!(model.weights.tensors.len(), expected.len());
    for (hf, shape, _, data) in &expected {
        let t = model
            .weights
            .get(hf)
            .unwrap_or_else(|| panic!("{hf} missing"));
        assert_eq!(&t.shape, shape, "{hf}");
        assert_eq!(&t.data, data, "{hf}");
    }
    assert_eq!(model.chat_template.as_deref(), Some("{{ messages }}"));
    assert_eq!(model.source, path.display().to_string());
}

#[test]
fn gguf_loading_reports_each_tensor_with_its_hf_name() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_model(&path, false, |_| {});
    let mut seen = Vec::new();
    load_model_with_progress(&path, &mut |done, total, name| {
        seen.push((done, total, name.to_owned()))
    })
    .unwrap();
    let expected = model_tensors(false);
    assert_eq!(seen.len(), expected.len());
    let mut names: Vec<_> = seen.iter().map(|(_, _, n)| n.clone()).collect();
    names.sort();
    let mut want: Vec<_> = expected.iter().map(|(hf, ..)| hf.to_string()).collect();
    want.sort();
    assert_eq!(names, want);
    assert_eq!(
        seen.last().map(|s| (s.0, s.1)),
        Some((expected.len(), expected.len()))
    );
}

#[test]
fn metadata_becomes_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_model(&path, true, |_| {});
    let model = load_model(&path).unwrap();
    let expected = LlamaConfig {
        architecture: "LlamaForCausalLM".into(),
        vocab_size: TOKENS.len(),
        hidden_size: HIDDEN,
        intermediate_size: INTER,
        num_hidden_layers: 1,
        num_attention_heads: N_HEADS,
        num_key_value_heads: N_KV_HEADS,
        head_dim: HEAD_DIM,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        max_position_embeddings: 4096,
        tie_word_embeddings: true,
        attention_bias: false,
        o_proj_bias: false,
        qk_norm: false,
        qk_norm_whole: false,
        clip_qkv: None,
        moe: None,
        bos_token_id: Some(TokenId(5)),
        eos_token_ids: vec![TokenId(5)],
    };
    assert_eq!(model.config, expected);
    assert!(model.weights.get("lm_head.weight").is_none());
}

/// A reload opens the file for its weights alone: the tokenizer arrays are skipped, not
/// parsed, yet their lengths (the vocabulary size) and every other key are as a full open
/// reads them, and so is the config.
#[test]
fn opening_for_the_weights_skips_the_tokenizer_arrays_and_keeps_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_model(&path, true, |_| {});
    let full = GgufFile::open(&path).unwrap();
    let weights = GgufFile::open_weights(&path).unwrap();
    for key in [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
    ] {
        assert!(
            full.get(key).is_some() && weights.get(key).is_none(),
            "{key}"
        );
        assert_eq!(weights.array_len(key), full.array_len(key), "{key}");
    }
    assert_eq!(
        weights.array_len("tokenizer.ggml.tokens"),
        Some(TOKENS.len())
    );
    let rest = |g: &GgufFile| {
        g.metadata
            .iter()
            .filter(|(_, v)| !matches!(v, GgufValue::Array(_)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(rest(&weights), rest(&full));
    assert_eq!(weights.tensors, full.tensors);
    let files = ferry_model::load::WeightFiles::open(&path).unwrap();
    assert_eq!(files.config(), &load_model(&path).unwrap().config);
    // A skipped array is checked as a parsed one is: every truncation fails cleanly.
    let good = std::fs::read(&path).unwrap();
    let bad = tmp.path().join("bad.gguf");
    for len in (0..good.len()).step_by(11) {
        std::fs::write(&bad, &good[..len]).unwrap();
        assert!(GgufFile::open_weights(&bad).is_err(), "truncated at {len}");
    }
}

#[test]
fn tokenizer_from_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_model(&path, true, |_| {});
    let tok = load_model(&path).unwrap().tokenizer.unwrap();
    // "ab" merges; " " is Ġ; control and user-defined tokens match whole; BOS (5) first.
    let enc = tok.encode("ab ab<|end|>b<think>", true).unwrap();
    assert_eq!(enc.get_ids(), &[5, 3, 4, 3, 5, 2, 6]);
    let enc = tok.encode("ab", false).unwrap();
    assert_eq!(enc.get_ids(), &[3]);
    assert_eq!(tok.decode(&[3, 4, 3, 5], false).unwrap(), "ab ab<|end|>");
    assert_eq!(tok.decode(&[3, 4, 3, 5], true).unwrap(), "ab ab");
}

/// Slots for a reload that must fail before any tensor is read.
struct NoSlots;

impl WeightSlots for NoSlots {
    fn slot(&mut self, idx: usize) -> &mut [f32] {
        panic!("tensor {idx} read: the reload should have been refused first")
    }

    fn finish(self: Box<Self>) -> PreparedWeights {
        panic!("the reload should have been refused")
    }
}

/// A tensor the forward would not read is refused, naming it, whatever its type: dropping a
/// weight is a silently wrong answer.
#[test]
fn an_unused_tensor_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let extra = [
        ("blk.0.unused.weight", None),
        // A later layer's bias where layer 0 (which sets the config) has none.
        (
            "blk.1.attn_output.bias",
            Some("model.layers.1.self_attn.o_proj.bias"),
        ),
    ];
    for (name, hf) in extra {
        write_model(&path, true, |ts| {
            ts.push(GgufTensor {
                name: name.into(),
                dims: vec![256, 1],
                ty: 12,
                bytes: vec![0; 144],
            })
        });
        match load_model(&path).unwrap_err() {
            LoadError::UnusedTensor {
                path: p, tensor, ..
            } => {
                assert_eq!(p, path);
                let want = hf.map_or(name.to_owned(), |hf| format!("{name} ({hf})"));
                assert_eq!(tensor, want);
            }
            other => panic!("expected UnusedTensor, got {other:?}"),
        }
        let err = WeightFiles::open(&path)
            .and_then(|f| f.read_into(&mut NoSlots))
            .unwrap_err();
        assert!(matches!(err, LoadError::UnusedTensor { .. }), "{err:?}");
    }
}

/// A GGUF's `tokenizer.ggml.pre = "qwen2"` splits as Qwen2's tokenizer.json does (each digit
/// alone, letters with one leading non-letter), not as GPT-2 does.
#[test]
fn the_qwen2_pre_tokenizer_splits_digits_one_by_one() {
    use ferry_model::load::tokenizer::{byte_level_bpe, ByteLevelBpeSpec, PreTokenizerKind};
    let tokens: Vec<String> = ["a", "b", "1", "2", "Ġ", "ab", "12", "Ġab", ",", "Ġ,"]
        .map(String::from)
        .into();
    let merges = [("a", "b"), ("1", "2"), ("Ġ", "ab"), ("Ġ", ",")]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .into();
    let ids = |pre: PreTokenizerKind, text: &str| {
        let spec = ByteLevelBpeSpec {
            tokens: tokens.clone(),
            merges: Vec::clone(&merges),
            special_ids: vec![],
            added_ids: vec![],
            bos_id: None,
            pre_tokenizer: pre,
        };
        let tok = byte_level_bpe(&spec).unwrap();
        tok.encode(text, false).unwrap().get_ids().to_vec()
    };
    assert_eq!(ids(PreTokenizerKind::Gpt2, "ab12 ab ,"), [5, 6, 7, 9]);
    assert_eq!(ids(PreTokenizerKind::Qwen2, "ab12 ab ,"), [5, 2, 3, 7, 9]);
}

#[test]
fn unsupported_type_names_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    // A needed one is an error naming it.
    write_model(&path, true, |ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.name == "blk.0.ffn_up.weight")
            .unwrap();
        t.ty = 10; // Q2_K
    });
    let err = load_model(&path).unwrap_err();
    match &err {
        LoadError::UnsupportedDtype {
            path: p,
            tensor,
            dtype,
        } => {
            assert_eq!(p, &path);
            assert_eq!(tensor, "blk.0.ffn_up.weight");
            assert!(dtype.starts_with("Q2_K "), "{dtype}");
        }
        other => panic!("expected UnsupportedDtype, got {other:?}"),
    }
    // The message a user reads: the path as written, the type by ggml's name.
    let text = err.to_string();
    assert!(text.starts_with(&format!("{}: ", path.display())), "{text}");
    assert!(
        !text.contains("Path(") && !text.contains("ggml type"),
        "{text}"
    );
}

/// Q5_0, Q5_1, Q4_K and Q6_K blocks of random bytes dequantize to the bits the `gguf`
/// package gives (tests/golden/ggml_dequant.json, from
/// scripts/golden/make_ggml_dequant.py): the definition the stored-precision kernels are
/// then held to.
#[test]
fn k_quant_and_q5_dequantization_matches_the_gguf_package() {
    use ferry_model::load::gguf::dequantize;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/ggml_dequant.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (name, id) in [("Q5_0", 6), ("Q5_1", 7), ("Q4_K", 12), ("Q6_K", 14)] {
        let case = &golden[name];
        let hex = case["bytes"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<u32> = case["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u32)
            .collect();
        let ty = GgmlType::from_id(id);
        assert_eq!(ty.to_string(), name);
        let got = dequantize(ty, &bytes, want.len()).unwrap();
        let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w,
                "{name} element {i}: {} vs gguf {}",
                f32::from_bits(*g),
                f32::from_bits(*w)
            );
        }
        // The same values through ferry's dtype (what the kernels are tested against).
        let dtype = ferry_model::WeightDtype::from_ggml(ty).unwrap();
        let mut via_dtype = vec![0.0; want.len()];
        ferry_model::dtype::dequantize_into(dtype, &bytes, &mut via_dtype);
        assert!(via_dtype
            .iter()
            .map(|x| x.to_bits())
            .eq(want.iter().copied()));
    }
}

/// A quantized tensor whose rows are not whole blocks (a Q4_K row of 128: the 256 elements
/// would fill one block only by running across rows) is refused naming it.
#[test]
fn rows_of_partial_blocks_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("rows.gguf");
    let tensor = GgufTensor {
        name: "x".into(),
        dims: vec![128, 2],
        ty: 12,
        bytes: vec![0; 144],
    };
    write_gguf(&path, &[], &[tensor]);
    match GgufFile::open(&path).unwrap_err() {
        LoadError::TensorData {
            tensor, message, ..
        } => {
            assert_eq!(tensor, "x");
            assert!(
                message.contains("not whole Q4_K blocks of 256"),
                "{message}"
            );
        }
        other => panic!("expected TensorData, got {other:?}"),
    }
}

#[test]
fn ggml_types_are_named_as_ggml_names_them() {
    for (id, name) in [
        (6, "Q5_0"),
        (12, "Q4_K"),
        (14, "Q6_K"),
        (30, "BF16"),
        (23, "IQ4_XS"),
    ] {
        assert_eq!(GgmlType::from_id(id).to_string(), name);
    }
    assert_eq!(GgmlType::from_id(4).to_string(), "ggml type 4");
    assert_eq!(GgmlType::from_id(999).to_string(), "ggml type 999");
}

#[test]
fn misshapen_and_missing_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_model(&path, true, |ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.name == "blk.0.attn_v.weight")
            .unwrap();
        t.dims = vec![4, 8];
    });
    match load_model(&path).unwrap_err() {
        LoadError::TensorShape {
            tensor,
            expected,
            actual,
            ..
        } => {
            assert_eq!(tensor, "blk.0.attn_v.weight");
            assert_eq!((expected, actual), (vec![4, 8], vec![8, 4]));
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }
    write_model(&path, true, |ts| {
        ts.retain(|t| t.name != "blk.0.ffn_gate.weight")
    });
    let err = load_model(&path).unwrap_err();
    assert!(matches!(&err, LoadError::MissingTensor { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("model.layers.0.mlp.gate_proj.weight (GGUF: blk.0.ffn_gate.weight)"),
        "{msg}"
    );
}

#[test]
fn other_architectures_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let mut kv = model_metadata();
    kv[0].1 = Meta::Str("gpt2");
    write_gguf(&path, &kv, &[]);
    match load_model(&path).unwrap_err() {
        LoadError::UnsupportedArchitecture { architecture, .. } => assert_eq!(architecture, "gpt2"),
        other => panic!("expected UnsupportedArchitecture, got {other:?}"),
    }
}

/// Partial rope is refused; so are rope factors (`rope_freqs.weight`, used as the rope
/// scaling: `tests/load_gguf_models.rs`) of the wrong length, or beside a scaling type.
#[test]
fn partial_rope_and_misfit_rope_freqs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let mut kv = model_metadata();
    kv.push(("llama.rope.dimension_count", Meta::U32(2)));
    write_gguf(&path, &kv, &[]);
    match load_model(&path).unwrap_err() {
        LoadError::UnsupportedRope { rope_type, .. } => {
            assert_eq!(rope_type, "partial rope over 2 of 4 head dims")
        }
        other => panic!("expected UnsupportedRope, got {other:?}"),
    }
    write_gguf(
        &path,
        &model_metadata(),
        &[f32_tensor("rope_freqs.weight", &[3], &[1.0, 1.0, 2.0])],
    );
    match load_model(&path).unwrap_err() {
        LoadError::TensorShape {
            tensor, expected, ..
        } => assert_eq!((tensor.as_str(), expected), ("rope_freqs.weight", vec![2])),
        other => panic!("expected TensorShape, got {other:?}"),
    }
    let mut kv = model_metadata();
    kv.push(("llama.rope.scaling.type", Meta::Str("linear")));
    write_gguf(
        &path,
        &kv,
        &[f32_tensor("rope_freqs.weight", &[2], &[1.0, 2.0])],
    );
    match load_model(&path).unwrap_err() {
        LoadError::Field { field, .. } => assert_eq!(field, "llama.rope.scaling.type"),
        other => panic!("expected Field, got {other:?}"),
    }
    write_gguf(
        &path,
        &model_metadata(),
        &[f32_tensor("rope_freqs.weight", &[2], &[1.0, -2.0])],
    );
    match load_model(&path).unwrap_err() {
        LoadError::Field { field, .. } => assert_eq!(field, "rope_scaling.factors"),
        other => panic!("expected Field, got {other:?}"),
    }
}

#[test]
fn unpermute_moves_rows_within_each_head() {
    // 2 heads of 4 rows, 1 column: GGUF rows [h0: 0 1 2 3 | h1: 4 5 6 7] hold HF rows
    // [0 2 1 3 | 4 6 5 7], so un-permuting gives HF order back.
    let gguf = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
    assert_eq!(
        unpermute_rows(&gguf, 2, &[8, 1]),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    );
    // Rows of 2 columns move whole; a 1-D bias works too.
    let gguf = [0.0, 0.5, 20.0, 20.5, 10.0, 10.5, 30.0, 30.5];
    assert_eq!(
        unpermute_rows(&gguf, 1, &[4, 2]),
        vec![0.0, 0.5, 10.0, 10.5, 20.0, 20.5, 30.0, 30.5]
    );
    assert_eq!(
        unpermute_rows(&[0.0, 2.0, 1.0, 3.0], 1, &[4]),
        vec![0.0, 1.0, 2.0, 3.0]
    );
}

#[test]
fn gguf_names_map_to_hf_names() {
    let cases = [
        ("token_embd.weight", Some("model.embed_tokens.weight")),
        ("output_norm.weight", Some("model.norm.weight")),
        ("output.weight", Some("lm_head.weight")),
        (
            "blk.12.attn_norm.weight",
            Some("model.layers.12.input_layernorm.weight"),
        ),
        (
            "blk.0.attn_q.weight",
            Some("model.layers.0.self_attn.q_proj.weight"),
        ),
        (
            "blk.0.attn_q.bias",
            Some("model.layers.0.self_attn.q_proj.bias"),
        ),
        (
            "blk.3.attn_k.weight",
            Some("model.layers.3.self_attn.k_proj.weight"),
        ),
        (
            "blk.3.attn_v.weight",
            Some("model.layers.3.self_attn.v_proj.weight"),
        ),
        (
            "blk.3.attn_output.weight",
            Some("model.layers.3.self_attn.o_proj.weight"),
        ),
        (
            "blk.3.attn_q_norm.weight",
            Some("model.layers.3.self_attn.q_norm.weight"),
        ),
        (
            "blk.3.attn_k_norm.weight",
            Some("model.layers.3.self_attn.k_norm.weight"),
        ),
        (
            "blk.3.ffn_norm.weight",
            Some("model.layers.3.post_attention_layernorm.weight"),
        ),
        (
            "blk.3.ffn_gate.weight",
            Some("model.layers.3.mlp.gate_proj.weight"),
        ),
        (
            "blk.3.ffn_up.weight",
            Some("model.layers.3.mlp.up_proj.weight"),
        ),
        (
            "blk.3.ffn_down.weight",
            Some("model.layers.3.mlp.down_proj.weight"),
        ),
        (
            "blk.3.ffn_gate_inp.weight",
            Some("model.layers.3.mlp.gate.weight"),
        ),
        (
            "blk.3.ffn_down_shexp.weight",
            Some("model.layers.3.mlp.shared_expert.down_proj.weight"),
        ),
        (
            "blk.3.ffn_gate_inp_shexp.weight",
            Some("model.layers.3.mlp.shared_expert_gate.weight"),
        ),
        // Stacked experts are one tensor per expert (see `gguf_place`).
        ("blk.3.ffn_up_exps.weight", None),
        ("rope_freqs.weight", None),
        ("blk.x.attn_q.weight", None),
        ("blk.1.attn_q.scale", None),
    ];
    for (gguf, hf) in cases {
        assert_eq!(hf_tensor_name(gguf).as_deref(), hf, "{gguf}");
    }
}

mod corrupted {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Corrupting header bytes (metadata, tensor infos: where the parsing is) of a valid
        /// model file gives an error or a model, never a panic.
        #[test]
        fn corrupted_model_files_never_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)
        ) {
            let tmp = tempfile::tempdir().unwrap();
            let path = tmp.path().join("m.gguf");
            write_model(&path, false, |_| {});
            let mut bytes = std::fs::read(&path).unwrap();
            for (at, value) in flips {
                let i = at.index(bytes.len().min(1200));
                bytes[i] = value;
            }
            std::fs::write(&path, &bytes).unwrap();
            let _ = load_model(&path);
        }
    }
}
