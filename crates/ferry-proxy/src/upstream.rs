//! Calls from the proxy to its instances: one `reqwest` client with a connect timeout (an
//! instance that is down is an error at once, never a hang), the instances' key, the request
//! id, and errors that name the instance ([`UpstreamError`]).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use ferry_http::error::ApiError;
use ferry_http::extract::REQUEST_ID_HEADER;
use ferry_http::ApiKey;

use crate::fleet::Instance;

/// The key the proxy sends to its instances (`Authorization: Bearer <key>`). Its `Debug`
/// shows no part of it, and the header is marked sensitive.
#[derive(Clone)]
pub struct InstanceKey(HeaderValue);

impl fmt::Debug for InstanceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InstanceKey(<redacted>)")
    }
}

impl FromStr for InstanceKey {
    type Err = ferry_http::auth::ApiKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ApiKey::new(s)?;
        let mut value = HeaderValue::from_str(&format!("Bearer {s}"))
            .map_err(|_| ferry_http::auth::ApiKeyError::NotPrintable)?;
        value.set_sensitive(true);
        Ok(Self(value))
    }
}

/// Why an instance gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Nothing was sent: the connection was refused or did not open in time.
    #[error("{role} instance {url} is unreachable: {reason}")]
    Unreachable {
        role: &'static str,
        url: String,
        reason: String,
    },
    /// The instance took the request but gave no complete answer in time.
    #[error("{role} instance {url} did not answer within {seconds} s")]
    Timeout {
        role: &'static str,
        url: String,
        seconds: u64,
    },
    /// The connection broke off, or the answer was not what an instance sends.
    #[error("{role} instance {url} failed: {reason}")]
    Broken {
        role: &'static str,
        url: String,
        reason: String,
    },
}

impl UpstreamError {
    /// Whether the instance never saw the request, so another one may take it.
    pub fn nothing_sent(&self) -> bool {
        matches!(self, UpstreamError::Unreachable { .. })
    }

    pub fn from_reqwest(
        instance: &Instance,
        timeout: Option<Duration>,
        e: &reqwest::Error,
    ) -> Self {
        let role = instance.role.as_str();
        let url = instance.url.clone();
        if e.is_connect() {
            UpstreamError::Unreachable {
                role,
                url,
                reason: source_chain(e),
            }
        } else if let Some(t) = timeout.filter(|_| e.is_timeout()) {
            UpstreamError::Timeout {
                role,
                url,
                seconds: t.as_secs(),
            }
        } else {
            // A timeout with no bound of ours is the kernel's: the connection died (its
            // keep-alive probes went unanswered).
            UpstreamError::Broken {
                role,
                url,
                reason: source_chain(e),
            }
        }
    }

    pub fn broken(instance: &Instance, reason: impl Into<String>) -> Self {
        UpstreamError::Broken {
            role: instance.role.as_str(),
            url: instance.url.clone(),
            reason: reason.into(),
        }
    }
}

/// A 502: an instance behind the proxy failed.
pub fn bad_gateway(message: impl Into<String>) -> ApiError {
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        message: message.into(),
        kind: "bad_gateway_error",
        param: None,
    }
}

impl From<UpstreamError> for ApiError {
    fn from(e: UpstreamError) -> Self {
        match e {
            UpstreamError::Unreachable { .. } => ApiError::unavailable(e.to_string()),
            UpstreamError::Timeout { .. } => ApiError::timeout(e.to_string()),
            UpstreamError::Broken { .. } => bad_gateway(e.to_string()),
        }
    }
}

/// reqwest's error and its causes on one line ("error sending request: connection refused").
fn source_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// The proxy's HTTP client for its instances.
#[derive(Debug, Clone)]
pub struct Upstream {
    client: reqwest::Client,
    key: Option<InstanceKey>,
}

