//! Request-side plumbing shared by every route: a JSON extractor whose errors name the field
//! and the engine's request sequence. The raw body extractor, the JSON reading
//! (`ferry_http::json`, through `serde_path_to_error`) and the `X-Request-Id` middleware are
//! ferry-http's, shared with the proxy and the admin calls, re-exported here under their old
//! paths.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

pub use ferry_http::extract::{
    random_id, request_id_layer, ApiBytes, RequestId, MAX_REQUEST_ID_LEN, REQUEST_ID_HEADER,
};
pub use ferry_http::json::{from_value, parse_json};

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

/// A process-wide counter that makes engine request ids unique even when clients reuse an
/// `X-Request-Id`.
pub fn next_engine_seq() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}
