//! LoRA adapters in the paged forward: against a dense f64 reference that adds `scale · B·(A·x)`
//! module by module (Llama, Qwen2, Qwen3, and the attention of every MoE architecture), batch
//! invariance with base rows and rows of several adapters mixed and chunked (bitwise, and base
//! rows bitwise those of a model without adapters), quantized bases (bitwise the same base
//! dequantized to f32), in-place replacement and unloading.

mod model_support;

use std::sync::Arc;

use ferry_core::LoraId;
use ferry_model::lora::random::{random_lora, RandomLora};
use ferry_model::random_model::{
    random_weights, small_config, small_moe_config, MOE_ARCHITECTURES,
};
use ferry_model::{
    ExecError, Executor, LlamaConfig, LlamaModel, LoraAdapter, StoredTensor, TargetModule,
    WeightDtype, WeightStore,
};
use model_support::*;

const BS: usize = 4;
/// Relative tolerance (to the row's largest logit) of the f32 forward against f64.
const TOL: f64 = 1e-4;
const MAX_RANK: usize = 16;

fn qwen2_config() -> LlamaConfig {
    LlamaConfig {
        architecture: "Qwen2ForCausalLM".into(),
        attention_bias: true,
        ..small_config()
    }
}

fn qwen3_config() -> LlamaConfig {
    LlamaConfig {
        architecture: "Qwen3ForCausalLM".into(),
        qk_norm: true,
        head_dim: 24,
        ..small_config()
    }
}

fn spec(rank: usize, targets: &[TargetModule], use_rslora: bool, seed: u64) -> RandomLora {
    RandomLora {
        rank,
        alpha: 2.0 * rank as f64,
        targets: targets.to_vec(),
        use_rslora,
        seed,
    }
}

/// A random adapter of `spec` for `config`, and the reference's view of it (its scales
/// computed here from the spec, not read back from the adapter).
fn adapter(config: &LlamaConfig, spec: &RandomLora) -> (Arc<LoraAdapter>, RefLora) {
    let (lora_config, tensors) = random_lora(config, spec);
    let scale = if spec.use_rslora {
        spec.alpha / (spec.rank as f64).sqrt()
    } else {
        spec.alpha / spec.rank as f64
    };
    let reference = RefLora::from_peft(&tensors, |_, _| scale);
    assert!(!reference.modules.is_empty());
    let a = LoraAdapter::from_f32(lora_config, &tensors, config, MAX_RANK).expect("valid adapter");
    (Arc::new(a), reference)
}

/// Prefills a prompt under adapter `id`, then decodes greedily, checking every step's logits
/// against the reference over the whole sequence so far; the adapter must move the logits.
fn check_against_reference(config: &LlamaConfig, targets: &[TargetModule], seed: u64) {
    let weights = random_weights(config, seed);
    let mut model = LlamaModel::new(config, &weights).unwrap();
    let (lora, reference) = adapter(config, &spec(4, targets, seed % 2 == 1, seed + 10));
    model.load_lora(LoraId(7), lora).unwrap();
    let mut kv = arena_for(&model, 64, BS);
    let mut pool = Pool::new(64, BS, seed);
    let mut seq = Seq::new(0, random_tokens(11, config.vocab_size, seed + 1));
    seq.lora = Some(LoraId(7));
    let mut count = seq.tokens.len();
    for step_idx in 0..4 {
        let logits = step(&mut model, &mut kv, &mut pool, &mut [&mut seq], &[count]);
        let want = reference_logits_lora(config, &weights, &reference, &seq.tokens);
        let what = format!("{} step {step_idx}", config.architecture);
        assert_close(logits.row(0), want.last().unwrap(), TOL, &what);
        let base = reference_logits(config, &weights, &seq.tokens);
        let moved = want
            .last()
            .unwrap()
            .iter()
            .zip(base.last().unwrap())
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(moved > 1e-2, "{what}: the adapter moved logits by {moved}");
        seq.tokens.push(argmax(logits.row(0)));
        count = 1;
    }
}

#[test]
fn adapters_on_every_module_match_the_dense_reference() {
    for (i, config) in [small_config(), qwen2_config(), qwen3_config()]
        .iter()
        .enumerate()
    {
        check_against_reference(config, &TargetModule::ALL, 1 + i as u64);
    }
}

#[test]
fn adapters_on_some_modules_match_the_dense_reference() {
    use TargetModule::*;
    check_against_reference(&small_config(), &[QProj, VProj], 4);
    check_against_reference(&qwen2_config(), &[KProj, OProj, DownProj], 5);
    check_against_reference(&qwen3_config(), &[UpProj], 6);
}

#[test]
fn attention_adapters_on_moe_models_match_the_dense_reference() {
    use TargetModule::*;
    for (i, arch) in MOE_ARCHITECTURES.iter().enumerate() {
        check_against_reference(
            &small_moe_config(arch),
            &[QProj, KProj, VProj, OProj],
            20 + i as u64,
        );
    }
}

/// Every sampled logits row of each request (by request id), as bits.
type Rows = Vec<Vec<Vec<u32>>>;

