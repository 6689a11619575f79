//! A reload from disk on one simulated engine: the engine's own machine
//! (`ferry_engine::DiskReload`, the one `EngineHandle::update_weights_from_disk` drives),
//! driven here with a check and a read that take simulated time and fail when the schedule
//! says, and a caller that may go away at any moment (the machine's guard then gives up the
//! weights it may have been lent).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::OpId;
use ferry_engine::{Call, CallResult, DiskReload, LendId, ReloadFailure, ReloadStep, WeightStore};
use ferry_model::{RetiredWeights, WeightPreparer};

use crate::schedule::ReloadFault;

/// Calls a reload's guard sent (it was dropped with the weights out), for the engine's
/// queue.
pub type Guarded = Arc<Mutex<Vec<Call>>>;

/// What a reload waits for.
#[derive(Debug)]
enum Wait {
    /// The engine's answer to its call.
    Call(OpId),
    /// Its check or read, done at `due`.
    Io {
        due: Duration,
        io: Io,
    },
    Done,
}

#[derive(Debug)]
enum Io {
    Check,
    InPlace(RetiredWeights),
    New,
}

/// One reload in flight (see the module docs).
#[derive(Debug)]
pub struct SimReload {
    /// The simulation's id for its reply.
    pub op: u64,
    machine: DiskReload,
    wait: Wait,
    check_ms: u8,
    read_ms: u8,
    fault: ReloadFault,
    /// When its caller goes away (`CallerLeaves`).
    pub leaves_at: Option<Duration>,
}

/// What a reload's step led to.
#[derive(Debug)]
pub enum Next {
    /// Make this call; [`SimReload::called`] with its id.
    Call(Call),
    /// Nothing until an answer or `due`.
    Wait,
    /// Over: the reply to the caller.
    Done(Result<(), String>),
}

impl SimReload {
    /// A reload of `op` at `now`, to `version`, lending as `lend`; its guard's calls go to
    /// `guarded`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        op: u64,
        now: Duration,
        (in_place, check_ms, read_ms, fault): (bool, u8, u8, ReloadFault),
        version: String,
        lend: LendId,
        guarded: &Guarded,
    ) -> (Self, Next) {
        let sink = Arc::clone(guarded);
        let mut machine = DiskReload::new(
            in_place,
            Some(version),
            lend,
            Box::new(move |call| {
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(call)
            }),
        );
        let first = machine.start();
        let leaves_at = match fault {
            ReloadFault::CallerLeaves { ms } => Some(now + ms_(ms)),
            _ => None,
        };
        let mut reload = Self {
            op,
            machine,
            wait: Wait::Done,
            check_ms,
            read_ms,
            fault,
            leaves_at,
        };
        let next = reload.take(first, now);
        (reload, next)
    }

    /// Its call went to the engine as `id`.
    pub fn called(&mut self, id: OpId) {
        self.wait = Wait::Call(id);
    }

    /// Whether it waits for the answer to `id`.
    pub fn waits_for(&self, id: OpId) -> bool {
        matches!(self.wait, Wait::Call(w) if w == id)
    }

    /// The engine's answer to its call, at `now`.
    pub fn answered(&mut self, answer: CallResult, now: Duration) -> Next {
        let step = self.machine.answered(answer);
        self.take(step, now)
    }

    /// When its check or read is done, if it waits for one.
    pub fn due(&self) -> Option<Duration> {
        match &self.wait {
            Wait::Io { due, .. } => Some(*due),
            _ => None,
        }
    }

    /// Its check or read, done at `now` (as the fault says), with `preparer` the engine's.
    pub fn io_done(&mut self, now: Duration, preparer: &dyn WeightPreparer) -> Next {
        let Wait::Io { io, .. } = std::mem::replace(&mut self.wait, Wait::Done) else {
            unreachable!("io_done is called at an io's due time")
        };
        let read = |ok: bool| {
            // The checksum model's weights are weightless: a read makes an empty complete
            // update, as a reload into new weights or over the lent ones would.
            ok.then(|| preparer.prepare(WeightStore::default()).ok())
                .flatten()
        };
        let step = match io {
            Io::Check => self.machine.checked(self.fault != ReloadFault::CheckFails),
            Io::InPlace(lent) => {
                drop(lent);
                let weights = read(self.fault != ReloadFault::ReadFails);
                self.machine.read(weights)
            }
            Io::New => self
                .machine
                .read(read(self.fault != ReloadFault::ReadFails)),
        };
        self.take(step, now)
    }

    fn take(&mut self, step: ReloadStep, now: Duration) -> Next {
        let io = |io, ms| Wait::Io {
            due: now + ms_(ms),
            io,
        };
        self.wait = match step {
            ReloadStep::Call(call) => return Next::Call(call),
            ReloadStep::Check => io(Io::Check, self.check_ms),
            ReloadStep::ReadInPlace(lent) => io(Io::InPlace(lent), self.read_ms),
            ReloadStep::ReadNew => io(Io::New, self.read_ms),
            ReloadStep::Done(result) => {
                self.wait = Wait::Done;
                return Next::Done(result.map(drop).map_err(|e| match e {
                    ReloadFailure::Refused => "the reload was refused".to_owned(),
                    ReloadFailure::Torn => "the read failed midway: the weights are lost".into(),
                    ReloadFailure::Weights(w) => format!("weight update refused: {w}"),
                    ReloadFailure::Unexpected(what) => format!("reload: {what}"),
                }));
            }
        };
        Next::Wait
    }
}

fn ms_(ms: u8) -> Duration {
    Duration::from_millis(u64::from(ms))
}
