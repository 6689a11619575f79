//! The checksum model: an [`Executor`] with no weights whose next token is a hash of every KV
//! byte of the sequence, so wrong, missing, misplaced or stale KV changes the output.
//!
//! It is the workhorse of lifecycle tests and simulation: exact, fast, and unforgiving.
//!
//! * **KV.** One layer, one KV head, [`HEAD_DIM`] floats of K and [`HEAD_DIM`] of V per token.
//!   A token's K and V are a function of `(token, position, weight version)` only
//!   ([`ChecksumModel::token_kv`]); each value is a 24-bit integer, so it is exact in `f32` and
//!   survives any byte-exact transfer bit for bit.
//! * **Next token.** For each request to sample, the model reads the K and V of positions
//!   `0..end` back from the arena *through the block table* (never from the plan's tokens: a
//!   block the scheduler or a transfer got wrong must show), folds them into a 64-bit digest,
//!   and answers `digest % vocab_size`. Every token id can come out, none is reserved: the
//!   model has no EOS, so tests stop requests by `max_tokens` or `stop_token_ids`.
//! * **Why read everything.** A running per-request digest would be O(1) per step but would
//!   not notice a block corrupted after it was written; reading all KV is O(sequence length)
//!   per sampled token, a few nanoseconds per position.
//! * **Digest.** Per position, the K then V floats as 64-bit words (two floats each) are
//!   chained `p = fmix64(p ^ w)`, then `h = fmix64(h ^ p) + C`, in position order. Every step
//!   is a bijection for fixed other inputs, so a change confined to one word (any single byte,
//!   any single float) *always* changes the digest, not just with high probability; wider
//!   changes collide with probability about 2^-64. The digest is also keyed by the weight
//!   version, so stale KV shows twice over: in the bytes and in the key.
//! * **Sampling.** The distribution is a point mass: every temperature, filter and seed gives
//!   the same token, with logprob 0.0 (and `[(token, 0.0)]` as its top-n when asked).
//! * **LoRA.** A request under an adapter ([`ScheduledReq::lora`]) computes with the
//!   adapter's seed ([`LoraAdapter::seed`], a hash of its values) mixed into the model's: its
//!   KV and its digest differ from the base model's and from any other adapter's, so KV
//!   shared across adapters, or computed under a stale version of one, changes its tokens.

use ferry_arena::{KvArena, KvLayout, KvPlane};
use ferry_core::{BlockId, ModelOutput, SampleSpec, SampledToken, ScheduledReq, StepPlan, TokenId};

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_core::LoraId;

use crate::lora::LoraAdapter;
use crate::weights::update::{
    ModelWeights, PreparedWeights, RetiredWeights, WeightError, WeightPreparer, Weightless,
};
use crate::{ExecError, Executor, WeightResidency};

/// Floats of K (and of V) per token.
pub const HEAD_DIM: usize = 4;

// The digest folds floats in pairs.
const _: () = assert!(HEAD_DIM.is_multiple_of(2));

/// Largest vocabulary: token ids are `u32`.
const MAX_VOCAB: u64 = 1 << 32;

/// Added after each digest step: `fmix64(0) == 0`, so without it a zero state would stay zero
/// through a run of zero words (a never-written block).
const STEP_CONSTANT: u64 = 0x9E37_79B9_7F4A_7C15;

/// The K and V vectors of one token.
pub type TokenKv = ([f32; HEAD_DIM], [f32; HEAD_DIM]);

/// Why a checksum model cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChecksumConfigError {
    #[error("checksum model: vocab_size must be in 1..={MAX_VOCAB}, got {0}")]
    VocabSize(usize),
}

/// The weightless executor described in the module doc.
#[derive(Debug, Clone)]
pub struct ChecksumModel {
    weight_version: String,
    /// Sleep states, and a version an update set (applied at the next step).
    weights: ChecksumWeights,
    /// Hash of `weight_version`, mixed into every token's KV.
    seed: u64,
    vocab_size: u64,
    /// The seed of each loaded adapter ([`LoraAdapter::seed`]).
    loras: BTreeMap<LoraId, u64>,
}

impl ChecksumModel {
    pub fn new(
        weight_version: impl Into<String>,
        vocab_size: usize,
    ) -> Result<Self, ChecksumConfigError> {
        if vocab_size == 0 || vocab_size as u64 > MAX_VOCAB {
            return Err(ChecksumConfigError::VocabSize(vocab_size));
        }
        let weight_version = weight_version.into();
        Ok(Self {
            weights: ChecksumWeights::default(),
            seed: version_seed(&weight_version),
            weight_version,
            vocab_size: vocab_size as u64,
            loras: BTreeMap::new(),
        })
    }

