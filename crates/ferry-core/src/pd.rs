//! The P/D connector, scheduler side: P exports a finished prefill's KV, D imports it.
//!
//! * **P** (`do_remote_decode` in a request's transfer parameters): when the request
//!   finishes (after its first token), its blocks become an export held by this connector
//!   under a lease, and the request's output carries the parameters D needs (vLLM's keys,
//!   plus the weight version, the LoRA adapter and its version, the number of tokens and an
//!   unguessable export token). The
//!   worker publishes the export; it ends when a reader pulled it (`ExportPulled`), or when
//!   a revocation or lease expiry was acknowledged (`ExportGone`).
//! * **D** (`do_remote_prefill`): at admission the connector offers the prompt's KV after the
//!   local prefix hit as an asynchronous load; the worker fetches it from P's export into the
//!   blocks the scheduler holds for it, and the request continues once it landed.
//!
//! Transfers fail closed. D refuses parameters that do not fit its prompt or name a host
//! outside its allowed peers before loading anything (`ExternalMatch::Refused`: invalid
//! input, the request fails whatever the policy). Parameters of another weight version were
//! made stale by the lifecycle (either side updated since the export was made): D never
//! loads them and the request computes its prompt itself, under either policy; so are those
//! of another LoRA adapter or adapter version than the request's here (the export names the
//! adapter its KV was computed with, `KvTransferParams::lora`, none for the base). P's worker
//! refuses a pull with a wrong token, a wrong prompt hash, a wrong version or block ids that
//! are not exactly the export's, an export pulled before (one load per export) (all
//! `Invalid`), and says when the export was revoked or expired, so D can tell a retraction
//! from a fault (`FetchFailure`). Requests with the same parameters (`n` > 1 choices) import
//! once: the first loads, the others wait (`NotYet`) and then take prefix hits on what
//! arrived. An export D will not pull (the request computes, another connector supplies
//! more, the request is gone) is released at once: D tells P, presenting its token.
//!
//! The export token is a keyed hash of the hold id under a secret the engine draws at start
//! (`PdConfig::secret`), so it is unguessable to clients yet deterministic under simulation.

use std::collections::{BTreeMap, HashMap};

use crate::connector::{
    prompt_hash, AllocatedLoad, ExternalMatch, ExternalQuery, FinishedRequest, KvConnector,
    KvTransferParams, LoadOutcome, LoadResult, NewRequest, PdJob, PdReport, TransferParamsError,
    WorkerJob,
};
use crate::connector::{FetchCancel, FetchFailure, ImportSpec, Unpublished};
use crate::holds::HoldKind;
use crate::ids::{BlockId, ReqIdx, TransferId};
use crate::lora::LoraRef;
use crate::peers::AllowedPeers;
use crate::request::FinishReason;

/// Which side(s) of P/D an engine plays (vLLM's `kv_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdRole {
    /// P: exports (`kv_producer`).
    Producer,
    /// D: imports (`kv_consumer`).
    Consumer,
    /// Both (`kv_both`).
    Both,
}

impl PdRole {
    fn produces(self) -> bool {
        matches!(self, Self::Producer | Self::Both)
    }

    fn consumes(self) -> bool {
        matches!(self, Self::Consumer | Self::Both)
    }
}

/// The P/D connector's configuration.
#[derive(Debug, Clone)]
pub struct PdConfig {
    pub role: PdRole,
    /// This engine's id, as readers name it (`remote_engine_id`).
    pub engine_id: String,
    /// Where readers reach this engine's transfer listener (advertised in the parameters).
    pub host: Option<String>,
    pub port: Option<u16>,
    /// Keys the export tokens; draw it at random when the engine starts.
    pub secret: [u8; 32],
    pub block_size: usize,
    /// Where D may load from (`--kv-allowed-peers`): a `remote_host` outside it is invalid.
    pub allowed_peers: AllowedPeers,
}

