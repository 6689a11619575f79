//! In-place weight updates and sleep for the Llama model, through the engine's contract
//! (`preparer().prepare(..)` then `install(..)`, `offload`, `drop_weights`, `restore`): pushed
//! tensors give bit for bit the outputs of a model built from them, bad pushes change nothing,
//! and the sleep states refuse steps until the weights are back.

mod model_support;

use ferry_core::ModelOutput;
use ferry_core::TokenId;
use ferry_model::random_model::{
    random_weights, small_config, small_moe_config, MOE_ARCHITECTURES,
};
use ferry_model::tiny::{tiny_model, write_hf_folder};
use ferry_model::{
    expected_tensors, load_model, ExecError, Executor, LlamaConfig, LlamaModel, LlamaWeights,
    RetiredWeights, Tensor, WeightError, WeightResidency, WeightStore,
};
use model_support::*;

const BS: usize = 4;

/// What a model computes for a fixed prompt: the logits bits of a prefill and three greedy
/// decode steps, and the tokens it picks. Runs on a fresh arena each time.
#[derive(Debug, PartialEq)]
struct Outputs {
    logits: Vec<Vec<u32>>,
    tokens: Vec<u32>,
}

fn outputs(model: &mut LlamaModel) -> Outputs {
    let vocab = model.config().vocab_size;
    let mut kv = arena_for(model, 16, BS);
    let mut pool = Pool::new(16, BS, 7);
    let mut seq = Seq::new(0, random_tokens(7, vocab, 8));
    let (mut logits, mut tokens) = (Vec::new(), Vec::new());
    let mut count = seq.tokens.len();
    for _ in 0..4 {
        let out = step(model, &mut kv, &mut pool, &mut [&mut seq], &[count]);
        let token = argmax(out.row(0));
        logits.push(bits(out.row(0)));
        tokens.push(token);
        seq.tokens.push(token);
        count = 1;
    }
    Outputs { logits, tokens }
}

fn model_from(config: &LlamaConfig, store: &WeightStore) -> LlamaModel {
    LlamaModel::new(config, store).expect("valid weights")
}

/// The engine's path: prepare (any thread), then install (the engine thread).
fn push(model: &mut LlamaModel, store: WeightStore) -> Result<Option<RetiredWeights>, WeightError> {
    let prepared = model.weight_ops().preparer().prepare(store)?;
    model.weight_ops_mut().install(prepared)
}

/// One `execute` step of a 3-token prompt, as the engine runs it.
fn execute_once(model: &mut LlamaModel) -> Result<ModelOutput, ExecError> {
    let mut kv = arena_for(model, 8, BS);
    let mut pool = Pool::new(8, BS, 3);
    let mut seq = Seq::new(0, vec![1, 2, 3]);
    let plan = build_plan(&mut pool, &mut [&mut seq], &[3]);
    model.execute(&plan, &mut kv)
}

/// The tensors of `store` whose index (in name order) is `i mod n`.
fn share(store: &WeightStore, i: usize, n: usize) -> WeightStore {
    let mut part = WeightStore::default();
    for (_, (name, t)) in store.tensors.iter().enumerate().filter(|(j, _)| j % n == i) {
        part.insert(name.clone(), t.clone());
    }
    part
}

/// Every variant of the fused layout: untied head; q/k/v and o_proj biases, q/k norms and a
/// tied head; and each MoE architecture (routers, experts, a shared expert, whole-projection
/// q/k norms, dense layers among MoE ones).
fn configs() -> Vec<LlamaConfig> {
    let mut configs = vec![
        small_config(),
        LlamaConfig {
            architecture: "Qwen3ForCausalLM".into(),
            attention_bias: true,
            o_proj_bias: true,
            qk_norm: true,
            tie_word_embeddings: true,
            ..small_config()
        },
    ];
    configs.extend(MOE_ARCHITECTURES.map(small_moe_config));
    configs
}

