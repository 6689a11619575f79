//! Hugging Face folders with safetensors written by the `safetensors` crate: single file and
//! sharded round trips, F16/BF16 conversion, and errors that name the file and tensor.

use ferry_core::TokenId;
use std::collections::BTreeMap;
use std::path::Path;

use ferry_model::load::config_json::to_hf_config_json;
use ferry_model::load::load_hf_folder;
use ferry_model::load::WeightFiles;
use ferry_model::{
    expected_tensors, load_model, LlamaConfig, LlamaPreparer, LoadError, WeightPreparer,
};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

fn small_config() -> LlamaConfig {
    LlamaConfig {
        architecture: "LlamaForCausalLM".into(),
        vocab_size: 10,
        hidden_size: 8,
        intermediate_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        attention_bias: false,
        o_proj_bias: false,
        qk_norm: false,
        qk_norm_whole: false,
        clip_qkv: None,
        moe: None,
        bos_token_id: None,
        eos_token_ids: vec![TokenId(9)],
    }
}

/// Deterministic values exactly representable in F16 and BF16 (multiples of 1/8 in [-4, 4)),
/// so every dtype must load them bit-exactly.
fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((seed * 31 + i * 7) % 64) as f32 - 32.0) / 8.0)
        .collect()
}

fn encode(dtype: Dtype, data: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => data
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::BF16 => data
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::I32 => data
            .iter()
            .flat_map(|x| (*x as i32).to_le_bytes())
            .collect(),
        other => panic!("test does not encode {other:?}"),
    }
}

struct Entry {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    data: Vec<f32>,
}

/// Every expected tensor of `config`, with `dtype_of` choosing each one's dtype.
fn entries(config: &LlamaConfig, dtype_of: impl Fn(usize) -> Dtype) -> Vec<Entry> {
    expected_tensors(config)
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| Entry {
            data: values(i, shape.iter().product()),
            name,
            shape,
            dtype: dtype_of(i),
        })
        .collect()
}

