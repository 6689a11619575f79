//! Property test of the lifecycle under load: random interleavings of requests, steps,
//! aborts, transfers (held by a connector that hands blocks back after a random delay), an
//! offload tier whose copier answers its jobs at random moments (a flush answers every job
//! handed over before it, as the real copier's does) and every lifecycle operation. Checked after every operation: block ownership and queues; no
//! plan while KV memory is released; KV memory released only when no block is in use; an
//! operation that resets the caches succeeds only with the reset done (no block held, no
//! hash cached, no transfer out); an operation fails only when a resume or wake-up cancels
//! it, with the error naming which. At the end (wake everything, resume, drain): every
//! operation got exactly one reply, every request finished exactly once, every block is free.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::Harness;
use ferry_core::{
    ConnectorId, Holder, KvConnector, LifecycleError, LifecycleEvent, OffloadConfig,
    OffloadConnector, OffloadPolicy, OpId, PauseMode, SamplingParams, SchedulerConfig, SleepLevel,
    TierJob, TierReport, TokenId, TransferId, WakeTag, WorkerJob, WorkerReport,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        base: u8,
        len: usize,
        max_tokens: u32,
    },
    Step,
    Abort(usize),
    Hold(usize),
    Pause(PauseMode, bool),
    Resume,
    Sleep(SleepLevel, PauseMode),
    WakeUp(u8),
    ReleaseKv,
    Reset(bool, bool),
    WeightVersion(u8),
    AbortAll,
    /// The offload copier answers this many of its oldest jobs.
    Copy(usize),
}

fn mode() -> impl Strategy<Value = PauseMode> {
    prop_oneof![
        Just(PauseMode::Abort),
        Just(PauseMode::Wait),
        Just(PauseMode::Keep)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let level = prop_oneof![
        Just(SleepLevel::L0),
        Just(SleepLevel::L1),
        Just(SleepLevel::L2)
    ];
    prop_oneof![
        4 => (0u8..3, 1usize..30, 1u32..10).prop_map(|(base, len, max_tokens)| Op::Add { base, len, max_tokens }),
        10 => Just(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => (0usize..64).prop_map(Op::Hold),
        2 => (mode(), any::<bool>()).prop_map(|(m, c)| Op::Pause(m, c)),
        2 => Just(Op::Resume),
        1 => (level, mode()).prop_map(|(l, m)| Op::Sleep(l, m)),
        1 => (0u8..3).prop_map(Op::WakeUp),
        1 => Just(Op::ReleaseKv),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(a, b)| Op::Reset(a, b)),
        1 => (0u8..3).prop_map(Op::WeightVersion),
        1 => Just(Op::AbortAll),
        3 => (1usize..4).prop_map(Op::Copy),
    ]
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        n_blocks: 32,
        max_num_seqs: 4,
        max_num_batched_tokens: 24,
        max_model_len: 48,
        eos_token_ids: vec![TokenId(3)],
        ..SchedulerConfig::default()
    }
}

/// Transfers end `delay` polls after they are aborted, or on their own after `lifetime`.
#[derive(Debug, Default)]
struct Transfers {
    /// (transfer, polls left before it ends on its own, polls left once aborted)
    live: Vec<(TransferId, u32, u32)>,
    aborted: bool,
}

#[derive(Debug, Clone)]
struct Conn(Arc<Mutex<Transfers>>);

impl KvConnector for Conn {
    fn name(&self) -> &str {
        "random"
    }
    fn abort_transfers(&mut self) {
        self.0.lock().unwrap().aborted = true;
    }
    fn take_finished_transfers(&mut self, out: &mut Vec<TransferId>) {
        let mut s = self.0.lock().unwrap();
        let aborted = s.aborted;
        s.live.retain_mut(|(t, lifetime, after_abort)| {
            let left = if aborted { after_abort } else { lifetime };
            if *left == 0 {
                out.push(*t);
                false
            } else {
                *left -= 1;
                true
            }
        });
        if s.live.is_empty() {
            s.aborted = false;
        }
    }
    fn has_pending_work(&self) -> bool {
        let s = self.0.lock().unwrap();
        s.aborted && !s.live.is_empty()
    }
    fn reset_cache(&mut self) {}
}

const TIER: ConnectorId = ConnectorId(1);

struct Run {
    h: Harness,
    conn: Arc<Mutex<Transfers>>,
    /// The offload copier's jobs not answered yet, oldest first.
    copier: Vec<WorkerJob>,
    /// Answer every copier job at once (the end of a run).
    copy_all: bool,
    added: Vec<String>,
    next_op: u64,
    /// Every operation issued, and whether it resets the caches.
    issued: BTreeMap<OpId, bool>,
    replies: BTreeMap<OpId, usize>,
    /// The error that may cancel pending operations in the poll after the current call: set
    /// by a resume or a wake-up, none otherwise.
    cancelling: Option<LifecycleError>,
    /// Operations a resume or wake-up cancelled, and resets that completed.
    n_cancelled: usize,
    n_resets_done: usize,
    kv_released: bool,
}

