//! What the P/D engine tests share: the two halves of a disaggregated request and waits on
//! the published stats, whatever the transport.

#![allow(dead_code)] // each test binary uses a different subset

use std::time::{Duration, Instant};

use ferry_core::{FinishReason, TokenId};
use ferry_engine::{EngineHandle, KvTransferParams, TransferRequest};

use crate::support::{collect, request, Collected};

pub const BOUND: Duration = Duration::from_secs(20);
pub const MAX_TOKENS: u32 = 10;

pub async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("no answer within the bound")
}

pub fn prompt(i: usize, len: usize) -> Vec<TokenId> {
    (0..len)
        .map(|j| TokenId((3 + 7 * i + 11 * j) as u32 % 900 + 1))
        .collect()
}

/// P's part: the prompt to its first token, exported.
pub async fn prefill(p: &EngineHandle, id: &str, prompt: Vec<TokenId>) -> KvTransferParams {
    let mut req = request(id, prompt, 1);
    req.transfer = Some(TransferRequest::Export);
    let c = within(collect(within(p.generate(req)).await.unwrap())).await;
    let finish = c.finish.expect("finished");
    assert_eq!(finish.reason, FinishReason::Length);
    assert!(finish.export.is_some(), "P holds the export");
    finish.kv_transfer_params.expect("P returns the parameters")
}

/// D's part, with P's parameters.
pub async fn decode(
    d: &EngineHandle,
    id: &str,
    prompt: Vec<TokenId>,
    params: KvTransferParams,
) -> Collected {
    let mut req = request(id, prompt, MAX_TOKENS);
    // D's edge parses P's parameters, with the roles a proxy sets.
    let params = KvTransferParams {
        do_remote_prefill: true,
        do_remote_decode: false,
        ..params
    };
    req.transfer = TransferRequest::parse(&params).expect("P's parameters parse");
    within(collect(within(d.generate(req)).await.unwrap())).await
}

/// Waits until `engine`'s published stats satisfy `ok` (they are published after the
/// outputs of a step are sent).
pub async fn until(engine: &EngineHandle, ok: impl Fn(&ferry_engine::SchedulerStats) -> bool) {
    let started = Instant::now();
    while !ok(&engine.stats().scheduler) {
        assert!(started.elapsed() < BOUND, "{:?}", engine.stats().scheduler);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Waits until `engine` holds no transfer and no block (an export pulled or revoked comes
/// back through a worker report).
pub async fn until_clean(engine: &EngineHandle) {
    let started = Instant::now();
    loop {
        let s = engine.stats().scheduler;
        if s.n_transfers == 0 && s.n_blocks_used == 0 {
            break;
        }
        assert!(started.elapsed() < BOUND, "still held: {s:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    within(engine.check_invariants()).await.unwrap().unwrap();
}