#[test]
fn partial_pushes_of_every_tensor_equal_a_model_built_from_them() {
    for config in configs() {
        let (wa, wb) = (random_weights(&config, 1), random_weights(&config, 2));
        let want_a = outputs(&mut model_from(&config, &wa));
        let want_b = outputs(&mut model_from(&config, &wb));
        assert_ne!(want_a.logits, want_b.logits);

        let mut model = model_from(&config, &wa);
        for i in 0..3 {
            let retired = push(&mut model, share(&wb, i, 3)).unwrap();
            assert!(retired.is_none(), "a patch replaces no buffer");
        }
        assert_eq!(model.weight_ops().residency(), WeightResidency::Resident);
        assert_eq!(outputs(&mut model), want_b, "{}", config.architecture);
    }
}

#[test]
fn a_complete_push_swaps_and_equals_a_model_built_from_it() {
    for config in configs() {
        let (wa, wb) = (random_weights(&config, 3), random_weights(&config, 4));
        let want_b = outputs(&mut model_from(&config, &wb));
        let mut model = model_from(&config, &wa);
        let prepared = model.weight_ops().preparer().prepare(wb).unwrap();
        let n = expected_tensors(&config).len();
        assert!(prepared.complete);
        assert_eq!(prepared.n_tensors, n);
        let retired = model.weight_ops_mut().install(prepared).unwrap();
        assert!(retired.is_some_and(|r| r.is::<LlamaWeights>()));
        assert_eq!(outputs(&mut model), want_b, "{}", config.architecture);
    }
}

#[test]
fn pushing_one_q_proj_changes_outputs_as_a_patched_store_does() {
    let tiny = tiny_model();
    let config = tiny.config.clone();
    let other = random_weights(&config, 5);
    let name = "model.layers.1.self_attn.q_proj.weight";
    let mut patched = tiny.weights.clone();
    patched.insert(name, other.get(name).unwrap().clone());
    let want = outputs(&mut model_from(&config, &patched));

    let mut model = model_from(&config, &tiny.weights);
    let before = outputs(&mut model);
    let mut one = WeightStore::default();
    one.insert(name, other.get(name).unwrap().clone());
    let prepared = model.weight_ops().preparer().prepare(one).unwrap();
    assert_eq!(
        (prepared.n_tensors, prepared.n_bytes, prepared.complete),
        (1, 64 * 64 * 4, false)
    );
    model.weight_ops_mut().install(prepared).unwrap();
    let after = outputs(&mut model);
    assert_ne!(after.logits, before.logits);
    assert_eq!(after, want);
}

#[test]
fn bad_tensors_are_refused_by_name_before_anything_changes() {
    let config = small_config();
    let wa = random_weights(&config, 6);
    let mut model = model_from(&config, &wa);
    let before = outputs(&mut model);
    let good = share(&random_weights(&config, 7), 0, 2);
    let v_proj = "model.layers.0.self_attn.v_proj.weight";

    let mut unknown = good.clone();
    unknown.insert(
        "model.layers.9.mlp.up_proj.weight",
        Tensor::new(vec![1], vec![0.0]),
    );
    let mut bad_shape = good.clone();
    bad_shape.insert(v_proj, Tensor::new(vec![64, 32], vec![0.0; 64 * 32]));
    let mut short = good.clone();
    short.insert(
        v_proj,
        Tensor {
            shape: vec![32, 64],
            data: vec![0.0; 5],
        },
    );
    let mut tied_head = good;
    tied_head.insert(
        "lm_head.weight",
        Tensor::new(vec![97, 64], vec![0.0; 97 * 64]),
    );

    let unknown_err = WeightError::UnknownTensor {
        name: "model.layers.9.mlp.up_proj.weight".into(),
    };
    assert_eq!(push(&mut model, unknown).unwrap_err(), unknown_err);
    let shape_err = WeightError::BadShape {
        name: v_proj.into(),
        expected: vec![32, 64],
        got: vec![64, 32],
    };
    assert_eq!(push(&mut model, bad_shape).unwrap_err(), shape_err);
    assert!(matches!(
        push(&mut model, short),
        Err(WeightError::Malformed(m)) if m.contains(v_proj)
    ));
    assert_eq!(
        push(&mut model, WeightStore::default()).unwrap_err(),
        WeightError::Empty
    );
    assert_eq!(
        outputs(&mut model),
        before,
        "a refused push changes nothing"
    );

    // With tied embeddings the head is the embedding table, not a parameter.
    let tied = LlamaConfig {
        tie_word_embeddings: true,
        ..config
    };
    let mut tied_model = model_from(&tied, &random_weights(&tied, 8));
    let tied_before = outputs(&mut tied_model);
    let head_err = WeightError::UnknownTensor {
        name: "lm_head.weight".into(),
    };
    assert_eq!(push(&mut tied_model, tied_head).unwrap_err(), head_err);
    assert_eq!(outputs(&mut tied_model), tied_before);
}

