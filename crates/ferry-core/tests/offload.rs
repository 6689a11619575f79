//! The offload tier's scheduler side with a stand-in for its copier (`Copier`): stores of
//! newly full blocks, hits after the local prefix cache, eviction by each policy, and every
//! reset rule of the contract ("Offload tier reset"): the flush set, re-entrancy, epochs,
//! retracted loads. Block ownership and the queues are checked after every step (the
//! harness's driver runs checked) and after every report. That the bytes copied are the
//! right KV is for the engine's tests (checksum model, tiny Llama).

mod common;

use common::{prompt, Harness};
use ferry_core::{
    hash::BlockHash, BlockId, ConnectorId, ExternalMatch, ExternalQuery, HoldKind, Holder,
    HostCopy, KvConnector, LifecycleEvent, OffloadConfig, OffloadConnector, OffloadPolicy, OpId,
    Owner, PauseMode, RequestState, SamplingParams, SchedulerConfig, SleepLevel, StoreHolds,
    TierJob, TierReport, TokenId, TransferId, WorkerJob, WorkerReport,
};

const BS: usize = 4;
const CONN: ConnectorId = ConnectorId(0);
/// Bytes of one engine block in these tests (any positive figure: no bytes move here).
const BLOCK_BYTES: usize = 8;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: BS,
        n_blocks: 64,
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        max_model_len: 128,
        ..SchedulerConfig::default()
    }
}

fn tier(n_slots: usize, blocks_per_slot: usize, policy: OffloadPolicy) -> OffloadConfig {
    OffloadConfig {
        block_size: BS,
        blocks_per_slot,
        block_bytes: BLOCK_BYTES,
        capacity_bytes: (n_slots * blocks_per_slot * BLOCK_BYTES) as u64,
        policy,
    }
}

fn engine(t: OffloadConfig) -> Harness {
    let mut h = Harness::new(config());
    assert_eq!(
        h.sched.add_connector(Box::new(OffloadConnector::new(t))),
        CONN
    );
    h
}

fn greedy(n: u32) -> SamplingParams {
    SamplingParams::greedy(n)
}

/// The copier's stand-in: takes each step's jobs, answers them when the test says.
#[derive(Debug, Default)]
struct Copier {
    /// Store and load jobs not answered yet, in order.
    pending: Vec<WorkerJob>,
    /// Every flush set delivered, in order.
    flushes: Vec<Vec<TransferId>>,
    n_stores: usize,
    n_loads: usize,
}

impl Copier {
    fn take(&mut self, step: &ferry_core::Step) {
        for work in step.plan.connector_work.iter().chain(&step.after_work) {
            assert_eq!(work.connector, CONN);
            for job in &work.jobs {
                match job {
                    WorkerJob::Tier(TierJob::Store { .. }) => self.n_stores += 1,
                    WorkerJob::Tier(TierJob::Load { .. }) => self.n_loads += 1,
                    WorkerJob::Tier(TierJob::Flush { holds }) => {
                        self.flushes.push(holds.clone());
                        continue;
                    }
                    other => panic!("not an offload job: {other:?}"),
                }
                self.pending.push(job.clone());
            }
        }
    }

    /// Answers every pending job (all succeed) and hands the reports to the core.
    fn complete(&mut self, h: &mut Harness) {
        for job in std::mem::take(&mut self.pending) {
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
                _ => unreachable!(),
            };
            h.sched.on_worker_report(CONN, report);
            let outs = h.sched.take_outputs();
            h.record(&outs);
            h.check();
        }
    }
}

fn step(c: &mut Copier, h: &mut Harness) -> ferry_core::StepPlan {
    let s = h.step_outputs();
    c.take(&s);
    s.plan
}

/// Steps until nothing is live and every job was answered.
fn drain(c: &mut Copier, h: &mut Harness) {
    for _ in 0..100 {
        if h.sched.n_live() == 0 && !h.sched.needs_idle_steps() && c.pending.is_empty() {
            return;
        }
        step(c, h);
        c.complete(h);
    }
    panic!("not drained: {:?}", h.sched.stats());
}

