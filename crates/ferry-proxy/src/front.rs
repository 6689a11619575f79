//! The proxy's front door: its HTTP/1 connections, read one request at a time, so that a
//! weight bucket's body can go from the caller's socket to every instance's without passing
//! through the proxy's memory ([`crate::splice`]).
//!
//! Why not `axum::serve`: hyper owns a connection for its whole life and hands a handler the
//! body only as bytes it has read, so a bucket through the proxy cost a copy in and one copy
//! out per instance on the proxy's core; on a machine where the client, the proxy and the
//! instances share two cores that was a third of a bucketed upload's time
//! ([docs/weight-sync.md](../../../docs/weight-sync.md)). No crate hands out the socket
//! between two requests of one connection, so this module reads each request's head itself
//! (`httparse`, the parser hyper uses) and:
//!
//! * a `POST /weight_uploads/{id}/buckets` whose body has a `Content-Length` goes to the
//!   router with an empty body and a [`SpliceSource`] (the socket and the body's bytes already
//!   read); the bucket route moves the body with `splice(2)` and `tee(2)`, and this module
//!   writes the answer;
//! * any other request goes to hyper alone: hyper serves a connection that ends where the
//!   request ends (its head and `Content-Length` body), and the next request is read here;
//! * anything this module does not frame itself (a chunked or unframed body, HTTP/1.0, an
//!   upgrade, a head that does not parse) hands the rest of the connection to hyper, as
//!   `axum::serve` would have from the start.
//!
//! A connection whose request left part of its body unread (the route answered without it)
//! is closed after the answer, as hyper does.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri, Version};
use axum::Router;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower::ServiceExt;

/// The longest request head read here; a longer one goes to hyper, which refuses it.
const MAX_HEAD_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 100;
/// The longest answer to a bucket (a JSON object naming the instances' results).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// Serves `router` on `listener` until `shutdown` resolves, then waits for open requests
/// (idle connections are closed; a request in progress is answered first).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let (stop_tx, stop) = watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => {
                    connections.spawn(connection(socket, router.clone(), stop.clone()));
                }
                // A connection that failed before it was accepted is the peer's matter;
                // anything else (too many open files) is waited out, as axum does.
                Err(e) if is_connection_error(&e) => {}
                Err(e) => {
                    tracing::error!("accepting a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// How the next request on a connection is served.
#[derive(Debug)]
enum Framing {
    /// A bucket: moved with splice by its route, answered here. Boxed: a head's header map
    /// is large beside the other variants.
    Bucket(Box<Head>),
    /// Anything else this module can frame: hyper serves just this request.
    One {
        head_len: usize,
        body_len: u64,
        close: bool,
    },
    /// hyper serves the rest of the connection.
    Rest,
}

/// A bucket request's head.
#[derive(Debug)]
struct Head {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    head_len: usize,
    body_len: u64,
    close: bool,
    expect_continue: bool,
}

/// Where the head in `buf` ends (just past its blank line).
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// Whether `path` is a bucket's (`/weight_uploads/{upload_id}/buckets`, as the table of admin
/// calls declares it).
fn is_bucket_path(path: &str) -> bool {
    ferry_admin::AdminCall::find(ferry_admin::Method::Post, path)
        == Some(ferry_admin::AdminCall::UploadBucket)
}

/// Whether a comma-separated header value holds `token`.
fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// How the request whose whole head is `head` is served.
fn classify(head: &[u8], splice: bool) -> Framing {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Complete(n)) if n == head.len() => {}
        _ => return Framing::Rest,
    }
    if request.version != Some(1) {
        return Framing::Rest;
    }
    let (Some(method), Some(path)) = (request.method, request.path) else {
        return Framing::Rest;
    };
    let mut body_len: Option<u64> = None;
    let (mut close, mut expect_continue) = (false, false);
    for h in request.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let Some(n) = std::str::from_utf8(h.value)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
            else {
                return Framing::Rest;
            };
            if body_len.is_some_and(|m| m != n) {
                return Framing::Rest;
            }
            body_len = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("upgrade")
        {
            return Framing::Rest;
        } else if name.eq_ignore_ascii_case("connection") {
            if has_token(h.value, "upgrade") {
                return Framing::Rest;
            }
            close |= has_token(h.value, "close");
        } else if name.eq_ignore_ascii_case("expect") {
            if !h.value.eq_ignore_ascii_case(b"100-continue") {
                return Framing::Rest;
            }
            expect_continue = true;
        }
    }
    if method == "CONNECT" {
        return Framing::Rest;
    }
    let head_len = head.len();
    let bucket = splice
        && method == "POST"
        && is_bucket_path(path.split('?').next().unwrap_or(path))
        && body_len.is_some();
    if !bucket {
        return Framing::One {
            head_len,
            body_len: body_len.unwrap_or(0),
            close,
        };
    }
    let (Ok(uri), Ok(method)) = (path.parse::<Uri>(), Method::from_bytes(method.as_bytes())) else {
        return Framing::Rest;
    };
    let mut map = HeaderMap::with_capacity(request.headers.len());
    for h in request.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return Framing::Rest;
        };
        map.append(name, value);
    }
    Framing::Bucket(Box::new(Head {
        method,
        uri,
        headers: map,
        head_len,
        body_len: body_len.unwrap_or(0),
        close,
        expect_continue,
    }))
}

