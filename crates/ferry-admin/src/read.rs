//! How a call's arguments are read from its request ([`AdminCall::read`]): the query string
//! (only the parameters the table lists), the path parameter and the JSON body.
//!
//! Reading refuses what the call does not take (an unknown query parameter, an unknown body
//! field where the body is strict) and every bad value with a 400 naming the parameter, so
//! a call that reads is a call the engine can be asked; the server then makes it, and the
//! proxy fences by its effects.

use ferry_core::{PauseMode, SleepLevel, WakeTag};
use ferry_http::error::ApiError;
use ferry_http::json::parse_json;
use serde::de::DeserializeOwned;

use crate::args::{AdminCall, Args, Pausing, UpdateWeights};
use crate::bodies;
use crate::calls::{path_param, Body};
use crate::query::{non_empty, pause_mode, sleep_level, wake_tags, QueryArgs};

/// What a call's request gives its reading.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The request's path (for a path parameter).
    pub path: &'a str,
    /// The raw query string.
    pub query: Option<&'a str>,
    /// The body, when it is read whole: a JSON body (or none). `None` for a body streamed
    /// past the reading (safetensors bytes), which reads the query only.
    pub body: Option<&'a [u8]>,
}

/// The message of vLLM's `update_info`, refused.
pub const NEEDS_COLLECTIVE: &str = "`update_info` asks for vLLM's NCCL weight transfer, which \
    needs a GPU collective between the trainer and this server; ferry has none. Send the \
    weights instead: the safetensors bytes as the body of `POST /update_weights` \
    (Content-Type: application/octet-stream), a folder with `POST /update_weights \
    {\"weight_dir\": ...}`, or a model folder with `POST /update_weights_from_disk \
    {\"model_path\": ...}`";

/// SGLang's memory tag for CUDA graphs: a CPU engine has none, so it is accepted and skipped.
const IGNORED_TAGS: &[&str] = &["cuda_graph"];

