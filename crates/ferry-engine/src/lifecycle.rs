//! The lifecycle operations on [`EngineHandle`]: pause, resume, sleep, wake-up, KV release,
//! cache reset, aborts and weight updates (`../shared/design/lifecycle.md`).
//!
//! Each is one utility call handled on the engine thread between steps, in arrival order.
//! They take no queue permit, so a full queue never delays a pause. Weight updates read and
//! convert tensors *before* queueing (on a blocking thread), so the engine thread only swaps
//! them in, and the replaced weights are dropped back on a blocking thread.
//!
//! Memory: pushed bytes and model files are converted straight into the new weights
//! (`ferry_model::WeightSlots`), never parsed into a copy first, and a streamed push
//! ([`EngineHandle::update_weights_from_safetensors_stream`]) never holds its whole body; so
//! an update costs one extra copy of the tensors it replaces while it runs, and the replaced
//! weights go back to the OS when dropped (`ferry_model::WeightBuf`). A reload from a model
//! folder while the engine is paused costs none: it writes over the weights in place.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use ferry_core::{Cleared, LifecycleStatus, PauseMode, SleepLevel, WakeTag, WeightResidency};
use ferry_model::{
    expected_tensors, BucketInfo, LoraAdapter, LoraConfig, PreparedWeights, SafetensorsPush,
    WeightFiles, WeightStore, WeightUpload,
};
use futures_core::Stream;
use tokio::sync::{mpsc, oneshot};

use crate::engine_core::{Call, CallResult, LendId};
use crate::input::{Input, Utility};
use crate::lora::{LoraCallError, LoraInfo, LoraLoad};
use crate::reload::{DiskReload, ReloadFailure, Step};
use crate::{
    EngineHandle, LifecycleCallError, Stopped, WeightInfo, WeightPushError, WeightReloadError,
    WeightUpdateError, WeightUpdateInfo,
};

/// Pieces of a streamed push read ahead of the conversion: enough to keep the blocking
/// thread busy while the next arrive, few enough that the body is never held (a network
/// piece is kilobytes to a megabyte).
const PUSH_PIECES_AHEAD: usize = 8;
/// Bytes of body pieces handed to the reader at once.
const PUSH_BATCH_BYTES: usize = 1 << 20;

impl EngineHandle {
    /// Stops compute (see [`PauseMode`]). Returns once paused: at once for `keep` and `abort`
    /// without `clear_cache`, after the drain for `wait`, and after the cache reset with
    /// `clear_cache`. Requests arriving while paused are queued.
    pub async fn pause(
        &self,
        mode: PauseMode,
        clear_cache: bool,
    ) -> Result<(), LifecycleCallError> {
        self.operation(Call::Pause { mode, clear_cache }).await
    }

    /// Continues scheduling; a pending reset or sleep fails with a "cancelled by resume"
    /// error. Refused while memory is released (call `wake_up`).
    pub async fn resume(&self) -> Result<(), LifecycleCallError> {
        self.operation(Call::Resume).await
    }

    /// Pauses with `mode`, then (levels 1 and 2) resets every cache, frees the KV memory and
    /// offloads (1) or drops (2) the weights. A full `wake_up` resumes.
    pub async fn sleep(
        &self,
        level: SleepLevel,
        mode: PauseMode,
    ) -> Result<(), LifecycleCallError> {
        self.operation(Call::Sleep { level, mode }).await
    }

    /// Restores what sleep or `release_kv_cache_memory` released (`tags` empty: everything).
    pub async fn wake_up(&self, tags: &[WakeTag]) -> Result<(), LifecycleCallError> {
        self.operation(Call::WakeUp {
            tags: tags.to_vec(),
        })
        .await
    }

    /// Resets every cache and frees the KV memory; needs a completed pause.
    pub async fn release_kv_cache_memory(&self) -> Result<(), LifecycleCallError> {
        self.operation(Call::ReleaseKvCacheMemory).await
    }

    /// Drops every cached block hash now: false (nothing changed) while blocks are held.
    /// `reset_running_requests` preempts running requests first; `reset_connector` resets
    /// every connector's cache too.
    pub async fn reset_prefix_cache(
        &self,
        reset_running_requests: bool,
        reset_connector: bool,
    ) -> Result<bool, Stopped> {
        let cleared = self
            .reset_caches(reset_running_requests, reset_connector)
            .await?;
        Ok(cleared.is_some())
    }

