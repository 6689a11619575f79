//! Two arenas, two `TcpTransport`s (or one and a hand-written peer) on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener, TcpStream as StdStream};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use ferry_arena::{Access, KvArena};
use ferry_core::{
    FetchEnd, FetchError, FetchFailure, PdReport, TransferId, Unpublished, WorkerReport,
};

use super::*;
use crate::transport::no_export;

const LAYOUT: KvLayout = KvLayout {
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 8,
    block_size: 4,
    aux_floats: 0,
};
const WAIT: Duration = Duration::from_secs(10);
const HASH: [u8; 32] = [7; 32];

fn config(id: &str, layout: KvLayout, model_id: &str, io_timeout: Duration) -> TcpTransportConfig {
    TcpTransportConfig {
        engine_id: id.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        layout,
        model_id: model_id.into(),
        max_in_flight_fetches: 4,
        max_connections: 4,
        io_timeout,
        allowed_peers: AllowedPeers::default(),
        secret: None,
        pool_idle_per_peer: DEFAULT_POOL_IDLE_PER_PEER,
        one_sided: None,
        read_timeout: crate::DEFAULT_READ_TIMEOUT,
    }
}

fn transport(id: &str) -> Arc<TcpTransport> {
    TcpTransport::start(config(id, LAYOUT, "m", WAIT)).unwrap()
}

/// Every byte of block `b` depends on `b` and its position.
fn pattern(layout: KvLayout, b: u32) -> Vec<u8> {
    (0..layout.block_bytes())
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(b * 101) as u8)
        .collect()
}

fn filled_arena(layout: KvLayout, n_blocks: usize) -> KvArena {
    let mut arena = KvArena::new(layout, n_blocks);
    for b in 0..n_blocks as u32 {
        arena
            .write_block_bytes(BlockId(b), &pattern(layout, b))
            .unwrap();
    }
    arena
}

fn reports() -> (Reports, Receiver<WorkerReport>) {
    let (tx, rx) = channel();
    let tx = Mutex::new(tx);
    (
        Reports::new(move |r| {
            let _ = lock(&tx).send(r);
        }),
        rx,
    )
}

fn publish(
    p: &TcpTransport,
    arena: &KvArena,
    blocks: &[u32],
    token: &str,
) -> Receiver<WorkerReport> {
    // SAFETY: the test's arenas are touched by nothing else while grants live.
    let grant = unsafe { arena.grant(BlockId::from_raw_slice(blocks), Access::Read) }.unwrap();
    let (r, rx) = reports();
    p.publish(
        ExportOffer {
            engine_id: "P".into(),
            hold: TransferId(1),
            token: token.into(),
            weight_version: "v0".into(),
            prompt_hash: HASH,
            n_tokens: blocks.len() * LAYOUT.block_size,
            grant,
        },
        r,
    );
    rx
}

fn spec(addr: SocketAddr, token: &str, first_block: usize, src_blocks: &[u32]) -> FetchSpec {
    FetchSpec {
        hold: TransferId(9),
        remote_engine_id: "P".into(),
        remote_host: Some(addr.ip().to_string()),
        remote_port: Some(addr.port()),
        token: token.into(),
        weight_version: "v0".into(),
        prompt_hash: HASH,
        first_block,
        src_blocks: BlockId::from_raw_slice(src_blocks).to_vec(),
    }
}

/// Starts a fetch into `dst_blocks` of `arena`; the receiver gets its `FetchDone`.
fn fetch(
    d: &TcpTransport,
    arena: &KvArena,
    spec: FetchSpec,
    dst_blocks: &[u32],
) -> Receiver<WorkerReport> {
    // SAFETY: as in `publish`.
    let grant = unsafe { arena.grant(BlockId::from_raw_slice(dst_blocks), Access::Write) }.unwrap();
    let (r, rx) = reports();
    d.fetch(spec, grant, r);
    rx
}

fn fetch_result(rx: &Receiver<WorkerReport>) -> Result<(), FetchError> {
    match rx.recv_timeout(WAIT).expect("a FetchDone") {
        WorkerReport::Pd(PdReport::FetchDone { hold, result }) => {
            assert_eq!(hold, TransferId(9));
            result
        }
        other => panic!("{other:?}"),
    }
}

fn refused(rx: &Receiver<WorkerReport>) -> String {
    refused_as(rx).1
}

/// A failed load with no block: who is to blame, and why.
fn refused_as(rx: &Receiver<WorkerReport>) -> (FetchFailure, String) {
    let e = fetch_result(rx).expect_err("refused");
    assert_eq!(e.good_blocks, 0, "{}", e.reason);
    (e.kind, e.reason)
}

/// The handshake's first bytes as a reader without a secret sends them.
fn hello(config: &TcpTransportConfig) -> Vec<u8> {
    let mut buf = Vec::new();
    Hello::ours(config, false, [0; NONCE_BYTES]).encode(&mut buf);
    buf
}

#[test]
fn a_pull_is_byte_exact_and_ends_the_export() {
    let (p, d) = (transport("P"), transport("D"));
    let p_arena = filled_arena(LAYOUT, 8);
    let d_arena = KvArena::new(LAYOUT, 8);
    let p_rx = publish(&p, &p_arena, &[5, 2, 7, 1], "tok");
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 1, &[2, 7, 1]),
        &[0, 3, 4],
    );
    assert_eq!(fetch_result(&rx), Ok(()));
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportPulled {
            hold: TransferId(1)
        })
    ));
    assert_eq!(d_arena.n_outstanding_grants(), 0);
    assert_eq!(
        p_arena.n_outstanding_grants(),
        0,
        "P dropped its grant before reporting"
    );
    for (src, dst) in [(2, 0), (7, 3), (1, 4)] {
        assert_eq!(
            d_arena.block_bytes(BlockId(dst)),
            &pattern(LAYOUT, src)[..],
            "block {src} → {dst}"
        );
    }
    assert_eq!(
        d_arena.block_bytes(BlockId(1)),
        &vec![0u8; LAYOUT.block_bytes()][..],
        "untouched"
    );
    assert_eq!(p.n_published(), 0);

    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 1, &[2, 7, 1]),
        &[0, 3, 4],
    );
    let (kind, reason) = refused_as(&rx);
    assert!(
        reason.contains("pulled or released already"),
        "one pull per export: {reason}"
    );
    assert_eq!(kind, FetchFailure::Invalid, "a second pull is a replay");
}