/// Runs `prompts` (request `i` under `loras[i]`) side by side: prefill in the chunk counts of
/// `schedule` (one entry per step, one count per request), then `n_decode` greedy steps of
/// all of them together. Returns every sampled row of each request.
fn run(
    model: &mut LlamaModel,
    prompts: &[Vec<u32>],
    loras: &[Option<LoraId>],
    schedule: &[Vec<usize>],
    n_decode: usize,
) -> Rows {
    let mut kv = arena_for(model, 128, BS);
    let mut pool = Pool::new(128, BS, 3);
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .zip(loras)
        .enumerate()
        .map(|(i, (p, &lora))| {
            let mut s = Seq::new(i as u32, p.clone());
            s.lora = lora;
            s
        })
        .collect();
    let mut rows: Rows = vec![Vec::new(); prompts.len()];
    let decode = vec![vec![1; prompts.len()]; n_decode];
    for counts in schedule.iter().chain(&decode) {
        let mut refs: Vec<&mut Seq> = seqs.iter_mut().collect();
        let logits = step(model, &mut kv, &mut pool, &mut refs, counts);
        for (i, &req) in logits.reqs.iter().enumerate() {
            let r = req.0 as usize;
            rows[r].push(bits(logits.row(i)));
            seqs[r].tokens.push(argmax(logits.row(i)));
        }
    }
    rows
}

/// Each request's rows when it runs alone, prefilled in one step.
fn alone(model: &mut LlamaModel, prompts: &[Vec<u32>], loras: &[Option<LoraId>], n: usize) -> Rows {
    prompts
        .iter()
        .zip(loras)
        .map(|(p, &lora)| {
            let rows = run(model, std::slice::from_ref(p), &[lora], &[vec![p.len()]], n);
            rows.into_iter().next().unwrap()
        })
        .collect()
}

/// Three adapters of different targets, ranks and scalings, loaded as ids 1, 2 and 3.
fn three_adapters(config: &LlamaConfig, model: &mut LlamaModel) -> Vec<Arc<LoraAdapter>> {
    use TargetModule::*;
    let specs = [
        spec(4, &TargetModule::ALL, false, 31),
        spec(8, &[QProj, VProj], true, 32),
        spec(2, &[KProj, OProj, GateProj, DownProj], false, 33),
    ];
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let (a, _) = adapter(config, s);
            model
                .load_lora(LoraId(i as u32 + 1), Arc::clone(&a))
                .unwrap();
            a
        })
        .collect()
}

/// Two chunkings of five prompts: uneven chunks side by side, and one step each.
fn mixed_schedule() -> Vec<Vec<usize>> {
    vec![
        vec![3, 5, 0, 2, 9],
        vec![4, 0, 6, 3, 0],
        vec![2, 4, 3, 5, 0],
    ]
}

fn five_prompts(vocab: usize) -> Vec<Vec<u32>> {
    [9, 9, 9, 10, 9]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(n, vocab, 40 + i as u64))
        .collect()
}

#[test]
fn mixed_batches_and_chunked_prefill_give_each_request_its_bits_alone() {
    for config in [small_config(), qwen3_config()] {
        let weights = random_weights(&config, 9);
        let mut model = LlamaModel::new(&config, &weights).unwrap();
        three_adapters(&config, &mut model);
        let prompts = five_prompts(config.vocab_size);
        // Base, adapter 1, adapter 2, adapter 3, and adapter 1 again (its rows apart).
        let loras = [
            None,
            Some(LoraId(1)),
            Some(LoraId(2)),
            Some(LoraId(3)),
            Some(LoraId(1)),
        ];
        let want = alone(&mut model, &prompts, &loras, 3);
        let mixed = run(&mut model, &prompts, &loras, &mixed_schedule(), 3);
        assert_eq!(
            mixed, want,
            "{}: mixed and chunked vs alone",
            config.architecture
        );
        let one_step: Vec<usize> = prompts.iter().map(Vec::len).collect();
        assert_eq!(run(&mut model, &prompts, &loras, &[one_step], 3), want);

        // Every adapter changes its request's rows; the same prompt's base rows are those of
        // a model that holds no adapters.
        let same = vec![prompts[0].clone(); 4];
        let under = [None, Some(LoraId(1)), Some(LoraId(2)), Some(LoraId(3))];
        let rows = alone(&mut model, &same, &under, 1);
        for i in 1..4 {
            assert_ne!(rows[i][0], rows[0][0], "adapter {i} changes the logits");
        }
        let mut plain = LlamaModel::new(&config, &weights).unwrap();
        assert_eq!(alone(&mut plain, &same[..1], &[None], 1)[0], rows[0]);
        assert_eq!(
            run(&mut plain, &prompts[..1], &[None], &[vec![9]], 3)[0],
            want[0]
        );
    }
}