    /// [`Self::reset_prefix_cache`], saying what it cleared (`None`: nothing, blocks are
    /// held): the device's prefix cache, and the offload tier with `reset_connector` when
    /// there is one.
    pub async fn reset_caches(
        &self,
        reset_running_requests: bool,
        reset_connector: bool,
    ) -> Result<Option<Cleared>, Stopped> {
        let answer = self
            .call(Call::ResetPrefixCache {
                reset_running_requests,
                reset_connector,
            })
            .await?;
        expect(answer, CallResult::into_reset)
    }

    /// Finishes the named live requests (`None`: all) as aborted; unknown ids are ignored.
    /// Returns how many were aborted.
    pub async fn abort_requests(&self, ids: Option<Vec<String>>) -> Result<usize, Stopped> {
        let answer = self.call(Call::AbortRequests { ids }).await?;
        expect(answer, CallResult::into_aborted)
    }

    /// Pushes tensors (some or all parameters). Names, shapes and dtypes are checked before
    /// anything changes. `version`: the new weight version (default: the previous one with
    /// its `+N` suffix bumped).
    pub async fn update_weights(
        &self,
        tensors: WeightStore,
        version: Option<String>,
    ) -> Result<WeightUpdateInfo, WeightUpdateError> {
        let preparer = self.weight_preparer();
        let started = Instant::now();
        let prepared = blocking(move || preparer.prepare(tensors)).await??;
        self.install(prepared, version, started).await
    }

    /// [`EngineHandle::update_weights`] from a safetensors file's bytes (F32, F16 or BF16
    /// tensors under their Hugging Face names). They are converted straight into the new
    /// weights, off the engine thread and off the caller's task.
    pub async fn update_weights_from_safetensors(
        &self,
        bytes: impl AsRef<[u8]> + Send + 'static,
        version: Option<String>,
    ) -> Result<WeightUpdateInfo, WeightUpdateError> {
        let mut push = SafetensorsPush::new(self.weight_preparer());
        let started = Instant::now();
        let prepared = blocking(move || {
            push.feed(bytes.as_ref())?;
            push.finish()
        })
        .await??;
        self.install(prepared, version, started).await
    }

    /// [`EngineHandle::update_weights_from_safetensors`] as the body arrives, as the admin
    /// API's push receives it: each piece is converted into the new weights on a blocking
    /// thread while the next is read, so the body is never held whole. The header is checked
    /// before any weight memory is taken; on a refusal the rest of `body` is left unread.
    pub async fn update_weights_from_safetensors_stream<S, B, E>(
        &self,
        body: &mut S,
        version: Option<String>,
    ) -> Result<WeightUpdateInfo, WeightPushError<E>>
    where
        S: Stream<Item = Result<B, E>> + Unpin,
        B: AsRef<[u8]> + Send + 'static,
    {
        let started = Instant::now();
        let push = read_stream(SafetensorsPush::new(self.weight_preparer()), body).await?;
        let prepared = blocking(move || push.finish())
            .await
            .map_err(WeightUpdateError::Stopped)?
            .map_err(WeightUpdateError::Weights)?;
        Ok(self.install(prepared, version, started).await?)
    }

    /// A bucketed upload of this engine's weights, to stage buckets into
    /// ([`EngineHandle::upload_bucket`]) and commit ([`EngineHandle::finish_upload`], then
    /// [`EngineHandle::install_upload`]). Nothing reaches the engine before the commit.
    pub fn weight_upload(&self) -> WeightUpload {
        WeightUpload::new(self.weight_preparer())
    }

    /// Reads one bucket (a safetensors body) as it arrives into `upload`'s staged buffers, as
    /// a push is read. On an error the upload is unchanged; the caller decides whether it
    /// lives on.
    pub async fn upload_bucket<S, B, E>(
        &self,
        upload: &mut WeightUpload,
        body: &mut S,
    ) -> Result<BucketInfo, WeightPushError<E>>
    where
        S: Stream<Item = Result<B, E>> + Unpin,
        B: AsRef<[u8]> + Send + 'static,
    {
        let push = read_stream(upload.bucket(), body).await?;
        Ok(upload.stage(push).map_err(WeightUpdateError::Weights)?)
    }

