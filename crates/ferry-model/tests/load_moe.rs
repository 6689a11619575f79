//! MoE models from Hugging Face folders: every architecture's config keys read (and written
//! back by `ferry make-model`), bad configs refused naming the key, and the forward checked
//! against transformers (`tests/golden/moe.json`, made by `scripts/golden/make_moe.py` from
//! the random-weight folders under `tests/fixtures/moe/`).

use std::path::Path;

use ferry_model::load::config_json::to_hf_config_json;
use ferry_model::random_model::{random_weights, small_moe_config, MOE_ARCHITECTURES};
use ferry_model::{load_model, LoadError, LoadedModel};
use serde_json::{json, Value};

fn write_folder(dir: &Path, arch: &str) -> LoadedModel {
    let config = small_moe_config(arch);
    let model = LoadedModel {
        weights: random_weights(&config, 17),
        config,
        tokenizer: None,
        chat_template: None,
        source: "random".into(),
    };
    ferry_model::tiny::write_hf_folder(&model, dir).unwrap();
    model
}

#[test]
fn every_moe_architecture_round_trips_through_a_folder() {
    for arch in MOE_ARCHITECTURES {
        let tmp = tempfile::tempdir().unwrap();
        let written = write_folder(tmp.path(), arch);
        let loaded = load_model(tmp.path()).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(loaded.config, written.config, "{arch}");
        assert_eq!(loaded.weights, written.weights, "{arch}");
    }
}

/// The folder's config.json with `edit` applied, loaded.
fn load_edited(arch: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> LoadError {
    let tmp = tempfile::tempdir().unwrap();
    let written = write_folder(tmp.path(), arch);
    let mut json = to_hf_config_json(&written.config);
    edit(json.as_object_mut().unwrap());
    std::fs::write(tmp.path().join("config.json"), json.to_string()).unwrap();
    load_model(tmp.path()).expect_err("refused")
}

/// An edit of a config.json object.
type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, Value>)>;

#[test]
fn configs_ferry_cannot_serve_are_refused_naming_the_key() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "Qwen3MoeForCausalLM",
            Box::new(|c| {
                c.insert("num_experts_per_tok".into(), json!(9));
            }),
            "num_experts_per_tok",
        ),
        (
            "Qwen3MoeForCausalLM",
            Box::new(|c| {
                c.insert("mlp_only_layers".into(), json!([3]));
            }),
            "mlp_only_layers",
        ),
        (
            "Qwen2MoeForCausalLM",
            Box::new(|c| {
                c.remove("shared_expert_intermediate_size");
            }),
            "shared_expert_intermediate_size",
        ),
        (
            "MixtralForCausalLM",
            Box::new(|c| {
                c.insert("num_local_experts".into(), json!(0));
            }),
            "num_local_experts",
        ),
        (
            "MixtralForCausalLM",
            Box::new(|c| {
                c.insert("sliding_window".into(), json!(4096));
            }),
            "sliding_window",
        ),
        (
            "OlmoeForCausalLM",
            Box::new(|c| {
                c.insert("scoring_func".into(), json!("sigmoid"));
            }),
            "scoring_func",
        ),
        (
            "Qwen3MoeForCausalLM",
            Box::new(|c| {
                c.insert("decoder_sparse_step".into(), json!(0));
            }),
            "decoder_sparse_step",
        ),
    ];
    for (arch, edit, key) in cases {
        let err = load_edited(arch, edit).to_string();
        assert!(err.contains(key), "{arch}: `{err}` should name {key}");
    }
}

