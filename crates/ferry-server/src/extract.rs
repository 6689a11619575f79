//! Request-side plumbing shared by every route: a JSON extractor whose errors name the field
//! (through `serde_path_to_error`) and the `X-Request-Id` middleware.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// The request id header, read from the client and echoed on every response.
pub static REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-supplied request id we accept; a longer one is a 400 (an id travels into
/// logs and engine maps, so it must stay small).
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// A JSON body. Unlike `axum::Json`, a bad body is a 400 with an OpenAI error body whose
/// `param` is the path of the field at fault, and no `Content-Type` is required (curl's `-d`
/// sends a form type).
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let ApiBytes(bytes) = ApiBytes::from_request(req, state).await?;
        parse_json(&bytes).map(ApiJson)
    }
}

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

/// Parses `bytes` as a `T`, naming the field at fault on a type error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    from_value(&value)
}

/// Reads a `T` out of a JSON value, naming the field at fault on a type error. Request types
/// read their parts with this, one part at a time, rather than with `#[serde(flatten)]`:
/// flattened fields are buffered and lose their path, so errors could not name them.
pub fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if path == "." {
            ApiError::bad_request(format!("the request body has the wrong shape: {inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("invalid value for `{path}`: {inner}"))
        }
    })
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

/// A process-wide counter that makes engine request ids unique even when clients reuse an
/// `X-Request-Id`.
pub fn next_engine_seq() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        n: Option<u32>,
        messages: Option<Vec<Msg>>,
    }
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        content: Option<String>,
    }

    #[test]
    fn type_errors_name_the_field_path() {
        let e =
            parse_json::<Body>(br#"{"messages": [{"content": "a"}, {"content": 3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].content"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse_json::<Body>(br#"{"n": "two"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
    }

    #[test]
    fn malformed_json_is_a_400_without_param() {
        for body in [&b"{\"n\": 1"[..], b"not json", b"{} trailing", b"[1]"] {
            let e = parse_json::<Body>(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body:?}");
            assert_eq!(e.param, None, "{body:?}");
        }
    }

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
