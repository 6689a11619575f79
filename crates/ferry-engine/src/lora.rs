//! LoRA adapters on the engine thread: which names are loaded, under which id and version,
//! which are pinned, and how many the engine holds (`--max-cpu-loras`).
//!
//! The engine core is the one place that says which adapter a name is now: a request names
//! its adapter by name ([`crate::GenerateRequest::lora`]) and the core resolves it when it
//! takes the request, so a request that arrives while the adapter is replaced runs under the
//! version loaded when it was added, never a version that is gone. Loading, replacing and
//! unloading are lifecycle calls, handled between two steps: the executor's weights, the
//! scheduler's adapter table (`Scheduler::load_lora`, which drops the KV an old version
//! computed) and this table change together, so no token is computed with a mix.
//!
//! Every adapter is held in memory (a CPU engine has no other tier for them), so
//! `--max-cpu-loras` bounds how many are loaded at once; a load beyond it is refused naming
//! the adapters held (unload one first), never met by evicting one: an adapter loaded or
//! pushed at run time could not be brought back.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use ferry_core::{LoraError, LoraId, LoraRef, RequestOutput, Scheduler};
use ferry_model::{Executor, LlamaConfig, LoraAdapter};

use crate::Stopped;

/// What an engine serving adapters needs to know: the base they must fit and the limits.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSettings {
    /// The base model's config, which every adapter is checked against.
    pub base: Arc<LlamaConfig>,
    /// Largest rank an adapter may have (`--max-lora-rank`).
    pub max_rank: usize,
    /// Most adapters loaded at once (`--max-cpu-loras`; `None`: no bound).
    pub max_cpu_loras: Option<usize>,
}

/// One loaded adapter, as `/v1/models` and the load calls report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraInfo {
    pub name: String,
    pub id: LoraId,
    /// Its version: 1 at its first load, one more at every in-place load or push (a name
    /// never gets a version it had before, not even after an unload).
    pub version: u64,
    /// Where it was read from (`None`: pushed).
    pub source: Option<String>,
    /// Loaded at run time (never unloaded but by a call).
    pub pinned: bool,
    /// Its largest rank.
    pub rank: usize,
}

