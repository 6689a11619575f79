//! A weight upload in buckets: the trainer sends its state dict as several safetensors bodies
//! (buckets) as it produces them, each read as it arrives straight into staged buffers
//! ([`SafetensorsPush`]), then one commit installs every staged tensor at once.
//!
//! Sans-IO, as the push: [`WeightUpload::bucket`] gives the reader of the next bucket,
//! [`WeightUpload::stage`] keeps what it read, [`WeightUpload::finish`] makes the one update
//! to install. A bucket may not repeat a tensor an earlier bucket staged (the upload would
//! otherwise hold two versions of it); a bucket that fails leaves the upload as it was, and
//! dropping the upload frees everything staged.
//!
//! Memory: the staged buffers are the only copy of the pushed tensors (in the executor's
//! layout), so an upload of every parameter holds the running weights plus the new ones; the
//! commit moves the staged matrices into place ([`WeightPreparer::merge`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::weights::push::SafetensorsPush;
use crate::weights::update::{PreparedWeights, WeightError, WeightPreparer};

/// What one staged bucket held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketInfo {
    pub n_tensors: usize,
    pub n_bytes: usize,
}

/// An upload being staged (see the module docs).
pub struct WeightUpload {
    preparer: Arc<dyn WeightPreparer>,
    staged: Vec<PreparedWeights>,
    names: BTreeSet<String>,
}

impl std::fmt::Debug for WeightUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightUpload")
            .field("n_buckets", &self.staged.len())
            .field("n_tensors", &self.names.len())
            .field("n_bytes", &self.n_bytes())
            .finish_non_exhaustive()
    }
}

impl WeightUpload {
    pub fn new(preparer: Arc<dyn WeightPreparer>) -> Self {
        Self {
            preparer,
            staged: Vec::new(),
            names: BTreeSet::new(),
        }
    }

    /// The reader of the next bucket: it refuses a tensor already staged.
    pub fn bucket(&self) -> SafetensorsPush {
        SafetensorsPush::excluding(self.preparer.clone(), self.names.clone())
    }

    /// Keeps a bucket that was read to its end (the reader's errors are the bucket's).
    pub fn stage(&mut self, bucket: SafetensorsPush) -> Result<BucketInfo, WeightError> {
        let (weights, names) = bucket.finish_named()?;
        if let Some(name) = names.iter().find(|n| self.names.contains(*n)) {
            return Err(WeightError::Duplicate { name: name.clone() });
        }
        let info = BucketInfo {
            n_tensors: weights.n_tensors,
            n_bytes: weights.n_bytes,
        };
        self.names.extend(names);
        self.staged.push(weights);
        Ok(info)
    }

    pub fn n_buckets(&self) -> usize {
        self.staged.len()
    }

    pub fn n_tensors(&self) -> usize {
        self.names.len()
    }

    /// Bytes staged, in the executor's layout.
    pub fn n_bytes(&self) -> usize {
        self.staged.iter().map(|w| w.n_bytes).sum()
    }

    /// The one update every staged bucket makes, ready to install.
    pub fn finish(self) -> Result<PreparedWeights, WeightError> {
        self.preparer.merge(self.staged)
    }

