//! End to end: `ferry bench offload --model tiny` on the real binary prints one JSON object
//! with every key, finite and positive figures, and the tier actually hit. No timing
//! thresholds (CI machines are shared); the bench itself fails if the tier changed any
//! output token or a copied block came back wrong.

use std::process::Command;

use serde_json::Value;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

#[test]
fn bench_offload_reports_throughput_against_memcpy_and_ttft_with_and_without_the_tier() {
    let out = Command::new(FERRY)
        .args([
            "bench",
            "offload",
            "--model",
            "tiny",
            "--n-blocks",
            "32",
            "--repeat",
            "2",
            "--n-prompts",
            "3",
            "--prompt-len",
            "64",
            "--rounds",
            "2",
            "--json",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ferry");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let report: Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    for key in [
        "store_gb_per_s",
        "load_gb_per_s",
        "memcpy_gb_per_s",
        "store_ratio",
        "load_ratio",
        "ttft_ms_mean_without_tier",
        "ttft_ms_p50_without_tier",
        "ttft_ms_mean_with_tier",
        "ttft_ms_p50_with_tier",
        "ttft_speedup",
    ] {
        let v = report[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {report}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    assert_eq!(report["n_blocks"], 32);
    assert_eq!(
        report["total_bytes"],
        32 * report["block_bytes"].as_u64().unwrap()
    );
    // Round two asks each of the 3 prompts again; the KV cache holds 1.5 of them.
    assert_eq!(report["tier_hits"], 3, "{report}");
    assert!(report["tier_bytes_used"].as_u64().unwrap() > 0);
}

#[test]
fn bench_offload_refuses_a_workload_that_fits_the_cache() {
    let out = Command::new(FERRY)
        .args(["bench", "offload", "--model", "tiny", "--n-prompts", "1"])
        .output()
        .expect("running ferry");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--cache-prompts"), "{err}");
}
