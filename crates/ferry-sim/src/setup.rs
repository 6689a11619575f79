//! How the engines of a run are set up: the scheduler's limits and the offload tier, drawn
//! per seed.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::{
    AllowedPeers, KvLoadFailurePolicy, OffloadConfig, OffloadConnector, OffloadPolicy, PdConfig,
    PdRole, SchedulerConfig,
};
use ferry_engine::Connector;
use ferry_model::{ChecksumModel, Executor, Hooked};

use crate::copier::Copier;
use crate::engine::StepFaults;
use crate::net::SimNet;
use crate::oracle::VOCAB;
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
            ..SchedulerConfig::default()
        }
    }

    /// What one engine is made of: the checksum executor (failing the forwards `faults` asks
    /// to), the P/D connector over the simulated network and, if the setup has one, the
    /// offload tier with its simulated copier, in the setup's connector order.
    pub fn parts(
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