    /// A weight update: KV written from now on differs, so KV from before is stale and shows.
    pub fn set_weight_version(&mut self, weight_version: impl Into<String>) {
        self.weight_version = weight_version.into();
        self.seed = version_seed(&self.weight_version);
    }

    pub fn weight_version(&self) -> &str {
        &self.weight_version
    }

    /// The K and V this model writes for `token` at position `pos`.
    pub fn token_kv(&self, token: TokenId, pos: usize) -> TokenKv {
        self.token_kv_under(None, token, pos)
    }

    /// [`Self::token_kv`] of a request under the adapter of seed `lora_seed`
    /// ([`LoraAdapter::seed`]; `None`: the base model).
    pub fn token_kv_under(&self, lora_seed: Option<u64>, token: TokenId, pos: usize) -> TokenKv {
        let key = self.key(lora_seed);
        let base = fmix64(fmix64(key ^ u64::from(token.0)) ^ pos as u64);
        let mut kv = ([0.0; HEAD_DIM], [0.0; HEAD_DIM]);
        // Each 64-bit hash gives two 24-bit values (bits 0..24 and 32..56).
        for j in 0..HEAD_DIM / 2 {
            let (k, v) = (
                fmix64(base ^ (2 * j as u64 + 1).wrapping_mul(STEP_CONSTANT)),
                fmix64(base ^ (2 * j as u64 + 2).wrapping_mul(STEP_CONSTANT)),
            );
            kv.0[2 * j..2 * j + 2].copy_from_slice(&[low24(k), low24(k >> 32)]);
            kv.1[2 * j..2 * j + 2].copy_from_slice(&[low24(v), low24(v >> 32)]);
        }
        kv
    }

    /// The token `execute` samples after `tokens` when their KV in the arena is intact: the
    /// oracle for simulations and tests (computed from tokens, not from an arena).
    pub fn reference_next_token(&self, tokens: &[TokenId]) -> TokenId {
        self.reference_next_token_under(None, tokens)
    }

    /// [`Self::reference_next_token`] of a request under the adapter of seed `lora_seed`.
    pub fn reference_next_token_under(
        &self,
        lora_seed: Option<u64>,
        tokens: &[TokenId],
    ) -> TokenId {
        let mut digest = Digest::new(self.key(lora_seed));
        for (pos, &token) in tokens.iter().enumerate() {
            let (k, v) = self.token_kv_under(lora_seed, token, pos);
            digest.position(&k, &v);
        }
        self.token_of(digest.finish(tokens.len()))
    }

    /// Under a constraint: the first token the mask allows at or after `token`, wrapping
    /// around (`token` itself when the mask allows nothing in the vocabulary).
    pub fn allowed_token_from(&self, token: TokenId, mask: &[u32]) -> TokenId {
        let vocab = self.vocab_size;
        (0..vocab)
            .map(|i| TokenId(((u64::from(token.0) + i) % vocab) as u32))
            .find(|&t| ferry_core::mask_allows(mask, t))
            .unwrap_or(token)
    }

    /// The key of a request's KV and digest: the weight version's seed, with the adapter's
    /// mixed in.
    fn key(&self, lora_seed: Option<u64>) -> u64 {
        match lora_seed {
            None => self.seed,
            Some(l) => fmix64(self.seed ^ fmix64(l ^ STEP_CONSTANT)),
        }
    }

    /// The adapter seed of `r`'s adapter (checked loaded by `validate`).
    fn lora_seed_of(&self, r: &ScheduledReq) -> Option<u64> {
        r.lora.and_then(|id| self.loras.get(&id).copied())
    }

    fn token_of(&self, digest: u64) -> TokenId {
        // In range: vocab_size <= 2^32.
        TokenId((digest % self.vocab_size) as u32)
    }

    /// Digest of the KV of positions `0..end`, read from `kv` through `table`, keyed by `key`.
    fn sequence_digest(
        &self,
        kv: &KvArena,
        table: &[BlockId],
        block_size: usize,
        (end, key): (usize, u64),
    ) -> u64 {
        let mut digest = Digest::new(key);
        for (j, &block) in table.iter().enumerate().take(end.div_ceil(block_size)) {
            // One block slice per block, not per token: this loop is the model's hot path.
            let (k_plane, v_plane) = (
                kv.plane(block, 0, KvPlane::K),
                kv.plane(block, 0, KvPlane::V),
            );
            let n = (end - j * block_size).min(block_size);
            for (k, v) in k_plane
                .chunks_exact(HEAD_DIM)
                .zip(v_plane.chunks_exact(HEAD_DIM))
                .take(n)
            {
                digest.position(k, v);
            }
        }
        digest.finish(end)
    }

