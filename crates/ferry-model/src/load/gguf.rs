//! A GGUF (v2/v3) reader: header, metadata, tensor infos, and dequantization to f32.
//!
//! Written by hand because the GGUF crates on crates.io are small, young single-author
//! projects; the format is simple and this reader is small and exact. Layout (all
//! little-endian): magic `GGUF`, version u32, tensor count u64, metadata count u64, metadata
//! key/values, tensor infos (name, dims innermost-first, ggml type, offset), padding to
//! `general.alignment` (default 32), then the tensor data section.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::LoadError;
// GGML's types and block formats are `ggml.rs`'s (the weight dtypes and the kernels use them
// too); the reader's users keep finding them here.
pub use crate::ggml::{dequantize, dequantize_into, GgmlType, QK, QK_K};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// Any integer type that fits in u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            Self::F64(v) => Some(v as f32),
            _ => self.as_i64().map(|v| v as f32),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// One tensor's description from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions as GGUF lists them: innermost (contiguous) first.
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The PyTorch (row-major, outermost-first) shape: the GGUF dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    /// Lengths of the `tokenizer.*` arrays [`GgufFile::open_weights`] skipped.
    skipped_arrays: BTreeMap<String, u64>,
    data_start: usize,
    mmap: memmap2::Mmap,
    /// The same file, for [`GgufFile::dequantize_into`]'s reads.
    file: std::fs::File,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        Self::open_with(path, false)
    }

    /// [`open`](Self::open) for the weights alone (a reload): the `tokenizer.*` arrays, some
    /// hundred thousand strings and numbers in a chat model's file, are skipped rather than
    /// parsed, keeping only their lengths ([`array_len`](Self::array_len)). Parsing them on
    /// every reload allocated ~10 MB in small pieces on whichever blocking-pool thread ran
    /// it, and glibc kept them in that thread's arena: resident memory grew by that much per
    /// new thread, a tenth of a Q4_1 model's weights.
    pub fn open_weights(path: &Path) -> Result<Self, LoadError> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, skip_tokenizer: bool) -> Result<Self, LoadError> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: read-only mapping; GGUF files are not rewritten in place while loaded, and
        // reading a multi-hundred-MB model into a buffer first would double peak memory.
        // Loading reads tensors with `dequantize_into` (positioned reads), so only the header
        // and metadata pages are ever touched through it.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let mut cur = Cursor {
            bytes: &mmap,
            pos: 0,
            path,
        };
        let header = read_header(&mut cur, skip_tokenizer)?;
        let data_start = header.data_start(cur.pos as u64);
        let data_start = data_start
            .and_then(|s| usize::try_from(s).ok())
            .filter(|&s| s <= mmap.len())
            .ok_or_else(|| LoadError::invalid(path, "GGUF data section starts past the end"))?;
        let gguf = Self {
            path: path.to_owned(),
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            skipped_arrays: header.skipped_arrays,
            data_start,
            mmap,
            file,
        };
        // Bounds-check every tensor of a known size now; a tensor of an unsupported type is
        // reported only if the model needs it (a file may carry extras we never read).
        for info in &gguf.tensors {
            if info.dtype.byte_size(info.numel()).is_some() {
                gguf.tensor_bytes(info)?;
            }
        }
        Ok(gguf)
    }

    /// The length of the array under `key`, parsed or skipped.
    pub fn array_len(&self, key: &str) -> Option<usize> {
        match self.metadata.get(key) {
            Some(GgufValue::Array(items)) => Some(items.len()),
            Some(_) => None,
            None => self.skipped_arrays.get(key).map(|&n| n as usize),
        }
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor; errors name the tensor when its type is unsupported, its
    /// rows are not whole blocks (ggml requires them to be; a Q4_K row is a multiple of 256)
    /// or its data runs past the end of the file.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Result<&[u8], LoadError> {
        let len = info
            .dtype
            .byte_size(info.numel())
            .ok_or_else(|| self.unsupported(info))?;
        let (block, _) = info.dtype.block().ok_or_else(|| self.unsupported(info))?;
        if let Some(&row) = info.dims.first().filter(|&&d| d % block as u64 != 0) {
            return Err(LoadError::TensorData {
                path: self.path.clone(),
                tensor: info.name.clone(),
                message: format!(
                    "rows of {row} elements are not whole {} blocks of {block}",
                    info.dtype
                ),
            });
        }
        let start = usize::try_from(info.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_start));
        start
            .and_then(|s| Some(s..s.checked_add(len)?))
            .and_then(|range| self.mmap.get(range))
            .ok_or_else(|| LoadError::TensorData {
                path: self.path.clone(),
                tensor: info.name.clone(),
                message: format!("{len} bytes at offset {} run past the end", info.offset),
            })
    }

    /// A tensor dequantized to f32, in GGUF element order.
    pub fn dequantize(&self, info: &GgufTensorInfo) -> Result<Vec<f32>, LoadError> {
        let bytes = self.tensor_bytes(info)?;
        dequantize(info.dtype, bytes, info.numel()).ok_or_else(|| self.unsupported(info))
    }

    /// [`GgufFile::dequantize`] into `out`, which holds the tensor's element count. The bytes
    /// are read a chunk of blocks at a time rather than through the mapping, so the file's
    /// pages stay out of resident memory (see [`super::read_chunks`]).
    pub fn dequantize_into(&self, info: &GgufTensorInfo, out: &mut [f32]) -> Result<(), LoadError> {
        self.dequantize_part_into(info, 0, 1, out)
    }

    /// Part `part` of `parts` equal consecutive pieces of a tensor dequantized into `out`
    /// (which holds its elements): one expert's matrix of a stacked expert tensor
    /// (`[experts, rows, cols]`, each expert whole rows, so whole blocks), read as
    /// [`GgufFile::dequantize_into`] reads a whole tensor.
    pub fn dequantize_part_into(
        &self,
        info: &GgufTensorInfo,
        part: usize,
        parts: usize,
        out: &mut [f32],
    ) -> Result<(), LoadError> {
        let (offset, len) = self.part_range(info, part, parts)?;
        let (block_elems, block_bytes) =
            info.dtype.block().ok_or_else(|| self.unsupported(info))?;
        if out.len() != info.numel() / parts {
            return Err(self.unsupported(info));
        }
        let mut ok = true;
        super::read_chunks(
            &self.file,
            &self.path,
            offset,
            len,
            block_bytes,
            |at, bytes| {
                let first = at / block_bytes * block_elems;
                let n = bytes.len() / block_bytes * block_elems;
                ok &= dequantize_into(info.dtype, bytes, &mut out[first..first + n]).is_some();
            },
        )?;
        if ok {
            Ok(())
        } else {
            Err(self.unsupported(info))
        }
    }

    /// A tensor's raw bytes into `out` (exactly their length), read as
    /// [`GgufFile::dequantize_into`] reads them.
    pub fn read_into(&self, info: &GgufTensorInfo, out: &mut [u8]) -> Result<(), LoadError> {
        self.read_part_into(info, 0, 1, out)
    }

    /// The raw bytes of part `part` of `parts` (see [`GgufFile::dequantize_part_into`]) into
    /// `out`, exactly their length.
    pub fn read_part_into(
        &self,
        info: &GgufTensorInfo,
        part: usize,
        parts: usize,
        out: &mut [u8],
    ) -> Result<(), LoadError> {
        let (offset, len) = self.part_range(info, part, parts)?;
        if out.len() != len {
            return Err(self.unsupported(info));
        }
        super::read_chunks(&self.file, &self.path, offset, len, 1, |at, bytes| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
        })
    }

    /// The file offset and byte length of part `part` of `parts` of a tensor, checked to be
    /// whole blocks: `parts` must divide the tensor's outermost dimension.
    fn part_range(
        &self,
        info: &GgufTensorInfo,
        part: usize,
        parts: usize,
    ) -> Result<(u64, usize), LoadError> {
        // Bounds-checks the range, and refuses an unsupported type naming the tensor.
        let len = self.tensor_bytes(info)?.len();
        let outer = info.dims.last().map_or(1, |&d| d as usize);
        if parts == 0 || part >= parts || !outer.is_multiple_of(parts) {
            return Err(LoadError::TensorData {
                path: self.path.clone(),
                tensor: info.name.clone(),
                message: format!(
                    "part {part} of {parts} of a tensor whose outermost dimension is {outer}"
                ),
            });
        }
        let part_len = len / parts;
        let offset = (self.data_start as u64)
            .saturating_add(info.offset)
            .saturating_add((part * part_len) as u64);
        Ok((offset, part_len))
    }

    fn unsupported(&self, info: &GgufTensorInfo) -> LoadError {
        LoadError::UnsupportedDtype {
            path: self.path.clone(),
            tensor: info.name.clone(),
            dtype: format!(
                "{} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K; \
                 element count {})",
                info.dtype,
                info.numel()
            ),
        }
    }
}

