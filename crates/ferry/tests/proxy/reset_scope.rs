//! A cache reset says what it cleared, and its KV events say the same. vLLM's default reset
//! (`reset_external=false`) clears the device's prefix cache and leaves the offload tier's
//! blocks loadable: ferry answers `"cleared": ["device"]` (not a bare `"success"`, which users
//! read as "all is cold"), publishes the removal of each device block rather than a whole-cache
//! `AllBlocksCleared`, and its proxy keeps routing by the tier's blocks; `reset_external=true`
//! clears both, and says so. On two `ferry serve` instances with an offload tier (shipped
//! defaults otherwise) behind `ferry proxy`, checked with a Python subscriber that reads the
//! events as vLLM's consumers do, and with the proxy's index.

use std::time::{Duration, Instant};

use ferry_core::{KvEvent, Medium};
use serde_json::{json, Value};

use super::bounded;
use super::kv_events::{batch_of, subscribe, Subscriber};
use super::procs::*;

const BLOCK: usize = 16;
/// Full blocks of the prompt.
const N_BLOCKS: usize = 16;

/// Prompt A: sixteen full blocks and one more token.
fn prompt() -> Vec<u32> {
    (0..=(N_BLOCKS * BLOCK) as u32)
        .map(|i| 3 + (i * 7) % 190)
        .collect()
}

/// One completion of A at `base`: the cached tokens its answer reports.
async fn send(base: &str) -> u64 {
    let body = json!({"model": "tiny", "prompt": prompt(), "max_tokens": 1, "temperature": 0});
    let (status, answer) = post(&format!("{base}/v1/completions"), &body).await;
    assert_eq!(status, 200, "{answer}");
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {answer}"))
}

/// A reset at `base`, asked again while a store in flight still holds blocks (it answers
/// `false` then, changing nothing): its answer once it went through.
async fn reset(base: &str, query: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, answer) = post(&format!("{base}/reset_prefix_cache{query}"), &json!({})).await;
        assert_eq!(status, 200, "{answer}");
        if answer["success"] == true {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "the reset never went through: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The events the subscriber receives within `within`.
fn events_within(sub: &Subscriber, within: Duration) -> Vec<(u64, KvEvent)> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(line) = sub.lines.recv_timeout(left) else {
            break;
        };
        let (_, batch) = batch_of(&serde_json::from_str(&line).unwrap());
        let epoch = batch.batch.epoch;
        out.extend(batch.batch.events.into_iter().map(|e| (epoch, e)));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_says_what_it_cleared_and_its_events_and_the_proxy_keep_the_tier() {
    bounded(async {
        let (proxy, [a, _b]) =
            kv_fleet(&["--kv-offload-bytes", "16MiB"], &["--enable-admin-api"]).await;
        let p = proxy.url.as_str();
        let (status, info) = get(&format!("{}/kv_events_info", a.url)).await;
        assert_eq!(status, 200, "{info}");
        let sub = subscribe(&info);
        let index = |m: &str, name: &str| instance_metric(m, name, &a.url);

        // A on `a`: computed, then stored in its tier (the proxy learns both from events).
        assert_eq!(send(&a.url).await, 0);
        wait_metrics(p, Duration::from_secs(20), |m| {
            index(m, "ferry_proxy_kv_index_tier_blocks") >= N_BLOCKS as f64
        })
        .await;
        let before = events_within(&sub, Duration::from_millis(200));
        let epoch = before.last().map_or(0, |(e, _)| *e);

        // vLLM's default reset, on the instance itself: the device cache only, and it says so.
        let answer = reset(&a.url, "").await;
        assert_eq!(answer, json!({"success": true, "cleared": ["device"]}));
        // Its events remove each device block (medium GPU) and announce no whole clear.
        let events = events_within(&sub, Duration::from_secs(2));
        assert!(
            events.iter().all(|(e, ev)| *e == epoch
                && !matches!(
                    ev,
                    KvEvent::AllCleared
                        | KvEvent::Removed {
                            medium: Medium::Tier,
                            ..
                        }
                )),
            "a reset of the device alone announced more: {events:?}"
        );
        let removed: usize = events
            .iter()
            .map(|(_, ev)| match ev {
                KvEvent::Removed {
                    hashes,
                    medium: Medium::Primary,
                } => hashes.len(),
                _ => 0,
            })
            .sum();
        assert!(removed >= N_BLOCKS, "{events:?}");
        // The proxy, which read only the events, forgets the device's blocks, not the tier's,
        let m = wait_metrics(p, Duration::from_secs(5), |m| {
            index(m, "ferry_proxy_kv_index_blocks") == 0.0
        })
        .await;
        assert!(index(&m, "ferry_proxy_kv_index_tier_blocks") >= N_BLOCKS as f64);
        // and routes A to the tier that holds it: a hit, loaded from the tier.
        let predicted = index(&m, "ferry_proxy_kv_predicted_hit_tokens_total");
        let hit = send(p).await;
        assert!(hit >= ((N_BLOCKS - 1) * BLOCK) as u64, "cached {hit}");
        let m = metrics_text(p).await;
        assert!(
            index(&m, "ferry_proxy_kv_predicted_hit_tokens_total") - predicted
                >= ((N_BLOCKS - 1) * BLOCK) as f64,
            "A was not routed by the tier's blocks:\n{m}"
        );
        // (Its loaded blocks are the device's again, announced before the next reset.)
        wait_metrics(p, Duration::from_secs(5), |m| {
            index(m, "ferry_proxy_kv_index_blocks") >= N_BLOCKS as f64
        })
        .await;

        // The same reset through the proxy: each instance says what it cleared, and the
        // proxy's fence drops the device's entries only.
        let answer = reset(p, "").await;
        assert_eq!(answer["cleared"], json!(["device"]), "{answer}");
        for instance in answer["instances"].as_array().unwrap() {
            assert_eq!(instance["body"]["cleared"], json!(["device"]), "{answer}");
        }
        let m = metrics_text(p).await;
        assert_eq!(index(&m, "ferry_proxy_kv_index_blocks"), 0.0);
        assert!(index(&m, "ferry_proxy_kv_index_tier_blocks") >= N_BLOCKS as f64);
        assert!(send(p).await >= ((N_BLOCKS - 1) * BLOCK) as u64);

        // `reset_external=true`: both, said so, announced as a whole clear; A is cold.
        let answer = reset(p, "?reset_external=true").await;
        assert_eq!(answer["cleared"], json!(["device", "offload"]), "{answer}");
        let m = metrics_text(p).await;
        assert_eq!(index(&m, "ferry_proxy_kv_index_tier_blocks"), 0.0);
        let events = events_within(&sub, Duration::from_secs(2));
        assert!(
            events.iter().any(|(_, ev)| *ev == KvEvent::AllCleared),
            "{events:?}"
        );
        assert_eq!(send(p).await, 0);
    })
    .await;
}
