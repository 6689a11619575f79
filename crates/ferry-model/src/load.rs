//! Loading a model: a Hugging Face folder or a GGUF file (the built-in `tiny` model is
//! `tiny.rs`'s; [`crate::ModelSpec`] names either).
//!
//! Every loader produces the same [`LoadedModel`]: a [`LlamaConfig`], f32 weights under their
//! Hugging Face names (GGUF names are mapped, and llama.cpp's q/k row permutation undone), the
//! tokenizer and the chat template. One naming means a weight update never has to know where the
//! model came from.
//!
//! Files are memory-mapped and converted to f32 tensor by tensor, so peak memory is the f32
//! weights plus the page cache, never a second full copy.

pub mod config_json;
pub mod gguf;
pub mod gguf_model;
mod read_ahead;
mod safetensors_io;

pub mod tokenizer;

use std::path::{Path, PathBuf};

use crate::dtype::WeightDtype;
use crate::weights::update::WeightSlots;
use crate::{LlamaConfig, StoredTensor, Tensor, WeightStore};

// The tensors a config names are the config's (`config/tensors.rs`); the loaders' users
// keep finding them here.
pub use crate::config::tensors::{expected_tensors, is_ignorable};

/// File name of the default real model (SmolLM2-135M-Instruct, Q4_1) inside `<cache>/models/`,
/// where `scripts/fetch-model.sh` puts it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Called once per tensor as the loader converts it, so a caller can show progress while a
/// large model loads: `(tensors done, tensors in all, the tensor just loaded)`.
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize, &str);

/// Everything needed to serve a model.
#[derive(Debug)]
pub struct LoadedModel {
    pub config: LlamaConfig,
    pub weights: WeightStore,
    pub tokenizer: Option<tokenizers::Tokenizer>,
    /// Jinja chat template (tokenizer_config.json or GGUF metadata).
    pub chat_template: Option<String>,
    /// Where it came from (a path, or "tiny").
    pub source: String,
}

/// What went wrong while loading; every variant names the file, and the tensor or field where
/// there is one.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: field `{field}`: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: unsupported architecture `{architecture}` (supported: {supported})")]
    UnsupportedArchitecture {
        path: PathBuf,
        architecture: String,
        supported: &'static str,
    },
    #[error("{path}: unsupported rope scaling type `{rope_type}` (supported: llama3, linear)")]
    UnsupportedRope { path: PathBuf, rope_type: String },
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("{path}: tensor `{tensor}` has unsupported dtype {dtype}")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// A tensor in the file that the forward would not read: loading it anyway would give
    /// outputs other than the checkpoint's, with no warning.
    #[error("{path}: tensor `{tensor}` is not used by this model: {message}")]
    UnusedTensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{path}: tensor `{tensor}`: {message}")]
    TensorData {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
}

impl LoadError {
    pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> Self {
        Self::Invalid {
            path: path.to_owned(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            source,
        }
    }

    pub(crate) fn field(path: &Path, field: &str, message: impl Into<String>) -> Self {
        Self::Field {
            path: path.to_owned(),
            field: field.to_owned(),
            message: message.into(),
        }
    }
}

/// Loads a Hugging Face model folder or a `.gguf` file, every tensor dequantized to f32.
pub fn load_model(path: &Path) -> Result<LoadedModel, LoadError> {
    load_model_with_progress(path, &mut |_, _, _| {})
}

/// [`load_model`], reporting each converted tensor to `progress`.
pub fn load_model_with_progress(
    path: &Path,
    progress: Progress<'_>,
) -> Result<LoadedModel, LoadError> {
    load_any(path, Precision::F32, progress)
}

/// Loads a Hugging Face model folder or a `.gguf` file with every matrix kept in its file's
/// precision ([`WeightStore::stored`]; vectors as f32): what a server computes from.
pub fn load_model_stored(path: &Path) -> Result<LoadedModel, LoadError> {
    load_model_stored_with_progress(path, &mut |_, _, _| {})
}

/// [`load_model_stored`], reporting each tensor read to `progress`.
pub fn load_model_stored_with_progress(
    path: &Path,
    progress: Progress<'_>,
) -> Result<LoadedModel, LoadError> {
    load_any(path, Precision::Stored, progress)
}

/// What a loader turns matrices into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32, dequantized at load.
    F32,
    /// The file's own dtype.
    Stored,
}

pub(crate) fn load_any(
    path: &Path,
    precision: Precision,
    progress: Progress<'_>,
) -> Result<LoadedModel, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if meta.is_dir() {
        load_hf_folder_with_progress(path, precision, progress)
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        gguf_model::load_gguf(path, precision, progress)
    } else {
        Err(LoadError::invalid(
            path,
            "not a model: expected a Hugging Face model folder or a .gguf file",
        ))
    }
}

/// Loads a Hugging Face folder: config.json (+ generation_config.json), safetensors (single
/// file or sharded with an index), tokenizer.json and the chat template.
pub fn load_hf_folder(dir: &Path) -> Result<LoadedModel, LoadError> {
    load_hf_folder_with_progress(dir, Precision::F32, &mut |_, _, _| {})
}

