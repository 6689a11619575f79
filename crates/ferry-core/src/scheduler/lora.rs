//! LoRA adapters in the scheduler: the adapters loaded, each at its version
//! ([`Scheduler::load_lora`], [`Scheduler::unload_lora`]), what a reload or an unload does to
//! the KV computed with the adapter, and how many adapters one step computes
//! (`SchedulerConfig::max_loras`, [`LoraSeats`]).
//!
//! The KV of an adapter follows the rule of the weights' (`../shared/design/lifecycle.md`):
//! its hash chains are keyed by the adapter's name and version (`hash::lora_root`), so no
//! other adapter, version or the base model can hit it; and what would only linger as
//! unreachable cache is dropped at once: an unload drops every block the adapter computed, a
//! reload every block of its older versions. A dropped block that something holds (a running
//! request, an export, a store to the offload tier) stays with its holders, out of the prefix
//! cache: it is freed when they release it and is never a hit again.

use super::{RequestOutput, Scheduler};
use crate::ids::{LoraId, ReqIdx};
use crate::lora::{LoraError, LoraRef};

impl Scheduler {
    /// Loads an adapter, or installs a new version of a loaded one in place (same id and
    /// name, a larger version). Call it when the executor holds the adapter's weights, before
    /// any request names that version.
    ///
    /// A new version makes the old one's KV stale, as a weight update does the weights':
    /// every cached block of an older version of the adapter leaves the prefix cache (see the
    /// module docs for held blocks); the adapter's live requests are computed with the new
    /// version from now on (`Request::lora`): those holding no KV hash their blocks under it
    /// when admitted; waiting ones that were handed KV (a landed load) drop it and
    /// recompute, and a load in flight is retracted when it lands; running ones keep their
    /// chain, cache no further blocks and are never exported (their KV mixes both versions).
    ///
    /// Refused, changing nothing: a name loaded under another id, an id loaded under another
    /// name, a version not larger than one the name had before (loaded now or unloaded since:
    /// a version names one set of weights for good, so peers and routers can compare it).
    pub fn load_lora(&mut self, lora: LoraRef) -> Result<(), LoraError> {
        if let Some(other) = self
            .loras
            .values()
            .find(|l| l.name == lora.name && l.id != lora.id)
        {
            return Err(LoraError::NameTaken {
                name: lora.name.clone(),
                loaded: other.id,
                given: lora.id,
            });
        }
        if let Some(loaded) = self.loras.get(&lora.id) {
            if loaded.name != lora.name {
                return Err(LoraError::IdTaken {
                    id: lora.id,
                    loaded: loaded.name.clone(),
                    given: lora.name.clone(),
                });
            }
        }
        if let Some(&latest) = self.lora_versions.get(&lora.name) {
            if lora.version <= latest {
                return Err(LoraError::VersionNotNewer {
                    name: lora.name.clone(),
                    latest,
                    given: lora.version,
                });
            }
        }
        self.lora_versions.insert(lora.name.clone(), lora.version);
        if self.loras.insert(lora.id, lora.clone()).is_some() {
            self.move_lora_to(&lora);
        }
        Ok(())
    }

    /// The adapter's live requests move to `lora`'s version; its older versions' KV goes.
    fn move_lora_to(&mut self, lora: &LoraRef) {
        let (id, version) = (lora.id, lora.version);
        self.kv
            .pool_mut()
            .evict_lora(|t| t.id == id && t.version != version);
        self.outdate_waiting_kv(|q| q.lora.as_ref().is_some_and(|l| l.id == id));
        for req in self.requests.iter_mut().flatten() {
            if let Some(l) = req.lora.as_mut().filter(|l| l.id == id) {
                l.clone_from(lora);
            }
        }
    }

