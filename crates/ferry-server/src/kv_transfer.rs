//! `kv_transfer_params` on the wire: vLLM's keys (plus ferry's `weight_version`,
//! `lora_name` and `lora_version` for a request under a LoRA adapter, `export_token`,
//! `n_tokens`), read off completions and chat requests and written back on
//! their responses, so a proxy that forwards P's parameters into D's request (as vLLM's
//! disaggregation proxies do) drives ferry's P and D unchanged.
//!
//! Here only the *shape* is checked (types, ranges, the keys a load needs), each failure a 400
//! naming the key; what the parameters *mean* (a live export, the right token and weight
//! version) is the connector's to check, and a stale or forged set fails closed there.
//!
//! One check more than shape, on a server with a P/D connector: where D would connect
//! ([`check_remote_host`], `connectors.md`, *Trust*). A load's `remote_host` is resolved once
//! (a name here, an address as it is), refused with a 400 unless the address is one of the
//! allowed KV peers (`ferry serve --kv-allowed-peers`), and replaced by that address, so the
//! engine connects to the address that was checked (and its connector checks it again).

use std::net::IpAddr;
use std::time::Duration;

use ferry_engine::{ip_literal, AllowedPeers, BlockId, KvTransferParams, LoraKey, TransferRequest};
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
    #[schema(value_type = Option<Vec<u32>>)]
    pub remote_block_ids: Option<Vec<BlockId>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// The LoRA adapter P computed the export with, and its version: D loads it only for a
    /// request under the same adapter at the same version (else it computes the prompt).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_version: Option<u64>,
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
    /// What the request asks of the P/D transfer, parsed once, after the shape checks: none
    /// when neither role flag is set. `n_prompts` is the request's batch size: an export holds
    /// one prompt's KV, so a batch cannot carry transfer parameters.
    pub fn check(
        self,
        limits: TransferLimits,
        n_prompts: usize,
    ) -> Result<Option<TransferRequest>, ApiError> {
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
            ("lora_name", &self.lora_name),
            ("export_token", &self.export_token),
        ] {
            if v.as_deref() == Some("") {
                return Err(ApiError::invalid(
                    key(k),
                    format!("`{}` must not be empty", key(k)),
                ));
            }
        }
        if self.lora_name.is_some() != self.lora_version.is_some() {
            let (given, missing) = if self.lora_name.is_some() {
                ("lora_name", "lora_version")
            } else {
                ("lora_version", "lora_name")
            };
            return Err(ApiError::invalid(
                key(missing),
                format!("`{}` needs `{}` beside it", key(given), key(missing)),
            ));
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
        // Every key a load needs was checked above, so this refuses nothing a client sends.
        TransferRequest::parse(&self.into_engine())
            .map_err(|e| ApiError::invalid(FIELD, e.to_string()))
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
            lora: self
                .lora_name
                .zip(self.lora_version)
                .map(|(name, version)| LoraKey {
                    name: name.into(),
                    version,
                }),
            export_token: self.export_token,
            n_tokens: self.n_tokens,
        }
    }
}

/// Longest wait for a `remote_host` name's resolution: a load's request is refused rather
/// than held on a slow resolver.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The edge's check of where a load would connect, after [`KvTransferParamsJson::check`] on
/// a server with a P/D connector. An import (`do_remote_prefill`) with a `remote_host` has it
/// resolved once (an IP literal as it is, a name to its first address), checked against
/// `peers`, and replaced by that address; an address outside `peers` is a 400 naming
/// `kv_transfer_params.remote_host`, before anything connects to it. Anything else passes
/// unchanged (a load without a host fails closed in the connector).
pub async fn check_remote_host(
    mut transfer: TransferRequest,
    peers: &AllowedPeers,
) -> Result<TransferRequest, ApiError> {
    let Some(spec) = transfer.import_mut() else {
        return Ok(transfer);
    };
    let Some(host) = spec.remote_host.as_deref() else {
        return Ok(transfer);
    };
    let key = format!("{FIELD}.remote_host");
    let literal = ip_literal(host);
    let ip = match literal {
        Some(ip) => ip,
        None => resolve(host, spec.remote_port.unwrap_or(0))
            .await
            .map_err(|why| {
                ApiError::invalid(
                    &key,
                    format!("`{key}` {host:?} could not be resolved to an address: {why}"),
                )
            })?,
    };
    if !peers.contains(ip) {
        let what = match literal {
            Some(_) => format!("{ip}"),
            None => format!("{host:?} (resolved to {ip})"),
        };
        return Err(ApiError::invalid(
            &key,
            format!(
                "`{key}` {what} is not an allowed KV peer of this server (allowed: {}); D \
                 loads KV only from the peers it was started with: add P's address to \
                 --kv-allowed-peers to allow it",
                peers.describe()
            ),
        ));
    }
    spec.remote_host = Some(ip.to_string());
    Ok(transfer)
}

