//! How the engines of a run are set up (the scheduler's limits and the offload tier, drawn
//! per seed), and what each engine core is given in the simulation: the checksum executor
//! with injected step failures, the real connectors over the simulated network and copier,
//! reports into the simulation's mailbox, inline masks under the simulation's constraint,
//! LoRA adapters served over the tiny model's config (small random ones, [`adapter`]), and
//! the oracle watching every forward.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_arena::Reports;
use ferry_core::{
    AllowedPeers, ConnectorId, KvLoadFailurePolicy, OffloadConfig, OffloadConnector, OffloadPolicy,
    PdConfig, PdRole, Scheduler, SchedulerConfig, StepPlan,
};
use ferry_engine::{
    Connector, Constraint, Constraints, EngineCore, InlineEnv, LoraSettings, StructuredOutput,
};
use ferry_model::{ChecksumModel, ExecError, Executor, Hooked, StepHook};

use crate::adapters::LORA_RANK;
use crate::copier::Copier;
use crate::messages::{Mail, Mailbox};
use crate::net::SimNet;
use crate::oracle::{SharedOracle, VOCAB};
use crate::schedule::Side;

/// How the engines of a run are set up (drawn per seed).
#[derive(Debug, Clone)]
pub struct EngineSetup {
    pub sched: SchedulerConfig,
    /// The offload tier's capacity in engine blocks (none: no tier).
    pub tier_blocks: Option<usize>,
    pub tier_blocks_per_slot: usize,
    pub tier_policy: OffloadPolicy,
    /// Register the tier before the P/D connector (`--kv-connector offload,pd`).
    pub tier_first: bool,
    /// Most LoRA adapters an engine holds (`--max-cpu-loras`; `None`: no bound).
    pub max_cpu_loras: Option<usize>,
    /// Every version of an adapter is loaded with its first version's weights
    /// (`SimConfig::stale_lora_weights`).
    pub stale_lora_weights: bool,
}

impl EngineSetup {
    pub fn scheduler_config(
        block_size: usize,
        n_blocks: u32,
        policy: KvLoadFailurePolicy,
    ) -> SchedulerConfig {
        SchedulerConfig {
            block_size,
            n_blocks,
            max_num_seqs: 6,
            max_num_batched_tokens: 32,
            max_model_len: 64,
            weight_version: "w0".into(),
            export_lease: Duration::from_millis(1500),
            kv_load_timeout: Duration::from_millis(500),
            lifecycle_wait_timeout: Duration::from_millis(1000),
            kv_load_failure_policy: policy,
            kv_events: true,
            ..SchedulerConfig::default()
        }
    }

    /// One engine's core, with checks on, and what the simulation keeps a handle on.
    pub fn build(
        &self,
        side: Side,
        incarnation: u32,
        net: &SimNet,
        mailbox: &Mailbox,
        secret: [u8; 32],
    ) -> Built {
        let faults = StepFaults::default();
        let (executor, connectors, copier) = self.parts(side, net, secret, &faults);
        let report_to = |connector: ConnectorId| {
            let mailbox = Arc::clone(mailbox);
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
        let sched = Scheduler::new(self.sched.clone()).expect("valid scheduler config");
        let oracle = SharedOracle::default();
        oracle.lock().enabled = true;
        let env = Box::new(InlineEnv);
        let mut core = EngineCore::with_connectors(sched, executor, connectors, report_to, env)
            .checked()
            .with_observer(Box::new(oracle.clone()));
        core.set_lora_settings(Some(LoraSettings {
            base: Arc::new(ferry_model::tiny::tiny_config()),
            max_rank: LORA_RANK,
            max_cpu_loras: self.max_cpu_loras,
        }));
        Built {
            core,
            copier,
            oracle,
            faults,
            stale_lora_weights: self.stale_lora_weights,
        }
    }

    /// What one engine is made of: the checksum executor (failing the forwards `faults` asks
    /// to), the P/D connector over the simulated network and, if the setup has one, the
    /// offload tier with its simulated copier, in the setup's connector order.
    fn parts(
        &self,
        side: Side,
        net: &SimNet,
        secret: [u8; 32],
        faults: &StepFaults,
    ) -> (Box<dyn Executor>, Vec<Connector>, Option<Copier>) {
        let checksum =
            ChecksumModel::new(self.sched.weight_version.clone(), VOCAB).expect("valid vocabulary");
        let block_bytes = checksum.kv_layout(self.sched.block_size).block_bytes();
        let executor = Box::new(Hooked {
            inner: checksum,
            hook: faults.clone(),
        });
        let pd = Connector::pd(
            PdConfig {
                role: match side {
                    Side::P => PdRole::Producer,
                    Side::D => PdRole::Consumer,
                },
                engine_id: side.name().to_owned(),
                host: Some("127.0.0.1".into()),
                port: Some(side.idx() as u16 + 1),
                secret,
                block_size: self.sched.block_size,
                allowed_peers: AllowedPeers::default(),
            },
            Arc::new(net.endpoint(side.name())),
        );
        let mut connectors = vec![pd];
        let mut copier = None;
        if let Some(n_blocks) = self.tier_blocks {
            let config = OffloadConfig {
                block_size: self.sched.block_size,
                blocks_per_slot: self.tier_blocks_per_slot,
                block_bytes,
                capacity_bytes: (n_blocks * block_bytes) as u64,
                policy: self.tier_policy,
            };
            config.validate().expect("valid tier config");
            let tier = Copier::new(config.n_host_blocks(), config.block_bytes);
            let connector = Connector::new(Box::new(OffloadConnector::new(config)), tier.worker());
            connectors.insert(usize::from(!self.tier_first), connector);
            copier = Some(tier);
        }
        (executor, connectors, copier)
    }
}

/// An engine core as [`EngineSetup::build`] makes it, with the handles the simulation keeps.
#[derive(Debug)]
pub struct Built {
    pub core: EngineCore,
    pub copier: Option<Copier>,
    pub oracle: SharedOracle,
    pub faults: StepFaults,
    /// See [`EngineSetup::stale_lora_weights`].
    pub stale_lora_weights: bool,
}

/// Fails the next forwards a fault asked for, never more than two in a row (a third would
/// end every request with `error`, which the checks would count as lost).
#[derive(Debug, Clone, Default)]
pub struct StepFaults(Arc<Mutex<(u8, u8)>>);

impl StepFaults {
    /// The next `n` forwards fail.
    pub fn fail_next(&self, n: u8) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).0 = n;
    }
}

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
