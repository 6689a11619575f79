//! The scheduler-side connector trait: the points where anything that moves KV blocks in or
//! out of the arena outside the running batch (a P/D transfer, an offload tier) meets the
//! scheduler (`../shared/design/connectors.md`).
//!
//! A connector decides *what* moves; its worker side (in `ferry-kv`) does the moving. The
//! ledger stays in the scheduler: every block a transfer touches is held through a transfer
//! hold the scheduler opens and names ([`Holder`](crate::holds::Holder), [`HoldKind`];
//! `holds.rs`), and is freed only when the connector that owns the hold reports it ended
//! ([`KvConnector::take_finished_transfers`]).
//! So a reset that waits always knows what it waits for, and a connector can never free or
//! reuse a block itself.
//!
//! The hooks, in the order a request meets them:
//!
//! | when | hook |
//! | --- | --- |
//! | a request arrives | [`KvConnector::on_new_request`] |
//! | admission, after the local prefix hit | [`KvConnector::match_external`] (no side effects) |
//! | after blocks are allocated for a hit | [`KvConnector::after_alloc`] (the request parks in `WaitingForRemoteKv`) |
//! | a step computed full blocks (`on_step_output`) | [`KvConnector::blocks_computed`] (a tier's stores, under `Store` holds) |
//! | every step, also a zero-token one | [`KvConnector::step_work`] (carried in the `StepPlan`) |
//! | worker results arrive (engine inputs) | [`KvConnector::on_pd_report`], [`KvConnector::on_tier_report`] |
//! | between steps | [`KvConnector::take_finished_transfers`], [`KvConnector::take_finished_loads`] |
//! | a request finishes | [`KvConnector::request_finished`] → export parameters, or nothing |
//! | time passes | [`KvConnector::hold_expired`] |
//! | the lifecycle | [`KvConnector::abort_transfers`], [`KvConnector::reset_cache`], [`KvConnector::has_pending_work`] |
//!
//! Several connectors are an ordered list (`Scheduler::add_connector`): the one with the
//! longest ready hit supplies a load (ties in list order; a `NotYet` from any parks the
//! request), every other one hears that its offer was declined ([`KvConnector::declined`]),
//! the first to ask for an export holds it, finishes and resets reach every connector,
//! pending work is the OR, and transfer parameters are merged with an error on a clash. The
//! scheduler names no particular connector.
//!
//! Who is to blame for a load that cannot be used (`connectors.md`): the lifecycle
//! (retracted: the request computes its prompt itself, under either policy), a fault
//! (`KvLoadFailurePolicy` decides) or invalid input (fails closed, whatever the policy). A
//! failed load says which through its [`FetchFailure`].

use crate::hash::BlockHash;
use crate::holds::HoldKind;
use crate::ids::{BlockId, ConnectorId, ReqIdx, TokenId, TransferId};
use crate::lora::{LoraKey, LoraRef};
use crate::request::FinishReason;

/// What to do when a KV load fails (engine config; vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLoadFailurePolicy {
    /// The request keeps its place and recomputes from the first bad block.
    Recompute,
    /// The request finishes with `finish_reason: "error"` and a message.
    #[default]
    Fail,
}

/// The P/D transfer parameters of a request, with vLLM's keys plus ferry's weight version,
/// LoRA adapter and export token. Plain data: the server parses and shape-checks them, connectors check
/// what they mean.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KvTransferParams {
    /// D: load this request's prompt KV from `remote_engine_id`.
    pub do_remote_prefill: bool,
    /// P: compute the prompt, then keep its KV for a remote reader.
    pub do_remote_decode: bool,
    pub remote_engine_id: Option<String>,
    pub remote_block_ids: Option<Vec<BlockId>>,
    pub remote_request_id: Option<String>,
    pub remote_host: Option<String>,
    pub remote_port: Option<u16>,
    /// The weight version the exported KV was computed with.
    pub weight_version: Option<String>,
    /// The LoRA adapter the exported KV was computed with, by name and version (none: the
    /// base model); on the wire, `lora_name` and `lora_version`, both or neither.
    pub lora: Option<LoraKey>,
    /// The unguessable token that names the export on its engine.
    pub export_token: Option<String>,
    /// How many prompt tokens the export holds KV for.
    pub n_tokens: Option<usize>,
}

