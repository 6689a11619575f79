//! P/D disaggregation between two engines in one process over the TCP transport on
//! 127.0.0.1: each engine has its own `TcpTransport`, and P advertises its listener in the
//! transfer parameters, so D reaches it only through what the parameters carry. The checksum
//! model makes every sampled token a function of the whole KV it attends over, so D producing
//! the single-engine tokens proves the right bytes crossed the socket into the right blocks.

mod pd_common;
mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_arena::BlockGrant;
use ferry_core::FinishReason;
use ferry_engine::{
    spawn_with_connectors, Connector, EngineConfig, EngineHandle, Executor, KvLoadFailurePolicy,
    KvTransferParams, PdConfig, PdRole, SchedulerConfig,
};
use ferry_kv::{Exposed, OneSided, OneSidedError, Remote, TcpTransport, TcpTransportConfig};
use pd_common::*;
use support::*;

fn pd_engine(id: &str, role: PdRole, config: SchedulerConfig) -> (EngineHandle, Arc<TcpTransport>) {
    pd_engine_with(id, role, config, None, ferry_kv::DEFAULT_READ_TIMEOUT)
}

/// A P/D engine whose transport reads KV through `one_sided` (none: streams it over TCP).
fn pd_engine_with(
    id: &str,
    role: PdRole,
    config: SchedulerConfig,
    one_sided: Option<Arc<dyn OneSided>>,
    read_timeout: Duration,
) -> (EngineHandle, Arc<TcpTransport>) {
    let bs = config.block_size;
    let transport = TcpTransport::start(TcpTransportConfig {
        engine_id: id.to_owned(),
        listen: "127.0.0.1:0".parse().unwrap(),
        layout: checksum().kv_layout(bs),
        model_id: format!("checksum/v0/vocab{VOCAB}"),
        max_in_flight_fetches: 4,
        max_connections: 8,
        io_timeout: Duration::from_secs(5),
        allowed_peers: ferry_core::AllowedPeers::default(),
        secret: None,
        pool_idle_per_peer: ferry_kv::DEFAULT_POOL_IDLE_PER_PEER,
        one_sided,
        read_timeout,
    })
    .unwrap();
    let addr = transport.local_addr();
    let pd = PdConfig {
        role,
        engine_id: id.to_owned(),
        host: Some(addr.ip().to_string()),
        port: Some(addr.port()),
        secret: [id.len() as u8 + 41; 32],
        block_size: bs,
        allowed_peers: ferry_core::AllowedPeers::default(),
    };
    let engine = spawn_with_connectors(
        EngineConfig {
            scheduler: config,
            input_queue_capacity: 256,
            lora: None,
        },
        Box::new(checksum()),
        None,
        vec![Connector::pd(pd, transport.clone())],
    )
    .unwrap();
    (engine, transport)
}

#[tokio::test]
async fn d_generates_what_a_single_engine_generates() {
    let (p, p_transport) = pd_engine("P", PdRole::Producer, small_config(256, 16));
    let (d, _d_transport) = pd_engine("D", PdRole::Consumer, small_config(256, 16));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (p, d) = (p.clone(), d.clone());
        tasks.push(tokio::spawn(async move {
            let id = format!("r{i}");
            let prompt = prompt(i, 5 + 3 * i);
            let params = prefill(&p, &id, prompt.clone()).await;
            assert_eq!(params.remote_host.as_deref(), Some("127.0.0.1"));
            let c = decode(&d, &id, prompt.clone(), params).await;
            (prompt, c)
        }));
    }
    for t in tasks {
        let (prompt, c) = t.await.unwrap();
        assert_eq!(c.reason(), FinishReason::Length);
        assert_eq!(
            c.tokens,
            oracle("v0", &prompt, MAX_TOKENS as usize),
            "D's tokens are a single engine's"
        );
    }
    until_clean(&p).await;
    until_clean(&d).await;
    assert_eq!(p_transport.n_published(), 0, "every export was pulled");
}