/// A name's first address, within [`RESOLVE_TIMEOUT`].
async fn resolve(host: &str, port: u16) -> Result<IpAddr, String> {
    let lookup = tokio::net::lookup_host((host, port));
    let mut addrs = tokio::time::timeout(RESOLVE_TIMEOUT, lookup)
        .await
        .map_err(|_| format!("no answer within {} s", RESOLVE_TIMEOUT.as_secs()))?
        .map_err(|e| e.to_string())?;
    addrs
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| "the name has no address".to_owned())
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
            lora_name: p.lora.as_ref().map(|l| l.name.to_string()),
            lora_version: p.lora.as_ref().map(|l| l.version),
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
        let transfer = p.clone().check(LIMITS, 1).unwrap().unwrap();
        let spec = transfer.import().expect("a load");
        assert_eq!(spec.remote_block_ids, BlockId::list([3, 4]));
        assert!(!transfer.exports());
        let engine = p.clone().into_engine();
        assert_eq!(engine.remote_block_ids, Some(BlockId::list([3, 4])));
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

    fn load(host: &str) -> TransferRequest {
        let p: KvTransferParamsJson = serde_json::from_str(GOOD).unwrap();
        let mut t = p.check(LIMITS, 1).unwrap().expect("a load");
        let spec = t.import_mut().expect("a load");
        spec.remote_host = Some(host.to_owned());
        spec.remote_port = Some(4000);
        t
    }

    /// The import's `remote_host` and `remote_port`.
    fn host_port(t: &TransferRequest) -> (Option<&str>, Option<u16>) {
        let spec = t.import().expect("a load");
        (spec.remote_host.as_deref(), spec.remote_port)
    }

    #[tokio::test]
    async fn a_remote_host_outside_the_allowed_peers_is_a_400_naming_it() {
        let peers = AllowedPeers::parse("127.0.0.2").unwrap();
        let e = check_remote_host(load("127.0.0.1"), &peers)
            .await
            .unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params.remote_host"));
        assert!(
            e.message.contains("not an allowed KV peer"),
            "{}",
            e.message
        );
        assert!(e.message.contains("--kv-allowed-peers"), "{}", e.message);
        assert!(e.message.contains("127.0.0.2/32"), "{}", e.message);
        // The default is loopback only.
        let e = check_remote_host(load("192.0.2.7"), &AllowedPeers::default())
            .await
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params.remote_host"));
    }

    #[tokio::test]
    async fn an_allowed_host_is_replaced_by_the_checked_address() {
        let peers = AllowedPeers::default();
        let p = check_remote_host(load("127.0.0.1"), &peers).await.unwrap();
        assert_eq!(host_port(&p).0, Some("127.0.0.1"));
        let p = check_remote_host(load("[::1]"), &peers).await.unwrap();
        assert_eq!(host_port(&p).0, Some("::1"));
        // A name is resolved once, and its address is what the engine gets.
        let p = check_remote_host(load("localhost"), &peers).await.unwrap();
        let ip: IpAddr = host_port(&p).0.unwrap().parse().unwrap();
        assert!(ip.is_loopback(), "{ip}");
        assert_eq!(host_port(&p).1, Some(4000));
    }

    #[tokio::test]
    async fn only_loads_with_a_host_are_checked() {
        let nobody = AllowedPeers::new(Vec::new());
        // P's side, and a load without a host: unchanged (the connector refuses the latter).
        let p = TransferRequest::Export;
        let out = check_remote_host(p.clone(), &nobody).await.unwrap();
        assert_eq!(out, p);
        let mut p = load("x");
        p.import_mut().expect("a load").remote_host = None;
        assert_eq!(check_remote_host(p.clone(), &nobody).await.unwrap(), p);
        // A name that resolves to nothing is refused, naming the key.
        let e = check_remote_host(load("no-such-host.invalid"), &AllowedPeers::default())
            .await
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params.remote_host"));
    }
}
