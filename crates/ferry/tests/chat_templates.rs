//! Three real models' chat templates (`tests/fixtures/chat_templates/`: Qwen3-0.6B,
//! Llama-3.1-8B-Instruct, Hermes-3-Llama-3.1-8B's `tool_use`) rendered by `ferry serve` exactly
//! as transformers renders them: tools, tool calls, tool results, reasoning, system messages,
//! `add_generation_prompt` on and off, `chat_template_kwargs`, and the requests the templates
//! refuse. The goldens (`tests/golden/chat_templates.json`) were made by
//! scripts/golden/make_chat_templates.py: transformers' `apply_chat_template` after vLLM 0.34's
//! message conversion, tokenized with the default model's tokenizer (SmolLM2-135M-Instruct).
//!
//! One `ferry serve` on the default model (fetched by scripts/fetch-model.sh; this test FAILS,
//! never skips, without it). Every case is a `POST /tokenize` with the case's request and the
//! template as `chat_template`; its `tokens` must equal the golden ids. The same goldens'
//! `turns` answer an RL question per template (does turn n+1's prompt start with turn n's
//! prompt and output ids? docs/turn-tokens.md): ferry must give the same answer on its own ids.

#[allow(dead_code)] // Shared with the proxy tests; only the spawn and client helpers are used.
#[path = "proxy/procs.rs"]
mod procs;

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

