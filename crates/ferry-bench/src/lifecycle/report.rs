//! What `ferry bench lifecycle` measured: the samples, resident memory, and how they print
//! (one flat JSON object with units in the key names, or a readable summary).

use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Map, Value};

/// Repeated measurements of one quantity, reported as min / p50 / max.
#[derive(Debug, Clone, Default)]
pub struct Samples(Vec<f64>);

impl Samples {
    pub fn push(&mut self, value: f64) {
        self.0.push(value);
    }

    pub fn push_ms(&mut self, d: Duration) {
        self.push(d.as_secs_f64() * 1e3);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    /// The nearest-rank median (the lower middle of an even count).
    pub fn p50(&self) -> f64 {
        let v = self.sorted();
        v.get(v.len().saturating_sub(1) / 2)
            .copied()
            .unwrap_or(f64::NAN)
    }

    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// `{key}_min`, `{key}_p50`, `{key}_max`, rounded to 0.1 µs.
    pub(super) fn insert(&self, out: &mut Map<String, Value>, key: &str) {
        for (suffix, v) in [
            ("min", self.min()),
            ("p50", self.p50()),
            ("max", self.max()),
        ] {
            out.insert(format!("{key}_{suffix}"), json!(round4(v)));
        }
    }

    fn summary(&self) -> String {
        format!(
            "{:>10.3} {:>10.3} {:>10.3}",
            self.min(),
            self.p50(),
            self.max()
        )
    }
}

/// Timings of the pause and resume calls under load (milliseconds unless named otherwise).
#[derive(Debug, Default)]
pub struct PauseTimings {
    /// `pause(keep)`: from the call to the reply.
    pub pause_keep: Samples,
    /// `pause(keep)`: from the end of the step in flight (its last output seen) to the reply.
    pub pause_keep_after_step: Samples,
    /// The engine thread's own time handling the call (`EngineStats`'s lifecycle counters):
    /// from taking it off the queue to its reply, no queueing, no step, no wake-ups.
    pub pause_keep_engine: Samples,
    pub resume: Samples,
    pub resume_engine: Samples,
    pub pause_keep_clear: Samples,
    pub pause_keep_clear_after_step: Samples,
    /// Includes the cache reset itself (the frozen engine is idle at once).
    pub pause_keep_clear_engine: Samples,
    pub pause_wait_clear: Samples,
    /// Tokens the `wait` drain produced after the call (the step in flight included).
    pub pause_wait_clear_drain_tokens: Samples,
    pub pause_wait_clear_drain_steps: Samples,
    /// From the last request's finish (seen by its reader) to the reply: the reset's own cost.
    pub pause_wait_clear_reset: Samples,
}

/// Timings of the RL cycle pause(keep) → reload from disk → resume, engine idle.
#[derive(Debug, Default)]
pub struct CycleTimings {
    pub pause: Samples,
    pub prepare: Samples,
    pub install: Samples,
    pub resume: Samples,
    pub total: Samples,
    /// The engine thread's own time for the pause, the install and the resume together.
    pub engine: Samples,
}

/// Resident memory around one memory operation, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct RssStep {
    pub before: u64,
    pub after: u64,
    /// After the matching wake-up (for sleep level 2: after the reload and the wake-up).
    pub after_wake: u64,
    /// The operation's own time (the release or the sleep call).
    pub op_ms: f64,
    /// The wake-up call's time (level 2: the reload and the wake-up).
    pub wake_ms: f64,
}

impl RssStep {
    fn freed(&self) -> i64 {
        self.before as i64 - self.after as i64
    }
}

#[derive(Debug)]
pub struct MemoryReport {
    pub release_kv: RssStep,
    pub sleep1: RssStep,
    pub sleep2: RssStep,
    /// KV bytes the load that precedes each measurement wrote (at most the arena).
    pub kv_fill_bytes: u64,
}

/// Resident memory around one update, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct UpdateRss {
    /// Just before the update.
    pub before: u64,
    /// When it returned (the replaced weights are freed by then).
    pub after: u64,
    /// The peak during it (`VmHWM` reset just before).
    pub peak: u64,
    /// Bytes of the weights held after it.
    pub weight_bytes: u64,
}

