//! End to end: `ferry bench route --model tiny` on the real binary starts a fleet per policy
//! behind the proxy and one instance with all the KV, and prints one JSON object with every
//! policy. No timing thresholds (CI machines are shared): the routing's effect is checked on
//! the hit rate, which does not depend on speed: `kv` matches what one instance with all the
//! KV reaches, and no policy routes by a wiped cache across the RL cycle midway.

use std::process::Command;

use serde_json::Value;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

#[test]
fn bench_route_reports_each_policy_and_kv_hits_as_one_instance_with_all_the_kv() {
    let out = Command::new(FERRY)
        .args([
            "bench",
            "route",
            "--model",
            "tiny",
            "--groups",
            "4",
            "--prefix-len",
            "64",
        ])
        .args(["--rounds", "8", "--no-pin", "--json"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ferry");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let baseline = report["baseline_one_instance"]["hit_rate"]
        .as_f64()
        .unwrap();
    let policies = report["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["kv", "least-loaded", "round-robin"]);
    for p in policies {
        assert_eq!(p["n_requests"], 32, "{p}");
        assert_eq!(p["stale_routes"], 0.0, "{p}");
        for key in ["ttft_p50_ms", "ttft_p90_ms", "wall_s"] {
            assert!(p[key].as_f64().unwrap() > 0.0, "{key}: {p}");
        }
    }
    let kv = &policies[0];
    // A predicted hit can miss only if the wipe midway came while it was in flight: at most
    // the requests in flight then (the concurrency, 2).
    assert!(kv["misses"].as_f64().unwrap() <= 2.0, "{kv}");
    assert!(kv["predicted_hit_tokens"].as_f64().unwrap() > 0.0, "{kv}");
    // Every request after its group's first (and its first after the wipe) can hit: a
    // perfect router reaches the baseline's rate.
    assert!(baseline > 0.5, "{report}");
    assert!(
        kv["hit_rate"].as_f64().unwrap() >= 0.9 * baseline,
        "{report}"
    );
    assert_eq!(
        report["kv_hit_rate_over_baseline"]
            .as_f64()
            .map(|r| r >= 0.9),
        Some(true)
    );
}