impl KvTransferParams {
    /// Adds `other`'s keys; a key both set to different values is an error naming it.
    pub fn merge(&mut self, other: KvTransferParams) -> Result<(), String> {
        fn one<T: PartialEq + std::fmt::Debug>(
            key: &str,
            a: &mut Option<T>,
            b: Option<T>,
        ) -> Result<(), String> {
            match (a.as_ref(), b) {
                (Some(x), Some(y)) if *x != y => Err(format!(
                    "two connectors set kv_transfer_params.{key}: {x:?} and {y:?}"
                )),
                (None, Some(y)) => {
                    *a = Some(y);
                    Ok(())
                }
                _ => Ok(()),
            }
        }
        self.do_remote_prefill |= other.do_remote_prefill;
        self.do_remote_decode |= other.do_remote_decode;
        one(
            "remote_engine_id",
            &mut self.remote_engine_id,
            other.remote_engine_id,
        )?;
        one(
            "remote_block_ids",
            &mut self.remote_block_ids,
            other.remote_block_ids,
        )?;
        one(
            "remote_request_id",
            &mut self.remote_request_id,
            other.remote_request_id,
        )?;
        one("remote_host", &mut self.remote_host, other.remote_host)?;
        one("remote_port", &mut self.remote_port, other.remote_port)?;
        one(
            "weight_version",
            &mut self.weight_version,
            other.weight_version,
        )?;
        one("lora", &mut self.lora, other.lora)?;
        one("export_token", &mut self.export_token, other.export_token)?;
        one("n_tokens", &mut self.n_tokens, other.n_tokens)
    }
}

/// D's side of the transfer parameters (`do_remote_prefill`), parsed once: which export to
/// load, where it is, and what it holds. Every key a load needs is there, so nothing that
/// holds one checks them again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSpec {
    pub remote_engine_id: String,
    pub export_token: String,
    pub weight_version: String,
    /// The LoRA adapter the export's KV was computed with (none: the base model).
    pub lora: Option<LoraKey>,
    pub remote_block_ids: Vec<BlockId>,
    pub remote_host: Option<String>,
    pub remote_port: Option<u16>,
    /// How many prompt tokens the export holds KV for.
    pub n_tokens: usize,
}

impl ImportSpec {
    /// The import `params` describe, or the first key a load needs that they lack.
    pub fn parse(params: &KvTransferParams) -> Result<Self, MissingParam> {
        fn need<T: Clone>(key: &'static str, v: &Option<T>) -> Result<T, MissingParam> {
            v.clone().ok_or(MissingParam(key))
        }
        Ok(Self {
            remote_engine_id: need("remote_engine_id", &params.remote_engine_id)?,
            export_token: need("export_token", &params.export_token)?,
            weight_version: need("weight_version", &params.weight_version)?,
            lora: params.lora.clone(),
            remote_block_ids: need("remote_block_ids", &params.remote_block_ids)?,
            n_tokens: need("n_tokens", &params.n_tokens)?,
            remote_host: params.remote_host.clone(),
            remote_port: params.remote_port,
        })
    }
}

/// A load's `kv_transfer_params` lack a key it needs (the key's name); the edge refuses the
/// request with it (HTTP 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("do_remote_prefill needs {0}")]
pub struct MissingParam(pub &'static str);

/// What a request asks of the P/D transfer: its `kv_transfer_params` parsed once, at the
/// edge ([`TransferRequest::parse`]), into the one value the engine and the connectors carry.
/// Both role flags together are allowed, as they always were: the request loads its prompt's
/// KV, then exports it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferRequest {
    /// P (`do_remote_decode`): compute the prompt, then keep its KV for a remote reader.
    Export,
    /// D (`do_remote_prefill`): load the prompt's KV from the export the spec names.
    Import(ImportSpec),
    /// Both flags: load the prompt's KV as [`Import`](Self::Import), then keep it for a
    /// remote reader as [`Export`](Self::Export).
    ImportThenExport(ImportSpec),
}