    /// Joins an upload's buckets into the one update its commit installs (off the engine
    /// thread), and checks it can be installed now: weights dropped by sleep level 2 take
    /// only a complete set. The first phase of a commit across instances.
    pub async fn finish_upload(
        &self,
        upload: WeightUpload,
    ) -> Result<PreparedWeights, WeightUpdateError> {
        let dropped = self.weight_info().await?.residency == WeightResidency::Dropped;
        let prepared = blocking(move || {
            if dropped {
                upload.finish_complete()
            } else {
                upload.finish()
            }
        })
        .await??;
        Ok(prepared)
    }

    /// Installs a finished upload between two steps under `version`: every staged tensor at
    /// once, so each token is computed by the old weights or the new, never a mix.
    pub async fn install_upload(
        &self,
        prepared: PreparedWeights,
        version: Option<String>,
    ) -> Result<WeightUpdateInfo, WeightUpdateError> {
        self.install(prepared, version, Instant::now()).await
    }

    /// Reloads every weight from a model folder (or GGUF file) of the same model. The
    /// config is checked before a tensor is read; each tensor is then converted straight
    /// into its place.
    ///
    /// While the engine is in a completed pause, a safetensors folder is read **in place**:
    /// every tensor is checked first ([`WeightFiles::check`]), then the engine lends its
    /// weights ([`WeightResidency::Reloading`]: resume and sleep wait for the reload's
    /// answer; it lends only in a completed pause, `crate::reload` has the order of the
    /// calls), the files are read over them, and they come back under the new version. No
    /// second copy, so no fresh memory, which is most of a reload's cost when the files are
    /// in the page cache. Only the disk failing or the files changing can stop that read
    /// midway; the weights, part old and part new, are then dropped
    /// ([`WeightReloadError::Torn`]), as sleep level 2 leaves them. Otherwise (running, or a
    /// GGUF file) the files are read into new weights, which replace the old between two
    /// steps while they serve.
    pub async fn update_weights_from_disk(
        &self,
        path: PathBuf,
        version: Option<String>,
    ) -> Result<WeightUpdateInfo, WeightReloadError> {
        let preparer = self.weight_preparer();
        let started = Instant::now();
        let (files, expected, preparer) = blocking(move || -> Result<_, WeightReloadError> {
            let files = WeightFiles::open(&path)?;
            preparer.check_config(files.config())?;
            // Complete: the files must hold every tensor the config needs, or reading fails
            // naming it.
            let expected = expected_tensors(files.config());
            Ok((Arc::new(files), Arc::new(expected), preparer))
        })
        .await??;
        // The order of the calls is the machine's (`reload.rs`); this drives it with the
        // files, reading on blocking threads. Leaving early (an error, or the caller giving
        // up) drops `reload`, whose guard tells the engine if its weights were out.
        let engine = self.clone();
        let mut reload = DiskReload::new(
            files.reads_in_place(),
            version,
            LendId::next(),
            Box::new(move |call| engine.send_call(call)),
        );
        // The error of the stage that failed, for the answer.
        let mut failed: Option<WeightReloadError> = None;
        let (mut prepare_seconds, mut queued) = (0.0, started);
        let mut step = reload.start();
        let reloaded = loop {
            step = match step {
                Step::Call(call) => {
                    if matches!(
                        call,
                        Call::InstallWeights { .. } | Call::ReturnWeights { .. }
                    ) {
                        prepare_seconds = started.elapsed().as_secs_f64();
                        queued = Instant::now();
                    }
                    reload.answered(self.call(call).await?)
                }
                Step::Check => {
                    let files = Arc::clone(&files);
                    let checked = blocking(move || files.check()).await?;
                    let checked = checked.map_err(WeightReloadError::Load);
                    reload.checked(kept(&mut failed, checked).is_some())
                }
                Step::ReadInPlace(lent) => {
                    let (files, expected) = (Arc::clone(&files), Arc::clone(&expected));
                    let preparer = Arc::clone(&preparer);
                    let read = blocking(move || -> Result<_, WeightReloadError> {
                        // Refused only for a list the check would have refused: the weights,
                        // still whole, are given up all the same.
                        let mut slots = preparer
                            .slots_in_place(lent, &expected)
                            .map_err(|(e, _lent)| WeightReloadError::Weights(e))?;
                        files
                            .read_into(&mut *slots)
                            .map_err(WeightReloadError::Torn)?;
                        Ok(slots.finish())
                    })
                    .await?;
                    reload.read(kept(&mut failed, read))
                }
                Step::ReadNew => {
                    let (files, expected) = (Arc::clone(&files), Arc::clone(&expected));
                    let preparer = Arc::clone(&preparer);
                    let read = blocking(move || -> Result<_, WeightReloadError> {
                        let mut slots = preparer.slots(&expected)?;
                        files.read_into(&mut *slots)?;
                        Ok(slots.finish())
                    })
                    .await?;
                    reload.read(kept(&mut failed, read))
                }
                Step::Done(result) => break result,
            };
        };
        let reloaded = match reloaded {
            Ok(r) => r,
            Err(ReloadFailure::Weights(e)) => return Err(WeightReloadError::Weights(e)),
            Err(ReloadFailure::Refused | ReloadFailure::Torn) => {
                return Err(failed.unwrap_or_else(|| WeightReloadError::Stopped(self.stopped())))
            }
            // Logged by the machine; the engine's answers cannot be trusted.
            Err(ReloadFailure::Unexpected(_)) => {
                return Err(WeightReloadError::Stopped(self.stopped()))
            }
        };
        let install_seconds = queued.elapsed().as_secs_f64();
        if let Some(old) = reloaded.retired {
            blocking(move || drop(old)).await?;
        }
        Ok(WeightUpdateInfo {
            weight_version: reloaded.weight_version,
            n_tensors: reloaded.n_tensors,
            n_bytes: reloaded.n_bytes,
            complete: reloaded.complete,
            prepare_seconds,
            install_seconds,
            in_place: reloaded.in_place,
        })
    }