#[tokio::test]
async fn a_producer_gone_is_a_failed_load_that_recomputes_or_fails() {
    let (p, _p_transport) = pd_engine("P", PdRole::Producer, small_config(128, 8));
    let mut cfg = small_config(128, 8);
    cfg.kv_load_failure_policy = KvLoadFailurePolicy::Recompute;
    let (d, _d) = pd_engine("D", PdRole::Consumer, cfg);
    let (d_fail, _d_fail) = pd_engine("D2", PdRole::Consumer, small_config(128, 8));
    let a = prompt(1, 13);
    let params = prefill(&p, "a", a.clone()).await;
    // A listener that dies on every connection (a dropped port could be reused by another
    // test's transport).
    let dying = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = KvTransferParams {
        remote_port: Some(dying.local_addr().unwrap().port()),
        ..params.clone()
    };
    std::thread::spawn(move || {
        for stream in dying.incoming() {
            drop(stream);
        }
    });
    let c = decode(&d, "a", a.clone(), dead.clone()).await;
    assert_eq!(
        c.tokens,
        oracle("v0", &a, MAX_TOKENS as usize),
        "recomputed"
    );
    let c = decode(&d_fail, "a", a.clone(), dead).await;
    assert_eq!(c.reason(), FinishReason::Error);
    assert!(c.tokens.is_empty());
    // The export is still there for a reader that reaches P.
    let c = decode(&d_fail, "a2", a.clone(), params).await;
    assert_eq!(c.tokens, oracle("v0", &a, MAX_TOKENS as usize));
    until_clean(&p).await;
    until_clean(&d).await;
    until_clean(&d_fail).await;
}

/// One-sided reads over a link that stalled: P exposes its blocks, and every read waits until
/// its deadline (P's read timeout) and reports that it ran out of time, as NIXL's does.
struct StalledReads;

impl OneSided for StalledReads {
    fn name(&self) -> &'static str {
        "stalled"
    }

    fn expose(&self, _grant: &BlockGrant, known: u64) -> Result<Exposed, OneSidedError> {
        Ok(Exposed {
            generation: 1,
            metadata: (known != 1).then(|| b"stalled".to_vec()),
        })
    }

    fn known(&self, _peer: SocketAddr) -> u64 {
        0
    }

    fn read(
        &self,
        _peer: SocketAddr,
        _remote: Remote<'_>,
        _dst: &mut BlockGrant,
        deadline: Instant,
        cancelled: &AtomicBool,
    ) -> Result<(), OneSidedError> {
        while Instant::now() < deadline {
            if cancelled.load(Ordering::Acquire) {
                return Err(OneSidedError::Cancelled);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Err(OneSidedError::TimedOut)
    }
}

/// A one-sided read that outlasts P's read timeout is a timed-out load on D's metrics
/// (`ferry_kv_loads_timed_out_total`), not a broken one, and under `recompute` D answers
/// with its own prefill. The scheduler's own load bound (30 s) is far off, so the count is
/// the transport's.
#[tokio::test]
async fn a_one_sided_read_past_the_read_timeout_counts_as_timed_out() {
    let read_timeout = Duration::from_millis(200);
    let (p, _p_transport) = pd_engine_with(
        "P",
        PdRole::Producer,
        small_config(128, 8),
        Some(Arc::new(StalledReads)),
        read_timeout,
    );
    let mut cfg = small_config(128, 8);
    cfg.kv_load_failure_policy = KvLoadFailurePolicy::Recompute;
    let (d, _d_transport) = pd_engine_with(
        "D",
        PdRole::Consumer,
        cfg,
        Some(Arc::new(StalledReads)),
        read_timeout,
    );
    let a = prompt(2, 13);
    let params = prefill(&p, "a", a.clone()).await;
    let c = decode(&d, "a", a.clone(), params).await;
    assert_eq!(
        c.tokens,
        oracle("v0", &a, MAX_TOKENS as usize),
        "recomputed"
    );
    let t = d.stats().transfers;
    assert_eq!(
        (
            t.n_loads_failed_total,
            t.n_loads_timed_out_total,
            t.n_loads_broken_total
        ),
        (1, 1, 0),
        "{t:?}"
    );
    until_clean(&d).await;
}
