//! `--kv-events-config`: vLLM's `KVEventsConfig` as JSON.

use serde::Deserialize;

/// The port the PUB socket binds when the config names no endpoint (vLLM's).
pub const DEFAULT_PORT: u16 = 5557;

/// vLLM's `KVEventsConfig` (`vllm/config/kv_events.py`), the same field names and defaults,
/// but for the endpoint: with none given, ferry binds the address `--host` binds, not every
/// interface (events carry prompt token ids).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `"zmq"` publishes; `"null"` (vLLM's default) publishes nothing.
    #[serde(default = "null_publisher")]
    pub publisher: String,
    /// Where the PUB socket binds (`tcp://host:port`; `*` for every interface).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Where the ROUTER replay socket binds; none: no replay.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// Accepted for vLLM's configs; the pure-Rust socket has no high-water mark to set, and
    /// the publisher never blocks the engine either way.
    #[serde(default = "default_hwm")]
    pub hwm: usize,
    /// Accepted for vLLM's configs; the channel from the engine is unbounded.
    #[serde(default = "default_hwm")]
    pub max_queue_size: usize,
    #[serde(default)]
    pub topic: String,
}

fn null_publisher() -> String {
    "null".into()
}

fn default_buffer_steps() -> usize {
    10_000
}

fn default_hwm() -> usize {
    100_000
}

/// A `--kv-events-config` ferry cannot use.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--kv-events-config is not valid: {0}")]
    Json(#[from] serde_json::Error),
    #[error("--kv-events-config: publisher {0:?} is not one of \"zmq\", \"null\"")]
    Publisher(String),
    #[error("--kv-events-config: {field} {endpoint:?} is not tcp://host:port")]
    Endpoint {
        field: &'static str,
        endpoint: String,
    },
    #[error("--kv-events-config: buffer_steps must be at least 1")]
    BufferSteps,
}

impl KvEventsConfig {
    /// Parses and checks the flag's JSON.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let config: Self = serde_json::from_str(json)?;
        if !matches!(config.publisher.as_str(), "zmq" | "null") {
            return Err(ConfigError::Publisher(config.publisher));
        }
        if config.buffer_steps == 0 {
            return Err(ConfigError::BufferSteps);
        }
        for (field, e) in [
            ("endpoint", &config.endpoint),
            ("replay_endpoint", &config.replay_endpoint),
        ] {
            if let Some(e) = e {
                if split_tcp(e).is_none() {
                    return Err(ConfigError::Endpoint {
                        field,
                        endpoint: e.clone(),
                    });
                }
            }
        }
        Ok(config)
    }

    /// Whether the engine publishes at all.
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == "zmq"
    }

    /// The PUB endpoint: the config's, or `--host`'s address on [`DEFAULT_PORT`].
    pub fn pub_endpoint(&self, host: &str) -> String {
        self.endpoint
            .clone()
            .unwrap_or_else(|| tcp_endpoint(host, DEFAULT_PORT))
    }
}

/// `tcp://host:port`, with an IPv6 literal in brackets.
pub fn tcp_endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

/// `tcp://host:port` into its host and port.
pub(crate) fn split_tcp(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_configs_parse_and_mistakes_are_named() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv",
                "replay_endpoint": "tcp://127.0.0.1:5558", "buffer_steps": 8, "hwm": 10}"#,
        )
        .unwrap();
        assert!(c.publishes());
        assert_eq!(c.pub_endpoint("127.0.0.1"), "tcp://127.0.0.1:5557");
        assert_eq!(c.pub_endpoint("::1"), "tcp://[::1]:5557");
        assert!(!KvEventsConfig::parse("{}").unwrap().publishes());
        let e = KvEventsConfig::parse(r#"{"publisher": "kafka"}"#).unwrap_err();
        assert!(e.to_string().contains("kafka"), "{e}");
        let e = KvEventsConfig::parse(r#"{"endpoint": "ipc:///tmp/x"}"#).unwrap_err();
        assert!(e.to_string().contains("ipc:///tmp/x"), "{e}");
        let e = KvEventsConfig::parse(r#"{"enable_kv_cache_event": true}"#).unwrap_err();
        assert!(e.to_string().contains("enable_kv_cache_event"), "{e}");
    }
}
