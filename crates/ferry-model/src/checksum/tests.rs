//! Tests of the checksum model: every KV byte of the sequence matters, nothing else does;
//! chunking and block placement do not; weight versions and wrong block tables do; bad plans
//! are refused with a message naming the problem.

use ferry_core::sampling::SamplerSpec;
use ferry_core::ReqIdx;

use super::*;

const BLOCK_SIZE: usize = 4;

/// One request's part of a hand-built plan.
struct Part {
    req: u32,
    start_pos: usize,
    tokens: Vec<TokenId>,
    table: Vec<BlockId>,
    sample: bool,
}

fn part(start_pos: usize, tokens: &[TokenId], table: &[BlockId], sample: bool) -> Part {
    Part {
        req: 0,
        start_pos,
        tokens: tokens.to_vec(),
        table: table.to_vec(),
        sample,
    }
}

fn sample_spec(logprobs: Option<u32>) -> SampleSpec {
    SampleSpec {
        params: SamplerSpec {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            seed_stream: 0,
            logprobs,
        },
        output_idx: 0,
        mask: None,
        adjust: None,
    }
}

fn plan(parts: Vec<Part>) -> StepPlan {
    let mut plan = StepPlan {
        step: 0,
        block_size: BLOCK_SIZE,
        ..StepPlan::default()
    };
    for p in parts {
        let tokens = plan.token_ids.len()..plan.token_ids.len() + p.tokens.len();
        let blocks = plan.block_tables.len()..plan.block_tables.len() + p.table.len();
        plan.token_ids.extend(&p.tokens);
        plan.block_tables.extend(&p.table);
        plan.reqs.push(ScheduledReq {
            lora: None,
            req: ReqIdx(p.req),
            start_pos: p.start_pos,
            tokens,
            blocks,
            sample: p.sample.then(|| sample_spec(None)),
        });
    }
    plan
}

fn model(vocab_size: usize) -> ChecksumModel {
    ChecksumModel::new("v1", vocab_size).unwrap()
}

fn arena(model: &ChecksumModel, n_blocks: usize) -> KvArena {
    KvArena::new(model.kv_layout(BLOCK_SIZE), n_blocks)
}

fn prompt(n: u32) -> Vec<TokenId> {
    (0..n).map(|i| TokenId((i * 7919 + 13) % 1000)).collect()
}

/// Runs `tokens` as a prefill in chunks of the given sizes, sampling after the last one.
fn prefill_chunked(
    m: &mut ChecksumModel,
    kv: &mut KvArena,
    tokens: &[TokenId],
    table: &[BlockId],
    chunks: &[usize],
) -> TokenId {
    let mut start = 0;
    let mut out = None;
    for (i, &len) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let p = plan(vec![part(start, &tokens[start..start + len], table, last)]);
        let sampled = m.execute(&p, kv).unwrap().sampled;
        assert_eq!(sampled.len(), usize::from(last));
        out = sampled.first().map(|s| s.token);
        start += len;
    }
    assert_eq!(start, tokens.len());
    out.unwrap()
}

fn prefill(
    m: &mut ChecksumModel,
    kv: &mut KvArena,
    tokens: &[TokenId],
    table: &[BlockId],
) -> TokenId {
    prefill_chunked(m, kv, tokens, table, &[tokens.len()])
}

#[test]
fn prefill_samples_the_reference_token_and_writes_each_slot() {
    let mut m = model(1000);
    let mut kv = arena(&m, 8);
    let tokens = prompt(10);
    let table = [3, 1, 6].map(BlockId);
    assert_eq!(
        prefill(&mut m, &mut kv, &tokens, &table),
        m.reference_next_token(&tokens)
    );
    for (pos, &t) in tokens.iter().enumerate() {
        let (block, slot) = (table[pos / BLOCK_SIZE], pos % BLOCK_SIZE);
        let (k, v) = m.token_kv(t, pos);
        assert_eq!(kv.token(block, slot, 0, KvPlane::K), k);
        assert_eq!(kv.token(block, slot, 0, KvPlane::V), v);
    }
    // Values are 24-bit integers, exact in f32.
    let (k, _) = m.token_kv(TokenId(5), 3);
    assert!(k
        .iter()
        .all(|&x| x.fract() == 0.0 && (0.0..16_777_216.0).contains(&x)));
}

