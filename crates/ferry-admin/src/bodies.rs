//! The admin calls' JSON bodies, as vLLM's and SGLang's clients send them. Each is read by
//! [`crate::AdminCall::read`] and named in the table ([`crate::Body::Json`]); with the
//! `openapi` feature each is also its own schema in the server's `/openapi.json`.

use serde::Deserialize;
use serde_json::Value;

/// `POST /sleep`'s optional JSON body (SkyRL sends `{"level": 1}`): the query's arguments;
/// one the body sets wins over the query's.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SleepBody {
    pub level: Option<u8>,
    /// `abort`, `wait` or `keep`.
    pub mode: Option<String>,
}

/// `POST /wake_up`'s optional JSON body (SkyRL sends `{"tags": [...]}`); its tags replace
/// the query's.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WakeUpBody {
    pub tags: Option<Vec<String>>,
}

/// `POST /reset_prefix_cache`'s optional JSON body (SkyRL sends its argument there): the
/// same arguments as the query string; one the body sets wins over the query's.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResetPrefixCache {
    pub reset_running_requests: Option<bool>,
    pub reset_external: Option<bool>,
}

/// `POST /abort_requests`'s body (absent or empty: abort everything).
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AbortRequests {
    pub request_ids: Option<Vec<String>>,
}

/// `POST /v1/load_lora_adapter`'s body (vLLM's; SGLang's `/load_lora_adapter` sends the
/// same names without `load_inplace`; other fields are ignored).
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LoadLoraAdapter {
    pub lora_name: Option<String>,
    /// A PEFT folder: `adapter_config.json` and `adapter_model.safetensors`.
    pub lora_path: Option<String>,
    /// Replace a loaded adapter's weights (vLLM's; default false).
    pub load_inplace: Option<bool>,
}

/// `POST /v1/unload_lora_adapter`'s body (and SGLang's `/unload_lora_adapter`'s).
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UnloadLoraAdapter {
    pub lora_name: Option<String>,
}

/// `POST /update_weights_from_disk`'s body (SGLang's and vLLM's field names; other SGLang
/// fields such as `load_format` are accepted and ignored).
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UpdateFromDisk {
    pub model_path: Option<String>,
    pub weight_version: Option<String>,
    /// SGLang's: abort every request in flight before the update (they end with
    /// `finish_reason` `abort`), so that none runs on across it.
    pub abort_all_requests: Option<bool>,
}

/// `POST /update_weights` with a JSON body (`Content-Type: application/json`): prime-rl's
/// `{"weight_dir": ...}`, and vLLM's `{"update_info": ...}`, which is refused.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UpdateWeightsJson {
    /// A folder of the same model's weights, loaded as `/update_weights_from_disk` loads
    /// `model_path`.
    pub weight_dir: Option<String>,
    pub weight_version: Option<String>,
    /// vLLM's NCCL weight transfer (names, dtypes, shapes of tensors broadcast over a GPU
    /// collective): refused with a 400 naming what ferry offers instead.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub update_info: Option<Value>,
}

/// `POST /update_weight_version`'s body.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UpdateWeightVersion {
    pub new_version: Option<String>,
}

/// `POST /weight_uploads`'s optional body.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BeginUpload {
    /// The version the commit installs under, unless the commit names one.
    pub weight_version: Option<String>,
}

/// `POST /weight_uploads/{upload_id}/commit`'s optional body.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CommitUpload {
    pub weight_version: Option<String>,
}

/// SGLang's `POST /pause_generation` body.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PauseGeneration {
    /// `abort` (default), `retract` or `in_place`.
    pub mode: Option<String>,
}

/// SGLang's memory routes' body.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemoryTags {
    pub tags: Option<Vec<String>>,
}

/// `POST /abort_request`'s body (SGLang's `AbortReq`).
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AbortRequest {
    /// A request's id: its `X-Request-Id`, which `/generate` reports as `meta_info.id`.
    pub rid: Option<String>,
    /// Abort every request in flight (slime drains its servers with it before a weight
    /// update).
    pub abort_all: Option<bool>,
}
