//! `cargo run -p ferry-sim -- --seed N`: replays one seed with a readable trace (and, when it
//! fails, shrinks it to a short schedule and prints that); `--seeds A..B` runs a range and
//! names the failing seeds.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use ferry_sim::{generate, run, shrink, ScheduleParams, SimConfig, Tier};

#[derive(Debug, Parser)]
#[command(about = "Deterministic simulation of P, D, the offload tier and a faulty network")]
struct Args {
    /// Replay this seed with a trace.
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run the seeds `A..B` (end excluded) and report the failing ones.
    #[arg(long, value_name = "A..B")]
    seeds: Option<String>,
    /// Milliseconds of scheduled activity per run (before quiescing).
    #[arg(long, default_value_t = ScheduleParams::default().n_ticks)]
    ticks: u32,
    /// The offload tier: drawn from the seed, on, or off.
    #[arg(long, default_value = "drawn", value_parser = ["drawn", "on", "off"])]
    tier: String,
    /// Do not shrink a failing seed.
    #[arg(long)]
    no_shrink: bool,
    /// Print the schedule's actions only, not every step.
    #[arg(long)]
    brief: bool,
    /// With --seeds: print only the summary.
    #[arg(long)]
    quiet: bool,
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let tier = match args.tier.as_str() {
        "on" => Tier::On,
        "off" => Tier::Off,
        _ => Tier::Drawn,
    };
    let params = ScheduleParams {
        n_ticks: args.ticks,
        ..ScheduleParams::default()
    };
    let config = |seed| SimConfig {
        tier,
        ..SimConfig::new(seed)
    };
    if let Some(range) = &args.seeds {
        let (a, b) = range
            .split_once("..")
            .ok_or_else(|| anyhow::anyhow!("--seeds takes A..B, got {range:?}"))?;
        let (a, b): (u64, u64) = (a.parse()?, b.parse()?);
        let started = Instant::now();
        let mut failed = Vec::new();
        // Panics are counted as failures (with their message), not printed as they happen.
        std::panic::set_hook(Box::new(|_| {}));
        for seed in a..b {
            let outcome = run(&config(seed), &generate(seed, params));
            if let Some(f) = outcome.failure {
                if !args.quiet {
                    println!("seed {seed}: FAILED at {} ms: {}", f.at_ms, f.message);
                }
                failed.push((seed, f.message));
            }
        }
        println!(
            "{} seeds in {:.1} s, {} failed{}",
            b.saturating_sub(a),
            started.elapsed().as_secs_f64(),
            failed.len(),
            match failed.first() {
                None => String::new(),
                Some((seed, message)) => format!(
                    "; the first is seed {seed}, the {}th run ({message}); replay it with --seed {seed}",
                    seed - a + 1
                ),
            }
        );
        return Ok(if failed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let seed = args.seed.unwrap_or(0);
    let schedule = generate(seed, params);
    let traced = SimConfig {
        trace: true,
        ..config(seed)
    };
    let outcome = run(&traced, &schedule);
    for line in &outcome.trace {
        let action = !line.contains(": step ") && !line.contains("copier finished");
        if !args.brief || action {
            println!("{line}");
        }
    }
    println!("seed {seed}: {:?}", outcome.stats);
    let Some(failure) = outcome.failure else {
        println!("seed {seed}: passed");
        return Ok(ExitCode::SUCCESS);
    };
    println!(
        "seed {seed}: FAILED at {} ms: {}",
        failure.at_ms, failure.message
    );
    if !args.no_shrink {
        let (short, outcome) = shrink(&traced, &schedule, 400);
        println!(
            "\nshrunk from {} to {} actions (the same kind of failure):",
            schedule.len(),
            short.len()
        );
        for t in &short {
            println!("  {t}");
        }
        println!("\ntrace of the shrunk schedule:");
        for line in &outcome.trace {
            println!("{line}");
        }
    }
    Ok(ExitCode::FAILURE)
}
