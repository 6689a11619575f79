//! End to end: `ferry bench agentic` on the real binary runs a small multi-turn tool-use
//! workload through the proxy on a fresh fleet per configuration (round-robin, kv, sessions)
//! and prints one JSON object with each. No timing thresholds (CI machines are shared), and
//! none that hang on where the sessions' hashes put them: every turn is answered and counted,
//! later turns' prompts start with the earlier context as the template renders it, and with
//! the session header every later turn finds cached all of it that a cache can hold (the
//! bench's KV per instance, half of everything plus a whole sequence per request in flight,
//! holds all 4 sessions on either instance).
//!
//! The default model (SmolLM2-135M-Instruct, fetched by scripts/fetch-model.sh): the tiny
//! model's byte-level tokenizer makes the system prompt and tools alone longer than its
//! 2,048-token context.

use std::process::Command;

use serde_json::Value;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

#[test]
fn bench_agentic_reports_each_configuration_and_sessions_find_their_context() {
    let out = Command::new(FERRY)
        .args(["bench", "agentic", "--sessions", "4", "--turns", "3"])
        .args(["--tool-tokens", "48", "--max-tokens", "4"])
        .args(["--no-pin", "--json"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ferry");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let configs = report["configs"].as_array().unwrap();
    let names: Vec<&str> = configs
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["round-robin", "kv", "sessions"]);
    for c in configs {
        assert_eq!(c["totals"]["n_requests"], 12, "{c}");
        let served: f64 = c["instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["requests"].as_f64().unwrap())
            .sum();
        assert_eq!(served, 12.0, "{c}");
        let turns = c["turns"].as_array().unwrap();
        assert_eq!(turns.len(), 3);
        for t in &turns[1..] {
            // The earlier context is in the prompt (all of it but the generation prompt's
            // empty think block, which the template leaves out of a past answer).
            let kept = t["earlier_context_in_prompt"].as_f64().unwrap();
            assert!(kept > 0.5 && kept <= 1.0, "{t}");
            assert!(t["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{t}");
        }
    }
    let sessions = &configs[2];
    for t in &sessions["turns"].as_array().unwrap()[1..] {
        assert_eq!(t["cached_of_cacheable"].as_f64(), Some(1.0), "{sessions}");
    }
    // Round-robin alternates: both instances served requests.
    for i in configs[0]["instances"].as_array().unwrap() {
        assert!(i["requests"].as_f64().unwrap() > 0.0, "{}", configs[0]);
    }
    assert_eq!(report["workload"]["tools"], true);
    assert!(report["targets"]["sessions_over_kv_cached_tokens"].is_number());
}
