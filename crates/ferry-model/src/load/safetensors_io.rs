//! Safetensors weights of a Hugging Face folder: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; F32, F16 and BF16 become f32, or
//! stay as they are where the destination keeps matrices in their stored precision.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use safetensors::{Dtype, SafeTensors};

use super::{read_ahead, read_chunks, read_exact_at, LoadError, Progress, TensorDest};
use crate::dtype::{decode_into, f32_source_width, WeightDtype};

const SINGLE_FILE: &str = "model.safetensors";
/// Bytes of the header's length prefix.
const HEADER_LEN_BYTES: usize = 8;
const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor the model needs: Hugging Face name and shape.
type Wanted = (String, Vec<usize>);

/// Where each parameter lies in a checkpoint of transformers 5's fused MoE layout: part
/// name → (fused tensor's name, its shape, the part's element offset in it); empty for a
/// dense model ([`crate::config::fused_parts`]).
#[derive(Debug, Default)]
pub(crate) struct FusedMap {
    by_part: BTreeMap<String, (String, Vec<usize>, usize)>,
}

impl FusedMap {
    pub(crate) fn of(config: &crate::LlamaConfig) -> Self {
        let mut by_part = BTreeMap::new();
        for l in 0..config.num_hidden_layers {
            for param in crate::config::FUSED_PARAMS {
                let name = format!("model.layers.{l}.{param}");
                if let Some((shape, parts)) = crate::config::fused_parts(config, &name) {
                    for part in parts {
                        by_part.insert(part.name, (name.clone(), shape.clone(), part.offset));
                    }
                }
            }
        }
        Self { by_part }
    }

    /// The fused tensor holding `part`, its shape and the part's element offset.
    fn source(&self, part: &str) -> Option<&(String, Vec<usize>, usize)> {
        self.by_part.get(part)
    }
}
/// The tensors each file holds, each with its index in the expected list.
type ByFile<'a> = BTreeMap<PathBuf, Vec<(usize, &'a Wanted)>>;

/// Reads exactly the `expected` tensors (name, shape) from the folder's safetensors files,
/// each converted straight into `dest` (as tensor `idx` of `expected`), after checking that
/// the files hold no tensor beyond them ([`check_unused`]).
pub(crate) fn read_weights(
    dir: &Path,
    expected: &[Wanted],
    fused: &FusedMap,
    dest: &mut dyn TensorDest,
    progress: Progress<'_>,
) -> Result<(), LoadError> {
    read_weights_as(dir, expected, fused, dest, progress, Readers::Auto)
}

/// [`read_weights`], each file read as `readers` says.
fn read_weights_as(
    dir: &Path,
    expected: &[Wanted],
    fused: &FusedMap,
    dest: &mut dyn TensorDest,
    progress: Progress<'_>,
    readers: Readers,
) -> Result<(), LoadError> {
    let (by_file, all_files) = assign_files(dir, expected, fused)?;
    check_unused(&all_files, expected, fused)?;
    let mut n_done = 0;
    let mut tensor_done = |name: &str| {
        n_done += 1;
        progress(n_done, expected.len(), name);
    };
    for (file, wanted) in by_file {
        read_file(&file, &wanted, fused, dest, &mut tensor_done, readers)?;
    }
    Ok(())
}

/// How a file's tensors are read.
#[derive(Clone, Copy, Debug)]
enum Readers {
    /// On several threads when every page of the file is in the page cache
    /// ([`read_cached`]), else on one, with the disk read a window ahead ([`read_planned`]).
    Auto,
    /// On one thread as if the file were not cached (tests).
    #[cfg(test)]
    One,
    /// On several threads as if it were, in pieces of the given size (tests).
    #[cfg(test)]
    Cached { readers: usize, piece_bytes: usize },
}

