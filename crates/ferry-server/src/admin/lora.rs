//! The LoRA adapter calls: vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
//! SGLang's `/load_lora_adapter` and `/unload_lora_adapter`. The folder is read and checked
//! off the engine thread; the engine swaps the adapter in between two steps
//! (`EngineHandle::load_lora`). An adapter loaded here is pinned: only an unload removes it.

use axum::body::Body;
use ferry_engine::{LoraCallError, LoraInfo};
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::upload::stalls_after;
use super::weights::limited;

use crate::error::{api_error, ApiError};
use crate::state::AppState;

/// Loads (or, `inplace`, replaces) the adapter `name` from the PEFT folder `path`.
pub async fn load(
    app: &AppState,
    name: &str,
    path: String,
    inplace: bool,
) -> Result<LoraInfo, ApiError> {
    if name == app.config.served_model_name {
        return Err(api_error(LoraCallError::BaseName(name.to_owned())));
    }
    app.engine
        .load_lora_from_dir(name, path.into(), inplace, true)
        .await
        .map_err(api_error)
}

/// Loads (or, `inplace`, replaces) the adapter `name` from its `config` (the text of an
/// `adapter_config.json`) and `body`, a safetensors file of its tensors (read whole: an
/// adapter is a few MB; `--max-weight-push-bytes` bounds it, and a body that stalls for
/// `--weight-upload-timeout-seconds` is a 408).
pub async fn push(
    app: &AppState,
    name: &str,
    config: String,
    body: Body,
    inplace: bool,
) -> Result<LoraInfo, ApiError> {
    if name == app.config.served_model_name {
        return Err(api_error(LoraCallError::BaseName(name.to_owned())));
    }
    if app.engine.lora_settings().is_none() {
        return Err(api_error(LoraCallError::Disabled));
    }
    let body = limited(body, app.config.max_weight_push_bytes)?;
    let mut pieces = Box::pin(stalls_after(body, app.config.weight_upload_timeout));
    let mut bytes = Vec::new();
    while let Some(piece) = pieces.next().await {
        bytes.extend_from_slice(&piece?);
    }
    app.engine
        .load_lora_from_bytes(name, config, bytes, inplace)
        .await
        .map_err(api_error)
}

/// Unloads the adapter `name`; how many of its requests in flight were aborted.
pub async fn unload(app: &AppState, name: &str) -> Result<usize, ApiError> {
    app.engine.unload_lora(name).await.map_err(api_error)
}

/// vLLM's success message, with what ferry adds: the adapter's version (the one every later
/// token under it reports in `lora_versions`), id and rank.
pub fn loaded_json(info: &LoraInfo, inplace: bool) -> Value {
    let name = &info.name;
    json!({
        "success": true,
        "message": if inplace {
            format!("Success: LoRA adapter '{name}' reloaded in place successfully.")
        } else {
            format!("Success: LoRA adapter '{name}' added successfully.")
        },
        "lora_name": name,
        "lora_version": info.version,
        "lora_int_id": info.id.0,
        "rank": info.rank,
    })
}

/// SGLang's answer: `success`, `error_message` and every adapter loaded, by name, with its
/// path (`null` when it was pushed).
pub fn sglang_answer(app: &AppState) -> Value {
    let loaded: serde_json::Map<String, Value> = app
        .engine
        .loras()
        .into_iter()
        .map(|l| (l.name, json!(l.source)))
        .collect();
    json!({"success": true, "error_message": "", "loaded_adapters": loaded})
}
