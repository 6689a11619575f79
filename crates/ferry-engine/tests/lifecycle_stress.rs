//! Every lifecycle operation, in a seeded random order, against requests streaming through a
//! free-running engine (the checksum model): every call replies within a bound, every request
//! finishes, a request that was not aborted has exactly the oracle's tokens (and an aborted
//! one a prefix of them), and at the end every block is free.
//!
//! The operation order is fixed by the seed; how operations interleave with steps is up to
//! the threads, which is the point: the per-operation tests (`lifecycle.rs`) pin the
//! interleavings down, this one shakes them.

mod support;

use std::time::Duration;

use ferry_core::{FinishReason, TokenId};
use ferry_engine::{
    EngineHandle, LifecycleCallError, LifecycleError, PauseMode, SleepLevel, WakeTag, WeightStore,
};
use support::*;

const BOUND: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no reply within the bound"))
}

/// xorshift64*: a fixed, dependency-free sequence for the test's choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn mode(rng: &mut Rng) -> PauseMode {
    [PauseMode::Abort, PauseMode::Wait, PauseMode::Keep][rng.below(3) as usize]
}

/// Weights dropped by a level-2 sleep come back by a (checksum) update to the same version.
async fn wake(engine: &EngineHandle, tags: &[WakeTag]) {
    match within("wake_up", engine.wake_up(tags)).await {
        Err(LifecycleCallError::Lifecycle(LifecycleError::WeightsDropped)) => {
            within(
                "update_weights",
                engine.update_weights(WeightStore::default(), Some("v0".into())),
            )
            .await
            .unwrap();
            within("wake_up", engine.wake_up(tags)).await.unwrap();
        }
        other => other.unwrap(),
    }
}

async fn random_operation(engine: &EngineHandle, rng: &mut Rng, n_requests: usize) {
    // Every error a random order can provoke is a lifecycle conflict with a clear cause;
    // anything else (a lost reply, a stopped engine) fails the test.
    let conflict = |r: Result<(), LifecycleCallError>| match r {
        Ok(()) | Err(LifecycleCallError::Lifecycle(_)) => {}
        Err(e) => panic!("unexpected error: {e}"),
    };
    match rng.below(9) {
        0 | 1 => {
            let (m, clear) = (mode(rng), rng.below(2) == 0);
            conflict(within("pause", engine.pause(m, clear)).await);
        }
        2 | 3 => conflict(within("resume", engine.resume()).await),
        4 => {
            let level = [SleepLevel::L0, SleepLevel::L1, SleepLevel::L2][rng.below(3) as usize];
            let m = mode(rng);
            conflict(within("sleep", engine.sleep(level, m)).await);
        }
        5 => {
            let tags: &[WakeTag] =
                [&[][..], &[WakeTag::Weights], &[WakeTag::KvCache]][rng.below(3) as usize];
            wake(engine, tags).await;
        }
        6 => conflict(within("release", engine.release_kv_cache_memory()).await),
        7 => {
            let (r, c) = (rng.below(2) == 0, rng.below(2) == 0);
            within("reset", engine.reset_prefix_cache(r, c))
                .await
                .unwrap();
        }
        _ => {
            let id = format!("q{}", rng.below(n_requests as u64));
            within("abort", engine.abort_requests(Some(vec![id])))
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_lifecycle_operations_under_load_lose_nothing() {
    for seed in [1u64, 2, 3] {
        let engine = engine_with_capacity(checksum(), small_config(48, 6), 256);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed);
        let n_requests = 48;
        let mut clients = Vec::new();
        let mut n_ops = 0;
        for i in 0..n_requests {
            let prompt: Vec<TokenId> = (0..4 + rng.below(20) as u32)
                .map(|j| {
                    TokenId(if j < 6 {
                        j + 1
                    } else {
                        100 + 17 * i as u32 + j
                    })
                })
                .collect();
            let max_tokens = 4 + rng.below(24) as u32;
            let req = request(&format!("q{i}"), prompt.clone(), max_tokens);
            let stream = within("generate", engine.generate(req)).await.unwrap();
            clients.push((prompt, max_tokens, tokio::spawn(collect(stream))));
            // A few operations between arrivals.
            for _ in 0..rng.below(4) {
                random_operation(&engine, &mut rng, n_requests).await;
                n_ops += 1;
            }
            for _ in 0..rng.below(50) {
                tokio::task::yield_now().await;
            }
        }
        // Bring everything back and let it run.
        wake(&engine, &[]).await;
        let _ = within("resume", engine.resume()).await;
        assert!(!within("is_paused", engine.is_paused()).await.unwrap());
        for (i, (prompt, max_tokens, client)) in clients.into_iter().enumerate() {
            let c = within("stream", client).await.unwrap();
            let want = oracle("v0", &prompt, max_tokens as usize);
            match c.reason() {
                FinishReason::Length => assert_eq!(c.tokens, want, "seed {seed} q{i}"),
                FinishReason::Abort => {
                    assert_eq!(c.tokens, want[..c.tokens.len()], "seed {seed} q{i}")
                }
                other => panic!("seed {seed} q{i}: finished with {other:?}"),
            }
        }
        within("wait_idle", engine.wait_idle()).await.unwrap();
        within("check", engine.check_invariants())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(engine.stats().scheduler.n_blocks_used, 0);
        assert!(n_ops > 40, "seed {seed}: only {n_ops} operations");
        engine.shutdown().await.unwrap();
    }
}
