//! `ferry bench transfer`: KV transfer throughput P→D through two `TcpTransport`s, against
//! plain loopback TCP measured by the same command; or its two ends in two processes, at
//! given addresses (on two hosts); or pulls per second with D's connection pool and without.
//!
//! The default run publishes one export of `--n-blocks` blocks of P's arena and times D's
//! fetch of all of them into D's arena, from the `fetch` call to its `FetchDone` (the
//! handshake and the pull's checks included). The plain run moves the same bytes over one
//! std TCP socket pair, `write_all` from one buffer and `read_exact` into another, one block
//! at a time, timed from before the connect to the last byte read. Each is run `--repeat`
//! times alternately; the best of each is reported (the least disturbed by other load).
//!
//! `--serve ADDR` is P alone: it binds ADDR, publishes `--repeat` exports of all its blocks
//! (tokens `bench-0`, `bench-1`, ...; every byte a function of its block and position) and
//! serves them until all are pulled or `--timeout-seconds` passed. `--pull ADDR` is D alone:
//! it waits for ADDR to accept connections, pulls those exports one after the other, checks
//! every byte, and reports each pull's time. Both ends must have the same layout flags,
//! `--n-blocks` and `--repeat`, and the same secret (`--secret` or
//! `FERRY_KV_TRANSFER_SECRET`), as a fleet's P and D do.
//!
//! `--kv-transport nixl` (a build with the `nixl` feature, after `scripts/fetch-nixl.sh`) adds
//! a third run to every round of the default mode: the same export read one-sided through
//! NIXL (two transports with a NIXL agent each, UCX choosing its transport as `UCX_TLS`
//! says), reported beside the TCP transport and plain TCP from the same rounds.
//!
//! `--pulls-per-second` runs many small pulls (`--pull-blocks` each) P→D on loopback for
//! `--seconds` with D's connection pool on and as long with it off, in alternating slices,
//! and reports both rates: what reusing a connection saves over a connect and handshake per
//! pull.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use ferry_arena::{Access, KvArena, KvLayout, Reports};
use ferry_core::{AllowedPeers, BlockId, PdReport, TransferId, WorkerReport};
use ferry_kv::{
    ExportOffer, FetchSpec, TcpTransport, TcpTransportConfig, Transport, DEFAULT_POOL_IDLE_PER_PEER,
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
    /// Runs of each kind; the best is reported. With `--serve` and `--pull`: the exports
    /// served and pulled.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Print JSON instead of a readable summary (one object; `--serve` prints one when it
    /// listens and one when it is done).
    #[arg(long)]
    json: bool,
    /// Run only P: bind ADDR (port 0 picks a free one, printed), publish `--repeat` exports of
    /// `--n-blocks` blocks and serve them until they are pulled or `--timeout-seconds` passed.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["pull", "pulls_per_second"])]
    serve: Option<SocketAddr>,
    /// Run only D: pull the exports a `--serve` end at ADDR publishes (the same layout flags,
    /// `--n-blocks` and `--repeat`), check their bytes and report the rate. ADDR's IP is
    /// the one allowed peer.
    #[arg(long, value_name = "ADDR", conflicts_with = "pulls_per_second")]
    pull: Option<SocketAddr>,
    /// The fleet's KV transfer secret both ends authenticate with (prefer the environment
    /// variable: a flag shows in the process list). Without it, transfers are not
    /// authenticated.
    #[arg(long, env = "FERRY_KV_TRANSFER_SECRET", hide_env_values = true)]
    secret: Option<String>,
    /// How long `--serve` waits for its exports to be pulled, and `--pull` for ADDR to
    /// accept connections and for each pull.
    #[arg(long, default_value_t = 120.0)]
    timeout_seconds: f64,
    /// Measure pulls per second of small exports on loopback, with D's connection pool and
    /// without it, instead of throughput.
    #[arg(long)]
    pulls_per_second: bool,
    /// Blocks per pull with `--pulls-per-second`.
    #[arg(long, default_value_t = 1)]
    pull_blocks: usize,
    /// Seconds of pulls with the pool, and as many without, with `--pulls-per-second`.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// `nixl`: also measure one-sided reads through NIXL in the same rounds (default mode).
    #[arg(long, value_enum, default_value_t = ferry_cli::KvTransportArg::Tcp)]
    kv_transport: ferry_cli::KvTransportArg,
    /// The folder holding NIXL's `libnixl_capi.so`, as `ferry serve --nixl-lib-dir`.
    #[arg(long, value_name = "DIR")]
    nixl_lib_dir: Option<std::path::PathBuf>,
}

