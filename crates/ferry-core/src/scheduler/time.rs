//! Time in the core: the engine passes a monotonic `now` in ([`Scheduler::advance_time`]) and
//! asks when the core next needs it ([`Scheduler::next_deadline`]); the core never reads a
//! clock, so tests and the simulation drive time by hand.
//!
//! Deadlines: the leases of transfer holds, export leases and load bounds (`crate::holds`:
//! the hold's connector is told, stops serving or cancels, and hands the blocks back) and the
//! bound on a clearing lifecycle operation's wait for transfers (`lifecycle_machine.rs`).

use std::time::Duration;

use super::Scheduler;
use crate::holds::Holder;

impl Scheduler {
    /// Moves the core's clock to `now` (a monotonic time since an epoch the engine chose;
    /// an earlier `now` than the last one is ignored) and acts on what fell due: the
    /// connector of every export whose lease ran out, and of every load that did not answer
    /// in time, is told (`KvConnector::hold_expired`) and hands the blocks back once its
    /// worker let go of them (a reader may be copying them right now, so they are not freed
    /// here). Deadlines of lifecycle
    /// operations are checked by the next `poll_lifecycle`. Call before every step and
    /// after every wait.
    pub fn advance_time(&mut self, now: Duration) {
        self.now = self.now.max(now);
        let now = self.now;
        let mut expired = Vec::new();
        self.holds.expire(now, &mut expired);
        for (id, holder) in expired {
            match holder {
                Holder::Connector(c) => self.connectors[c.0 as usize].hold_expired(id),
                Holder::Caller => self.end_transfer(id, Holder::Caller),
            }
        }
    }

    /// The core's clock: the latest `now` passed to `advance_time`.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// When the core next needs `advance_time` and `poll_lifecycle` even if no input arrives:
    /// the earliest export lease, or the deadline of a clearing operation's wait. `None`:
    /// nothing is due until an input arrives, so an idle engine may block.
    pub fn next_deadline(&self) -> Option<Duration> {
        let lease = self.holds.next_deadline();
        let reset = self.reset_deadline();
        [lease, reset].into_iter().flatten().min()
    }
}