impl TransferRequest {
    /// The transfer `params` ask for: none when neither role flag is set (the other keys
    /// then mean nothing), or the first key a load needs that they lack (from
    /// [`ImportSpec::parse`]).
    pub fn parse(params: &KvTransferParams) -> Result<Option<Self>, MissingParam> {
        let import = if params.do_remote_prefill {
            Some(ImportSpec::parse(params)?)
        } else {
            None
        };
        Ok(match (import, params.do_remote_decode) {
            (None, false) => None,
            (None, true) => Some(Self::Export),
            (Some(spec), false) => Some(Self::Import(spec)),
            (Some(spec), true) => Some(Self::ImportThenExport(spec)),
        })
    }

    /// Whether the request's KV is kept for a remote reader when it finishes (P).
    pub fn exports(&self) -> bool {
        matches!(self, Self::Export | Self::ImportThenExport(_))
    }

    /// The import the request loads its prompt's KV from (D), if any.
    pub fn import(&self) -> Option<&ImportSpec> {
        match self {
            Self::Export => None,
            Self::Import(spec) | Self::ImportThenExport(spec) => Some(spec),
        }
    }

    /// The import, mutably: the edge replaces its `remote_host` by the address it resolved.
    pub fn import_mut(&mut self) -> Option<&mut ImportSpec> {
        match self {
            Self::Export => None,
            Self::Import(spec) | Self::ImportThenExport(spec) => Some(spec),
        }
    }
}

/// What a connector can supply for a request at admission (`match_external`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExternalMatch {
    /// Nothing: compute locally.
    None,
    /// Not yet (another request is loading the same KV): leave the request at its place in
    /// the queue and ask again next step.
    NotYet,
    /// The KV of `tokens` prompt tokens after the local hit can be loaded, asynchronously:
    /// the request parks in `WaitingForRemoteKv` until the load lands.
    Hit { tokens: usize, kind: HoldKind },
    /// The request's transfer parameters are invalid for this connector (malformed, for
    /// another engine, for a host outside the allowed peers): the request fails closed,
    /// whatever the `KvLoadFailurePolicy`. Parameters made stale by the lifecycle (another
    /// weight version) are no refusal: the connector answers `None` and the request
    /// computes.
    Refused { reason: String },
}

/// The admission question (`match_external`).
#[derive(Debug, Clone, Copy)]
pub struct ExternalQuery<'a> {
    pub req: ReqIdx,
    pub prompt_len: usize,
    /// Tokens found in the local prefix cache (whole blocks).
    pub local_hit_tokens: usize,
    /// The request's block hashes (every full block of its tokens, chained from the
    /// version-seeded root): a local tier looks its prefix up by them.
    pub block_hashes: &'a [BlockHash],
    /// The weight version loaded now.
    pub weight_version: &'a str,
    /// The LoRA adapter the request is computed with, at its version now (`None`: the base
    /// model): KV computed otherwise is never loaded for it.
    pub lora: Option<&'a LoraRef>,
}

/// A request as the hooks see it at arrival.
#[derive(Debug, Clone, Copy)]
pub struct NewRequest<'a> {
    pub req: ReqIdx,
    pub request_id: &'a str,
    pub prompt: &'a [TokenId],
    /// What the request asks of the P/D transfer, parsed at the edge.
    pub transfer: Option<&'a TransferRequest>,
}

/// An asynchronous load the scheduler allocated blocks for (`after_alloc`).
#[derive(Debug, Clone, Copy)]
pub struct AllocatedLoad<'a> {
    pub req: ReqIdx,
    /// The hold over `blocks` (kind `Import` or `Load`), owned by the connector: it ends
    /// when the connector reports it, whatever happened to the request.
    pub hold: TransferId,
    /// The blocks the load writes, in block-table order: block `i` holds positions
    /// `(first_block + i) * block_size ..`.
    pub blocks: &'a [BlockId],
    /// Index in the request's block table of `blocks[0]` (the local prefix hit's length).
    pub first_block: usize,
    /// Prompt tokens the load supplies, after the local hit.
    pub n_tokens: usize,
    /// The request's block hashes, as `match_external` saw them.
    pub block_hashes: &'a [BlockHash],
}

/// Full blocks whose KV is now there, for one request (`blocks_computed`): blocks
/// `n_before / block_size .. n_after / block_size` of the table became full (a step computed
/// them, or a load landed them).
#[derive(Debug, Clone, Copy)]
pub struct ComputedBlocks<'a> {
    pub req: ReqIdx,
    /// The request's block table.
    pub blocks: &'a [BlockId],
    /// Hashes of the request's full blocks (at least every full computed one).
    pub block_hashes: &'a [BlockHash],
    /// Tokens whose KV was there before the step, and after it.
    pub n_before: usize,
    pub n_after: usize,
}