impl UpdateRss {
    /// How far the peak rose over what was resident before.
    pub fn peak_extra(&self) -> u64 {
        self.peak.saturating_sub(self.before)
    }
}

/// What phase 0 measured (`updates.rs`).
#[derive(Debug, Default)]
pub struct UpdateMemory {
    /// Resident memory before the first update.
    pub rss_before: u64,
    /// Bytes of the weights held before the first update.
    pub weight_bytes_before: u64,
    pub pushes: Vec<UpdateRss>,
    pub reloads: Vec<UpdateRss>,
    pub push_ms: Samples,
    pub reload_ms: Samples,
}

/// Everything the benchmark prints.
#[derive(Debug)]
pub struct Report {
    pub model: String,
    pub in_flight: usize,
    pub prompt_len: usize,
    pub output_len: u32,
    pub repeat: usize,
    pub weights_bytes: u64,
    pub kv_arena_bytes: u64,
    pub n_kv_blocks: u32,
    pub step_ms_mean: f64,
    pub n_preemptions: u64,
    pub pauses: PauseTimings,
    pub cycle: CycleTimings,
    pub memory: MemoryReport,
    pub updates: UpdateMemory,
}

impl Report {
    pub fn to_json(&self) -> Value {
        let mut out = Map::new();
        let scalars = [
            ("model", json!(self.model)),
            ("in_flight", json!(self.in_flight)),
            ("prompt_len", json!(self.prompt_len)),
            ("output_len", json!(self.output_len)),
            ("repeat", json!(self.repeat)),
            ("weights_bytes", json!(self.weights_bytes)),
            ("kv_arena_bytes", json!(self.kv_arena_bytes)),
            ("n_kv_blocks", json!(self.n_kv_blocks)),
            ("step_ms_mean", json!(round4(self.step_ms_mean))),
            ("n_preemptions", json!(self.n_preemptions)),
            ("load_avg_1m", json!(load_avg())),
        ];
        for (k, v) in scalars {
            out.insert(k.to_owned(), v);
        }
        let p = &self.pauses;
        p.pause_keep.insert(&mut out, "pause_keep_ms");
        p.pause_keep_after_step
            .insert(&mut out, "pause_keep_after_step_ms");
        p.pause_keep_engine.insert(&mut out, "pause_keep_engine_ms");
        p.resume.insert(&mut out, "resume_ms");
        p.resume_engine.insert(&mut out, "resume_engine_ms");
        p.pause_keep_clear.insert(&mut out, "pause_keep_clear_ms");
        p.pause_keep_clear_after_step
            .insert(&mut out, "pause_keep_clear_after_step_ms");
        p.pause_keep_clear_engine
            .insert(&mut out, "pause_keep_clear_engine_ms");
        p.pause_wait_clear.insert(&mut out, "pause_wait_clear_ms");
        p.pause_wait_clear_drain_tokens
            .insert(&mut out, "pause_wait_clear_drain_tokens");
        p.pause_wait_clear_drain_steps
            .insert(&mut out, "pause_wait_clear_drain_steps");
        p.pause_wait_clear_reset
            .insert(&mut out, "pause_wait_clear_reset_ms");
        let c = &self.cycle;
        c.pause.insert(&mut out, "cycle_pause_ms");
        c.prepare.insert(&mut out, "cycle_prepare_ms");
        c.install.insert(&mut out, "cycle_install_ms");
        c.resume.insert(&mut out, "cycle_resume_ms");
        c.total.insert(&mut out, "cycle_total_ms");
        c.engine.insert(&mut out, "cycle_engine_ms");
        self.memory_json(&mut out);
        self.updates_json(&mut out);
        Value::Object(out)
    }

