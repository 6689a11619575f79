//! Short text renderings of plans, for trace tests and debugging.

use std::fmt::Write;

use super::Scheduler;
use crate::plan::StepPlan;

impl Scheduler {
    /// One line per scheduled request: `A: pos 0..40 blocks [1, 2, 3] sample`, using request
    /// ids (the plan must come from this scheduler and its requests must still be live).
    pub fn render_plan(&self, plan: &StepPlan) -> String {
        let mut s = String::new();
        for r in &plan.reqs {
            let id = self.request(r.req).map_or("?", |q| q.id.as_str());
            let end = r.start_pos + r.tokens.len();
            let _ = write!(
                s,
                "{id}: pos {}..{end} blocks {:?}",
                r.start_pos,
                plan.block_table_of(r)
            );
            if r.sample.is_some() {
                s.push_str(" sample");
            }
            s.push('\n');
        }
        if plan.reqs.is_empty() {
            s.push_str("(nothing scheduled)\n");
        }
        s
    }
}
