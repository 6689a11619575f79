//! Sleep level 2 really gives the weights' memory back to the OS. Alone in its test binary,
//! so no other test allocates while resident memory is measured.

use ferry_model::random_model::{random_weights, smollm2_135m_config};
use ferry_model::{Executor, LlamaConfig, LlamaModel, WeightResidency};

const MIB: usize = 1 << 20;

#[cfg(target_os = "linux")]
fn rss_bytes() -> usize {
    ferry_arena::resident_bytes().expect("VmRSS") as usize
}

/// The SmolLM2-135M shape cut to 4 layers with an untied head: about 280 MB of f32, of
/// which the embedding table and the head (113 MB each) are single allocations far above
/// any allocator's mmap threshold, so freeing them must unmap them.
#[cfg(target_os = "linux")]
#[test]
fn dropping_the_weights_lowers_resident_memory() {
    let config = LlamaConfig {
        num_hidden_layers: 4,
        tie_word_embeddings: false,
        ..smollm2_135m_config()
    };
    let mut model = {
        let store = random_weights(&config, 1);
        LlamaModel::new(&config, &store).unwrap()
    };
    let total = model.weights().total_bytes();
    assert!(total > 250 * MIB, "{} MiB", total / MIB);

    let before = rss_bytes();
    let retired = model.weight_ops_mut().drop_weights();
    assert!(retired.is_some());
    drop(retired);
    let after = rss_bytes();
    assert_eq!(model.weight_ops().residency(), WeightResidency::Dropped);
    let freed = before.saturating_sub(after);
    // Margin: the layer matrices (57 MB) may stay in the allocator's free lists.
    assert!(
        freed >= total * 3 / 4,
        "dropping {} MiB of weights freed {} MiB of resident memory",
        total / MIB,
        freed / MIB
    );
}