    async fn install(
        &self,
        weights: PreparedWeights,
        version: Option<String>,
        started: Instant,
    ) -> Result<WeightUpdateInfo, WeightUpdateError> {
        let (n_tensors, n_bytes, complete) = (weights.n_tensors, weights.n_bytes, weights.complete);
        let prepare_seconds = started.elapsed().as_secs_f64();
        let queued = Instant::now();
        let answer = self.call(Call::InstallWeights { weights, version }).await?;
        let (weight_version, retired) = expect(answer, CallResult::into_installed)??;
        let install_seconds = queued.elapsed().as_secs_f64();
        if let Some(old) = retired {
            // Freeing hundreds of megabytes takes milliseconds: not on this task, nor on the
            // engine thread. Awaited, so when an update returns its memory is back (the
            // replaced weights are unmapped, see `ferry_model::WeightBuf`); the weights are
            // already serving, so only this caller waits.
            blocking(move || drop(old)).await?;
        }
        Ok(WeightUpdateInfo {
            weight_version,
            n_tensors,
            n_bytes,
            complete,
            prepare_seconds,
            install_seconds,
            in_place: false,
        })
    }

    /// Renames the weights now loaded (no weights change). Prefix-cache entries of the old
    /// name are never hit again.
    pub async fn update_weight_version(&self, version: String) -> Result<(), Stopped> {
        let answer = self.call(Call::SetWeightVersion { version }).await?;
        expect(answer, CallResult::into_version_set)
    }

    /// The lifecycle state and the weights, read on the engine thread (so it reflects every
    /// call handled before it).
    pub async fn lifecycle_status(&self) -> Result<(LifecycleStatus, WeightInfo), Stopped> {
        let answer = self.call(Call::Status).await?;
        expect(answer, CallResult::into_status)
    }

    pub async fn is_paused(&self) -> Result<bool, Stopped> {
        Ok(self.lifecycle_status().await?.0.paused)
    }

    pub async fn is_sleeping(&self) -> Result<bool, Stopped> {
        Ok(self.lifecycle_status().await?.0.sleeping)
    }

    pub async fn weight_info(&self) -> Result<WeightInfo, Stopped> {
        Ok(self.lifecycle_status().await?.1)
    }