impl AdminCall {
    /// Reads the call's arguments from `req`: its query (only the parameters the table
    /// lists), its path parameter and its JSON body, each bad one a 400 naming it.
    pub fn read(self, req: Request<'_>) -> Result<Args, ApiError> {
        use AdminCall as C;
        let decl = self.decl();
        let q = QueryArgs::parse(req.query, decl.query.iter().map(|p| p.name))?;
        let body = req.body.unwrap_or(b"");
        let upload_id = || -> Result<String, ApiError> {
            path_param(decl.path, req.path)
                .filter(|id| !id.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| ApiError::invalid("upload_id", "the path names no upload"))
        };
        Ok(match self {
            C::Pause => {
                let default_mode = if q.bool("wait_for_inflight_requests", false)? {
                    PauseMode::Wait
                } else {
                    PauseMode::Abort
                };
                Args::Pause(Pausing {
                    mode: q.pause_mode("mode", default_mode)?,
                    clear_cache: q.bool("clear_cache", true)?,
                })
            }
            C::Resume => Args::Resume,
            C::IsPaused => Args::IsPaused,
            C::Sleep => {
                let b: bodies::SleepBody = json(body)?;
                Args::Sleep {
                    level: match b.level {
                        Some(l) => sleep_level(l, "level")?,
                        None => q.sleep_level("level", SleepLevel::L1)?,
                    },
                    mode: match b.mode {
                        Some(m) => pause_mode(m, "mode")?,
                        None => q.pause_mode("mode", PauseMode::Abort)?,
                    },
                }
            }
            C::WakeUp => {
                let b: bodies::WakeUpBody = json(body)?;
                let tags = match &b.tags {
                    Some(list) => {
                        let list: Vec<&str> = list.iter().map(String::as_str).collect();
                        wake_tags(&list, "tags", &[])?
                    }
                    None => wake_tags(&q.all("tags"), "tags", &[])?,
                };
                Args::WakeUp { tags }
            }
            C::IsSleeping => Args::IsSleeping,
            C::ReleaseKvCacheMemory => Args::ReleaseKvCacheMemory,
            C::ResetPrefixCache => {
                let b: bodies::ResetPrefixCache = json(body)?;
                Args::ResetPrefixCache {
                    reset_running_requests: match b.reset_running_requests {
                        Some(v) => v,
                        None => q.bool("reset_running_requests", false)?,
                    },
                    reset_external: match b.reset_external {
                        Some(v) => v,
                        None => q.bool("reset_external", false)?,
                    },
                }
            }
            C::AbortRequests => {
                let b: bodies::AbortRequests = json(body)?;
                Args::AbortRequests {
                    ids: b.request_ids.filter(|ids| !ids.is_empty()),
                }
            }
            C::UpdateWeights => Args::UpdateWeights(match req.body {
                None => UpdateWeights::Push {
                    weight_version: q.non_empty("weight_version")?,
                },
                Some(body) => update_weights_json(body, &q)?,
            }),
            C::UpdateWeightsFromDisk => {
                let b: bodies::UpdateFromDisk = json(body)?;
                Args::UpdateWeightsFromDisk {
                    model_path: required(b.model_path, "model_path")?,
                    weight_version: non_empty(b.weight_version, "weight_version")?,
                    abort_all_requests: b.abort_all_requests == Some(true),
                }
            }
            C::UpdateWeightVersion => {
                let b: bodies::UpdateWeightVersion = json(body)?;
                Args::UpdateWeightVersion {
                    new_version: required(b.new_version, "new_version")?,
                }
            }
            C::WeightInfo => Args::WeightInfo,
            C::InitWeightTransferEngine => Args::InitWeightTransferEngine,
            C::BeginUpload => {
                let b: bodies::BeginUpload = json(body)?;
                Args::BeginUpload {
                    weight_version: non_empty(b.weight_version, "weight_version")?,
                }
            }
            C::CurrentUpload => Args::CurrentUpload,
            C::UploadBucket => Args::UploadBucket {
                upload_id: upload_id()?,
            },
            C::PrepareUpload => Args::PrepareUpload {
                upload_id: upload_id()?,
            },
            C::CommitUpload => {
                let b: bodies::CommitUpload = json(body)?;
                let weight_version = match non_empty(b.weight_version, "weight_version")? {
                    Some(v) => Some(v),
                    None => q.non_empty("weight_version")?,
                };
                Args::CommitUpload {
                    upload_id: upload_id()?,
                    weight_version,
                }
            }
            C::DiscardUpload => Args::DiscardUpload {
                upload_id: upload_id()?,
            },
            C::PauseGeneration => {
                let b: bodies::PauseGeneration = json(body)?;
                let (mode, clear_cache) = match b.mode.as_deref().unwrap_or("abort") {
                    "abort" => (PauseMode::Abort, false),
                    // Retracted requests give their KV back and recompute on continue.
                    "retract" => (PauseMode::Keep, true),
                    "in_place" => (PauseMode::Keep, false),
                    other => {
                        return Err(ApiError::invalid(
                            "mode",
                            format!(
                                "unknown pause mode `{other}` (expected abort, retract or \
                                 in_place)"
                            ),
                        ))
                    }
                };
                Args::PauseGeneration(Pausing { mode, clear_cache })
            }
            C::ContinueGeneration => Args::ContinueGeneration,
            C::FlushCache => Args::FlushCache,
            C::ReleaseMemoryOccupation => Args::ReleaseMemoryOccupation {
                tags: memory_tags(body)?,
            },
            C::ResumeMemoryOccupation => Args::ResumeMemoryOccupation {
                tags: memory_tags(body)?,
            },
            C::GetWeightVersion => Args::GetWeightVersion,
            C::AbortRequest => {
                let b: bodies::AbortRequest = json(body)?;
                let ids = match (b.abort_all, b.rid) {
                    (Some(true), _) => None,
                    (_, Some(rid)) if !rid.is_empty() => Some(vec![rid]),
                    _ => {
                        return Err(ApiError::invalid(
                            "rid",
                            "`rid` (a request id) or `abort_all: true` is required",
                        ))
                    }
                };
                Args::AbortRequest { ids }
            }
            C::LoadLoraAdapter | C::SglangLoadLoraAdapter => {
                let b: bodies::LoadLoraAdapter = json(body)?;
                let lora_name = required(b.lora_name, "lora_name")?;
                let lora_path = required(b.lora_path, "lora_path")?;
                match (self, b.load_inplace) {
                    (C::LoadLoraAdapter, inplace) => Args::LoadLoraAdapter {
                        lora_name,
                        lora_path,
                        load_inplace: inplace == Some(true),
                    },
                    (_, Some(_)) => {
                        return Err(ApiError::invalid(
                            "load_inplace",
                            "SGLang's /load_lora_adapter has no `load_inplace`: use vLLM's \
                             /v1/load_lora_adapter",
                        ))
                    }
                    (_, None) => Args::SglangLoadLoraAdapter {
                        lora_name,
                        lora_path,
                    },
                }
            }
            C::PushLoraAdapter => Args::PushLoraAdapter {
                lora_name: required(q.last("lora_name").map(str::to_owned), "lora_name")?,
                config: required(q.last("config").map(str::to_owned), "config")?,
                load_inplace: q.bool("load_inplace", false)?,
            },
            C::UnloadLoraAdapter | C::SglangUnloadLoraAdapter => {
                let b: bodies::UnloadLoraAdapter = json(body)?;
                let lora_name = required(b.lora_name, "lora_name")?;
                if self == C::UnloadLoraAdapter {
                    Args::UnloadLoraAdapter { lora_name }
                } else {
                    Args::SglangUnloadLoraAdapter { lora_name }
                }
            }
        })
    }

