//! The `ferry` command line: benchmarks and model tools (the server comes with its own issue).

use clap::{Parser, Subcommand};

mod bench_model;
mod bench_scheduler;
mod bench_serve;
mod make_model;

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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(BenchCommand::Scheduler(args)) => bench_scheduler::run(args),
        Command::Bench(BenchCommand::Model(args)) => bench_model::run(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run(args),
        Command::MakeModel(cmd) => make_model::run(cmd),
    }
}
