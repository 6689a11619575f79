//! LoRA adapters as the core sees them: which adapter a request is computed with, and the
//! errors of loading and unloading one (`Scheduler::load_lora`, `Scheduler::unload_lora`).
//!
//! An adapter's KV is keyed like the weights' (`../shared/design/lifecycle.md`, "Stale KV
//! never survives a weight update"): a request with an adapter hashes its blocks from a root
//! that mixes the weight version's root with the adapter's name and version
//! (`hash::lora_root`), so KV of one adapter, or of one version of it, is never a hit for
//! another, nor for the base model. The name and version are what other engines and routers
//! can compare (KV events, P/D exports); the id is the engine's own handle, which the executor
//! is given (`ScheduledReq::lora`).

use std::sync::Arc;

use crate::ids::LoraId;

/// The adapter a request is computed with: the engine's id for it, its name and its version.
/// Plain data; the engine fills it from the adapter it loaded (`Scheduler::load_lora`).
///
/// The version says which weights the name has: every in-place reload or push of the adapter
/// gives it a new, larger one, and a name never gets a version it had before (not even after
/// an unload), so a (name, version) pair always means the same weights.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoraRef {
    pub id: LoraId,
    pub name: Arc<str>,
    pub version: u64,
}

impl LoraRef {
    pub fn new(id: LoraId, name: impl Into<Arc<str>>, version: u64) -> Self {
        Self {
            id,
            name: name.into(),
            version,
        }
    }

    /// How other engines name it: its name and version ([`LoraKey`]).
    pub fn key(&self) -> LoraKey {
        LoraKey {
            name: self.name.clone(),
            version: self.version,
        }
    }

    /// The key its KV is cached under: its id and version ([`LoraTag`]).
    pub fn tag(&self) -> LoraTag {
        LoraTag {
            id: self.id,
            version: self.version,
        }
    }
}

/// An adapter as engines name it to each other (P/D exports and pulls): its name and version.
/// Ids are each engine's own; a (name, version) pair names the same weights everywhere.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoraKey {
    pub name: Arc<str>,
    pub version: u64,
}

/// Which adapter, at which version, computed a cached block (the block pool keeps one per
/// cached block, so an adapter's blocks can be dropped when it is unloaded or reloaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoraTag {
    pub id: LoraId,
    pub version: u64,
}

/// Why the core refused to load or unload an adapter, or a request naming one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraError {
    #[error("LoRA adapter {name:?} is loaded as id {loaded:?}, not {given:?}")]
    NameTaken {
        name: Arc<str>,
        loaded: LoraId,
        given: LoraId,
    },
    #[error("LoRA adapter id {id:?} is adapter {loaded:?}, not {given:?}")]
    IdTaken {
        id: LoraId,
        loaded: Arc<str>,
        given: Arc<str>,
    },
    #[error(
        "LoRA adapter {name:?}: version {given} is not newer than {latest}, which it had \
         before (a version names one set of weights, so it is never reused)"
    )]
    VersionNotNewer {
        name: Arc<str>,
        latest: u64,
        given: u64,
    },
    #[error("LoRA adapter id {0:?} is not loaded")]
    NotLoaded(LoraId),
    #[error("LoRA adapter {given:?} is not the one loaded ({loaded:?})")]
    NotCurrent { given: LoraRef, loaded: LoraRef },
}
