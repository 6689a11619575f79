//! The lifecycle matrix with real processes (`../shared/design/lifecycle.md`, "The matrix
//! that must pass, under load"): one `ferry serve --kv-role kv_producer` (P), one
//! `--kv-role kv_consumer` (D) and `ferry proxy` in front, on loopback, with greedy requests
//! streaming through the proxy while each lifecycle operation runs on P, on D or on both.
//!
//! Every case of the contract runs on the tiny model with the offload tier off and again with
//! it on (on P and D), and a subset on the default model, each with D at its default
//! `kv_load_failure_policy` (`fail`: no flag, every flag at its default); every case runs
//! once more on the tiny model without the tier with D under `recompute`, and once on a
//! random mixture-of-experts model (`ferry make-model moe`) with the tier on. Each case checks:
//!
//! 1. every admin call answers within its stated bound (each reply time is recorded);
//! 2. no request is lost: each streaming request ends, with every token or with
//!    `finish_reason: abort` where the operation aborts it (a client that left on purpose
//!    aside); an error is a lost request under either policy (no case injects a fault that
//!    may fail a load: the lifecycle's retractions are recomputed whatever the policy);
//! 3. the tokens of every request equal one plain engine's for the same prompt (a request
//!    aborted part-way has streamed a prefix of them);
//! 4. after the drain, every engine is idle, resumed and awake, and `/metrics` shows every KV
//!    block free (none held by a request or a transfer).
//!
//! One trio per setup runs the cases one after another (starting processes costs more than
//! most cases): the clean-state check after each case is also the precondition of the next.
//! A failed case is recorded, its trio replaced, and the run goes on, so one run reports
//! the whole matrix; the test then fails naming every failed case.
//!
//! `FERRY_MATRIX_OUT=path.json` writes every case's result as JSON (see `report`);
//! `FERRY_MATRIX_CASE=text` runs only the cases whose names contain `text`;
//! `docs/lifecycle-matrix.md` holds a run's table and the command.

#[allow(dead_code)] // Shared with the proxy tests; not every helper is used here.
#[path = "../proxy/procs.rs"]
mod procs;

mod cases;
mod ctx;
mod faults;
mod fleet;
mod load;
mod report;

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use cases::Case;
use ctx::{Ctx, Record};
use fleet::{Model, Policy, Setup, Trio};

/// The machine has 2 cores: the two tiny-model runs may share them (their engines are mostly
/// idle between steps), the default model's run takes both.
static CORES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// A case that runs past this has hung (an operation or a request that never ends).
fn case_bound(setup: &Setup) -> Duration {
    match setup.model {
        Model::Tiny | Model::Moe => Duration::from_secs(90),
        Model::Default(_) => Duration::from_secs(240),
    }
}

/// How long a case's leftovers may take to clear: P's unpulled exports come back by lease.
fn drain_bound(setup: &Setup) -> Duration {
    Duration::from_secs(setup.lease_seconds() + 10)
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Runs `cases` on one trio of `setup`, each bounded, and fails naming every failed case.
async fn run(setup: Setup, cases: Vec<Case>) {
    let reference = load::reference(&setup).await;
    let mut trio = Trio::start(&setup);
    trio.wait_clean(drain_bound(&setup)).await;
    let started = Instant::now();
    let mut failed = Vec::new();
    // `FERRY_MATRIX_CASE=text` runs only the cases whose names contain it (to replay one).
    let only = std::env::var("FERRY_MATRIX_CASE").ok();
    let chosen = cases
        .into_iter()
        .filter(|c| c.applies(setup.tier) && only.as_deref().is_none_or(|o| c.name().contains(o)));
    for case in chosen {
        let name = case.name();
        let record = Arc::new(Mutex::new(Record::default()));
        let case_started = Instant::now();
        let counters_before = trio.counters().await;
        let ctx = Ctx::new(&trio, &setup, &reference, name.clone(), Arc::clone(&record));
        let body = async {
            case.run(&ctx).await;
            trio.wait_clean(drain_bound(&setup)).await;
        };
        let error =
            match tokio::time::timeout(case_bound(&setup), AssertUnwindSafe(body).catch_unwind())
                .await
            {
                Ok(Ok(())) => None,
                Ok(Err(panic)) => Some(panic_message(panic)),
                Err(_) => Some(format!(
                    "the case ran past its bound of {} s\n{}",
                    case_bound(&setup).as_secs(),
                    trio.log_tail()
                )),
            };
        drop(ctx);
        let wall_ms = case_started.elapsed().as_millis() as u64;
        if error.is_none() {
            let after = trio.counters().await;
            record.lock().unwrap().counters = after
                .iter()
                .map(|(name, v)| (*name, v - counters_before[name]))
                .collect();
        }
        let record = record.lock().unwrap().clone();
        report::keep(report::CaseResult::new(
            &name,
            setup.tier_label(),
            setup.model.label(),
            setup.policy.label(),
            record,
            wall_ms,
            error.clone(),
        ));
        if error.is_some() {
            failed.push(name);
            // What the failed case left behind must not fail the next one.
            trio = Trio::start(&setup);
            trio.wait_clean(drain_bound(&setup)).await;
        }
    }
    eprintln!(
        "matrix: {} with the tier {}, D under {}: {} s",
        setup.model.label(),
        setup.tier_label(),
        setup.policy.label(),
        started.elapsed().as_secs()
    );
    assert!(failed.is_empty(), "failed cases: {failed:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_on_the_tiny_model_without_the_tier() {
    let _cores = CORES.acquire().await.unwrap();
    let setup = Setup {
        model: Model::Tiny,
        tier: false,
        policy: Policy::Default,
    };
    run(setup, Case::all()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_on_the_tiny_model_with_the_offload_tier() {
    let _cores = CORES.acquire().await.unwrap();
    let setup = Setup {
        model: Model::Tiny,
        tier: true,
        policy: Policy::Default,
    };
    run(setup, Case::all()).await;
}

/// A mixture-of-experts model (`ferry make-model moe`), P/D with the offload tier on both:
/// every case, its KV moved by both connectors and its weights reloaded in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_on_an_moe_model_with_the_offload_tier() {
    let _cores = CORES.acquire().await.unwrap();
    let setup = Setup {
        model: Model::Moe,
        tier: true,
        policy: Policy::Default,
    };
    run(setup, Case::all()).await;
}

/// D under `--kv-load-failure-policy recompute`, the tier off: the same cases, none may fail
/// either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_on_the_tiny_model_with_d_under_recompute() {
    let _cores = CORES.acquire().await.unwrap();
    let setup = Setup {
        model: Model::Tiny,
        tier: false,
        policy: Policy::Recompute,
    };
    run(setup, Case::all()).await;
}

/// The default model (SmolLM2-135M-Instruct, fetched by scripts/fetch-model.sh; this test
/// FAILS, never skips, without it), on a subset of cases: real weights reloaded from disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subset_on_the_default_model() {
    let cache = ferry_model::cache_dir(std::env::var_os("FERRY_CACHE"), std::env::var_os("HOME"))
        .expect("FERRY_CACHE or HOME is set");
    let path = ferry_model::default_model_path(&cache);
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/fetch-model.sh` first",
        path.display()
    );
    let _cores = CORES.acquire_many(2).await.unwrap();
    let setup = Setup {
        model: Model::Default(path),
        tier: false,
        policy: Policy::Default,
    };
    run(setup, Case::default_model_subset()).await;
}