impl Args {
    fn layout(&self) -> anyhow::Result<KvLayout> {
        let layout = KvLayout {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            aux_floats: 0,
        };
        ensure!(layout.block_bytes() > 0, "an empty block");
        Ok(layout)
    }

    fn secret(&self) -> anyhow::Result<Option<Vec<u8>>> {
        match &self.secret {
            Some(s) if s.is_empty() => bail!("the KV transfer secret is empty"),
            Some(s) => Ok(Some(s.as_bytes().to_vec())),
            None => Ok(None),
        }
    }

    fn timeout(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.timeout_seconds)
            .ok()
            .filter(|t| !t.is_zero())
            .context("--timeout-seconds must be positive")
    }
}

/// P's engine id in every mode: D's pulls name it.
const P_ID: &str = "bench-p";
const MODEL_ID: &str = "bench";

/// Starts a transport of the bench (its configuration from [`config_of`]).
fn start(config: TcpTransportConfig) -> anyhow::Result<std::sync::Arc<TcpTransport>> {
    let (id, listen) = (config.engine_id.clone(), config.listen);
    TcpTransport::start(config).with_context(|| format!("{id}'s transport on {listen}"))
}

/// A transport of the bench: `listen`, trusting `allowed_peers`, with a pool of
/// `pool_idle_per_peer` idle connections on D (TCP only: `one_sided` is `None`).
fn config_of(
    id: &str,
    listen: SocketAddr,
    layout: KvLayout,
    allowed_peers: AllowedPeers,
    secret: Option<Vec<u8>>,
    pool_idle_per_peer: usize,
    io_timeout: Duration,
) -> TcpTransportConfig {
    TcpTransportConfig {
        engine_id: id.into(),
        listen,
        layout,
        model_id: MODEL_ID.into(),
        max_in_flight_fetches: 1,
        max_connections: 16,
        io_timeout,
        allowed_peers,
        secret,
        pool_idle_per_peer,
        one_sided: None,
        read_timeout: ferry_kv::DEFAULT_READ_TIMEOUT,
    }
}

/// Block `b`'s bytes, the same in every process: each a function of its block and position.
fn block_pattern(b: usize, block_bytes: usize) -> Vec<u8> {
    (0..block_bytes).map(|i| (i * 7 + b * 13) as u8).collect()
}

fn filled_arena(layout: KvLayout, n_blocks: usize) -> anyhow::Result<KvArena> {
    let mut arena = KvArena::new(layout, n_blocks);
    for b in 0..n_blocks {
        arena.write_block_bytes(BlockId(b as u32), &block_pattern(b, layout.block_bytes()))?;
    }
    Ok(arena)
}