#[test]
fn a_handshake_mismatch_fails_closed_with_its_reason() {
    let p = transport("P");
    let p_arena = filled_arena(LAYOUT, 4);
    let _p_rx = publish(&p, &p_arena, &[0, 1], "tok");

    let other_model = TcpTransport::start(config("D", LAYOUT, "other", WAIT)).unwrap();
    let d_arena = KvArena::new(LAYOUT, 4);
    let rx = fetch(
        &other_model,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &[0, 1]),
        &[2, 3],
    );
    let (kind, reason) = refused_as(&rx);
    assert!(
        reason.contains("handshake") && reason.contains("model mismatch"),
        "{reason}"
    );
    assert_eq!(kind, FetchFailure::Fault);
    assert!(reason.contains("\"other\""), "{reason}");

    let layout = KvLayout {
        block_size: 8,
        ..LAYOUT
    };
    let other_layout = TcpTransport::start(config("D", layout, "m", WAIT)).unwrap();
    let d_arena = KvArena::new(layout, 4);
    let rx = fetch(
        &other_layout,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &[0, 1]),
        &[2, 3],
    );
    let (kind, reason) = refused_as(&rx);
    assert!(
        reason.contains("KV layout mismatch") && reason.contains("block_size 8"),
        "{reason}"
    );
    assert_eq!(kind, FetchFailure::Fault);

    // A reader whose blocks carry expert routing (aux words) and a P whose do not.
    let routed = KvLayout {
        aux_floats: 3,
        ..LAYOUT
    };
    let routed_d = TcpTransport::start(config("D", routed, "m", WAIT)).unwrap();
    let routed_arena = KvArena::new(routed, 4);
    let rx = fetch(
        &routed_d,
        &routed_arena,
        spec(p.local_addr(), "tok", 0, &[0, 1]),
        &[2, 3],
    );
    let (kind, reason) = refused_as(&rx);
    assert!(
        reason.contains("aux words per token 3")
            && reason.contains("--enable-return-routed-experts"),
        "{reason}"
    );
    assert_eq!(kind, FetchFailure::Fault);
    assert_eq!(
        d_arena.block_bytes(BlockId(2)),
        &vec![0u8; layout.block_bytes()][..]
    );
    assert_eq!(p.n_published(), 1, "a refused reader consumes nothing");
}

#[test]
fn forged_or_wrong_pulls_are_refused_and_consume_nothing() {
    let (p, d) = (transport("P"), transport("D"));
    let p_arena = filled_arena(LAYOUT, 8);
    let d_arena = KvArena::new(LAYOUT, 8);
    let p_rx = publish(&p, &p_arena, &[5, 2, 7], "tok");
    let addr = p.local_addr();
    let good = spec(addr, "tok", 0, &[5, 2, 7]);
    let invalid = FetchFailure::Invalid;
    let cases = [
        (
            FetchSpec {
                token: "forged".into(),
                ..good.clone()
            },
            "no export with this token",
            invalid,
        ),
        (
            FetchSpec {
                prompt_hash: [8; 32],
                ..good.clone()
            },
            "prompt is not the exported one",
            invalid,
        ),
        (
            FetchSpec {
                weight_version: "v1".into(),
                ..good.clone()
            },
            "KV of weights \"v0\"",
            invalid,
        ),
        (
            spec(addr, "tok", 0, &[5, 2, 6]),
            "remote_block_ids are not the export's blocks",
            invalid,
        ),
        (
            spec(addr, "tok", 1, &[5, 2, 7]),
            "remote_block_ids are not the export's blocks",
            invalid,
        ),
        (
            spec(addr, "tok", usize::MAX, &[5, 2, 7]),
            "remote_block_ids are not the export's blocks",
            invalid,
        ),
        (
            FetchSpec {
                remote_engine_id: "Q".into(),
                ..good.clone()
            },
            "serves engine \"P\", not \"Q\"",
            // Not this P's export: P restarted under a new id, or it is another P.
            FetchFailure::Fault,
        ),
    ];
    for (bad, expected, expected_kind) in cases {
        let rx = fetch(&d, &d_arena, bad, &[0, 1, 2]);
        let (kind, reason) = refused_as(&rx);
        assert!(reason.contains(expected), "{reason} lacks {expected}");
        assert_eq!(kind, expected_kind, "{reason}");
    }
    let rx = fetch(&d, &d_arena, good.clone(), &[0, 1]);
    let (kind, reason) = refused_as(&rx);
    assert!(reason.contains("2 destination blocks for 3 source blocks"));
    assert_eq!(kind, FetchFailure::Invalid);
    assert!(p_rx.try_recv().is_err(), "P learnt nothing");
    assert_eq!(
        d_arena.block_bytes(BlockId(0)),
        &vec![0u8; LAYOUT.block_bytes()][..]
    );

    let rx = fetch(&d, &d_arena, good.clone(), &[0, 1, 2]);
    assert_eq!(fetch_result(&rx), Ok(()));
    assert_eq!(d_arena.block_bytes(BlockId(2)), &pattern(LAYOUT, 7)[..]);
    let rx = fetch(&d, &d_arena, good, &[3, 4, 5]);
    let (kind, reason) = refused_as(&rx);
    assert!(reason.contains("pulled or released already"), "{reason}");
    assert_eq!(kind, FetchFailure::Invalid, "a second pull");
}

#[test]
fn a_fetch_without_an_address_or_with_a_producer_gone_fails() {
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    // A P that dies on every connection (a dropped port could be reused by another test).
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
        }
    });
    let no_address = FetchSpec {
        remote_host: None,
        ..spec(addr, "tok", 0, &[0])
    };
    let rx = fetch(&d, &d_arena, no_address, &[0]);
    let (kind, reason) = refused_as(&rx);
    assert!(reason.contains("no remote_host"), "{reason}");
    assert_eq!(kind, FetchFailure::Invalid);
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &[0]), &[0]);
    let (kind, reason) = refused_as(&rx);
    assert!(
        reason.contains(&format!("handshake with {addr}")),
        "{reason}"
    );
    assert_eq!(kind, FetchFailure::Fault, "P is gone");
    assert_eq!(d_arena.n_outstanding_grants(), 0);
}

/// A hand-written P: answers the handshake and the pull with ok, sends `n_blocks` blocks,
/// then either closes (`stall: None`) or keeps the connection open without sending for
/// `stall`.
fn fake_p(n_blocks: usize, stall: Option<Duration>) -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let hello = hello(&config("D", LAYOUT, "m", WAIT));
        s.read_exact(&mut vec![0; hello.len()]).unwrap();
        s.write_all(&[STATUS_OK, STATUS_OK]).unwrap();
        let mut pull = Vec::new();
        write_pull(&mut pull, &spec(addr, "tok", 0, &[0, 1, 2, 3]));
        s.read_exact(&mut vec![0; pull.len()]).unwrap();
        s.write_all(&[STATUS_OK]).unwrap();
        for b in 0..n_blocks {
            s.write_all(&pattern(LAYOUT, b as u32)).unwrap();
        }
        if let Some(stall) = stall {
            std::thread::sleep(stall);
        }
    });
    addr
}

#[test]
fn a_producer_that_dies_mid_transfer_is_a_failed_load_with_the_good_blocks() {
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    let addr = fake_p(2, None);
    let rx = fetch(
        &d,
        &d_arena,
        spec(addr, "tok", 0, &[0, 1, 2, 3]),
        &[0, 1, 2, 3],
    );
    let e = fetch_result(&rx).unwrap_err();
    assert_eq!(e.good_blocks, 2, "{}", e.reason);
    assert!(
        e.reason.contains("reading block 2") && e.reason.contains("closed"),
        "{}",
        e.reason
    );
    assert_eq!(d_arena.block_bytes(BlockId(1)), &pattern(LAYOUT, 1)[..]);
    assert_eq!(d_arena.n_outstanding_grants(), 0);
}

#[test]
fn a_producer_that_stalls_mid_transfer_fails_the_load_within_the_timeout() {
    let d = TcpTransport::start(config("D", LAYOUT, "m", Duration::from_millis(300))).unwrap();
    let d_arena = KvArena::new(LAYOUT, 4);
    let addr = fake_p(1, Some(Duration::from_secs(5)));
    let started = Instant::now();
    let rx = fetch(
        &d,
        &d_arena,
        spec(addr, "tok", 0, &[0, 1, 2, 3]),
        &[0, 1, 2, 3],
    );
    let e = fetch_result(&rx).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(e.good_blocks, 1, "{}", e.reason);
    assert!(e.reason.contains("timed out after 300ms"), "{}", e.reason);
}

