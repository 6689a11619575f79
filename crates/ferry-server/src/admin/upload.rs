//! Bucketed weight uploads: a trainer sends its state dict as several safetensors bodies
//! (buckets) as it produces them, and one commit installs every staged tensor at once under
//! the new version ([docs/weight-sync.md](../../../../docs/weight-sync.md)).
//!
//! ```text
//! POST   /weight_uploads                   {"weight_version"?}  → {"upload_id", ...}
//! POST   /weight_uploads/{upload_id}/buckets      safetensors body     → what it staged
//! POST   /weight_uploads/{upload_id}/prepare                           → ready to commit
//! POST   /weight_uploads/{upload_id}/commit       {"weight_version"?}  → the update's reply
//! DELETE /weight_uploads/{upload_id}                                   → discarded
//! GET    /weight_uploads                                        → the open upload, or null
//! ```
//!
//! One upload at a time (a second is a 409 naming the open one). Each bucket is read as it
//! arrives straight into staged buffers (`ferry_model::WeightUpload`); nothing reaches the
//! engine before the commit, which installs between two steps, so every token is computed
//! by the old weights or the new, never a mix. `prepare` is the first phase of a commit across
//! instances (the proxy's): it joins the buckets and checks the update can be installed, so
//! the commit that follows only installs.
//!
//! What fails discards the whole upload and frees what it staged, so nothing half-staged can
//! be committed: a bucket that does not match the model (a 400 naming the tensor), a body cut
//! off or stalled mid-bucket, a refused prepare, and an upload that no call touches for
//! `ServerConfig::weight_upload_timeout` (`--weight-upload-timeout-seconds`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use ferry_engine::PreparedWeights;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};

use super::weights::{limited, refusal, update_reply, BodyError};
use crate::error::{api_error, ApiError};
use crate::state::AppState;
use crate::uploads::{free, Claim, Open, Stage, Taken};

/// `POST /weight_uploads {"weight_version"?}`: opens an upload (409 while one is open).
pub fn begin(app: &Arc<AppState>, version: Option<String>) -> Result<Value, ApiError> {
    let id = format!("upload-{}", &crate::extract::random_id()[..16]);
    {
        let mut open = app.uploads.lock();
        if let Some(u) = open.as_ref() {
            return Err(ApiError::conflict(format!(
                "weight upload `{}` is open: commit or discard it first (DELETE \
                 /weight_uploads/{})",
                u.id, u.id
            )));
        }
        *open = Some(Open {
            id: id.clone(),
            version,
            stage: Stage::Staging(app.engine.weight_upload()),
            n_buckets: 0,
            touched: Instant::now(),
        });
    }
    let timeout = app.config.weight_upload_timeout;
    tokio::spawn(expire(app.clone(), id.clone(), timeout));
    Ok(json!({
        "upload_id": id,
        "timeout_seconds": timeout.as_secs_f64(),
    }))
}

/// Discards the upload `id` once no call has touched it for `timeout` (a call in progress
/// keeps it: a bucket's body has its own bound, the same timeout between pieces).
async fn expire(app: Arc<AppState>, id: String, timeout: Duration) {
    loop {
        let due = {
            let open = app.uploads.lock();
            match open.as_ref() {
                Some(u) if u.id == id => u.touched + timeout,
                _ => return,
            }
        };
        tokio::time::sleep_until(due.into()).await;
        let mut open = app.uploads.lock();
        let idle = open.as_ref().is_some_and(|u| {
            u.id == id && !matches!(u.stage, Stage::Busy(_)) && u.touched.elapsed() >= timeout
        });
        if idle {
            tracing::warn!(
                upload_id = %id,
                "weight upload discarded: no call for {:.0} s",
                timeout.as_secs_f64()
            );
            free(open.take());
            return;
        }
    }
}

/// `GET /weight_uploads` → `{"upload": null}` or the open upload's id, stage and counts.
pub fn current(app: &AppState) -> Value {
    let open = app.uploads.lock();
    let upload = open.as_ref().map(|u| {
        let (stage, n_tensors, n_bytes) = match &u.stage {
            Stage::Staging(w) => ("staging", w.n_tensors(), w.n_bytes()),
            Stage::Busy(doing) => (*doing, 0, 0),
            Stage::Prepared(p) => ("prepared", p.n_tensors, p.n_bytes),
        };
        json!({
            "upload_id": u.id,
            "stage": stage,
            "n_buckets": u.n_buckets,
            "n_tensors": n_tensors,
            "n_bytes": n_bytes,
            "idle_seconds": u.touched.elapsed().as_secs_f64(),
        })
    });
    json!({ "upload": upload })
}

