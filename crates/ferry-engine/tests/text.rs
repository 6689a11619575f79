//! Text output with the tiny model's byte-level tokenizer: incremental detokenization,
//! stop strings, EOS, and the real tiny Llama model behind the engine.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_core::{AddError, FinishReason, SamplingParams, SchedulerConfig, TokenId};
use ferry_engine::detok::IncrementalDetokenizer;
use ferry_engine::{spawn, EngineConfig, EngineHandle, GenerateError, GenerateRequest, StopReason};
use ferry_model::tiny::{tiny_config, tiny_model, IM_END};
use ferry_model::{Executor, LlamaModel};
use support::*;
use tokenizers::Tokenizer;

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(tiny_model().tokenizer.expect("tiny tokenizer"))
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<TokenId> {
    TokenId::from_raw_slice(tok.encode(text, false).unwrap().get_ids()).to_vec()
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        n_blocks: 128,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        eos_token_ids: tiny_config().eos_token_ids,
        ..SchedulerConfig::default()
    }
}

fn text_engine(executor: impl Executor + 'static, tok: &Arc<Tokenizer>) -> EngineHandle {
    let config = EngineConfig {
        scheduler: config(),
        input_queue_capacity: 64,
        lora: None,
    };
    spawn(config, Box::new(executor), Some(tok.clone())).unwrap()
}

fn scripted(tok: &Tokenizer, text: &str) -> (Scripted, Vec<TokenId>) {
    let script = encode(tok, text);
    let exec = Scripted {
        script: script.clone(),
        vocab_size: tok.get_vocab_size(true),
        weights: Default::default(),
    };
    (exec, script)
}

fn text_request(id: &str, max_tokens: usize, stop: &[&str]) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        prompt: TokenId::list([72, 105]),
        params: SamplingParams::greedy(max_tokens as u32),
        stop: stop.iter().map(|s| s.to_string()).collect(),
        detokenize: true,
        transfer: None,
        constraint: None,
        ..GenerateRequest::default()
    }
}

const MULTIBYTE: &str = "héllo wörld, 世界 says 🎉🚀 to the café — done";

#[test]
fn deltas_add_up_to_the_full_decode_for_multibyte_text() {
    let tok = tokenizer();
    let ids = encode(&tok, MULTIBYTE);
    for context in [vec![], encode(&tok, "Hi there ")] {
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &context);
        let deltas: Vec<String> = ids.iter().map(|&t| detok.push(t)).collect();
        let text = deltas.concat() + &detok.flush();
        assert_eq!(text, MULTIBYTE);
        assert_eq!(text, tok.decode(TokenId::as_raw_slice(&ids), true).unwrap());
        assert!(deltas
            .iter()
            .all(|d| !d.contains(char::REPLACEMENT_CHARACTER)));
        // Some token ended inside a character and had to wait.
        assert!(deltas.iter().any(String::is_empty));
    }
}

#[test]
fn deltas_add_up_to_the_full_decode_even_for_invalid_utf8() {
    // Random byte tokens and merges, as a random-weight model emits them: invalid sequences,
    // stray continuation bytes, characters cut at the end.
    let tok = tokenizer();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n) as u32
    };
    let n_plain = tok.get_vocab_size(true) as u64 - 3; // the specials are last
    for _ in 0..300 {
        let len = 1 + next(12) as usize;
        let ids: Vec<TokenId> = (0..len)
            .map(|_| {
                // Mostly multibyte lead and continuation bytes, some ASCII and merges.
                TokenId(match next(4) {
                    0 => 0x80 + next(0x80),
                    1 => 0xE0 + next(0x20),
                    2 => next(0x80),
                    _ => next(n_plain),
                })
            })
            .collect();
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &[]);
        let text: String = ids.iter().map(|&t| detok.push(t)).collect();
        assert_eq!(
            text + &detok.flush(),
            tok.decode(TokenId::as_raw_slice(&ids), true).unwrap(),
            "{ids:?}"
        );
    }
}