/// Reads until `buf` holds a whole request head; `None` at the end of the connection.
async fn read_head(socket: &TcpStream, buf: &mut BytesMut, splice: bool) -> Option<Framing> {
    loop {
        if let Some(end) = head_end(buf) {
            return Some(classify(&buf[..end], splice));
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Some(Framing::Rest);
        }
        buf.reserve(8 * 1024);
        if socket.readable().await.is_err() {
            return None;
        }
        match socket.try_read_buf(buf) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return None,
        }
    }
}

async fn connection(socket: TcpStream, router: Router, mut stop: watch::Receiver<bool>) {
    let socket = Arc::new(socket);
    let splice = cfg!(target_os = "linux");
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let framing = tokio::select! {
            biased;
            () = stopped(&mut stop) => return,
            f = read_head(&socket, &mut buf, splice) => f,
        };
        let Some(framing) = framing else { return };
        match framing {
            Framing::Rest => {
                let io = Io::new(&socket, buf.split().freeze(), u64::MAX);
                serve_hyper(io, &router, &mut stop, true).await;
                return;
            }
            Framing::One {
                head_len,
                body_len,
                close,
            } => {
                let (prefix, in_socket) = split_request(&mut buf, head_len, body_len);
                let mut io = Io::new(&socket, prefix, in_socket);
                let served = serve_hyper(&mut io, &router, &mut stop, false).await;
                if !served || close || !io.drained() {
                    return;
                }
            }
            Framing::Bucket(head) => {
                let (mut prefix, in_socket) = split_request(&mut buf, head.head_len, head.body_len);
                prefix.advance(head.head_len);
                let source = SpliceSource::new(
                    Arc::clone(&socket),
                    prefix,
                    in_socket,
                    head.body_len,
                    head.expect_continue,
                );
                let mut request = Request::new(Body::empty());
                *request.method_mut() = head.method;
                *request.uri_mut() = head.uri;
                *request.version_mut() = Version::HTTP_11;
                *request.headers_mut() = head.headers;
                request.extensions_mut().insert(source.clone());
                let Ok(response) = router.clone().oneshot(request).await;
                let keep = !head.close && source.complete();
                if write_answer(&socket, response, keep).await.is_err() || !keep {
                    return;
                }
            }
        }
    }
}

/// Resolves once the server is shutting down (the guard `wait_for` returns is not `Send`, so
/// it is dropped here).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The request's bytes already in `buf` (taken out of it) and how many of its body's bytes
/// are still in the socket.
fn split_request(buf: &mut BytesMut, head_len: usize, body_len: u64) -> (Bytes, u64) {
    let whole = (head_len as u64).saturating_add(body_len);
    let here = (buf.len() as u64).min(whole);
    let prefix = buf.split_to(here as usize).freeze();
    (prefix, whole - here)
}

/// hyper serves `io` (one request, or the rest of the connection); whether it ended well.
async fn serve_hyper<I>(
    io: I,
    router: &Router,
    stop: &mut watch::Receiver<bool>,
    rest: bool,
) -> bool
where
    I: AsyncRead + AsyncWrite + Unpin + Send,
{
    let router = router.clone();
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        router.clone().oneshot(request.map(Body::new))
    });
    // `half_close`: a connection cut at the request's end reads as closed by the caller, who
    // is still waiting for the answer.
    let conn = hyper::server::conn::http1::Builder::new()
        .half_close(!rest)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = stopped(stop) => {
            conn.as_mut().graceful_shutdown();
            conn.as_mut().await
        }
    };
    if let Err(e) = &result {
        tracing::debug!("serving a connection: {e}");
    }
    result.is_ok()
}