#[test]
fn chunked_prefill_and_block_placement_do_not_change_the_token() {
    let tokens = prompt(23);
    let mut m = model(50_000);
    let want = m.reference_next_token(&tokens);
    for chunks in [&[23][..], &[11, 12], &[5, 5, 5, 5, 3], &[1, 4, 6, 2, 10]] {
        let mut kv = arena(&m, 16);
        let table = [9, 2, 14, 3, 7, 1].map(BlockId);
        assert_eq!(
            prefill_chunked(&mut m, &mut kv, &tokens, &table, chunks),
            want,
            "{chunks:?}"
        );
    }
}

#[test]
fn decode_continues_the_sequence() {
    let mut m = model(1000);
    let mut kv = arena(&m, 8);
    let mut tokens = prompt(7);
    let table = [2, 5, 4].map(BlockId);
    let mut next = prefill(&mut m, &mut kv, &tokens, &table);
    for _ in 0..4 {
        let p = plan(vec![part(tokens.len(), &[next], &table, true)]);
        tokens.push(next);
        next = m.execute(&p, &mut kv).unwrap().sampled[0].token;
        assert_eq!(next, m.reference_next_token(&tokens));
    }
}

/// Flips every bit of every KV byte of a 10-token sequence (3 blocks): the 64-bit digest
/// changes every time (guaranteed by construction), and so does the sampled token with a
/// 2^32 vocabulary; flips outside the sequence (the last block's unused slots, other blocks)
/// change nothing.
#[test]
fn every_kv_bit_of_the_sequence_changes_the_output() {
    let mut m = model(1 << 32);
    let mut kv = arena(&m, 6);
    let tokens = prompt(10);
    let table = [4, 1, 2].map(BlockId);
    prefill(&mut m, &mut kv, &tokens, &table);
    let base_digest = m.sequence_digest(&kv, &table, BLOCK_SIZE, (10, m.seed));
    // Decoding only the last token again rewrites slot 9 and samples from everything.
    let last = plan(vec![part(9, &tokens[9..], &table, true)]);
    let base_token = m.execute(&last, &mut kv).unwrap().sampled[0].token;
    let block_bytes = kv.layout().block_bytes();

    let (mut inside, mut outside) = (0, 0);
    for block in (0..6).map(BlockId) {
        for byte in 0..block_bytes {
            let slot = (byte / 4) % (BLOCK_SIZE * HEAD_DIM) / HEAD_DIM;
            let pos = table
                .iter()
                .position(|&b| b == block)
                .map(|j| j * BLOCK_SIZE + slot);
            for bit in 0..8 {
                kv.block_bytes_mut(block)[byte] ^= 1 << bit;
                let digest = m.sequence_digest(&kv, &table, BLOCK_SIZE, (10, m.seed));
                let in_sequence = pos.is_some_and(|p| p < 10);
                assert_eq!(
                    digest != base_digest,
                    in_sequence,
                    "block {block} byte {byte} bit {bit}"
                );
                if pos.is_some_and(|p| p < 9) {
                    let token = m.execute(&last, &mut kv).unwrap().sampled[0].token;
                    assert_ne!(token, base_token, "block {block} byte {byte} bit {bit}");
                }
                kv.block_bytes_mut(block)[byte] ^= 1 << bit;
                if in_sequence {
                    inside += 1;
                } else {
                    outside += 1;
                }
            }
        }
    }
    assert_eq!(inside, 10 * 2 * HEAD_DIM * 4 * 8);
    assert_eq!(outside, (6 * block_bytes - 10 * 32) * 8);
    assert_eq!(
        m.execute(&last, &mut kv).unwrap().sampled[0].token,
        base_token
    );
}