/// Reports into a channel.
fn reports() -> (Reports, Receiver<WorkerReport>) {
    let (tx, rx) = channel();
    let tx = std::sync::Mutex::new(tx);
    let reports = Reports::new(move |r| {
        let _ = tx.lock().map(|tx| tx.send(r));
    });
    (reports, rx)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let nixl = args.kv_transport == ferry_cli::KvTransportArg::Nixl;
    if nixl {
        ensure!(
            args.serve.is_none() && args.pull.is_none() && !args.pulls_per_second,
            "--kv-transport nixl measures the default mode (both ends in this process)"
        );
        // Before any thread starts.
        ferry_cli::load_nixl_library(args.nixl_lib_dir.as_deref())?;
    }
    ensure!(args.n_blocks > 0, "--n-blocks must be at least 1");
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    if let Some(addr) = args.serve {
        return serve(&args, addr);
    }
    if let Some(addr) = args.pull {
        return pull(&args, addr);
    }
    if args.pulls_per_second {
        return pulls_per_second(&args);
    }
    let layout = args.layout()?;
    let block_bytes = layout.block_bytes();
    let total_bytes = block_bytes * args.n_blocks;

    let p_arena = filled_arena(layout, args.n_blocks)?;
    let d_arena = KvArena::new(layout, args.n_blocks);
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    let secret = args.secret()?;
    let config = |id: &str| {
        config_of(
            id,
            loopback,
            layout,
            AllowedPeers::default(),
            secret.clone(),
            DEFAULT_POOL_IDLE_PER_PEER,
            Duration::from_secs(30),
        )
    };
    let p = start(config(P_ID))?;
    let d = start(config("D"))?;
    // The NIXL pair: P's engine id (D's reads name it), each end with its own agent.
    let one_sided = |id: &str| -> anyhow::Result<std::sync::Arc<TcpTransport>> {
        let one_sided = Some(ferry_cli::nixl_reads(id)?);
        start(TcpTransportConfig {
            one_sided,
            ..config(id)
        })
        .with_context(|| format!("{id}'s NIXL transport"))
    };
    let nixl_pair = if nixl {
        Some((
            one_sided(P_ID)?,
            one_sided("D")?,
            KvArena::new(layout, args.n_blocks),
        ))
    } else {
        None
    };

    let src: Vec<u8> = (0..total_bytes).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; total_bytes];
    let (mut transport_s, mut plain_s, mut nixl_s) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for r in 0..args.repeat {
        let token = format!("bench-{r}");
        transport_s = transport_s.min(transport_run(&p, &d, &p_arena, &d_arena, &token)?);
        if let Some((np, nd, n_arena)) = &nixl_pair {
            let token = format!("nixl-{r}");
            nixl_s = nixl_s.min(transport_run(np, nd, &p_arena, n_arena, &token)?);
        }
        plain_s = plain_s.min(plain_run(&src, &mut dst, block_bytes)?);
    }
    if let Some((_, _, n_arena)) = &nixl_pair {
        for b in 0..args.n_blocks as u32 {
            ensure!(
                n_arena.block_bytes(BlockId(b)) == p_arena.block_bytes(BlockId(b)),
                "block {b} arrived wrong over NIXL"
            );
        }
    }
    for b in 0..args.n_blocks as u32 {
        ensure!(
            d_arena.block_bytes(BlockId(b)) == p_arena.block_bytes(BlockId(b)),
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
        let mut report = report;
        if nixl {
            report["nixl_s"] = nixl_s.into();
            report["nixl_gb_per_s"] = (gb / nixl_s).into();
            report["nixl_ratio"] = (gb / nixl_s / plain_gbps).into();
            report["nixl_to_transport"] = (transport_s / nixl_s).into();
            report["ucx_tls"] = std::env::var("UCX_TLS").unwrap_or_default().into();
        }
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
        if nixl {
            println!(
                "NIXL P→D:         {:.2} GB/s ({:.1} ms), {:.1}% of plain TCP",
                gb / nixl_s,
                nixl_s * 1e3,
                gb / nixl_s / plain_gbps * 100.0
            );
        }
    }
    Ok(())
}

