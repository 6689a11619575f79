//! Structured outputs on the real tiny Llama model: every output matches its constraint,
//! greedy tokens equal an unconstrained run wherever the constraint allows the argmax, a
//! constrained request's tokens do not depend on its batch, and bad constraints are refused
//! by name.

mod support;

use std::sync::Arc;

use ferry_core::{FinishReason, SamplerSpec, SamplingParams, SchedulerConfig, TokenId};
use ferry_engine::{
    spawn, Constraint, ConstraintError, EngineConfig, EngineHandle, GenerateRequest, StopReason,
    StructuredOutput,
};
use ferry_model::tiny::{tiny_config, tiny_model};
use ferry_model::LlamaModel;
use support::{collect, Collected};
use tokenizers::Tokenizer;

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(tiny_model().tokenizer.expect("tiny tokenizer"))
}

fn engine(tok: &Arc<Tokenizer>, max_num_seqs: usize) -> EngineHandle {
    let tiny = tiny_model();
    let llama = LlamaModel::new(&tiny.config, &tiny.weights).unwrap();
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            block_size: 4,
            n_blocks: 256,
            max_num_seqs,
            max_num_batched_tokens: 64,
            max_model_len: 512,
            eos_token_ids: tiny_config().eos_token_ids,
            ..SchedulerConfig::default()
        },
        input_queue_capacity: 64,
        lora: None,
    };
    spawn(config, Box::new(llama), Some(tok.clone())).unwrap()
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<TokenId> {
    TokenId::from_raw_slice(tok.encode(text, false).unwrap().get_ids()).to_vec()
}

fn compile(engine: &EngineHandle, spec: StructuredOutput) -> Constraint {
    engine.constraints().unwrap().compile(&spec).unwrap()
}

/// Greedy, with logprobs, `max_tokens`, text.
fn request(
    id: &str,
    prompt: Vec<TokenId>,
    max_tokens: u32,
    constraint: Option<Constraint>,
) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        prompt,
        params: SamplingParams {
            max_tokens,
            sampler: SamplerSpec {
                logprobs: Some(2),
                ..SamplerSpec::default()
            },
            ..SamplingParams::default()
        },
        detokenize: true,
        constraint,
        ..GenerateRequest::default()
    }
}

async fn run(engine: &EngineHandle, req: GenerateRequest) -> Collected {
    collect(engine.generate(req).await.unwrap()).await
}

fn logprobs(c: &Collected) -> Vec<(TokenId, u32)> {
    c.chunks
        .iter()
        .flat_map(|ch| &ch.logprobs)
        .map(|l| (l.token, l.logprob.to_bits()))
        .collect()
}

fn forced(c: &Collected) -> Vec<bool> {
    c.chunks.iter().flat_map(|ch| ch.forced.clone()).collect()
}

fn prompt(tok: &Tokenizer, i: usize) -> Vec<TokenId> {
    encode(tok, &format!("Tell me something about number {i}, please:"))
}

#[tokio::test]
async fn a_constraint_that_allows_the_argmax_changes_nothing_but_the_end() {
    let tok = tokenizer();
    let engine = engine(&tok, 8);
    let eos = tiny_config().eos_token_ids[0];
    for i in 0..4 {
        let p = prompt(&tok, i);
        let free = run(&engine, request(&format!("free{i}"), p.clone(), 24, None)).await;
        // The longest prefix of the free run that is whole text without special tokens.
        let mut n = free.tokens.iter().take_while(|&&t| t != eos).count();
        let text = loop {
            let t = tok
                .decode(TokenId::as_raw_slice(&free.tokens[..n]), false)
                .unwrap();
            if !t.contains(char::REPLACEMENT_CHARACTER)
                && tok
                    .decode(TokenId::as_raw_slice(&free.tokens[..n]), true)
                    .unwrap()
                    == t
            {
                break t;
            }
            n -= 1;
        };
        assert!(n > 0, "prompt {i}: no usable prefix in {:?}", free.tokens);
        // Constrained to exactly that text: greedy takes the same tokens (each is the argmax
        // and allowed), with the same raw logprobs, then EOS, the only token left.
        let c = compile(&engine, StructuredOutput::Choice(vec![text.clone()]));
        let out = run(&engine, request(&format!("c{i}"), p, 64, Some(c))).await;
        assert_eq!(out.tokens[..n], free.tokens[..n], "prompt {i}");
        assert_eq!(out.tokens[n..], [eos], "prompt {i}");
        assert_eq!(logprobs(&out)[..n], logprobs(&free)[..n], "prompt {i}");
        assert_eq!(out.text, text);
        let finish = out.finish.as_ref().unwrap();
        assert_eq!(finish.reason, FinishReason::Stop);
        assert_eq!(finish.stop_reason, Some(StopReason::Token(eos)));
        let forced = forced(&out);
        assert_eq!(forced.len(), out.tokens.len());
        assert!(forced[n], "EOS after the complete text is forced");
    }
    engine.shutdown().await.unwrap();
}

