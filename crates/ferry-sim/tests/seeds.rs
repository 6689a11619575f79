//! The simulation in CI: 2,000 seeds (1,000 with the offload tier, 1,000 without; set
//! `FERRY_SIM_SEEDS` for more), each a random schedule of requests, lifecycle calls on P, D or
//! both, and network and peer faults, checked after every step (`ferry_sim::sim`). A failure
//! names the seed and its shrunk schedule; `cargo run -p ferry-sim -- --seed N` replays it
//! with a trace. And the checks themselves can fail: corrupted transfers are caught.

use ferry_engine::CallKind;
use ferry_sim::{generate, shrink, ScheduleParams, Sim, SimConfig, Stats, Tier};
use strum::IntoEnumIterator;

fn n_seeds() -> u64 {
    std::env::var("FERRY_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000)
}

/// Runs `n` seeds from `first`; panics with the first failure, shrunk.
fn run_seeds(first: u64, n: u64, tier: Tier) -> Stats {
    let params = ScheduleParams::default();
    let mut total = Stats::default();
    for seed in first..first + n {
        let config = SimConfig {
            tier,
            ..SimConfig::new(seed)
        };
        let schedule = generate(seed, params);
        let outcome = Sim::new(config.clone()).run(&schedule);
        if let Some(f) = &outcome.failure {
            let (short, _) = shrink(&config, &schedule, 200);
            let lines: Vec<String> = short.iter().map(|t| format!("  {t}")).collect();
            panic!(
                "seed {seed} failed at {} ms: {}\nshrunk schedule:\n{}\nreplay: cargo run -p ferry-sim -- --seed {seed} --tier {}",
                f.at_ms,
                f.message,
                lines.join("\n"),
                if tier == Tier::On { "on" } else { "off" }
            );
        }
        let s = outcome.stats;
        total.n_requests += s.n_requests;
        total.n_finished += s.n_finished;
        total.n_aborted += s.n_aborted;
        total.n_failed += s.n_failed;
        total.n_load_faults += s.n_load_faults;
        total.n_runs_under_fail += s.n_runs_under_fail;
        total.n_disconnected += s.n_disconnected;
        total.n_tokens_mixed += s.n_tokens_mixed;
        total.n_tokens_masked += s.n_tokens_masked;
        total.n_tokens_lora += s.n_tokens_lora;
        total.n_lora_refused += s.n_lora_refused;
        total.n_step_failures += s.n_step_failures;
        total.n_kv_batches += s.n_kv_batches;
        total.n_tier_kv_events += s.n_tier_kv_events;
        total.n_ops += s.n_ops;
        total.n_pulls_ok += s.n_pulls_ok;
        total.n_pulls_failed += s.n_pulls_failed;
        total.n_copies += s.n_copies;
        total.n_crashes += s.n_crashes;
        total.n_tokens_checked += s.n_tokens_checked;
        total.n_steps += s.n_steps;
        for (kind, n) in s.calls {
            *total.calls.entry(kind).or_default() += n;
        }
    }
    eprintln!("{n} seeds ({tier:?}): {total:?}");
    total
}

/// The runs must exercise what they claim to: tokens checked (some under a constraint's
/// mask, some under LoRA adapters), requests refused for an adapter not loaded, pulls that succeed and fail, crashes, failed steps, KV events (the tier's with the
/// tier on), tier copies (with the tier on),
/// and requests failed by the faults injected on their loads under `fail` (each one checked
/// to be such a fault); and every lifecycle call the engine core takes, by its name (a call
/// added to `ferry_engine::Call` fails this until the schedules make it).
fn assert_exercised(s: &Stats, n: u64, tier: bool) {
    assert!(s.n_tokens_checked > 50 * n, "{s:?}");
    assert!(s.n_tokens_masked > 5 * n, "{s:?}");
    assert!(s.n_step_failures > n / 4, "{s:?}");
    assert!(s.n_load_faults > n / 10, "{s:?}");
    assert!(s.n_pulls_ok > 3 * n && s.n_pulls_failed > n / 2, "{s:?}");
    assert!(s.n_crashes > n / 4, "{s:?}");
    assert!(s.n_ops > 20 * n, "{s:?}");
    assert_eq!(s.n_copies > 0, tier, "{s:?}");
    assert!(s.n_kv_batches > 20 * n, "{s:?}");
    assert_eq!(s.n_tier_kv_events > 0, tier, "{s:?}");
    // Tokens under LoRA adapters, checked against their version's weights, and requests
    // naming an adapter not loaded, refused as the server's 404.
    assert!(s.n_tokens_lora > 10 * n && s.n_lora_refused > n, "{s:?}");
    for kind in CallKind::iter() {
        let made = s.calls.get(&kind).copied().unwrap_or(0);
        assert!(
            made > n / 10,
            "{kind:?} made {made} times in {n} seeds: {:?}",
            s.calls
        );
    }
}

#[test]
fn seeds_with_the_offload_tier_hold_the_contract() {
    let n = n_seeds();
    let stats = run_seeds(0, n, Tier::On);
    assert_exercised(&stats, n, true);
}

#[test]
fn seeds_without_the_offload_tier_hold_the_contract() {
    let n = n_seeds();
    let stats = run_seeds(1_000_000, n, Tier::Off);
    assert_exercised(&stats, n, false);
}

#[test]
fn a_seed_replays_exactly() {
    let run = |seed| {
        let config = SimConfig {
            trace: true,
            ..SimConfig::new(seed)
        };
        Sim::new(config).run(&generate(seed, ScheduleParams::default()))
    };
    for seed in [7, 8] {
        let (a, b) = (run(seed), run(seed));
        assert!(a.trace.len() > 100, "a trace worth comparing");
        assert_eq!(a.trace, b.trace, "seed {seed}");
    }
    assert_ne!(run(7).trace, run(8).trace);
}

#[test]
fn corrupted_transfers_are_caught_and_shrink_to_a_short_schedule() {
    let params = ScheduleParams::default();
    let mut caught = 0;
    for seed in 0..20 {
        let config = SimConfig {
            corrupt_pulls: true,
            ..SimConfig::new(seed)
        };
        let schedule = generate(seed, params);
        let outcome = Sim::new(config.clone()).run(&schedule);
        let Some(f) = outcome.failure else { continue };
        assert!(
            f.message.contains("oracle") && f.message.contains("its KV is wrong"),
            "seed {seed}: {}",
            f.message
        );
        caught += 1;
        if caught == 1 {
            let (short, again) = shrink(&config, &schedule, 300);
            assert!(
                short.len() <= 3,
                "shrunk to {} actions: {short:?}",
                short.len()
            );
            assert!(again.failure.is_some_and(|g| g.kind() == f.kind()));
        }
    }
    // Some seeds pull nothing, or nothing that is read again before the run ends.
    assert!(
        caught >= 10,
        "only {caught} of 20 seeds saw the corrupted KV"
    );
}

/// A new version of an adapter loaded with its old weights computes its tokens under the old
/// version's seed: the oracle, which knows each version's weights, must say so (and name the
/// adapter and version). The checksum model mixes the adapter's seed into every KV position
/// and the digest, so this is the check that KV or weights of another version, served to a
/// request under this one, are caught.
#[test]
fn tokens_computed_under_a_stale_adapter_are_caught() {
    let params = ScheduleParams::default();
    let mut caught = 0;
    for seed in 0..40 {
        let config = SimConfig {
            stale_lora_weights: true,
            ..SimConfig::new(seed)
        };
        let outcome = Sim::new(config).run(&generate(seed, params));
        let Some(f) = outcome.failure else { continue };
        assert!(
            f.message.contains("oracle")
                && f.message.contains("and adapter a")
                && f.message.contains("its KV is wrong"),
            "seed {seed}: {}",
            f.message
        );
        caught += 1;
    }
    // Many seeds never compute a token under an adapter's second version.
    assert!(
        caught >= 5,
        "only {caught} of 40 seeds caught the stale adapter"
    );
}
