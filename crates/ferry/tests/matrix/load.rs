//! The load a matrix case runs under: greedy streaming completions through the proxy, the
//! reference they are held to (one plain `ferry serve` per model, computed once per test
//! process), and the judgement of each request's end.
//!
//! Every request asks for `return_token_ids`, so equality is checked on token ids, not text
//! (two token sequences can decode to the same text). A request that was aborted must still
//! have streamed a prefix of the reference: an abort may cut output short, never change it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;

use crate::fleet::{Model, Setup};
use crate::procs::{self, client, post};

/// The prompts every case draws from (varied lengths, so requests reach D's queue at
/// different moments and hold different numbers of blocks), with their output lengths.
struct PromptSet {
    prompts: Vec<String>,
    max_tokens: Vec<usize>,
}

fn prompt_set(model: &Model) -> PromptSet {
    let base = "The ferry crossed the wide river at dawn, carrying twelve cars, a bicycle and a \
                dog that barked at every gull it saw.";
    let prompts: Vec<String> = (0..8)
        .map(|i| {
            let repeat = match model {
                // Tiny is fast: long prompts and outputs keep requests in flight for the
                // length of an operation (about a second for the whole wave).
                Model::Tiny | Model::Moe => 1 + i % 4,
                Model::Default(_) => 1,
            };
            format!("Story {i}. {}", base.repeat(repeat))
        })
        .collect();
    let max_tokens = (0..8)
        .map(|i| match model {
            Model::Tiny | Model::Moe => 560 + 40 * i,
            Model::Default(_) => 12 + 2 * i,
        })
        .collect();
    PromptSet {
        prompts,
        max_tokens,
    }
}

/// The reference: each prompt's greedy tokens from one plain engine.
#[derive(Debug)]
pub struct Reference {
    pub prompts: Vec<String>,
    pub max_tokens: Vec<usize>,
    pub tokens: Vec<Vec<u32>>,
}

static TINY_REFERENCE: OnceCell<Arc<Reference>> = OnceCell::const_new();
static DEFAULT_REFERENCE: OnceCell<Arc<Reference>> = OnceCell::const_new();
static MOE_REFERENCE: OnceCell<Arc<Reference>> = OnceCell::const_new();

/// The model's reference, computed by the first test that asks (a plain `ferry serve`
/// started for it and stopped after).
pub async fn reference(setup: &Setup) -> Arc<Reference> {
    let cell = match setup.model {
        Model::Tiny => &TINY_REFERENCE,
        Model::Default(_) => &DEFAULT_REFERENCE,
        Model::Moe => &MOE_REFERENCE,
    };
    Arc::clone(
        cell.get_or_init(|| async {
            let set = prompt_set(&setup.model);
            let single = procs::spawn(&setup.serve_args(None), &[]).ready();
            let tasks: Vec<_> = set
                .prompts
                .iter()
                .zip(&set.max_tokens)
                .map(|(prompt, &max_tokens)| {
                    let mut body = request_body(setup, prompt, max_tokens, None);
                    body["stream"] = json!(false);
                    body.as_object_mut().unwrap().remove("stream_options");
                    let target = format!("{}/v1/completions", single.url);
                    tokio::spawn(async move { post(&target, &body).await })
                })
                .collect();
            let mut tokens = Vec::new();
            for task in tasks {
                let (status, out) = task.await.unwrap();
                assert_eq!(status, 200, "reference: {out}");
                tokens.push(token_ids(&out["choices"][0]["token_ids"]));
            }
            Arc::new(Reference {
                prompts: set.prompts,
                max_tokens: set.max_tokens,
                tokens,
            })
        })
        .await,
    )
}

