//! `ferry bench lifecycle`: timing and memory of the lifecycle operations
//! (`../shared/design/lifecycle.md`) on an engine spawned in-process, so every time is
//! engine-side (no HTTP).
//!
//! Phases, in order:
//! 0. On the idle engine, `--updates` full weight pushes (the model's own weights as a
//!    safetensors body, streamed in pieces) then as many reloads from disk, with resident
//!    memory before the first, after each, and each one's peak (`updates.rs`).
//! 1. `--repeat` rounds, each under a fresh load of `--in-flight` requests: once all are
//!    decoding, `pause(keep)` + `resume()`; then `pause(keep, clear_cache)` + `resume()` (the
//!    frozen requests recompute); then `pause(wait, clear_cache)`, which drains the load.
//! 2. After the last round (paused, the arena written by the load): `release_kv_cache_memory`
//!    and `wake_up(["kv_cache"])`, with resident memory around them.
//! 3. `--repeat` RL cycles on the idle engine (no step in flight, so each figure is the
//!    operation's own cost): pause(keep) → reload from disk → resume.
//! 4. A load that writes the KV arena, then `sleep(1)` + `wake_up`; another such load, then
//!    `sleep(2)` + reload + `wake_up`, with resident memory around each.
//!
//! A lifecycle call is handled between engine steps, so under load a pause's reply waits for
//! the step in flight; the `after_step` figures subtract it (see `load.rs` for how), and the
//! `engine` figures are the engine thread's own time handling the call, from its counters.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use ferry_cli::ByteSize;
use ferry_engine::{
    EngineHandle, KvCacheSize, LifecycleCallError, ModelEngineConfig, PauseMode, SchedulerConfig,
    SleepLevel, StartError, WakeTag,
};
use ferry_model::ModelSpec;

mod load;
mod pd;
pub(crate) mod report;
mod updates;

use load::{Load, LoadSpec, Snapshot};
use report::{CycleTimings, MemoryReport, PauseTimings, Report, RssStep};

const BLOCK_SIZE: usize = 16;
/// Prompt tokens per step, as `ferry serve` defaults to.
const MAX_NUM_BATCHED_TOKENS: usize = 2048;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face model folder, a GGUF file, or `tiny` (written to a temporary folder, since
    /// a reload needs one). Default: the default model, fetched like `ferry serve` does.
    #[arg(long)]
    model: Option<String>,
    /// Requests in flight during the pauses.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Output tokens per request (greedy, EOS ignored); at least 16, so requests are still
    /// decoding when the pauses come.
    #[arg(long, default_value_t = 256)]
    output_len: u32,
    /// Times each operation is measured.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Weight pushes, and then reloads, whose resident memory is measured (phase 0).
    #[arg(long, default_value_t = 8)]
    updates: usize,
    /// Memory for the KV arena, e.g. `1GiB` (as `ferry serve`).
    #[arg(long, default_value = "1GiB")]
    kv_cache_bytes: ByteSize,
    /// Python whose pip fetches the default model.
    #[arg(long, env = "PYTHON", default_value = "python3")]
    python: String,
    /// Print one JSON object instead of a readable summary.
    #[arg(long)]
    json: bool,
    /// P/D mode instead of the single-engine phases: a producer and a consumer engine in this
    /// process over the in-memory transport, `--in-flight` requests mid-transfer, and
    /// `pause(keep, clear_cache)` on both at once (see `pd.rs`).
    #[arg(long)]
    pd: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    ensure!(args.in_flight > 0, "--in-flight must be at least 1");
    ensure!(args.prompt_len > 0, "--prompt-len must be at least 1");
    ensure!(args.output_len >= 16, "--output-len must be at least 16");
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    // One thread: tasks woken by the engine thread then run in wake order (see `load.rs`).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .context("starting the tokio runtime")?;
    if args.pd {
        let tmp = tempfile::tempdir().context("creating a temporary folder")?;
        let model_path = model_path(&args, tmp.path())?;
        let pd = runtime.block_on(pd::measure(&args, &model_path))?;
        if args.json {
            println!("{}", serde_json::json!({ "pd": pd }));
        } else {
            print!("{}", pd::summary(&pd));
        }
        return Ok(());
    }
    let report = runtime.block_on(measure(&args))?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.summary());
    }
    Ok(())
}

/// The engine under test and what the report says about it.
struct Bench {
    engine: EngineHandle,
    /// The folder or file the reloads read.
    model_path: PathBuf,
    /// The model's weights as one safetensors file: the body of the pushes.
    push_body: PathBuf,
    /// Holds the `tiny` model's folder and the push body until the end.
    _tmp: tempfile::TempDir,
    source: String,
    weights_bytes: u64,
    kv_block_bytes: u64,
    scheduler: SchedulerConfig,
    vocab_size: usize,
    n_loads: usize,
}