/// The socket as hyper sees it: the bytes already read, then at most `in_socket` more bytes
/// from the socket, then the end (a connection that ends where the request ends); writes go
/// to the socket. Shutting it down does nothing: the connection goes on here.
#[derive(Debug)]
struct Io<'a> {
    socket: &'a TcpStream,
    prefix: Bytes,
    in_socket: u64,
}

impl<'a> Io<'a> {
    fn new(socket: &'a TcpStream, prefix: Bytes, in_socket: u64) -> Self {
        Self {
            socket,
            prefix,
            in_socket,
        }
    }

    /// Whether hyper read the whole request.
    fn drained(&self) -> bool {
        self.prefix.is_empty() && self.in_socket == 0
    }
}

impl AsyncRead for Io<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        if self.in_socket == 0 || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            ready!(self.socket.poll_read_ready(cx))?;
            let limit = usize::try_from(self.in_socket)
                .unwrap_or(usize::MAX)
                .min(buf.remaining());
            let dst = buf.initialize_unfilled_to(limit);
            match self.socket.try_read(dst) {
                Ok(n) => {
                    buf.advance(n);
                    // The caller closed its end: nothing more comes.
                    self.in_socket = if n == 0 { 0 } else { self.in_socket - n as u64 };
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Io<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.socket.poll_write_ready(cx))?;
            match self.socket.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(r),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.socket.poll_write_ready(cx))?;
            match self.socket.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(r),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Writes a bucket's answer (read whole: a small JSON object); `keep`: whether the
