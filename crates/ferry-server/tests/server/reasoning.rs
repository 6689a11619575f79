//! `--reasoning-parser`: a chat answer's `<think>` block is its reasoning
//! (`message.reasoning` and `reasoning_content`, streamed as `delta.reasoning`), the rest its
//! content. The tiny model never writes `</think>`, so under either parser its whole answer
//! is reasoning (it is cut off while "thinking"), and under `qwen3` with
//! `enable_thinking: false` all content: each checked against the same request's text
//! without a parser. How marked-up answers split is `reasoning.rs`'s unit tests.

use serde_json::{json, Value};

use ferry_server::reasoning::ReasoningParser;

use crate::support::{start, Options, MODEL};

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reasoning_parser_splits_the_answer_streamed_or_not() {
    let plain = start(Options::default()).await;
    let text = plain.ok("/v1/chat/completions", &chat(json!({}))).await["choices"][0]["message"]
        ["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!text.is_empty() && !text.contains("</think>"));
    for parser in [ReasoningParser::Qwen3, ReasoningParser::DeepseekR1] {
        let s = start(Options {
            reasoning_parser: Some(parser),
            ..Options::default()
        })
        .await;
        let out = s.ok("/v1/chat/completions", &chat(json!({}))).await;
        let message = &out["choices"][0]["message"];
        assert_eq!(message["reasoning"], text, "{parser:?}: {out}");
        assert_eq!(message["reasoning_content"], text, "{parser:?}: {out}");
        assert!(message["content"].is_null(), "{parser:?}: {out}");
        // Streamed: the reasoning deltas join to the same text, and no content comes.
        let events = s
            .stream("/v1/chat/completions", &chat(json!({"stream": true})))
            .await;
        let deltas = events.iter().map(|e| &e["choices"][0]["delta"]);
        let streamed: String = deltas
            .clone()
            .filter_map(|d| d["reasoning"].as_str())
            .collect();
        assert_eq!(streamed, text, "{parser:?}");
        assert!(
            deltas
                .clone()
                .all(|d| d["content"].as_str().unwrap_or("").is_empty()),
            "{parser:?}: {events:?}"
        );
    }
    // qwen3 without thinking (the request's chat_template_kwargs): all content.
    let s = start(Options {
        reasoning_parser: Some(ReasoningParser::Qwen3),
        ..Options::default()
    })
    .await;
    let off = chat(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    let out = s.ok("/v1/chat/completions", &off).await;
    let message = &out["choices"][0]["message"];
    assert!(message["reasoning"].is_null(), "{out}");
    assert!(message.get("reasoning_content").is_none(), "{out}");
    // The kwarg reaches the template too, so the prompt may differ: compare with the
    // same request without a parser.
    let want =
        plain.ok("/v1/chat/completions", &off).await["choices"][0]["message"]["content"].clone();
    assert_eq!(message["content"], want, "{out}");
    // A structured output with a reasoning parser holds the content only: the constraint
    // starts after `</think>`. Thinking, the tiny model never closes the block, so its answer
    // is the free text it writes without any constraint, all reasoning; not thinking, the
    // whole answer is content and is JSON.
    let json_object = json!({"response_format": {"type": "json_object"}, "max_tokens": 24});
    let out = s
        .ok("/v1/chat/completions", &chat(json_object.clone()))
        .await;
    let free = plain
        .ok("/v1/chat/completions", &chat(json!({"max_tokens": 24})))
        .await;
    assert_eq!(
        out["choices"][0]["message"]["reasoning"], free["choices"][0]["message"]["content"],
        "{out}"
    );
    assert!(out["choices"][0]["message"]["content"].is_null(), "{out}");
    let mut off = chat(json!({"chat_template_kwargs": {"enable_thinking": false},
                              "response_format": {"type": "json_object"}, "max_tokens": 64}));
    off["ignore_eos"] = json!(false);
    let out = s.ok("/v1/chat/completions", &off).await;
    let content = out["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(content).is_ok_and(|v| v.is_object()),
        "{out}"
    );
}