/// With a realistic vocabulary, the token still changes for the overwhelming majority of
/// single-byte changes (a collision has probability 1/vocab per change).
#[test]
fn byte_changes_change_the_token_with_a_small_vocab() {
    let mut m = model(49_152);
    let mut kv = arena(&m, 4);
    let tokens = prompt(9);
    let table = [1, 2, 3].map(BlockId);
    prefill(&mut m, &mut kv, &tokens, &table);
    let last = plan(vec![part(8, &tokens[8..], &table, true)]);
    let base = m.execute(&last, &mut kv).unwrap().sampled[0].token;
    let (mut changed, mut total) = (0, 0);
    for (j, &block) in table.iter().enumerate() {
        for byte in 0..kv.layout().block_bytes() {
            let slot = (byte / 4) % (BLOCK_SIZE * HEAD_DIM) / HEAD_DIM;
            if j * BLOCK_SIZE + slot >= 8 {
                continue;
            }
            kv.block_bytes_mut(block)[byte] ^= 0xA5;
            changed += usize::from(m.execute(&last, &mut kv).unwrap().sampled[0].token != base);
            total += 1;
            kv.block_bytes_mut(block)[byte] ^= 0xA5;
        }
    }
    assert_eq!(total, 8 * 32);
    assert!(changed >= total - 1, "{changed} of {total} changes showed");
}

#[test]
fn weight_version_changes_kv_and_output() {
    let mut a = model(1 << 32);
    let b = ChecksumModel::new("v2", 1 << 32).unwrap();
    let tokens = prompt(12);
    assert_ne!(a.token_kv(TokenId(5), 3), b.token_kv(TokenId(5), 3));
    assert_ne!(
        a.reference_next_token(&tokens),
        b.reference_next_token(&tokens)
    );

    // Stale KV: written under v1, then the weights change and only the last token is decoded.
    let mut kv = arena(&a, 4);
    let table = [1, 2, 3].map(BlockId);
    prefill(&mut a, &mut kv, &tokens, &table);
    a.set_weight_version("v2");
    assert_eq!(a.weight_version(), "v2");
    let last = plan(vec![part(11, &tokens[11..], &table, true)]);
    let stale = a.execute(&last, &mut kv).unwrap().sampled[0].token;
    assert_ne!(stale, b.reference_next_token(&tokens));
    // Recomputing everything under v2 gives v2's answer.
    assert_eq!(
        prefill(&mut a, &mut kv, &tokens, &table),
        b.reference_next_token(&tokens)
    );
}

#[test]
fn a_wrong_block_table_changes_the_output() {
    let mut m = model(1 << 32);
    let mut kv = arena(&m, 8);
    let a = prompt(12);
    let b: Vec<TokenId> = a.iter().map(|t| TokenId(t.0 + 1)).collect();
    let want = prefill(&mut m, &mut kv, &a, &BlockId::list([1, 2, 3]));
    prefill(&mut m, &mut kv, &b, &BlockId::list([4, 5, 6]));
    // Decode a's last token again, but with a's middle block swapped for b's, or the order
    // of two of a's blocks swapped, or a never-written block.
    for table in [[1, 5, 3], [2, 1, 3], [1, 7, 3]].map(|t| t.map(BlockId)) {
        let last = plan(vec![part(11, &a[11..], &table, true)]);
        let got = m.execute(&last, &mut kv).unwrap().sampled[0].token;
        assert_ne!(got, want, "table {table:?}");
    }
    let right = plan(vec![part(11, &a[11..], &BlockId::list([1, 2, 3]), true)]);
    assert_eq!(m.execute(&right, &mut kv).unwrap().sampled[0].token, want);
}