    /// Whether the call streams its body past the reading (safetensors bytes), given its
    /// `Content-Type` (`json`: the type is `application/json`).
    pub fn streams_body(self, json: bool) -> bool {
        match self.decl().body {
            Body::Safetensors => true,
            Body::JsonOrSafetensors(_) => !json,
            Body::None | Body::Json(_) => false,
        }
    }
}

/// An optional JSON body: empty or `null` (what a client that always sends a body sends
/// without arguments, and the proxy's fan-out) is no arguments.
fn json<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    let body = body.trim_ascii();
    if body.is_empty() || body == b"null" {
        Ok(T::default())
    } else {
        parse_json(body)
    }
}

/// A string argument that must be given, and not empty.
fn required(v: Option<String>, param: &str) -> Result<String, ApiError> {
    non_empty(v, param)?.ok_or_else(|| ApiError::invalid(param, format!("`{param}` is required")))
}

fn update_weights_json(body: &[u8], q: &QueryArgs) -> Result<UpdateWeights, ApiError> {
    let b: bodies::UpdateWeightsJson = json(body)?;
    if b.update_info.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid("update_info", NEEDS_COLLECTIVE));
    }
    let weight_dir = match b.weight_dir {
        None => {
            return Err(ApiError::invalid(
                "weight_dir",
                "`weight_dir` is required in a JSON body (or send safetensors bytes as \
                 application/octet-stream)",
            ))
        }
        Some(d) => required(Some(d), "weight_dir")?,
    };
    let weight_version = match non_empty(b.weight_version, "weight_version")? {
        Some(v) => Some(v),
        None => q.non_empty("weight_version")?,
    };
    Ok(UpdateWeights::Folder {
        weight_dir,
        weight_version,
    })
}

