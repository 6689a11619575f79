//! A subscriber to an engine's KV events (what `ferry proxy` runs per instance): a SUB socket
//! for live batches and a DEALER socket for replays.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::wire::{self, Decoded};

/// Why a subscription failed.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("KV events at {endpoint}: {source}")]
    Socket {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("KV events: {0}")]
    Decode(#[from] wire::DecodeError),
    #[error("KV events: a message of {0} frames, not (topic, sequence, batch)")]
    Frames(usize),
    #[error("KV events: no replay endpoint")]
    NoReplay,
    #[error("KV events: the replay did not answer within {0:?}")]
    ReplayTimeout(Duration),
}

/// A batch and its sequence number.
pub type Sequenced = (u64, Decoded);

/// Subscribed to one publisher.
pub struct Subscriber {
    sub: SubSocket,
    replay_endpoint: Option<String>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

fn socket_err(endpoint: &str) -> impl FnOnce(zeromq::ZmqError) -> SubscribeError + '_ {
    move |source| SubscribeError::Socket {
        endpoint: endpoint.to_owned(),
        source,
    }
}

impl Subscriber {
    pub async fn connect(
        endpoint: &str,
        replay_endpoint: Option<String>,
        topic: &str,
    ) -> Result<Self, SubscribeError> {
        let mut sub = SubSocket::new();
        sub.connect(endpoint).await.map_err(socket_err(endpoint))?;
        sub.subscribe(topic).await.map_err(socket_err(endpoint))?;
        Ok(Self {
            sub,
            replay_endpoint,
        })
    }

    /// The next live batch.
    pub async fn recv(&mut self) -> Result<Sequenced, SubscribeError> {
        let frames = self
            .sub
            .recv()
            .await
            .map_err(|source| SubscribeError::Socket {
                endpoint: "the PUB socket".into(),
                source,
            })?
            .into_vec();
        let [_, seq, payload] = &frames[..] else {
            return Err(SubscribeError::Frames(frames.len()));
        };
        Ok((seq_of(seq)?, wire::decode(payload)?))
    }

    /// Every batch the publisher still buffers from `from` on, in order.
    pub async fn replay(
        &self,
        from: u64,
        within: Duration,
    ) -> Result<Vec<Sequenced>, SubscribeError> {
        let endpoint = self
            .replay_endpoint
            .as_deref()
            .ok_or(SubscribeError::NoReplay)?;
        let mut dealer = DealerSocket::new();
        dealer
            .connect(endpoint)
            .await
            .map_err(socket_err(endpoint))?;
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        dealer.send(request).await.map_err(socket_err(endpoint))?;
        let read = async {
            let mut out = Vec::new();
            loop {
                let frames = dealer
                    .recv()
                    .await
                    .map_err(socket_err(endpoint))?
                    .into_vec();
                // (empty, topic, seq, batch) from vLLM 0.34 and ferry, (empty, seq, batch)
                // from vLLM 0.11; the end is seq -1.
                let [.., seq, payload] = &frames[..] else {
                    return Err(SubscribeError::Frames(frames.len()));
                };
                if seq[..] == (-1i64).to_be_bytes() {
                    return Ok(out);
                }
                out.push((seq_of(seq)?, wire::decode(payload)?));
            }
        };
        tokio::time::timeout(within, read)
            .await
            .map_err(|_| SubscribeError::ReplayTimeout(within))?
    }
}

fn seq_of(frame: &[u8]) -> Result<u64, SubscribeError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| SubscribeError::Frames(0))
}