/// One export P holds.
#[derive(Debug)]
struct Export {
    /// The worker was told to stop serving it (revoked or expired); its hold ends with the
    /// worker's `ExportGone`.
    unpublished: bool,
}

/// D's view of a request that asked for a remote prefill.
#[derive(Debug, Clone)]
struct Import {
    /// The parsed parameters, or why they cannot be used, found at arrival.
    spec: Result<ImportSpec, String>,
    prompt_hash: [u8; 32],
    /// Prompt tokens the export holds KV for.
    n_tokens: usize,
    /// The hold of its load in flight.
    loading: Option<TransferId>,
}

/// A load in flight.
#[derive(Debug, Clone)]
struct Loading {
    req: ReqIdx,
    export: ExportKey,
    /// `CancelFetch` was sent (reset or the request ended): the load's outcome no longer
    /// matters, only its acknowledgement.
    cancelled: bool,
}

/// Names one export across engines: (engine id, token).
type ExportKey = (String, String);

/// The P/D connector (see the module docs).
#[derive(Debug)]
pub struct PdConnector {
    config: PdConfig,
    /// P: requests that asked to export, with their prompt's hash and length.
    wants_export: HashMap<ReqIdx, ([u8; 32], usize)>,
    /// P: exports held, by hold.
    exports: BTreeMap<TransferId, Export>,
    /// D: requests that asked to import.
    imports: HashMap<ReqIdx, Import>,
    /// D: loads in flight, by hold.
    loading: BTreeMap<TransferId, Loading>,
    /// D: exports this engine loaded or is loading, with how many live requests name them:
    /// an export is loaded once; the others take prefix hits.
    seen: HashMap<ExportKey, Seen>,
    jobs: Vec<PdJob>,
    ended: Vec<TransferId>,
    loads: Vec<LoadResult>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    n_requests: usize,
    /// A load of it is in flight.
    loading: bool,
    /// It was loaded (or a load of it was tried): it is never fetched again.
    used: bool,
}

impl PdConnector {
    pub fn new(config: PdConfig) -> Self {
        Self {
            config,
            wants_export: HashMap::new(),
            exports: BTreeMap::new(),
            imports: HashMap::new(),
            loading: BTreeMap::new(),
            seen: HashMap::new(),
            jobs: Vec::new(),
            ended: Vec::new(),
            loads: Vec::new(),
        }
    }

    pub fn config(&self) -> &PdConfig {
        &self.config
    }

    /// The export token of hold `hold`: a keyed hash, hex.
    fn token(&self, hold: TransferId) -> String {
        let mut input = Vec::with_capacity(8 + self.config.engine_id.len());
        input.extend_from_slice(&hold.0.to_le_bytes());
        input.extend_from_slice(self.config.engine_id.as_bytes());
        blake3::keyed_hash(&self.config.secret, &input)
            .to_hex()
            .to_string()
    }

    /// Checks D's import, parsed at the edge, against this engine's role, the allowed peers
    /// (defence in depth: the server's edge checked them too) and the prompt: the import,
    /// or why it cannot be used.
    fn check_import(&self, spec: &ImportSpec, prompt_len: usize) -> Result<ImportSpec, String> {
        if !self.config.role.consumes() {
            return Err(format!(
                "do_remote_prefill: this engine ({}) is not a KV consumer",
                self.config.engine_id
            ));
        }
        if let Some(host) = &spec.remote_host {
            self.config
                .allowed_peers
                .check_host(host)
                .map_err(|e| e.to_string())?;
        }
        let (n_tokens, ids) = (spec.n_tokens, &spec.remote_block_ids);
        if n_tokens == 0 || n_tokens > prompt_len {
            return Err(format!(
                "n_tokens is {n_tokens}, but the prompt has {prompt_len} tokens"
            ));
        }
        let n_blocks = n_tokens.div_ceil(self.config.block_size);
        if ids.len() != n_blocks {
            return Err(format!(
                "remote_block_ids has {} ids, {n_tokens} tokens take {n_blocks} blocks of {}",
                ids.len(),
                self.config.block_size
            ));
        }
        Ok(spec.clone())
    }

