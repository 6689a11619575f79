//! What a case body works with: the trio, the reference, the bounds for its model, and the
//! record the summary is made from (every admin call's reply time against its bound, every
//! request's end). The record lives behind a lock shared with the runner, so a case that
//! panics still reports what it measured.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::fleet::{admin_post, Model, Reply, Setup, Target, Trio};
use crate::load::{judge_all, request_body, Counts, End, Load, Outcome, Reference, Send};
use crate::procs::{metric, metrics_text, wait_metrics};

/// One admin call as the summary shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CallRecord {
    pub call: String,
    pub status: u16,
    pub reply_ms: f64,
    pub bound_ms: u64,
}

/// What a case measured.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Record {
    pub calls: Vec<CallRecord>,
    pub counts: Counts,
    pub notes: Vec<String>,
    /// How far the case moved the transfer and tier counters (P's exports, D's loads,
    /// preemptions, the tier's stores, loads and flushes): evidence of what it exercised.
    pub counters: BTreeMap<&'static str, f64>,
    /// Which call is the operation under test (`None`: the first).
    pub main_call: Option<usize>,
}

/// Reply-time bounds, per model (the default model's steps are ~100x the tiny model's).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Calls that must not wait for anything: a keep pause without `clear_cache`, resume,
    /// `reset_prefix_cache`, `abort_requests`, a wake-up.
    pub instant: Duration,
    /// Calls that reset caches: no longer than the transfers take to hand back their blocks
    /// (under P's export lease, so a reset that waits for a lease misses it).
    pub clearing: Duration,
    /// Calls that let running requests finish first (`wait`).
    pub draining: Duration,
    /// A weight reload from disk.
    pub reload: Duration,
    /// Every request of a case ends within this after the operation.
    pub requests: Duration,
    /// How long a paused engine is watched to compute nothing.
    pub hold: Duration,
}

impl Bounds {
    pub fn of(model: &Model) -> Bounds {
        match model {
            Model::Tiny | Model::Moe => Bounds {
                instant: Duration::from_millis(1000),
                clearing: Duration::from_millis(1500),
                draining: Duration::from_secs(15),
                reload: Duration::from_secs(15),
                requests: Duration::from_secs(60),
                hold: Duration::from_millis(150),
            },
            Model::Default(_) => Bounds {
                instant: Duration::from_millis(2000),
                clearing: Duration::from_secs(5),
                draining: Duration::from_secs(60),
                reload: Duration::from_secs(60),
                requests: Duration::from_secs(120),
                hold: Duration::from_millis(300),
            },
        }
    }
}

/// Which requests may end other than with every token.
#[derive(Debug, Clone, Copy, Default)]
pub struct Allow {
    pub abort: bool,
    pub fail: bool,
}

pub struct Ctx<'a> {
    pub trio: &'a Trio,
    pub setup: &'a Setup,
    pub reference: &'a Reference,
    pub bounds: Bounds,
    pub case: String,
    record: Arc<Mutex<Record>>,
    n_sent: AtomicUsize,
}

impl<'a> Ctx<'a> {
    pub fn new(
        trio: &'a Trio,
        setup: &'a Setup,
        reference: &'a Reference,
        case: String,
        record: Arc<Mutex<Record>>,
    ) -> Self {
        Ctx {
            trio,
            setup,
            reference,
            bounds: Bounds::of(&setup.model),
            case,
            record,
            n_sent: AtomicUsize::new(0),
        }
    }

    pub fn url(&self, target: Target) -> &str {
        self.trio.url(target)
    }

    /// The next admin call is the operation under test (the calls before it set the stage).
    pub fn next_is_main(&self) {
        let mut record = self.record.lock().unwrap();
        record.main_call = Some(record.calls.len());
    }

    pub fn note(&self, note: impl Into<String>) {
        self.record.lock().unwrap().notes.push(note.into());
    }

    /// Requests per wave: enough to fill D's batch (4) and queue more behind it.
    pub fn wave_size(&self) -> usize {
        match self.setup.model {
            Model::Tiny | Model::Moe => 6,
            Model::Default(_) => 4,
        }
    }

    /// One request of prompt `prompt_idx` to `url`. Even-numbered sends carry a salt unique
    /// to this send (fresh KV on P and D: a real transfer), odd ones none (prefix hits on
    /// what earlier cases cached, or on the tier).
    pub fn request(&self, url: &str, prompt_idx: usize) -> Send {
        let n = self.n_sent.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{}-{n}", slug(&self.case), self.setup.id_label());
        let salt = n.is_multiple_of(2).then(|| id.clone());
        let idx = prompt_idx % self.reference.prompts.len();
        Send {
            url: url.to_owned(),
            prompt_idx: idx,
            body: request_body(
                self.setup,
                &self.reference.prompts[idx],
                self.reference.max_tokens[idx],
                salt.as_deref(),
            ),
            id,
            disconnect_after: None,
        }
    }

    /// `n` streaming requests through the proxy.
    pub fn send(&self, n: usize) -> Load {
        let mut load = Load::default();
        let url = format!("{}/v1/completions", self.trio.proxy.url);
        let first = self.n_sent.load(Ordering::Relaxed);
        for i in 0..n {
            load.push(self.request(&url, first + i));
        }
        load
    }

    /// Waits until D runs at least `n` requests (the load is mid-decode).
    pub async fn decoding(&self, n: usize) {
        let n = n as f64;
        wait_metrics(&self.trio.d.url, Duration::from_secs(20), |t| {
            metric(t, "ferry_num_requests_running") >= n
        })
        .await;
    }

