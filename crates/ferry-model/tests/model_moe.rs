//! Expert routing capture of the MoE forward (`--enable-return-routed-experts`): each
//! token's picks are reported whatever its batch, and read back from the KV blocks of a
//! prefix the request did not compute itself.

mod model_support;

use ferry_core::{ModelOutput, RoutingRead, RoutingShape};
use ferry_model::random_model::{
    random_weights, small_config, small_moe_config, MOE_ARCHITECTURES,
};
use ferry_model::{Executor, LlamaModel, ModelError};
use model_support::*;

const BS: usize = 4;

fn capturing(arch: &str) -> LlamaModel {
    let config = small_moe_config(arch);
    let weights = random_weights(&config, 3);
    LlamaModel::new(&config, &weights)
        .unwrap()
        .with_routed_experts(true)
        .unwrap()
}

/// Runs one step of `seqs` through `execute`, marking their tokens computed.
fn execute(
    model: &mut LlamaModel,
    kv: &mut ferry_arena::KvArena,
    pool: &mut Pool,
    seqs: &mut [&mut Seq],
    counts: &[usize],
    reads: Vec<RoutingRead>,
) -> ModelOutput {
    let mut plan = build_plan(pool, seqs, counts);
    plan.routing_reads = reads;
    let out = model.execute(&plan, kv).expect("valid plan");
    for (seq, &count) in seqs.iter_mut().zip(counts) {
        seq.computed += count;
    }
    out
}

#[test]
fn routing_is_reported_per_token_whatever_the_batch_and_read_back_from_cached_blocks() {
    for arch in MOE_ARCHITECTURES {
        let mut model = capturing(arch);
        let config = model.config().clone();
        let moe = config.moe.clone().unwrap();
        let shape = model.routing_shape().expect("capturing");
        assert_eq!(
            shape,
            RoutingShape {
                layers: config.num_hidden_layers,
                top_k: moe.top_k,
                num_experts: moe.num_experts,
            }
        );
        let width = shape.width();
        let mut kv = arena_for(&model, 64, BS);
        let mut pool = Pool::new(64, BS, 7);
        let prompt = random_tokens(10, config.vocab_size, 8);

        // A alone, in one step.
        let mut a = Seq::new(0, prompt.clone());
        let out = execute(&mut model, &mut kv, &mut pool, &mut [&mut a], &[10], vec![]);
        let alone = &out.routed[0];
        assert_eq!((alone.req, alone.first_pos), (a.req, 0));
        assert_eq!(alone.ids.len(), 10 * width, "{arch}");
        for (i, row) in alone.ids.chunks_exact(moe.top_k).enumerate() {
            let layer = i % config.num_hidden_layers;
            let mut picks = row.to_vec();
            if !moe.is_sparse(layer) {
                assert!(
                    picks.iter().all(|&e| e == 0),
                    "{arch}: a dense layer's row is 0"
                );
                continue;
            }
            picks.sort();
            picks.dedup();
            assert_eq!(picks.len(), moe.top_k, "{arch}: distinct experts per token");
            assert!(picks.iter().all(|&e| (e as usize) < moe.num_experts));
        }
        let used: std::collections::BTreeSet<u16> = alone.ids.iter().copied().collect();
        assert!(
            used.len() > moe.top_k,
            "{arch}: routing varies across tokens"
        );

        // B: the same prompt in chunks beside C, whose prompt differs.
        let mut b = Seq::new(1, prompt.clone());
        let mut c = Seq::new(2, random_tokens(6, config.vocab_size, 9));
        let first = execute(
            &mut model,
            &mut kv,
            &mut pool,
            &mut [&mut c, &mut b],
            &[6, 3],
            vec![],
        );
        let rest = execute(&mut model, &mut kv, &mut pool, &mut [&mut b], &[7], vec![]);
        let mut chunked = first.routed[1].ids.clone();
        assert_eq!(first.routed[1].first_pos, 0);
        assert_eq!(rest.routed[0].first_pos, 3);
        chunked.extend(&rest.routed[0].ids);
        assert_eq!(
            chunked, alone.ids,
            "{arch}: routing changed with batch or chunking"
        );

        // D: A's first two blocks from the prefix cache (its table starts with them), the
        // rest computed; its routing for the cached positions is read back from them.
        let mut d = Seq::new(3, prompt.clone());
        d.table = a.table[..2].to_vec();
        d.computed = 2 * BS;
        let out = execute(
            &mut model,
            &mut kv,
            &mut pool,
            &mut [&mut d],
            &[10 - 2 * BS],
            vec![RoutingRead {
                req_pos: 0,
                from: 0,
            }],
        );
        assert_eq!(out.routed[0].first_pos, 0);
        assert_eq!(
            out.routed[0].ids, alone.ids,
            "{arch}: read back from the blocks"
        );

        // Without a read, only the computed positions.
        let mut e = Seq::new(4, prompt.clone());
        e.table = a.table[..2].to_vec();
        e.computed = 2 * BS;
        let out = execute(&mut model, &mut kv, &mut pool, &mut [&mut e], &[2], vec![]);
        assert_eq!(out.routed[0].first_pos, 2 * BS);
        assert_eq!(out.routed[0].ids, alone.ids[2 * BS * width..]);
    }
}

#[test]
fn routing_is_off_unless_asked_and_a_dense_model_refuses_it() {
    let config = small_moe_config("Qwen3MoeForCausalLM");
    let mut model = LlamaModel::new(&config, &random_weights(&config, 3)).unwrap();
    assert_eq!(model.routing_shape(), None);
    let mut kv = arena_for(&model, 16, BS);
    let mut pool = Pool::new(16, BS, 1);
    let mut a = Seq::new(0, random_tokens(5, config.vocab_size, 2));
    let out = execute(&mut model, &mut kv, &mut pool, &mut [&mut a], &[5], vec![]);
    assert!(out.routed.is_empty());

    let dense = small_config();
    let err = LlamaModel::new(&dense, &random_weights(&dense, 3))
        .unwrap()
        .with_routed_experts(true)
        .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::InvalidConfig {
                field: "--enable-return-routed-experts",
                ..
            }
        ),
        "{err}"
    );
}

/// Capture is a setting of the model, not a step buffer: sleep level 2 (weights dropped,
/// step buffers freed) and the complete install that wakes it keep it, and the KV layout
/// with it (the engine's arena, which survives the sleep, has its aux words).
#[test]
fn routing_capture_survives_dropped_weights_and_their_reinstall() {
    let mut model = capturing("Qwen3MoeForCausalLM");
    let config = model.config().clone();
    let layout = model.kv_layout(BS);
    assert!(layout.aux_floats > 0);
    let mut kv = arena_for(&model, 16, BS);
    let mut pool = Pool::new(16, BS, 2);
    let prompt = random_tokens(6, config.vocab_size, 4);
    let mut a = Seq::new(0, prompt.clone());
    let before = execute(&mut model, &mut kv, &mut pool, &mut [&mut a], &[6], vec![]);

    assert!(model.weight_ops_mut().drop_weights().is_some());
    let prepared = model
        .weight_ops()
        .preparer()
        .prepare(random_weights(&config, 3))
        .unwrap();
    model.weight_ops_mut().install(prepared).unwrap();
    model.weight_ops_mut().restore().unwrap();
    assert_eq!(model.kv_layout(BS), layout);
    assert!(model.routing_shape().is_some());
    let mut b = Seq::new(1, prompt);
    let after = execute(&mut model, &mut kv, &mut pool, &mut [&mut b], &[6], vec![]);
    assert_eq!(after.routed[0].ids, before.routed[0].ids);
}
