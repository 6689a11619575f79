//! `ferry bench lifecycle --pd`: a clearing pause on a P/D pair with transfers in flight.
//!
//! Two engines in this process share an in-memory transport. Each round: P prefills
//! `--in-flight` prompts to their first token and holds them as exports; D is given their
//! parameters and starts that many loads, which the transport holds mid-transfer (a fetch
//! that has started and not finished; a cancelled one stops at once, as a real transport
//! stops at a block boundary). Then `pause(keep, clear_cache)` on both engines at once: P
//! revokes its exports, D cancels its loads and retracts their requests, both wait until
//! every transfer handed its blocks back, reset, and reply. Measured: the time from the
//! calls to both replies (no step is in flight: nothing is running on either engine, so
//! there is no step to subtract), and each engine thread's own time over that window (its
//! busy time, `EngineStats::busy_seconds_total`). Then both resume, D's requests recompute
//! and finish, and the next round starts.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use ferry_arena::{BlockGrant, Reports};
use ferry_engine::{
    Connector, EngineHandle, GenerateRequest, InMemoryFabric, InMemoryTransport, KvCacheSize,
    KvTransferParams, ModelEngineConfig, PauseMode, PdConfig, PdRole, SamplingParams, TokenId,
    TransferRequest,
};
use ferry_kv::{ExportOffer, FetchSpec, Transport};
use serde_json::{json, Value};

use super::report::Samples;
use super::Args;

/// D's transport: fetches start and then stay in flight until cancelled.
#[derive(Debug)]
struct Stalled {
    inner: InMemoryTransport,
    /// Fetches in flight: their grants (what a transport writing into them holds) and where
    /// their end is reported.
    in_flight: Mutex<Vec<(FetchSpec, BlockGrant, Reports)>>,
}

impl Transport for Stalled {
    fn publish(&self, offer: ExportOffer, reports: Reports) {
        self.inner.publish(offer, reports);
    }

    fn unpublish(
        &self,
        engine_id: &str,
        hold: ferry_engine::TransferId,
        reason: ferry_core::Unpublished,
        reports: Reports,
    ) {
        self.inner.unpublish(engine_id, hold, reason, reports);
    }

    fn release(&self, spec: ferry_kv::ReleaseSpec) {
        self.inner.release(spec);
    }

    fn fetch(&self, spec: FetchSpec, dst: BlockGrant, reports: Reports) {
        self.in_flight.lock().unwrap().push((spec, dst, reports));
    }

    fn cancel_fetch(&self, hold: ferry_engine::TransferId) {
        let mut in_flight = self.in_flight.lock().unwrap();
        if let Some(at) = in_flight.iter().position(|(s, ..)| s.hold == hold) {
            let (spec, grant, reports) = in_flight.swap_remove(at);
            drop(grant);
            reports.send(ferry_core::WorkerReport::Pd(
                ferry_core::PdReport::FetchDone {
                    hold: spec.hold,
                    result: Err(ferry_core::FetchError::fault(0, "cancelled")),
                },
            ));
        }
    }
}

impl Stalled {
    fn n_in_flight(&self) -> usize {
        self.in_flight.lock().unwrap().len()
    }
}

