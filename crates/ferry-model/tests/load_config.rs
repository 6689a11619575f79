//! config.json / generation_config.json parsing: architectures, defaults, rope scaling, EOS
//! merging, and errors that name the file and field.

use ferry_core::TokenId;
use std::path::{Path, PathBuf};

use ferry_model::load::config_json::{parse_config, read_folder_config, to_hf_config_json};
use ferry_model::{LlamaConfig, LoadError, RopeScaling};
use serde_json::{json, Value};

fn path() -> PathBuf {
    PathBuf::from("/models/x/config.json")
}

/// SmolLM2-135M's config.json, trimmed.
fn llama() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": null,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2
    })
}

fn parse(v: &Value) -> Result<LlamaConfig, LoadError> {
    parse_config(v, &path())
}

#[test]
fn llama_fields_and_defaults() {
    let c = parse(&llama()).unwrap();
    let expected = LlamaConfig {
        architecture: "LlamaForCausalLM".into(),
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        attention_bias: false,
        o_proj_bias: false,
        qk_norm: false,
        qk_norm_whole: false,
        clip_qkv: None,
        moe: None,
        bos_token_id: Some(TokenId(1)),
        eos_token_ids: vec![TokenId(2)],
    };
    assert_eq!(c, expected);

    let mut minimal = llama();
    let obj = minimal.as_object_mut().unwrap();
    for key in [
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ] {
        obj.remove(key);
    }
    let c = parse(&minimal).unwrap();
    assert_eq!(c.num_key_value_heads, 9);
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert_eq!(c.rope_theta, 10_000.0);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.max_position_embeddings, 2048);
    assert_eq!(c.bos_token_id, None);
    assert!(c.eos_token_ids.is_empty());
}

#[test]
fn llama3_rope_scaling_and_eos_list() {
    let mut v = llama();
    v["rope_scaling"] = json!({
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
    });
    v["eos_token_id"] = json!([128001, 128008, 128009]);
    let c = parse(&v).unwrap();
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        })
    );
    assert_eq!(c.eos_token_ids, TokenId::list([128001, 128008, 128009]));
}

#[test]
fn linear_and_default_rope_and_legacy_type_key() {
    let mut v = llama();
    v["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    assert_eq!(
        parse(&v).unwrap().rope_scaling,
        Some(RopeScaling::Linear { factor: 2.0 })
    );
    v["rope_scaling"] = json!({"rope_type": "default"});
    assert_eq!(parse(&v).unwrap().rope_scaling, None);
}

#[test]
fn transformers5_rope_parameters() {
    let mut v = llama();
    let obj = v.as_object_mut().unwrap();
    obj.remove("rope_theta");
    obj.remove("rope_scaling");
    obj.insert(
        "rope_parameters".into(),
        json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}),
    );
    let c = parse(&v).unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
}

#[test]
fn unsupported_rope_type_is_named() {
    let mut v = llama();
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    match parse(&v) {
        Err(LoadError::UnsupportedRope { path: p, rope_type }) => {
            assert_eq!(p, path());
            assert_eq!(rope_type, "yarn");
        }
        other => panic!("expected UnsupportedRope, got {other:?}"),
    }
}

#[test]
fn qwen2_has_attention_bias() {
    let mut v = llama();
    v["architectures"] = json!(["Qwen2ForCausalLM"]);
    v["use_sliding_window"] = json!(false);
    let c = parse(&v).unwrap();
    assert!(c.attention_bias);
    assert!(!c.o_proj_bias, "Qwen2's o_proj has no bias");
    assert!(!c.qk_norm);
    v["attention_bias"] = json!(true);
    assert!(!parse(&v).unwrap().o_proj_bias);
}

/// transformers gives Llama and Qwen3 a bias on all four attention projections when
/// `attention_bias` is set, `o_proj` included.
#[test]
fn llama_and_qwen3_attention_bias_covers_o_proj() {
    for arch in ["LlamaForCausalLM", "Qwen3ForCausalLM"] {
        let mut v = llama();
        v["architectures"] = json!([arch]);
        let c = parse(&v).unwrap();
        assert!(!c.attention_bias && !c.o_proj_bias, "{arch}");
        v["attention_bias"] = json!(true);
        let c = parse(&v).unwrap();
        assert!(c.attention_bias && c.o_proj_bias, "{arch}");
        assert_eq!(parse(&to_hf_config_json(&c)).unwrap(), c, "{arch}");
    }
}

