//! Where a forward's time goes, for `ferry bench model`: the wall time of the layer matmuls,
//! the head, attention, and the calling thread's waits for the forward pool's helpers, summed
//! over every forward of the process while enabled; and the weight bytes the matmuls read
//! (each call reads its matrix once: an MoE step reads only the experts its tokens use). Off by default: a timed section then
//! costs one relaxed load. Process-wide, so two models stepping at once share the sums.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// A timed part of the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The decoder layers' matmuls (qkv, o, gate/up, down).
    LayerMatmuls,
    /// The final matmul onto the vocabulary.
    Head,
    /// Paged attention.
    Attention,
    /// The calling thread waiting for a pool job's other tasks (inside the phases above).
    PoolWait,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static WEIGHT_BYTES: AtomicU64 = AtomicU64::new(0);

/// Weight bytes the model's matmuls have read while profiling was on.
pub fn weight_bytes_read() -> u64 {
    WEIGHT_BYTES.load(Relaxed)
}

/// Counts a matmul's weight bytes when profiling is on.
pub(crate) fn count_weight_bytes(n: usize) {
    if ENABLED.load(Relaxed) {
        WEIGHT_BYTES.fetch_add(n as u64, Relaxed);
    }
}

/// Starts or stops timing.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Relaxed);
}

/// Nanoseconds spent in each [`Phase`] while timing was on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseNanos {
    pub layer_matmuls: u64,
    pub head: u64,
    pub attention: u64,
    pub pool_wait: u64,
}

impl PhaseNanos {
    /// The sums so far.
    pub fn now() -> Self {
        let [layer_matmuls, head, attention, pool_wait] = NANOS.each_ref().map(|a| a.load(Relaxed));
        Self {
            layer_matmuls,
            head,
            attention,
            pool_wait,
        }
    }

    /// What was added since `earlier`.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            layer_matmuls: self.layer_matmuls - earlier.layer_matmuls,
            head: self.head - earlier.head,
            attention: self.attention - earlier.attention,
            pool_wait: self.pool_wait - earlier.pool_wait,
        }
    }
}

impl std::ops::AddAssign for PhaseNanos {
    fn add_assign(&mut self, other: Self) {
        self.layer_matmuls += other.layer_matmuls;
        self.head += other.head;
        self.attention += other.attention;
        self.pool_wait += other.pool_wait;
    }
}

/// Times `f` as part of `phase` when timing is on.
pub(crate) fn timed<R>(phase: Phase, f: impl FnOnce() -> R) -> R {
    if !ENABLED.load(Relaxed) {
        return f();
    }
    let t = Instant::now();
    let r = f();
    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    NANOS[phase as usize].fetch_add(ns, Relaxed);
    r
}