    fn forget_import(&mut self, req: ReqIdx) {
        let Some(import) = self.imports.remove(&req) else {
            return;
        };
        if let Some(hold) = import.loading {
            // The request is gone: nobody waits for the load's outcome.
            self.cancel_load(hold, FetchCancel::Retracted, None);
        }
        let Ok(spec) = &import.spec else {
            return;
        };
        let key = export_key(spec);
        let Some(seen) = self.seen.get_mut(&key) else {
            return;
        };
        seen.n_requests -= 1;
        if seen.n_requests == 0 && !seen.loading {
            let used = seen.used;
            self.seen.remove(&key);
            if !used {
                // Nobody here will pull it: P need not wait out the lease.
                self.release(spec);
            }
        }
    }

    /// Tells P that this engine will not pull the export `spec` names.
    fn release(&mut self, spec: &ImportSpec) {
        self.jobs.push(PdJob::Release {
            remote_engine_id: spec.remote_engine_id.clone(),
            remote_host: spec.remote_host.clone(),
            remote_port: spec.remote_port,
            token: spec.export_token.clone(),
        });
    }

    /// Tells the worker to stop serving export `hold`, once; its hold ends with `ExportGone`.
    fn unpublish(&mut self, hold: TransferId, reason: Unpublished) {
        if let Some(export) = self.exports.get_mut(&hold) {
            if !export.unpublished {
                export.unpublished = true;
                self.jobs.push(PdJob::Unpublish { hold, reason });
            }
        }
    }

    /// Tells the worker to cancel load `hold`, once, and reports `outcome` for its request
    /// now (none when the request is gone); the hold ends with the worker's `FetchDone`.
    fn cancel_load(&mut self, hold: TransferId, why: FetchCancel, outcome: Option<LoadOutcome>) {
        let Some(l) = self.loading.get_mut(&hold).filter(|l| !l.cancelled) else {
            return;
        };
        l.cancelled = true;
        self.jobs.push(PdJob::CancelFetch { hold, why });
        if let Some(outcome) = outcome {
            self.loads.push(LoadResult {
                req: l.req,
                hold,
                outcome,
            });
        }
    }
}

fn export_key(spec: &ImportSpec) -> ExportKey {
    (spec.remote_engine_id.clone(), spec.export_token.clone())
}

impl KvConnector for PdConnector {
    fn name(&self) -> &str {
        "pd"
    }

    fn on_new_request(&mut self, new: NewRequest<'_>) -> Result<(), TransferParamsError> {
        let Some(transfer) = new.transfer else {
            return Ok(());
        };
        if transfer.exports() {
            if !self.config.role.produces() {
                return Err(TransferParamsError(format!(
                    "do_remote_decode: this engine ({}) is not a KV producer",
                    self.config.engine_id
                )));
            }
            self.wants_export
                .insert(new.req, (prompt_hash(new.prompt), new.prompt.len()));
        }
        if let Some(spec) = transfer.import() {
            let spec = self.check_import(spec, new.prompt.len());
            let n_tokens = spec.as_ref().map_or(0, |s| s.n_tokens);
            let hash = prompt_hash(&new.prompt[..n_tokens]);
            if let Ok(spec) = &spec {
                self.seen.entry(export_key(spec)).or_default().n_requests += 1;
            }
            self.imports.insert(
                new.req,
                Import {
                    spec,
                    prompt_hash: hash,
                    n_tokens,
                    loading: None,
                },
            );
        }
        Ok(())
    }

