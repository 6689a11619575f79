//! LoRA adapters in the core: the prefix cache keyed by adapter and version, loading,
//! reloading and unloading adapters (what happens to their cached blocks, their requests and
//! the KV events), and `max_loras`.

mod common;

use common::{prompt, small_config, Harness};
use ferry_core::{
    AddError, KvEvent, KvEventBatch, LoraError, LoraId, LoraRef, Medium, SamplingParams,
    SchedulerConfig,
};

fn lora(id: u32, name: &str, version: u64) -> LoraRef {
    LoraRef::new(LoraId(id), name, version)
}

fn with(l: Option<&LoraRef>, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        lora: l.cloned(),
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Runs one request alone to its end; returns the prompt tokens it took from the prefix
/// cache.
fn hit_of(h: &mut Harness, id: &str, l: Option<&LoraRef>) -> u64 {
    let before = h.sched.stats().prefix_hit_tokens;
    h.add(id, prompt(1, 40), with(l, 2));
    h.drain(20);
    h.sched.stats().prefix_hit_tokens - before
}

/// The adapters of the hashes now cached, by adapter id (`None`: the base model).
fn cached_by_adapter(h: &Harness) -> std::collections::BTreeMap<Option<LoraId>, usize> {
    let pool = h.sched.kv_pool();
    let mut by = std::collections::BTreeMap::new();
    for (_, &b) in pool.cached_entries() {
        *by.entry(pool.cached_lora(b).map(|t| t.id)).or_default() += 1;
    }
    by
}

fn events(h: &mut Harness) -> Vec<KvEvent> {
    let mut batches: Vec<KvEventBatch> = Vec::new();
    h.sched.take_kv_events(&mut batches);
    batches.into_iter().flat_map(|b| b.events).collect()
}

#[test]
fn only_the_same_adapter_at_the_same_version_hits_its_prefix() {
    let mut h = Harness::new(small_config());
    let (a1, b1) = (lora(1, "a", 1), lora(2, "b", 1));
    h.sched.load_lora(a1.clone()).unwrap();
    h.sched.load_lora(b1.clone()).unwrap();
    // Computed with adapter a: the plan names it for the executor.
    h.add("a-first", prompt(1, 40), with(Some(&a1), 2));
    let plan = h.step();
    assert_eq!(plan.reqs[0].lora, Some(LoraId(1)));
    h.drain(20);
    // Two full blocks of 16 of the 40 tokens are cached under a at version 1.
    assert_eq!(cached_by_adapter(&h).get(&Some(LoraId(1))), Some(&2));
    assert_eq!(hit_of(&mut h, "base", None), 0, "the base model hit a's KV");
    assert_eq!(hit_of(&mut h, "b", Some(&b1)), 0, "adapter b hit a's KV");
    assert_eq!(hit_of(&mut h, "a-again", Some(&a1)), 32);
    // The base model's own blocks, cached by `base`, are hits for the base only.
    assert_eq!(hit_of(&mut h, "base-again", None), 32);
    // A new version of a: its requests hit nothing of the old one's.
    let a2 = lora(1, "a", 2);
    h.sched.load_lora(a2.clone()).unwrap();
    assert_eq!(
        hit_of(&mut h, "a-v2", Some(&a2)),
        0,
        "version 2 hit version 1's KV"
    );
    assert_eq!(hit_of(&mut h, "a-v2-again", Some(&a2)), 32);
}

#[test]
fn a_request_must_name_an_adapter_as_loaded() {
    let mut h = Harness::new(small_config());
    let a1 = lora(1, "a", 1);
    let add = |h: &mut Harness, l: &LoraRef| {
        h.sched
            .add_request("r", prompt(1, 8), with(Some(l), 2))
            .map(|_| ())
    };
    assert_eq!(
        add(&mut h, &a1),
        Err(AddError::Lora {
            id: "r".into(),
            error: LoraError::NotLoaded(LoraId(1))
        })
    );
    h.sched.load_lora(a1.clone()).unwrap();
    h.sched.load_lora(lora(1, "a", 2)).unwrap();
    // Version 1 is gone: a request still naming it is refused, not served with version 2.
    assert!(matches!(
        add(&mut h, &a1),
        Err(AddError::Lora {
            error: LoraError::NotCurrent { .. },
            ..
        })
    ));
    assert_eq!(add(&mut h, &lora(1, "a", 2)), Ok(()));
    assert_eq!(
        h.sched.loras().cloned().collect::<Vec<_>>(),
        [lora(1, "a", 2)]
    );
}

#[test]
fn loading_refuses_a_taken_name_or_id_and_a_reused_version() {
    let mut h = Harness::new(small_config());
    h.sched.load_lora(lora(1, "a", 5)).unwrap();
    let e = |h: &mut Harness, l| h.sched.load_lora(l).unwrap_err();
    assert!(matches!(
        e(&mut h, lora(2, "a", 6)),
        LoraError::NameTaken {
            loaded: LoraId(1),
            given: LoraId(2),
            ..
        }
    ));
    assert!(matches!(
        e(&mut h, lora(1, "b", 6)),
        LoraError::IdTaken { .. }
    ));
    assert!(matches!(
        e(&mut h, lora(1, "a", 5)),
        LoraError::VersionNotNewer {
            latest: 5,
            given: 5,
            ..
        }
    ));
    assert!(matches!(
        e(&mut h, lora(1, "a", 4)),
        LoraError::VersionNotNewer { .. }
    ));
    // Nothing changed by a refusal.
    assert_eq!(h.sched.lora(LoraId(1)), Some(&lora(1, "a", 5)));
    // Unloaded and loaded again (any id): still never an old version.
    assert_eq!(h.sched.unload_lora(LoraId(1)), Ok(Vec::new()));
    assert_eq!(
        h.sched.unload_lora(LoraId(1)),
        Err(LoraError::NotLoaded(LoraId(1)))
    );
    assert!(matches!(
        e(&mut h, lora(3, "a", 5)),
        LoraError::VersionNotNewer { .. }
    ));
    h.sched.load_lora(lora(3, "a", 6)).unwrap();
}

#[test]
fn unloading_aborts_the_adapters_requests_and_drops_every_block_it_computed() {
    let mut h = Harness::new(SchedulerConfig {
        kv_events: true,
        ..small_config()
    });
    let (a1, b1) = (lora(1, "a", 1), lora(2, "b", 1));
    h.sched.load_lora(a1.clone()).unwrap();
    h.sched.load_lora(b1.clone()).unwrap();
    for (id, l, seed) in [("a", Some(&a1), 1), ("b", Some(&b1), 2), ("base", None, 3)] {
        h.add(id, prompt(seed, 40), with(l, 2));
    }
    h.drain(20);
    // A request of a runs (holding cached blocks), another was just added.
    h.add("a-running", prompt(4, 40), with(Some(&a1), 50));
    h.step();
    h.add("a-waiting", prompt(5, 8), with(Some(&a1), 5));
    let stored = events(&mut h);
    let a_stored: Vec<u64> = stored
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored {
                hashes,
                lora: Some(l),
                medium: Medium::Primary,
                ..
            } if *l == a1 => Some(hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    // Stored events name the adapter (vLLM's `lora_name`) and its version.
    assert_eq!(a_stored.len(), 4, "{stored:?}");
    assert!(stored
        .iter()
        .any(|e| matches!(e, KvEvent::Stored { lora: None, hashes, .. } if !hashes.is_empty())));
    let outs = h.sched.unload_lora(LoraId(1)).unwrap();
    let aborted: Vec<&str> = outs
        .iter()
        .map(|o| o.finished.as_ref().unwrap())
        .inspect(|f| assert_eq!(f.reason.as_str(), "abort"))
        .map(|f| f.request_id.as_str())
        .collect();
    assert_eq!(aborted, ["a-running", "a-waiting"]);
    h.check();
    let by = cached_by_adapter(&h);
    assert_eq!(by.get(&Some(LoraId(1))), None, "{by:?}");
    assert_eq!(
        (by.get(&Some(LoraId(2))), by.get(&None)),
        (Some(&2), Some(&2))
    );
    // Every block a stored is announced removed.
    let mut removed: Vec<u64> = events(&mut h)
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::Removed { hashes, .. } => hashes,
            _ => Vec::new(),
        })
        .collect();
    removed.sort_unstable();
    let mut a_stored = a_stored;
    a_stored.sort_unstable();
    assert_eq!(removed, a_stored);
    assert!(h.sched.lora(LoraId(1)).is_none());
    // b and the base still hit theirs.
    h.add("b-same", prompt(2, 40), with(Some(&b1), 2));
    let before = h.sched.stats().prefix_hit_tokens;
    h.drain(20);
    assert_eq!(h.sched.stats().prefix_hit_tokens - before, 32);
}