/// The tags a memory route names: `None` for all (absent or empty), else the wake-up tags
/// (possibly none, when only ignored tags were named).
fn memory_tags(body: &[u8]) -> Result<Option<Vec<WakeTag>>, ApiError> {
    let b: bodies::MemoryTags = json(body)?;
    match b.tags {
        None => Ok(None),
        Some(t) if t.is_empty() => Ok(None),
        Some(t) => {
            let names: Vec<&str> = t.iter().map(String::as_str).collect();
            wake_tags(&names, "tags", IGNORED_TAGS).map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(call: AdminCall, query: Option<&str>, body: &str) -> Result<Args, ApiError> {
        let path = call.decl().path.replace("{upload_id}", "u1");
        call.read(Request {
            path: &path,
            query,
            body: Some(body.as_bytes()),
        })
    }

    fn wipes(call: AdminCall, query: Option<&str>, body: &str) -> bool {
        read(call, query, body).unwrap().effects().wipes_cache()
    }

    #[test]
    fn every_call_reads_with_no_arguments_or_names_the_missing_one() {
        for call in AdminCall::all() {
            match read(call, None, "") {
                Ok(args) => assert_eq!(args.call(), call),
                Err(e) => {
                    assert_eq!(e.status, 400, "{call:?}");
                    let param = e.param.unwrap_or_default();
                    assert!(
                        [
                            "model_path",
                            "new_version",
                            "rid",
                            "weight_dir",
                            "lora_name",
                            "config"
                        ]
                        .contains(&param.as_str()),
                        "{call:?}: {param}"
                    );
                }
            }
        }
    }

    /// A push reads its query only (the body is the tensors, streamed past the reading),
    /// each missing or bad parameter named.
    #[test]
    fn a_lora_push_reads_its_query() {
        let push = |query: &str| {
            AdminCall::PushLoraAdapter.read(Request {
                path: "/v1/push_lora_adapter",
                query: Some(query),
                body: None,
            })
        };
        let config = r#"{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}"#;
        let query = format!(
            "lora_name=pol&load_inplace=true&config={}",
            form_urlencoded::byte_serialize(config.as_bytes()).collect::<String>()
        );
        let args = push(&query).unwrap();
        assert_eq!(
            args,
            Args::PushLoraAdapter {
                lora_name: "pol".into(),
                config: config.into(),
                load_inplace: true
            }
        );
        assert_eq!(args.effects(), crate::Effects::default());
        assert!(AdminCall::PushLoraAdapter.streams_body(false));
        assert!(AdminCall::PushLoraAdapter.streams_body(true));
        let param = |q: &str| push(q).unwrap_err().param;
        assert_eq!(param("config=%7B%7D"), Some("lora_name".into()));
        assert_eq!(param("lora_name=a"), Some("config".into()));
        assert_eq!(param("lora_name=a&config="), Some("config".into()));
        assert_eq!(
            param("lora_name=a&config=x&load_inplace=maybe"),
            Some("load_inplace".into())
        );
        assert_eq!(
            param("lora_name=a&config=x&lora_path=/p"),
            Some("lora_path".into())
        );
    }

    /// vLLM's load takes `load_inplace`; SGLang's has none and names it; an unload aborts
    /// the adapter's requests and, like a load, leaves the base's cache alone.
    #[test]
    fn lora_calls_read_their_bodies() {
        use AdminCall as C;
        let body = r#"{"lora_name": "a", "lora_path": "/p", "load_inplace": true}"#;
        assert_eq!(
            read(C::LoadLoraAdapter, None, body).unwrap(),
            Args::LoadLoraAdapter {
                lora_name: "a".into(),
                lora_path: "/p".into(),
                load_inplace: true
            }
        );
        let e = read(C::SglangLoadLoraAdapter, None, body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("load_inplace"));
        let e = read(C::LoadLoraAdapter, None, r#"{"lora_name": "a"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("lora_path"));
        let unload = read(C::UnloadLoraAdapter, None, r#"{"lora_name": "a"}"#).unwrap();
        assert!(unload.effects().aborts && !unload.effects().wipes_cache());
        assert!(!wipes(C::LoadLoraAdapter, None, body));
    }

    #[test]
    fn a_pause_clears_the_cache_unless_told_not_to() {
        use AdminCall as C;
        assert!(wipes(C::Pause, None, ""));
        assert!(wipes(C::Pause, Some("mode=keep"), ""));
        assert!(!wipes(C::Pause, Some("clear_cache=false&mode=keep"), ""));
        assert!(wipes(C::PauseGeneration, None, r#"{"mode": "retract"}"#));
        assert!(!wipes(C::PauseGeneration, None, r#"{"mode": "in_place"}"#));
        assert!(!wipes(C::PauseGeneration, None, ""));
        assert!(!wipes(C::Sleep, Some("level=0"), ""));
        assert!(wipes(C::Sleep, None, r#"{"level": 2}"#));
        assert!(wipes(C::ReleaseMemoryOccupation, None, ""));
        assert!(!wipes(
            C::ReleaseMemoryOccupation,
            None,
            r#"{"tags": ["cuda_graph"]}"#
        ));
        assert!(wipes(C::FlushCache, None, ""));
        assert!(wipes(C::CommitUpload, None, ""));
        assert!(!wipes(C::PrepareUpload, None, ""));
        assert!(!wipes(C::WakeUp, None, ""));
        let push = C::UpdateWeights.read(Request {
            path: "/update_weights",
            query: Some("weight_version=v2"),
            body: None,
        });
        assert_eq!(
            push.unwrap(),
            Args::UpdateWeights(UpdateWeights::Push {
                weight_version: Some("v2".into())
            })
        );
    }

    #[test]
    fn bad_arguments_name_their_parameter() {
        use AdminCall as C;
        let param = |call, q: Option<&str>, b: &str| read(call, q, b).unwrap_err().param;
        assert_eq!(
            param(C::Pause, Some("clear_cach=false"), ""),
            Some("clear_cach".into())
        );
        assert_eq!(param(C::IsPaused, Some("x=1"), ""), Some("x".into()));
        assert_eq!(
            param(C::Sleep, None, r#"{"level": 3}"#),
            Some("level".into())
        );
        assert_eq!(
            read(C::Sleep, None, r#"{"lvl": 1}"#).unwrap_err().status,
            400
        );
        assert_eq!(
            param(C::PauseGeneration, None, r#"{"mode": "nap"}"#),
            Some("mode".into())
        );
        assert_eq!(
            param(C::UpdateWeights, None, r#"{"update_info": {}}"#),
            Some("update_info".into())
        );
        assert_eq!(param(C::WakeUp, Some("tags=gpu"), ""), Some("tags".into()));
        assert_eq!(
            read(C::CommitUpload, Some("weight_version=v3"), "").unwrap(),
            Args::CommitUpload {
                upload_id: "u1".into(),
                weight_version: Some("v3".into())
            }
        );
    }
}