    /// `rss_before_updates_bytes` and `weight_bytes_before_updates`, then per kind (`push`,
    /// `reload`): resident memory and the weights held after each update and each one's peak
    /// over what was resident before it (arrays, in update order), the growth from before the
    /// first to after the last, of resident memory and of resident memory beyond the weights
    /// (`{kind}_rss_beyond_weights_growth_bytes`: what updates left behind), the largest peak,
    /// and each update's time.
    fn updates_json(&self, out: &mut Map<String, Value>) {
        let u = &self.updates;
        out.insert("n_updates".into(), json!(u.pushes.len()));
        out.insert("rss_before_updates_bytes".into(), json!(u.rss_before));
        out.insert(
            "weight_bytes_before_updates".into(),
            json!(u.weight_bytes_before),
        );
        for (kind, rows, ms) in [
            ("push", &u.pushes, &u.push_ms),
            ("reload", &u.reloads, &u.reload_ms),
        ] {
            let after: Vec<u64> = rows.iter().map(|r| r.after).collect();
            let peak: Vec<u64> = rows.iter().map(UpdateRss::peak_extra).collect();
            let last = after.last().copied().unwrap_or(u.rss_before);
            let weights: Vec<u64> = rows.iter().map(|r| r.weight_bytes).collect();
            let last_weights = weights.last().copied().unwrap_or(u.weight_bytes_before);
            out.insert(format!("{kind}_rss_after_bytes"), json!(after));
            out.insert(format!("{kind}_weight_bytes_after"), json!(weights));
            out.insert(
                format!("{kind}_rss_beyond_weights_growth_bytes"),
                json!(
                    (last as i64 - last_weights as i64)
                        - (u.rss_before as i64 - u.weight_bytes_before as i64)
                ),
            );
            out.insert(format!("{kind}_peak_extra_bytes"), json!(peak));
            out.insert(
                format!("{kind}_rss_growth_bytes"),
                json!(last as i64 - u.rss_before as i64),
            );
            out.insert(
                format!("{kind}_peak_extra_bytes_max"),
                json!(peak.iter().max().copied().unwrap_or(0)),
            );
            ms.insert(out, &format!("{kind}_ms"));
        }
    }

    fn memory_json(&self, out: &mut Map<String, Value>) {
        let m = &self.memory;
        out.insert("kv_fill_bytes".into(), json!(m.kv_fill_bytes));
        let steps = [
            ("release_kv", "wake_kv", &m.release_kv),
            ("sleep1", "wake1", &m.sleep1),
            ("sleep2", "reload_wake2", &m.sleep2),
        ];
        for (op, wake, s) in steps {
            out.insert(format!("rss_before_{op}_bytes"), json!(s.before));
            out.insert(format!("rss_after_{op}_bytes"), json!(s.after));
            out.insert(format!("rss_after_{wake}_bytes"), json!(s.after_wake));
            out.insert(format!("{op}_freed_bytes"), json!(s.freed()));
            out.insert(format!("{op}_ms"), json!(round4(s.op_ms)));
            out.insert(format!("{wake}_ms"), json!(round4(s.wake_ms)));
        }
    }

    /// The readable form.
    pub fn summary(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let p = &self.pauses;
        let c = &self.cycle;
        let m = &self.memory;
        let mut s = format!(
            "ferry bench lifecycle: {} | {} in flight, prompt {} + output {} tokens, {} repeats\n\
             weights {:.1} MiB, KV arena {:.1} MiB ({} blocks), mean step {:.2} ms, {} preemptions \
             (recomputes after the keep resets included)\n\n\
             {:<46} {:>10} {:>10} {:>10}\n",
            self.model,
            self.in_flight,
            self.prompt_len,
            self.output_len,
            self.repeat,
            mib(self.weights_bytes),
            mib(self.kv_arena_bytes),
            self.n_kv_blocks,
            self.step_ms_mean,
            self.n_preemptions,
            "ms (engine-side, in-process)",
            "min",
            "p50",
            "max"
        );
        let rows = [
            ("pause(keep), call to reply", &p.pause_keep),
            (
                "  of which after the step in flight",
                &p.pause_keep_after_step,
            ),
            ("  engine thread's own time", &p.pause_keep_engine),
            ("resume()", &p.resume),
            ("  engine thread's own time", &p.resume_engine),
            (
                "pause(keep, clear_cache), call to reply",
                &p.pause_keep_clear,
            ),
            (
                "  of which after the step in flight",
                &p.pause_keep_clear_after_step,
            ),
            (
                "  engine thread's own time (reset included)",
                &p.pause_keep_clear_engine,
            ),
            (
                "pause(wait, clear_cache), call to reply",
                &p.pause_wait_clear,
            ),
            (
                "  drain: tokens produced (count)",
                &p.pause_wait_clear_drain_tokens,
            ),
            (
                "  drain: engine steps (count)",
                &p.pause_wait_clear_drain_steps,
            ),
            (
                "  last finish to reply (the reset)",
                &p.pause_wait_clear_reset,
            ),
            ("cycle: pause(keep)", &c.pause),
            ("cycle: reload prepare (read + convert)", &c.prepare),
            ("cycle: install (queue to reply)", &c.install),
            ("cycle: resume", &c.resume),
            ("cycle: total", &c.total),
            ("cycle: engine thread's own time", &c.engine),
        ];
        for (name, samples) in rows {
            s += &format!("{name:<46} {}\n", samples.summary());
        }
        s += &format!(
            "\nresident memory (MiB; each preceded by a load that wrote {:.1} MiB of KV):\n",
            mib(m.kv_fill_bytes)
        );
        let steps = [
            ("release_kv_cache_memory / wake_up(kv_cache)", &m.release_kv),
            ("sleep(1) / wake_up", &m.sleep1),
            ("sleep(2) / reload + wake_up", &m.sleep2),
        ];
        for (name, r) in steps {
            s += &format!(
                "{name:<46} before {:>8.1}  after {:>8.1}  (freed {:>8.1})  after wake {:>8.1}  \
                 [{:.1} ms / {:.1} ms]\n",
                mib(r.before),
                mib(r.after),
                r.freed() as f64 / (1 << 20) as f64,
                mib(r.after_wake),
                r.op_ms,
                r.wake_ms
            );
        }
        s + &self.updates_summary()
    }

