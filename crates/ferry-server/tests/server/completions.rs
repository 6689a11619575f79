//! `/v1/completions`: streaming equals non-streaming, every sampling parameter, logprob
//! shapes, token-id and batched prompts, `n`, stop strings and stop tokens, request ids.

use serde_json::{json, Value};

use crate::support::{assert_usage_after_cached_rerun, ids, start, Options, MODEL};

const PROMPT: &str = "the quick brown fox and the lazy dog";

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_stream_equals_non_stream_and_prompt_ids_equal_tokenize() {
    let s = start(Options::default()).await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true, "return_token_ids": true});
    let full = s.ok("/v1/completions", &body).await;
    let choice = &full["choices"][0];
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["model"], MODEL);
    assert_eq!(choice["finish_reason"], "length");
    let tokens = ids(&choice["token_ids"]);
    assert_eq!(tokens.len(), 12);
    let tokenized = s.ok("/tokenize", &json!({"prompt": PROMPT})).await;
    assert_eq!(ids(&choice["prompt_token_ids"]), ids(&tokenized["tokens"]));
    let n_prompt = tokenized["count"].as_u64().unwrap();
    assert_eq!(full["usage"]["prompt_tokens"].as_u64(), Some(n_prompt));
    assert_eq!(full["usage"]["completion_tokens"], 12);
    assert_eq!(full["usage"]["total_tokens"].as_u64(), Some(n_prompt + 12));
    // The text is the detokenized tokens.
    let detok = s
        .ok("/detokenize", &json!({"tokens": choice["token_ids"]}))
        .await;
    assert_eq!(detok["prompt"], choice["text"]);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/completions", &streamed).await;
    let (usage_event, chunks) = events.split_last().unwrap();
    assert_eq!(usage_event["choices"], json!([]));
    assert_usage_after_cached_rerun(&usage_event["usage"], &full["usage"]);
    let mut stream_text = String::new();
    let mut stream_tokens = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        let ch = &c["choices"][0];
        assert_eq!(c["id"], chunks[0]["id"]);
        assert!(c.get("usage").is_none());
        // prompt ids come once, with the first chunk.
        assert_eq!(ch.get("prompt_token_ids").is_some(), i == 0, "{c}");
        stream_text.push_str(ch["text"].as_str().unwrap());
        stream_tokens.extend(ids(&ch["token_ids"]));
        let last = i + 1 == chunks.len();
        assert_eq!(
            ch["finish_reason"].as_str(),
            last.then_some("length"),
            "{c}"
        );
    }
    assert_eq!(
        ids(&chunks[0]["choices"][0]["prompt_token_ids"]),
        ids(&tokenized["tokens"])
    );
    assert_eq!(stream_text, text(&full));
    assert_eq!(stream_tokens, tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_prompts_batches_and_n_are_indexed_choices() {
    let s = start(Options::default()).await;
    let tokenized = s.ok("/tokenize", &json!({"prompt": PROMPT})).await;
    let prompt_ids = tokenized["tokens"].clone();
    let greedy = |prompt: Value| {
        json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
               "return_token_ids": true})
    };
    let by_text = s.ok("/v1/completions", &greedy(json!(PROMPT))).await;
    let by_ids = s.ok("/v1/completions", &greedy(prompt_ids.clone())).await;
    assert_eq!(
        by_ids["choices"][0]["token_ids"],
        by_text["choices"][0]["token_ids"]
    );
    assert_eq!(text(&by_ids), text(&by_text));

    let other = s
        .ok("/v1/completions", &greedy(json!("a different prompt")))
        .await;
    let mut batch = greedy(json!([PROMPT, "a different prompt"]));
    batch["n"] = json!(2);
    let out = s.ok("/v1/completions", &batch).await;
    let choices = out["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let want = if i < 2 { &by_text } else { &other };
        assert_eq!(
            c["token_ids"], want["choices"][0]["token_ids"],
            "choice {i}"
        );
        assert_eq!(
            c["prompt_token_ids"], want["choices"][0]["prompt_token_ids"],
            "choice {i}"
        );
    }
    // Each prompt counted once in usage, every choice's tokens counted.
    let p0 = by_text["usage"]["prompt_tokens"].as_u64().unwrap();
    let p1 = other["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(out["usage"]["prompt_tokens"].as_u64(), Some(p0 + p1));
    assert_eq!(out["usage"]["completion_tokens"], 24);
    // Streamed, the choices interleave; regrouped by index they are the same, and each
    // choice's prompt ids come once.
    batch["stream"] = json!(true);
    let events = s.stream("/v1/completions", &batch).await;
    let mut streamed = vec![Vec::new(); 4];
    let mut prompt_ids_seen = [0; 4];
    for e in &events {
        let c = &e["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        streamed[i].extend(ids(&c["token_ids"]));
        prompt_ids_seen[i] += usize::from(c.get("prompt_token_ids").is_some());
    }
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(streamed[i], ids(&c["token_ids"]), "choice {i}");
    }
    assert_eq!(prompt_ids_seen, [1; 4]);

    // A batch of token-id prompts.
    let out = s
        .ok("/v1/completions", &greedy(json!([prompt_ids, prompt_ids])))
        .await;
    assert_eq!(
        out["choices"][1]["token_ids"],
        by_text["choices"][0]["token_ids"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_filters_and_n_follow_the_sampling_parameters() {
    let s = start(Options::default()).await;
    let req = |extra: Value| {
        let mut b = json!({"prompt": PROMPT, "max_tokens": 10, "ignore_eos": true, "return_token_ids": true});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let tokens = |v: &Value, i: usize| ids(&v["choices"][i]["token_ids"]);
    let greedy = s
        .ok("/v1/completions", &req(json!({"temperature": 0})))
        .await;
    // Filters that leave only the best token are greedy at any temperature.
    for filter in [
        json!({"top_k": 1}),
        json!({"top_p": 1e-6}),
        json!({"min_p": 1.0}),
    ] {
        let mut f = filter.clone();
        f["temperature"] = json!(1.0);
        f["seed"] = json!(3);
        let out = s.ok("/v1/completions", &req(f)).await;
        assert_eq!(tokens(&out, 0), tokens(&greedy, 0), "{filter}");
    }
    // A seed reproduces; choice i of n draws from the seed's stream i (choice 0 is the lone
    // request's draws), never from seed + i's: choice 1 of seed 7 is not seed 8's choice 0,
    // and choice 3 of seed 7 is not seed 10's (they were equal before).
    let seeded = |seed: i64, n: i64| req(json!({"temperature": 1.0, "seed": seed, "n": n}));
    let a = s.ok("/v1/completions", &seeded(7, 1)).await;
    let b = s.ok("/v1/completions", &seeded(7, 1)).await;
    let c = s.ok("/v1/completions", &seeded(8, 1)).await;
    assert_eq!(tokens(&a, 0), tokens(&b, 0));
    assert_ne!(
        tokens(&a, 0),
        tokens(&c, 0),
        "seeds 7 and 8 sampled the same 10 tokens"
    );
    let n4 = s.ok("/v1/completions", &seeded(7, 4)).await;
    assert_eq!(tokens(&n4, 0), tokens(&a, 0));
    assert_ne!(tokens(&n4, 1), tokens(&c, 0));
    let d = s.ok("/v1/completions", &seeded(10, 1)).await;
    assert_ne!(tokens(&n4, 3), tokens(&d, 0));
    let choices: std::collections::BTreeSet<Vec<u64>> = (0..4).map(|i| tokens(&n4, i)).collect();
    assert_eq!(choices.len(), 4, "{n4}");
    // n > 1 reproduces choice by choice.
    let again = s.ok("/v1/completions", &seeded(7, 4)).await;
    for i in 0..4 {
        assert_eq!(tokens(&again, i), tokens(&n4, i));
    }
    // Accepted and ignored fields.
    let out = s
        .ok("/v1/completions", &req(json!({"temperature": 0, "priority": 5, "user": "u", "cache_salt": "salt",
                                             "presence_penalty": 0, "best_of": 1, "unknown_field": [1]})))
        .await;
    assert_eq!(tokens(&out, 0), tokens(&greedy, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_stop_tokens_end_the_output() {
    let s = start(Options::default()).await;
    let base = json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                      "return_token_ids": true});
    let full = s.ok("/v1/completions", &base).await;
    let full_text = text(&full);
    let full_tokens = ids(&full["choices"][0]["token_ids"]);

    // A stop token: the output ends with its first occurrence, included.
    let stop_id = full_tokens[4];
    let first = full_tokens.iter().position(|&t| t == stop_id).unwrap();
    let mut body = base.clone();
    body["stop_token_ids"] = json!([stop_id]);
    let out = s.ok("/v1/completions", &body).await;
    assert_eq!(ids(&out["choices"][0]["token_ids"]), full_tokens[..=first]);
    assert_eq!(out["choices"][0]["finish_reason"], "stop");
    assert_eq!(out["choices"][0]["stop_reason"].as_u64(), Some(stop_id));

    // A stop string from the middle of the text: the text ends before it.
    let chars: Vec<char> = full_text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = full_text.find(&stop).unwrap();
    for stream in [false, true] {
        let mut body = base.clone();
        body["stop"] = json!(stop);
        body["stream"] = json!(stream);
        let (got, finish, reason) = if stream {
            let events = s.stream("/v1/completions", &body).await;
            let last = &events.last().unwrap()["choices"][0];
            let t: String = events
                .iter()
                .map(|e| e["choices"][0]["text"].as_str().unwrap())
                .collect();
            (
                t,
                last["finish_reason"].clone(),
                last["stop_reason"].clone(),
            )
        } else {
            let out = s.ok("/v1/completions", &body).await;
            (
                text(&out),
                out["choices"][0]["finish_reason"].clone(),
                out["choices"][0]["stop_reason"].clone(),
            )
        };
        assert_eq!(got, full_text[..cut], "stream={stream} stop={stop:?}");
        assert_eq!(finish, "stop");
        assert_eq!(reason, json!(stop));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_have_the_legacy_shape() {
    let s = start(Options::default()).await;
    let body = json!({"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "logprobs": 3});
    let out = s.ok("/v1/completions", &body).await;
    let lp = &out["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 5);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 5);
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, text(&out));
    let mut offset = 0;
    for i in 0..5 {
        assert_eq!(lp["text_offset"][i].as_u64(), Some(offset));
        offset += tokens[i].as_str().unwrap().chars().count() as u64;
        let top = lp["top_logprobs"][i].as_object().unwrap();
        // Top 3 plus the sampled token (greedy makes it the best one); texts that decode
        // alike (partial UTF-8 bytes all read "\u{fffd}") share one key, as in vLLM.
        assert!((1..=4).contains(&top.len()), "{top:?}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        assert_eq!(chosen, best);
        assert_eq!(top[tokens[i].as_str().unwrap()].as_f64(), Some(chosen));
    }
    // logprobs: 0 gives the sampled token's logprob only.
    let mut body = body.clone();
    body["logprobs"] = json!(0);
    let out = s.ok("/v1/completions", &body).await;
    assert_eq!(
        out["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .len(),
        1
    );
    // Streamed logprobs carry offsets that continue across chunks.
    body["stream"] = json!(true);
    body["logprobs"] = json!(1);
    let events = s.stream("/v1/completions", &body).await;
    let offsets: Vec<u64> = events
        .iter()
        .flat_map(|e| ids(&e["choices"][0]["logprobs"]["text_offset"]))
        .collect();
    assert_eq!(offsets, ids(&out["choices"][0]["logprobs"]["text_offset"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_echoed_and_may_repeat() {
    let s = start(Options::default()).await;
    let body = json!({"prompt": PROMPT, "max_tokens": 4});
    let send = || {
        s.http
            .post(s.url("/v1/completions"))
            .header("x-request-id", "client-id-1")
            .json(&body)
            .send()
    };
    // The same client id twice at once: engine ids stay unique, both succeed.
    let (a, b) = tokio::join!(send(), send());
    for resp in [a.unwrap(), b.unwrap()] {
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(resp.headers()["x-request-id"], "client-id-1");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["id"], "client-id-1");
    }
    // Without one, an id is generated and returned in both places.
    let resp = s.send_post("/v1/completions", &body).await;
    let header = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["id"], header);
    assert!(header.len() >= 16);
}
