//! A KV event batch as msgpack, in the layout of vLLM's `vllm/distributed/kv_events.py`.
//!
//! Pinned to vLLM 0.34.0 (the newest release; its `kv_events.py` is the same file as 0.33.0's).
//! Its batch is an `array_like` struct (an array of its fields in order); its events are
//! tagged structs, maps with a `type` key first and then their fields in declaration order,
//! those with defaults left out when equal to them (`omit_defaults`):
//!
//! ```text
//! batch            [ts: float, events: [...], data_parallel_rank: 0, weight_version: str, epoch: int]
//! BlockStored      {type: "BlockStored", block_hashes: [int], parent_block_hash: int | nil,
//!                   token_ids: [int], block_size: int, lora_id: nil, medium: "GPU",
//!                   lora_name: nil, extra_keys: [nil, ...], group_idx: 0}
//! BlockRemoved     {type: "BlockRemoved", block_hashes: [int], medium: "GPU", group_idx: 0}
//! AllBlocksCleared {type: "AllBlocksCleared"}
//! ```
//!
//! The optional fields are filled as vLLM's block pool fills them for a request without LoRA,
//! multimodal inputs or lookahead (`lora_id`, `lora_name` nil; `extra_keys` one nil per
//! block; `group_idx` 0, the one KV cache group; `session_id`, `lookahead_token_ids` and the
//! rest left out). The offload tier's blocks (`medium: "CPU"`) are written as vLLM's offloading
//! connector writes a tier block whose tokens it does not know: no tokens, no `extra_keys`.
//! msgspec gives `BlockStored` (sixteen possible keys) a 16-bit map header whatever it holds,
//! and so does [`encode`], so a batch is byte for byte what vLLM's encoder writes for the same
//! events (`tests/vllm_golden.rs` checks it against batches vLLM 0.34.0's own code published).
//!
//! `weight_version` and `epoch` are ferry's: trailing batch fields, which msgspec's decoder of
//! vLLM's `KVEventBatch` ignores (an `array_like` struct reads its fields and skips the rest),
//! so vLLM's consumers read ferry's batches unchanged; ferry's own consumer (the proxy) uses
//! them to drop what a wipe made stale. `data_parallel_rank` is always written (0), as vLLM's
//! publisher fills it, and keeps the fields after it in place.
//!
//! [`decode`] reads this layout and vLLM 0.11's (ferry's before), whose events are arrays
//! (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`),
//! so a proxy follows a fleet that mixes both; and batches of vLLM itself: hashes as bytes
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), fields ferry does not write, no ferry fields.

use std::sync::Arc;

use ferry_core::{KvEvent, KvEventBatch, Medium, TokenId};
use rmp::encode::{write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint};
use rmpv::Value;

/// The layout's name in `GET /kv_events_info` (`format`).
pub const FORMAT: &str = "vllm-0.34";

/// Encodes a batch stamped `ts` (seconds since the Unix epoch).
pub fn encode(batch: &KvEventBatch, ts: f64) -> Vec<u8> {
    // Writing into a Vec cannot fail.
    let mut b = Vec::with_capacity(64 + batch.events.len() * 160);
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
                lora,
            } => {
                let primary = *medium == Medium::Primary;
                // msgspec sizes the header by the keys the struct may have (16), not by those
                // it writes.
                w.push(0xde);
                let n_keys = if primary { 10u16 } else { 9 } + u16::from(lora.is_some());
                w.extend_from_slice(&n_keys.to_be_bytes());
                tag(w, "BlockStored");
                key(w, "block_hashes");
                write_uints(w, hashes.iter().copied());
                key(w, "parent_block_hash");
                match parent {
                    Some(p) => {
                        write_uint(w, *p).unwrap();
                    }
                    None => write_nil(w).unwrap(),
                }
                key(w, "token_ids");
                write_uints(w, tokens.iter().map(|&t| u64::from(t.0)));
                key(w, "block_size");
                write_uint(w, batch.block_size as u64).unwrap();
                // An adapter as vLLM names one: its id and name; its version is ferry's
                // `lora_version`, after `lora_name` (msgspec's decoders skip keys they do not
                // know, so vLLM's consumers read these events unchanged).
                key(w, "lora_id");
                match lora {
                    Some(l) => write_uint(w, u64::from(l.id.0)).map(drop).unwrap(),
                    None => write_nil(w).unwrap(),
                }
                key(w, "medium");
                write_str(w, medium.as_str()).unwrap();
                key(w, "lora_name");
                match lora {
                    Some(l) => {
                        write_str(w, &l.name).unwrap();
                        key(w, "lora_version");
                        write_uint(w, l.version).unwrap();
                    }
                    None => write_nil(w).unwrap(),
                }
                if primary {
                    // One entry per block: the adapter's name alone, as vLLM's untagged extra
                    // keys have it, or nothing (no multimodal input or salt is named here:
                    // ferry's hashes are its own; a salt is in them).
                    key(w, "extra_keys");
                    write_array_len(w, hashes.len() as u32).unwrap();
                    for _ in hashes {
                        match lora {
                            Some(l) => {
                                write_array_len(w, 1).unwrap();
                                write_str(w, &l.name).unwrap();
                            }
                            None => write_nil(w).unwrap(),
                        }
                    }
                }
                key(w, "group_idx");
                write_uint(w, 0).unwrap();
            }
            KvEvent::Removed { hashes, medium } => {
                write_map_len(w, 4).unwrap();
                tag(w, "BlockRemoved");
                key(w, "block_hashes");
                write_uints(w, hashes.iter().copied());
                key(w, "medium");
                write_str(w, medium.as_str()).unwrap();
                key(w, "group_idx");
                write_uint(w, 0).unwrap();
            }
            KvEvent::AllCleared => {
                write_map_len(w, 1).unwrap();
                tag(w, "AllBlocksCleared");
            }
        }
    }
    write_uint(w, 0).unwrap();
    write_str(w, &batch.weight_version).unwrap();
    write_uint(w, batch.epoch).unwrap();
    b
}

