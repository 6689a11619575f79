//! A reload of every weight from disk (`update_weights_from_disk`) as one synchronous state
//! machine: which engine calls it makes, in which order, and what each answer leads to. The
//! engine's handle drives it with real files on blocking threads
//! (`EngineHandle::update_weights_from_disk`); the simulation drives the same machine with
//! reads that take simulated time and fail when its schedule says, so every seed runs the
//! order users run, the lost-caller guard included.
//!
//! ```text
//! start ─(files can be read in place)─▶ Check ─ok─▶ LendWeights ─lent─▶ ReadInPlace ─ok─▶ ReturnWeights
//!   │                                     │ refused    │ not lent              │ failed
//!   │                                     ▼            ▼                       ▼
//!   └──(a GGUF file)──────────────────▶ done      ReadNew ─ok─▶ InstallWeights  LoseWeights
//! ```
//!
//! Every reload that can be read in place asks for the lend: the engine lends only in a
//! completed pause (the core decides, `Scheduler::lend_weights`), so a running engine's
//! answer sends the reload to new weights, at the cost of checking the files' headers first
//! (milliseconds). No status is asked before: the answer to the lend is the only one that
//! cannot be stale.
//!
//! The machine does no I/O and keeps no clock: [`DiskReload::start`] and each answer
//! (`answered`, `checked`, `read`) return the next [`Step`] for the driver to take.
//!
//! The guard: weights lent to a reload are the engine's only copy. If the reload is dropped
//! while they may be out (its lend asked for, their return not yet sent: the read failed
//! past the driver, or the caller stopped waiting), it sends [`Call::LoseWeights`] through
//! the driver's sink, so the engine drops them as sleep level 2 would instead of waiting
//! for them forever. Each lend is named ([`LendId`]): a loss or return for another lend is
//! ignored, so a guard that fires late never takes weights lent to a later reload.

use std::sync::atomic::{AtomicU64, Ordering};

use ferry_model::{PreparedWeights, RetiredWeights, WeightError};

use crate::engine_core::{Call, CallResult, LendId};

/// What the driver does next.
#[derive(Debug)]
pub enum Step {
    /// Send this call to the engine; hand its answer to [`DiskReload::answered`].
    Call(Call),
    /// Check every tensor of the files without reading their data; hand the result to
    /// [`DiskReload::checked`].
    Check,
    /// Read the files over these weights, the engine's own, lent; hand the result to
    /// [`DiskReload::read`].
    ReadInPlace(RetiredWeights),
    /// Read the files into new weights; hand the result to [`DiskReload::read`].
    ReadNew,
    /// The reload is over.
    Done(Result<Reloaded, ReloadFailure>),
}

/// A finished reload.
#[derive(Debug)]
pub struct Reloaded {
    pub weight_version: String,
    /// The weights an update into new memory replaced, for the driver to drop off the
    /// engine thread.
    pub retired: Option<RetiredWeights>,
    pub in_place: bool,
    pub n_tensors: usize,
    pub n_bytes: usize,
    pub complete: bool,
}

/// Why a reload ended without new weights, by which stage ended it.
#[derive(Debug)]
pub enum ReloadFailure {
    /// The check or a read into new weights failed: nothing changed.
    Refused,
    /// The read over the lent weights failed midway: they are dropped.
    Torn,
    /// The engine refused the weights (or, for a return, lost them).
    Weights(WeightError),
    /// An answer of the wrong kind: a bug, never a user's error.
    Unexpected(&'static str),
}

/// Where the guard's [`Call::LoseWeights`] goes.
pub type LoseSink = Box<dyn FnOnce(Call) + Send>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    Checking,
    /// The lend is asked for: the weights may be out from now on.
    Lending,
    ReadingInPlace,
    ReadingNew,
    /// The lent weights are on their way back, or known lost.
    Returning,
    Losing,
    Installing,
    Done,
}

/// One reload (see the module docs).
pub struct DiskReload {
    state: State,
    in_place: bool,
    version: Option<String>,
    lend: LendId,
    /// The size of the update read, for the answer.
    read: Option<(usize, usize, bool)>,
    lose: Option<LoseSink>,
}

impl std::fmt::Debug for DiskReload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskReload")
            .field("state", &self.state)
            .field("lend", &self.lend)
            .finish_non_exhaustive()
    }
}

