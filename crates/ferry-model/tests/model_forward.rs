//! Whole-model correctness of the paged forward: against a dense naive f64 reference (for
//! every architecture variant), batch invariance (bitwise), chunked prefill (bitwise), and
//! errors that name what is wrong.

mod model_support;

use ferry_arena::KvArena;
use ferry_core::{BlockId, TokenId};
use ferry_model::random_model::{
    random_weights, small_config, small_moe_config, MOE_ARCHITECTURES,
};
use ferry_model::{ExecError, Executor, LlamaConfig, LlamaModel, ModelError, RopeScaling};
use model_support::*;

const BS: usize = 4;
/// Relative tolerance (to the row's largest logit) of the f32 forward against f64.
const TOL: f64 = 1e-4;

/// Prefills a prompt in one step, then decodes greedily, checking every step's logits
/// against the dense reference over the whole sequence so far.
fn check_against_reference(config: &LlamaConfig, seed: u64) {
    let weights = random_weights(config, seed);
    let mut model = LlamaModel::new(config, &weights).expect("valid weights");
    let mut kv = arena_for(&model, 64, BS);
    let mut pool = Pool::new(64, BS, seed);
    let mut seq = Seq::new(0, random_tokens(11, config.vocab_size, seed + 1));
    let mut count = seq.tokens.len();
    for step_idx in 0..4 {
        let logits = step(&mut model, &mut kv, &mut pool, &mut [&mut seq], &[count]);
        let want = reference_logits(config, &weights, &seq.tokens);
        let what = format!("{} step {step_idx}", config.architecture);
        assert_close(logits.row(0), want.last().unwrap(), TOL, &what);
        seq.tokens.push(argmax(logits.row(0)));
        count = 1;
    }
}

#[test]
fn moe_architectures_match_dense_reference() {
    for arch in MOE_ARCHITECTURES {
        check_against_reference(&small_moe_config(arch), 5);
    }
}

#[test]
fn llama_matches_dense_reference() {
    check_against_reference(&small_config(), 1);
}

#[test]
fn tied_embeddings_match_dense_reference() {
    let config = LlamaConfig {
        tie_word_embeddings: true,
        ..small_config()
    };
    check_against_reference(&config, 2);
}

#[test]
fn qwen2_qkv_bias_matches_dense_reference() {
    let config = LlamaConfig {
        architecture: "Qwen2ForCausalLM".into(),
        attention_bias: true,
        ..small_config()
    };
    check_against_reference(&config, 3);
}

/// Llama with `attention_bias`: transformers puts a bias on `o_proj` too, which the forward
/// must add (dropping it moves logits by whole units).
#[test]
fn llama_attention_bias_with_o_proj_bias_matches_dense_reference() {
    let config = LlamaConfig {
        attention_bias: true,
        o_proj_bias: true,
        ..small_config()
    };
    check_against_reference(&config, 5);
}

/// Qwen3 with `attention_bias`: q/k/v and o biases along with the q/k norms.
#[test]
fn qwen3_attention_bias_with_o_proj_bias_matches_dense_reference() {
    let config = LlamaConfig {
        architecture: "Qwen3ForCausalLM".into(),
        attention_bias: true,
        o_proj_bias: true,
        qk_norm: true,
        head_dim: 24,
        ..small_config()
    };
    check_against_reference(&config, 6);
}

#[test]
fn qwen3_qk_norm_and_wide_heads_match_dense_reference() {
    // Qwen3's head_dim is not hidden / heads: 4 heads × 24 = 96 wide from hidden 64.
    let config = LlamaConfig {
        architecture: "Qwen3ForCausalLM".into(),
        qk_norm: true,
        head_dim: 24,
        num_key_value_heads: 1,
        ..small_config()
    };
    check_against_reference(&config, 4);
}

/// A small original context so the 16-dim head has medium and low frequencies, and the
/// scaling moves angles a lot within 15 positions.
fn llama3_config() -> LlamaConfig {
    LlamaConfig {
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }),
        ..small_config()
    }
}