    /// A lifecycle call and its answer; an unanswered call means the engine stopped.
    pub(crate) async fn call(&self, call: Call) -> Result<CallResult, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.send_utility_unbounded(Input::Utility(Utility::Lifecycle(call, tx)))?;
        rx.await.map_err(|_| self.stopped())
    }

    /// A lifecycle call whose answer no one waits for (a reload's guard giving up lent
    /// weights). A stopped engine has nothing to tell.
    fn send_call(&self, call: Call) {
        let (reply, _) = oneshot::channel();
        let _ = self.send_utility_unbounded(Input::Utility(Utility::Lifecycle(call, reply)));
    }

    /// A lifecycle operation the core may refuse or cancel.
    async fn operation(&self, call: Call) -> Result<(), LifecycleCallError> {
        let answer = self.call(call).await?;
        Ok(expect(answer, CallResult::into_op)??)
    }
}

/// The answer of the kind `kind` takes; another kind is a bug in the core, logged, and the
/// caller sees the engine as gone (its answers cannot be trusted).
pub(crate) fn expect<T>(
    answer: CallResult,
    kind: fn(CallResult) -> Result<T, CallResult>,
) -> Result<T, Stopped> {
    kind(answer).map_err(|other| {
        tracing::error!(?other, "a lifecycle answer of the wrong kind");
        Stopped::ShutDown
    })
}

/// `result`'s value; its error is kept in `failed` (a reload's answer names the stage that
/// failed).
fn kept<T>(
    failed: &mut Option<WeightReloadError>,
    result: Result<T, WeightReloadError>,
) -> Option<T> {
    result.map_err(|e| *failed = Some(e)).ok()
}

/// Runs `f` on tokio's blocking pool (file reads, tensor conversion). `Stopped` if the pool
/// is gone (the runtime is shutting down) or `f` panicked.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Stopped> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| Stopped::ShutDown)
}

/// Feeds `body` into `push` piece by piece on a blocking thread while the next pieces are
/// read, so the body is never held whole; returns the push once the body ended, for its
/// `finish`. On a refusal (the reader's error) the rest of `body` is left unread.
async fn read_stream<S, B, E>(
    mut push: SafetensorsPush,
    body: &mut S,
) -> Result<SafetensorsPush, WeightPushError<E>>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]> + Send + 'static,
{
    // Pieces go to the reader in batches of about `PUSH_BATCH_BYTES`: a network piece is
    // often a few kilobytes, and a hand-off per piece cost more than the conversion.
    let (tx, mut rx) = mpsc::channel::<Vec<B>>(PUSH_PIECES_AHEAD);
    let reader = tokio::task::spawn_blocking(move || {
        while let Some(batch) = rx.blocking_recv() {
            for piece in batch {
                push.feed(piece.as_ref())?;
            }
        }
        Ok(push)
    });
    let mut body_error = None;
    let (mut batch, mut n_batched) = (Vec::new(), 0);
    while let Some(piece) = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_next(cx)).await {
        match piece {
            Ok(piece) => {
                n_batched += piece.as_ref().len();
                batch.push(piece);
                // A send fails only once the reader has refused the push: its error says why.
                if n_batched >= PUSH_BATCH_BYTES {
                    n_batched = 0;
                    if tx.send(std::mem::take(&mut batch)).await.is_err() {
                        break;
                    }
                }
            }
            Err(e) => {
                body_error = Some(e);
                break;
            }
        }
    }
    if !batch.is_empty() && body_error.is_none() {
        let _ = tx.send(batch).await;
    }
    drop(tx);
    // Awaited even after a body error, so the partial bucket is freed before returning.
    let read = reader
        .await
        .map_err(|_| WeightUpdateError::Stopped(Stopped::ShutDown));
    if let Some(e) = body_error {
        return Err(WeightPushError::Body(e));
    }
    Ok(read?.map_err(WeightUpdateError::Weights)?)
}

// ---- LoRA adapters (the engine thread's side: `crate::lora`) ----

impl EngineHandle {
    /// The adapters loaded now (as of the engine thread's last load or unload).
    pub fn loras(&self) -> Vec<LoraInfo> {
        self.lora_table()
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The adapter loaded under `name`, if one is.
    pub fn lora(&self, name: &str) -> Option<LoraInfo> {
        self.lora_table()
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|l| l.name == name)
            .cloned()
    }