    fn write_tokens(&self, plan: &StepPlan, r: &ScheduledReq, kv: &mut KvArena) {
        let table = plan.block_table_of(r);
        let lora_seed = self.lora_seed_of(r);
        for (i, &token) in plan.tokens_of(r).iter().enumerate() {
            let pos = r.start_pos + i;
            let (block, slot) = (table[pos / plan.block_size], pos % plan.block_size);
            let (k, v) = self.token_kv_under(lora_seed, token, pos);
            kv.token_mut(block, slot, 0, KvPlane::K).copy_from_slice(&k);
            kv.token_mut(block, slot, 0, KvPlane::V).copy_from_slice(&v);
        }
    }

    fn sample_one(
        &self,
        plan: &StepPlan,
        r: &ScheduledReq,
        spec: &SampleSpec,
        kv: &KvArena,
    ) -> SampledToken {
        let end = r.start_pos + r.tokens.len();
        let key = self.key(self.lora_seed_of(r));
        let digest = self.sequence_digest(kv, plan.block_table_of(r), plan.block_size, (end, key));
        let token = match plan.mask_of(spec) {
            Some(mask) => self.allowed_token_from(self.token_of(digest), mask),
            None => self.token_of(digest),
        };
        let top_logprobs = match spec.params.logprobs {
            Some(n) if n > 0 => vec![(token, 0.0)],
            _ => Vec::new(),
        };
        SampledToken {
            req: r.req,
            token,
            logprob: 0.0,
            top_logprobs,
        }
    }

    /// Checks everything `execute` indexes, so the step itself cannot panic or write out of
    /// place.
    fn validate(&self, plan: &StepPlan, kv: &KvArena) -> Result<(), ExecError> {
        if plan.block_size == 0 {
            return Err(invalid("block_size is 0".into()));
        }
        let want = self.kv_layout(plan.block_size);
        if kv.layout() != want {
            return Err(invalid(format!(
                "arena layout {:?} is not the checksum model's {want:?}",
                kv.layout()
            )));
        }
        plan.reqs
            .iter()
            .try_for_each(|r| self.validate_req(plan, r, kv.n_blocks()))
    }

    fn validate_req(
        &self,
        plan: &StepPlan,
        r: &ScheduledReq,
        n_blocks: usize,
    ) -> Result<(), ExecError> {
        let req = r.req;
        if let Some(id) = r.lora.filter(|id| !self.loras.contains_key(id)) {
            return Err(ExecError::LoraNotLoaded(id));
        }
        let tokens = plan.token_ids.get(r.tokens.clone()).ok_or_else(|| {
            invalid(format!(
                "request {req:?}: tokens {:?} are outside token_ids (length {})",
                r.tokens,
                plan.token_ids.len()
            ))
        })?;
        let table = plan.block_tables.get(r.blocks.clone()).ok_or_else(|| {
            invalid(format!(
                "request {req:?}: blocks {:?} are outside block_tables (length {})",
                r.blocks,
                plan.block_tables.len()
            ))
        })?;
        if let Some(i) = tokens
            .iter()
            .position(|&t| u64::from(t.0) >= self.vocab_size)
        {
            return Err(invalid(format!(
                "request {req:?}: token {} at position {} is outside the vocabulary of {}",
                tokens[i],
                r.start_pos + i,
                self.vocab_size
            )));
        }
        let end = r.start_pos.checked_add(tokens.len()).ok_or_else(|| {
            invalid(format!(
                "request {req:?}: start_pos {} overflows",
                r.start_pos
            ))
        })?;
        if r.sample.is_some() && end == 0 {
            return Err(invalid(format!(
                "request {req:?}: asks for a sample of an empty sequence"
            )));
        }
        let needed = end.div_ceil(plan.block_size);
        if table.len() < needed {
            return Err(invalid(format!(
                "request {req:?}: block table has {} blocks, positions 0..{end} need {needed}",
                table.len()
            )));
        }
        for (j, &block) in table.iter().enumerate() {
            if block.index() >= n_blocks {
                return Err(invalid(format!(
                    "request {req:?}: block table entry {j} is block {block}, the arena has {n_blocks} blocks"
                )));
            }
            if block == BlockId::NULL && j < needed {
                return Err(invalid(format!(
                    "request {req:?}: block table entry {j} is the null block 0"
                )));
            }
        }
        Ok(())
    }
}

