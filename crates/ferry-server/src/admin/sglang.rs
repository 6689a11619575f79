//! SGLang's names for the lifecycle routes, in SGLang's request and response shapes, so RL
//! frameworks written against SGLang (verl, slime, ...) drive ferry unchanged. Their routes
//! and arguments are declared in `ferry-admin` with the rest; what is here is how the ones
//! that are more than a rename act on the engine.
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

use ferry_engine::{PauseMode, SleepLevel, WakeTag};
use serde_json::{json, Value};

use crate::error::{api_error, ApiError};
use crate::state::AppState;

/// `GET|POST /flush_cache`: drops every cached prefix; 400 (nothing changed) while requests
/// or transfers still hold blocks, as SGLang refuses a flush while requests run.
pub async fn flush_cache(app: &AppState) -> Result<Value, ApiError> {
    let Some(cleared) = app
        .engine
        .reset_caches(false, false)
        .await
        .map_err(api_error)?
    else {
        return Err(ApiError::bad_request(
            "the cache was not flushed: requests or transfers still hold KV blocks; \
             pause the engine (or let it drain) and retry",
        ));
    };
    Ok(json!({"success": true, "message": "Cache flushed.", "cleared": cleared.names()}))
}

/// `GET|POST /release_memory_occupation {"tags": [...]}`: sleep level 1 in `keep` mode
/// (running requests are frozen and recompute after the wake-up), then the tags *not* named
/// are woken again, so only the named memory stays released. `tags`: `None` for all, none
/// when only tags ferry has nothing of were named (nothing to do).
pub async fn release_memory_occupation(
    app: &AppState,
    tags: Option<Vec<WakeTag>>,
) -> Result<Value, ApiError> {
    if tags.as_ref().is_some_and(Vec::is_empty) {
        return Ok(json!({"success": true}));
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
    Ok(json!({"success": true}))
}

/// `GET|POST /resume_memory_occupation {"tags": [...]}`: wakes the named memory (none: all);
/// generation continues once everything is back.
pub async fn resume_memory_occupation(
    app: &AppState,
    tags: Option<Vec<WakeTag>>,
) -> Result<Value, ApiError> {
    if tags.as_ref().is_some_and(Vec::is_empty) {
        return Ok(json!({"success": true}));
    }
    app.engine
        .wake_up(tags.as_deref().unwrap_or(&[]))
        .await
        .map_err(api_error)?;
    Ok(json!({"success": true}))
}