    /// Reads the PEFT folder `path` on a blocking thread, checks it against the base model
    /// and `--max-lora-rank`, and loads it as `name` (see [`Self::load_lora`]).
    pub async fn load_lora_from_dir(
        &self,
        name: &str,
        path: PathBuf,
        inplace: bool,
        pinned: bool,
    ) -> Result<LoraInfo, LoraCallError> {
        let settings = self.lora_settings().ok_or(LoraCallError::Disabled)?.clone();
        let dir = path.clone();
        let adapter = tokio::task::spawn_blocking(move || {
            LoraAdapter::load(&dir, &settings.base, settings.max_rank)
        })
        .await
        .map_err(|e| LoraCallError::Invalid(format!("reading the adapter: {e}")))?
        .map_err(|e| LoraCallError::Invalid(e.to_string()))?;
        self.load_lora(LoraLoad {
            name: name.into(),
            adapter: Arc::new(adapter),
            source: Some(path),
            inplace,
            pinned,
        })
        .await
    }

    /// Reads a pushed adapter on a blocking thread, its config from the text of an
    /// `adapter_config.json` and its tensors from the bytes of a safetensors file (PEFT's
    /// names: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), checks it as
    /// a folder's, and loads it as `name` (see [`Self::load_lora`]). A refusal names the
    /// config or the body and changes nothing.
    pub async fn load_lora_from_bytes(
        &self,
        name: &str,
        config: String,
        bytes: Vec<u8>,
        inplace: bool,
    ) -> Result<LoraInfo, LoraCallError> {
        let settings = self.lora_settings().ok_or(LoraCallError::Disabled)?.clone();
        let adapter = tokio::task::spawn_blocking(move || {
            let config = LoraConfig::from_json(&config)?;
            LoraAdapter::from_safetensors(config, &bytes, "body", &settings.base, settings.max_rank)
        })
        .await
        .map_err(|e| LoraCallError::Invalid(format!("reading the adapter: {e}")))?
        .map_err(|e| LoraCallError::Pushed {
            param: if e.is_config() { "config" } else { "body" },
            message: e.to_string(),
        })?;
        self.load_lora(LoraLoad {
            name: name.into(),
            adapter: Arc::new(adapter),
            source: None,
            inplace,
            pinned: true,
        })
        .await
    }

    /// Loads an adapter already read and checked, or replaces a loaded one's weights under
    /// its next version (`inplace`), between two steps: requests under it compute every
    /// later token with the new weights (their `lora_versions` list both), and the KV the
    /// old version computed leaves every cache.
    pub async fn load_lora(&self, load: LoraLoad) -> Result<LoraInfo, LoraCallError> {
        if self.lora_settings().is_none() {
            return Err(LoraCallError::Disabled);
        }
        let answer = self.call(Call::LoadLora(Box::new(load))).await?;
        expect(answer, CallResult::into_lora_loaded)?
    }

    /// Unloads the adapter `name`: its live requests finish as aborted (their number is
    /// returned) and the KV it computed leaves every cache.
    pub async fn unload_lora(&self, name: &str) -> Result<usize, LoraCallError> {
        if self.lora_settings().is_none() {
            return Err(LoraCallError::Disabled);
        }
        let answer = self.call(Call::UnloadLora { name: name.into() }).await?;
        expect(answer, CallResult::into_lora_unloaded)?
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::{LifecycleError, SchedulerConfig, TokenId};
    use ferry_model::{LlamaModel, WeightResidency};

    use super::*;
    use crate::{spawn, EngineConfig, LifecycleCallError};

    /// A reload in place that never hands its weights back (its read failed, or its caller
    /// stopped waiting) leaves them dropped, as sleep level 2 does, and the engine serves
    /// again after a complete set and a wake-up, with nothing lost.
    #[tokio::test]
    async fn weights_lent_and_never_returned_are_dropped_and_come_back_with_a_complete_set() {
        let tiny = ferry_model::tiny::tiny_model();
        let model = LlamaModel::new(&tiny.config, &tiny.weights).unwrap();
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                block_size: 4,
                n_blocks: 64,
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
                max_model_len: 256,
                ..SchedulerConfig::default()
            },
            input_queue_capacity: 8,
            lora: None,
        };
        let engine = spawn(config, Box::new(model), None).unwrap();
        let lend = |engine: &EngineHandle| {
            let engine = engine.clone();
            async move {
                let answer = engine.call(Call::LendWeights { lend: LendId(7) });
                answer.await.unwrap().into_lent().unwrap()
            }
        };
        assert!(lend(&engine).await.is_none(), "running: nothing is lent");