#[test]
fn a_cancel_mid_transfer_stops_at_a_block_boundary_and_releases_the_grant() {
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    let addr = fake_p(1, Some(Duration::from_secs(5)));
    let rx = fetch(
        &d,
        &d_arena,
        spec(addr, "tok", 0, &[0, 1, 2, 3]),
        &[0, 1, 2, 3],
    );
    // Until block 0 landed (the fake P then stalls).
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "still waiting for block 1");
    let started = Instant::now();
    d.cancel_fetch(TransferId(9));
    let e = fetch_result(&rx).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!((e.good_blocks, e.reason.as_str()), (1, "cancelled"));
    assert_eq!(
        d_arena.n_outstanding_grants(),
        0,
        "dropped before the report"
    );
}

/// A hand-written D: handshake, a pull of `blocks`, reads the status and one block, then
/// stops reading. Dropping the stream closes it.
fn fake_d(addr: SocketAddr, blocks: &[u32]) -> StdStream {
    let mut s = StdStream::connect(addr).unwrap();
    let mut msg = hello(&config("D", LAYOUT_BIG, "m", WAIT));
    s.write_all(&msg).unwrap();
    let mut statuses = [9u8; 2];
    s.read_exact(&mut statuses).unwrap();
    assert_eq!(statuses, [STATUS_OK; 2]);
    let mut status = [9u8];
    msg.clear();
    write_pull(&mut msg, &spec(addr, "tok", 0, blocks));
    s.write_all(&msg).unwrap();
    s.read_exact(&mut status).unwrap();
    assert_eq!(status, [STATUS_OK]);
    s.read_exact(&mut vec![0; LAYOUT_BIG.block_bytes()])
        .unwrap();
    s
}

/// 1 MiB blocks: an export of 48 of them does not fit in loopback socket buffers, so P is
/// still writing when a fake D stops reading.
const LAYOUT_BIG: KvLayout = KvLayout {
    n_layers: 16,
    n_kv_heads: 4,
    head_dim: 64,
    block_size: 16,
    aux_floats: 0,
};

fn until_ready(p: &TcpTransport) {
    let started = Instant::now();
    while !lock(&p.inner.exports)
        .live
        .values()
        .any(|s| matches!(s, Slot::Ready(_)))
    {
        assert!(started.elapsed() < WAIT, "the export never came back");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_reader_gone_mid_pull_leaves_the_export_published() {
    let p = TcpTransport::start(config("P", LAYOUT_BIG, "m", WAIT)).unwrap();
    let d = TcpTransport::start(config("D", LAYOUT_BIG, "m", WAIT)).unwrap();
    let blocks: Vec<u32> = (0..48).collect();
    let p_arena = filled_arena(LAYOUT_BIG, 48);
    let p_rx = publish(&p, &p_arena, &blocks, "tok");
    drop(fake_d(p.local_addr(), &blocks));
    until_ready(&p);
    assert!(p_rx.try_recv().is_err(), "P learnt nothing");
    let d_arena = KvArena::new(LAYOUT_BIG, 48);
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &blocks),
        &blocks,
    );
    assert_eq!(fetch_result(&rx), Ok(()));
    assert_eq!(
        d_arena.block_bytes(BlockId(47)),
        &pattern(LAYOUT_BIG, 47)[..]
    );
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportPulled { .. })
    ));
}

#[test]
fn an_unpublish_during_a_pull_reports_gone_once_the_pull_ended() {
    let p = TcpTransport::start(config("P", LAYOUT_BIG, "m", WAIT)).unwrap();
    let d = TcpTransport::start(config("D", LAYOUT_BIG, "m", WAIT)).unwrap();
    let blocks: Vec<u32> = (0..48).collect();
    let p_arena = filled_arena(LAYOUT_BIG, 48);
    let p_rx = publish(&p, &p_arena, &blocks, "tok");
    let reader = fake_d(p.local_addr(), &blocks);
    // A second reader meanwhile is refused: one pull per export.
    let d_arena = KvArena::new(LAYOUT_BIG, 48);
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &blocks),
        &blocks,
    );
    let (kind, reason) = refused_as(&rx);
    assert!(
        reason.contains("being pulled by another reader"),
        "{reason}"
    );
    assert_eq!(kind, FetchFailure::Invalid);

    let (r, gone_rx) = reports();
    p.unpublish("P", TransferId(1), Unpublished::Revoked, r);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        gone_rx.try_recv().is_err(),
        "the pull in progress holds the export"
    );
    assert_eq!(p_arena.n_outstanding_grants(), 1);
    drop(reader);
    assert!(matches!(
        gone_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone {
            hold: TransferId(1)
        })
    ));
    assert_eq!(
        p_arena.n_outstanding_grants(),
        0,
        "dropped before the report"
    );
    assert_eq!(p.n_published(), 0);
    assert!(p_rx.try_recv().is_err(), "not pulled");
    // The failed pull did not put a revoked export back, and P remembers why it ended.
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &blocks),
        &blocks,
    );
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Revoked, "{reason}");
    assert!(reason.contains("revoked the export"), "{reason}");
}

#[test]
fn an_unpublish_during_a_pull_that_completes_leaves_a_pulled_export() {
    let p = TcpTransport::start(config("P", LAYOUT_BIG, "m", WAIT)).unwrap();
    let d = TcpTransport::start(config("D", LAYOUT_BIG, "m", WAIT)).unwrap();
    let blocks: Vec<u32> = (0..48).collect();
    let p_arena = filled_arena(LAYOUT_BIG, 48);
    let p_rx = publish(&p, &p_arena, &blocks, "tok");
    let mut reader = fake_d(p.local_addr(), &blocks);
    let (r, gone_rx) = reports();
    p.unpublish("P", TransferId(1), Unpublished::Expired, r);
    // The rest of the blocks (`fake_d` read the first).
    reader
        .read_exact(&mut vec![0; 47 * LAYOUT_BIG.block_bytes()])
        .unwrap();
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportPulled {
            hold: TransferId(1)
        })
    ));
    assert!(matches!(
        gone_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone {
            hold: TransferId(1)
        })
    ));
    let d_arena = KvArena::new(LAYOUT_BIG, 48);
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &blocks),
        &blocks,
    );
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Invalid, "pulled, not expired: {reason}");
    assert!(reason.contains("pulled or released already"), "{reason}");
}

#[test]
fn unpublish_of_a_ready_export_reports_gone_at_once() {
    let p = transport("P");
    let p_arena = filled_arena(LAYOUT, 4);
    let _p_rx = publish(&p, &p_arena, &[0, 1], "tok");
    let (r, rx) = reports();
    p.unpublish("P", TransferId(1), Unpublished::Revoked, r.clone());
    assert!(matches!(
        rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone {
            hold: TransferId(1)
        })
    ));
    assert_eq!((p.n_published(), p_arena.n_outstanding_grants()), (0, 0));
    p.unpublish("P", TransferId(1), Unpublished::Revoked, r);
    assert!(
        matches!(
            rx.recv_timeout(WAIT).unwrap(),
            WorkerReport::Pd(PdReport::ExportGone { .. })
        ),
        "unknown: gone"
    );
}

