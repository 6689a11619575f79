//! The world of one run: two engines (P and D), the network, the clients and the proxy, the
//! admin caller and the faults, advanced one millisecond tick at a time, with the lifecycle
//! contract checked as it goes.
//!
//! A tick: the schedule's actions for it; requests leaving the proxy for D; pulls that fall
//! due; the offload copiers' progress (drawn); worker reports into the engines' input
//! queues; one turn of each live engine's loop, in a drawn order; then the checks. After the
//! schedule, the run *quiesces*: faults heal, crashed engines are back, the trainer's cycles
//! stop, the operator wakes and resumes both engines, and time runs (jumping to the next
//! deadline when nothing else happens) until nothing is left to do; then every block must be
//! free.
//!
//! Checked: on every engine after every input and every schedule and output, block ownership
//! and the queues (the checked step driver); every sampled token against the reference (the
//! oracle, `engine.rs`); every engine request finishes exactly once, every client request
//! ends exactly once, none is aborted without an abort asked for, and one that finished by
//! length has all its tokens; none fails but by a fault the simulation injected on its own
//! load, under the `fail` policy (a link down, a broken or lost pull, a pull slowed past D's
//! load bound, a crashed P; or an export whose lease ran out while D ran normally): never
//! under `recompute`, never for the lifecycle, never as invalid input (the simulation forges
//! no parameters; `check_error`); every lifecycle call gets exactly one reply, at once where
//! the contract says at once (keep and abort pauses without `clear_cache`, and every call
//! that is not deferred), and a deferred one within its bound, and a reset never times out
//! unless a transfer truly had not handed its blocks back (a slow pull already copying when
//! its cancel came, until the deadline at least); a pull or an offload copy
//! touches blocks only while its hold still owns them; after quiescing, every block of every
//! engine is free, no transfer or copy is left, and nothing is published on the network.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::{
    BlockStatus, FinishReason, KvLoadFailurePolicy, OffloadPolicy, PauseMode, RequestState,
    WeightResidency,
};

use crate::client::{Client, End, Stage};
use crate::engine::{EngineSetup, Event, Input, SimEngine};
use crate::messages::Mailbox;
use crate::net::{SimNet, Touch};
use crate::rng::Rng;
use crate::schedule::{Action, Fault, OpKind, Route, Side, Target, Timed, LORA_NAMES};
use ferry_engine::Constraint;

/// Whether a run has the offload tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Drawn from the seed.
    Drawn,
    On,
    Off,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub seed: u64,
    pub tier: Tier,
    /// Keep a readable trace of everything that happened.
    pub trace: bool,
    /// Corrupt every pulled block (a check that the oracle catches bad KV).
    pub corrupt_pulls: bool,
    /// Load every version of an adapter with its first version's weights (a check that the
    /// oracle catches a token computed under the wrong adapter).
    pub stale_lora_weights: bool,
    /// Ticks the quiescing may take before the run counts as stuck.
    pub max_quiesce_ticks: u32,
}

impl SimConfig {
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            tier: Tier::Drawn,
            trace: false,
            corrupt_pulls: false,
            stale_lora_weights: false,
            max_quiesce_ticks: 20_000,
        }
    }
}

/// A broken rule, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub at_ms: u64,
    pub message: String,
}

impl Failure {
    /// The kind of failure, for shrinking to the same bug: the message up to its first
    /// detail.
    pub fn kind(&self) -> &str {
        self.message
            .split([':', '('])
            .next()
            .unwrap_or(&self.message)
    }
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub n_requests: u64,
    pub n_finished: u64,
    pub n_aborted: u64,
    /// Ended with an error answer: the engine was down or died.
    pub n_failed: u64,
    /// Failed by a fault the run injected on the request's load (`fail` only).
    pub n_load_faults: u64,
    /// Runs with D under `fail` (0 or 1 for one run).
    pub n_runs_under_fail: u64,
    pub n_disconnected: u64,
    pub n_ops: u64,
    pub n_ops_failed: u64,
    pub n_pulls_ok: u64,
    pub n_pulls_failed: u64,
    pub n_copies: u64,
    pub n_crashes: u64,
    pub n_tokens_checked: u64,
    pub n_tokens_mixed: u64,
    /// Tokens checked that a structured-output mask constrained.
    pub n_tokens_masked: u64,
    /// Tokens checked of requests under a LoRA adapter.
    pub n_tokens_lora: u64,
    /// Requests refused for naming an adapter not loaded on the engine they reached.
    pub n_lora_refused: u64,
    /// Forwards that failed (a fault) and the engine recovered from.
    pub n_step_failures: u64,
    /// KV events checked (batches applied to a subscriber's view), and the tier's among them.
    pub n_kv_batches: u64,
    pub n_tier_kv_events: u64,
    pub n_steps: u64,
    /// The lifecycle calls the engines were made, by kind.
    pub calls: std::collections::BTreeMap<ferry_engine::CallKind, u64>,
    pub tier: bool,
    pub end_ms: u64,
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub seed: u64,
    pub failure: Option<Failure>,
    pub stats: Stats,
    pub trace: Vec<String>,
}

/// A lifecycle call and its reply.
#[derive(Debug, Clone)]
struct OpRecord {
    side: Side,
    kind: OpKind,
    issued: Duration,
    /// Time jumped over (faults) before the call: the engine could not act in it.
    jumped_at_issue: Duration,
    reply: Option<(Duration, Result<(), String>)>,
}

