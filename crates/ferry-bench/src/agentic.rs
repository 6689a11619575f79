//! `ferry bench agentic`: a multi-turn tool-use workload through `ferry proxy`, under
//! round-robin, under `--routing kv`, and with the session header and no KV events, in one
//! invocation (JSON with `--json`).
//!
//! `--sessions` conversations of `--turns` turns each. Turn 1 is a system prompt shared by
//! every session (an agent's instructions) and a task of the session's own; each later turn
//! appends the assistant message with the model's actual answer to the turn before and a
//! `tool` message with about `--tool-tokens` tokens of pseudo-tool output (deterministic,
//! different per session and turn), and asks again. Every request carries
//! `chat_template_kwargs: {"enable_thinking": false}` (no reasoning) and, with
//! [`SEND_TOOLS`], two function tools with `tool_choice: "none"` (rendered by the template
//! into the prompt; no tool parser involved). Answers are greedy, `--max-tokens` long, and
//! streamed: TTFT is the time to the first chunk that carries a token (after the role delta).
//! Sessions are interleaved: each round sends every session's next turn, in an order shuffled
//! with a fixed seed, `--concurrency` at a time; a round starts when the one before is done.
//!
//! Each configuration runs on a fresh fleet: `--instances` `ferry serve` processes, each pinned
//! to one core, with the tools-capable chat template (`--chat-template`, by default Qwen3's,
//! committed under crates/ferry/tests/fixtures/chat_templates: ChatML, the same
//! `<|im_start|>`/`<|im_end|>` tokens as the default model's own) and KV for about half of
//! all sessions' context (computed from the prompts' lengths: together the instances hold all
//! of it, one alone does not), behind `ferry proxy`:
//!
//! * `round-robin`: `--routing round-robin`, no session header;
//! * `kv`: `--routing kv`, every instance publishing KV events (as `ferry bench route`);
//! * `sessions`: `X-Session-ID: <session>` on every request, no KV events, the proxy's
//!   default routing.
//!
//! Per configuration and turn: the mean fraction of the prompt found cached (`cached_tokens`
//! over `prompt_tokens`), of the earlier context (`cached_tokens` over the previous turn's
//! prompt and output: what the conversation so far holds), and of what the previous turn's
//! tokens share with this prompt (`return_token_ids`: the template renders a past assistant
//! message otherwise than the generation prompt it answered); TTFT p50/p90 on turns 2 and
//! later; totals; and the requests each instance served.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};

use crate::child::{start, strings, Proc};
use crate::route::{metric, percentile, BLOCK_SIZE, EVENTS};
use crate::serve::sse::SseReader;

/// Whether requests carry `tools` (two function tools) with `tool_choice: "none"`: the
/// template renders them into the system turn, so every prompt grows by that much. (Off, the
/// workload runs on a server without chat tools, which answers `tools` with a 400.)
pub const SEND_TOOLS: bool = true;

/// The committed tools-capable template (Qwen3-0.6B's, as its repository publishes it).
const QWEN3_TEMPLATE: &str =
    include_str!("../../ferry/tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja");

/// What turn 1 of every session starts with: an agent's instructions.
const SYSTEM_PROMPT: &str = "You are a software engineering agent working in a Rust \
repository on behalf of a developer. You solve one task at a time. Before you change any \
code, read the files involved and run the failing test to see its output; never guess the \
contents of a file you have not read. Prefer the smallest change that fixes the cause of a \
failure over one that hides its symptom, and keep the existing style of the code: its \
naming, its error handling, and its comments. When a test fails, read its assertion and the \
code it exercises, form a hypothesis, and check it with one more command before you edit. \
Do not change tests to make them pass unless the test itself is wrong, and say so when it \
is. Do not add dependencies. Keep every command you run short and bounded in time; a \
command that has not finished after ten minutes is stopped. When you are done, run the \
whole test suite of the crate you changed, then reply with a short summary: what was wrong, \
what you changed, and how you checked it. If the task cannot be done, say what blocks it \
and what you would need to go on. Answer in plain text; use code blocks only for code.";

const MODULES: &[&str] = &[
    "scheduler",
    "tokenizer",
    "sampler",
    "kv_cache",
    "router",
    "loader",
    "server",
    "metrics",
    "planner",
    "arena",
    "detokenizer",
    "grammar",
];

