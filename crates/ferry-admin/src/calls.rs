//! The table: every admin call's route, methods, dialect, summary, query parameters and body
//! ([`AdminCall::decl`]). The server mounts each call at its path for its methods and
//! documents it in `/openapi.json` from this; the proxy mounts the same routes; the query
//! parameters listed here are the only ones [`AdminCall::read`] accepts.

use strum::IntoEnumIterator;

use crate::args::AdminCall;

/// An HTTP method an admin call answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
    Delete,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Post => "POST",
            Self::Delete => "DELETE",
        }
    }
}

/// Whose name a route is: the RL frameworks written against vLLM or SGLang call ferry by
/// these, unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Vllm,
    Sglang,
    /// ferry's own (the bucketed weight uploads, the LoRA push).
    Ferry,
}

/// A query parameter: its name and meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    pub name: &'static str,
    pub about: &'static str,
}

/// What a call's body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// None is read.
    None,
    /// An optional small JSON object, of this schema (a component of `/openapi.json`).
    Json(&'static str),
    /// Safetensors bytes, streamed to the engine as they arrive, never read whole.
    Safetensors,
    /// By `Content-Type`: `application/json` is this schema, anything else safetensors
    /// bytes (`/update_weights`).
    JsonOrSafetensors(&'static str),
}

/// One call's row of the table.
#[derive(Debug, Clone, Copy)]
pub struct CallDecl {
    /// The path, with `{upload_id}` where a path parameter goes.
    pub path: &'static str,
    pub methods: &'static [Method],
    pub dialect: Dialect,
    pub summary: &'static str,
    pub query: &'static [Param],
    pub body: Body,
    /// The call reads the weight version: through the proxy, instances that answer
    /// different versions are a 409, never one standing for all.
    pub reads_weight_version: bool,
}

const POST: &[Method] = &[Method::Post];
const GET: &[Method] = &[Method::Get];
const GET_POST: &[Method] = &[Method::Get, Method::Post];
const DELETE: &[Method] = &[Method::Delete];

const fn row(
    methods: &'static [Method],
    path: &'static str,
    dialect: Dialect,
    summary: &'static str,
) -> CallDecl {
    CallDecl {
        path,
        methods,
        dialect,
        summary,
        query: &[],
        body: Body::None,
        reads_weight_version: false,
    }
}

const fn vllm(methods: &'static [Method], path: &'static str, summary: &'static str) -> CallDecl {
    row(methods, path, Dialect::Vllm, summary)
}

const fn sglang(methods: &'static [Method], path: &'static str, summary: &'static str) -> CallDecl {
    row(methods, path, Dialect::Sglang, summary)
}

const fn ferry(methods: &'static [Method], path: &'static str, summary: &'static str) -> CallDecl {
    row(methods, path, Dialect::Ferry, summary)
}

const WEIGHT_VERSION: Param = Param {
    name: "weight_version",
    about: "the version the weights get (default: the previous one bumped)",
};

impl CallDecl {
    /// The call's methods, for a router (the server's and the proxy's mount each call so).
    pub fn method_filter(&self) -> axum::routing::MethodFilter {
        use axum::routing::MethodFilter;
        self.methods
            .iter()
            .map(|m| match m {
                Method::Get => MethodFilter::GET,
                Method::Post => MethodFilter::POST,
                Method::Delete => MethodFilter::DELETE,
            })
            .reduce(MethodFilter::or)
            .expect("a call has a method")
    }
}

impl AdminCall {
    /// The call's row of the table.
    pub const fn decl(self) -> CallDecl {
        use AdminCall as C;
        match self {
            C::Pause => CallDecl {
                query: &[
                    Param { name: "mode", about: "`abort` (default), `wait` or `keep`" },
                    Param { name: "clear_cache", about: "reset the prefix cache once paused (default true)" },
                    Param { name: "wait_for_inflight_requests", about: "deprecated: `true` means `mode=wait`" },
                ],
                ..vllm(POST, "/pause", "Pause generation")
            },
            C::Resume => vllm(POST, "/resume", "Resume after a pause"),
            C::IsPaused => vllm(GET, "/is_paused", "Whether the engine is paused"),
            C::Sleep => CallDecl {
                query: &[
                    Param { name: "level", about: "0, 1 (default: weights offloaded) or 2 (weights dropped)" },
                    Param { name: "mode", about: "`abort` (default), `wait` or `keep`" },
                ],
                body: Body::Json("SleepBody"),
                ..vllm(POST, "/sleep", "Release memory")
            },
            C::WakeUp => CallDecl {
                query: &[Param { name: "tags", about: "`weights` or `kv_cache`, repeatable (none: all)" }],
                body: Body::Json("WakeUpBody"),
                ..vllm(POST, "/wake_up", "Bring memory back")
            },
            C::IsSleeping => vllm(GET, "/is_sleeping", "Whether anything is asleep"),
            C::ReleaseKvCacheMemory => vllm(
                POST,
                "/release_kv_cache_memory",
                "Free the KV cache of a paused engine",
            ),
            C::ResetPrefixCache => CallDecl {
                query: &[
                    Param { name: "reset_running_requests", about: "also preempt running requests (default false)" },
                    Param { name: "reset_external", about: "also reset the connectors' caches (default false)" },
                ],
                body: Body::Json("ResetPrefixCache"),
                ..vllm(POST, "/reset_prefix_cache", "Drop the prefix cache (the offload tier too with reset_external); the answer names what it cleared")
            },
            C::AbortRequests => CallDecl {
                body: Body::Json("AbortRequests"),
                ..vllm(POST, "/abort_requests", "Abort requests by id (none: all)")
            },
            C::UpdateWeights => CallDecl {
                query: &[WEIGHT_VERSION],
                body: Body::JsonOrSafetensors("UpdateWeightsJson"),
                ..vllm(
                    POST,
                    "/update_weights",
                    "Push weights: safetensors bytes, or JSON `{\"weight_dir\": ...}` \
                     (`update_info` is refused: it needs a GPU collective)",
                )
            },
            C::UpdateWeightsFromDisk => CallDecl {
                body: Body::Json("UpdateFromDisk"),
                ..vllm(
                    POST,
                    "/update_weights_from_disk",
                    "Reload weights from a model folder or GGUF file",
                )
            },
            C::UpdateWeightVersion => CallDecl {
                body: Body::Json("UpdateWeightVersion"),
                ..vllm(
                    POST,
                    "/update_weight_version",
                    "Rename the current weights' version",
                )
            },
            C::WeightInfo => CallDecl {
                reads_weight_version: true,
                ..vllm(
                    GET,
                    "/weight_info",
                    "The weights' version, update count and residency",
                )
            },
            C::InitWeightTransferEngine => vllm(
                POST,
                "/init_weight_transfer_engine",
                "vLLM's NCCL weight-transfer setup: refused (400), it needs a GPU collective",
            ),
            C::BeginUpload => CallDecl {
                body: Body::Json("BeginUpload"),
                ..ferry(
                    POST,
                    "/weight_uploads",
                    "Begin a bucketed weight upload (409 while one is open)",
                )
            },
            C::CurrentUpload => ferry(GET, "/weight_uploads", "The open weight upload, or null"),
            C::UploadBucket => CallDecl {
                body: Body::Safetensors,
                ..ferry(
                    POST,
                    "/weight_uploads/{upload_id}/buckets",
                    "Stage a bucket: safetensors bytes, read as they arrive",
                )
            },
            C::PrepareUpload => ferry(
                POST,
                "/weight_uploads/{upload_id}/prepare",
                "Join the buckets and check they can be installed (the first phase of a commit)",
            ),
            C::CommitUpload => CallDecl {
                query: &[Param { name: "weight_version", about: "the version the upload installs under (default: the begin's, else bumped)" }],
                body: Body::Json("CommitUpload"),
                ..ferry(
                    POST,
                    "/weight_uploads/{upload_id}/commit",
                    "Install every staged tensor at once",
                )
            },
            C::DiscardUpload => ferry(
                DELETE,
                "/weight_uploads/{upload_id}",
                "Discard the upload and free what it staged",
            ),
            C::PauseGeneration => CallDecl {
                body: Body::Json("PauseGeneration"),
                ..sglang(
                    POST,
                    "/pause_generation",
                    "SGLang's pause: `abort`, `retract` (keep, with a cache reset) or `in_place` (keep)",
                )
            },
            C::ContinueGeneration => sglang(POST, "/continue_generation", "SGLang's resume"),
            C::FlushCache => sglang(
                GET_POST,
                "/flush_cache",
                "SGLang's prefix-cache reset (400 while blocks are held)",
            ),
            C::ReleaseMemoryOccupation => CallDecl {
                body: Body::Json("MemoryTags"),
                ..sglang(
                    GET_POST,
                    "/release_memory_occupation",
                    "SGLang's sleep: level 1 in `keep` mode, then what `tags` leaves out woken",
                )
            },
            C::ResumeMemoryOccupation => CallDecl {
                body: Body::Json("MemoryTags"),
                ..sglang(
                    GET_POST,
                    "/resume_memory_occupation",
                    "SGLang's wake-up",
                )
            },
            C::GetWeightVersion => CallDecl {
                reads_weight_version: true,
                ..sglang(GET, "/get_weight_version", "SGLang's weight version")
            },
            C::AbortRequest => CallDecl {
                body: Body::Json("AbortRequest"),
                ..sglang(
                    POST,
                    "/abort_request",
                    "SGLang's abort: one request by `rid`, or all with `abort_all`",
                )
            },
            C::LoadLoraAdapter => CallDecl {
                body: Body::Json("LoadLoraAdapter"),
                ..vllm(
                    POST,
                    "/v1/load_lora_adapter",
                    "Load a LoRA adapter from a PEFT folder (`load_inplace`: new weights, its next version)",
                )
            },
            C::UnloadLoraAdapter => CallDecl {
                body: Body::Json("UnloadLoraAdapter"),
                ..vllm(
                    POST,
                    "/v1/unload_lora_adapter",
                    "Unload a LoRA adapter (its requests in flight end as aborted)",
                )
            },
            C::PushLoraAdapter => CallDecl {
                query: &[
                    Param { name: "lora_name", about: "the adapter's name (required)" },
                    Param { name: "config", about: "its adapter_config.json, URL-encoded (required)" },
                    Param { name: "load_inplace", about: "replace a loaded adapter's weights: its next version (default false)" },
                ],
                body: Body::Safetensors,
                ..ferry(
                    POST,
                    "/v1/push_lora_adapter",
                    "Load a LoRA adapter from its tensors: safetensors bytes with PEFT's names (`load_inplace`: new weights, its next version)",
                )
            },
            C::SglangLoadLoraAdapter => CallDecl {
                body: Body::Json("LoadLoraAdapter"),
                ..sglang(POST, "/load_lora_adapter", "SGLang's adapter load")
            },
            C::SglangUnloadLoraAdapter => CallDecl {
                body: Body::Json("UnloadLoraAdapter"),
                ..sglang(POST, "/unload_lora_adapter", "SGLang's adapter unload")
            },
        }
    }

    /// Every call, in declaration order.
    pub fn all() -> impl Iterator<Item = AdminCall> {
        AdminCall::iter()
    }

    /// The call served at `path` for `method`, if any (`{upload_id}` matches one segment).
    pub fn find(method: Method, path: &str) -> Option<AdminCall> {
        Self::all().find(|c| {
            let d = c.decl();
            d.methods.contains(&method) && path_param(d.path, path).is_some()
        })
    }
}

/// Matches `path` against the `template`: `Some` with the value of its one `{..}` segment
/// (`""` when it has none), `None` when they differ.
pub fn path_param<'a>(template: &str, path: &'a str) -> Option<&'a str> {
    let (mut t, mut a) = (template.split('/'), path.split('/'));
    let mut value = "";
    loop {
        match (t.next(), a.next()) {
            (None, None) => return Some(value),
            (Some(ts), Some(seg)) if ts.starts_with('{') && ts.ends_with('}') => {
                if seg.is_empty() {
                    return None;
                }
                value = seg;
            }
            (Some(ts), Some(seg)) if ts == seg => {}
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_route_and_method_is_one_call() {
        let mut seen = BTreeSet::new();
        for call in AdminCall::all() {
            let d = call.decl();
            assert!(d.path.starts_with('/'), "{call:?}");
            assert!(!d.methods.is_empty(), "{call:?}");
            for m in d.methods {
                assert!(
                    seen.insert((d.path, m.as_str())),
                    "{} {} is declared twice",
                    m.as_str(),
                    d.path
                );
            }
            assert_eq!(
                AdminCall::find(d.methods[0], d.path.replace("{upload_id}", "u1").as_str()),
                Some(call)
            );
        }
    }

    #[test]
    fn a_path_parameter_matches_one_segment() {
        let t = "/weight_uploads/{upload_id}/commit";
        assert_eq!(path_param(t, "/weight_uploads/u-1/commit"), Some("u-1"));
        assert_eq!(path_param(t, "/weight_uploads//commit"), None);
        assert_eq!(path_param(t, "/weight_uploads/u-1/prepare"), None);
        assert_eq!(path_param(t, "/weight_uploads/u-1"), None);
        assert_eq!(path_param("/pause", "/pause"), Some(""));
        assert_eq!(
            AdminCall::find(Method::Delete, "/weight_uploads/x"),
            Some(AdminCall::DiscardUpload)
        );
        assert_eq!(AdminCall::find(Method::Get, "/pause"), None);
    }
}
