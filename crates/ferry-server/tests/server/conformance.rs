//! Where ferry answers as the OpenAI and vLLM servers do and a client would notice otherwise:
//! an unknown model is a 404; `stop_reason` is `null` on the model's own EOS; chat roles are
//! OpenAI's; a bad `X-Request-Id` is a 400; a body over the limit is a 413 with a JSON body.

use std::sync::atomic::Ordering;

use serde_json::{json, Value};

use crate::support::{ids, start, Options, Server, MODEL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_a_404_naming_the_model() {
    let s = start(Options::default()).await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        ("/v1/completions", json!({"prompt": "x", "model": "gpt-4"})),
        (
            "/v1/chat/completions",
            json!({"messages": user, "model": "nope"}),
        ),
        ("/tokenize", json!({"prompt": "x", "model": "other"})),
        ("/detokenize", json!({"tokens": [72], "model": "other"})),
    ];
    for (path, body) in cases {
        let (status, json) = s.post(path, &body).await;
        assert_eq!(status, 404, "{path}: {json}");
        let err = &json["error"];
        assert_eq!(err["param"], "model", "{json}");
        assert_eq!(err["type"], "not_found_error", "{json}");
        assert_eq!(err["code"], 404, "{json}");
        let name = body["model"].as_str().unwrap();
        assert_eq!(
            err["message"],
            format!("the model `{name}` does not exist; this server serves `{MODEL}`")
        );
    }
    assert_eq!(s.n_steps.load(Ordering::SeqCst), 0);
    // The served name, or none, is fine.
    s.ok(
        "/v1/completions",
        &json!({"prompt": "x", "model": MODEL, "max_tokens": 1}),
    )
    .await;
}