/// `POST /weight_uploads/{upload_id}/buckets` with a safetensors body: stages its tensors. A bucket
/// may not repeat a tensor an earlier one sent. On any error the upload is discarded.
pub async fn bucket(app: &AppState, id: String, body: Body) -> Result<Value, ApiError> {
    let body = limited(body, app.config.max_weight_push_bytes)?;
    let stage = app.uploads.take(&id, "receiving a bucket")?.stage;
    let Stage::Staging(mut upload) = stage else {
        app.uploads.put(&id, stage, false);
        return Err(ApiError::conflict(format!(
            "upload `{id}` is prepared: commit or discard it"
        )));
    };
    let claim = Claim::new(&app.uploads, &id);
    let timeout = app.config.weight_upload_timeout;
    // Fused: the refusal below reads on past the end the engine may have reached.
    let mut pieces = Box::pin(stalls_after(body, timeout).fuse());
    match app.engine.upload_bucket(&mut upload, &mut pieces).await {
        Ok(info) => {
            claim.release();
            let (n_tensors, n_bytes) = (upload.n_tensors(), upload.n_bytes());
            let n_bucket = upload.n_buckets();
            app.uploads.put(&id, Stage::Staging(upload), true);
            Ok(json!({
                "upload_id": id,
                "bucket": n_bucket,
                "n_tensors": info.n_tensors,
                "n_bytes": info.n_bytes,
                "staged_tensors": n_tensors,
                "staged_bytes": n_bytes,
            }))
        }
        Err(e) => {
            // Still claimed while the rest of the body is read out.
            let error = refusal(e, &mut pieces).await;
            claim.release();
            Err(app
                .uploads
                .discard_after(&id, Some(Stage::Staging(upload)), error))
        }
    }
}

/// The body's pieces, ending with `Stalled` when none comes for `timeout`.
pub(super) fn stalls_after(
    body: impl Stream<Item = Result<Bytes, BodyError>> + Unpin,
    timeout: Duration,
) -> impl Stream<Item = Result<Bytes, BodyError>> {
    futures_util::stream::unfold(Some(body), move |body| async move {
        let mut body = body?;
        match tokio::time::timeout(timeout, body.next()).await {
            Ok(Some(Ok(piece))) => Some((Ok(piece), Some(body))),
            Ok(Some(Err(e))) => Some((Err(e), None)),
            Ok(None) => None,
            Err(_) => Some((Err(BodyError::Stalled { timeout }), None)),
        }
    })
}

/// `POST /weight_uploads/{upload_id}/prepare`: joins the buckets into the update the commit
/// installs and checks it can be installed now (weights dropped by sleep level 2 take only a
/// complete set). A refusal discards the upload.
pub async fn prepare(app: &AppState, id: String) -> Result<Value, ApiError> {
    let (n_buckets, _, prepared) = prepared(app, &id).await?;
    let reply = json!({
        "upload_id": id,
        "prepared": true,
        "n_buckets": n_buckets,
        "n_tensors": prepared.n_tensors,
        "n_bytes": prepared.n_bytes,
        "complete": prepared.complete,
    });
    app.uploads.put(&id, Stage::Prepared(prepared), false);
    Ok(reply)
}

/// Takes the upload `id` and prepares it unless it was; on a refusal it is discarded.
/// Returns its buckets, its version and the update.
async fn prepared(
    app: &AppState,
    id: &str,
) -> Result<(usize, Option<String>, PreparedWeights), ApiError> {
    let Taken {
        stage,
        version,
        n_buckets,
    } = app.uploads.take(id, "preparing")?;
    match stage {
        Stage::Prepared(p) => Ok((n_buckets, version, p)),
        Stage::Busy(_) => unreachable!("take refuses a busy upload"),
        Stage::Staging(upload) if upload.n_buckets() == 0 => {
            app.uploads.put(id, Stage::Staging(upload), false);
            Err(ApiError::invalid(
                "upload_id",
                format!("upload `{id}` holds no bucket yet"),
            ))
        }
        Stage::Staging(upload) => {
            let claim = Claim::new(&app.uploads, id);
            let finished = app.engine.finish_upload(upload).await;
            claim.release();
            match finished {
                Ok(p) => Ok((n_buckets, version, p)),
                Err(e) => Err(app.uploads.discard_after(id, None, api_error(e))),
            }
        }
    }
}

/// `POST /weight_uploads/{upload_id}/commit {"weight_version"?}` (or `?weight_version=`): prepares
/// the upload unless it was, then installs every staged tensor at once between two steps.
/// The version: the commit's (`named`), else the start's, else the previous one bumped.
pub async fn commit(app: &AppState, id: String, named: Option<String>) -> Result<Value, ApiError> {
    let started = Instant::now();
    let (n_buckets, begun, prepared) = prepared(app, &id).await?;
    // The upload ends here either way: installed, or refused with nothing changed.
    app.uploads.end(&id);
    let info = app
        .engine
        .install_upload(prepared, named.or(begun))
        .await
        .map_err(api_error)?;
    let mut reply = update_reply(&info, "weight upload committed");
    reply["upload_id"] = json!(id);
    reply["n_buckets"] = json!(n_buckets);
    reply["commit_seconds"] = json!(started.elapsed().as_secs_f64());
    Ok(reply)
}

/// `DELETE /weight_uploads/{upload_id}`: discards the upload and frees what it staged (409 while a
/// call is reading a bucket of it: that call's error discards it).
pub fn discard(app: &AppState, id: &str) -> Result<Value, ApiError> {
    let stage = app.uploads.take(id, "being discarded")?.stage;
    let open = app.uploads.end(id);
    tokio::task::spawn_blocking(move || drop((stage, open)));
    Ok(json!({"upload_id": id, "discarded": true}))
}