#[test]
fn weights_prepared_for_another_shape_are_refused() {
    let config = small_config();
    let wider = LlamaConfig {
        intermediate_size: 128,
        ..small_config()
    };
    let mut model = model_from(&config, &random_weights(&config, 9));
    let before = outputs(&mut model);
    let other = model_from(&wider, &random_weights(&wider, 9));
    let prepared = other
        .weight_ops()
        .preparer()
        .prepare(share(&random_weights(&wider, 10), 0, 4))
        .unwrap();
    let err = model.weight_ops_mut().install(prepared).unwrap_err();
    assert_eq!(err, WeightError::WrongExecutor);
    assert_eq!(outputs(&mut model), before);
}

#[test]
fn check_config_names_the_field_that_differs() {
    let config = small_config();
    let model = model_from(&config, &random_weights(&config, 11));
    let preparer = model.weight_ops().preparer();
    assert_eq!(preparer.check_config(&config), Ok(()));
    // Token ids steer stopping, not the forward.
    let other_eos = LlamaConfig {
        eos_token_ids: TokenId::list([2, 3]),
        ..small_config()
    };
    assert_eq!(preparer.check_config(&other_eos), Ok(()));

    let deeper = LlamaConfig {
        num_hidden_layers: 3,
        ..small_config()
    };
    let want = WeightError::ConfigMismatch {
        field: "num_hidden_layers",
        running: "2".into(),
        new: "3".into(),
    };
    assert_eq!(preparer.check_config(&deeper), Err(want));
    let wider = LlamaConfig {
        hidden_size: 128,
        ..small_config()
    };
    let want = WeightError::ConfigMismatch {
        field: "hidden_size",
        running: "64".into(),
        new: "128".into(),
    };
    assert_eq!(preparer.check_config(&wider), Err(want));
    let theta = LlamaConfig {
        rope_theta: 500000.0,
        ..small_config()
    };
    assert!(matches!(
        preparer.check_config(&theta),
        Err(WeightError::ConfigMismatch {
            field: "rope_theta",
            ..
        })
    ));
}

/// The engine's `update_weights_from_disk`: load the folder, check its config, prepare a
/// complete set, install.
#[test]
fn reload_from_a_folder_installs_its_weights() {
    let tiny = tiny_model();
    let config = tiny.config.clone();
    let new_weights = random_weights(&config, 12);
    let want = outputs(&mut model_from(&config, &new_weights));
    let tmp = tempfile::tempdir().unwrap();
    let folder = ferry_model::LoadedModel {
        weights: new_weights,
        ..tiny_model()
    };
    write_hf_folder(&folder, tmp.path()).unwrap();

    let mut model = model_from(&config, &tiny.weights);
    let preparer = model.weight_ops().preparer();
    let loaded = load_model(tmp.path()).unwrap();
    preparer.check_config(&loaded.config).unwrap();
    let prepared = preparer.prepare(loaded.weights).unwrap();
    assert!(prepared.complete);
    model.weight_ops_mut().install(prepared).unwrap();
    assert_eq!(outputs(&mut model), want);
}

