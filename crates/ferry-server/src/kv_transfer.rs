//! `kv_transfer_params` on the wire: vLLM's keys (plus ferry's `weight_version`,
//! `export_token`, `n_tokens`), read off completions and chat requests and written back on
//! their responses, so a proxy that forwards P's parameters into D's request (as vLLM's
//! disaggregation proxies do) drives ferry's P and D unchanged.
//!
//! Here only the *shape* is checked (types, ranges, the keys a load needs), each failure a 400
//! naming the key; what the parameters *mean* (a live export, the right token and weight
//! version) is the connector's to check, and a stale or forged set fails closed there.

use ferry_engine::KvTransferParams;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

const FIELD: &str = "kv_transfer_params";

/// The wire form. Unknown keys are ignored (proxies add their own); `null` reads as absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct KvTransferParamsJson {
    #[serde(default, deserialize_with = "null_as_false")]
    pub do_remote_prefill: bool,
    #[serde(default, deserialize_with = "null_as_false")]
    pub do_remote_decode: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_tokens: Option<usize>,
}

fn null_as_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// What the server knows when it checks a request's parameters.
#[derive(Debug, Clone, Copy)]
pub struct TransferLimits {
    /// Whether the engine runs a P/D connector (`ferry serve --kv-role`).
    pub kv_connector: bool,
    /// Longest sequence: no export can hold more tokens, or more blocks, than this.
    pub max_model_len: usize,
}

impl KvTransferParamsJson {
    /// The engine's parameters, after the shape checks. `n_prompts` is the request's batch
    /// size: an export holds one prompt's KV, so a batch cannot carry transfer parameters.
    pub fn check(
        self,
        limits: TransferLimits,
        n_prompts: usize,
    ) -> Result<KvTransferParams, ApiError> {
        let key = |k: &str| format!("{FIELD}.{k}");
        let active = self.do_remote_prefill || self.do_remote_decode;
        if active && !limits.kv_connector {
            let flag = if self.do_remote_prefill {
                "do_remote_prefill"
            } else {
                "do_remote_decode"
            };
            return Err(ApiError::invalid(
                key(flag),
                format!(
                    "`{FIELD}.{flag}` needs a KV connector: this server was started without \
                     --kv-role"
                ),
            ));
        }
        if active && n_prompts > 1 {
            return Err(ApiError::invalid(
                FIELD,
                format!("`{FIELD}` applies to one prompt; this request has a batch of {n_prompts}"),
            ));
        }
        for (k, v) in [
            ("remote_engine_id", &self.remote_engine_id),
            ("remote_request_id", &self.remote_request_id),
            ("remote_host", &self.remote_host),
            ("weight_version", &self.weight_version),
            ("export_token", &self.export_token),
        ] {
            if v.as_deref() == Some("") {
                return Err(ApiError::invalid(
                    key(k),
                    format!("`{}` must not be empty", key(k)),
                ));
            }
        }
        if self.remote_port == Some(0) {
            return Err(ApiError::invalid(
                key("remote_port"),
                format!(
                    "`{}` must be a port between 1 and 65535",
                    key("remote_port")
                ),
            ));
        }
        if let Some(n) = self.n_tokens {
            if n == 0 || n > limits.max_model_len {
                return Err(ApiError::invalid(
                    key("n_tokens"),
                    format!(
                        "`{}` must be between 1 and {} (the maximum context length), got {n}",
                        key("n_tokens"),
                        limits.max_model_len
                    ),
                ));
            }
        }
        if let Some(ids) = &self.remote_block_ids {
            // A block holds at least one token, so no export has more blocks than tokens.
            if ids.len() > limits.max_model_len {
                return Err(ApiError::invalid(
                    key("remote_block_ids"),
                    format!(
                        "`{}` has {} ids, more than an export of at most {} tokens can have",
                        key("remote_block_ids"),
                        ids.len(),
                        limits.max_model_len
                    ),
                ));
            }
        }
        if self.do_remote_prefill {
            let missing = [
                ("remote_engine_id", self.remote_engine_id.is_none()),
                ("remote_block_ids", self.remote_block_ids.is_none()),
                ("export_token", self.export_token.is_none()),
                ("weight_version", self.weight_version.is_none()),
                ("n_tokens", self.n_tokens.is_none()),
            ];
            if let Some((k, _)) = missing.iter().find(|(_, m)| *m) {
                return Err(ApiError::invalid(
                    key(k),
                    format!(
                        "`{FIELD}.do_remote_prefill` needs `{}` (forward the \
                         `{FIELD}` of P's response unchanged)",
                        key(k)
                    ),
                ));
            }
        }
        Ok(self.into_engine())
    }