fn load_hf_folder_with_progress(
    dir: &Path,
    precision: Precision,
    progress: Progress<'_>,
) -> Result<LoadedModel, LoadError> {
    let config = config_json::read_folder_config(dir)?;
    let mut weights = WeightStore::default();
    let expected = expected_tensors(&config);
    let fused = &safetensors_io::FusedMap::of(&config);
    match precision {
        Precision::F32 => {
            safetensors_io::read_weights(dir, &expected, fused, &mut weights, progress)?
        }
        Precision::Stored => {
            let dest = &mut StoredDest(&mut weights);
            safetensors_io::read_weights(dir, &expected, fused, dest, progress)?
        }
    }
    let tokenizer = tokenizer::read_hf_tokenizer(dir)?;
    let chat_template = tokenizer::read_chat_template(dir)?;
    Ok(LoadedModel {
        config,
        weights,
        tokenizer,
        chat_template,
        source: dir.display().to_string(),
    })
}

/// Where a loader writes each tensor it reads: a new [`WeightStore`] (loading a model), or
/// the slots of a prepared update (a reload, [`WeightFiles::read_into`]), so a reload never
/// holds a tensor twice. Asked again for the same tensor (and dtype), a destination answers
/// the same memory: a reader may learn every tensor's place before it writes any.
pub(crate) trait TensorDest {
    /// The floats of tensor `idx` of [`expected_tensors`] (`name`, `shape`, already checked),
    /// which the loader then writes whole.
    fn tensor_mut(&mut self, idx: usize, name: &str, shape: &[usize]) -> &mut [f32];

    /// The bytes of matrix `idx` (`name`, `shape` of two dims, already checked) kept in
    /// `dtype`, which the loader then writes whole in the file's layout (q/k rows already
    /// in Hugging Face order); `None` when this destination wants f32 (then the loader
    /// converts into [`TensorDest::tensor_mut`]).
    fn stored_mut(
        &mut self,
        _idx: usize,
        _name: &str,
        _shape: &[usize],
        _dtype: WeightDtype,
    ) -> Option<&mut [u8]> {
        None
    }
}

/// A [`WeightStore`] that keeps matrices in their stored precision (vectors as f32).
struct StoredDest<'a>(&'a mut WeightStore);

impl TensorDest for StoredDest<'_> {
    fn tensor_mut(&mut self, idx: usize, name: &str, shape: &[usize]) -> &mut [f32] {
        self.0.tensor_mut(idx, name, shape)
    }

    fn stored_mut(
        &mut self,
        _idx: usize,
        name: &str,
        shape: &[usize],
        dtype: WeightDtype,
    ) -> Option<&mut [u8]> {
        let n_bytes = dtype.row_bytes(shape[1])? * shape[0];
        let differs = |t: &StoredTensor| t.dtype != dtype || t.shape != shape;
        if self.0.stored.get(name).is_none_or(differs) {
            let t = StoredTensor {
                shape: shape.to_vec(),
                dtype,
                bytes: vec![0; n_bytes],
            };
            self.0.insert_stored(name, t);
        }
        let t = self.0.stored.get_mut(name).expect("inserted just above");
        Some(&mut t.bytes)
    }
}

impl TensorDest for WeightStore {
    fn tensor_mut(&mut self, _idx: usize, name: &str, shape: &[usize]) -> &mut [f32] {
        if self.tensors.get(name).is_none_or(|t| t.shape != shape) {
            let zeros = vec![0.0; shape.iter().product()];
            self.insert(name, Tensor::new(shape.to_vec(), zeros));
        }
        let tensor = self.tensors.get_mut(name).expect("inserted just above");
        &mut tensor.data
    }
}

/// Bytes read per call by [`read_chunks`].
const CHUNK_BYTES: usize = 1 << 20;

/// Reads `len` bytes at `offset` of `file` in chunks of whole `unit`-byte units, handing
/// `each(byte offset in the range, chunk)` every one. Reads rather than a memory map, so the
/// file's pages never count in this process's resident memory: a reload's peak is the new
/// weights, not the new weights plus the file. Positioned reads ([`read_exact_at`]), so
/// readers on several threads may share the file.
pub(crate) fn read_chunks(
    file: &std::fs::File,
    path: &Path,
    offset: u64,
    len: usize,
    unit: usize,
    mut each: impl FnMut(usize, &[u8]),
) -> Result<(), LoadError> {
    let chunk = (CHUNK_BYTES / unit).max(1) * unit;
    let mut buf = vec![0u8; chunk.min(len)];
    let mut done = 0;
    while done < len {
        let n = chunk.min(len - done);
        read_exact_at(file, path, offset + done as u64, &mut buf[..n])?;
        each(done, &buf[..n]);
        done += n;
    }
    Ok(())
}