#[test]
fn offload_refuses_steps_until_restore_and_keeps_the_weights() {
    let tiny = tiny_model();
    let mut model = model_from(&tiny.config, &tiny.weights);
    let before = outputs(&mut model);
    let sampled = execute_once(&mut model).unwrap();

    model.weight_ops_mut().offload();
    assert_eq!(model.weight_ops().residency(), WeightResidency::Offloaded);
    assert!(matches!(
        execute_once(&mut model),
        Err(ExecError::WeightsUnloaded)
    ));
    model.weight_ops_mut().restore().unwrap();
    assert_eq!(model.weight_ops().residency(), WeightResidency::Resident);
    assert_eq!(execute_once(&mut model).unwrap(), sampled);
    assert_eq!(outputs(&mut model), before);
}

#[test]
fn a_patch_while_offloaded_applies_and_shows_after_restore() {
    let config = small_config();
    let (wa, wb) = (random_weights(&config, 13), random_weights(&config, 14));
    let want_b = outputs(&mut model_from(&config, &wb));
    let mut model = model_from(&config, &wa);
    model.weight_ops_mut().offload();
    for i in 0..2 {
        push(&mut model, share(&wb, i, 2)).unwrap();
    }
    assert_eq!(model.weight_ops().residency(), WeightResidency::Offloaded);
    model.weight_ops_mut().restore().unwrap();
    assert_eq!(outputs(&mut model), want_b);
}

#[test]
fn drop_frees_the_weights_and_only_a_complete_install_brings_them_back() {
    let config = small_config();
    let (wa, wb) = (random_weights(&config, 15), random_weights(&config, 16));
    let want_b = outputs(&mut model_from(&config, &wb));
    let mut model = model_from(&config, &wa);
    let total = model.weights().total_bytes();

    let retired = model.weight_ops_mut().drop_weights().unwrap();
    let old = retired.downcast::<LlamaWeights>().unwrap();
    assert_eq!(old.total_bytes(), total, "the old weights are handed back");
    assert_eq!(model.weights().total_bytes(), 0);
    assert_eq!(model.weight_ops().residency(), WeightResidency::Dropped);
    assert!(
        model.weight_ops_mut().drop_weights().is_none(),
        "nothing left to drop"
    );
    model.weight_ops_mut().offload();
    assert_eq!(model.weight_ops().residency(), WeightResidency::Dropped);
    assert!(matches!(
        execute_once(&mut model),
        Err(ExecError::WeightsUnloaded)
    ));
    assert!(matches!(
        model.weight_ops_mut().restore(),
        Err(ExecError::WeightsUnloaded)
    ));

    // A partial push has nothing to patch.
    let err = push(&mut model, share(&wb, 1, 2)).unwrap_err();
    let n = expected_tensors(&config).len();
    let first_missing = expected_tensors(&config)
        .into_iter()
        .map(|(name, _)| name)
        .find(|name| share(&wb, 1, 2).get(name).is_none())
        .unwrap();
    assert_eq!(
        err,
        WeightError::Incomplete {
            n_missing: n - share(&wb, 1, 2).tensors.len(),
            first: first_missing,
        }
    );
    assert_eq!(model.weight_ops().residency(), WeightResidency::Dropped);

    // A complete install brings them back, asleep until the wake-up.
    assert!(push(&mut model, wb).unwrap().is_none());
    assert_eq!(model.weight_ops().residency(), WeightResidency::Offloaded);
    assert!(matches!(
        execute_once(&mut model),
        Err(ExecError::WeightsUnloaded)
    ));
    model.weight_ops_mut().restore().unwrap();
    assert_eq!(outputs(&mut model), want_b);
}

