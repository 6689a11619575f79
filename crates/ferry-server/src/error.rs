//! The one error type every handler returns, [`ApiError`], rendered as an OpenAI error body:
//! `{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.
//!
//! The type and its body live in `ferry-http`, which the P/D proxy shares (re-exported here
//! under their old paths); what is the server's own is how the engine's errors map onto it
//! ([`EngineFailure`]), by variant, never by a message's text.

pub use ferry_http::error::{ApiError, ErrorBody, ErrorInfo};

/// An engine error with the HTTP error it answers with. A trait rather than `From` impls:
/// `ApiError` is ferry-http's and these errors are ferry-engine's, so the orphan rule forbids
/// `impl From<EngineError> for ApiError` here, and ferry-http must not know the engine.
/// Handlers convert with [`api_error`]: `engine.resume().await.map_err(api_error)?`.
pub trait EngineFailure {
    /// The HTTP error this engine error answers with.
    fn into_api_error(self) -> ApiError;
}

/// `e`'s HTTP error; the function form of [`EngineFailure::into_api_error`], for `map_err`.
pub fn api_error(e: impl EngineFailure) -> ApiError {
    e.into_api_error()
}

/// An engine that was shut down: a 503, as for any call that needs one (retry elsewhere or
/// later). One that failed (its thread panicked, on a broken invariant or a bug): a 500
/// naming the failure (`the engine failed: <panic message>`), for every call from then on.
impl EngineFailure for ferry_engine::Stopped {
    fn into_api_error(self) -> ApiError {
        match self {
            ferry_engine::Stopped::ShutDown => ApiError::unavailable(self.to_string()),
            ferry_engine::Stopped::Failed(_) => ApiError::internal(self.to_string()),
        }
    }
}

/// A refused adapter load or unload: 404 for a name not loaded (vLLM's), 409 when
/// `--max-cpu-loras` adapters are loaded already, 400 naming the field for the rest (a name
/// loaded without `load_inplace`, a bad folder, a pushed adapter's `config` or `body`, adapters
/// off).
impl EngineFailure for ferry_engine::LoraCallError {
    fn into_api_error(self) -> ApiError {
        use ferry_engine::LoraCallError as E;
        let message = self.to_string();
        match self {
            E::Stopped(stopped) => stopped.into_api_error(),
            E::NotFound(_) => ApiError::not_found(Some("lora_name"), message),
            E::Full { .. } => ApiError::conflict(message),
            E::AlreadyLoaded(_) | E::BaseName(_) => ApiError::invalid("lora_name", message),
            E::Invalid(_) | E::Executor(_) => ApiError::invalid("lora_path", message),
            E::Pushed { param, .. } => ApiError::invalid(param, message),
            E::Disabled => ApiError::bad_request(message),
            E::Core(_) => ApiError::internal(message),
        }
    }
}