async fn measure(args: &Args) -> anyhow::Result<Report> {
    let mut bench = start(args)?;
    let updates = updates::measure(
        &bench.engine,
        &bench.push_body,
        &bench.model_path,
        args.updates,
    )
    .await?;
    let mut pauses = PauseTimings::default();
    for round in 0..args.repeat {
        if round > 0 {
            bench.engine.resume().await?;
        }
        run_round(&mut bench, args, &mut pauses).await?;
    }
    let release_kv = release_kv(&bench.engine).await?;
    let mut cycle = CycleTimings::default();
    for i in 0..args.repeat {
        run_cycle(&bench, i, &mut cycle).await?;
    }
    let sleep1 = sleep_and_wake(&mut bench, args, SleepLevel::L1).await?;
    let sleep2 = sleep_and_wake(&mut bench, args, SleepLevel::L2).await?;
    let stats = bench.engine.stats();
    bench.engine.shutdown().await?;
    let n_blocks = bench.scheduler.n_blocks;
    let fill_blocks = (args.in_flight * fill_prompt_len(args).div_ceil(BLOCK_SIZE)) as u64;
    Ok(Report {
        model: bench.source.clone(),
        in_flight: args.in_flight,
        prompt_len: args.prompt_len,
        output_len: args.output_len,
        repeat: args.repeat,
        weights_bytes: bench.weights_bytes,
        kv_arena_bytes: u64::from(n_blocks) * bench.kv_block_bytes,
        n_kv_blocks: n_blocks,
        step_ms_mean: stats.step_seconds_total * 1e3 / stats.n_steps.max(1) as f64,
        n_preemptions: stats.scheduler.n_preemptions,
        pauses,
        cycle,
        memory: MemoryReport {
            release_kv,
            sleep1,
            sleep2,
            kv_fill_bytes: fill_blocks.min(u64::from(n_blocks)) * bench.kv_block_bytes,
        },
        updates,
    })
}

/// Loads the model and starts the engine as `ferry serve` would, with room for the longest
/// sequence the benchmark sends.
fn start(args: &Args) -> anyhow::Result<Bench> {
    let tmp = tempfile::tempdir().context("creating a temporary folder")?;
    let model_path = model_path(args, tmp.path())?;
    // The push body: the model's own weights as one f32 safetensors file, written from an f32
    // load that is gone before the engine starts.
    let push_dir = tmp.path().join("push");
    {
        let f32_model = ferry_model::load_model(&model_path)
            .with_context(|| format!("loading the model {}", model_path.display()))?;
        ferry_model::tiny::write_hf_folder(&f32_model, &push_dir)
            .with_context(|| format!("writing the push body to {}", push_dir.display()))?;
    }
    // The engine holds the weights in the file's precision, as `ferry serve` does.
    let loaded = ferry_model::load_model_stored(&model_path)
        .with_context(|| format!("loading the model {}", model_path.display()))?;
    let max_model_len = fill_prompt_len(args) + 1;
    let config = ModelEngineConfig {
        block_size: BLOCK_SIZE,
        kv_cache: KvCacheSize::Bytes(args.kv_cache_bytes.0),
        max_num_seqs: args.in_flight.max(256),
        max_num_batched_tokens: MAX_NUM_BATCHED_TOKENS,
        max_model_len: Some(max_model_len),
        ..ModelEngineConfig::default()
    };
    let started = ferry_engine::start_model(loaded, &config).map_err(|e| match e {
        StartError::MaxModelLenTooLong { model_max, .. } => anyhow::anyhow!(
            "--prompt-len + --output-len ({}) exceeds the model's max_position_embeddings \
             ({model_max})",
            max_model_len - 1
        ),
        StartError::KvCacheTooSmall {
            n_blocks,
            block_bytes,
            n_blocks_needed,
            ..
        } => anyhow::anyhow!(
            "--kv-cache-bytes holds {n_blocks} KV blocks of {block_bytes} bytes; one request \
             needs {n_blocks_needed}"
        ),
        e => anyhow::Error::new(e).context("starting the engine"),
    })?;
    Ok(Bench {
        engine: started.handle,
        model_path,
        push_body: push_dir.join("model.safetensors"),
        _tmp: tmp,
        source: started.model.source,
        weights_bytes: started.model.weights_bytes,
        kv_block_bytes: started.model.kv_block_bytes,
        scheduler: started.scheduler,
        vocab_size: started.model.vocab_size,
        n_loads: 0,
    })
}

