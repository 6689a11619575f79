//! The sampling and request fields RL clients send (vLLM's extensions): `min_tokens`,
//! `include_stop_str_in_output`, the completions `max_tokens` default, `skip_special_tokens`,
//! `return_tokens_as_token_ids`, `truncate_prompt_tokens`, `stream_options`, and the
//! penalties and `logit_bias` against a reference of vLLM's formula over the raw logits.

use std::collections::HashMap;

use ferry_engine::LogprobsMode;
use serde_json::{json, Value};

use crate::support::{ids, start, Options, Server, MODEL};

const PROMPT: &str = "the quick brown fox and the lazy dog";

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// A greedy completion of `PROMPT` that ignores EOS, with `extra` fields added.
fn greedy(max_tokens: u32, extra: Value) -> Value {
    let mut body = json!({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": true, "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn detokenize(s: &Server, tokens: &[u64]) -> String {
    let out = s.ok("/detokenize", &json!({"tokens": tokens})).await;
    out["prompt"].as_str().unwrap().to_owned()
}

fn vocab_size(s: &Server) -> usize {
    s.engine.tokenizer().unwrap().get_vocab_size(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_default_to_16_tokens_and_chat_to_the_rest_of_the_context() {
    let s = start(Options::default()).await;
    let out = s
        .ok(
            "/v1/completions",
            &json!({"prompt": PROMPT, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(out["usage"]["completion_tokens"], 16);
    assert_eq!(out["choices"][0]["finish_reason"], "length");
    let out = s
        .ok(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                    "ignore_eos": true}),
        )
        .await;
    let prompt = out["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        out["usage"]["completion_tokens"].as_u64().unwrap(),
        crate::support::MAX_MODEL_LEN as u64 - prompt
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_holds_back_stop_tokens_and_stop_strings() {
    let s = start(Options::default()).await;
    let free = s
        .ok("/v1/completions", &greedy(6, json!({"logprobs": 1})))
        .await;
    let tokens = ids(&free["choices"][0]["token_ids"]);
    let first = tokens[0];
    // The first token as a stop token ends the request at once.
    let stopped = s
        .ok(
            "/v1/completions",
            &greedy(6, json!({"stop_token_ids": [first]})),
        )
        .await;
    assert_eq!(ids(&stopped["choices"][0]["token_ids"]), [first]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    // With min_tokens it cannot be sampled: the first token is the model's second best.
    let held = s
        .ok(
            "/v1/completions",
            &greedy(
                6,
                json!({"stop_token_ids": [first], "min_tokens": 1, "logprobs": 2,
                       "return_tokens_as_token_ids": true}),
            ),
        )
        .await;
    let choice = &held["choices"][0];
    let held_tokens = ids(&choice["token_ids"]);
    assert_ne!(held_tokens[0], first);
    let top = choice["logprobs"]["top_logprobs"][0].as_object().unwrap();
    // Raw logprobs: the held-back token is still the model's best, the sample its second.
    let mut ranked: Vec<(&String, f64)> =
        top.iter().map(|(k, v)| (k, v.as_f64().unwrap())).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    assert_eq!(ranked[0].0, &format!("token:{first}"));
    assert_eq!(ranked[1].0, &format!("token:{}", held_tokens[0]));

    // A stop string that is the first token's text matches nowhere while min_tokens covers
    // the whole output.
    let first_text = detokenize(&s, &[first]).await;
    let free_text = text(&free);
    let out = s
        .ok(
            "/v1/completions",
            &greedy(6, json!({"stop": [first_text.clone()]})),
        )
        .await;
    assert_eq!(text(&out), "");
    assert_eq!(out["choices"][0]["stop_reason"], first_text);
    let out = s
        .ok(
            "/v1/completions",
            &greedy(6, json!({"stop": [first_text], "min_tokens": 6})),
        )
        .await;
    assert_eq!(text(&out), free_text);
    assert_eq!(out["choices"][0]["finish_reason"], "length");
    // min_tokens above max_tokens is refused.
    s.expect_error(
        "/v1/completions",
        &greedy(4, json!({"min_tokens": 5})),
        400,
        Some("min_tokens"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text() {
    let s = start(Options::default()).await;
    let free = s.ok("/v1/completions", &greedy(8, json!({}))).await;
    let free_text = text(&free);
    let tokens = ids(&free["choices"][0]["token_ids"]);
    // A stop string inside the output: two characters from the middle.
    let chars: Vec<char> = free_text.chars().collect();
    assert!(chars.len() >= 4, "{free_text:?}");
    let at = chars.len() / 2;
    let stop: String = chars[at..at + 2].iter().collect();
    let before: String = free_text[..free_text.find(&stop).unwrap()].to_owned();
    for (include, want) in [(false, before.clone()), (true, before.clone() + &stop)] {
        let out = s
            .ok(
                "/v1/completions",
                &greedy(
                    8,
                    json!({"stop": [stop.clone()], "include_stop_str_in_output": include}),
                ),
            )
            .await;
        assert_eq!(text(&out), want, "include {include}");
        assert_eq!(out["choices"][0]["stop_reason"], stop.as_str());
        // Streaming cuts the same text.
        let mut streamed = greedy(
            8,
            json!({"stop": [stop.clone()], "include_stop_str_in_output": include,
                   "stream": true}),
        );
        streamed["return_token_ids"] = json!(false);
        let events = s.stream("/v1/completions", &streamed).await;
        let joined: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(joined, want, "streamed, include {include}");
    }
    // A stop token: its text is kept with the flag, left out without it.
    let k = (1..tokens.len())
        .find(|&k| !tokens[..k].contains(&tokens[k]))
        .unwrap();
    for (include, n) in [(false, k), (true, k + 1)] {
        let out = s
            .ok(
                "/v1/completions",
                &greedy(
                    8,
                    json!({"stop_token_ids": [tokens[k]], "include_stop_str_in_output": include}),
                ),
            )
            .await;
        assert_eq!(ids(&out["choices"][0]["token_ids"]), tokens[..=k]);
        assert_eq!(text(&out), detokenize(&s, &tokens[..n]).await);
    }
}

/// The id of the tiny tokenizer's `<|im_start|>`.
fn im_start(s: &Server) -> u32 {
    s.engine
        .tokenizer()
        .unwrap()
        .token_to_id("<|im_start|>")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_special_tokens_false_keeps_special_tokens_in_the_text() {
    let s = start(Options::default()).await;
    let special = im_start(&s);
    // A large bias makes every output token the special one.
    let bias = json!({"logit_bias": {special.to_string(): 100}});
    let out = s.ok("/v1/completions", &greedy(3, bias.clone())).await;
    assert_eq!(
        ids(&out["choices"][0]["token_ids"]),
        [u64::from(special); 3]
    );
    assert_eq!(text(&out), "");
    let mut keep = bias;
    keep["skip_special_tokens"] = json!(false);
    let out = s.ok("/v1/completions", &greedy(3, keep.clone())).await;
    assert_eq!(text(&out), "<|im_start|>".repeat(3));
    keep["stream"] = json!(true);
    keep["return_token_ids"] = json!(false);
    let events = s.stream("/v1/completions", &greedy(3, keep)).await;
    let joined: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, "<|im_start|>".repeat(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn return_tokens_as_token_ids_names_logprob_tokens_by_id() {
    let s = start(Options::default()).await;
    let out = s
        .ok(
            "/v1/completions",
            &greedy(
                4,
                json!({"logprobs": 2, "return_tokens_as_token_ids": true}),
            ),
        )
        .await;
    let choice = &out["choices"][0];
    let want: Vec<String> = ids(&choice["token_ids"])
        .iter()
        .map(|t| format!("token:{t}"))
        .collect();
    assert_eq!(choice["logprobs"]["tokens"], json!(want));
    for top in choice["logprobs"]["top_logprobs"].as_array().unwrap() {
        for key in top.as_object().unwrap().keys() {
            assert!(
                key.strip_prefix("token:").unwrap().parse::<u32>().is_ok(),
                "{key}"
            );
        }
    }
    let out = s
        .ok(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2,
                    "return_tokens_as_token_ids": true, "return_token_ids": true}),
        )
        .await;
    let choice = &out["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    for (entry, t) in content.iter().zip(ids(&choice["token_ids"])) {
        assert_eq!(entry["token"], format!("token:{t}"));
        assert_eq!(entry["bytes"], json!(format!("token:{t}").into_bytes()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_prompt_tokens_keeps_the_last_tokens() {
    let s = start(Options::default()).await;
    let prompt: Vec<u64> = ids(&s.ok("/tokenize", &json!({"prompt": PROMPT})).await["tokens"]);
    assert!(prompt.len() > 3);
    let mut body = greedy(5, json!({"truncate_prompt_tokens": 3}));
    let cut = s.ok("/v1/completions", &body).await;
    assert_eq!(cut["usage"]["prompt_tokens"], 3);
    assert_eq!(
        ids(&cut["choices"][0]["prompt_token_ids"]),
        prompt[prompt.len() - 3..]
    );
    body["prompt"] = json!(prompt[prompt.len() - 3..]);
    body.as_object_mut()
        .unwrap()
        .remove("truncate_prompt_tokens");
    let direct = s.ok("/v1/completions", &body).await;
    assert_eq!(
        direct["choices"][0]["token_ids"],
        cut["choices"][0]["token_ids"]
    );
    body["truncate_prompt_tokens"] = json!(0);
    s.expect_error(
        "/v1/completions",
        &body,
        400,
        Some("truncate_prompt_tokens"),
    )
    .await;
}

/// `truncation_side: "right"` keeps the prompt's first tokens (vLLM's); `"left"` is the
/// default; anything else is a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncation_side_right_keeps_the_first_tokens() {
    let s = start(Options::default()).await;
    let prompt: Vec<u64> = ids(&s.ok("/tokenize", &json!({"prompt": PROMPT})).await["tokens"]);
    assert!(prompt.len() > 3);
    for (side, kept) in [
        (json!("right"), &prompt[..3]),
        (json!("left"), &prompt[prompt.len() - 3..]),
    ] {
        let body = greedy(
            2,
            json!({"truncate_prompt_tokens": 3, "truncation_side": side}),
        );
        let cut = s.ok("/v1/completions", &body).await;
        assert_eq!(ids(&cut["choices"][0]["prompt_token_ids"]), kept, "{side}");
        let chat = s
            .ok(
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                        "max_tokens": 1, "truncate_prompt_tokens": 3,
                        "truncation_side": side, "return_token_ids": true}),
            )
            .await;
        assert_eq!(chat["usage"]["prompt_tokens"], 3, "{side}");
    }
    // `-1`: the model's length less one, vLLM's room for one output token.
    let long: Vec<u64> = (0..crate::support::MAX_MODEL_LEN as u64 + 5)
        .map(|i| 3 + i % 50)
        .collect();
    let mut body = greedy(1, json!({"truncate_prompt_tokens": -1}));
    body["prompt"] = json!(long);
    let cut = s.ok("/v1/completions", &body).await;
    assert_eq!(
        cut["usage"]["prompt_tokens"],
        crate::support::MAX_MODEL_LEN - 1,
        "{cut}"
    );
    let body = greedy(
        2,
        json!({"truncate_prompt_tokens": 3, "truncation_side": "middle"}),
    );
    s.expect_error("/v1/completions", &body, 400, Some("truncation_side"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_options_need_a_stream_and_continuous_usage_counts_every_chunk() {
    let s = start(Options::default()).await;
    s.expect_error(
        "/v1/completions",
        &greedy(3, json!({"stream_options": {"include_usage": true}})),
        400,
        Some("stream_options"),
    )
    .await;
    s.expect_error(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}],
                "stream_options": {"include_usage": true}}),
        400,
        Some("stream_options"),
    )
    .await;
    let body = greedy(
        5,
        json!({"stream": true,
               "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
    );
    let events = s.stream("/v1/completions", &body).await;
    let (last, chunks) = events.split_last().unwrap();
    let mut seen = 0;
    for c in chunks {
        let n = c["choices"][0]["token_ids"].as_array().unwrap().len() as u64;
        seen += n;
        assert_eq!(c["usage"]["completion_tokens"].as_u64(), Some(seen), "{c}");
        assert!(c["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    }
    assert_eq!(seen, 5);
    assert_eq!(last["usage"]["completion_tokens"], 5);
    // Chat, two choices: every chunk carries its own choice's usage (vLLM's), the opening
    // role chunks too (no tokens yet); the last, usage-only chunk sums the choices.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "n": 2, "ignore_eos": true, "stream": true,
                      "return_token_ids": true,
                      "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let events = s.stream("/v1/chat/completions", &body).await;
    let (last, chunks) = events.split_last().unwrap();
    let prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut seen = [0u64; 2];
    for c in chunks {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        seen[i] += choice["token_ids"].as_array().unwrap().len() as u64;
        assert_eq!(c["usage"]["prompt_tokens"].as_u64(), Some(prompt), "{c}");
        assert_eq!(
            c["usage"]["completion_tokens"].as_u64(),
            Some(seen[i]),
            "{c}"
        );
    }
    assert!(chunks
        .iter()
        .take(2)
        .all(|c| c["usage"]["completion_tokens"] == 0));
    assert_eq!(seen, [4, 4]);
    assert_eq!(last["usage"]["completion_tokens"], 8);
    // Without the option the chunks carry no usage.
    let body = greedy(
        3,
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let events = s.stream("/v1/completions", &body).await;
    let (_, chunks) = events.split_last().unwrap();
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

/// The penalties of one test request.
const PRESENCE: f32 = 0.7;
const FREQUENCY: f32 = 0.4;
const REPETITION: f32 = 1.6;
const BIAS: f32 = 1.5;

/// vLLM's `apply_penalties` (plus `logit_bias` before it) over a full row of raw logits,
/// written from the formula: counts over the output, a seen-mask over prompt and output.
fn reference_processed(
    raw: &[f32],
    prompt: &[u64],
    output: &[u64],
    bias: &HashMap<u64, f32>,
) -> Vec<f32> {
    let mut counts = vec![0u32; raw.len()];
    let mut seen = vec![false; raw.len()];
    for &t in prompt {
        seen[t as usize] = true;
    }
    for &t in output {
        counts[t as usize] += 1;
        seen[t as usize] = true;
    }
    raw.iter()
        .enumerate()
        .map(|(t, &l)| {
            let mut l = l + bias.get(&(t as u64)).copied().unwrap_or(0.0);
            if seen[t] {
                l = if l > 0.0 {
                    l / REPETITION
                } else {
                    l * REPETITION
                };
            }
            l -= FREQUENCY * counts[t] as f32;
            l -= PRESENCE * if counts[t] > 0 { 1.0 } else { 0.0 };
            l
        })
        .collect()
}

/// Every step's full row of logits (as reported in `mode`) and the sampled tokens of one
/// greedy completion with penalties and a bias on `biased`.
async fn penalized_run(
    mode: LogprobsMode,
    prompt: &[u64],
    biased: u64,
) -> (Vec<Vec<f32>>, Vec<u64>) {
    let s = start(Options {
        logprobs_mode: mode,
        max_top_logprobs: Some(1000),
        ..Options::default()
    })
    .await;
    let vocab = vocab_size(&s);
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": true,
                      "logprobs": vocab, "return_tokens_as_token_ids": true,
                      "return_token_ids": true, "presence_penalty": PRESENCE,
                      "frequency_penalty": FREQUENCY, "repetition_penalty": REPETITION,
                      "logit_bias": {biased.to_string(): BIAS}});
    let out = s.ok("/v1/completions", &body).await;
    let choice = &out["choices"][0];
    let rows = choice["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|top| {
            let mut row = vec![f32::NAN; vocab];
            for (k, v) in top.as_object().unwrap() {
                let t: usize = k.strip_prefix("token:").unwrap().parse().unwrap();
                row[t] = v.as_f64().unwrap() as f32;
            }
            assert!(row.iter().all(|l| !l.is_nan()), "a full row");
            row
        })
        .collect();
    (rows, ids(&choice["token_ids"]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_logit_bias_follow_vllms_formula_over_the_raw_logits() {
    let prompt: Vec<u64> = vec![10, 20, 30, 10, 40, 50, 60, 70];
    // A token the unpenalized model does not pick first, so the bias matters.
    let (raw, tokens) = penalized_run(LogprobsMode::RawLogits, &prompt, 200).await;
    let bias = HashMap::from([(200u64, BIAS)]);
    let mut output: Vec<u64> = Vec::new();
    let mut n_changed = 0;
    for (i, row) in raw.iter().enumerate() {
        let processed = reference_processed(row, &prompt, &output, &bias);
        // Greedy: the argmax of the processed logits, ties to the lower id.
        let want = (0..processed.len()).fold(0, |best, t| {
            if processed[t] > processed[best] {
                t
            } else {
                best
            }
        });
        assert_eq!(tokens[i], want as u64, "step {i}");
        let raw_best = (0..row.len()).fold(0, |best, t| if row[t] > row[best] { t } else { best });
        n_changed += usize::from(raw_best != want);
        output.push(tokens[i]);
    }
    assert!(
        n_changed > 0,
        "the penalties changed no greedy choice: the test tests nothing"
    );
    // The processed modes report the processed logits, bit for bit.
    let (processed, same_tokens) = penalized_run(LogprobsMode::ProcessedLogits, &prompt, 200).await;
    assert_eq!(same_tokens, tokens);
    let mut output: Vec<u64> = Vec::new();
    for (i, (row, got)) in raw.iter().zip(&processed).enumerate() {
        let want = reference_processed(row, &prompt, &output, &bias);
        let same = want
            .iter()
            .zip(got)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "step {i}");
        output.push(tokens[i]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalty_fields_are_checked() {
    let s = start(Options::default()).await;
    for (field, value) in [
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3)),
        ("repetition_penalty", json!(0)),
        ("min_tokens", json!(-1)),
    ] {
        s.expect_error(
            "/v1/completions",
            &greedy(3, json!({field: value})),
            400,
            Some(field),
        )
        .await;
    }
    s.expect_error(
        "/v1/completions",
        &greedy(3, json!({"logit_bias": {"x": 1}})),
        400,
        Some("logit_bias.x"),
    )
    .await;
    let oov = vocab_size(&s).to_string();
    s.expect_error(
        "/v1/completions",
        &greedy(3, json!({"logit_bias": {oov.clone(): 1}})),
        400,
        Some(&format!("logit_bias.{oov}")),
    )
    .await;
}

/// A prompt long enough to fill prefix-cache blocks.
fn long_prompt() -> Vec<u64> {
    (0..40).map(|i| 40 + (i * 7) % 180).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_equal_a_forward_of_each_prefix_and_skip_the_prefix_cache() {
    let s = start(Options {
        max_top_logprobs: Some(1000),
        ..Options::default()
    })
    .await;
    let vocab = vocab_size(&s);
    let prompt = long_prompt();
    // Fill the cache with the prompt first: the request below still computes every position.
    let plain = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    s.ok("/v1/completions", &plain).await;
    let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0,
                      "prompt_logprobs": 2, "return_token_ids": true});
    let out = s.ok("/v1/completions", &body).await;
    assert_eq!(out["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let lps = out["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), prompt.len());
    assert_eq!(lps[0], Value::Null);
    // The reference: the next-token logprobs of a one-token completion of each prefix.
    for p in 1..prompt.len() {
        let reference = s
            .ok(
                "/v1/completions",
                &json!({"prompt": prompt[..p], "max_tokens": 1, "temperature": 0,
                        "logprobs": vocab, "return_tokens_as_token_ids": true}),
            )
            .await;
        let top = reference["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .clone();
        let value = |t: u64| top[&format!("token:{t}")].as_f64().unwrap();
        let entry = lps[p].as_object().unwrap();
        let own = &entry[&prompt[p].to_string()];
        assert_eq!(
            own["logprob"].as_f64().unwrap(),
            value(prompt[p]),
            "position {p}"
        );
        // vLLM's rank: the tokens at least as likely, itself included.
        let rank = top
            .values()
            .filter(|v| v.as_f64().unwrap() >= value(prompt[p]))
            .count();
        assert_eq!(own["rank"].as_u64().unwrap() as usize, rank, "position {p}");
        assert_eq!(
            own["decoded_token"],
            detokenize(&s, &[prompt[p]]).await,
            "position {p}"
        );
        // The top 2 are the reference's best two, ranks 1 and 2.
        let mut best: Vec<(u64, f64)> = top
            .iter()
            .map(|(k, v)| (k[6..].parse().unwrap(), v.as_f64().unwrap()))
            .collect();
        best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (i, (t, l)) in best[..2].iter().enumerate() {
            let e = &entry[&t.to_string()];
            assert_eq!(e["logprob"].as_f64().unwrap(), *l, "position {p}");
            if *t != prompt[p] {
                assert_eq!(e["rank"].as_u64().unwrap() as usize, i + 1, "position {p}");
            }
        }
        assert!(entry.len() <= 3, "position {p}: {entry:?}");
    }
    // It filled the cache for others all the same.
    s.ok("/v1/completions", &plain).await;
    let again = s.ok("/v1/completions", &body).await;
    assert_eq!(
        again["choices"][0]["prompt_logprobs"],
        out["choices"][0]["prompt_logprobs"]
    );
    let after = s.ok("/v1/completions", &plain).await;
    assert!(
        after["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    // Streaming: the same list on the first chunk; chat: on the response.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/completions", &streamed).await;
    assert_eq!(
        events[0]["choices"][0]["prompt_logprobs"],
        out["choices"][0]["prompt_logprobs"]
    );
    assert!(events[1..]
        .iter()
        .all(|e| e["choices"][0].get("prompt_logprobs").is_none()));
    let chat = s
        .ok(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "prompt_logprobs": 0}),
        )
        .await;
    let n_prompt = chat["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(chat["prompt_logprobs"].as_array().unwrap().len(), n_prompt);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_puts_the_prompt_and_its_logprobs_before_the_output() {
    let s = start(Options::default()).await;
    let plain = s
        .ok("/v1/completions", &greedy(4, json!({"logprobs": 1})))
        .await;
    let echoed = s
        .ok(
            "/v1/completions",
            &greedy(4, json!({"logprobs": 1, "echo": true})),
        )
        .await;
    assert_eq!(text(&echoed), format!("{PROMPT}{}", text(&plain)));
    let prompt_ids = ids(&echoed["choices"][0]["prompt_token_ids"]);
    let n = prompt_ids.len();
    let lp = &echoed["choices"][0]["logprobs"];
    let plain_lp = &plain["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n + 4);
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    assert_eq!(
        lp["token_logprobs"].as_array().unwrap()[n..],
        plain_lp["token_logprobs"].as_array().unwrap()[..]
    );
    assert_eq!(
        lp["tokens"].as_array().unwrap()[n..],
        plain_lp["tokens"].as_array().unwrap()[..]
    );
    // The prompt's entries are its prompt logprobs.
    let with_prompt = s
        .ok("/v1/completions", &greedy(4, json!({"prompt_logprobs": 1})))
        .await;
    let prompt_lps = with_prompt["choices"][0]["prompt_logprobs"]
        .as_array()
        .unwrap();
    for i in 1..n {
        let own = &prompt_lps[i][&prompt_ids[i].to_string()];
        assert_eq!(lp["token_logprobs"][i], own["logprob"], "prompt token {i}");
    }
    // Offsets count the echoed text too.
    let offsets: Vec<u64> = ids(&lp["text_offset"]);
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[n] as usize, PROMPT.chars().count());
    // Streamed, the echo comes with the first chunk.
    let mut streamed = greedy(4, json!({"echo": true, "stream": true}));
    streamed["return_token_ids"] = json!(false);
    let events = s.stream("/v1/completions", &streamed).await;
    assert!(events[0]["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with(PROMPT));
    let joined: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, text(&echoed));
}
