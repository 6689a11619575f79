//! `routed_experts` (`--enable-return-routed-experts`), over an engine whose executor routes
//! as an MoE model does (`testing::FakeMoe`: each token's experts a function of the token and
//! its position, stored beside its KV slot and read back for prefix-cache hits). Every
//! answer's `.npy` is decoded here, header parsed, and compared row for row with that
//! function over the choice's prompt and output tokens: completions, chat, `n` = 2, a prompt
//! served from the prefix cache, `routed_experts_prompt_start`, streams, vLLM's
//! `/inference/v1/generate` and SGLang's `/generate`.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use ferry_engine::testing::fake_routing_row;
use ferry_engine::{RoutingShape, TokenId};
use serde_json::{json, Value};

use crate::native::prompt_ids;
use crate::support::{ids, start, Options, Server};

const SHAPE: RoutingShape = RoutingShape {
    layers: 3,
    top_k: 2,
    num_experts: 64,
};

/// A decoded `.npy`: its dtype, shape and values.
#[derive(Debug, PartialEq)]
struct Npy {
    descr: String,
    shape: Vec<usize>,
    values: Vec<u16>,
}

/// `value` of `'key': value, ` in a `.npy` header's dict.
fn header_entry<'a>(header: &'a str, key: &str) -> &'a str {
    let from = header
        .find(&format!("'{key}': "))
        .unwrap_or_else(|| panic!("no {key} in {header:?}"))
        + key.len()
        + 4;
    let rest = &header[from..];
    let end = if rest.starts_with('(') {
        rest.find(')').unwrap() + 1
    } else {
        rest.find(',').unwrap()
    };
    &rest[..end]
}

/// Reads a base64 `.npy` as numpy's `np.load` does (format 1.0, C order, `u1` or `<u2`).
fn decode_npy(b64: &Value) -> Npy {
    let bytes = STANDARD
        .decode(
            b64.as_str()
                .unwrap_or_else(|| panic!("not a string: {b64}")),
        )
        .unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00", "magic and format 1.0");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let data = &bytes[10 + header_len..];
    assert_eq!((10 + header_len) % 64, 0, "the data is 64-byte aligned");
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(
        header.starts_with('{') && header.ends_with('\n'),
        "{header:?}"
    );
    assert_eq!(header_entry(header, "fortran_order"), "False");
    let descr = header_entry(header, "descr").trim_matches('\'').to_owned();
    let shape: Vec<usize> = header_entry(header, "shape")
        .trim_matches(['(', ')'])
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().unwrap())
        .collect();
    let values: Vec<u16> = match descr.as_str() {
        "|u1" => data.iter().map(|&b| u16::from(b)).collect(),
        "<u2" => data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect(),
        other => panic!("dtype {other}"),
    };
    assert_eq!(values.len(), shape.iter().product::<usize>(), "{shape:?}");
    Npy {
        descr,
        shape,
        values,
    }
}

/// The fake model's routing of positions `from..tokens.len() - 1` (every input token).
fn expected(shape: RoutingShape, tokens: &[u64], from: usize) -> Vec<u16> {
    (from..tokens.len() - 1)
        .flat_map(|p| fake_routing_row(shape, TokenId(tokens[p] as u32), p))
        .collect()
}

/// Checks a choice's `routed_experts` against its tokens (prompt then output) from row
/// `from`; returns the decoded array.
fn check(shape: RoutingShape, routed: &Value, tokens: &[u64], from: usize) -> Npy {
    let npy = decode_npy(routed);
    let descr = if shape.num_experts <= 256 {
        "|u1"
    } else {
        "<u2"
    };
    assert_eq!(npy.descr, descr);
    assert_eq!(
        npy.shape,
        [tokens.len() - 1 - from, shape.layers, shape.top_k]
    );
    assert_eq!(npy.values, expected(shape, tokens, from));
    npy
}

async fn moe(shape: RoutingShape) -> Server {
    start(Options {
        moe: Some(shape),
        ..Options::default()
    })
    .await
}

