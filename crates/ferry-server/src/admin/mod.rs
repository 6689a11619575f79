//! The lifecycle admin API (`../shared/design/lifecycle.md`): pause, resume, sleep, wake-up,
//! KV release, cache reset, aborts and weight updates, under the paths and parameters RL
//! frameworks already call on vLLM, with SGLang's names as aliases ([`sglang`]).
//!
//! Every call is declared once, in `ferry-admin` (its route, methods, arguments and effects):
//! [`routes`] mounts each [`AdminCall`] at its path for its methods, and [`handle`] reads its
//! arguments with [`AdminCall::read`] (a bad one is a 400 naming it and changes nothing), then
//! makes the engine calls its [`Args`] ask for: one exhaustive `match`, so a call added to the
//! table does not build until the server says what it does.
//!
//! Mounted by [`crate::router`] only with `ServerConfig::enable_admin_api` (off: every path
//! here is a 404 like any unknown route), because any client that reaches it can stop the
//! engine or replace its weights. The engine's errors map by variant (the
//! [`crate::error::EngineFailure`] impls in [`failures`]): lifecycle conflicts are 409, a
//! refused weight update or an unreadable model folder is 400, a stopped engine is 503.

pub mod failures;
pub mod lora;
pub mod sglang;
pub mod upload;
pub mod weights;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap};
use axum::routing::on;
use axum::{Json, Router};
use ferry_admin::{AdminCall, Args, Pausing};
use serde_json::{json, Value};

use crate::error::{api_error, ApiError};
use crate::extract::ApiBytes;
use crate::state::AppState;

/// A handler's reply: a small JSON object, or an OpenAI-shaped error.
pub type AdminReply = Result<Json<Value>, ApiError>;

/// Every admin call, at its path, for its methods.
pub fn routes() -> Router<Arc<AppState>> {
    AdminCall::all().fold(Router::new(), |router, call| {
        let decl = call.decl();
        router.route(
            decl.path,
            on(decl.method_filter(), move |State(app), req| {
                handle(app, call, req)
            }),
        )
    })
}

/// Whether the request's body is JSON (`/update_weights` chooses its form by it).
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// One admin call: its arguments read as the table says, then made.
async fn handle(app: Arc<AppState>, call: AdminCall, req: Request) -> AdminReply {
    let (parts, body) = req.into_parts();
    let uri = parts.uri.clone();
    let (args, streamed) = if call.streams_body(is_json(&parts.headers)) {
        let args = call.read(ferry_admin::Request {
            path: uri.path(),
            query: uri.query(),
            body: None,
        })?;
        (args, Some(body))
    } else {
        let ApiBytes(bytes) = ApiBytes::from_request(Request::from_parts(parts, body), &()).await?;
        let args = call.read(ferry_admin::Request {
            path: uri.path(),
            query: uri.query(),
            body: Some(&bytes),
        })?;
        (args, None)
    };
    run(app, args, streamed).await
}