    /// Runs an admin call, records its reply time, and fails the case if it took longer than
    /// `bound` or answered other than `want`.
    pub async fn op(
        &self,
        name: impl Into<String>,
        bound: Duration,
        want: u16,
        call: impl std::future::Future<Output = Reply>,
    ) -> Reply {
        let name = name.into();
        let reply = call.await;
        self.record.lock().unwrap().calls.push(CallRecord {
            call: name.clone(),
            status: reply.status,
            reply_ms: reply.ms,
            bound_ms: bound.as_millis() as u64,
        });
        assert_eq!(
            reply.status, want,
            "{name} answered {} (wanted {want}): {}",
            reply.status, reply.body
        );
        assert!(
            reply.ms <= bound.as_millis() as f64,
            "{name} replied in {} ms, over its bound of {} ms",
            reply.ms,
            bound.as_millis()
        );
        reply
    }

    /// `POST target+path`, as [`Ctx::op`].
    pub async fn post(&self, target: Target, path: &str, bound: Duration, want: u16) -> Reply {
        let name = format!("{path} on {}", target.name());
        self.op(name, bound, want, admin_post(self.url(target), path, None))
            .await
    }

    /// `POST target+path` with a JSON body, as [`Ctx::op`].
    pub async fn post_json(
        &self,
        target: Target,
        path: &str,
        body: &Value,
        bound: Duration,
        want: u16,
    ) -> Reply {
        let name = format!("{path} on {}", target.name());
        self.op(
            name,
            bound,
            want,
            admin_post(self.url(target), path, Some(body)),
        )
        .await
    }

    /// Reloads the same weights from disk under a new version, everywhere; returns it, and
    /// whether the reload read over the weights in place (as it does for a folder, here the
    /// tiny model's, while the engine is paused with its weights resident).
    pub async fn reload(&self) -> (String, bool) {
        let n = self.n_sent.fetch_add(1, Ordering::Relaxed);
        let version = format!("{}-{}-v{n}", slug(&self.case), self.setup.id_label());
        let body = json!({"model_path": self.setup.model.reload_path(), "weight_version": version});
        let reply = self
            .post_json(
                Target::Both,
                "/update_weights_from_disk",
                &body,
                self.bounds.reload,
                200,
            )
            .await;
        assert_eq!(
            reply.body["weight_version"],
            version.as_str(),
            "{}",
            reply.body
        );
        let in_place = reply.body["in_place"].as_bool();
        assert!(in_place.is_some(), "{}", reply.body);
        (version, in_place == Some(true))
    }

    /// Whether each engine the target names is paused (`want`).
    pub async fn assert_paused(&self, target: Target, want: bool) {
        for (on, base) in [
            (target.includes_p(), &self.trio.p.url),
            (target.includes_d(), &self.trio.d.url),
        ] {
            if on {
                let (_, out) = crate::procs::get(&format!("{base}/is_paused")).await;
                assert_eq!(out["is_paused"], want, "{base}: {out}");
            }
        }
    }

    /// Requests sent while `target` is paused or asleep: they queue on the first paused engine
    /// on their way (P, else D), and a paused D computes nothing for `hold`.
    pub async fn queued_while_paused(&self, target: Target) -> Load {
        let n = 2;
        let wave = self.send(n);
        let first = if target.includes_p() {
            &self.trio.p.url
        } else {
            &self.trio.d.url
        };
        wait_metrics(first, Duration::from_secs(10), |t| {
            metric(t, "ferry_num_requests_waiting") >= n as f64
        })
        .await;
        if target.includes_d() {
            let tokens = |t: &str| metric(t, "ferry_generation_tokens_total");
            let before = tokens(&metrics_text(&self.trio.d.url).await);
            tokio::time::sleep(self.bounds.hold).await;
            let after = tokens(&metrics_text(&self.trio.d.url).await);
            assert_eq!(before, after, "a paused D generated tokens");
        }
        wave
    }

    /// Waits for every request, judges each against the reference, records the counts and
    /// fails the case on a lost or wrong request, or an end `allow` does not permit.
    pub async fn finish(&self, load: Load, allow: Allow) -> Vec<(Outcome, End)> {
        let outcomes = load.join(self.bounds.requests).await;
        let ends = judge_all(&outcomes, self.reference).unwrap_or_else(|e| panic!("{e}"));
        let mut counts = Counts::default();
        let mut out = Vec::new();
        for o in outcomes {
            let end = ends[&o.id];
            counts.add(end);
            out.push((o, end));
        }
        {
            let mut record = self.record.lock().unwrap();
            let c = &mut record.counts;
            c.n_requests += counts.n_requests;
            c.n_finished += counts.n_finished;
            c.n_aborted += counts.n_aborted;
            c.n_failed += counts.n_failed;
            c.n_disconnected += counts.n_disconnected;
        }
        for (o, end) in &out {
            let permitted = match end {
                End::Finished | End::Disconnected => true,
                End::Aborted => allow.abort,
                End::Failed => allow.fail,
            };
            assert!(permitted, "request {} ended {end:?}: {o:?}", o.id);
        }
        out
    }

    /// The counts of a finished set.
    pub fn count(ends: &[(Outcome, End)], end: End) -> usize {
        ends.iter().filter(|(_, e)| *e == end).count()
    }

    /// A metric summed over P and D.
    pub async fn metric_pd(&self, name: &str) -> f64 {
        metric(&metrics_text(&self.trio.p.url).await, name)
            + metric(&metrics_text(&self.trio.d.url).await, name)
    }
}

/// A case name as an id (lowercase, dashes).
pub fn slug(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_owned()
}
