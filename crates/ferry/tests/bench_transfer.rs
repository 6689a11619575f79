//! End to end: `ferry bench transfer`'s two ends in two processes of the real binary on
//! loopback (`--serve` and `--pull`, with a fleet secret), and `--pulls-per-second`. No
//! timing thresholds (CI machines are shared); the pull end itself fails if a byte arrived
//! wrong, and the serve end if an export was not pulled.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// Small blocks (2 × 2 × 8 × 4 × 2 planes × 4 bytes = 1 KiB), so the test moves little.
const LAYOUT: [&str; 8] = [
    "--n-layers",
    "2",
    "--n-kv-heads",
    "2",
    "--head-dim",
    "8",
    "--block-size",
    "4",
];

fn bench(args: &[&str]) -> Command {
    let mut cmd = Command::new(FERRY);
    cmd.args(["bench", "transfer"])
        .args(LAYOUT)
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("FERRY_KV_TRANSFER_SECRET");
    cmd
}

/// Kills the serve end if the test fails before it exits.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn number(report: &Value, key: &str) -> f64 {
    report[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing: {report}"))
}

#[test]
fn the_two_ends_in_two_processes_move_every_export_and_report_the_rate() {
    let sizes = ["--n-blocks", "8", "--repeat", "3", "--json"];
    let mut serve = bench(&sizes)
        .args(["--serve", "127.0.0.1:0", "--timeout-seconds", "60"])
        .env("FERRY_KV_TRANSFER_SECRET", "the fleet's secret")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map(Reaped)
        .expect("running ferry");
    let mut lines = BufReader::new(serve.0.stdout.take().unwrap()).lines();
    let listening: Value =
        serde_json::from_str(&lines.next().expect("a line when listening").unwrap()).unwrap();
    assert_eq!(listening["role"], "serve", "{listening}");
    let addr = listening["addr"].as_str().unwrap().to_owned();
    assert!(!addr.ends_with(":0"), "the bound port: {addr}");

    let out = bench(&sizes)
        .args(["--pull", &addr, "--timeout-seconds", "60"])
        .env("FERRY_KV_TRANSFER_SECRET", "the fleet's secret")
        .output()
        .expect("running ferry");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["role"], "pull");
    assert_eq!(report["addr"], addr.as_str());
    assert_eq!(report["authenticated"], true);
    assert_eq!(report["repeat"], 3);
    assert_eq!(report["block_bytes"], 1024, "{report}");
    assert_eq!(report["total_bytes"], 8 * 1024);
    let seconds = report["seconds"].as_array().expect("seconds per run");
    assert_eq!(seconds.len(), 3);
    assert!(seconds.iter().all(|s| s.as_f64().is_some_and(|s| s > 0.0)));
    for key in [
        "best_gb_per_s",
        "median_gb_per_s",
        "best_mbit_per_s",
        "median_mbit_per_s",
    ] {
        let v = number(&report, key);
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    assert!(number(&report, "best_gb_per_s") >= number(&report, "median_gb_per_s"));
    let mbit_per_gb = number(&report, "best_mbit_per_s") / number(&report, "best_gb_per_s");
    assert!((mbit_per_gb - 8000.0).abs() < 1e-6, "{mbit_per_gb}");
    // Three pulls on one connection: the pool at work across processes.
    assert_eq!(report["connections_opened"], 1, "{report}");
    assert_eq!(report["connections_reused"], 2, "{report}");

    let done: Value =
        serde_json::from_str(&lines.next().expect("a line when done").unwrap()).unwrap();
    assert_eq!(done["pulled"], 3, "{done}");
    assert_eq!(done["exports"], 3);
    assert_eq!(done["connections_accepted"], 1, "{done}");
    assert!(serve.0.wait().unwrap().success());
}

#[test]
fn a_pull_end_with_another_secret_gets_nothing_and_says_why() {
    let sizes = ["--n-blocks", "2", "--repeat", "1", "--json"];
    let mut serve = bench(&sizes)
        .args(["--serve", "127.0.0.1:0", "--timeout-seconds", "60"])
        .env("FERRY_KV_TRANSFER_SECRET", "the fleet's secret")
        .stdout(Stdio::piped())
        .spawn()
        .map(Reaped)
        .expect("running ferry");
    let mut lines = BufReader::new(serve.0.stdout.take().unwrap()).lines();
    let listening: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let addr = listening["addr"].as_str().unwrap();
    let out = bench(&sizes)
        .args(["--pull", addr, "--timeout-seconds", "60"])
        .args(["--secret", "another secret"])
        .output()
        .expect("running ferry");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("authentication failed"), "{err}");
}

#[test]
fn pulls_per_second_reports_both_rates_and_the_pool_saves_connections() {
    let out = bench(&["--pulls-per-second", "--seconds", "0.4", "--json"])
        .output()
        .expect("running ferry");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["mode"], "pulls_per_second");
    assert_eq!(report["pull_blocks"], 1);
    for key in [
        "pulls_per_second_with_pool",
        "pulls_per_second_without_pool",
        "ratio",
    ] {
        let v = number(&report, key);
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    let ratio = number(&report, "pulls_per_second_with_pool")
        / number(&report, "pulls_per_second_without_pool");
    assert!((ratio - number(&report, "ratio")).abs() < 1e-9);
    // Without the pool a connection per pull; with it, one for all of them.
    assert_eq!(
        report["connections_opened_without_pool"], report["pulls_without_pool"],
        "{report}"
    );
    assert_eq!(report["connections_opened_with_pool"], 1, "{report}");
    assert!(number(&report, "pulls_with_pool") >= 4.0, "{report}");
}
