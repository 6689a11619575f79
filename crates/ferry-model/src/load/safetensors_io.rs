//! Safetensors weights of a Hugging Face folder: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; F32, F16 and BF16 become f32, or
//! stay as they are where the destination keeps matrices in their stored precision.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::{read_chunks, LoadError, Progress, TensorDest};
use crate::dtype::WeightDtype;

const SINGLE_FILE: &str = "model.safetensors";
/// Bytes of the header's length prefix.
const HEADER_LEN_BYTES: usize = 8;
const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor the model needs: Hugging Face name and shape.
type Wanted = (String, Vec<usize>);
/// The tensors each file holds, each with its index in the expected list.
type ByFile<'a> = BTreeMap<PathBuf, Vec<(usize, &'a Wanted)>>;

/// Reads exactly the `expected` tensors (name, shape) from the folder's safetensors files,
/// each converted straight into `dest` (as tensor `idx` of `expected`).
pub(crate) fn read_weights(
    dir: &Path,
    expected: &[Wanted],
    dest: &mut dyn TensorDest,
    progress: Progress<'_>,
) -> Result<(), LoadError> {
    let by_file = assign_files(dir, expected)?;
    let mut n_done = 0;
    let mut tensor_done = |name: &str| {
        n_done += 1;
        progress(n_done, expected.len(), name);
    };
    for (file, wanted) in by_file {
        read_file(&file, &wanted, dest, &mut tensor_done)?;
    }
    Ok(())
}

/// Which file holds each expected tensor (with its index in `expected`): all in
/// `model.safetensors`, or as the index says.
fn assign_files<'a>(dir: &Path, expected: &'a [Wanted]) -> Result<ByFile<'a>, LoadError> {
    let index_path = dir.join(INDEX_FILE);
    let single_path = dir.join(SINGLE_FILE);
    let mut by_file: ByFile<'a> = BTreeMap::new();
    if index_path.exists() {
        let index = super::config_json::read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                LoadError::field(&index_path, "weight_map", "missing or not an object")
            })?;
        for (idx, item) in expected.iter().enumerate() {
            let file = map.get(&item.0).and_then(|f| f.as_str()).ok_or_else(|| {
                LoadError::MissingTensor {
                    path: index_path.clone(),
                    tensor: item.0.clone(),
                }
            })?;
            by_file.entry(dir.join(file)).or_default().push((idx, item));
        }
    } else if single_path.exists() {
        by_file.insert(single_path, expected.iter().enumerate().collect());
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
    wanted: &[(usize, &Wanted)],
    dest: &mut dyn TensorDest,
    tensor_done: &mut dyn FnMut(&str),
) -> Result<(), LoadError> {
    let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: the mapping is read-only and lives only for this function. Another process
    // truncating the file while we read it would be undefined behaviour; model files are not
    // rewritten in place while a server loads them, and a copy would double peak memory.
    // Only the header is read through it (validating it touches no tensor data); tensors
    // are read with `read_chunks`, so their pages stay out of resident memory.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    let (n_header, header) = SafeTensors::read_metadata(&mmap)
        .map_err(|e| LoadError::invalid(path, format!("invalid safetensors file: {e}")))?;
    let data_start = (HEADER_LEN_BYTES + n_header) as u64;
    for &(idx, (name, shape)) in wanted {
        let info = header.info(name).ok_or_else(|| LoadError::MissingTensor {
            path: path.to_owned(),
            tensor: name.clone(),
        })?;
        if info.shape != *shape {
            return Err(LoadError::TensorShape {
                path: path.to_owned(),
                tensor: name.clone(),
                expected: shape.clone(),
                actual: info.shape.clone(),
            });
        }
        let Some(width) = f32_source_width(info.dtype) else {
            return Err(LoadError::UnsupportedDtype {
                path: path.to_owned(),
                tensor: name.clone(),
                dtype: format!("{:?} (supported: F32, F16, BF16)", info.dtype),
            });
        };
        // The shape matches and the header was validated: the bytes are exactly its elements.
        let (start, end) = info.data_offsets;
        let offset = data_start + start as u64;
        let dtype = WeightDtype::from_safetensors(info.dtype).filter(|_| shape.len() == 2);
        if let Some(out) = dtype.and_then(|d| dest.stored_mut(idx, name, shape, d)) {
            read_chunks(&file, path, offset, end - start, 1, |at, bytes| {
                out[at..at + bytes.len()].copy_from_slice(bytes);
            })?;
            tensor_done(name);
            continue;
        }
        let out = dest.tensor_mut(idx, name, shape);
        read_chunks(&file, path, offset, end - start, width, |at, bytes| {
            decode_into(
                info.dtype,
                bytes,
                &mut out[at / width..(at + bytes.len()) / width],
            );
        })?;
        tensor_done(name);
    }
    Ok(())
}

/// Little-endian F32/F16/BF16 bytes → f32; `None` for other dtypes. The bytes of a mapped
/// file need not be aligned, so values are decoded from byte chunks, not cast in place.
pub(crate) fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let width = f32_source_width(dtype)?;
    let mut out = vec![0.0; bytes.len() / width];
    decode_into(dtype, &bytes[..out.len() * width], &mut out);
    Some(out)
}

/// Bytes per element of a dtype that converts to f32 (F32, F16, BF16); `None` for others.
pub(crate) fn f32_source_width(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        _ => None,
    }
}

/// Decodes little-endian `dtype` values from `bytes` into `out`, one per element
/// (`bytes.len()` is `out.len()` times the dtype's width; a dtype [`f32_source_width`]
/// refuses writes nothing).
pub(crate) fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {}
    }
}