    /// [`WeightUpload::finish`] for weights that need a complete set (sleep level 2 dropped
    /// them): an upload missing a parameter is refused naming the first, and frees what it
    /// staged.
    pub fn finish_complete(self) -> Result<PreparedWeights, WeightError> {
        let absent: Vec<String> = self
            .preparer
            .expected()
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| !self.names.contains(name))
            .collect();
        match absent.first() {
            Some(first) => Err(WeightError::Incomplete {
                n_missing: absent.len(),
                first: first.clone(),
            }),
            None => self.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use safetensors::Dtype;

    use super::*;
    use crate::weights::push::tests::{bits_of, update_of};
    use crate::weights::random::{random_weights, small_config};
    use crate::{LlamaPreparer, WeightStore};

    fn body(store: &WeightStore) -> Vec<u8> {
        let raw: Vec<(String, Vec<usize>, Vec<u8>)> = store
            .tensors
            .iter()
            .map(|(name, t)| {
                let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                (name.clone(), t.shape.clone(), bytes)
            })
            .collect();
        let views = raw.iter().map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes)
                .expect("a view of the tensor");
            (name.clone(), view)
        });
        safetensors::serialize(views, None).expect("serialized")
    }

    fn upload() -> WeightUpload {
        WeightUpload::new(Arc::new(LlamaPreparer::new(small_config())))
    }

    fn send(upload: &mut WeightUpload, store: &WeightStore) -> Result<BucketInfo, WeightError> {
        let mut bucket = upload.bucket();
        for piece in body(store).chunks(1000) {
            bucket.feed(piece)?;
        }
        upload.stage(bucket)
    }

    /// The weights split into `n` buckets by name.
    fn buckets(all: &WeightStore, n: usize) -> Vec<WeightStore> {
        let mut out = vec![WeightStore::default(); n];
        for (i, (name, t)) in all.tensors.iter().enumerate() {
            out[i % n].insert(name, t.clone());
        }
        out
    }

    /// Every float of a full update, buffer by buffer, as bits.
    fn bits(p: PreparedWeights) -> Vec<u32> {
        bits_of(update_of(p))
    }

    #[test]
    fn buckets_holding_every_parameter_make_the_weights_of_one_body() {
        let all = random_weights(&small_config(), 7);
        let mut one = upload();
        send(&mut one, &all).unwrap();
        let want = bits(one.finish().unwrap());
        for n in [2, 3, 5] {
            let mut up = upload();
            let mut total = 0;
            for b in buckets(&all, n) {
                total += send(&mut up, &b).unwrap().n_tensors;
            }
            assert_eq!((up.n_buckets(), up.n_tensors()), (n, total));
            let merged = up.finish().unwrap();
            assert!(merged.complete, "{n} buckets");
            assert_eq!(merged.n_tensors, all.tensors.len());
            assert!(bits(merged) == want, "{n} buckets give other weights");
        }
    }

    #[test]
    fn buckets_of_some_parameters_make_a_partial_update() {
        let all = random_weights(&small_config(), 8);
        let parts = buckets(&all, 4);
        let mut up = upload();
        send(&mut up, &parts[0]).unwrap();
        send(&mut up, &parts[2]).unwrap();
        let merged = up.finish().unwrap();
        assert!(!merged.complete);
        assert_eq!(
            merged.n_tensors,
            parts[0].tensors.len() + parts[2].tensors.len()
        );
    }

    #[test]
    fn a_tensor_sent_twice_is_refused_and_the_upload_keeps_what_it_had() {
        let all = random_weights(&small_config(), 9);
        let parts = buckets(&all, 2);
        let mut up = upload();
        send(&mut up, &parts[0]).unwrap();
        let mut again = parts[1].clone();
        let (name, t) = parts[0].tensors.iter().next().unwrap();
        again.insert(name, t.clone());
        match send(&mut up, &again) {
            Err(WeightError::Duplicate { name: got }) => assert_eq!(&got, name),
            other => panic!("expected the duplicate refused, got {other:?}"),
        }
        assert_eq!(up.n_buckets(), 1);
        send(&mut up, &parts[1]).unwrap();
        assert!(up.finish().unwrap().complete);
    }

    #[test]
    fn a_complete_set_is_required_only_where_asked_and_the_refusal_names_a_missing_tensor() {
        let all = random_weights(&small_config(), 10);
        let parts = buckets(&all, 3);
        let mut up = upload();
        send(&mut up, &parts[0]).unwrap();
        send(&mut up, &parts[1]).unwrap();
        let first_missing = parts[2].tensors.keys().next().unwrap().clone();
        match up.finish_complete() {
            Err(WeightError::Incomplete { n_missing, first }) => {
                assert_eq!((n_missing, first), (parts[2].tensors.len(), first_missing));
            }
            other => panic!("expected an incomplete upload refused, got {other:?}"),
        }
        let mut up = upload();
        for b in &parts {
            send(&mut up, b).unwrap();
        }
        assert!(up.finish_complete().unwrap().complete);
    }
}