/// A completion choice's prompt then output ids.
fn completion_tokens(choice: &Value) -> Vec<u64> {
    let mut t = ids(&choice["prompt_token_ids"]);
    t.extend(ids(&choice["token_ids"]));
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_carry_the_routing_of_every_input_token() {
    let s = moe(SHAPE).await;
    let out = s
        .ok(
            "/v1/completions",
            &json!({"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0,
                    "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
    let c = &out["choices"][0];
    let tokens = completion_tokens(c);
    assert_eq!(ids(&c["token_ids"]).len(), 5);
    check(SHAPE, &c["routed_experts"], &tokens, 0);

    let chat = s
        .ok(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4,
                    "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
    let mut tokens = ids(&chat["prompt_token_ids"]);
    tokens.extend(ids(&chat["choices"][0]["token_ids"]));
    check(SHAPE, &chat["choices"][0]["routed_experts"], &tokens, 0);
}

/// Choices of one prompt: the later ones take the first one's prompt blocks as hits in the
/// step it computes them, and read their routing back; each choice's own tokens follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_of_n_choices_has_the_prompts_routing_and_its_own() {
    let s = moe(SHAPE).await;
    let out = s
        .ok(
            "/v1/completions",
            &json!({"prompt": "one two three four five six seven", "max_tokens": 6, "n": 2,
                    "temperature": 1.0, "seed": 3, "ignore_eos": true,
                    "return_token_ids": true}),
        )
        .await;
    let choices = out["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut outputs = Vec::new();
    for c in choices {
        check(SHAPE, &c["routed_experts"], &completion_tokens(c), 0);
        outputs.push(ids(&c["token_ids"]));
    }
    assert_ne!(outputs[0], outputs[1], "two samples, two outputs");
}

/// The second request's prompt is served from the prefix cache: its rows are read back from
/// the blocks the first request computed, and are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_served_from_the_prefix_cache_has_the_same_routing() {
    let s = moe(SHAPE).await;
    let body = json!({"prompt": "a prompt long enough to fill a few blocks", "max_tokens": 3,
                      "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let first = s.ok("/v1/completions", &body).await;
    let second = s.ok("/v1/completions", &body).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 8,
        "{second}"
    );
    let (a, b) = (&first["choices"][0], &second["choices"][0]);
    let tokens = completion_tokens(b);
    assert_eq!(tokens, completion_tokens(a));
    check(SHAPE, &b["routed_experts"], &tokens, 0);
    assert_eq!(a["routed_experts"], b["routed_experts"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_experts_prompt_start_skips_prompt_rows_and_is_checked() {
    let s = moe(SHAPE).await;
    let prompt = prompt_ids(&s, "skip the first rows of this").await;
    let n = prompt.len();
    for start in [0, 3, n] {
        let out = s
            .ok(
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "ignore_eos": true, "return_token_ids": true,
                        "routed_experts_prompt_start": start}),
            )
            .await;
        let c = &out["choices"][0];
        let npy = check(SHAPE, &c["routed_experts"], &completion_tokens(c), start);
        assert_eq!(npy.shape[0], n + 3 - start);
    }
    for bad in [json!(n + 1), json!(-1)] {
        let body = json!({"prompt": prompt, "max_tokens": 2, "routed_experts_prompt_start": bad});
        s.expect_error(
            "/v1/completions",
            &body,
            400,
            Some("routed_experts_prompt_start"),
        )
        .await;
        let chat = json!({"messages": [{"role": "user", "content": "x"}],
                          "routed_experts_prompt_start": 10_000});
        s.expect_error(
            "/v1/chat/completions",
            &chat,
            400,
            Some("routed_experts_prompt_start"),
        )
        .await;
    }
    let (_, err) = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "routed_experts_prompt_start": n + 1}),
        )
        .await;
    assert_eq!(
        err["error"]["message"],
        format!(
            "routed_experts_prompt_start must be between 0 and the prompt length ({n}), inclusive."
        )
    );
}

/// vLLM's streamed completion and chat chunks have no `routed_experts`; its token-in/token-out
/// route's have one on every chunk, set on a choice's last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_carry_routing_only_where_vllms_do() {
    let s = moe(SHAPE).await;
    let events = s
        .stream(
            "/v1/completions",
            &json!({"prompt": "stream me", "max_tokens": 4, "stream": true,
                    "return_token_ids": true}),
        )
        .await;
    // (A slow reader gets the tokens merged: maybe one event.)
    for e in &events {
        assert!(e["choices"][0].get("routed_experts").is_none(), "{e}");
    }
    let chat = s
        .stream(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                    "stream": true}),
        )
        .await;
    for e in &chat {
        assert!(e["choices"][0].get("routed_experts").is_none(), "{e}");
    }

    let prompt = prompt_ids(&s, "token in token out").await;
    let body = |stream: bool| {
        json!({"token_ids": prompt, "stream": stream,
               "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": true,
                                   "routed_experts_prompt_start": 2}})
    };
    let whole = s.ok("/inference/v1/generate", &body(false)).await;
    let choice = &whole["choices"][0];
    let mut tokens = prompt.clone();
    tokens.extend(ids(&choice["token_ids"]));
    check(SHAPE, &choice["routed_experts"], &tokens, 2);
    let chunks = s.stream("/inference/v1/generate", &body(true)).await;
    let (last, rest) = chunks.split_last().unwrap();
    for e in rest {
        assert_eq!(e["choices"][0]["routed_experts"], Value::Null, "{e}");
    }
    assert_eq!(
        last["choices"][0]["routed_experts"],
        choice["routed_experts"]
    );
}