    fn match_external(&mut self, query: ExternalQuery<'_>) -> ExternalMatch {
        let Some(import) = self.imports.get(&query.req) else {
            return ExternalMatch::None;
        };
        if import.loading.is_some() {
            return ExternalMatch::NotYet;
        }
        let spec = match &import.spec {
            Ok(spec) => spec,
            Err(reason) => {
                return ExternalMatch::Refused {
                    reason: reason.clone(),
                }
            }
        };
        let key = export_key(spec);
        let seen = self.seen.get(&key).copied().unwrap_or_default();
        if seen.loading {
            // Another choice of the same prompt is loading it: wait, then take prefix hits.
            return ExternalMatch::NotYet;
        }
        // A request readmitted after its export was loaded or tried (retracted by a cache
        // reset, preempted) computes locally.
        if seen.used {
            return ExternalMatch::None;
        }
        // KV of other weights is never loaded, whichever side moved on since the export was
        // made (P updated before D, or D before P's export reached it): the lifecycle made
        // it stale, so the request computes its prompt here, under either policy (the RL
        // cycle pause → update → resume loses nothing). `declined` then releases the export.
        if spec.weight_version != query.weight_version {
            return ExternalMatch::None;
        }
        // Likewise KV of another adapter, or another version of it, than the one the request
        // is computed with here (the base model included): either side reloaded the adapter
        // since, or the two disagree on it; the request computes, never loads it.
        if spec.lora.as_ref() != query.lora.map(LoraRef::key).as_ref() {
            return ExternalMatch::None;
        }
        let tokens = import.n_tokens.saturating_sub(query.local_hit_tokens);
        if tokens == 0 {
            return ExternalMatch::None;
        }
        ExternalMatch::Hit {
            tokens,
            kind: HoldKind::Import,
        }
    }

    fn after_alloc(&mut self, load: AllocatedLoad<'_>) {
        // Only an import whose parameters were usable gave a `Hit`.
        let Some(Import {
            spec: Ok(spec),
            prompt_hash,
            loading,
            ..
        }) = self.imports.get_mut(&load.req)
        else {
            // Not ours to load: end the hold at once, as a failed load.
            self.loads.push(LoadResult {
                req: load.req,
                hold: load.hold,
                outcome: LoadOutcome::Failed {
                    good_blocks: 0,
                    reason: "no transfer parameters for this request".into(),
                    kind: FetchFailure::Invalid,
                },
            });
            self.ended.push(load.hold);
            return;
        };
        *loading = Some(load.hold);
        let key = export_key(spec);
        let src_blocks: Vec<BlockId> = spec
            .remote_block_ids
            .iter()
            .skip(load.first_block)
            .take(load.blocks.len())
            .copied()
            .collect();
        self.jobs.push(PdJob::Fetch {
            hold: load.hold,
            remote_engine_id: spec.remote_engine_id.clone(),
            remote_host: spec.remote_host.clone(),
            remote_port: spec.remote_port,
            token: spec.export_token.clone(),
            weight_version: spec.weight_version.clone(),
            lora: spec.lora.clone(),
            prompt_hash: *prompt_hash,
            first_block: load.first_block,
            src_blocks,
            blocks: load.blocks.to_vec(),
        });
        let seen = self.seen.entry(key.clone()).or_default();
        seen.loading = true;
        seen.used = true;
        self.loading.insert(
            load.hold,
            Loading {
                req: load.req,
                export: key,
                cancelled: false,
            },
        );
    }

    fn step_work(&mut self, out: &mut Vec<WorkerJob>) {
        out.extend(self.jobs.drain(..).map(WorkerJob::Pd));
    }

    fn on_pd_report(&mut self, report: PdReport) {
        match report {
            PdReport::ExportPulled { hold } | PdReport::ExportGone { hold } => {
                if self.exports.remove(&hold).is_some() {
                    self.ended.push(hold);
                }
            }
            PdReport::FetchDone { hold, result } => {
                let Some(l) = self.loading.remove(&hold) else {
                    return;
                };
                if let Some(seen) = self.seen.get_mut(&l.export) {
                    seen.loading = false;
                    if seen.n_requests == 0 {
                        self.seen.remove(&l.export);
                    }
                }
                if let Some(import) = self.imports.get_mut(&l.req) {
                    if import.loading == Some(hold) {
                        import.loading = None;
                    }
                }
                self.ended.push(hold);
                if l.cancelled {
                    return;
                }
                let outcome = match result {
                    Ok(()) => LoadOutcome::Loaded,
                    Err(e) => LoadOutcome::Failed {
                        good_blocks: e.good_blocks,
                        reason: e.reason,
                        kind: e.kind,
                    },
                };
                self.loads.push(LoadResult {
                    req: l.req,
                    hold,
                    outcome,
                });
            }
        }
    }