impl OpRecord {
    /// Must this call reply in the same turn of the engine loop that handled it?
    fn at_once(&self) -> bool {
        match self.kind {
            OpKind::Pause { mode, clear_cache } => {
                !clear_cache && matches!(mode, PauseMode::Keep | PauseMode::Abort)
            }
            OpKind::Sleep { .. } | OpKind::ReleaseKv | OpKind::Reload { .. } => false,
            _ => true,
        }
    }
}

/// A caller's calls made one after another, each once the last one replied on every
/// engine it went to (a trainer's cycle, the operator's wake-up).
#[derive(Debug)]
struct Script {
    /// Each call, with the weight version it sets (`None`: a new one where it sets one).
    steps: VecDeque<(Target, OpKind, Option<String>)>,
    waiting: Vec<u64>,
}

/// The world (see the module docs).
pub struct Sim {
    config: SimConfig,
    rng: Rng,
    now: Duration,
    setup: EngineSetup,
    net: SimNet,
    mailbox: Mailbox,
    engines: [Option<SimEngine>; 2],
    /// The structured-output constraint constrained requests run under (compiled once).
    constraint: Constraint,
    incarnations: [u32; 2],
    restart_at: [Option<Duration>; 2],
    clients: Vec<Client>,
    ops: Vec<OpRecord>,
    scripts: Vec<Script>,
    /// Per engine, abort causes so far.
    abort_causes: [u64; 2],
    /// Per engine, pause and sleep calls so far.
    pauses: [u64; 2],
    /// Per engine, when a pull into it last ended.
    last_pull_end: [Option<Duration>; 2],
    /// The newest weight version set anywhere.
    n_versions: u64,
    trace: Vec<String>,
    stats: Stats,
    /// The bound of a deferred lifecycle call.
    op_bound: Duration,
    /// A time jump to make at the end of this tick.
    jump: Duration,
    /// Time jumped over so far.
    jumped: Duration,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("seed", &self.config.seed)
            .field("now", &self.now)
            .finish_non_exhaustive()
    }
}

type Check = Result<(), String>;

impl Sim {
    pub fn new(config: SimConfig) -> Self {
        let mut rng = Rng::new(config.seed, 3);
        let block_size = [2, 4, 4, 8][rng.below(4) as usize];
        // At least one longest sequence (64 tokens) must fit, with room to spare or not.
        let min_blocks = 64 / block_size as u64 + 2;
        let n_blocks = rng.range(min_blocks, min_blocks + 12) as u32;
        let policy = if rng.bool() {
            KvLoadFailurePolicy::Recompute
        } else {
            KvLoadFailurePolicy::Fail
        };
        let tier = match config.tier {
            Tier::Drawn => rng.chance(1, 2),
            Tier::On => true,
            Tier::Off => false,
        };
        let mut sched = EngineSetup::scheduler_config(block_size, n_blocks, policy);
        // A step computes at most this many adapters (LoRA seats), or any number.
        sched.max_loras = rng.weighted(&[(2, None), (1, Some(1)), (1, Some(2))]);
        let setup = EngineSetup {
            sched,
            tier_blocks: tier.then(|| rng.range(8, 40) as usize),
            tier_blocks_per_slot: rng.range(1, 2) as usize,
            tier_policy: if rng.bool() {
                OffloadPolicy::Lru
            } else {
                OffloadPolicy::Arc
            },
            tier_first: rng.bool(),
            stale_lora_weights: config.stale_lora_weights,
            max_cpu_loras: rng.weighted(&[(1, None), (1, Some(2))]),
        };
        let s = &setup.sched;
        // A clearing call waits for transfers (bounded by the wait timeout) after the drain;
        // a drain waits for loads (their bound) and for blocks that exports hold (their
        // lease); and a little for the steps themselves.
        let op_bound = s.lifecycle_wait_timeout
            + s.kv_load_timeout
            + s.export_lease
            + Duration::from_millis(500);
        let net = SimNet::new(config.seed);
        if config.corrupt_pulls {
            net.corrupt_pulls();
        }
        let mut sim = Self {
            rng,
            now: Duration::ZERO,
            net,
            mailbox: Arc::new(Mutex::new(Vec::new())),
            constraint: crate::setup::constraint(),
            engines: [None, None],
            incarnations: [0, 0],
            restart_at: [None, None],
            clients: Vec::new(),
            ops: Vec::new(),
            scripts: Vec::new(),
            abort_causes: [0, 0],
            pauses: [0, 0],
            last_pull_end: [None, None],
            n_versions: 0,
            trace: Vec::new(),
            stats: Stats {
                tier,
                n_runs_under_fail: u64::from(policy == KvLoadFailurePolicy::Fail),
                ..Stats::default()
            },
            op_bound,
            jump: Duration::ZERO,
            jumped: Duration::ZERO,
            setup,
            config,
        };
        let tier_line = match sim.setup.tier_blocks {
            Some(n) => format!(
                "{n} blocks, {} per slot, {:?}, {}",
                sim.setup.tier_blocks_per_slot,
                sim.setup.tier_policy,
                if sim.setup.tier_first {
                    "before P/D"
                } else {
                    "after P/D"
                }
            ),
            None => "off".into(),
        };
        sim.note(|| {
            format!(
                "setup: block_size {block_size}, {n_blocks} blocks, kv_load_failure_policy {policy:?}, offload tier {tier_line}"
            )
        });
        sim.start(Side::P);
        sim.start(Side::D);
        sim
    }

