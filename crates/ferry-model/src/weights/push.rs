//! A tensor push read as it arrives: [`SafetensorsPush`] takes a safetensors body in pieces
//! of any size (network chunks, or the whole body at once) and converts every tensor's bytes
//! straight into its slot of the prepared update ([`WeightSlots`]).
//!
//! Nothing holds the whole body: a pushed model costs the new weights plus the piece in hand,
//! where reading the body first cost the body, a parsed f32 copy and the converted weights
//! (three extra copies of a full push). Sans-IO: the caller feeds bytes and calls `finish`;
//! which thread does it and where the bytes come from are the caller's business.
//!
//! A matrix arrives in the dtype it was pushed in (F32, F16, BF16) and stays in it: a
//! trainer's bf16 push into a Q4_1 model makes those tensors bf16, never re-quantized, so the
//! model computes exactly the trainer's weights.
//!
//! The header is checked in full (every dtype, then every name and shape, each in name order)
//! before a slot exists, so a refused push costs no weight memory and names the first bad
//! tensor as [`crate::parse_safetensors`] and [`WeightPreparer::prepare`] do.

use std::collections::BTreeSet;
use std::sync::Arc;

use safetensors::tensor::Metadata;
use safetensors::Dtype;

use crate::dtype::WeightDtype;
use crate::dtype::{decode_into, f32_source_width};
use crate::weights::update::{PreparedWeights, WeightError, WeightPreparer, WeightSlots};

/// Bytes of the length prefix of a safetensors header.
const HEADER_LEN_BYTES: usize = 8;
/// The largest header accepted, as the `safetensors` crate's own limit: the JSON of a model
/// with thousands of tensors is a few hundred kilobytes.
const MAX_HEADER_BYTES: usize = 100_000_000;

/// One tensor's bytes in the data section, in data order.
#[derive(Debug, Clone, Copy)]
struct Segment {
    /// Its index in the list the slots were made for.
    slot_idx: usize,
    dtype: Dtype,
    /// Bytes per element.
    width: usize,
    /// Kept in its own dtype: the bytes are copied as they come, not converted to f32.
    raw: bool,
    /// Byte offsets in the data section.
    start: usize,
    end: usize,
}

/// Where a push stands.
enum Stage {
    /// Collecting the length prefix and the JSON header.
    Header { bytes: Vec<u8> },
    /// Converting the data section into the slots.
    Data(DataStage),
}

struct DataStage {
    slots: Box<dyn WeightSlots>,
    /// The tensors' names, in name order.
    names: Vec<String>,
    segments: Vec<Segment>,
    /// The segment the next byte belongs to.
    seg_idx: usize,
    /// Data-section bytes consumed so far.
    pos: usize,
    data_len: usize,
    /// The first bytes of an element split across two pieces.
    carry: [u8; 4],
    n_carry: usize,
}

/// A safetensors body being read into a prepared update (see the module docs).
pub struct SafetensorsPush {
    preparer: Arc<dyn WeightPreparer>,
    /// Names this push may not hold: tensors an earlier bucket of the same upload staged.
    taken: BTreeSet<String>,
    stage: Stage,
}

impl std::fmt::Debug for SafetensorsPush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("SafetensorsPush");
        match &self.stage {
            Stage::Header { bytes } => d.field("header_bytes", &bytes.len()),
            Stage::Data(data) => d.field("data_bytes", &data.pos).field("of", &data.data_len),
        };
        d.finish_non_exhaustive()
    }
}

impl SafetensorsPush {
    pub fn new(preparer: Arc<dyn WeightPreparer>) -> Self {
        Self::excluding(preparer, BTreeSet::new())
    }

    /// A push refusing the tensors named in `taken` ([`WeightError::Duplicate`]): one bucket
    /// of an upload whose earlier buckets staged them.
    pub fn excluding(preparer: Arc<dyn WeightPreparer>, taken: BTreeSet<String>) -> Self {
        Self {
            preparer,
            taken,
            stage: Stage::Header { bytes: Vec::new() },
        }
    }

