//! `ferry proxy --routing kv` (the default) in front of plain instances that publish KV events:
//! a repeated prefix goes to the instance that holds it; a wipe done on that instance directly
//! (not through the proxy, as RL frameworks do) stops that the moment its event arrives; and
//! once an instance announces the prefix again under its new epoch, it gets it back.

use std::time::Duration;

use serde_json::json;

use super::bounded;
use super::procs::*;

const BLOCK: usize = 16;

/// A prompt of `shared` blocks of the shared prefix and then a suffix of its own.
fn prompt(suffix: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..3 * BLOCK as u32).map(|i| 3 + i * 5 % 190).collect();
    p.extend([200 + suffix, 201 + suffix, 7, 9]);
    p
}

/// Sends one completion through the proxy; the cached tokens its answer reports.
async fn send(proxy: &str, suffix: u32) -> u64 {
    let body =
        json!({"model": "tiny", "prompt": prompt(suffix), "max_tokens": 1, "temperature": 0});
    let (status, answer) = post(&format!("{proxy}/v1/completions"), &body).await;
    assert_eq!(status, 200, "{answer}");
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_goes_where_it_is_cached_and_never_to_a_wiped_cache() {
    bounded(async {
        let (proxy, [a, b]) = kv_fleet(&[], &[]).await;
        let p = proxy.url.as_str();

        // The first request computes the prefix somewhere; once its blocks are announced,
        // every request sharing it goes there and hits them.
        assert_eq!(send(p, 0).await, 0);
        let m = wait_metrics(p, Duration::from_secs(10), |m| {
            metric(m, "ferry_proxy_kv_index_blocks") >= 3.0
        })
        .await;
        let (holder, other) = if instance_metric(&m, "ferry_proxy_kv_index_blocks", &a.url) >= 3.0 {
            (&a, &b)
        } else {
            (&b, &a)
        };
        for suffix in 1..=4 {
            assert_eq!(send(p, suffix).await, 3 * BLOCK as u64, "request {suffix}");
        }
        let m = metrics_text(p).await;
        assert_eq!(
            instance_metric(&m, "ferry_proxy_kv_routed_requests_total", &holder.url),
            5.0
        );
        assert_eq!(
            instance_metric(&m, "ferry_proxy_kv_routed_requests_total", &other.url),
            0.0
        );
        assert_eq!(
            metric(&m, "ferry_proxy_kv_predicted_hit_tokens_total"),
            4.0 * 3.0 * BLOCK as f64
        );

        // The holder is wiped directly: its event drops the index, and the proxy predicts no
        // hit there any more.
        let (status, body) = post(&format!("{}/reset_prefix_cache", holder.url), &json!({})).await;
        assert_eq!(status, 200, "{body}");
        wait_metrics(p, Duration::from_secs(2), |m| {
            instance_metric(m, "ferry_proxy_kv_index_blocks", &holder.url) == 0.0
        })
        .await;
        assert_eq!(send(p, 5).await, 0, "nothing is cached anywhere now");
        let m = metrics_text(p).await;
        assert_eq!(
            metric(&m, "ferry_proxy_kv_predicted_hit_tokens_total"),
            4.0 * 3.0 * BLOCK as f64
        );
        assert_eq!(metric(&m, "ferry_proxy_kv_misses_total"), 0.0);
        assert_eq!(metric(&m, "ferry_proxy_kv_stale_routes_total"), 0.0);

        // That request stored the prefix again where it ran: the proxy follows it there.
        let m = wait_metrics(p, Duration::from_secs(10), |m| {
            metric(m, "ferry_proxy_kv_index_blocks") >= 3.0
        })
        .await;
        let new_holder = if instance_metric(&m, "ferry_proxy_kv_index_blocks", &a.url) >= 3.0 {
            &a
        } else {
            &b
        };
        let before = instance_metric(&m, "ferry_proxy_kv_routed_requests_total", &new_holder.url);
        assert_eq!(send(p, 6).await, 3 * BLOCK as u64);
        let m = metrics_text(p).await;
        assert_eq!(
            instance_metric(&m, "ferry_proxy_kv_routed_requests_total", &new_holder.url),
            before + 1.0
        );
        assert_eq!(metric(&m, "ferry_proxy_kv_misses_total"), 0.0);
    })
    .await;
}

/// A chat whose rendering depends on its `tools` and its own `chat_template`: the proxy
/// tokenizes it with both, as the instance renders it, so it predicts exactly the hits the
/// instance then reports (before, it tokenized the messages alone and predicted none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_is_routed_by_the_prompt_its_tools_and_template_make() {
    bounded(async {
        let (proxy, [a, b]) = kv_fleet(&[], &[]).await;
        let p = proxy.url.as_str();
        let template = "{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}\n\
                        {% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n\
                        {% endfor %}assistant:";
        let tools = json!([{"type": "function", "function": {"name": "lookup",
            "description": "Looks a word up in the dictionary and returns its meanings, \
                            its etymology and examples of its use in sentences."}}]);
        let chat = |k: u32| {
            json!({"model": "tiny", "max_tokens": 1, "temperature": 0, "tools": tools,
                   "tool_choice": "none", "chat_template": template,
                   "messages": [{"role": "user", "content": format!("question {k}")}]})
        };
        let send = |k: u32| {
            let body = chat(k);
            async move {
                let (status, answer) = post(&format!("{p}/v1/chat/completions"), &body).await;
                assert_eq!(status, 200, "{answer}");
                answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
            }
        };
        assert_eq!(send(0).await, 0);
        let m = wait_metrics(p, Duration::from_secs(10), |m| {
            metric(m, "ferry_proxy_kv_index_blocks") >= 3.0
        })
        .await;
        let holder = if instance_metric(&m, "ferry_proxy_kv_index_blocks", &a.url) >= 3.0 {
            &a
        } else {
            &b
        };
        let mut cached = 0;
        for k in 1..=4 {
            let c = send(k).await;
            assert!(c >= 3 * BLOCK as u64, "request {k}: {c} cached");
            cached += c;
        }
        let m = metrics_text(p).await;
        assert_eq!(
            metric(&m, "ferry_proxy_kv_predicted_hit_tokens_total"),
            cached as f64
        );
        assert_eq!(
            instance_metric(&m, "ferry_proxy_kv_routed_requests_total", &holder.url),
            5.0
        );
    })
    .await;
}