fn write_safetensors(path: &Path, entries: &[&Entry]) {
    let bytes: Vec<Vec<u8>> = entries.iter().map(|e| encode(e.dtype, &e.data)).collect();
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .zip(&bytes)
        .map(|(e, b)| {
            let view = TensorView::new(e.dtype, e.shape.clone(), b).unwrap();
            (e.name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn write_config(dir: &Path, config: &LlamaConfig) {
    let text = to_hf_config_json(config).to_string();
    std::fs::write(dir.join("config.json"), text).unwrap();
}

/// Writes `entries` split into `n_shards` files with an index (or one file when 1).
fn write_folder(dir: &Path, config: &LlamaConfig, entries: &[Entry], n_shards: usize) {
    write_config(dir, config);
    if n_shards == 1 {
        let all: Vec<&Entry> = entries.iter().collect();
        write_safetensors(&dir.join("model.safetensors"), &all);
        return;
    }
    let mut weight_map = BTreeMap::new();
    for shard in 0..n_shards {
        let file = format!("model-{:05}-of-{n_shards:05}.safetensors", shard + 1);
        let part: Vec<&Entry> = entries.iter().skip(shard).step_by(n_shards).collect();
        for e in &part {
            weight_map.insert(e.name.clone(), file.clone());
        }
        write_safetensors(&dir.join(&file), &part);
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn assert_loaded_equals(dir: &Path, config: &LlamaConfig, entries: &[Entry]) {
    let model = load_model(dir).unwrap();
    assert_eq!(&model.config, config);
    assert_eq!(model.weights.tensors.len(), entries.len());
    for e in entries {
        let t = model.weights.get(&e.name).unwrap();
        assert_eq!(t.shape, e.shape, "{}", e.name);
        assert_eq!(t.data, e.data, "{}", e.name);
    }
    assert!(model.tokenizer.is_none());
    assert!(model.chat_template.is_none());
}

#[test]
fn single_file_round_trip_in_every_float_dtype() {
    let config = small_config();
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::BF16];
    let entries = entries(&config, |i| dtypes[i % 3]);
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 1);
    assert_loaded_equals(tmp.path(), &config, &entries);
}

#[test]
fn sharded_round_trip() {
    let config = small_config();
    let entries = entries(&config, |_| Dtype::BF16);
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 3);
    assert_loaded_equals(tmp.path(), &config, &entries);
}

/// A Llama folder with `attention_bias` holds an `o_proj.bias` per layer, and it is loaded.
#[test]
fn llama_attention_bias_loads_the_o_proj_bias() {
    let config = LlamaConfig {
        attention_bias: true,
        o_proj_bias: true,
        ..small_config()
    };
    let entries = entries(&config, |_| Dtype::F32);
    assert!(entries
        .iter()
        .any(|e| e.name == "model.layers.1.self_attn.o_proj.bias"));
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 1);
    assert_loaded_equals(tmp.path(), &config, &entries);
}

#[test]
fn tied_embeddings_need_no_lm_head_and_extra_tensors_are_ignored() {
    let mut config = small_config();
    config.tie_word_embeddings = true;
    let mut entries = entries(&config, |_| Dtype::F32);
    assert!(entries.iter().all(|e| e.name != "lm_head.weight"));
    let tmp = tempfile::tempdir().unwrap();
    entries.push(Entry {
        name: "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        shape: vec![2],
        dtype: Dtype::F32,
        data: vec![1.0, 0.5],
    });
    write_folder(tmp.path(), &config, &entries, 1);
    let model = load_model(tmp.path()).unwrap();
    assert_eq!(model.weights.tensors.len(), entries.len() - 1);
    assert!(model.weights.get("lm_head.weight").is_none());
}

/// A tensor the forward would not read is refused at load and by a reload from disk, naming
/// it and its file, in a single file or in any shard.
#[test]
fn an_unused_tensor_is_refused_naming_it() {
    let config = small_config();
    for n_shards in [1, 3] {
        let mut entries = entries(&config, |_| Dtype::F32);
        entries.push(Entry {
            name: "model.layers.1.self_attn.o_proj.bias".into(),
            shape: vec![8],
            dtype: Dtype::F32,
            data: vec![0.5; 8],
        });
        let tmp = tempfile::tempdir().unwrap();
        write_folder(tmp.path(), &config, &entries, n_shards);
        let check = |err: LoadError| match err {
            LoadError::UnusedTensor { path, tensor, .. } => {
                assert_eq!(tensor, "model.layers.1.self_attn.o_proj.bias");
                assert!(path.starts_with(tmp.path()), "{}", path.display());
            }
            other => panic!("expected UnusedTensor, got {other:?}"),
        };
        check(load_model(tmp.path()).unwrap_err());
        check(ferry_model::load::load_model_stored(tmp.path()).unwrap_err());
        let files = WeightFiles::open(tmp.path()).unwrap();
        let mut slots = LlamaPreparer::new(config.clone())
            .slots(&expected_tensors(&config))
            .unwrap();
        check(files.read_into(slots.as_mut()).unwrap_err());
    }
}

/// A tied model's `lm_head.weight` is accepted when it equals the embedding (a checkpoint
/// saved without de-duplicating the tie) and refused when it differs.
#[test]
fn a_tied_head_must_equal_the_embedding() {
    let mut config = small_config();
    config.tie_word_embeddings = true;
    let mut entries = entries(&config, |_| Dtype::F32);
    let embed = entries
        .iter()
        .find(|e| e.name == "model.embed_tokens.weight")
        .unwrap();
    let mut head = Entry {
        name: "lm_head.weight".into(),
        shape: embed.shape.clone(),
        dtype: Dtype::BF16,
        data: embed.data.clone(),
    };
    head.data[17] += 1.0;
    entries.push(head);
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 2);
    match load_model(tmp.path()).unwrap_err() {
        LoadError::UnusedTensor {
            tensor, message, ..
        } => {
            assert_eq!(tensor, "lm_head.weight");
            assert!(message.contains("tie_word_embeddings"), "{message}");
        }
        other => panic!("expected UnusedTensor, got {other:?}"),
    }
    let head = entries.last_mut().unwrap();
    head.data[17] -= 1.0;
    write_folder(tmp.path(), &config, &entries, 2);
    let model = load_model(tmp.path()).unwrap();
    assert!(model.weights.get("lm_head.weight").is_none());
}

#[test]
fn f16_and_bf16_bit_patterns_convert_exactly() {
    use ferry_model::load::gguf::{dequantize, GgmlType};
    // (bits, value): one, minus two, the smallest subnormal, infinity, a rounding-sensitive one.
    let f16_cases = [
        (0x3c00u16, 1.0f32),
        (0xc000, -2.0),
        (0x0001, 2f32.powi(-24)),
        (0x7c00, f32::INFINITY),
        (0x3555, 0.333_251_95),
    ];
    let bf16_cases = [
        (0x3f80u16, 1.0f32),
        (0xc000, -2.0),
        (0x3eab, 0.333_984_38),
        (0xff80, f32::NEG_INFINITY),
    ];
    for (ty, cases) in [
        (GgmlType::F16, &f16_cases[..]),
        (GgmlType::BF16, &bf16_cases[..]),
    ] {
        let bytes: Vec<u8> = cases.iter().flat_map(|(b, _)| b.to_le_bytes()).collect();
        let got = dequantize(ty, &bytes, cases.len()).unwrap();
        let want: Vec<f32> = cases.iter().map(|(_, v)| *v).collect();
        assert_eq!(got, want, "{ty}");
    }
    // The same bytes through a safetensors folder.
    let mut config = small_config();
    config.vocab_size = 1;
    config.hidden_size = 2;
    config.num_attention_heads = 1;
    config.head_dim = 2;
    config.intermediate_size = 1;
    config.num_hidden_layers = 0;
    let tmp = tempfile::tempdir().unwrap();
    write_config(tmp.path(), &config);
    let emb = [0x3555u16, 0x0001];
    let norm = [0x3eabu16, 0xc000];
    let lm_head = [0x3c00u16, 0x7c00];
    let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|b| b.to_le_bytes()).collect() };
    let (b_emb, b_norm, b_head) = (bytes(&emb), bytes(&norm), bytes(&lm_head));
    let views = vec![
        (
            "model.embed_tokens.weight",
            TensorView::new(Dtype::F16, vec![1, 2], &b_emb).unwrap(),
        ),
        (
            "model.norm.weight",
            TensorView::new(Dtype::BF16, vec![2], &b_norm).unwrap(),
        ),
        (
            "lm_head.weight",
            TensorView::new(Dtype::F16, vec![1, 2], &b_head).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).unwrap();
    let model = load_hf_folder(tmp.path()).unwrap();
    let get = |n: &str| model.weights.get(n).unwrap().data.clone();
    assert_eq!(
        get("model.embed_tokens.weight"),
        vec![0.333_251_95, 2f32.powi(-24)]
    );
    assert_eq!(get("model.norm.weight"), vec![0.333_984_38, -2.0]);
    assert_eq!(get("lm_head.weight"), vec![1.0, f32::INFINITY]);
}

