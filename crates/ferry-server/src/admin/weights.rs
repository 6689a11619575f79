//! The weight routes of the admin API: a reload from a model folder, a tensor push
//! (safetensors bytes), renaming the weight version, and what the engine reports about its
//! weights.
//!
//! Both updates are checked in full (names, shapes, dtypes) before anything changes, so a
//! refused update is a 400 naming the tensor or field at fault and the weights stay as they
//! were. Neither needs a pause: the engine swaps weights between two steps, and the new
//! weight version seeds every block hash from then on, so no prefix hit crosses the update.
//!
//! A push's body is streamed to the engine as it arrives, never collected: a full push of a
//! model costs the new weights, not the body plus copies of it.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap};
use axum::Json;
use ferry_engine::{WeightInfo, WeightPushError, WeightResidency, WeightUpdateInfo};
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{non_empty, optional_json, QueryArgs};
use super::AdminReply;
use crate::error::{api_error, ApiError};
use crate::extract::ApiBytes;
use crate::state::AppState;

/// `POST /update_weights_from_disk`'s body (SGLang's and vLLM's field names; other SGLang
/// fields such as `load_format` are accepted and ignored).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct UpdateFromDisk {
    pub model_path: Option<String>,
    pub weight_version: Option<String>,
    /// SGLang's: abort every request in flight before the update (they end with
    /// `finish_reason` `abort`), so that none runs on across it.
    pub abort_all_requests: Option<bool>,
}

/// `POST /update_weights_from_disk {"model_path": ..., "weight_version": optional,
/// "abort_all_requests": optional}`: reloads every weight from a model folder (or GGUF file)
/// of the same model.
pub async fn update_weights_from_disk(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let req: UpdateFromDisk = optional_json(&body)?;
    let path = match req.model_path.as_deref() {
        None => return Err(ApiError::invalid("model_path", "`model_path` is required")),
        Some("") => return Err(ApiError::invalid("model_path", "`model_path` is empty")),
        Some(p) => PathBuf::from(p),
    };
    let version = non_empty(req.weight_version, "weight_version")?;
    if req.abort_all_requests == Some(true) {
        app.engine.abort_requests(None).await.map_err(api_error)?;
    }
    reload(&app, path, version).await
}

/// Reloads every weight from `path` (a model folder or GGUF file).
async fn reload(app: &AppState, path: PathBuf, version: Option<String>) -> AdminReply {
    let info = app
        .engine
        .update_weights_from_disk(path, version)
        .await
        .map_err(api_error)?;
    Ok(Json(update_reply(&info, "weights reloaded from disk")))
}

/// `POST /update_weights` with a JSON body (`Content-Type: application/json`): prime-rl's
/// `{"weight_dir": ...}`, and vLLM's `{"update_info": ...}`, which is refused.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct UpdateWeightsJson {
    /// A folder of the same model's weights, loaded as `/update_weights_from_disk` loads
    /// `model_path`.
    pub weight_dir: Option<String>,
    pub weight_version: Option<String>,
    /// vLLM's NCCL weight transfer (names, dtypes, shapes of tensors broadcast over a GPU
    /// collective): refused with a 400 naming what ferry offers instead.
    #[schema(value_type = Option<Object>)]
    pub update_info: Option<Value>,
}

/// The 400 for vLLM's `update_info`.
pub const NEEDS_COLLECTIVE: &str = "`update_info` asks for vLLM's NCCL weight transfer, which \
    needs a GPU collective between the trainer and this server; ferry has none. Send the \
    weights instead: the safetensors bytes as the body of `POST /update_weights` \
    (Content-Type: application/octet-stream), a folder with `POST /update_weights \
    {\"weight_dir\": ...}`, or a model folder with `POST /update_weights_from_disk \
    {\"model_path\": ...}`";

/// `POST /init_weight_transfer_engine` (vLLM's: joins an NCCL group with the trainer, as
/// TRL's async GRPO and SkyRL do before `{"update_info": ...}` pushes): a 400 saying it needs
/// a GPU collective and what ferry offers instead.
pub async fn init_weight_transfer_engine() -> ApiError {
    ApiError::invalid(
        "init_info",
        "`/init_weight_transfer_engine` joins vLLM's NCCL weight-transfer group, which needs a \
         GPU collective between the trainer and this server; ferry has none. Send the weights \
         instead: the safetensors bytes as the body of `POST /update_weights` (Content-Type: \
         application/octet-stream), a folder with `POST /update_weights {\"weight_dir\": ...}`, \
         or a model folder with `POST /update_weights_from_disk {\"model_path\": ...}`",
    )
}

