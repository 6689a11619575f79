//! SGLang's names for the lifecycle routes, in SGLang's request and response shapes, so RL
//! frameworks written against SGLang (verl, slime, ...) drive ferry unchanged.
//!
//! | SGLang | ferry |
//! | --- | --- |
//! | `POST /pause_generation {"mode": "abort" \| "retract" \| "in_place"}` | pause `abort`, `keep` with a cache reset (retracted requests recompute), `keep` |
//! | `POST /continue_generation` | resume |
//! | `GET\|POST /flush_cache` | `reset_prefix_cache`: 200, or 400 while blocks are held |
//! | `GET\|POST /release_memory_occupation {"tags": [...]}` | sleep level 1 (`keep`), then wake what `tags` leaves out |
//! | `GET\|POST /resume_memory_occupation {"tags": [...]}` | `wake_up(tags)` |
//! | `POST /update_weights_from_disk` | the same route |
//! | `GET /get_weight_version` | `{"weight_version": ...}` |
//! | `POST /abort_request {"rid": ..., "abort_all": bool}` | `abort_requests` (one request's id, or all) |

use std::sync::Arc;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_engine::{PauseMode, SleepLevel, WakeTag};
use serde::Deserialize;
use serde_json::json;

use super::args::{optional_json, wake_tags};
use super::weights::engine_weight_info;
use super::AdminReply;
use crate::error::{api_error, ApiError};
use crate::extract::ApiBytes;
use crate::state::AppState;

/// SGLang's memory tag for CUDA graphs: a CPU engine has none, so it is accepted and skipped.
const IGNORED_TAGS: &[&str] = &["cuda_graph"];

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/pause_generation", post(pause_generation))
        .route("/continue_generation", post(continue_generation))
        .route("/flush_cache", get(flush_cache).post(flush_cache))
        .route(
            "/release_memory_occupation",
            get(release_memory_occupation).post(release_memory_occupation),
        )
        .route(
            "/resume_memory_occupation",
            get(resume_memory_occupation).post(resume_memory_occupation),
        )
        .route("/get_weight_version", get(get_weight_version))
        .route("/abort_request", post(abort_request))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct PauseGeneration {
    pub mode: Option<String>,
}

/// `POST /pause_generation {"mode": ...}` (default `abort`).
pub async fn pause_generation(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let req: PauseGeneration = optional_json(&body)?;
    let (mode, clear_cache) = match req.mode.as_deref().unwrap_or("abort") {
        "abort" => (PauseMode::Abort, false),
        // Retracted requests give their KV back and recompute on continue.
        "retract" => (PauseMode::Keep, true),
        "in_place" => (PauseMode::Keep, false),
        other => {
            return Err(ApiError::invalid(
                "mode",
                format!("unknown pause mode `{other}` (expected abort, retract or in_place)"),
            ))
        }
    };
    app.engine
        .pause(mode, clear_cache)
        .await
        .map_err(api_error)?;
    Ok(Json(
        json!({"message": "Generation paused successfully.", "status": "ok"}),
    ))
}

/// `POST /continue_generation`.
pub async fn continue_generation(State(app): State<Arc<AppState>>) -> AdminReply {
    app.engine.resume().await.map_err(api_error)?;
    Ok(Json(
        json!({"message": "Generation continued successfully.", "status": "ok"}),
    ))
}

/// `GET|POST /flush_cache`: drops every cached prefix; 400 (nothing changed) while requests
/// or transfers still hold blocks, as SGLang refuses a flush while requests run.
pub async fn flush_cache(State(app): State<Arc<AppState>>) -> AdminReply {
    let flushed = app
        .engine
        .reset_prefix_cache(false, false)
        .await
        .map_err(api_error)?;
    if !flushed {
        return Err(ApiError::bad_request(
            "the cache was not flushed: requests or transfers still hold KV blocks; \
             pause the engine (or let it drain) and retry",
        ));
    }
    Ok(Json(json!({"success": true, "message": "Cache flushed."})))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct MemoryTags {
    pub tags: Option<Vec<String>>,
}

/// The tags a memory route names: `None` for all (absent or empty), else the wake-up tags
/// (possibly none, when only ignored tags were named).
fn memory_tags(body: &[u8]) -> Result<Option<Vec<WakeTag>>, ApiError> {
    let req: MemoryTags = optional_json(body)?;
    match req.tags {
        None => Ok(None),
        Some(t) if t.is_empty() => Ok(None),
        Some(t) => {
            let names: Vec<&str> = t.iter().map(String::as_str).collect();
            wake_tags(&names, "tags", IGNORED_TAGS).map(Some)
        }
    }
}

/// `GET|POST /release_memory_occupation {"tags": [...]}`: sleep level 1 in `keep` mode
/// (running requests are frozen and recompute after the wake-up), then the tags *not* named
/// are woken again, so only the named memory stays released.
pub async fn release_memory_occupation(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let tags = memory_tags(&body)?;
    if tags.as_ref().is_some_and(Vec::is_empty) {
        return Ok(Json(json!({"success": true})));
    }
    app.engine
        .sleep(SleepLevel::L1, PauseMode::Keep)
        .await
        .map_err(api_error)?;
    if let Some(tags) = tags {
        let keep: Vec<WakeTag> = [WakeTag::Weights, WakeTag::KvCache]
            .into_iter()
            .filter(|t| !tags.contains(t))
            .collect();
        if !keep.is_empty() {
            app.engine.wake_up(&keep).await.map_err(api_error)?;
        }
    }
    Ok(Json(json!({"success": true})))
}

/// `GET|POST /resume_memory_occupation {"tags": [...]}`: wakes the named memory (none: all);
/// generation continues once everything is back.
pub async fn resume_memory_occupation(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let tags = memory_tags(&body)?;
    if tags.as_ref().is_some_and(Vec::is_empty) {
        return Ok(Json(json!({"success": true})));
    }
    app.engine
        .wake_up(tags.as_deref().unwrap_or(&[]))
        .await
        .map_err(api_error)?;
    Ok(Json(json!({"success": true})))
}

/// `POST /abort_request`'s body (SGLang's `AbortReq`).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct AbortRequest {
    /// A request's id: its `X-Request-Id`, which `/generate` reports as `meta_info.id`.
    pub rid: Option<String>,
    /// Abort every request in flight (slime drains its servers with it before a weight
    /// update).
    pub abort_all: Option<bool>,
}

/// `POST /abort_request {"rid": ..., "abort_all": bool}` → `{"success": true, "aborted":
/// n}`: aborts one request (every choice of it) or, with `abort_all`, every request. An
/// unknown or finished id aborts nothing.
pub async fn abort_request(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let req: AbortRequest = optional_json(&body)?;
    let ids = match (req.abort_all, req.rid.as_deref()) {
        (Some(true), _) => None,
        (_, Some(rid)) if !rid.is_empty() => Some(app.live.expand(&[rid.to_owned()])),
        _ => {
            return Err(ApiError::invalid(
                "rid",
                "`rid` (a request id) or `abort_all: true` is required",
            ))
        }
    };
    let n = app.engine.abort_requests(ids).await.map_err(api_error)?;
    Ok(Json(json!({"success": true, "aborted": n})))
}

/// `GET /get_weight_version` → `{"weight_version": ...}`.
pub async fn get_weight_version(State(app): State<Arc<AppState>>) -> AdminReply {
    let info = engine_weight_info(&app).await?;
    Ok(Json(json!({"weight_version": info.weight_version})))
}