fn token_ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_u64())
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// A streaming greedy completion of `prompt`.
pub fn request_body(setup: &Setup, prompt: &str, max_tokens: usize, salt: Option<&str>) -> Value {
    let mut body = json!({"model": setup.model.served_name(), "prompt": prompt,
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true,
        "return_token_ids": true, "stream_options": {"include_usage": true}});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

/// What one streaming request saw.
#[derive(Clone)]
pub struct Outcome {
    pub prompt_idx: usize,
    pub id: String,
    pub status: u16,
    pub tokens: Vec<u32>,
    pub finish: Option<String>,
    pub error: Option<String>,
    pub done: bool,
    /// The client went away on purpose after this many events.
    pub disconnected: bool,
}

/// Short: the tokens' count and first few, not all of them.
impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (prompt {}): HTTP {}, {} tokens {:?}.., finish {:?}, [DONE] {}, error {:?}{}",
            self.id,
            self.prompt_idx,
            self.status,
            self.tokens.len(),
            &self.tokens[..self.tokens.len().min(6)],
            self.finish,
            self.done,
            self.error,
            if self.disconnected { ", left" } else { "" }
        )
    }
}

/// How a request ended, once judged against the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Every token, equal to the reference.
    Finished,
    /// `finish_reason: abort` with a prefix of the reference.
    Aborted,
    /// An HTTP error or an error event: a clear error, never wrong tokens.
    Failed,
    /// The client left on purpose (what it got is a prefix of the reference).
    Disconnected,
}

impl Outcome {
    /// Judges the outcome; `Err` for anything no operation may do to a request: wrong or
    /// missing tokens, a stream that ended without a finish reason or `[DONE]`.
    pub fn judge(&self, reference: &Reference) -> Result<End, String> {
        let want = &reference.tokens[self.prompt_idx];
        let who = format!("request {} (prompt {})", self.id, self.prompt_idx);
        let is_prefix = self.tokens.len() <= want.len() && want[..self.tokens.len()] == self.tokens;
        if self.disconnected {
            return if is_prefix {
                Ok(End::Disconnected)
            } else {
                Err(format!(
                    "{who}: streamed tokens that are not the reference's"
                ))
            };
        }
        if self.status != 200 || self.error.is_some() {
            return if is_prefix {
                Ok(End::Failed)
            } else {
                Err(format!(
                    "{who}: failed after tokens that are not the reference's"
                ))
            };
        }
        if !self.done {
            return Err(format!(
                "{who}: the stream ended without [DONE] after {} tokens (finish {:?})",
                self.tokens.len(),
                self.finish
            ));
        }
        match self.finish.as_deref() {
            Some("length") if self.tokens == *want => Ok(End::Finished),
            Some("length") => Err(format!(
                "{who}: {} tokens differ from the reference's {} (first difference at {:?})",
                self.tokens.len(),
                want.len(),
                self.tokens.iter().zip(want).position(|(a, b)| a != b)
            )),
            Some("abort") if is_prefix => Ok(End::Aborted),
            Some("abort") => Err(format!("{who}: aborted after tokens not the reference's")),
            other => Err(format!("{who}: finish reason {other:?}")),
        }
    }
}

/// Requests in flight.
#[derive(Debug, Default)]
pub struct Load {
    tasks: Vec<Task>,
}

#[derive(Debug)]
struct Task {
    prompt_idx: usize,
    id: String,
    handle: JoinHandle<Outcome>,
}

/// How a request of a load is sent.
#[derive(Debug, Clone)]
pub struct Send {
    pub url: String,
    pub prompt_idx: usize,
    pub body: Value,
    pub id: String,
    /// Leave after this many events.
    pub disconnect_after: Option<usize>,
}

impl Load {
    pub fn push(&mut self, send: Send) {
        self.push_task(send, None);
    }

    /// A request whose client leaves `after` sending, whatever it got by then (for a
    /// short `after`: while P computes the prompt or D loads it).
    pub fn push_abandoned(&mut self, send: Send, after: Duration) {
        self.push_task(send, Some(after));
    }

    fn push_task(&mut self, send: Send, abandon_after: Option<Duration>) {
        let (prompt_idx, id) = (send.prompt_idx, send.id.clone());
        let handle = tokio::spawn(async move {
            let Some(after) = abandon_after else {
                return stream(send).await;
            };
            let left = Outcome::new(&send);
            match tokio::time::timeout(after, stream(send)).await {
                Ok(outcome) => outcome,
                Err(_) => Outcome {
                    disconnected: true,
                    ..left
                },
            }
        });
        self.tasks.push(Task {
            prompt_idx,
            id,
            handle,
        });
    }

