//! End to end: `ferry bench lifecycle --model tiny` runs every phase on the real binary and
//! prints one JSON object with every key and sane values. No timing thresholds: only that
//! each figure exists, is finite and positive where it must be, that the counts add up, and
//! that the memory a sleep or KV release frees is really returned (RSS drops). (Resident
//! memory across weight updates is bounded by `ferry-engine`'s `tests/weight_memory.rs`, on
//! a model large enough to measure; the tiny model's updates are below the noise.)

use std::process::Command;

use serde_json::Value;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
const IN_FLIGHT: u64 = 8;
const OUTPUT_LEN: u64 = 256;
const N_UPDATES: usize = 3;

/// Millisecond figures that are round trips or sums of work: always above zero.
const POSITIVE_MS: &[&str] = &[
    "pause_keep_ms",
    "resume_ms",
    "pause_keep_clear_ms",
    "pause_wait_clear_ms",
    "cycle_pause_ms",
    "cycle_prepare_ms",
    "cycle_install_ms",
    "cycle_resume_ms",
    "cycle_total_ms",
    "pause_keep_engine_ms",
    "resume_engine_ms",
    "pause_keep_clear_engine_ms",
    "cycle_engine_ms",
    "push_ms",
    "reload_ms",
];

/// Differences of two observed instants: zero is possible.
const NON_NEGATIVE_MS: &[&str] = &[
    "pause_keep_after_step_ms",
    "pause_keep_clear_after_step_ms",
    "pause_wait_clear_reset_ms",
];

fn run_bench() -> Value {
    let out = Command::new(FERRY)
        .args([
            "bench",
            "lifecycle",
            "--model",
            "tiny",
            "--in-flight",
            "8",
            "--repeat",
            "2",
            "--updates",
            "3",
            "--json",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ferry");
    assert!(
        out.status.success(),
        "ferry bench lifecycle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "--json prints one line: {stdout}");
    serde_json::from_str(lines[0]).expect("the output is JSON")
}

fn number(report: &Value, key: &str) -> f64 {
    let v = report
        .get(key)
        .unwrap_or_else(|| panic!("key {key} missing from {report}"));
    let n = v
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number: {v}"));
    assert!(n.is_finite(), "{key} = {n}");
    n
}

/// `{key}_min <= {key}_p50 <= {key}_max`, each checked by `ok`.
fn check_triple(report: &Value, key: &str, ok: impl Fn(f64) -> bool) -> [f64; 3] {
    let [min, p50, max] = ["min", "p50", "max"].map(|s| number(report, &format!("{key}_{s}")));
    for (s, v) in [("min", min), ("p50", p50), ("max", max)] {
        assert!(ok(v), "{key}_{s} = {v} out of range");
    }
    assert!(min <= p50 && p50 <= max, "{key}: {min} {p50} {max}");
    [min, p50, max]
}

#[test]
fn tiny_run_reports_every_figure_and_returns_memory() {
    let report = run_bench();
    let obj = report.as_object().expect("a JSON object");

    assert_eq!(report["in_flight"], IN_FLIGHT);
    assert_eq!(report["repeat"], 2);
    assert_eq!(report["output_len"], OUTPUT_LEN);
    for key in POSITIVE_MS {
        check_triple(&report, key, |v| v > 0.0);
    }
    for key in NON_NEGATIVE_MS {
        check_triple(&report, key, |v| v >= 0.0);
    }
    // The drain finishes what is left of every request: at most all their tokens, and at
    // least the tokens left after the few each had produced before the wait pause.
    check_triple(&report, "pause_wait_clear_drain_tokens", |v| {
        v > 0.0 && v <= (IN_FLIGHT * OUTPUT_LEN) as f64
    });
    check_triple(&report, "pause_wait_clear_drain_steps", |v| {
        v > 0.0 && v <= OUTPUT_LEN as f64
    });
    for key in [
        "step_ms_mean",
        "weights_bytes",
        "kv_arena_bytes",
        "kv_fill_bytes",
    ] {
        assert!(number(&report, key) > 0.0, "{key}");
    }
    assert!(number(&report, "kv_fill_bytes") <= number(&report, "kv_arena_bytes"));

    for (op, wake) in [
        ("release_kv", "wake_kv"),
        ("sleep1", "wake1"),
        ("sleep2", "reload_wake2"),
    ] {
        let before = number(&report, &format!("rss_before_{op}_bytes"));
        let after = number(&report, &format!("rss_after_{op}_bytes"));
        assert!(number(&report, &format!("rss_after_{wake}_bytes")) > 0.0);
        assert_eq!(
            number(&report, &format!("{op}_freed_bytes")),
            before - after,
            "{op}"
        );
        assert!(number(&report, &format!("{op}_ms")) > 0.0, "{op}_ms");
        assert!(number(&report, &format!("{wake}_ms")) > 0.0, "{wake}_ms");
    }
    // Sleep level 2 drops the weights and the KV arena the load before it wrote.
    assert!(
        number(&report, "rss_after_sleep2_bytes") < number(&report, "rss_before_sleep2_bytes"),
        "{report}"
    );
    // Releasing KV memory returns the arena the rounds wrote.
    assert!(
        number(&report, "rss_after_release_kv_bytes")
            < number(&report, "rss_before_release_kv_bytes"),
        "{report}"
    );
    assert!(obj.contains_key("model") && obj.contains_key("load_avg_1m"));
    check_updates(&report);
}

/// Phase 0: resident memory before the updates, after each and each one's peak, per kind.
fn check_updates(report: &Value) {
    assert_eq!(report["n_updates"], N_UPDATES);
    let before = number(report, "rss_before_updates_bytes");
    assert!(before > 0.0);
    let weights_before = number(report, "weight_bytes_before_updates");
    assert!(weights_before > 0.0 && weights_before < before, "{report}");
    for kind in ["push", "reload"] {
        let series = |key: &str| -> Vec<f64> {
            let key = format!("{kind}_{key}");
            let values = report[&key]
                .as_array()
                .unwrap_or_else(|| panic!("{key} is not an array: {report}"));
            assert_eq!(values.len(), N_UPDATES, "{key}");
            values.iter().map(|v| v.as_f64().unwrap()).collect()
        };
        let after = series("rss_after_bytes");
        let peak = series("peak_extra_bytes");
        // The tiny model is f32, and the push is its own weights in f32: the bytes held stay.
        assert!(
            series("weight_bytes_after")
                .iter()
                .all(|&w| w == weights_before),
            "{report}"
        );
        assert_eq!(
            number(report, &format!("{kind}_rss_beyond_weights_growth_bytes")),
            after[N_UPDATES - 1] - before,
            "{kind}: the weights held did not change"
        );
        assert!(after.iter().all(|&b| b > 0.0), "{report}");
        assert_eq!(
            number(report, &format!("{kind}_rss_growth_bytes")),
            after[N_UPDATES - 1] - before,
            "{kind}"
        );
        assert_eq!(
            number(report, &format!("{kind}_peak_extra_bytes_max")),
            peak.iter().copied().fold(0.0, f64::max),
            "{kind}"
        );
    }
}