/// Which file holds each expected tensor (with its index in `expected`): all in
/// `model.safetensors`, or as the index says; and every file of the checkpoint (the index
/// may name files holding no expected tensor).
fn assign_files<'a>(
    dir: &Path,
    expected: &'a [Wanted],
    fused: &FusedMap,
) -> Result<(ByFile<'a>, BTreeSet<PathBuf>), LoadError> {
    let index_path = dir.join(INDEX_FILE);
    let single_path = dir.join(SINGLE_FILE);
    let mut by_file: ByFile<'a> = BTreeMap::new();
    let mut all_files = BTreeSet::new();
    if index_path.exists() {
        let index = super::config_json::read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                LoadError::field(&index_path, "weight_map", "missing or not an object")
            })?;
        for file in map.values() {
            let file = file.as_str().ok_or_else(|| {
                LoadError::field(&index_path, "weight_map", "a file name is not a string")
            })?;
            all_files.insert(dir.join(file));
        }
        for (idx, item) in expected.iter().enumerate() {
            let file = map.get(&item.0).or_else(|| {
                let (name, _, _) = fused.source(&item.0)?;
                map.get(name)
            });
            let file = file
                .and_then(|f| f.as_str())
                .ok_or_else(|| LoadError::MissingTensor {
                    path: index_path.clone(),
                    tensor: item.0.clone(),
                })?;
            by_file.entry(dir.join(file)).or_default().push((idx, item));
        }
    } else if single_path.exists() {
        all_files.insert(single_path.clone());
        by_file.insert(single_path, expected.iter().enumerate().collect());
    } else {
        return Err(LoadError::invalid(
            dir,
            format!("no {SINGLE_FILE} or {INDEX_FILE} in the model folder"),
        ));
    }
    Ok((by_file, all_files))
}

/// Refuses a checkpoint holding a tensor outside `expected`, naming it and its file, unless
/// [`super::is_ignorable`] allows it, or it is the `lm_head.weight` of a tied model that
/// equals the embedding (a checkpoint saved without de-duplicating the tie). A tied model's
/// head that differs is refused: the config says the head is the embedding, the file says
/// otherwise, and either choice could be the wrong answer.
fn check_unused(
    files: &BTreeSet<PathBuf>,
    expected: &[Wanted],
    fused: &FusedMap,
) -> Result<(), LoadError> {
    let mut wanted: std::collections::HashSet<&str> =
        expected.iter().map(|(name, _)| name.as_str()).collect();
    let tied = !wanted.contains(HEAD);
    let mut headers = Vec::new();
    for path in files {
        let (_, mmap) = map_file(path)?;
        let (_, header) = read_header(&mmap, path)?;
        let mut names = header.offset_keys();
        names.sort();
        headers.push((path, names));
    }
    // A fused tensor is read for its parts, unless the checkpoint holds a part on its own
    // too: then two tensors say what one parameter is, and neither is taken.
    let held: BTreeSet<&str> = headers
        .iter()
        .flat_map(|(_, names)| names.iter().map(String::as_str))
        .collect();
    let fused_names: BTreeSet<&str> = expected
        .iter()
        .filter(|(name, _)| !held.contains(name.as_str()))
        .filter_map(|(name, _)| fused.source(name).map(|(f, _, _)| f.as_str()))
        .collect();
    wanted.extend(&fused_names);
    for (path, names) in &headers {
        for name in names.iter().cloned() {
            if wanted.contains(name.as_str()) || super::is_ignorable(&name) {
                continue;
            }
            let message = if name == HEAD && tied {
                if head_equals_embedding(files)? {
                    continue;
                }
                format!(
                    "the config ties the head to the embeddings (`tie_word_embeddings`), but \
                     this {HEAD} differs from {EMBED}"
                )
            } else {
                "the forward of this config does not read it (see docs/model.md)".to_owned()
            };
            return Err(LoadError::UnusedTensor {
                path: path.to_path_buf(),
                tensor: name,
                message,
            });
        }
    }
    Ok(())
}

const HEAD: &str = "lm_head.weight";
const EMBED: &str = "model.embed_tokens.weight";
/// Elements compared at a time by [`head_equals_embedding`].
const COMPARE_ELEMS: usize = 1 << 18;

/// Whether `lm_head.weight` holds the same values (as f32, bit for bit) and shape as
/// `model.embed_tokens.weight`, compared in chunks so no full copy of either is made.
fn head_equals_embedding(files: &BTreeSet<PathBuf>) -> Result<bool, LoadError> {
    let (Some(head), Some(embed)) = (locate(files, HEAD)?, locate(files, EMBED)?) else {
        return Ok(false);
    };
    if head.shape != embed.shape {
        return Ok(false);
    }
    let n: usize = head.shape.iter().product();
    let mut start = 0;
    while start < n {
        let len = COMPARE_ELEMS.min(n - start);
        let (a, b) = (head.read_f32(start, len)?, embed.read_f32(start, len)?);
        if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
            return Ok(false);
        }
        start += len;
    }
    Ok(true)
}

