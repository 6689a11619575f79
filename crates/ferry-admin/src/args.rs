//! A call's arguments as read ([`Args`], one variant per call; [`AdminCall`] is its name) and
//! what a call may do given them ([`Args::effects`]). How they are read from a request is
//! [`crate::read`].

use ferry_core::{PauseMode, SleepLevel, WakeTag};

/// What a call asks for, read from its request. The variant names the call ([`AdminCall`]).
#[derive(Debug, Clone, PartialEq, Eq, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(AdminCall),
    derive(Hash, PartialOrd, Ord, strum::EnumIter),
    doc = "One admin call: a route of the lifecycle and weight API (see the crate docs). Its \
           row of the table is [`AdminCall::decl`], its arguments are read by \
           [`AdminCall::read`]."
)]
pub enum Args {
    /// `POST /pause` (vLLM's).
    Pause(Pausing),
    Resume,
    IsPaused,
    Sleep {
        level: SleepLevel,
        mode: PauseMode,
    },
    /// No tags: everything.
    WakeUp {
        tags: Vec<WakeTag>,
    },
    IsSleeping,
    ReleaseKvCacheMemory,
    ResetPrefixCache {
        reset_running_requests: bool,
        reset_external: bool,
    },
    /// `None`: every request.
    AbortRequests {
        ids: Option<Vec<String>>,
    },
    UpdateWeights(UpdateWeights),
    UpdateWeightsFromDisk {
        model_path: String,
        weight_version: Option<String>,
        /// Abort every request first (SGLang's `abort_all_requests`).
        abort_all_requests: bool,
    },
    UpdateWeightVersion {
        new_version: String,
    },
    WeightInfo,
    /// vLLM's NCCL setup: the server refuses it (it needs a GPU collective).
    InitWeightTransferEngine,
    BeginUpload {
        weight_version: Option<String>,
    },
    CurrentUpload,
    UploadBucket {
        upload_id: String,
    },
    PrepareUpload {
        upload_id: String,
    },
    CommitUpload {
        upload_id: String,
        weight_version: Option<String>,
    },
    DiscardUpload {
        upload_id: String,
    },
    /// SGLang's pause: its modes as ferry's (`retract` is a keep pause that clears the cache).
    PauseGeneration(Pausing),
    ContinueGeneration,
    FlushCache,
    /// `None`: every tag; `Some` of no tags: only tags ferry has none of (nothing to do).
    ReleaseMemoryOccupation {
        tags: Option<Vec<WakeTag>>,
    },
    /// As [`Args::ReleaseMemoryOccupation`]'s tags.
    ResumeMemoryOccupation {
        tags: Option<Vec<WakeTag>>,
    },
    GetWeightVersion,
    /// `None`: every request (`abort_all`).
    AbortRequest {
        ids: Option<Vec<String>>,
    },
    /// vLLM's `/v1/load_lora_adapter`: a PEFT folder as the adapter `lora_name`; with
    /// `load_inplace`, new weights for a loaded one (its next version).
    LoadLoraAdapter {
        lora_name: String,
        lora_path: String,
        load_inplace: bool,
    },
    UnloadLoraAdapter {
        lora_name: String,
    },
    /// ferry's `/v1/push_lora_adapter`: the adapter's tensors as the body (safetensors bytes,
    /// not read here), its `adapter_config.json` as `config`, loaded as `lora_name`; with
    /// `load_inplace`, new weights for a loaded one (its next version).
    PushLoraAdapter {
        lora_name: String,
        config: String,
        load_inplace: bool,
    },
    /// SGLang's `/load_lora_adapter` (no in-place load: a loaded name is refused).
    SglangLoadLoraAdapter {
        lora_name: String,
        lora_path: String,
    },
    SglangUnloadLoraAdapter {
        lora_name: String,
    },
}

/// A pause's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pausing {
    pub mode: PauseMode,
    pub clear_cache: bool,
}

/// `POST /update_weights`, by its body's `Content-Type`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateWeights {
    /// Safetensors bytes, streamed (not read here).
    Push { weight_version: Option<String> },
    /// JSON `{"weight_dir": ...}` (prime-rl's): a reload from that folder.
    Folder {
        weight_dir: String,
        weight_version: Option<String>,
    },
}

