//! The engine with the checksum model: exact token streams under concurrency, aborts,
//! ordering, overload, failures and shutdown.

mod support;

use std::collections::BTreeMap;

use ferry_core::{FinishReason, SamplingParams, TokenId};
use ferry_engine::{EngineHandle, GenerateError, GenerateRequest, Stopped};
use support::*;

/// `n` requests, every other one sharing a 10-token prefix.
fn workload(n: usize) -> Vec<(String, Vec<TokenId>, u32)> {
    (0..n)
        .map(|i| {
            let mut prompt: Vec<TokenId> = if i % 2 == 0 {
                (1..=10).map(TokenId).collect()
            } else {
                vec![]
            };
            prompt.extend((0..1 + i % 7).map(|j| TokenId((100 + 13 * i + j) as u32)));
            (format!("r{i}"), prompt, 1 + (i % 9) as u32)
        })
        .collect()
}

/// [`support::spawn_held`] for `(id, prompt, max_tokens)` triples.
async fn spawn_held(
    engine: &EngineHandle,
    gate: &mut Gate,
    reqs: Vec<(String, Vec<TokenId>, u32)>,
) -> Vec<tokio::task::JoinHandle<Collected>> {
    let reqs = reqs
        .into_iter()
        .map(|(id, p, n)| request(&id, p, n))
        .collect();
    support::spawn_held(engine, gate, reqs).await
}

async fn run_all(
    engine: &EngineHandle,
    reqs: &[(String, Vec<TokenId>, u32)],
) -> BTreeMap<String, Vec<TokenId>> {
    let mut tasks = Vec::new();
    for (id, prompt, max_tokens) in reqs {
        let stream = engine
            .generate(request(id, prompt.clone(), *max_tokens))
            .await
            .unwrap();
        tasks.push((id.clone(), tokio::spawn(collect(stream))));
    }
    let mut out = BTreeMap::new();
    for (id, task) in tasks {
        let c = task.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Length, "{id}");
        out.insert(id, c.tokens);
    }
    out
}

#[tokio::test]
async fn concurrent_requests_get_the_tokens_they_get_alone() {
    let reqs = workload(24);
    let mut alone = BTreeMap::new();
    for r in &reqs {
        let engine = engine(checksum(), small_config(64, 4));
        alone.extend(run_all(&engine, std::slice::from_ref(r)).await);
        engine.shutdown().await.unwrap();
    }
    // Few blocks and seats, everything queued at once: requests wait, share prefixes and
    // get preempted.
    let (exec, mut gate) = gated(checksum());
    let engine = engine(exec, small_config(12, 6));
    let tasks = spawn_held(&engine, &mut gate, reqs.clone()).await;
    gate.open();
    gate.release();
    let mut together = BTreeMap::new();
    for ((id, ..), task) in reqs.iter().zip(tasks) {
        let c = task.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Length, "{id}");
        together.insert(id.clone(), c.tokens);
    }
    assert_eq!(together, alone);
    engine.wait_idle().await.unwrap();
    engine.check_invariants().await.unwrap().unwrap();
    let stats = engine.stats();
    assert_eq!(stats.scheduler.n_blocks_used, 0);
    assert_eq!(stats.n_requests_finished_total, reqs.len() as u64);
    let n_tokens: u64 = reqs.iter().map(|r| u64::from(r.2)).sum();
    assert_eq!(stats.n_generated_tokens_total, n_tokens);
    assert!(stats.scheduler.prefix_hit_tokens > 0);
    assert!(stats.scheduler.n_preemptions > 0);
    engine.shutdown().await.unwrap();
    assert!(!engine.stats().running);
}