#[test]
fn a_reload_drops_the_old_versions_blocks_and_moves_the_adapters_requests_on() {
    let mut h = Harness::new(SchedulerConfig {
        kv_events: true,
        max_num_seqs: 1,
        ..small_config()
    });
    let (a1, a2) = (lora(1, "a", 1), lora(1, "a", 2));
    h.sched.load_lora(a1.clone()).unwrap();
    h.add("done", prompt(1, 40), with(Some(&a1), 2));
    h.drain(20);
    // Running across the reload, holding cached blocks; another waits with no KV.
    h.add("running", prompt(2, 40), with(Some(&a1), 30));
    h.step();
    h.add("waiting", prompt(1, 40), with(Some(&a1), 2));
    h.step();
    let n_cached_running = cached_by_adapter(&h)[&Some(LoraId(1))];
    assert_eq!(n_cached_running, 4);
    events(&mut h);
    h.sched.load_lora(a2.clone()).unwrap();
    // Every version 1 block left the cache, the running request's too (held: it keeps them).
    assert_eq!(cached_by_adapter(&h).get(&Some(LoraId(1))), None);
    let removed: usize = events(&mut h)
        .iter()
        .map(|e| match e {
            KvEvent::Removed { hashes, .. } => hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(removed, 4);
    h.check();
    let running = h.sched.request_idx("running").unwrap();
    assert_eq!(h.sched.request(running).unwrap().lora, Some(a2.clone()));
    // It keeps computing (with version 2 now) but caches nothing: its KV mixes both.
    for _ in 0..25 {
        h.step();
    }
    assert_eq!(cached_by_adapter(&h).get(&Some(LoraId(1))), None);
    h.drain(40);
    // The waiting request ran with version 2, hit nothing and cached under version 2.
    assert_eq!(h.finished["waiting"].0.as_str(), "length");
    let pool = h.sched.kv_pool();
    let tags: Vec<u64> = pool
        .cached_entries()
        .filter_map(|(_, &b)| pool.cached_lora(b))
        .map(|t| t.version)
        .collect();
    assert_eq!(tags, [2, 2]);
    assert_eq!(hit_of(&mut h, "v2", Some(&a2)), 32);
    assert_eq!(h.sched.stats().n_blocks_used, 0);
}

/// Steps `n_steps` times: the adapters each step computed, and the first step each request
/// was computed in.
fn run_steps(
    h: &mut Harness,
    n_steps: usize,
) -> (Vec<Vec<u32>>, std::collections::BTreeMap<String, usize>) {
    let mut first = std::collections::BTreeMap::new();
    let steps = (0..n_steps)
        .map(|step| {
            let plan = h.step();
            // A request that finished in the step is gone (each here runs more than one).
            for r in &plan.reqs {
                if let Some(q) = h.sched.request(r.req) {
                    first.entry(q.id.clone()).or_insert(step);
                }
            }
            let mut ids: Vec<u32> = plan
                .reqs
                .iter()
                .filter_map(|r| r.lora)
                .map(|l| l.0)
                .collect();
            ids.sort_unstable();
            ids.dedup();
            ids
        })
        .collect();
    (steps, first)
}

#[test]
fn a_step_computes_at_most_max_loras_adapters_and_base_requests_are_not_held_up() {
    let mut h = Harness::new(SchedulerConfig {
        max_loras: Some(2),
        max_num_seqs: 8,
        ..small_config()
    });
    let ls: Vec<LoraRef> = (1..=3).map(|i| lora(i, &format!("l{i}"), 1)).collect();
    for l in &ls {
        h.sched.load_lora(l.clone()).unwrap();
    }
    h.add("l1", prompt(1, 8), with(Some(&ls[0]), 4));
    h.add("l2", prompt(2, 8), with(Some(&ls[1]), 4));
    h.add("l3", prompt(3, 8), with(Some(&ls[2]), 4));
    h.add("base", prompt(4, 8), with(None, 4));
    h.add("l1-b", prompt(5, 8), with(Some(&ls[0]), 4));
    let (steps, first) = run_steps(&mut h, 12);
    assert!(steps.iter().all(|ids| ids.len() <= 2), "{steps:?}");
    // l3 waits for a seat; the base request behind it goes at once; l1-b, behind the
    // starving l3, waits too, although l1 is seated, and runs no earlier than l3.
    assert_eq!((first["l1"], first["l2"], first["base"]), (0, 0, 0));
    assert!(first["l3"] > 0, "{first:?}");
    assert!(first["l1-b"] >= first["l3"], "{first:?}");
    h.drain(30);
    assert_eq!(h.finished.len(), 5);
}

#[test]
fn an_adapter_waiting_for_a_seat_is_not_starved_by_a_busy_one() {
    let mut h = Harness::new(SchedulerConfig {
        max_loras: Some(1),
        max_num_seqs: 8,
        ..small_config()
    });
    let (a, b) = (lora(1, "a", 1), lora(2, "b", 1));
    h.sched.load_lora(a.clone()).unwrap();
    h.sched.load_lora(b.clone()).unwrap();
    h.add("a0", prompt(1, 8), with(Some(&a), 3));
    h.step();
    h.add("b0", prompt(2, 8), with(Some(&b), 3));
    // a keeps getting requests, each arriving while one of a's runs: without the rule
    // against starvation a would hold the one seat for ever.
    let mut first_step = std::collections::BTreeMap::new();
    for step in 1..40 {
        if step < 20 {
            h.add(
                &format!("a{step}"),
                prompt(10 + step as u32, 8),
                with(Some(&a), 3),
            );
        }
        let (_, first) = run_steps(&mut h, 1);
        for (id, _) in first {
            first_step.entry(id).or_insert(step);
        }
    }
    h.drain(100);
    // b0 ran once a0 was done, before any request of a that arrived after it.
    let b0 = first_step["b0"];
    assert!(b0 <= 3, "b0 first ran in step {b0}");
    assert!(
        first_step
            .iter()
            .filter(|(id, _)| id.as_str() != "a0" && id.as_str() != "b0")
            .all(|(_, &s)| s > b0),
        "{first_step:?}"
    );
    assert_eq!(h.finished.len(), 21);
}