#[test]
fn llama3_rope_scaling_matches_dense_reference() {
    check_against_reference(&llama3_config(), 5);
}

/// The scaling tests can fail: with these configs, scaled and unscaled logits differ by far
/// more than the tolerance.
#[test]
fn rope_scaling_changes_the_logits() {
    let plain = small_config();
    let weights = random_weights(&plain, 5);
    let tokens = random_tokens(15, plain.vocab_size, 6);
    let base = reference_logits(&plain, &weights, &tokens);
    let linear = LlamaConfig {
        rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }),
        ..small_config()
    };
    for config in [llama3_config(), linear] {
        let scaled = reference_logits(&config, &weights, &tokens);
        let diff = base[14]
            .iter()
            .zip(&scaled[14])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            diff > 100.0 * TOL,
            "{:?} barely changes the logits: {diff}",
            config.rope_scaling
        );
    }
}

#[test]
fn linear_rope_scaling_matches_dense_reference() {
    let config = LlamaConfig {
        rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }),
        ..small_config()
    };
    check_against_reference(&config, 6);
}

/// The reference check can fail: a perturbed weight changes the logits beyond tolerance.
#[test]
fn reference_check_detects_a_wrong_weight() {
    let config = small_config();
    let mut weights = random_weights(&config, 7);
    let tokens = random_tokens(5, config.vocab_size, 8);
    let want = reference_logits(&config, &weights, &tokens);
    weights
        .tensors
        .get_mut("model.layers.1.mlp.down_proj.weight")
        .unwrap()
        .data[3] += 0.5;
    let mut model = LlamaModel::new(&config, &weights).unwrap();
    let mut kv = arena_for(&model, 16, BS);
    let mut pool = Pool::new(16, BS, 9);
    let mut seq = Seq::new(0, tokens);
    let logits = step(&mut model, &mut kv, &mut pool, &mut [&mut seq], &[5]);
    let row = logits.row(0);
    let scale = want[4].iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_err = row
        .iter()
        .zip(&want[4])
        .map(|(&g, w)| (g as f64 - w).abs() / scale)
        .fold(0.0, f64::max);
    assert!(max_err > TOL, "perturbation went unnoticed: {max_err:e}");
}

/// Request A's logits, step by step, when it runs alone.
fn run_alone(config: &LlamaConfig, prompt: &[u32], steps: usize) -> Vec<Vec<u32>> {
    let weights = random_weights(config, 11);
    let mut model = LlamaModel::new(config, &weights).unwrap();
    let mut kv = arena_for(&model, 128, BS);
    let mut pool = Pool::new(128, BS, 12);
    let mut a = Seq::new(0, prompt.to_vec());
    let mut out = Vec::new();
    let mut count = prompt.len();
    for _ in 0..steps {
        let logits = step(&mut model, &mut kv, &mut pool, &mut [&mut a], &[count]);
        out.push(bits(logits.row(0)));
        a.tokens.push(argmax(logits.row(0)));
        count = 1;
    }
    out
}

#[test]
fn logits_are_bitwise_identical_alone_and_in_a_batch() {
    check_batch_invariance(&small_config());
}

#[test]
fn moe_logits_are_bitwise_identical_alone_and_in_a_batch() {
    for arch in MOE_ARCHITECTURES {
        check_batch_invariance(&small_moe_config(arch));
    }
}