/// Fills `out` with the file's bytes from `offset`, without moving the file's position
/// (`pread`), so readers on several threads may share the file.
pub(crate) fn read_exact_at(
    file: &std::fs::File,
    path: &Path,
    offset: u64,
    out: &mut [u8],
) -> Result<(), LoadError> {
    #[cfg(unix)]
    let read = std::os::unix::fs::FileExt::read_exact_at(file, out, offset);
    #[cfg(not(unix))]
    let read = {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = file;
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(out))
    };
    read.map_err(|e| LoadError::io(path, e))
}

/// [`WeightSlots`] made for [`expected_tensors`], in that order.
struct ExpectedSlots<'a>(&'a mut dyn WeightSlots);

impl TensorDest for ExpectedSlots<'_> {
    fn tensor_mut(&mut self, idx: usize, _name: &str, _shape: &[usize]) -> &mut [f32] {
        self.0.slot(idx)
    }

    /// A reload keeps the file's dtypes where the executor keeps matrices as stored.
    fn stored_mut(
        &mut self,
        idx: usize,
        _name: &str,
        _shape: &[usize],
        dtype: WeightDtype,
    ) -> Option<&mut [u8]> {
        self.0.stored_slot(idx, dtype)
    }
}

/// A model's weights on disk (a Hugging Face folder or a GGUF file) for a reload: opened and
/// its config read first, so the caller can check the config and make the update's
/// [`WeightSlots`] before a tensor is read; then each tensor is converted straight into its
/// slot. Tokenizer and chat template are not read (a reload keeps the running ones).
#[derive(Debug)]
pub struct WeightFiles {
    config: LlamaConfig,
    source: WeightSource,
}

#[derive(Debug)]
enum WeightSource {
    Folder(PathBuf),
    Gguf(Box<gguf::GgufFile>),
}

impl WeightFiles {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
        if meta.is_dir() {
            let config = config_json::read_folder_config(path)?;
            Ok(Self {
                config,
                source: WeightSource::Folder(path.to_owned()),
            })
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            let file = gguf::GgufFile::open_weights(path)?;
            Ok(Self {
                config: gguf_model::gguf_config(&file)?,
                source: WeightSource::Gguf(Box::new(file)),
            })
        } else {
            Err(LoadError::invalid(
                path,
                "not a model: expected a Hugging Face model folder or a .gguf file",
            ))
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Whether a reload may write these files over the weights in place
    /// ([`crate::WeightPreparer::slots_in_place`]): a safetensors folder, each of whose
    /// tensors [`WeightFiles::check`] checks before one is read, so only the disk failing or
    /// the files changing can stop the read midway. A GGUF file's tensors are checked as they
    /// are read, so it is read into fresh weights.
    pub fn reads_in_place(&self) -> bool {
        matches!(self.source, WeightSource::Folder(_))
    }

    /// Checks what [`WeightFiles::read_into`] checks before it reads tensor data, reading
    /// none: for a folder, its files and every expected tensor's shape, dtype and bytes.
    pub fn check(&self) -> Result<(), LoadError> {
        match &self.source {
            WeightSource::Folder(dir) => {
                let fused = &safetensors_io::FusedMap::of(&self.config);
                safetensors_io::check_weights(dir, &expected_tensors(&self.config), fused)
            }
            WeightSource::Gguf(_) => Ok(()),
        }
    }

    /// Reads every tensor of [`expected_tensors`] of the config into `slots`, which must have
    /// been made for that list, in that order.
    pub fn read_into(&self, slots: &mut dyn WeightSlots) -> Result<(), LoadError> {
        let progress = &mut |_: usize, _: usize, _: &str| {};
        match &self.source {
            // The reader takes the slots' pages on another thread as it goes.
            WeightSource::Folder(dir) => {
                let dest = &mut ExpectedSlots(slots);
                let (expected, fused) = (
                    expected_tensors(&self.config),
                    safetensors_io::FusedMap::of(&self.config),
                );
                safetensors_io::read_weights(dir, &expected, &fused, dest, progress)
            }
            WeightSource::Gguf(file) => {
                // A file in the page cache is copied faster than the kernel clears fresh
                // pages: they are all taken first, on every thread.
                slots.prefault();
                let dest = &mut ExpectedSlots(slots);
                gguf_model::gguf_weights(file, &self.config, dest, progress)
            }
        }
    }
}

/// The cache folder, `${FERRY_CACHE:-$HOME/.cache/ferry}`, from those two variables' values
/// (`None` when neither is set). The caller reads the environment (the binary, tests), so the
/// rule is written once and the library reads no environment.
pub fn cache_dir(
    ferry_cache: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    ferry_cache
        .map(PathBuf::from)
        .or_else(|| home.map(|h| PathBuf::from(h).join(".cache").join("ferry")))
}

/// Where `scripts/fetch-model.sh` puts the default model, given the cache folder
/// ([`cache_dir`]).
pub fn default_model_path(cache_dir: &Path) -> PathBuf {
    cache_dir.join("models").join(DEFAULT_MODEL_FILE)
}
