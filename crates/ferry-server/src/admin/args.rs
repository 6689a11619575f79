//! Reading the admin routes' arguments (query strings and small JSON bodies) and mapping the
//! engine's lifecycle and weight errors to HTTP ([`EngineFailure`] impls: a handler writes
//! `.map_err(api_error)?`).
//!
//! Query strings are parsed by hand over `form_urlencoded` rather than with `axum::Query`:
//! `wake_up?tags=weights&tags=kv_cache` repeats a key, which `serde_urlencoded` cannot read
//! into a list, and every bad value must be a 400 that names its parameter. Unknown
//! parameters are refused too: a typo such as `clear_cach=false` would otherwise silently
//! clear the cache.

use ferry_engine::{
    LifecycleCallError, PauseMode, SleepLevel, WakeTag, WeightError, WeightReloadError,
    WeightUpdateError,
};
use serde::de::DeserializeOwned;

use crate::error::{ApiError, EngineFailure};
use crate::extract::parse_json;

/// A route's query parameters, in order, percent-decoded.
#[derive(Debug, Clone, Default)]
pub struct QueryArgs {
    pairs: Vec<(String, String)>,
}

impl QueryArgs {
    /// Parses `raw` and refuses any parameter not in `known`.
    pub fn parse(raw: Option<&str>, known: &[&str]) -> Result<Self, ApiError> {
        let pairs: Vec<(String, String)> = form_urlencoded::parse(raw.unwrap_or("").as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        if let Some((k, _)) = pairs.iter().find(|(k, _)| !known.contains(&k.as_str())) {
            let expected = if known.is_empty() {
                "this route takes no query parameters".to_owned()
            } else {
                format!("expected {}", known.join(", "))
            };
            return Err(ApiError::invalid(
                k.clone(),
                format!("unknown query parameter `{k}`: {expected}"),
            ));
        }
        Ok(Self { pairs })
    }

    /// The last value of `name` (a repeated scalar keeps its last value, as FastAPI does).
    pub fn last(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name`, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.pairs
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// A boolean (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`, any case).
    pub fn bool(&self, name: &str, default: bool) -> Result<bool, ApiError> {
        self.last(name).map_or(Ok(default), |v| {
            parse_bool(v).ok_or_else(|| bad_bool(name, v))
        })
    }

    pub fn pause_mode(&self, name: &str, default: PauseMode) -> Result<PauseMode, ApiError> {
        self.last(name).map_or(Ok(default), |v| {
            v.parse().map_err(|e: String| ApiError::invalid(name, e))
        })
    }

    pub fn sleep_level(&self, name: &str, default: SleepLevel) -> Result<SleepLevel, ApiError> {
        let Some(v) = self.last(name) else {
            return Ok(default);
        };
        v.parse::<u8>()
            .ok()
            .and_then(SleepLevel::from_u8)
            .ok_or_else(|| {
                ApiError::invalid(
                    name,
                    format!("invalid sleep level `{v}` (expected 0, 1 or 2)"),
                )
            })
    }

    /// A string value that must not be empty when given.
    pub fn non_empty(&self, name: &str) -> Result<Option<String>, ApiError> {
        non_empty(self.last(name).map(str::to_owned), name)
    }
}

/// A string argument (query or JSON), which must not be empty when given.
pub fn non_empty(v: Option<String>, param: &str) -> Result<Option<String>, ApiError> {
    match v {
        Some(s) if s.is_empty() => Err(ApiError::invalid(param, format!("`{param}` is empty"))),
        v => Ok(v),
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn bad_bool(name: &str, v: &str) -> ApiError {
    ApiError::invalid(
        name,
        format!("invalid boolean `{v}` for `{name}` (expected true or false)"),
    )
}

/// Wake-up tags: `weights`, `kv_cache`. `ignored` names tags accepted and skipped (SGLang's
/// `cuda_graph`: a CPU engine has no graphs to release). `param` names the field for errors.
pub fn wake_tags(values: &[&str], param: &str, ignored: &[&str]) -> Result<Vec<WakeTag>, ApiError> {
    let mut tags = Vec::new();
    for v in values.iter().filter(|v| !ignored.contains(v)) {
        let tag: WakeTag = v.parse().map_err(|e: String| ApiError::invalid(param, e))?;
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }
    Ok(tags)
}

/// A JSON body that may be absent: an empty body reads as `{}`.
pub fn optional_json<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    parse_json(bytes)
}

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
    fn repeated_and_encoded_values() {
        let q = QueryArgs::parse(Some("tags=weights&tags=kv%5Fcache&x=1"), &["tags", "x"]).unwrap();
        assert_eq!(q.all("tags"), ["weights", "kv_cache"]);
        assert_eq!(
            wake_tags(&q.all("tags"), "tags", &[]).unwrap(),
            [WakeTag::Weights, WakeTag::KvCache]
        );
    }

    #[test]
    fn unknown_parameter_and_bad_values_name_the_parameter() {
        let e = QueryArgs::parse(Some("clear_cach=false"), &["mode", "clear_cache"]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("clear_cach"));
        let q = QueryArgs::parse(
            Some("clear_cache=maybe&level=3&mode=nap"),
            &["clear_cache", "level", "mode"],
        )
        .unwrap();
        assert_eq!(
            q.bool("clear_cache", true).unwrap_err().param.as_deref(),
            Some("clear_cache")
        );
        assert_eq!(
            q.sleep_level("level", SleepLevel::L1)
                .unwrap_err()
                .param
                .as_deref(),
            Some("level")
        );
        assert_eq!(
            q.pause_mode("mode", PauseMode::Abort)
                .unwrap_err()
                .param
                .as_deref(),
            Some("mode")
        );
    }

    #[test]
    fn defaults_and_bool_spellings() {
        let q = QueryArgs::parse(None, &["clear_cache"]).unwrap();
        assert!(q.bool("clear_cache", true).unwrap());
        for (v, want) in [("TRUE", true), ("0", false), ("off", false), ("yes", true)] {
            let raw = format!("clear_cache={v}");
            let q = QueryArgs::parse(Some(&raw), &["clear_cache"]).unwrap();
            assert_eq!(q.bool("clear_cache", !want).unwrap(), want, "{v}");
        }
    }

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
            api_error(LifecycleCallError::from(ferry_engine::Stopped)).status,
            StatusCode::SERVICE_UNAVAILABLE
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

    #[test]
    fn empty_body_reads_as_default() {
        #[derive(Debug, Default, serde::Deserialize, PartialEq)]
        struct B {
            x: Option<u32>,
        }
        assert_eq!(optional_json::<B>(b" \n").unwrap(), B::default());
        assert_eq!(
            optional_json::<B>(br#"{"x": 2}"#).unwrap(),
            B { x: Some(2) }
        );
        assert!(optional_json::<B>(b"{").is_err());
    }
}