    fn updates_summary(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let u = &self.updates;
        let mut s = format!(
            "\nweight updates on the idle engine (resident MiB; before the first {:.1}, of \
             which weights {:.1}):\n",
            mib(u.rss_before),
            mib(u.weight_bytes_before)
        );
        for (kind, rows) in [("push", &u.pushes), ("reload", &u.reloads)] {
            for (i, r) in rows.iter().enumerate() {
                s += &format!(
                    "{kind:<6} {:>3}  after {:>8.1} (weights {:>7.1})  peak +{:>7.1} over the \
                     {:.1} before it\n",
                    i + 1,
                    mib(r.after),
                    mib(r.weight_bytes),
                    mib(r.peak_extra()),
                    mib(r.before)
                );
            }
        }
        s
    }
}

/// This process's resident memory (`VmRSS` in `/proc/self/status`), in bytes.
pub fn rss_bytes() -> anyhow::Result<u64> {
    ferry_arena::resident_bytes()
        .context("no VmRSS in /proc/self/status (resident memory needs Linux)")
}

/// Resets this process's peak resident memory (`VmHWM`) to its current resident memory
/// ([`reset_peak`]).
pub fn reset_peak_rss() -> anyhow::Result<()> {
    reset_peak("self")
}

/// This process's peak resident memory since start or the last [`reset_peak_rss`]
/// (`VmHWM`), in bytes.
pub fn peak_rss_bytes() -> anyhow::Result<u64> {
    status_bytes("self", "VmHWM")
}

/// Resets the peak resident memory (`VmHWM`) of `process` (`self`, or a pid) to its current
/// resident memory, by writing `5` to `/proc/<process>/clear_refs` (Linux ≥ 4.0).
pub fn reset_peak(process: &str) -> anyhow::Result<()> {
    std::fs::write(format!("/proc/{process}/clear_refs"), "5").with_context(|| {
        format!("resetting the peak resident memory through /proc/{process}/clear_refs")
    })
}

/// A memory figure of `process` (`self`, or a pid) from `/proc/<process>/status` (`VmRSS`,
/// `VmHWM`), in bytes.
pub fn status_bytes(process: &str, key: &str) -> anyhow::Result<u64> {
    let path = format!("/proc/{process}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))
        .with_context(|| format!("no {key} in {path}"))?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("a malformed {key} line in {path}"))?;
    Ok(kib * 1024)
}

/// The 1-minute load average, so a reader can tell a contended run (Linux only).
fn load_avg() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

fn round4(v: f64) -> f64 {
    (v * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_give_min_lower_median_and_max() {
        let mut s = Samples::default();
        for v in [4.0, 1.0, 3.0, 2.0] {
            s.push(v);
        }
        assert_eq!((s.min(), s.p50(), s.max()), (1.0, 2.0, 4.0));
        s.push(5.0);
        assert_eq!(s.p50(), 3.0);
    }
}