        engine.pause(PauseMode::Keep, false).await.unwrap();
        let lent = lend(&engine).await;
        assert!(lent.is_some(), "a completed pause lends");
        let info = engine.weight_info().await.unwrap();
        assert_eq!(info.residency, WeightResidency::Reloading);
        assert_eq!(info.n_bytes, 0, "the engine holds none while lent");
        let refused = |r: Result<(), LifecycleCallError>| {
            matches!(
                r,
                Err(LifecycleCallError::Lifecycle(LifecycleError::Reloading))
            )
        };
        assert!(refused(engine.resume().await));
        assert!(refused(engine.wake_up(&[WakeTag::Weights]).await));
        assert!(refused(engine.sleep(SleepLevel::L1, PauseMode::Keep).await));
        let other = engine.update_weights(tiny.weights.clone(), None).await;
        assert!(
            matches!(
                other,
                Err(WeightUpdateError::Weights(
                    ferry_model::WeightError::Reloading
                ))
            ),
            "{other:?}"
        );
        // Another lend's loss or return does not touch them.
        engine.send_call(Call::LoseWeights { lend: LendId(8) });
        let info = engine.weight_info().await.unwrap();
        assert_eq!(info.residency, WeightResidency::Reloading);
        drop(lent);

        // A reload whose caller goes away mid-read: its guard gives the weights up. The
        // engine is lent to `LendId(7)`; this reload's lend is that one, driven to its read.
        let in_place_as_7 = || {
            let sink = engine.clone();
            DiskReload::new(
                true,
                None,
                LendId(7),
                Box::new(move |call| sink.send_call(call)),
            )
        };
        let mut reload = in_place_as_7();
        let Step::Check = reload.start() else {
            panic!("a reload in place checks its files first")
        };
        assert!(matches!(
            reload.checked(true),
            Step::Call(Call::LendWeights { lend: LendId(7) })
        ));
        // (The weights are already lent to it, above: the engine refuses a second lend.)
        let second = engine.call(Call::LendWeights { lend: LendId(7) }).await;
        let Step::ReadNew = reload.answered(second.unwrap()) else {
            panic!("a lend refused reads into new weights")
        };
        drop(reload);
        let info = engine.weight_info().await.unwrap();
        assert_eq!(
            info.residency,
            WeightResidency::Reloading,
            "a reload that was not lent anything gives nothing up"
        );
        let mut reload = in_place_as_7();
        reload.start();
        reload.checked(true);
        // Dropped while its lend is asked for (the weights may be out): the guard fires.
        drop(reload);
        let info = engine.weight_info().await.unwrap();
        assert_eq!(info.residency, WeightResidency::Dropped);
        let status = engine.lifecycle_status().await.unwrap().0;
        assert!(status.paused && status.sleeping);
        assert!(matches!(
            engine.resume().await,
            Err(LifecycleCallError::Lifecycle(LifecycleError::Asleep { .. }))
        ));
        engine
            .update_weights(tiny.weights.clone(), Some("again".into()))
            .await
            .unwrap();
        engine.wake_up(&[WakeTag::Weights]).await.unwrap();
        engine.resume().await.unwrap();
        let req = crate::GenerateRequest {
            request_id: "after".into(),
            prompt: TokenId::list([5, 6, 7]),
            params: ferry_core::SamplingParams::greedy(4),
            ..crate::GenerateRequest::default()
        };
        let mut stream = engine.generate(req).await.unwrap();
        let mut n = 0;
        while let Some(chunk) = stream.next().await {
            n += chunk.token_ids.len();
            if let Some(finish) = chunk.finish {
                assert_eq!(finish.weight_versions, ["again"]);
            }
        }
        assert_eq!(n, 4);
        engine.shutdown().await.unwrap();
    }
}
