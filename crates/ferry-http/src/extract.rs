//! Request-side plumbing every ferry HTTP edge shares: a body extractor whose errors are
//! OpenAI error bodies, and the `X-Request-Id` middleware.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The request id header, read from the client and echoed on every response.
pub static REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-supplied request id we accept; a longer one is a 400 (an id travels into
/// logs and engine maps, so it must stay small).
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// A raw body within the server's size limit. Unlike axum's `Bytes`, a body over the limit
/// is a 413 with an OpenAI error body (axum's is plain text), as is every other read error a
/// 400 in that shape.
#[derive(Debug)]
pub struct ApiBytes(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(req, state)
            .await
            .map(ApiBytes)
            .map_err(body_error)
    }
}

/// A body that could not be read: over the size limit (axum's rejection says so by its
/// status, 413) is a 413 with an OpenAI error body, anything else a 400.
fn body_error(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large(format!(
            "the request body is larger than this server's limit of {} bytes",
            crate::MAX_BODY_BYTES
        ))
    } else {
        ApiError::bad_request(format!("could not read the request body: {e}"))
    }
}

/// The request's id: the client's `X-Request-Id`, or a generated one. Handlers read it from
/// the request extensions; the middleware puts it on the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub String);

/// Middleware: resolves the [`RequestId`] and echoes it as a response header. A client's id
/// longer than [`MAX_REQUEST_ID_LEN`] bytes, or with a control or non-ASCII character (it
/// goes into logs as it is), is a 400 naming the header; an empty one is replaced.
pub async fn request_id_layer(mut req: Request, next: Next) -> Response {
    let id = match req.headers().get(&REQUEST_ID_HEADER) {
        None => random_id(),
        Some(v) => match client_request_id(v.as_bytes()) {
            Ok(Some(id)) => id,
            Ok(None) => random_id(),
            Err(e) => return e.into_response(),
        },
    };
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(req).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response
            .headers_mut()
            .insert(REQUEST_ID_HEADER.clone(), value);
    }
    response
}

/// A client's `X-Request-Id` checked: `None` when empty (a generated id replaces it).
fn client_request_id(bytes: &[u8]) -> Result<Option<String>, ApiError> {
    let param = "X-Request-Id";
    if bytes.len() > MAX_REQUEST_ID_LEN {
        return Err(ApiError::invalid(
            param,
            format!(
                "the `X-Request-Id` header is {} bytes long; the most is {MAX_REQUEST_ID_LEN}",
                bytes.len()
            ),
        ));
    }
    // Printable ASCII only: no control characters (tab and DEL included) and no bytes a log
    // line or a JSON reply would have to escape or could not decode.
    if let Some(pos) = bytes.iter().position(|b| !(0x20..0x7f).contains(b)) {
        return Err(ApiError::invalid(
            param,
            format!(
                "the `X-Request-Id` header has a control or non-ASCII character (byte 0x{:02x} at offset {pos}); use printable ASCII",
                bytes[pos]
            ),
        ));
    }
    Ok((!bytes.is_empty()).then(|| String::from_utf8_lossy(bytes).into_owned()))
}

/// 32 hex digits, unique within the process and unpredictable across processes.
///
/// Written by hand rather than pulling in `uuid`/`rand`: std's `RandomState` is seeded from OS
/// entropy per process, and a counter makes every id in this process distinct.
pub fn random_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(n);
    format!("{:016x}{n:016x}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_request_ids_are_checked() {
        assert_eq!(
            client_request_id(b"abc-1").unwrap().as_deref(),
            Some("abc-1")
        );
        assert_eq!(client_request_id(b"").unwrap(), None);
        let longest = vec![b'a'; MAX_REQUEST_ID_LEN];
        assert!(client_request_id(&longest).unwrap().is_some());
        let too_long = vec![b'a'; MAX_REQUEST_ID_LEN + 1];
        for bad in [&too_long[..], b"a\tb", b"a\x7fb", b"\x01", "é".as_bytes()] {
            let e = client_request_id(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad:?}");
            assert_eq!(e.param.as_deref(), Some("X-Request-Id"), "{bad:?}");
        }
    }

    #[test]
    fn random_ids_differ() {
        let (a, b) = (random_id(), random_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
    }
}