const WORDS: &[&str] = &[
    "value", "buffer", "index", "request", "token", "cache", "block", "error", "length", "offset",
    "result", "handle", "config", "stream", "parser", "queue", "worker", "state", "limit", "batch",
    "engine", "model", "layer", "weight", "shape", "slice", "table", "entry", "prefix", "session",
    "window", "budget", "count", "chunk", "step", "output", "input", "event", "reply", "name",
    "field", "range", "position", "capacity", "timeout", "version", "sender", "receiver", "lock",
    "guard", "pool", "page", "hash", "key", "list", "map", "order", "schedule", "plan", "phase",
    "score", "status", "target", "source",
];

/// A fixed-seed xorshift generator: every configuration gets the same workload.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick(&mut self, from: &[&'static str]) -> &'static str {
        from[self.below(from.len())]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Config {
    /// `ferry proxy --routing round-robin`, no session header.
    RoundRobin,
    /// `ferry proxy --routing kv`, the instances publishing KV events.
    Kv,
    /// `X-Session-ID` on every request, no KV events, the proxy's default routing.
    Sessions,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::RoundRobin => "round-robin",
            Config::Kv => "kv",
            Config::Sessions => "sessions",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model each instance serves (as `ferry serve --model`; default: the default model).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 2)]
    instances: usize,
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Tokens of each tool result (about: the pseudo-tool output is made of lines, their
    /// number set from their length in the model's tokenizer).
    #[arg(long, default_value_t = 200)]
    tool_tokens: usize,
    /// Tokens each answer is generated with (greedy); the answer is the next turn's
    /// assistant message.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// KV blocks per instance. Default: half of all sessions' context at their last turn (the
    /// shared system prompt once), plus room for the requests in flight.
    #[arg(long)]
    num_kv_blocks: Option<u32>,
    /// The chat template every instance serves with (a Jinja file). Default: Qwen3's,
    /// committed as crates/ferry/tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// The configurations, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,kv,sessions"
    )]
    configs: Vec<Config>,
    /// Do not pin each instance to a core.
    #[arg(long)]
    no_pin: bool,
    #[arg(long)]
    json: bool,
}

/// The two function tools every request carries with [`SEND_TOOLS`].
fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "read_file",
            "description": "Read lines of a file in the repository.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "Path from the repository root."},
                "start_line": {"type": "integer", "description": "First line, from 1."},
                "end_line": {"type": "integer", "description": "Last line, included."}
            }, "required": ["path"]}
        }},
        {"type": "function", "function": {
            "name": "run_command",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string", "description": "The command line."},
                "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 600,
                                    "description": "Seconds before it is stopped."}
            }, "required": ["command"]}
        }}
    ])
}

/// Session `s`'s task (turn 1's user message).
fn user_task(s: usize) -> String {
    let mut r = Rng::new(1000 + s as u64);
    let m = r.pick(MODULES);
    let (a, b, c, d, e) = (
        r.pick(WORDS),
        r.pick(WORDS),
        r.pick(WORDS),
        r.pick(WORDS),
        r.pick(WORDS),
    );
    format!(
        "Task {s}: the test `{m}::tests::{a}_{b}` fails since the last change to \
         `src/{m}.rs`: it expects the {c} to keep its {d} after a {e}. Find the cause with \
         the tools, fix it with the smallest change, and run the tests again."
    )
}

/// One line of pseudo-tool output (a test run, a compiler message, a line of code).
fn tool_line(r: &mut Rng, m: &str) -> String {
    let (a, b, c, d) = (r.pick(WORDS), r.pick(WORDS), r.pick(WORDS), r.pick(WORDS));
    match r.below(5) {
        0 => format!("test {m}::tests::{a}_{b} ... ok"),
        1 => format!("test {m}::tests::{a}_{b}_{c} ... FAILED"),
        2 => format!("warning: unused variable `{a}_{b}` in src/{m}/{c}.rs"),
        3 => format!("    let {a} = self.{b}.{c}(&{d});"),
        _ => format!("  = note: the {a} of the {b} was {c} before the {d} changed"),
    }
}

/// The tool result session `s` gets after turn `turn`: `lines` lines after a command line.
fn tool_result(s: usize, turn: usize, lines: usize) -> String {
    let mut r = Rng::new(((s as u64) << 16) + turn as u64 + 7);
    let m = r.pick(MODULES);
    let mut out = format!("$ cargo test -p {m} -- {}", r.pick(WORDS));
    for _ in 0..lines {
        out.push('\n');
        out.push_str(&tool_line(&mut r, m));
    }
    out
}

