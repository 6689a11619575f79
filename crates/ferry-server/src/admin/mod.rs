//! The lifecycle admin API (`../shared/design/lifecycle.md`): pause, resume, sleep, wake-up,
//! KV release, cache reset, aborts and weight updates, under the paths and parameters RL
//! frameworks already call on vLLM, with SGLang's names as aliases ([`sglang`]).
//!
//! Mounted by [`crate::router`] only with `ServerConfig::enable_admin_api` (off: every path
//! here is a 404 like any unknown route), because any client that reaches it can stop the
//! engine or replace its weights.
//!
//! Every handler validates its arguments before it calls the engine (a bad argument is a 400
//! naming it and changes nothing), then makes one [`ferry_engine::EngineHandle`] call; the
//! engine's errors map by variant (the [`crate::error::EngineFailure`] impls in [`args`]):
//! lifecycle conflicts are 409, a refused weight update or an unreadable model folder is 400,
//! a stopped engine is 503.

pub mod args;
pub mod sglang;
pub mod upload;
pub mod weights;

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_engine::{PauseMode, SleepLevel};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{api_error, ApiError};
use crate::extract::ApiBytes;
use crate::state::AppState;
use args::{optional_json, wake_tags, QueryArgs};

/// A handler's reply: a small JSON object, or an OpenAI-shaped error.
pub type AdminReply = Result<Json<Value>, ApiError>;

/// The admin routes (vLLM's paths, then SGLang's aliases).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/sleep", post(sleep))
        .route("/wake_up", post(wake_up))
        .route("/is_sleeping", get(is_sleeping))
        .route("/release_kv_cache_memory", post(release_kv_cache_memory))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/abort_requests", post(abort_requests))
        .route("/update_weights", post(weights::push))
        .route(
            "/update_weights_from_disk",
            post(weights::update_weights_from_disk),
        )
        .route(
            "/update_weight_version",
            post(weights::update_weight_version),
        )
        .route("/weight_info", get(weights::weight_info))
        .route(
            "/init_weight_transfer_engine",
            post(weights::init_weight_transfer_engine),
        )
        .merge(upload::routes())
        .merge(sglang::routes())
}

/// `POST /pause?mode=abort|wait|keep&clear_cache=true|false`. vLLM's defaults: `abort`, and
/// `clear_cache=true`; the deprecated `wait_for_inflight_requests=true` means `mode=wait`.
/// Replies once paused (after the drain for `wait`, after the cache reset with
/// `clear_cache`).
pub async fn pause(State(app): State<Arc<AppState>>, RawQuery(raw): RawQuery) -> AdminReply {
    let q = QueryArgs::parse(
        raw.as_deref(),
        &["mode", "clear_cache", "wait_for_inflight_requests"],
    )?;
    let default_mode = if q.bool("wait_for_inflight_requests", false)? {
        PauseMode::Wait
    } else {
        PauseMode::Abort
    };
    let mode = q.pause_mode("mode", default_mode)?;
    let clear_cache = q.bool("clear_cache", true)?;
    app.engine
        .pause(mode, clear_cache)
        .await
        .map_err(api_error)?;
    Ok(Json(json!({"status": "paused"})))
}

/// `POST /resume`: continues scheduling; a pending cache reset or sleep fails with 409.
pub async fn resume(State(app): State<Arc<AppState>>, RawQuery(raw): RawQuery) -> AdminReply {
    QueryArgs::parse(raw.as_deref(), &[])?;
    app.engine.resume().await.map_err(api_error)?;
    Ok(Json(json!({"status": "resumed"})))
}

/// `GET /is_paused` → `{"is_paused": bool}`.
pub async fn is_paused(State(app): State<Arc<AppState>>) -> AdminReply {
    let paused = app.engine.is_paused().await.map_err(api_error)?;
    Ok(Json(json!({"is_paused": paused})))
}

/// `POST /sleep`'s optional JSON body (SkyRL sends `{"level": 1}`): the query's arguments;
/// one the body sets wins over the query's.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SleepBody {
    pub level: Option<u8>,
    /// `abort`, `wait` or `keep`.
    pub mode: Option<String>,
}

/// `POST /sleep?level=0|1|2&mode=abort|wait|keep` (vLLM's defaults: level 1, abort), or the
/// same in a JSON body.
pub async fn sleep(
    State(app): State<Arc<AppState>>,
    RawQuery(raw): RawQuery,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let q = QueryArgs::parse(raw.as_deref(), &["level", "mode"])?;
    let req: SleepBody = body_or_default(&body)?;
    let level = match req.level {
        Some(l) => SleepLevel::from_u8(l).ok_or_else(|| {
            ApiError::invalid(
                "level",
                format!("invalid sleep level `{l}` (expected 0, 1 or 2)"),
            )
        })?,
        None => q.sleep_level("level", SleepLevel::L1)?,
    };
    let mode = match req.mode {
        Some(m) => m
            .parse()
            .map_err(|e: String| ApiError::invalid("mode", e))?,
        None => q.pause_mode("mode", PauseMode::Abort)?,
    };
    app.engine.sleep(level, mode).await.map_err(api_error)?;
    Ok(Json(json!({"status": "sleeping", "level": level.as_u8()})))
}