/// One call to an instance.
#[derive(Debug)]
pub struct Call<'a> {
    pub method: Method,
    /// Path and query (`/pause?mode=keep`).
    pub path_and_query: &'a str,
    pub request_id: Option<&'a str>,
    pub content_type: Option<HeaderValue>,
    pub body: reqwest::Body,
    /// Bound on the whole call (sending, and the answer's headers); `None`: no bound beyond
    /// the connect timeout (a generation streams for as long as it runs).
    pub timeout: Option<Duration>,
}

impl Upstream {
    /// `dead_after`: how soon a connection to an instance that stopped answering at the TCP
    /// level (a cut link, a host gone) must count as dead, whatever is being waited for —
    /// a non-streamed answer sends nothing until it is complete, so only TCP keep-alive
    /// probes, which a live host's kernel answers however long the generation runs, tell a
    /// slow answer from a dead link. Probes start after a third of it and repeat every sixth,
    /// and the kernel ends a connection whose probes (or data) went unanswered for
    /// `dead_after` (`TCP_USER_TIMEOUT`, which takes precedence over the probe count). `None`:
    /// no bound at all (reqwest's own default would end such connections after 30 s).
    pub fn new(
        connect_timeout: Duration,
        dead_after: Option<Duration>,
        key: Option<InstanceKey>,
    ) -> Result<Self, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            // Instances are addressed directly: a proxy from the environment must not be used.
            .no_proxy()
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true);
        // The kernel counts keep-alive times in whole seconds.
        let at_least_1s = |d: Duration| d.max(Duration::from_secs(1));
        builder = match dead_after {
            Some(t) => builder
                .tcp_keepalive(at_least_1s(t / 3))
                .tcp_keepalive_interval(at_least_1s(t / 6))
                .tcp_keepalive_retries(3)
                .tcp_user_timeout(at_least_1s(t)),
            None => builder.tcp_keepalive(None).tcp_user_timeout(None),
        };
        Ok(Self {
            client: builder.build()?,
            key,
        })
    }

    /// The `Authorization` header the proxy sends its instances, if any.
    pub fn authorization(&self) -> Option<&HeaderValue> {
        self.key.as_ref().map(|k| &k.0)
    }

    /// Sends `call` to `instance`; the answer's status and headers, its body unread.
    pub async fn send(
        &self,
        instance: &Instance,
        call: Call<'_>,
    ) -> Result<reqwest::Response, UpstreamError> {
        let url = format!("{}{}", instance.url, call.path_and_query);
        let mut headers = HeaderMap::new();
        if let Some(key) = &self.key {
            headers.insert(axum::http::header::AUTHORIZATION, key.0.clone());
        }
        if let Some(id) = call.request_id {
            if let Ok(v) = HeaderValue::from_str(id) {
                headers.insert(REQUEST_ID_HEADER.clone(), v);
            }
        }
        if let Some(ct) = call.content_type {
            headers.insert(HeaderName::from_static("content-type"), ct);
        }
        let mut request = self
            .client
            .request(call.method, url)
            .headers(headers)
            .body(call.body);
        if let Some(t) = call.timeout {
            request = request.timeout(t);
        }
        request
            .send()
            .await
            .map_err(|e| UpstreamError::from_reqwest(instance, call.timeout, &e))
    }

    /// [`Upstream::send`], then the whole body, within `timeout`.
    pub async fn send_read(
        &self,
        instance: &Instance,
        call: Call<'_>,
    ) -> Result<(StatusCode, HeaderMap, axum::body::Bytes), UpstreamError> {
        let timeout = call.timeout;
        let read = async {
            let response = self.send(instance, call).await?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = response
                .bytes()
                .await
                .map_err(|e| UpstreamError::from_reqwest(instance, timeout, &e))?;
            Ok((status, headers, body))
        };
        match timeout {
            None => read.await,
            Some(t) => tokio::time::timeout(t, read).await.unwrap_or_else(|_| {
                Err(UpstreamError::Timeout {
                    role: instance.role.as_str(),
                    url: instance.url.clone(),
                    seconds: t.as_secs(),
                })
            }),
        }
    }
}
