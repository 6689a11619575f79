//! Whole random-weight models written as GGUF files the way llama.cpp's converter writes them
//! (llama with q/k rows permuted for its interleaved rope; qwen2 and qwen3 in Hugging Face's
//! order), in F32 and in the quantized types GGUF files ship in (Q4_K and Q6_K as a Q4_K_M
//! file mixes them, Q5_0, Q5_1), then loaded: the config each architecture's metadata
//! describes, the weights as the file holds them, logits against the dense f64 reference
//! forward over the dequantized weights, and the model kept as stored computing the bits of
//! the same file dequantized to f32. Mixture-of-experts files (qwen3moe, qwen2moe, olmoe,
//! Mixtral as llama) hold each layer's experts stacked in `ffn_*_exps` tensors, as
//! llama.cpp's converter merges them.

mod model_support;

use std::path::Path;

use ferry_model::dtype::quantize;
use ferry_model::random_model::{random_weights, small_config};
use ferry_model::{load_model, LlamaConfig, LlamaModel, WeightDtype, WeightStore};
use model_support::*;

/// Relative tolerance of the f32 forward against the f64 reference (as `model_forward.rs`).
const TOL: f64 = 1e-4;
const BS: usize = 4;

// ---------------------------------------------------------------------------------------------
// A GGUF writer: metadata of the value types a converter writes, tensors 32-byte aligned.

#[derive(Clone)]
enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file of `kv` and `tensors` (name, PyTorch shape, ggml type id, bytes).
fn gguf_bytes(kv: &[(String, Meta)], tensors: &[(String, Vec<usize>, u32, Vec<u8>)]) -> Vec<u8> {
    const ALIGN: usize = 32;
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (key, value) in kv {
        put_str(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Bool(v) => {
                out.extend(7u32.to_le_bytes());
                out.push(u8::from(*v));
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
        }
    }
    let mut offset = 0;
    let mut offsets = Vec::new();
    for (name, shape, ty, bytes) in tensors {
        put_str(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = (offset + bytes.len()).next_multiple_of(ALIGN);
    }
    out.resize(out.len().next_multiple_of(ALIGN), 0);
    let start = out.len();
    for ((_, _, _, bytes), at) in tensors.iter().zip(offsets) {
        out.resize(start + at, 0);
        out.extend(bytes);
    }
    out
}

/// The GGUF name llama.cpp gives a Hugging Face tensor.
fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, param) = rest.split_once('.').unwrap();
    let (part, suffix) = param.rsplit_once('.').unwrap();
    let g = match part {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{g}.{suffix}")
}

/// An expert's projection (`model.layers.{l}.{mlp,block_sparse_moe}.experts.{e}.{proj}
/// .weight`): the stacked GGUF tensor llama.cpp's converter merges it into, and `e`.
fn expert_slot(hf: &str) -> Option<(String, usize)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (_, rest) = rest.split_once(".experts.")?;
    let (e, proj) = rest.split_once('.')?;
    let g = match proj {
        "gate_proj.weight" | "w1.weight" => "ffn_gate_exps",
        "up_proj.weight" | "w3.weight" => "ffn_up_exps",
        "down_proj.weight" | "w2.weight" => "ffn_down_exps",
        other => panic!("no GGUF name for {other}"),
    };
    Some((format!("blk.{layer}.{g}.weight"), e.parse().unwrap()))
}

/// llama.cpp's converter permutation of q/k rows (`reshape(n_head, 2, half, ...)
/// .swapaxes(1, 2)`): GGUF row `h*hd + 2i + s` holds Hugging Face row `h*hd + s*half + i`.
fn permute_rows(hf: &[f32], n_heads: usize, rows: usize) -> Vec<f32> {
    let cols = hf.len() / rows;
    let (hd, mut out) = (rows / n_heads, vec![0.0; hf.len()]);
    for h in 0..n_heads {
        for i in 0..hd / 2 {
            for s in 0..2 {
                let (src, dst) = (h * hd + s * hd / 2 + i, h * hd + 2 * i + s);
                out[dst * cols..][..cols].copy_from_slice(&hf[src * cols..][..cols]);
            }
        }
    }
    out
}

/// A GGUF tensor: name, PyTorch shape, ggml type id, bytes.
type GgufTensor = (String, Vec<usize>, u32, Vec<u8>);

