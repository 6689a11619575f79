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

use ferry_core::{LifecycleStatus, PauseMode, SleepLevel, WakeTag, WeightResidency};
use ferry_model::{
    expected_tensors, BucketInfo, PreparedWeights, RetiredWeights, SafetensorsPush, WeightFiles,
    WeightPreparer, WeightStore, WeightUpload,
};
use futures_core::Stream;
use tokio::sync::{mpsc, oneshot};

use crate::input::{Input, LifecycleCall, OpReply, Reply};
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
        self.operation(|reply| LifecycleCall::Pause {
            mode,
            clear_cache,
            reply,
        })
        .await
    }

    /// Continues scheduling; a pending reset or sleep fails with a "cancelled by resume"
    /// error. Refused while memory is released (call `wake_up`).
    pub async fn resume(&self) -> Result<(), LifecycleCallError> {
        self.operation(LifecycleCall::Resume).await
    }

    /// Pauses with `mode`, then (levels 1 and 2) resets every cache, frees the KV memory and
    /// offloads (1) or drops (2) the weights. A full `wake_up` resumes.
    pub async fn sleep(
        &self,
        level: SleepLevel,
        mode: PauseMode,
    ) -> Result<(), LifecycleCallError> {
        self.operation(|reply| LifecycleCall::Sleep { level, mode, reply })
            .await
    }

    /// Restores what sleep or `release_kv_cache_memory` released (`tags` empty: everything).
    pub async fn wake_up(&self, tags: &[WakeTag]) -> Result<(), LifecycleCallError> {
        let tags = tags.to_vec();
        self.operation(|reply| LifecycleCall::WakeUp { tags, reply })
            .await
    }

    /// Resets every cache and frees the KV memory; needs a completed pause.
    pub async fn release_kv_cache_memory(&self) -> Result<(), LifecycleCallError> {
        self.operation(LifecycleCall::ReleaseKvCacheMemory).await
    }

    /// Drops every cached block hash now: false (nothing changed) while blocks are held.
    /// `reset_running_requests` preempts running requests first; `reset_connector` resets
    /// every connector's cache too.
    pub async fn reset_prefix_cache(
        &self,
        reset_running_requests: bool,
        reset_connector: bool,
    ) -> Result<bool, Stopped> {
        self.lifecycle(|reply| LifecycleCall::ResetPrefixCache {
            reset_running_requests,
            reset_connector,
            reply,
        })
        .await
    }

    /// Finishes the named live requests (`None`: all) as aborted; unknown ids are ignored.
    /// Returns how many were aborted.
    pub async fn abort_requests(&self, ids: Option<Vec<String>>) -> Result<usize, Stopped> {
        self.lifecycle(|reply| LifecycleCall::AbortRequests { ids, reply })
            .await
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
    /// answer), the files are read over them, and they come back under the new version. No
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
            Ok((files, expected, preparer))
        })
        .await??;
        // In place only if nothing can stop the read but the disk: every tensor checked
        // before the engine lends its weights (which it does only in a completed pause).
        let (files, lent) = if files.reads_in_place() && self.is_paused().await? {
            let files = blocking(move || files.check().map(|()| files)).await??;
            (files, self.lifecycle(LifecycleCall::LendWeights).await?)
        } else {
            (files, None)
        };
        let reload = Reload {
            preparer,
            files,
            expected,
            version,
            started,
        };
        match lent {
            Some(lent) => self.reload_in_place(lent, reload).await,
            None => self.reload_into_new(reload).await,
        }
    }

    /// The weights read into new memory, then swapped in between two steps.
    async fn reload_into_new(&self, reload: Reload) -> Result<WeightUpdateInfo, WeightReloadError> {
        let (preparer, files) = (reload.preparer, reload.files);
        let expected = reload.expected;
        let prepared = blocking(move || -> Result<_, WeightReloadError> {
            let mut slots = preparer.slots(&expected)?;
            files.read_into(&mut *slots)?;
            Ok(slots.finish())
        })
        .await??;
        Ok(self
            .install(prepared, reload.version, reload.started)
            .await?)
    }

    /// The files read over `lent`, the engine's weights, then handed back. Whatever ends
    /// this early (an error, or the caller giving up) leaves `lost` to tell the engine that
    /// what it lent is gone.
    async fn reload_in_place(
        &self,
        lent: RetiredWeights,
        reload: Reload,
    ) -> Result<WeightUpdateInfo, WeightReloadError> {
        let Reload {
            preparer,
            files,
            expected,
            version,
            started,
        } = reload;
        let lost = LostIfDropped(Some(self.clone()));
        let prepared = blocking(move || -> Result<_, WeightReloadError> {
            // Refused only for a list the check above would have refused: the weights, still
            // whole, are dropped with `lost` all the same.
            let mut slots = preparer
                .slots_in_place(lent, &expected)
                .map_err(|(e, _lent)| e)?;
            files
                .read_into(&mut *slots)
                .map_err(WeightReloadError::Torn)?;
            Ok(slots.finish())
        })
        .await??;
        lost.defuse();
        let (n_tensors, n_bytes) = (prepared.n_tensors, prepared.n_bytes);
        let prepare_seconds = started.elapsed().as_secs_f64();
        let queued = Instant::now();
        let (weight_version, _) = self
            .lifecycle(|reply| LifecycleCall::ReturnWeights {
                weights: prepared,
                version,
                reply,
            })
            .await?
            .map_err(WeightReloadError::Weights)?;
        Ok(WeightUpdateInfo {
            weight_version,
            n_tensors,
            n_bytes,
            complete: true,
            prepare_seconds,
            install_seconds: queued.elapsed().as_secs_f64(),
            in_place: true,
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
        let (weight_version, retired) = self
            .lifecycle(|reply| LifecycleCall::InstallWeights {
                weights,
                version,
                reply,
            })
            .await??;
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
        self.lifecycle(|reply| LifecycleCall::SetWeightVersion { version, reply })
            .await
    }

    /// The lifecycle state and the weights, read on the engine thread (so it reflects every
    /// call handled before it).
    pub async fn lifecycle_status(&self) -> Result<(LifecycleStatus, WeightInfo), Stopped> {
        self.lifecycle(LifecycleCall::Status).await
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

    /// A lifecycle call and its reply; an unanswered reply means the engine stopped.
    async fn lifecycle<T>(
        &self,
        call: impl FnOnce(Reply<T>) -> LifecycleCall,
    ) -> Result<T, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.send_utility_unbounded(Input::Utility(crate::input::Utility::Lifecycle(call(tx))))?;
        rx.await.map_err(|_| Stopped)
    }

    /// A lifecycle operation the core may refuse or cancel.
    async fn operation(
        &self,
        call: impl FnOnce(OpReply) -> LifecycleCall,
    ) -> Result<(), LifecycleCallError> {
        Ok(self.lifecycle(call).await??)
    }
}

/// A reload from disk, its files opened and their config checked against the model's.
struct Reload {
    preparer: Arc<dyn WeightPreparer>,
    files: WeightFiles,
    /// Every parameter the model takes: a reload is complete.
    expected: Vec<(String, Vec<usize>)>,
    version: Option<String>,
    /// When the call began (for `prepare_seconds`).
    started: Instant,
}

/// Tells the engine, when dropped armed, that the weights it lent to a reload in place are
/// lost: the read failed, or its caller stopped waiting (the read itself runs on and drops
/// what it wrote). Without it, an engine whose weights never came back would refuse resume
/// for good.
struct LostIfDropped(Option<EngineHandle>);

impl LostIfDropped {
    /// The weights are on their way back.
    fn defuse(mut self) {
        self.0 = None;
    }
}

impl Drop for LostIfDropped {
    fn drop(&mut self) {
        if let Some(engine) = self.0.take() {
            let (reply, _) = oneshot::channel();
            let call = LifecycleCall::LoseWeights(reply);
            // A stopped engine has nothing to tell.
            let _ = engine
                .send_utility_unbounded(Input::Utility(crate::input::Utility::Lifecycle(call)));
        }
    }
}

/// Runs `f` on tokio's blocking pool (file reads, tensor conversion). `Stopped` if the pool
/// is gone (the runtime is shutting down) or `f` panicked.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Stopped> {
    tokio::task::spawn_blocking(f).await.map_err(|_| Stopped)
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
        .map_err(|_| WeightUpdateError::Stopped(Stopped));
    if let Some(e) = body_error {
        return Err(WeightPushError::Body(e));
    }
    Ok(read?.map_err(WeightUpdateError::Weights)?)
}

#[cfg(test)]
mod tests {
    use ferry_core::{LifecycleError, SchedulerConfig};
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
        };
        let engine = spawn(config, Box::new(model), None).unwrap();
        let lent = engine.lifecycle(LifecycleCall::LendWeights).await.unwrap();
        assert!(lent.is_none(), "running: nothing is lent");

        engine.pause(PauseMode::Keep, false).await.unwrap();
        let lent = engine.lifecycle(LifecycleCall::LendWeights).await.unwrap();
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

        // The reload gives up: the guard tells the engine.
        drop(LostIfDropped(Some(engine.clone())));
        drop(lent);
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
            prompt: vec![5, 6, 7],
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