fn poll(c: &mut Copier, h: &mut Harness) -> Vec<LifecycleEvent> {
    let mut out = Vec::new();
    h.sched.poll_lifecycle(&mut out);
    if h.sched.needs_idle_steps() {
        step(c, h);
    }
    out
}

fn holds_of(h: &Harness, kind: HoldKind) -> Vec<TransferId> {
    let ledger = h.sched.block_ledger().unwrap();
    h.sched
        .transfer_ids()
        .filter(|&t| {
            let owner = Owner::Transfer {
                hold: t,
                holder: Holder::Connector(CONN),
                kind,
            };
            ledger
                .iter()
                .any(|b| matches!(b, ferry_core::BlockStatus::Held(o) if o.contains(&owner)))
        })
        .collect()
}

fn state(h: &Harness, id: &str) -> RequestState {
    let idx = h.sched.request_idx(id).expect("live");
    h.sched.request(idx).unwrap().state.clone()
}

/// A single engine's output without a tier, as the reference.
fn reference(id: &str, p: Vec<TokenId>, max_tokens: u32) -> Vec<TokenId> {
    let mut h = Harness::new(config());
    h.add(id, p, greedy(max_tokens));
    h.drain(100);
    h.generated[id].clone()
}

/// Runs `id` to completion and answers its stores.
fn run_and_store(c: &mut Copier, h: &mut Harness, id: &str, p: Vec<TokenId>) {
    h.add(id, p, greedy(1));
    drain(c, h);
}

