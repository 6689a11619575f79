//! Reading and checking adapters: every refusal names what is wrong.

use super::random::{random_lora, write_peft_folder, RandomLora};
use super::*;
use crate::random_model::{small_config, small_moe_config};
use serde_json::Value;

const MAX_RANK: usize = 16;

fn spec(targets: &[TargetModule]) -> RandomLora {
    RandomLora {
        rank: 4,
        alpha: 8.0,
        targets: targets.to_vec(),
        use_rslora: false,
        seed: 7,
    }
}

fn attention() -> Vec<TargetModule> {
    vec![TargetModule::QProj, TargetModule::VProj]
}

/// The error of building `config` (edited by `edit`) over the tensors of a random adapter
/// (edited by `edit_tensors`) for `base`.
fn error_of(
    base: &LlamaConfig,
    edit: impl FnOnce(&mut Value),
    edit_tensors: impl FnOnce(&mut Vec<(String, Tensor)>),
) -> String {
    let (config, mut tensors) = random_lora(base, &spec(&attention()));
    let mut json = config.to_json();
    edit(&mut json);
    edit_tensors(&mut tensors);
    let result = LoraConfig::from_json(&json.to_string())
        .and_then(|c| LoraAdapter::from_f32(c, &tensors, base, MAX_RANK));
    result.expect_err("refused").to_string()
}

fn config_error(edit: impl FnOnce(&mut Value)) -> String {
    error_of(&small_config(), edit, |_| {})
}

#[test]
fn a_random_adapter_round_trips_through_a_peft_folder() {
    let base = small_config();
    let mut s = spec(&TargetModule::ALL);
    s.use_rslora = true;
    let (config, tensors) = random_lora(&base, &s);
    let dir = tempfile::tempdir().unwrap();
    write_peft_folder(dir.path(), &config, &tensors).unwrap();
    let loaded = LoraAdapter::load(dir.path(), &base, MAX_RANK).unwrap();
    let direct = LoraAdapter::from_f32(config, &tensors, &base, MAX_RANK).unwrap();
    assert_eq!(loaded.digest(), direct.digest());
    assert_eq!(loaded.targets(), &TargetModule::ALL);
    assert_eq!(loaded.max_rank(), 4);
    // rslora: alpha / sqrt(r).
    assert_eq!(
        loaded.rank_and_scale(1, TargetModule::DownProj),
        Some((4, 4.0))
    );
    let n: usize = tensors.iter().map(|(_, t)| t.numel()).sum();
    assert_eq!(loaded.n_params(), n);
}

#[test]
fn scale_rank_pattern_alpha_pattern_and_layers_to_transform_are_read() {
    let base = small_config();
    let (config, mut tensors) = random_lora(&base, &spec(&attention()));
    let mut json = config.to_json();
    json["rank_pattern"] = serde_json::json!({"layers.1.self_attn.v_proj": 2});
    json["alpha_pattern"] = serde_json::json!({"q_proj": 3.0});
    // Layer 1's v_proj at rank 2.
    for (name, t) in &mut tensors {
        if name.contains("layers.1.self_attn.v_proj") {
            if name.contains("lora_A") {
                *t = Tensor::new(vec![2, t.shape[1]], t.data[..2 * t.shape[1]].to_vec());
            } else {
                let rows: Vec<f32> = t.data.chunks(4).flat_map(|r| r[..2].to_vec()).collect();
                *t = Tensor::new(vec![t.shape[0], 2], rows);
            }
        }
    }
    let c = LoraConfig::from_json(&json.to_string()).unwrap();
    let a = LoraAdapter::from_f32(c, &tensors, &base, MAX_RANK).unwrap();
    assert_eq!(a.rank_and_scale(0, TargetModule::VProj), Some((4, 2.0)));
    assert_eq!(a.rank_and_scale(1, TargetModule::VProj), Some((2, 4.0)));
    assert_eq!(a.rank_and_scale(1, TargetModule::QProj), Some((4, 0.75)));
    assert_eq!(a.rank_and_scale(1, TargetModule::KProj), None);

    json["layers_to_transform"] = serde_json::json!([1]);
    tensors.retain(|(name, _)| name.contains("layers.1."));
    let c = LoraConfig::from_json(&json.to_string()).unwrap();
    let a = LoraAdapter::from_f32(c, &tensors, &base, MAX_RANK).unwrap();
    assert_eq!(a.rank_and_scale(0, TargetModule::QProj), None);
    assert_eq!(a.rank_and_scale(1, TargetModule::QProj), Some((4, 0.75)));
}

