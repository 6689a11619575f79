//! Sessions that keep their cache: `ferry proxy` sends every turn of a conversation named by
//! `X-Session-ID` (vllm-router's and SkyRL's header) or `X-SMG-Routing-Key` (SGLang's
//! gateway's) to one instance, by rendezvous hashing of the key over the instances, with no
//! KV events and no state per session: each turn finds the conversation so far cached. An
//! instance that goes away moves only its own sessions. Under P/D the session picks D.

use std::collections::BTreeMap;

use serde_json::json;

use super::bounded;
use super::procs::*;

const BLOCK: u64 = 16;

/// Session `s`'s conversation after `turns` turns: a prompt of its own, grown a block and a
/// half each turn.
fn conversation(s: u64, turns: u64) -> Vec<u64> {
    (0..(3 + turns * 3) * BLOCK / 2)
        .map(|i| 3 + (i * 7 + s * 13) % 190)
        .collect()
}

/// One turn through the proxy with the session header `header`: the cached tokens.
async fn turn(proxy: &str, header: &str, s: u64, t: u64) -> u64 {
    let body = json!({"model": "tiny", "prompt": conversation(s, t), "max_tokens": 1,
                      "temperature": 0});
    let key = format!("session-{s}");
    let (status, answer, _) = call(
        reqwest::Method::POST,
        &format!("{proxy}/v1/completions"),
        Some(&body),
        &[(header, &key)],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// Requests the proxy sent to each instance so far.
async fn sent(proxy: &str, urls: &[String]) -> Vec<f64> {
    let m = metrics_text(proxy).await;
    urls.iter()
        .map(|u| instance_metric(&m, "ferry_proxy_requests_total", u))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_stay_on_one_instance_and_find_their_cache() {
    bounded(async {
        let (a, b) = (serve(&[]), serve(&[]));
        let (a, mut b) = (a.ready(), b.ready());
        let proxy = whole_proxy(&[&a.url, &b.url], &[]).ready();
        let p = proxy.url.as_str();
        let urls = [a.url.clone(), b.url.clone()];

        // Eight sessions, three turns each, the two headers alternating by session.
        let mut home: BTreeMap<u64, usize> = BTreeMap::new();
        for s in 0..8 {
            let header = ["X-Session-ID", "X-SMG-Routing-Key"][s as usize % 2];
            for t in 0..3 {
                let before = sent(p, &urls).await;
                let cached = turn(p, header, s, t).await;
                let after = sent(p, &urls).await;
                let at = (0..2).find(|&i| after[i] > before[i]).unwrap();
                assert_eq!(
                    *home.entry(s).or_insert(at),
                    at,
                    "session {s} turn {t} moved"
                );
                // Each turn after the first finds the conversation so far cached.
                if t > 0 {
                    let earlier = conversation(s, t - 1).len() as u64;
                    assert!(
                        cached >= earlier / BLOCK * BLOCK,
                        "session {s} turn {t}: {cached}"
                    );
                }
            }
        }
        // (How they spread depends on the ports the instances got; `fleet.rs`'s unit test
        // checks the spread on fixed addresses.)

        // b goes away: its sessions move to a, a's stay (a's still hit their cache).
        b.kill();
        for (&s, &at) in &home {
            let cached = turn(p, "X-Session-ID", s, 3).await;
            if at == 0 {
                let earlier = conversation(s, 2).len() as u64;
                assert!(
                    cached >= earlier / BLOCK * BLOCK,
                    "session {s} lost its cache"
                );
            }
        }
    })
    .await;
}

/// Under P/D the session picks D, the instance holding the conversation's decode KV; P is
/// picked as any prompt's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pd_a_session_keeps_its_decode_instance() {
    bounded(async {
        let (p0, d0, d1) = (prefill(&[]), decode(&[]), decode(&[]));
        let (p0, d0, d1) = (p0.ready(), d0.ready(), d1.ready());
        let proxy = proxy(&[&p0.url], &[&d0.url, &d1.url], &[]).ready();
        let p = proxy.url.as_str();
        let urls = [d0.url.clone(), d1.url.clone()];
        for s in 0..6 {
            let mut home = None;
            for t in 0..3 {
                let before = sent(p, &urls).await;
                turn(p, "X-Session-ID", s, t).await;
                let after = sent(p, &urls).await;
                let at = (0..2).find(|&i| after[i] > before[i]).unwrap();
                assert_eq!(*home.get_or_insert(at), at, "session {s} turn {t} moved");
            }
        }
    })
    .await;
}
