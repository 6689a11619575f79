//! Tool calling: `tools` rendered by the template, `tool_choice` of every kind, calls in the
//! answer (whole and streamed, which join to the same calls), the RL fields beside them, and
//! the 400s. The tiny model writes no calls of its own, so `auto` is driven by a request's
//! own constraint in the hermes format (the constraint holds the whole output under `auto`);
//! `required` and named calls are constrained by the tools' schemas. How the parsers read
//! hand-written outputs is `tool_parsers.rs`'s unit tests.

use serde_json::{json, Value};

use ferry_server::tool_parsers::ToolCallParser;

use crate::support::{ids, start, Options, Server, MODEL};

/// A template that renders tools, calls and results (ChatML with Hermes-style tool text).
const TEMPLATE: &str = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}\
{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\
{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\
{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}\
{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// For generation: tools by name only (the tiny model's context is short).
const SHORT: &str = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}\
{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
         "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
             "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                           "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "tools": tools(), "chat_template": SHORT, "temperature": 0,
                          "max_tokens": 96});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn hermes_server() -> Server {
    start(Options {
        tool_call_parser: Some(ToolCallParser::Hermes),
        max_model_len: Some(1024),
        ..Options::default()
    })
    .await
}

/// A call as `(id, name, arguments)`.
type Call = (String, String, String);

/// The streamed events of one choice joined: (content, calls, finish_reason, token ids).
fn join_stream(events: &[Value]) -> (String, Vec<Call>, String, Vec<u64>) {
    let mut content = String::new();
    let mut calls: Vec<Call> = Vec::new();
    let mut finish = String::new();
    let mut token_ids = Vec::new();
    for e in events {
        let Some(choice) = e["choices"].get(0) else {
            continue;
        };
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or(""));
        if let Some(list) = delta["tool_calls"].as_array() {
            for c in list {
                let index = c["index"].as_u64().unwrap() as usize;
                if index == calls.len() {
                    // A call's first delta: its index, id, type and name.
                    assert_eq!(c["type"], "function", "{c}");
                    calls.push((
                        c["id"].as_str().unwrap().to_owned(),
                        c["function"]["name"].as_str().unwrap().to_owned(),
                        String::new(),
                    ));
                } else {
                    assert!(
                        c.get("id").is_none() && c["function"].get("name").is_none(),
                        "{c}"
                    );
                }
                calls[index].2 += c["function"]["arguments"].as_str().unwrap_or("");
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            assert!(finish.is_empty(), "one finish_reason per choice");
            finish = f.to_owned();
        }
        if !choice["token_ids"].is_null() {
            token_ids.extend(ids(&choice["token_ids"]));
        }
    }
    (content, calls, finish, token_ids)
}

fn message_calls(message: &Value) -> Vec<Call> {
    message["tool_calls"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|c| {
                    assert_eq!(c["type"], "function", "{c}");
                    (
                        c["id"].as_str().unwrap().to_owned(),
                        c["function"]["name"].as_str().unwrap().to_owned(),
                        c["function"]["arguments"].as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Names and arguments (ids differ between requests).
fn calls_without_ids(calls: &[Call]) -> Vec<(String, String)> {
    calls
        .iter()
        .map(|(id, name, args)| {
            assert!(id.starts_with("chatcmpl-tool-"), "{id}");
            (name.clone(), args.clone())
        })
        .collect()
}

fn check_weather_args(args: &str) {
    let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}"));
    assert!(
        ["Paris", "Oslo", "Lima"].contains(&v["city"].as_str().unwrap()),
        "{v}"
    );
    assert!(["c", "f"].contains(&v["unit"].as_str().unwrap()), "{v}");
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
}

/// `tools` reach the template (rendered with transformers' `tojson`), and so do an
/// assistant's calls and a tool message's call id, on chat and on `/tokenize`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_and_calls_are_rendered_by_the_template() {
    let s = hermes_server().await;
    let messages = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\",\"unit\":\"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"}
    ]);
    let body = json!({"model": MODEL, "messages": messages, "tools": tools(),
                      "chat_template": TEMPLATE});
    let got = ids(&s.ok("/tokenize", &body).await["tokens"]);
    let tool_json = |t: &Value| {
        // Python's json.dumps layout, keys in the order sent.
        let f = &t["function"];
        let mut out = format!(
            r#"{{"type": "function", "function": {{"name": "{}""#,
            f["name"].as_str().unwrap()
        );
        if let Some(d) = f["description"].as_str() {
            out += &format!(r#", "description": "{d}""#);
        }
        out + ", \"parameters\": " + &py_json(&f["parameters"]) + "}}"
    };
    let text = format!(
        "<tools>{}{}</tools>\n<|user|>weather?\n<|assistant|><tool_call>{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Oslo\", \"unit\": \"c\"}}}}</tool_call>\n<|tool|>-3[call_1]\n<|assistant|>",
        tool_json(&tools()[0]),
        tool_json(&tools()[1])
    );
    let want = ids(&s
        .ok(
            "/tokenize",
            &json!({"model": MODEL, "prompt": text, "add_special_tokens": false}),
        )
        .await["tokens"]);
    assert_eq!(got, want);
    // The chat prompt is the same.
    let mut chat_body = chat(json!({"messages": body["messages"], "max_tokens": 1,
                                    "return_token_ids": true, "tool_choice": "none",
                                    "chat_template": TEMPLATE}));
    chat_body["tools"] = tools();
    let out = s.ok("/v1/chat/completions", &chat_body).await;
    assert_eq!(ids(&out["prompt_token_ids"]), want, "{out}");
    // `tool_choice: "none"`: tools rendered, no calls read.
    assert!(
        out["choices"][0]["message"].get("tool_calls").is_none(),
        "{out}"
    );
}

/// Python's `json.dumps` of a small schema (objects, strings, arrays, numbers, booleans).
fn py_json(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let items: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("\"{k}\": {}", py_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(py_json).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// `tool_choice: "auto"` with a request's own constraint (which holds the whole output):
/// the hermes parser reads text then two calls; the stream joins to the same content and
/// calls, and no call text reaches its content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_calls_are_parsed_whole_and_streamed() {
    let s = hermes_server().await;
    let weather = r#"%json { "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false} }"#;
    let grammar = format!(
        "start: \"Let me check.\" call call\ncall: \"<tool_call>\\n{{\\\"name\\\": \\\"get_weather\\\", \\\"arguments\\\": \" args \"}}\\n</tool_call>\"\nargs: {weather}\n"
    );
    let body = chat(
        json!({"structured_outputs": {"grammar": grammar}, "max_tokens": 300,
                           "return_token_ids": true, "logprobs": true}),
    );
    let out = s.ok("/v1/chat/completions", &body).await;
    let choice = &out["choices"][0];
    let message = &choice["message"];
    assert_eq!(message["content"], "Let me check.", "{out}");
    let calls = message_calls(message);
    assert_eq!(calls.len(), 2, "{out}");
    for (_, name, args) in &calls {
        assert_eq!(name, "get_weather");
        let v: Value = serde_json::from_str(args).unwrap();
        assert!(
            ["Paris", "Oslo"].contains(&v["city"].as_str().unwrap()),
            "{args}"
        );
    }
    assert_eq!(choice["finish_reason"], "tool_calls", "{out}");
    // RL keeps its tokens: the ids decode to the whole answer, one logprob each, and the
    // constraint's forced tokens are marked.
    let token_ids = ids(&choice["token_ids"]);
    let text = s
        .ok("/detokenize", &json!({"model": MODEL, "tokens": token_ids}))
        .await["prompt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.starts_with("Let me check.<tool_call>") && text.matches("</tool_call>").count() == 2,
        "{text}"
    );
    assert_eq!(
        choice["logprobs"]["content"].as_array().unwrap().len(),
        token_ids.len()
    );
    assert_eq!(
        choice["forced_tokens"].as_array().unwrap().len(),
        token_ids.len()
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &streamed).await;
    let (content, scalls, finish, stream_ids) = join_stream(&events);
    assert_eq!(content, "Let me check.");
    assert_eq!(calls_without_ids(&scalls), calls_without_ids(&calls));
    assert_eq!(finish, "tool_calls");
    assert_eq!(stream_ids, token_ids);
    for e in &events {
        let c = e["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        assert!(
            !c.contains('<') && !c.contains('{'),
            "call text leaked: {e}"
        );
    }

    // `parallel_tool_calls: false`: only the first call.
    let mut one = body.clone();
    one["parallel_tool_calls"] = json!(false);
    let out = s.ok("/v1/chat/completions", &one).await;
    assert_eq!(
        message_calls(&out["choices"][0]["message"]).len(),
        1,
        "{out}"
    );

    // Malformed call JSON is content, whole.
    let broken = "start: \"<tool_call>{\\\"name\\\": \\\"add\\\", \\\"arguments\\\": {\\\"a\\\": 1</tool_call>\"\n";
    let out = s
        .ok(
            "/v1/chat/completions",
            &chat(json!({"structured_outputs": {"grammar": broken}, "max_tokens": 300})),
        )
        .await;
    assert_eq!(
        out["choices"][0]["message"]["content"],
        "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1</tool_call>",
        "{out}"
    );
    assert!(out["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(out["choices"][0]["finish_reason"], "stop");

    // Without a constraint the tiny model writes text, which stays content.
    let free = s
        .ok(
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 12, "ignore_eos": true})),
        )
        .await;
    assert!(free["choices"][0]["message"]["content"]
        .as_str()
        .is_some_and(|c| !c.is_empty()));
    assert_eq!(free["choices"][0]["finish_reason"], "length");
}

/// `required` and a named function hold the output to the tools' schemas, so it always
/// parses into calls whose arguments match; streamed, the same calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_calls_match_their_schemas() {
    let s = hermes_server().await;
    for parallel in [true, false] {
        // The tiny model would add calls until `max_tokens`: a bias against "," (token 44,
        // forced where the schema needs it) closes the array after the first with
        // `parallel_tool_calls`; without, the schema's `maxItems: 1` does.
        let mut body = chat(
            json!({"tool_choice": "required", "parallel_tool_calls": parallel,
                                   "max_tokens": 300}),
        );
        if parallel {
            body["logit_bias"] = json!({"44": -100});
        }
        let out = s.ok("/v1/chat/completions", &body).await;
        let choice = &out["choices"][0];
        assert!(choice["message"]["content"].is_null(), "{out}");
        let calls = message_calls(&choice["message"]);
        assert!(!calls.is_empty(), "{out}");
        if !parallel {
            assert_eq!(calls.len(), 1, "{out}");
        }
        for (_, name, args) in &calls {
            let v: Value = serde_json::from_str(args).unwrap();
            match name.as_str() {
                "get_weather" => check_weather_args(args),
                "add" => assert!(v["a"].as_u64().unwrap() <= 9 && v["b"].as_u64().unwrap() <= 9),
                other => panic!("unknown tool {other}"),
            }
        }
        assert_eq!(choice["finish_reason"], "tool_calls", "{out}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (content, scalls, finish, _) =
            join_stream(&s.stream("/v1/chat/completions", &streamed).await);
        assert_eq!(content, "");
        assert_eq!(calls_without_ids(&scalls), calls_without_ids(&calls));
        assert_eq!(finish, "tool_calls");
    }

    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let body = chat(json!({"tool_choice": named}));
    let out = s.ok("/v1/chat/completions", &body).await;
    let choice = &out["choices"][0];
    let calls = message_calls(&choice["message"]);
    assert_eq!(calls.len(), 1, "{out}");
    assert_eq!(calls[0].1, "get_weather");
    check_weather_args(&calls[0].2);
    assert!(choice["message"]["content"].is_null(), "{out}");
    // OpenAI (and vLLM) report `stop` for a named function.
    assert_eq!(choice["finish_reason"], "stop", "{out}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &streamed).await;
    let (content, scalls, finish, _) = join_stream(&events);
    assert_eq!(content, "");
    assert_eq!(calls_without_ids(&scalls), calls_without_ids(&calls));
    assert_eq!(finish, "stop");
    // Cut off by max_tokens, as vLLM ends them: a named call keeps the arguments it has
    // (not valid JSON yet); a `required` array that does not parse makes no call.
    let out = s
        .ok(
            "/v1/chat/completions",
            &chat(json!({"tool_choice": named, "max_tokens": 3})),
        )
        .await;
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{out}");
    let calls = message_calls(&choice["message"]);
    assert_eq!(calls.len(), 1, "{out}");
    assert!(serde_json::from_str::<Value>(&calls[0].2).is_err(), "{out}");
    let out = s
        .ok(
            "/v1/chat/completions",
            &chat(json!({"tool_choice": "required", "max_tokens": 3})),
        )
        .await;
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{out}");
    assert!(choice["message"].get("tool_calls").is_none(), "{out}");
    assert!(choice["message"]["content"].is_null(), "{out}");
}

/// Bad tool input is a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tool_input_names_the_field() {
    let s = hermes_server().await;
    let path = "/v1/chat/completions";
    let weather = tools()[0].clone();
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"tools": [{"type": "function", "function": {"description": "x"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [weather, weather]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"tool_choice": "required", "tools": null}),
            "tool_choice",
        ),
        (json!({"tools": "get_weather"}), "tools"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "add"}},
                "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "add", "arguments": {"a": 1}}}]}]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "d", "content": "1"}]}),
            "messages[2].tool_call_id",
        ),
    ];
    for (extra, param) in cases {
        s.expect_error(path, &chat(extra), 400, Some(param)).await;
    }
    // A server without --enable-auto-tool-choice refuses `auto` (the default with tools),
    // as vLLM does, and takes `none`, `required` and named calls.
    let plain = start(Options {
        max_model_len: Some(1024),
        ..Options::default()
    })
    .await;
    plain
        .expect_error(path, &chat(json!({})), 400, Some("tool_choice"))
        .await;
    plain
        .ok(path, &chat(json!({"tool_choice": "none", "max_tokens": 2})))
        .await;
    let required =
        json!({"tool_choice": "required", "max_tokens": 300, "logit_bias": {"44": -100}});
    let out = plain.ok(path, &chat(required)).await;
    assert!(
        !message_calls(&out["choices"][0]["message"]).is_empty(),
        "{out}"
    );
    // `tools` stay refused on completions.
    plain
        .expect_error(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "x", "tools": tools()}),
            400,
            Some("tools"),
        )
        .await;
}

