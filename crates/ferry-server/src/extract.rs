//! Request-side plumbing shared by every route: a JSON extractor whose errors name the field
//! (through `serde_path_to_error`) and the engine's request sequence. The raw body extractor
//! and the `X-Request-Id` middleware are ferry-http's, shared with the proxy and re-exported
//! here under their old paths.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde_json::Value;

pub use ferry_http::extract::{
    random_id, request_id_layer, ApiBytes, RequestId, MAX_REQUEST_ID_LEN, REQUEST_ID_HEADER,
};

use crate::error::ApiError;

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

/// A process-wide counter that makes engine request ids unique even when clients reuse an
/// `X-Request-Id`.
pub fn next_engine_seq() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

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
}
