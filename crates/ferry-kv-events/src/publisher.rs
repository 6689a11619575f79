//! The ZMQ publisher: a PUB socket for live batches and a ROUTER socket for replays, run by
//! one tokio task that owns both and the replay buffer (so no lock), fed by the engine's
//! channel.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use ferry_core::KvEventBatch;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::{wire, KvEventsConfig};

/// The replay's end marker: sequence number -1.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// A socket that could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("KV events: cannot bind {endpoint}: {source}")]
pub struct PublisherError {
    endpoint: String,
    source: zeromq::ZmqError,
}

/// A started publisher: where it listens. It runs until the engine's channel closes.
#[derive(Debug, Clone)]
pub struct Publisher {
    /// The PUB socket's endpoint, with the port it bound (`tcp://host:port`).
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
}

impl Publisher {
    /// Binds the sockets (`pub_endpoint`: see [`KvEventsConfig::pub_endpoint`]) and spawns the
    /// task that publishes every batch `batches` yields. Needs a tokio runtime.
    pub async fn start(
        config: &KvEventsConfig,
        pub_endpoint: &str,
        batches: mpsc::UnboundedReceiver<KvEventBatch>,
    ) -> Result<Self, PublisherError> {
        let bind_err = |endpoint: &str| {
            let endpoint = endpoint.to_owned();
            move |source| PublisherError { endpoint, source }
        };
        let mut publisher = PubSocket::new();
        let bound = publisher
            .bind(pub_endpoint)
            .await
            .map_err(bind_err(pub_endpoint))?;
        let mut replay = None;
        let mut replay_endpoint = None;
        if let Some(e) = &config.replay_endpoint {
            let mut router = RouterSocket::new();
            let bound = router.bind(e).await.map_err(bind_err(e))?;
            replay_endpoint = Some(bound.to_string());
            replay = Some(router);
        }
        let task = Task {
            publisher,
            replay,
            topic: Bytes::from(config.topic.clone().into_bytes()),
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps,
            next_seq: 0,
        };
        tokio::spawn(task.run(batches));
        Ok(Self {
            endpoint: bound.to_string(),
            replay_endpoint,
            topic: config.topic.clone(),
        })
    }
}

struct Task {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    /// The latest batches, oldest first, with their sequence numbers.
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    next_seq: u64,
}

impl Task {
    async fn run(mut self, mut batches: mpsc::UnboundedReceiver<KvEventBatch>) {
        loop {
            let request = async {
                match &mut self.replay {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = batches.recv() => match batch {
                    Some(batch) => self.publish(&batch).await,
                    None => return,
                },
                request = request => match request {
                    Ok(request) => self.serve_replay(request).await,
                    Err(e) => tracing::warn!("KV events replay socket: {e}"),
                },
            }
        }
    }

    async fn publish(&mut self, batch: &KvEventBatch) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(wire::encode(batch, ts));
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut message = ZmqMessage::from(self.topic.clone());
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(payload.clone());
        // PUB drops for subscribers that are not keeping up; they replay what they missed.
        if let Err(e) = self.publisher.send(message).await {
            tracing::warn!("KV events: batch {seq} not sent: {e}");
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// A replay request, `(identity, "", start sequence as 8 bytes big-endian)`: every
    /// buffered batch from `start` on as `(identity, "", topic, seq, batch)`, then
    /// `(identity, "", "", -1, "")`, as vLLM 0.34's publisher answers (0.11's sent no topic
    /// frame; ferry's subscriber reads both).
    async fn serve_replay(&mut self, request: ZmqMessage) {
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            tracing::warn!("KV events: a replay request without an 8-byte sequence number");
            return;
        };
        let start = u64::from_be_bytes(start);
        let Some(router) = &mut self.replay else {
            return;
        };
        let frame = |topic: Bytes, seq: &[u8], payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(Bytes::new());
            m.push_back(topic);
            m.push_back(Bytes::copy_from_slice(seq));
            m.push_back(payload);
            m
        };
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            if router
                .send(frame(
                    self.topic.clone(),
                    &seq.to_be_bytes(),
                    payload.clone(),
                ))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = router
            .send(frame(Bytes::new(), &END_SEQ, Bytes::new()))
            .await;
    }
}