/// Each parser reads its own format under `auto` (driven by a request's own grammar), whole
/// and streamed alike, and no call text reaches the streamed content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_parser_reads_its_format_whole_and_streamed() {
    let city = r#"%json { "enum": ["Paris", "Oslo"] }"#;
    let cases = [
        (
            ToolCallParser::Hermes,
            format!(
                "start: \"Ok. \" \"<tool_call>\\n{{\\\"name\\\": \\\"get_weather\\\", \\\"arguments\\\": {{\\\"city\\\": \" c \"}}}}\\n</tool_call>\"\nc: {city}\n"
            ),
            Some("Ok. "),
        ),
        (
            ToolCallParser::Llama3Json,
            format!(
                "start: \"{{\\\"name\\\": \\\"get_weather\\\", \\\"parameters\\\": {{\\\"city\\\": \" c \"}}}}\"\nc: {city}\n"
            ),
            None,
        ),
        (
            ToolCallParser::Pythonic,
            "start: \"[get_weather(city='\" c \"')]\"\nc: \"Paris\" | \"Oslo\"\n".to_owned(),
            None,
        ),
    ];
    for (parser, grammar, content) in cases {
        let s = start(Options {
            tool_call_parser: Some(parser),
            max_model_len: Some(1024),
            ..Options::default()
        })
        .await;
        let body = chat(json!({"structured_outputs": {"grammar": grammar}, "max_tokens": 200}));
        let out = s.ok("/v1/chat/completions", &body).await;
        let message = &out["choices"][0]["message"];
        assert_eq!(message["content"].as_str(), content, "{parser:?}: {out}");
        let calls = message_calls(message);
        assert_eq!(calls.len(), 1, "{parser:?}: {out}");
        assert_eq!(calls[0].1, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].2).unwrap();
        assert!(
            ["Paris", "Oslo"].contains(&args["city"].as_str().unwrap()),
            "{args}"
        );
        assert_eq!(
            out["choices"][0]["finish_reason"], "tool_calls",
            "{parser:?}: {out}"
        );
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = s.stream("/v1/chat/completions", &streamed).await;
        let (scontent, scalls, finish, _) = join_stream(&events);
        assert_eq!(scontent, content.unwrap_or(""), "{parser:?}");
        assert_eq!(
            calls_without_ids(&scalls),
            calls_without_ids(&calls),
            "{parser:?}"
        );
        assert_eq!(finish, "tool_calls");
    }
}
