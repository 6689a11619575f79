//! ferry-http: the HTTP edge that ferry's OpenAI server (`ferry-server`) and its P/D proxy
//! (`ferry-proxy`) share, so a client meets one wire contract through either: the same error
//! bodies, the same request-id rules, the same API-key check and the same body limit.
//!
//! Modules: [`error`] (the OpenAI-shaped error every handler returns), [`extract`] (the raw
//! body extractor and the `X-Request-Id` middleware), [`json`] (JSON bodies whose errors name
//! the field at fault), [`auth`] (the API key). [`edge_layers`]
//! puts the middlewares on a router in the order both sides use.
//!
//! The key decision: this crate knows HTTP and nothing behind it. It depends on axum, serde,
//! serde_json, thiserror and tracing (and utoipa with the `openapi` feature, which the server turns on for
//! its schema), never on the engine or the model, so building the proxy builds neither. The
//! engine's errors are mapped to [`error::ApiError`] in `ferry-server`.

pub mod auth;
pub mod error;
pub mod extract;
pub mod json;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::Router;

pub use crate::auth::ApiKey;

/// Largest request body (a batch of long token-id prompts fits well inside); a larger one is
/// a 413 from [`extract::ApiBytes`]. A route may set its own limit (the server's
/// `POST /update_weights` does, `ServerConfig::max_weight_push_bytes`).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// `routes` behind the layers every ferry edge wears, innermost first: with `api_key`,
/// [`auth::require_api_key`] (around the fallback too, so a client without the key learns
/// nothing of the routes); the [`MAX_BODY_BYTES`] limit; and, outermost,
/// [`extract::request_id_layer`], so every response, a refusal by an inner layer included,
/// carries the request id.
pub fn edge_layers<S>(routes: Router<S>, api_key: Option<ApiKey>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let routes = match api_key {
        Some(key) => routes.layer(axum::middleware::from_fn_with_state(
            Arc::new(key),
            auth::require_api_key,
        )),
        None => routes,
    };
    routes
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(extract::request_id_layer))
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{header, HeaderValue, Request, StatusCode};
    use axum::response::Response;
    use axum::routing::{get, post};
    use serde_json::Value;
    use tower::ServiceExt;

    use super::*;
    use crate::extract::{ApiBytes, REQUEST_ID_HEADER};

    /// A keyed edge with one open and one guarded route; the guarded one echoes its body's
    /// length.
    fn edge() -> Router {
        let routes = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route(
                "/v1/echo",
                post(|ApiBytes(body): ApiBytes| async move { body.len().to_string() }),
            );
        edge_layers(routes, Some(ApiKey::new("sk-1").unwrap()))
    }

    fn request(method: &str, path: &str) -> axum::http::request::Builder {
        Request::builder().method(method).uri(path)
    }

    async fn send(req: Request<Body>) -> (Response<()>, Vec<u8>) {
        let response = edge().oneshot(req).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        (Response::from_parts(parts, ()), bytes.to_vec())
    }

    fn error_of(body: &[u8]) -> Value {
        serde_json::from_slice::<Value>(body).unwrap()["error"].clone()
    }

    #[tokio::test]
    async fn a_request_without_the_key_is_a_401_with_a_request_id() {
        for path in ["/v1/echo", "/no-such-route"] {
            let (response, body) = send(request("POST", path).body(Body::empty()).unwrap()).await;
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{path}");
            assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
            assert_eq!(response.headers()[&REQUEST_ID_HEADER].len(), 32);
            let error = error_of(&body);
            assert_eq!(error["type"], "authentication_error");
            assert_eq!(error["code"], 401);
        }
        let wrong = request("POST", "/v1/echo")
            .header(header::AUTHORIZATION, "Bearer sk-2")
            .body(Body::empty())
            .unwrap();
        let (response, body) = send(wrong).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(error_of(&body)["message"], "invalid API key");
    }

    #[tokio::test]
    async fn open_paths_and_keyed_requests_pass_with_their_id_echoed() {
        let (response, body) = send(request("GET", "/health").body(Body::empty()).unwrap()).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(body, b"ok");
        let keyed = request("POST", "/v1/echo")
            .header(header::AUTHORIZATION, "bearer sk-1")
            .header(&REQUEST_ID_HEADER, "client-7")
            .body(Body::from("abc"))
            .unwrap();
        let (response, body) = send(keyed).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(body, b"3");
        assert_eq!(response.headers()[&REQUEST_ID_HEADER], "client-7");
    }

    #[tokio::test]
    async fn a_bad_request_id_is_a_400_naming_the_header() {
        let bad = request("GET", "/health")
            .header(
                &REQUEST_ID_HEADER,
                HeaderValue::from_bytes(b"a\tb").unwrap(),
            )
            .body(Body::empty())
            .unwrap();
        let (response, body) = send(bad).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert_eq!(error_of(&body)["param"], "X-Request-Id");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_a_413_in_the_openai_shape() {
        for (len, status) in [
            (MAX_BODY_BYTES, StatusCode::OK),
            (MAX_BODY_BYTES + 1, StatusCode::PAYLOAD_TOO_LARGE),
        ] {
            let req = request("POST", "/v1/echo")
                .header(header::AUTHORIZATION, "Bearer sk-1")
                .body(Body::from(vec![b'x'; len]))
                .unwrap();
            let (response, body) = send(req).await;
            assert_eq!(response.status(), status, "{len}");
            if status == StatusCode::OK {
                assert_eq!(body, len.to_string().as_bytes());
            } else {
                let error = error_of(&body);
                assert_eq!(error["param"], "body");
                assert_eq!(error["type"], "invalid_request_error");
                assert_eq!(error["code"], 413);
            }
        }
    }
}