/// The workload's text: each session's task and tool results.
struct Workload {
    sessions: usize,
    /// Lines per tool result.
    lines: usize,
    /// The order of each round's sessions.
    orders: Vec<Vec<usize>>,
}

impl Workload {
    fn new(args: &Args, lines: usize) -> Self {
        let mut r = Rng::new(42);
        let orders = (0..args.turns)
            .map(|_| {
                let mut order: Vec<usize> = (0..args.sessions).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, r.below(i + 1));
                }
                order
            })
            .collect();
        Self {
            sessions: args.sessions,
            lines,
            orders,
        }
    }

    /// Session `s`'s messages for turn `turn` (from 1), given its answers so far.
    fn messages(&self, s: usize, answers: &[String]) -> Vec<Value> {
        let mut m = vec![
            json!({"role": "system", "content": SYSTEM_PROMPT}),
            json!({"role": "user", "content": user_task(s)}),
        ];
        for (k, answer) in answers.iter().enumerate() {
            m.push(json!({"role": "assistant", "content": answer}));
            m.push(json!({"role": "tool", "content": tool_result(s, k + 1, self.lines)}));
        }
        m
    }
}

/// A chat request's body (streamed, greedy, token ids returned, no reasoning).
fn body(model: &str, messages: Vec<Value>, max_tokens: usize) -> Value {
    let mut b = json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "return_token_ids": true,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    if SEND_TOOLS {
        b["tools"] = tools();
        b["tool_choice"] = json!("none");
    }
    b
}

/// One turn's answer.
#[derive(Debug, Clone, Default)]
struct Reply {
    ttft_s: f64,
    e2e_s: f64,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    content: String,
    /// From `return_token_ids` (absent if the server does not return them).
    prompt_ids: Option<Vec<u64>>,
    output_ids: Vec<u64>,
}

fn ids(v: &Value) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(Value::as_u64).collect()
}

/// Sends one streamed chat request and reads its answer.
async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    session: Option<&str>,
) -> anyhow::Result<Reply> {
    let start = Instant::now();
    let mut request = client.post(url).json(body);
    if let Some(s) = session {
        request = request.header("X-Session-ID", s);
    }
    let mut response = request.send().await?;
    let status = response.status();
    if !status.is_success() {
        bail!("{status}: {}", response.text().await.unwrap_or_default());
    }
    let mut sse = SseReader::default();
    let mut reply = Reply::default();
    let mut ttft = None;
    while let Some(bytes) = response.chunk().await? {
        let at = start.elapsed();
        for data in sse.feed(&bytes)? {
            if data.trim() == "[DONE]" {
                reply.ttft_s = ttft.context("the stream carried no token")?;
                reply.e2e_s = start.elapsed().as_secs_f64();
                return Ok(reply);
            }
            let chunk: Value = serde_json::from_str(&data)
                .with_context(|| format!("a stream chunk is not JSON: {data}"))?;
            if let Some(e) = chunk.get("error") {
                bail!("error in the stream: {e}");
            }
            if let Some(p) = chunk.get("prompt_token_ids").and_then(ids) {
                reply.prompt_ids = Some(p);
            }
            if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                reply.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                reply.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                reply.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
            for c in chunk["choices"].as_array().into_iter().flatten() {
                let delta = &c["delta"];
                // The role delta comes first, before any token is computed.
                if delta.get("role").is_none() && ttft.is_none() {
                    ttft = Some(at.as_secs_f64());
                }
                if let Some(t) = delta["content"].as_str() {
                    reply.content.push_str(t);
                }
                reply
                    .output_ids
                    .extend(c.get("token_ids").and_then(ids).unwrap_or_default());
            }
        }
    }
    bail!("the stream ended without data: [DONE]")
}

