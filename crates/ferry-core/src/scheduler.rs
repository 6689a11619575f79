//! The scheduler: continuous batching with a token budget, chunked prefill, FCFS admission and
//! preemption by recompute.
//!
//! One step is `schedule()` (a [`StepPlan`] out) then `on_step_output()` (sampled tokens in,
//! [`RequestOutput`]s out). `schedule()` reads as its phases: running requests first (decodes
//! and unfinished prefill chunks, preempting the latest-admitted request when blocks run out),
//! then waiting requests in order while budget, seats and blocks allow, then the plan.
//!
//! Executor contract beyond `plan.rs`: full blocks enter the prefix cache when they are
//! *scheduled*, not when computed, so a request admitted later in the same step can hit blocks
//! whose KV an earlier request in the same plan writes in this step (its `start_pos` counts
//! them). An executor must therefore write each layer's KV for all plan entries, in plan order,
//! before reading it (layer-by-layer batched, or request by request in plan order, both do).
//! This is what makes concurrent requests with a shared prefix share it at once.
//!
//! Cost per step is proportional to the scheduled requests and the block tables copied into
//! the plan, never to the number of waiting requests: the waiting queue is only looked at from
//! its head.
//!
//! This file holds the scheduler's state, admission, planning, step outputs and finishes; the
//! rest is split by job: `lifecycle_machine.rs` (the lifecycle state machine: pauses, sleep,
//! wake-up, KV release, the weight version), `aborts_and_resets.rs` (aborts, preempting
//! everything, cache resets), `routing.rs` (each request's expert routing, when the engine
//! captures it), `transfers.rs` (the transfer-hold API; the holds themselves are
//! `crate::holds`), `connectors.rs` (registering connectors, their jobs, reports and ended
//! transfers), `offer.rs` (full blocks to the connectors that store them), `time.rs` (the clock
//! and deadlines) and `render.rs` (plans as text).

mod aborts_and_resets;
mod connectors;
mod lifecycle_machine;
mod lora;
mod offer;
mod render;
mod routing;
#[cfg(test)]
mod tests;
mod time;
mod transfers;

pub use aborts_and_resets::Cleared;
pub use transfers::TransferError;

use std::collections::{HashMap, VecDeque};

use crate::config::{ConfigError, SchedulerConfig};
use crate::connector::{
    AllocatedLoad, ExternalMatch, ExternalQuery, FetchFailure, FinishedRequest,
    KvLoadFailurePolicy, KvTransferParams, LoadOutcome, LoadResult, NewRequest, TransferRequest,
};
use crate::hash::{chain_root, BlockHash};
use crate::holds::{HoldKind, Holder, Holds, Lease};
use crate::ids::{BlockId, ConnectorId, LoraId, ReqIdx, TokenId, TransferId};
use crate::kv_cache::{KvCacheManager, PrefixHit};
use crate::lora::LoraRef;
use crate::ownership::{self, Owner, OwnershipError};
use crate::plan::{
    AdjustedToken, ExpertRouting, LogitsAdjust, ModelOutput, PromptLogprobsWork, RoutingRead,
    RoutingShape, SampleSpec, SampledToken, ScheduledReq, StepPlan,
};
use crate::request::{AddError, FinishReason, Request, RequestState};
use crate::sampling::SamplingParams;

/// What one step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub req: ReqIdx,
    /// The token generated this step (none for an abort).
    pub sampled: Option<SampledToken>,
    /// Tokens generated so far, this one included.
    pub n_output_tokens: usize,
    /// Set on the request's last output; its `ReqIdx` is free for reuse afterwards. Boxed:
    /// a `Finished` (with its P/D transfer parameters) is four times the rest of the output,
    /// and a step makes and moves one output per sampled request but finishes few of them
    /// (unboxed, moving 296-byte outputs was a third of a decode step's cost).
    pub finished: Option<Box<Finished>>,
}

/// How and which request finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub request_id: String,
    pub reason: FinishReason,
    /// The transfer now holding the request's KV: an export a connector made
    /// (`KvConnector::request_finished`), or a caller's hold (`Scheduler::hold_kv_on_finish`).
    pub transfer: Option<TransferId>,
    /// The connectors' transfer parameters for the client (P's export: where and how D
    /// loads it).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Why, for a request finished with `Error` (a failed KV load under the `fail` policy).
    pub message: Option<String>,
    /// The request's expert routing, when the engine captures it
    /// ([`Scheduler::set_routing_shape`]): every position it had routing for, so positions
    /// `0..len - 1` of a request that finished on its own (its last token was never an
    /// input), fewer for one aborted before its prompt was computed.
    pub routing: Option<ExpertRouting>,
}

/// The model output does not answer the plan it is given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputError {
    #[error("output for step {got}, but the latest plan is step {latest}")]
    StalePlan { got: u64, latest: u64 },
    #[error("expected a sampled token for {expected:?}, got one for {got:?}")]
    WrongRequest { expected: ReqIdx, got: ReqIdx },
    #[error("sampled token for {got:?}, which the plan did not ask to sample")]
    Unexpected { got: ReqIdx },
    #[error("no sampled token for {missing:?}, which the plan asked to sample")]
    Missing { missing: ReqIdx },
    #[error("expert routing for {got} requests, the plan scheduled {expected}")]
    RoutingCount { expected: usize, got: usize },
    #[error(
        "expert routing for {got:?} at positions {got_first}.. ({got_ids} ids), expected \
         {expected:?} at {expected_first}.. ({expected_ids} ids)"
    )]
    RoutingRange {
        expected: ReqIdx,
        expected_first: usize,
        expected_ids: usize,
        got: ReqIdx,
        got_first: usize,
        got_ids: usize,
    },
    #[error("expert routing for {req:?} names expert {id}, the model has {num_experts}")]
    RoutingExpert {
        req: ReqIdx,
        id: u16,
        num_experts: usize,
    },
}

/// A request is in the wrong queue, in two, or in none.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error(
        "request {id:?} is in state {state:?} but listed {n_listed} times in the {queue} queue"
    )]
    Misplaced {
        id: String,
        state: RequestState,
        queue: &'static str,
        n_listed: usize,
    },
    #[error("queue {queue} lists {req:?}, which is not a live request")]
    Dangling { queue: &'static str, req: ReqIdx },
    #[error("{n_running} requests running, max_num_seqs is {max}")]
    TooManyRunning { n_running: usize, max: usize },
}

/// Counters and gauges for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    pub n_steps: u64,
    pub n_running: usize,
    pub n_waiting: usize,
    pub n_blocks_used: usize,
    pub n_blocks_free: usize,
    pub n_blocks_cached: usize,
    pub n_transfers: usize,
    /// Tokens found in the prefix cache at admission.
    pub prefix_hit_tokens: u64,
    /// Tokens looked up in the prefix cache at admission.
    pub prefix_query_tokens: u64,
    pub n_preemptions: u64,
}