/// Makes `Store` holds for the connector being asked (`KvConnector::blocks_computed`): the
/// blocks stay allocated, and are never written by a step, until the connector reports the
/// hold ended.
pub trait StoreHolds {
    /// Holds `blocks` (each gets one more reference) for a store job; returns the hold.
    fn hold(&mut self, blocks: &[BlockId]) -> TransferId;
}

/// One block copy between the arena and a local tier's host memory: arena block `block`
/// and host block `host_block` (host memory is addressed in engine-block units).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCopy {
    pub block: BlockId,
    pub host_block: u32,
}

/// A local tier's gauges and counters (`KvConnector::tier_stats`), for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Host bytes the tier's index holds blocks in (stored or being stored).
    pub bytes_used: u64,
    pub bytes_capacity: u64,
    /// Admissions that loaded a prefix from the tier, and the blocks they loaded.
    pub n_hits: u64,
    pub n_hit_blocks: u64,
    /// Blocks stored into the tier (jobs sent), and loads started.
    pub n_stores: u64,
    pub n_loads: u64,
    /// Blocks evicted to make room.
    pub n_evictions: u64,
    /// Flush sets delivered to the worker (one per reset that abandoned jobs).
    pub n_flushes: u64,
}

impl TierStats {
    /// Sums two tiers' figures.
    pub fn add(&mut self, o: &TierStats) {
        self.bytes_used += o.bytes_used;
        self.bytes_capacity += o.bytes_capacity;
        self.n_hits += o.n_hits;
        self.n_hit_blocks += o.n_hit_blocks;
        self.n_stores += o.n_stores;
        self.n_loads += o.n_loads;
        self.n_evictions += o.n_evictions;
        self.n_flushes += o.n_flushes;
    }
}

/// A finished request as `request_finished` sees it.
#[derive(Debug, Clone, Copy)]
pub struct FinishedRequest<'a> {
    pub req: ReqIdx,
    pub request_id: &'a str,
    pub reason: FinishReason,
    /// The request's blocks, in block-table order; they hold KV for `n_computed` tokens.
    pub blocks: &'a [BlockId],
    pub n_computed: usize,
    /// The hold the blocks would go to if this connector exports them (under the lease
    /// `SchedulerConfig::export_lease`, which the scheduler keeps: the connector is told when
    /// it runs out, `hold_expired`).
    pub hold: TransferId,
    /// The weight version the KV was computed with.
    pub weight_version: &'a str,
    /// The LoRA adapter the KV was computed with (`None`: the base model).
    pub lora: Option<&'a LoraRef>,
}

/// How an asynchronous load ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadOutcome {
    /// Every block arrived and was checked.
    Loaded,
    /// The load failed; the first `good_blocks` blocks arrived intact. A connector reports
    /// `good_blocks > 0` only once nothing writes the blocks any more (the hold ends with the
    /// same report); with 0 the request starts over in fresh blocks, so a load still being
    /// cancelled (a timeout) can never write into KV the request uses. `kind` says who is to
    /// blame, and so what happens to the request (`Scheduler::on_load_result`).
    Failed {
        good_blocks: usize,
        reason: String,
        kind: FetchFailure,
    },
    /// Cut short by `abort_transfers` (a cache reset) or by the request's end: a retraction,
    /// never a failure of the request.
    Cancelled,
}

/// One load's end, for the scheduler (`take_finished_loads`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadResult {
    pub req: ReqIdx,
    pub hold: TransferId,
    pub outcome: LoadOutcome,
}

/// One job for a connector's worker this step: plain data, carried in the `StepPlan`. Each
/// family of connector has its own jobs; this only wraps them, and a worker gets its own
/// family's (`WorkerConnector` in `ferry-kv` unwraps once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerJob {
    /// A P/D connector's job.
    Pd(PdJob),
    /// A local tier's job.
    Tier(TierJob),
}

impl From<PdJob> for WorkerJob {
    fn from(job: PdJob) -> Self {
        Self::Pd(job)
    }
}

impl From<TierJob> for WorkerJob {
    fn from(job: TierJob) -> Self {
        Self::Tier(job)
    }
}

