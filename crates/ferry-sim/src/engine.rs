//! One simulated engine: `ferry_engine::EngineCore`, the engine thread's own core (its step,
//! lifecycle events and wake-up), with checks on, driven as the engine thread drives it. Only
//! what the core is given differs: the checksum executor (failing the steps a fault asks to,
//! before its forward), the real P/D worker over the simulated network, the offload worker
//! with a simulated copier, reports into the simulation's mailbox, inline masks and no clock.
//! [`SimEngine::tick`] is one turn of the engine loop: every queued input in arrival order
//! (each followed by the checks), the clock, one step (or the idle work).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::{
    ConnectorId, FinishReason, KvTransferParams, OpId, SamplingParams, Scheduler, StepPlan,
    TokenId, TransferRequest, WorkerReport,
};
use ferry_engine::{
    CallResult, Constraint, Constraints, CoreEvent, EngineCore, Event as CoreOut, InlineEnv,
    NewRequest, StructuredOutput,
};
use ferry_kv::Reports;
use ferry_model::{ExecError, StepHook};

use crate::copier::Copier;
use crate::net::SimNet;
use crate::oracle::SharedOracle;
pub use crate::oracle::VOCAB;
use crate::schedule::{OpKind, Side};
pub use crate::setup::EngineSetup;

/// A worker report on its way to an engine's input queue.
#[derive(Debug)]
pub struct Mail {
    pub side: Side,
    pub incarnation: u32,
    pub connector: ConnectorId,
    pub report: WorkerReport,
}

/// Where every worker's reports go, for the simulation to hand to the right engine.
pub type Mailbox = Arc<Mutex<Vec<Mail>>>;

/// An engine's input, as `ferry-engine`'s input queue carries it.
#[derive(Debug)]
pub enum Input {
    Add {
        id: String,
        prompt: Vec<TokenId>,
        max_tokens: u32,
        /// What the request asks of the P/D transfer, parsed as the server's edge parses it.
        kv: Option<TransferRequest>,
        /// Under the simulation's structured-output constraint.
        constrained: bool,
    },
    Abort(String),
    Report(ConnectorId, WorkerReport),
    /// A lifecycle call; `op` is the simulation's id for its reply.
    Op {
        op: u64,
        kind: OpKind,
        version: String,
    },
}

/// What an engine tells the outside world.
#[derive(Debug)]
pub enum Event {
    Token {
        id: String,
        token: TokenId,
    },
    Finished {
        id: String,
        reason: FinishReason,
        kv: Option<KvTransferParams>,
        message: Option<String>,
    },
    Refused {
        id: String,
        message: String,
    },
    Reply {
        op: u64,
        result: Result<(), String>,
    },
}

/// Fails the next forwards a fault asked for, never more than two in a row (a third would
/// end every request with `error`, which the checks would count as lost).
#[derive(Debug, Clone, Default)]
pub struct StepFaults(Arc<Mutex<(u8, u8)>>);

impl StepHook for StepFaults {
    fn before_step(&mut self, plan: &StepPlan) -> Result<(), ExecError> {
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (to_fail, in_a_row) = &mut *s;
        if *to_fail == 0 || *in_a_row >= 2 {
            *in_a_row = 0;
            return Ok(());
        }
        *to_fail -= 1;
        *in_a_row += 1;
        Err(ExecError::InvalidPlan(format!(
            "step {} failed by the simulation",
            plan.step
        )))
    }
}

/// One engine (see the module docs).
#[derive(Debug)]
pub struct SimEngine {
    pub side: Side,
    pub incarnation: u32,
    /// Simulated time this incarnation started: its core's clock counts from here.
    epoch: Duration,
    pub core: EngineCore,
    inbox: VecDeque<Input>,
    pub copier: Option<Copier>,
    pub oracle: SharedOracle,
    faults: StepFaults,
    constraint: Constraint,
    /// Core op id → the simulation's.
    ops: BTreeMap<OpId, u64>,
    /// Request slot → id, for the core's events.
    ids: BTreeMap<u32, String>,
    /// Requests accepted and not finished yet: each must finish exactly once.
    pub live: BTreeSet<String>,
    pub n_steps: u64,
}

