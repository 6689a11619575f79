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
use ferry_admin::UpdateWeights;
use ferry_engine::{WeightInfo, WeightPushError, WeightResidency, WeightUpdateInfo};
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};

use crate::error::{api_error, ApiError};
use crate::state::AppState;

/// `POST /update_weights`: by the body's `Content-Type`, safetensors bytes pushed
/// ([`push_safetensors`]), or JSON `{"weight_dir": ..., "weight_version": optional}`, which
/// reloads every weight from that folder (prime-rl's weight sync, between
/// `/pause?mode=keep` and `/resume`; vLLM's `{"update_info": ...}` was refused as it was
/// read).
pub async fn update_weights(
    app: &Arc<AppState>,
    update: UpdateWeights,
    streamed: Option<Body>,
) -> Result<Value, ApiError> {
    match update {
        UpdateWeights::Push { weight_version } => {
            let body = streamed.expect("a push streams its body");
            push_safetensors(app, weight_version, body).await
        }
        UpdateWeights::Folder {
            weight_dir,
            weight_version,
        } => reload(app, weight_dir.into(), weight_version)
            .await
            .map_err(|mut e| {
                if e.param.as_deref() == Some("model_path") {
                    e.param = Some("weight_dir".to_owned());
                }
                e
            }),
    }
}

/// Reloads every weight from `path` (a model folder or GGUF file) of the same model
/// (`POST /update_weights_from_disk {"model_path": ...}`).
pub async fn reload(
    app: &AppState,
    path: PathBuf,
    version: Option<String>,
) -> Result<Value, ApiError> {
    let info = app
        .engine
        .update_weights_from_disk(path, version)
        .await
        .map_err(api_error)?;
    Ok(update_reply(&info, "weights reloaded from disk"))
}

/// `POST /init_weight_transfer_engine` (vLLM's: joins an NCCL group with the trainer, as
/// TRL's async GRPO and SkyRL do before `{"update_info": ...}` pushes): a 400 saying it needs
/// a GPU collective and what ferry offers instead.
pub fn needs_collective() -> ApiError {
    ApiError::invalid(
        "init_info",
        "`/init_weight_transfer_engine` joins vLLM's NCCL weight-transfer group, which needs a \
         GPU collective between the trainer and this server; ferry has none. Send the weights \
         instead: the safetensors bytes as the body of `POST /update_weights` (Content-Type: \
         application/octet-stream), a folder with `POST /update_weights {\"weight_dir\": ...}`, \
         or a model folder with `POST /update_weights_from_disk {\"model_path\": ...}`",
    )
}

/// `POST /update_weights?weight_version=v7` with a safetensors body (`Content-Type:
/// application/octet-stream`): replaces the named parameters (some or all). The body may be
/// up to `ServerConfig::max_weight_push_bytes`; it is converted as it arrives.
async fn push_safetensors(
    app: &AppState,
    version: Option<String>,
    body: Body,
) -> Result<Value, ApiError> {
    let mut body = Box::pin(limited(body, app.config.max_weight_push_bytes)?);
    match app
        .engine
        .update_weights_from_safetensors_stream(&mut body, version)
        .await
    {
        Ok(info) => Ok(update_reply(&info, "weights updated")),
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

/// `GET /weight_info` → `{"weight_version", "n_weight_updates", "residency", "weight_bytes"}`
/// (`resident`, `offloaded` by sleep level 1, `dropped` by sleep level 2 or a failed reload
/// in place, `reloading` while one runs; the bytes of the weights held, each tensor in its
/// stored dtype).
pub async fn weight_info(app: &AppState) -> Result<Value, ApiError> {
    let info = engine_weight_info(app).await?;
    Ok(json!({
        "weight_version": info.weight_version,
        "n_weight_updates": info.n_weight_updates,
        "residency": residency_name(info.residency),
        "weight_bytes": info.n_bytes,
    }))
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