    /// Unloads an adapter: its live requests finish as aborted (running ones first, then
    /// waiting ones, each in queue order; the executor will not hold its weights any more),
    /// and every block computed with it, whatever the version, leaves the prefix cache (see
    /// the module docs for held blocks). Returns the aborted requests' outputs. Its name's
    /// latest version is remembered: loading it again needs a larger one.
    pub fn unload_lora(&mut self, id: LoraId) -> Result<Vec<RequestOutput>, LoraError> {
        if self.loras.remove(&id).is_none() {
            return Err(LoraError::NotLoaded(id));
        }
        let of_it: Vec<ReqIdx> = self
            .running
            .iter()
            .chain(&self.waiting)
            .copied()
            .filter(|&r| {
                self.request(r)
                    .is_some_and(|q| q.lora.as_ref().is_some_and(|l| l.id == id))
            })
            .collect();
        let outputs = of_it
            .into_iter()
            .map(|r| {
                self.remove_from_queues(r);
                self.aborted_output(r)
            })
            .collect();
        // After the aborts: the blocks they cached are freed now, and go too.
        self.kv.pool_mut().evict_lora(|t| t.id == id);
        Ok(outputs)
    }

    /// The adapter loaded under `id`, at its version now.
    pub fn lora(&self, id: LoraId) -> Option<&LoraRef> {
        self.loras.get(&id)
    }

    /// The latest version the adapter `name` has had, loaded now or since unloaded (a load
    /// must give it a larger one).
    pub fn lora_latest_version(&self, name: &str) -> Option<u64> {
        self.lora_versions.get(name).copied()
    }

    /// Every adapter loaded, by id.
    pub fn loras(&self) -> impl Iterator<Item = &LoraRef> {
        self.loras.values()
    }

    /// `Ok` if `lora` is the adapter loaded under its id, at the version loaded now.
    pub(super) fn check_lora_current(&self, lora: &LoraRef) -> Result<(), LoraError> {
        match self.loras.get(&lora.id) {
            None => Err(LoraError::NotLoaded(lora.id)),
            Some(loaded) if loaded != lora => Err(LoraError::NotCurrent {
                given: lora.clone(),
                loaded: loaded.clone(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// The seats of the waiting phase under `SchedulerConfig::max_loras`, `None` without a
    /// limit.
    pub(super) fn lora_seats(&self) -> Option<LoraSeats> {
        let max = self.config.max_loras?;
        let mut seated: Vec<LoraId> = self
            .running
            .iter()
            .filter_map(|&r| Some(self.request(r)?.lora.as_ref()?.id))
            .collect();
        seated.sort_unstable();
        seated.dedup();
        Some(LoraSeats {
            max,
            seated,
            starving: None,
        })
    }
}

/// The adapters a step may compute, as the waiting phase admits requests
/// (`SchedulerConfig::max_loras`). An adapter holds a seat while any request of it runs, so
/// the running requests, and so every step, name at most `max` adapters; base requests need
/// no seat.
///
/// No adapter starves: the first request in the queue refused for want of a seat names the
/// adapter that waited longest, and from there on the scan admits no further request of a
/// seated adapter either (base requests, and those ahead of it, still go). The seated
/// adapters' running requests finish or are preempted, a seat frees, and it goes to that
/// adapter, first in the queue, before any adapter that came after it.
#[derive(Debug)]
pub(super) struct LoraSeats {
    max: usize,
    /// Adapters with a running request, or admitted in this step; sorted.
    seated: Vec<LoraId>,
    /// The adapter of the first request refused a seat in this scan.
    starving: Option<LoraId>,
}

impl LoraSeats {
    /// Whether a request of adapter `lora` (`None`: the base model) may be admitted now;
    /// a refusal of an unseated adapter is remembered (see the type's docs).
    pub(super) fn admits(&mut self, lora: Option<LoraId>) -> bool {
        let Some(id) = lora else {
            return true;
        };
        if self.seated.binary_search(&id).is_ok() {
            return self.starving.is_none();
        }
        if self.seated.len() < self.max && self.starving.is_none() {
            return true;
        }
        self.starving.get_or_insert(id);
        false
    }

    /// A request of `lora` was admitted.
    pub(super) fn seat(&mut self, lora: Option<LoraId>) {
        if let Some(id) = lora {
            if let Err(at) = self.seated.binary_search(&id) {
                self.seated.insert(at, id);
            }
        }
    }
}