    fn request_finished(&mut self, f: FinishedRequest<'_>) -> Option<KvTransferParams> {
        self.forget_import(f.req);
        let (hash, prompt_len) = self.wants_export.remove(&f.req)?;
        if f.blocks.is_empty() || matches!(f.reason, FinishReason::Abort | FinishReason::Error) {
            return None;
        }
        let n_tokens = f.n_computed.min(prompt_len);
        let n_blocks = n_tokens.div_ceil(self.config.block_size);
        if n_tokens == 0 || n_blocks > f.blocks.len() {
            return None;
        }
        let blocks = f.blocks[..n_blocks].to_vec();
        let token = self.token(f.hold);
        let lora = f.lora.map(LoraRef::key);
        self.jobs.push(PdJob::Publish {
            hold: f.hold,
            token: token.clone(),
            weight_version: f.weight_version.to_owned(),
            lora: lora.clone(),
            blocks: blocks.clone(),
            prompt_hash: hash,
            n_tokens,
        });
        self.exports.insert(f.hold, Export { unpublished: false });
        Some(KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: Some(self.config.engine_id.clone()),
            remote_block_ids: Some(blocks),
            remote_request_id: Some(f.request_id.to_owned()),
            remote_host: self.config.host.clone(),
            remote_port: self.config.port,
            weight_version: Some(f.weight_version.to_owned()),
            lora,
            export_token: Some(token),
            n_tokens: Some(n_tokens),
        })
    }

    fn declined(&mut self, req: ReqIdx) {
        let Some(import) = self.imports.get(&req) else {
            return;
        };
        if import.loading.is_some() {
            return;
        }
        let Ok(spec) = &import.spec else {
            return;
        };
        let key = export_key(spec);
        // Every import that was not refused counts in `seen` from its arrival on.
        let Some(seen) = self.seen.get_mut(&key) else {
            return;
        };
        if seen.used || seen.loading {
            return;
        }
        // Never loaded from now on (the request holds KV computed otherwise); P frees it.
        seen.used = true;
        let spec = spec.clone();
        self.release(&spec);
    }

    fn abort_transfers(&mut self) {
        let exports: Vec<TransferId> = self.exports.keys().copied().collect();
        for hold in exports {
            self.unpublish(hold, Unpublished::Revoked);
        }
        let loads: Vec<TransferId> = self.loading.keys().copied().collect();
        for hold in loads {
            // A retraction: the request holds no KV and recomputes after the resume.
            self.cancel_load(hold, FetchCancel::Retracted, Some(LoadOutcome::Cancelled));
        }
    }

    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>) {
        out.append(&mut self.ended);
    }

    fn take_finished_loads(&mut self, out: &mut Vec<LoadResult>) {
        out.append(&mut self.loads);
    }

    fn hold_expired(&mut self, hold: TransferId) {
        self.unpublish(hold, Unpublished::Expired);
        let timed_out = LoadOutcome::Failed {
            good_blocks: 0,
            reason: "the load did not answer in time".into(),
            kind: FetchFailure::Fault,
        };
        self.cancel_load(hold, FetchCancel::TimedOut, Some(timed_out));
    }

    fn has_pending_work(&self) -> bool {
        !self.jobs.is_empty()
    }

    fn reset_cache(&mut self) {
        // No cache of its own: exports and loads ended in `abort_transfers`.
    }
}