/// Writes `weights` of `config` as a GGUF of architecture `arch`, every matrix in
/// `dtype_of(name)` (quantized by ferry's quantizers), every vector f32. Returns the weights
/// as the file holds them, dequantized, in Hugging Face order: what loading must give.
fn write_gguf(
    path: &Path,
    arch: &str,
    config: &LlamaConfig,
    weights: &WeightStore,
    dtype_of: impl Fn(&str) -> WeightDtype,
) -> WeightStore {
    let (kv, tensors, held) = gguf_parts(arch, config, weights, dtype_of);
    std::fs::write(path, gguf_bytes(&kv, &tensors)).unwrap();
    held
}

/// What [`write_gguf`] writes: the metadata, the tensors and the weights as held. An MoE
/// config's experts are written as llama.cpp's converter merges them: `<arch>.expert_count`,
/// `expert_used_count`, the Qwen expert sizes, and per layer and projection one
/// `ffn_*_exps` tensor `[experts, rows, cols]` of the experts' matrices in order; the
/// router `ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` and its gate
/// `ffn_gate_inp_shexp` (1-D `[hidden]` as llama.cpp declares it when f32, `[1, hidden]`
/// otherwise); OLMoE's clip as `attention.clamp_kqv`.
fn gguf_parts(
    arch: &str,
    config: &LlamaConfig,
    weights: &WeightStore,
    dtype_of: impl Fn(&str) -> WeightDtype,
) -> (Vec<(String, Meta)>, Vec<GgufTensor>, WeightStore) {
    let k = |key: &str| format!("{arch}.{key}");
    let c = config;
    let mut kv = vec![
        ("general.architecture".into(), Meta::Str(arch.into())),
        (k("vocab_size"), Meta::U32(c.vocab_size as u32)),
        (k("embedding_length"), Meta::U32(c.hidden_size as u32)),
        (
            k("feed_forward_length"),
            Meta::U32(c.intermediate_size as u32),
        ),
        (k("block_count"), Meta::U32(c.num_hidden_layers as u32)),
        (
            k("attention.head_count"),
            Meta::U32(c.num_attention_heads as u32),
        ),
        (
            k("attention.head_count_kv"),
            Meta::U32(c.num_key_value_heads as u32),
        ),
        (k("attention.key_length"), Meta::U32(c.head_dim as u32)),
        (k("rope.dimension_count"), Meta::U32(c.head_dim as u32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Meta::F32(c.rms_norm_eps),
        ),
        (k("rope.freq_base"), Meta::F32(c.rope_theta)),
        (
            k("context_length"),
            Meta::U32(c.max_position_embeddings as u32),
        ),
    ];
    if let Some(moe) = &c.moe {
        kv.push((k("expert_count"), Meta::U32(moe.num_experts as u32)));
        kv.push((k("expert_used_count"), Meta::U32(moe.top_k as u32)));
        if arch.starts_with("qwen") {
            kv.push((
                k("expert_feed_forward_length"),
                Meta::U32(moe.expert_intermediate_size as u32),
            ));
        }
        if let Some(n) = moe.shared_expert_intermediate_size {
            kv.push((k("expert_shared_feed_forward_length"), Meta::U32(n as u32)));
        }
    }
    if let Some(clip) = c.clip_qkv {
        kv.push((k("attention.clamp_kqv"), Meta::F32(clip)));
    }
    if let Some(bos) = c.bos_token_id {
        kv.push(("tokenizer.ggml.bos_token_id".into(), Meta::U32(bos.0)));
    }
    kv.push((
        "tokenizer.ggml.eos_token_id".into(),
        Meta::U32(c.eos_token_ids[0].0),
    ));
    let mut tensors = Vec::new();
    let mut held = WeightStore::default();
    // Stacked expert tensors: name → (expert, shape, ggml type, bytes) of each expert.
    type Experts = Vec<(usize, Vec<usize>, u32, Vec<u8>)>;
    let mut stacked: std::collections::BTreeMap<String, Experts> = Default::default();
    for (name, t) in &weights.tensors {
        let heads = if arch != "llama" {
            None
        } else if name.contains(".q_proj.") {
            Some(c.num_attention_heads)
        } else if name.contains(".k_proj.") {
            Some(c.num_key_value_heads)
        } else {
            None
        };
        let dtype = if t.shape.len() == 2 {
            dtype_of(name)
        } else {
            WeightDtype::F32
        };
        let bytes = quantize(dtype, &t.data);
        // What the file holds, back in Hugging Face order (the permutation moves whole rows,
        // and each row's blocks with it).
        let mut values = vec![0.0; t.data.len()];
        ferry_model::dtype::dequantize_into(dtype, &bytes, &mut values);
        held.insert(
            name.clone(),
            ferry_model::Tensor::new(t.shape.clone(), values),
        );
        let bytes = match heads {
            Some(n) => quantize(dtype, &permute_rows(&t.data, n, t.shape[0])),
            None => bytes,
        };
        let ty = dtype.ggml().id();
        if let Some((gguf, e)) = expert_slot(name) {
            stacked
                .entry(gguf)
                .or_default()
                .push((e, t.shape.clone(), ty, bytes));
            continue;
        }
        let shape = if name.ends_with("shared_expert_gate.weight") && dtype == WeightDtype::F32 {
            vec![t.shape[1]]
        } else {
            t.shape.clone()
        };
        tensors.push((gguf_name(name), shape, ty, bytes));
    }
    for (gguf, mut experts) in stacked {
        experts.sort_by_key(|(e, ..)| *e);
        let (shape, ty) = (experts[0].1.clone(), experts[0].2);
        assert!(experts
            .iter()
            .enumerate()
            .all(|(i, x)| x.0 == i && x.2 == ty));
        let shape = [&[experts.len()][..], &shape].concat();
        let bytes = experts.into_iter().flat_map(|x| x.3).collect();
        tensors.push((gguf, shape, ty, bytes));
    }
    (kv, tensors, held)
}

// ---------------------------------------------------------------------------------------------

/// Prefill then three greedy tokens, each step's logits against the dense reference over
/// `weights` (what the file holds); returns every step's logits as bits.
fn check_forward(
    config: &LlamaConfig,
    model: &mut LlamaModel,
    weights: &WeightStore,
) -> Vec<Vec<u32>> {
    let mut kv = arena_for(model, 64, BS);
    let mut pool = Pool::new(64, BS, 3);
    let mut seq = Seq::new(0, random_tokens(9, config.vocab_size, 5));
    let mut count = seq.tokens.len();
    let mut rows = Vec::new();
    for step_idx in 0..4 {
        let logits = step(model, &mut kv, &mut pool, &mut [&mut seq], &[count]);
        let want = reference_logits(config, weights, &seq.tokens);
        let what = format!("{} step {step_idx}", config.architecture);
        assert_close(logits.row(0), want.last().unwrap(), TOL, &what);
        rows.push(bits(logits.row(0)));
        seq.tokens.push(argmax(logits.row(0)));
        count = 1;
    }
    rows
}

/// Loads `path` dequantized to f32 and kept as stored: the config is `config`, the f32
/// weights are `held` bit for bit, both forwards match the reference over them, and the
/// stored one computes the bits of the f32 one.
fn check_loaded(path: &Path, config: &LlamaConfig, held: &WeightStore) {
    let f32s = load_model(path).unwrap();
    assert_eq!(&f32s.config, config);
    assert_eq!(f32s.weights.tensors.len(), held.tensors.len());
    for (name, t) in &held.tensors {
        let got = f32s.weights.get(name).unwrap();
        assert_eq!(got.shape, t.shape, "{name}");
        assert!(
            got.data == t.data,
            "{} {name}: values differ",
            config.architecture
        );
    }
    let stored = ferry_model::load::load_model_stored(path).unwrap();
    let mut a = LlamaModel::new(&f32s.config, &f32s.weights).unwrap();
    let mut b = LlamaModel::new(&stored.config, &stored.weights).unwrap();
    let want = check_forward(config, &mut a, held);
    assert!(
        check_forward(config, &mut b, held) == want,
        "{}: stored differs",
        config.architecture
    );
}

/// A config of `arch` as the GGUF's metadata and tensors describe it.
fn arch_config(arch: &str, base: LlamaConfig) -> LlamaConfig {
    match arch {
        "llama" => LlamaConfig {
            attention_bias: true,
            o_proj_bias: true,
            ..base
        },
        "qwen2" => LlamaConfig {
            architecture: "Qwen2ForCausalLM".into(),
            attention_bias: true,
            tie_word_embeddings: true,
            ..base
        },
        _ => LlamaConfig {
            architecture: "Qwen3ForCausalLM".into(),
            qk_norm: true,
            head_dim: base.hidden_size / base.num_attention_heads * 3 / 2,
            ..base
        },
    }
}

/// Llama (with `attention_bias`: q/k/v and o biases, q/k permuted), Qwen2 (q/k/v biases,
/// tied head) and Qwen3 (q/k norms, head_dim wider than hidden / heads) in F32 and Q8_0.
#[test]
fn llama_qwen2_and_qwen3_ggufs_load_and_match_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2", "qwen3"] {
        let config = arch_config(arch, small_config());
        let weights = random_weights(&config, 11);
        for dtype in [WeightDtype::F32, WeightDtype::Q8_0] {
            let path = tmp.path().join(format!("{arch}-{dtype}.gguf"));
            let held = write_gguf(&path, arch, &config, &weights, |_| dtype);
            check_loaded(&path, &config, &held);
        }
    }
}