impl DiskReload {
    /// A reload to `version` (none: the next after the current). `in_place`: its files can
    /// be read over the weights (a safetensors folder; a GGUF file is read into new ones).
    /// `lend` names its lend (unique per engine: [`LendId::next`]); `lose` is where the
    /// guard sends its call.
    pub fn new(in_place: bool, version: Option<String>, lend: LendId, lose: LoseSink) -> Self {
        Self {
            state: State::Start,
            in_place,
            version,
            lend,
            read: None,
            lose: Some(lose),
        }
    }

    /// The first step.
    pub fn start(&mut self) -> Step {
        assert_eq!(self.state, State::Start, "a reload starts once");
        if self.in_place {
            self.state = State::Checking;
            Step::Check
        } else {
            self.read_new()
        }
    }

    /// The engine's answer to the last [`Step::Call`].
    pub fn answered(&mut self, answer: CallResult) -> Step {
        match (self.state, answer) {
            (State::Lending, CallResult::Lent(Some(weights))) => {
                self.state = State::ReadingInPlace;
                Step::ReadInPlace(weights)
            }
            // Not in a completed pause after all: read into new weights.
            (State::Lending, CallResult::Lent(None)) => self.read_new(),
            (State::Losing, CallResult::Op(_)) => self.done(Err(ReloadFailure::Torn)),
            (State::Returning | State::Installing, CallResult::Installed(result)) => {
                let in_place = self.state == State::Returning;
                let result = result
                    .map(|(weight_version, retired)| {
                        let (n_tensors, n_bytes, complete) = self.read.unwrap_or_default();
                        Reloaded {
                            weight_version,
                            retired,
                            in_place,
                            n_tensors,
                            n_bytes,
                            complete,
                        }
                    })
                    .map_err(ReloadFailure::Weights);
                self.done(result)
            }
            (_, answer) => {
                tracing::error!(state = ?self.state, ?answer, "a reload's answer of the wrong kind");
                if self.weights_out() {
                    // Whatever was lent is given up, as a failed read gives it up.
                    self.state = State::Losing;
                    return Step::Call(Call::LoseWeights { lend: self.lend });
                }
                self.done(Err(ReloadFailure::Unexpected(
                    "an answer of the wrong kind",
                )))
            }
        }
    }

    /// The check's result: `ok` lends (the read can then fail only if the disk or the
    /// files do), else the reload is refused with nothing changed.
    pub fn checked(&mut self, ok: bool) -> Step {
        assert_eq!(self.state, State::Checking, "a check answers a Check");
        if ok {
            self.state = State::Lending;
            Step::Call(Call::LendWeights { lend: self.lend })
        } else {
            self.done(Err(ReloadFailure::Refused))
        }
    }

    /// The read's result: the weights read (`None`: the read failed).
    pub fn read(&mut self, weights: Option<PreparedWeights>) -> Step {
        let lend = self.lend;
        match (self.state, weights) {
            (State::ReadingInPlace, Some(weights)) => {
                self.note(&weights);
                self.state = State::Returning;
                Step::Call(Call::ReturnWeights {
                    lend,
                    weights,
                    version: self.version.take(),
                })
            }
            (State::ReadingInPlace, None) => {
                self.state = State::Losing;
                Step::Call(Call::LoseWeights { lend })
            }
            (State::ReadingNew, Some(weights)) => {
                self.note(&weights);
                self.state = State::Installing;
                Step::Call(Call::InstallWeights {
                    weights,
                    version: self.version.take(),
                })
            }
            (State::ReadingNew, None) => self.done(Err(ReloadFailure::Refused)),
            (state, _) => panic!("a read answers a Read, not {state:?}"),
        }
    }

    /// Whether the reload ended.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    fn read_new(&mut self) -> Step {
        self.state = State::ReadingNew;
        Step::ReadNew
    }

    fn note(&mut self, weights: &PreparedWeights) {
        self.read = Some((weights.n_tensors, weights.n_bytes, weights.complete));
    }

    fn done(&mut self, result: Result<Reloaded, ReloadFailure>) -> Step {
        self.state = State::Done;
        Step::Done(result)
    }

    /// Whether the engine may hold its weights lent to this reload, with no return or loss
    /// on its way.
    fn weights_out(&self) -> bool {
        matches!(self.state, State::Lending | State::ReadingInPlace)
    }
}

impl Drop for DiskReload {
    fn drop(&mut self) {
        if self.weights_out() {
            if let Some(lose) = self.lose.take() {
                lose(Call::LoseWeights { lend: self.lend });
            }
        }
    }
}

impl LendId {
    /// A lend id no other in this process had.
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}