/// `POST /wake_up`'s optional JSON body (SkyRL sends `{"tags": [...]}`); its tags replace the
/// query's.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WakeUpBody {
    pub tags: Option<Vec<String>>,
}

/// `POST /wake_up?tags=weights&tags=kv_cache` (none: everything; or `{"tags": [...]}` in a
/// JSON body) → `{"is_sleeping": bool}`, true while some tag is still asleep.
pub async fn wake_up(
    State(app): State<Arc<AppState>>,
    RawQuery(raw): RawQuery,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let q = QueryArgs::parse(raw.as_deref(), &["tags"])?;
    let req: WakeUpBody = body_or_default(&body)?;
    let tags = match &req.tags {
        Some(list) => {
            let list: Vec<&str> = list.iter().map(String::as_str).collect();
            wake_tags(&list, "tags", &[])?
        }
        None => wake_tags(&q.all("tags"), "tags", &[])?,
    };
    app.engine.wake_up(&tags).await.map_err(api_error)?;
    is_sleeping(State(app)).await
}

/// An admin call's optional JSON body: empty or `null` (what a client that always sends a
/// body sends without arguments, and the proxy's fan-out) is no arguments.
fn body_or_default<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.trim_ascii() == b"null" {
        Ok(T::default())
    } else {
        optional_json(body)
    }
}

/// `GET /is_sleeping` → `{"is_sleeping": bool}`.
pub async fn is_sleeping(State(app): State<Arc<AppState>>) -> AdminReply {
    let sleeping = app.engine.is_sleeping().await.map_err(api_error)?;
    Ok(Json(json!({"is_sleeping": sleeping})))
}

/// `POST /release_kv_cache_memory`: needs a completed pause (else 409); `wake_up` with
/// `tags=kv_cache` brings the memory back.
pub async fn release_kv_cache_memory(
    State(app): State<Arc<AppState>>,
    RawQuery(raw): RawQuery,
) -> AdminReply {
    QueryArgs::parse(raw.as_deref(), &[])?;
    app.engine
        .release_kv_cache_memory()
        .await
        .map_err(api_error)?;
    Ok(Json(json!({"status": "released"})))
}

/// `POST /reset_prefix_cache`'s optional JSON body (SkyRL sends its argument there): the
/// same arguments as the query string; one the body sets wins over the query's.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct ResetPrefixCache {
    pub reset_running_requests: Option<bool>,
    pub reset_external: Option<bool>,
}

/// `POST /reset_prefix_cache?reset_running_requests=&reset_external=` (or the same in a JSON
/// body) → `{"success": bool}`: false (nothing changed) while blocks are held.
/// `reset_external` resets every connector's cache too.
pub async fn reset_prefix_cache(
    State(app): State<Arc<AppState>>,
    RawQuery(raw): RawQuery,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let q = QueryArgs::parse(
        raw.as_deref(),
        &["reset_running_requests", "reset_external"],
    )?;
    let req: ResetPrefixCache = body_or_default(&body)?;
    let running = match req.reset_running_requests {
        Some(b) => b,
        None => q.bool("reset_running_requests", false)?,
    };
    let external = match req.reset_external {
        Some(b) => b,
        None => q.bool("reset_external", false)?,
    };
    let success = app
        .engine
        .reset_prefix_cache(running, external)
        .await
        .map_err(api_error)?;
    Ok(Json(json!({"success": success})))
}

/// `POST /abort_requests`'s body (absent or empty: abort everything).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct AbortRequests {
    pub request_ids: Option<Vec<String>>,
}

/// `POST /abort_requests {"request_ids": [...]}` → `{"status": "aborted", "aborted": n}`.
/// An id is an `X-Request-Id` of a generation request (every choice of it is aborted) or an
/// engine request id; unknown or finished ids are ignored. Empty or missing: every request.
pub async fn abort_requests(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let req: AbortRequests = optional_json(&body)?;
    let ids = req
        .request_ids
        .filter(|ids| !ids.is_empty())
        .map(|ids| app.live.expand(&ids));
    let n = app.engine.abort_requests(ids).await.map_err(api_error)?;
    Ok(Json(json!({"status": "aborted", "aborted": n})))
}
