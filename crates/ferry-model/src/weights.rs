//! Weights as loaded: f32 tensors by Hugging Face name (GGUF names are mapped to these), so
//! loading, weight updates and the model share one naming.

use std::collections::BTreeMap;

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// Tensors by Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightStore {
    pub tensors: BTreeMap<String, Tensor>,
}

impl WeightStore {
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    pub fn insert(&mut self, name: impl Into<String>, t: Tensor) {
        self.tensors.insert(name.into(), t);
    }

    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.numel() * 4).sum()
    }
}
