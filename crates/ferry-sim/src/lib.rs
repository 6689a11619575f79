//! ferry-sim: a deterministic simulation of a P and a D engine, the offload tier and a faulty
//! network, driven by a seeded schedule of client requests, lifecycle calls and faults, with
//! the lifecycle contract (`../shared/design/lifecycle.md`) checked after every step.
//!
//! The key decision: simulate around the real code, not a model of it. Each engine is the
//! real core (`ferry_core::Scheduler` with the real P/D and offload connectors) stepped by the
//! shared step driver, the checksum executor over a real KV arena, and the real P/D worker;
//! only what would need threads, clocks or sockets is replaced, by deterministic stand-ins
//! that keep the real contracts and reuse the real code paths where there is code to reuse:
//! the network (`net.rs`, a `ferry_kv::Transport` whose pulls run P's own checks and copy
//! real bytes), the offload copier (`copier.rs`, running `ferry_kv::HostMemory`), the engine
//! loop's turn (`engine.rs`) and time (a simulated millisecond clock; leases and bounds
//! expire in it). A seed fixes everything, so a failing seed replays exactly, with a
//! readable trace, and shrinks to a short schedule (`shrink.rs`).
//!
//! What a run checks is listed in `sim.rs`; the oracle for tokens is in `engine.rs`.

pub mod client;
pub mod copier;
pub mod engine;
pub mod net;
pub mod rng;
pub mod schedule;
pub mod shrink;
pub mod sim;

pub use schedule::{generate, ScheduleParams, Timed};
pub use shrink::shrink;
pub use sim::{Failure, Outcome, Sim, SimConfig, Stats, Tier};

/// Runs seed `config.seed` on the schedule it draws.
pub fn run_seed(config: &SimConfig, params: ScheduleParams) -> Outcome {
    let schedule = generate(config.seed, params);
    Sim::new(config.clone()).run(&schedule)
}