/// The path reloads read: `--model` (the default model fetched when missing), or a folder
/// in `tmp` holding the `tiny` model.
fn model_path(args: &Args, tmp: &Path) -> anyhow::Result<PathBuf> {
    match ferry_cli::resolve_model(args.model.as_deref(), &args.python)? {
        ModelSpec::Path(path) => Ok(path),
        ModelSpec::Tiny => {
            let dir = tmp.join("tiny");
            ferry_model::tiny::write_hf_folder(&ferry_model::tiny::tiny_model(), &dir)
                .with_context(|| format!("writing the tiny model to {}", dir.display()))?;
            Ok(dir)
        }
    }
}

/// Prompt tokens of the loads that fill the KV arena: as many KV tokens as a round's load
/// reaches at its end.
fn fill_prompt_len(args: &Args) -> usize {
    args.prompt_len + args.output_len as usize
}

impl Bench {
    /// A new load's spec; every load gets its own prompts.
    fn next_load(&mut self, n_requests: usize, prompt_len: usize, output_len: u32) -> LoadSpec {
        self.n_loads += 1;
        LoadSpec {
            n_requests,
            prompt_len,
            output_len,
            salt: self.n_loads,
            vocab_size: self.vocab_size,
        }
    }

    /// Runs a load that writes as much KV as a round's load does, to its end.
    async fn fill_kv(&mut self, args: &Args) -> anyhow::Result<()> {
        let spec = self.next_load(args.in_flight, fill_prompt_len(args), 1);
        Load::start(&self.engine, spec).await?.finish().await?;
        Ok(())
    }
}

/// One round under a fresh load (phase 1); ends paused, drained, the cache reset.
async fn run_round(bench: &mut Bench, args: &Args, t: &mut PauseTimings) -> anyhow::Result<()> {
    let spec = bench.next_load(args.in_flight, args.prompt_len, args.output_len);
    let engine = bench.engine.clone();
    let load = Load::start(&engine, spec).await?;
    load.wait_all_advanced(&Snapshot::default(), "every request's first token")
        .await?;

    let calls = EngineTime::start(&engine);
    let (total, after_step) = timed_pause(&engine, &load, PauseMode::Keep, false).await?;
    t.pause_keep.push_ms(total);
    t.pause_keep_after_step.push_ms(after_step);
    t.pause_keep_engine.push_ms(calls.wait(&engine, 1).await?);
    let calls = EngineTime::start(&engine);
    let started = Instant::now();
    engine.resume().await?;
    t.resume.push_ms(started.elapsed());
    t.resume_engine.push_ms(calls.wait(&engine, 1).await?);

    load.wait_all_advanced(&load.snapshot(), "a decode step after resume")
        .await?;
    let calls = EngineTime::start(&engine);
    let (total, after_step) = timed_pause(&engine, &load, PauseMode::Keep, true).await?;
    t.pause_keep_clear.push_ms(total);
    t.pause_keep_clear_after_step.push_ms(after_step);
    t.pause_keep_clear_engine
        .push_ms(calls.wait(&engine, 1).await?);
    let before_resume = load.snapshot();
    engine.resume().await?;
    load.wait_all_advanced(&before_resume, "every request's recompute after the reset")
        .await?;

    let before = load.snapshot();
    let steps_before = engine.stats().n_steps;
    let (called, replied) = timed_call(&engine, PauseMode::Wait, true).await?;
    let end = load.finish().await?;
    t.pause_wait_clear.push_ms(replied - called);
    t.pause_wait_clear_drain_tokens
        .push((end.n_tokens_total() - before.n_tokens_total()) as f64);
    t.pause_wait_clear_drain_steps
        .push(engine.stats().n_steps.saturating_sub(steps_before) as f64);
    let last_finish = end.last_finish.unwrap_or(called);
    t.pause_wait_clear_reset
        .push_ms(replied.saturating_duration_since(last_finish));
    Ok(())
}

/// The engine thread's own time handling lifecycle calls, from `EngineStats`'s counters.
struct EngineTime {
    n_calls: u64,
    seconds: f64,
}

impl EngineTime {
    fn start(engine: &EngineHandle) -> Self {
        let s = engine.stats();
        Self {
            n_calls: s.n_lifecycle_calls_total,
            seconds: s.lifecycle_call_seconds_total,
        }
    }

    /// The time of the `n` calls made since `start`. The engine publishes it just after each
    /// reply, so this waits (briefly) until all `n` are counted.
    async fn wait(&self, engine: &EngineHandle, n: u64) -> anyhow::Result<Duration> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = engine.stats();
            if s.n_lifecycle_calls_total >= self.n_calls + n {
                ensure!(
                    s.n_lifecycle_calls_total == self.n_calls + n,
                    "more lifecycle calls than measured"
                );
                let secs = (s.lifecycle_call_seconds_total - self.seconds).max(0.0);
                return Ok(Duration::from_secs_f64(secs));
            }
            ensure!(
                Instant::now() < deadline,
                "the engine never counted the call"
            );
            tokio::task::yield_now().await;
        }
    }
}