    /// Reads the next piece of the body. After an error the push is refused: the caller
    /// drops it (and may stop reading the body).
    pub fn feed(&mut self, mut piece: &[u8]) -> Result<(), WeightError> {
        if let Stage::Header { bytes } = &mut self.stage {
            let Some(data) = header_piece(bytes, &mut piece)? else {
                return Ok(());
            };
            self.stage = Stage::Data(self.start_data(&data)?);
        }
        match &mut self.stage {
            Stage::Data(data) => data.feed(piece),
            Stage::Header { .. } => unreachable!("the header stage ended above"),
        }
    }

    /// The prepared update, once the body has ended: every tensor's bytes arrived.
    pub fn finish(self) -> Result<PreparedWeights, WeightError> {
        self.finish_named().map(|(weights, _)| weights)
    }

    /// [`SafetensorsPush::finish`], with the names of the tensors the update holds.
    pub fn finish_named(self) -> Result<(PreparedWeights, Vec<String>), WeightError> {
        match self.stage {
            Stage::Header { bytes } => Err(malformed(format!(
                "the body ends inside the header ({} bytes)",
                bytes.len()
            ))),
            Stage::Data(data) if data.pos < data.data_len => Err(malformed(format!(
                "the body ends after {} of the {} data bytes its header describes",
                data.pos, data.data_len
            ))),
            Stage::Data(data) => Ok((data.slots.finish(), data.names)),
        }
    }

    /// Checks the header (dtypes, then names and shapes) and makes the slots.
    fn start_data(&self, header: &Metadata) -> Result<DataStage, WeightError> {
        let mut by_name: Vec<_> = header.tensors().into_iter().collect();
        by_name.sort_by(|a, b| a.0.cmp(&b.0));
        if by_name.is_empty() {
            return Err(WeightError::Empty);
        }
        for (name, info) in &by_name {
            if f32_source_width(info.dtype).is_none() {
                return Err(WeightError::UnsupportedDtype {
                    name: name.clone(),
                    dtype: format!("{:?}", info.dtype),
                });
            }
        }
        // Each tensor as the parameters it holds: itself, or the per-expert parts of a
        // fused MoE tensor, each a contiguous range of its bytes.
        let mut list: Vec<(String, Vec<usize>)> = Vec::new();
        let mut ranges: Vec<(Dtype, usize, usize)> = Vec::new();
        for (name, info) in &by_name {
            let width = f32_source_width(info.dtype).unwrap_or(4);
            let (start, end) = info.data_offsets;
            match self.preparer.fused_parts(name) {
                None => {
                    list.push((name.clone(), info.shape.clone()));
                    ranges.push((info.dtype, start, end));
                }
                Some((shape, _)) if shape != info.shape => {
                    return Err(WeightError::BadShape {
                        name: name.clone(),
                        expected: shape,
                        got: info.shape.clone(),
                    });
                }
                Some((_, parts)) => {
                    for part in parts {
                        let n: usize = part.shape.iter().product();
                        let at = start + part.offset * width;
                        ranges.push((info.dtype, at, at + n * width));
                        list.push((part.name, part.shape));
                    }
                }
            }
        }
        if let Some((name, _)) = list.iter().find(|(name, _)| self.taken.contains(name)) {
            return Err(WeightError::Duplicate { name: name.clone() });
        }
        let mut slots = self.preparer.slots(&list)?;
        let mut segments: Vec<Segment> = ranges
            .iter()
            .enumerate()
            .map(|(slot_idx, &(dtype, start, end))| {
                // A matrix the executor keeps as stored arrives in its own dtype.
                let raw = WeightDtype::from_safetensors(dtype)
                    .is_some_and(|d| slots.stored_slot(slot_idx, d).is_some());
                Segment {
                    slot_idx,
                    dtype,
                    width: f32_source_width(dtype).unwrap_or(4),
                    raw,
                    start,
                    end,
                }
            })
            .collect();
        // The header was validated: offsets tile the data section from 0 in this order.
        segments.sort_by_key(|s| s.start);
        Ok(DataStage {
            slots,
            names: list.into_iter().map(|(name, _)| name).collect(),
            segments,
            seg_idx: 0,
            pos: 0,
            data_len: header.data_len(),
            carry: [0; 4],
            n_carry: 0,
        })
    }
}