impl Executor for ChecksumModel {
    fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: HEAD_DIM,
            block_size,
            aux_floats: 0,
        }
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size as usize
    }

    /// Validates the whole plan first (nothing is written on error), then writes every
    /// scheduled token's KV, then samples: a request's digest sees this step's writes.
    fn execute(&mut self, plan: &StepPlan, kv: &mut KvArena) -> Result<ModelOutput, ExecError> {
        if !kv.is_allocated() {
            return Err(ExecError::ArenaReleased);
        }
        if self.weights.residency() != WeightResidency::Resident {
            return Err(ExecError::WeightsUnloaded);
        }
        if let Some(version) = self.weights.version.take() {
            self.set_weight_version(version);
        }
        self.validate(plan, kv)?;
        for r in &plan.reqs {
            self.write_tokens(plan, r, kv);
        }
        let sampled = plan
            .reqs
            .iter()
            .filter_map(|r| r.sample.as_ref().map(|s| self.sample_one(plan, r, s, kv)))
            .collect();
        Ok(ModelOutput {
            sampled,
            ..ModelOutput::default()
        })
    }

    fn weight_ops(&self) -> &dyn ModelWeights {
        &self.weights
    }

    fn weight_ops_mut(&mut self) -> &mut dyn ModelWeights {
        &mut self.weights
    }

    /// Holds the adapter's seed: the adapter's values are not computed with, only hashed.
    fn load_lora(&mut self, id: LoraId, adapter: Arc<LoraAdapter>) -> Result<(), ExecError> {
        self.loras.insert(id, adapter.seed());
        Ok(())
    }

    fn unload_lora(&mut self, id: LoraId) -> Result<(), ExecError> {
        self.loras
            .remove(&id)
            .map(drop)
            .ok_or(ExecError::LoraNotLoaded(id))
    }
}

/// The checksum model's weights: none, but an update's version changes its KV.
#[derive(Debug, Clone, Default)]
struct ChecksumWeights {
    states: Weightless,
    /// A version set by an update, for `ChecksumModel` to pick up at its next step.
    version: Option<String>,
}

impl ModelWeights for ChecksumWeights {
    fn preparer(&self) -> Arc<dyn WeightPreparer> {
        self.states.preparer()
    }

    fn install(&mut self, weights: PreparedWeights) -> Result<Option<RetiredWeights>, WeightError> {
        self.states.install(weights)
    }

    fn set_version(&mut self, version: &str) {
        self.version = Some(version.to_owned());
    }

    fn offload(&mut self) {
        self.states.offload();
    }

    fn drop_weights(&mut self) -> Option<RetiredWeights> {
        self.states.drop_weights()
    }

    fn restore(&mut self) -> Result<(), ExecError> {
        self.states.restore()
    }

    fn lend(&mut self) -> Option<RetiredWeights> {
        self.states.lend()
    }

    fn take_back(&mut self, weights: Option<PreparedWeights>) -> Result<(), WeightError> {
        self.states.take_back(weights)
    }

    fn residency(&self) -> WeightResidency {
        self.states.residency()
    }
}

fn invalid(message: String) -> ExecError {
    ExecError::InvalidPlan(message)
}

/// The weight version string as a 64-bit seed (first 8 bytes of its BLAKE3 hash).
fn version_seed(weight_version: &str) -> u64 {
    let hash = blake3::hash(weight_version.as_bytes());
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(seed)
}

/// MurmurHash3's 64-bit finalizer: a bijection on `u64` with full avalanche. Written by hand
/// because the digest needs exactly this property (bijective steps) and it is five lines.
fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

fn low24(x: u64) -> f32 {
    (x & 0xFF_FFFF) as f32
}

/// The running KV digest (see the module doc).
#[derive(Debug)]
struct Digest {
    h: u64,
}

impl Digest {
    fn new(seed: u64) -> Self {
        Self { h: fmix64(seed) }
    }

    /// Folds in one position's K and V. The position's words are first chained into their
    /// own hash (independent of `h`, so the CPU overlaps consecutive positions), and only that
    /// enters the serial chain on `h`: one dependent step per position instead of four.
    fn position(&mut self, k: &[f32], v: &[f32]) {
        let mut words = k.chunks_exact(2).chain(v.chunks_exact(2));
        let mut p = STEP_CONSTANT;
        for pair in &mut words {
            let word = u64::from(pair[0].to_bits()) | (u64::from(pair[1].to_bits()) << 32);
            p = fmix64(p ^ word);
        }
        self.h = fmix64(self.h ^ p).wrapping_add(STEP_CONSTANT);
    }

    fn finish(&self, n_positions: usize) -> u64 {
        fmix64(self.h ^ n_positions as u64)
    }
}

#[cfg(test)]
mod tests;