/// A job for the P/D connector's worker (`PdWorker`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PdJob {
    /// Serve `blocks` to a reader that presents `token` (P): the export of `hold`.
    Publish {
        hold: TransferId,
        token: String,
        weight_version: String,
        /// The LoRA adapter the KV was computed with (none: the base model): a pull must
        /// name the same, as it must the weight version.
        lora: Option<LoraKey>,
        blocks: Vec<BlockId>,
        /// Hash of the prompt tokens the KV is for (`prompt_hash`), so a reader with another
        /// prompt is refused.
        prompt_hash: [u8; 32],
        n_tokens: usize,
    },
    /// Stop serving `hold`: readers that come later are told it is gone, and why (`reason`),
    /// so D knows whether the lifecycle retracted it.
    Unpublish {
        hold: TransferId,
        reason: Unpublished,
    },
    /// D will not pull this export (another connector supplies the prompt, the request
    /// computes it or is gone): tell P, presenting the export's token, so P frees the blocks
    /// now instead of at the end of the lease. Best effort: P's lease still bounds it.
    Release {
        remote_engine_id: String,
        remote_host: Option<String>,
        remote_port: Option<u16>,
        token: String,
    },
    /// Load `src_blocks[i]` of the export `token` on `remote_engine_id` into local `blocks[i]`
    /// (D), then report the hold's outcome.
    Fetch {
        hold: TransferId,
        remote_engine_id: String,
        remote_host: Option<String>,
        remote_port: Option<u16>,
        token: String,
        weight_version: String,
        /// The LoRA adapter D computes the request with (none: the base model).
        lora: Option<LoraKey>,
        prompt_hash: [u8; 32],
        /// Index in the export's blocks of `src_blocks[0]`.
        first_block: usize,
        src_blocks: Vec<BlockId>,
        blocks: Vec<BlockId>,
    },
    /// Cancel a fetch in flight; the worker reports it ended once nothing writes its blocks.
    /// `why` is the scheduler's reason, so the engine counts the load as timed out or
    /// cancelled (the worker only sees a cancel).
    CancelFetch { hold: TransferId, why: FetchCancel },
}

/// A job for a local tier's worker (the offload copier).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierJob {
    /// Copy arena blocks into a local tier's host blocks (a `Store` hold), then report
    /// `StoreDone`. Runs off the engine thread, after the step that computed the blocks.
    Store {
        hold: TransferId,
        epoch: u64,
        copies: Vec<HostCopy>,
    },
    /// Copy host blocks into arena blocks (a `Load` hold), then report `LoadDone`.
    Load {
        hold: TransferId,
        epoch: u64,
        copies: Vec<HostCopy>,
    },
    /// The flush set of a reset: wait until these jobs are done (their grants dropped, their
    /// host blocks no longer touched) before this step goes on.
    Flush { holds: Vec<TransferId> },
}

/// What one connector's worker does this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepWork {
    pub connector: ConnectorId,
    pub jobs: Vec<WorkerJob>,
}

/// A worker's result, delivered to the engine as an input and to the connector in order,
/// between steps (`Scheduler::on_worker_report`, which unwraps it once and hands the connector
/// its own family's: [`KvConnector::on_pd_report`], [`KvConnector::on_tier_report`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerReport {
    /// From a P/D connector's worker.
    Pd(PdReport),
    /// From a local tier's worker.
    Tier(TierReport),
}

impl From<PdReport> for WorkerReport {
    fn from(report: PdReport) -> Self {
        Self::Pd(report)
    }
}

impl From<TierReport> for WorkerReport {
    fn from(report: TierReport) -> Self {
        Self::Tier(report)
    }
}

/// A P/D worker's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PdReport {
    /// P: a reader pulled the export `hold` (all of it): its blocks may go.
    ExportPulled { hold: TransferId },
    /// P: the worker stopped serving `hold` (after `Unpublish`): nothing reads it any more.
    ExportGone { hold: TransferId },
    /// D: the fetch of `hold` ended: `Ok`, or failed after `good_blocks` intact blocks.
    /// After a `CancelFetch` this is the acknowledgement (whatever it says).
    FetchDone {
        hold: TransferId,
        result: Result<(), FetchError>,
    },
}