/// A tensor found in one of a checkpoint's files.
struct Located {
    file: std::fs::File,
    path: PathBuf,
    /// Byte offset of its data in the file.
    offset: u64,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// The tensor `name` in the first of `files` holding it.
fn locate(files: &BTreeSet<PathBuf>, name: &str) -> Result<Option<Located>, LoadError> {
    for path in files {
        let (file, mmap) = map_file(path)?;
        let (n_header, header) = read_header(&mmap, path)?;
        if let Some(info) = header.info(name) {
            return Ok(Some(Located {
                offset: (HEADER_LEN_BYTES + n_header + info.data_offsets.0) as u64,
                dtype: info.dtype,
                shape: info.shape.clone(),
                file,
                path: path.clone(),
            }));
        }
    }
    Ok(None)
}

impl Located {
    /// Elements `start..start + len` as f32.
    fn read_f32(&self, start: usize, len: usize) -> Result<Vec<f32>, LoadError> {
        let width = f32_source_width(self.dtype).ok_or_else(|| LoadError::UnsupportedDtype {
            path: self.path.clone(),
            tensor: HEAD.to_owned(),
            dtype: format!("{:?} (supported: F32, F16, BF16)", self.dtype),
        })?;
        let mut out = vec![0.0; len];
        let offset = self.offset + (start * width) as u64;
        read_chunks(
            &self.file,
            &self.path,
            offset,
            len * width,
            width,
            |at, bytes| {
                decode_into(
                    self.dtype,
                    bytes,
                    &mut out[at / width..(at + bytes.len()) / width],
                );
            },
        )?;
        Ok(out)
    }
}

/// A safetensors file opened and memory-mapped (only its header is read through the map).
fn map_file(path: &Path) -> Result<(std::fs::File, memmap2::Mmap), LoadError> {
    let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: as in `read_file`: a read-only mapping, read only for its header.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    Ok((file, mmap))
}

/// The header's length and the header of a mapped safetensors file.
fn read_header(
    mmap: &[u8],
    path: &Path,
) -> Result<(usize, safetensors::tensor::Metadata), LoadError> {
    SafeTensors::read_metadata(mmap)
        .map_err(|e| LoadError::invalid(path, format!("invalid safetensors file: {e}")))
}

/// A tensor of a file to read: which of `expected` it is, and where its bytes lie.
struct Planned<'a> {
    idx: usize,
    name: &'a str,
    shape: &'a [usize],
    dtype: Dtype,
    /// Bytes per element in the file.
    width: usize,
    /// Byte offset of its data in the file, and its length.
    offset: u64,
    n_bytes: usize,
    /// The dtype `dest` keeps it in as stored; `None` when it takes floats. Set by `place`.
    kept: Option<WeightDtype>,
}

impl Planned<'_> {
    /// Asks `dest` for this tensor's place, noting in `kept` whether it keeps the tensor as
    /// stored (a matrix of a dtype the destination keeps) or takes its floats; returns the
    /// place's address and length in bytes, for [`read_ahead::populate`].
    fn place(&mut self, dest: &mut dyn TensorDest) -> (usize, usize) {
        let dtype = WeightDtype::from_safetensors(self.dtype).filter(|_| self.shape.len() == 2);
        if let Some(d) = dtype {
            if let Some(out) = dest.stored_mut(self.idx, self.name, self.shape, d) {
                self.kept = Some(d);
                return (out.as_ptr() as usize, out.len());
            }
        }
        let out = dest.tensor_mut(self.idx, self.name, self.shape);
        (out.as_ptr() as usize, size_of_val(out))
    }

    /// Reads the values from the `at`-th byte of this tensor's data (a whole value's) into
    /// `out`, converted to floats, a chunk at a time.
    fn read_floats(
        &self,
        file: &std::fs::File,
        path: &Path,
        at: usize,
        out: &mut [f32],
    ) -> Result<(), LoadError> {
        let width = self.width;
        let offset = self.offset + at as u64;
        read_chunks(file, path, offset, out.len() * width, width, |at, bytes| {
            let values = at / width..(at + bytes.len()) / width;
            decode_into(self.dtype, bytes, &mut out[values]);
        })
    }
}

