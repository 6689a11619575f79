//! Beam search (`use_beam_search`) against a reference beam search written here over the
//! model's own logprobs (each step a one-token greedy request with its top `2n` logprobs,
//! token ids named by `return_tokens_as_token_ids`), from vLLM's algorithm: every beam's
//! `2n` best next tokens are candidates scored by cumulative logprob, an EOS candidate is a
//! finished sequence, the `n` best of the rest go on; the answer ranks finished and live
//! sequences by `cumulative / generated ^ length_penalty`.

use serde_json::{json, Value};

use crate::support::{ids, start, Options, Server, MODEL};

/// `(token, logprob)` candidates of the token after `tokens`, best first.
async fn next_tokens(s: &Server, tokens: &[u64], k: usize) -> Vec<(u64, f64)> {
    let out = s
        .ok(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": tokens, "max_tokens": 1, "temperature": 0,
                    "ignore_eos": true, "logprobs": k, "return_tokens_as_token_ids": true}),
        )
        .await;
    let top = out["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .unwrap()
        .iter()
        .map(|(t, l)| {
            let id = t.strip_prefix("token:").unwrap().parse().unwrap();
            (id, l.as_f64().unwrap())
        })
        .collect::<Vec<_>>();
    let mut top = top;
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    top
}

/// A sequence of the reference search: generated tokens, cumulative logprob, ended by EOS.
#[derive(Debug, Clone)]
struct Seq {
    tokens: Vec<u64>,
    cum: f64,
    eos: bool,
}

async fn reference(
    s: &Server,
    prompt: &[u64],
    width: usize,
    max_tokens: usize,
    length_penalty: f64,
    eos: &[u64],
) -> Vec<Seq> {
    let mut live = vec![Seq {
        tokens: vec![],
        cum: 0.0,
        eos: false,
    }];
    let mut done = Vec::new();
    for _ in 0..max_tokens {
        if live.is_empty() {
            break;
        }
        let mut candidates = Vec::new();
        for beam in &live {
            let context: Vec<u64> = prompt.iter().chain(&beam.tokens).copied().collect();
            for (t, l) in next_tokens(s, &context, 2 * width).await {
                let mut next = beam.clone();
                next.tokens.push(t);
                next.cum += l;
                if eos.contains(&t) {
                    next.eos = true;
                    done.push(next);
                } else {
                    candidates.push(next);
                }
            }
        }
        candidates.sort_by(|a, b| b.cum.total_cmp(&a.cum));
        candidates.truncate(width);
        live = candidates;
    }
    done.extend(live);
    let score = |q: &Seq| q.cum / (q.tokens.len().max(1) as f64).powf(length_penalty);
    done.sort_by(|a, b| score(b).total_cmp(&score(a)));
    done.truncate(width);
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beam_search_returns_the_reference_searchs_sequences_best_first() {
    let s = start(Options::default()).await;
    let prompt: Vec<u64> = ids(&s.ok("/tokenize", &json!({"prompt": "The beams"})).await["tokens"]);
    let eos: Vec<u64> = s
        .engine
        .scheduler_config()
        .eos_token_ids
        .iter()
        .map(|t| u64::from(t.0))
        .collect();
    // Three widths, lengths and length penalties (a penalty reorders finished sequences of
    // different lengths; the reference finishes a sequence on EOS as the server must).
    for (width, max_tokens, length_penalty) in [(3, 4, 1.0), (2, 5, 0.0), (4, 3, 2.0)] {
        let want = reference(&s, &prompt, width, max_tokens, length_penalty, &eos).await;
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                          "n": width, "use_beam_search": true,
                          "length_penalty": length_penalty, "return_token_ids": true});
        let out = s.ok("/v1/completions", &body).await;
        let choices = out["choices"].as_array().unwrap();
        assert_eq!(choices.len(), width, "{out}");
        for (rank, (choice, seq)) in choices.iter().zip(&want).enumerate() {
            assert_eq!(choice["index"], rank, "{out}");
            assert_eq!(ids(&choice["token_ids"]), seq.tokens, "rank {rank}: {out}");
            let reason = if seq.eos { "stop" } else { "length" };
            assert_eq!(choice["finish_reason"], reason, "{out}");
        }
        let total: usize = want.iter().map(|q| q.tokens.len()).sum();
        assert_eq!(out["usage"]["completion_tokens"], total, "{out}");
    }
}

/// Chat streams each sequence whole, in one chunk, and its choices equal the non-streamed
/// ones; completions refuse to stream it (vLLM's words); logprobs come with the tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beam_search_streams_on_chat_and_not_on_completions() {
    let s = start(Options::default()).await;
    let messages = json!([{"role": "user", "content": "hi"}]);
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 3, "n": 2,
                      "use_beam_search": true, "return_token_ids": true,
                      "logprobs": true, "top_logprobs": 2});
    let whole = s.ok("/v1/chat/completions", &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &streamed).await;
    for choice in whole["choices"].as_array().unwrap() {
        let index = &choice["index"];
        let chunks: Vec<&Value> = events
            .iter()
            .filter(|e| {
                &e["choices"][0]["index"] == index && e["choices"][0]["delta"]["role"].is_null()
            })
            .collect();
        assert_eq!(chunks.len(), 1, "one chunk per sequence: {events:?}");
        let c = &chunks[0]["choices"][0];
        assert_eq!(c["token_ids"], choice["token_ids"]);
        assert_eq!(c["delta"]["content"], choice["message"]["content"]);
        assert_eq!(c["finish_reason"], choice["finish_reason"]);
        let logprobs = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(logprobs.len(), ids(&choice["token_ids"]).len());
        assert!(logprobs
            .iter()
            .all(|l| l["top_logprobs"].as_array().unwrap().len() == 2));
    }
    let (status, err) = s
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "x", "n": 2, "use_beam_search": true,
                    "stream": true}),
        )
        .await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(
        err["error"]["message"],
        "Streaming is not currently supported with beam search"
    );
}