#[test]
fn special_tokens_are_skipped() {
    let tok = tokenizer();
    let mut ids = encode(&tok, "ab");
    ids.push(TokenId(tok.token_to_id(IM_END).unwrap()));
    ids.extend(encode(&tok, "c"));
    let mut detok = IncrementalDetokenizer::new(tok, &[]);
    let text: String = ids.iter().map(|&t| detok.push(t)).collect();
    assert_eq!(text + &detok.flush(), "abc");
}

#[tokio::test]
async fn text_deltas_follow_the_tokens() {
    let tok = tokenizer();
    let (exec, script) = scripted(&tok, MULTIBYTE);
    let engine = text_engine(exec, &tok);
    let out = collect(
        engine
            .generate(text_request("a", script.len(), &[]))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(out.tokens, script);
    assert_eq!(out.text, MULTIBYTE);
    assert_eq!(out.reason(), FinishReason::Length);
    engine.shutdown().await.unwrap();
}

/// The tokens up to the one whose text completes `stop`, and the text before `stop`.
fn expected_stop(tok: &Tokenizer, script: &[TokenId], stop: &str) -> (Vec<TokenId>, String) {
    let k = (1..=script.len())
        .find(|&k| {
            tok.decode(TokenId::as_raw_slice(&script[..k]), true)
                .unwrap()
                .contains(stop)
        })
        .expect("stop string in the script");
    let full = tok.decode(TokenId::as_raw_slice(script), true).unwrap();
    (
        script[..k].to_vec(),
        full[..full.find(stop).unwrap()].to_owned(),
    )
}

#[tokio::test]
async fn stop_strings_cut_the_text_and_abort_the_request() {
    let tok = tokenizer();
    let text = "Hello world, the END is near. 世界🎉 and more";
    // Within one token's text, across token boundaries, and inside a multibyte character
    // split over byte tokens.
    for stop in ["END", "d, t", "界", "🎉 a"] {
        let (exec, script) = scripted(&tok, text);
        let (exec, mut gate) = gated(exec);
        let engine = text_engine(exec, &tok);
        let req = text_request("a", 200, &["never", stop]);
        let mut stream = engine.generate(req).await.unwrap();
        // Lock-step: one step, one chunk, so the engine cannot run ahead of the reader.
        let mut out = Collected::default();
        while out.finish.is_none() {
            gate.next_step().await;
            gate.release();
            let chunk = stream.next().await.unwrap();
            out.tokens.extend_from_slice(&chunk.token_ids);
            out.text.push_str(&chunk.text);
            out.finish = chunk.finish;
        }
        assert!(stream.next().await.is_none());
        gate.open();
        gate.release();
        let (tokens, before) = expected_stop(&tok, &script, stop);
        assert_eq!(out.tokens, tokens, "{stop:?}");
        assert_eq!(out.text, before, "{stop:?}");
        let finish = out.finish.unwrap();
        assert_eq!(finish.reason, FinishReason::Stop);
        assert_eq!(finish.stop_reason, Some(StopReason::String(stop.into())));
        assert_eq!(finish.n_output_tokens, tokens.len());
        // The core request was aborted: at most the step in flight ran on.
        engine.wait_idle().await.unwrap();
        let stats = engine.stats();
        assert!(
            stats.n_generated_tokens_total <= tokens.len() as u64 + 1,
            "{stop:?}"
        );
        assert_eq!(stats.scheduler.n_blocks_used, 0);
        engine.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn text_that_may_start_a_stop_string_is_held_back_until_it_does_not() {
    let tok = tokenizer();
    let text = "Hello world, worm wo";
    let (exec, script) = scripted(&tok, text);
    let engine = text_engine(exec, &tok);
    let out = collect(
        engine
            .generate(text_request("a", script.len(), &["worlds"]))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(out.text, text, "held text is released at the end");
    assert_eq!(out.reason(), FinishReason::Length);
    let mut sent = String::new();
    for chunk in &out.chunks[..out.chunks.len() - 1] {
        sent.push_str(&chunk.text);
        for n in 1.."worlds".len() {
            assert!(
                !sent.ends_with(&"worlds"[..n]),
                "{sent:?} sent before it was safe"
            );
        }
    }
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn stop_strings_work_without_text_output() {
    let tok = tokenizer();
    let (exec, script) = scripted(&tok, "one two three four");
    let engine = text_engine(exec, &tok);
    let req = GenerateRequest {
        detokenize: false,
        ..text_request("a", 50, &["three"])
    };
    let out = collect(engine.generate(req).await.unwrap()).await;
    assert_eq!(out.text, "");
    assert_eq!(out.tokens, expected_stop(&tok, &script, "three").0);
    assert_eq!(out.reason(), FinishReason::Stop);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn eos_stops_unless_ignored_and_its_text_is_not_output() {
    let tok = tokenizer();
    let text = format!("Hi there{IM_END}more");
    let eos = tok.token_to_id(IM_END).unwrap();
    let (exec, script) = scripted(&tok, &text);
    let n_before_eos = script.iter().position(|&t| t == TokenId(eos)).unwrap();
    let engine = text_engine(exec, &tok);
    let params = SamplingParams {
        max_tokens: script.len() as u32,
        ..SamplingParams::default()
    };
    let req = GenerateRequest {
        params: params.clone(),
        ..text_request("a", 0, &[])
    };
    let out = collect(engine.generate(req).await.unwrap()).await;
    assert_eq!(out.tokens, script[..=n_before_eos]);
    assert_eq!(out.text, "Hi there");
    let finish = out.finish.unwrap();
    assert_eq!(
        (finish.reason, finish.stop_reason),
        (FinishReason::Stop, Some(StopReason::Token(TokenId(eos))))
    );

    let req = GenerateRequest {
        params: SamplingParams {
            ignore_eos: true,
            ..params
        },
        ..text_request("b", 0, &[])
    };
    let out = collect(engine.generate(req).await.unwrap()).await;
    assert_eq!(out.tokens, script);
    assert_eq!(out.text, "Hi theremore");
    assert_eq!(out.reason(), FinishReason::Length);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_requests_are_refused_with_a_named_reason() {
    let tok = tokenizer();
    let no_tok = engine(checksum(), small_config(64, 4));
    for req in [text_request("a", 4, &["x"]), text_request("b", 4, &[])] {
        let err = no_tok.generate(req).await.unwrap_err();
        assert!(matches!(err, GenerateError::NoTokenizer), "{err}");
    }
    let (exec, _) = scripted(&tok, "abc");
    // Held step by step, so that "dup" stays live.
    let (exec, mut gate) = gated(exec);
    let engine = text_engine(exec, &tok);
    let empty = GenerateRequest {
        prompt: vec![],
        ..text_request("e", 4, &[])
    };
    let err = engine.generate(empty).await.unwrap_err();
    assert!(
        matches!(err, GenerateError::Rejected(AddError::EmptyPrompt { .. })),
        "{err}"
    );
    let _live = engine
        .generate(text_request("dup", 100, &[]))
        .await
        .unwrap();
    gate.next_step().await;
    let e = engine.clone();
    let dup = tokio::spawn(async move { e.generate(text_request("dup", 4, &[])).await });
    while engine.n_queued_inputs() < 1 {
        tokio::task::yield_now().await;
    }
    gate.release();
    let err = dup.await.unwrap().unwrap_err();
    assert!(
        matches!(err, GenerateError::Rejected(AddError::DuplicateId { .. })),
        "{err}"
    );
    gate.open();
    gate.release();
    engine.shutdown().await.unwrap();
    no_tok.shutdown().await.unwrap();
}

fn llama() -> LlamaModel {
    let tiny = tiny_model();
    LlamaModel::new(&tiny.config, &tiny.weights).unwrap()
}

/// Prompts for the real model: half share a long prefix.
fn prompts(tok: &Tokenizer) -> Vec<(String, Vec<TokenId>)> {
    (0..10)
        .map(|i| {
            let text = if i % 2 == 0 {
                format!("The quick brown fox jumps over the lazy dog, story {i}")
            } else {
                format!("A different prompt {i}")
            };
            (format!("r{i}"), encode(tok, &text))
        })
        .collect()
}

/// Runs `reqs` (greedy, 12 tokens, top-3 logprobs, text) all at once through a gated engine.
async fn generate_all(
    engine: &EngineHandle,
    gate: &mut Gate,
    reqs: &[(String, Vec<TokenId>)],
) -> BTreeMap<String, Collected> {
    let requests = reqs
        .iter()
        .map(|(id, prompt)| GenerateRequest {
            request_id: id.clone(),
            prompt: prompt.clone(),
            params: SamplingParams {
                sampler: ferry_core::SamplerSpec {
                    logprobs: Some(3),
                    ..Default::default()
                },
                ..SamplingParams::greedy(12)
            },
            stop: vec![],
            detokenize: true,
            transfer: None,
            constraint: None,
            ..GenerateRequest::default()
        })
        .collect();
    let tasks = spawn_held(engine, gate, requests).await;
    gate.open();
    gate.release();
    let mut out = BTreeMap::new();
    for ((id, _), task) in reqs.iter().zip(tasks) {
        out.insert(id.clone(), task.await.unwrap());
    }
    out
}

#[tokio::test]
async fn tiny_llama_concurrent_requests_match_their_solo_runs() {
    let tok = tokenizer();
    let reqs = prompts(&tok);
    let mut alone = BTreeMap::new();
    for r in &reqs {
        let (exec, mut gate) = gated(llama());
        let engine = text_engine(exec, &tok);
        alone.extend(generate_all(&engine, &mut gate, std::slice::from_ref(r)).await);
        engine.shutdown().await.unwrap();
    }
    // 16 blocks of 4 tokens: not everything fits at once.
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            n_blocks: 16,
            max_num_seqs: 6,
            ..config()
        },
        input_queue_capacity: 64,
        lora: None,
    };
    let (exec, mut gate) = gated(llama());
    let engine = spawn(config, Box::new(exec), Some(tok.clone())).unwrap();
    let together = generate_all(&engine, &mut gate, &reqs).await;
    for (id, c) in &together {
        let solo = &alone[id];
        assert_eq!(c.tokens, solo.tokens, "{id}");
        assert_eq!(c.text, solo.text, "{id}");
        assert_eq!(
            c.text,
            tok.decode(TokenId::as_raw_slice(&c.tokens), true).unwrap(),
            "{id}"
        );
        assert_eq!(c.reason(), FinishReason::Length);
        let logprobs: Vec<_> = c.chunks.iter().flat_map(|ch| &ch.logprobs).collect();
        assert_eq!(logprobs.len(), c.tokens.len());
        for (lp, &t) in logprobs.iter().zip(&c.tokens) {
            assert_eq!(lp.token, t);
            assert_eq!(lp.top.len(), 3);
            // Greedy: the token is the best one, with its logprob.
            assert_eq!(lp.top[0], (t, lp.logprob));
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(lp.top.iter().all(|&(_, l)| l <= 0.0));
        }
    }
    engine.wait_idle().await.unwrap();
    engine.check_invariants().await.unwrap().unwrap();
    let stats = engine.stats();
    assert_eq!(stats.scheduler.n_blocks_used, 0);
    assert!(stats.scheduler.prefix_hit_tokens > 0);
    assert!(stats.scheduler.n_preemptions > 0);
    assert!(stats.forward_seconds_total > 0.0);
    assert!(stats.step_seconds_total >= stats.forward_seconds_total);
    engine.shutdown().await.unwrap();
}