#[test]
fn missing_tensor_names_file_and_tensor() {
    let config = small_config();
    let entries: Vec<Entry> = entries(&config, |_| Dtype::F32)
        .into_iter()
        .filter(|e| e.name != "model.layers.1.mlp.up_proj.weight")
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 1);
    let err = load_model(tmp.path()).unwrap_err();
    let file = tmp.path().join("model.safetensors");
    match &err {
        LoadError::MissingTensor { path, tensor } => {
            assert_eq!(path, &file);
            assert_eq!(tensor, "model.layers.1.mlp.up_proj.weight");
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "{}: missing tensor `model.layers.1.mlp.up_proj.weight`",
            file.display()
        )
    );
}

#[test]
fn tensor_missing_from_the_index_names_the_index() {
    let config = small_config();
    let entries: Vec<Entry> = entries(&config, |_| Dtype::F32)
        .into_iter()
        .filter(|e| e.name != "model.norm.weight")
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 2);
    match load_model(tmp.path()).unwrap_err() {
        LoadError::MissingTensor { path, tensor } => {
            assert_eq!(path, tmp.path().join("model.safetensors.index.json"));
            assert_eq!(tensor, "model.norm.weight");
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn misshapen_tensor_names_shard_and_tensor() {
    let config = small_config();
    let mut entries = entries(&config, |_| Dtype::F32);
    let bad = entries
        .iter_mut()
        .find(|e| e.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    bad.shape = vec![8, 4];
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 2);
    match load_model(tmp.path()).unwrap_err() {
        LoadError::TensorShape {
            path,
            tensor,
            expected,
            actual,
        } => {
            assert!(path.starts_with(tmp.path()));
            assert!(
                path.to_string_lossy().contains("-of-00002.safetensors"),
                "{path:?}"
            );
            assert_eq!(tensor, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!(expected, vec![4, 8]);
            assert_eq!(actual, vec![8, 4]);
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    let config = small_config();
    let entries = entries(&config, |i| if i == 3 { Dtype::I32 } else { Dtype::F32 });
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), &config, &entries, 1);
    match load_model(tmp.path()).unwrap_err() {
        LoadError::UnsupportedDtype { tensor, dtype, .. } => {
            assert_eq!(tensor, entries[3].name);
            assert!(dtype.starts_with("I32"), "{dtype}");
        }
        other => panic!("expected UnsupportedDtype, got {other:?}"),
    }
}

#[test]
fn folder_without_weights_and_unknown_files_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    write_config(tmp.path(), &small_config());
    let err = load_model(tmp.path()).unwrap_err();
    assert!(err.to_string().contains("no model.safetensors"), "{err}");

    let txt = tmp.path().join("weights.bin");
    std::fs::write(&txt, b"x").unwrap();
    assert!(matches!(load_model(&txt), Err(LoadError::Invalid { .. })));
    let missing = tmp.path().join("nope");
    assert!(matches!(load_model(&missing), Err(LoadError::Io { path, .. }) if path == missing));
}

#[test]
fn chat_template_string_list_and_jinja_file() {
    use ferry_model::load::tokenizer::read_chat_template;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    assert_eq!(read_chat_template(dir).unwrap(), None);

    std::fs::write(dir.join("chat_template.jinja"), "{{ jinja }}").unwrap();
    assert_eq!(
        read_chat_template(dir).unwrap().as_deref(),
        Some("{{ jinja }}")
    );

    let cfg = dir.join("tokenizer_config.json");
    std::fs::write(&cfg, r#"{"chat_template": "{{ plain }}"}"#).unwrap();
    assert_eq!(
        read_chat_template(dir).unwrap().as_deref(),
        Some("{{ plain }}")
    );

    let list = r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                      {"name": "default", "template": "D"}]}"#;
    std::fs::write(&cfg, list).unwrap();
    assert_eq!(read_chat_template(dir).unwrap().as_deref(), Some("D"));

    std::fs::write(&cfg, r#"{"chat_template": 7}"#).unwrap();
    match read_chat_template(dir).unwrap_err() {
        LoadError::Field { path, field, .. } => {
            assert_eq!(path, cfg);
            assert_eq!(field, "chat_template");
        }
        other => panic!("expected a Field error, got {other:?}"),
    }
}
