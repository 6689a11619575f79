//! ferry-kv-events: the engine's KV cache events on the wire, as vLLM publishes them, so the
//! KV-aware routers users already run (Dynamo, llm-d, SGLang's gateway, vllm-router) and
//! `ferry proxy` can follow every instance's prefix cache.
//!
//! * [`KvEventsConfig`]: `--kv-events-config`, vLLM's `KVEventsConfig` fields.
//! * [`wire`]: a batch as msgpack, in the layout of vLLM 0.34.0's
//!   `vllm/distributed/kv_events.py` (the batch an array, each event a map tagged with its
//!   class), with two trailing batch fields vLLM's decoder ignores: the weight version and the
//!   cache epoch the batch's blocks belong to. It reads vLLM 0.11's layout too.
//! * [`Publisher`]: a ZMQ PUB socket sending `(topic, sequence number as 8 bytes big-endian,
//!   batch)`, and a ROUTER socket that resends buffered batches from a sequence number,
//!   `(topic, sequence, batch)` each, ending with sequence -1.
//! * [`Subscriber`]: the other end, as `ferry proxy` follows each instance.
//!
//! The engine thread never waits on any of it: batches reach the publisher's task over an
//! unbounded channel (`EngineHandle::take_kv_events`).

mod config;
mod publisher;
mod subscriber;
pub mod wire;

pub use config::{ConfigError, KvEventsConfig, DEFAULT_PORT};
pub use publisher::{Publisher, PublisherError};
pub use subscriber::{Sequenced, SubscribeError, Subscriber};