/// Sampled completions of the tiny model until some choices end on the model's EOS token:
/// `(request body, response)` pairs, `n` = 16 choices each.
async fn runs_that_hit_eos(s: &Server, extra: &Value) -> Vec<(Value, Value)> {
    let mut runs = Vec::new();
    for seed in 0..8 {
        let mut body = json!({"prompt": "Once upon", "max_tokens": 60, "temperature": 2.0,
                              "seed": seed, "n": 16, "return_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let out = s.ok("/v1/completions", &body).await;
        runs.push((body, out));
    }
    runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reason_is_null_when_the_model_stops_on_its_eos() {
    let s = start(Options::default()).await;
    let runs = runs_that_hit_eos(&s, &json!({})).await;
    let mut eos_ids = std::collections::BTreeSet::new();
    for (_, out) in &runs {
        for c in out["choices"].as_array().unwrap() {
            if c["finish_reason"] == "stop" {
                assert_eq!(c["stop_reason"], Value::Null, "{c}");
                eos_ids.insert(*ids(&c["token_ids"]).last().unwrap());
            } else {
                assert_eq!(c["finish_reason"], "length", "{c}");
                assert_eq!(c["stop_reason"], Value::Null, "{c}");
            }
        }
    }
    // The tiny model has one EOS token, and the runs hit it.
    assert_eq!(eos_ids.len(), 1, "no choice stopped on EOS: {eos_ids:?}");
    let eos = *eos_ids.first().unwrap();

    // Streamed, the last chunk of an EOS-stopped choice says the same.
    let (body, full) = runs
        .iter()
        .find(|(_, out)| out["choices"][0]["finish_reason"] == "stop")
        .or_else(|| runs.first())
        .unwrap();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/completions", &streamed).await;
    let finishes: Vec<&Value> = events
        .iter()
        .flat_map(|e| e["choices"].as_array().unwrap())
        .filter(|c| !c["finish_reason"].is_null())
        .collect();
    assert_eq!(finishes.len(), 16);
    for f in finishes {
        let i = f["index"].as_u64().unwrap() as usize;
        assert_eq!(f["finish_reason"], full["choices"][i]["finish_reason"]);
        assert_eq!(f["stop_reason"], Value::Null, "{f}");
    }

    // Asked for as a stop token, the same EOS is a `stop_token_ids` hit and is named.
    let listed = runs_that_hit_eos(&s, &json!({"stop_token_ids": [eos]})).await;
    for ((_, plain), (_, with_eos)) in runs.iter().zip(&listed) {
        for (a, b) in plain["choices"]
            .as_array()
            .unwrap()
            .iter()
            .zip(with_eos["choices"].as_array().unwrap())
        {
            assert_eq!(a["token_ids"], b["token_ids"]);
            let want = if a["finish_reason"] == "stop" {
                json!(eos)
            } else {
                Value::Null
            };
            assert_eq!(b["stop_reason"], want, "{b}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_roles_are_openais_and_custom_ones_reach_the_template() {
    let s = start(Options::default()).await;
    let chat = |messages: Value| json!({"messages": messages, "max_tokens": 1});
    // A role OpenAI does not list goes to the template as it is (vLLM passes it through).
    for role in ["function", "User", "bot", ""] {
        let messages = json!([{"role": "system", "content": "a"},
                              {"role": role, "content": "b"}]);
        let rendered = format!(
            "<|im_start|>system\na<|im_end|>\n<|im_start|>{role}\nb<|im_end|>\n<|im_start|>assistant\n"
        );
        let by_messages = s.ok("/tokenize", &json!({"messages": messages})).await;
        let by_text = s.ok("/tokenize", &json!({"prompt": rendered})).await;
        assert_eq!(by_messages["tokens"], by_text["tokens"], "{role:?}");
        let out = s.ok("/v1/chat/completions", &chat(messages)).await;
        assert_eq!(out["usage"]["prompt_tokens"], by_text["count"], "{role:?}");
    }
    // A message without a role is still refused.
    s.expect_error(
        "/v1/chat/completions",
        &chat(json!([{"content": "b"}])),
        400,
        Some("messages[0].role"),
    )
    .await;
    let every_role = json!([
        {"role": "developer", "content": "a"},
        {"role": "system", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "tool", "content": "e"},
    ]);
    let out = s.ok("/v1/chat/completions", &chat(every_role)).await;
    assert_eq!(out["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_id_header_is_a_400() {
    let s = start(Options::default()).await;
    let body = json!({"prompt": "x", "max_tokens": 1});
    let send = |id: Vec<u8>| {
        s.http
            .post(s.url("/v1/completions"))
            .header(
                "x-request-id",
                reqwest::header::HeaderValue::from_bytes(&id).unwrap(),
            )
            .json(&body)
            .send()
    };
    let longest = "a".repeat(256);
    let resp = send(longest.clone().into_bytes()).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["x-request-id"], longest.as_str());
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["id"], longest.as_str());

    let too_long = "a".repeat(257).into_bytes();
    for bad in [too_long, b"a\tb".to_vec(), "r\u{e9}q".as_bytes().to_vec()] {
        let resp = send(bad.clone()).await.unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{bad:?}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["param"], "X-Request-Id", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    assert_eq!(s.n_steps.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_a_413_with_a_json_body() {
    let s = start(Options {
        admin_api: true,
        ..Options::default()
    })
    .await;
    let limit = ferry_server::MAX_BODY_BYTES;
    // JSON whitespace: the body would parse if it were read whole.
    let mut big = vec![b' '; limit + 1];
    big[0] = b'{';
    big[limit] = b'}';
    for path in ["/v1/completions", "/tokenize", "/update_weight_version"] {
        let resp = s
            .http
            .post(s.url(path))
            .header("content-type", "application/json")
            .body(big.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 413, "{path}");
        let v: Value = resp.json().await.unwrap();
        let err = &v["error"];
        assert_eq!(err["code"], 413, "{v}");
        assert_eq!(err["param"], "body", "{v}");
        assert_eq!(
            err["message"],
            format!("the request body is larger than this server's limit of {limit} bytes")
        );
    }
    // At the limit exactly, the body is read (and this one is refused for what it says).
    let mut at_limit = big;
    at_limit.truncate(limit);
    at_limit[limit - 1] = b'}';
    let resp = s
        .http
        .post(s.url("/v1/completions"))
        .body(at_limit)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["param"], "prompt", "{v}");
}

/// Every field vLLM's non-streamed responses always carry is there, `null` when unset
/// (clients read `choice.prompt_logprobs` and the like as attributes); what ferry fills is
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_answers_carry_every_field_vllms_always_carry() {
    let s = start(Options::default()).await;
    let present = |obj: &Value, keys: &[&str], what: &str| {
        for key in keys {
            assert!(obj.get(*key).is_some(), "{what} lacks `{key}`: {obj}");
        }
    };
    let c = s
        .ok(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}),
        )
        .await;
    present(
        &c,
        &[
            "service_tier",
            "system_fingerprint",
            "kv_transfer_params",
            "metrics",
        ],
        "a completion",
    );
    let choice = &c["choices"][0];
    present(
        choice,
        &[
            "prompt_logprobs",
            "prompt_token_ids",
            "token_ids",
            "stop_reason",
            "logprobs",
        ],
        "a completion choice",
    );
    assert_eq!(choice["prompt_logprobs"], Value::Null);
    present(&c["usage"], &["completion_tokens_details"], "usage");
    assert!(c["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    let chat = s
        .ok(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2, "return_token_ids": true}),
        )
        .await;
    present(
        &chat,
        &[
            "prompt_logprobs",
            "prompt_token_ids",
            "prompt_text",
            "system_fingerprint",
        ],
        "a chat response",
    );
    assert_eq!(chat["prompt_logprobs"], Value::Null);
    assert!(
        chat["prompt_token_ids"].is_array(),
        "what ferry fills is kept"
    );
    present(
        &chat["choices"][0],
        &["token_ids", "stop_reason"],
        "a chat choice",
    );
    present(
        &chat["choices"][0]["message"],
        &["refusal", "function_call", "reasoning"],
        "a chat message",
    );
    assert!(chat["choices"][0]["message"].get("tool_calls").is_none());
}