/// `POST /update_weights`: the body's `Content-Type` chooses the form. `application/json`:
/// `{"weight_dir": ..., "weight_version": optional}` reloads every weight from that folder
/// (prime-rl's weight sync, between `/pause?mode=keep` and `/resume`), and vLLM's
/// `{"update_info": ...}` is a 400 ([`NEEDS_COLLECTIVE`]). Anything else is a safetensors
/// push ([`push_safetensors`]).
pub async fn push(
    State(app): State<Arc<AppState>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> AdminReply {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return push_safetensors(app, raw, body).await;
    }
    let q = QueryArgs::parse(raw.as_deref(), &["weight_version"])?;
    let bytes = axum::body::to_bytes(body, crate::MAX_BODY_BYTES)
        .await
        .map_err(|e| ApiError::invalid("body", format!("could not read the JSON body: {e}")))?;
    let req: UpdateWeightsJson = optional_json(&bytes)?;
    if req.update_info.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid("update_info", NEEDS_COLLECTIVE));
    }
    let path = match req.weight_dir.as_deref() {
        None => {
            return Err(ApiError::invalid(
                "weight_dir",
                "`weight_dir` is required in a JSON body (or send safetensors bytes as \
                 application/octet-stream)",
            ))
        }
        Some("") => return Err(ApiError::invalid("weight_dir", "`weight_dir` is empty")),
        Some(p) => PathBuf::from(p),
    };
    let version = match non_empty(req.weight_version, "weight_version")? {
        Some(v) => Some(v),
        None => q.non_empty("weight_version")?,
    };
    reload(&app, path, version).await.map_err(|mut e| {
        if e.param.as_deref() == Some("model_path") {
            e.param = Some("weight_dir".to_owned());
        }
        e
    })
}

/// `POST /update_weights?weight_version=v7` with a safetensors body (`Content-Type:
/// application/octet-stream`): replaces the named parameters (some or all). The body may be
/// up to `ServerConfig::max_weight_push_bytes`; it is converted as it arrives.
async fn push_safetensors(app: Arc<AppState>, raw: Option<String>, body: Body) -> AdminReply {
    let q = QueryArgs::parse(raw.as_deref(), &["weight_version"])?;
    let version = q.non_empty("weight_version")?;
    let mut body = Box::pin(limited(body, app.config.max_weight_push_bytes)?);
    match app
        .engine
        .update_weights_from_safetensors_stream(&mut body, version)
        .await
    {
        Ok(info) => Ok(Json(update_reply(&info, "weights updated"))),
        Err(e) => Err(refusal(e, &mut body).await),
    }
}

/// A push or bucket that failed, as the client's answer. A refused one leaves the body
/// unread: it is read out (within the limit), so the client, still sending, gets the 400
/// rather than a reset connection.
pub(super) async fn refusal(
    e: WeightPushError<BodyError>,
    rest: &mut (impl Stream<Item = Result<Bytes, BodyError>> + Unpin),
) -> ApiError {
    match e {
        WeightPushError::Body(e) => e.into(),
        WeightPushError::Update(e) => {
            while let Some(Ok(_)) = rest.next().await {}
            api_error(e)
        }
    }
}

/// Why a pushed body could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum BodyError {
    #[error("the safetensors body is over {limit} bytes (see --max-weight-push-bytes)")]
    TooLarge { limit: usize },
    #[error("could not read the safetensors body: {0}")]
    Read(axum::Error),
    #[error(
        "the safetensors body stalled: no bytes for {:.0} s (see --weight-upload-timeout-seconds)",
        timeout.as_secs_f64()
    )]
    Stalled { timeout: std::time::Duration },
}

impl From<BodyError> for ApiError {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::TooLarge { .. } => ApiError::too_large(e.to_string()),
            BodyError::Read(_) => ApiError::invalid("body", e.to_string()),
            // The client's body, not an upstream, outlasted the bound: 408, not 504.
            BodyError::Stalled { .. } => ApiError {
                status: axum::http::StatusCode::REQUEST_TIMEOUT,
                ..ApiError::timeout(e.to_string())
            },
        }
    }
}