/// Runs the P/D rounds; returns the report's `pd` object.
pub async fn measure(args: &Args, model_path: &std::path::Path) -> anyhow::Result<Value> {
    let fabric = InMemoryFabric::new();
    let stalled = Arc::new(Stalled {
        inner: InMemoryTransport::new("D", fabric.clone()),
        in_flight: Mutex::new(Vec::new()),
    });
    let config = ModelEngineConfig {
        block_size: super::BLOCK_SIZE,
        kv_cache: KvCacheSize::Bytes(args.kv_cache_bytes.0),
        max_num_seqs: args.in_flight.max(256),
        max_num_batched_tokens: super::MAX_NUM_BATCHED_TOKENS,
        max_model_len: Some(args.prompt_len + 16),
        // The exports must outlive P's prefill of every request (minutes for a real model on
        // a small CPU): the bench times the pause, not lease expiry.
        export_lease: Duration::from_secs(3600),
        ..ModelEngineConfig::default()
    };
    let start = |id: &str, role, transport: Arc<dyn Transport>| -> anyhow::Result<_> {
        let loaded = ferry_model::load_model(model_path)
            .with_context(|| format!("loading the model {}", model_path.display()))?;
        let pd = PdConfig {
            role,
            engine_id: id.to_owned(),
            host: None,
            port: None,
            secret: ferry_engine::random_secret(),
            block_size: super::BLOCK_SIZE,
            allowed_peers: ferry_core::AllowedPeers::default(),
        };
        let started = ferry_engine::start_model_with_connectors(
            loaded,
            &config,
            |e| e,
            vec![Connector::pd(pd, transport)],
        )
        .with_context(|| format!("starting engine {id}"))?;
        Ok(started)
    };
    let p = start(
        "P",
        PdRole::Producer,
        Arc::new(InMemoryTransport::new("P", fabric.clone())),
    )?;
    let d = start("D", PdRole::Consumer, stalled.clone())?;
    let vocab = p.model.vocab_size;
    let (p, d) = (p.handle, d.handle);

    let mut both = Samples::default();
    let mut busy_p = Samples::default();
    let mut busy_d = Samples::default();
    for round in 0..args.repeat {
        let params = prefill_all(&p, args, round, vocab).await?;
        let readers = start_loads(&d, args, round, vocab, params).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while stalled.n_in_flight() < args.in_flight {
            ensure!(Instant::now() < deadline, "D's loads did not start");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let n_exports = p.stats().scheduler.n_transfers;
        ensure!(
            n_exports == args.in_flight,
            "P holds {n_exports} exports, expected {}",
            args.in_flight
        );
        // Both engines idle (nothing runs): their busy time from here is the pause's.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (p0, d0) = (busy(&p), busy(&d));
        let called = Instant::now();
        let (rp, rd) = tokio::join!(
            p.pause(PauseMode::Keep, true),
            d.pause(PauseMode::Keep, true)
        );
        let replied = called.elapsed();
        rp.context("pause on P")?;
        rd.context("pause on D")?;
        both.push_ms(replied);
        // Let both engines go idle, so their busy time is published.
        tokio::time::sleep(Duration::from_millis(50)).await;
        busy_p.push_ms(Duration::from_secs_f64(busy(&p) - p0));
        busy_d.push_ms(Duration::from_secs_f64(busy(&d) - d0));
        for e in [&p, &d] {
            let s = e.stats().scheduler;
            ensure!(
                s.n_transfers == 0 && s.n_blocks_used == 0,
                "a transfer or block survived the reset: {s:?}"
            );
        }
        p.resume().await?;
        d.resume().await?;
        for r in readers {
            let tokens = r.await.context("a D request's reader")??;
            ensure!(tokens == 4, "a D request generated {tokens} tokens, not 4");
        }
    }
    for e in [&p, &d] {
        e.check_invariants()
            .await?
            .map_err(|e| anyhow::anyhow!("invariants: {e}"))?;
        e.shutdown().await?;
    }
    let mut out = serde_json::Map::new();
    out.insert("in_flight".into(), json!(args.in_flight));
    out.insert("prompt_len".into(), json!(args.prompt_len));
    out.insert("rounds".into(), json!(args.repeat));
    both.insert(&mut out, "pause_keep_clear_both_replied_ms");
    busy_p.insert(&mut out, "engine_busy_p_ms");
    busy_d.insert(&mut out, "engine_busy_d_ms");
    Ok(Value::Object(out))
}

/// A readable summary of `measure`'s object.
pub fn summary(pd: &Value) -> String {
    let f = |k: &str| {
        let v = |s: &str| pd[format!("{k}_{s}")].as_f64().unwrap_or(f64::NAN);
        format!(
            "min {:.2} / p50 {:.2} / max {:.2} ms",
            v("min"),
            v("p50"),
            v("max")
        )
    };
    format!(
        "P/D: pause(keep, clear_cache) on P and D with {} requests mid-transfer\n  \
         call to both replies: {}\n  engine thread busy, P: {}\n  engine thread busy, D: {}\n",
        pd["in_flight"],
        f("pause_keep_clear_both_replied_ms"),
        f("engine_busy_p_ms"),
        f("engine_busy_d_ms"),
    )
}

fn busy(e: &EngineHandle) -> f64 {
    e.stats().busy_seconds_total
}

fn prompt(round: usize, i: usize, len: usize, vocab: usize) -> Vec<TokenId> {
    (0..len)
        .map(|j| {
            TokenId(((7919 * (round * 1000 + i) + 104_729 * j + 13) % (vocab - 10) + 5) as u32)
        })
        .collect()
}

/// P computes every prompt to its first token and exports it.
async fn prefill_all(
    p: &EngineHandle,
    args: &Args,
    round: usize,
    vocab: usize,
) -> anyhow::Result<Vec<KvTransferParams>> {
    let mut tasks = Vec::new();
    for i in 0..args.in_flight {
        let p = p.clone();
        let req = GenerateRequest {
            request_id: format!("p{round}-{i}"),
            prompt: prompt(round, i, args.prompt_len, vocab),
            params: SamplingParams::greedy(1),
            transfer: Some(TransferRequest::Export),
            ..GenerateRequest::default()
        };
        tasks.push(tokio::spawn(async move {
            let mut stream = p.generate(req).await?;
            let mut finish = None;
            while let Some(chunk) = stream.next().await {
                finish = chunk.finish.or(finish);
            }
            finish
                .and_then(|f| f.kv_transfer_params)
                .context("P returned no transfer parameters")
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    Ok(out)
}

/// D starts a request per export (4 tokens, greedy); returns their readers, which resolve to
/// the number of tokens each generated.
async fn start_loads(
    d: &EngineHandle,
    args: &Args,
    round: usize,
    vocab: usize,
    params: Vec<KvTransferParams>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<usize>>>> {
    let mut readers = Vec::new();
    for (i, params) in params.into_iter().enumerate() {
        let req = GenerateRequest {
            request_id: format!("d{round}-{i}"),
            prompt: prompt(round, i, args.prompt_len, vocab),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(4)
            },
            // D's edge parses P's parameters, with the roles a proxy sets.
            transfer: TransferRequest::parse(&KvTransferParams {
                do_remote_prefill: true,
                do_remote_decode: false,
                ..params
            })
            .map_err(|e| anyhow::anyhow!("P's transfer parameters: {e}"))?,
            ..GenerateRequest::default()
        };
        let mut stream = d.generate(req).await?;
        readers.push(tokio::spawn(async move {
            let mut n = 0;
            while let Some(chunk) = stream.next().await {
                n += chunk.token_ids.len();
            }
            Ok(n)
        }));
    }
    Ok(readers)
}