#[test]
fn a_refused_pull_arrives_with_who_is_to_blame() {
    let (p, d) = (transport("P"), transport("D"));
    let p_arena = filled_arena(LAYOUT, 8);
    let d_arena = KvArena::new(LAYOUT, 8);
    let addr = p.local_addr();
    let (r, _gone) = reports();
    let cases = [
        (
            Some(Unpublished::Revoked),
            FetchFailure::Revoked,
            "revoked the export",
        ),
        (Some(Unpublished::Expired), FetchFailure::Expired, "lease"),
        (None, FetchFailure::Invalid, "pulled or released already"),
    ];
    for (i, (unpublished, expected, words)) in cases.into_iter().enumerate() {
        let token = format!("tok{i}");
        let _p_rx = publish(&p, &p_arena, &[0, 1], &token);
        match unpublished {
            Some(reason) => p.unpublish("P", TransferId(1), reason, r.clone()),
            None => {
                let rx = fetch(&d, &d_arena, spec(addr, &token, 0, &[0, 1]), &[2, 3]);
                assert_eq!(fetch_result(&rx), Ok(()));
            }
        }
        let rx = fetch(&d, &d_arena, spec(addr, &token, 0, &[0, 1]), &[4, 5]);
        let (kind, reason) = refused_as(&rx);
        assert_eq!(kind, expected, "{reason}");
        assert!(reason.contains(words), "{reason} lacks {words}");
        assert!(reason.contains("pull refused by"), "{reason}");
    }
    let rx = fetch(&d, &d_arena, spec(addr, "never", 0, &[0, 1]), &[4, 5]);
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Invalid, "an unknown token: {reason}");
    assert!(reason.contains("no export with this token"), "{reason}");
    let rx = fetch(
        &d,
        &d_arena,
        FetchSpec {
            remote_engine_id: "P-before-restart".into(),
            ..spec(addr, "never", 0, &[0, 1])
        },
        &[4, 5],
    );
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Fault, "P is gone: {reason}");
    assert_eq!(
        d_arena.block_bytes(BlockId(4)),
        &vec![0u8; LAYOUT.block_bytes()][..]
    );
}

fn release_spec(addr: SocketAddr, engine_id: &str, token: &str) -> ReleaseSpec {
    ReleaseSpec {
        remote_engine_id: engine_id.into(),
        remote_host: Some(addr.ip().to_string()),
        remote_port: Some(addr.port()),
        token: token.into(),
    }
}

#[test]
fn a_release_frees_a_ready_export_and_a_later_pull_is_invalid() {
    let (p, d) = (transport("P"), transport("D"));
    let p_arena = filled_arena(LAYOUT, 8);
    let d_arena = KvArena::new(LAYOUT, 8);
    let addr = p.local_addr();
    let p_rx = publish(&p, &p_arena, &[0, 1], "tok");
    // Another engine's id or an unknown token: nothing happens.
    d.release(release_spec(addr, "Q", "tok"));
    d.release(release_spec(addr, "P", "other"));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!((p.n_published(), p_arena.n_outstanding_grants()), (1, 1));
    assert!(p_rx.try_recv().is_err());

    d.release(release_spec(addr, "P", "tok"));
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone {
            hold: TransferId(1)
        })
    ));
    assert_eq!(
        (p.n_published(), p_arena.n_outstanding_grants()),
        (0, 0),
        "the grant was dropped before the report"
    );
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &[0, 1]), &[2, 3]);
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Invalid, "{reason}");
    assert!(reason.contains("pulled or released already"), "{reason}");
    // Released again: still nothing to report.
    d.release(release_spec(addr, "P", "tok"));
    assert!(p_rx.recv_timeout(Duration::from_millis(200)).is_err());
}

#[test]
fn a_release_during_a_pull_ends_the_export_when_the_pull_fails() {
    let p = TcpTransport::start(config("P", LAYOUT_BIG, "m", WAIT)).unwrap();
    let d = TcpTransport::start(config("D", LAYOUT_BIG, "m", WAIT)).unwrap();
    let blocks: Vec<u32> = (0..48).collect();
    let p_arena = filled_arena(LAYOUT_BIG, 48);
    let p_rx = publish(&p, &p_arena, &blocks, "tok");
    let reader = fake_d(p.local_addr(), &blocks);
    d.release(release_spec(p.local_addr(), "P", "tok"));
    std::thread::sleep(Duration::from_millis(200));
    assert!(p_rx.try_recv().is_err(), "the pull holds the export");
    assert_eq!(p.n_published(), 1);
    drop(reader);
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone {
            hold: TransferId(1)
        })
    ));
    assert_eq!((p.n_published(), p_arena.n_outstanding_grants()), (0, 0));
}

#[test]
fn a_host_outside_the_allowed_peers_is_never_connected_to() {
    let mut cfg = config("D", LAYOUT, "m", WAIT);
    cfg.allowed_peers = AllowedPeers::parse("127.0.0.2").unwrap();
    let d = TcpTransport::start(cfg).unwrap();
    let d_arena = KvArena::new(LAYOUT, 4);
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &[0]), &[0]);
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Invalid, "{reason}");
    assert!(reason.contains("not an allowed KV peer"), "{reason}");
    // A name is never resolved here.
    let named = FetchSpec {
        remote_host: Some("localhost".into()),
        ..spec(addr, "tok", 0, &[0])
    };
    let rx = fetch(&d, &d_arena, named, &[0]);
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Invalid, "{reason}");
    assert!(reason.contains("not an IP address"), "{reason}");
    d.release(release_spec(addr, "P", "tok"));
    std::thread::sleep(Duration::from_millis(300));
    match listener.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("a connection was made: {other:?}"),
    }
    assert_eq!(d_arena.n_outstanding_grants(), 0);
}

fn with_secret(id: &str, secret: Option<&[u8]>) -> Arc<TcpTransport> {
    let mut cfg = config(id, LAYOUT, "m", WAIT);
    cfg.secret = secret.map(<[u8]>::to_vec);
    TcpTransport::start(cfg).unwrap()
}

#[test]
fn peers_with_the_same_secret_transfer() {
    let p = with_secret("P", Some(b"fleet secret"));
    let d = with_secret("D", Some(b"fleet secret"));
    let p_arena = filled_arena(LAYOUT, 4);
    let d_arena = KvArena::new(LAYOUT, 4);
    let p_rx = publish(&p, &p_arena, &[1, 2], "tok");
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &[1, 2]),
        &[0, 3],
    );
    assert_eq!(fetch_result(&rx), Ok(()));
    assert_eq!(d_arena.block_bytes(BlockId(3)), &pattern(LAYOUT, 2)[..]);
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportPulled { .. })
    ));
    // A release authenticates the same way.
    let p_rx = publish(&p, &p_arena, &[0], "tok2");
    d.release(release_spec(p.local_addr(), "P", "tok2"));
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone { .. })
    ));
    // The handshake's other checks still hold, after the authentication.
    let mut cfg = config("D", LAYOUT, "other", WAIT);
    cfg.secret = Some(b"fleet secret".to_vec());
    let other_model = TcpTransport::start(cfg).unwrap();
    let _p_rx = publish(&p, &p_arena, &[1, 2], "tok3");
    let rx = fetch(
        &other_model,
        &d_arena,
        spec(p.local_addr(), "tok3", 0, &[1, 2]),
        &[0, 3],
    );
    let (kind, reason) = refused_as(&rx);
    assert!(reason.contains("model mismatch"), "{reason}");
    assert_eq!(kind, FetchFailure::Fault);
}

