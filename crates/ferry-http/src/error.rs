//! The one error type every handler returns, rendered as an OpenAI error body:
//! `{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.
//!
//! Errors are classified where they arise (validation names the field; engine errors map by
//! variant), so nothing here ever inspects a message's text. The mapping of engine errors
//! lives in ferry-server (`ferry_server::error::EngineFailure`): this crate knows nothing of
//! the engine, so the proxy that answers with the same errors does not build one.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// An HTTP error with an OpenAI-shaped body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The OpenAI error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, as a path (`messages[0].content`), when there is one.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
        }
    }

    /// A 400 about the request as a whole (malformed JSON, no chat template).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// A 404: the request names something this server does not have (a model, a route).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: param.map(str::to_owned),
        }
    }

    /// A 401: the request lacks the server's API key (see [`crate::auth`]).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "authentication_error",
            param: None,
        }
    }

    /// A 409: a lifecycle operation conflicts with the engine's state (not paused, asleep,
    /// cancelled by a resume). Nothing was lost; the caller may retry in another state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::CONFLICT,
            message: message.into(),
            kind: "conflict_error",
            param: None,
        }
    }

    /// A 504: a wait outlasted its bound. On the server, a lifecycle operation's wait for
    /// transfers (the engine stays paused and consistent; the operation can be asked for
    /// again); on the proxy, an instance's answer.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: message.into(),
            kind: "timeout_error",
            param: None,
        }
    }

    /// A 413: the request body is over the route's limit.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some("body".into()),
        }
    }

    /// A 503: the engine is overloaded or has stopped (on the proxy: no instance can take
    /// the request). Clients may retry later.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
        }
    }

    /// A 500: something the server should have prevented.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "internal_server_error",
            param: None,
        }
    }

    /// A 500: the engine finished a choice with an explained `error` (a KV load that failed
    /// under `--kv-load-failure-policy fail`); the message says why.
    pub fn generation_failed(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "generation_error",
            param: None,
        }
    }

    /// The JSON body, also used inside an SSE stream.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorInfo {
                message: self.message.clone(),
                kind: self.kind,
                param: self.param.clone(),
                code: self.status.as_u16(),
            },
        }
    }
}

// The two wire types below carry plain comments, not doc comments: `ToSchema` would put doc
// comments into `/openapi.json` as descriptions.

// The body of every error response: `{"error": {...}}`.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorInfo,
}

// The error itself; `code` repeats the HTTP status.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorInfo {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: u16,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, "{}", self.message);
        } else {
            tracing::debug!(status = %self.status, param = ?self.param, "{}", self.message);
        }
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid("max_tokens", "max_tokens must be at least 1");
        let json = serde_json::to_value(e.body()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"error": {
                "message": "max_tokens must be at least 1",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": 400
            }})
        );
        assert_eq!(
            ApiError::unavailable("x").status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