// ---------------------------------------------------------------------------------------
// `parse_safetensors`: the bytes of a tensor push.

mod push_bytes {
    use ferry_model::{parse_safetensors, Tensor, WeightError};
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    /// Values exact in f16 and bf16, so every dtype round-trips bit for bit.
    const VALUES: [f32; 6] = [1.0, -2.5, 0.125, 3.0, 0.0, -0.75];

    fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
        match dtype {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            other => panic!("test encodes no {other:?}"),
        }
    }

    fn serialize(entries: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(String, TensorView<'_>)> = entries
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                let view = TensorView::new(*dtype, shape.clone(), bytes).unwrap();
                ((*name).to_owned(), view)
            })
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn f32_f16_bf16_round_trip_exactly() {
        let bytes = serialize(&[
            ("a.f32", Dtype::F32, vec![2, 3], encode(Dtype::F32, &VALUES)),
            ("b.f16", Dtype::F16, vec![3, 2], encode(Dtype::F16, &VALUES)),
            ("c.bf16", Dtype::BF16, vec![6], encode(Dtype::BF16, &VALUES)),
        ]);
        let store = parse_safetensors(&bytes).unwrap();
        let names: Vec<&str> = store.tensors.keys().map(String::as_str).collect();
        assert_eq!(names, ["a.f32", "b.f16", "c.bf16"]);
        assert_eq!(
            store.get("a.f32"),
            Some(&Tensor::new(vec![2, 3], VALUES.to_vec()))
        );
        assert_eq!(
            store.get("b.f16"),
            Some(&Tensor::new(vec![3, 2], VALUES.to_vec()))
        );
        assert_eq!(
            store.get("c.bf16"),
            Some(&Tensor::new(vec![6], VALUES.to_vec()))
        );
    }

    #[test]
    fn integer_tensors_are_refused_by_name() {
        for (dtype, bytes) in [(Dtype::I64, vec![0u8; 16]), (Dtype::U8, vec![0u8; 2])] {
            let bytes = serialize(&[
                ("a.ok", Dtype::F32, vec![6], encode(Dtype::F32, &VALUES)),
                ("b.ints", dtype, vec![2], bytes),
            ]);
            let want = WeightError::UnsupportedDtype {
                name: "b.ints".into(),
                dtype: format!("{dtype:?}"),
            };
            assert_eq!(parse_safetensors(&bytes).unwrap_err(), want);
        }
    }

    #[test]
    fn garbage_and_empty_pushes_are_refused() {
        let garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all";
        assert!(matches!(
            parse_safetensors(garbage),
            Err(WeightError::Malformed(_))
        ));
        assert!(matches!(
            parse_safetensors(b"xy"),
            Err(WeightError::Malformed(_))
        ));
        let mut truncated = serialize(&[("a", Dtype::F32, vec![6], encode(Dtype::F32, &VALUES))]);
        truncated.truncate(truncated.len() - 4);
        assert!(matches!(
            parse_safetensors(&truncated),
            Err(WeightError::Malformed(_))
        ));
        assert_eq!(
            parse_safetensors(&serialize(&[])).unwrap_err(),
            WeightError::Empty
        );
    }
}

/// Where each matrix segment's bytes live: a reload in place keeps every one.
fn segment_addresses(w: &LlamaWeights) -> Vec<usize> {
    let mut matrices = vec![&w.embed];
    matrices.extend(w.lm_head.as_ref());
    for l in &w.layers {
        matrices.extend([&l.qkv, &l.o_proj, &l.gate_up, &l.down]);
    }
    matrices
        .iter()
        .flat_map(|m| m.segments().iter().map(|s| s.bytes().as_ptr() as usize))
        .collect()
}