#[test]
fn peers_whose_secrets_differ_transfer_nothing() {
    let d_arena = KvArena::new(LAYOUT, 4);
    let zero = vec![0u8; LAYOUT.block_bytes()];
    let (fleet, another): (&[u8], &[u8]) = (b"fleet secret", b"another secret");
    let pairs = [
        (Some(fleet), Some(another)),
        (Some(fleet), None),
        (None, Some(fleet)),
    ];
    for (p_secret, d_secret) in pairs {
        let p = with_secret("P", p_secret);
        let d = with_secret("D", d_secret);
        let p_arena = filled_arena(LAYOUT, 4);
        let p_rx = publish(&p, &p_arena, &[1, 2], "tok");
        let rx = fetch(
            &d,
            &d_arena,
            spec(p.local_addr(), "tok", 0, &[1, 2]),
            &[0, 3],
        );
        let (kind, reason) = refused_as(&rx);
        assert_eq!(kind, FetchFailure::Fault, "{reason}");
        assert!(
            reason.contains(AUTH_FAILED),
            "{p_secret:?}/{d_secret:?}: {reason}"
        );
        assert_eq!(d_arena.block_bytes(BlockId(0)), &zero[..]);
        assert_eq!(d_arena.block_bytes(BlockId(3)), &zero[..]);
        d.release(release_spec(p.local_addr(), "P", "tok"));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(p.n_published(), 1, "P keeps its export");
        assert!(p_rx.try_recv().is_err(), "P learnt nothing");
    }
}

#[test]
fn a_reader_that_cannot_prove_the_secret_is_served_nothing() {
    let p = with_secret("P", Some(b"fleet secret"));
    let p_arena = filled_arena(LAYOUT, 4);
    let p_rx = publish(&p, &p_arena, &[1, 2], "tok");
    let mut s = StdStream::connect(p.local_addr()).unwrap();
    // Claims a secret, then answers P's challenge with a guess.
    let mut msg = Vec::new();
    Hello::ours(&config("D", LAYOUT, "m", WAIT), true, [3; NONCE_BYTES]).encode(&mut msg);
    s.write_all(&msg).unwrap();
    let mut challenge = [9u8; 1 + 2 * NONCE_BYTES];
    s.read_exact(&mut challenge).unwrap();
    assert_eq!(challenge[0], STATUS_OK);
    s.write_all(&[0; 32]).unwrap();
    // And pulls at once, without waiting for the verdict.
    msg.clear();
    write_pull(&mut msg, &spec(p.local_addr(), "tok", 0, &[1, 2]));
    s.write_all(&msg).unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).unwrap();
    let mut expected = Vec::new();
    put_refusal(&mut expected, FetchFailure::Fault, AUTH_FAILED);
    assert_eq!(reply, expected, "a refusal, then the connection closes");
    assert_eq!(p.n_published(), 1);
    assert!(p_rx.try_recv().is_err());
}

#[test]
fn a_reader_of_another_protocol_version_reads_its_refusal() {
    let p = transport("P");
    let mut s = StdStream::connect(p.local_addr()).unwrap();
    // Version 1's hello: no secret flag and no nonce.
    let mut msg = MAGIC.to_vec();
    msg.extend_from_slice(&1u32.to_le_bytes());
    msg.push(1);
    put_string(&mut msg, "m");
    for d in &layout_dims(LAYOUT)[..4] {
        msg.extend_from_slice(&d.to_le_bytes());
    }
    s.write_all(&msg).unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).unwrap();
    let mut expected = vec![STATUS_REFUSED];
    put_string(
        &mut expected,
        &format!("protocol version 1, this listener speaks {PROTOCOL_VERSION}"),
    );
    assert_eq!(
        reply, expected,
        "version 1's refusal: a status and a string"
    );
}

#[test]
fn an_empty_secret_is_refused_at_start() {
    let mut cfg = config("P", LAYOUT, "m", WAIT);
    cfg.secret = Some(Vec::new());
    let e = TcpTransport::start(cfg).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let mut cfg = config("P", LAYOUT, "m", WAIT);
    cfg.secret = Some(b"do not print me".to_vec());
    let shown = format!("{cfg:?}");
    assert!(!shown.contains("do not print me"), "{shown}");
}

#[test]
fn a_connection_over_the_producers_limit_is_refused_after_the_timeout() {
    // P's timeout is 40 times the busy reader's cadence, so a loaded machine cannot make the
    // busy connection look idle.
    let mut cfg = config("P", LAYOUT, "m", Duration::from_secs(2));
    cfg.max_connections = 1;
    let p = TcpTransport::start(cfg).unwrap();
    let p_arena = filled_arena(LAYOUT, 4);
    let _p_rx = publish(&p, &p_arena, &[0, 1], "tok");
    let addr = p.local_addr();
    // A reader that keeps its connection busy with refused pulls, each well within the timeout.
    let (stop_tx, stop_rx) = channel::<()>();
    let (busy_tx, busy_rx) = channel::<()>();
    let busy = std::thread::spawn(move || {
        let mut s = StdStream::connect(addr).unwrap();
        let mut msg = hello(&config("D", LAYOUT, "m", WAIT));
        s.write_all(&msg).unwrap();
        let mut statuses = [9u8; 2];
        s.read_exact(&mut statuses).unwrap();
        assert_eq!(statuses, [STATUS_OK; 2]);
        busy_tx.send(()).unwrap();
        msg.clear();
        write_pull(&mut msg, &spec(addr, "forged", 0, &[0]));
        let reason = no_export("P");
        while stop_rx.try_recv().is_err() {
            s.write_all(&msg).unwrap();
            let mut reply = vec![0u8; 2 + 4 + reason.len()];
            s.read_exact(&mut reply).unwrap();
            assert_eq!(
                reply[..2],
                [STATUS_REFUSED_AS, kind_to_wire(FetchFailure::Invalid)]
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    busy_rx.recv_timeout(WAIT).unwrap();
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &[0, 1]), &[0, 1]);
    let reason = refused(&rx);
    assert!(reason.contains("maximum of 1 connections"), "{reason}");
    stop_tx.send(()).unwrap();
    busy.join().unwrap();
    // The slot is free again once the busy reader left.
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &[0, 1]), &[0, 1]);
    assert_eq!(fetch_result(&rx), Ok(()));
}

#[test]
fn a_producer_transport_dropped_mid_pull_is_a_failed_load_on_d() {
    let p = TcpTransport::start(config("P", LAYOUT_BIG, "m", WAIT)).unwrap();
    let d = TcpTransport::start(config("D", LAYOUT_BIG, "m", WAIT)).unwrap();
    let blocks: Vec<u32> = (0..128).collect();
    let p_arena = filled_arena(LAYOUT_BIG, 128);
    let _p_rx = publish(&p, &p_arena, &blocks, "tok");
    let d_arena = KvArena::new(LAYOUT_BIG, 128);
    let started = Instant::now();
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "tok", 0, &blocks),
        &blocks,
    );
    // Until P started streaming (128 MiB take far longer than this loop's step).
    while !lock(&p.inner.exports)
        .live
        .values()
        .any(|s| matches!(s, Slot::Pulling { .. }))
    {
        assert!(started.elapsed() < WAIT, "the pull never started");
        std::thread::yield_now();
    }
    drop(p);
    let e = fetch_result(&rx).unwrap_err();
    assert!(started.elapsed() < WAIT);
    assert!(e.good_blocks < 128, "{}", e.good_blocks);
    assert!(
        e.reason.contains("the peer closed the connection"),
        "{}",
        e.reason
    );
    assert_eq!(d_arena.n_outstanding_grants(), 0);
    // P's runtime let go of the export's grant.
    while p_arena.n_outstanding_grants() != 0 {
        assert!(started.elapsed() < WAIT, "P's grant leaked");
        std::thread::sleep(Duration::from_millis(5));
    }
}

// ---- connection reuse ----

