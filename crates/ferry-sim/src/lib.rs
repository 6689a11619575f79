//! ferry-sim: a deterministic simulation of a P and a D engine, the offload tier and a faulty
//! network, driven by a seeded schedule of client requests, lifecycle calls and faults, with
//! the lifecycle contract (`../shared/design/lifecycle.md`) checked after every step.
//!
//! The key decision: simulate around the real code, not a model of it. Each engine is the
//! engine thread's own core, `ferry_engine::EngineCore` (the step, the lifecycle events and
//! wake-up, the structured-output masks, the recovery from a failed step; the real P/D and
//! offload connectors), over the checksum executor, a real KV arena and the real P/D worker;
//! only what would need threads, clocks or sockets is replaced, by deterministic stand-ins
//! that keep the real contracts and reuse the real code paths where there is code to reuse:
//! the network (`net.rs`, a `ferry_kv::Transport` whose pulls run P's own checks and copy
//! real bytes), the offload copier (`copier.rs`, running `ferry_kv::HostMemory`), the masks
//! (computed inline, by the real llguidance matcher over the tiny model's tokenizer) and
//! time (a simulated millisecond clock; leases and bounds expire in it). `engine.rs` and `setup.rs`
//! are only the wiring. A seed fixes everything, so a failing seed replays exactly, with a
//! readable trace, and shrinks to a short schedule (`shrink.rs`).
//!
//! What a run checks is listed in `sim.rs`; the oracle for tokens is in `oracle.rs`, the
//! check of the KV events against the prefix cache in `kv_view.rs`.

pub mod adapters;
pub mod client;
pub mod copier;
pub mod engine;
pub mod kv_view;
pub mod messages;
pub mod net;
pub mod oracle;
pub mod reload;
pub mod rng;
pub mod schedule;
pub mod setup;
pub mod shrink;
pub mod sim;

pub use schedule::{generate, ScheduleParams, Timed};
pub use shrink::shrink;
pub use sim::{Failure, Outcome, Sim, SimConfig, Stats, Tier};

/// Runs seed `config.seed` on the schedule it draws.
pub fn run_seed(config: &SimConfig, params: ScheduleParams) -> Outcome {
    let schedule = generate(config.seed, params);
    run(config, &schedule)
}

/// Runs `schedule`; a panic anywhere in the engines (an assertion the code under test makes)
/// is a failure of the run, not of the caller.
pub fn run(config: &SimConfig, schedule: &[Timed]) -> Outcome {
    let sim = Sim::new(config.clone());
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.run(schedule))).unwrap_or_else(
        |panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".into());
            Outcome {
                seed: config.seed,
                failure: Some(Failure {
                    at_ms: 0,
                    message: format!("panic: {message}"),
                }),
                stats: Stats::default(),
                trace: Vec::new(),
            }
        },
    )
}
