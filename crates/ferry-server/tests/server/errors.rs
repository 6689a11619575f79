//! Every bad input is a 400 whose error names the field; unsupported fields too.

use serde_json::json;

use crate::support::{start, Options, MAX_MODEL_LEN};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_completion_requests_name_their_field() {
    let s = start(Options::default()).await;
    let c = "/v1/completions";
    let long_prompt: Vec<u32> = vec![65; MAX_MODEL_LEN];
    let cases = [
        (
            json!({"prompt": "x", "max_tokens": "ten"}),
            Some("max_tokens"),
        ),
        (json!({"prompt": "x", "max_tokens": -1}), Some("max_tokens")),
        (json!({"prompt": "x", "max_tokens": 0}), Some("max_tokens")),
        (
            json!({"prompt": "x", "max_tokens": 1_000_000}),
            Some("max_tokens"),
        ),
        (
            json!({"prompt": "x", "temperature": -1}),
            Some("temperature"),
        ),
        (
            json!({"prompt": "x", "temperature": 100}),
            Some("temperature"),
        ),
        (json!({"prompt": "x", "top_p": 0}), Some("top_p")),
        (json!({"prompt": "x", "top_p": 1.1}), Some("top_p")),
        (json!({"prompt": "x", "top_k": -5}), Some("top_k")),
        (json!({"prompt": "x", "min_p": -0.5}), Some("min_p")),
        (json!({"prompt": "x", "n": 0}), Some("n")),
        (json!({"prompt": "x", "n": 1000}), Some("n")),
        (json!({"prompt": "x", "logprobs": 21}), Some("logprobs")),
        (json!({"prompt": "x", "logprobs": -1}), Some("logprobs")),
        (json!({"prompt": "x", "seed": "s"}), Some("seed")),
        (json!({"prompt": "x", "stop": [""]}), Some("stop[0]")),
        (json!({"prompt": "x", "stop": 5}), Some("stop")),
        (
            json!({"prompt": "x", "stop_token_ids": [-1]}),
            Some("stop_token_ids[0]"),
        ),
        (
            json!({"prompt": "x", "stop_token_ids": [99999]}),
            Some("stop_token_ids[0]"),
        ),
        (json!({"prompt": "x", "stream": "yes"}), Some("stream")),
        (json!({"prompt": "x", "cache_salt": ""}), Some("cache_salt")),
        (json!({"prompt": ""}), Some("prompt")),
        (json!({"prompt": []}), Some("prompt")),
        (json!({"prompt": ["ok", ""]}), Some("prompt[1]")),
        (json!({"prompt": [1, 99999]}), Some("prompt[1]")),
        (json!({"prompt": long_prompt}), Some("prompt")),
        (json!({"prompt": vec!["a"; 1025]}), Some("prompt")),
        (json!({"prompt": {"text": "x"}}), Some("prompt")),
        (json!({"max_tokens": 3}), Some("prompt")),
        (
            json!({"prompt": "x", "presence_penalty": 2.5}),
            Some("presence_penalty"),
        ),
        (
            json!({"prompt": "x", "frequency_penalty": 3}),
            Some("frequency_penalty"),
        ),
        (
            json!({"prompt": "x", "logit_bias": {"5": "up"}}),
            Some("logit_bias.5"),
        ),
        (
            json!({"prompt": "x", "prompt_logprobs": 50}),
            Some("prompt_logprobs"),
        ),
        (json!({"prompt": "x", "best_of": 2}), Some("best_of")),
        (json!({"prompt": "x", "echo": "yes"}), Some("echo")),
        (json!({"prompt": "x", "suffix": "y"}), Some("suffix")),
    ];
    for (body, param) in cases {
        s.expect_error(c, &body, 400, param).await;
    }
    // Malformed JSON and a body of the wrong shape: 400 without a field.
    for raw in ["{\"prompt\": ", "[1, 2]", "\"x\""] {
        let resp = s.http.post(s.url(c)).body(raw).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{raw}");
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
    }
    // Nothing reached the engine.
    assert_eq!(s.engine.stats().n_requests_finished_total, 0);
    assert_eq!(s.n_steps.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chat_requests_name_their_field() {
    let s = start(Options::default()).await;
    let c = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "hi"}]);
    let long = "the ".repeat(MAX_MODEL_LEN);
    let cases = [
        (json!({}), Some("messages")),
        (json!({"messages": []}), Some("messages")),
        (json!({"messages": "hi"}), Some("messages")),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            Some("messages[0].content"),
        ),
        (
            json!({"messages": [{"content": "x"}]}),
            Some("messages[0].role"),
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            Some("messages[0].content[0]"),
        ),
        (
            json!({"messages": [{"role": "user", "content": long}]}),
            Some("messages"),
        ),
        (
            json!({"messages": user, "max_completion_tokens": 0}),
            Some("max_completion_tokens"),
        ),
        (
            json!({"messages": user, "max_tokens": -3}),
            Some("max_tokens"),
        ),
        (
            json!({"messages": user, "max_completion_tokens": 100_000}),
            Some("max_completion_tokens"),
        ),
        (
            json!({"messages": user, "top_logprobs": 2}),
            Some("top_logprobs"),
        ),
        (
            json!({"messages": user, "logprobs": true, "top_logprobs": 50}),
            Some("top_logprobs"),
        ),
        (json!({"messages": user, "logprobs": 3}), Some("logprobs")),
        // Tools with `auto` (their default) on a server without a tool parser.
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            Some("tool_choice"),
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {}}]}),
            Some("tools[0].function.name"),
        ),
        (
            json!({"messages": user, "response_format": {"type": "yaml"}}),
            Some("response_format.type"),
        ),
        (json!({"messages": user, "n": -1}), Some("n")),
    ];
    for (body, param) in cases {
        s.expect_error(c, &body, 400, param).await;
    }
    assert_eq!(s.n_steps.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// Errors clients match by their words are worded as vLLM's: a prompt token the model lacks
/// says "Token id N is out of vocabulary" (ferry's detail after it), and a seed outside 64 bits
/// says which bound it breaks (`less_than_equal`, `greater_than_equal`), not a type error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_clients_match_are_worded_as_vllms() {
    let s = start(Options::default()).await;
    let message = |body: serde_json::Value| body["error"]["message"].as_str().unwrap().to_owned();
    let (status, body) = s
        .post(
            "/v1/completions",
            &json!({"prompt": [1, 99999], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        message(body).starts_with("Token id 99999 is out of vocabulary: "),
        "out of vocabulary"
    );
    for (seed, kind, bound) in [
        (
            "18446744073709551616",
            "less_than_equal",
            "9223372036854775807",
        ),
        (
            "-9223372036854775809",
            "greater_than_equal",
            "-9223372036854775808",
        ),
    ] {
        let raw = format!(r#"{{"prompt": "x", "max_tokens": 1, "seed": {seed}}}"#);
        let resp = s
            .http
            .post(s.url("/v1/completions"))
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["param"], "seed", "{body}");
        let text = message(body);
        assert!(text.starts_with(kind) && text.contains(bound), "{text}");
    }
    // The bounds themselves are seeds.
    for seed in [i64::MAX, i64::MIN] {
        let (status, body) = s
            .post(
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 1, "seed": seed}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
}