#[test]
fn batched_requests_sample_in_plan_order() {
    let mut m = model(1000);
    let mut kv = arena(&m, 8);
    let (a, b) = (prompt(5), prompt(9));
    let mut p = plan(vec![
        part(0, &b, &BlockId::list([4, 5, 6]), true),
        part(0, &a[..3], &BlockId::list([1, 2]), false),
    ]);
    p.reqs[0].req = ReqIdx(9);
    p.reqs[1].req = ReqIdx(3);
    let out = m.execute(&p, &mut kv).unwrap().sampled;
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].req, out[0].token),
        (ReqIdx(9), m.reference_next_token(&b))
    );
    let mut p = plan(vec![
        part(3, &a[3..], &BlockId::list([1, 2]), true),
        part(9, &[TokenId(7)], &BlockId::list([4, 5, 6]), true),
    ]);
    p.reqs[0].req = ReqIdx(3);
    p.reqs[1].req = ReqIdx(9);
    let out = m.execute(&p, &mut kv).unwrap().sampled;
    let mut b7 = b.clone();
    b7.push(TokenId(7));
    assert_eq!(out[0].token, m.reference_next_token(&a));
    assert_eq!(out[1].token, m.reference_next_token(&b7));
    assert_eq!((out[0].req, out[1].req), (ReqIdx(3), ReqIdx(9)));
}

#[test]
fn logprobs_are_a_point_mass() {
    let mut m = model(1000);
    let mut kv = arena(&m, 4);
    let mut p = plan(vec![part(0, &prompt(3), &[BlockId(1)], true)]);
    let out = m.execute(&p, &mut kv).unwrap().sampled;
    assert_eq!(out[0].logprob, 0.0);
    assert!(out[0].top_logprobs.is_empty());
    p.reqs[0].sample = Some(sample_spec(Some(5)));
    let out = m.execute(&p, &mut kv).unwrap().sampled;
    assert_eq!(out[0].top_logprobs, vec![(out[0].token, 0.0)]);
}

fn expect_invalid(m: &mut ChecksumModel, kv: &mut KvArena, p: &StepPlan, needle: &str) {
    match m.execute(p, kv) {
        Err(ExecError::InvalidPlan(msg)) => {
            assert!(msg.contains(needle), "{msg:?} lacks {needle:?}")
        }
        other => panic!("expected InvalidPlan containing {needle:?}, got {other:?}"),
    }
}

#[test]
fn invalid_plans_are_refused_and_write_nothing() {
    let mut m = model(1000);
    let mut kv = arena(&m, 4);
    let t = prompt(6);
    let cases: Vec<(StepPlan, &str)> = vec![
        (
            plan(vec![part(0, &t, &BlockId::list([1, 4]), true)]),
            "entry 1 is block 4, the arena has 4 blocks",
        ),
        (
            plan(vec![part(0, &t, &BlockId::list([1, 0]), true)]),
            "entry 1 is the null block 0",
        ),
        (
            plan(vec![part(0, &t, &[BlockId(1)], true)]),
            "block table has 1 blocks, positions 0..6 need 2",
        ),
        (
            plan(vec![part(4, &t, &BlockId::list([1, 2]), true)]),
            "positions 0..10 need 3",
        ),
        (
            plan(vec![part(
                0,
                &TokenId::list([1, 1000]),
                &[BlockId(1)],
                true,
            )]),
            "token 1000 at position 1 is outside the vocabulary of 1000",
        ),
        (
            plan(vec![part(0, &[], &[], true)]),
            "asks for a sample of an empty sequence",
        ),
        (
            plan(vec![
                part(0, &t, &BlockId::list([1, 2]), true),
                part(0, &t, &BlockId::list([3, 9]), false),
            ]),
            "block 9",
        ),
    ];
    for (p, needle) in &cases {
        expect_invalid(&mut m, &mut kv, p, needle);
    }
    let mut p = plan(vec![part(0, &t, &BlockId::list([1, 2]), true)]);
    p.reqs[0].tokens = 2..9;
    expect_invalid(
        &mut m,
        &mut kv,
        &p,
        "tokens 2..9 are outside token_ids (length 6)",
    );
    let mut p = plan(vec![part(0, &t, &BlockId::list([1, 2]), true)]);
    p.reqs[0].blocks = 1..3;
    expect_invalid(
        &mut m,
        &mut kv,
        &p,
        "blocks 1..3 are outside block_tables (length 2)",
    );
    let mut p = plan(vec![part(0, &t, &BlockId::list([1, 2]), true)]);
    p.block_size = 0;
    expect_invalid(&mut m, &mut kv, &p, "block_size is 0");
    p.block_size = 8;
    expect_invalid(&mut m, &mut kv, &p, "is not the checksum model's");
    // A refused plan wrote nothing (the first request of the last case was valid).
    assert!(kv.as_slice().iter().all(|&x| x == 0.0));

    kv.release();
    let ok = plan(vec![part(0, &t, &BlockId::list([1, 2]), true)]);
    assert!(matches!(
        m.execute(&ok, &mut kv),
        Err(ExecError::ArenaReleased)
    ));
    kv.reallocate();
    assert!(m.execute(&ok, &mut kv).is_ok());
}

