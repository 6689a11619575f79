//! The proxy's small routes: `/health` and `/metrics` about the whole fleet, and the routes an
//! instance answers as well as any other (`/v1/models`, `/tokenize`, `/detokenize`,
//! `/version`, SGLang's discovery routes), forwarded to one.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_http::error::ApiError;
use ferry_http::extract::{ApiBytes, RequestId};
use serde_json::{json, Value};

use crate::fleet::{Instance, Role};
use crate::metrics::{self, Scrape};
use crate::upstream::Call;
use crate::versions::{self, InstanceVersion};
use crate::ProxyState;

/// `GET /health`: each instance's `/health`, probed at once within the health timeout. 200
/// (`"ok"`, or `"degraded"` with some down) while at least one prefill and one decode
/// instance are healthy, else 503; `instances` says which is which.
///
/// It also reads each instance's weight version, at the same time and within the same
/// timeout, from the instance's `/metrics` (`ferry_weight_version_info`; no other route an
/// instance always serves carries it, and the admin routes may be off on the instances):
/// `weight_versions` lists each instance's URL, role and version (`null` when unread), and
/// `version_skew` is true when two instances answered different versions. A skew does not
/// change the status: the instances still serve, each on its own weights.
pub async fn health(State(app): State<Arc<ProxyState>>) -> Response {
    let probes = app
        .fleet
        .all()
        .iter()
        .map(|i| futures_util::future::join(probe(&app, i), weight_version(&app, i)));
    let (results, read): (Vec<Result<(), String>>, Vec<Option<String>>) =
        futures_util::future::join_all(probes)
            .await
            .into_iter()
            .unzip();
    let versions: Vec<InstanceVersion<'_>> = app
        .fleet
        .all()
        .iter()
        .zip(read)
        .map(|(i, version)| InstanceVersion {
            instance: i,
            version,
        })
        .collect();
    let version_skew = versions::skewed(&versions);
    let weight_versions = versions::to_json(&versions);
    let healthy = |role: Role| {
        app.fleet
            .all()
            .iter()
            .zip(&results)
            .any(|(i, r)| i.role == role && r.is_ok())
    };
    let instances: Vec<Value> = app
        .fleet
        .all()
        .iter()
        .zip(&results)
        .map(|(i, r)| {
            let mut v = json!({"url": i.url, "role": i.role.as_str(), "healthy": r.is_ok()});
            if let Err(e) = r {
                v["error"] = json!(e);
            }
            v
        })
        .collect();
    // The roles the fleet needs: P and D, or its plain instances.
    let roles: &[Role] = match app.fleet.prompt_role() {
        Role::Whole => &[Role::Whole],
        _ => &[Role::Prefill, Role::Decode],
    };
    if roles.iter().all(|r| healthy(*r)) {
        let status = if results.iter().all(Result::is_ok) {
            "ok"
        } else {
            "degraded"
        };
        return Json(json!({"status": status, "instances": instances,
                           "version_skew": version_skew, "weight_versions": weight_versions}))
        .into_response();
    }
    let down: Vec<&str> = roles
        .iter()
        .copied()
        .filter(|r| !healthy(*r))
        .map(Role::as_str)
        .collect();
    let error = ApiError::unavailable(format!(
        "no healthy {} instance behind the proxy",
        down.join(" or ")
    ));
    let mut body = serde_json::to_value(error.body()).unwrap_or_else(|_| json!({}));
    body["instances"] = Value::Array(instances);
    body["version_skew"] = json!(version_skew);
    body["weight_versions"] = weight_versions;
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// The weight version `instance` runs, from its `/metrics` (always served, open without the
/// key); `None` when it does not answer within the health timeout.
async fn weight_version(app: &ProxyState, instance: &Instance) -> Option<String> {
    let call = get_call("/metrics", app.config.health_timeout);
    match app.upstream.send_read(instance, call).await {
        Ok((status, _, body)) if status.is_success() => {
            versions::from_metrics(&String::from_utf8_lossy(&body))
        }
        _ => None,
    }
}

async fn probe(app: &ProxyState, instance: &Instance) -> Result<(), String> {
    let call = get_call("/health", app.config.health_timeout);
    match app.upstream.send_read(instance, call).await {
        Ok((status, _, _)) if status.is_success() => Ok(()),
        Ok((status, _, _)) => Err(format!("answered {}", status.as_u16())),
        Err(e) => Err(e.to_string()),
    }
}

fn get_call(path: &str, timeout: std::time::Duration) -> Call<'_> {
    Call {
        method: Method::GET,
        path_and_query: path,
        request_id: None,
        content_type: None,
        body: reqwest::Body::from(Bytes::new()),
        timeout: Some(timeout),
    }
}

/// `GET /metrics`: the proxy's figures per instance, then every instance's metrics labelled
/// with it (instances that do not answer within the health timeout are left out, `up` 0).
pub async fn metrics(State(app): State<Arc<ProxyState>>) -> Response {
    let scrapes = app.fleet.all().iter().map(|i| async {
        let call = get_call("/metrics", app.config.health_timeout);
        let text = match app.upstream.send_read(i, call).await {
            Ok((status, _, body)) if status.is_success() => {
                Some(String::from_utf8_lossy(&body).into_owned())
            }
            _ => None,
        };
        Scrape { instance: i, text }
    });
    let scrapes = futures_util::future::join_all(scrapes).await;
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        metrics::render(&scrapes),
    )
        .into_response()
}

/// `/v1/models`, `/tokenize`, `/detokenize`, `/version` and SGLang's discovery routes
/// (`/server_info`, `/get_server_info`, `/model_info`, `/get_model_info`,
/// `/health_generate`, `/get_world_size`): forwarded to one instance (decode first, the next
/// one when one is unreachable), its answer returned as it came.
pub async fn forward(
    State(app): State<Arc<ProxyState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Response {
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let order = app
        .fleet
        .of(Role::Decode)
        .chain(app.fleet.of(Role::Prefill))
        .chain(app.fleet.of(Role::Whole));
    let mut unreachable = Vec::new();
    for instance in order {
        let call = Call {
            method: method.clone(),
            path_and_query: &path_and_query,
            request_id: Some(&id),
            content_type: headers.get(header::CONTENT_TYPE).cloned(),
            body: reqwest::Body::from(body.clone()),
            timeout: Some(app.config.admin_timeout),
        };
        match app.upstream.send_read(instance, call).await {
            Ok((status, headers, body)) => {
                let mut response = Response::new(Body::from(body));
                *response.status_mut() = status;
                if let Some(ct) = headers.get(header::CONTENT_TYPE) {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, ct.clone());
                }
                return response;
            }
            Err(e) if e.nothing_sent() => unreachable.push(e.to_string()),
            Err(e) => return ApiError::from(e).into_response(),
        }
    }
    ApiError::unavailable(format!(
        "no instance is reachable: {}",
        unreachable.join("; ")
    ))
    .into_response()
}

/// Any other path: a 404 in the OpenAI shape.
pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(None, format!("no route for {}", uri.path()))
}