/// The metadata value type of an array.
const ARRAY: u32 = 9;

struct Header {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    skipped_arrays: BTreeMap<String, u64>,
    tensors: Vec<GgufTensorInfo>,
}

impl Header {
    /// `None` when a corrupt alignment overflows.
    fn data_start(&self, end_of_infos: u64) -> Option<u64> {
        let align = self
            .metadata
            .get("general.alignment")
            .and_then(GgufValue::as_u64)
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT);
        end_of_infos.div_ceil(align).checked_mul(align)
    }
}

fn read_header(cur: &mut Cursor<'_>, skip_tokenizer: bool) -> Result<Header, LoadError> {
    if cur.take(4)? != MAGIC {
        return Err(cur.err("not a GGUF file (bad magic)"));
    }
    let version = cur.u32()?;
    if !(2..=3).contains(&version) {
        return Err(cur.err(format!("GGUF version {version} is not supported (2 or 3)")));
    }
    let n_tensors = cur.u64()?;
    let n_kv = cur.u64()?;
    let mut metadata = BTreeMap::new();
    let mut skipped_arrays = BTreeMap::new();
    for _ in 0..n_kv {
        let key = cur.string()?;
        let kind = cur.u32()?;
        if skip_tokenizer && kind == ARRAY && key.starts_with("tokenizer.") {
            let n = cur.skip_array(0)?;
            skipped_arrays.insert(key, n);
            continue;
        }
        let value = cur.value(kind, 0)?;
        metadata.insert(key, value);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        tensors.push(read_tensor_info(cur)?);
    }
    Ok(Header {
        version,
        metadata,
        skipped_arrays,
        tensors,
    })
}