fn pull_ok(d: &TcpTransport, d_arena: &KvArena, addr: SocketAddr, token: &str, blocks: &[u32]) {
    let rx = fetch(d, d_arena, spec(addr, token, 0, blocks), blocks);
    assert_eq!(fetch_result(&rx), Ok(()), "pulling {token}");
}

fn with_pool(id: &str, pool_idle_per_peer: usize, io_timeout: Duration) -> Arc<TcpTransport> {
    let mut cfg = config(id, LAYOUT, "m", io_timeout);
    cfg.pool_idle_per_peer = pool_idle_per_peer;
    TcpTransport::start(cfg).unwrap()
}

#[test]
fn pulls_and_releases_to_one_producer_share_one_connection() {
    let (p, d) = (transport("P"), transport("D"));
    let addr = p.local_addr();
    let p_arena = filled_arena(LAYOUT, 8);
    let d_arena = KvArena::new(LAYOUT, 8);
    let _a = publish(&p, &p_arena, &[0, 1], "a");
    let _b = publish(&p, &p_arena, &[2, 3], "b");
    let c_rx = publish(&p, &p_arena, &[4], "c");
    pull_ok(&d, &d_arena, addr, "a", &[0, 1]);
    pull_ok(&d, &d_arena, addr, "b", &[2, 3]);
    for b in 0..4 {
        assert_eq!(
            d_arena.block_bytes(BlockId(b)),
            &pattern(LAYOUT, b)[..],
            "block {b}"
        );
    }
    // A refused pull keeps the connection, and the next pull uses it again.
    let rx = fetch(&d, &d_arena, spec(addr, "a", 0, &[0, 1]), &[0, 1]);
    assert_eq!(refused_as(&rx).0, FetchFailure::Invalid);
    let _e = publish(&p, &p_arena, &[5], "e");
    pull_ok(&d, &d_arena, addr, "e", &[5]);
    // Last: P reports the release before it answers it, so a request after this report
    // could find the connection still busy.
    d.release(release_spec(addr, "P", "c"));
    assert!(matches!(
        c_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportGone { .. })
    ));
    assert_eq!(p.stats().handshakes_accepted, 1, "{:?}", p.stats());
    let stats = d.stats();
    assert_eq!(
        (stats.connections_opened, stats.connections_reused),
        (1, 4),
        "{stats:?}"
    );
}

#[test]
fn without_the_pool_each_pull_connects() {
    let p = transport("P");
    let d = with_pool("D", 0, WAIT);
    let addr = p.local_addr();
    let p_arena = filled_arena(LAYOUT, 4);
    let d_arena = KvArena::new(LAYOUT, 4);
    let _a = publish(&p, &p_arena, &[0, 1], "a");
    let _b = publish(&p, &p_arena, &[2, 3], "b");
    pull_ok(&d, &d_arena, addr, "a", &[0, 1]);
    pull_ok(&d, &d_arena, addr, "b", &[2, 3]);
    assert_eq!(p.stats().handshakes_accepted, 2, "{:?}", p.stats());
    let stats = d.stats();
    assert_eq!(
        (stats.connections_opened, stats.connections_reused),
        (2, 0),
        "{stats:?}"
    );
}

#[test]
fn an_idle_connection_past_half_the_timeout_is_not_reused() {
    let p = transport("P");
    let d = with_pool("D", DEFAULT_POOL_IDLE_PER_PEER, Duration::from_millis(400));
    let addr = p.local_addr();
    let p_arena = filled_arena(LAYOUT, 4);
    let d_arena = KvArena::new(LAYOUT, 4);
    let _a = publish(&p, &p_arena, &[0, 1], "a");
    let _b = publish(&p, &p_arena, &[2, 3], "b");
    pull_ok(&d, &d_arena, addr, "a", &[0, 1]);
    std::thread::sleep(Duration::from_millis(300));
    pull_ok(&d, &d_arena, addr, "b", &[2, 3]);
    assert_eq!(p.stats().handshakes_accepted, 2, "{:?}", p.stats());
    assert_eq!(d.stats().connections_reused, 0, "{:?}", d.stats());
}

#[test]
fn a_producer_restarted_on_its_address_is_reached_on_a_fresh_connection() {
    let d = transport("D");
    let p = transport("P");
    let addr = p.local_addr();
    let p_arena = filled_arena(LAYOUT, 4);
    let d_arena = KvArena::new(LAYOUT, 4);
    let _a = publish(&p, &p_arena, &[0, 1], "a");
    pull_ok(&d, &d_arena, addr, "a", &[0, 1]);
    // P goes; until its runtime dropped every task, and with them its end of D's idle
    // connection.
    let old = p.inner.clone();
    drop(p);
    let started = Instant::now();
    while Arc::strong_count(&old) > 1 {
        assert!(started.elapsed() < WAIT, "P's tasks never ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut cfg = config("P", LAYOUT, "m", WAIT);
    cfg.listen = addr;
    let p = TcpTransport::start(cfg).unwrap();
    let _b = publish(&p, &p_arena, &[2, 3], "b");
    pull_ok(&d, &d_arena, addr, "b", &[2, 3]);
    assert_eq!(d_arena.block_bytes(BlockId(3)), &pattern(LAYOUT, 3)[..]);
    assert_eq!(p.stats().handshakes_accepted, 1, "{:?}", p.stats());
    // The health check dropped the stale connection: it was never written to.
    let stats = d.stats();
    assert_eq!(
        (
            stats.idle_dropped,
            stats.retries,
            stats.connections_reused,
            stats.connections_opened
        ),
        (1, 0, 0, 2),
        "{stats:?}"
    );
}

/// What a scripted P does with one pull (of four blocks, token `"tok"`) on a connection.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// Status ok and the four blocks.
    Serve,
    /// Reads the pull and closes without a byte of answer, as a P whose idle timeout fired
    /// just then or that died would.
    CloseUnanswered,
    /// Status ok, then closes: the pull was taken.
    OkThenClose,
    /// The first byte of a refusal, then closes.
    RefusalCut,
    /// Status ok and block 0, then nothing for `WAIT`, the connection open.
    Stall,
}

/// A hand-written P that answers the pulls on its `i`-th connection as `script[i]` says,
/// then keeps that connection until D closes it. Returns its address and how many
/// connections it accepted.
fn scripted_p(script: Vec<Vec<Answer>>) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for answers in script {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || -> std::io::Result<()> {
                let hello = hello(&config("D", LAYOUT, "m", WAIT));
                s.read_exact(&mut vec![0; hello.len()])?;
                s.write_all(&[STATUS_OK, STATUS_OK])?;
                let mut pull = Vec::new();
                write_pull(&mut pull, &spec(addr, "tok", 0, &[0, 1, 2, 3]));
                for answer in answers {
                    s.read_exact(&mut vec![0; pull.len()])?;
                    match answer {
                        Answer::Serve => {
                            s.write_all(&[STATUS_OK])?;
                            for b in 0..4 {
                                s.write_all(&pattern(LAYOUT, b))?;
                            }
                        }
                        Answer::CloseUnanswered => return Ok(()),
                        Answer::OkThenClose => return s.write_all(&[STATUS_OK]),
                        Answer::RefusalCut => return s.write_all(&[STATUS_REFUSED_AS]),
                        Answer::Stall => {
                            s.write_all(&[STATUS_OK])?;
                            s.write_all(&pattern(LAYOUT, 0))?;
                            std::thread::sleep(WAIT);
                            return Ok(());
                        }
                    }
                }
                // Until D closes.
                let _ = s.read(&mut [0u8; 1]);
                Ok(())
            });
        }
    });
    (addr, accepted)
}