fn key(w: &mut Vec<u8>, name: &str) {
    write_str(w, name).unwrap();
}

fn tag(w: &mut Vec<u8>, class: &str) {
    key(w, "type");
    write_str(w, class).unwrap();
}

fn write_uints(w: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    write_array_len(w, values.len() as u32).unwrap();
    for v in values {
        write_uint(w, v).unwrap();
    }
}

/// A batch in neither layout, and where.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("KV event batch: not msgpack: {0}")]
    Msgpack(#[from] rmpv::decode::Error),
    #[error("KV event batch: not an array")]
    NotABatch,
    #[error("KV event batch: `{field}` is missing or not {expected}")]
    Field {
        field: &'static str,
        expected: &'static str,
    },
    #[error("KV event batch: an event is neither a map nor an array")]
    NotAnEvent,
    #[error("KV event batch: unknown event type {0:?}")]
    UnknownEvent(String),
}

/// A decoded batch: its stamp and what it says. Batches from vLLM (no ferry fields) decode
/// with an empty weight version and epoch 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub ts: f64,
    pub batch: KvEventBatch,
}

/// Decodes a batch: ferry's, vLLM 0.34's or vLLM 0.11's (see the module docs).
pub fn decode(mut bytes: &[u8]) -> Result<Decoded, DecodeError> {
    let value = rmpv::decode::read_value(&mut bytes)?;
    let fields = value.as_array().ok_or(DecodeError::NotABatch)?;
    let ts = fields
        .first()
        .and_then(Value::as_f64)
        .ok_or(DecodeError::Field {
            field: "ts",
            expected: "a number",
        })?;
    let raw = fields
        .get(1)
        .and_then(Value::as_array)
        .ok_or(DecodeError::Field {
            field: "events",
            expected: "a list",
        })?;
    let weight_version: Arc<str> = Arc::from(fields.get(3).and_then(Value::as_str).unwrap_or(""));
    let epoch = fields.get(4).and_then(Value::as_u64).unwrap_or(0);
    // The primary tier's block size; a tier block that vLLM knows no tokens of says 0.
    let (mut block_size, mut any_size) = (None, 0);
    let mut events = Vec::with_capacity(raw.len());
    for e in raw {
        let e = Event::of(e)?;
        events.push(match e.class()? {
            "BlockStored" => {
                let medium = e.medium()?;
                let size = e.uint("block_size")? as usize;
                any_size = size;
                if medium == Medium::Primary {
                    block_size = Some(size);
                }
                KvEvent::Stored {
                    hashes: e.hashes("block_hashes")?,
                    parent: e.parent()?,
                    tokens: e.tokens()?,
                    medium,
                    lora: e.lora()?,
                }
            }
            "BlockRemoved" => KvEvent::Removed {
                hashes: e.hashes("block_hashes")?,
                medium: e.medium()?,
            },
            "AllBlocksCleared" => KvEvent::AllCleared,
            other => return Err(DecodeError::UnknownEvent(other.to_owned())),
        });
    }
    Ok(Decoded {
        ts,
        batch: KvEventBatch {
            events,
            block_size: block_size.unwrap_or(any_size),
            weight_version,
            epoch,
        },
    })
}