#[test]
fn full_blocks_are_stored_and_a_new_request_loads_them_after_the_local_cache() {
    let mut c = Copier::default();
    let mut h = engine(tier(16, 1, OffloadPolicy::Lru));
    h.add("a", prompt(1, 17), greedy(1));
    let plan = step(&mut c, &mut h);
    assert_eq!(plan.reqs.len(), 1);
    assert_eq!(h.finished["a"].1, 1, "a finished in its first step");
    // The store of its 4 full blocks is in flight, holding them.
    assert_eq!(c.n_stores, 1);
    let WorkerJob::Tier(TierJob::Store { copies, .. }) = &c.pending[0] else {
        panic!("a store")
    };
    assert_eq!(
        copies.iter().map(|c| c.host_block).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(holds_of(&h, HoldKind::Store).len(), 1);
    assert!(
        !h.sched.reset_caches(false, false),
        "the store holds blocks"
    );
    c.complete(&mut h);
    assert!(holds_of(&h, HoldKind::Store).is_empty());
    let stats = h.sched.tier_stats().unwrap();
    assert_eq!(stats.n_stores, 4);
    assert_eq!(stats.bytes_used, 4 * BLOCK_BYTES as u64);

    // Without the local prefix cache, b finds the prefix in the tier.
    assert!(h.sched.reset_caches(false, false));
    h.add("b", prompt(1, 17), greedy(3));
    let plan = step(&mut c, &mut h);
    assert!(plan.reqs.is_empty(), "b waits for its load");
    assert!(matches!(
        state(&h, "b"),
        RequestState::WaitingForRemoteKv { n_tokens: 16, .. }
    ));
    assert_eq!(holds_of(&h, HoldKind::Load).len(), 1);
    let WorkerJob::Tier(TierJob::Load { copies, .. }) = &c.pending[0] else {
        panic!("a load")
    };
    assert_eq!(
        copies.iter().map(|c| c.host_block).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    c.complete(&mut h);
    let plan = step(&mut c, &mut h);
    assert_eq!(
        plan.reqs[0].start_pos, 16,
        "only the last prompt token is computed"
    );
    drain(&mut c, &mut h);
    assert_eq!(h.generated["b"], reference("b", prompt(1, 17), 3));
    let stats = h.sched.tier_stats().unwrap();
    assert_eq!((stats.n_hits, stats.n_hit_blocks, stats.n_loads), (1, 4, 1));
    assert_eq!(h.sched.stats().n_blocks_used, 0);
}

#[test]
fn an_offloaded_block_of_two_engine_blocks_loads_only_what_the_local_hit_lacks() {
    let mut c = Copier::default();
    let mut h = engine(tier(8, 2, OffloadPolicy::Lru));
    // 4 engine blocks = 2 offloaded blocks; the 5th block is not full.
    run_and_store(&mut c, &mut h, "a", prompt(2, 18));
    assert_eq!(h.sched.tier_stats().unwrap().n_stores, 2);
    // A prompt sharing only the first engine block locally: drop the local cache, compute a
    // 5-token request of the same prefix (1 full block), then ask for the long one.
    assert!(h.sched.reset_caches(false, false));
    run_and_store(&mut c, &mut h, "short", prompt(2, 5));
    h.add("b", prompt(2, 18), greedy(2));
    step(&mut c, &mut h);
    let WorkerJob::Tier(TierJob::Load { copies, .. }) = &c.pending[0] else {
        panic!("a load")
    };
    // Local hit: engine block 0; the tier supplies blocks 1..4 (host blocks 1, 2, 3).
    assert_eq!(
        copies.iter().map(|c| c.host_block).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    c.complete(&mut h);
    let plan = step(&mut c, &mut h);
    assert_eq!(plan.reqs[0].start_pos, 16);
    drain(&mut c, &mut h);
    assert_eq!(h.generated["b"], reference("b", prompt(2, 18), 2));
}

/// The test: a request finished with its store in flight, then two resets with no
/// step between.
#[test]
fn two_resets_before_a_step_flush_exactly_the_jobs_in_flight_and_sleep_waits_for_it() {
    let mut c = Copier::default();
    let mut h = engine(tier(16, 1, OffloadPolicy::Lru));
    h.add("a", prompt(3, 9), greedy(1));
    step(&mut c, &mut h);
    assert_eq!(h.finished["a"].1, 1);
    let stores = holds_of(&h, HoldKind::Store);
    assert_eq!(stores.len(), 1, "a's store is in flight");
    assert!(
        !h.sched.reset_caches(false, true),
        "reset_prefix_cache(reset_external) answers false while a job is in flight"
    );
    assert_eq!(
        h.sched.tier_stats().unwrap().n_flushes,
        0,
        "and revokes nothing"
    );

    // Reset one: a clearing pause; reset two: a sleep; no step between.
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    let mut events = Vec::new();
    h.sched.poll_lifecycle(&mut events);
    h.sched.sleep(OpId(2), SleepLevel::L1, PauseMode::Keep);
    h.sched.release_transfer_kv();
    h.sched.poll_lifecycle(&mut events);
    assert!(
        events.is_empty(),
        "nothing completes before the flush: {events:?}"
    );
    assert!(h.sched.needs_idle_steps(), "the flush set is pending work");

    // The next step carries exactly the job in flight, once.
    let plan = step(&mut c, &mut h);
    assert!(plan.reqs.is_empty());
    assert_eq!(c.flushes, vec![stores.clone()]);
    assert!(
        !h.sched.needs_idle_steps(),
        "delivered: waiting for the hold needs no steps"
    );
    h.sched.poll_lifecycle(&mut events);
    assert!(
        events.is_empty(),
        "the store still holds its blocks: {events:?}"
    );

    // The abandoned store ends: its hold goes, its completion never enters the index.
    c.complete(&mut h);
    assert_eq!(h.sched.transfer_ids().count(), 0);
    let mut all = Vec::new();
    for _ in 0..4 {
        all.extend(poll(&mut c, &mut h));
    }
    assert_eq!(
        all,
        vec![
            LifecycleEvent::Done(OpId(1)),
            LifecycleEvent::ReleaseKvMemory,
            LifecycleEvent::OffloadWeights,
            LifecycleEvent::Done(OpId(2)),
        ]
    );
    assert_eq!(c.flushes.len(), 1, "one flush, never repeated");
    assert!(!h.sched.needs_idle_steps(), "nothing pending afterwards");
    let stats = h.sched.tier_stats().unwrap();
    assert_eq!(stats.bytes_used, 0, "the index was dropped");
    assert_eq!(stats.n_flushes, 1);
}

/// The same rules at the connector itself: resets are re-entrant and never assert, and a
/// completion from before a reset ends its hold without entering the index.
#[test]
fn connector_resets_merge_into_one_flush_set_and_old_completions_are_ignored() {
    struct Holds(u64);
    impl StoreHolds for Holds {
        fn hold(&mut self, _: &[BlockId]) -> TransferId {
            self.0 += 1;
            TransferId(self.0)
        }
    }
    let hashes: Vec<BlockHash> = (0..4u8).map(|i| BlockHash([i; 32])).collect();
    let blocks = BlockId::list([1, 2, 3, 4]);
    let mut t = OffloadConnector::new(tier(8, 1, OffloadPolicy::Lru));
    let computed = |n_before, n_after| ferry_core::ComputedBlocks {
        req: ferry_core::ReqIdx(0),
        blocks: &blocks,
        block_hashes: &hashes,
        n_before,
        n_after,
    };
    let mut holds = Holds(0);
    t.blocks_computed(computed(0, 8), &mut holds);
    t.blocks_computed(computed(8, 16), &mut holds);
    let mut jobs = Vec::new();
    t.step_work(&mut jobs);
    assert_eq!(jobs.len(), 2);
    assert_eq!(t.n_in_flight(), 2);
    assert!(
        matches!(&jobs[1], WorkerJob::Tier(TierJob::Store { copies, epoch: 0, .. })
        if copies == &[HostCopy { block: BlockId(3), host_block: 2 }, HostCopy { block: BlockId(4), host_block: 3 }])
    );
    // The first store lands; the second is still in flight.
    t.on_tier_report(TierReport::StoreDone {
        hold: TransferId(1),
        epoch: 0,
        ok: true,
    });
    assert!(t.contains(&hashes[1]));
    // Four blocks in the index (two stored, two being stored); one job in flight.
    assert_eq!((t.n_entries(), t.n_in_flight()), (4, 1));
    t.abort_transfers();
    t.reset_cache();
    t.abort_transfers();
    t.reset_cache();
    assert!(t.has_pending_work());
    assert_eq!(t.n_entries(), 0);
    let mut jobs = Vec::new();
    t.step_work(&mut jobs);
    assert_eq!(
        jobs,
        vec![WorkerJob::Tier(TierJob::Flush {
            holds: vec![TransferId(2)]
        })]
    );
    assert!(!t.has_pending_work());
    t.on_tier_report(TierReport::StoreDone {
        hold: TransferId(2),
        epoch: 0,
        ok: true,
    });
    let mut ended = Vec::new();
    t.take_finished_transfers(&mut ended);
    assert_eq!(ended, vec![TransferId(1), TransferId(2)]);
    assert!(
        !t.contains(&hashes[3]),
        "a pre-reset completion enters no index"
    );
    assert_eq!(t.epoch(), 2);
    // The slots the abandoned job wrote are free again: a new store gets slot 0 first.
    t.blocks_computed(computed(0, 4), &mut holds);
    let mut jobs = Vec::new();
    t.step_work(&mut jobs);
    assert!(
        matches!(&jobs[0], WorkerJob::Tier(TierJob::Store { copies, epoch: 2, .. })
        if copies == &[HostCopy { block: BlockId(1), host_block: 0 }])
    );
}

/// Stores one-block prefixes `keys` in order, each landing at once; `touch` re-stores a key
/// the tier has (a use). Returns which keys the tier still has.
fn eviction_run(policy: OffloadPolicy, ops: &[(&str, u8)]) -> Vec<u8> {
    struct Holds(u64);
    impl StoreHolds for Holds {
        fn hold(&mut self, _: &[BlockId]) -> TransferId {
            self.0 += 1;
            TransferId(self.0)
        }
    }
    let mut t = OffloadConnector::new(tier(2, 1, policy));
    let mut holds = Holds(0);
    for &(_, key) in ops {
        let hashes = [BlockHash([key; 32])];
        t.blocks_computed(
            ferry_core::ComputedBlocks {
                req: ferry_core::ReqIdx(0),
                blocks: &[BlockId(1)],
                block_hashes: &hashes,
                n_before: 0,
                n_after: 4,
            },
            &mut holds,
        );
        let mut jobs = Vec::new();
        t.step_work(&mut jobs);
        for job in jobs {
            if let WorkerJob::Tier(TierJob::Store { hold, epoch, .. }) = job {
                t.on_tier_report(TierReport::StoreDone {
                    hold,
                    epoch,
                    ok: true,
                });
            }
        }
    }
    let mut have: Vec<u8> = (0..=255u8)
        .filter(|&k| t.contains(&BlockHash([k; 32])))
        .collect();
    have.sort_unstable();
    assert!(t.n_entries() <= 2);
    have
}

#[test]
fn lru_evicts_the_least_recently_used_and_arc_keeps_a_reused_block_through_a_scan() {
    // A is used twice, then B and C are new: LRU evicts A (older than B), ARC keeps A (it
    // is in the frequency list) and evicts B from the recency list.
    let ops = [("store", 1), ("store", 1), ("store", 2), ("store", 3)];
    assert_eq!(eviction_run(OffloadPolicy::Lru, &ops), vec![2, 3]);
    assert_eq!(eviction_run(OffloadPolicy::Arc, &ops), vec![1, 3]);
    // Plain recency: A, B, touch A, C: both evict B.
    let ops = [("store", 1), ("store", 2), ("store", 1), ("store", 3)];
    assert_eq!(eviction_run(OffloadPolicy::Lru, &ops), vec![1, 3]);
    assert_eq!(eviction_run(OffloadPolicy::Arc, &ops), vec![1, 3]);
}

#[test]
fn eviction_under_pressure_never_takes_a_block_being_stored_or_loaded() {
    for policy in [OffloadPolicy::Lru, OffloadPolicy::Arc] {
        let mut c = Copier::default();
        // Room for 3 offloaded blocks; every prompt below has 2 full blocks.
        let mut h = engine(tier(3, 1, policy));
        run_and_store(&mut c, &mut h, "a", prompt(10, 9));
        // b's load of a's prefix is in flight (pinned) while c and d need room.
        assert!(h.sched.reset_caches(false, false));
        h.add("b", prompt(10, 9), greedy(1));
        step(&mut c, &mut h);
        assert_eq!(c.n_loads, 1, "{policy:?}");
        let load = c.pending.pop().unwrap();
        h.add("c", prompt(11, 9), greedy(1));
        h.add("d", prompt(12, 9), greedy(1));
        step(&mut c, &mut h);
        let stats = h.sched.tier_stats().unwrap();
        // 3 slots: a's 2 are pinned, so c stores 1 block, d none (nothing evictable).
        assert_eq!(stats.n_stores, 3, "{policy:?}");
        assert_eq!(stats.n_evictions, 0, "{policy:?}");
        assert!(stats.bytes_used <= stats.bytes_capacity);
        c.pending.push(load);
        c.complete(&mut h);
        drain(&mut c, &mut h);
        // With nothing pinned, new prefixes evict.
        for seed in 20..26 {
            run_and_store(&mut c, &mut h, &format!("p{seed}"), prompt(seed, 9));
            let stats = h.sched.tier_stats().unwrap();
            assert!(stats.bytes_used <= stats.bytes_capacity, "{policy:?}");
        }
        let stats = h.sched.tier_stats().unwrap();
        assert_eq!(stats.bytes_used, stats.bytes_capacity, "{policy:?}");
        assert!(stats.n_evictions >= 12 - 3, "{policy:?}: {stats:?}");
        assert_eq!(h.generated["b"], reference("b", prompt(10, 9), 1));
        assert_eq!(h.sched.stats().n_blocks_used, 0);
    }
}

#[test]
fn a_reset_during_a_load_retracts_it_and_the_request_recomputes() {
    let mut c = Copier::default();
    let mut h = engine(tier(16, 1, OffloadPolicy::Arc));
    run_and_store(&mut c, &mut h, "a", prompt(4, 13));
    assert!(h.sched.reset_caches(false, false));
    h.add("b", prompt(4, 13), greedy(4));
    step(&mut c, &mut h);
    let load = holds_of(&h, HoldKind::Load);
    assert_eq!(load.len(), 1);
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    let mut events = Vec::new();
    h.sched.poll_lifecycle(&mut events);
    // Retracted at once: b holds no KV and waits to recompute; the hold waits for the copy.
    assert_eq!(state(&h, "b"), RequestState::Waiting);
    assert!(h
        .sched
        .request(h.sched.request_idx("b").unwrap())
        .unwrap()
        .blocks
        .is_empty());
    assert_eq!(holds_of(&h, HoldKind::Load), load);
    step(&mut c, &mut h);
    assert_eq!(c.flushes, vec![load.clone()]);
    c.complete(&mut h);
    for _ in 0..3 {
        events.extend(poll(&mut c, &mut h));
    }
    assert_eq!(events, vec![LifecycleEvent::Done(OpId(1))]);
    h.sched.resume().unwrap();
    let plan = step(&mut c, &mut h);
    assert_eq!(
        plan.reqs[0].start_pos, 0,
        "b recomputes: the tier was reset too"
    );
    drain(&mut c, &mut h);
    assert_eq!(h.generated["b"], reference("b", prompt(4, 13), 4));
    assert_eq!(h.finished["b"].1, 1);
}

#[test]
fn no_hit_crosses_a_weight_update() {
    let mut c = Copier::default();
    let mut h = engine(tier(16, 1, OffloadPolicy::Lru));
    run_and_store(&mut c, &mut h, "a", prompt(5, 17));
    assert_eq!(h.sched.tier_stats().unwrap().n_stores, 4);
    h.sched.set_weight_version("v2");
    h.add("b", prompt(5, 17), greedy(1));
    let plan = step(&mut c, &mut h);
    assert_eq!(
        plan.reqs[0].start_pos, 0,
        "neither the local cache nor the tier hits"
    );
    assert_eq!(c.n_loads, 0);
    // The query itself: the tier has nothing for the new version's hashes.
    let mut t = OffloadConnector::new(tier(4, 1, OffloadPolicy::Lru));
    let q = ExternalQuery {
        req: ferry_core::ReqIdx(0),
        prompt_len: 17,
        local_hit_tokens: 0,
        block_hashes: &[],
        weight_version: "v2",
        lora: None,
    };
    assert_eq!(t.match_external(q), ExternalMatch::None);
    drain(&mut c, &mut h);
    // b's blocks were stored under the new version: a third request hits them.
    assert!(h.sched.reset_caches(false, false));
    h.add("c", prompt(5, 17), greedy(1));
    step(&mut c, &mut h);
    assert_eq!(c.n_loads, 1);
    c.complete(&mut h);
    drain(&mut c, &mut h);
}

#[test]
fn reset_prefix_cache_with_reset_external_empties_the_tier_once_no_job_is_in_flight() {
    let mut c = Copier::default();
    let mut h = engine(tier(16, 1, OffloadPolicy::Lru));
    run_and_store(&mut c, &mut h, "a", prompt(6, 9));
    assert_eq!(
        h.sched.tier_stats().unwrap().bytes_used,
        2 * BLOCK_BYTES as u64
    );
    assert!(h.sched.reset_caches(false, true));
    assert_eq!(h.sched.tier_stats().unwrap().bytes_used, 0);
    assert!(
        !h.sched.needs_idle_steps(),
        "nothing was in flight: no flush"
    );
    h.add("b", prompt(6, 9), greedy(1));
    let plan = step(&mut c, &mut h);
    assert_eq!(plan.reqs[0].start_pos, 0);
    assert_eq!(c.n_loads, 0);
    drain(&mut c, &mut h);
}

#[test]
fn the_tier_names_itself() {
    let tier = OffloadConnector::new(tier(4, 1, OffloadPolicy::Lru));
    assert_eq!(ferry_core::KvConnector::name(&tier), "offload");
}

#[test]
fn slots_a_reset_orphaned_come_back_once_their_jobs_end() {
    // A one-slot tier: the store in flight at a reset keeps its slot until it reports, then
    // the slot is free again for the next store (never lost to the tier).
    let mut c = Copier::default();
    let mut h = engine(tier(1, 1, OffloadPolicy::Lru));
    h.add("a", prompt(3, 9), greedy(1));
    step(&mut c, &mut h);
    assert_eq!(c.pending.len(), 1, "a's store is in flight");
    h.sched.pause(OpId(1), PauseMode::Keep, true);
    for _ in 0..3 {
        assert!(
            poll(&mut c, &mut h).is_empty(),
            "the reset waits for the store"
        );
    }
    c.complete(&mut h);
    let mut events = Vec::new();
    for _ in 0..4 {
        events.extend(poll(&mut c, &mut h));
    }
    assert_eq!(events, vec![LifecycleEvent::Done(OpId(1))]);
    h.sched.resume().unwrap();
    h.add("b", prompt(4, 9), greedy(1));
    drain(&mut c, &mut h);
    assert_eq!(
        c.n_stores, 2,
        "b was stored in the slot a's store gave back"
    );
    assert_eq!(h.sched.tier_stats().unwrap().n_stores, 2);
}

#[test]
fn a_tier_load_that_outlives_its_bound_gives_up_on_the_tier() {
    let mut c = Copier::default();
    let mut h = engine(tier(16, 1, OffloadPolicy::Lru));
    h.add("a", prompt(1, 17), greedy(1));
    step(&mut c, &mut h);
    c.complete(&mut h);
    assert!(h.sched.reset_caches(false, false));
    h.add("b", prompt(1, 17), greedy(3));
    step(&mut c, &mut h);
    assert!(matches!(
        state(&h, "b"),
        RequestState::WaitingForRemoteKv { .. }
    ));
    // The copier never answers; the load's bound passes.
    let bound = h.sched.config().kv_load_timeout;
    h.sched
        .advance_time(bound + std::time::Duration::from_millis(1));
    step(&mut c, &mut h);
    assert!(
        h.finished.contains_key("b")
            || !matches!(state(&h, "b"), RequestState::WaitingForRemoteKv { .. }),
        "b no longer waits for the tier"
    );
    // The hold ends only when the copier lets go of its blocks.
    assert_eq!(holds_of(&h, HoldKind::Load).len(), 1);
    c.complete(&mut h);
    drain(&mut c, &mut h);
    assert!(holds_of(&h, HoldKind::Load).is_empty());
    assert_eq!(h.sched.stats().n_blocks_used, 0);
}

/// Every slot of KV that fills is stored exactly once, whatever the prefill chunking: the
/// tier's store count after a request equals the full slots of the KV it computed (prompt
/// and decoded tokens but the last, which is sampled, never computed), for chunk budgets
/// that end chunks on and off block boundaries, prompts of whole blocks and not, and slots
/// of one and two engine blocks. A request behind a local prefix hit stores the rest.
#[test]
fn every_slot_that_fills_is_stored_once_whatever_the_chunking() {
    for k in [1, 2] {
        for budget in 1..=9 {
            for (seed, len) in [(30, 4), (31, 8), (32, 13), (33, 16), (34, 20)] {
                let mut c = Copier::default();
                let mut h = Harness::new(SchedulerConfig {
                    max_num_batched_tokens: budget,
                    ..config()
                });
                h.sched.add_connector(Box::new(OffloadConnector::new(tier(
                    32,
                    k,
                    OffloadPolicy::Lru,
                ))));
                let max_tokens = 6;
                h.add("a", prompt(seed, len), greedy(max_tokens));
                drain(&mut c, &mut h);
                let computed = len + max_tokens as usize - 1;
                let slots = computed / BS / k;
                let case = format!("slots of {k} blocks, budget {budget}, prompt {len}");
                assert_eq!(
                    h.sched.tier_stats().unwrap().n_stores,
                    slots as u64,
                    "{case}"
                );
                assert_eq!(
                    h.generated["a"],
                    reference("a", prompt(seed, len), max_tokens)
                );
            }
        }
    }
    // A local hit of one block, then the rest of a long prompt in one chunk (from 4 tokens
    // to 64): the tier gets every slot past the hit.
    let mut c = Copier::default();
    let mut h = engine(tier(32, 1, OffloadPolicy::Lru));
    run_and_store(&mut c, &mut h, "short", prompt(40, 5));
    assert_eq!(h.sched.tier_stats().unwrap().n_stores, 1);
    h.add("long", prompt(40, 64), greedy(1));
    let plan = step(&mut c, &mut h);
    assert_eq!(
        (plan.reqs[0].start_pos, plan.reqs[0].tokens.len()),
        (4, 60),
        "one chunk after the local hit"
    );
    drain(&mut c, &mut h);
    assert_eq!(h.sched.tier_stats().unwrap().n_stores, 16);
}

/// A load's own blocks are not offered back to the tier when it lands: the use is the
/// lookup, so LRU order is set when the load starts. Here a store comes between a load's
/// start and its landing, and the next store under pressure evicts the loaded block, the
/// least recently used.
#[test]
fn a_landing_load_is_no_second_use_of_its_blocks() {
    let mut c = Copier::default();
    let mut h = engine(tier(2, 1, OffloadPolicy::Lru));
    run_and_store(&mut c, &mut h, "a", prompt(50, 5));
    assert!(h.sched.reset_caches(false, false));
    h.add("b", prompt(50, 5), greedy(1));
    step(&mut c, &mut h);
    assert_eq!(c.n_loads, 1, "b loads a's block from the tier");
    h.add("c", prompt(51, 5), greedy(1));
    step(&mut c, &mut h);
    assert_eq!(
        c.n_stores, 2,
        "c's block is stored while b's load is in flight"
    );
    c.complete(&mut h);
    drain(&mut c, &mut h);
    // A third prefix needs a slot: the LRU victim is a's block (used when b's load started,
    // before c's store).
    run_and_store(&mut c, &mut h, "d", prompt(52, 5));
    assert_eq!(h.sched.tier_stats().unwrap().n_evictions, 1);
    assert!(h.sched.reset_caches(false, false));
    for (id, seed, hit) in [("c2", 51, true), ("a2", 50, false)] {
        let loads = c.n_loads;
        h.add(id, prompt(seed, 5), greedy(1));
        drain(&mut c, &mut h);
        assert_eq!(c.n_loads > loads, hit, "{id}");
    }
}

/// vLLM's default reset (`reset_connector=false`) clears the device's prefix cache and leaves
/// the tier's blocks loadable: it says so, and its KV events remove each device block rather
/// than announce a whole-cache clear (a router would forget tier blocks that still serve). A
/// reset of the connectors too clears both, and says that.
#[test]
fn a_reset_of_the_device_cache_alone_says_so_and_its_events_keep_the_tier() {
    use ferry_core::kv_events::external_hash;
    use ferry_core::{Cleared, KvEvent, Medium};
    use std::collections::BTreeSet;
    let mut c = Copier::default();
    let mut h = Harness::new(SchedulerConfig {
        kv_events: true,
        ..config()
    });
    h.sched.add_connector(Box::new(OffloadConnector::new(tier(
        16,
        1,
        OffloadPolicy::Lru,
    ))));
    run_and_store(&mut c, &mut h, "a", prompt(1, 17));
    let mut batches = Vec::new();
    h.sched.take_kv_events(&mut batches);
    let epoch = batches.last().unwrap().epoch;
    let device: BTreeSet<u64> = h
        .sched
        .kv_pool()
        .cached_entries()
        .map(|(k, _)| external_hash(k))
        .collect();
    let tier: BTreeSet<u64> = h.sched.tier_blocks().iter().map(external_hash).collect();
    assert_eq!((device.len(), tier.len()), (4, 4));

    let device_only = Cleared {
        device: true,
        offload: false,
    };
    assert_eq!(h.sched.reset_caches_saying(false, false), Some(device_only));
    assert_eq!(device_only.names(), ["device"]);
    let mut batches = Vec::new();
    h.sched.take_kv_events(&mut batches);
    assert_eq!(batches.len(), 1);
    assert_eq!(
        batches[0].epoch, epoch,
        "no wipe: the tier's blocks still serve"
    );
    let [KvEvent::Removed {
        hashes,
        medium: Medium::Primary,
    }] = &batches[0].events[..]
    else {
        panic!("{:?}", batches[0].events)
    };
    assert_eq!(hashes.iter().copied().collect::<BTreeSet<u64>>(), device);
    let kept: BTreeSet<u64> = h.sched.tier_blocks().iter().map(external_hash).collect();
    assert_eq!(kept, tier);

    let both = Cleared {
        device: true,
        offload: true,
    };
    assert_eq!(h.sched.reset_caches_saying(false, true), Some(both));
    assert_eq!(both.names(), ["device", "offload"]);
    let mut batches = Vec::new();
    h.sched.take_kv_events(&mut batches);
    assert_eq!(batches[0].events[0], KvEvent::AllCleared);
    assert_eq!(batches[0].epoch, epoch + 1);
    assert!(h.sched.tier_blocks().is_empty());
}
