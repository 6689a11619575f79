//! The oracle: every sampled token is compared with the checksum model's reference for the
//! request's tokens under the weights of that step and, for a request under a LoRA adapter,
//! the adapter at the version the request is computed with then (`Request::lora`; its
//! weights are `crate::adapters::adapter` of its name and version, whose seed the reference
//! mixes in); under a constraint: the first token the step's mask allows from there. Unless
//! the request's own KV mixes weight or adapter versions (a request frozen across an update
//! without a cache clear keeps its KV, and a running request moves to an adapter's new
//! version with the KV the old one computed: both allowed, and its tokens are then not
//! predictable). KV a request did not compute itself (a prefix hit, a P/D load, an offload
//! load) is taken to be of the current weights and adapter version: stale KV (of other
//! weights, another adapter or an older version of it) shows as a wrong token. It watches
//! the engine core's steps as a `StepObserver`, and remembers the adapter version of each
//! token it saw sampled, for the engine's report of it (`Event::Output::lora_version`) to be
//! checked against ([`Oracle::take_lora_version`]). A weight version is the weights it
//! names, except a new name given to the weights loaded (`update_weight_version`), which
//! names the same weights as before ([`Oracle::rename`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ferry_core::{ModelOutput, Scheduler, StepPlan, TokenId};
use ferry_engine::StepObserver;
use ferry_model::ChecksumModel;

/// The checksum model's vocabulary: large enough that a wrong digest rarely maps to the
/// right token by chance.
pub const VOCAB: usize = 50_000;

/// What computed a position of a request's KV: the weights, and the adapter (name, version)
/// if the request has one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Computed {
    weights: String,
    lora: Option<(Arc<str>, u64)>,
}

/// The oracle's record of which weights computed each position of a request's KV.
#[derive(Debug, Default)]
pub struct Oracle {
    versions: Vec<Computed>,
    /// A name `update_weight_version` gave → the version whose weights it names.
    renamed: BTreeMap<String, String>,
    /// Request id → per position, the index (in `versions`) of the weights its KV is of.
    shadow: HashMap<String, Vec<u32>>,
    refs: BTreeMap<String, ChecksumModel>,
    /// Request id → the adapter version of its last token sampled, not yet reported.
    lora_versions: HashMap<String, Option<u64>>,
    pub violations: Vec<String>,
    pub n_checked: u64,
    pub n_mixed: u64,
    /// Of `n_checked`, tokens a constraint's mask chose among.
    pub n_masked: u64,
    /// Of `n_checked`, tokens of requests under an adapter.
    pub n_lora: u64,
    /// Off: a test that the checks catch a planted fault turns the oracle's answer around.
    pub enabled: bool,
}

impl Oracle {
    /// The weights loaded, named `old`, are named `new` from now on (no weight changes).
    pub fn rename(&mut self, new: &str, old: &str) {
        let weights = self.weights_of(old).to_owned();
        self.renamed.insert(new.to_owned(), weights);
    }

    /// The version whose weights `name` names.
    fn weights_of<'a>(&'a self, name: &'a str) -> &'a str {
        self.renamed.get(name).map_or(name, String::as_str)
    }

    fn intern(&mut self, computed: Computed) -> u32 {
        match self.versions.iter().position(|v| *v == computed) {
            Some(i) => i as u32,
            None => {
                self.versions.push(computed);
                self.versions.len() as u32 - 1
            }
        }
    }

    fn reference(&mut self, version: &str, lora_seed: Option<u64>, tokens: &[TokenId]) -> TokenId {
        self.refs
            .entry(version.to_owned())
            .or_insert_with(|| ChecksumModel::new(version, VOCAB).expect("valid vocabulary"))
            .reference_next_token_under(lora_seed, tokens)
    }

    pub fn forget(&mut self, id: &str) {
        self.shadow.remove(id);
        self.lora_versions.remove(id);
    }

    /// The adapter version request `id`'s last sampled token was computed under (`Some(None)`:
    /// the base model), once; `None` if the oracle saw no token sampled since.
    pub fn take_lora_version(&mut self, id: &str) -> Option<Option<u64>> {
        self.lora_versions.remove(id)
    }

    fn check(&mut self, core: &Scheduler, plan: &StepPlan, out: &ModelOutput) {
        let version = self.weights_of(core.weight_version()).to_owned();
        let version = version.as_str();
        let mut sampled = out.sampled.iter();
        for r in &plan.reqs {
            let Some(req) = core.request(r.req) else {
                self.violations.push(format!(
                    "the plan schedules a request that is not live: {:?}",
                    r.req
                ));
                continue;
            };
            let lora = req.lora.as_ref();
            if r.lora != lora.map(|l| l.id) {
                self.violations.push(format!(
                    "{}: the plan computes it with adapter {:?}, the request is under {lora:?}",
                    req.id, r.lora
                ));
            }
            let lora = lora.map(|l| (l.name.clone(), l.version));
            let lora_seed = lora
                .as_ref()
                .map(|(name, v)| crate::adapters::adapter(name, *v).seed());
            let lora_version = lora.as_ref().map(|&(_, v)| v);
            let current = self.intern(Computed {
                weights: version.to_owned(),
                lora,
            });
            let shadow = self.shadow.entry(req.id.clone()).or_default();
            if r.start_pos != shadow.len() {
                // KV the request did not compute in its last step (a hit, a load, or what is
                // left after a preemption or a failed load) must be of the current weights
                // and adapter version.
                shadow.clear();
                shadow.resize(r.start_pos, current);
            }
            shadow.extend(std::iter::repeat_n(current, r.tokens.len()));
            let Some(spec) = r.sample else {
                continue;
            };
            let Some(token) = sampled.next() else {
                self.violations.push(format!(
                    "{}: no token sampled where the plan asked for one",
                    req.id
                ));
                continue;
            };
            self.lora_versions.insert(req.id.clone(), lora_version);
            if shadow.iter().any(|&g| g != current) {
                self.n_mixed += 1;
                continue;
            }
            let end = r.start_pos + r.tokens.len();
            let mut expected = self.reference(version, lora_seed, &req.tokens[..end]);
            if let Some(mask) = plan.mask_of(&spec) {
                // A constrained sample: the first token the request's mask allows.
                expected = self.refs[version].allowed_token_from(expected, mask);
                self.n_masked += 1;
            }
            self.n_checked += 1;
            self.n_lora += u64::from(lora_version.is_some());
            if token.token != expected {
                let under = match &req.lora {
                    Some(l) => format!(" and adapter {} version {}", l.name, l.version),
                    None => String::new(),
                };
                self.violations.push(format!(
                    "{}: sampled token {} after {end} tokens under weights {version:?}{under}, \
                     the reference is {expected}: its KV is wrong, stale or misplaced",
                    req.id, token.token
                ));
            }
        }
    }
}

/// The oracle shared between an engine core (which shows it every step) and the simulation
/// (which reads its verdicts).
#[derive(Debug, Clone, Default)]
pub struct SharedOracle(pub Arc<Mutex<Oracle>>);

impl SharedOracle {
    pub fn lock(&self) -> MutexGuard<'_, Oracle> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StepObserver for SharedOracle {
    fn on_computed(&mut self, core: &Scheduler, plan: &StepPlan, output: &ModelOutput) {
        let mut oracle = self.lock();
        if oracle.enabled {
            oracle.check(core, plan, output);
        }
    }
}