#[test]
fn config_refusals_name_the_key() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("r", serde_json::json!(0), "`r`"),
        ("r", serde_json::json!(32), "rank 32"),
        (
            "modules_to_save",
            serde_json::json!(["lm_head"]),
            "`modules_to_save`",
        ),
        ("bias", serde_json::json!("lora_only"), "`bias`"),
        ("use_dora", serde_json::json!(true), "`use_dora`"),
        (
            "fan_in_fan_out",
            serde_json::json!(true),
            "`fan_in_fan_out`",
        ),
        ("lora_bias", serde_json::json!(true), "`lora_bias`"),
        ("peft_type", serde_json::json!("IA3"), "`peft_type`"),
        (
            "target_modules",
            serde_json::json!(".*q_proj"),
            "regular expression",
        ),
        (
            "target_modules",
            serde_json::json!(["lm_head"]),
            "\"lm_head\" names no module",
        ),
        (
            "target_modules",
            serde_json::json!(["embed_tokens"]),
            "\"embed_tokens\"",
        ),
        ("target_modules", serde_json::json!([]), "empty"),
        ("target_modules", Value::Null, "`target_modules`: missing"),
        (
            "rank_pattern",
            serde_json::json!({"q_.*": 2}),
            "`rank_pattern`",
        ),
        ("layers_to_transform", serde_json::json!([5]), "layer 5"),
        ("layers_pattern", serde_json::json!("h"), "`layers_pattern`"),
        (
            "exclude_modules",
            serde_json::json!(["q_proj"]),
            "`exclude_modules`",
        ),
        (
            "target_parameters",
            serde_json::json!(["mlp.experts.gate_up_proj"]),
            "`target_parameters`",
        ),
    ];
    for (key, value, want) in cases {
        let got = config_error(|j| j[key] = value.clone());
        assert!(got.contains(want), "{key} = {value}: {got}");
    }
    let got = config_error(|j| j["rank_pattern"] = serde_json::json!({"q_proj": 17}));
    assert!(
        got.contains("rank_pattern.q_proj") && got.contains("rank 17"),
        "{got}"
    );
    let got = config_error(|j| {
        j["rank_pattern"] = serde_json::json!({"q_proj": 2, "self_attn.q_proj": 3})
    });
    assert!(got.contains("ambiguous"), "{got}");
    assert!(LoraConfig::from_json("[1]")
        .unwrap_err()
        .to_string()
        .contains("object"));
    assert!(LoraConfig::from_json("{")
        .unwrap_err()
        .to_string()
        .contains(CONFIG_FILE));
}

#[test]
fn moe_models_take_attention_targets_only() {
    let base = small_moe_config("Qwen3MoeForCausalLM");
    let (config, tensors) = random_lora(&base, &spec(&attention()));
    LoraAdapter::from_f32(config, &tensors, &base, MAX_RANK).expect("attention targets load");
    let got = error_of(
        &base,
        |j| j["target_modules"] = serde_json::json!(["q_proj", "gate_proj"]),
        |_| {},
    );
    assert!(
        got.contains("\"gate_proj\"") && got.contains("mixture-of-experts"),
        "{got}"
    );
    let got = error_of(
        &base,
        |j| j["target_modules"] = serde_json::json!("all-linear"),
        |_| {},
    );
    assert!(got.contains("all-linear"), "{got}");
}

