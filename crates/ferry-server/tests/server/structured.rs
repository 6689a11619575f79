//! Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs`
//! and `guided_*` on both routes, streaming and not; every output meets its constraint, the
//! response says which tokens were forced, and bad constraints are a 400 naming the field.

use serde_json::{json, Value};

use crate::support::{ids, start, Options, MODEL};

/// Checks a constrained output's text.
type Check = dyn Fn(&str);

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9}
        },
        "required": ["color", "count"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false}
    })
}

fn check_schema_output(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 2, "{text}");
    assert!(
        ["red", "green", "blue"].contains(&o["color"].as_str().unwrap()),
        "{text}"
    );
    assert!(o["count"].as_u64().unwrap() <= 9, "{text}");
}

/// `[xyz]{2,5}` by hand.
fn matches_regex(text: &str) -> bool {
    (2..=5).contains(&text.len()) && text.bytes().all(|b| b"xyz".contains(&b))
}

/// A constrained choice that stopped: its text meets `check`, and `forced_tokens` has one
/// flag per token, the last (EOS, the only token a complete output allows) forced.
fn check_choice(choice: &Value, text: &str, check: &dyn Fn(&str)) {
    assert_eq!(choice["finish_reason"], "stop", "{choice}");
    check(text);
    let forced: Vec<bool> = choice["forced_tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no forced_tokens: {choice}"))
        .iter()
        .map(|f| f.as_bool().unwrap())
        .collect();
    assert_eq!(forced.len(), ids(&choice["token_ids"]).len(), "{choice}");
    assert_eq!(forced.last(), Some(&true), "{choice}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_constrains_completions_streamed_or_not() {
    let s = start(Options::default()).await;
    let json_check = |t: &str| check_schema_output(t);
    let regex_check = |t: &str| assert!(matches_regex(t), "{t:?}");
    let choice_check = |t: &str| assert!(["yes", "no", "maybe (later)"].contains(&t), "{t:?}");
    let grammar_check = |t: &str| {
        let inner = t
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .unwrap_or_else(|| panic!("{t:?}"));
        assert!(
            inner
                .split(',')
                .all(|d| d.len() == 1 && d.as_bytes()[0].is_ascii_digit()),
            "{t:?}"
        );
    };
    let cases: Vec<(Value, &Check)> = vec![
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema(), "strict": true}}}),
            &json_check,
        ),
        (
            json!({"structured_outputs": {"json": schema().to_string()}}),
            &json_check,
        ),
        (json!({"guided_json": schema()}), &json_check),
        (
            json!({"structured_outputs": {"regex": "[xyz]{2,5}"}}),
            &regex_check,
        ),
        (json!({"guided_regex": "[xyz]{2,5}"}), &regex_check),
        (
            json!({"structured_outputs": {"choice": ["yes", "no", "maybe (later)"]}}),
            &choice_check,
        ),
        (
            json!({"guided_choice": ["yes", "no", "maybe (later)"]}),
            &choice_check,
        ),
        (
            json!({"structured_outputs": {"grammar": "start: \"[\" D (\",\" D)? (\",\" D)? \"]\"\nD: /[0-9]/\n"}}),
            &grammar_check,
        ),
        (
            json!({"guided_grammar": "start: \"[\" D (\",\" D)? (\",\" D)? \"]\"\nD: /[0-9]/\n"}),
            &grammar_check,
        ),
    ];
    for (i, (fields, check)) in cases.iter().enumerate() {
        let mut body = json!({"model": MODEL, "prompt": format!("case {i}: answer"), "max_tokens": 48,
                              "temperature": 0, "return_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        let full = s.ok("/v1/completions", &body).await;
        let choice = &full["choices"][0];
        let text = choice["text"].as_str().unwrap();
        check_choice(choice, text, *check);
        // Streamed: the same tokens and flags, chunk by chunk.
        body["stream"] = json!(true);
        let events = s.stream("/v1/completions", &body).await;
        let (mut text2, mut tokens, mut forced) = (String::new(), Vec::new(), Vec::new());
        for e in &events {
            let c = &e["choices"][0];
            text2.push_str(c["text"].as_str().unwrap());
            tokens.extend(ids(&c["token_ids"]));
            forced.extend(c["forced_tokens"].as_array().unwrap().iter().cloned());
        }
        assert_eq!(text2, text, "case {i}");
        assert_eq!(tokens, ids(&choice["token_ids"]), "case {i}");
        assert_eq!(Value::Array(forced), choice["forced_tokens"], "case {i}");
    }
    // Sampled, n = 3: every choice meets the constraint.
    let body = json!({"model": MODEL, "prompt": "pick", "max_tokens": 48, "temperature": 1.0,
                      "seed": 7, "n": 3, "return_token_ids": true, "guided_json": schema()});
    let full = s.ok("/v1/completions", &body).await;
    for c in full["choices"].as_array().unwrap() {
        check_choice(c, c["text"].as_str().unwrap(), &json_check);
    }
    // Unconstrained: no `forced_tokens` at all.
    let plain = s
        .ok(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "pick", "max_tokens": 4}),
        )
        .await;
    assert!(
        plain["choices"][0].get("forced_tokens").is_none(),
        "{plain}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_takes_json_object_and_json_schema() {
    let s = start(Options::default()).await;
    let messages = json!([{"role": "user", "content": "hi"}]);
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0,
                      "return_token_ids": true,
                      "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema()}}});
    let full = s.ok("/v1/chat/completions", &body).await;
    let choice = &full["choices"][0];
    let content = choice["message"]["content"].as_str().unwrap();
    check_choice(choice, content, &|t| check_schema_output(t));
    // json_object: any object. A random model may not close it within the budget, so the
    // check is on what it wrote: it starts an object and never leaves JSON's alphabet.
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0,
                      "response_format": {"type": "json_object"}});
    let full = s.ok("/v1/chat/completions", &body).await;
    let content = full["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.trim_start().starts_with('{'), "{content:?}");
    if full["choices"][0]["finish_reason"] == "stop" {
        let v: Value = serde_json::from_str(content).unwrap();
        assert!(v.is_object());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_constraints_are_refused_naming_the_field() {
    let s = start(Options::default()).await;
    let base = json!({"model": MODEL, "prompt": "x", "max_tokens": 4});
    let with = |fields: Value| {
        let mut b = base.clone();
        b.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        b
    };
    let cases = [
        (json!({"guided_regex": "([a-z]"}), "guided_regex"),
        (
            json!({"structured_outputs": {"regex": "(("}}),
            "structured_outputs.regex",
        ),
        (json!({"guided_json": {"type": 5}}), "guided_json"),
        (
            json!({"guided_grammar": "start: missing_rule"}),
            "guided_grammar",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
            "guided_regex",
        ),
    ];
    for (fields, param) in cases {
        s.expect_error("/v1/completions", &with(fields), 400, Some(param))
            .await;
    }
    assert_eq!(s.n_steps.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gbnf_grammars_constrain_like_their_lark_form() {
    let s = start(Options::default()).await;
    let digits = |t: &str| {
        let inner = t
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .unwrap_or_else(|| panic!("{t:?}"));
        assert!(
            inner
                .split(',')
                .all(|d| d.len() == 1 && d.as_bytes()[0].is_ascii_digit()),
            "{t:?}"
        );
    };
    // llama.cpp's format: a comment, a rule over two lines, a dashed name, a class.
    let gbnf = "# a list of up to three digits\nroot ::= \"[\" one-digit\n    (\",\" one-digit)? (\",\" one-digit)? \"]\"\none-digit ::= [0-9]\n";
    let words = |t: &str| {
        assert!(
            t.split(' ')
                .all(|w| !w.is_empty() && w.bytes().all(|b| b"ab".contains(&b))),
            "{t:?}"
        );
    };
    let gbnf_words = "root ::= word (\" \" word){0,2}\nword ::= [ab]+ | \"a\"";
    // The digit lists end where the grammar does (EOS forced); the words may go on.
    let cases: [(Value, &Check, bool); 3] = [
        (
            json!({"structured_outputs": {"grammar": gbnf}}),
            &digits,
            true,
        ),
        (json!({"guided_grammar": gbnf}), &digits, true),
        (json!({"guided_grammar": gbnf_words}), &words, false),
    ];
    for (i, (fields, check, ends_forced)) in cases.iter().enumerate() {
        for seed in 0..3 {
            let mut body = json!({"model": MODEL, "prompt": format!("gbnf {i}"), "max_tokens": 24,
                                  "temperature": 1.0, "seed": seed, "return_token_ids": true});
            body.as_object_mut()
                .unwrap()
                .extend(fields.as_object().unwrap().clone());
            let full = s.ok("/v1/completions", &body).await;
            let choice = &full["choices"][0];
            let text = choice["text"].as_str().unwrap();
            if *ends_forced {
                check_choice(choice, text, *check);
            } else {
                assert_eq!(choice["finish_reason"], "stop", "{choice}");
                check(text);
            }
        }
    }
    // A GBNF grammar that does not parse is a 400 naming the field.
    for bad in ["root ::= (\"a\"", "start ::= \"a\"", "root ::= [a-"] {
        let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_grammar": bad});
        s.expect_error("/v1/completions", &body, 400, Some("guided_grammar"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disable_any_whitespace_gives_compact_json() {
    let s = start(Options::default()).await;
    let mut flexible = schema();
    flexible.as_object_mut().unwrap().remove("x-guidance");
    // A bias that makes the model write a space wherever it may.
    let space = s.ok("/tokenize", &json!({"prompt": " "})).await["tokens"][0].clone();
    let body = |disable: bool| {
        json!({"model": MODEL, "prompt": "json", "max_tokens": 40, "temperature": 0,
               "return_token_ids": true, "logit_bias": {space.to_string(): 30},
               "structured_outputs": {"json": flexible, "disable_any_whitespace": disable}})
    };
    let loose = s.ok("/v1/completions", &body(false)).await;
    let text = loose["choices"][0]["text"].as_str().unwrap();
    assert!(text.contains(' '), "free whitespace is taken: {text:?}");
    let compact = s.ok("/v1/completions", &body(true)).await;
    let choice = &compact["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(!text.contains(char::is_whitespace), "{text:?}");
    check_choice(choice, text, &check_schema_output);
    // Also for json_object, and through chat.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 12, "temperature": 0, "logit_bias": {space.to_string(): 30},
                      "structured_outputs": {"json_object": true, "disable_any_whitespace": true}});
    let out = s.ok("/v1/chat/completions", &chat).await;
    let content = out["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with('{'), "{content:?}");
    assert!(!content.contains(char::is_whitespace), "{content:?}");
}