/// connection stays open for the next request.
async fn write_answer(socket: &TcpStream, response: Response<Body>, keep: bool) -> io::Result<()> {
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, MAX_ANSWER_BYTES)
        .await
        .map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {}\r\n",
            parts.status.as_str(),
            parts.status.canonical_reason().unwrap_or("")
        )
        .as_bytes(),
    );
    for (name, value) in &parts.headers {
        if [
            axum::http::header::CONTENT_LENGTH,
            axum::http::header::TRANSFER_ENCODING,
            axum::http::header::CONNECTION,
        ]
        .contains(name)
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    if !keep {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    write_all(socket, &out).await
}

async fn write_all(socket: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        socket.writable().await?;
        match socket.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A bucket's body still on the caller's connection, for its route to move: with splice
/// ([`SpliceSource::take`]), or read as a body ([`SpliceSource::into_body`]). Only one of
/// them, once.
#[derive(Debug, Clone)]
pub struct SpliceSource(Arc<SourceInner>);

#[derive(Debug)]
struct SourceInner {
    socket: Arc<TcpStream>,
    len: u64,
    state: Mutex<SourceState>,
}

#[derive(Debug)]
struct SourceState {
    /// The body's bytes read with the head, and those still in the socket; `None` once taken.
    rest: Option<(Bytes, u64)>,
    expect_continue: bool,
    /// Whether the whole body was read.
    complete: bool,
}

/// A bucket's body, taken to be moved with splice: the caller's socket (`fd`), the bytes
/// already read (`prefix`), then `in_socket` bytes to read from the socket.
#[derive(Debug)]
pub struct RawBody {
    pub socket: Arc<TcpStream>,
    pub prefix: Bytes,
    pub in_socket: u64,
    /// The caller sent `Expect: 100-continue`: it waits for `100 Continue` before the body.
    pub expect_continue: bool,
}

impl SpliceSource {
    fn new(
        socket: Arc<TcpStream>,
        prefix: Bytes,
        in_socket: u64,
        len: u64,
        expect_continue: bool,
    ) -> Self {
        Self(Arc::new(SourceInner {
            socket,
            len,
            state: Mutex::new(SourceState {
                rest: Some((prefix, in_socket)),
                expect_continue,
                complete: len == 0,
            }),
        }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SourceState> {
        self.0
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The body's length (its `Content-Length`).
    pub fn len(&self) -> u64 {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The body, to move with splice; `None` if it was taken already. The taker reads all of
    /// it and then calls [`SpliceSource::read_all`], or the connection closes after the
    /// answer.
    pub fn take(&self) -> Option<RawBody> {
        let mut state = self.state();
        let (prefix, in_socket) = state.rest.take()?;
        Some(RawBody {
            socket: Arc::clone(&self.0.socket),
            prefix,
            in_socket,
            expect_continue: state.expect_continue,
        })
    }

    /// The taker read the whole body: the connection can carry the next request.
    pub fn read_all(&self) {
        self.state().complete = true;
    }

    fn complete(&self) -> bool {
        self.state().complete
    }

    /// The body read into memory as it arrives, for a route that cannot splice it; empty if
    /// it was taken already.
    pub fn into_body(self) -> Body {
        let Some(raw) = self.take() else {
            return Body::empty();
        };
        let stream = futures_util::stream::unfold(
            (raw, self, false),
            |(mut raw, source, mut continued)| async move {
                if raw.expect_continue && !continued {
                    continued = true;
                    if let Err(e) = write_all(&raw.socket, b"HTTP/1.1 100 Continue\r\n\r\n").await {
                        raw.in_socket = 0;
                        return Some((Err(e), (raw, source, continued)));
                    }
                }
                if !raw.prefix.is_empty() {
                    let piece = std::mem::take(&mut raw.prefix);
                    if raw.in_socket == 0 {
                        source.read_all();
                    }
                    return Some((Ok(piece), (raw, source, continued)));
                }
                if raw.in_socket == 0 {
                    return None;
                }
                let want = usize::try_from(raw.in_socket)
                    .unwrap_or(usize::MAX)
                    .min(1 << 20);
                let mut piece = BytesMut::with_capacity(want);
                let read = loop {
                    if let Err(e) = raw.socket.readable().await {
                        break Err(e);
                    }
                    // At most the body's bytes: what follows is the next request's.
                    match raw.socket.try_read_buf(&mut (&mut piece).limit(want)) {
                        Ok(0) => {
                            break Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "the connection ended mid-body",
                            ))
                        }
                        Ok(n) => break Ok(n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => break Err(e),
                    }
                };
                match read {
                    Ok(n) => {
                        let n = (n as u64).min(raw.in_socket);
                        raw.in_socket -= n;
                        if raw.in_socket == 0 {
                            source.read_all();
                        }
                        Some((Ok(piece.freeze()), (raw, source, continued)))
                    }
                    Err(e) => {
                        raw.in_socket = 0;
                        Some((Err(e), (raw, source, continued)))
                    }
                }
            },
        );
        Body::from_stream(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framing(head: &str) -> Framing {
        classify(head.as_bytes(), true)
    }

    #[test]
    fn a_bucket_with_a_length_is_spliced_and_everything_else_goes_to_hyper() {
        let bucket = "POST /weight_uploads/u-1/buckets HTTP/1.1\r\nHost: x\r\n\
                      Content-Length: 12\r\nExpect: 100-continue\r\n\r\n";
        match framing(bucket) {
            Framing::Bucket(h) => {
                assert_eq!(h.body_len, 12);
                assert_eq!(h.head_len, bucket.len());
                assert!(h.expect_continue && !h.close);
                assert_eq!(h.uri.path(), "/weight_uploads/u-1/buckets");
                assert_eq!(h.headers["host"], "x");
            }
            other => panic!("{other:?}"),
        }
        // Not on a system without splice.
        assert!(matches!(
            classify(bucket.as_bytes(), false),
            Framing::One { body_len: 12, .. }
        ));
        let one = "POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nConnection: close\r\n\r\n";
        match framing(one) {
            Framing::One {
                head_len,
                body_len,
                close,
            } => assert_eq!((head_len, body_len, close), (one.len(), 5, true)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            framing("GET /health HTTP/1.1\r\n\r\n"),
            Framing::One {
                body_len: 0,
                close: false,
                ..
            }
        ));
        for rest in [
            // A chunked body, even a bucket's: hyper frames it.
            "POST /weight_uploads/u/buckets HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET / HTTP/1.0\r\n\r\n",
            "GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\n",
            "nonsense\r\n\r\n",
        ] {
            assert!(matches!(framing(rest), Framing::Rest), "{rest}");
        }
    }

    #[test]
    fn only_a_buckets_own_path_is_one() {
        assert!(is_bucket_path("/weight_uploads/u-1/buckets"));
        for not in [
            "/weight_uploads//buckets",
            "/weight_uploads/a/b/buckets",
            "/weight_uploads/u-1/commit",
            "/weight_uploads/buckets",
        ] {
            assert!(!is_bucket_path(not), "{not}");
        }
    }
}