/// A local tier's worker's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierReport {
    /// A local tier's store job ended (its grant dropped); `ok` if every block was copied.
    StoreDone {
        hold: TransferId,
        epoch: u64,
        ok: bool,
    },
    /// A local tier's load job ended (its grant dropped).
    LoadDone {
        hold: TransferId,
        epoch: u64,
        result: Result<(), FetchError>,
    },
}

/// Why a fetch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchError {
    pub good_blocks: usize,
    pub reason: String,
    /// Who is to blame: what happens to the request.
    pub kind: FetchFailure,
    /// How the fetch ended short: what `/metrics` counts it as.
    pub end: FetchEnd,
}

impl FetchError {
    /// A fault (the link broke, a peer gone): the policy decides.
    pub fn fault(good_blocks: usize, reason: impl Into<String>) -> Self {
        Self {
            good_blocks,
            reason: reason.into(),
            kind: FetchFailure::Fault,
            end: FetchEnd::Failed,
        }
    }

    /// Invalid input (a forged or replayed pull), refused before any block moved.
    pub fn invalid(reason: impl Into<String>) -> Self {
        Self::refused(FetchFailure::Invalid, reason)
    }

    /// Refused before any block moved (P's answer, or a check of the pull), `kind` to blame.
    pub fn refused(kind: FetchFailure, reason: impl Into<String>) -> Self {
        Self {
            good_blocks: 0,
            reason: reason.into(),
            kind,
            end: FetchEnd::Refused,
        }
    }

    /// A step of the transfer did not finish in time: a fault.
    pub fn timed_out(good_blocks: usize, reason: impl Into<String>) -> Self {
        Self {
            end: FetchEnd::TimedOut,
            ..Self::fault(good_blocks, reason)
        }
    }

    /// Cut short by a `CancelFetch` (reason `"cancelled"`): a fault, should it ever be used.
    pub fn cancelled(good_blocks: usize) -> Self {
        Self {
            end: FetchEnd::Cancelled,
            ..Self::fault(good_blocks, "cancelled")
        }
    }
}

/// How a fetch ended short, as `/metrics` counts loads (`kv_loads_failed`, `_timed_out`,
/// `_cancelled`, `_refused`). Independent of the blame ([`FetchFailure`]), which decides what
/// happens to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchEnd {
    /// The transfer broke (the link, the peer, a grant): any other failure.
    Failed,
    /// A step did not finish within its bound.
    TimedOut,
    /// Cut short by the scheduler.
    Cancelled,
    /// Refused before any block moved: by P (its answer names the kind) or by a check.
    Refused,
}

/// Why the scheduler cancels a fetch (`PdJob::CancelFetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchCancel {
    /// The load's bound ran out (`SchedulerConfig::kv_load_timeout`).
    TimedOut,
    /// A retraction: a cache reset (`abort_transfers`) or the request ended.
    Retracted,
}

/// Who is to blame for a load that could not be used (`connectors.md`); P says which in its
/// refusal of a pull, so D need not guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchFailure {
    /// The link broke, a read timed out, P is gone or unreachable, a grant could not be had:
    /// `KvLoadFailurePolicy` decides.
    Fault,
    /// P revoked the export in a clearing operation (pause with `clear_cache`, sleep, KV
    /// release, cache reset): the lifecycle retracted it; the request computes, under either
    /// policy.
    Revoked,
    /// The export's lease ran out before D pulled it: a retraction if the request waited
    /// behind a pause or reset on D, else a fault.
    Expired,
    /// A forged or replayed pull (unknown token, a second pull, block ids, prompt, version or
    /// adapter that are not the export's): fails closed, whatever the policy.
    Invalid,
}

impl FetchFailure {
    /// The name P sends in a refusal and logs show.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fault => "fault",
            Self::Revoked => "revoked",
            Self::Expired => "expired",
            Self::Invalid => "invalid",
        }
    }
}

/// Why P stopped serving an export (`PdJob::Unpublish`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unpublished {
    /// A clearing operation revoked it.
    Revoked,
    /// Its lease ran out.
    Expired,
}

impl From<Unpublished> for FetchFailure {
    fn from(u: Unpublished) -> Self {
        match u {
            Unpublished::Revoked => Self::Revoked,
            Unpublished::Expired => Self::Expired,
        }
    }
}

/// A connector refused a request at arrival (its transfer parameters make no sense to it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_params: {0}")]
pub struct TransferParamsError(pub String);