/// SGLang's `return_routed_experts`: `meta_info.routed_experts` as little-endian int32s, from
/// `routed_experts_start_len`; in a stream, on the finished choice's event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_returns_int32_routing_when_asked() {
    let s = moe(SHAPE).await;
    let prompt = prompt_ids(&s, "route these tokens").await;
    let int32s = |v: &Value| -> Vec<u16> {
        let bytes = STANDARD.decode(v.as_str().unwrap()).unwrap();
        bytes
            .chunks_exact(4)
            .map(|b| u16::try_from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])).unwrap())
            .collect()
    };
    let body = |extra: Value| {
        let mut b = json!({"input_ids": prompt,
                           "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                               "ignore_eos": true}});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let plain = s.ok("/generate", &body(json!({}))).await;
    assert!(
        plain["meta_info"].get("routed_experts").is_none(),
        "{plain}"
    );
    for start in [0, 2] {
        let out = s
            .ok(
                "/generate",
                &body(json!({"return_routed_experts": true, "routed_experts_start_len": start})),
            )
            .await;
        let mut tokens = prompt.clone();
        tokens.extend(ids(&out["output_ids"]));
        assert_eq!(
            int32s(&out["meta_info"]["routed_experts"]),
            expected(SHAPE, &tokens, start)
        );
    }
    let events = s
        .stream(
            "/generate",
            &body(json!({"return_routed_experts": true, "stream": true})),
        )
        .await;
    let (last, rest) = events.split_last().unwrap();
    assert!(rest
        .iter()
        .all(|e| e["meta_info"].get("routed_experts").is_none()));
    let mut tokens = prompt.clone();
    tokens.extend(ids(&last["output_ids"]));
    assert_eq!(
        int32s(&last["meta_info"]["routed_experts"]),
        expected(SHAPE, &tokens, 0)
    );
    let bad = body(json!({"return_routed_experts": true,
                          "routed_experts_start_len": prompt.len() + 1}));
    s.expect_error("/generate", &bad, 400, Some("routed_experts_start_len"))
        .await;
    let info = s.get_json("/get_server_info").await;
    assert_eq!(info["enable_return_routed_experts"], true);
}

/// Over 256 experts the array is `uint16`, as vLLM's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_256_experts_are_uint16() {
    let shape = RoutingShape {
        layers: 2,
        top_k: 4,
        num_experts: 1000,
    };
    let s = moe(shape).await;
    let out = s
        .ok(
            "/v1/completions",
            &json!({"prompt": "wide experts", "max_tokens": 3, "return_token_ids": true}),
        )
        .await;
    let c = &out["choices"][0];
    let npy = check(shape, &c["routed_experts"], &completion_tokens(c), 0);
    assert!(npy.values.iter().any(|&v| v > 255), "ids past a byte");
}

/// Without the flag: `routed_experts` is `null` on every non-streamed choice (vLLM dumps its
/// unset fields), SGLang's request for it is a 400 naming it, and
/// `routed_experts_prompt_start` is still checked (vLLM checks it either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_capture_routed_experts_is_null_and_sglangs_request_is_refused() {
    let s = start(Options::default()).await;
    let out = s
        .ok("/v1/completions", &json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(out["choices"][0]["routed_experts"], Value::Null);
    assert!(out["choices"][0].get("routed_experts").is_some());
    let chat = s
        .ok(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        )
        .await;
    assert!(chat["choices"][0].get("routed_experts").is_some());
    assert_eq!(chat["choices"][0]["routed_experts"], Value::Null);
    let prompt = prompt_ids(&s, "x").await;
    let tito = s
        .ok(
            "/inference/v1/generate",
            &json!({"token_ids": prompt, "sampling_params": {"max_tokens": 1}}),
        )
        .await;
    assert_eq!(tito["choices"][0]["routed_experts"], Value::Null);
    s.expect_error(
        "/generate",
        &json!({"input_ids": prompt, "return_routed_experts": true}),
        400,
        Some("return_routed_experts"),
    )
    .await;
    s.expect_error(
        "/v1/completions",
        &json!({"prompt": "x", "routed_experts_prompt_start": 50}),
        400,
        Some("routed_experts_prompt_start"),
    )
    .await;
    let info = s.get_json("/get_server_info").await;
    assert_eq!(info["enable_return_routed_experts"], false);
}