    pub fn extend(&mut self, other: Load) {
        self.tasks.extend(other.tasks);
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// The `X-Request-Id` of the `i`-th request.
    pub fn id(&self, i: usize) -> &str {
        &self.tasks[i].id
    }

    /// How many have ended.
    pub fn n_ended(&self) -> usize {
        self.tasks.iter().filter(|t| t.handle.is_finished()).count()
    }

    /// Every client leaves now (their connections close), unjudged.
    pub fn abandon(self) {
        for t in self.tasks {
            t.handle.abort();
        }
    }

    /// Every request's outcome, all within `within` (a request still streaming then fails the
    /// case: it was lost or hung).
    pub async fn join(self, within: Duration) -> Vec<Outcome> {
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        let n = self.tasks.len();
        for t in self.tasks {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, t.handle).await {
                Ok(outcome) => out.push(outcome.expect("a request task panicked")),
                Err(_) => panic!(
                    "request {} (prompt {}) was still streaming {} s after the operation; \
                     {} of {n} had ended",
                    t.id,
                    t.prompt_idx,
                    within.as_secs(),
                    out.len()
                ),
            }
        }
        out
    }
}

impl Outcome {
    fn new(send: &Send) -> Outcome {
        Outcome {
            prompt_idx: send.prompt_idx,
            id: send.id.clone(),
            status: 0,
            tokens: Vec::new(),
            finish: None,
            error: None,
            done: false,
            disconnected: false,
        }
    }
}

/// Sends one streaming request and reads its events as they come.
async fn stream(send: Send) -> Outcome {
    let mut outcome = Outcome::new(&send);
    let response = client()
        .post(&send.url)
        .header("X-Request-Id", &send.id)
        .json(&send.body)
        .send()
        .await;
    let mut response = match response {
        Ok(r) => r,
        Err(e) => {
            outcome.error = Some(format!("sending: {e}"));
            return outcome;
        }
    };
    outcome.status = response.status().as_u16();
    if outcome.status != 200 {
        outcome.error = Some(response.text().await.unwrap_or_default());
        return outcome;
    }
    let mut buffer = String::new();
    let mut n_events = 0;
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                outcome.error = Some(format!("reading the stream: {e}"));
                break;
            }
        };
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find('\n') {
            let line: String = buffer.drain(..=end).collect();
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                outcome.done = true;
                continue;
            }
            n_events += 1;
            read_event(data, &mut outcome);
        }
        if send.disconnect_after.is_some_and(|n| n_events >= n) {
            // Dropping the response closes the connection mid-stream.
            outcome.disconnected = true;
            return outcome;
        }
    }
    outcome
}

fn read_event(data: &str, outcome: &mut Outcome) {
    let event: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => {
            outcome.error = Some(format!("an event that is not JSON ({e}): {data}"));
            return;
        }
    };
    if event.get("error").is_some() {
        outcome.error = Some(event.to_string());
        return;
    }
    let choice = &event["choices"][0];
    outcome.tokens.extend(token_ids(&choice["token_ids"]));
    if let Some(reason) = choice["finish_reason"].as_str() {
        outcome.finish = Some(reason.to_owned());
    }
}

/// Counts of ends, for the summary.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Counts {
    pub n_requests: usize,
    pub n_finished: usize,
    pub n_aborted: usize,
    pub n_failed: usize,
    pub n_disconnected: usize,
}

impl Counts {
    pub fn add(&mut self, end: End) {
        self.n_requests += 1;
        match end {
            End::Finished => self.n_finished += 1,
            End::Aborted => self.n_aborted += 1,
            End::Failed => self.n_failed += 1,
            End::Disconnected => self.n_disconnected += 1,
        }
    }
}

/// Judges every outcome; the ends by request id.
pub fn judge_all(
    outcomes: &[Outcome],
    reference: &Reference,
) -> Result<HashMap<String, End>, String> {
    let mut ends = HashMap::new();
    let mut errors = Vec::new();
    for o in outcomes {
        match o.judge(reference) {
            Ok(end) => {
                ends.insert(o.id.clone(), end);
            }
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(ends)
    } else {
        Err(errors.join("\n"))
    }
}