    fn into_engine(self) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: self.do_remote_prefill,
            do_remote_decode: self.do_remote_decode,
            remote_engine_id: self.remote_engine_id,
            remote_block_ids: self.remote_block_ids,
            remote_request_id: self.remote_request_id,
            remote_host: self.remote_host,
            remote_port: self.remote_port,
            weight_version: self.weight_version,
            export_token: self.export_token,
            n_tokens: self.n_tokens,
        }
    }
}

impl From<&KvTransferParams> for KvTransferParamsJson {
    fn from(p: &KvTransferParams) -> Self {
        Self {
            do_remote_prefill: p.do_remote_prefill,
            do_remote_decode: p.do_remote_decode,
            remote_engine_id: p.remote_engine_id.clone(),
            remote_block_ids: p.remote_block_ids.clone(),
            remote_request_id: p.remote_request_id.clone(),
            remote_host: p.remote_host.clone(),
            remote_port: p.remote_port,
            weight_version: p.weight_version.clone(),
            export_token: p.export_token.clone(),
            n_tokens: p.n_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: TransferLimits = TransferLimits {
        kv_connector: true,
        max_model_len: 100,
    };

    fn field(json: &str) -> String {
        let p: KvTransferParamsJson = serde_json::from_str(json).unwrap();
        p.check(LIMITS, 1).unwrap_err().param.unwrap()
    }

    const GOOD: &str = r#"{"do_remote_prefill": true, "remote_engine_id": "p",
        "remote_block_ids": [3, 4], "export_token": "t", "weight_version": "0", "n_tokens": 20,
        "extra_proxy_key": {"x": 1}, "remote_port": null}"#;

    #[test]
    fn p_parameters_pass_and_round_trip() {
        let p: KvTransferParamsJson = serde_json::from_str(GOOD).unwrap();
        let engine = p.clone().check(LIMITS, 1).unwrap();
        assert_eq!(engine.remote_block_ids, Some(vec![3, 4]));
        assert_eq!(KvTransferParamsJson::from(&engine), p);
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"p","remote_block_ids":[3,4],"weight_version":"0","export_token":"t","n_tokens":20}"#
        );
    }

    #[test]
    fn bad_shapes_name_the_key() {
        assert_eq!(
            field(r#"{"do_remote_prefill": true}"#),
            "kv_transfer_params.remote_engine_id"
        );
        assert_eq!(
            field(&GOOD.replace(r#""n_tokens": 20"#, r#""n_tokens": 0"#)),
            "kv_transfer_params.n_tokens"
        );
        assert_eq!(
            field(&GOOD.replace(r#""export_token": "t""#, r#""export_token": """#)),
            "kv_transfer_params.export_token"
        );
        assert_eq!(
            field(r#"{"remote_port": 0}"#),
            "kv_transfer_params.remote_port"
        );
        let many = format!(r#"{{"remote_block_ids": {:?}}}"#, [1u32; 101]);
        assert_eq!(field(&many), "kv_transfer_params.remote_block_ids");
    }

    #[test]
    fn batches_and_servers_without_a_connector_are_refused() {
        let p: KvTransferParamsJson =
            serde_json::from_str(r#"{"do_remote_decode": true}"#).unwrap();
        assert_eq!(
            p.clone().check(LIMITS, 2).unwrap_err().param.as_deref(),
            Some("kv_transfer_params")
        );
        let none = TransferLimits {
            kv_connector: false,
            ..LIMITS
        };
        assert_eq!(
            p.check(none, 1).unwrap_err().param.as_deref(),
            Some("kv_transfer_params.do_remote_decode")
        );
        // Inactive parameters are harmless anywhere.
        let p: KvTransferParamsJson =
            serde_json::from_str(r#"{"do_remote_decode": false}"#).unwrap();
        assert!(p.check(none, 3).is_ok());
    }
}