/// P alone (`--serve`): publishes `--repeat` exports of all its blocks and serves them until
/// all are pulled or the timeout passed.
fn serve(args: &Args, listen: SocketAddr) -> anyhow::Result<()> {
    let layout = args.layout()?;
    let timeout = args.timeout()?;
    let p_arena = filled_arena(layout, args.n_blocks)?;
    // P connects to nobody: its allowed peers are never asked.
    let p = start(config_of(
        P_ID,
        listen,
        layout,
        AllowedPeers::default(),
        args.secret()?,
        0,
        Duration::from_secs(30),
    ))?;
    let addr = p.local_addr();
    let blocks: Vec<u32> = (0..args.n_blocks as u32).collect();
    let (reports, rx) = reports();
    for r in 0..args.repeat {
        // SAFETY: nothing writes the arena after it was filled; these grants only read it
        // (and keep its allocation alive).
        let grant = unsafe { p_arena.grant(BlockId::from_raw_slice(&blocks), Access::Read) }?;
        p.publish(
            offer(&format!("bench-{r}"), r, layout, grant),
            reports.clone(),
        );
    }
    let block_bytes = layout.block_bytes();
    let about = |pulled: Option<usize>| {
        let mut report = serde_json::json!({
            "role": "serve",
            "addr": addr.to_string(),
            "exports": args.repeat,
            "n_blocks": args.n_blocks,
            "block_bytes": block_bytes,
            "total_bytes": block_bytes * args.n_blocks,
            "authenticated": args.secret.is_some(),
        });
        if let Some(pulled) = pulled {
            report["pulled"] = pulled.into();
            report["connections_accepted"] = p.stats().handshakes_accepted.into();
        }
        report
    };
    if args.json {
        println!("{}", about(None));
    } else {
        println!(
            "serving {} exports of {} blocks of {block_bytes} bytes on {addr}",
            args.repeat, args.n_blocks
        );
    }
    let deadline = Instant::now() + timeout;
    let mut pulled = 0;
    while pulled < args.repeat {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(WorkerReport::Pd(PdReport::ExportPulled { .. })) => pulled += 1,
            Ok(other) => bail!("unexpected report {other:?}"),
            Err(_) => break,
        }
    }
    if args.json {
        println!("{}", about(Some(pulled)));
    } else {
        println!("{pulled} of {} exports pulled", args.repeat);
    }
    ensure!(
        pulled == args.repeat,
        "only {pulled} of {} exports were pulled within {timeout:?}",
        args.repeat
    );
    Ok(())
}

/// D alone (`--pull`): pulls the exports a `--serve` end at `addr` publishes, one after the
/// other, checks every byte, and reports each pull's time.
fn pull(args: &Args, addr: SocketAddr) -> anyhow::Result<()> {
    let layout = args.layout()?;
    let timeout = args.timeout()?;
    let block_bytes = layout.block_bytes();
    let total_bytes = block_bytes * args.n_blocks;
    let mut d_arena = KvArena::new(layout, args.n_blocks);
    // D's own listener serves nothing here: loopback of P's address family.
    let listen = SocketAddr::new(
        match addr.ip() {
            IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
            IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
        },
        0,
    );
    let allowed = AllowedPeers::parse(&addr.ip().to_string())?;
    let d = start(config_of(
        "bench-d",
        listen,
        layout,
        allowed,
        args.secret()?,
        DEFAULT_POOL_IDLE_PER_PEER,
        timeout,
    ))?;
    wait_for_listener(addr, timeout)?;
    let blocks: Vec<u32> = (0..args.n_blocks as u32).collect();
    let zeros = vec![0u8; block_bytes];
    let mut seconds = Vec::with_capacity(args.repeat);
    for r in 0..args.repeat {
        for &b in &blocks {
            d_arena.write_block_bytes(BlockId(b), &zeros)?;
        }
        let spec = pull_spec(&format!("bench-{r}"), addr, blocks.clone());
        seconds.push(fetch_timed(&d, &d_arena, spec, timeout)?);
        for b in 0..args.n_blocks {
            ensure!(
                d_arena.block_bytes(BlockId(b as u32)) == block_pattern(b, block_bytes),
                "export bench-{r}: block {b} arrived wrong"
            );
        }
    }
    let mut sorted = seconds.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median_s = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    let (best_s, bytes) = (sorted[0], total_bytes as f64);
    let (best_gbps, median_gbps) = (bytes / best_s / 1e9, bytes / median_s / 1e9);
    let (best_mbit, median_mbit) = (bytes * 8.0 / best_s / 1e6, bytes * 8.0 / median_s / 1e6);
    let stats = d.stats();
    if args.json {
        let report = serde_json::json!({
            "role": "pull",
            "addr": addr.to_string(),
            "n_blocks": args.n_blocks,
            "block_bytes": block_bytes,
            "total_bytes": total_bytes,
            "repeat": args.repeat,
            "seconds": seconds,
            "best_gb_per_s": best_gbps,
            "median_gb_per_s": median_gbps,
            "best_mbit_per_s": best_mbit,
            "median_mbit_per_s": median_mbit,
            "connections_opened": stats.connections_opened,
            "connections_reused": stats.connections_reused,
            "authenticated": args.secret.is_some(),
        });
        println!("{report}");
    } else {
        println!(
            "{} pulls of {} blocks of {block_bytes} bytes ({:.1} MB) from {addr}",
            args.repeat,
            args.n_blocks,
            total_bytes as f64 / 1e6
        );
        println!(
            "best:   {best_gbps:.3} GB/s ({best_mbit:.1} Mbit/s, {:.1} ms)",
            best_s * 1e3
        );
        println!(
            "median: {median_gbps:.3} GB/s ({median_mbit:.1} Mbit/s, {:.1} ms)",
            median_s * 1e3
        );
    }
    Ok(())
}