    fn note(&mut self, line: impl FnOnce() -> String) {
        if self.config.trace {
            let line = line();
            self.trace
                .push(format!("{:>6}ms {line}", self.now.as_millis()));
        }
    }

    fn start(&mut self, side: Side) {
        let i = side.idx();
        self.incarnations[i] += 1;
        let mut secret = [0u8; 32];
        for chunk in secret.chunks_mut(8) {
            chunk.copy_from_slice(&self.rng.below(u64::MAX).to_le_bytes());
        }
        let inc = self.incarnations[i];
        let built = self
            .setup
            .build(side, inc, &self.net, &self.mailbox, secret);
        self.engines[i] = Some(SimEngine::start(side, inc, self.now, built));
        self.note(|| {
            format!(
                "{}: engine starts (incarnation {inc}, weights w0, adapter {} loaded at start)",
                side.name(),
                LORA_NAMES[0]
            )
        });
        // The operator's `--lora-modules`: the first adapter is loaded as the engine starts.
        self.issue(
            side,
            OpKind::LoadLora {
                name: 0,
                inplace: false,
            },
            String::new(),
        );
    }

    /// Runs `schedule` (see the module docs).
    pub fn run(mut self, schedule: &[Timed]) -> Outcome {
        let result = self.run_inner(schedule);
        let failure = result.err().map(|message| Failure {
            at_ms: self.now.as_millis() as u64,
            message,
        });
        if let Some(f) = &failure {
            let message = f.message.clone();
            self.note(|| format!("FAILED: {message}"));
        }
        for e in std::mem::take(&mut self.engines).iter().flatten() {
            self.count(e);
        }
        let (ok, failed) = self.net.counts();
        self.stats.n_pulls_ok = ok;
        self.stats.n_pulls_failed = failed;
        self.stats.end_ms = self.now.as_millis() as u64;
        Outcome {
            seed: self.config.seed,
            failure,
            stats: self.stats,
            trace: self.trace,
        }
    }

    fn run_inner(&mut self, schedule: &[Timed]) -> Check {
        let mut next = 0;
        let end = schedule.last().map_or(0, |t| t.tick) + 1;
        for tick in 0..end {
            while next < schedule.len() && schedule[next].tick <= tick {
                let action = schedule[next].action;
                self.note(|| format!("{action}"));
                self.act(action)?;
                next += 1;
            }
            self.tick()?;
        }
        self.quiesce()
    }

    /// One millisecond of the world after the actions of this moment.
    fn tick(&mut self) -> Check {
        for side in [Side::P, Side::D] {
            if self.restart_at[side.idx()].is_some_and(|t| t <= self.now) {
                self.restart_at[side.idx()] = None;
                self.start(side);
            }
        }
        self.net.set_now(self.now);
        self.leave_proxy();
        self.run_scripts();
        for ev in self.net.fire_due() {
            // A block a transfer writes must be the transfer's until it ends (the contract's
            // "a block still being written into by a transfer is never reused").
            let side = if ev.to == Side::P.name() {
                Side::P
            } else {
                Side::D
            };
            self.last_pull_end[side.idx()] = Some(self.now);
            let held = self.engines[side.idx()]
                .as_ref()
                .is_none_or(|e| e.core().transfer_ids().any(|t| t == ev.hold));
            if ev.n_written > 0 && !held {
                return Err(format!(
                    "{}: a pull wrote {} blocks for hold {} after the hold had ended (its blocks may belong to another request now)",
                    ev.to, ev.n_written, ev.hold.0
                ));
            }
            self.note(|| {
                format!(
                    "net: pull of hold {} {}→{}: {}",
                    ev.hold.0,
                    ev.from,
                    ev.to,
                    match &ev.outcome {
                        Ok(n) => format!("{n} blocks"),
                        Err(e) => format!("failed ({e})"),
                    }
                )
            });
        }
        self.run_copiers()?;
        self.deliver_mail();
        let order = if self.rng.bool() {
            [Side::P, Side::D]
        } else {
            [Side::D, Side::P]
        };
        for side in order {
            self.tick_engine(side)?;
        }
        self.check_ops()?;
        self.now += Duration::from_millis(1);
        // Time jumps only while nothing but timers is left: an engine loop with work to do
        // (a step, a reset's next turn) never sleeps, and pulls, copies and proxy hops go
        // on while time passes, so none may be skipped.
        if !self.jump.is_zero() && self.only_timers_left() && self.net.n_outstanding().1 == 0 {
            self.jumped += self.jump;
            self.now += std::mem::take(&mut self.jump);
        }
        Ok(())
    }

    fn engine(&mut self, side: Side) -> Option<&mut SimEngine> {
        self.engines[side.idx()].as_mut()
    }

    fn tick_engine(&mut self, side: Side) -> Check {
        let now = self.now;
        let Some(engine) = self.engine(side) else {
            return Ok(());
        };
        let mut events = Vec::new();
        let result = engine.tick(now, &mut events);
        let stepped = matches!(result, Ok(true));
        let inc = engine.incarnation;
        for ev in events {
            self.on_event(side, inc, ev)?;
        }
        result.map_err(|e| format!("{}: {e}", side.name()))?;
        if side == Side::D {
            self.note_loads();
        }
        if stepped && self.config.trace {
            let e = self.engines[side.idx()].as_ref().expect("ticked");
            let st = e.core().stats();
            self.note(|| {
                format!(
                    "{}: step {} ({} running, {} waiting, {} blocks used, {} transfers)",
                    side.name(),
                    st.n_steps,
                    st.n_running,
                    st.n_waiting,
                    st.n_blocks_used,
                    st.n_transfers
                )
            });
        }
        Ok(())
    }