/// The hash of the prompt tokens an export's KV is for: a reader whose prompt differs is
/// refused, so KV is never used for tokens it was not computed from.
pub fn prompt_hash(tokens: &[TokenId]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"ferry prompt v1");
    for t in tokens {
        h.update(&t.0.to_le_bytes());
    }
    *h.finalize().as_bytes()
}

/// The scheduler side of a connector. Sans-IO like the rest of the core: a connector records
/// what must happen and its worker side (in `ferry-kv`) does it.
pub trait KvConnector: Send + std::fmt::Debug {
    /// A short name for logs and errors (`"pd"`, `"offload"`).
    fn name(&self) -> &str;

    /// A request arrived. An error refuses it (the caller sees why).
    fn on_new_request(&mut self, _req: NewRequest<'_>) -> Result<(), TransferParamsError> {
        Ok(())
    }

    /// Admission, after the local prefix hit: what can this connector supply? No side
    /// effects; may be asked again for the same request.
    fn match_external(&mut self, _query: ExternalQuery<'_>) -> ExternalMatch {
        ExternalMatch::None
    }

    /// Request `req` was admitted and this connector does not supply its load (another one
    /// does, or the request computes its prompt): whatever this connector offered or was
    /// asked for will not be used. P/D releases the export at once (tells P). Called on every
    /// admission for every connector but the loader.
    fn declined(&mut self, _req: ReqIdx) {}

    /// Blocks were allocated for the `Hit` this connector gave: start the load (in its next
    /// [`step_work`](Self::step_work)). The request waits in `WaitingForRemoteKv` until
    /// [`take_finished_loads`](Self::take_finished_loads) reports the load.
    fn after_alloc(&mut self, load: AllocatedLoad<'_>) {
        let _ = load;
    }

    /// Full blocks whose KV is now there: computed by a step (called from `on_step_output`,
    /// before finishes free anything) or landed by another connector's load (a P/D import);
    /// only for requests whose hash chain follows the current weights. A local tier stores
    /// them, holding what its jobs read through `holds`.
    fn blocks_computed(&mut self, _computed: ComputedBlocks<'_>, _holds: &mut dyn StoreHolds) {}

    /// Whether `blocks_computed` is wanted at all (the scheduler skips the work otherwise).
    fn stores_blocks(&self) -> bool {
        false
    }

    /// A local tier's figures, for metrics; `None` for connectors that are no tier.
    fn tier_stats(&self) -> Option<TierStats> {
        None
    }

    /// A local tier's loadable blocks (stored, their store job done), by key; none for
    /// connectors that are no tier. What its KV events must announce (the simulation checks
    /// a subscriber's view against it).
    fn tier_blocks(&self, _out: &mut Vec<crate::hash::BlockHash>) {}

    /// The jobs for this connector's worker in the step being planned (also a zero-token
    /// step). Appends to `out`.
    fn step_work(&mut self, _out: &mut Vec<WorkerJob>) {}

    /// A P/D worker's result arrived (only for a connector whose worker runs `PdJob`s: the
    /// scheduler hands each connector the reports of its own worker).
    fn on_pd_report(&mut self, _report: PdReport) {}

    /// A local tier's worker's result arrived (likewise, for a connector that plans
    /// `TierJob`s).
    fn on_tier_report(&mut self, _report: TierReport) {}

    /// A request finished (any reason, aborts included) or was retracted from the engine.
    /// Return `Some` to keep its blocks as an export under `req.hold`, owned by this connector
    /// (only the first connector to ask gets it; the others are told, and their `Some` is
    /// merged into the parameters the client gets). Only for finishes that are not aborts and
    /// hold blocks.
    fn request_finished(&mut self, _req: FinishedRequest<'_>) -> Option<KvTransferParams> {
        None
    }

    /// Ends every transfer: revokes exports (tells readers they are gone), cancels loads in
    /// flight. Blocks come back later through [`KvConnector::take_finished_transfers`], once
    /// nothing can still read or write them. Called once per cache reset.
    fn abort_transfers(&mut self);

    /// Transfers that ended since the last call (completed, failed or revoked); the scheduler
    /// frees their blocks. Only holds this connector owns are freed; other ids are ignored.
    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>);

    /// Loads that ended since the last call.
    fn take_finished_loads(&mut self, _out: &mut Vec<LoadResult>) {}