const FOUR: [u32; 4] = [0, 1, 2, 3];

#[test]
fn a_reused_connection_closed_before_the_answer_is_retried_once_on_a_new_one() {
    use Answer::*;
    let (addr, accepted) = scripted_p(vec![vec![Serve, CloseUnanswered], vec![Serve]]);
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    let stats = d.stats();
    assert_eq!(
        (
            stats.connections_reused,
            stats.retries,
            stats.connections_opened
        ),
        (1, 1, 2),
        "{stats:?}"
    );
}

#[test]
fn a_request_whose_answer_began_is_never_retried() {
    use Answer::*;
    let (addr, accepted) = scripted_p(vec![
        vec![Serve, OkThenClose],
        vec![Serve, RefusalCut],
        vec![Serve],
    ]);
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    // Each broken pull runs on a reused connection, where an unanswered one would be retried.
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &FOUR), &FOUR);
    let e = fetch_result(&rx).unwrap_err();
    assert_eq!(
        (e.kind, e.good_blocks),
        (FetchFailure::Fault, 0),
        "{}",
        e.reason
    );
    assert!(e.reason.contains("reading block 0"), "{}", e.reason);
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &FOUR), &FOUR);
    let e = fetch_result(&rx).unwrap_err();
    assert_eq!(
        (e.kind, e.good_blocks),
        (FetchFailure::Fault, 0),
        "{}",
        e.reason
    );
    assert!(e.reason.contains("pull refused by"), "{}", e.reason);
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "no third connection");
    let stats = d.stats();
    assert_eq!(
        (stats.retries, stats.connections_reused),
        (0, 2),
        "{stats:?}"
    );
}

#[test]
fn a_timed_out_pull_leaves_no_connection_to_reuse() {
    use Answer::*;
    let (addr, accepted) = scripted_p(vec![vec![Serve, Stall], vec![Serve]]);
    // Long enough that the first connection is young when the second pull takes it.
    let d = with_pool("D", DEFAULT_POOL_IDLE_PER_PEER, Duration::from_secs(2));
    let d_arena = KvArena::new(LAYOUT, 4);
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &FOUR), &FOUR);
    let e = fetch_result(&rx).unwrap_err();
    assert_eq!(e.good_blocks, 1, "{}", e.reason);
    assert!(e.reason.contains("timed out"), "{}", e.reason);
    // On the stalled connection this pull would time out too.
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(d.stats().connections_reused, 1, "{:?}", d.stats());
}

#[test]
fn a_cancelled_pull_leaves_no_connection_to_reuse() {
    use Answer::*;
    let (addr, accepted) = scripted_p(vec![vec![Serve, Stall], vec![Serve]]);
    let d = transport("D");
    let d_arena = KvArena::new(LAYOUT, 4);
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    let rx = fetch(&d, &d_arena, spec(addr, "tok", 0, &FOUR), &FOUR);
    // Until block 0 landed (the scripted P then stalls).
    std::thread::sleep(Duration::from_millis(300));
    d.cancel_fetch(TransferId(9));
    let e = fetch_result(&rx).unwrap_err();
    assert_eq!((e.good_blocks, e.reason.as_str()), (1, "cancelled"));
    pull_ok(&d, &d_arena, addr, "tok", &FOUR);
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(d.stats().connections_reused, 1, "{:?}", d.stats());
}

// ---- one-sided reads (the protocol's *read*, with an in-process stand-in for NIXL) ----

/// A [`OneSided`] for tests: "reads" by copying from P's addresses in this same process,
/// after `delay` (a slow network), counting the metadata it loaded.
struct LocalReads {
    delay: Duration,
    known: Mutex<HashMap<SocketAddr, u64>>,
    loads: std::sync::atomic::AtomicUsize,
}

impl LocalReads {
    const GENERATION: u64 = 7;

    fn new(delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            delay,
            known: Mutex::default(),
            loads: Default::default(),
        })
    }
}

impl crate::one_sided::OneSided for LocalReads {
    fn name(&self) -> &'static str {
        "local"
    }

    fn expose(&self, _grant: &BlockGrant, known: u64) -> Result<crate::Exposed, OneSidedError> {
        Ok(crate::Exposed {
            generation: Self::GENERATION,
            metadata: (known != Self::GENERATION).then(|| b"local".to_vec()),
        })
    }

    fn known(&self, peer: SocketAddr) -> u64 {
        lock(&self.known).get(&peer).copied().unwrap_or(0)
    }

    fn read(
        &self,
        peer: SocketAddr,
        remote: crate::Remote<'_>,
        dst: &mut BlockGrant,
        deadline: Instant,
        cancelled: &AtomicBool,
    ) -> Result<(), OneSidedError> {
        if let Some(md) = remote.metadata {
            assert_eq!(md, b"local");
            self.loads.fetch_add(1, Ordering::Relaxed);
            lock(&self.known).insert(peer, remote.generation);
        }
        let until = Instant::now() + self.delay;
        while Instant::now() < until {
            if cancelled.load(Ordering::Acquire) {
                return Err(OneSidedError::Cancelled);
            }
            if Instant::now() >= deadline {
                return Err(OneSidedError::TimedOut);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let n = dst.layout().block_bytes();
        for (i, &addr) in remote.addrs.iter().enumerate() {
            // SAFETY: P is this process, and it keeps the export's blocks (a read grant) until
            // the read is confirmed or its read timeout passed, which the delay stays within in
            // the tests that read.
            let src = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, n) };
            dst.block_bytes_mut(i).unwrap().copy_from_slice(src);
        }
        Ok(())
    }
}

/// A [`OneSided`] whose reads fail in the stack: addresses exposed, nothing read.
struct BrokenReads;

impl crate::one_sided::OneSided for BrokenReads {
    fn name(&self) -> &'static str {
        "broken"
    }

    fn expose(&self, _grant: &BlockGrant, _known: u64) -> Result<crate::Exposed, OneSidedError> {
        Ok(crate::Exposed {
            generation: 1,
            metadata: None,
        })
    }

    fn known(&self, _peer: SocketAddr) -> u64 {
        1
    }

    fn read(
        &self,
        _peer: SocketAddr,
        _remote: crate::Remote<'_>,
        _dst: &mut BlockGrant,
        _deadline: Instant,
        _cancelled: &AtomicBool,
    ) -> Result<(), OneSidedError> {
        Err(OneSidedError::Stack {
            step: "the read",
            reason: "the endpoint is gone".into(),
        })
    }
}

fn one_sided(
    id: &str,
    reads: Arc<dyn crate::one_sided::OneSided>,
    read_timeout: Duration,
) -> Arc<TcpTransport> {
    let mut cfg = config(id, LAYOUT, "m", WAIT);
    cfg.one_sided = Some(reads);
    cfg.read_timeout = read_timeout;
    TcpTransport::start(cfg).unwrap()
}