impl SimEngine {
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        side: Side,
        incarnation: u32,
        now: Duration,
        setup: &EngineSetup,
        net: &SimNet,
        mailbox: &Mailbox,
        secret: [u8; 32],
        constraint: &Constraint,
    ) -> Self {
        let faults = StepFaults::default();
        let (executor, connectors, copier) = setup.parts(side, net, secret, &faults);
        let mailbox = Arc::clone(mailbox);
        let report_to = |connector: ConnectorId| {
            let mailbox = Arc::clone(&mailbox);
            Reports::new(move |report| {
                let mail = Mail {
                    side,
                    incarnation,
                    connector,
                    report,
                };
                mailbox
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(mail);
            })
        };
        let sched = Scheduler::new(setup.sched.clone()).expect("valid scheduler config");
        let oracle = SharedOracle::default();
        oracle.lock().enabled = true;
        let core = EngineCore::with_connectors(
            sched,
            executor,
            connectors,
            report_to,
            Box::new(InlineEnv),
        )
        .checked()
        .with_observer(Box::new(oracle.clone()));
        Self {
            side,
            incarnation,
            epoch: now,
            core,
            inbox: VecDeque::new(),
            copier,
            oracle,
            faults,
            constraint: constraint.clone(),
            ops: BTreeMap::new(),
            ids: BTreeMap::new(),
            live: BTreeSet::new(),
            n_steps: 0,
        }
    }

    pub fn push(&mut self, input: Input) {
        self.inbox.push_back(input);
    }

    pub fn core(&self) -> &Scheduler {
        self.core.sched()
    }

    pub fn has_inputs(&self) -> bool {
        !self.inbox.is_empty()
    }

    /// The next `n` forwards fail (a fault).
    pub fn fail_steps(&self, n: u8) {
        self.faults
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0 = n;
    }

    /// The core's next deadline, in simulated time.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.core.next_deadline().map(|d| self.epoch + d)
    }

    /// One turn of the engine loop at simulated time `now`. `Err`: a broken invariant.
    pub fn tick(&mut self, now: Duration, events: &mut Vec<Event>) -> Result<bool, String> {
        self.core.handle_time(now.saturating_sub(self.epoch));
        while let Some(input) = self.inbox.pop_front() {
            self.handle(input, events);
            self.drain(events)?;
            self.core.check()?;
        }
        let stepped = self
            .core
            .step()
            .map_err(|e| format!("step: {e}"))?
            .is_some();
        self.n_steps += u64::from(stepped);
        self.drain(events)?;
        match self.oracle.lock().violations.first() {
            Some(v) => Err(format!("oracle: {v}")),
            None => Ok(stepped),
        }
    }

    fn handle(&mut self, input: Input, events: &mut Vec<Event>) {
        let (op, call) = match input {
            Input::Add {
                id,
                prompt,
                max_tokens,
                kv,
                constrained,
            } => {
                let req = NewRequest {
                    request_id: id.clone(),
                    prompt,
                    params: SamplingParams::greedy(max_tokens),
                    transfer: kv,
                    constraint: constrained.then(|| self.constraint.clone()),
                };
                match self.core.handle_add(req) {
                    Ok(idx) => {
                        self.ids.insert(idx.0, id.clone());
                        self.live.insert(id);
                    }
                    Err(e) => events.push(Event::Refused {
                        id,
                        message: e.to_string(),
                    }),
                }
                return;
            }
            Input::Abort(id) => {
                self.core.handle_abort(&id);
                return;
            }
            Input::Report(c, report) => return self.core.handle_report(c, report),
            Input::Op { op, kind, version } => {
                let weights = || self.core.executor().weight_ops().preparer();
                (op, kind.call(&self.live, weights, version))
            }
        };
        match call {
            Ok(call) => drop(self.ops.insert(self.core.handle_call(call), op)),
            Err(e) => events.push(Event::Reply { op, result: Err(e) }),
        }
    }

    /// The core's events, as the simulation reads them; checks each request finishes once.
    fn drain(&mut self, events: &mut Vec<Event>) -> Result<(), String> {
        while let Some(event) = self.core.poll_event() {
            match event {
                CoreEvent::Request(_, CoreOut::Admitted { .. }) => {}
                CoreEvent::Request(
                    idx,
                    CoreOut::Output {
                        sampled, finish, ..
                    },
                ) => {
                    let id = self
                        .ids
                        .get(&idx.0)
                        .cloned()
                        .ok_or_else(|| format!("an output for a request not live: {idx:?}"))?;
                    if let Some(t) = sampled {
                        events.push(Event::Token {
                            id: id.clone(),
                            token: t.token,
                        });
                    }
                    if let Some(f) = finish {
                        self.ids.remove(&idx.0);
                        if !self.live.remove(&id) {
                            return Err(format!(
                                "{id}: finished twice (or before it was accepted)"
                            ));
                        }
                        self.oracle.lock().forget(&id);
                        let message = f.message.or(f.constraint_stop);
                        events.push(Event::Finished {
                            id,
                            reason: f.reason,
                            kv: f.kv_transfer_params.map(|p| *p),
                            message,
                        });
                    }
                }
                CoreEvent::Reply(op, result) => {
                    let result = match result {
                        CallResult::Op(r) => r.map_err(|e| e.to_string()),
                        CallResult::Installed(r) => r.map(drop).map_err(|e| e.to_string()),
                        _ => Ok(()),
                    };
                    if let Some(op) = self.ops.remove(&op) {
                        events.push(Event::Reply { op, result });
                    }
                }
            }
        }
        Ok(())
    }
}

/// The structured-output constraint of constrained requests: a short choice, then up to two
/// words, over the tiny model's tokenizer (so some tokens are forced, and the grammar
/// completes), compiled by the real llguidance matcher. Compiled once per thread.
pub fn constraint() -> Constraint {
    thread_local! {
        static COMPILED: Constraint = {
            let model = ferry_model::tiny::tiny_model();
            let eos = model.config.eos_token_ids[0];
            let tokenizer = Arc::new(model.tokenizer.expect("the tiny model has a tokenizer"));
            Constraints::new(tokenizer, eos, VOCAB)
                .and_then(|c| c.compile(&StructuredOutput::Regex("(yes|no|maybe)( [a-z]{1,4}){0,2}".into())))
                .expect("the simulation's constraint compiles")
        };
    }
    COMPILED.with(Constraint::clone)
}