/// One event, by field name whatever its layout.
enum Event<'a> {
    /// vLLM 0.34's: `{type: class, field: value, ...}`, fields with defaults possibly absent.
    Map(&'a [(Value, Value)]),
    /// vLLM 0.11's: `[class, value, ...]` in field order.
    Array(&'a [Value]),
}

impl<'a> Event<'a> {
    fn of(v: &'a Value) -> Result<Self, DecodeError> {
        match v {
            Value::Map(m) => Ok(Self::Map(m)),
            Value::Array(a) => Ok(Self::Array(a)),
            _ => Err(DecodeError::NotAnEvent),
        }
    }

    fn class(&self) -> Result<&'a str, DecodeError> {
        let class = match self {
            Self::Map(_) => self.get("type"),
            Self::Array(a) => a.first(),
        };
        class.and_then(Value::as_str).ok_or(DecodeError::Field {
            field: "type",
            expected: "an event class name",
        })
    }

    /// A field's value; `None` if absent (a map's field left at its default, or a short array).
    fn get(&self, field: &str) -> Option<&'a Value> {
        match self {
            Self::Map(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == Some(field))
                .map(|(_, v)| v),
            Self::Array(a) => {
                // vLLM 0.11's field order, after the class name.
                let at = match (a.first().and_then(Value::as_str), field) {
                    (_, "block_hashes") => 1,
                    (Some("BlockStored"), "parent_block_hash") => 2,
                    (Some("BlockStored"), "token_ids") => 3,
                    (Some("BlockStored"), "block_size") => 4,
                    (Some("BlockStored"), "medium") => 6,
                    (Some("BlockRemoved"), "medium") => 2,
                    _ => return None,
                };
                a.get(at)
            }
        }
    }

    fn uint(&self, field: &'static str) -> Result<u64, DecodeError> {
        self.get(field)
            .and_then(Value::as_u64)
            .ok_or(DecodeError::Field {
                field,
                expected: "an unsigned int",
            })
    }

    fn hashes(&self, field: &'static str) -> Result<Vec<u64>, DecodeError> {
        let bad = DecodeError::Field {
            field,
            expected: "a list of block hashes",
        };
        let Some(list) = self.get(field).and_then(Value::as_array) else {
            return Err(bad);
        };
        list.iter()
            .map(|h| hash(h).ok_or_else(|| bad_hash(field)))
            .collect()
    }

    fn parent(&self) -> Result<Option<u64>, DecodeError> {
        match self.get("parent_block_hash") {
            None | Some(Value::Nil) => Ok(None),
            Some(h) => hash(h)
                .map(Some)
                .ok_or_else(|| bad_hash("parent_block_hash")),
        }
    }

    fn tokens(&self) -> Result<Vec<TokenId>, DecodeError> {
        let bad = || DecodeError::Field {
            field: "token_ids",
            expected: "a list of token ids",
        };
        self.get("token_ids")
            .and_then(Value::as_array)
            .ok_or_else(bad)?
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .map(TokenId)
                    .ok_or_else(bad)
            })
            .collect()
    }

    /// `"GPU"` (or none given) is the primary tier; every other medium (`"CPU"`, vLLM's
    /// `"STORAGE"`, a connector's own names) is a tier below it, whose blocks are no prefill hit.
    /// The adapter a block was computed with: ferry's `lora_id`, `lora_name` and
    /// `lora_version` all set; anything else (vLLM's events, which carry no version, or none)
    /// is none.
    fn lora(&self) -> Result<Option<ferry_core::LoraRef>, DecodeError> {
        let (Some(id), Some(name), Some(version)) = (
            self.get("lora_id").and_then(Value::as_u64),
            self.get("lora_name").and_then(Value::as_str),
            self.get("lora_version").and_then(Value::as_u64),
        ) else {
            return Ok(None);
        };
        let id = u32::try_from(id).map_err(|_| DecodeError::Field {
            field: "lora_id",
            expected: "a 32-bit id",
        })?;
        Ok(Some(ferry_core::LoraRef::new(
            ferry_core::LoraId(id),
            name,
            version,
        )))
    }

    fn medium(&self) -> Result<Medium, DecodeError> {
        match self.get("medium") {
            None | Some(Value::Nil) => Ok(Medium::Primary),
            Some(v) => match v.as_str() {
                Some(m) if m.eq_ignore_ascii_case("GPU") => Ok(Medium::Primary),
                Some(_) => Ok(Medium::Tier),
                None => Err(DecodeError::Field {
                    field: "medium",
                    expected: "a string",
                }),
            },
        }
    }
}

/// A block hash: an int, or bytes as vLLM turns them into one (their low 64 bits).
fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Binary(b) => {
            let low = &b[b.len().saturating_sub(8)..];
            Some(low.iter().fold(0, |h, &byte| h << 8 | u64::from(byte)))
        }
        _ => v.as_u64(),
    }
}

