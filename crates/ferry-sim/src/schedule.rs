//! A run's schedule: what the outside world does and when (clients, the admin caller, faults),
//! drawn from a seed. Each action names what it acts on relative to the state it meets ("the
//! k-th live request"), so any subset of a schedule is still a schedule: that is what lets a
//! failing run shrink to a few actions.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use ferry_core::{PauseMode, SleepLevel, WakeTag};
use ferry_engine::Call;
use ferry_model::{WeightPreparer, WeightStore};

use crate::rng::Rng;

/// The names of the LoRA adapters the engines serve (loaded, replaced and unloaded by the
/// schedule; a request names one by its index here).
pub const LORA_NAMES: [&str; 3] = ["a0", "a1", "a2"];

/// Which engines an admin call or fault reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    P,
    D,
    /// Both, at the same moment (the proxy fans admin calls out).
    Both,
}

impl Target {
    pub fn engines(self) -> &'static [Side] {
        match self {
            Target::P => &[Side::P],
            Target::D => &[Side::D],
            Target::Both => &[Side::P, Side::D],
        }
    }
}

/// One of the two engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    P,
    D,
}

impl Side {
    pub fn idx(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Side::P => "P",
            Side::D => "D",
        }
    }
}

/// How a client's request travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Through the proxy: prefill on P (`max_tokens: 1`, export), then decode on D.
    Disaggregated,
    /// Straight to one engine, as a plain server (a P or D answers those too).
    Direct(Side),
}

/// A lifecycle call, as the admin API makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Pause {
        mode: PauseMode,
        clear_cache: bool,
    },
    Resume,
    Sleep {
        level: SleepLevel,
        mode: PauseMode,
    },
    /// Bit 0: `weights`, bit 1: `kv_cache`; 0 means no tags (everything).
    WakeUp {
        tags: u8,
    },
    ReleaseKv,
    ResetPrefixCache {
        running: bool,
        connector: bool,
    },
    AbortAll,
    /// Abort the `pick`-th live request (modulo their number), by id.
    AbortOne {
        pick: u16,
    },
    /// A weight update in place (a push): a new version, the same on every target.
    WeightUpdate,
    /// A reload from disk (`update_weights_from_disk`), driven by the engine's own machine
    /// (`ferry_engine::DiskReload`): read over the weights in a completed pause when
    /// `in_place` (a safetensors folder; a GGUF file never is), else into new ones. Its
    /// check takes `check_ms` and its read `read_ms` of simulated time; `fault` says what
    /// goes wrong.
    Reload {
        in_place: bool,
        check_ms: u8,
        read_ms: u8,
        fault: ReloadFault,
    },
    /// A new name for the weights (`update_weight_version`).
    SetWeightVersion,
    /// The engine's lifecycle status and weights (`is_paused`, `weight_info`, ...).
    Status,
    /// Loads the LoRA adapter `LORA_NAMES[name]` (`load_lora_adapter`), or replaces a loaded
    /// one's weights under its next version (`inplace`). Its weights are those of its name
    /// and the version the engine gives it (`crate::adapters::adapter`).
    LoadLora {
        name: u8,
        inplace: bool,
    },
    /// Unloads the LoRA adapter `LORA_NAMES[name]` (`unload_lora_adapter`).
    UnloadLora {
        name: u8,
    },
}

/// What goes wrong in a reload from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadFault {
    None,
    /// A tensor's header does not match: refused before anything is lent.
    CheckFails,
    /// The disk fails midway through the read (over lent weights: they are lost).
    ReadFails,
    /// The caller goes away after `ms`, wherever the reload is then.
    CallerLeaves {
        ms: u8,
    },
}

/// A fault of the network or of a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The engine's transfer link is down for `ms`: pulls to or from it fail.
    LinkDown { side: Side, ms: u32 },
    /// The engine dies (all its state is lost) and a fresh one starts after `ms`.
    Crash { side: Side, ms: u32 },
    /// The next `n` pulls take `ms` each (past the load bound when long).
    Slow { n: u8, ms: u32 },
    /// The next pull breaks after `good` blocks (P keeps its export).
    BreakPull { good: u8 },
    /// The next pull is served (P hears it was pulled) but D's side of it fails.
    LostAfterServe,
    /// Time jumps by `ms` with nothing else happening (leases and bounds fall due).
    TimeJump { ms: u32 },
    /// The engine's next `n` forwards fail (the executor errs; the engine recovers).
    StepFails { side: Side, n: u8 },
}

