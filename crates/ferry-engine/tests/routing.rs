//! Expert routing through the engine: an executor that captures it (`testing::FakeMoe`, whose
//! routing is a function of token and position) makes every finish carry one row per input
//! token, read back from the prefix cache for a prompt sent again, and cut at a stop string's
//! token though the core ran on past it.

mod support;

use ferry_core::{FinishReason, RoutingShape, TokenId};
use ferry_engine::testing::{fake_routing_row, tiny_model, FakeMoe};
use ferry_engine::{
    start_model_with, ExpertRouting, GenerateRequest, KvCacheSize, ModelEngineConfig,
    SamplingParams, StopReason,
};
use support::*;

const SHAPE: RoutingShape = RoutingShape {
    layers: 2,
    top_k: 3,
    num_experts: 300,
};

/// The rows the fake model gives the first `n` positions of `tokens`.
fn expected(tokens: &[TokenId], n: usize) -> Vec<u16> {
    (0..n)
        .flat_map(|p| fake_routing_row(SHAPE, tokens[p], p))
        .collect()
}

fn routing_of(c: &Collected) -> &ExpertRouting {
    let f = c.finish.as_ref().unwrap();
    f.routing.as_ref().expect("the finish carries routing")
}

#[tokio::test]
async fn every_finish_carries_the_routing_of_its_input_tokens_hits_included() {
    let engine = engine(FakeMoe::new(checksum(), SHAPE), small_config(64, 4));
    assert_eq!(engine.routing_shape(), Some(SHAPE));
    let prompt: Vec<TokenId> = (1..=10).map(TokenId).collect();
    let mut runs = Vec::new();
    for id in ["a", "b"] {
        let c = collect(
            engine
                .generate(request(id, prompt.clone(), 5))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(c.reason(), FinishReason::Length);
        let tokens: Vec<TokenId> = prompt.iter().chain(&c.tokens).copied().collect();
        let routing = routing_of(&c);
        assert_eq!(routing.shape, SHAPE);
        assert_eq!(routing.rows(), 14, "10 prompt tokens and 4 of 5 outputs");
        assert_eq!(routing.ids, expected(&tokens, 14), "{id}");
        runs.push(c);
    }
    let f = runs[1].finish.as_ref().unwrap();
    assert_eq!(
        f.n_cached_tokens, 8,
        "the second run hit the first one's blocks"
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn without_capture_a_finish_has_no_routing() {
    let engine = engine(checksum(), small_config(64, 4));
    assert_eq!(engine.routing_shape(), None);
    let c = collect(
        engine
            .generate(request("a", TokenId::list([1, 2, 3]), 2))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(c.finish.unwrap().routing, None);
    engine.shutdown().await.unwrap();
}

/// A stop string ends the stream before the core's finish: the finish waits for the core's
/// (of the abort the stream asked for) and keeps the rows of the tokens it reported.
#[tokio::test]
async fn a_stop_string_finish_has_the_routing_of_the_tokens_up_to_it() {
    let config = ModelEngineConfig {
        block_size: 4,
        kv_cache: KvCacheSize::Blocks(64),
        max_model_len: Some(64),
        ..ModelEngineConfig::default()
    };
    let started = start_model_with(tiny_model(), &config, FakeMoe::wrap(SHAPE, |e| e)).unwrap();
    let engine = started.handle;
    let tokenizer = engine.tokenizer().unwrap().clone();
    let prompt: Vec<TokenId> = TokenId::list(
        tokenizer
            .encode("Once upon a time", true)
            .unwrap()
            .get_ids()
            .iter()
            .copied(),
    );
    let greedy = |id: &str, stop: Vec<String>| GenerateRequest {
        request_id: id.to_owned(),
        prompt: prompt.clone(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(12)
        },
        stop,
        detokenize: true,
        ..GenerateRequest::default()
    };
    let whole = collect(engine.generate(greedy("whole", Vec::new())).await.unwrap()).await;
    assert_eq!(whole.tokens.len(), 12);
    // A stop string that the fourth token's text completes: the text up to it.
    let text_of = |ids: &[TokenId]| tokenizer.decode(TokenId::as_raw_slice(ids), true).unwrap();
    let stop = text_of(&whole.tokens[..4]).trim_start().to_owned();
    assert!(stop.len() > text_of(&whole.tokens[..3]).len(), "{stop:?}");
    let c = collect(
        engine
            .generate(greedy("stopped", vec![stop.clone()]))
            .await
            .unwrap(),
    )
    .await;
    let f = c.finish.as_ref().unwrap();
    assert_eq!(f.reason, FinishReason::Stop);
    assert_eq!(f.stop_reason, Some(StopReason::String(stop)));
    assert_eq!(c.tokens, whole.tokens[..4]);
    let tokens: Vec<TokenId> = prompt.iter().chain(&c.tokens).copied().collect();
    let routing = routing_of(&c);
    assert_eq!(routing.rows(), prompt.len() + 3);
    assert_eq!(routing.ids, expected(&tokens, prompt.len() + 3));
    engine.shutdown().await.unwrap();
}
