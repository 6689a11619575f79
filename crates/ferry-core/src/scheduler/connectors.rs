//! The scheduler's side of its connectors' plumbing: registering them, collecting their
//! workers' jobs for each step, delivering the workers' reports, and polling the connectors
//! for loads and transfers that ended (moving loads forward, freeing what a connector's holds
//! kept). The hooks of admission, of a finish and of a reset are called where those happen
//! (`scheduler.rs`, `transfers.rs`, `lifecycle_machine.rs`).

use super::Scheduler;
use crate::connector::{KvConnector, StepWork, TierStats, WorkerReport};
use crate::holds::Holder;
use crate::ids::ConnectorId;

impl Scheduler {
    /// Registers a connector; the lifecycle drives it from now on. Holds it owns name it by
    /// the returned id (its index in registration order).
    pub fn add_connector(&mut self, mut connector: Box<dyn KvConnector>) -> ConnectorId {
        if self.config.kv_events {
            connector.publish_tier_changes();
        }
        self.connectors.push(connector);
        ConnectorId(self.connectors.len() as u32 - 1)
    }

    /// Each connector's jobs for its worker now. `schedule()` puts them in the plan (run
    /// before the forward); call it again after `on_step_output` for what the step's
    /// finishes produced (P's exports), and run those before the outputs reach anyone, so an
    /// export is served before its parameters can be used.
    pub fn take_connector_work(&mut self, out: &mut Vec<StepWork>) {
        for (i, c) in self.connectors.iter_mut().enumerate() {
            let mut jobs = Vec::new();
            c.step_work(&mut jobs);
            if !jobs.is_empty() {
                out.push(StepWork {
                    connector: ConnectorId(i as u32),
                    jobs,
                });
            }
        }
    }

    /// A connector's worker reported: the connector learns it (the report's own family, so
    /// no connector sees another's messages), then the scheduler frees what ended and moves
    /// loads forward (in order, between steps).
    pub fn on_worker_report(&mut self, connector: ConnectorId, report: WorkerReport) {
        let Some(c) = self.connectors.get_mut(connector.0 as usize) else {
            return;
        };
        match report {
            WorkerReport::Pd(report) => c.on_pd_report(report),
            WorkerReport::Tier(report) => c.on_tier_report(report),
        }
        self.poll_connectors();
    }

    /// Moves loads forward as connectors report them ended, then frees the blocks of every
    /// transfer a connector reports ended, if that connector owns it: a connector can never
    /// free another's hold (or the caller's).
    pub(crate) fn poll_connectors(&mut self) {
        let mut ended = std::mem::take(&mut self.ended_transfers);
        let mut loads = std::mem::take(&mut self.load_results);
        for i in 0..self.connectors.len() {
            let owner = Holder::Connector(ConnectorId(i as u32));
            self.connectors[i].take_finished_loads(&mut loads);
            for load in loads.drain(..) {
                if self.transfer_holder(load.hold) == Some(owner) {
                    self.on_load_result(load, ConnectorId(i as u32));
                }
            }
            self.connectors[i].take_finished_transfers(&mut ended);
            for id in ended.drain(..) {
                // A report of a hold this connector does not hold is expected, not a bug: a
                // worker's late report after a reset or a lease already ended it. Ignored.
                if self.transfer_holder(id) == Some(owner) {
                    self.end_transfer(id, owner);
                }
            }
        }
        self.ended_transfers = ended;
        self.load_results = loads;
    }

    /// Every local tier's loadable blocks, by key (see `KvConnector::tier_blocks`).
    pub fn tier_blocks(&self) -> Vec<crate::hash::BlockHash> {
        let mut out = Vec::new();
        for c in &self.connectors {
            c.tier_blocks(&mut out);
        }
        out
    }

    /// Every local tier's figures, summed (`None` when no connector is a tier).
    pub fn tier_stats(&self) -> Option<TierStats> {
        let mut all: Option<TierStats> = None;
        for s in self.connectors.iter().filter_map(|c| c.tier_stats()) {
            all.get_or_insert_with(Default::default).add(&s);
        }
        all
    }
}
