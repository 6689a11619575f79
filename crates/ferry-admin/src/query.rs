//! A call's query string, read by hand over `form_urlencoded` rather than with
//! `axum::Query`: `wake_up?tags=weights&tags=kv_cache` repeats a key, which
//! `serde_urlencoded` cannot read into a list, and every bad value must be a 400 that names
//! its parameter. Unknown parameters are refused too: a typo such as `clear_cach=false` would
//! otherwise silently clear the cache.

use ferry_core::{PauseMode, SleepLevel, WakeTag};
use ferry_http::error::ApiError;

/// A route's query parameters, in order, percent-decoded.
#[derive(Debug, Clone, Default)]
pub struct QueryArgs {
    pairs: Vec<(String, String)>,
}

impl QueryArgs {
    /// Parses `raw` and refuses any parameter not in `known`.
    pub fn parse<'a>(
        raw: Option<&str>,
        known: impl IntoIterator<Item = &'a str> + Clone,
    ) -> Result<Self, ApiError> {
        let pairs: Vec<(String, String)> = form_urlencoded::parse(raw.unwrap_or("").as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let is_known = |k: &str| known.clone().into_iter().any(|n| n == k);
        if let Some((k, _)) = pairs.iter().find(|(k, _)| !is_known(k)) {
            let names: Vec<&str> = known.into_iter().collect();
            let expected = if names.is_empty() {
                "this route takes no query parameters".to_owned()
            } else {
                format!("expected {}", names.join(", "))
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
            parse_bool(v).ok_or_else(|| {
                ApiError::invalid(
                    name,
                    format!("invalid boolean `{v}` for `{name}` (expected true or false)"),
                )
            })
        })
    }

    pub fn pause_mode(&self, name: &str, default: PauseMode) -> Result<PauseMode, ApiError> {
        self.last(name)
            .map_or(Ok(default), |v| pause_mode(v.to_owned(), name))
    }

    pub fn sleep_level(&self, name: &str, default: SleepLevel) -> Result<SleepLevel, ApiError> {
        let Some(v) = self.last(name) else {
            return Ok(default);
        };
        v.parse::<u8>()
            .ok()
            .and_then(SleepLevel::from_u8)
            .ok_or_else(|| bad_level(name, v))
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

/// A pause mode (`abort`, `wait`, `keep`), named by `param` when it is none of them.
pub fn pause_mode(v: String, param: &str) -> Result<PauseMode, ApiError> {
    v.parse().map_err(|e: String| ApiError::invalid(param, e))
}

/// A sleep level (0, 1, 2), named by `param` when it is none of them.
pub fn sleep_level(level: u8, param: &str) -> Result<SleepLevel, ApiError> {
    SleepLevel::from_u8(level).ok_or_else(|| bad_level(param, level))
}

fn bad_level(param: &str, v: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(
        param,
        format!("invalid sleep level `{v}` (expected 0, 1 or 2)"),
    )
}

/// Wake-up tags: `weights`, `kv_cache`, each once. `ignored` names tags accepted and skipped
/// (SGLang's `cuda_graph`: a CPU engine has no graphs to release). `param` names the field
/// for errors.
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

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_and_encoded_values() {
        let q = QueryArgs::parse(Some("tags=weights&tags=kv%5Fcache&x=1"), ["tags", "x"]).unwrap();
        assert_eq!(q.all("tags"), ["weights", "kv_cache"]);
        assert_eq!(
            wake_tags(&q.all("tags"), "tags", &[]).unwrap(),
            [WakeTag::Weights, WakeTag::KvCache]
        );
    }

    #[test]
    fn unknown_parameter_and_bad_values_name_the_parameter() {
        let e = QueryArgs::parse(Some("clear_cach=false"), ["mode", "clear_cache"]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("clear_cach"));
        assert!(
            e.message.contains("expected mode, clear_cache"),
            "{}",
            e.message
        );
        let e = QueryArgs::parse(Some("x=1"), []).unwrap_err();
        assert!(
            e.message.contains("takes no query parameters"),
            "{}",
            e.message
        );
        let q = QueryArgs::parse(
            Some("clear_cache=maybe&level=3&mode=nap"),
            ["clear_cache", "level", "mode"],
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
        let q = QueryArgs::parse(None, ["clear_cache"]).unwrap();
        assert!(q.bool("clear_cache", true).unwrap());
        for (v, want) in [("TRUE", true), ("0", false), ("off", false), ("yes", true)] {
            let raw = format!("clear_cache={v}");
            let q = QueryArgs::parse(Some(&raw), ["clear_cache"]).unwrap();
            assert_eq!(q.bool("clear_cache", !want).unwrap(), want, "{v}");
        }
    }
}
