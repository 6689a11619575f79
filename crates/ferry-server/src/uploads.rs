//! The server's one open bucketed weight upload ([`Uploads`], in `AppState`): its stage, the
//! call that holds it (`Claim`: ended if that call is dropped midway) and how it ends. The
//! routes that drive it, and what the stages mean, are `admin/upload.rs`.

use std::sync::Mutex;
use std::time::Instant;

use ferry_engine::{PreparedWeights, WeightUpload};

use crate::error::ApiError;

/// The server's one open upload, if any.
#[derive(Debug, Default)]
pub struct Uploads {
    open: Mutex<Option<Open>>,
}

#[derive(Debug)]
pub(crate) struct Open {
    pub(crate) id: String,
    /// Set at the start; a commit's own version wins.
    pub(crate) version: Option<String>,
    pub(crate) stage: Stage,
    pub(crate) n_buckets: usize,
    /// The last call on it; idle past the timeout, it is discarded.
    pub(crate) touched: Instant,
}

/// An upload taken out of its stage by a call (`Uploads::take`).
#[derive(Debug)]
pub(crate) struct Taken {
    pub(crate) stage: Stage,
    pub(crate) version: Option<String>,
    pub(crate) n_buckets: usize,
}

#[derive(Debug)]
pub(crate) enum Stage {
    /// Taking buckets.
    Staging(WeightUpload),
    /// A call is reading a bucket, preparing or committing: the upload is in its hands.
    Busy(&'static str),
    /// Joined and checked; waiting for the commit.
    Prepared(PreparedWeights),
}

impl Uploads {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Option<Open>> {
        // A panic while holding the lock leaves nothing half-written: each critical
        // section swaps whole values.
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes the upload `id` out of its stage for a call (`what`): 404 when it is not the
    /// open upload, 409 while another call holds it.
    pub(crate) fn take(&self, id: &str, what: &'static str) -> Result<Taken, ApiError> {
        let mut open = self.lock();
        let upload = match open.as_mut() {
            Some(u) if u.id == id => u,
            _ => return Err(unknown(id)),
        };
        if let Stage::Busy(doing) = upload.stage {
            return Err(ApiError::conflict(format!(
                "upload `{id}` is {doing}; send one call at a time"
            )));
        }
        upload.touched = Instant::now();
        Ok(Taken {
            stage: std::mem::replace(&mut upload.stage, Stage::Busy(what)),
            version: upload.version.clone(),
            n_buckets: upload.n_buckets,
        })
    }

    /// Ends the upload `id` after `error` and frees what it staged (`staged`, which a call
    /// held outside it, too); the error says so.
    pub(crate) fn discard_after(
        &self,
        id: &str,
        staged: Option<Stage>,
        mut error: ApiError,
    ) -> ApiError {
        let open = self.end(id);
        // What it staged may be most of a model: freed off the async workers.
        tokio::task::spawn_blocking(move || drop((open, staged)));
        error.message = format!("{}; upload `{id}` was discarded", error.message);
        error
    }

    /// Puts the upload back after a call, in `stage`.
    pub(crate) fn put(&self, id: &str, stage: Stage, bucket: bool) {
        let mut open = self.lock();
        if let Some(u) = open.as_mut().filter(|u| u.id == id) {
            u.stage = stage;
            u.touched = Instant::now();
            u.n_buckets += usize::from(bucket);
        }
    }

    /// Ends the upload `id` (committed, failed or discarded); returns what it staged.
    pub(crate) fn end(&self, id: &str) -> Option<Open> {
        let mut open = self.lock();
        if open.as_ref().is_some_and(|u| u.id == id) {
            open.take()
        } else {
            None
        }
    }
}

/// The upload a call took out of its stage (`Uploads::take`), ended if the call is dropped
/// before it puts the upload back or ends it (a client gone mid-call: hyper drops the
/// handler), so no upload stays busy forever.
pub(crate) struct Claim<'a> {
    uploads: &'a Uploads,
    id: &'a str,
    armed: bool,
}

impl<'a> Claim<'a> {
    pub(crate) fn new(uploads: &'a Uploads, id: &'a str) -> Self {
        Self {
            uploads,
            id,
            armed: true,
        }
    }

    /// The call put the upload back or ended it itself.
    pub(crate) fn release(mut self) {
        self.armed = false;
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::warn!(upload_id = %self.id, "weight upload discarded: its call ended midway");
            free(self.uploads.end(self.id));
        }
    }
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(
        Some("upload_id"),
        format!(
            "no open weight upload `{id}` (it was committed, discarded after an error, or \
             expired; start another with POST /weight_uploads)"
        ),
    )
}

/// Frees staged weights off the async workers: they may be most of a model.
pub(crate) fn free(open: Option<Open>) {
    if let Some(open) = open {
        tokio::task::spawn_blocking(move || drop(open));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(id: &str) -> Uploads {
        let uploads = Uploads::default();
        *uploads.lock() = Some(Open {
            id: id.to_owned(),
            version: None,
            stage: Stage::Busy("receiving a bucket"),
            n_buckets: 0,
            touched: Instant::now(),
        });
        uploads
    }

    /// A call dropped midway (its client gone) ends the upload it held; one that finished
    /// leaves it to whoever put it back.
    #[tokio::test]
    async fn a_claim_dropped_midway_ends_the_upload() {
        let uploads = open("u1");
        drop(Claim::new(&uploads, "u1"));
        assert!(uploads.lock().is_none());
        let uploads = open("u2");
        Claim::new(&uploads, "u2").release();
        assert!(uploads.lock().is_some());
        // A busy upload refuses a second call with a 409, and another id is a 404.
        assert_eq!(uploads.take("u2", "preparing").unwrap_err().status, 409);
        assert_eq!(uploads.take("u3", "preparing").unwrap_err().status, 404);
    }
}
