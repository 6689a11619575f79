//! API-key authentication (`ferry serve --api-key` or `ferry proxy --api-key`, or
//! `FERRY_API_KEY`): with a key, every route but [`OPEN_PATHS`] needs `Authorization: Bearer
//! <key>`, the admin routes included (stricter than `vllm serve --api-key`, which guards only
//! `/v1`: the admin routes can pause the engine and replace its weights). A missing or wrong
//! key is a 401 with an OpenAI error body.
//!
//! The key is compared in constant time ([`ApiKey::matches`]) and never printed: [`ApiKey`]'s
//! `Debug` redacts it, so logging a configuration that holds one cannot leak it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Routes any client may call without the key: liveness probes and metrics scrapes, which
/// monitoring calls without credentials (as vLLM leaves them open).
pub const OPEN_PATHS: [&str; 2] = ["/health", "/metrics"];

/// The key clients must send. Its `Debug` shows no part of it. (`PartialEq` compares
/// configurations; requests are checked with [`ApiKey::matches`], in constant time.)
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

/// Why a string cannot be an API key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeyError {
    #[error("the API key is empty")]
    Empty,
    /// A client could not send it in an `Authorization` header.
    #[error("the API key must be printable ASCII without spaces")]
    NotPrintable,
}

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Result<Self, ApiKeyError> {
        let key = key.into();
        if key.is_empty() {
            return Err(ApiKeyError::Empty);
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiKeyError::NotPrintable);
        }
        Ok(Self(key))
    }

    /// Whether `presented` is the key, in time that depends only on `presented`'s length,
    /// never on how much of it is right.
    ///
    /// A loop written out rather than the `subtle` crate: it is the one constant-time
    /// comparison ferry needs. Every byte of `presented` is compared (against the key's bytes,
    /// cycled) and the differences are OR-ed together without an early exit; `black_box`
    /// keeps the optimizer from turning the accumulation back into a short-circuit.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let key = self.0.as_bytes();
        let mut diff = u8::from(presented.len() != key.len());
        for (i, &b) in presented.iter().enumerate() {
            diff |= std::hint::black_box(b ^ key[i % key.len()]);
        }
        presented.len() == key.len() && std::hint::black_box(diff) == 0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl FromStr for ApiKey {
    type Err = ApiKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// Middleware: lets a request through when its path is open or it carries the key; else a
/// 401 with an OpenAI error body and `WWW-Authenticate: Bearer`.
pub async fn require_api_key(State(key): State<Arc<ApiKey>>, req: Request, next: Next) -> Response {
    if OPEN_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    match bearer_token(req.headers().get(header::AUTHORIZATION)) {
        Some(token) if key.matches(token) => next.run(req).await,
        presented => {
            // The message never repeats what was presented: it may be a near-miss of the key.
            let message = if presented.is_some() {
                "invalid API key"
            } else {
                "this server needs an API key: send `Authorization: Bearer <key>`"
            };
            let mut response = ApiError::unauthorized(message).into_response();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header (the scheme is case-insensitive,
/// as RFC 9110 says); `None` without one.
fn bearer_token(value: Option<&HeaderValue>) -> Option<&[u8]> {
    let bytes = value?.as_bytes();
    let (scheme, token) = bytes.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_only_the_exact_key() {
        let key = ApiKey::new("sk-abc123").unwrap();
        assert!(key.matches(b"sk-abc123"));
        for wrong in [
            &b""[..],
            b"sk-abc12",
            b"sk-abc1234",
            b"sk-abc124",
            b"SK-abc123",
            b"x",
        ] {
            assert!(!key.matches(wrong), "{wrong:?}");
        }
        // A presented token longer than the key, equal to it repeated, is still wrong.
        assert!(!key.matches(b"sk-abc123sk-abc123"));
    }

    #[test]
    fn debug_never_shows_the_key() {
        let key = ApiKey::new("sk-secret-value").unwrap();
        let shown = format!("{key:?} {:?}", Some(key.clone()));
        assert!(!shown.contains("secret"), "{shown}");
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
    }

    #[test]
    fn empty_or_unsendable_keys_are_refused() {
        assert_eq!(ApiKey::new(""), Err(ApiKeyError::Empty));
        assert_eq!("a b".parse::<ApiKey>(), Err(ApiKeyError::NotPrintable));
        assert_eq!(ApiKey::new("é"), Err(ApiKeyError::NotPrintable));
        assert!(ApiKey::new("token-1").is_ok());
    }

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        let token =
            |v: &'static str| bearer_token(Some(&HeaderValue::from_static(v))).map(<[u8]>::to_vec);
        assert_eq!(token("Bearer k"), Some(b"k".to_vec()));
        assert_eq!(token("bearer k"), Some(b"k".to_vec()));
        assert_eq!(token("Bearer "), Some(Vec::new()));
        assert_eq!(token("Basic k"), None);
        assert_eq!(token("Bearer"), None);
        assert_eq!(bearer_token(None), None);
    }
}