/// Until `addr` accepts a TCP connection (the `--serve` end may start after this one), at
/// most `timeout`. The probe connection closes at once: P drops it at its handshake.
fn wait_for_listener(addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!("{addr} accepted no connection within {timeout:?}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// `--pulls-per-second`: pulls of `--pull-blocks` blocks, one after the other, for
/// `--seconds` with D's pool on and as long with it off, in alternating slices.
fn pulls_per_second(args: &Args) -> anyhow::Result<()> {
    ensure!(args.pull_blocks > 0, "--pull-blocks must be at least 1");
    let seconds = Duration::try_from_secs_f64(args.seconds)
        .ok()
        .filter(|s| !s.is_zero())
        .context("--seconds must be positive")?;
    let layout = args.layout()?;
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    let secret = args.secret()?;
    let t = Duration::from_secs(30);
    let start = |id: &str, pool: usize| {
        start(config_of(
            id,
            loopback,
            layout,
            AllowedPeers::default(),
            secret.clone(),
            pool,
            t,
        ))
    };
    let p = start(P_ID, 0)?;
    let with_pool = start("D-pool", DEFAULT_POOL_IDLE_PER_PEER)?;
    let without_pool = start("D-no-pool", 0)?;
    let p_arena = filled_arena(layout, args.pull_blocks)?;
    let d_arena = KvArena::new(layout, args.pull_blocks);
    // Alternating slices, so a change in the machine's load falls on both alike.
    const SLICES: u32 = 4;
    let slice = seconds / SLICES;
    let mut pulls = [0usize; 2];
    let mut spent = [Duration::ZERO; 2];
    let mut next = 0usize;
    for _ in 0..SLICES {
        for (mode, d) in [&without_pool, &with_pool].into_iter().enumerate() {
            let started = Instant::now();
            while started.elapsed() < slice {
                let token = format!("pps-{next}");
                next += 1;
                transport_run(&p, d, &p_arena, &d_arena, &token)?;
                pulls[mode] += 1;
            }
            spent[mode] += started.elapsed();
        }
    }
    for b in 0..args.pull_blocks as u32 {
        ensure!(
            d_arena.block_bytes(BlockId(b)) == p_arena.block_bytes(BlockId(b)),
            "block {b} arrived wrong"
        );
    }
    let rate = |mode: usize| pulls[mode] as f64 / spent[mode].as_secs_f64();
    let (without, with) = (rate(0), rate(1));
    let (s_without, s_with) = (without_pool.stats(), with_pool.stats());
    if args.json {
        let report = serde_json::json!({
            "mode": "pulls_per_second",
            "pull_blocks": args.pull_blocks,
            "block_bytes": layout.block_bytes(),
            "seconds_per_mode": seconds.as_secs_f64(),
            "pulls_with_pool": pulls[1],
            "pulls_without_pool": pulls[0],
            "pulls_per_second_with_pool": with,
            "pulls_per_second_without_pool": without,
            "ratio": with / without,
            "connections_opened_with_pool": s_with.connections_opened,
            "connections_opened_without_pool": s_without.connections_opened,
            "authenticated": args.secret.is_some(),
        });
        println!("{report}");
    } else {
        println!(
            "pulls of {} blocks of {} bytes on loopback, {:.1} s each way",
            args.pull_blocks,
            layout.block_bytes(),
            seconds.as_secs_f64()
        );
        println!(
            "with the pool:    {with:.0} pulls/s ({} connections for {} pulls)",
            s_with.connections_opened, pulls[1]
        );
        println!(
            "without the pool: {without:.0} pulls/s ({} connections)",
            s_without.connections_opened
        );
        println!("ratio:            {:.2}", with / without);
    }
    Ok(())
}

/// The export `token` of every block in `grant`, as P publishes it.
fn offer(
    token: &str,
    hold: usize,
    layout: KvLayout,
    grant: ferry_arena::BlockGrant,
) -> ExportOffer {
    ExportOffer {
        engine_id: P_ID.into(),
        hold: TransferId(hold as u64 + 1),
        token: token.into(),
        weight_version: "v0".into(),
        prompt_hash: [0; 32],
        n_tokens: grant.blocks().len() * layout.block_size,
        grant,
    }
}

/// D's pull of the export `token` (all of `blocks`) from P at `addr`.
fn pull_spec(token: &str, addr: SocketAddr, blocks: Vec<u32>) -> FetchSpec {
    FetchSpec {
        hold: TransferId(1),
        remote_engine_id: P_ID.into(),
        remote_host: Some(addr.ip().to_string()),
        remote_port: Some(addr.port()),
        token: token.into(),
        weight_version: "v0".into(),
        prompt_hash: [0; 32],
        first_block: 0,
        src_blocks: BlockId::from_raw_vec(blocks),
    }
}

/// Fetches `spec` into all of `d_arena`; seconds from the fetch to its `FetchDone`.
fn fetch_timed(
    d: &TcpTransport,
    d_arena: &KvArena,
    spec: FetchSpec,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let blocks: Vec<u32> = (0..d_arena.n_blocks() as u32).collect();
    // SAFETY: nothing else reads or writes D's arena while the grant lives: the transport
    // drops it before its report, which this function waits for.
    let write = unsafe { d_arena.grant(BlockId::from_raw_slice(&blocks), Access::Write) }?;
    let (reports, rx) = reports();
    let started = Instant::now();
    d.fetch(spec, write, reports);
    match rx.recv_timeout(timeout) {
        Ok(WorkerReport::Pd(PdReport::FetchDone { result, .. })) => {
            let elapsed = started.elapsed().as_secs_f64();
            result.map_err(|e| anyhow::anyhow!("the fetch failed: {}", e.reason))?;
            Ok(elapsed)
        }
        Ok(other) => bail!("unexpected report {other:?}"),
        Err(_) => bail!("no fetch report within {timeout:?}"),
    }
}

/// One export `token` of every block of `p_arena`, pulled into `d_arena`; seconds from the
/// fetch to its report. Returns once P reported the export pulled, too.
fn transport_run(
    p: &TcpTransport,
    d: &TcpTransport,
    p_arena: &KvArena,
    d_arena: &KvArena,
    token: &str,
) -> anyhow::Result<f64> {
    let blocks: Vec<u32> = (0..p_arena.n_blocks() as u32).collect();
    let (reports, rx) = reports();
    // SAFETY: nothing else reads or writes the bench's arenas while the grants live: the
    // grants are dropped before their reports, which this function waits for.
    let read = unsafe { p_arena.grant(BlockId::from_raw_slice(&blocks), Access::Read) }?;
    let write = unsafe { d_arena.grant(BlockId::from_raw_slice(&blocks), Access::Write) }?;
    p.publish(offer(token, 0, p_arena.layout(), read), reports.clone());
    let spec = pull_spec(token, p.local_addr(), blocks);
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
