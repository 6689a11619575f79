//! How the engine's lifecycle and weight errors answer an admin call
//! ([`EngineFailure`] impls: a handler writes `.map_err(api_error)?`). The calls' arguments
//! are read in `ferry-admin`; this is the other half of the edge, the engine's answers.

use ferry_engine::{LifecycleCallError, WeightError, WeightReloadError, WeightUpdateError};

use crate::error::{ApiError, EngineFailure};

/// A lifecycle operation the core refused or cancelled is a conflict with the engine's state
/// (409); nothing was lost and the caller may retry in another state.
impl EngineFailure for LifecycleCallError {
    fn into_api_error(self) -> ApiError {
        match self {
            LifecycleCallError::Lifecycle(e @ ferry_engine::LifecycleError::Timeout { .. }) => {
                ApiError::timeout(e.to_string())
            }
            LifecycleCallError::Lifecycle(e) => ApiError::conflict(e.to_string()),
            LifecycleCallError::Stopped(e) => e.into_api_error(),
        }
    }
}

/// A refused push: the tensor at fault is the `param` where there is one, else the body.
impl EngineFailure for WeightUpdateError {
    fn into_api_error(self) -> ApiError {
        match self {
            WeightUpdateError::Weights(w) => weight_error(w, "body"),
            WeightUpdateError::Stopped(e) => e.into_api_error(),
        }
    }
}

/// A failed reload: the tensor at fault where there is one, else `model_path`.
impl EngineFailure for WeightReloadError {
    fn into_api_error(self) -> ApiError {
        match self {
            WeightReloadError::Load(_) => ApiError::invalid("model_path", self.to_string()),
            // The request was good; the disk or the files failed it, and the weights are gone.
            WeightReloadError::Torn(_) => ApiError::internal(self.to_string()),
            WeightReloadError::Weights(w) => weight_error(w, "model_path"),
            WeightReloadError::Stopped(e) => e.into_api_error(),
        }
    }
}

/// A refused weight update. `source_param` is the request field the weights came from (the
/// push's body, the reload's `model_path`), blamed when no tensor is at fault.
fn weight_error(w: WeightError, source_param: &str) -> ApiError {
    let message = format!("weight update refused: {w}");
    match &w {
        WeightError::UnknownTensor { name }
        | WeightError::BadShape { name, .. }
        | WeightError::UnsupportedDtype { name, .. }
        | WeightError::Duplicate { name } => ApiError::invalid(name.clone(), message),
        WeightError::Empty | WeightError::Malformed(_) => ApiError::invalid("body", message),
        WeightError::Incomplete { .. } | WeightError::ConfigMismatch { .. } => {
            ApiError::invalid(source_param, message)
        }
        WeightError::WrongExecutor => ApiError::internal(message),
        WeightError::Reloading => ApiError::conflict(message),
        // Only the engine's own reload hands weights back.
        WeightError::NotLent => ApiError::internal(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::api_error;

    #[test]
    fn errors_map_to_status_by_kind() {
        use axum::http::StatusCode;
        let e = api_error(LifecycleCallError::from(
            ferry_engine::LifecycleError::NotPaused,
        ));
        assert_eq!(e.status, StatusCode::CONFLICT);
        let e = api_error(LifecycleCallError::from(
            ferry_engine::LifecycleError::Timeout {
                waited: std::time::Duration::from_secs(60),
                waiting_for: "1 transfer hold(s) to hand back 4 KV block(s)".into(),
            },
        ));
        assert_eq!(e.status, StatusCode::GATEWAY_TIMEOUT);
        assert!(e.message.contains("4 KV block(s)"), "{}", e.message);
        assert_eq!(
            api_error(LifecycleCallError::from(ferry_engine::Stopped::ShutDown)).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        let e = api_error(LifecycleCallError::from(ferry_engine::Stopped::Failed(
            "block pool: a double free".into(),
        )));
        assert_eq!(
            (e.status, e.message.as_str()),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine failed: block pool: a double free"
            )
        );
        let e = api_error(WeightReloadError::from(WeightError::BadShape {
            name: "a.weight".into(),
            expected: vec![2],
            got: vec![3],
        }));
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("a.weight"))
        );
    }
}
