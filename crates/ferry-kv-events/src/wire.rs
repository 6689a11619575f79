//! A KV event batch as msgpack, in vLLM's positional layout.
//!
//! Pinned to vLLM 0.11.0, `vllm/distributed/kv_events.py`, whose structs are `array_like`
//! (each one an array of its fields in declaration order; a tagged event starts with its class
//! name) with `omit_defaults` (trailing fields equal to their default left out):
//!
//! ```text
//! EventBatch      [ts: float, events: [...], data_parallel_rank: int, weight_version: str, epoch: int]
//! BlockStored     ["BlockStored", block_hashes: [int], parent_block_hash: int | nil,
//!                  token_ids: [int], block_size: int, lora_id: nil, medium: str]
//! BlockRemoved    ["BlockRemoved", block_hashes: [int], medium: str]
//! AllBlocksCleared ["AllBlocksCleared"]
//! ```
//!
//! `weight_version` and `epoch` are ferry's: trailing fields, which msgspec's decoder of
//! vLLM's `KVEventBatch` ignores, so vLLM's consumers read ferry's batches unchanged; ferry's
//! own consumer (the proxy) uses them to drop what a wipe made stale. `data_parallel_rank` is
//! always written (0), since the fields after it must stay in place.

use std::sync::Arc;

use ferry_core::{KvEvent, KvEventBatch, Medium};
use rmpv::Value;

/// Encodes a batch stamped `ts` (seconds since the Unix epoch).
pub fn encode(batch: &KvEventBatch, ts: f64) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_f64, write_nil, write_str, write_uint};
    // Writing into a Vec cannot fail.
    let mut b = Vec::with_capacity(64 + batch.events.len() * 32);
    let w = &mut b;
    write_array_len(w, 5).unwrap();
    write_f64(w, ts).unwrap();
    write_array_len(w, batch.events.len() as u32).unwrap();
    for event in &batch.events {
        match event {
            KvEvent::Stored {
                hashes,
                parent,
                tokens,
                medium,
            } => {
                write_array_len(w, 7).unwrap();
                write_str(w, "BlockStored").unwrap();
                write_uints(w, hashes.iter().copied());
                match parent {
                    Some(p) => {
                        write_uint(w, *p).unwrap();
                    }
                    None => write_nil(w).unwrap(),
                }
                write_uints(w, tokens.iter().map(|&t| u64::from(t)));
                write_uint(w, batch.block_size as u64).unwrap();
                write_nil(w).unwrap();
                write_str(w, medium.as_str()).unwrap();
            }
            KvEvent::Removed { hashes, medium } => {
                write_array_len(w, 3).unwrap();
                write_str(w, "BlockRemoved").unwrap();
                write_uints(w, hashes.iter().copied());
                write_str(w, medium.as_str()).unwrap();
            }
            KvEvent::AllCleared => {
                write_array_len(w, 1).unwrap();
                write_str(w, "AllBlocksCleared").unwrap();
            }
        }
    }
    write_uint(w, 0).unwrap();
    write_str(w, &batch.weight_version).unwrap();
    write_uint(w, batch.epoch).unwrap();
    b
}

fn write_uints(w: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    rmp::encode::write_array_len(w, values.len() as u32).unwrap();
    for v in values {
        rmp::encode::write_uint(w, v).unwrap();
    }
}

/// A batch that is not in the layout above, and why.
#[derive(Debug, thiserror::Error)]
#[error("KV event batch: {0}")]
pub struct DecodeError(String);

/// A decoded batch: its stamp and what it says. Batches from vLLM (no trailing fields) decode
/// with an empty weight version and epoch 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub ts: f64,
    pub batch: KvEventBatch,
}

/// Decodes a batch (ferry's or vLLM 0.11's).
pub fn decode(mut bytes: &[u8]) -> Result<Decoded, DecodeError> {
    let bad = |what: &str| DecodeError(what.to_owned());
    let value = rmpv::decode::read_value(&mut bytes).map_err(|e| DecodeError(e.to_string()))?;
    let fields = value.as_array().ok_or_else(|| bad("not an array"))?;
    let ts = fields
        .first()
        .and_then(Value::as_f64)
        .ok_or_else(|| bad("no ts"))?;
    let raw = fields
        .get(1)
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no events"))?;
    let weight_version: Arc<str> = Arc::from(fields.get(3).and_then(Value::as_str).unwrap_or(""));
    let epoch = fields.get(4).and_then(Value::as_u64).unwrap_or(0);
    let mut block_size = 0;
    let mut events = Vec::with_capacity(raw.len());
    for e in raw {
        let f = e
            .as_array()
            .ok_or_else(|| bad("an event is not an array"))?;
        let uints = |i: usize| -> Result<Vec<u64>, DecodeError> {
            f.get(i)
                .and_then(Value::as_array)
                .ok_or_else(|| bad("a list of ints is missing"))?
                .iter()
                .map(|v| v.as_u64().ok_or_else(|| bad("not an unsigned int")))
                .collect()
        };
        let medium = |i: usize| match f.get(i).and_then(Value::as_str) {
            Some("CPU") => Medium::Tier,
            _ => Medium::Primary,
        };
        events.push(match f.first().and_then(Value::as_str) {
            Some("BlockStored") => {
                block_size = f.get(4).and_then(Value::as_u64).unwrap_or(0) as usize;
                KvEvent::Stored {
                    hashes: uints(1)?,
                    parent: f.get(2).and_then(Value::as_u64),
                    tokens: uints(3)?.into_iter().map(|t| t as u32).collect(),
                    medium: medium(6),
                }
            }
            Some("BlockRemoved") => KvEvent::Removed {
                hashes: uints(1)?,
                medium: medium(2),
            },
            Some("AllBlocksCleared") => KvEvent::AllCleared,
            other => return Err(DecodeError(format!("unknown event tag {other:?}"))),
        });
    }
    Ok(Decoded {
        ts,
        batch: KvEventBatch {
            events,
            block_size,
            weight_version,
            epoch,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_round_trips_in_vllms_layout() {
        let batch = KvEventBatch {
            events: vec![
                KvEvent::AllCleared,
                KvEvent::Stored {
                    hashes: vec![u64::MAX, 7],
                    parent: None,
                    tokens: vec![1, 2, 3, 4],
                    medium: Medium::Primary,
                },
                KvEvent::Stored {
                    hashes: vec![8],
                    parent: Some(7),
                    tokens: vec![5, 6],
                    medium: Medium::Primary,
                },
                KvEvent::Removed {
                    hashes: vec![9],
                    medium: Medium::Tier,
                },
            ],
            block_size: 2,
            weight_version: Arc::from("w1"),
            epoch: 3,
        };
        let bytes = encode(&batch, 12.5);
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let fields = value.as_array().unwrap();
        assert_eq!(fields.len(), 5);
        let stored = fields[1].as_array().unwrap()[1].as_array().unwrap();
        assert_eq!(stored[0].as_str(), Some("BlockStored"));
        assert!(stored[2].is_nil());
        assert_eq!(stored[4].as_u64(), Some(2));
        assert!(stored[5].is_nil());
        assert_eq!(stored[6].as_str(), Some("GPU"));
        let back = decode(&bytes).unwrap();
        assert_eq!(back.ts, 12.5);
        assert_eq!(back.batch, batch);
    }
}