/// Checks `text` against `[a-c]{2,4}-[0-9]{1,2}` by hand.
fn matches_code(text: &str) -> bool {
    let Some((letters, digits)) = text.split_once('-') else {
        return false;
    };
    (2..=4).contains(&letters.len())
        && letters.bytes().all(|b| (b'a'..=b'c').contains(&b))
        && (1..=2).contains(&digits.len())
        && digits.bytes().all(|b| b.is_ascii_digit())
}

fn person_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": { "type": "string", "enum": ["ada", "alan", "grace"] },
            "age": { "type": "integer", "minimum": 0, "maximum": 99 },
            "tags": { "type": "array", "items": { "type": "boolean" }, "maxItems": 3 }
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false,
        "x-guidance": { "whitespace_flexible": false }
    })
}

fn check_person(text: &str) {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{text}");
    assert!(
        ["ada", "alan", "grace"].contains(&o["name"].as_str().unwrap()),
        "{text}"
    );
    assert!(o["age"].as_u64().unwrap() <= 99, "{text}");
    let tags = o["tags"].as_array().unwrap();
    assert!(
        tags.len() <= 3 && tags.iter().all(|t| t.is_boolean()),
        "{text}"
    );
}

/// Parses `text` against `start: "(" NUM ("+" NUM)* ")"` by hand; NUM is 1 to 3 digits.
fn matches_sum(text: &str) -> bool {
    let Some(inner) = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')) else {
        return false;
    };
    inner
        .split('+')
        .all(|n| (1..=3).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
}

