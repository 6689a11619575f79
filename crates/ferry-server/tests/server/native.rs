//! The native generate routes (SGLang's `/generate`, vLLM's `/inference/v1/generate`) and
//! SGLang's discovery routes: one request gives the same tokens and logprobs through every
//! generate route; batches, `n`, streams and finish reasons in each route's shape; a field
//! the completions route refuses is refused here under its native name.

use serde_json::{json, Value};

use crate::support::{ids, start, Options, Server, MAX_MODEL_LEN, MODEL};

/// The prompt's token ids, as `/tokenize` gives them.
pub async fn prompt_ids(s: &Server, text: &str) -> Vec<u64> {
    let t = s.ok("/tokenize", &json!({"prompt": text})).await;
    ids(&t["tokens"])
}

/// Logprobs as f64s, from any JSON list of numbers.
fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_seeded_request_gives_the_same_tokens_and_logprobs_on_every_route() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "the quick brown fox").await;
    let completion = s
        .ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 42,
                    "ignore_eos": true, "logprobs": 0, "return_token_ids": true}),
        )
        .await;
    let c = &completion["choices"][0];
    let want_ids = ids(&c["token_ids"]);
    let want_lps = floats(&c["logprobs"]["token_logprobs"]);
    assert_eq!(want_ids.len(), 8);

    let sglang = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt, "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 1.0,
                                        "sampling_seed": 42, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(ids(&sglang["output_ids"]), want_ids, "{sglang}");
    let triples = sglang["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap();
    let sg_ids: Vec<u64> = triples.iter().map(|t| t[1].as_u64().unwrap()).collect();
    let sg_lps: Vec<f64> = triples.iter().map(|t| t[0].as_f64().unwrap()).collect();
    assert_eq!(sg_ids, want_ids);
    assert_eq!(sg_lps, want_lps);
    assert!(triples.iter().all(|t| t[2].is_null()), "{sglang}");
    assert_eq!(sglang["text"], c["text"]);
    assert_eq!(
        sglang["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 8})
    );
    assert_eq!(sglang["meta_info"]["prompt_tokens"], prompt.len());
    assert_eq!(sglang["meta_info"]["completion_tokens"], 8);
    assert_eq!(sglang["meta_info"]["weight_version"], "0");

    let vllm = s
        .ok(
            "/inference/v1/generate",
            &json!({"model": MODEL, "token_ids": prompt,
                    "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 42,
                                        "ignore_eos": true, "logprobs": 0}}),
        )
        .await;
    let v = &vllm["choices"][0];
    assert_eq!(ids(&v["token_ids"]), want_ids, "{vllm}");
    let content = v["logprobs"]["content"].as_array().unwrap();
    let v_lps: Vec<f64> = content
        .iter()
        .map(|e| e["logprob"].as_f64().unwrap())
        .collect();
    assert_eq!(v_lps, want_lps);
    for (e, id) in content.iter().zip(&want_ids) {
        assert_eq!(e["token"], format!("token_id:{id}"));
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 1);
    }
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["index"], 0);
    assert_eq!(vllm["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(vllm["usage"]["completion_tokens"], 8);
    assert_eq!(vllm["prompt_logprobs"], Value::Null);
    assert!(vllm["request_id"].as_str().is_some_and(|id| !id.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_logprobs_come_in_each_routes_shape() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "hello there").await;
    let completion = s
        .ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 3,
                    "return_token_ids": true}),
        )
        .await;
    let sglang = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt, "return_logprob": true, "top_logprobs_num": 3,
                    "return_text_in_logprobs": true,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0}}),
        )
        .await;
    let vllm = s
        .ok(
            "/inference/v1/generate",
            &json!({"token_ids": prompt, "sampling_params": {"max_tokens": 3,
                    "temperature": 0, "logprobs": 3}}),
        )
        .await;
    let tops = sglang["meta_info"]["output_top_logprobs"]
        .as_array()
        .unwrap();
    let content = vllm["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(tops.len(), 3, "{sglang}");
    assert_eq!(content.len(), 3, "{vllm}");
    for (pos, (top, entry)) in tops.iter().zip(content).enumerate() {
        // Greedy: the sampled token is the best, so vLLM's list (the sampled token, then
        // the best others) is SGLang's top 3, by id and logprob.
        let sg: Vec<(Value, Value)> = top
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (json!(format!("token_id:{}", t[1])), t[0].clone()))
            .collect();
        let vl: Vec<(Value, Value)> = entry["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["token"].clone(), t["logprob"].clone()))
            .collect();
        assert_eq!(sg, vl, "position {pos}");
    }
    // The third element of each triple is the token's text, as completions reports it.
    let texts: Vec<Value> = sglang["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[2].clone())
        .collect();
    assert_eq!(
        Value::Array(texts),
        completion["choices"][0]["logprobs"]["tokens"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_comes_back_as_a_list_in_prompt_order() {
    let s = start(Options::default()).await;
    let a = prompt_ids(&s, "one two three").await;
    let b = prompt_ids(&s, "four five").await;
    let single = |p: &Vec<u64>| {
        json!({"input_ids": p, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                   "ignore_eos": true}})
    };
    let alone_a = s.ok("/generate", &single(&a)).await;
    let alone_b = s.ok("/generate", &single(&b)).await;
    let batch = s
        .ok(
            "/generate",
            &json!({"input_ids": [a, b], "sampling_params": {"max_new_tokens": 5,
                    "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    let batch = batch
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {batch}"));
    assert_eq!(batch.len(), 2);
    assert_eq!(batch[0]["output_ids"], alone_a["output_ids"]);
    assert_eq!(batch[1]["output_ids"], alone_b["output_ids"]);
    assert_eq!(batch[0]["index"], 0);
    assert_eq!(batch[1]["index"], 1);
    assert_eq!(batch[1]["meta_info"]["prompt_tokens"], b.len());
    assert_ne!(batch[0]["meta_info"]["id"], batch[1]["meta_info"]["id"]);
    // The same batch as text.
    let texts = s
        .ok(
            "/generate",
            &json!({"text": ["one two three", "four five"], "sampling_params":
                    {"max_new_tokens": 5, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(texts[0]["output_ids"], alone_a["output_ids"]);
    assert_eq!(texts[1]["output_ids"], alone_b["output_ids"]);
    // `n` > 1: a list of the prompt's samples; sample 0 is the lone seeded request's.
    let seeded = |n: u64| {
        json!({"input_ids": a, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0,
               "sampling_seed": 5, "n": n, "ignore_eos": true}})
    };
    let lone = s.ok("/generate", &seeded(1)).await;
    let two = s.ok("/generate", &seeded(2)).await;
    let two = two.as_array().unwrap();
    assert_eq!(two.len(), 2);
    assert_eq!(two[0]["output_ids"], lone["output_ids"]);
    assert_eq!(two[1]["index"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_streams_cumulative_outputs_ending_with_the_whole_answer() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "the quick brown fox").await;
    let body = |stream: bool| {
        json!({"input_ids": prompt, "return_logprob": true, "stream": stream,
               "sampling_params": {"max_new_tokens": 7, "temperature": 0, "ignore_eos": true}})
    };
    let whole = s.ok("/generate", &body(false)).await;
    let events = s.stream("/generate", &body(true)).await;
    assert!(!events.is_empty());
    let mut last_len = 0;
    for e in &events[..events.len() - 1] {
        assert_eq!(e["meta_info"]["finish_reason"], Value::Null, "{e}");
        let n = e["output_ids"].as_array().unwrap().len();
        assert!(n >= last_len, "not cumulative: {e}");
        last_len = n;
        let so_far = &whole["output_ids"].as_array().unwrap()[..n];
        assert_eq!(e["output_ids"].as_array().unwrap(), so_far);
        assert_eq!(
            e["meta_info"]["output_token_logprobs"]
                .as_array()
                .unwrap()
                .len(),
            n
        );
        assert!(e.get("index").is_none(), "{e}");
    }
    let last = events.last().unwrap();
    for key in ["text", "output_ids"] {
        assert_eq!(last[key], whole[key], "{key}");
    }
    for key in [
        "finish_reason",
        "output_token_logprobs",
        "completion_tokens",
        "prompt_tokens",
    ] {
        assert_eq!(last["meta_info"][key], whole["meta_info"][key], "{key}");
    }
    // A streamed batch: each event names its choice.
    let other = prompt_ids(&s, "four five").await;
    let events = s
        .stream(
            "/generate",
            &json!({"input_ids": [prompt, other], "stream": true,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    let finals: Vec<u64> = events
        .iter()
        .filter(|e| !e["meta_info"]["finish_reason"].is_null())
        .map(|e| e["index"].as_u64().unwrap())
        .collect();
    let mut sorted = finals.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [0, 1], "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_streams_new_token_ids_and_the_usage_chunk() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "the quick brown fox").await;
    let body = |stream: bool| {
        let mut body = json!({"token_ids": prompt, "stream": stream,
               "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": true,
                                   "logprobs": 1}});
        // vLLM refuses `stream_options` without `stream`.
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };
    let whole = s.ok("/inference/v1/generate", &body(false)).await;
    let events = s.stream("/inference/v1/generate", &body(true)).await;
    let (usage, chunks) = events.split_last().unwrap();
    let streamed: Vec<u64> = chunks
        .iter()
        .flat_map(|e| ids(&e["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(streamed, ids(&whole["choices"][0]["token_ids"]));
    let lps: Vec<Value> = chunks
        .iter()
        .flat_map(|e| {
            e["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .clone()
        })
        .collect();
    assert_eq!(
        Value::Array(lps),
        whole["choices"][0]["logprobs"]["content"]
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert_eq!(usage["usage"]["prompt_tokens"], prompt.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_are_reported_in_each_routes_finish_reason() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "the quick brown fox").await;
    let greedy = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                    "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    let out = ids(&greedy["output_ids"]);
    let stop = out[3];
    let at = out.iter().position(|&t| t == stop).unwrap();
    let stopped = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                    "temperature": 0, "ignore_eos": true, "stop_token_ids": [stop]}}),
        )
        .await;
    assert_eq!(
        stopped["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": stop}),
        "{stopped}"
    );
    assert_eq!(ids(&stopped["output_ids"]), out[..=at]);
    let vllm = s
        .ok(
            "/inference/v1/generate",
            &json!({"token_ids": prompt, "sampling_params": {"max_tokens": 6,
                    "temperature": 0, "ignore_eos": true, "stop_token_ids": [stop]}}),
        )
        .await;
    assert_eq!(vllm["choices"][0]["finish_reason"], "stop");
    assert_eq!(ids(&vllm["choices"][0]["token_ids"]), out[..=at]);
    // A stop string: SGLang's `matched` is the string.
    let text = greedy["text"].as_str().unwrap();
    let word: String = text.chars().skip(1).take(2).collect();
    let by_string = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                    "temperature": 0, "ignore_eos": true, "stop": [word]}}),
        )
        .await;
    assert_eq!(
        by_string["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": word}),
        "{by_string} (greedy text {text:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_the_field_as_the_native_request_sent_it() {
    let s = start(Options::default()).await;
    let cases = [
        ("/generate", json!({"sampling_params": {}}), "input_ids"),
        (
            "/generate",
            json!({"input_ids": [1], "text": "x"}),
            "input_ids",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}),
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"max_new_tokens": MAX_MODEL_LEN}}),
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"temperature": 9}}),
            "sampling_params.temperature",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "sampling_params": {"bogus": 1}}),
            "sampling_params.bogus",
        ),
        (
            "/generate",
            json!({"input_ids": [[1], [99999999]]}),
            "input_ids[1][0]",
        ),
        (
            "/generate",
            json!({"input_ids": vec![1; MAX_MODEL_LEN]}),
            "input_ids",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "image_data": ["x"]}),
            "image_data",
        ),
        (
            "/generate",
            json!({"input_ids": [1], "return_logprob": true, "logprob_start_len": 0}),
            "logprob_start_len",
        ),
        ("/inference/v1/generate", json!({}), "token_ids"),
        (
            "/inference/v1/generate",
            json!({"token_ids": [1], "sampling_params": {"max_tokens": 0}}),
            "sampling_params.max_tokens",
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": [1], "sampling_params": {"best_of": 3}}),
            "sampling_params.best_of",
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": [1], "sampling_params": {"allowed_token_ids": [1]}}),
            "sampling_params.allowed_token_ids",
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": [1], "sampling_params": {"bogus": 1}}),
            "sampling_params.bogus",
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": [99999999]}),
            "token_ids[0]",
        ),
    ];
    for (path, body, param) in cases {
        s.expect_error(path, &body, 400, Some(param)).await;
    }
    // A model other than the served one is vLLM's 404.
    s.expect_error(
        "/inference/v1/generate",
        &json!({"model": "other", "token_ids": [1]}),
        404,
        Some("model"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_max_new_tokens_defaults_to_128_cut_to_the_context() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "hello").await;
    let out = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": true}}),
        )
        .await;
    // The tiny model's context (96) is shorter than SGLang's default of 128.
    assert_eq!(
        out["meta_info"]["completion_tokens"],
        MAX_MODEL_LEN - prompt.len()
    );
    // vLLM's route runs to the end of the context without `max_tokens`.
    let out = s
        .ok(
            "/inference/v1/generate",
            &json!({"token_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(
        out["usage"]["completion_tokens"],
        MAX_MODEL_LEN - prompt.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_routes_describe_the_server() {
    let s = start(Options::default()).await;
    for path in ["/server_info", "/get_server_info"] {
        let info = s.get_json(path).await;
        for key in ["tp_size", "pp_size", "dp_size", "ep_size"] {
            assert_eq!(info[key], 1, "{path} {key}: {info}");
        }
        assert_eq!(info["served_model_name"], MODEL);
        assert_eq!(info["model_path"], "tiny");
        assert_eq!(info["enable_memory_saver"], true);
        assert_eq!(info["weight_version"], "0");
        assert_eq!(info["context_length"], MAX_MODEL_LEN);
        assert_eq!(info["page_size"], 4);
        assert_eq!(info["max_total_num_tokens"], 512 * 4);
    }
    for path in ["/model_info", "/get_model_info"] {
        assert_eq!(
            s.get_json(path).await,
            json!({"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": true,
                   "preferred_sampling_params": null, "has_image_understanding": false,
                   "has_audio_understanding": false, "weight_version": "0"}),
            "{path}"
        );
    }
    assert_eq!(
        s.get_json("/get_world_size").await,
        json!({"world_size": 1})
    );
    assert_eq!(s.get("/health_generate").await.status().as_u16(), 200);
    // A paused engine cannot generate: 503 (after the route's own timeout).
    s.engine
        .pause(ferry_engine::PauseMode::Keep, false)
        .await
        .unwrap();
    let resp = s.get("/health_generate").await;
    assert_eq!(resp.status().as_u16(), 503);
    s.engine.resume().await.unwrap();
    assert_eq!(s.get("/health_generate").await.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_generate_reports_the_prompt_logprobs_completions_does() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "the quick brown fox jumps").await;
    let completion = s
        .ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0,
                    "prompt_logprobs": 1}),
        )
        .await;
    let want = &completion["choices"][0]["prompt_logprobs"];
    assert_eq!(want.as_array().unwrap().len(), prompt.len(), "{want}");
    let native = s
        .ok(
            "/inference/v1/generate",
            &json!({"token_ids": prompt,
                    "sampling_params": {"max_tokens": 2, "temperature": 0,
                                        "prompt_logprobs": 1}}),
        )
        .await;
    // The same f32s (the JSON texts differ: this route writes them through f64).
    assert_eq!(as_f32(&native["prompt_logprobs"]), as_f32(want), "{native}");
    // Not asked for: null, as vLLM.
    let plain = s
        .ok(
            "/inference/v1/generate",
            &json!({"token_ids": prompt, "sampling_params": {"max_tokens": 2}}),
        )
        .await;
    assert_eq!(plain["prompt_logprobs"], Value::Null);
}

/// `v` with every number rounded to f32, the precision logprobs have.
fn as_f32(v: &Value) -> Value {
    match v {
        Value::Number(n) => json!(n.as_f64().unwrap() as f32),
        Value::Array(a) => Value::Array(a.iter().map(as_f32).collect()),
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), as_f32(v))).collect()),
        other => other.clone(),
    }
}