/// Adds the header bytes of `piece` to `bytes` and advances `piece` past them; once the
/// header is whole, parses and validates it.
fn header_piece(bytes: &mut Vec<u8>, piece: &mut &[u8]) -> Result<Option<Metadata>, WeightError> {
    let mut take = |bytes: &mut Vec<u8>, want: usize| {
        let n = want.saturating_sub(bytes.len()).min(piece.len());
        bytes.extend_from_slice(&piece[..n]);
        *piece = &piece[n..];
        bytes.len() >= want
    };
    if !take(bytes, HEADER_LEN_BYTES) {
        return Ok(None);
    }
    let prefix: [u8; HEADER_LEN_BYTES] = bytes[..HEADER_LEN_BYTES]
        .try_into()
        .expect("the prefix is whole");
    let n_header = u64::from_le_bytes(prefix);
    let n_header = usize::try_from(n_header)
        .ok()
        .filter(|&n| n <= MAX_HEADER_BYTES)
        .ok_or_else(|| {
            malformed(format!(
                "a header of {n_header} bytes is over the limit of {MAX_HEADER_BYTES}"
            ))
        })?;
    if !take(bytes, HEADER_LEN_BYTES + n_header) {
        return Ok(None);
    }
    let metadata: Metadata = serde_json::from_slice(&bytes[HEADER_LEN_BYTES..])
        .map_err(|e| malformed(format!("invalid header: {e}")))?;
    Ok(Some(metadata))
}

impl DataStage {
    fn feed(&mut self, mut piece: &[u8]) -> Result<(), WeightError> {
        if piece.len() > self.data_len - self.pos {
            return Err(malformed(format!(
                "the body is longer than the {} data bytes its header describes",
                self.data_len
            )));
        }
        while !piece.is_empty() {
            let seg = self.segments[self.seg_idx];
            let n = (seg.end - self.pos).min(piece.len());
            let (now, rest) = piece.split_at(n);
            self.convert(seg, now);
            self.pos += n;
            piece = rest;
            if self.pos == seg.end {
                self.seg_idx += 1;
            }
        }
        Ok(())
    }

    /// Converts `bytes`, the next bytes of `seg`, into its slot: an element split across
    /// pieces is completed from the carry.
    fn convert(&mut self, seg: Segment, mut bytes: &[u8]) {
        if seg.raw {
            let at = self.pos - seg.start;
            let dtype = WeightDtype::from_safetensors(seg.dtype).expect("checked at the header");
            let out = self.slots.stored_slot(seg.slot_idx, dtype);
            let out = out.expect("the slot kept its dtype at the header");
            out[at..at + bytes.len()].copy_from_slice(bytes);
            return;
        }
        let w = seg.width;
        let mut elem = (self.pos - seg.start) / w;
        let out = self.slots.slot(seg.slot_idx);
        if self.n_carry > 0 {
            let n = (w - self.n_carry).min(bytes.len());
            self.carry[self.n_carry..self.n_carry + n].copy_from_slice(&bytes[..n]);
            self.n_carry += n;
            bytes = &bytes[n..];
            if self.n_carry < w {
                return;
            }
            decode_into(seg.dtype, &self.carry[..w], &mut out[elem..elem + 1]);
            self.n_carry = 0;
            elem += 1;
        }
        let n_whole = bytes.len() / w;
        let (whole, tail) = bytes.split_at(n_whole * w);
        decode_into(seg.dtype, whole, &mut out[elem..elem + n_whole]);
        self.carry[..tail.len()].copy_from_slice(tail);
        self.n_carry = tail.len();
    }
}