#[test]
fn tensor_refusals_name_the_tensor() {
    let base = small_config();
    let q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let got = error_of(&base, |_| {}, |t| t.retain(|(n, _)| n != q_a));
    assert_eq!(got, format!("missing tensor `{q_a}`"));

    let got = error_of(
        &base,
        |_| {},
        |t| {
            let (_, a) = t.iter_mut().find(|(n, _)| n == q_a).unwrap();
            *a = Tensor::new(vec![4, 32], a.data[..128].to_vec());
        },
    );
    assert!(
        got.contains(q_a) && got.contains("[4, 32]") && got.contains("[4, 64]"),
        "{got}"
    );

    let extra = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight";
    let got = error_of(
        &base,
        |_| {},
        |t| t.push((extra.into(), Tensor::new(vec![4, 64], vec![0.0; 256]))),
    );
    assert!(
        got.contains(extra) && got.starts_with("unexpected tensor"),
        "{got}"
    );

    let embed = "base_model.model.model.embed_tokens.lora_embedding_A";
    let got = error_of(
        &base,
        |_| {},
        |t| t.push((embed.into(), Tensor::new(vec![4, 97], vec![0.0; 388]))),
    );
    assert!(got.contains(embed), "{got}");

    let got = error_of(
        &base,
        |_| {},
        |t| t.iter_mut().find(|(n, _)| n == q_a).unwrap().1.data[3] = f32::NAN,
    );
    assert!(got.contains(q_a) && got.contains("not finite"), "{got}");
}

#[test]
fn stored_dtypes_and_folders_are_checked() {
    let base = small_config();
    let (config, tensors) = random_lora(&base, &spec(&attention()));
    let half: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, t)| {
            t.data
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect()
        })
        .collect();
    let views = tensors.iter().zip(&half).map(|((name, t), b)| LoraTensor {
        name,
        dtype: WeightDtype::BF16,
        shape: &t.shape,
        bytes: b,
    });
    let a = LoraAdapter::from_tensors(config.clone(), views, &base, MAX_RANK).unwrap();
    let f32_of_bf16: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let d = t
                .data
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            (n.clone(), Tensor::new(t.shape.clone(), d))
        })
        .collect();
    let b = LoraAdapter::from_f32(config.clone(), &f32_of_bf16, &base, MAX_RANK).unwrap();
    assert_eq!(a.digest(), b.digest(), "BF16 is held as its f32 values");

    let q8 = vec![0u8; 34];
    let (name, t) = &tensors[0];
    let views = [LoraTensor {
        name,
        dtype: WeightDtype::Q8_0,
        shape: &t.shape,
        bytes: &q8,
    }];
    let got = LoraAdapter::from_tensors(config, views, &base, MAX_RANK)
        .unwrap_err()
        .to_string();
    assert!(got.contains(name) && got.contains("Q8_0"), "{got}");

    let dir = tempfile::tempdir().unwrap();
    let got = LoraAdapter::load(dir.path(), &base, MAX_RANK)
        .unwrap_err()
        .to_string();
    assert!(got.contains(CONFIG_FILE), "{got}");
}

#[test]
fn an_adapter_checks_the_base_it_is_loaded_into() {
    let base = small_config();
    let (config, tensors) = random_lora(&base, &spec(&attention()));
    let a = LoraAdapter::from_f32(config, &tensors, &base, MAX_RANK).unwrap();
    assert_eq!(a.check_base(&base), Ok(()));
    let wider = LlamaConfig {
        num_attention_heads: 8,
        ..small_config()
    };
    assert!(a.check_base(&wider).unwrap_err().contains("q_proj"));
    let deeper = LlamaConfig {
        num_hidden_layers: 3,
        ..small_config()
    };
    assert!(a.check_base(&deeper).unwrap_err().contains("3"));
}