#[test]
fn decoder_sparse_step_and_mlp_only_layers_pick_the_dense_layers() {
    let tmp = tempfile::tempdir().unwrap();
    write_folder(tmp.path(), "Qwen3MoeForCausalLM");
    let path = tmp.path().join("config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["decoder_sparse_step"] = json!(2);
    json["mlp_only_layers"] = json!([]);
    json["num_hidden_layers"] = json!(3);
    let config =
        ferry_model::load::config_json::parse_config(&json, &path).expect("a valid config");
    // Layer l routes when (l + 1) % step == 0.
    assert_eq!(config.moe.unwrap().sparse_layers, [false, true, false]);
}

mod model_support;

use ferry_model::{Executor, LlamaModel};
use model_support::{arena_for, argmax, build_plan, step, Pool, Seq};

/// Router probabilities closer than this to a tie are not compared: f32 rounding may pick
/// either expert (the fixtures keep every decision at least 2e-4 from a tie).
const NEAR_TIE: f64 = 1e-5;

fn golden() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/moe.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn fixture(case: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/moe")
        .join(case)
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits of every position of `prompt`, one position per step (each step's KV from the
/// arena), and the routing of every position from one capturing prefill.
fn run(model: LlamaModel, prompt: &[u32]) -> (Vec<Vec<f32>>, Vec<u16>) {
    let mut model = model.with_routed_experts(true).unwrap();
    let mut kv = arena_for(&model, 32, 4);
    let mut pool = Pool::new(32, 4, 5);
    let mut seq = Seq::new(0, prompt.to_vec());
    let logits = (0..prompt.len())
        .map(|_| {
            let mut seqs = [&mut seq];
            seqs[0].tokens = prompt[..seqs[0].computed + 1].to_vec();
            step(&mut model, &mut kv, &mut pool, &mut seqs, &[1])
                .row(0)
                .to_vec()
        })
        .collect();
    let mut whole = Seq::new(1, prompt.to_vec());
    let plan = build_plan(&mut pool, &mut [&mut whole], &[prompt.len()]);
    let out = model.execute(&plan, &mut kv).unwrap();
    (logits, out.routed[0].ids.clone())
}

/// transformers 5's in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
/// [E, H, I]), saved with `save_original_format=False`, loads as the same parameters as the
/// hub's per-expert layout.
#[test]
fn a_fused_expert_checkpoint_loads_as_the_per_expert_one() {
    let fused = load_model(&fixture("qwen3_moe_fused")).unwrap();
    let per_expert = load_model(&fixture("qwen3_moe")).unwrap();
    assert_eq!(fused.config, per_expert.config);
    assert_eq!(fused.weights, per_expert.weights);
    let ferry_model::LoadedModel { config, .. } = fused;
    let stored = ferry_model::load_model_stored(&fixture("qwen3_moe_fused")).unwrap();
    assert_eq!(
        stored.weights.tensors.len() + stored.weights.stored.len(),
        ferry_model::expected_tensors(&config).len()
    );
}

#[test]
fn moe_forward_matches_transformers_logits_routing_and_greedy_tokens() {
    let g = golden();
    let tol = g["tolerance_logits_abs"].as_f64().unwrap();
    let cases = g["cases"].as_object().unwrap();
    assert!(cases.len() >= 5, "every architecture has a case");
    for (name, case) in cases {
        let loaded = load_model(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let config = loaded.config.clone();
        let moe = config.moe.clone().expect("an MoE config");
        let sparse: Vec<usize> = (0..config.num_hidden_layers)
            .filter(|&l| moe.is_sparse(l))
            .collect();
        assert_eq!(
            sparse,
            ids(&case["moe_layers"])
                .iter()
                .map(|&l| l as usize)
                .collect::<Vec<_>>(),
            "{name}"
        );
        let k = moe.top_k;
        let mut compared = 0;
        for (p, prompt) in case["prompts"].as_array().unwrap().iter().enumerate() {
            let tokens = ids(&prompt["ids"]);
            let model = LlamaModel::new(&config, &loaded.weights).unwrap();
            let (logits, routing) = run(model, &tokens);
            for (pos, want) in prompt["logits"].as_array().unwrap().iter().enumerate() {
                let want = floats(want);
                for (v, (&got, want)) in logits[pos].iter().zip(&want).enumerate() {
                    assert!(
                        (got as f64 - want).abs() <= tol,
                        "{name} prompt {p} position {pos} token {v}: {got} vs transformers {want}"
                    );
                }
            }
            // A row per decoder layer; the golden's rows are the MoE layers'.
            let width = config.num_hidden_layers * k;
            let routed = prompt["routed_experts"].as_array().unwrap();
            let margins = prompt["router_margin"].as_array().unwrap();
            for (pos, (want, margin)) in routed.iter().zip(margins).enumerate() {
                let layers: &Vec<Value> = want.as_array().unwrap();
                let layer_margins: &Vec<Value> = margin.as_array().unwrap();
                for (j, (want, margin)) in layers.iter().zip(layer_margins).enumerate() {
                    let want = ids(want);
                    let margin = floats(margin);
                    let got = &routing[pos * width + sparse[j] * k..][..k];
                    // The top-(r+1) set is decided by the gap after pick r.
                    for r in 0..k {
                        if margin[r] > NEAR_TIE {
                            let mut a: Vec<u32> = got[..=r].iter().map(|&e| e as u32).collect();
                            let mut b = want[..=r].to_vec();
                            a.sort();
                            b.sort();
                            assert_eq!(
                                a,
                                b,
                                "{name} prompt {p} position {pos} MoE layer {j}: top-{}",
                                r + 1
                            );
                            compared += 1;
                        }
                    }
                }
            }
        }
        assert!(compared > 0, "{name}: some routing compared");

        // Greedy continuation of prompt 0.
        let greedy = &case["greedy"];
        let prompt = ids(&case["prompts"][greedy["prompt"].as_u64().unwrap() as usize]["ids"]);
        let mut model = LlamaModel::new(&config, &loaded.weights).unwrap();
        let mut kv = arena_for(&model, 32, 4);
        let mut pool = Pool::new(32, 4, 9);
        let mut seq = Seq::new(0, prompt.clone());
        let mut count = prompt.len();
        let mut got = Vec::new();
        for _ in 0..ids(&greedy["ids"]).len() {
            let next =
                argmax(step(&mut model, &mut kv, &mut pool, &mut [&mut seq], &[count]).row(0));
            got.push(next);
            seq.tokens.push(next);
            count = 1;
        }
        assert_eq!(got, ids(&greedy["ids"]), "{name}: greedy tokens");
    }
}

/// `store` in transformers 5's in-memory layout: each MoE layer's experts fused into
/// `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], and
/// Mixtral's router under `mlp.gate.weight` (what a trainer's `state_dict()` holds).
fn fuse(
    config: &ferry_model::LlamaConfig,
    store: &ferry_model::WeightStore,
) -> ferry_model::WeightStore {
    let mut out = store.clone();
    let moe = config.moe.as_ref().unwrap();
    let (h, i) = (config.hidden_size, moe.expert_intermediate_size);
    for l in (0..config.num_hidden_layers).filter(|&l| moe.is_sparse(l)) {
        let p = format!("model.layers.{l}");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..moe.num_experts {
            let [g, u, d] = moe.naming.expert(e).map(|n| format!("{p}.{n}"));
            let mut take = |name: &str| out.tensors.remove(name).unwrap().data;
            gate_up.extend(take(&g));
            gate_up.extend(take(&u));
            down.extend(take(&d));
        }
        let n = moe.num_experts;
        out.insert(
            format!("{p}.mlp.experts.gate_up_proj"),
            ferry_model::Tensor::new(vec![n, 2 * i, h], gate_up),
        );
        out.insert(
            format!("{p}.mlp.experts.down_proj"),
            ferry_model::Tensor::new(vec![n, h, i], down),
        );
        if moe.naming == ferry_model::ExpertNaming::Mixtral {
            let router = out
                .tensors
                .remove(&format!("{p}.block_sparse_moe.gate.weight"))
                .unwrap();
            out.insert(format!("{p}.mlp.gate.weight"), router);
        }
    }
    out
}

/// A safetensors body (f32) of `store`.
fn body(store: &ferry_model::WeightStore) -> Vec<u8> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = store
        .tensors
        .iter()
        .map(|(name, t)| {
            (
                name.clone(),
                t.shape.clone(),
                t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(name, shape, b)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Logits bits of a short prefill and two greedy decode steps.
fn outputs(model: &mut LlamaModel) -> Vec<Vec<u32>> {
    let mut kv = arena_for(model, 16, 4);
    let mut pool = Pool::new(16, 4, 3);
    let mut seq = Seq::new(0, vec![5, 17, 3, 60, 2]);
    let mut count = seq.tokens.len();
    (0..3)
        .map(|_| {
            let row = step(model, &mut kv, &mut pool, &mut [&mut seq], &[count])
                .row(0)
                .to_vec();
            seq.tokens.push(argmax(&row));
            count = 1;
            row.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

#[test]
fn a_trainers_fused_state_dict_pushes_as_the_per_expert_weights() {
    use ferry_model::{SafetensorsPush, WeightError};
    for arch in MOE_ARCHITECTURES {
        let config = small_moe_config(arch);
        let (wa, wb) = (random_weights(&config, 1), random_weights(&config, 2));
        let want = outputs(&mut LlamaModel::new(&config, &wb).unwrap());
        let fused = fuse(&config, &wb);
        assert!(fused
            .tensors
            .keys()
            .any(|n| n.ends_with("mlp.experts.gate_up_proj")));

        // Whole, through `prepare` (a parsed body or tensors handed over in process).
        let mut model = LlamaModel::new(&config, &wa).unwrap();
        assert_ne!(outputs(&mut model), want);
        let prepared = model
            .weight_ops()
            .preparer()
            .prepare(fused.clone())
            .unwrap();
        assert!(
            prepared.complete,
            "{arch}: the fused tensors are every expert"
        );
        model.weight_ops_mut().install(prepared).unwrap();
        assert_eq!(outputs(&mut model), want, "{arch}: prepared");

        // Streamed, in pieces that split tensors and elements.
        let mut model = LlamaModel::new(&config, &wa).unwrap();
        let mut push = SafetensorsPush::new(model.weight_ops().preparer());
        for piece in body(&fused).chunks(1001) {
            push.feed(piece).unwrap();
        }
        let prepared = push.finish().unwrap();
        assert!(prepared.complete);
        model.weight_ops_mut().install(prepared).unwrap();
        assert_eq!(outputs(&mut model), want, "{arch}: pushed");

        // One fused tensor alone patches its experts; a wrong shape is refused by its name.
        let mut model = LlamaModel::new(&config, &wa).unwrap();
        let down = "model.layers.0.mlp.experts.down_proj";
        let mut one = ferry_model::WeightStore::default();
        one.insert(down, fused.tensors[down].clone());
        let prepared = model.weight_ops().preparer().prepare(one).unwrap();
        assert!(!prepared.complete);
        model.weight_ops_mut().install(prepared).unwrap();
        let mut patched = wa.clone();
        let moe = config.moe.as_ref().unwrap();
        for e in 0..moe.num_experts {
            let name = format!("model.layers.0.{}", moe.naming.expert(e)[2]);
            patched.insert(name.clone(), wb.tensors[&name].clone());
        }
        assert_eq!(
            outputs(&mut model),
            outputs(&mut LlamaModel::new(&config, &patched).unwrap()),
            "{arch}: patch"
        );

        let mut bad = ferry_model::WeightStore::default();
        let t = &fused.tensors[down];
        let shape = vec![t.shape[0], t.shape[2], t.shape[1]];
        bad.insert(down, ferry_model::Tensor::new(shape, t.data.clone()));
        let err = model
            .weight_ops()
            .preparer()
            .prepare(bad.clone())
            .unwrap_err();
        assert!(
            matches!(&err, WeightError::BadShape { name, .. } if name == down),
            "{arch}: {err}"
        );
        let mut push = SafetensorsPush::new(model.weight_ops().preparer());
        let err = push.feed(&body(&bad)).unwrap_err();
        assert!(
            matches!(&err, WeightError::BadShape { name, .. } if name == down),
            "{arch}: {err}"
        );
    }
}