/// The types GGUF files ship in, on a model whose rows are multiples of 256: a Q4_K_M-like
/// mix (Q6_K for v, down and the head, Q4_K elsewhere), all Q5_0, all Q5_1, for each
/// architecture.
#[test]
fn k_quant_and_q5_ggufs_load_and_match_the_reference() {
    let base = LlamaConfig {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 512,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        ..small_config()
    };
    let q4_k_m = |name: &str| {
        if name.contains("v_proj") || name.contains("down_proj") || name.contains("lm_head") {
            WeightDtype::Q6_K
        } else {
            WeightDtype::Q4_K
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2", "qwen3"] {
        let mut config = arch_config(arch, base.clone());
        // Qwen3's wider heads: 4 × 128 = 512, still a multiple of 256.
        if arch == "qwen3" {
            config.head_dim = 128;
        }
        let weights = random_weights(&config, 12);
        let path = tmp.path().join(format!("{arch}-q4_k_m.gguf"));
        let held = write_gguf(&path, arch, &config, &weights, q4_k_m);
        check_loaded(&path, &config, &held);
        let gguf = ferry_model::load::gguf::GgufFile::open(&path).unwrap();
        let types: std::collections::BTreeSet<String> =
            gguf.tensors.iter().map(|t| t.dtype.to_string()).collect();
        assert_eq!(types, ["F32", "Q4_K", "Q6_K"].map(String::from).into());
        for dtype in [WeightDtype::Q5_0, WeightDtype::Q5_1] {
            let path = tmp.path().join(format!("{arch}-{dtype}.gguf"));
            let held = write_gguf(&path, arch, &config, &weights, |_| dtype);
            check_loaded(&path, &config, &held);
        }
    }
}

/// A Llama 3.1-style GGUF: llama.cpp's converter writes the llama3 rope scaling as
/// per-frequency factors in `rope_freqs.weight` (its `generate_extra_tensors`), which the
/// loader reads into the config and the forward uses: logits match the reference forward of
/// the Hugging Face config with `rope_scaling` llama3, and differ from the unscaled model's.
#[test]
fn a_gguf_with_rope_freqs_computes_the_llama3_scaled_model() {
    let (factor, low, high, old) = (8.0f64, 1.0f64, 4.0f64, 64.0f64);
    let hf = LlamaConfig {
        rope_theta: 500_000.0,
        rope_scaling: Some(ferry_model::RopeScaling::Llama3 {
            factor: factor as f32,
            low_freq_factor: low as f32,
            high_freq_factor: high as f32,
            original_max_position_embeddings: old as usize,
        }),
        ..small_config()
    };
    let d = hf.head_dim;
    // The converter's factors, in f64 then stored as f32.
    let factors: Vec<f32> = (0..d / 2)
        .map(|i| {
            let freq = 1.0 / 500_000f64.powf((2 * i) as f64 / d as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect();
    assert!(
        factors.iter().any(|&f| f > 1.0 && f < 8.0),
        "a blended band"
    );
    let in_file = LlamaConfig {
        rope_scaling: Some(ferry_model::RopeScaling::Factors {
            factors: factors.clone(),
        }),
        ..hf.clone()
    };
    let weights = random_weights(&hf, 13);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("llama3.gguf");
    let held = write_gguf(&path, "llama", &hf, &weights, |_| WeightDtype::F32);
    // The file as converted: the factors beside the weights (appended, rewritten).
    append_rope_freqs(&path, &factors);
    let loaded = load_model(&path).unwrap();
    assert_eq!(loaded.config, in_file);
    let mut model = LlamaModel::new(&loaded.config, &loaded.weights).unwrap();
    // Against Hugging Face's llama3 frequencies (the reference computes them from `hf`).
    let scaled = check_forward(&hf, &mut model, &held);
    let mut plain = LlamaModel::new(&small_config_with(&hf), &loaded.weights).unwrap();
    let mut kv = arena_for(&plain, 64, BS);
    let mut pool = Pool::new(64, BS, 3);
    let mut seq = Seq::new(0, random_tokens(9, hf.vocab_size, 5));
    let n = seq.tokens.len();
    let logits = step(&mut plain, &mut kv, &mut pool, &mut [&mut seq], &[n]);
    assert_ne!(
        bits(logits.row(0)),
        scaled[0],
        "the factors change the model"
    );
}

/// `config` without rope scaling.
fn small_config_with(config: &LlamaConfig) -> LlamaConfig {
    LlamaConfig {
        rope_scaling: None,
        ..config.clone()
    }
}

/// Rewrites the GGUF at `path` with `rope_freqs.weight` (f32) added after its tensors.
fn append_rope_freqs(path: &Path, factors: &[f32]) {
    use ferry_model::load::gguf::GgufFile;
    let gguf = GgufFile::open(path).unwrap();
    let kv: Vec<(String, Meta)> = gguf
        .metadata
        .iter()
        .map(|(k, v)| {
            let m = match v {
                ferry_model::load::gguf::GgufValue::U32(x) => Meta::U32(*x),
                ferry_model::load::gguf::GgufValue::F32(x) => Meta::F32(*x),
                other => Meta::Str(other.as_str().unwrap().to_owned()),
            };
            (k.clone(), m)
        })
        .collect();
    let mut tensors: Vec<(String, Vec<usize>, u32, Vec<u8>)> = gguf
        .tensors
        .iter()
        .map(|t| {
            let bytes = gguf.tensor_bytes(t).unwrap().to_vec();
            (t.name.clone(), t.shape(), t.dtype.id(), bytes)
        })
        .collect();
    let bytes = factors.iter().flat_map(|f| f.to_le_bytes()).collect();
    tensors.push(("rope_freqs.weight".into(), vec![factors.len()], 0, bytes));
    drop(gguf);
    std::fs::write(path, gguf_bytes(&kv, &tensors)).unwrap();
}

/// A Qwen2 GGUF with an `o_proj` bias (which Qwen2 does not have) is refused naming it, as
/// is one lacking the q/k/v biases every Qwen2 has.
#[test]
fn a_qwen2_gguf_with_an_o_bias_or_without_qkv_biases_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let config = arch_config("qwen2", small_config());
    let with_o = LlamaConfig {
        o_proj_bias: true,
        ..config.clone()
    };
    let path = tmp.path().join("o.gguf");
    write_gguf(&path, "qwen2", &with_o, &random_weights(&with_o, 1), |_| {
        WeightDtype::F32
    });
    match load_model(&path).unwrap_err() {
        ferry_model::LoadError::UnusedTensor { tensor, .. } => {
            assert_eq!(
                tensor,
                "blk.0.attn_output.bias (model.layers.0.self_attn.o_proj.bias)"
            )
        }
        other => panic!("expected UnusedTensor, got {other:?}"),
    }
    let without = LlamaConfig {
        attention_bias: false,
        ..config
    };
    write_gguf(
        &path,
        "qwen2",
        &without,
        &random_weights(&without, 1),
        |_| WeightDtype::F32,
    );
    let err = load_model(&path).unwrap_err().to_string();
    assert!(
        err.contains("missing tensor") && err.contains("q_proj.bias"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Mixture-of-experts files, as llama.cpp's converter writes them.

/// The GGUF architecture llama.cpp's converter gives an MoE architecture (Mixtral is `llama`
/// with experts).
fn moe_arch(hf: &str) -> &'static str {
    match hf {
        "Qwen3MoeForCausalLM" => "qwen3moe",
        "Qwen2MoeForCausalLM" => "qwen2moe",
        "OlmoeForCausalLM" => "olmoe",
        "MixtralForCausalLM" => "llama",
        other => panic!("{other} is not an MoE architecture"),
    }
}

/// Matrices in `dtype_of(name)`, but the router in f32 (llama.cpp's converter and quantizer
/// keep `ffn_gate_inp` so) and, when that dtype's blocks do not tile the small config's
/// Qwen2-MoE shared expert down projection (48-wide rows), F16 for it.
fn moe_dtype(dtype_of: impl Fn(&str) -> WeightDtype) -> impl Fn(&str) -> WeightDtype {
    move |name: &str| {
        let dtype = dtype_of(name);
        if name.ends_with(".gate.weight") {
            WeightDtype::F32
        } else if name.contains("shared_expert.down_proj") && dtype.row_bytes(48).is_none() {
            WeightDtype::F16
        } else {
            dtype
        }
    }
}

/// Every MoE architecture (Qwen3-MoE with a dense last layer, Qwen2-MoE with its shared
/// expert, OLMoE with whole-projection q/k norms and a clip, Mixtral as `llama` with q/k
/// permuted) in every dtype the kernels read in registers (F32, F16, BF16, Q8_0, Q4_0, Q4_1):
/// the config is the Hugging Face one, the stacked expert tensors are split into each
/// expert's matrix (kept in the file's dtype when stored), and both forwards match the
/// reference over the file's weights, the stored one bit for bit the f32 one.
#[test]
fn moe_ggufs_of_every_architecture_load_and_match_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for hf in ferry_model::random_model::MOE_ARCHITECTURES {
        let arch = moe_arch(hf);
        let config = ferry_model::random_model::small_moe_config(hf);
        let moe = config.moe.clone().unwrap();
        let weights = random_weights(&config, 21);
        for dtype in WeightDtype::ALL {
            let path = tmp.path().join(format!("{arch}-{dtype}.gguf"));
            let held = write_gguf(&path, arch, &config, &weights, moe_dtype(|_| dtype));
            let gguf = ferry_model::load::gguf::GgufFile::open(&path).unwrap();
            let up = gguf.tensor_info("blk.0.ffn_up_exps.weight").unwrap();
            assert_eq!(
                up.shape(),
                [
                    moe.num_experts,
                    moe.expert_intermediate_size,
                    config.hidden_size
                ]
            );
            assert_eq!(up.dtype, dtype.ggml());
            drop(gguf);
            check_loaded(&path, &config, &held);
            let stored = ferry_model::load::load_model_stored(&path).unwrap();
            let [_, up, _] = moe.naming.expert(7);
            let up = &stored.weights.stored[&format!("model.layers.1.{up}")];
            assert_eq!((up.dtype, &up.shape[..]), (dtype, &[32, 64][..]), "{hf}");
        }
    }
}

/// Every MoE architecture with its experts in K-quants and Q5 blocks, as `llama-quantize`
/// makes them: a Q4_K_M-style mix (Q6_K for the value and down projections and the head,
/// Q4_K elsewhere, the experts' stacked tensors included; the routers f32), and all Q5_0 and
/// all Q5_1. Their 256-value super-blocks need every row a multiple of 256 long, so the
/// small configs are widened to 256 (hidden, attention output, every intermediate size).
/// The experts stay in their blocks when stored, and both forwards match the reference over
/// the file's weights, the stored one bit for bit the f32 one.
#[test]
fn moe_ggufs_with_k_quant_and_q5_experts_load_and_match_the_reference() {
    let q4_k_m = |name: &str| {
        if name.contains("v_proj")
            || name.contains("down_proj")
            || name.ends_with(".w2.weight")
            || name.contains("lm_head")
        {
            WeightDtype::Q6_K
        } else {
            WeightDtype::Q4_K
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    for hf in ferry_model::random_model::MOE_ARCHITECTURES {
        let arch = moe_arch(hf);
        let mut config = ferry_model::random_model::small_moe_config(hf);
        config.hidden_size = 256;
        config.intermediate_size = 256;
        config.num_attention_heads = 4;
        config.num_key_value_heads = 2;
        config.head_dim = 64;
        let moe = config.moe.as_mut().unwrap();
        moe.expert_intermediate_size = 256;
        if let Some(shared) = &mut moe.shared_expert_intermediate_size {
            *shared = 256;
        }
        let naming = moe.naming;
        let weights = random_weights(&config, 22);
        let path = tmp.path().join(format!("{arch}-q4_k_m.gguf"));
        let held = write_gguf(&path, arch, &config, &weights, moe_dtype(q4_k_m));
        let gguf = ferry_model::load::gguf::GgufFile::open(&path).unwrap();
        let dtype_of = |name: &str| gguf.tensor_info(name).unwrap().dtype.to_string();
        assert_eq!(
            (
                dtype_of("blk.1.ffn_up_exps.weight"),
                dtype_of("blk.1.ffn_down_exps.weight"),
                dtype_of("blk.1.ffn_gate_inp.weight")
            ),
            ("Q4_K".into(), "Q6_K".into(), "F32".into()),
            "{hf}"
        );
        drop(gguf);
        check_loaded(&path, &config, &held);
        let stored = ferry_model::load::load_model_stored(&path).unwrap();
        let [gate, _, down] = naming.expert(5);
        let stored_dtype =
            |name: &str| stored.weights.stored[&format!("model.layers.1.{name}")].dtype;
        assert_eq!(
            (stored_dtype(&gate), stored_dtype(&down)),
            (WeightDtype::Q4_K, WeightDtype::Q6_K),
            "{hf}"
        );
        for dtype in [WeightDtype::Q5_0, WeightDtype::Q5_1] {
            let path = tmp.path().join(format!("{arch}-{dtype}.gguf"));
            let held = write_gguf(&path, arch, &config, &weights, moe_dtype(|_| dtype));
            check_loaded(&path, &config, &held);
        }
    }
}

/// A Qwen3-MoE file's routing weights are renormalised as llama.cpp hard-codes it unless
/// `expert_weights_norm` says not; a `leading_dense_block_count` must agree with which
/// layers have a router.
#[test]
fn moe_gguf_routing_keys_are_read() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let config = ferry_model::random_model::small_moe_config("Qwen3MoeForCausalLM");
    let weights = random_weights(&config, 22);
    let (mut kv, tensors, held) = gguf_parts("qwen3moe", &config, &weights, |_| WeightDtype::F32);
    kv.push(("qwen3moe.expert_weights_norm".into(), Meta::Bool(false)));
    std::fs::write(&path, gguf_bytes(&kv, &tensors)).unwrap();
    let mut want = config.clone();
    want.moe.as_mut().unwrap().norm_topk_prob = false;
    check_loaded(&path, &want, &held);
    // Layer 2 is dense: no leading dense layers.
    kv.push(("qwen3moe.leading_dense_block_count".into(), Meta::U32(1)));
    std::fs::write(&path, gguf_bytes(&kv, &tensors)).unwrap();
    let err = load_model(&path).unwrap_err().to_string();
    assert!(
        err.contains("qwen3moe.leading_dense_block_count") && err.contains("layer 0"),
        "{err}"
    );
}

/// Refusals, each naming the key or tensor: an expert count the router's or a stacked
/// tensor's shape contradicts, more experts used than there are, scaled routing weights,
/// experts in a dense layer.
#[test]
fn moe_ggufs_contradicting_themselves_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let config = ferry_model::random_model::small_moe_config("Qwen3MoeForCausalLM");
    let weights = random_weights(&config, 23);
    let (kv, tensors, _) = gguf_parts("qwen3moe", &config, &weights, |_| WeightDtype::Q8_0);
    let set = |kv: &mut Vec<(String, Meta)>, key: &str, value: Meta| match kv
        .iter_mut()
        .find(|(k, _)| k == key)
    {
        Some(slot) => slot.1 = value,
        None => kv.push((key.into(), value)),
    };
    let load_err = |kv: &[(String, Meta)], tensors: &[GgufTensor]| {
        std::fs::write(&path, gguf_bytes(kv, tensors)).unwrap();
        load_model(&path).unwrap_err()
    };

    let mut bad = kv.clone();
    set(&mut bad, "qwen3moe.expert_count", Meta::U32(7));
    match load_err(&bad, &tensors) {
        ferry_model::LoadError::TensorShape {
            tensor,
            expected,
            actual,
            ..
        } => {
            assert_eq!(tensor, "blk.0.ffn_gate_inp.weight");
            assert_eq!((expected, actual), (vec![7, 64], vec![8, 64]));
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }

    // One stacked tensor holding 7 experts' rows where the file says 8.
    let mut short = tensors.clone();
    let t = short
        .iter_mut()
        .find(|t| t.0 == "blk.1.ffn_up_exps.weight")
        .unwrap();
    t.1[0] = 7;
    t.3.truncate(t.3.len() / 8 * 7);
    match load_err(&kv, &short) {
        ferry_model::LoadError::TensorShape {
            tensor,
            expected,
            actual,
            ..
        } => {
            assert_eq!(tensor, "blk.1.ffn_up_exps.weight");
            assert_eq!((expected, actual), (vec![8, 32, 64], vec![7, 32, 64]));
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }

    let mut bad = kv.clone();
    set(&mut bad, "qwen3moe.expert_used_count", Meta::U32(9));
    let err = load_err(&bad, &tensors).to_string();
    assert!(
        err.contains("qwen3moe.expert_used_count") && err.contains("9"),
        "{err}"
    );

    let mut bad = kv.clone();
    set(&mut bad, "qwen3moe.expert_weights_scale", Meta::F32(2.5));
    let err = load_err(&bad, &tensors).to_string();
    assert!(err.contains("qwen3moe.expert_weights_scale"), "{err}");

    // Experts in layer 2, which has no router: the dense MLP's config does not read them.
    let mut extra = tensors.clone();
    let mut stray = extra
        .iter()
        .find(|t| t.0 == "blk.0.ffn_gate_exps.weight")
        .unwrap()
        .clone();
    stray.0 = "blk.2.ffn_gate_exps.weight".into();
    extra.push(stray);
    match load_err(&kv, &extra) {
        ferry_model::LoadError::UnusedTensor { tensor, .. } => {
            assert_eq!(tensor, "blk.2.ffn_gate_exps.weight")
        }
        other => panic!("expected UnusedTensor, got {other:?}"),
    }
}

/// A Mixtral file converted before llama.cpp stacked the experts holds each expert's matrix
/// as `blk.{l}.ffn_{gate,up,down}.{e}.weight`: it loads as the stacked one does. Beside the
/// stacked tensor, such a tensor is refused as unused.
#[test]
fn a_mixtral_gguf_with_one_tensor_per_expert_loads() {
    use ferry_model::load::gguf_model::gguf_place;
    assert_eq!(
        gguf_place("model.layers.4.block_sparse_moe.experts.5.w3.weight"),
        Some(("blk.4.ffn_up_exps.weight".into(), Some(5)))
    );
    assert_eq!(
        gguf_place("model.layers.4.mlp.experts.5.down_proj.weight"),
        Some(("blk.4.ffn_down_exps.weight".into(), Some(5)))
    );
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("mixtral.gguf");
    let config = ferry_model::random_model::small_moe_config("MixtralForCausalLM");
    let weights = random_weights(&config, 24);
    let (kv, tensors, held) = gguf_parts("llama", &config, &weights, |_| WeightDtype::Q8_0);
    let mut split = Vec::new();
    for (name, shape, ty, bytes) in &tensors {
        let Some(base) = name.strip_suffix("_exps.weight") else {
            split.push((name.clone(), shape.clone(), *ty, bytes.clone()));
            continue;
        };
        let each = bytes.len() / shape[0];
        for (e, piece) in bytes.chunks(each).enumerate() {
            split.push((
                format!("{base}.{e}.weight"),
                shape[1..].to_vec(),
                *ty,
                piece.to_vec(),
            ));
        }
    }
    std::fs::write(&path, gguf_bytes(&kv, &split)).unwrap();
    check_loaded(&path, &config, &held);
    let mut both = tensors.clone();
    both.push(
        split
            .iter()
            .find(|t| t.0 == "blk.1.ffn_down.3.weight")
            .unwrap()
            .clone(),
    );
    std::fs::write(&path, gguf_bytes(&kv, &both)).unwrap();
    match load_model(&path).unwrap_err() {
        ferry_model::LoadError::UnusedTensor { tensor, .. } => {
            assert_eq!(tensor, "blk.1.ffn_down.3.weight")
        }
        other => panic!("expected UnusedTensor, got {other:?}"),
    }
}