    /// Remembers the hold each request on D loads its prompt through. A load lasts at least
    /// until the next tick (a pull falls due a millisecond later at the earliest, a tier copy
    /// runs between ticks), so looking after every turn of D's loop sees every hold.
    fn note_loads(&mut self) {
        let Some(d) = self.engines[Side::D.idx()].as_ref() else {
            return;
        };
        let inc = d.incarnation;
        let core = d.core();
        let mut seen = Vec::new();
        for id in &d.live {
            let Some(r) = core.request_idx(id).and_then(|idx| core.request(idx)) else {
                continue;
            };
            if let RequestState::WaitingForRemoteKv { transfer, .. } = r.state {
                seen.push((id.clone(), transfer));
            }
        }
        for (id, hold) in seen {
            let Ok(i) = self.client_idx(&id) else {
                continue;
            };
            let c = &mut self.clients[i];
            if c.engine() == Some((Side::D, inc)) && c.d_holds.last() != Some(&hold) {
                c.d_holds.push(hold);
            }
        }
    }

    /// Offload copiers make progress at drawn moments, oldest job first.
    fn run_copiers(&mut self) -> Check {
        for side in [Side::P, Side::D] {
            let draw = self.rng.below(4);
            let Some(copier) = self.engines[side.idx()]
                .as_ref()
                .and_then(|e| e.copier.clone())
            else {
                continue;
            };
            // Each job's blocks must still be its hold's when the copy runs.
            let holds = copier.lock().next_holds(draw as usize);
            let core = self.engines[side.idx()]
                .as_ref()
                .expect("has a copier")
                .core();
            if let Some(h) = holds
                .iter()
                .find(|&&h| !core.transfer_ids().any(|t| t == h))
            {
                return Err(format!(
                    "{}: the offload copier ran a job of hold {} after the hold had ended",
                    side.name(),
                    h.0
                ));
            }
            let ran = copier.lock().run(draw as usize);
            self.stats.n_copies += ran as u64;
            if ran > 0 {
                self.note(|| format!("{}: copier finished {ran} jobs", side.name()));
            }
        }
        Ok(())
    }

    /// Worker reports to their engines' input queues (those of dead engines are lost).
    fn deliver_mail(&mut self) {
        let mail =
            std::mem::take(&mut *self.mailbox.lock().unwrap_or_else(PoisonError::into_inner));
        for m in mail {
            let alive = self.engines[m.side.idx()]
                .as_ref()
                .is_some_and(|e| e.incarnation == m.incarnation);
            if alive {
                let e = self.engine(m.side).expect("alive");
                e.push(Input::Report(m.connector, m.report));
            }
        }
    }

    fn act(&mut self, action: Action) -> Check {
        match action {
            Action::Arrive {
                route,
                prefix,
                extra,
                max_tokens,
                constrained,
                lora,
            } => self.arrive(route, prefix, extra, max_tokens, (constrained, lora)),
            Action::Disconnect { pick } => self.disconnect(pick),
            Action::Op { target, op } => {
                let version = self.new_version(op);
                for &side in target.engines() {
                    self.issue(side, op, version.clone());
                }
            }
            Action::RlCycle { mode, update } => {
                let pause = OpKind::Pause {
                    mode,
                    clear_cache: true,
                };
                let calls = std::iter::once(pause)
                    .chain(update.calls())
                    .chain([OpKind::Resume]);
                self.scripts.push(Script {
                    steps: calls.map(|op| (Target::Both, op, None)).collect(),
                    waiting: Vec::new(),
                });
            }
            Action::Fault(fault) => self.fault(fault),
        }
        Ok(())
    }

    fn new_version(&mut self, op: OpKind) -> String {
        if op.sets_version() {
            self.n_versions += 1;
        }
        format!("w{}", self.n_versions)
    }

    fn arrive(
        &mut self,
        route: Route,
        prefix: u8,
        extra: u8,
        max_tokens: u8,
        (constrained, lora): (bool, Option<u8>),
    ) {
        let n = self.clients.len();
        self.stats.n_requests += 1;
        let mut client = Client {
            id: format!("c{n}"),
            route,
            prompt: Client::prompt(n, prefix, extra),
            max_tokens: u32::from(max_tokens),
            constrained,
            lora: lora.map(|i| LORA_NAMES[usize::from(i)]),
            stage: Stage::Ended,
            tokens: Vec::new(),
            end: None,
            abort_causes_at_add: [0; 2],
            d_holds: Vec::new(),
            d_pauses_at_add: 0,
            d_paused_at_add: false,
        };
        let (side, max) = match route {
            Route::Disaggregated => (Side::P, 1),
            Route::Direct(side) => (side, client.max_tokens),
        };
        let kv = (route == Route::Disaggregated).then_some(ferry_core::TransferRequest::Export);
        self.clients.push(client.clone());
        match self.engines[side.idx()].as_mut() {
            Some(e) => {
                let constraint = client.constrained.then(|| self.constraint.clone());
                e.push(Input::add(
                    &client.id,
                    &client.prompt,
                    max,
                    kv,
                    constraint,
                    client.lora,
                ));
                client.stage = Stage::On {
                    side,
                    incarnation: e.incarnation,
                };
                client.abort_causes_at_add[side.idx()] = self.abort_causes[side.idx()];
                if side == Side::D {
                    client.d_pauses_at_add = self.pauses[side.idx()];
                    client.d_paused_at_add = paused(e);
                }
                self.clients[n] = client;
            }
            None => {
                self.end(n, End::Failed(format!("{} is down", side.name())));
            }
        }
    }