fn check_batch_invariance(config: &LlamaConfig) {
    let config = config.clone();
    let prompt = random_tokens(9, config.vocab_size, 13);
    let steps = 5;
    let alone = run_alone(&config, &prompt, steps);

    // Same weights, a different arena layout (another pool seed), and company: B prefills in
    // chunks alongside, C is decoding, D arrives later with a long prompt.
    let weights = random_weights(&config, 11);
    let mut model = LlamaModel::new(&config, &weights).unwrap();
    let mut kv = arena_for(&model, 128, BS);
    let mut pool = Pool::new(128, BS, 99);
    let mut b = Seq::new(1, random_tokens(14, config.vocab_size, 14));
    let mut c = Seq::new(2, random_tokens(3, config.vocab_size, 15));
    let mut d = Seq::new(3, random_tokens(20, config.vocab_size, 16));
    let mut a = Seq::new(0, prompt.clone());
    // Warm C up so it is decoding when A arrives.
    let lc = step(&mut model, &mut kv, &mut pool, &mut [&mut c], &[3]);
    c.tokens.push(argmax(lc.row(0)));
    let schedule: [[usize; 4]; 5] = [
        // counts for [C, A, B, D]
        [1, 9, 5, 0],
        [1, 1, 5, 0],
        [1, 1, 4, 17],
        [0, 1, 1, 3],
        [1, 1, 1, 1],
    ];
    for (s, counts) in schedule.iter().enumerate() {
        let mut seqs = [&mut c, &mut a, &mut b, &mut d];
        let logits = step(&mut model, &mut kv, &mut pool, &mut seqs, counts);
        let pos = logits
            .reqs
            .iter()
            .position(|r| r.0 == 0)
            .expect("A samples every step");
        assert_eq!(
            bits(logits.row(pos)),
            alone[s],
            "step {s}: A's logits changed with its batch"
        );
        // Everyone who sampled gets its token, so the batch keeps changing shape.
        for (i, r) in logits.reqs.clone().into_iter().enumerate() {
            let seq = [&mut c, &mut a, &mut b, &mut d]
                .into_iter()
                .find(|q| q.req == r)
                .unwrap();
            seq.tokens.push(argmax(logits.row(i)));
        }
    }
    assert_eq!(a.tokens.len(), prompt.len() + steps);
}

#[test]
fn chunked_prefill_gives_the_same_logits_and_greedy_tokens() {
    check_chunked_prefill(&small_config());
}

#[test]
fn moe_chunked_prefill_gives_the_same_logits_and_greedy_tokens() {
    for arch in MOE_ARCHITECTURES {
        check_chunked_prefill(&small_moe_config(arch));
    }
}

fn check_chunked_prefill(config: &LlamaConfig) {
    let config = config.clone();
    let prompt = random_tokens(17, config.vocab_size, 21);
    let steps = 4;
    let one_shot = run_alone(&config, &prompt, steps);
    for chunk in [1, 3, 7] {
        let weights = random_weights(&config, 11);
        let mut model = LlamaModel::new(&config, &weights).unwrap();
        let mut kv = arena_for(&model, 128, BS);
        let mut pool = Pool::new(128, BS, chunk as u64);
        let mut a = Seq::new(0, prompt.clone());
        while a.computed + chunk < prompt.len() {
            let l = step(&mut model, &mut kv, &mut pool, &mut [&mut a], &[chunk]);
            assert!(l.reqs.is_empty(), "no sample before the prompt's end");
        }
        let mut count = prompt.len() - a.computed;
        for (s, want) in one_shot.iter().enumerate() {
            let logits = step(&mut model, &mut kv, &mut pool, &mut [&mut a], &[count]);
            assert_eq!(&bits(logits.row(0)), want, "chunk {chunk}, step {s}");
            a.tokens.push(argmax(logits.row(0)));
            count = 1;
        }
    }
}

