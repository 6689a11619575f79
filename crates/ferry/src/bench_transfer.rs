//! `ferry bench transfer`: KV transfer throughput P→D through two `TcpTransport`s on
//! loopback, against plain loopback TCP measured by the same command.
//!
//! The transport run publishes one export of `--n-blocks` blocks of P's arena and times D's
//! fetch of all of them into D's arena, from the `fetch` call to its `FetchDone` (the
//! handshake and the pull's checks included). The plain run moves the same bytes over one
//! std TCP socket pair, `write_all` from one buffer and `read_exact` into another, one block
//! at a time, timed from before the connect to the last byte read. Each is run `--repeat`
//! times alternately; the best of each is reported (the least disturbed by other load).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use ferry_core::{PdReport, TransferId, WorkerReport};
use ferry_kv::{
    Access, ExportOffer, FetchSpec, KvArena, KvLayout, Reports, TcpTransport, TcpTransportConfig,
    Transport,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Blocks moved per run.
    #[arg(long, default_value_t = 256)]
    n_blocks: usize,
    /// The KV layout; the defaults are the default model's (SmolLM2-135M), 737,280 bytes a
    /// block.
    #[arg(long, default_value_t = 30)]
    n_layers: usize,
    #[arg(long, default_value_t = 3)]
    n_kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Runs of each kind; the best is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Print one JSON object instead of a readable summary.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    ensure!(args.n_blocks > 0, "--n-blocks must be at least 1");
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    let layout = KvLayout {
        n_layers: args.n_layers,
        n_kv_heads: args.n_kv_heads,
        head_dim: args.head_dim,
        block_size: args.block_size,
    };
    let block_bytes = layout.block_bytes();
    ensure!(block_bytes > 0, "an empty block");
    let total_bytes = block_bytes * args.n_blocks;

    let mut p_arena = KvArena::new(layout, args.n_blocks);
    for b in 0..args.n_blocks {
        let bytes: Vec<u8> = (0..block_bytes).map(|i| (i * 7 + b * 13) as u8).collect();
        p_arena.write_block_bytes(b as u32, &bytes)?;
    }
    let d_arena = KvArena::new(layout, args.n_blocks);
    let config = |id: &str| TcpTransportConfig {
        engine_id: id.into(),
        listen: "127.0.0.1:0".parse().expect("an address"),
        layout,
        model_id: "bench".into(),
        max_in_flight_fetches: 1,
        max_connections: 1,
        io_timeout: Duration::from_secs(30),
        allowed_peers: ferry_core::AllowedPeers::default(),
        secret: None,
    };
    let p = TcpTransport::start(config("P")).context("P's transport")?;
    let d = TcpTransport::start(config("D")).context("D's transport")?;

    let src: Vec<u8> = (0..total_bytes).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; total_bytes];
    let (mut transport_s, mut plain_s) = (f64::INFINITY, f64::INFINITY);
    for r in 0..args.repeat {
        transport_s = transport_s.min(transport_run(&p, &d, &p_arena, &d_arena, r)?);
        plain_s = plain_s.min(plain_run(&src, &mut dst, block_bytes)?);
    }
    for b in 0..args.n_blocks as u32 {
        ensure!(
            d_arena.block_bytes(b) == p_arena.block_bytes(b),
            "block {b} arrived wrong"
        );
    }
    ensure!(dst == src, "the plain TCP bytes arrived wrong");

    let gb = total_bytes as f64 / 1e9;
    let (transport_gbps, plain_gbps) = (gb / transport_s, gb / plain_s);
    let ratio = transport_gbps / plain_gbps;
    if args.json {
        let report = serde_json::json!({
            "n_blocks": args.n_blocks,
            "block_bytes": block_bytes,
            "total_bytes": total_bytes,
            "repeat": args.repeat,
            "transport_s": transport_s,
            "plain_tcp_s": plain_s,
            "transport_gb_per_s": transport_gbps,
            "plain_tcp_gb_per_s": plain_gbps,
            "ratio": ratio,
        });
        println!("{report}");
    } else {
        println!(
            "{} blocks of {block_bytes} bytes ({:.1} MB), best of {}",
            args.n_blocks,
            total_bytes as f64 / 1e6,
            args.repeat
        );
        println!(
            "TcpTransport P→D: {transport_gbps:.2} GB/s ({:.1} ms)",
            transport_s * 1e3
        );
        println!(
            "plain TCP:        {plain_gbps:.2} GB/s ({:.1} ms)",
            plain_s * 1e3
        );
        println!("ratio:            {:.1}%", ratio * 100.0);
    }
    Ok(())
}

/// One export of every block of `p_arena`, pulled into `d_arena`; seconds from the fetch to
/// its report.
fn transport_run(
    p: &TcpTransport,
    d: &TcpTransport,
    p_arena: &KvArena,
    d_arena: &KvArena,
    run: usize,
) -> anyhow::Result<f64> {
    let blocks: Vec<u32> = (0..p_arena.n_blocks() as u32).collect();
    let token = format!("bench-{run}");
    let (tx, rx) = channel();
    let tx = std::sync::Mutex::new(tx);
    let reports = Reports::new(move |r| {
        let _ = tx.lock().map(|tx| tx.send(r));
    });
    // SAFETY: nothing else reads or writes the bench's arenas while the grants live: the
    // grants are dropped before their reports, which this function waits for.
    let read = unsafe { p_arena.grant(&blocks, Access::Read) }?;
    let write = unsafe { d_arena.grant(&blocks, Access::Write) }?;
    p.publish(
        ExportOffer {
            engine_id: "P".into(),
            hold: TransferId(1),
            token: token.clone(),
            weight_version: "v0".into(),
            prompt_hash: [0; 32],
            n_tokens: blocks.len() * p_arena.layout().block_size,
            grant: read,
        },
        reports.clone(),
    );
    let addr = p.local_addr();
    let spec = FetchSpec {
        hold: TransferId(2),
        remote_engine_id: "P".into(),
        remote_host: Some(addr.ip().to_string()),
        remote_port: Some(addr.port()),
        token,
        weight_version: "v0".into(),
        prompt_hash: [0; 32],
        first_block: 0,
        src_blocks: blocks,
    };
    let started = Instant::now();
    d.fetch(spec, write, reports);
    let (mut fetched, mut pulled) = (None, false);
    while fetched.is_none() || !pulled {
        match rx.recv_timeout(Duration::from_secs(60))? {
            WorkerReport::Pd(PdReport::FetchDone { result, .. }) => {
                fetched = Some(started.elapsed().as_secs_f64());
                if let Err(e) = result {
                    bail!("the fetch failed: {}", e.reason);
                }
            }
            WorkerReport::Pd(PdReport::ExportPulled { .. }) => pulled = true,
            other => bail!("unexpected report {other:?}"),
        }
    }
    Ok(fetched.expect("loop ends with it"))
}

/// `src` over one loopback socket pair into `dst`, a block at a time; seconds.
fn plain_run(src: &[u8], dst: &mut [u8], block_bytes: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<f64> {
        let sender = s.spawn(move || -> std::io::Result<()> {
            let (mut stream, _) = listener.accept()?;
            stream.set_nodelay(true)?;
            for chunk in src.chunks(block_bytes) {
                stream.write_all(chunk)?;
            }
            stream.flush()
        });
        let mut stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        for chunk in dst.chunks_mut(block_bytes) {
            stream.read_exact(chunk)?;
        }
        let elapsed = started.elapsed().as_secs_f64();
        sender.join().expect("the sender thread panicked")?;
        Ok(elapsed)
    })
}