#[test]
fn a_one_sided_read_moves_the_blocks_and_ends_the_export() {
    let p = one_sided("P", LocalReads::new(Duration::ZERO), WAIT);
    let reads = LocalReads::new(Duration::ZERO);
    let d = one_sided("D", reads.clone(), WAIT);
    let addr = p.local_addr();
    let p_arena = filled_arena(LAYOUT, 8);
    let d_arena = KvArena::new(LAYOUT, 8);
    let p_rx = publish(&p, &p_arena, &[1, 3, 5], "a");
    let rx = fetch(&d, &d_arena, spec(addr, "a", 0, &[1, 3, 5]), &[0, 1, 2]);
    assert_eq!(fetch_result(&rx), Ok(()));
    for (dst, src) in [(0, 1), (1, 3), (2, 5)] {
        assert_eq!(
            d_arena.block_bytes(BlockId(dst)),
            &pattern(LAYOUT, src)[..],
            "block {dst}"
        );
    }
    assert!(matches!(
        p_rx.recv_timeout(WAIT).unwrap(),
        WorkerReport::Pd(PdReport::ExportPulled {
            hold: TransferId(1)
        })
    ));
    assert_eq!(p.n_published(), 0);
    assert_eq!(p_arena.n_outstanding_grants(), 0, "P let the blocks go");
    // Read once: a second read is a replay.
    let rx = fetch(&d, &d_arena, spec(addr, "a", 0, &[1, 3, 5]), &[3, 4, 5]);
    assert_eq!(refused_as(&rx).0, FetchFailure::Invalid);
    // A second export of the same P: its metadata is not sent again.
    let _b = publish(&p, &p_arena, &[6], "b");
    let rx = fetch(&d, &d_arena, spec(addr, "b", 0, &[6]), &[6]);
    assert_eq!(fetch_result(&rx), Ok(()));
    assert_eq!(d_arena.block_bytes(BlockId(6)), &pattern(LAYOUT, 6)[..]);
    assert_eq!(
        reads.loads.load(Ordering::Relaxed),
        1,
        "metadata loaded once"
    );
    // A forged read is refused before P says where anything is.
    let _c = publish(&p, &p_arena, &[7], "c");
    let mut forged = spec(addr, "c", 0, &[7]);
    forged.weight_version = "v1".into();
    let rx = fetch(&d, &d_arena, forged, &[7]);
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Invalid);
    assert!(reason.contains("holds KV of weights"), "{reason}");
}

#[test]
fn an_unpublish_during_a_slow_read_waits_only_for_the_read_timeout() {
    let read_timeout = Duration::from_millis(300);
    let p = one_sided("P", LocalReads::new(Duration::ZERO), read_timeout);
    // A reader far slower than P's read timeout.
    let d = one_sided("D", LocalReads::new(Duration::from_secs(3)), WAIT);
    let p_arena = filled_arena(LAYOUT, 4);
    let d_arena = KvArena::new(LAYOUT, 4);
    let ready_rx = publish(&p, &p_arena, &[2], "ready");
    let _read_rx = {
        // The export being read: another hold.
        // SAFETY: as in `publish`.
        let grant = unsafe { p_arena.grant(&BlockId::list([0, 1]), Access::Read) }.unwrap();
        let (r, rx) = reports();
        p.publish(
            ExportOffer {
                engine_id: "P".into(),
                hold: TransferId(2),
                token: "slow".into(),
                weight_version: "v0".into(),
                prompt_hash: HASH,
                n_tokens: 2 * LAYOUT.block_size,
                grant,
            },
            r,
        );
        rx
    };
    let rx = fetch(
        &d,
        &d_arena,
        spec(p.local_addr(), "slow", 0, &[0, 1]),
        &[0, 1],
    );
    // Wait until the read has begun: the export is being read.
    let started = Instant::now();
    while !matches!(
        lock(&p.inner.exports).live.get("slow"),
        Some(Slot::Pulling { .. })
    ) {
        assert!(started.elapsed() < WAIT, "the read never began");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A clearing operation: the export not being read goes at once...
    let (r, gone_ready) = reports();
    let t = Instant::now();
    p.unpublish("P", TransferId(1), Unpublished::Revoked, r);
    assert!(matches!(
        gone_ready.recv_timeout(Duration::from_millis(100)),
        Ok(WorkerReport::Pd(PdReport::ExportGone { .. }))
    ));
    drop(ready_rx);
    // ...and the one being read within P's read timeout, long before the reader is done.
    let (r, gone_slow) = reports();
    p.unpublish("P", TransferId(2), Unpublished::Revoked, r);
    assert!(matches!(
        gone_slow.recv_timeout(WAIT),
        Ok(WorkerReport::Pd(PdReport::ExportGone {
            hold: TransferId(2)
        }))
    ));
    let waited = t.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "waited {waited:?} for a read P bounds at {read_timeout:?}"
    );
    assert_eq!(p_arena.n_outstanding_grants(), 0, "P let every block go");
    // The reader's late read counts nothing: its load fails, as a timeout.
    let e = fetch_result(&rx).expect_err("an unconfirmed read");
    assert_eq!(
        (e.kind, e.end),
        (FetchFailure::Fault, FetchEnd::TimedOut),
        "{}",
        e.reason
    );
    assert!(e.reason.contains("read timeout"), "{}", e.reason);
    assert_eq!(d_arena.n_outstanding_grants(), 0);
}

/// A one-sided read ends as its stack said: one that outlasts P's read timeout as timed out,
/// one the stack failed as broken (how `/metrics` counts loads: `kv_loads_timed_out`,
/// `kv_loads_broken`), both faults to the request, neither confirmed by P.
#[test]
fn a_one_sided_read_that_runs_out_of_time_ends_as_timed_out() {
    let p = one_sided(
        "P",
        LocalReads::new(Duration::ZERO),
        Duration::from_millis(200),
    );
    let slow = one_sided("D", LocalReads::new(Duration::from_secs(3)), WAIT);
    let broken = one_sided("D2", Arc::new(BrokenReads), WAIT);
    let p_arena = filled_arena(LAYOUT, 4);
    let d_arena = KvArena::new(LAYOUT, 4);
    let addr = p.local_addr();
    let _a = publish(&p, &p_arena, &[1, 2], "a");
    let e = fetch_result(&fetch(
        &slow,
        &d_arena,
        spec(addr, "a", 0, &[1, 2]),
        &[0, 1],
    ))
    .expect_err("a read past P's read timeout");
    assert_eq!(
        (e.kind, e.end, e.good_blocks),
        (FetchFailure::Fault, FetchEnd::TimedOut, 0),
        "{}",
        e.reason
    );
    assert!(e.reason.contains("local read of 2 blocks"), "{}", e.reason);
    let _b = publish(&p, &p_arena, &[3], "b");
    let e = fetch_result(&fetch(&broken, &d_arena, spec(addr, "b", 0, &[3]), &[2]))
        .expect_err("a read the stack failed");
    assert_eq!(
        (e.kind, e.end, e.good_blocks),
        (FetchFailure::Fault, FetchEnd::Failed, 0),
        "{}",
        e.reason
    );
    assert!(
        e.reason.contains("the read: the endpoint is gone"),
        "{}",
        e.reason
    );
    assert_eq!(d_arena.n_outstanding_grants(), 0);
}

#[test]
fn a_read_from_a_tcp_only_producer_is_refused_as_a_fault() {
    let p = transport("P");
    let d = one_sided("D", LocalReads::new(Duration::ZERO), WAIT);
    let p_arena = filled_arena(LAYOUT, 2);
    let d_arena = KvArena::new(LAYOUT, 2);
    let _p_rx = publish(&p, &p_arena, &[0], "a");
    let rx = fetch(&d, &d_arena, spec(p.local_addr(), "a", 0, &[0]), &[0]);
    let (kind, reason) = refused_as(&rx);
    assert_eq!(kind, FetchFailure::Fault);
    assert!(reason.contains("over TCP only"), "{reason}");
    // The export is still there for a reader that pulls.
    let tcp_d = transport("D2");
    pull_ok(&tcp_d, &d_arena, p.local_addr(), "a", &[0]);
}