/// Reads `wanted` out of one file into `dest`: every tensor checked first (none read before
/// all pass), then read in the file's order: by several readers when the whole file is in
/// the page cache, else by one, with the disk and the destination's pages taken a step ahead
/// of it ([`read_ahead`]).
fn read_file(
    path: &Path,
    wanted: &[(usize, &Wanted)],
    fused: &FusedMap,
    dest: &mut dyn TensorDest,
    tensor_done: &mut dyn FnMut(&str),
    readers: Readers,
) -> Result<(), LoadError> {
    let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: the mapping is read-only and lives only for this function. Another process
    // truncating the file while we read it would be undefined behaviour; model files are not
    // rewritten in place while a server loads them, and a copy would double peak memory.
    // Only the header is read through it (validating it touches no tensor data); tensors
    // are read with `read_chunks`, so their pages stay out of resident memory.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
    let mut plan = plan_file(path, &mmap, wanted, fused)?;
    // In the file's order: the kernel reads ahead of a reader that goes front to back. One
    // that jumps (the model's order, where layer 2 follows layer 1, which the file, sorted by
    // name, keeps apart) read a cold file far less evenly (see `read_ahead`).
    plan.sort_by_key(|p| p.offset);
    // Every tensor's place, fixed before a byte is read (a destination hands the same memory
    // again), so its pages can be taken while earlier tensors are read.
    let ranges: Vec<(usize, usize)> = plan.iter_mut().map(|p| p.place(dest)).collect();
    let cached = match readers {
        Readers::Auto => {
            read_ahead::cached(&mmap).then(|| (read_ahead::cached_readers(), PIECE_BYTES))
        }
        #[cfg(test)]
        Readers::One => None,
        #[cfg(test)]
        Readers::Cached {
            readers,
            piece_bytes,
        } => Some((readers, piece_bytes)),
    };
    if let Some((readers, piece_bytes)) = cached {
        // Nothing to wait for on the disk: the copy and the new pages are the work, shared.
        let places = places(ranges);
        return read_cached(
            &file,
            path,
            &plan,
            &places,
            readers,
            piece_bytes,
            tensor_done,
        );
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| read_ahead::populate(&ranges, &stop));
        let read = read_planned(&file, path, &plan, mmap.len() as u64, dest, tensor_done);
        stop.store(true, Ordering::Relaxed);
        read
    })
}

/// Every tensor of `wanted` checked against the header of `path` (mapped as `mmap`): there,
/// of its shape and a dtype the loader reads. The header itself is checked whole by
/// `read_metadata`, its data offsets against the file's length too, so a plan that passes
/// reads only bytes the file holds.
fn plan_file<'a>(
    path: &Path,
    mmap: &[u8],
    wanted: &[(usize, &'a Wanted)],
    fused: &FusedMap,
) -> Result<Vec<Planned<'a>>, LoadError> {
    let (n_header, header) = SafeTensors::read_metadata(mmap)
        .map_err(|e| LoadError::invalid(path, format!("invalid safetensors file: {e}")))?;
    let data_start = (HEADER_LEN_BYTES + n_header) as u64;
    let mut plan = Vec::with_capacity(wanted.len());
    for &(idx, (name, shape)) in wanted {
        // The tensor itself, or the fused tensor holding it (its shape checked, and the
        // part's elements from its offset).
        let (source, source_shape, elem_offset) = match (header.info(name), fused.source(name)) {
            (None, Some((fused_name, fused_shape, offset))) => (fused_name, fused_shape, *offset),
            _ => (name, shape, 0),
        };
        let info = header
            .info(source)
            .ok_or_else(|| LoadError::MissingTensor {
                path: path.to_owned(),
                tensor: name.clone(),
            })?;
        if info.shape != *source_shape {
            return Err(LoadError::TensorShape {
                path: path.to_owned(),
                tensor: source.clone(),
                expected: source_shape.clone(),
                actual: info.shape.clone(),
            });
        }
        let Some(width) = f32_source_width(info.dtype) else {
            return Err(LoadError::UnsupportedDtype {
                path: path.to_owned(),
                tensor: source.clone(),
                dtype: format!("{:?} (supported: F32, F16, BF16)", info.dtype),
            });
        };
        // The shape matches and the header was validated: the bytes are exactly its elements.
        let n_bytes = shape.iter().product::<usize>() * width;
        let start = info.data_offsets.0 + elem_offset * width;
        plan.push(Planned {
            idx,
            name,
            shape,
            dtype: info.dtype,
            width,
            offset: data_start + start as u64,
            n_bytes,
            kept: None,
        });
    }
    Ok(plan)
}

