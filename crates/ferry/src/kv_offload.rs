//! `ferry serve`'s offload tier flags (`--kv-offload-bytes`, `--kv-offload-policy`,
//! `--kv-offload-block-size`) and the connector order (`--kv-connector`), checked before
//! anything is loaded where they can be; errors name the flag.

use anyhow::{bail, Context};
use ferry_cli::ByteSize;
use ferry_engine::{Connector, OffloadConfig, OffloadPolicy};

/// `--kv-offload-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyArg {
    Lru,
    Arc,
}

impl From<PolicyArg> for OffloadPolicy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::Lru => OffloadPolicy::Lru,
            PolicyArg::Arc => OffloadPolicy::Arc,
        }
    }
}

/// A name in `--kv-connector`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConnectorName {
    /// The CPU offload tier (`--kv-offload-bytes`).
    Offload,
    /// P/D disaggregation (`--kv-role`).
    Pd,
}

/// The tier as the flags ask for it, before the model says how big a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadPlan {
    pub capacity_bytes: u64,
    pub blocks_per_slot: usize,
    pub policy: OffloadPolicy,
}

/// Checks the tier's flags; `None` without `--kv-offload-bytes`.
pub fn offload_plan(
    bytes: Option<ByteSize>,
    block_tokens: Option<usize>,
    policy: PolicyArg,
    block_size: usize,
) -> anyhow::Result<Option<OffloadPlan>> {
    let Some(bytes) = bytes else {
        return Ok(None);
    };
    if bytes.0 == 0 {
        bail!("--kv-offload-bytes must be more than 0 (leave it out to run without the tier)");
    }
    let blocks_per_slot = match block_tokens {
        None => 1,
        Some(n) if block_size == 0 || n == 0 || n % block_size != 0 => bail!(
            "--kv-offload-block-size {n} must be a positive multiple of --block-size {block_size}"
        ),
        Some(n) => n / block_size,
    };
    Ok(Some(OffloadPlan {
        capacity_bytes: bytes.0,
        blocks_per_slot,
        policy: policy.into(),
    }))
}

/// The connectors in load-priority order: `--kv-connector` as given (each must be turned on
/// by its own flag, once), else the tier first (a local copy is cheaper than the network),
/// then P/D.
pub fn connector_order(
    order: Option<&[ConnectorName]>,
    offload: bool,
    pd: bool,
) -> anyhow::Result<Vec<ConnectorName>> {
    let on = |c: ConnectorName| match c {
        ConnectorName::Offload => offload,
        ConnectorName::Pd => pd,
    };
    let flag = |c: ConnectorName| match c {
        ConnectorName::Offload => ("offload", "--kv-offload-bytes"),
        ConnectorName::Pd => ("pd", "--kv-role"),
    };
    let all = [ConnectorName::Offload, ConnectorName::Pd];
    let Some(order) = order else {
        return Ok(all.into_iter().filter(|&c| on(c)).collect());
    };
    for (i, &c) in order.iter().enumerate() {
        let (name, needs) = flag(c);
        if order[..i].contains(&c) {
            bail!("--kv-connector lists {name} twice");
        }
        if !on(c) {
            bail!("--kv-connector lists {name}, which needs {needs}");
        }
    }
    if let Some(&c) = all.iter().find(|&&c| on(c) && !order.contains(&c)) {
        let (name, needs) = flag(c);
        bail!("--kv-connector leaves out {name}, which {needs} turns on: list every connector");
    }
    Ok(order.to_vec())
}

/// The tier's connector for blocks of `layout` (the model's KV layout: its bytes per block).
pub fn offload_connector(
    plan: &OffloadPlan,
    layout: ferry_arena::KvLayout,
) -> anyhow::Result<(Connector, OffloadConfig)> {
    let block_size = layout.block_size;
    let config = OffloadConfig {
        block_size,
        blocks_per_slot: plan.blocks_per_slot,
        block_bytes: layout.block_bytes(),
        capacity_bytes: plan.capacity_bytes,
        policy: plan.policy,
    };
    if let Err(e) = config.validate() {
        bail!("--kv-offload-bytes {}: {e}", plan.capacity_bytes);
    }
    let connector = Connector::offload(config.clone()).context("starting the offload copier")?;
    Ok((connector, config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ConnectorName::{Offload, Pd};

    #[test]
    fn the_order_is_checked_against_the_flags_that_turn_connectors_on() {
        assert_eq!(connector_order(None, true, true).unwrap(), [Offload, Pd]);
        assert_eq!(connector_order(None, false, true).unwrap(), [Pd]);
        assert!(connector_order(None, false, false).unwrap().is_empty());
        assert_eq!(
            connector_order(Some(&[Pd, Offload]), true, true).unwrap(),
            [Pd, Offload]
        );
        let err = |o: &[ConnectorName], off, pd| {
            connector_order(Some(o), off, pd).unwrap_err().to_string()
        };
        assert!(err(&[Offload], false, false).contains("needs --kv-offload-bytes"));
        assert!(err(&[Pd], true, false).contains("needs --kv-role"));
        assert!(err(&[Offload, Offload], true, false).contains("twice"));
        assert!(err(&[Offload], true, true).contains("leaves out pd"));
    }

    #[test]
    fn the_offloaded_block_is_a_multiple_of_the_engine_block() {
        let plan = offload_plan(Some(ByteSize(1 << 20)), Some(32), PolicyArg::Arc, 16)
            .unwrap()
            .unwrap();
        assert_eq!(plan.blocks_per_slot, 2);
        assert_eq!(plan.policy, OffloadPolicy::Arc);
        assert!(offload_plan(None, None, PolicyArg::Lru, 16)
            .unwrap()
            .is_none());
        let err = offload_plan(Some(ByteSize(1 << 20)), Some(24), PolicyArg::Lru, 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--kv-offload-block-size 24"), "{err}");
        let err = offload_plan(Some(ByteSize(0)), None, PolicyArg::Lru, 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--kv-offload-bytes"), "{err}");
    }
}