impl Run {
    fn new(arc: bool) -> Self {
        let conn = Arc::new(Mutex::new(Transfers::default()));
        let mut h = Harness::new(config());
        h.model.vocab = 12;
        let id = h.sched.add_connector(Box::new(Conn(conn.clone())));
        assert_eq!(id, ConnectorId(0));
        let policy = if arc {
            OffloadPolicy::Arc
        } else {
            OffloadPolicy::Lru
        };
        let tier = OffloadConnector::new(OffloadConfig {
            block_size: 4,
            blocks_per_slot: 1,
            block_bytes: 1,
            capacity_bytes: 6,
            policy,
        });
        assert_eq!(h.sched.add_connector(Box::new(tier)), TIER);
        Self {
            h,
            conn,
            copier: Vec::new(),
            copy_all: false,
            added: Vec::new(),
            next_op: 0,
            issued: BTreeMap::new(),
            replies: BTreeMap::new(),
            cancelling: None,
            n_cancelled: 0,
            n_resets_done: 0,
            kv_released: false,
        }
    }

    fn op_id(&mut self, resets: bool) -> OpId {
        self.next_op += 1;
        self.issued.insert(OpId(self.next_op), resets);
        OpId(self.next_op)
    }

    fn poll(&mut self) {
        let mut events = Vec::new();
        self.h.sched.poll_lifecycle(&mut events);
        for e in events {
            match e {
                LifecycleEvent::ReleaseKvMemory => {
                    assert_eq!(
                        self.h.sched.stats().n_blocks_used,
                        0,
                        "KV freed while in use"
                    );
                    self.kv_released = true;
                }
                LifecycleEvent::Done(op) => {
                    if self.issued[&op] {
                        // A reset that says it is done is done.
                        let s = self.h.sched.stats();
                        assert_eq!(
                            (
                                s.n_blocks_used,
                                s.n_blocks_cached,
                                s.n_transfers,
                                s.n_running
                            ),
                            (0, 0, 0, 0),
                            "{op:?} completed without its reset done"
                        );
                        assert!(self.h.sched.lifecycle_status().paused);
                        self.n_resets_done += 1;
                    }
                    *self.replies.entry(op).or_default() += 1;
                }
                LifecycleEvent::Failed(op, e) => {
                    assert_eq!(
                        Some(&e),
                        self.cancelling.as_ref(),
                        "{op:?} failed, but only a resume or a wake-up may cancel it"
                    );
                    self.n_cancelled += 1;
                    *self.replies.entry(op).or_default() += 1;
                }
                LifecycleEvent::OffloadWeights | LifecycleEvent::DropWeights => {}
            }
        }
        self.h.check();
    }

    fn step(&mut self) {
        let step = self.h.step_outputs();
        assert!(
            !self.kv_released || step.plan.is_empty(),
            "a step was planned with the KV memory released"
        );
        for work in step.plan.connector_work.iter().chain(&step.after_work) {
            assert_eq!(work.connector, TIER, "only the tier plans jobs");
            for job in &work.jobs {
                match job {
                    // The real copier waits for every job handed over before the flush.
                    WorkerJob::Tier(TierJob::Flush { .. }) => self.copy(self.copier.len()),
                    job => self.copier.push(job.clone()),
                }
            }
        }
        self.h.recycle(step);
        if self.copy_all {
            self.copy(self.copier.len());
        }
        self.poll();
    }

    /// The copier answers its `n` oldest jobs, every one a success.
    fn copy(&mut self, n: usize) {
        let n = n.min(self.copier.len());
        for job in self.copier.drain(..n).collect::<Vec<_>>() {
            let report = match job {
                WorkerJob::Tier(TierJob::Store { hold, epoch, .. }) => {
                    WorkerReport::Tier(TierReport::StoreDone {
                        hold,
                        epoch,
                        ok: true,
                    })
                }
                WorkerJob::Tier(TierJob::Load { hold, epoch, .. }) => {
                    WorkerReport::Tier(TierReport::LoadDone {
                        hold,
                        epoch,
                        result: Ok(()),
                    })
                }
                other => panic!("not a copier job: {other:?}"),
            };
            self.h.sched.on_worker_report(TIER, report);
            let outs = self.h.sched.take_outputs();
            self.h.record(&outs);
            self.h.check();
        }
    }

