//! `/v1/chat/completions`: template rendering, streaming equals non-streaming, prompt ids equal
//! /tokenize's, logprob shapes, `max_completion_tokens`, and no template → 400.

use serde_json::{json, Value};

use crate::support::{assert_usage_after_cached_rerun, ids, start, Options, MODEL};

fn messages() -> Value {
    json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_equals_non_stream_and_prompt_ids_equal_tokenize() {
    let s = start(Options::default()).await;
    let body = json!({"model": MODEL, "messages": messages(), "max_completion_tokens": 10,
                      "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let full = s.ok("/v1/chat/completions", &body).await;
    assert_eq!(full["object"], "chat.completion");
    let choice = &full["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(ids(&choice["token_ids"]).len(), 10);
    let tokenized = s.ok("/tokenize", &json!({"messages": messages()})).await;
    assert_eq!(ids(&full["prompt_token_ids"]), ids(&tokenized["tokens"]));
    assert_eq!(full["usage"]["prompt_tokens"], tokenized["count"]);
    // The prompt is the ChatML rendering.
    let detok = s
        .ok("/detokenize", &json!({"tokens": full["prompt_token_ids"]}))
        .await;
    assert_eq!(
        detok["prompt"],
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/chat/completions", &streamed).await;
    let (usage_event, chunks) = events.split_last().unwrap();
    assert_usage_after_cached_rerun(&usage_event["usage"], &full["usage"]);
    assert_eq!(usage_event["choices"], json!([]));
    // The first chunk is the role delta, with the prompt ids.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(
        ids(&chunks[0]["prompt_token_ids"]),
        ids(&tokenized["tokens"])
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let tokens: Vec<u64> = chunks
        .iter()
        .flat_map(|c| ids(&c["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(content, choice["message"]["content"].as_str().unwrap());
    assert_eq!(tokens, ids(&choice["token_ids"]));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks[1..]
        .iter()
        .all(|c| c.get("prompt_token_ids").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_parameters_parts_and_logprobs() {
    let s = start(Options::default()).await;
    let greedy = |msgs: Value| json!({"messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let plain = s
        .ok(
            "/v1/chat/completions",
            &greedy(json!([{"role": "user", "content": "a\nb"}])),
        )
        .await;
    let parts = s
        .ok(
            "/v1/chat/completions",
            &greedy(json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])),
        )
        .await;
    assert_eq!(
        plain["choices"][0]["message"],
        parts["choices"][0]["message"]
    );
    assert_eq!(plain["usage"]["completion_tokens"], 6);

    let mut body = greedy(messages());
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    body["n"] = json!(2);
    let out = s.ok("/v1/chat/completions", &body).await;
    assert_eq!(out["choices"].as_array().unwrap().len(), 2);
    assert_eq!(out["choices"][0]["message"], out["choices"][1]["message"]);
    let content = out["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    let text: String = content
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(
        text,
        out["choices"][0]["message"]["content"].as_str().unwrap()
    );
    for e in content {
        let token = e["token"].as_str().unwrap();
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, token.as_bytes());
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], e["token"], "greedy picks the best token");
        assert_eq!(top[0]["logprob"], e["logprob"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    // logprobs without top_logprobs: entries with empty top lists; no logprobs: null.
    body["top_logprobs"] = json!(null);
    body["n"] = json!(1);
    let out = s.ok("/v1/chat/completions", &body).await;
    assert_eq!(
        out["choices"][0]["logprobs"]["content"][0]["top_logprobs"],
        json!([])
    );
    let out = s.ok("/v1/chat/completions", &greedy(messages())).await;
    assert_eq!(out["choices"][0]["logprobs"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_chat_template_is_a_400_saying_so() {
    let s = start(Options {
        chat_template: false,
        ..Options::default()
    })
    .await;
    let (status, body) = s
        .post("/v1/chat/completions", &json!({"messages": messages()}))
        .await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no chat template"),
        "{body}"
    );
    // Completions still work.
    s.ok("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}))
        .await;
}