fn malformed(message: String) -> WeightError {
    WeightError::Malformed(message)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::weights::llama_update::{LlamaPayload, LlamaUpdate};
    use crate::weights::random::{random_weights, small_config};
    use crate::{parse_safetensors, LlamaPreparer, WeightStore};

    fn body(store: &WeightStore, dtype: Dtype) -> Vec<u8> {
        let raw: Vec<(String, Vec<usize>, Vec<u8>)> = store
            .tensors
            .iter()
            .map(|(name, t)| {
                let bytes = match dtype {
                    Dtype::F32 => t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    _ => t
                        .data
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                };
                (name.clone(), t.shape.clone(), bytes)
            })
            .collect();
        let views = raw.iter().map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        });
        safetensors::serialize(views, None).unwrap()
    }

    fn preparer() -> Arc<dyn WeightPreparer> {
        Arc::new(LlamaPreparer::new(small_config()))
    }

    /// The update a push makes, fed in pieces of `piece` bytes.
    fn pushed(bytes: &[u8], piece: usize) -> Result<PreparedWeights, WeightError> {
        let mut push = SafetensorsPush::new(preparer());
        for chunk in bytes.chunks(piece) {
            push.feed(chunk)?;
        }
        push.finish()
    }

    pub(crate) fn update_of(p: PreparedWeights) -> LlamaUpdate {
        p.into_payload::<LlamaPayload>().unwrap().update
    }

    /// Every float of full weights, as bits, buffer by buffer.
    pub(crate) fn bits_of(update: LlamaUpdate) -> Vec<u32> {
        let LlamaUpdate::Full(w) = update else {
            panic!("a complete set is a full update");
        };
        let mut bufs: Vec<Vec<f32>> = vec![w.embed.to_f32(), w.norm.to_vec()];
        bufs.extend(w.lm_head.as_ref().map(|m| m.to_f32()));
        for l in &w.layers {
            bufs.extend([
                l.input_norm.to_vec(),
                l.qkv.to_f32(),
                l.o_proj.to_f32(),
                l.post_norm.to_vec(),
                l.gate_up.to_f32(),
                l.down.to_f32(),
            ]);
        }
        bufs.iter()
            .flat_map(|b| b.iter().map(|x| x.to_bits()))
            .collect()
    }

    #[test]
    fn any_piece_size_gives_the_bits_of_parsing_the_whole_body() {
        for dtype in [Dtype::F32, Dtype::BF16] {
            let bytes = body(&random_weights(&small_config(), 3), dtype);
            let parsed = parse_safetensors(&bytes).unwrap();
            let want = bits_of(update_of(preparer().prepare(parsed).unwrap()));
            for piece in [1, 3, 7, 4096, bytes.len()] {
                let got = pushed(&bytes, piece).unwrap();
                assert!(got.complete, "{dtype:?}, pieces of {piece}");
                assert!(
                    bits_of(update_of(got)) == want,
                    "{dtype:?}, pieces of {piece}"
                );
            }
        }
    }

    #[test]
    fn a_partial_push_makes_patches() {
        let mut one = WeightStore::default();
        let all = random_weights(&small_config(), 4);
        let name = "model.layers.1.mlp.up_proj.weight";
        one.insert(name, all.get(name).unwrap().clone());
        let got = pushed(&body(&one, Dtype::F32), 5).unwrap();
        assert_eq!((got.n_tensors, got.complete), (1, false));
        assert_eq!(got.n_bytes, one.total_bytes());
        let LlamaUpdate::Partial(patches) = update_of(got) else {
            panic!("one tensor is a partial update");
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(patches.len(), 1);
        let mut values = vec![0.0; patches[0].data.rows() * 64];
        crate::dtype::dequantize_into(
            patches[0].data.dtype(),
            patches[0].data.bytes(),
            &mut values,
        );
        assert_eq!(bits(&values), bits(&all.get(name).unwrap().data));
    }

    #[test]
    fn a_short_long_or_broken_body_is_refused() {
        let mut one = WeightStore::default();
        let t = random_weights(&small_config(), 4)
            .get("model.norm.weight")
            .unwrap()
            .clone();
        one.insert("model.norm.weight", t);
        let bytes = body(&one, Dtype::F32);
        let message = |r: Result<PreparedWeights, WeightError>| match r {
            Err(WeightError::Malformed(m)) => m,
            other => panic!("expected a malformed body, got {other:?}"),
        };
        assert!(message(pushed(&bytes[..bytes.len() - 1], 64)).contains("ends after"));
        assert!(message(pushed(&bytes[..5], 64)).contains("inside the header"));
        let mut long = bytes.clone();
        long.push(0);
        assert!(message(pushed(&long, 64)).contains("longer"));
        let huge = u64::MAX.to_le_bytes();
        assert!(message(pushed(&huge, 64)).contains("over the limit"));
        let mut bad_json = 2u64.to_le_bytes().to_vec();
        bad_json.extend_from_slice(b"{x");
        assert!(message(pushed(&bad_json, 64)).contains("invalid header"));
        assert!(matches!(
            pushed(&body(&WeightStore::default(), Dtype::F32), 64),
            Err(WeightError::Empty)
        ));
    }
}