/// Runs the workload against `base`: round by round, `concurrency` at a time. Returns each
/// session's replies, by turn, and the wall time.
async fn drive(
    args: &Args,
    base: &str,
    work: &Workload,
    sessions_header: bool,
) -> anyhow::Result<(Vec<Vec<Reply>>, f64)> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()?;
    let model = model_id(&client, base).await?;
    let url = format!("{base}/v1/chat/completions");
    let mut replies: Vec<Vec<Reply>> = vec![Vec::new(); work.sessions];
    let started = Instant::now();
    for order in &work.orders {
        let jobs: Arc<Vec<(usize, Value)>> = Arc::new(
            order
                .iter()
                .map(|&s| {
                    let answers: Vec<String> =
                        replies[s].iter().map(|r| r.content.clone()).collect();
                    (s, body(&model, work.messages(s, &answers), args.max_tokens))
                })
                .collect(),
        );
        let next = Arc::new(AtomicUsize::new(0));
        let mut workers = Vec::new();
        for _ in 0..args.concurrency {
            let (client, url, jobs, next) = (
                client.clone(),
                url.clone(),
                Arc::clone(&jobs),
                Arc::clone(&next),
            );
            workers.push(tokio::spawn(async move {
                let mut done = Vec::new();
                loop {
                    let Some((s, body)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        return anyhow::Ok(done);
                    };
                    let key = sessions_header.then(|| format!("session-{s}"));
                    let reply = send(&client, &url, body, key.as_deref())
                        .await
                        .with_context(|| format!("session {s}"))?;
                    done.push((*s, reply));
                }
            }));
        }
        for w in workers {
            for (s, reply) in w.await?? {
                replies[s].push(reply);
            }
        }
    }
    Ok((replies, started.elapsed().as_secs_f64()))
}

async fn model_id(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    Ok(client
        .get(format!("{base}/v1/models"))
        .send()
        .await?
        .json::<Value>()
        .await?["data"][0]["id"]
        .as_str()
        .context("no model")?
        .to_owned())
}

/// `POST /tokenize` on `base`: the ids.
async fn tokenize(client: &reqwest::Client, base: &str, body: Value) -> anyhow::Result<Vec<u64>> {
    let r = client
        .post(format!("{base}/tokenize"))
        .json(&body)
        .send()
        .await?;
    let status = r.status();
    let answer: Value = r.json().await?;
    ensure!(status.is_success(), "/tokenize: {status}: {answer}");
    ids(&answer["tokens"]).context("/tokenize gave no tokens")
}

/// What the probe measured: tool-result lines, and the KV the sessions' contexts take.
#[derive(Debug)]
struct Sizing {
    lines: usize,
    /// Tokens of one tool result, on average (sessions' first ones).
    tool_tokens_mean: f64,
    /// Tokens every session's prompt starts with.
    shared_tokens: usize,
    /// Tokens of turn 1's prompt, longest.
    first_prompt_tokens: usize,
    /// Tokens of each session's whole conversation (the last turn's prompt and output).
    final_tokens: Vec<usize>,
    /// Tokens the template renders into a chat prompt that `/tokenize` leaves out (the tools).
    chat_extra_tokens: usize,
}

/// Measures the workload's lengths on one instance with the template: the pseudo-tool lines'
/// length in tokens, then every session's last prompt through `/tokenize` (the answers
/// stood in by `--max-tokens` words), and turn 1 through the chat route itself once (a
/// server whose `/tokenize` leaves out the tools counts fewer tokens than chat renders).
async fn probe(args: &Args, base: &str) -> anyhow::Result<Sizing> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()?;
    let model = model_id(&client, base).await?;
    let sample = tool_result(usize::MAX, 0, 200);
    let sample_tokens = tokenize(
        &client,
        base,
        json!({"prompt": sample, "add_special_tokens": false}),
    )
    .await?
    .len();
    let lines = ((args.tool_tokens * 200) as f64 / sample_tokens as f64).round() as usize;
    let lines = lines.max(1);
    let work = Workload::new(args, lines);
    let chat = |messages: Vec<Value>| {
        let mut b = json!({"messages": messages, "add_generation_prompt": true,
                           "chat_template_kwargs": {"enable_thinking": false}});
        if SEND_TOOLS {
            b["tools"] = tools();
        }
        b
    };
    let mut tool_tokens = 0;
    let mut firsts = Vec::new();
    let mut final_tokens = Vec::new();
    let stand_in = vec![" x".repeat(args.max_tokens); args.turns - 1];
    for s in 0..args.sessions {
        let first = tokenize(&client, base, chat(work.messages(s, &[]))).await?;
        tool_tokens += tokenize(
            &client,
            base,
            json!({"prompt": tool_result(s, 1, lines), "add_special_tokens": false}),
        )
        .await?
        .len();
        let last = tokenize(&client, base, chat(work.messages(s, &stand_in))).await?;
        final_tokens.push(last.len() + args.max_tokens);
        firsts.push(first);
    }
    let shared_tokens = firsts
        .iter()
        .skip(1)
        .map(|f| f.iter().zip(&firsts[0]).take_while(|(a, b)| a == b).count())
        .min()
        .unwrap_or(firsts[0].len());
    // The chat route's own count of turn 1, one token asked: what `/tokenize` missed.
    let mut one = body(&model, work.messages(0, &[]), 1);
    one["stream"] = json!(false);
    if let Some(o) = one.as_object_mut() {
        o.remove("stream_options");
    }
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&one)
        .send()
        .await?;
    let status = r.status();
    let answer: Value = r.json().await?;
    ensure!(
        status.is_success(),
        "turn 1 on the probe: {status}: {answer}"
    );
    let chat_prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
    let chat_extra_tokens = chat_prompt.saturating_sub(firsts[0].len());
    Ok(Sizing {
        lines,
        tool_tokens_mean: tool_tokens as f64 / args.sessions as f64,
        shared_tokens: shared_tokens + chat_extra_tokens,
        first_prompt_tokens: firsts.iter().map(Vec::len).max().unwrap_or(0) + chat_extra_tokens,
        final_tokens: final_tokens
            .into_iter()
            .map(|t| t + chat_extra_tokens)
            .collect(),
        chat_extra_tokens,
    })
}