#[test]
fn qwen3_has_qk_norm_and_explicit_head_dim() {
    let mut v = llama();
    v["architectures"] = json!(["Qwen3ForCausalLM"]);
    v["head_dim"] = json!(128);
    v["attention_bias"] = json!(false);
    let c = parse(&v).unwrap();
    assert!(c.qk_norm);
    assert!(!c.attention_bias);
    assert_eq!(c.head_dim, 128);
}

#[test]
fn unsupported_architecture_is_named() {
    let mut v = llama();
    v["architectures"] = json!(["MambaForCausalLM"]);
    let err = parse(&v).unwrap_err();
    assert!(
        matches!(&err, LoadError::UnsupportedArchitecture { architecture, .. } if architecture == "MambaForCausalLM")
    );
    assert!(err.to_string().contains("/models/x/config.json"), "{err}");
}

#[test]
fn bad_fields_are_named() {
    let cases = [
        ("hidden_size", json!("big")),
        ("hidden_act", json!("gelu")),
        ("mlp_bias", json!(true)),
        ("eos_token_id", json!("</s>")),
    ];
    for (field, value) in cases {
        let mut v = llama();
        v[field] = value;
        match parse(&v) {
            Err(LoadError::Field {
                path: p, field: f, ..
            }) => {
                assert_eq!(p, path());
                assert_eq!(f, field);
            }
            other => panic!("{field}: expected a Field error, got {other:?}"),
        }
    }
    let relations = [
        ("num_key_value_heads", json!(0), "must be positive"),
        (
            "num_key_value_heads",
            json!(2),
            "2 does not divide num_attention_heads 9",
        ),
        (
            "head_dim",
            json!(63),
            "63 is odd; rotary embeddings need pairs",
        ),
        (
            "num_hidden_layers",
            json!(4_000_000_000u64),
            "4000000000 is more than 1024",
        ),
        (
            "num_attention_heads",
            json!(7),
            "must divide hidden_size 576",
        ),
    ];
    for (field, value, message) in relations {
        let mut v = llama();
        v[field] = value;
        let err = parse(&v).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("/models/x/config.json: field `{field}`: {message}")
        );
    }
    let mut v = llama();
    v.as_object_mut().unwrap().remove("vocab_size");
    let err = parse(&v).unwrap_err();
    assert_eq!(
        err.to_string(),
        "/models/x/config.json: field `vocab_size`: missing"
    );
}

fn write_folder(dir: &Path, config: &Value, generation: Option<&Value>) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    if let Some(g) = generation {
        std::fs::write(dir.join("generation_config.json"), g.to_string()).unwrap();
    }
}

#[test]
fn generation_config_eos_is_merged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut v = llama();
    v["eos_token_id"] = json!(2);
    write_folder(dir, &v, Some(&json!({"eos_token_id": [2, 7, 9]})));
    assert_eq!(
        read_folder_config(dir).unwrap().eos_token_ids,
        TokenId::list([2, 7, 9])
    );

    write_folder(dir, &v, Some(&json!({"eos_token_id": 5})));
    assert_eq!(
        read_folder_config(dir).unwrap().eos_token_ids,
        TokenId::list([2, 5])
    );
}

#[test]
fn invalid_json_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let err = read_folder_config(dir).unwrap_err();
    assert!(matches!(&err, LoadError::Json { path, .. } if path == &dir.join("config.json")));
}

#[test]
fn written_config_parses_back_identically() {
    let mut v = llama();
    v["rope_scaling"] = json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
    });
    v["eos_token_id"] = json!([2, 3]);
    for arch in ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"] {
        v["architectures"] = json!([arch]);
        let c = parse(&v).unwrap();
        assert_eq!(parse(&to_hf_config_json(&c)).unwrap(), c, "{arch}");
    }
}

/// A GGUF's rope factors (`RopeScaling::Factors`) written into a folder read back as they
/// were (ferry's own `rope_freqs` rope type), and a list of the wrong length is refused.
#[test]
fn rope_factors_round_trip_and_are_checked() {
    let mut c = parse(&llama()).unwrap();
    c.head_dim = 4;
    c.rope_scaling = Some(RopeScaling::Factors {
        factors: vec![1.0, 3.25],
    });
    let json = to_hf_config_json(&c);
    assert_eq!(json["rope_scaling"]["rope_type"], "rope_freqs");
    assert_eq!(parse(&json).unwrap(), c);
    let mut short = json.clone();
    short["rope_scaling"]["factors"] = json!([1.0]);
    match parse(&short).unwrap_err() {
        LoadError::Field { field, .. } => assert_eq!(field, "rope_scaling.factors"),
        other => panic!("expected Field, got {other:?}"),
    }
}