    fn live_clients(&self) -> Vec<usize> {
        (0..self.clients.len())
            .filter(|&i| self.clients[i].is_live())
            .collect()
    }

    fn disconnect(&mut self, pick: u16) {
        let live = self.live_clients();
        if live.is_empty() {
            return;
        }
        let i = live[usize::from(pick) % live.len()];
        let id = self.clients[i].id.clone();
        self.note(|| format!("client {id} goes away"));
        if let Some((side, inc)) = self.clients[i].engine() {
            if let Some(e) = self.engine(side).filter(|e| e.incarnation == inc) {
                e.push(Input::Abort(id));
            }
        }
        self.clients[i].stage = Stage::Ended;
        self.stats.n_disconnected += 1;
        self.clients[i].end = Some(End::Disconnected);
    }

    /// Ends client `i` (once).
    fn end(&mut self, i: usize, end: End) {
        let c = &mut self.clients[i];
        c.stage = Stage::Ended;
        if c.end.is_some() {
            return;
        }
        match &end {
            End::Finished(FinishReason::Abort) => self.stats.n_aborted += 1,
            End::Finished(FinishReason::Error) => self.stats.n_load_faults += 1,
            End::Finished(_) => self.stats.n_finished += 1,
            End::Failed(_) => self.stats.n_failed += 1,
            End::Disconnected => self.stats.n_disconnected += 1,
        }
        let id = c.id.clone();
        self.note(|| format!("client {id} ends: {end:?}"));
        self.clients[i].end = Some(end);
    }

