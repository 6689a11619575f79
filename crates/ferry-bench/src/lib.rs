//! `ferry bench ...`: the benchmarks of the `ferry` command line, each a subcommand that
//! prints JSON (or a readable summary). The binary embeds [`BenchCommand`] as its `bench`
//! subcommand and calls [`run`]; everything else is here.
//!
//! Like the binary, this crate is the command line's edge: flags are parsed here (clap's
//! derive), and errors go to the person at the terminal (`anyhow`), never matched on. The
//! fleet benchmarks (`route`, `agentic`, `weight-sync`) start `ferry serve` and `ferry proxy` processes
//! (`child.rs`) from the binary the caller names.

use std::path::Path;

use clap::Subcommand;

mod agentic;
mod child;
mod lifecycle;
mod lora;
mod model;
mod offload;
mod route;
mod scheduler;
mod serve;
mod transfer;
mod weight_sync;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Replay a request trace through the scheduler with a fake model.
    Scheduler(scheduler::Args),
    /// Prefill and decode throughput of a model.
    Model(model::Args),
    /// Decode and prefill with LoRA adapters mixed in the batch against the base alone,
    /// interleaved in one process.
    Lora(lora::Args),
    /// Load a running OpenAI-compatible server and report throughput and latency.
    Serve(serve::Args),
    /// Time and memory of the lifecycle operations (pause, resume, reset, sleep, weight
    /// reload) on an in-process engine under load.
    Lifecycle(lifecycle::Args),
    /// KV transfer throughput P→D through two TCP transports on loopback, against plain
    /// loopback TCP.
    Transfer(transfer::Args),
    /// Weight sync: a bucketed upload of the model's f32 tensors to `ferry serve` (and through
    /// `ferry proxy` to 1P1D) against plain loopback sockets, the one-body push, and a reload
    /// from disk against `cat`, in one run.
    WeightSync(weight_sync::Args),
    /// The CPU offload tier: store and load throughput against memcpy, and time to first
    /// token on repeated prefixes that do not fit the KV cache, with and without the tier.
    Offload(offload::Args),
    /// `ferry proxy`'s routing policies on a shared-prefix workload: TTFT, prefix-cache hit
    /// rate, misses and stale routes per policy, against one instance with all the KV.
    Route(route::Args),
    /// A multi-turn tool-use workload through `ferry proxy` over a fleet, under round-robin,
    /// under `--routing kv`, and with the session header and no KV events: cached context and
    /// TTFT per turn.
    Agentic(agentic::Args),
}

/// Runs `command`; `ferry` is the `ferry` binary, which the fleet benchmarks start as their
/// servers and proxies.
pub fn run(command: BenchCommand, ferry: &Path) -> anyhow::Result<()> {
    match command {
        BenchCommand::Scheduler(args) => scheduler::run(args),
        BenchCommand::Model(args) => model::run(args),
        BenchCommand::Lora(args) => lora::run(args),
        BenchCommand::Serve(args) => serve::run(args),
        BenchCommand::Lifecycle(args) => lifecycle::run(args),
        BenchCommand::Transfer(args) => transfer::run(args),
        BenchCommand::WeightSync(args) => weight_sync::run(args, ferry),
        BenchCommand::Offload(args) => offload::run(args),
        BenchCommand::Route(args) => route::run(args, ferry),
        BenchCommand::Agentic(args) => agentic::run(args, ferry),
    }
}