    fn pick(&self, k: usize) -> Option<&String> {
        self.added.get(k % self.added.len().max(1))
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add {
                base,
                len,
                max_tokens,
            } => {
                let id = format!("r{}", self.added.len());
                let prompt: Vec<TokenId> = (0..len as u32)
                    .map(|p| TokenId(u32::from(base) * 100 + p))
                    .collect();
                let params = SamplingParams {
                    max_tokens,
                    ..SamplingParams::default()
                };
                if self
                    .h
                    .sched
                    .add_request(id.as_str(), prompt, params)
                    .is_ok()
                {
                    self.added.push(id);
                }
            }
            Op::Step => self.step(),
            Op::Abort(k) => {
                if let Some(id) = self.pick(k).cloned() {
                    if let Some(out) = self.h.sched.abort(&id) {
                        self.h.record(&[out]);
                    }
                }
            }
            Op::Hold(k) => {
                let idx = self.pick(k).and_then(|id| self.h.sched.request_idx(id));
                if let Some(idx) = idx {
                    if let Ok(t) = self
                        .h
                        .sched
                        .hold_blocks_for_transfer(idx, Holder::Connector(ConnectorId(0)))
                    {
                        let lifetime = (k % 7) as u32 + 1;
                        self.conn
                            .lock()
                            .unwrap()
                            .live
                            .push((t, lifetime, (k % 3) as u32));
                    }
                }
            }
            Op::Pause(mode, clear) => {
                let id = self.op_id(clear);
                let outs = self.h.sched.pause(id, mode, clear);
                self.h.record(&outs);
            }
            Op::Resume => {
                if self.h.sched.resume().is_ok() {
                    self.cancelling = Some(LifecycleError::CancelledByResume);
                }
            }
            Op::Sleep(level, mode) => {
                let id = self.op_id(level >= SleepLevel::L1);
                let outs = self.h.sched.sleep(id, level, mode);
                self.h.record(&outs);
            }
            Op::WakeUp(t) => {
                let tags: &[WakeTag] = match t {
                    0 => &[],
                    1 => &[WakeTag::Weights],
                    _ => &[WakeTag::KvCache],
                };
                if tags.is_empty() || tags.contains(&WakeTag::KvCache) {
                    self.kv_released = false;
                }
                self.h.sched.wake_up(tags);
                self.cancelling = Some(LifecycleError::CancelledByWakeUp);
            }
            Op::ReleaseKv => {
                let id = self.op_id(true);
                if let Err(e) = self.h.sched.release_kv_cache_memory(id) {
                    assert_eq!(e, LifecycleError::NotPaused);
                    self.issued.insert(id, false);
                    *self.replies.entry(id).or_default() += 1;
                }
            }
            Op::Reset(running, connector) => {
                let held = self.h.sched.stats().n_blocks_used > 0;
                let ok = self.h.sched.reset_caches(running, connector);
                if ok {
                    assert_eq!(self.h.sched.stats().n_blocks_cached, 0);
                }
                if !held && !running {
                    assert!(ok || self.h.sched.stats().n_transfers > 0);
                }
            }
            Op::WeightVersion(v) => self.h.sched.set_weight_version(v.to_string()),
            Op::AbortAll => {
                let outs = self.h.sched.abort_all();
                self.h.record(&outs);
            }
            Op::Copy(n) => self.copy(n),
        }
        self.poll();
        self.cancelling = None;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn every_lifecycle_operation_completes_and_nothing_is_lost(
        ops in proptest::collection::vec(op(), 1..60),
        arc in any::<bool>(),
    ) {
        let mut run = Run::new(arc);
        for op in &ops {
            run.apply(op);
        }
        // Let transfers and copies end, wake everything, resume, drain.
        run.copy_all = true;
        for _ in 0..20 {
            run.step();
        }
        run.kv_released = false;
        run.h.sched.wake_up(&[]);
        run.cancelling = Some(LifecycleError::CancelledByWakeUp);
        run.poll();
        if run.h.sched.resume().is_ok() {
            run.cancelling = Some(LifecycleError::CancelledByResume);
        }
        run.poll();
        run.cancelling = None;
        prop_assert!(!run.h.sched.lifecycle_status().paused);
        for _ in 0..2000 {
            if run.h.sched.n_live() == 0 && run.h.sched.stats().n_transfers == 0 {
                break;
            }
            run.step();
        }
        prop_assert_eq!(run.h.sched.n_live(), 0, "not drained: {:?}", run.h.sched.stats());
        for op in run.issued.keys() {
            prop_assert_eq!(run.replies.get(op).copied(), Some(1), "operation {:?} replies", op);
        }
        for id in &run.added {
            prop_assert_eq!(run.h.finished.get(id).map(|f| f.1), Some(1), "request {} finished", id);
        }
        let s = run.h.sched.stats();
        prop_assert_eq!((s.n_blocks_used, s.n_transfers, s.n_running, s.n_waiting), (0, 0, 0, 0));
        prop_assert!(run.h.sched.reset_caches(false, true));
    }
}
