//! Weights: how they are held in memory, laid out for the Llama forward, and replaced in place.
//!
//! * Held: [`store`] is the weights as loaded, tensors by Hugging Face name; [`matrix`] a weight
//!   matrix in its stored precision, one row segment per tensor, whose 4-bit rows
//!   [`row_groups`] regroups for the AVX-512 kernel; [`buf`] the memory under both, anonymous
//!   mappings carved from huge-page slabs (`buf/slab.rs`) that go back to the OS when dropped.
//! * Made up: [`random`] is random weights in a real architecture's shape, for tests and
//!   benchmarks (`ferry_model::random_model`).
//! * Laid out: [`llama`] is the Llama-family weights as the forward reads them (q/k/v and
//!   gate/up fused), built from a store after checking every tensor.
//! * Replaced: [`update`] is what any executor's weight update goes through (prepare off the
//!   engine thread, install between two steps, sleep states); [`llama_update`] is that for the
//!   Llama model (every Hugging Face tensor's place in the fused layout); [`push`] reads a
//!   pushed safetensors body piece by piece straight into an update's slots; [`upload`]
//!   stages the buckets of one upload and joins them into one update at its commit.
//!
//! The Llama model's own side of an update (installing, offload, drop, restore) needs its
//! private fields, so it lives beside the forward, in `llama/weight_ops.rs`.

pub mod buf;
pub mod llama;
pub mod llama_update;
pub mod matrix;
pub mod push;
pub mod random;
pub mod row_groups;
pub mod store;
pub mod update;
pub mod upload;
