//! The forward's phase timing (`profile.rs`) on a forward of a small model: here, with the
//! model, since the timing sits below the kernels and the model it times.

use ferry_arena::KvArena;
use ferry_core::{BlockId, ReqIdx, SampleSpec, SamplerSpec, ScheduledReq, StepPlan, TokenId};

use super::LlamaModel;
use crate::executor::Executor;
use crate::profile::{set_enabled, PhaseNanos};
use crate::weights::random::{random_weights, small_config};

/// One forward of a small model: 4 prompt tokens of one request, which samples.
fn forward(model: &mut LlamaModel, kv: &mut KvArena) {
    let plan = StepPlan {
        block_size: 4,
        token_ids: TokenId::list([1, 2, 3, 4]),
        block_tables: vec![BlockId(0)],
        reqs: vec![ScheduledReq {
            lora: None,
            req: ReqIdx(0),
            tokens: 0..4,
            blocks: 0..1,
            start_pos: 0,
            sample: Some(SampleSpec {
                params: SamplerSpec::default(),
                output_idx: 0,
                mask: None,
                adjust: None,
            }),
        }],
        ..StepPlan::default()
    };
    model.execute(&plan, kv).expect("a valid step");
}

/// Timing off, a forward adds nothing; on, it adds time to every phase it runs. (Off is
/// checked first: this is the only test that turns timing on, so until it does no other
/// test's forward can be inside a timed section.)
#[test]
fn a_forward_fills_its_phases_only_while_enabled() {
    let config = small_config();
    let mut model = LlamaModel::new(&config, &random_weights(&config, 1)).unwrap();
    let mut kv = KvArena::new(model.kv_layout(4), 2);
    let before = PhaseNanos::now();
    forward(&mut model, &mut kv);
    assert_eq!(PhaseNanos::now(), before, "timing off");
    set_enabled(true);
    let before = PhaseNanos::now();
    forward(&mut model, &mut kv);
    let on = PhaseNanos::now().since(&before);
    set_enabled(false);
    assert!(on.layer_matmuls > 0, "{on:?}");
    assert!(on.head > 0, "{on:?}");
    assert!(on.attention > 0, "{on:?}");
}