/// What a call may do to an engine, given its arguments. "May": a reset refused because
/// blocks are held changed nothing, but the caller cannot know that before the answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Effects {
    /// Stops compute (a pause or sleep).
    pub pauses: bool,
    /// Drops cached prefixes: a reset, a pause unless `clear_cache=false`, SGLang's
    /// `retract`, a sleep or release of memory.
    pub clears_cache: bool,
    /// Drops the offload tier's blocks too: every clear but a reset's by default (vLLM's
    /// `reset_external=false`, SGLang's `/flush_cache`), which leaves them loadable.
    pub clears_offload: bool,
    /// Changes the weights or their version, which makes every cached block unreachable.
    pub changes_weights: bool,
    /// Finishes requests as aborted.
    pub aborts: bool,
    /// Releases memory (the KV cache, the weights).
    pub releases_memory: bool,
}

impl Effects {
    /// No block of the device's prefix cache may be hit after the call: a KV-aware router
    /// must forget them before it routes by them again.
    pub fn wipes_cache(&self) -> bool {
        self.clears_cache || self.changes_weights
    }

    /// No block of the offload tier may be hit after the call either (a new weight version
    /// makes every block unreachable, the tier's too).
    pub fn wipes_offload(&self) -> bool {
        self.clears_offload || self.changes_weights
    }
}

impl Args {
    /// The call these arguments are for.
    pub fn call(&self) -> AdminCall {
        AdminCall::from(self)
    }

    /// What the call may do given these arguments.
    pub fn effects(&self) -> Effects {
        let none = Effects::default();
        let pause = |mode: PauseMode| Effects {
            pauses: true,
            aborts: mode == PauseMode::Abort,
            ..none
        };
        let weights = Effects {
            changes_weights: true,
            ..none
        };
        match self {
            Args::Pause(p) | Args::PauseGeneration(p) => Effects {
                clears_cache: p.clear_cache,
                clears_offload: p.clear_cache,
                ..pause(p.mode)
            },
            Args::Sleep { level, mode } => Effects {
                clears_cache: *level != SleepLevel::L0,
                clears_offload: *level != SleepLevel::L0,
                releases_memory: *level != SleepLevel::L0,
                ..pause(*mode)
            },
            Args::ReleaseMemoryOccupation { tags } => match tags {
                Some(t) if t.is_empty() => none,
                _ => Effects {
                    clears_cache: true,
                    clears_offload: true,
                    releases_memory: true,
                    ..pause(PauseMode::Keep)
                },
            },
            Args::ReleaseKvCacheMemory => Effects {
                clears_cache: true,
                clears_offload: true,
                releases_memory: true,
                ..none
            },
            Args::ResetPrefixCache { reset_external, .. } => Effects {
                clears_cache: true,
                clears_offload: *reset_external,
                ..none
            },
            Args::FlushCache => Effects {
                clears_cache: true,
                ..none
            },
            Args::AbortRequests { .. } | Args::AbortRequest { .. } => Effects {
                aborts: true,
                ..none
            },
            Args::UpdateWeightsFromDisk {
                abort_all_requests, ..
            } => Effects {
                aborts: *abort_all_requests,
                ..weights
            },
            Args::UpdateWeights(_)
            | Args::UpdateWeightVersion { .. }
            | Args::CommitUpload { .. } => weights,
            // An adapter's new version or its unload drops only the KV that adapter computed
            // (its blocks' removals reach routers as KV events); the base's stays cached.
            Args::UnloadLoraAdapter { .. } | Args::SglangUnloadLoraAdapter { .. } => Effects {
                aborts: true,
                ..none
            },
            Args::LoadLoraAdapter { .. }
            | Args::SglangLoadLoraAdapter { .. }
            | Args::PushLoraAdapter { .. } => none,
            Args::Resume
            | Args::ContinueGeneration
            | Args::IsPaused
            | Args::IsSleeping
            | Args::WakeUp { .. }
            | Args::ResumeMemoryOccupation { .. }
            | Args::WeightInfo
            | Args::GetWeightVersion
            | Args::InitWeightTransferEngine
            | Args::BeginUpload { .. }
            | Args::CurrentUpload
            | Args::UploadBucket { .. }
            | Args::PrepareUpload { .. }
            | Args::DiscardUpload { .. } => none,
        }
    }
}