/// What happens at one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A client request: a prompt of `prefix` (one of a few shared prefixes, 0 = none) and
    /// `extra` tokens of its own.
    Arrive {
        route: Route,
        prefix: u8,
        extra: u8,
        max_tokens: u8,
        /// Under a structured-output constraint (the engines' masks).
        constrained: bool,
        /// Under the LoRA adapter `LORA_NAMES[i]`, by name (refused where none is loaded).
        lora: Option<u8>,
    },
    /// The `pick`-th live client request's client goes away.
    Disconnect {
        pick: u16,
    },
    Op {
        target: Target,
        op: OpKind,
    },
    /// A trainer's cycle on both engines, each call after the last replied: pause with
    /// `mode` (clearing), the weight update `update`, resume.
    RlCycle {
        mode: PauseMode,
        update: CycleUpdate,
    },
    Fault(Fault),
}

/// How a trainer's cycle updates the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CycleUpdate {
    /// One install of new weights.
    Install,
    /// A reload from disk, in place (the engines are paused), taking `ms` to read.
    Reload { ms: u8 },
    /// A reload in place whose read fails midway (the weights are lost); the trainer does
    /// what the reply says: a complete install, a wake-up of the weights, then the resume.
    ReloadFails { ms: u8 },
}

impl CycleUpdate {
    /// The calls it makes, in turn, between the pause and the resume.
    pub fn calls(self) -> Vec<OpKind> {
        let reload = |read_ms, fault| OpKind::Reload {
            in_place: true,
            check_ms: 1,
            read_ms,
            fault,
        };
        match self {
            Self::Install => vec![OpKind::WeightUpdate],
            Self::Reload { ms } => vec![reload(ms, ReloadFault::None)],
            Self::ReloadFails { ms } => vec![
                reload(ms, ReloadFault::ReadFails),
                OpKind::WeightUpdate,
                OpKind::WakeUp { tags: 1 },
            ],
        }
    }
}

/// An action at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timed {
    pub tick: u32,
    pub action: Action,
}

/// Shapes of the schedules a seed draws.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleParams {
    /// Ticks (milliseconds of simulated time) the schedule spans.
    pub n_ticks: u32,
    /// Roughly one action every this many ticks.
    pub mean_gap: u32,
}

impl Default for ScheduleParams {
    fn default() -> Self {
        Self {
            n_ticks: 400,
            mean_gap: 4,
        }
    }
}

const MODES: [PauseMode; 3] = [PauseMode::Abort, PauseMode::Wait, PauseMode::Keep];

fn mode(rng: &mut Rng) -> PauseMode {
    MODES[rng.below(3) as usize]
}

fn side(rng: &mut Rng) -> Side {
    if rng.bool() {
        Side::P
    } else {
        Side::D
    }
}

fn target(rng: &mut Rng) -> Target {
    rng.weighted(&[(2, Target::P), (2, Target::D), (3, Target::Both)])
}

fn op(rng: &mut Rng) -> OpKind {
    match rng.below(21) {
        0..=2 => OpKind::Pause {
            mode: mode(rng),
            clear_cache: rng.chance(2, 3),
        },
        3..=5 => OpKind::Resume,
        6 => OpKind::Sleep {
            level: [SleepLevel::L0, SleepLevel::L1, SleepLevel::L2][rng.below(3) as usize],
            mode: if rng.bool() {
                PauseMode::Abort
            } else {
                PauseMode::Wait
            },
        },
        7 => OpKind::WakeUp {
            tags: rng.below(4) as u8,
        },
        8 => OpKind::ReleaseKv,
        9 | 10 => OpKind::ResetPrefixCache {
            running: rng.bool(),
            connector: rng.bool(),
        },
        11 => OpKind::AbortAll,
        12 => OpKind::AbortOne {
            pick: rng.below(64) as u16,
        },
        13 => match rng.below(3) {
            0 => OpKind::WeightUpdate,
            _ => reload(rng),
        },
        14 => OpKind::SetWeightVersion,
        15 => OpKind::Status,
        16..=18 => OpKind::LoadLora {
            name: rng.below(LORA_NAMES.len() as u64) as u8,
            inplace: false,
        },
        19 => OpKind::LoadLora {
            name: rng.below(LORA_NAMES.len() as u64) as u8,
            inplace: true,
        },
        _ => OpKind::UnloadLora {
            name: rng.below(LORA_NAMES.len() as u64) as u8,
        },
    }
}

fn reload(rng: &mut Rng) -> OpKind {
    let (check_ms, read_ms) = (rng.below(4) as u8, rng.below(40) as u8);
    let leaves_after = rng.below(u64::from(check_ms) + u64::from(read_ms) + 3) as u8;
    let fault = rng.weighted(&[
        (4, ReloadFault::None),
        (1, ReloadFault::CheckFails),
        (2, ReloadFault::ReadFails),
        (1, ReloadFault::CallerLeaves { ms: leaves_after }),
    ]);
    OpKind::Reload {
        in_place: rng.chance(7, 8),
        check_ms,
        read_ms,
        fault,
    }
}

