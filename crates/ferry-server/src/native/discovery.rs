//! SGLang's discovery routes, which RL frameworks read before they generate: `GET
//! /server_info` (and its older name `/get_server_info`; slime and miles compare these
//! server arguments with their own in external-engine mode), `GET /model_info` (and
//! `/get_model_info`), `GET /health_generate`, and vLLM's `GET /get_world_size` (SkyRL sizes
//! its weight-sync group from it).
//!
//! ferry is one process on one device: every parallel size is 1.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use ferry_engine::FinishReason;
use serde_json::{json, Map, Value};

use super::as_completions;
use crate::error::ApiError;
use crate::extract::RequestId;
use crate::generate::start;
use crate::state::AppState;

/// How long `/health_generate`'s one-token generation may take before the server counts as
/// unhealthy (a paused or sleeping engine never finishes it).
pub const HEALTH_GENERATE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the model came from (the served name when the server was not told).
fn model_path(app: &AppState) -> String {
    app.config
        .model_path
        .clone()
        .unwrap_or_else(|| app.config.served_model_name.clone())
}

async fn weight_version(app: &AppState) -> Result<String, ApiError> {
    app.engine
        .weight_info()
        .await
        .map(|i| i.weight_version)
        .map_err(crate::error::api_error)
}

/// `GET /server_info` (`/get_server_info`): SGLang's server arguments as far as ferry has
/// them. `enable_memory_saver` is true: `/release_memory_occupation` and
/// `/resume_memory_occupation` work without a flag.
pub async fn server_info(State(app): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let sched = app.engine.scheduler_config();
    let path = model_path(&app);
    Ok(Json(json!({
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": app.config.served_model_name,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "enable_memory_saver": true,
        "skip_tokenizer_init": app.engine.tokenizer().is_none(),
        "is_embedding": false,
        "context_length": app.limits.max_model_len,
        "page_size": sched.block_size,
        "max_total_num_tokens": sched.n_blocks as usize * sched.block_size,
        "max_running_requests": sched.max_num_seqs,
        "chunked_prefill_size": sched.max_num_batched_tokens,
        "disable_radix_cache": !sched.enable_prefix_caching,
        "enable_return_routed_experts": app.engine.routing_shape().is_some(),
        "weight_version": weight_version(&app).await?,
        "version": env!("CARGO_PKG_VERSION"),
        "engine": "ferry",
    })))
}

/// `GET /model_info` (`/get_model_info`).
pub async fn model_info(State(app): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let path = model_path(&app);
    Ok(Json(json!({
        "model_path": path,
        "tokenizer_path": path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "weight_version": weight_version(&app).await?,
    })))
}

/// `GET /get_world_size` → `{"world_size": 1}` (vLLM's: the ranks of one server).
pub async fn world_size() -> Json<Value> {
    Json(json!({"world_size": 1}))
}

/// `GET /health_generate`: 200 once a one-token greedy generation (prompt: token 0, as
/// SGLang's) finishes within [`HEALTH_GENERATE_TIMEOUT`]; else 503 saying why. It runs
/// through the same path as every generation request.
pub async fn health_generate(
    State(app): State<Arc<AppState>>,
    Extension(RequestId(id)): Extension<RequestId>,
) -> Response {
    match tokio::time::timeout(HEALTH_GENERATE_TIMEOUT, one_token(&app, id)).await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => ApiError::unavailable(format!("a one-token generation failed: {}", e.message))
            .into_response(),
        Err(_) => ApiError::unavailable(format!(
            "a one-token generation did not finish within {HEALTH_GENERATE_TIMEOUT:?} (is the engine paused or asleep?)"
        ))
        .into_response(),
    }
}

/// The one-token generation, under the health request's own id.
async fn one_token(app: &AppState, id: String) -> Result<(), ApiError> {
    let mut body = Map::new();
    body.insert("prompt".into(), json!([0]));
    body.insert("max_tokens".into(), json!(1));
    body.insert("temperature".into(), json!(0));
    let (prompts, params) = as_completions(app, vec![body], |_, p| p.to_owned())?;
    let (_, choices) = start(app, id, &prompts, &params, "prompt", Instant::now()).await?;
    for choice in choices {
        let c = choice.collect().await;
        match c.finish.map(|f| f.reason) {
            Some(FinishReason::Stop | FinishReason::Length) => {}
            other => {
                return Err(ApiError::unavailable(format!(
                    "it ended with {}",
                    other.map_or("no finish", FinishReason::as_str)
                )))
            }
        }
    }
    Ok(())
}