/// The engine's `update_weights_from_disk` while paused: the model lends its weights, the
/// folder is read over them, and they come back. Bit for bit a model built from the folder,
/// in the same memory, for every variant of the layout; and back again to the first weights.
#[test]
fn a_reload_in_place_writes_the_files_over_the_same_memory() {
    for config in configs() {
        let (wa, wb) = (random_weights(&config, 21), random_weights(&config, 22));
        let (want_a, want_b) = (
            outputs(&mut model_from(&config, &wa)),
            outputs(&mut model_from(&config, &wb)),
        );
        assert_ne!(want_a, want_b);
        let tmp = tempfile::tempdir().unwrap();
        let folder = |name: &str, weights: &WeightStore| {
            let dir = tmp.path().join(name);
            let model = ferry_model::LoadedModel {
                config: config.clone(),
                weights: weights.clone(),
                tokenizer: None,
                chat_template: None,
                source: name.to_owned(),
            };
            write_hf_folder(&model, &dir).unwrap();
            dir
        };
        let (dir_a, dir_b) = (folder("a", &wa), folder("b", &wb));

        let mut model = model_from(&config, &wa);
        let addresses = segment_addresses(model.weights());
        for (dir, want) in [(&dir_b, &want_b), (&dir_a, &want_a)] {
            let files = ferry_model::WeightFiles::open(dir).unwrap();
            assert!(files.reads_in_place());
            files.check().unwrap();
            let preparer = model.weight_ops().preparer();
            let lent = model
                .weight_ops_mut()
                .lend()
                .expect("resident weights lend");
            assert_eq!(model.weight_ops().residency(), WeightResidency::Reloading);
            assert!(model.weight_ops_mut().lend().is_none(), "lent once");
            assert!(matches!(
                execute_once(&mut model),
                Err(ExecError::WeightsUnloaded)
            ));
            assert_eq!(
                push(&mut model, wb.clone()).unwrap_err(),
                WeightError::Reloading,
                "no other update while lent"
            );
            let mut slots = preparer
                .slots_in_place(lent, &expected_tensors(&config))
                .map_err(|(e, _)| e)
                .unwrap();
            files.read_into(&mut *slots).unwrap();
            model
                .weight_ops_mut()
                .take_back(Some(slots.finish()))
                .unwrap();
            assert_eq!(model.weight_ops().residency(), WeightResidency::Resident);
            assert_eq!(segment_addresses(model.weights()), addresses, "in place");
            assert_eq!(&outputs(&mut model), want);
        }
    }
}

/// A reload in place whose read failed midway: the lent weights are lost, and the model
/// holds them dropped, as after sleep level 2, until a complete set and a wake-up.
#[test]
fn weights_lost_by_a_reload_in_place_stay_dropped_until_a_complete_set() {
    let tiny = tiny_model();
    let mut model = model_from(&tiny.config, &tiny.weights);
    let want = outputs(&mut model);
    let preparer = model.weight_ops().preparer();
    assert_eq!(
        model.weight_ops_mut().take_back(None),
        Err(WeightError::NotLent),
        "nothing was lent"
    );
    let lent = model.weight_ops_mut().lend().unwrap();
    // Slots for part of the weights are refused, and hand the lent weights back untouched.
    let some: Vec<(String, Vec<usize>)> =
        expected_tensors(&tiny.config).into_iter().take(3).collect();
    let (e, lent) = match preparer.slots_in_place(lent, &some) {
        Err(refused) => refused,
        Ok(_) => panic!("a partial list is not a reload"),
    };
    assert!(matches!(e, WeightError::Incomplete { .. }), "{e}");
    drop(lent);
    model.weight_ops_mut().take_back(None).unwrap();
    assert_eq!(model.weight_ops().residency(), WeightResidency::Dropped);
    assert!(model.weight_ops_mut().restore().is_err());
    push(&mut model, tiny.weights.clone()).unwrap();
    model.weight_ops_mut().restore().unwrap();
    assert_eq!(outputs(&mut model), want);
}