/// `f32s` with every matrix in `dtype` (vectors stay f32).
fn stored_in(f32s: &WeightStore, dtype: WeightDtype) -> WeightStore {
    let mut store = WeightStore::default();
    for (name, t) in &f32s.tensors {
        if t.shape.len() == 2 {
            store.insert_stored(
                name.clone(),
                StoredTensor::quantized(t.shape.clone(), dtype, &t.data),
            );
        } else {
            store.insert(name.clone(), t.clone());
        }
    }
    store
}

#[test]
fn quantized_bases_with_adapters_compute_the_dequantized_model_with_them() {
    let config = small_config();
    let f32s = random_weights(&config, 12);
    let prompts = five_prompts(config.vocab_size);
    let loras = [
        None,
        Some(LoraId(1)),
        Some(LoraId(2)),
        Some(LoraId(3)),
        Some(LoraId(1)),
    ];
    for dtype in [WeightDtype::Q8_0, WeightDtype::Q4_1] {
        let stored = stored_in(&f32s, dtype);
        let dequantized = stored.dequantized();
        let mut quantized = LlamaModel::new(&config, &stored).unwrap();
        let mut plain = LlamaModel::new(&config, &dequantized).unwrap();
        for (i, a) in three_adapters(&config, &mut quantized)
            .into_iter()
            .enumerate()
        {
            plain.load_lora(LoraId(i as u32 + 1), a).unwrap();
        }
        let got = run(&mut quantized, &prompts, &loras, &mixed_schedule(), 2);
        let want = run(&mut plain, &prompts, &loras, &mixed_schedule(), 2);
        assert_eq!(got, want, "{dtype}: stored vs dequantized, bitwise");
    }
    // And against the reference over the dequantized weights.
    let stored = stored_in(&f32s, WeightDtype::Q4_1);
    let mut model = LlamaModel::new(&config, &stored).unwrap();
    let (lora, reference) = adapter(&config, &spec(4, &TargetModule::ALL, false, 50));
    model.load_lora(LoraId(1), lora).unwrap();
    let mut seq = Seq::new(0, prompts[3].clone());
    seq.lora = Some(LoraId(1));
    let mut kv = arena_for(&model, 64, BS);
    let mut pool = Pool::new(64, BS, 1);
    let n = seq.tokens.len();
    let logits = step(&mut model, &mut kv, &mut pool, &mut [&mut seq], &[n]);
    let want = reference_logits_lora(&config, &stored.dequantized(), &reference, &seq.tokens);
    assert_close(
        logits.row(0),
        want.last().unwrap(),
        TOL,
        "Q4_1 base with an adapter",
    );
}

#[test]
fn replacing_an_adapter_in_place_changes_its_outputs_and_unloading_refuses_its_requests() {
    let config = small_config();
    let weights = random_weights(&config, 14);
    let mut model = LlamaModel::new(&config, &weights).unwrap();
    let (v1, _) = adapter(&config, &spec(4, &TargetModule::ALL, false, 60));
    let (v2, _) = adapter(&config, &spec(4, &TargetModule::ALL, false, 61));
    let prompt = vec![random_tokens(7, config.vocab_size, 2)];
    let id = [Some(LoraId(5))];

    let missing = run_result(&mut model, &prompt[0], id[0]);
    assert!(
        matches!(missing, Err(ExecError::LoraNotLoaded(LoraId(5)))),
        "{missing:?}"
    );
    model.load_lora(LoraId(5), Arc::clone(&v1)).unwrap();
    let first = alone(&mut model, &prompt, &id, 2);
    model.load_lora(LoraId(5), Arc::clone(&v2)).unwrap();
    let second = alone(&mut model, &prompt, &id, 2);
    assert_ne!(first, second, "the new version computes");
    let mut fresh = LlamaModel::new(&config, &weights).unwrap();
    fresh.load_lora(LoraId(5), v2).unwrap();
    assert_eq!(alone(&mut fresh, &prompt, &id, 2), second);

    model.unload_lora(LoraId(5)).unwrap();
    let err = run_result(&mut model, &prompt[0], id[0]).unwrap_err();
    assert_eq!(err.to_string(), "LoRA adapter LoraId(5) is not loaded");
    assert!(matches!(
        model.unload_lora(LoraId(5)),
        Err(ExecError::LoraNotLoaded(_))
    ));

    // An adapter made for another base does not load.
    let other = LlamaConfig {
        intermediate_size: 128,
        ..small_config()
    };
    let (wrong, _) = adapter(&other, &spec(4, &TargetModule::ALL, false, 62));
    let err = model.load_lora(LoraId(6), wrong).unwrap_err().to_string();
    assert!(
        err.contains("LoraId(6)") && err.contains("gate_proj"),
        "{err}"
    );
}

/// One prefill step of `prompt` under `lora`.
fn run_result(
    model: &mut LlamaModel,
    prompt: &[u32],
    lora: Option<LoraId>,
) -> Result<(), ExecError> {
    let mut seq = Seq::new(0, prompt.to_vec());
    seq.lora = lora;
    let mut kv = arena_for(model, 16, BS);
    let mut pool = Pool::new(16, BS, 0);
    let plan = build_plan(&mut pool, &mut [&mut seq], &[prompt.len()]);
    model.forward(&plan, &mut kv).map(drop)
}