/// Checks, reading no tensor, what [`read_weights`] would check before it reads a byte of
/// its tensor data: the files (index, headers, tensors the config does not use), and each
/// expected tensor's shape, dtype and bytes. A read that follows fails only if the disk does
/// or the files change; a reload in place checks first, as it writes over the weights.
pub(crate) fn check_weights(
    dir: &Path,
    expected: &[Wanted],
    fused: &FusedMap,
) -> Result<(), LoadError> {
    let (by_file, all_files) = assign_files(dir, expected, fused)?;
    check_unused(&all_files, expected, fused)?;
    for (path, wanted) in by_file {
        let (_, mmap) = map_file(&path)?;
        plan_file(&path, &mmap, &wanted, fused)?;
    }
    Ok(())
}

/// Reads each planned tensor of `file` (`file_len` bytes) into its place in `dest`, in turn.
fn read_planned(
    file: &std::fs::File,
    path: &Path,
    plan: &[Planned<'_>],
    file_len: u64,
    dest: &mut dyn TensorDest,
    tensor_done: &mut dyn FnMut(&str),
) -> Result<(), LoadError> {
    let mut ahead = read_ahead::ReadAhead::new(file, file_len);
    for p in plan {
        ahead.reading_to(p.offset + p.n_bytes as u64);
        if let Some(d) = p.kept {
            // Kept as stored: read straight into its place, no copy through a buffer.
            let out = dest
                .stored_mut(p.idx, p.name, p.shape, d)
                .expect("a destination answers the place it gave for this tensor again");
            read_exact_at(file, path, p.offset, out)?;
        } else {
            p.read_floats(file, path, 0, dest.tensor_mut(p.idx, p.name, p.shape))?;
        }
        tensor_done(p.name);
    }
    Ok(())
}

/// Bytes a reader of a cached file takes at a time ([`read_cached`]): small enough that the
/// readers finish together, large enough that taking one is no cost.
const PIECE_BYTES: usize = 8 << 20;

/// A planned tensor's place as an address range, learnt from the destination before any
/// byte is read.
#[derive(Clone, Copy)]
struct Place {
    addr: usize,
    n_bytes: usize,
}

/// The places of `ranges` (address, bytes), checked to be apart.
///
/// # Panics
/// When two overlap: a destination broke [`TensorDest`]'s contract (each tensor its own
/// memory), and readers writing side by side would race.
fn places(ranges: Vec<(usize, usize)>) -> Vec<Place> {
    let mut sorted: Vec<(usize, usize)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        assert!(
            pair[0].0 + pair[0].1 <= pair[1].0,
            "a destination gave two tensors overlapping memory"
        );
    }
    ranges
        .into_iter()
        .map(|(addr, n_bytes)| Place { addr, n_bytes })
        .collect()
}

