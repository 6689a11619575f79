//! `ferry` child processes for the benchmarks that run a fleet (`ferry bench route`, `ferry
//! bench agentic`, `ferry bench weight-sync`): started from the `ferry` binary the caller
//! names (the one running the benchmark), their address read from their log, killed when
//! dropped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A `ferry` child process, killed when dropped.
pub struct Proc {
    pub child: Child,
    pub url: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `<ferry> <args>` (pinned to `core` when given) and waits for its address.
pub fn start(ferry: &Path, args: &[String], core: Option<usize>) -> anyhow::Result<Proc> {
    let mut command = match core {
        Some(c) => {
            let mut t = Command::new("taskset");
            t.args(["-c", &c.to_string()]).arg(ferry);
            t
        }
        None => Command::new(ferry),
    };
    let mut child = command
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env_remove("FERRY_API_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting ferry {}", args.join(" ")))?;
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().context("no stderr")?;
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // Sent or not, the pipe is drained, so the child never blocks on it.
            let _ = tx.send(line);
        }
    });
    let mut proc = Proc {
        child,
        url: String::new(),
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut log = Vec::new();
    while proc.url.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            bail!(
                "ferry {} did not start:\n{}",
                args.join(" "),
                log.join("\n")
            );
        };
        if let Some(rest) = line.split("serving on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap_or_default();
            proc.url = format!("http://{addr}");
        }
        log.push(line);
    }
    Ok(proc)
}

/// Command-line arguments as owned strings.
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}