#[tokio::test]
async fn every_kind_of_constraint_is_met_alone_and_in_a_mixed_batch() {
    let tok = tokenizer();
    let engine = engine(&tok, 16);
    let specs = [
        StructuredOutput::Regex("[a-c]{2,4}-[0-9]{1,2}".into()),
        StructuredOutput::Choice(vec!["red".into(), "green".into(), "a (blue) [sky]?".into()]),
        StructuredOutput::JsonSchema(person_schema()),
        StructuredOutput::Grammar(
            "start: \"(\" NUM (\"+\" NUM)* \")\"\nNUM: /[0-9]{1,3}/\n".into(),
        ),
    ];
    let check = |k: usize, c: &Collected| {
        assert_eq!(c.reason(), FinishReason::Stop, "spec {k}: {:?}", c.text);
        let text = &c.text;
        match k {
            0 => assert!(matches_code(text), "{text:?}"),
            1 => assert!(
                ["red", "green", "a (blue) [sky]?"].contains(&text.as_str()),
                "{text:?}"
            ),
            2 => check_person(text),
            _ => assert!(matches_sum(text), "{text:?}"),
        }
    };
    // Alone, then all together with unconstrained requests in the same steps.
    let mut alone = Vec::new();
    for (k, spec) in specs.iter().enumerate() {
        for i in 0..2 {
            let c = compile(&engine, spec.clone());
            let out = run(
                &engine,
                request(&format!("a{k}-{i}"), prompt(&tok, i), 96, Some(c)),
            )
            .await;
            check(k, &out);
            alone.push(out);
        }
    }
    let free_alone = run(&engine, request("free", prompt(&tok, 7), 16, None)).await;
    let mut tasks = Vec::new();
    for (k, spec) in specs.iter().enumerate() {
        for i in 0..2 {
            let req = request(
                &format!("b{k}-{i}"),
                prompt(&tok, i),
                96,
                Some(compile(&engine, spec.clone())),
            );
            let e = engine.clone();
            tasks.push(tokio::spawn(async move { run(&e, req).await }));
        }
    }
    let e = engine.clone();
    let free =
        tokio::spawn(async move { run(&e, request("free2", prompt(&tok, 7), 16, None)).await });
    for (j, task) in tasks.into_iter().enumerate() {
        let out = task.await.unwrap();
        check(j / 2, &out);
        assert_eq!(out.tokens, alone[j].tokens, "request {j}: batch-invariant");
        assert_eq!(logprobs(&out), logprobs(&alone[j]), "request {j}");
    }
    let free = free.await.unwrap();
    assert_eq!(free.tokens, free_alone.tokens);
    assert_eq!(logprobs(&free), logprobs(&free_alone));
    assert!(
        free.chunks.iter().all(|c| c.forced.is_empty()),
        "unconstrained: no forced list"
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_complete_constraint_under_ignore_eos_stops_with_a_constraint_reason() {
    let tok = tokenizer();
    let engine = engine(&tok, 4);
    let c = compile(&engine, StructuredOutput::Choice(vec!["ok".into()]));
    let mut req = request("r", prompt(&tok, 1), 32, Some(c.clone()));
    req.params.ignore_eos = true;
    let out = run(&engine, req).await;
    let finish = out.finish.as_ref().unwrap();
    assert_eq!(finish.reason, FinishReason::Stop);
    assert!(
        matches!(&finish.stop_reason, Some(StopReason::Constraint(why)) if why.contains("complete")),
        "{:?}",
        finish.stop_reason
    );
    // "ok", then the EOS the constraint forced (generation past EOS is allowed, the
    // constraint is not).
    let eos = tiny_config().eos_token_ids[0];
    assert_eq!(out.tokens.last(), Some(&eos));
    assert_eq!(
        tok.decode(TokenId::as_raw_slice(&out.tokens), true)
            .unwrap(),
        "ok"
    );
    // A clone is an independent copy: the original still starts from the beginning.
    let again = run(&engine, request("again", prompt(&tok, 1), 32, Some(c))).await;
    assert_eq!(again.text, "ok");
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_constraints_are_refused_with_what_is_wrong() {
    let tok = tokenizer();
    let engine = engine(&tok, 4);
    let constraints = engine.constraints().unwrap();
    for spec in [
        StructuredOutput::Regex("([a-z]".into()),
        StructuredOutput::Choice(Vec::new()),
        StructuredOutput::JsonSchema(serde_json::json!({ "type": 5 })),
        StructuredOutput::JsonSchema(serde_json::json!({ "type": "object", "required": "x" })),
        StructuredOutput::Grammar("start: undefined_rule\n".into()),
        StructuredOutput::Grammar("this is not lark".into()),
    ] {
        let err = constraints.compile(&spec).unwrap_err();
        assert!(
            matches!(err, ConstraintError::Invalid(ref m) if !m.is_empty()),
            "{spec:?}: {err:?}"
        );
    }
    engine.shutdown().await.unwrap();
    // An engine without a tokenizer cannot take constraints, and says so.
    let tiny = tiny_model();
    let llama = LlamaModel::new(&tiny.config, &tiny.weights).unwrap();
    let bare = spawn(EngineConfig::default(), Box::new(llama), None).unwrap();
    let err = bare.constraints().unwrap_err();
    assert!(
        matches!(err, ConstraintError::Unavailable(ref m) if m.contains("tokenizer")),
        "{err}"
    );
    bare.shutdown().await.unwrap();
}

/// The default model (SmolLM2-135M-Instruct, fetched by scripts/fetch-model.sh; this test
/// FAILS, never skips, without it): a constraint that allows the argmax leaves the greedy
/// tokens and logprobs as they are, and every kind of constraint is met.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_model_meets_every_constraint_and_keeps_its_argmax() {
    let cache = ferry_model::cache_dir(std::env::var_os("FERRY_CACHE"), std::env::var_os("HOME"))
        .expect("FERRY_CACHE or HOME is set");
    let path = ferry_model::default_model_path(&cache);
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/fetch-model.sh` first",
        path.display()
    );
    let model = ferry_model::load_model(&path).unwrap();
    let tok = Arc::new(
        model
            .tokenizer
            .clone()
            .expect("the default model has a tokenizer"),
    );
    let config = ferry_engine::ModelEngineConfig {
        kv_cache: ferry_engine::KvCacheSize::Blocks(64),
        max_model_len: Some(512),
        ..ferry_engine::ModelEngineConfig::default()
    };
    let engine = ferry_engine::start_model(model, &config).unwrap().handle;
    let eos = engine.scheduler_config().eos_token_ids[0];
    let chat = |q: &str| {
        encode(
            &tok,
            &format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
        )
    };

    // The argmax run, then the same text as the only choice.
    let p = chat("What is the capital of France?");
    let free = run(&engine, request("free", p.clone(), 12, None)).await;
    let mut n = free.tokens.iter().take_while(|&&t| t != eos).count();
    let text = loop {
        let t = tok
            .decode(TokenId::as_raw_slice(&free.tokens[..n]), false)
            .unwrap();
        if !t.contains(char::REPLACEMENT_CHARACTER) {
            break t;
        }
        n -= 1;
    };
    assert!(n >= 4, "{:?}", free.tokens);
    let c = compile(&engine, StructuredOutput::Choice(vec![text.clone()]));
    let out = run(&engine, request("same", p, 32, Some(c))).await;
    assert_eq!(out.tokens[..n], free.tokens[..n]);
    assert_eq!(out.tokens[n..], [eos]);
    assert_eq!(logprobs(&out)[..n], logprobs(&free)[..n]);
    assert_eq!(out.text, text);

    // Every kind, each output checked by hand.
    let cases: [(StructuredOutput, &str); 4] = [
        (
            StructuredOutput::JsonSchema(person_schema()),
            "Describe a person as JSON.",
        ),
        (
            StructuredOutput::Regex("[a-c]{2,4}-[0-9]{1,2}".into()),
            "Give me a code.",
        ),
        (
            StructuredOutput::Choice(vec!["red".into(), "green".into(), "a (blue) [sky]?".into()]),
            "Pick a color.",
        ),
        (
            StructuredOutput::Grammar(
                "start: \"(\" NUM (\"+\" NUM)? (\"+\" NUM)? \")\"\nNUM: /[0-9]{1,3}/\n".into(),
            ),
            "Write a sum.",
        ),
    ];
    for (k, (spec, q)) in cases.into_iter().enumerate() {
        let c = compile(&engine, spec);
        let out = run(&engine, request(&format!("k{k}"), chat(q), 64, Some(c))).await;
        assert_eq!(out.reason(), FinishReason::Stop, "case {k}: {:?}", out.text);
        match k {
            0 => check_person(&out.text),
            1 => assert!(matches_code(&out.text), "{:?}", out.text),
            2 => assert!(
                ["red", "green", "a (blue) [sky]?"].contains(&out.text.as_str()),
                "{:?}",
                out.text
            ),
            _ => assert!(matches_sum(&out.text), "{:?}", out.text),
        }
    }
    engine.shutdown().await.unwrap();
}

/// A constraint after the reasoning: any text up to the first `</think>` is free (markers
/// and braces inside it included), then the schema holds; text that breaks the schema after
/// the marker, or an answer without the marker, is refused.
#[tokio::test]
async fn a_constraint_after_the_reasoning_leaves_the_reasoning_free() {
    let tok = tokenizer();
    let engine = engine(&tok, 4);
    let spec = StructuredOutput::AfterReasoning {
        end: "</think>".into(),
        inner: Box::new(StructuredOutput::JsonSchema(person_schema())),
    };
    let c = compile(&engine, spec);
    let person = r#"{"name":"ada","age":36,"tags":[true]}"#;
    let accepts = |text: &str| c.accepts(&encode(&tok, text));
    assert!(accepts(&format!(
        "<think>\nhmm {{ not json </thin\n</think>{person}"
    )));
    assert!(accepts(&format!("</think>{person}")));
    assert!(!accepts("<think>x</think>{\"name\":5}"));
    assert!(!accepts(person), "the reasoning must end first");
    assert!(!accepts(&format!("<think>x</think>{person}</think>")));
    // Each kind of inner constraint.
    let choice = compile(
        &engine,
        StructuredOutput::AfterReasoning {
            end: "</think>".into(),
            inner: Box::new(StructuredOutput::Choice(vec!["yes".into(), "no".into()])),
        },
    );
    assert!(choice.accepts(&encode(&tok, "a/b</think>no")));
    assert!(!choice.accepts(&encode(&tok, "a</think>maybe")));
    engine.shutdown().await.unwrap();
}