/// Reads the planned tensors of a file in the page cache into their `places` on `readers`
/// threads (this one among them), `piece_bytes` at a time in the file's order, each reader
/// faulting in the pages it writes; reports each tensor done in the file's order. The first
/// error stops every reader and is returned.
fn read_cached(
    file: &std::fs::File,
    path: &Path,
    plan: &[Planned<'_>],
    places: &[Place],
    readers: usize,
    piece_bytes: usize,
    tensor_done: &mut dyn FnMut(&str),
) -> Result<(), LoadError> {
    // (tensor, byte offset in it, bytes): whole values each, `piece_bytes` being a multiple
    // of every width.
    let mut pieces = Vec::new();
    let mut left = Vec::with_capacity(plan.len());
    for (i, p) in plan.iter().enumerate() {
        assert_eq!(piece_bytes % p.width, 0, "pieces of whole values");
        let n = p.n_bytes.div_ceil(piece_bytes);
        pieces.extend((0..n).map(|k| {
            let at = k * piece_bytes;
            (i, at, piece_bytes.min(p.n_bytes - at))
        }));
        left.push(AtomicUsize::new(n));
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    // Reads the next piece; `None` once none is left or a reader has failed.
    let read_one = || -> Option<Result<(), LoadError>> {
        if failed.load(Ordering::Relaxed) {
            return None;
        }
        let &(i, at, n) = pieces.get(next.fetch_add(1, Ordering::Relaxed))?;
        let (p, place) = (&plan[i], places[i]);
        let read = if p.kept.is_some() {
            assert!(at + n <= place.n_bytes, "a piece within its tensor's place");
            // SAFETY: `place` is tensor `i`'s memory in the destination (`n_bytes` long), which
            // the caller holds borrowed exclusively and does not touch while the readers run;
            // places are apart (`places` checked), and pieces of a tensor are apart, so no
            // other reader writes these bytes.
            let out = unsafe { std::slice::from_raw_parts_mut((place.addr + at) as *mut u8, n) };
            read_exact_at(file, path, p.offset + at as u64, out)
        } else {
            let width = p.width;
            assert!(
                (at + n) / width * size_of::<f32>() <= place.n_bytes,
                "a piece within its tensor's place"
            );
            // SAFETY: as above, for a place of f32s (aligned: the destination's own slice).
            let out = unsafe {
                std::slice::from_raw_parts_mut((place.addr as *mut f32).add(at / width), n / width)
            };
            p.read_floats(file, path, at, out)
        };
        if read.is_err() {
            failed.store(true, Ordering::Relaxed);
        } else {
            left[i].fetch_sub(1, Ordering::Release);
        }
        Some(read)
    };
    let mut reported = 0;
    let mut report = |reported: &mut usize| {
        while *reported < plan.len() && left[*reported].load(Ordering::Acquire) == 0 {
            tensor_done(plan[*reported].name);
            *reported += 1;
        }
    };
    let read = std::thread::scope(|scope| {
        let others: Vec<_> = (1..readers)
            .map(|_| {
                scope.spawn(|| {
                    while let Some(read) = read_one() {
                        read?;
                    }
                    Ok(())
                })
            })
            .collect();
        let mut mine = Ok(());
        while let Some(read) = read_one() {
            if read.is_err() {
                mine = read;
                break;
            }
            report(&mut reported);
        }
        let theirs = others.into_iter().map(|h| match h.join() {
            Ok(read) => read,
            Err(panic) => std::panic::resume_unwind(panic),
        });
        // Collected whole: every reader joined before an error is returned.
        std::iter::once(mine)
            .chain(theirs.collect::<Vec<_>>())
            .collect()
    });
    report(&mut reported);
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StoredTensor, WeightStore};

    /// Writes `model.safetensors` holding `tensors` (name, shape, f32 values) in `dir`; the
    /// writer orders them by name.
    fn write(dir: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), b)| {
                let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), b);
                (*name, view.unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(SINGLE_FILE)).unwrap();
    }

    /// Tensors are read in the file's order whatever the order asked, each into its own place;
    /// a destination asked twice for a tensor (to learn its place first) keeps one copy.
    #[test]
    fn reads_in_the_files_order_into_each_tensors_place() {
        let dir = tempfile::tempdir().unwrap();
        let values = |n: usize, base: f32| (0..n).map(|i| base + i as f32).collect::<Vec<_>>();
        let tensors = [
            ("a.weight", vec![3, 4], values(12, 100.0)),
            ("b.weight", vec![5], values(5, 200.0)),
            ("c.weight", vec![2, 8], values(16, 300.0)),
        ];
        write(dir.path(), &tensors);
        // Asked in an order other than the file's.
        let expected: Vec<Wanted> = [2, 0, 1]
            .iter()
            .map(|&i| (tensors[i].0.to_owned(), tensors[i].1.clone()))
            .collect();
        let cached = Readers::Cached {
            readers: 3,
            piece_bytes: 8,
        };
        for (stored, readers) in [false, true]
            .into_iter()
            .flat_map(|s| [Readers::Auto, Readers::One, cached].map(|r| (s, r)))
        {
            let mut store = WeightStore::default();
            let mut order = Vec::new();
            let mut progress = |_: usize, _: usize, name: &str| order.push(name.to_owned());
            let dir = dir.path();
            if stored {
                let dest = &mut super::super::StoredDest(&mut store);
                read_weights_as(
                    dir,
                    &expected,
                    &FusedMap::default(),
                    dest,
                    &mut progress,
                    readers,
                )
                .unwrap();
            } else {
                read_weights_as(
                    dir,
                    &expected,
                    &FusedMap::default(),
                    &mut store,
                    &mut progress,
                    readers,
                )
                .unwrap();
            }
            assert_eq!(
                order,
                ["a.weight", "b.weight", "c.weight"],
                "stored: {stored}, {readers:?}"
            );
            for (name, shape, v) in &tensors {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                match store.stored.get(*name) {
                    Some(StoredTensor {
                        shape: s, bytes: b, ..
                    }) => assert_eq!((s, b), (shape, &bytes), "{name}"),
                    None => {
                        let t = &store.tensors[*name];
                        assert_eq!((&t.shape, &t.data), (shape, v), "{name}");
                    }
                }
            }
            // Matrices kept as stored, the vector as floats; nothing twice.
            let n_stored = if stored { 2 } else { 0 };
            assert_eq!(
                (store.stored.len(), store.tensors.len()),
                (n_stored, 3 - n_stored)
            );
        }
    }

    /// Readers of a cached file split tensors into pieces across threads: 16-bit tensors are
    /// converted piece by piece into their floats, or kept as they are, exactly.
    #[test]
    fn cached_readers_convert_and_keep_16_bit_tensors_piece_by_piece() {
        let dir = tempfile::tempdir().unwrap();
        let m: Vec<f32> = (0..15).map(|i| i as f32 * 0.5 - 3.0).collect();
        let v: Vec<f32> = (0..7).map(|i| 1.0 / (1 << i) as f32).collect();
        let m_bytes: Vec<u8> = m
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        let v_bytes: Vec<u8> = v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        let views = [
            ("m.weight", Dtype::BF16, vec![3, 5], &m_bytes),
            ("v.weight", Dtype::F16, vec![7], &v_bytes),
        ]
        .map(|(name, dtype, shape, bytes)| {
            (
                name,
                safetensors::tensor::TensorView::new(dtype, shape, bytes).unwrap(),
            )
        });
        safetensors::serialize_to_file(views, None, &dir.path().join(SINGLE_FILE)).unwrap();
        let expected: Vec<Wanted> = vec![
            ("v.weight".into(), vec![7]),
            ("m.weight".into(), vec![3, 5]),
        ];
        let readers = Readers::Cached {
            readers: 3,
            piece_bytes: 4,
        };
        let mut progress = |_: usize, _: usize, _: &str| {};
        let mut floats = WeightStore::default();
        read_weights_as(
            dir.path(),
            &expected,
            &FusedMap::default(),
            &mut floats,
            &mut progress,
            readers,
        )
        .unwrap();
        assert_eq!(floats.tensors["m.weight"].data, m);
        assert_eq!(floats.tensors["v.weight"].data, v);
        let mut kept = WeightStore::default();
        let dest = &mut super::super::StoredDest(&mut kept);
        read_weights_as(
            dir.path(),
            &expected,
            &FusedMap::default(),
            dest,
            &mut progress,
            readers,
        )
        .unwrap();
        assert_eq!(kept.stored["m.weight"].bytes, m_bytes);
        assert_eq!(kept.stored["m.weight"].dtype, WeightDtype::BF16);
        assert_eq!(
            kept.tensors["v.weight"].data, v,
            "a vector is kept as floats"
        );
    }

    /// A reader that fails stops the others; the error names the file, and no tensor it
    /// failed to fill is reported done.
    #[test]
    fn a_failed_cached_read_is_the_error_and_reports_nothing_unread() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, &[1u8; 100]).unwrap();
        let planned = |name, offset| Planned {
            idx: 0,
            name,
            shape: &[16],
            dtype: Dtype::F32,
            width: 4,
            offset,
            n_bytes: 64,
            kept: Some(WeightDtype::F32),
        };
        // The second tensor runs past the file's end.
        let plan = [planned("x", 0), planned("y", 90)];
        let (mut x, mut y) = ([0u8; 64], [0u8; 64]);
        let places = places(vec![
            (x.as_mut_ptr() as usize, x.len()),
            (y.as_mut_ptr() as usize, y.len()),
        ]);
        let mut done = Vec::new();
        let err = read_cached(
            file.as_file(),
            file.path(),
            &plan,
            &places,
            3,
            8,
            &mut |name| done.push(name.to_owned()),
        )
        .unwrap_err();
        assert!(
            matches!(&err, LoadError::Io { path, .. } if path == file.path()),
            "{err}"
        );
        assert!(!done.contains(&"y".to_owned()), "{done:?}");
    }

    #[test]
    #[should_panic(expected = "overlapping memory")]
    fn places_refuse_overlapping_tensors() {
        places(vec![(4096, 100), (0, 0), (4000, 97)]);
    }
}