fn fault(rng: &mut Rng) -> Fault {
    match rng.below(9) {
        0 => Fault::LinkDown {
            side: side(rng),
            ms: rng.range(5, 400) as u32,
        },
        1 => Fault::Crash {
            side: side(rng),
            ms: rng.range(1, 200) as u32,
        },
        2 | 3 => Fault::Slow {
            n: rng.range(1, 4) as u8,
            ms: if rng.bool() {
                rng.range(20, 200) as u32
            } else {
                rng.range(600, 3000) as u32
            },
        },
        4 => Fault::BreakPull {
            good: rng.below(4) as u8,
        },
        5 => Fault::LostAfterServe,
        6 => Fault::StepFails {
            side: side(rng),
            n: rng.range(1, 3) as u8,
        },
        _ => Fault::TimeJump {
            ms: rng.range(100, 4000) as u32,
        },
    }
}

/// The schedule `seed` draws.
pub fn generate(seed: u64, params: ScheduleParams) -> Vec<Timed> {
    let mut rng = Rng::new(seed, 1);
    let mut out = Vec::new();
    let mut tick = 0u32;
    loop {
        tick += rng.range(0, 2 * u64::from(params.mean_gap)) as u32;
        if tick >= params.n_ticks {
            return out;
        }
        let action = match rng.below(100) {
            0..=54 => Action::Arrive {
                route: rng.weighted(&[
                    (6, Route::Disaggregated),
                    (2, Route::Direct(Side::D)),
                    (1, Route::Direct(Side::P)),
                ]),
                prefix: rng.below(4) as u8,
                extra: rng.range(1, 12) as u8,
                max_tokens: rng.range(1, 10) as u8,
                constrained: rng.chance(1, 5),
                // The first adapter (loaded as an engine starts) half the time.
                lora: if rng.chance(1, 3) {
                    Some(rng.weighted(&[(2, 0), (1, 1), (1, 2)]))
                } else {
                    None
                },
            },
            55..=61 => Action::Disconnect {
                pick: rng.below(64) as u16,
            },
            62..=85 => Action::Op {
                target: target(&mut rng),
                op: op(&mut rng),
            },
            86..=92 => {
                let in_place = rng.bool();
                let mode = mode(&mut rng);
                let ms = rng.below(30) as u8;
                let update = match (in_place, in_place && rng.chance(1, 4)) {
                    (false, _) => CycleUpdate::Install,
                    (true, false) => CycleUpdate::Reload { ms },
                    (true, true) => CycleUpdate::ReloadFails { ms },
                };
                Action::RlCycle { mode, update }
            }
            _ => Action::Fault(fault(&mut rng)),
        };
        out.push(Timed { tick, action });
    }
}

impl OpKind {
    /// The engine core's call for this admin call: `live` are the engine's live requests (for
    /// `AbortOne`), `preparer` gives the engine's weight preparer (for an update). `None`
    /// for a reload, which is no one call but the calls of its machine, and for an adapter's
    /// load, whose weights depend on the engine's versions (both in
    /// `crate::engine::SimEngine`).
    pub fn call(
        self,
        live: &BTreeSet<String>,
        preparer: impl FnOnce() -> Arc<dyn WeightPreparer>,
        version: String,
    ) -> Result<Option<Call>, String> {
        Ok(Some(match self {
            OpKind::Pause { mode, clear_cache } => Call::Pause { mode, clear_cache },
            OpKind::Sleep { level, mode } => Call::Sleep { level, mode },
            OpKind::Resume => Call::Resume,
            OpKind::WakeUp { tags } => Call::WakeUp {
                tags: [(1, WakeTag::Weights), (2, WakeTag::KvCache)]
                    .iter()
                    .filter(|(bit, _)| tags & bit != 0)
                    .map(|&(_, t)| t)
                    .collect(),
            },
            OpKind::ReleaseKv => Call::ReleaseKvCacheMemory,
            OpKind::ResetPrefixCache { running, connector } => Call::ResetPrefixCache {
                reset_running_requests: running,
                reset_connector: connector,
            },
            OpKind::AbortAll => Call::AbortRequests { ids: None },
            OpKind::AbortOne { pick } => {
                let n = live.len().max(1);
                Call::AbortRequests {
                    ids: Some(
                        live.iter()
                            .nth(usize::from(pick) % n)
                            .cloned()
                            .into_iter()
                            .collect(),
                    ),
                }
            }
            // An update in place: new (weightless) weights and the new version.
            OpKind::WeightUpdate => Call::InstallWeights {
                weights: preparer()
                    .prepare(WeightStore::default())
                    .map_err(|e| e.to_string())?,
                version: Some(version),
            },
            OpKind::SetWeightVersion => Call::SetWeightVersion { version },
            OpKind::Status => Call::Status,
            OpKind::UnloadLora { name } => Call::UnloadLora {
                name: LORA_NAMES[usize::from(name)].into(),
            },
            OpKind::Reload { .. } | OpKind::LoadLora { .. } => return Ok(None),
        }))
    }