/// A pause under `load`: (call to reply, end of the step in flight to reply). The step in
/// flight ends with its outputs, which the readers see before the reply (see `load.rs`).
async fn timed_pause(
    engine: &EngineHandle,
    load: &Load,
    mode: PauseMode,
    clear_cache: bool,
) -> anyhow::Result<(Duration, Duration)> {
    let (called, replied) = timed_call(engine, mode, clear_cache).await?;
    let step_end = load.snapshot().last_token.map_or(called, |t| t.max(called));
    Ok((
        replied - called,
        replied.saturating_duration_since(step_end),
    ))
}

/// `pause` awaited in a spawned task, so its reply is seen in wake order with the readers.
/// Returns (called, replied).
async fn timed_call(
    engine: &EngineHandle,
    mode: PauseMode,
    clear_cache: bool,
) -> anyhow::Result<(Instant, Instant)> {
    let engine = engine.clone();
    let task = tokio::spawn(async move {
        let called = Instant::now();
        engine.pause(mode, clear_cache).await?;
        Ok::<_, LifecycleCallError>((called, Instant::now()))
    });
    let what = format!("pause({}, clear_cache={clear_cache})", mode.as_str());
    task.await
        .with_context(|| format!("{what} task"))?
        .with_context(|| what)
}

/// Phase 2: the engine is paused after a drain, its arena written by the round's load.
async fn release_kv(engine: &EngineHandle) -> anyhow::Result<RssStep> {
    let before = report::rss_bytes()?;
    let started = Instant::now();
    engine.release_kv_cache_memory().await?;
    let op_ms = ms(started);
    let after = report::rss_bytes()?;
    let started = Instant::now();
    engine.wake_up(&[WakeTag::KvCache]).await?;
    let wake_ms = ms(started);
    let after_wake = report::rss_bytes()?;
    engine.resume().await?;
    Ok(RssStep {
        before,
        after,
        after_wake,
        op_ms,
        wake_ms,
    })
}

/// Phase 3: one RL cycle on the idle engine.
async fn run_cycle(bench: &Bench, i: usize, t: &mut CycleTimings) -> anyhow::Result<()> {
    let engine = &bench.engine;
    let calls = EngineTime::start(engine);
    let started = Instant::now();
    engine.pause(PauseMode::Keep, false).await?;
    let paused = Instant::now();
    let info = engine
        .update_weights_from_disk(bench.model_path.clone(), Some(format!("cycle-{i}")))
        .await
        .with_context(|| format!("reloading {}", bench.model_path.display()))?;
    let reloaded = Instant::now();
    engine.resume().await?;
    let resumed = Instant::now();
    t.pause.push_ms(paused - started);
    t.prepare.push(info.prepare_seconds * 1e3);
    t.install.push(info.install_seconds * 1e3);
    t.resume.push_ms(resumed - reloaded);
    t.total.push_ms(resumed - started);
    // Pause, install, resume; a reload of a folder first asks to borrow the weights (lent in
    // a completed pause, then returned instead of installed: `ferry_engine::reload`).
    let n_calls = if bench.model_path.is_dir() { 4 } else { 3 };
    t.engine.push_ms(calls.wait(engine, n_calls).await?);
    Ok(())
}

/// Phase 4: a load writes the arena, then `sleep(level)` and a full `wake_up` (after sleep
/// level 2, which dropped the weights, a reload comes first and counts as part of waking).
async fn sleep_and_wake(
    bench: &mut Bench,
    args: &Args,
    level: SleepLevel,
) -> anyhow::Result<RssStep> {
    bench.fill_kv(args).await?;
    let engine = &bench.engine;
    let before = report::rss_bytes()?;
    let started = Instant::now();
    engine.sleep(level, PauseMode::Wait).await?;
    let op_ms = ms(started);
    let after = report::rss_bytes()?;
    let started = Instant::now();
    if level == SleepLevel::L2 {
        engine
            .update_weights_from_disk(bench.model_path.clone(), Some("after-sleep2".into()))
            .await
            .with_context(|| format!("reloading {}", bench.model_path.display()))?;
    }
    engine.wake_up(&[]).await?;
    let wake_ms = ms(started);
    ensure!(
        !engine.is_sleeping().await?,
        "the engine still sleeps after the wake_up"
    );
    Ok(RssStep {
        before,
        after,
        after_wake: report::rss_bytes()?,
        op_ms,
        wake_ms,
    })
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
