//! Each request's expert routing ("rollout routing replay" for RL trainers of MoE models):
//! which experts the router picked for each of its positions, in every MoE layer.
//!
//! An executor capturing routing reports, for every request it computes, the routing of the
//! positions it computed, after the positions the plan asked it to read back
//! ([`crate::RoutingRead`]). It stores each token's routing in its KV block, so a request
//! whose first computed position is past the routing it has (it took blocks as a prefix-cache
//! hit, a P/D import or a load from the offload tier) reads theirs back instead of computing
//! it. Here each request accumulates its rows by
//! position: a row recomputed after a preemption overwrites the old one, rows past the end
//! are appended, and the whole goes out with the request's finish
//! ([`super::Finished::routing`]).
//!
//! What a request holds after a preemption stays: it never had fewer rows than its computed
//! tokens, so a readmission whose prefix hit ends at or before its routing reads nothing
//! back, and one whose hit reaches further (another request computed more of the same
//! prefix meanwhile) reads back only the rows past its own.
//!
//! The KV a connector loads carries its routing (the block holds it, so a connector moving
//! blocks moves it): such positions are past the request's rows like a prefix-cache hit's,
//! and are read back the same way.

use super::{OutputError, Scheduler};
use crate::config::ConfigError;
use crate::plan::{ModelOutput, RoutingShape, StepPlan};
use crate::request::RequestState;

impl Scheduler {
    /// Makes every request accumulate its expert routing of this shape (the executor's
    /// `routing_shape`), reported by the executor in [`ModelOutput::routed`]; `None` (the
    /// default): no routing. Set before the first request is added: requests already live
    /// have routing for none of their positions, and a request with routing of another shape
    /// could not be read.
    pub fn set_routing_shape(&mut self, shape: Option<RoutingShape>) -> Result<(), ConfigError> {
        if let Some(s) = shape {
            if s.layers == 0
                || s.top_k == 0
                || s.num_experts == 0
                || s.num_experts > usize::from(u16::MAX) + 1
            {
                return Err(ConfigError::RoutingShape(s));
            }
        }
        assert!(
            self.ids.is_empty(),
            "scheduler: routing shape set with {} requests live",
            self.ids.len()
        );
        self.routing_shape = shape;
        Ok(())
    }

    /// The shape of the routing requests accumulate, if any.
    pub fn routing_shape(&self) -> Option<RoutingShape> {
        self.routing_shape
    }

    /// The executor's routing answers the plan: one entry per scheduled request, in plan
    /// order, from the position read back from (or its first computed one), covering every
    /// position through its last computed one, naming experts the model has.
    pub(super) fn validate_routing(
        &self,
        plan: &StepPlan,
        output: &ModelOutput,
    ) -> Result<(), OutputError> {
        let Some(shape) = self.routing_shape else {
            return Ok(());
        };
        if output.routed.len() != plan.reqs.len() {
            return Err(OutputError::RoutingCount {
                expected: plan.reqs.len(),
                got: output.routed.len(),
            });
        }
        let mut reads = plan.routing_reads.iter().peekable();
        for (i, (r, got)) in plan.reqs.iter().zip(&output.routed).enumerate() {
            let first = match reads.next_if(|read| read.req_pos == i) {
                Some(read) => read.from,
                None => r.start_pos,
            };
            let n_ids = (r.start_pos + r.tokens.len() - first) * shape.width();
            if got.req != r.req || got.first_pos != first || got.ids.len() != n_ids {
                return Err(OutputError::RoutingRange {
                    expected: r.req,
                    expected_first: first,
                    expected_ids: n_ids,
                    got: got.req,
                    got_first: got.first_pos,
                    got_ids: got.ids.len(),
                });
            }
            if let Some(&id) = got
                .ids
                .iter()
                .find(|&&id| usize::from(id) >= shape.num_experts)
            {
                return Err(OutputError::RoutingExpert {
                    req: r.req,
                    id,
                    num_experts: shape.num_experts,
                });
            }
        }
        Ok(())
    }

    /// Writes each entry of a validated output into its request's rows: over the rows it
    /// recomputed, appended past the end. Nothing moves a request's rows between the plan
    /// and its output, so an entry never starts past them (the plan read back any gap).
    pub(super) fn absorb_routing(&mut self, plan: &StepPlan, output: &ModelOutput) {
        let Some(shape) = self.routing_shape else {
            return;
        };
        let width = shape.width();
        for got in &output.routed {
            let Some(req) = self
                .requests
                .get_mut(got.req.0 as usize)
                .and_then(Option::as_mut)
            else {
                continue;
            };
            if req.state != RequestState::Running {
                continue;
            }
            let at = got.first_pos * width;
            assert!(
                at <= req.routing.len(),
                "scheduler: routing of request #{} ({:?}) from position {} (step {}), past \
                 the {} rows it has",
                got.req.0,
                req.id,
                got.first_pos,
                plan.step,
                req.routing.len() / width
            );
            let n_over = (req.routing.len() - at).min(got.ids.len());
            req.routing[at..at + n_over].copy_from_slice(&got.ids[..n_over]);
            req.routing.extend_from_slice(&got.ids[n_over..]);
        }
    }
}