    /// Whether the call makes a new weight version (a fresh one is drawn for it).
    pub fn sets_version(self) -> bool {
        matches!(
            self,
            OpKind::WeightUpdate | OpKind::Reload { .. } | OpKind::SetWeightVersion
        )
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Target::P => "P",
            Target::D => "D",
            Target::Both => "P+D",
        })
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            OpKind::Pause { mode, clear_cache } => write!(
                f,
                "pause(mode={}, clear_cache={clear_cache})",
                mode.as_str()
            ),
            OpKind::Resume => f.write_str("resume()"),
            OpKind::Sleep { level, mode } => {
                write!(f, "sleep(level={}, mode={})", level.as_u8(), mode.as_str())
            }
            OpKind::WakeUp { tags } => {
                let names: Vec<&str> = [(1, "weights"), (2, "kv_cache")]
                    .iter()
                    .filter(|(bit, _)| tags & bit != 0)
                    .map(|(_, n)| *n)
                    .collect();
                write!(f, "wake_up(tags=[{}])", names.join(", "))
            }
            OpKind::ReleaseKv => f.write_str("release_kv_cache_memory()"),
            OpKind::ResetPrefixCache { running, connector } => write!(
                f,
                "reset_prefix_cache(reset_running_requests={running}, reset_connector={connector})"
            ),
            OpKind::AbortAll => f.write_str("abort_requests(all)"),
            OpKind::AbortOne { pick } => write!(f, "abort_requests([live #{pick}])"),
            OpKind::WeightUpdate => f.write_str("update_weights()"),
            OpKind::Reload {
                in_place,
                check_ms,
                read_ms,
                fault,
            } => {
                write!(
                    f,
                    "update_weights_from_disk({}, check {check_ms} ms, read {read_ms} ms",
                    if in_place { "safetensors" } else { "gguf" }
                )?;
                match fault {
                    ReloadFault::None => f.write_str(")"),
                    ReloadFault::CheckFails => f.write_str(", the check fails)"),
                    ReloadFault::ReadFails => f.write_str(", the read fails midway)"),
                    ReloadFault::CallerLeaves { ms } => {
                        write!(f, ", the caller leaves after {ms} ms)")
                    }
                }
            }
            OpKind::SetWeightVersion => f.write_str("update_weight_version()"),
            OpKind::Status => f.write_str("status()"),
            OpKind::LoadLora { name, inplace } => write!(
                f,
                "load_lora_adapter({}{})",
                LORA_NAMES[usize::from(name)],
                if inplace { ", load_inplace" } else { "" }
            ),
            OpKind::UnloadLora { name } => {
                write!(f, "unload_lora_adapter({})", LORA_NAMES[usize::from(name)])
            }
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Arrive {
                route,
                prefix,
                extra,
                max_tokens,
                constrained,
                lora,
            } => {
                let route = match route {
                    Route::Disaggregated => "P→D".to_owned(),
                    Route::Direct(s) => format!("{} only", s.name()),
                };
                write!(
                    f,
                    "client: request via {route}, prefix {prefix} + {extra} tokens, max_tokens {max_tokens}{}{}",
                    if *constrained { ", constrained" } else { "" },
                    lora.map(|i| format!(", adapter {}", LORA_NAMES[usize::from(i)]))
                        .unwrap_or_default()
                )
            }
            Action::Disconnect { pick } => write!(f, "client: live request #{pick} disconnects"),
            Action::Op { target, op } => write!(f, "admin {target}: {op}"),
            Action::RlCycle { mode, update } => {
                let calls: Vec<String> = update.calls().iter().map(|c| c.to_string()).collect();
                write!(
                    f,
                    "trainer P+D: pause({}, clear_cache) → {} → resume",
                    mode.as_str(),
                    calls.join(" → ")
                )
            }
            Action::Fault(fault) => write!(f, "fault: {fault:?}"),
        }
    }
}

impl fmt::Display for Timed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}ms {}", self.tick, self.action)
    }
}
