//! Safetensors weights of a Hugging Face folder: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; F32, F16 and BF16 become f32.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::{LoadError, Progress};
use crate::{Tensor, WeightStore};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor the model needs: Hugging Face name and shape.
type Wanted = (String, Vec<usize>);

/// Reads exactly the `expected` tensors (name, shape) from the folder's safetensors files.
pub(crate) fn read_weights(
    dir: &Path,
    expected: &[Wanted],
    progress: Progress<'_>,
) -> Result<WeightStore, LoadError> {
    let by_file = assign_files(dir, expected)?;
    let mut store = WeightStore::default();
    let mut n_done = 0;
    let mut tensor_done = |name: &str| {
        n_done += 1;
        progress(n_done, expected.len(), name);
    };
    for (file, wanted) in by_file {
        read_file(&file, &wanted, &mut store, &mut tensor_done)?;
    }
    Ok(store)
}

/// Which file holds each expected tensor: all in `model.safetensors`, or as the index says.
fn assign_files<'a>(
    dir: &Path,
    expected: &'a [Wanted],
) -> Result<BTreeMap<PathBuf, Vec<&'a Wanted>>, LoadError> {
    let index_path = dir.join(INDEX_FILE);
    let single_path = dir.join(SINGLE_FILE);
    let mut by_file: BTreeMap<PathBuf, Vec<_>> = BTreeMap::new();
    if index_path.exists() {
        let index = super::config_json::read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                LoadError::field(&index_path, "weight_map", "missing or not an object")
            })?;
        for item in expected {
            let file = map.get(&item.0).and_then(|f| f.as_str()).ok_or_else(|| {
                LoadError::MissingTensor {
                    path: index_path.clone(),
                    tensor: item.0.clone(),
                }
            })?;
            by_file.entry(dir.join(file)).or_default().push(item);
        }
    } else if single_path.exists() {
        by_file.insert(single_path, expected.iter().collect());
    } else {
        return Err(LoadError::invalid(
            dir,
            format!("no {SINGLE_FILE} or {INDEX_FILE} in the model folder"),
        ));
    }
    Ok(by_file)
}

fn read_file(
    path: &Path,
    wanted: &[&Wanted],
    store: &mut WeightStore,
    tensor_done: &mut dyn FnMut(&str),
) -> Result<(), LoadError> {
    let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: the mapping is read-only and lives only for this function. Another process
    // truncating the file while we read it would be undefined behaviour; model files are not
    // rewritten in place while a server loads them, and a copy would double peak memory.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    let tensors = SafeTensors::deserialize(&mmap)
        .map_err(|e| LoadError::invalid(path, format!("invalid safetensors file: {e}")))?;
    for (name, shape) in wanted {
        let view = tensors.tensor(name).map_err(|_| LoadError::MissingTensor {
            path: path.to_owned(),
            tensor: name.clone(),
        })?;
        if view.shape() != shape.as_slice() {
            return Err(LoadError::TensorShape {
                path: path.to_owned(),
                tensor: name.clone(),
                expected: shape.clone(),
                actual: view.shape().to_vec(),
            });
        }
        let data =
            to_f32(view.dtype(), view.data()).ok_or_else(|| LoadError::UnsupportedDtype {
                path: path.to_owned(),
                tensor: name.clone(),
                dtype: format!("{:?} (supported: F32, F16, BF16)", view.dtype()),
            })?;
        store.insert(name.clone(), Tensor::new(shape.clone(), data));
        tensor_done(name);
    }
    Ok(())
}

/// Little-endian F32/F16/BF16 bytes → f32; `None` for other dtypes. The bytes of a mapped
/// file need not be aligned, so values are decoded from byte chunks, not cast in place.
pub(crate) fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}
