//! Sends one streaming `/v1/completions` request and times its chunks as they arrive.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::sse::{NotUtf8, SseReader};
use super::workload::RequestSpec;

/// Why a request did not complete. Every failed request is reported with one of these.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("HTTP: {0}")]
    Http(#[from] reqwest::Error),
    #[error("HTTP status {status}: {message}")]
    Status { status: u16, message: String },
    #[error(transparent)]
    Sse(#[from] NotUtf8),
    #[error("stream chunk is not JSON ({source}): {data}")]
    BadChunk {
        data: String,
        source: serde_json::Error,
    },
    #[error("server sent an error in the stream: {0}")]
    InStream(String),
    #[error("stream ended without data: [DONE]")]
    NoDone,
    #[error("stream finished without any token")]
    NoTokens,
}

/// Timings of a completed request, in seconds from when it was sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Gaps between consecutive token-carrying chunks.
    pub itl_s: Vec<f64>,
    /// `usage.completion_tokens` when the server sent usage, else token-carrying chunks.
    pub n_output_tokens: u32,
    /// `usage.prompt_tokens`, when the server sent usage.
    pub n_prompt_tokens: Option<u32>,
}

/// The body of a benchmark request: greedy, exactly `output_len` tokens, streamed with usage;
/// with the run's variant (a JSON-schema constraint, a cache salt) when it has one.
pub fn request_body(model: &str, spec: &RequestSpec, variant: &Variant) -> Value {
    let mut body = json!({
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "ignore_eos": true,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(schema) = &variant.json_schema {
        body["structured_outputs"] = json!({ "json": schema });
    }
    if let Some(salt) = &variant.cache_salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

/// What one run of the workload adds to every request.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    /// vLLM's `structured_outputs.json`.
    pub json_schema: Option<Value>,
    /// Keeps this run's prefix-cache entries apart from another run's on the same server.
    pub cache_salt: Option<String>,
}

/// Sends `body` to `url` and reads the whole stream.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<Timing, RequestError> {
    let start = Instant::now();
    let mut response = client.post(url).json(body).send().await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(RequestError::Status {
            status: status.as_u16(),
            message: error_message(&text),
        });
    }
    let mut stream = StreamState::default();
    let mut sse = SseReader::default();
    while let Some(bytes) = response.chunk().await? {
        // Every event in this read arrived now: that is what a client observes.
        let at = start.elapsed();
        for data in sse.feed(&bytes)? {
            if stream.on_event(&data, at)? {
                return stream.finish(start.elapsed());
            }
        }
    }
    Err(RequestError::NoDone)
}

/// The OpenAI error body's `error.message`, else the body itself (cut short).
fn error_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    match parsed.as_ref().and_then(|v| v["error"]["message"].as_str()) {
        Some(m) => m.to_owned(),
        None => body.chars().take(300).collect(),
    }
}

/// What has been seen of one stream so far.
#[derive(Debug, Default)]
struct StreamState {
    token_times: Vec<Duration>,
    usage: Option<(u32, u32)>,
}

impl StreamState {
    /// Handles one event's data; true at `[DONE]`.
    fn on_event(&mut self, data: &str, at: Duration) -> Result<bool, RequestError> {
        if data.trim() == "[DONE]" {
            return Ok(true);
        }
        let chunk: Value = serde_json::from_str(data).map_err(|source| RequestError::BadChunk {
            data: data.chars().take(300).collect(),
            source,
        })?;
        if let Some(err) = chunk.get("error") {
            let message = err["message"]
                .as_str()
                .map_or_else(|| err.to_string(), str::to_owned);
            return Err(RequestError::InStream(message));
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            let field = |name: &str| usage[name].as_u64().map(|n| n as u32);
            if let (Some(prompt), Some(completion)) =
                (field("prompt_tokens"), field("completion_tokens"))
            {
                self.usage = Some((prompt, completion));
            }
        }
        if carries_token(&chunk) {
            self.token_times.push(at);
        }
        Ok(false)
    }

    fn finish(self, e2e: Duration) -> Result<Timing, RequestError> {
        let first = *self.token_times.first().ok_or(RequestError::NoTokens)?;
        let itl_s = self
            .token_times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect();
        let n_chunks = self.token_times.len() as u32;
        Ok(Timing {
            ttft_s: first.as_secs_f64(),
            e2e_s: e2e.as_secs_f64(),
            itl_s,
            n_output_tokens: self.usage.map_or(n_chunks, |(_, c)| c),
            n_prompt_tokens: self.usage.map(|(p, _)| p),
        })
    }
}

/// A chunk carries a token when it has a choice with text, or a choice that is not the
/// closing one (a token whose text the detokenizer holds back still arrives as an empty
/// delta). The usage chunk has no choices.
fn carries_token(chunk: &Value) -> bool {
    let Some(choices) = chunk["choices"].as_array() else {
        return false;
    };
    choices.iter().any(|c| {
        let has_text = c["text"].as_str().is_some_and(|t| !t.is_empty());
        let has_ids = c["token_ids"].as_array().is_some_and(|t| !t.is_empty());
        has_text || has_ids || c["finish_reason"].is_null()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn timing_comes_from_token_chunks_and_counts_from_usage() {
        let mut s = StreamState::default();
        let events = [
            (
                r#"{"choices":[{"index":0,"text":"a","finish_reason":null}]}"#,
                10,
            ),
            (
                r#"{"choices":[{"index":0,"text":"","finish_reason":null}]}"#,
                15,
            ),
            (
                r#"{"choices":[{"index":0,"text":"b","finish_reason":"length"}]}"#,
                30,
            ),
            (
                r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#,
                31,
            ),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}"#,
                32,
            ),
        ];
        for (data, t) in events {
            assert!(!s.on_event(data, ms(t)).unwrap());
        }
        assert!(s.on_event("[DONE]", ms(33)).unwrap());
        let t = s.finish(ms(40)).unwrap();
        assert_eq!(t.ttft_s, 0.010);
        assert_eq!(t.itl_s, [0.005, 0.015]);
        assert_eq!((t.n_output_tokens, t.n_prompt_tokens), (3, Some(4)));
        assert_eq!(t.e2e_s, 0.040);
    }

    #[test]
    fn without_usage_chunks_are_counted() {
        let mut s = StreamState::default();
        s.on_event(r#"{"choices":[{"text":"a","finish_reason":null}]}"#, ms(1))
            .unwrap();
        s.on_event(r#"{"choices":[{"text":"b","finish_reason":null}]}"#, ms(2))
            .unwrap();
        let t = s.finish(ms(3)).unwrap();
        assert_eq!((t.n_output_tokens, t.n_prompt_tokens), (2, None));
    }

    #[test]
    fn stream_errors_are_reported() {
        let mut s = StreamState::default();
        let err = s
            .on_event(r#"{"error":{"message":"engine died","code":500}}"#, ms(1))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "server sent an error in the stream: engine died"
        );
        assert!(matches!(
            s.on_event("{not json", ms(1)),
            Err(RequestError::BadChunk { .. })
        ));
        assert!(matches!(
            StreamState::default().finish(ms(1)),
            Err(RequestError::NoTokens)
        ));
    }

    #[test]
    fn error_message_prefers_the_openai_field() {
        assert_eq!(
            error_message(r#"{"error":{"message":"max_tokens: must be positive","type":"x"}}"#),
            "max_tokens: must be positive"
        );
        assert_eq!(error_message("plain"), "plain");
    }
}