    /// The time of hold `hold` ran out: an export's lease (`SchedulerConfig::export_lease`)
    /// or a load's bound (`SchedulerConfig::kv_load_timeout`). The connector stops serving
    /// the export, or cancels the load and reports it failed; either way it reports the hold
    /// ended once its worker let go of the blocks (they are not freed before).
    fn hold_expired(&mut self, _hold: TransferId) {}

    /// Work that needs the engine to keep stepping even with no request to compute (jobs not
    /// yet handed to the worker).
    fn has_pending_work(&self) -> bool;

    /// Drops the connector's own cache (an offload tier's index). Re-entrant: a second call
    /// before the next step only adds to what the first one did.
    fn reset_cache(&mut self);

    /// From now on, journal the changes of the connector's own cache for KV events (a tier's
    /// stored and removed blocks); connectors with no cache of their own ignore it.
    fn publish_tier_changes(&mut self) {}

    /// The changes journaled since the last call (see `publish_tier_changes`).
    fn take_tier_changes(&mut self, _out: &mut Vec<crate::kv_events::TierChange>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_parameters_take_every_key_and_a_clash_names_the_key() {
        let mut p = KvTransferParams {
            remote_engine_id: Some("p0".into()),
            ..KvTransferParams::default()
        };
        let other = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("p0".into()),
            remote_block_ids: Some(BlockId::list([3, 4])),
            n_tokens: Some(9),
            ..KvTransferParams::default()
        };
        p.merge(other).unwrap();
        assert!(p.do_remote_prefill && !p.do_remote_decode);
        assert_eq!(p.remote_engine_id.as_deref(), Some("p0"));
        assert_eq!(p.remote_block_ids, Some(BlockId::list([3, 4])));
        assert_eq!(p.n_tokens, Some(9));
        // A key set on one side only keeps that value, whichever side had it.
        let mut q = KvTransferParams {
            remote_port: Some(7),
            ..KvTransferParams::default()
        };
        q.merge(KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        })
        .unwrap();
        assert_eq!(q.remote_port, Some(7));
        assert!(q.do_remote_decode && !q.do_remote_prefill);
        let clash = KvTransferParams {
            remote_engine_id: Some("p1".into()),
            ..KvTransferParams::default()
        };
        let err = p.merge(clash).unwrap_err();
        assert!(
            err.contains("remote_engine_id") && err.contains("p1"),
            "{err}"
        );
    }

    #[test]
    fn tier_stats_add_up_field_by_field() {
        let a = TierStats {
            bytes_used: 2,
            bytes_capacity: 3,
            n_hits: 4,
            n_hit_blocks: 5,
            n_stores: 6,
            n_loads: 7,
            n_evictions: 8,
            n_flushes: 9,
        };
        let mut sum = a;
        sum.add(&a);
        assert_eq!(
            sum,
            TierStats {
                bytes_used: 4,
                bytes_capacity: 6,
                n_hits: 8,
                n_hit_blocks: 10,
                n_stores: 12,
                n_loads: 14,
                n_evictions: 16,
                n_flushes: 18,
            }
        );
    }

    #[test]
    fn prompt_hashes_tell_prompts_apart() {
        let a = prompt_hash(&TokenId::list([1, 2, 3]));
        assert_eq!(a, prompt_hash(&TokenId::list([1, 2, 3])));
        assert_ne!(a, prompt_hash(&TokenId::list([1, 2, 4])));
        assert_ne!(a, prompt_hash(&TokenId::list([1, 2])));
        assert_ne!(a, [0; 32]);
        assert_ne!(a, [1; 32]);
    }

    /// A connector that only implements what it must: the defaults are those of a connector
    /// that stores nothing and is no tier.
    #[derive(Debug)]
    struct Bare;

    impl KvConnector for Bare {
        fn name(&self) -> &str {
            "bare"
        }
        fn abort_transfers(&mut self) {}
        fn take_finished_transfers(&mut self, _: &mut Vec<TransferId>) {}
        fn has_pending_work(&self) -> bool {
            false
        }
        fn reset_cache(&mut self) {}
    }

    #[test]
    fn a_connector_stores_nothing_and_is_no_tier_by_default() {
        assert!(!Bare.stores_blocks());
        assert_eq!(Bare.tier_stats(), None);
    }
}