#[test]
fn vocab_size_is_checked() {
    assert_eq!(
        ChecksumModel::new("v", 0).unwrap_err(),
        ChecksumConfigError::VocabSize(0)
    );
    assert!(ChecksumModel::new("v", (1 << 32) + 1).is_err());
    assert_eq!(model(1 << 32).vocab_size(), 1 << 32);
}

/// An adapter of the small test config, from seed `seed`.
fn adapter(seed: u64) -> Arc<LoraAdapter> {
    use crate::lora::random::{random_lora, RandomLora};
    let base = crate::random_model::small_config();
    let spec = RandomLora {
        rank: 2,
        alpha: 4.0,
        targets: vec![crate::TargetModule::QProj],
        use_rslora: false,
        seed,
    };
    let (config, tensors) = random_lora(&base, &spec);
    Arc::new(LoraAdapter::from_f32(config, &tensors, &base, 8).unwrap())
}

#[test]
fn an_adapter_keys_its_requests_and_a_new_version_changes_them() {
    let mut m = model(1000);
    let mut kv = arena(&m, 16);
    let tokens = prompt(9);
    let under =
        |m: &mut ChecksumModel, kv: &mut KvArena, lora: Option<LoraId>, table: &[BlockId]| {
            let mut p = plan(vec![part(0, &tokens, table, true)]);
            p.reqs[0].lora = lora;
            m.execute(&p, kv).map(|out| out.sampled[0].token)
        };
    let id = LoraId(3);
    assert!(matches!(
        under(&mut m, &mut kv, Some(id), &BlockId::list([1, 2, 3])),
        Err(ExecError::LoraNotLoaded(LoraId(3)))
    ));
    let (v1, v2) = (adapter(1), adapter(2));
    m.load_lora(id, Arc::clone(&v1)).unwrap();
    let base = under(&mut m, &mut kv, None, &BlockId::list([1, 2, 3])).unwrap();
    let first = under(&mut m, &mut kv, Some(id), &BlockId::list([4, 5, 6])).unwrap();
    assert_eq!(base, m.reference_next_token(&tokens));
    assert_eq!(
        first,
        m.reference_next_token_under(Some(v1.seed()), &tokens)
    );
    assert_ne!(base, first);
    assert_ne!(
        kv.token(BlockId(1), 0, 0, KvPlane::K),
        kv.token(BlockId(4), 0, 0, KvPlane::K),
        "the adapter's KV differs from the base model's"
    );

    // Reloaded in place: the next step computes with the new version.
    m.load_lora(id, Arc::clone(&v2)).unwrap();
    let second = under(&mut m, &mut kv, Some(id), &BlockId::list([7, 8, 9])).unwrap();
    assert_eq!(
        second,
        m.reference_next_token_under(Some(v2.seed()), &tokens)
    );
    assert_ne!(second, first);
    // The same adapter again gives the same seed.
    assert_eq!(adapter(1).seed(), v1.seed());

    m.unload_lora(id).unwrap();
    assert!(matches!(
        under(&mut m, &mut kv, Some(id), &BlockId::list([10, 11, 12])),
        Err(ExecError::LoraNotLoaded(_))
    ));
    assert!(matches!(
        m.unload_lora(id),
        Err(ExecError::LoraNotLoaded(_))
    ));
}