/// Why a load or unload was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoraCallError {
    #[error("this server serves no LoRA adapters (start it with --enable-lora)")]
    Disabled,
    #[error(
        "the LoRA adapter `{0}` has already been loaded; to replace its weights, load it with \
         load_inplace true"
    )]
    AlreadyLoaded(String),
    #[error("the LoRA adapter `{0}` cannot be found")]
    NotFound(String),
    #[error("the LoRA adapter name `{0}` is the base model's")]
    BaseName(String),
    #[error(
        "{held} LoRA adapters are loaded, the most --max-cpu-loras allows: unload one of \
         {names} first"
    )]
    Full { held: usize, names: String },
    /// The adapter itself: its folder, config or tensors (the message names which).
    #[error("{0}")]
    Invalid(String),
    /// A pushed adapter: its config (`param` is `config`) or its safetensors body (`body`).
    #[error("{message}")]
    Pushed {
        param: &'static str,
        message: String,
    },
    #[error("the executor refused the adapter: {0}")]
    Executor(String),
    #[error(transparent)]
    Core(#[from] LoraError),
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// The adapters loaded now, shared with the handle (read by `/v1/models` and by the server's
/// early 404 for an unknown name; the engine thread is the one writer).
pub(crate) type LoraTable = Arc<RwLock<Vec<LoraInfo>>>;

#[derive(Debug)]
struct Entry {
    lora: LoraRef,
    source: Option<String>,
    pinned: bool,
    rank: usize,
}

/// The engine core's adapter names ([`crate::EngineCore`] holds one).
#[derive(Debug, Default)]
pub(crate) struct Loras {
    settings: Option<LoraSettings>,
    by_name: BTreeMap<Arc<str>, Entry>,
    next_id: u32,
    table: LoraTable,
}

/// A load, as the handle sends it to the engine thread (the adapter read and checked off it).
#[derive(Debug)]
pub struct LoraLoad {
    pub name: Arc<str>,
    pub adapter: Arc<LoraAdapter>,
    pub source: Option<PathBuf>,
    pub inplace: bool,
    pub pinned: bool,
}

impl Loras {
    pub(crate) fn new(settings: Option<LoraSettings>) -> Self {
        Self {
            settings,
            ..Self::default()
        }
    }

    pub(crate) fn table(&self) -> LoraTable {
        self.table.clone()
    }

    /// The adapter `name` is now, for a request naming it.
    pub(crate) fn resolve(&self, name: &str) -> Option<LoraRef> {
        self.by_name.get(name).map(|e| e.lora.clone())
    }

    /// Loads `load` into the executor and the scheduler, or replaces the weights of a loaded
    /// adapter (`inplace`) under its next version. Refused, changing nothing, when adapters
    /// are off, the name is loaded and `inplace` is false, or the engine holds
    /// `max_cpu_loras` adapters already.
    pub(crate) fn load(
        &mut self,
        load: LoraLoad,
        executor: &mut dyn Executor,
        sched: &mut Scheduler,
    ) -> Result<LoraInfo, LoraCallError> {
        let Some(settings) = &self.settings else {
            return Err(LoraCallError::Disabled);
        };
        let name = load.name;
        let existing = self.by_name.get(&name);
        let id = match existing {
            Some(_) if !load.inplace => return Err(LoraCallError::AlreadyLoaded(name.to_string())),
            Some(e) => e.lora.id,
            None => {
                if let Some(max) = settings.max_cpu_loras {
                    if self.by_name.len() >= max {
                        return Err(LoraCallError::Full {
                            held: self.by_name.len(),
                            names: self.names(),
                        });
                    }
                }
                LoraId(self.next_id)
            }
        };
        // The core remembers each name's versions, unloaded ones too: never one twice.
        let version = sched.lora_latest_version(&name).map_or(1, |v| v + 1);
        let rank = load.adapter.max_rank();
        executor
            .load_lora(id, load.adapter)
            .map_err(|e| LoraCallError::Executor(e.to_string()))?;
        let lora = LoraRef::new(id, name.clone(), version);
        if let Err(e) = sched.load_lora(lora.clone()) {
            // The scheduler refused (a bug in this table): the executor must not hold what
            // no request can name.
            if existing.is_none() {
                let _ = executor.unload_lora(id);
            }
            return Err(e.into());
        }
        if existing.is_none() {
            self.next_id += 1;
        }
        let pinned = load.pinned || existing.is_some_and(|e| e.pinned);
        self.by_name.insert(
            name.clone(),
            Entry {
                lora,
                source: load.source.map(|p| p.display().to_string()),
                pinned,
                rank,
            },
        );
        self.publish();
        Ok(self.info(&self.by_name[&name]))
    }

    /// Unloads `name`: its live requests finish as aborted (returned, for their streams),
    /// its cached KV goes, the executor drops its weights.
    pub(crate) fn unload(
        &mut self,
        name: &str,
        executor: &mut dyn Executor,
        sched: &mut Scheduler,
    ) -> Result<Vec<RequestOutput>, LoraCallError> {
        if self.settings.is_none() {
            return Err(LoraCallError::Disabled);
        }
        let Some(entry) = self.by_name.get(name) else {
            return Err(LoraCallError::NotFound(name.to_owned()));
        };
        let id = entry.lora.id;
        let aborted = sched.unload_lora(id)?;
        // The scheduler no longer names it, so no plan will; an executor that did not hold
        // it has nothing to drop.
        let _ = executor.unload_lora(id);
        self.by_name.remove(name);
        self.publish();
        Ok(aborted)
    }

    fn names(&self) -> String {
        let names: Vec<String> = self.by_name.keys().map(|n| format!("`{n}`")).collect();
        names.join(", ")
    }

    fn info(&self, e: &Entry) -> LoraInfo {
        LoraInfo {
            name: e.lora.name.to_string(),
            id: e.lora.id,
            version: e.lora.version,
            source: e.source.clone(),
            pinned: e.pinned,
            rank: e.rank,
        }
    }

    fn publish(&self) {
        let infos = self.by_name.values().map(|e| self.info(e)).collect();
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = infos;
    }
}