#[test]
fn execute_samples_the_greedy_token_for_each_sampling_request() {
    let config = small_config();
    let weights = random_weights(&config, 31);
    let mut model = LlamaModel::new(&config, &weights).unwrap();
    let mut kv = arena_for(&model, 32, BS);
    let mut pool = Pool::new(32, BS, 32);
    let mut a = Seq::new(5, random_tokens(6, config.vocab_size, 33));
    let mut b = Seq::new(6, random_tokens(9, config.vocab_size, 34));
    // a finishes its prompt (samples), b only prefills a chunk (does not).
    let plan = build_plan(&mut pool, &mut [&mut a, &mut b], &[6, 4]);
    let out = model.execute(&plan, &mut kv).unwrap();
    let want = reference_logits(&config, &weights, &a.tokens);
    let want_tok = want[5]
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .unwrap()
        .0 as u32;
    assert_eq!(out.sampled.len(), 1);
    assert_eq!(out.sampled[0].req, a.req);
    assert_eq!(out.sampled[0].token, TokenId(want_tok));
    assert_eq!(model.vocab_size(), config.vocab_size);
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let config = small_config();
    let mut weights = random_weights(&config, 41);
    weights
        .tensors
        .remove("model.layers.1.self_attn.k_proj.weight");
    let err = LlamaModel::new(&config, &weights).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingTensor { name } if name == "model.layers.1.self_attn.k_proj.weight"),
        "{err}"
    );

    let mut weights = random_weights(&config, 41);
    weights.tensors.get_mut("model.norm.weight").unwrap().shape = vec![63];
    let err = LlamaModel::new(&config, &weights).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.norm.weight has shape [63], expected [64]"
    );

    let qwen2 = LlamaConfig {
        attention_bias: true,
        ..config.clone()
    };
    let err = LlamaModel::new(&qwen2, &random_weights(&config, 41)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "missing tensor model.layers.0.self_attn.q_proj.bias"
    );

    let bad = LlamaConfig {
        num_key_value_heads: 3,
        ..config
    };
    let err = LlamaModel::new(&bad, &random_weights(&small_config(), 41)).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidConfig {
                field: "num_key_value_heads",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn bad_plans_and_a_released_arena_are_errors_not_panics() {
    let config = small_config();
    let mut model = LlamaModel::new(&config, &random_weights(&config, 51)).unwrap();
    let mut kv = arena_for(&model, 8, BS);
    let mut pool = Pool::new(8, BS, 52);
    let mut a = Seq::new(0, vec![1, 2, 3]);
    let good = build_plan(&mut pool, &mut [&mut a], &[3]);

    let mut p = good.clone();
    p.token_ids[1] = TokenId(97);
    assert!(
        matches!(model.forward(&p, &mut kv), Err(ExecError::InvalidPlan(m)) if m.contains("token id 97"))
    );

    let mut p = good.clone();
    p.block_tables[0] = BlockId(8);
    assert!(
        matches!(model.forward(&p, &mut kv), Err(ExecError::InvalidPlan(m)) if m.contains("block 8"))
    );

    let mut p = good.clone();
    p.reqs[0].start_pos = 2; // needs 5 positions, the table holds 4
    assert!(matches!(
        model.forward(&p, &mut kv),
        Err(ExecError::InvalidPlan(_))
    ));

    let mut p = good.clone();
    p.block_size = 8;
    assert!(
        matches!(model.forward(&p, &mut kv), Err(ExecError::InvalidPlan(m)) if m.contains("layout"))
    );

    let mut p = good.clone();
    p.reqs[0].start_pos = config.max_position_embeddings - 2; // the last position is past it
    p.block_tables = vec![BlockId(1); config.max_position_embeddings / BS + 1];
    p.reqs[0].blocks = 0..p.block_tables.len();
    assert!(
        matches!(model.forward(&p, &mut kv), Err(ExecError::InvalidPlan(m)) if m.contains("context"))
    );

    let mut released = KvArena::new(model.kv_layout(BS), 8);
    released.release();
    assert!(matches!(
        model.forward(&good, &mut released),
        Err(ExecError::ArenaReleased)
    ));

    assert!(model.forward(&good, &mut kv).is_ok());
    let empty = model
        .forward(
            &ferry_core::StepPlan {
                block_size: BS,
                ..Default::default()
            },
            &mut kv,
        )
        .unwrap();
    assert!(empty.reqs.is_empty() && empty.data.is_empty());
}

#[test]
fn replace_weights_swaps_in_place_and_keeps_the_old_on_error() {
    let config = small_config();
    let (wa, wb) = (random_weights(&config, 61), random_weights(&config, 62));
    let prompt = random_tokens(6, config.vocab_size, 63);
    let logits_of = |model: &mut LlamaModel| {
        let mut kv = arena_for(model, 16, BS);
        let mut pool = Pool::new(16, BS, 64);
        let mut seq = Seq::new(0, prompt.clone());
        bits(step(model, &mut kv, &mut pool, &mut [&mut seq], &[6]).row(0))
    };
    let want_b = logits_of(&mut LlamaModel::new(&config, &wb).unwrap());
    let mut model = LlamaModel::new(&config, &wa).unwrap();
    let want_a = logits_of(&mut model);
    assert_ne!(want_a, want_b);

    let mut broken = wb.clone();
    broken.tensors.remove("model.norm.weight");
    assert!(model.replace_weights(&broken).is_err());
    assert_eq!(
        logits_of(&mut model),
        want_a,
        "a failed update keeps the old weights"
    );

    model.replace_weights(&wb).unwrap();
    assert_eq!(logits_of(&mut model), want_b);
}

/// Prompt logprobs, computed in chunked prefill steps (a chunk's last position scored
/// against the next chunk's first token), equal the log-softmax of the dense reference's
/// logits at every position, with ranks and top lists from the same rows; the sample is the
/// one a plain forward gives.
#[test]
fn prompt_logprobs_match_the_dense_reference() {
    use ferry_core::PromptLogprobsWork;
    let config = small_config();
    let weights = random_weights(&config, 11);
    let mut model = LlamaModel::new(&config, &weights).expect("valid weights");
    let mut kv = arena_for(&model, 64, BS);
    let mut pool = Pool::new(64, BS, 11);
    let tokens = random_tokens(13, config.vocab_size, 12);
    let mut seq = Seq::new(0, tokens.clone());
    let reference = reference_logits(&config, &weights, &tokens);
    let top_n = 3;
    let mut got = Vec::new();
    for count in [5, 6, 2] {
        let mut plan = build_plan(&mut pool, &mut [&mut seq], &[count]);
        let start = seq.computed;
        let end_target = (start + count + 1).min(tokens.len());
        plan.prompt_logprobs.push(PromptLogprobsWork {
            req_pos: 0,
            top_n,
            targets: TokenId::from_raw_slice(&tokens[start + 1..end_target]).to_vec(),
        });
        let out = model.execute(&plan, &mut kv).expect("valid plan");
        seq.computed += count;
        assert_eq!(out.prompt_logprobs.len(), 1);
        assert_eq!(out.prompt_logprobs[0].first_target, start + 1);
        got.extend(out.prompt_logprobs[0].tokens.clone());
        if seq.computed == tokens.len() {
            assert_eq!(
                out.sampled[0].token,
                TokenId(argmax_f64(reference.last().unwrap()))
            );
        }
    }
    assert_eq!(got.len(), tokens.len() - 1);
    for (p, lp) in got.iter().enumerate() {
        let row = &reference[p];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        let target = tokens[p + 1];
        assert_eq!(lp.token, TokenId(target));
        let want = row[target as usize] - lse;
        assert!(
            (f64::from(lp.logprob) - want).abs() < TOL * max.abs().max(1.0),
            "position {p}: {} vs {want}",
            lp.logprob
        );
        let rank = row.iter().filter(|&&l| l >= row[target as usize]).count();
        assert_eq!(lp.rank as usize, rank, "position {p}");
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let top: Vec<u32> = lp.top.iter().map(|&(t, _)| t.0).collect();
        let want_top: Vec<u32> = order[..top_n as usize].iter().map(|&t| t as u32).collect();
        assert_eq!(top, want_top, "position {p}");
    }
}

fn argmax_f64(row: &[f64]) -> u32 {
    (0..row.len()).fold(0, |best, t| if row[t] > row[best] { t } else { best }) as u32
}
