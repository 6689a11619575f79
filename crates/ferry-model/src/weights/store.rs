//! Weights as loaded: tensors by Hugging Face name (GGUF names are mapped to these), so
//! loading, weight updates and the model share one naming. A tensor is either f32 values
//! ([`Tensor`], what the f32 loaders and the tests use) or the raw bytes of its stored
//! precision ([`StoredTensor`], what the model keeps and computes from).

use std::collections::BTreeMap;

use crate::dtype::WeightDtype;

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor shape and data length"
        );
        Self { shape, data }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// A tensor in its stored precision: little-endian values or GGML blocks, rows of whole
/// blocks, row-major.
#[derive(Clone, PartialEq)]
pub struct StoredTensor {
    pub shape: Vec<usize>,
    pub dtype: WeightDtype,
    pub bytes: Vec<u8>,
}

impl StoredTensor {
    /// `values` (of `shape`) quantized to `dtype` (see [`crate::dtype::quantize`]).
    pub fn quantized(shape: Vec<usize>, dtype: WeightDtype, values: &[f32]) -> Self {
        let bytes = crate::dtype::quantize(dtype, values);
        Self {
            shape,
            dtype,
            bytes,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values as f32, exactly as the f32 loaders dequantize them.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        crate::dtype::dequantize_into(self.dtype, &self.bytes, &mut out);
        out
    }
}

impl std::fmt::Debug for StoredTensor {
    /// Shape and dtype only: a weight matrix is megabytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredTensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("n_bytes", &self.bytes.len())
            .finish()
    }
}

/// Tensors by Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`:
/// as f32 values in `tensors`, or in their stored precision in `stored` (a name is in one of
/// the two; the model looks in `stored` first).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightStore {
    pub tensors: BTreeMap<String, Tensor>,
    pub stored: BTreeMap<String, StoredTensor>,
}

impl WeightStore {
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    pub fn insert(&mut self, name: impl Into<String>, t: Tensor) {
        self.tensors.insert(name.into(), t);
    }

    pub fn insert_stored(&mut self, name: impl Into<String>, t: StoredTensor) {
        self.stored.insert(name.into(), t);
    }

    /// Bytes held: 4 per f32 value, and the stored tensors' own bytes.
    pub fn total_bytes(&self) -> usize {
        let f32s: usize = self.tensors.values().map(|t| t.numel() * 4).sum();
        f32s + self.stored.values().map(|t| t.bytes.len()).sum::<usize>()
    }

    /// Every tensor in its stored precision, dequantized to f32 ([`Tensor`]s only): the model
    /// the f32 path computes, for comparing the two.
    pub fn dequantized(&self) -> WeightStore {
        let mut out = WeightStore {
            tensors: self.tensors.clone(),
            stored: BTreeMap::new(),
        };
        for (name, t) in &self.stored {
            out.insert(name.clone(), Tensor::new(t.shape.clone(), t.to_f32()));
        }
        out
    }
}