/// What admitting one waiting request did.
#[derive(Debug)]
enum Admit {
    /// Runs this step, computing this many tokens.
    Scheduled(usize),
    /// Stays at its place in the queue (a load started, or another request's load of the
    /// same KV must land first).
    Parked,
    /// Finished with an error (a refused load under the `fail` policy).
    Failed(String),
    /// Does not fit now; the queue stops here.
    NoRoom,
}

/// One request's share of the step being planned.
#[derive(Debug, Clone, Copy)]
struct Decision {
    req: ReqIdx,
    n_new: usize,
}

/// The engine core's scheduler. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    /// Request slab indexed by `ReqIdx`; `None` slots are free (listed in `free_slots`).
    requests: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    /// Only for `add_request`/`abort`; never iterated, so its order never reaches a plan.
    ids: HashMap<String, ReqIdx>,
    waiting: VecDeque<ReqIdx>,
    /// In admission order: the last one is the first to be preempted.
    running: Vec<ReqIdx>,
    /// Every piece of lifecycle state: the pause, pending operations, what is asleep, the
    /// weight version (`lifecycle_machine.rs`).
    control: lifecycle_machine::Control,
    connectors: Vec<Box<dyn crate::connector::KvConnector>>,
    /// The chain root new block hashes start from; follows the weight version. A request
    /// with an adapter mixes it with the adapter's (`hash::lora_root`).
    hash_root: BlockHash,
    /// The LoRA adapters loaded, each at its version now (`lora.rs`, `scheduler/lora.rs`).
    loras: std::collections::BTreeMap<LoraId, LoraRef>,
    /// The latest version each adapter name had, loaded now or before: a version is never
    /// given to a name twice.
    lora_versions: std::collections::BTreeMap<std::sync::Arc<str>, u64>,
    /// Every transfer hold: its blocks, holder, kind and lease (`holds.rs`).
    holds: Holds,
    /// Loads that were in flight when the weights changed: whatever they land is stale, so
    /// their requests recompute (`set_weight_version`).
    stale_loads: std::collections::BTreeSet<TransferId>,
    /// The engine's monotonic clock as of its last `advance_time` (since an epoch the engine
    /// chose); the core never reads a clock.
    now: std::time::Duration,
    next_step: u64,
    prefix_hit_tokens: u64,
    prefix_query_tokens: u64,
    n_preemptions: u64,
    /// Outputs of requests finished between steps (a failed load under the `fail` policy),
    /// until `take_outputs`.
    side_outputs: Vec<RequestOutput>,
    /// Reused by `poll_connectors`.
    load_results: Vec<LoadResult>,
    /// Reused by `poll_connectors`.
    ended_transfers: Vec<TransferId>,
    /// Reused every step so planning does not allocate.
    decisions: Vec<Decision>,
    /// Buffers of a plan handed back by `recycle_plan`, reused by the next `schedule()`.
    spare: StepPlan,
    /// The shape of the expert routing the executor reports, when it captures routing
    /// (`routing.rs`).
    routing_shape: Option<RoutingShape>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let hash_root = chain_root(&config.weight_version);
        let mut kv = KvCacheManager::new(
            config.n_blocks,
            config.block_size,
            config.enable_prefix_caching,
        );
        kv.set_current_root(hash_root);
        kv.pool_mut().set_log(crate::kv_events::KvEventLog::new(
            config.kv_events,
            config.block_size,
            &config.weight_version,
        ));
        let control = lifecycle_machine::Control::new(&config.weight_version);
        Ok(Self {
            kv,
            hash_root,
            loras: std::collections::BTreeMap::new(),
            lora_versions: std::collections::BTreeMap::new(),
            config,
            requests: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            control,
            connectors: Vec::new(),
            holds: Holds::new(),
            stale_loads: std::collections::BTreeSet::new(),
            now: std::time::Duration::ZERO,
            next_step: 0,
            prefix_hit_tokens: 0,
            prefix_query_tokens: 0,
            n_preemptions: 0,
            side_outputs: Vec::new(),
            load_results: Vec::new(),
            ended_transfers: Vec::new(),
            decisions: Vec::new(),
            spare: StepPlan::default(),
            routing_shape: None,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request at the tail of the waiting queue (also while paused).
    pub fn add_request(
        &mut self,
        id: impl Into<String>,
        prompt: Vec<TokenId>,
        params: SamplingParams,
    ) -> Result<ReqIdx, AddError> {
        self.add_request_with_transfer(id, prompt, params, None)
    }

    /// [`add_request`](Self::add_request) with what the request asks of the P/D transfer
    /// (its `kv_transfer_params`, parsed at the edge by [`TransferRequest::parse`]), which
    /// every connector sees (`KvConnector::on_new_request`); one that refuses it refuses the
    /// request.
    pub fn add_request_with_transfer(
        &mut self,
        id: impl Into<String>,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        transfer: Option<TransferRequest>,
    ) -> Result<ReqIdx, AddError> {
        let id = id.into();
        self.validate_request(&id, &prompt, &params)?;
        let max_len = Request::max_len(prompt.len(), params.max_tokens, self.config.max_model_len);
        let idx = self.alloc_slot();
        let mut tokens = prompt;
        // Room for every token this request can ever have: no regrowth while decoding.
        tokens.reserve_exact(max_len - tokens.len());
        let n_blocks_max = max_len.div_ceil(self.config.block_size);
        let req_lora = params.lora.clone();
        let mut req = Request {
            id: id.clone(),
            idx,
            params,
            state: RequestState::Waiting,
            prompt_len: tokens.len(),
            tokens,
            n_computed: 0,
            blocks: Vec::with_capacity(n_blocks_max),
            lora: req_lora,
            block_hashes: Vec::with_capacity(n_blocks_max),
            hash_root: self.hash_root,
            weight_root: self.hash_root,
            chain_lora_version: None,
            n_cached_blocks: 0,
            n_cached_tokens: 0,
            admitted: false,
            pause_mark: self.control.pause_mark(),
            n_preemptions: 0,
            export_on_finish: false,
            routing: Vec::new(),
        };
        self.kv.rehash_if_stale(&mut req, &self.hash_root);
        let version = self.control.weight_version.clone();
        for i in 0..self.connectors.len() {
            let new = NewRequest {
                req: idx,
                request_id: &id,
                prompt: &req.tokens,
                transfer: transfer.as_ref(),
            };
            if let Err(e) = self.connectors[i].on_new_request(new) {
                // The connectors that took it forget it again. An abort holding no blocks is
                // never exported: the hold they are told of is never opened.
                let unopened = self.holds.reserve();
                for c in &mut self.connectors[..i] {
                    c.request_finished(FinishedRequest {
                        req: idx,
                        request_id: &id,
                        reason: FinishReason::Abort,
                        blocks: &[],
                        n_computed: 0,
                        hold: unopened.id(),
                        weight_version: &version,
                        lora: req.lora.as_ref(),
                    });
                }
                self.free_slots.push(idx.0);
                return Err(AddError::KvTransfer { id, reason: e.0 });
            }
        }
        self.requests[idx.0 as usize] = Some(req);
        self.ids.insert(id, idx);
        self.waiting.push_back(idx);
        Ok(idx)
    }

    fn validate_request(
        &self,
        id: &str,
        prompt: &[TokenId],
        params: &SamplingParams,
    ) -> Result<(), AddError> {
        let c = &self.config;
        let id = || id.to_owned();
        if prompt.is_empty() {
            return Err(AddError::EmptyPrompt { id: id() });
        }
        if prompt.len() >= c.max_model_len {
            return Err(AddError::PromptTooLong {
                id: id(),
                prompt_len: prompt.len(),
                max_model_len: c.max_model_len,
            });
        }
        if self.ids.contains_key(id().as_str()) {
            return Err(AddError::DuplicateId { id: id() });
        }
        if params.max_tokens == 0 {
            return Err(AddError::ZeroMaxTokens { id: id() });
        }
        if let Some(lora) = &params.lora {
            self.check_lora_current(lora)
                .map_err(|error| AddError::Lora { id: id(), error })?;
        }
        if !c.enable_chunked_prefill && prompt.len() > c.max_num_batched_tokens {
            return Err(AddError::PromptExceedsBatch {
                id: id(),
                prompt_len: prompt.len(),
                max_num_batched_tokens: c.max_num_batched_tokens,
            });
        }
        // The last token is never computed, so it needs no KV. A request that cannot fit even
        // alone would be preempted forever.
        let max_len = Request::max_len(prompt.len(), params.max_tokens, c.max_model_len);
        let n_blocks_needed = (max_len - 1).div_ceil(c.block_size);
        let n_blocks_usable = self.kv.pool().n_usable();
        if n_blocks_needed > n_blocks_usable {
            return Err(AddError::TooLongForKvCache {
                id: id(),
                n_blocks_needed,
                n_blocks_usable,
            });
        }
        Ok(())
    }

    fn alloc_slot(&mut self) -> ReqIdx {
        match self.free_slots.pop() {
            Some(i) => ReqIdx(i),
            None => {
                self.requests.push(None);
                ReqIdx(self.requests.len() as u32 - 1)
            }
        }
    }

    /// The live request at `idx`, if any.
    pub fn request(&self, idx: ReqIdx) -> Option<&Request> {
        self.requests.get(idx.0 as usize)?.as_ref()
    }

    /// The handle of a live request.
    pub fn request_idx(&self, id: &str) -> Option<ReqIdx> {
        self.ids.get(id).copied()
    }

    /// Plans the next step. Frozen: an empty plan. Paused with `NoAdmit`: running requests and
    /// preempted ones (admitted before the pause) only.
    pub fn schedule(&mut self) -> StepPlan {
        self.poll_connectors();
        let mut decisions = std::mem::take(&mut self.decisions);
        decisions.clear();
        if !self.control.frozen() {
            let budget = self.config.max_num_batched_tokens;
            let (budget, n_preempted) = self.schedule_running(budget, &mut decisions);
            // Admitting while preempting would only thrash: the blocks are not there.
            if n_preempted == 0 {
                // A `wait` pause readmits preempted requests (they were admitted) only.
                let readmit_only = !self.control.admits_new();
                self.schedule_waiting(budget, readmit_only, &mut decisions);
            }
        }
        let mut plan = self.finish_plan(&decisions);
        self.decisions = decisions;
        self.take_connector_work(&mut plan.connector_work);
        plan
    }

    /// Phase 1: running requests in admission order, each getting its uncomputed tokens (one
    /// for a decode) within the budget. Returns the budget left and the preemption count.
    fn schedule_running(&mut self, mut budget: usize, out: &mut Vec<Decision>) -> (usize, usize) {
        let mut n_preempted = 0;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let r = self.running[i];
            let n_new = self.requests[r.0 as usize]
                .as_ref()
                .map_or(0, |req| req.n_uncomputed().min(budget));
            if n_new == 0 {
                i += 1;
                continue;
            }
            let (allocated, n) = self.allocate_or_preempt(r, n_new);
            n_preempted += n;
            if !allocated {
                break;
            }
            out.push(Decision { req: r, n_new });
            budget -= n_new;
            i += 1;
        }
        (budget, n_preempted)
    }

    /// Allocates `n_new` slots for running request `r`, preempting from the tail of the running
    /// list (latest admitted first) until it fits; `r` itself may be the last victim. Victims
    /// are always after `r` in the list, so none was scheduled earlier in this step.
    fn allocate_or_preempt(&mut self, r: ReqIdx, n_new: usize) -> (bool, usize) {
        let mut n_preempted = 0;
        loop {
            let Some(req) = self.requests[r.0 as usize].as_mut() else {
                return (false, n_preempted);
            };
            if self.kv.allocate_slots(req, PrefixHit::default(), n_new, 0) {
                return (true, n_preempted);
            }
            let Some(victim) = self.running.pop() else {
                return (false, n_preempted);
            };
            self.preempt(victim);
            n_preempted += 1;
            if victim == r {
                return (false, n_preempted);
            }
        }
    }

    /// Phase 2: waiting requests from the head of the queue (FCFS), while budget, seats and
    /// blocks allow. Stops at the first request that does not fit, keeping the order. A
    /// request whose KV a connector is loading (or will load once another request's load of
    /// the same KV landed) keeps its place and is passed over, so it never holds up the queue;
    /// so is one whose LoRA adapter waits for a seat (`max_loras`, `lora.rs`'s `LoraSeats`).
    fn schedule_waiting(&mut self, mut budget: usize, readmit_only: bool, out: &mut Vec<Decision>) {
        let mut seats = self.lora_seats();
        let mut i = 0;
        while budget > 0 && self.running.len() < self.config.max_num_seqs && i < self.waiting.len()
        {
            let r = self.waiting[i];
            let Some(req) = self.requests[r.0 as usize].as_ref() else {
                self.waiting.remove(i);
                continue;
            };
            if matches!(req.state, RequestState::WaitingForRemoteKv { .. })
                || (readmit_only && !req.admitted)
            {
                // A `wait` pause admits nothing new but lets admitted requests finish:
                // preempted ones (at the head) and those whose load landed or failed (anywhere
                // in the queue), so it passes over the rest (only while it drains).
                i += 1;
                continue;
            }
            let lora = req.lora.as_ref().map(|l| l.id);
            if seats.as_mut().is_some_and(|s| !s.admits(lora)) {
                // Its adapter waits for a seat (`max_loras`); the queue goes on behind it.
                i += 1;
                continue;
            }
            let admit = if req.blocks.is_empty() {
                self.admit_fresh(r, budget)
            } else {
                self.admit_holding_kv(r, budget)
            };
            match admit {
                Admit::Scheduled(n_new) => {
                    if let Some(s) = seats.as_mut() {
                        s.seat(lora);
                    }
                    self.waiting.remove(i);
                    self.running.push(r);
                    out.push(Decision { req: r, n_new });
                    budget -= n_new;
                }
                Admit::Parked => i += 1,
                Admit::Failed(reason) => {
                    self.waiting.remove(i);
                    self.finish_between_steps(r, reason);
                }
                Admit::NoRoom => {
                    // Nothing runs, so no step will free a block: KV that waiting requests
                    // were handed (landed loads) goes back, from the back of the queue,
                    // until this one fits. They recompute later, keeping their places.
                    if self.running.is_empty() && self.reclaim_waiting_kv(r) {
                        continue;
                    }
                    break;
                }
            }
        }
    }

    /// Frees the KV of the last waiting request (other than `except`) that holds blocks and
    /// is not loading into them; false if there is none.
    fn reclaim_waiting_kv(&mut self, except: ReqIdx) -> bool {
        self.waiting.iter().rev().any(|&r| {
            r != except
                && self.requests[r.0 as usize]
                    .as_mut()
                    .is_some_and(|req| drop_waiting_kv(&mut self.kv, req))
        })
    }

    /// Admits a request holding no KV: local prefix hit, then the connectors' offers.
    fn admit_fresh(&mut self, r: ReqIdx, budget: usize) -> Admit {
        let block_size = self.config.block_size;
        let req = self.requests[r.0 as usize]
            .as_mut()
            .expect("a live request");
        self.kv.rehash_if_stale(req, &self.hash_root);
        // Prompt logprobs need every position computed: no hit (the blocks still enter the
        // cache for others).
        let wants_prompt_logprobs = req.params.prompt_logprobs.is_some();
        let hit = if wants_prompt_logprobs {
            crate::kv_cache::PrefixHit::default()
        } else {
            self.kv.find_computed_blocks(req)
        };
        let n_hit_tokens = hit.n_blocks() * block_size;
        let query = ExternalQuery {
            req: r,
            prompt_len: req.prompt_len,
            local_hit_tokens: n_hit_tokens,
            block_hashes: &req.block_hashes,
            weight_version: &self.control.weight_version,
            lora: req.lora.as_ref(),
        };
        // Every connector is asked; the longest ready hit loads (ties in list order). A
        // connector that is not ready yet (another request loads the same KV) parks the
        // request; invalid transfer parameters fail it closed, whatever the policy.
        // Loads supply prompt KV only, and never the last prompt token (its logits are
        // needed to sample): hits are compared on what they can supply.
        let n_max = if wants_prompt_logprobs {
            0
        } else {
            req.prompt_len.saturating_sub(1 + n_hit_tokens)
        };
        let mut best: Option<(ConnectorId, usize, HoldKind)> = None;
        let mut not_yet = false;
        let mut refused = None;
        for (c, connector) in self.connectors.iter_mut().enumerate() {
            match connector.match_external(query) {
                ExternalMatch::None => {}
                ExternalMatch::NotYet => not_yet = true,
                ExternalMatch::Refused { reason } => {
                    refused.get_or_insert(reason);
                }
                ExternalMatch::Hit { tokens, kind } => {
                    let tokens = tokens.min(n_max);
                    if best.is_none_or(|(_, longest, _)| tokens > longest) {
                        best = Some((ConnectorId(c as u32), tokens, kind));
                    }
                }
            }
        }
        if let Some(reason) = refused {
            return Admit::Failed(format!("kv_transfer_params: {reason}"));
        }
        if not_yet {
            return Admit::Parked;
        }
        if let Some((c, n_external, kind)) = best {
            if n_external > 0 {
                let admit = self.start_load(r, hit, c, n_external, kind);
                if matches!(admit, Admit::Parked) {
                    self.decline_others(r, Some(c));
                }
                return admit;
            }
        }
        let req = self.requests[r.0 as usize]
            .as_mut()
            .expect("a live request");
        // Holding no KV, it has computed nothing (a preemption reset its count).
        assert!(
            req.n_computed == 0,
            "scheduler: admission of request #{} ({:?}), which holds no KV but counts {} tokens \
             computed",
            r.0,
            req.id,
            req.n_computed
        );
        let n_left = req.tokens.len() - n_hit_tokens;
        let Some(n_new) = Self::chunk(&self.config, req, n_left, budget) else {
            return Admit::NoRoom;
        };
        if !self.kv.allocate_slots(req, hit, n_new, 0) {
            return Admit::NoRoom;
        }
        req.n_computed += n_hit_tokens;
        req.n_cached_tokens = n_hit_tokens;
        req.admitted = true;
        req.state = RequestState::Running;
        self.prefix_hit_tokens += n_hit_tokens as u64;
        self.prefix_query_tokens += req.tokens.len() as u64;
        self.decline_others(r, None);
        Admit::Scheduled(n_new)
    }

    /// Tells every connector but `loader` that request `r` was admitted without its offer.
    fn decline_others(&mut self, r: ReqIdx, loader: Option<ConnectorId>) {
        for (c, connector) in self.connectors.iter_mut().enumerate() {
            if Some(ConnectorId(c as u32)) != loader {
                connector.declined(r);
            }
        }
    }

    /// Admits a request that already holds KV while waiting (a load that landed, or the good
    /// part of a failed one): it computes the rest, and its loaded blocks enter the prefix
    /// cache with this allocation.
    fn admit_holding_kv(&mut self, r: ReqIdx, budget: usize) -> Admit {
        let req = self.requests[r.0 as usize]
            .as_mut()
            .expect("a live request");
        let n_left = req.tokens.len() - req.n_computed;
        let Some(n_new) = Self::chunk(&self.config, req, n_left, budget) else {
            return Admit::NoRoom;
        };
        if !self
            .kv
            .allocate_slots(req, crate::kv_cache::PrefixHit::default(), n_new, 0)
        {
            return Admit::NoRoom;
        }
        req.state = RequestState::Running;
        self.prefix_query_tokens += req.tokens.len() as u64;
        Admit::Scheduled(n_new)
    }

    /// How many of `n_left` tokens an admission computes this step; `None` if the request
    /// must wait (chunked prefill off and its prompt does not fit the budget).
    fn chunk(
        config: &SchedulerConfig,
        req: &Request,
        n_left: usize,
        budget: usize,
    ) -> Option<usize> {
        // A preempted request recomputes in chunks even with chunked prefill off: its prompt
        // fit in one step, but prompt + output may not, and it must not block the queue
        // forever.
        if config.enable_chunked_prefill || req.n_output_tokens() > 0 {
            Some(n_left.min(budget))
        } else {
            (n_left <= budget).then_some(n_left)
        }
    }

    /// Allocates blocks for the local hit and `n_external` loaded tokens, holds the blocks
    /// the load writes for connector `c`, and parks the request until the load ends.
    fn start_load(
        &mut self,
        r: ReqIdx,
        hit: crate::kv_cache::PrefixHit,
        c: ConnectorId,
        n_external: usize,
        kind: HoldKind,
    ) -> Admit {
        let block_size = self.config.block_size;
        let req = self.requests[r.0 as usize]
            .as_mut()
            .expect("a live request");
        let n_hit_tokens = hit.n_blocks() * block_size;
        if !self.kv.allocate_slots(req, hit, 0, n_external) {
            return Admit::NoRoom;
        }
        req.n_computed += n_hit_tokens;
        req.n_cached_tokens = n_hit_tokens;
        req.admitted = true;
        self.prefix_hit_tokens += n_hit_tokens as u64;
        let first_block = n_hit_tokens / block_size;
        let end_block = (n_hit_tokens + n_external).div_ceil(block_size);
        let blocks = req.blocks[first_block..end_block].to_vec();
        // The hold's own reference: the blocks stay allocated until the connector says
        // nothing writes them any more, whatever happens to the request.
        let bound = Lease::Until(self.now + self.config.kv_load_timeout);
        let hold = self.holds.open_referencing(
            self.kv.pool_mut(),
            blocks,
            Holder::Connector(c),
            kind,
            bound,
        );
        let req = self.requests[r.0 as usize]
            .as_mut()
            .expect("a live request");
        req.state = RequestState::WaitingForRemoteKv {
            transfer: hold,
            n_tokens: n_external,
        };
        let load = AllocatedLoad {
            req: r,
            hold,
            blocks: &self.holds.get(hold).expect("the hold just opened").blocks,
            first_block,
            n_tokens: n_external,
            block_hashes: &req.block_hashes,
        };
        self.connectors[c.0 as usize].after_alloc(load);
        Admit::Parked
    }

    /// Phase 3: the plan, in decision order (running first, then admissions). Advances each
    /// request's computed count: the KV will be there once the executor has run the plan.
    fn finish_plan(&mut self, decisions: &[Decision]) -> StepPlan {
        let mut plan = std::mem::take(&mut self.spare);
        plan.step = self.next_step;
        plan.block_size = self.config.block_size;
        self.next_step += 1;
        plan.reqs.reserve(decisions.len());
        let n_tokens = decisions.iter().map(|d| d.n_new).sum();
        plan.token_ids.reserve(n_tokens);
        let n_table: usize = decisions
            .iter()
            .filter_map(|d| self.request(d.req))
            .map(|r| r.blocks.len())
            .sum();
        plan.block_tables.reserve(n_table);
        for d in decisions {
            let Some(req) = self.requests[d.req.0 as usize].as_mut() else {
                continue;
            };
            let start_pos = req.n_computed;
            let end_pos = start_pos + d.n_new;
            let tokens = plan.token_ids.len()..plan.token_ids.len() + d.n_new;
            plan.token_ids
                .extend_from_slice(&req.tokens[start_pos..end_pos]);
            let blocks = plan.block_tables.len()..plan.block_tables.len() + req.blocks.len();
            plan.block_tables.extend_from_slice(&req.blocks);
            let sample = (end_pos == req.tokens.len()).then(|| {
                let adjust = logits_adjust(req, &self.config.eos_token_ids).map(|a| {
                    plan.logits_adjusts.push(a);
                    plan.logits_adjusts.len() as u32 - 1
                });
                SampleSpec {
                    params: req.params.sampler,
                    output_idx: req.n_output_tokens() as u32,
                    mask: None,
                    adjust,
                }
            });
            if let Some(top_n) = req.params.prompt_logprobs {
                // Position p scores the prompt token at p + 1.
                let end_target = (end_pos + 1).min(req.prompt_len);
                if start_pos + 1 < end_target {
                    plan.prompt_logprobs.push(PromptLogprobsWork {
                        req_pos: plan.reqs.len(),
                        top_n,
                        targets: req.tokens[start_pos + 1..end_target].to_vec(),
                    });
                }
            }
            if let Some(shape) = self.routing_shape {
                // Positions the request did not compute itself (a prefix-cache hit past the
                // routing it has): their routing is read back from the blocks.
                let have = req.routing.len() / shape.width();
                if have < start_pos {
                    plan.routing_reads.push(RoutingRead {
                        req_pos: plan.reqs.len(),
                        from: have,
                    });
                }
            }
            req.n_computed = end_pos;
            plan.reqs.push(ScheduledReq {
                lora: req.lora.as_ref().map(|l| l.id),
                req: d.req,
                start_pos,
                tokens,
                blocks,
                sample,
            });
        }
        plan
    }

    /// Hands a finished plan's buffers back, so the next `schedule()` does not allocate them
    /// again (optional: a plan that is simply dropped costs a few allocations next step).
    pub fn recycle_plan(&mut self, mut plan: StepPlan) {
        plan.reqs.clear();
        plan.token_ids.clear();
        plan.block_tables.clear();
        plan.connector_work.clear();
        plan.token_masks.clear();
        plan.logits_adjusts.clear();
        plan.prompt_logprobs.clear();
        plan.routing_reads.clear();
        if plan.block_tables.capacity() >= self.spare.block_tables.capacity() {
            self.spare = plan;
        }
    }

    /// Feeds the executor's output for `plan` back: appends each sampled token, checks stop
    /// conditions, and frees finished requests. Outputs come in plan order. Requests aborted
    /// since the plan was made are skipped.
    pub fn on_step_output(
        &mut self,
        plan: &StepPlan,
        output: &ModelOutput,
    ) -> Result<Vec<RequestOutput>, OutputError> {
        self.validate_output(plan, output)?;
        self.validate_routing(plan, output)?;
        self.offer_computed_blocks(plan);
        // Before the tokens: a request that finishes now takes its routing with it.
        self.absorb_routing(plan, output);
        let mut outs = Vec::with_capacity(output.sampled.len());
        let mut any_finished = false;
        for s in &output.sampled {
            let Some(out) = self.append_token(s) else {
                continue;
            };
            any_finished |= out.finished.is_some();
            outs.push(out);
        }
        if any_finished {
            let requests = &self.requests;
            self.running.retain(|r| requests[r.0 as usize].is_some());
        }
        Ok(outs)
    }

    fn validate_output(&self, plan: &StepPlan, output: &ModelOutput) -> Result<(), OutputError> {
        let latest = self.next_step.wrapping_sub(1);
        if plan.step != latest {
            return Err(OutputError::StalePlan {
                got: plan.step,
                latest,
            });
        }
        let mut expected = plan
            .reqs
            .iter()
            .filter(|r| r.sample.is_some())
            .map(|r| r.req);
        for s in &output.sampled {
            match expected.next() {
                Some(e) if e == s.req => {}
                Some(e) => {
                    return Err(OutputError::WrongRequest {
                        expected: e,
                        got: s.req,
                    })
                }
                None => return Err(OutputError::Unexpected { got: s.req }),
            }
        }
        match expected.next() {
            Some(missing) => Err(OutputError::Missing { missing }),
            None => Ok(()),
        }
    }

    /// Appends one sampled token to its request; finishes the request if a stop condition
    /// holds (its slot is freed, but `running` is cleaned up by the caller, once per step).
    fn append_token(&mut self, s: &SampledToken) -> Option<RequestOutput> {
        let eos = &self.config.eos_token_ids;
        let max_model_len = self.config.max_model_len;
        let req = self.requests.get_mut(s.req.0 as usize)?.as_mut()?;
        if req.state != RequestState::Running || req.n_computed != req.tokens.len() {
            return None;
        }
        req.tokens.push(s.token);
        self.kv.extend_hashes(req);
        let reason = stop_reason(req, s.token, eos, max_model_len);
        let mut out = RequestOutput {
            req: s.req,
            sampled: Some(s.clone()),
            n_output_tokens: req.n_output_tokens(),
            finished: None,
        };
        if let Some(reason) = reason {
            out.finished = Some(self.release_request(s.req, reason));
        }
        Some(out)
    }

    /// Frees a request's blocks and slot; it must already be out of every queue (or be
    /// removed by the caller). Every connector hears of the finish; the first that asks for
    /// an export gets the blocks as a leased hold, and the parameters go to the client.
    fn release_request(&mut self, idx: ReqIdx, reason: FinishReason) -> Box<Finished> {
        let mut req = self.requests[idx.0 as usize]
            .take()
            .expect("release_request on a live request");
        // KV that mixes weights (a request that ran across an update or an adapter reload
        // keeps its old chain) has no version a reader could check: it is never exported.
        let exportable = !matches!(reason, FinishReason::Abort | FinishReason::Error)
            && !req.blocks.is_empty()
            && req.chain_is_current(&self.hash_root);
        let mut transfer = None;
        let mut kv_transfer_params: Option<KvTransferParams> = None;
        if req.export_on_finish && exportable {
            // Ownership moves from the request to the transfer: no reference count changes.
            transfer = Some(self.holds.open(
                std::mem::take(&mut req.blocks),
                Holder::Caller,
                HoldKind::Caller,
                Lease::Unbounded,
            ));
        }
        // The connectors are told the id the export would get; it is opened under that id
        // if one asks for it, and left to the next hold otherwise.
        let export = self.holds.reserve();
        let hold = export.id();
        let lease = Lease::Until(self.now + self.config.export_lease);
        let version = self.control.weight_version.clone();
        let mut exporter = None;
        let mut clash = None;
        for (c, connector) in self.connectors.iter_mut().enumerate() {
            let finished = FinishedRequest {
                req: idx,
                request_id: &req.id,
                reason,
                blocks: if exportable && transfer.is_none() {
                    &req.blocks
                } else {
                    &[]
                },
                n_computed: req.n_computed,
                hold,
                weight_version: &version,
                lora: req.lora.as_ref(),
            };
            let Some(params) = connector.request_finished(finished) else {
                continue;
            };
            if exporter.is_none() && exportable && transfer.is_none() {
                exporter = Some(ConnectorId(c as u32));
            }
            match kv_transfer_params.as_mut() {
                None => kv_transfer_params = Some(params),
                Some(all) => {
                    if let Err(e) = all.merge(params) {
                        clash.get_or_insert(e);
                    }
                }
            }
        }
        if let Some(c) = exporter {
            let blocks = std::mem::take(&mut req.blocks);
            transfer = Some(export.open(blocks, Holder::Connector(c), HoldKind::Export, lease));
        }
        let mut reason = reason;
        let mut message = None;
        if let Some(e) = clash {
            // Two connectors disagree on what the client must be told: no parameters go out
            // (a reader could not use them), the request finishes with an error naming the
            // key, and the export, if one was made, is withdrawn at once.
            reason = FinishReason::Error;
            message = Some(e);
            kv_transfer_params = None;
            if let (Some(c), Some(id)) = (exporter, transfer) {
                self.connectors[c.0 as usize].hold_expired(id);
            }
        }
        self.kv.free(&mut req);
        self.ids.remove(&req.id);
        self.free_slots.push(idx.0);
        let routing = self.routing_shape.map(|shape| ExpertRouting {
            shape,
            ids: std::mem::take(&mut req.routing),
        });
        Box::new(Finished {
            request_id: req.id,
            reason,
            transfer,
            kv_transfer_params,
            message,
            routing,
        })
    }

    /// Finishes a request that is out of every queue with an error, between steps; its
    /// output waits for [`take_outputs`](Self::take_outputs).
    fn finish_between_steps(&mut self, r: ReqIdx, message: String) {
        let n_output_tokens = self.request(r).map_or(0, |q| q.n_output_tokens());
        let mut finished = self.release_request(r, FinishReason::Error);
        finished.message = Some(message);
        self.side_outputs.push(RequestOutput {
            req: r,
            sampled: None,
            n_output_tokens,
            finished: Some(finished),
        });
    }

    /// Outputs of requests that finished between steps (a failed KV load under the `fail`
    /// policy). The engine calls it after every `schedule` and every worker report.
    pub fn take_outputs(&mut self) -> Vec<RequestOutput> {
        std::mem::take(&mut self.side_outputs)
    }

    /// A load ended: the request continues (loaded), recomputes from the first bad block or
    /// fails (per `kv_load_failure_policy`), or is retracted (cut short by a reset: it holds
    /// no KV and recomputes, keeping its place).
    /// A load that landed is offered to the connectors that store blocks (not `loader`): the
    /// offload tier keeps a P/D import for later requests.
    pub(crate) fn on_load_result(&mut self, result: LoadResult, loader: ConnectorId) {
        let block_size = self.config.block_size;
        let Some(req) = self
            .requests
            .get_mut(result.req.0 as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        let RequestState::WaitingForRemoteKv { transfer, n_tokens } = req.state else {
            return;
        };
        if transfer != result.hold {
            return;
        }
        // A load that started under other weights lands stale KV: dropped, like a load a
        // reset retracted (never a failure of the request).
        let outcome = if self.stale_loads.remove(&result.hold) {
            LoadOutcome::Cancelled
        } else {
            result.outcome
        };
        // Who is to blame decides (`connectors.md`): the lifecycle's retraction recomputes
        // under either policy, invalid input fails closed under either, a fault follows the
        // policy.
        let outcome = match outcome {
            LoadOutcome::Failed { kind, .. }
                if retracted(kind, req.pause_mark, self.control.pause_mark()) =>
            {
                LoadOutcome::Cancelled
            }
            o => o,
        };
        let policy = match &outcome {
            LoadOutcome::Failed {
                kind: FetchFailure::Invalid,
                ..
            } => KvLoadFailurePolicy::Fail,
            _ => self.config.kv_load_failure_policy,
        };
        match outcome {
            LoadOutcome::Loaded => {
                let n_before = req.n_computed;
                req.n_computed += n_tokens;
                req.n_cached_tokens += n_tokens;
                req.state = RequestState::Waiting;
                let n_after = req.n_computed;
                self.offer_blocks(result.req, n_before, n_after, Some(loader));
            }
            LoadOutcome::Failed {
                good_blocks,
                reason,
                kind,
            } => match policy {
                KvLoadFailurePolicy::Recompute if good_blocks == 0 => {
                    // Nothing usable arrived, and the load may still be writing (a timeout
                    // reports before the worker let go): start over in fresh blocks.
                    self.kv.free(req);
                    req.n_computed = 0;
                    req.n_cached_tokens = 0;
                    req.state = RequestState::Waiting;
                }
                KvLoadFailurePolicy::Recompute => {
                    // A worker reports good blocks only once nothing writes them any more.
                    let n_good = (good_blocks * block_size).min(n_tokens);
                    req.n_computed += n_good;
                    req.n_cached_tokens += n_good;
                    req.state = RequestState::Waiting;
                }
                KvLoadFailurePolicy::Fail => {
                    self.remove_from_queues(result.req);
                    self.finish_between_steps(
                        result.req,
                        format!(
                            "loading the prompt's KV failed ({}): {reason}",
                            kind.as_str()
                        ),
                    );
                }
            },
            LoadOutcome::Cancelled => {
                self.kv.free(req);
                req.n_computed = 0;
                req.n_cached_tokens = 0;
                req.state = RequestState::Waiting;
            }
        }
    }

    /// After a failed forward (`StepDriver`): the KV the plan was to write never was. The
    /// blocks it was to write leave the prefix cache (the core caches full blocks when they
    /// are scheduled, so a later request with the same prefix would hit them), every running
    /// request is preempted (it recomputes), and a waiting request that took any of those
    /// blocks as a prefix hit in the failed step while it loads the rest of its prompt loses
    /// its KV when the load ends, as a retracted load does, and recomputes. (Found by the
    /// simulation: a step failing on D while a P/D request hit the blocks a local request was
    /// computing in it.)
    pub fn recover_failed_step(&mut self, plan: &StepPlan) {
        let mut unwritten = std::collections::BTreeSet::new();
        for r in &plan.reqs {
            let table = plan.block_table_of(r);
            let n = r.tokens.len();
            if n == 0 || table.is_empty() {
                continue;
            }
            let first = r.start_pos / plan.block_size;
            let last = ((r.start_pos + n - 1) / plan.block_size).min(table.len() - 1);
            if first <= last {
                self.kv.evict_blocks(&table[first..=last]);
                unwritten.extend(table[first..=last].iter().copied());
            }
        }
        self.preempt_all_running();
        for &r in &self.waiting {
            let Some(req) = self.requests[r.0 as usize].as_mut() else {
                continue;
            };
            if !req.blocks.iter().any(|b| unwritten.contains(b)) {
                continue;
            }
            match req.state {
                RequestState::WaitingForRemoteKv { transfer, .. } => {
                    self.stale_loads.insert(transfer);
                }
                _ => {
                    drop_waiting_kv(&mut self.kv, req);
                }
            }
        }
    }

    /// Waiting requests that hold KV (arrived loads, the good part of failed ones) lose it:
    /// part of a cache reset. They recompute in queue order.
    pub(crate) fn retract_waiting_kv(&mut self) {
        for &r in &self.waiting {
            if let Some(req) = self.requests[r.0 as usize].as_mut() {
                drop_waiting_kv(&mut self.kv, req);
            }
        }
    }

    /// KV that waiting requests `pick` chooses were handed but have not computed on (a landed
    /// load, the good part of a failed one) was made stale (the weights or their adapter
    /// changed): it is dropped, and they recompute in their places in the queue; a load of
    /// theirs still in flight lands stale KV, so its result is taken as a retraction
    /// (`on_load_result`).
    pub(crate) fn outdate_waiting_kv(&mut self, pick: impl Fn(&Request) -> bool) {
        let mut in_flight = Vec::new();
        for &r in &self.waiting {
            let Some(req) = self.requests[r.0 as usize].as_mut().filter(|q| pick(q)) else {
                continue;
            };
            match req.state {
                RequestState::WaitingForRemoteKv { transfer, .. } => in_flight.push(transfer),
                _ => {
                    drop_waiting_kv(&mut self.kv, req);
                }
            }
        }
        let holds = &self.holds;
        self.stale_loads.retain(|&t| holds.contains(t));
        self.stale_loads.extend(in_flight);
    }

    /// Preempts a request by recompute: frees its blocks (tail first), forgets its computed
    /// tokens (keeping the generated ones) and puts it at the head of the waiting queue.
    fn preempt(&mut self, r: ReqIdx) {
        let Some(req) = self.requests[r.0 as usize].as_mut() else {
            return;
        };
        self.kv.free(req);
        req.n_computed = 0;
        req.n_preemptions += 1;
        req.state = RequestState::Preempted {
            n_preemptions: req.n_preemptions,
        };
        self.waiting.push_front(r);
        self.n_preemptions += 1;
    }

    pub fn stats(&self) -> SchedulerStats {
        let pool = self.kv.pool();
        SchedulerStats {
            n_steps: self.next_step,
            n_running: self.running.len(),
            n_waiting: self.waiting.len(),
            n_blocks_used: pool.n_used(),
            n_blocks_free: pool.n_free(),
            n_blocks_cached: pool.n_cached(),
            n_transfers: self.holds.len(),
            prefix_hit_tokens: self.prefix_hit_tokens,
            prefix_query_tokens: self.prefix_query_tokens,
            n_preemptions: self.n_preemptions,
        }
    }

    /// Live requests, waiting and running.
    pub fn n_live(&self) -> usize {
        self.ids.len()
    }

    /// Accounts for every block: free, or held by named requests and transfers, agreeing with
    /// the pool's reference counts and free queue.
    pub fn check_ownership(&self) -> Result<(), OwnershipError> {
        ownership::check(self.kv.pool(), self.owners())
    }

    /// The block pool (read-only): its prefix-cache index, for checks.
    pub fn kv_pool(&self) -> &crate::block_pool::BlockPool {
        self.kv.pool()
    }

    /// Every block's status, for tests and debugging.
    pub fn block_ledger(&self) -> Result<Vec<ownership::BlockStatus>, OwnershipError> {
        ownership::ledger(self.kv.pool(), self.owners())
    }

    fn owners(&self) -> impl Iterator<Item = (Owner, &[BlockId])> {
        let reqs = self
            .requests
            .iter()
            .flatten()
            .map(|r| (Owner::Request(r.idx), &r.blocks[..]));
        let transfers = self.holds.iter().map(|(id, hold)| {
            let owner = Owner::Transfer {
                hold: id,
                holder: hold.holder,
                kind: hold.kind,
            };
            (owner, &hold.blocks[..])
        });
        reqs.chain(transfers)
    }

    /// Checks that every live request is in exactly the queue its state says, once.
    pub fn check_queues(&self) -> Result<(), QueueError> {
        let mut n_waiting = vec![0usize; self.requests.len()];
        let mut n_running = vec![0usize; self.requests.len()];
        for (queue, list, counts) in [
            (
                "waiting",
                self.waiting.iter().collect::<Vec<_>>(),
                &mut n_waiting,
            ),
            ("running", self.running.iter().collect(), &mut n_running),
        ] {
            for &r in list {
                if self.request(r).is_none() {
                    return Err(QueueError::Dangling { queue, req: r });
                }
                counts[r.0 as usize] += 1;
            }
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err(QueueError::TooManyRunning {
                n_running: self.running.len(),
                max: self.config.max_num_seqs,
            });
        }
        for req in self.requests.iter().flatten() {
            let i = req.idx.0 as usize;
            let (queue, n_listed, want) = match req.state {
                RequestState::Running => ("running", n_running[i], n_waiting[i] == 0),
                RequestState::Waiting
                | RequestState::Preempted { .. }
                | RequestState::WaitingForRemoteKv { .. } => {
                    ("waiting", n_waiting[i], n_running[i] == 0)
                }
                _ => ("none", n_waiting[i] + n_running[i], true),
            };
            let expected = usize::from(queue != "none");
            if n_listed != expected || !want {
                return Err(QueueError::Misplaced {
                    id: req.id.clone(),
                    state: req.state.clone(),
                    queue,
                    n_listed,
                });
            }
        }
        Ok(())
    }
}

/// The reason `req` stops after `token` was appended, if it does.
fn stop_reason(
    req: &Request,
    token: TokenId,
    eos: &[TokenId],
    max_model_len: usize,
) -> Option<FinishReason> {
    // Below `min_tokens` a stop token does not stop (the sampler holds them back; this
    // covers a constraint that forces one).
    let may_stop = req.n_output_tokens() >= req.params.logits.min_tokens as usize;
    if may_stop
        && ((!req.params.ignore_eos && eos.contains(&token))
            || req.params.stop_token_ids.contains(&token))
    {
        Some(FinishReason::Stop)
    } else if req.n_output_tokens() >= req.params.max_tokens as usize
        || req.tokens.len() >= max_model_len
    {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// The logits processing of `req`'s next sample (see [`crate::LogitsParams`]), or `None` when it
/// has none. Built from the request's tokens each time it samples: the cost is linear in its
/// length, paid only by requests with penalties (bias and `min_tokens` alone cost their own
/// few entries).
fn logits_adjust(req: &Request, eos: &[TokenId]) -> Option<LogitsAdjust> {
    let p = &req.params.logits;
    let n_output = req.n_output_tokens();
    let hold_stops = n_output < p.min_tokens as usize;
    if !p.has_penalties() && p.logit_bias.is_empty() && !hold_stops {
        return None;
    }
    let mut tokens: Vec<AdjustedToken> = Vec::new();
    let entry = |token| AdjustedToken {
        token,
        bias: 0.0,
        output_count: 0,
        seen: false,
    };
    if p.has_penalties() {
        let mut prompt: Vec<TokenId> = req.tokens[..req.prompt_len].to_vec();
        prompt.sort_unstable();
        prompt.dedup();
        let mut output: Vec<TokenId> = req.tokens[req.prompt_len..].to_vec();
        output.sort_unstable();
        tokens.extend(prompt.into_iter().map(|t| AdjustedToken {
            seen: true,
            ..entry(t)
        }));
        for chunk in output.chunk_by(|a, b| a == b) {
            tokens.push(AdjustedToken {
                output_count: chunk.len() as u32,
                seen: true,
                ..entry(chunk[0])
            });
        }
    }
    let mut extra: Vec<(TokenId, f32)> = p.logit_bias.clone();
    if hold_stops {
        let stops = req.params.stop_token_ids.iter();
        let eos = eos.iter().filter(|_| !req.params.ignore_eos);
        extra.extend(stops.chain(eos).map(|&t| (t, f32::NEG_INFINITY)));
    }
    tokens.extend(
        extra
            .into_iter()
            .map(|(t, bias)| AdjustedToken { bias, ..entry(t) }),
    );
    // One entry per token: counts add up, `seen` and the biases combine.
    tokens.sort_by_key(|e| e.token);
    let mut merged: Vec<AdjustedToken> = Vec::with_capacity(tokens.len());
    for e in tokens {
        match merged.last_mut() {
            Some(m) if m.token == e.token => {
                m.bias += e.bias;
                m.output_count += e.output_count;
                m.seen |= e.seen;
            }
            _ => merged.push(e),
        }
    }
    Some(LogitsAdjust {
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        tokens: merged,
    })
}

/// Whether a load that failed with `kind` was retracted by the lifecycle (the request
/// computes its prompt, under either policy): P revoked the export, or its lease ran out while
/// the request waited behind a pause or reset here (it arrived paused, or a pause began since
/// it arrived: its `pause_mark` against today's).
fn retracted(kind: FetchFailure, pause_mark: u64, mark_now: u64) -> bool {
    match kind {
        FetchFailure::Revoked => true,
        FetchFailure::Expired => pause_mark % 2 == 1 || pause_mark != mark_now,
        FetchFailure::Fault | FetchFailure::Invalid => false,
    }
}

/// Frees the KV a waiting request holds (a landed load, the good part of a failed one; not
/// blocks a load may still write): it recomputes. True if there was any.
fn drop_waiting_kv(kv: &mut KvCacheManager, req: &mut Request) -> bool {
    if req.blocks.is_empty() || matches!(req.state, RequestState::WaitingForRemoteKv { .. }) {
        return false;
    }
    kv.free(req);
    req.n_computed = 0;
    req.n_cached_tokens = 0;
    true
}
