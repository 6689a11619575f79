//! Server-sent events for streaming routes: merges the choices' engine streams (in arrival
//! order), lets a route-specific [`ChunkFormatter`] turn each engine chunk into JSON events,
//! and closes with `data: [DONE]`.
//!
//! The response body owns the engine streams: when the client disconnects, hyper drops the
//! body, which drops every `GenerateStream` and so aborts the requests.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use ferry_engine::OutputChunk;
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use serde::Serialize;

/// Turns engine output into the route's chunk JSON.
pub trait ChunkFormatter: Send + 'static {
    /// Events sent before any engine output (chat's role deltas).
    fn start(&mut self) -> Vec<String>;
    /// Events for one engine chunk of choice `index`.
    fn chunk(&mut self, index: usize, chunk: OutputChunk) -> Vec<String>;
    /// Events after every choice finished (the usage chunk).
    fn end(&mut self) -> Vec<String>;
}

struct State<F> {
    merged: SelectAll<BoxStream<'static, (usize, OutputChunk)>>,
    formatter: F,
    pending: VecDeque<String>,
    done: bool,
}

/// The SSE response for `choices`: each choice's engine output as `(choice index, chunk)`.
pub fn sse_response<F: ChunkFormatter>(
    choices: impl IntoIterator<Item = BoxStream<'static, (usize, OutputChunk)>>,
    mut formatter: F,
) -> Response {
    let merged = stream::select_all(choices);
    let pending = formatter.start().into();
    let state = State {
        merged,
        formatter,
        pending,
        done: false,
    };
    let events = stream::unfold(state, |mut s| async move {
        loop {
            if let Some(data) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(Event::default().data(data)), s));
            }
            if s.done {
                return None;
            }
            match s.merged.next().await {
                Some((index, chunk)) => {
                    let events = s.formatter.chunk(index, chunk);
                    s.pending.extend(events);
                }
                None => {
                    let events = s.formatter.end();
                    s.pending.extend(events);
                    s.pending.push_back("[DONE]".to_owned());
                    s.done = true;
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE).text("keep-alive"))
        .into_response()
}

/// A stream that sent nothing for this long sends an SSE comment (`: keep-alive`), which
/// clients skip: a request queued, paused or computing a long prompt still shows a live
/// connection, so a proxy (`ferry proxy --stream-idle-timeout-seconds`) or a client can tell
/// it from a link that went silent.
pub const SSE_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// JSON text of a response chunk. Our response types always serialize; should one ever fail,
/// the client gets an error event rather than a silently missing chunk.
pub fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| {
        serde_json::json!({"error": {"message": format!("could not serialize a chunk: {e}"),
            "type": "internal_server_error", "param": null, "code": 500}})
        .to_string()
    })
}
