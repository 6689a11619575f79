//! Phase 0 of `ferry bench lifecycle`: weight updates on the idle engine, with resident
//! memory around each. `--updates` full pushes of the model's own weights (a safetensors
//! body streamed from a file in 1 MiB pieces, as the admin API receives one over the
//! network), then as many reloads from disk. Before each update the peak (`VmHWM`) is reset
//! through `/proc/self/clear_refs`, so the peak read after it is the update's own.
//!
//! The engine holds the weights in their stored precision, as `ferry serve` does, and a
//! pushed tensor keeps the dtype it arrives in (f32 here), so a push into a quantized model
//! makes its weights larger and a reload makes them the file's again: each update also reads
//! the bytes of the weights held (`weight_info`).
//!
//! Goal (`issues show 15`): resident memory minus the weights held stays what it was before
//! the first update (within 5% of the weights), and the peak during an update is at most one
//! extra copy of the tensors it installs.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use ferry_engine::EngineHandle;

use super::report::{self, UpdateMemory, UpdateRss};

/// Bytes per piece of a streamed push.
const PIECE_BYTES: usize = 1 << 20;

/// Pushes `body` (a safetensors file) `n` times, then reloads `model_path` `n` times.
pub async fn measure(
    engine: &EngineHandle,
    body: &Path,
    model_path: &Path,
    n: usize,
) -> anyhow::Result<UpdateMemory> {
    let mut m = UpdateMemory {
        rss_before: report::rss_bytes()?,
        weight_bytes_before: engine.weight_info().await?.n_bytes,
        ..UpdateMemory::default()
    };
    for i in 0..n {
        let started = Instant::now();
        let rss = around(engine, push(engine, body, i)).await?;
        m.push_ms.push_ms(started.elapsed());
        m.pushes.push(rss);
    }
    for i in 0..n {
        let started = Instant::now();
        let rss = around(engine, reload(engine, model_path.to_owned(), i)).await?;
        m.reload_ms.push_ms(started.elapsed());
        m.reloads.push(rss);
    }
    Ok(m)
}

/// Runs `update` with resident memory read before and after it and its peak reset first,
/// then the bytes of the weights it left.
async fn around(
    engine: &EngineHandle,
    update: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<UpdateRss> {
    let before = report::rss_bytes()?;
    report::reset_peak_rss()?;
    update.await?;
    let peak = report::peak_rss_bytes()?;
    let after = report::rss_bytes()?;
    Ok(UpdateRss {
        before,
        after,
        peak,
        weight_bytes: engine.weight_info().await?.n_bytes,
    })
}

async fn push(engine: &EngineHandle, body: &Path, i: usize) -> anyhow::Result<()> {
    let file = std::fs::File::open(body).with_context(|| format!("opening {}", body.display()))?;
    let mut pieces = futures_util::stream::iter(Pieces { file });
    let info = engine
        .update_weights_from_safetensors_stream(&mut pieces, Some(format!("push-{i}")))
        .await
        .with_context(|| format!("pushing {}", body.display()))?;
    anyhow::ensure!(info.complete, "the pushed body is not a complete set");
    Ok(())
}

async fn reload(engine: &EngineHandle, path: PathBuf, i: usize) -> anyhow::Result<()> {
    let what = format!("reloading {}", path.display());
    engine
        .update_weights_from_disk(path, Some(format!("reload-{i}")))
        .await
        .context(what)?;
    Ok(())
}

/// A file read in `PIECE_BYTES` pieces. Read on the runtime's thread: from the page cache a
/// piece takes microseconds, and the conversion runs on the blocking pool.
struct Pieces {
    file: std::fs::File,
}

impl Iterator for Pieces {
    type Item = std::io::Result<Vec<u8>>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut piece = Vec::with_capacity(PIECE_BYTES);
        match (&mut self.file)
            .take(PIECE_BYTES as u64)
            .read_to_end(&mut piece)
        {
            Ok(0) => None,
            Ok(_) => Some(Ok(piece)),
            Err(e) => Some(Err(e)),
        }
    }
}