/// The body's pieces, ending with `TooLarge` once more than `limit` bytes came; a declared
/// length over the limit is refused before a byte is read.
pub(super) fn limited(
    body: Body,
    limit: usize,
) -> Result<impl Stream<Item = Result<Bytes, BodyError>>, ApiError> {
    if body.size_hint().lower() > limit as u64 {
        return Err(BodyError::TooLarge { limit }.into());
    }
    let mut n_read = 0usize;
    Ok(body.into_data_stream().map(move |piece| {
        let piece = piece.map_err(BodyError::Read)?;
        n_read = n_read.saturating_add(piece.len());
        if n_read > limit {
            return Err(BodyError::TooLarge { limit });
        }
        Ok(piece)
    }))
}

pub(super) fn update_reply(info: &WeightUpdateInfo, message: &str) -> Value {
    json!({
        "success": true,
        "message": message,
        "weight_version": info.weight_version,
        "n_tensors": info.n_tensors,
        "n_bytes": info.n_bytes,
        "complete": info.complete,
        "prepare_seconds": info.prepare_seconds,
        "install_seconds": info.install_seconds,
        "in_place": info.in_place,
    })
}

/// `POST /update_weight_version`'s body.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct UpdateWeightVersion {
    pub new_version: Option<String>,
}

/// `POST /update_weight_version {"new_version": ...}`: renames the weights now loaded (no
/// weight changes); prefix-cache entries of the old name are never hit again.
pub async fn update_weight_version(
    State(app): State<Arc<AppState>>,
    ApiBytes(body): ApiBytes,
) -> AdminReply {
    let req: UpdateWeightVersion = optional_json(&body)?;
    let version = non_empty(req.new_version, "new_version")?
        .ok_or_else(|| ApiError::invalid("new_version", "`new_version` is required"))?;
    app.engine
        .update_weight_version(version.clone())
        .await
        .map_err(api_error)?;
    Ok(Json(json!({"success": true, "new_version": version})))
}

/// `GET /weight_info` → `{"weight_version", "n_weight_updates", "residency", "weight_bytes"}`
/// (`resident`, `offloaded` by sleep level 1, `dropped` by sleep level 2 or a failed reload
/// in place, `reloading` while one runs; the bytes of the weights held, each tensor in its
/// stored dtype).
pub async fn weight_info(State(app): State<Arc<AppState>>) -> AdminReply {
    let info = engine_weight_info(&app).await?;
    Ok(Json(json!({
        "weight_version": info.weight_version,
        "n_weight_updates": info.n_weight_updates,
        "residency": residency_name(info.residency),
        "weight_bytes": info.n_bytes,
    })))
}

pub(super) async fn engine_weight_info(app: &AppState) -> Result<WeightInfo, ApiError> {
    app.engine.weight_info().await.map_err(api_error)
}

fn residency_name(r: WeightResidency) -> &'static str {
    match r {
        WeightResidency::Resident => "resident",
        WeightResidency::Offloaded => "offloaded",
        WeightResidency::Dropped => "dropped",
        WeightResidency::Reloading => "reloading",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunked body (no length declared) is cut off past the limit, as it arrives: the
    /// pieces within it pass whole, the one that crosses it is `TooLarge`. (Over HTTP the
    /// client may still be sending when the 413 comes, so this is checked here.)
    #[tokio::test]
    async fn a_body_past_the_limit_ends_with_too_large() {
        let pieces = |n: usize, len: usize| {
            let pieces = (0..n).map(move |_| Ok::<_, std::io::Error>(vec![1u8; len]));
            Body::from_stream(futures_util::stream::iter(pieces))
        };
        let body = pieces(3, 40);
        assert_eq!(body.size_hint().lower(), 0, "no declared length");
        let got: Vec<_> = limited(body, 100).unwrap().collect().await;
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].as_ref().unwrap().len(), 40);
        assert_eq!(got[1].as_ref().unwrap().len(), 40);
        assert!(matches!(got[2], Err(BodyError::TooLarge { limit: 100 })));
        let got: Vec<_> = limited(pieces(2, 50), 100).unwrap().collect().await;
        assert!(got.iter().all(Result::is_ok) && got.len() == 2);
    }
}