/// Makes the engine calls `args` ask for; `streamed` is the body of a call that streams it.
async fn run(app: Arc<AppState>, args: Args, streamed: Option<Body>) -> AdminReply {
    let engine = &app.engine;
    let reply = match args {
        Args::Pause(Pausing { mode, clear_cache }) => {
            engine.pause(mode, clear_cache).await.map_err(api_error)?;
            json!({"status": "paused"})
        }
        Args::Resume => {
            engine.resume().await.map_err(api_error)?;
            json!({"status": "resumed"})
        }
        Args::IsPaused => json!({"is_paused": engine.is_paused().await.map_err(api_error)?}),
        Args::Sleep { level, mode } => {
            engine.sleep(level, mode).await.map_err(api_error)?;
            json!({"status": "sleeping", "level": level.as_u8()})
        }
        Args::WakeUp { tags } => {
            engine.wake_up(&tags).await.map_err(api_error)?;
            is_sleeping(&app).await?
        }
        Args::IsSleeping => is_sleeping(&app).await?,
        Args::ReleaseKvCacheMemory => {
            engine.release_kv_cache_memory().await.map_err(api_error)?;
            json!({"status": "released"})
        }
        Args::ResetPrefixCache {
            reset_running_requests,
            reset_external,
        } => {
            // What it cleared, by name: with vLLM's default (`reset_external=false`) the
            // offload tier keeps its blocks, and "success" alone reads as "all is cold".
            match engine
                .reset_caches(reset_running_requests, reset_external)
                .await
                .map_err(api_error)?
            {
                Some(cleared) => json!({"success": true, "cleared": cleared.names()}),
                None => json!({"success": false}),
            }
        }
        Args::AbortRequests { ids } => {
            let n = abort(&app, ids).await?;
            json!({"status": "aborted", "aborted": n})
        }
        Args::UpdateWeights(update) => weights::update_weights(&app, update, streamed).await?,
        Args::UpdateWeightsFromDisk {
            model_path,
            weight_version,
            abort_all_requests,
        } => {
            if abort_all_requests {
                engine.abort_requests(None).await.map_err(api_error)?;
            }
            weights::reload(&app, model_path.into(), weight_version).await?
        }
        Args::UpdateWeightVersion { new_version } => {
            engine
                .update_weight_version(new_version.clone())
                .await
                .map_err(api_error)?;
            json!({"success": true, "new_version": new_version})
        }
        Args::WeightInfo => weights::weight_info(&app).await?,
        Args::InitWeightTransferEngine => return Err(weights::needs_collective()),
        Args::BeginUpload { weight_version } => upload::begin(&app, weight_version)?,
        Args::CurrentUpload => upload::current(&app),
        Args::UploadBucket { upload_id } => {
            let body = streamed.expect("a bucket streams its body");
            upload::bucket(&app, upload_id, body).await?
        }
        Args::PrepareUpload { upload_id } => upload::prepare(&app, upload_id).await?,
        Args::CommitUpload {
            upload_id,
            weight_version,
        } => upload::commit(&app, upload_id, weight_version).await?,
        Args::DiscardUpload { upload_id } => upload::discard(&app, &upload_id)?,
        Args::PauseGeneration(Pausing { mode, clear_cache }) => {
            engine.pause(mode, clear_cache).await.map_err(api_error)?;
            json!({"message": "Generation paused successfully.", "status": "ok"})
        }
        Args::ContinueGeneration => {
            engine.resume().await.map_err(api_error)?;
            json!({"message": "Generation continued successfully.", "status": "ok"})
        }
        Args::FlushCache => sglang::flush_cache(&app).await?,
        Args::ReleaseMemoryOccupation { tags } => {
            sglang::release_memory_occupation(&app, tags).await?
        }
        Args::ResumeMemoryOccupation { tags } => {
            sglang::resume_memory_occupation(&app, tags).await?
        }
        Args::GetWeightVersion => {
            let info = weights::engine_weight_info(&app).await?;
            json!({"weight_version": info.weight_version})
        }
        Args::AbortRequest { ids } => {
            let n = abort(&app, ids).await?;
            json!({"success": true, "aborted": n})
        }
        Args::LoadLoraAdapter {
            lora_name,
            lora_path,
            load_inplace,
        } => {
            let info = lora::load(&app, &lora_name, lora_path, load_inplace).await?;
            lora::loaded_json(&info, load_inplace)
        }
        Args::PushLoraAdapter {
            lora_name,
            config,
            load_inplace,
        } => {
            let body = streamed.expect("a push streams its body");
            let info = lora::push(&app, &lora_name, config, body, load_inplace).await?;
            lora::loaded_json(&info, load_inplace)
        }
        Args::UnloadLoraAdapter { lora_name } => {
            let aborted = lora::unload(&app, &lora_name).await?;
            json!({
                "success": true,
                "message": format!("Success: LoRA adapter '{lora_name}' removed successfully."),
                "aborted": aborted,
            })
        }
        Args::SglangLoadLoraAdapter {
            lora_name,
            lora_path,
        } => {
            lora::load(&app, &lora_name, lora_path, false).await?;
            lora::sglang_answer(&app)
        }
        Args::SglangUnloadLoraAdapter { lora_name } => {
            lora::unload(&app, &lora_name).await?;
            lora::sglang_answer(&app)
        }
    };
    Ok(Json(reply))
}

/// `{"is_sleeping": bool}`: true while some tag is still asleep.
async fn is_sleeping(app: &AppState) -> Result<Value, ApiError> {
    let sleeping = app.engine.is_sleeping().await.map_err(api_error)?;
    Ok(json!({"is_sleeping": sleeping}))
}

/// Aborts `ids` (`None`: every request). An id is an `X-Request-Id` of a generation request
/// (every choice of it is aborted) or an engine request id; unknown or finished ids are
/// ignored. Returns how many were aborted.
async fn abort(app: &AppState, ids: Option<Vec<String>>) -> Result<usize, ApiError> {
    let ids = ids.map(|ids| app.live.expand(&ids));
    app.engine.abort_requests(ids).await.map_err(api_error)
}