#[tokio::test]
async fn abort_mid_stream_finishes_with_abort_and_frees_blocks() {
    let (exec, mut gate) = gated(checksum());
    let engine = engine(exec, small_config(64, 4));
    let mut stream = engine
        .generate(request("a", TokenId::list([1, 2, 3]), 100))
        .await
        .unwrap();
    gate.next_step().await; // prefill
    gate.release();
    let first = stream.next().await.unwrap();
    assert_eq!(first.token_ids.len(), 1);
    gate.next_step().await; // first decode: the engine is inside it
    engine.abort("a").await.unwrap();
    engine.abort("unknown").await.unwrap();
    gate.open();
    gate.release();
    let rest = collect(stream).await;
    // The abort waited for the step in flight: its token came, then the finish.
    assert_eq!(rest.tokens.len(), 1);
    let finish = rest.finish.unwrap();
    assert_eq!(finish.reason, FinishReason::Abort);
    assert_eq!((finish.n_prompt_tokens, finish.n_output_tokens), (3, 2));
    engine.wait_idle().await.unwrap();
    engine.check_invariants().await.unwrap().unwrap();
    assert_eq!(engine.stats().scheduler.n_blocks_used, 0);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn dropping_a_stream_aborts_its_request() {
    let (exec, mut gate) = gated(checksum());
    let engine = engine(exec, small_config(64, 4));
    let mut stream = engine
        .generate(request("a", TokenId::list([1, 2, 3]), 200))
        .await
        .unwrap();
    gate.next_step().await;
    gate.release();
    stream.next().await.unwrap();
    gate.next_step().await;
    drop(stream);
    gate.open();
    gate.release();
    engine.wait_idle().await.unwrap();
    let stats = engine.stats();
    assert_eq!(stats.n_generated_tokens_total, 2, "the request ran on");
    assert_eq!(stats.n_requests_finished_total, 1);
    assert_eq!(stats.scheduler.n_blocks_used, 0);
    engine.check_invariants().await.unwrap().unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn inputs_are_handled_between_steps_in_arrival_order() {
    let (exec, mut gate) = gated(checksum());
    let engine = engine(exec, small_config(64, 8));
    let a = engine
        .generate(request("a", TokenId::list([1, 2, 3]), 100))
        .await
        .unwrap();
    let first = gate.next_step().await;
    assert_eq!(first.reqs, [(TokenId(1), 3)]);
    // The engine is inside step 0: queue B, an abort of A, then C.
    let e = engine.clone();
    let b = tokio::spawn(async move { e.generate(request("b", TokenId::list([20, 21]), 2)).await });
    while engine.n_queued_inputs() < 1 {
        tokio::task::yield_now().await;
    }
    engine.abort("a").await.unwrap();
    let e = engine.clone();
    let c = tokio::spawn(async move {
        e.generate(request("c", TokenId::list([30, 31, 32]), 2))
            .await
    });
    while engine.n_queued_inputs() < 3 {
        tokio::task::yield_now().await;
    }
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(
        !b.is_finished() && !c.is_finished(),
        "accepted during a step"
    );
    gate.open();
    gate.release();
    let a = collect(a).await;
    assert_eq!((a.tokens.len(), a.reason()), (1, FinishReason::Abort));
    let b = collect(b.await.unwrap().unwrap()).await;
    let c = collect(c.await.unwrap().unwrap()).await;
    assert_eq!((b.tokens.len(), c.tokens.len()), (2, 2));
    // The step after: A gone (aborted before it), B admitted before C.
    let second = gate.next_step().await;
    assert_eq!(second.reqs, [(TokenId(20), 2), (TokenId(30), 3)]);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_full_queue_is_overloaded_at_once_and_aborts_still_get_through() {
    let (exec, mut gate) = gated(checksum());
    let engine = engine_with_capacity(exec, small_config(64, 8), 2);
    let a = engine
        .generate(request("a", TokenId::list([1, 2, 3]), 200))
        .await
        .unwrap();
    gate.next_step().await;
    let mut queued = Vec::new();
    for (id, t) in [("b", 20), ("c", 30)] {
        let e = engine.clone();
        queued.push(tokio::spawn(async move {
            e.generate(request(id, vec![TokenId(t)], 3)).await
        }));
    }
    while engine.n_queued_inputs() < 2 {
        tokio::task::yield_now().await;
    }
    let err = engine
        .generate(request("d", TokenId::list([40]), 3))
        .await
        .unwrap_err();
    assert!(
        matches!(err, GenerateError::Overloaded { capacity: 2 }),
        "{err}"
    );
    // The client of A goes away while the queue is full: its abort must not be lost.
    drop(a);
    gate.open();
    gate.release();
    for task in queued {
        let c = collect(task.await.unwrap().unwrap()).await;
        assert_eq!((c.tokens.len(), c.reason()), (3, FinishReason::Length));
    }
    engine.wait_idle().await.unwrap();
    let stats = engine.stats();
    assert_eq!(stats.n_generated_tokens_total, 1 + 3 + 3);
    assert_eq!(stats.scheduler.n_blocks_used, 0);
    engine.shutdown().await.unwrap();
}

async fn alone(config: ferry_core::SchedulerConfig, params: SamplingParams) -> Collected {
    let engine = engine(checksum(), config);
    let stream = engine
        .generate(GenerateRequest {
            request_id: "x".into(),
            prompt: TokenId::list([5, 6, 7, 8, 9]),
            params,
            ..GenerateRequest::default()
        })
        .await
        .unwrap();
    let c = collect(stream).await;
    engine.shutdown().await.unwrap();
    c
}

#[tokio::test]
async fn stop_token_ids_eos_ignore_eos_and_max_tokens() {
    let config = small_config(64, 4);
    let full = alone(config.clone(), SamplingParams::greedy(12)).await;
    assert_eq!(
        (full.tokens.len(), full.reason()),
        (12, FinishReason::Length)
    );
    assert_eq!(full.finish.as_ref().unwrap().stop_reason, None);
    let stop_token = full.tokens[4];
    let cut = full.tokens.iter().position(|&t| t == stop_token).unwrap() + 1;

    let params = SamplingParams {
        stop_token_ids: vec![stop_token],
        ..SamplingParams::greedy(12)
    };
    let by_id = alone(config.clone(), params).await;
    assert_eq!(by_id.tokens, full.tokens[..cut]);
    let finish = by_id.finish.unwrap();
    assert_eq!(finish.reason, FinishReason::Stop);
    assert_eq!(
        finish.stop_reason,
        Some(ferry_engine::StopReason::Token(stop_token))
    );

    let eos_config = ferry_core::SchedulerConfig {
        eos_token_ids: vec![stop_token],
        ..config
    };
    let params = SamplingParams {
        ignore_eos: false,
        ..SamplingParams::greedy(12)
    };
    let by_eos = alone(eos_config.clone(), params.clone()).await;
    assert_eq!(by_eos.tokens, full.tokens[..cut]);
    assert_eq!(by_eos.reason(), FinishReason::Stop);
    let ignoring = SamplingParams {
        ignore_eos: true,
        ..params
    };
    let ignored = alone(eos_config, ignoring).await;
    assert_eq!(ignored.tokens, full.tokens);
    assert_eq!(ignored.reason(), FinishReason::Length);
}

#[tokio::test]
async fn logprobs_come_one_per_token_only_when_asked() {
    let config = small_config(64, 4);
    let mut params = SamplingParams::greedy(6);
    params.sampler.logprobs = Some(1);
    let with = alone(config.clone(), params).await;
    for chunk in &with.chunks {
        assert_eq!(chunk.logprobs.len(), chunk.token_ids.len());
        for (lp, &t) in chunk.logprobs.iter().zip(&chunk.token_ids) {
            assert_eq!((lp.token, lp.logprob), (t, 0.0));
            assert_eq!(lp.top, [(t, 0.0)]);
        }
    }
    let without = alone(config, SamplingParams::greedy(6)).await;
    assert!(without.chunks.iter().all(|c| c.logprobs.is_empty()));
    assert_eq!(without.tokens, with.tokens);
}

#[tokio::test]
async fn a_step_failing_once_is_recovered_with_the_same_tokens() {
    let reqs = workload(6);
    let clean = run_all(&engine(checksum(), small_config(64, 4)), &reqs).await;
    let failing = failing(checksum(), |n| n == 1);
    // Deterministic: every request queued behind step 0, so the failing step 1 is the
    // prefill of the others, shared-prefix blocks included (cached when scheduled, never
    // written: they must not be hit afterwards).
    let (exec, mut gate) = gated(failing);
    let engine = engine(exec, small_config(64, 8));
    let tasks = spawn_held(&engine, &mut gate, reqs.clone()).await;
    gate.open();
    gate.release();
    let mut recovered = BTreeMap::new();
    for ((id, ..), task) in reqs.iter().zip(tasks) {
        recovered.insert(id.clone(), task.await.unwrap().tokens);
    }
    assert_eq!(recovered, clean);
    let stats = engine.stats();
    assert_eq!(stats.n_step_failures_total, 1);
    assert!(stats.scheduler.n_preemptions > 0);
    engine.check_invariants().await.unwrap().unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_executor_failing_always_ends_every_request_with_error() {
    let failing = failing(checksum(), |_| true);
    let (exec, mut gate) = gated(failing);
    let engine = engine(exec, small_config(64, 4));
    // All requests queued while step 0 (of the first) is held: the three failures in a row
    // then cover every request.
    let tasks = spawn_held(&engine, &mut gate, workload(6)).await;
    gate.open();
    gate.release();
    for task in tasks {
        let c = task.await.unwrap();
        assert_eq!((c.tokens.len(), c.reason()), (0, FinishReason::Error));
        // Each error names the executor's failure.
        let message = c.finish.unwrap().message.unwrap_or_default();
        assert!(
            message.starts_with("3 engine steps failed in a row, the last: ")
                && message.ends_with("injected failure 2"),
            "{message}"
        );
    }
    engine.wait_idle().await.unwrap();
    let stats = engine.stats();
    assert_eq!(stats.n_step_failures_total, 3);
    assert_eq!(stats.scheduler.n_blocks_used, 0);
    engine.check_invariants().await.unwrap().unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_with_requests_in_flight_aborts_each() {
    let (exec, mut gate) = gated(checksum());
    let engine = engine(exec, small_config(64, 8));
    let reqs = workload(5)
        .into_iter()
        .map(|(id, p, _)| (id, p, 100))
        .collect();
    let tasks = spawn_held(&engine, &mut gate, reqs).await;
    // Queued inside step 0: a deferred reply (never reached: requests stay live), then the
    // shutdown. The runtime is single-threaded, so one yield runs the shutdown task up to
    // its send.
    let wait = {
        let e = engine.clone();
        tokio::spawn(async move { e.wait_idle().await })
    };
    while engine.n_queued_inputs() < 5 {
        tokio::task::yield_now().await;
    }
    let e = engine.clone();
    let shutdown = tokio::spawn(async move { e.shutdown().await });
    tokio::task::yield_now().await;
    // Only step 0 may run: were the shutdown not queued, the engine would block in step 1.
    gate.release();
    for task in tasks {
        let c = task.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Abort);
        assert!(c.tokens.len() <= 1);
    }
    shutdown.await.unwrap().unwrap();
    assert!(wait.await.unwrap().is_err(), "a deferred reply completes");
    assert!(!engine.stats().running);
    assert!(matches!(engine.shutdown().await, Err(Stopped::ShutDown)));
    let late = engine
        .generate(request("late", TokenId::list([1]), 1))
        .await;
    assert!(matches!(late, Err(GenerateError::Stopped(_))));
}

/// Panics in its second step.
struct Panicking(ferry_model::ChecksumModel, u32);

impl ferry_model::Executor for Panicking {
    fn kv_layout(&self, block_size: usize) -> ferry_arena::KvLayout {
        self.0.kv_layout(block_size)
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn weight_ops(&self) -> &dyn ferry_model::ModelWeights {
        self.0.weight_ops()
    }
    fn weight_ops_mut(&mut self) -> &mut dyn ferry_model::ModelWeights {
        self.0.weight_ops_mut()
    }
    fn execute(
        &mut self,
        plan: &ferry_core::StepPlan,
        kv: &mut ferry_arena::KvArena,
    ) -> Result<ferry_core::ModelOutput, ferry_model::ExecError> {
        self.1 += 1;
        assert!(self.1 < 2, "injected executor panic");
        self.0.execute(plan, kv)
    }
}

/// A panic on the engine thread is the engine's failure, named everywhere: the stream in
/// flight ends with an error carrying the panic's message, the stats keep it, and every later
/// call (a generation, a lifecycle call, a status read) fails with `Stopped::Failed` naming
/// it. Nothing hangs.
#[tokio::test]
async fn an_engine_thread_panic_is_the_engines_failure_named_everywhere_not_a_hang() {
    let engine = engine(Panicking(checksum(), 0), small_config(64, 4));
    let out = collect(
        engine
            .generate(request("a", TokenId::list([1, 2]), 10))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((out.tokens.len(), out.reason()), (1, FinishReason::Error));
    let failed = Stopped::Failed("injected executor panic".into());
    assert_eq!(
        out.finish.unwrap().message.as_deref(),
        Some("the engine failed: injected executor panic")
    );
    let stats = engine.stats();
    assert!(!stats.running);
    assert_eq!(stats.failure.as_deref(), Some("injected executor panic"));
    assert_eq!(engine.failure().as_deref(), Some("injected executor panic"));
    match engine.generate(request("b", TokenId::list([1]), 1)).await {
        Err(GenerateError::Stopped(e)) => assert_eq!(e, failed),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        engine.reset_prefix_cache(false, false).await,
        Err(failed.clone())
    );
    assert_eq!(engine.wait_idle().await, Err(failed.clone()));
    assert_eq!(engine.abort("b").await, Err(failed));
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_slow_reader_gets_everything_merged_into_one_chunk() {
    use futures_core::Stream;
    let engine = engine(checksum(), small_config(64, 4));
    let mut stream = engine
        .generate(request("a", TokenId::list([1, 2, 3]), 20))
        .await
        .unwrap();
    // The engine runs the request to its end without waiting for the reader.
    engine.wait_idle().await.unwrap();
    let chunk = std::future::poll_fn(|cx| std::pin::Pin::new(&mut stream).poll_next(cx))
        .await
        .unwrap();
    assert_eq!(chunk.token_ids.len(), 20);
    let finish = chunk.finish.unwrap();
    assert_eq!(
        (finish.reason, finish.n_output_tokens),
        (FinishReason::Length, 20)
    );
    assert_eq!(stream.next().await, None);
    engine.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_prompt_token_outside_the_vocabulary_is_refused_and_harms_no_one() {
    let engine = engine(checksum(), small_config(64, 4));
    let good = engine
        .generate(request("good", TokenId::list([1, 2]), 5))
        .await
        .unwrap();
    let bad = engine
        .generate(request("bad", vec![TokenId(1), TokenId(VOCAB as u32)], 5))
        .await;
    assert!(
        matches!(
            bad,
            Err(GenerateError::TokenOutOfVocabulary { token, vocab_size })
                if token == TokenId(VOCAB as u32) && vocab_size == VOCAB
        ),
        "{bad:?}"
    );
    let good = collect(good).await;
    assert_eq!(
        (good.tokens.len(), good.reason()),
        (5, FinishReason::Length)
    );
    assert_eq!(engine.stats().n_step_failures_total, 0);
    engine.shutdown().await.unwrap();
}
