//! Following each instance's KV events into its [`KvIndex`](crate::kv_index::KvIndex): one
//! task per instance that computes prompts (P, or a plain instance), started with the proxy.
//!
//! The task asks the instance where it publishes (`GET /kv_events_info`; an instance that
//! does not publish is routed by load), subscribes, replays what the publisher still buffers
//! from sequence 0 (a restarted proxy starts empty and catches up), and then applies live
//! batches in sequence. A gap is filled by a replay; one the replay cannot fill, or a
//! publisher that restarted (its sequence back at 0), drops the index. An instance that goes
//! away is followed again once it answers.

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use ferry_kv_events::{Sequenced, Subscriber};
use serde_json::Value;

use crate::fleet::{unix_now, Instance};
use crate::kv_index::Sync;
use crate::upstream::{Call, Upstream};

/// Pause between attempts to reach an instance's events.
const RETRY: Duration = Duration::from_secs(1);
/// Bound on one replay.
const REPLAY_WITHIN: Duration = Duration::from_secs(10);

/// Follows `instance`'s events for as long as the proxy runs.
pub async fn follow(instance: Arc<Instance>, upstream: Arc<Upstream>) {
    loop {
        match subscribe(&instance, &upstream).await {
            Ok(Some(mut sub)) => {
                if let Err(e) = run(&instance, &mut sub).await {
                    tracing::warn!(instance = %instance.url, "KV events: {e}; following again");
                }
            }
            Ok(None) => {
                instance.kv().sync = Sync::NoEvents;
                // It may be restarted with events on.
                tokio::time::sleep(RETRY * 10).await;
                continue;
            }
            Err(e) => tracing::debug!(instance = %instance.url, "KV events: {e}"),
        }
        // Whatever the index held may be gone by the time the instance is back.
        {
            let mut kv = instance.kv();
            if kv.sync == Sync::Synced {
                kv.wipe(unix_now());
            }
            kv.sync = Sync::Unknown;
            kv.last_seq = None;
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Where the instance publishes, subscribed; `None` if it does not publish.
async fn subscribe(instance: &Instance, upstream: &Upstream) -> Result<Option<Subscriber>, String> {
    let call = Call {
        method: Method::GET,
        path_and_query: "/kv_events_info",
        request_id: None,
        content_type: None,
        body: reqwest::Body::from(""),
        timeout: Some(Duration::from_secs(5)),
    };
    let (status, _, body) = upstream
        .send_read(instance, call)
        .await
        .map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Ok(None);
    }
    let info: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    if info["enabled"] != true {
        return Ok(None);
    }
    let endpoint = reachable(info["endpoint"].as_str().unwrap_or_default(), &instance.url);
    let replay = info["replay_endpoint"]
        .as_str()
        .map(|e| reachable(e, &instance.url));
    let topic = info["topic"].as_str().unwrap_or_default();
    {
        let mut kv = instance.kv();
        kv.block_size = info["block_size"].as_u64().unwrap_or(0) as usize;
        kv.sync = Sync::Syncing;
    }
    Subscriber::connect(&endpoint, replay, topic)
        .await
        .map(Some)
        .map_err(|e| e.to_string())
}

/// An endpoint bound on every interface is reached at the instance's own host.
fn reachable(endpoint: &str, instance_url: &str) -> String {
    let host = instance_url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.rsplit_once(':'))
        .map_or("127.0.0.1", |(h, _)| h);
    ["tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"]
        .iter()
        .find_map(|wild| endpoint.strip_prefix(wild))
        .map_or_else(
            || endpoint.to_owned(),
            |port| format!("tcp://{host}:{port}"),
        )
}

async fn run(instance: &Instance, sub: &mut Subscriber) -> Result<(), String> {
    // Catch up: everything the publisher still buffers.
    match sub.replay(0, REPLAY_WITHIN).await {
        Ok(batches) => apply_all(instance, batches, None),
        Err(ferry_kv_events::SubscribeError::NoReplay) => {}
        Err(e) => return Err(e.to_string()),
    }
    instance.kv().sync = Sync::Synced;
    tracing::info!(instance = %instance.url, "KV events followed: routing by prefix");
    loop {
        let (seq, batch) = sub.recv().await.map_err(|e| e.to_string())?;
        let expected = instance.kv().last_seq.map_or(0, |s| s + 1);
        if seq < expected {
            if seq == 0 {
                // The publisher restarted: what the index holds is another process's.
                instance.kv().wipe(unix_now());
                instance.kv().last_seq = None;
                apply_all(instance, vec![(seq, batch)], None);
            }
            continue;
        }
        if seq > expected {
            let batches = sub
                .replay(expected, REPLAY_WITHIN)
                .await
                .unwrap_or_default();
            apply_all(instance, batches, Some(expected));
            let mut kv = instance.kv();
            if kv.last_seq.map_or(0, |s| s + 1) < seq {
                // Batches no replay could give back: whatever they removed may be indexed.
                kv.wipe(unix_now());
            }
        }
        apply_all(instance, vec![(seq, batch)], None);
    }
}

/// Applies batches in order, skipping ones already applied. A replay to fill a gap from
/// `from` whose first batch comes later means batches were lost: the index is dropped first.
fn apply_all(instance: &Instance, batches: Vec<Sequenced>, from: Option<u64>) {
    let mut kv = instance.kv();
    if let (Some(from), Some((first, _))) = (from, batches.first()) {
        if *first > from {
            kv.wipe(unix_now());
        }
    }
    for (seq, decoded) in batches {
        if kv.last_seq.is_some_and(|last| seq <= last) {
            continue;
        }
        kv.apply(&decoded.batch, decoded.ts);
        kv.last_seq = Some(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_on_every_interface_is_reached_at_the_instances_host() {
        assert_eq!(
            reachable("tcp://0.0.0.0:5557", "http://10.0.0.5:8000"),
            "tcp://10.0.0.5:5557"
        );
        assert_eq!(
            reachable("tcp://127.0.0.1:5557", "http://10.0.0.5:8000"),
            "tcp://127.0.0.1:5557"
        );
    }
}
