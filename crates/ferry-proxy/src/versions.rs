//! The weight version each instance runs, and whether the fleet agrees on one.
//!
//! P and D on different weight versions make every transfer fail D's version check (and,
//! under `--kv-load-failure-policy recompute`, every prompt is computed twice), so the proxy
//! never hides a skew: the version reads through it (`/get_weight_version`, `/weight_info`)
//! are a 409 naming each instance's version ([`crate::broadcast::summarise`]), and `/health`
//! says `version_skew` ([`crate::routes::health`]).
//!
//! `/health` reads each instance's version from its `/metrics`
//! (`ferry_weight_version_info{version="..."}`, [`from_metrics`]): of the routes an instance
//! always serves (`/health`, `/v1/models`, `/version`, `/metrics`, ...) it is the only one that
//! carries the version, and unlike the admin routes it needs neither `--enable-admin-api` on
//! the instances nor on the proxy, nor the instances' API key.

use serde_json::{json, Value};

use crate::fleet::Instance;

/// One instance's weight version as the proxy read it: `None` when it could not be read
/// (the instance is down, or its answer had no version).
#[derive(Debug, Clone)]
pub struct InstanceVersion<'a> {
    pub instance: &'a Instance,
    pub version: Option<String>,
}

/// Whether the instances run different versions: two distinct versions among those read.
/// An instance whose version could not be read counts for neither side.
pub fn skewed(versions: &[InstanceVersion<'_>]) -> bool {
    let mut known = versions.iter().filter_map(|v| v.version.as_deref());
    match known.next() {
        Some(first) => known.any(|v| v != first),
        None => false,
    }
}

/// Each instance's URL, role and version (`null` when unread), for a reply.
pub fn to_json(versions: &[InstanceVersion<'_>]) -> Value {
    Value::Array(
        versions
            .iter()
            .map(|v| {
                json!({"url": v.instance.url, "role": v.instance.role.as_str(),
                       "version": v.version})
            })
            .collect(),
    )
}

/// Each instance's version in words, for an error message:
/// `prefill http://p:1 runs "v1", decode http://d:2 runs "v2"`.
pub fn describe(versions: &[InstanceVersion<'_>]) -> String {
    versions
        .iter()
        .map(|v| {
            let version = v
                .version
                .as_deref()
                .map_or_else(|| "an unknown version".to_owned(), |s| format!("{s:?}"));
            format!("{} {} runs {version}", v.instance.role, v.instance.url)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// An instance's version from its answer to `/get_weight_version` or `/weight_info`
/// (`{"weight_version": ...}`).
pub fn from_body(body: &Value) -> Option<String> {
    match &body["weight_version"] {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

/// The metric of an instance's `/metrics` that names its weight version (an info gauge:
/// the version is the `version` label, the value always 1).
pub const VERSION_METRIC: &str = "ferry_weight_version_info";

/// An instance's version from its `/metrics` text: the `version` label of
/// [`VERSION_METRIC`], unescaped.
pub fn from_metrics(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let labels = line.strip_prefix(VERSION_METRIC)?.strip_prefix('{')?;
        label(labels, "version")
    })
}

/// The value of label `want` in `a="x",b="y"} 1` (the text after a sample's `{`), with the
/// text format's escapes (`\\`, `\"`, `\n`) undone.
fn label(labels: &str, want: &str) -> Option<String> {
    let mut rest = labels;
    loop {
        let (name, after) = rest.split_once("=\"")?;
        let name = name.trim_start_matches(',').trim();
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        if name == want {
            return Some(value);
        }
        rest = &after[end + 1..];
        if !rest.starts_with(',') {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Role;

    #[test]
    fn reads_the_version_label_from_metrics() {
        let text = "# HELP ferry_weight_version_info The weight version now loaded.\n\
                    # TYPE ferry_weight_version_info gauge\n\
                    ferry_weight_version_info{version=\"v7\"} 1\n# EOF\n";
        assert_eq!(from_metrics(text).as_deref(), Some("v7"));
        let escaped = "ferry_weight_version_info{a=\"x,\\\"y\",version=\"say \\\"hi\\\" \\\\ \
                       \\n\"} 1\n";
        assert_eq!(from_metrics(escaped).as_deref(), Some("say \"hi\" \\ \n"));
        assert_eq!(
            from_metrics("ferry_weight_version_info_x{version=\"v\"} 1"),
            None
        );
        assert_eq!(
            from_metrics("ferry_weight_version_info{other=\"v\"} 1"),
            None
        );
        assert_eq!(from_metrics("ferry_weight_version_info{version=\"v"), None);
        assert_eq!(from_metrics(""), None);
    }

    #[test]
    fn a_skew_needs_two_known_versions_that_differ() {
        let p = Instance::new("http://p:1", Role::Prefill);
        let d = Instance::new("http://d:2", Role::Decode);
        let at = |i, v: Option<&str>| InstanceVersion {
            instance: i,
            version: v.map(str::to_owned),
        };
        assert!(!skewed(&[at(&p, Some("v1")), at(&d, Some("v1"))]));
        assert!(!skewed(&[at(&p, Some("v1")), at(&d, None)]));
        assert!(!skewed(&[at(&p, None), at(&d, None)]));
        assert!(!skewed(&[]));
        let both = [at(&p, Some("v1")), at(&d, Some("v2"))];
        assert!(skewed(&both));
        assert_eq!(
            describe(&both),
            "prefill http://p:1 runs \"v1\", decode http://d:2 runs \"v2\""
        );
        assert_eq!(
            to_json(&[at(&p, Some("v1")), at(&d, None)]),
            json!([{"url": "http://p:1", "role": "prefill", "version": "v1"},
                   {"url": "http://d:2", "role": "decode", "version": null}])
        );
        assert_eq!(
            from_body(&json!({"weight_version": "v3"})).as_deref(),
            Some("v3")
        );
        assert_eq!(
            from_body(&json!({"weight_version": 3})).as_deref(),
            Some("3")
        );
        assert_eq!(from_body(&json!({})), None);
    }
}