fn read_tensor_info(cur: &mut Cursor<'_>) -> Result<GgufTensorInfo, LoadError> {
    let name = cur.string()?;
    let n_dims = cur.u32()?;
    if n_dims > 8 {
        return Err(cur.err(format!("tensor `{name}` has {n_dims} dimensions")));
    }
    let dims = (0..n_dims)
        .map(|_| cur.u64())
        .collect::<Result<Vec<_>, _>>()?;
    if dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .is_none()
    {
        return Err(cur.err(format!("tensor `{name}` has an overflowing element count")));
    }
    let dtype = GgmlType::from_id(cur.u32()?);
    let offset = cur.u64()?;
    Ok(GgufTensorInfo {
        name,
        dims,
        dtype,
        offset,
    })
}

/// A bounds-checked little-endian reader over the mapped header.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, message: impl Into<String>) -> LoadError {
        LoadError::invalid(self.path, message)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], LoadError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end =
            end.ok_or_else(|| self.err(format!("GGUF header truncated at byte {}", self.pos)))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], LoadError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, LoadError> {
        let bytes = self.string_bytes()?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err("string is not valid UTF-8"))
    }

    /// A string's bytes, not yet checked as UTF-8.
    fn string_bytes(&mut self) -> Result<&'a [u8], LoadError> {
        let len = self.u64()?;
        let len = usize::try_from(len).map_err(|_| self.err("string length overflows"))?;
        self.take(len)
    }

    fn value(&mut self, kind: u32, depth: u32) -> Result<GgufValue, LoadError> {
        Ok(match kind {
            0 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => GgufValue::Bool(self.take(1)?[0] != 0),
            8 => GgufValue::String(self.string()?),
            ARRAY => self.array_value(depth)?,
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(format!("unknown GGUF metadata value type {other}"))),
        })
    }

    fn array_value(&mut self, depth: u32) -> Result<GgufValue, LoadError> {
        let (kind, n) = self.array_header(depth)?;
        let items = (0..n)
            .map(|_| self.value(kind, depth + 1))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GgufValue::Array(items))
    }

    /// An array's element type and count, checked.
    fn array_header(&mut self, depth: u32) -> Result<(u32, u64), LoadError> {
        if depth > 4 {
            return Err(self.err("GGUF metadata arrays nested too deeply"));
        }
        let kind = self.u32()?;
        let n = self.u64()?;
        // Every element takes at least one byte: a count beyond the remaining bytes is corrupt,
        // and checking first keeps a bad count from reserving huge memory.
        if n > (self.bytes.len() - self.pos) as u64 {
            return Err(self.err(format!("GGUF array of {n} elements runs past the end")));
        }
        Ok((kind, n))
    }

    /// Moves past an array as [`array_value`](Self::array_value) would read it, with the same
    /// checks, allocating nothing; returns its length.
    fn skip_array(&mut self, depth: u32) -> Result<u64, LoadError> {
        let (kind, n) = self.array_header(depth)?;
        for _ in 0..n {
            match kind {
                0 | 1 | 7 => drop(self.take(1)?),
                2 | 3 => drop(self.take(2)?),
                4..=6 => drop(self.take(4)?),
                10..=12 => drop(self.take(8)?),
                8 => drop(self.string_bytes()?),
                ARRAY => drop(self.skip_array(depth + 1)?),
                other => return Err(self.err(format!("unknown GGUF metadata value type {other}"))),
            }
        }
        Ok(n)
    }
}