fn serve_args(
    args: &Args,
    template: &Path,
    n_blocks: u32,
    max_len: usize,
    events: bool,
) -> Vec<String> {
    let mut a = strings(&["serve", "--port", "0", "--chat-template"]);
    a.push(template.display().to_string());
    if let Some(m) = &args.model {
        a.extend(["--model".into(), m.clone()]);
    }
    a.extend([
        "--num-kv-blocks".into(),
        n_blocks.to_string(),
        "--max-model-len".into(),
        max_len.to_string(),
    ]);
    if events {
        a.extend(["--kv-events-config".into(), EVENTS.into()]);
    }
    a
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn ms_percentiles(mut s: Vec<f64>) -> (f64, f64) {
    s.sort_by(f64::total_cmp);
    (percentile(&s, 0.5) * 1e3, percentile(&s, 0.9) * 1e3)
}

/// Tokens at the start of `a` and `b` that are the same.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The figures of one configuration's replies (by session, by turn).
fn summary(replies: &[Vec<Reply>], turns: usize, wall_s: f64) -> Value {
    let mut per_turn = Vec::new();
    let mut later_ttft = Vec::new();
    let mut later_fractions = Vec::new();
    let (mut later_cached, mut later_earlier, mut later_prompt) = (0, 0, 0);
    for t in 0..turns {
        let (mut ttft, mut of_prompt, mut of_earlier, mut shared, mut of_shared) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut prompt = 0;
        for session in replies {
            let Some(r) = session.get(t) else { continue };
            ttft.push(r.ttft_s);
            prompt += r.prompt_tokens;
            of_prompt.push(r.cached_tokens as f64 / r.prompt_tokens.max(1) as f64);
            if t == 0 {
                continue;
            }
            let prev = &session[t - 1];
            let earlier = prev.prompt_tokens + prev.completion_tokens;
            of_earlier.push(r.cached_tokens as f64 / earlier.max(1) as f64);
            later_ttft.push(r.ttft_s);
            later_cached += r.cached_tokens;
            later_earlier += earlier;
            later_prompt += r.prompt_tokens;
            if let (Some(p), Some(now)) = (&prev.prompt_ids, &r.prompt_ids) {
                let full: Vec<u64> = p.iter().chain(&prev.output_ids).copied().collect();
                let common = common_prefix(&full, now);
                shared.push(common as f64 / earlier.max(1) as f64);
                // What a cache can give: whole blocks, and never the prompt's last token.
                let cacheable = common.min(now.len().saturating_sub(1)) / BLOCK_SIZE * BLOCK_SIZE;
                of_shared.push(r.cached_tokens as f64 / cacheable.max(1) as f64);
            }
        }
        later_fractions.extend(&of_earlier);
        let (p50, p90) = ms_percentiles(ttft.clone());
        per_turn.push(json!({
            "turn": t + 1,
            "n_requests": ttft.len(),
            "prompt_tokens_mean": prompt as f64 / ttft.len().max(1) as f64,
            "cached_of_prompt": mean(&of_prompt),
            "cached_of_earlier_context": mean(&of_earlier),
            "earlier_context_in_prompt": mean(&shared),
            "cached_of_cacheable": mean(&of_shared),
            "ttft_p50_ms": p50,
            "ttft_p90_ms": p90,
        }));
    }
    let min_turn = per_turn
        .iter()
        .skip(1)
        .filter_map(|t| t["cached_of_earlier_context"].as_f64())
        .min_by(f64::total_cmp);
    let (p50, p90) = ms_percentiles(later_ttft);
    let all = replies.iter().flatten();
    let prompt: u64 = all.clone().map(|r| r.prompt_tokens).sum();
    let cached: u64 = all.clone().map(|r| r.cached_tokens).sum();
    json!({
        "turns": per_turn,
        "later_turns": {
            "ttft_p50_ms": p50,
            "ttft_p90_ms": p90,
            "cached_of_earlier_context_mean": mean(&later_fractions),
            "cached_of_earlier_context_min_turn": min_turn,
            "cached_tokens": later_cached,
            "earlier_context_tokens": later_earlier,
            "prompt_tokens": later_prompt,
        },
        "totals": {
            "n_requests": all.clone().count(),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": all.map(|r| r.completion_tokens).sum::<u64>(),
            "hit_rate": cached as f64 / prompt.max(1) as f64,
            "wall_s": wall_s,
        },
    })
}

/// The CPU's model name, from /proc/cpuinfo.
fn cpu_name() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
}