    fn client_idx(&self, id: &str) -> Result<usize, String> {
        id.strip_prefix('c')
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n < self.clients.len())
            .ok_or_else(|| format!("an output for an unknown request {id}"))
    }

    /// Requests whose proxy hop is over go to D.
    fn leave_proxy(&mut self) {
        for i in 0..self.clients.len() {
            let Stage::Proxy { due, kv } = &self.clients[i].stage else {
                continue;
            };
            if *due > self.now {
                continue;
            }
            let kv = kv.clone();
            let Some(d) = self.engines[Side::D.idx()].as_mut() else {
                self.end(i, End::Failed("D is down".into()));
                continue;
            };
            let c = &self.clients[i];
            let constraint = c.constrained.then(|| self.constraint.clone());
            d.push(Input::add(
                &c.id,
                &c.prompt,
                c.max_tokens,
                kv,
                constraint,
                c.lora,
            ));
            let inc = d.incarnation;
            let d_paused = paused(d);
            let causes = self.abort_causes[Side::D.idx()];
            let pauses = self.pauses[Side::D.idx()];
            let c = &mut self.clients[i];
            c.stage = Stage::On {
                side: Side::D,
                incarnation: inc,
            };
            c.abort_causes_at_add[Side::D.idx()] = causes;
            c.d_pauses_at_add = pauses;
            c.d_paused_at_add = d_paused;
        }
    }

    fn on_event(&mut self, side: Side, inc: u32, ev: Event) -> Check {
        match ev {
            Event::Token { id, token, .. } => {
                let i = self.client_idx(&id)?;
                let c = &mut self.clients[i];
                if c.is_live() && c.answers_from(side) {
                    c.tokens.push(token);
                }
            }
            Event::Finished {
                id,
                reason,
                kv,
                message,
            } => {
                let i = self.client_idx(&id)?;
                let note = format!(
                    "{}: {id} finished: {}{}",
                    side.name(),
                    reason.as_str(),
                    message
                        .as_deref()
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default()
                );
                self.note(|| note);
                let c = &self.clients[i];
                if c.engine() != Some((side, inc)) || !c.is_live() {
                    // The client left (or the proxy moved on); the engine still had to end it.
                    return Ok(());
                }
                if reason == FinishReason::Abort
                    && self.abort_causes[side.idx()] == c.abort_causes_at_add[side.idx()]
                {
                    return Err(format!(
                        "{id} was aborted on {} though nothing asked for an abort",
                        side.name()
                    ));
                }
                if c.answers_from(side)
                    || matches!(reason, FinishReason::Abort | FinishReason::Error)
                {
                    // An abort on P is the client's answer (the proxy never undoes it on D),
                    // and so is an error (the proxy answers with it).
                    self.client_done(i, side, reason, message)?;
                } else {
                    // P's prefill is over: the proxy takes P's parameters to D (none, e.g.
                    // for KV that mixed weights: D computes the prompt itself), and D's edge
                    // parses them, as the server's does.
                    let kv = kv
                        .as_ref()
                        .map(ferry_core::TransferRequest::parse)
                        .transpose()
                        .map_err(|e| {
                            format!("{id}: P returned kv_transfer_params D cannot parse: {e}")
                        })?
                        .flatten();
                    let due = self.now + Duration::from_millis(self.rng.range(0, 5));
                    self.clients[i].stage = Stage::Proxy { due, kv };
                }
            }
            Event::Refused {
                id,
                message,
                unknown_lora,
            } => {
                let i = self.client_idx(&id)?;
                let c = &self.clients[i];
                if unknown_lora && c.lora.is_some() {
                    // The adapter it names is not loaded there (never, or not any more): the
                    // server's 404, the client's answer (unless it left first).
                    self.stats.n_lora_refused += 1;
                    if c.is_live() && c.engine() == Some((side, inc)) {
                        self.end(i, End::Failed(message));
                    }
                    return Ok(());
                }
                return Err(format!(
                    "{}: {} refused a well-formed request: {message}",
                    side.name(),
                    self.clients[i].id
                ));
            }
            Event::Reply { op, result } => {
                let rec = &mut self.ops[op as usize];
                if rec.reply.is_some() {
                    return Err(format!("{} {}: a second reply", rec.side.name(), rec.kind));
                }
                if result.is_err() {
                    self.stats.n_ops_failed += 1;
                }
                if let Err(e) = &result {
                    // In the simulation every transfer hands its blocks back soon after it is
                    // released (exports are unpublished at once, copies drawn every tick,
                    // pulls cancelled within a millisecond), except a slow pull that was
                    // already copying when its cancel came. A reset that times out with no
                    // such pull waited for something that was never released. (One that ended
                    // in this very tick was still copying at the deadline: the reset still
                    // needed a turn after it.)
                    let slow_pull = self.net.n_fetches_of(rec.side.name()) > 0
                        || self.last_pull_end[rec.side.idx()] == Some(self.now);
                    if e.contains("timed out") && !slow_pull {
                        return Err(format!("{} {}: {e}", rec.side.name(), rec.kind));
                    }
                }
                rec.reply = Some((self.now, result.clone()));
                if rec.at_once() && rec.issued != self.now {
                    return Err(format!(
                        "{} {}: replied after {:?}, not at once",
                        rec.side.name(),
                        rec.kind,
                        self.now - rec.issued
                    ));
                }
                let (kind, side) = (rec.kind, rec.side);
                self.note(|| format!("{}: {kind} → {result:?}", side.name()));
            }
        }
        Ok(())
    }

    fn client_done(
        &mut self,
        i: usize,
        side: Side,
        reason: FinishReason,
        message: Option<String>,
    ) -> Check {
        let c = &self.clients[i];
        match reason {
            FinishReason::Length if c.tokens.len() != c.max_tokens as usize => {
                return Err(format!(
                    "{} finished by length with {} of {} tokens",
                    c.id,
                    c.tokens.len(),
                    c.max_tokens
                ));
            }
            FinishReason::Error => {
                let message = message.unwrap_or_default();
                self.check_error(i, side, &message).map_err(|why| {
                    format!("{} failed on {}, {why}: {message}", c.id, side.name())
                })?;
            }
            _ => {}
        }
        self.end(i, End::Finished(reason));
        Ok(())
    }

    /// Whether client `i`'s request may fail on `side` with `message` (`connectors.md`, "Who
    /// is to blame"): only by a fault the simulation injected on its load, under `fail`.
    /// `Err` says why not.
    fn check_error(&self, i: usize, side: Side, message: &str) -> Result<(), &'static str> {
        if self.setup.sched.kv_load_failure_policy == KvLoadFailurePolicy::Recompute {
            return Err("under the recompute policy");
        }
        if message.contains("(invalid)") || message.contains("kv_transfer_params") {
            return Err("closed on parameters the simulation never forged");
        }
        let c = &self.clients[i];
        let touches: Vec<Touch> = if side == Side::D {
            c.d_holds
                .iter()
                .flat_map(|&h| self.net.touches(side.name(), h))
                .collect()
        } else {
            Vec::new()
        };
        if message.contains("(fault)") {
            let bound = self.setup.sched.kv_load_timeout;
            // A drawn slow pull is short (at most 200 ms) or long (600 ms and more).
            let injected = touches.iter().any(|t| match *t {
                Touch::Slow(latency) => latency + Duration::from_millis(5) >= bound,
                Touch::LeaseRanOut => false,
                _ => true,
            });
            return if injected {
                Ok(())
            } else {
                Err("as a fault though no fault the simulation injected touched its load")
            };
        }
        if message.contains("(expired)") {
            if !touches.contains(&Touch::LeaseRanOut) {
                return Err("as an expired export though P never said its lease ran out");
            }
            let d_ran_normally =
                !c.d_paused_at_add && self.pauses[Side::D.idx()] == c.d_pauses_at_add;
            return if d_ran_normally {
                Ok(())
            } else {
                Err("though its export's lease ran out while it waited behind a pause on D (the lifecycle's retraction: it must compute)")
            };
        }
        Err("for the lifecycle, not for a fault")
    }

    /// Sends a lifecycle call to `side` (an error reply at once if it is down).
    fn issue(&mut self, side: Side, kind: OpKind, version: String) -> u64 {
        // A new name is the engine's own: P and D may hold different weights when it comes
        // (one restarted), and one name on both would tell D that P's KV is of its weights.
        let version = if kind == OpKind::SetWeightVersion {
            format!("{version}-{}", side.name())
        } else {
            version
        };
        let op = self.ops.len() as u64;
        self.stats.n_ops += 1;
        self.ops.push(OpRecord {
            side,
            kind,
            issued: self.now,
            jumped_at_issue: self.jumped,
            reply: None,
        });
        let aborts = match kind {
            OpKind::Pause { mode, .. } | OpKind::Sleep { mode, .. } => mode == PauseMode::Abort,
            // An unload aborts the adapter's live requests.
            OpKind::AbortAll | OpKind::AbortOne { .. } | OpKind::UnloadLora { .. } => true,
            _ => false,
        };
        if aborts {
            self.abort_causes[side.idx()] += 1;
        }
        if matches!(kind, OpKind::Pause { .. } | OpKind::Sleep { .. }) {
            self.pauses[side.idx()] += 1;
        }
        match self.engine(side) {
            Some(e) => e.push(Input::Op { op, kind, version }),
            None => {
                self.ops[op as usize].reply = Some((self.now, Err("the engine is down".into())));
            }
        }
        op
    }

    fn run_scripts(&mut self) {
        let mut scripts = std::mem::take(&mut self.scripts);
        for s in &mut scripts {
            if !s
                .waiting
                .iter()
                .all(|&op| self.ops[op as usize].reply.is_some())
            {
                continue;
            }
            s.waiting.clear();
            if let Some((target, kind, version)) = s.steps.pop_front() {
                let version = version.unwrap_or_else(|| self.new_version(kind));
                self.note(|| format!("script: admin {target}: {kind}"));
                for &side in target.engines() {
                    let op = self.issue(side, kind, version.clone());
                    s.waiting.push(op);
                }
            }
        }
        scripts.retain(|s| !s.steps.is_empty() || !s.waiting.is_empty());
        scripts.append(&mut self.scripts);
        self.scripts = scripts;
    }

    fn fault(&mut self, fault: Fault) {
        let ms = |m: u32| Duration::from_millis(u64::from(m));
        match fault {
            Fault::LinkDown { side, ms: m } => self.net.link_down(side.name(), self.now + ms(m)),
            Fault::Crash { side, ms: m } => self.crash(side, ms(m)),
            Fault::Slow { n, ms: m } => self.net.slow(usize::from(n), ms(m)),
            Fault::BreakPull { good } => self.net.break_next_pull(usize::from(good)),
            Fault::LostAfterServe => self.net.lose_next_pull(),
            // At the end of this tick: calls made at this moment are handled at it.
            Fault::TimeJump { ms: m } => self.jump += ms(m),
            Fault::StepFails { side, n } => {
                if let Some(e) = self.engines[side.idx()].as_ref() {
                    e.faults.fail_next(n);
                }
            }
        }
    }

    /// Adds an engine's counters to the run's (when it stops or dies).
    fn count(&mut self, e: &SimEngine) {
        let o = e.oracle.lock();
        self.stats.n_tokens_checked += o.n_checked;
        self.stats.n_tokens_mixed += o.n_mixed;
        self.stats.n_tokens_masked += o.n_masked;
        self.stats.n_tokens_lora += o.n_lora;
        self.stats.n_step_failures += e.core.counters().n_step_failures_total;
        self.stats.n_kv_batches += e.kv_view.n_batches;
        self.stats.n_tier_kv_events += e.kv_view.n_tier_events;
        self.stats.n_steps += e.n_steps;
        for (&kind, &n) in &e.calls {
            *self.stats.calls.entry(kind).or_default() += n;
        }
    }

    fn crash(&mut self, side: Side, down_for: Duration) {
        let Some(engine) = self.engines[side.idx()].take() else {
            return;
        };
        self.count(&engine);
        self.stats.n_crashes += 1;
        self.net.crash(side.name());
        let inc = engine.incarnation;
        drop(engine);
        for i in 0..self.clients.len() {
            if self.clients[i].is_live() && self.clients[i].engine() == Some((side, inc)) {
                self.end(i, End::Failed(format!("{} died", side.name())));
            }
        }
        for rec in &mut self.ops {
            if rec.side == side && rec.reply.is_none() {
                rec.reply = Some((self.now, Err("the engine died".into())));
            }
        }
        self.restart_at[side.idx()] = Some(self.now + down_for);
    }

    /// Every call replied within its bound.
    fn check_ops(&self) -> Check {
        for rec in &self.ops {
            let age = self
                .now
                .saturating_sub(rec.issued)
                .saturating_sub(self.jumped - rec.jumped_at_issue);
            if rec.reply.is_none() && age > self.op_bound {
                return Err(format!(
                    "{} {}: no reply after {age:?} (bound {:?})",
                    rec.side.name(),
                    rec.kind,
                    self.op_bound
                ));
            }
        }
        Ok(())
    }

    /// Heal, wake, resume, and run until nothing is left; then every block must be free.
    fn quiesce(&mut self) -> Check {
        self.note(|| {
            "quiesce: faults heal, the trainer stops, the operator wakes and resumes both engines"
                .into()
        });
        self.net.heal();
        // Jumps still waiting for a quiet moment are faults of the schedule: it is over.
        self.jump = Duration::ZERO;
        for side in [Side::P, Side::D] {
            if self.engines[side.idx()].is_none() {
                self.restart_at[side.idx()] = None;
                self.start(side);
            }
        }
        for s in &mut self.scripts {
            s.steps.clear();
        }
        let deadline = self.now + Duration::from_millis(u64::from(self.config.max_quiesce_ticks));
        let mut woken = false;
        loop {
            if self.now > deadline {
                return Err(format!(
                    "not quiescent after {} ms: {}",
                    self.config.max_quiesce_ticks,
                    self.what_is_left()
                ));
            }
            let mut calls_done =
                self.scripts.is_empty() && self.ops.iter().all(|o| o.reply.is_some());
            if calls_done && !woken {
                woken = true;
                self.wake_all();
                calls_done = false;
            }
            if woken && calls_done && self.idle() {
                break;
            }
            if woken && calls_done && self.only_timers_left() {
                // Nothing happens until a deadline: the engines' loops would sleep until it.
                if let Some(t) = self.next_timer() {
                    self.now = self.now.max(t);
                }
            }
            self.tick()?;
        }
        self.check_quiescent()
    }

    fn wake_all(&mut self) {
        // Dropped weights are reloaded, with the same new version on both engines. (Weights
        // lent to a reload and never returned stay `Reloading`: the wake-up is refused and
        // the run fails as not running after it.)
        let version = self.new_version(OpKind::WeightUpdate);
        for side in [Side::P, Side::D] {
            let e = self.engines[side.idx()].as_ref().expect("restarted");
            let mut steps = VecDeque::new();
            if e.core.executor().weight_ops().residency() == WeightResidency::Dropped {
                steps.push_back((target_of(side), OpKind::WeightUpdate, Some(version.clone())));
            }
            steps.push_back((target_of(side), OpKind::WakeUp { tags: 0 }, None));
            steps.push_back((target_of(side), OpKind::Resume, None));
            self.scripts.push(Script {
                steps,
                waiting: Vec::new(),
            });
        }
    }

    fn idle(&self) -> bool {
        self.clients.iter().all(|c| !c.is_live())
            && self.engines.iter().flatten().all(|e| {
                !e.core.has_work()
                    && !e.has_inputs()
                    && e.live.is_empty()
                    && e.core().stats().n_transfers == 0
                    && e.copier.as_ref().is_none_or(|c| c.lock().n_queued() == 0)
            })
            && self.net.n_outstanding() == (0, 0)
            && self
                .mailbox
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
    }

    /// Nothing will happen before a deadline (a lease, a pull falling due).
    fn only_timers_left(&self) -> bool {
        self.clients
            .iter()
            .all(|c| !matches!(c.stage, Stage::Proxy { .. }))
            && self.engines.iter().flatten().all(|e| {
                !e.core.has_work()
                    && !e.has_inputs()
                    && e.copier.as_ref().is_none_or(|c| c.lock().n_queued() == 0)
            })
            && self
                .mailbox
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
    }

    fn next_timer(&self) -> Option<Duration> {
        let engines = self
            .engines
            .iter()
            .flatten()
            .filter_map(SimEngine::next_deadline);
        engines.chain(self.net.next_due()).min()
    }

    fn what_is_left(&self) -> String {
        let live: Vec<&str> = self
            .clients
            .iter()
            .filter(|c| c.is_live())
            .map(|c| c.id.as_str())
            .collect();
        let pending: Vec<String> = self
            .ops
            .iter()
            .filter(|o| o.reply.is_none())
            .map(|o| format!("{} {}", o.side.name(), o.kind))
            .collect();
        let engines: Vec<String> = self
            .engines
            .iter()
            .flatten()
            .map(|e| {
                let core = e.core();
                let st = core.stats();
                let reqs: Vec<String> = e
                    .live
                    .iter()
                    .filter_map(|id| core.request(core.request_idx(id)?))
                    .map(|r| {
                        format!(
                            "{} {:?} computed {}/{} blocks {}",
                            r.id,
                            r.state,
                            r.n_computed,
                            r.tokens.len(),
                            r.blocks.len()
                        )
                    })
                    .collect();
                let holds: Vec<String> = core
                    .transfer_ids()
                    .map(|t| format!("{}:{:?}", t.0, core.transfer_holder(t)))
                    .collect();
                format!(
                    "{}: {} running, {} waiting, {} blocks used, {} free, {} transfers {holds:?} (next deadline {:?}, core clock {:?}), status {:?}, requests [{}]",
                    e.side.name(),
                    st.n_running,
                    st.n_waiting,
                    st.n_blocks_used,
                    st.n_blocks_free,
                    st.n_transfers,
                    core.next_deadline(),
                    core.now(),
                    core.lifecycle_status(),
                    reqs.join("; ")
                )
            })
            .collect();
        format!(
            "clients {live:?}, calls {pending:?}, {}, net {:?}",
            engines.join("; "),
            self.net.n_outstanding()
        )
    }

    fn check_quiescent(&self) -> Check {
        for e in self.engines.iter().flatten() {
            let ledger = e.core().block_ledger().map_err(|err| err.to_string())?;
            let held: Vec<(usize, &BlockStatus)> = ledger
                .iter()
                .enumerate()
                .filter(|(_, b)| matches!(b, BlockStatus::Held(_)))
                .collect();
            if !held.is_empty() {
                return Err(format!(
                    "{}: after quiescing, {} blocks are still held, first {:?}",
                    e.side.name(),
                    held.len(),
                    held[0]
                ));
            }
            if !e.live.is_empty() {
                return Err(format!(
                    "{}: requests never finished: {:?}",
                    e.side.name(),
                    e.live
                ));
            }
            let status = e.core().lifecycle_status();
            if status.paused || status.sleeping || status.kv_released {
                return Err(format!(
                    "{}: not running after the wake-up: {status:?}",
                    e.side.name()
                ));
            }
        }
        Ok(())
    }
}

/// Whether `e` is paused now (by a client or a sleep).
fn paused(e: &SimEngine) -> bool {
    let status = e.core().lifecycle_status();
    status.paused || status.sleeping
}

fn target_of(side: Side) -> Target {
    match side {
        Side::P => Target::P,
        Side::D => Target::D,
    }
}