const GOLDEN: &str = include_str!("golden/chat_templates.json");
/// The name the server answers to.
const MODEL: &str = "smol";
/// The whole test: the server's start and about a hundred small requests.
const TEST_BOUND: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_chat_templates_render_and_tokenize_as_transformers_does() {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    let cache = ferry_model::cache_dir(std::env::var_os("FERRY_CACHE"), std::env::var_os("HOME"))
        .expect("FERRY_CACHE or HOME is set");
    let path = ferry_model::default_model_path(&cache);
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/fetch-model.sh` first",
        path.display()
    );
    let args: Vec<String> = [
        "serve",
        "--model",
        path.to_str().unwrap(),
        "--served-model-name",
        MODEL,
        "--port",
        "0",
        "--kv-cache-bytes",
        "256MiB",
        "--max-model-len",
        "2048",
    ]
    .map(str::to_owned)
    .to_vec();
    let server = procs::spawn(&args, &[]).ready();
    let ferry = Ferry {
        url: server.url.clone(),
        client: procs::client(),
    };
    let mut failures = Vec::new();
    tokio::time::timeout(TEST_BOUND, async {
        special_tokens_match(&ferry, &golden, &mut failures).await;
        every_case(&ferry, &golden, &mut failures).await;
        every_turn(&ferry, &golden, &mut failures).await;
    })
    .await
    .expect("the test ran past its bound");
    assert!(
        failures.is_empty(),
        "{} of the chat-template checks failed:\n\n{}\n\nferry's log (last lines):\n{}",
        failures.len(),
        failures.join("\n\n"),
        server.log_tail(30)
    );
}

/// The server under test.
struct Ferry {
    url: String,
    client: reqwest::Client,
}

impl Ferry {
    /// POSTs a JSON text as it is: status (0 for a transport error) and body.
    async fn post(&self, path: &str, body: String) -> (u16, Value) {
        let sent = self
            .client
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => return (0, Value::String(format!("{path}: {e}"))),
        };
        let status = response.status().as_u16();
        let text = response.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, body)
    }

    /// `/tokenize`'s tokens for a body, or why not.
    async fn tokenize(&self, body: String) -> Result<Vec<u64>, String> {
        match self.post("/tokenize", body).await {
            (200, answer) => Ok(ids(&answer["tokens"])),
            (status, answer) => Err(format!("/tokenize answered {status}: {answer}")),
        }
    }

    /// A chat request of the goldens through `/tokenize` with `template`.
    async fn tokenize_chat(&self, request_json: &str, template: &str) -> Result<Vec<u64>, String> {
        self.tokenize(chat_body(request_json, template)).await
    }

    /// A text's ids as ferry tokenizes a model's output (no special tokens added).
    async fn tokenize_text(&self, text: &str) -> Result<Vec<u64>, String> {
        let body = json!({"model": MODEL, "prompt": text, "add_special_tokens": false});
        self.tokenize(body.to_string()).await
    }

    async fn detokenize(&self, tokens: &[u64]) -> String {
        let body = json!({"model": MODEL, "tokens": tokens});
        match self.post("/detokenize", body.to_string()).await {
            (200, answer) => answer["prompt"].as_str().unwrap_or_default().to_owned(),
            (status, answer) => format!("<detokenize answered {status}: {answer}>"),
        }
    }

    /// Where two id lists first differ, shown as ids and as text.
    async fn show_difference(&self, expected: &[u64], got: &[u64], at: usize) -> String {
        let window =
            |v: &[u64]| v[at.saturating_sub(8).min(v.len())..(at + 24).min(v.len())].to_vec();
        let (e, g) = (window(expected), window(got));
        format!(
            "first difference at id {at} (transformers: {} ids, ferry: {})\n  \
             transformers: {e:?}\n  ferry:        {g:?}\n  \
             transformers' text there: {:?}\n  ferry's text there:        {:?}",
            expected.len(),
            got.len(),
            self.detokenize(&e).await,
            self.detokenize(&g).await,
        )
    }
}

/// The `/tokenize` body for a golden request: its JSON text verbatim (so its keys keep the
/// order transformers saw: this test's serde_json may sort an object's keys), with `model`
/// and `chat_template` put in front.
fn chat_body(request_json: &str, template: &str) -> String {
    let rest = request_json
        .trim()
        .strip_prefix('{')
        .expect("a golden request is a JSON object");
    format!(
        "{{\"model\": {}, \"chat_template\": {}, {rest}",
        Value::from(MODEL),
        Value::from(template)
    )
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("the golden's `{key}` is not a string"))
}

/// The first index where `a` and `b` differ, the shorter's length when one is a prefix of the
/// other, None when they are equal (the script's `first_difference`).
fn first_difference(a: &[u64], b: &[u64]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() == b.len() => None,
        None => Some(a.len().min(b.len())),
    }
}

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat_templates")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The goldens were rendered with the model's own bos/eos strings; ferry must pass the same.
async fn special_tokens_match(ferry: &Ferry, golden: &Value, failures: &mut Vec<String>) {
    let request =
        r#"{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}"#;
    let expected = format!(
        "{}|{}",
        text(golden, "bos_token"),
        text(golden, "eos_token")
    );
    let got = match ferry
        .tokenize_chat(request, "{{ bos_token }}|{{ eos_token }}")
        .await
    {
        Ok(tokens) => ferry.detokenize(&tokens).await,
        Err(e) => e,
    };
    if got != expected {
        failures.push(format!(
            "bos_token|eos_token: the goldens used {expected:?}, ferry passes {got:?}"
        ));
    }
}

/// Every case: the golden ids, or a 400 where transformers raised. The refused cases go last:
/// one of them is a template that recurses without end, which must not take the server down
/// before the other cases ran.
async fn every_case(ferry: &Ferry, golden: &Value, failures: &mut Vec<String>) {
    let cases = golden["cases"].as_array().unwrap();
    let (refused, rendered): (Vec<&Value>, Vec<&Value>) =
        cases.iter().partition(|c| c.get("error").is_some());
    for case in rendered.into_iter().chain(refused) {
        let name = text(case, "name");
        let template = fixture(text(case, "template"));
        let request = text(case, "request_json");
        if let Some(error) = case["error"].as_str() {
            let (status, answer) = ferry.post("/tokenize", chat_body(request, &template)).await;
            // Jinja2 cannot iterate over None (Hermes' `{% for tool in tools %}` without
            // tools); minijinja iterates none and undefined as empty, so ferry renders what
            // vLLM refuses. Accepted, as long as the answer is a 200 or a 400.
            if error.starts_with("TypeError: 'NoneType' object is not iterable")
                && (status == 200 || status == 400)
            {
                continue;
            }
            // transformers' `raise_exception` message comes back as vLLM gives it.
            let message = error.strip_prefix("TemplateError: ");
            let said = answer["error"]["message"].as_str().unwrap_or_default();
            if status != 400 || message.is_some_and(|m| !said.contains(m)) {
                failures.push(format!(
                    "{name}: transformers refuses this request ({error}); ferry must answer 400{}, \
                     it answered {status}: {answer}",
                    message.map(|m| format!(" saying {m:?}")).unwrap_or_default()
                ));
            }
            continue;
        }
        let expected = ids(&case["ids"]);
        match ferry.tokenize_chat(request, &template).await {
            Err(e) => failures.push(format!("{name}: {e}")),
            Ok(got) => {
                if let Some(at) = first_difference(&expected, &got) {
                    let shown = ferry.show_difference(&expected, &got, at).await;
                    failures.push(format!("{name}: {shown}"));
                }
            }
        }
    }
}

/// Every turn: ferry's ids for turn n's prompt, the model's output and turn n+1's prompt equal
/// the goldens', and ferry's own ids give the golden's answer to "does turn n+1's prompt start
/// with turn n's prompt and output ids, and where does it first differ".
async fn every_turn(ferry: &Ferry, golden: &Value, failures: &mut Vec<String>) {
    for turn in golden["turns"].as_array().unwrap() {
        let name = format!("turns/{}", text(turn, "name"));
        let template = fixture(text(turn, "template"));
        let prompt = ferry
            .tokenize_chat(text(turn, "turn_json"), &template)
            .await;
        let output = ferry.tokenize_text(text(turn, "output_text")).await;
        let next = ferry
            .tokenize_chat(text(turn, "next_turn_json"), &template)
            .await;
        let (prompt, output, next) = match (prompt, output, next) {
            (Ok(p), Ok(o), Ok(n)) => (p, o, n),
            (p, o, n) => {
                for e in [p.err(), o.err(), n.err()].into_iter().flatten() {
                    failures.push(format!("{name}: {e}"));
                }
                continue;
            }
        };
        for (what, key, got) in [
            ("turn n's prompt", "prompt_ids", &prompt),
            ("the model's output", "output_ids", &output),
            ("turn n+1's prompt", "next_ids", &next),
        ] {
            let expected = ids(&turn[key]);
            if let Some(at) = first_difference(&expected, got) {
                let shown = ferry.show_difference(&expected, got, at).await;
                failures.push(format!("{name}, {what}: {shown}"));
            }
        }
        let joined = [prompt, output].concat();
        let answer = first_difference(&joined, &next[..next.len().min(joined.len())]);
        let expected = turn["ids_first_difference"].as_u64().map(|i| i as usize);
        if answer != expected {
            failures.push(format!(
                "{name}: transformers' turn n+1 prompt {} turn n's prompt + output ids (first \
                 difference {expected:?}); ferry's {} (first difference {answer:?})",
                if expected.is_none() {
                    "extends"
                } else {
                    "does not extend"
                },
                if answer.is_none() { "does" } else { "does not" },
            ));
        }
    }
}