pub fn run(args: Args, ferry: &Path) -> anyhow::Result<()> {
    ensure!(
        args.instances > 0 && args.sessions > 0 && args.turns > 0 && args.max_tokens > 0,
        "nothing to run"
    );
    ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let n_cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let pin = |i: usize| (!args.no_pin).then_some(i % n_cpus);
    let committed;
    let template: &Path = match &args.chat_template {
        Some(p) => p,
        None => {
            committed = tempfile::Builder::new()
                .prefix("qwen3-")
                .suffix(".jinja")
                .tempfile()?;
            std::fs::write(committed.path(), QWEN3_TEMPLATE)?;
            committed.path()
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    // The lengths, measured on one instance with the template.
    let sizing = {
        let one = start(ferry, &probe_args(&args, template), pin(0))?;
        runtime.block_on(probe(&args, &one.url))?
    };
    let max_final = sizing.final_tokens.iter().copied().max().unwrap_or(0);
    let max_len = (max_final + 64).next_multiple_of(BLOCK_SIZE);
    let shared_blocks = sizing.shared_tokens / BLOCK_SIZE;
    let context_blocks: usize = shared_blocks
        + sizing
            .final_tokens
            .iter()
            .map(|t| (t - shared_blocks * BLOCK_SIZE).div_ceil(BLOCK_SIZE))
            .sum::<usize>();
    // Each instance holds its share of all sessions' context, as `ferry bench route` sizes
    // it, plus a whole sequence per request in flight.
    let running = (max_len / BLOCK_SIZE + 1) * args.concurrency;
    let n_blocks = args
        .num_kv_blocks
        .unwrap_or((context_blocks.div_ceil(args.instances) + running) as u32);
    let work = Workload::new(&args, sizing.lines);

    let mut configs = Vec::new();
    for &config in &args.configs {
        let events = config != Config::Sessions;
        let fleet: Vec<Proc> = (0..args.instances)
            .map(|i| {
                start(
                    ferry,
                    &serve_args(&args, template, n_blocks, max_len, events),
                    pin(i),
                )
            })
            .collect::<anyhow::Result<_>>()?;
        let mut proxy_args = strings(&["proxy", "--port", "0"]);
        match config {
            Config::RoundRobin => proxy_args.extend(strings(&["--routing", "round-robin"])),
            Config::Kv => proxy_args.extend(strings(&["--routing", "kv"])),
            Config::Sessions => {}
        }
        for i in &fleet {
            proxy_args.extend(["--instance".into(), i.url.clone()]);
        }
        let proxy = start(ferry, &proxy_args, None)?;
        let result = runtime.block_on(async {
            let client = reqwest::Client::builder().no_proxy().build()?;
            let metrics = |url: String| {
                let client = client.clone();
                async move {
                    anyhow::Ok(
                        client
                            .get(format!("{url}/metrics"))
                            .send()
                            .await?
                            .text()
                            .await?,
                    )
                }
            };
            if config == Config::Kv {
                let deadline = Instant::now() + Duration::from_secs(60);
                while metric(&metrics(proxy.url.clone()).await?, "ferry_proxy_kv_synced")
                    < args.instances as f64
                {
                    ensure!(
                        Instant::now() < deadline,
                        "the proxy never followed every instance"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let (replies, wall) =
                drive(&args, &proxy.url, &work, config == Config::Sessions).await?;
            let mut s = summary(&replies, args.turns, wall);
            s["config"] = json!(config.name());
            let mut instances = Vec::new();
            for i in &fleet {
                let m = metrics(i.url.clone()).await?;
                instances.push(json!({
                    "requests": metric(&m, "ferry_time_to_first_token_seconds_count"),
                    "prompt_tokens": metric(&m, "ferry_prompt_tokens_total"),
                }));
            }
            s["instances"] = json!(instances);
            if config == Config::Kv {
                let m = metrics(proxy.url.clone()).await?;
                s["predicted_hit_tokens"] =
                    json!(metric(&m, "ferry_proxy_kv_predicted_hit_tokens_total"));
                s["misses"] = json!(metric(&m, "ferry_proxy_kv_misses_total"));
                s["stale_routes"] = json!(metric(&m, "ferry_proxy_kv_stale_routes_total"));
            }
            anyhow::Ok(s)
        })?;
        drop((proxy, fleet));
        configs.push(result);
    }

    let find = |name: &str| configs.iter().find(|c| c["config"] == name);
    let later = |name: &str, key: &str| find(name).and_then(|c| c["later_turns"][key].as_f64());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let sessions_min = later("sessions", "cached_of_earlier_context_min_turn");
    let over_kv = ratio(
        later("sessions", "cached_tokens"),
        later("kv", "cached_tokens"),
    );
    let rr_over_sessions = ratio(
        later("round-robin", "ttft_p50_ms"),
        later("sessions", "ttft_p50_ms"),
    );
    let report = json!({
        "cpu": cpu_name(),
        "workload": {
            "instances": args.instances, "sessions": args.sessions, "turns": args.turns,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "tools": SEND_TOOLS, "tool_result_lines": sizing.lines,
            "tool_result_tokens_mean": sizing.tool_tokens_mean,
            "shared_prefix_tokens": sizing.shared_tokens,
            "first_prompt_tokens_max": sizing.first_prompt_tokens,
            "last_context_tokens_max": max_final,
            "chat_tokens_beyond_tokenize": sizing.chat_extra_tokens,
            "context_blocks_all_sessions": context_blocks,
            "kv_blocks_per_instance": n_blocks, "block_size": BLOCK_SIZE,
            "max_model_len": max_len, "pinned": !args.no_pin,
            "model": args.model.clone().unwrap_or_else(|| "default".into()),
            "chat_template": args.chat_template.as_ref().map_or_else(
                || "Qwen-Qwen3-0.6B.jinja (committed)".to_owned(),
                |p| p.display().to_string()),
            "ttft": "streamed: time to the first chunk carrying a token",
        },
        "configs": configs,
        "targets": {
            "sessions_cached_of_earlier_context_min_turn": sessions_min,
            "sessions_at_least_0_9": sessions_min.map(|m| m >= 0.9),
            "sessions_over_kv_cached_tokens": over_kv,
            "round_robin_over_sessions_ttft_p50": rr_over_sessions,
            "round_robin_over_sessions_at_least_3": rr_over_sessions.map(|r| r >= 3.0),
        },
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// `serve` with the template and the model only: the probe's instance.
fn probe_args(args: &Args, template: &Path) -> Vec<String> {
    let mut a = strings(&["serve", "--port", "0", "--chat-template"]);
    a.push(template.display().to_string());
    if let Some(m) = &args.model {
        a.extend(["--model".into(), m.clone()]);
    }
    a
}

fn print_table(report: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.3}"));
    for c in report["configs"].as_array().into_iter().flatten() {
        let l = &c["later_turns"];
        println!(
            "{:>11}: turns 2+: TTFT p50 {:>8.1} ms, p90 {:>8.1} ms, earlier context cached {} \
             (lowest turn {}); all turns: hit rate {}, wall {:.0} s",
            c["config"].as_str().unwrap_or(""),
            l["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            l["ttft_p90_ms"].as_f64().unwrap_or(0.0),
            f(&l["cached_of_earlier_context_mean"]),
            f(&l["cached_of_earlier_context_min_turn"]),
            f(&c["totals"]["hit_rate"]),
            c["totals"]["wall_s"].as_f64().unwrap_or(0.0),
        );
        for t in c["turns"].as_array().into_iter().flatten() {
            println!(
                "             turn {}: prompt {:>6.0}, cached of prompt {}, of earlier \
                 context {}, of cacheable {}, TTFT p50 {:>7.1} ms",
                t["turn"],
                t["prompt_tokens_mean"].as_f64().unwrap_or(0.0),
                f(&t["cached_of_prompt"]),
                f(&t["cached_of_earlier_context"]),
                f(&t["cached_of_cacheable"]),
                t["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            );
        }
    }
    let t = &report["targets"];
    println!(
        "sessions: lowest turn's earlier context cached {} (target 0.9), cached tokens over \
         kv's {}, round-robin's TTFT p50 over theirs {} (target 3)",
        f(&t["sessions_cached_of_earlier_context_min_turn"]),
        f(&t["sessions_over_kv_cached_tokens"]),
        f(&t["round_robin_over_sessions_ttft_p50"]),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(prompt: Vec<u64>, output: Vec<u64>, cached: u64, ttft_s: f64) -> Reply {
        Reply {
            ttft_s,
            e2e_s: ttft_s,
            prompt_tokens: prompt.len() as u64,
            completion_tokens: output.len() as u64,
            cached_tokens: cached,
            content: String::new(),
            prompt_ids: Some(prompt),
            output_ids: output,
        }
    }

    #[test]
    fn later_turns_are_measured_against_the_turn_before() {
        // Turn 1: 40 prompt tokens and 8 out; turn 2 keeps 38 of them (the template drops
        // two), adds 30: 68 tokens, of which whole blocks of the 38 can be cached (32).
        let first: Vec<u64> = (0..40).collect();
        let out: Vec<u64> = (100..108).collect();
        let second: Vec<u64> = (0..38).chain(200..230).collect();
        let replies = vec![vec![
            reply(first, out, 0, 0.5),
            reply(second, vec![1, 2, 3, 4], 32, 0.2),
        ]];
        let s = summary(&replies, 2, 1.0);
        let t2 = &s["turns"][1];
        assert_eq!(t2["cached_of_earlier_context"].as_f64(), Some(32.0 / 48.0));
        assert_eq!(t2["earlier_context_in_prompt"].as_f64(), Some(38.0 / 48.0));
        assert_eq!(t2["cached_of_cacheable"].as_f64(), Some(1.0));
        assert_eq!(t2["cached_of_prompt"].as_f64(), Some(32.0 / 68.0));
        assert!(s["turns"][0]["cached_of_earlier_context"].is_null());
        assert_eq!(s["later_turns"]["ttft_p50_ms"].as_f64(), Some(200.0));
        assert_eq!(s["later_turns"]["earlier_context_tokens"], 48);
        assert_eq!(s["totals"]["cached_tokens"], 32);
    }

    #[test]
    fn the_workload_is_fixed_and_each_tool_result_its_own() {
        let args = <Args as clap::Args>::augment_args(clap::Command::new("agentic"))
            .try_get_matches_from(["agentic"])
            .and_then(|m| <Args as clap::FromArgMatches>::from_arg_matches(&m))
            .unwrap();
        let (a, b) = (Workload::new(&args, 14), Workload::new(&args, 14));
        assert_eq!(a.orders, b.orders);
        assert_eq!(a.orders.len(), 6);
        for order in &a.orders {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..16).collect::<Vec<_>>());
        }
        assert_ne!(a.orders[0], a.orders[1]);
        assert_ne!(tool_result(0, 1, 14), tool_result(1, 1, 14));
        assert_ne!(tool_result(0, 1, 14), tool_result(0, 2, 14));
        assert_eq!(tool_result(3, 2, 14).lines().count(), 15);
        let m = a.messages(2, &["one".into(), "two".into()]);
        let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "assistant", "tool"]
        );
        assert_eq!(m[4]["content"], "two");
    }
}