fn bad_hash(field: &'static str) -> DecodeError {
    DecodeError::Field {
        field,
        expected: "an unsigned int or bytes",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> KvEventBatch {
        KvEventBatch {
            events: vec![
                KvEvent::AllCleared,
                KvEvent::Stored {
                    hashes: vec![u64::MAX, 7],
                    parent: None,
                    tokens: TokenId::list([1, 2, 3, 4]),
                    medium: Medium::Primary,
                    lora: None,
                },
                KvEvent::Stored {
                    hashes: vec![8],
                    parent: Some(7),
                    tokens: TokenId::list([5, 6]),
                    medium: Medium::Primary,
                    lora: None,
                },
                KvEvent::Removed {
                    hashes: vec![9],
                    medium: Medium::Tier,
                },
            ],
            block_size: 2,
            weight_version: Arc::from("w1"),
            epoch: 3,
        }
    }

    #[test]
    fn a_batch_round_trips_with_events_as_tagged_maps() {
        let batch = batch();
        let bytes = encode(&batch, 12.5);
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let fields = value.as_array().unwrap();
        assert_eq!(fields.len(), 5);
        assert_eq!(fields[2].as_u64(), Some(0), "data_parallel_rank");
        let stored = fields[1].as_array().unwrap()[1].as_map().unwrap();
        let keys: Vec<&str> = stored.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx"
            ]
        );
        assert_eq!(stored[0].1.as_str(), Some("BlockStored"));
        assert_eq!(stored[8].1, Value::Array(vec![Value::Nil, Value::Nil]));
        let back = decode(&bytes).unwrap();
        assert_eq!(back.ts, 12.5);
        assert_eq!(back.batch, batch);
    }

    /// A block an adapter computed names it as vLLM does (`lora_id`, `lora_name`, the name as
    /// each block's extra key) with ferry's `lora_version` after the name, and reads back
    /// whole; vLLM's own events name no version, and read back as no adapter.
    #[test]
    fn an_adapters_block_carries_its_name_and_version() {
        let lora = ferry_core::LoraRef::new(ferry_core::LoraId(3), "pol", 7);
        let batch = KvEventBatch {
            events: vec![KvEvent::Stored {
                hashes: vec![11],
                parent: None,
                tokens: TokenId::list([1, 2]),
                medium: Medium::Primary,
                lora: Some(lora.clone()),
            }],
            block_size: 2,
            weight_version: Arc::from("w1"),
            epoch: 0,
        };
        let bytes = encode(&batch, 1.0);
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let stored = value.as_array().unwrap()[1].as_array().unwrap()[0]
            .as_map()
            .unwrap()
            .clone();
        let field = |k: &str| {
            stored
                .iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(field("lora_id"), Some(Value::from(3)));
        assert_eq!(field("lora_name"), Some(Value::from("pol")));
        assert_eq!(field("lora_version"), Some(Value::from(7)));
        assert_eq!(
            field("extra_keys"),
            Some(Value::Array(vec![Value::Array(vec![Value::from("pol")])]))
        );
        assert_eq!(decode(&bytes).unwrap().batch, batch);

        // vLLM's event of an adapter: no version, so no adapter ferry could key by.
        let vllm: Vec<(Value, Value)> = stored
            .into_iter()
            .filter(|(k, _)| k.as_str() != Some("lora_version"))
            .collect();
        let mut raw = value.as_array().unwrap().clone();
        raw[1] = Value::Array(vec![Value::Map(vllm)]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &Value::Array(raw)).unwrap();
        let back = decode(&bytes).unwrap().batch;
        assert!(matches!(
            &back.events[0],
            KvEvent::Stored { lora: None, .. }
        ));
    }

    #[test]
    fn malformed_batches_name_what_is_wrong() {
        let err = |bytes: &[u8]| decode(bytes).unwrap_err().to_string();
        // An array of two that ends after the first's marker.
        let cut = err(&[0x92, 0xcb]);
        assert!(cut.contains("not msgpack"), "{cut}");
        // {"a": 1}
        assert!(err(&[0x81, 0xa1, b'a', 1]).contains("not an array"));
        let with_event = |event: Value| {
            let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![event])]);
            let mut b = Vec::new();
            rmpv::encode::write_value(&mut b, &batch).unwrap();
            err(&b)
        };
        let map = |pairs: Vec<(&str, Value)>| {
            Value::Map(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
        };
        assert!(with_event(Value::from(3)).contains("neither a map nor an array"));
        let e = with_event(map(vec![("type", "BlockEvicted".into())]));
        assert!(e.contains("unknown event type \"BlockEvicted\""), "{e}");
        let e = with_event(map(vec![("type", "BlockRemoved".into())]));
        assert!(e.contains("`block_hashes`"), "{e}");
        let e = with_event(map(vec![
            ("type", "BlockRemoved".into()),
            ("block_hashes", Value::Array(vec![Value::from(-1)])),
        ]));
        assert!(e.contains("`block_hashes`") && e.contains("bytes"), "{e}");
    }
}
