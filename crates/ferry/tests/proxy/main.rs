//! `ferry proxy` in front of real `ferry serve --kv-role` processes on loopback (the built-in
//! `tiny` model): P/D gives one engine's greedy tokens and logprobs, streaming and not; the RL
//! cycle and a cache-clearing pause go through it with requests in flight and lose nothing; a
//! P that dies while D pulls, a D that dies while P holds exports, forged parameters sent
//! straight to D, several P and D, an instance that is down, keys and bad input, and
//! instances on different weight versions (a 409 and `/health`'s `version_skew`). Beside them,
//! the KV events the instances publish (`kv_events.rs`), the proxy's routing by them
//! (`kv_routing.rs`), the RL frameworks' native routes through P and D (`native.rs`),
//! bucketed weight uploads with their two-phase commit (`upload.rs`), and vLLM's own router
//! (`vllm-router` from PyPI) in front of unchanged instances, in P/D and by session
//! (`vllm_router.rs`).
//!
//! The tests take one lock each, so their processes never compete for the CPU (several
//! tests wait on leases and pauses), and each is bounded in time.

mod admin_calls;
mod kv_events;
mod kv_routing;
mod native;
mod procs;
mod reset_scope;
mod sessions;
mod upload;
mod vllm_router;

use std::time::{Duration, Instant};

use procs::*;
use serde_json::{json, Value};

/// One test at a time (each starts several servers).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs a test body under the lock, within `TEST_BOUND`.
async fn bounded<F: std::future::Future<Output = ()>>(body: F) {
    let _turn = SERIAL.lock().await;
    tokio::time::timeout(TEST_BOUND, body)
        .await
        .expect("the test ran past its bound");
}

const TEST_BOUND: Duration = Duration::from_secs(90);

fn chat(content: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": content}],
           "max_completion_tokens": max_tokens, "temperature": 0, "logprobs": true,
           "top_logprobs": 2, "ignore_eos": true})
}

/// P's export for `prompt`, asked of P directly, as a proxy would.
async fn export(p: &str, prompt: &str) -> Value {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                      "kv_transfer_params": {"do_remote_decode": true}});
    let (status, out) = post(&url(p, "/v1/completions"), &body).await;
    assert_eq!(status, 200, "{out}");
    let params = out["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{out}");
    params
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_p_one_d_gives_the_tokens_and_logprobs_of_one_engine() {
    bounded(async {
        let single = serve(&[]);
        let fleet = pd_fleet(&[], &[]);
        let single = single.ready();
        let proxy = &fleet.proxy.url;

        let body = completion(PROMPT, 12);
        let (status, one) = post(&url(&single.url, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{one}");
        let (status, pd, headers) = call(
            reqwest::Method::POST,
            &url(proxy, "/v1/completions"),
            Some(&body),
            &[("X-Request-Id", "pd-equality-1")],
        )
        .await;
        assert_eq!(status, 200, "{pd}");
        assert_eq!(headers["x-request-id"], "pd-equality-1");
        assert_eq!(pd["choices"][0]["text"], one["choices"][0]["text"]);
        assert_eq!(pd["choices"][0]["logprobs"], one["choices"][0]["logprobs"]);
        assert_eq!(pd["usage"]["completion_tokens"], 12, "{pd}");
        // D loaded the prompt's KV from P (one pull) rather than computing it.
        let d = metrics_text(&fleet.d.url).await;
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 1.0, "{d}");
        assert_eq!(metric(&d, "ferry_kv_loads_failed_total"), 0.0, "{d}");
        // P counts the pull once its worker reports it (a step at most after D has it).
        wait_metrics(&fleet.p.url, Duration::from_secs(5), |t| {
            metric(t, "ferry_kv_exports_pulled_total") == 1.0
        })
        .await;

        // Streaming: D's events pass through, and their text is one engine's.
        let other = "A second prompt, so D has to load it from P as well.";
        let (status, one) =
            post(&url(&single.url, "/v1/completions"), &completion(other, 10)).await;
        assert_eq!(status, 200);
        let body = with(completion(other, 10), "stream", json!(true));
        let (status, events, done) = stream(&url(proxy, "/v1/completions"), &body).await;
        assert_eq!(status, 200);
        assert!(done, "{events:?}");
        assert_eq!(
            streamed_text(&events, false),
            one["choices"][0]["text"].as_str().unwrap()
        );
        let d = metrics_text(&fleet.d.url).await;
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 2.0, "{d}");

        // A batch of prompts goes to D alone (an export holds one prompt), as one engine.
        let batch = json!({"model": "tiny", "prompt": [PROMPT, other], "max_tokens": 10,
                           "temperature": 0, "ignore_eos": true});
        let (status, out) = post(&url(proxy, "/v1/completions"), &batch).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["choices"].as_array().unwrap().len(), 2, "{out}");
        assert_eq!(out["choices"][1]["text"], one["choices"][0]["text"]);

        // Chat, not streaming and streaming.
        let content = "Tell me about the river crossing.";
        let (status, one) =
            post(&url(&single.url, "/v1/chat/completions"), &chat(content, 9)).await;
        assert_eq!(status, 200, "{one}");
        let (status, pd) = post(&url(proxy, "/v1/chat/completions"), &chat(content, 9)).await;
        assert_eq!(status, 200, "{pd}");
        assert_eq!(pd["choices"][0]["message"], one["choices"][0]["message"]);
        assert_eq!(pd["choices"][0]["logprobs"], one["choices"][0]["logprobs"]);
        let body = with(chat(content, 9), "stream", json!(true));
        let (status, events, done) = stream(&url(proxy, "/v1/chat/completions"), &body).await;
        assert!(status == 200 && done, "{events:?}");
        assert_eq!(
            streamed_text(&events, true),
            one["choices"][0]["message"]["content"].as_str().unwrap()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rl_cycle_through_the_proxy_loses_nothing_and_sets_one_version() {
    bounded(async {
        let single = serve(&[]);
        let fleet = pd_fleet(&[], &[]);
        let single = single.ready();
        let proxy = &fleet.proxy.url;
        let greedy = completion(PROMPT, 8);
        let (_, before) = post(&url(proxy, "/v1/completions"), &greedy).await;

        // Three long requests, all decoding on D before the pause (long enough, within
        // the servers' 1024 positions, that the tiny model is still decoding when D is
        // polled: three requests of 300 tokens took ~15 ms).
        let n_tokens = 900;
        let inflight: Vec<_> = (0..3)
            .map(|i| {
                let body = json!({"model": "tiny", "prompt": format!("{PROMPT} ({i})"),
                    "max_tokens": n_tokens, "ignore_eos": true, "temperature": 0,
                    "stream": true, "stream_options": {"include_usage": true}});
                let target = url(proxy, "/v1/completions");
                tokio::spawn(async move { stream(&target, &body).await })
            })
            .collect();
        wait_metrics(&fleet.d.url, Duration::from_secs(20), |t| {
            metric(t, "ferry_num_requests_running") >= 3.0
        })
        .await;

        let (status, paused) = post(&url(proxy, "/pause?mode=keep"), &json!(null)).await;
        assert_eq!(status, 200, "{paused}");
        assert_eq!(paused["instances"].as_array().unwrap().len(), 2, "{paused}");
        let (_, is_paused) = get(&url(proxy, "/is_paused")).await;
        assert_eq!(is_paused["is_paused"], true, "{is_paused}");

        // A push with no version: the proxy makes one, the same on both.
        let (status, updated) = push(proxy, "", norm_push(0.5)).await;
        assert_eq!(status, 200, "{updated}");
        let version = updated["weight_version"].as_str().unwrap().to_owned();
        assert!(version.starts_with("proxy-"), "{updated}");
        for instance in updated["instances"].as_array().unwrap() {
            assert_eq!(instance["status"], 200, "{updated}");
            assert_eq!(
                instance["body"]["weight_version"],
                version.as_str(),
                "{updated}"
            );
        }
        let (status, _) = push(
            &single.url,
            &format!("?weight_version={version}"),
            norm_push(0.5),
        )
        .await;
        assert_eq!(status, 200);
        let (_, info) = get(&url(proxy, "/weight_info")).await;
        for instance in info["instances"].as_array().unwrap() {
            assert_eq!(
                instance["body"]["weight_version"],
                version.as_str(),
                "{info}"
            );
        }

        let (status, resumed) = post(&url(proxy, "/resume"), &json!(null)).await;
        assert_eq!(status, 200, "{resumed}");
        for task in inflight {
            let (status, events, done) = task.await.unwrap();
            assert!(status == 200 && done, "{events:?}");
            let usage = &events.last().unwrap()["usage"];
            let tail = &events[events.len().saturating_sub(3)..];
            assert_eq!(
                usage["completion_tokens"],
                n_tokens,
                "{tail:?}\nD: {}",
                fleet.d.log()
            );
        }

        // After the update: one engine's tokens under the new weights, from a fresh transfer
        // (D's cache of this prompt under the old weights is never hit).
        let (status, after) = post(&url(proxy, "/v1/completions"), &greedy).await;
        assert_eq!(status, 200, "{after}");
        let (_, one) = post(&url(&single.url, "/v1/completions"), &greedy).await;
        assert_eq!(
            after["choices"][0]["logprobs"],
            one["choices"][0]["logprobs"]
        );
        assert_ne!(
            after["choices"][0]["logprobs"],
            before["choices"][0]["logprobs"]
        );
        assert_eq!(
            after["choices"][0]["weight_versions"],
            json!([version]),
            "{after}"
        );
        let d = metrics_text(&fleet.d.url).await;
        assert_eq!(metric(&d, "ferry_kv_loads_failed_total"), 0.0, "{d}");
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 5.0, "{d}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_clearing_pause_through_the_proxy_loses_no_request() {
    bounded(async {
        let single = serve(&[]);
        // Exports dropped by P's cache reset are recomputed on D.
        let fleet = pd_fleet(&[], &["--kv-load-failure-policy", "recompute"]);
        let single = single.ready();
        let proxy = fleet.proxy.url.clone();
        let n_tokens = 600;
        let prompts: Vec<String> = (0..6).map(|i| format!("{PROMPT} Request {i}.")).collect();
        let tasks: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (body, target) = (completion(p, n_tokens), url(&proxy, "/v1/completions"));
                tokio::spawn(async move { post(&target, &body).await })
            })
            .collect();
        // Some requests decoding on D, others on their way (P exporting, D loading).
        wait_metrics(&fleet.d.url, Duration::from_secs(20), |t| {
            metric(t, "ferry_num_requests_running") >= 1.0
        })
        .await;
        let (status, paused) = post(
            &url(&proxy, "/pause?mode=keep&clear_cache=true"),
            &json!(null),
        )
        .await;
        assert_eq!(status, 200, "{paused}");
        let (_, is_paused) = get(&url(&proxy, "/is_paused")).await;
        assert_eq!(is_paused["is_paused"], true, "{is_paused}");
        assert!(
            tasks.iter().any(|t| !t.is_finished()),
            "requests are in flight across the pause"
        );
        // Paused: D generates nothing.
        let before = metric(
            &metrics_text(&fleet.d.url).await,
            "ferry_generation_tokens_total",
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = metric(
            &metrics_text(&fleet.d.url).await,
            "ferry_generation_tokens_total",
        );
        assert_eq!(before, after, "D decodes nothing while paused");
        let (status, resumed) = post(&url(&proxy, "/resume"), &json!(null)).await;
        assert_eq!(status, 200, "{resumed}");
        for (task, prompt) in tasks.into_iter().zip(&prompts) {
            let (status, pd) = task.await.unwrap();
            assert_eq!(status, 200, "{pd}");
            let (_, one) = post(
                &url(&single.url, "/v1/completions"),
                &completion(prompt, n_tokens),
            )
            .await;
            assert_eq!(
                pd["choices"][0]["logprobs"], one["choices"][0]["logprobs"],
                "{prompt}"
            );
            assert_eq!(pd["usage"]["completion_tokens"], n_tokens);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_p_killed_while_d_pulls_fails_under_fail_and_recomputes_under_recompute() {
    bounded(async {
        let single = serve(&[]);
        let p = prefill(&[]);
        let d_fail = decode(&["--kv-load-failure-policy", "fail"]);
        let d_recompute = decode(&["--kv-load-failure-policy", "recompute"]);
        let (single, mut p, d_fail, d_recompute) = (
            single.ready(),
            p.ready(),
            d_fail.ready(),
            d_recompute.ready(),
        );
        let prompts = [format!("{PROMPT} One."), format!("{PROMPT} Two.")];
        let params = [
            export(&p.url, &prompts[0]).await,
            export(&p.url, &prompts[1]).await,
        ];

        // P stops (its transfer listener still accepts connections), both D start pulling,
        // then P dies with the pulls in flight.
        p.signal("STOP");
        let started = Instant::now();
        let pulls: Vec<_> = [&d_fail, &d_recompute]
            .iter()
            .zip(prompts.iter().zip(&params))
            .map(|(d, (prompt, params))| {
                let body = with(completion(prompt, 8), "kv_transfer_params", params.clone());
                let target = url(&d.url, "/v1/completions");
                tokio::spawn(async move { post(&target, &body).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        p.kill();
        let mut outcomes = Vec::new();
        for pull in pulls {
            outcomes.push(pull.await.unwrap());
        }
        assert!(started.elapsed() < Duration::from_secs(20));
        let (status, failed) = &outcomes[0];
        assert_eq!(*status, 500, "{failed}");
        assert_eq!(failed["error"]["type"], "generation_error", "{failed}");
        let (status, recomputed) = &outcomes[1];
        assert_eq!(*status, 200, "{recomputed}");
        let (_, one) = post(
            &url(&single.url, "/v1/completions"),
            &completion(&prompts[1], 8),
        )
        .await;
        assert_eq!(recomputed["choices"][0]["text"], one["choices"][0]["text"]);
        for d in [&d_fail, &d_recompute] {
            let m = metrics_text(&d.url).await;
            assert_eq!(metric(&m, "ferry_kv_loads_failed_total"), 1.0, "{m}");
            // D still serves.
            let (status, _) = post(&url(&d.url, "/v1/completions"), &completion("Hi", 2)).await;
            assert_eq!(status, 200);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_d_leaves_p_exports_that_come_back_by_lease() {
    bounded(async {
        let mut fleet = pd_fleet(&["--kv-lease-seconds", "1"], &[]);
        fleet.d.kill();
        let proxy = &fleet.proxy.url;
        for i in 0..3 {
            let started = Instant::now();
            let (status, out) = post(
                &url(proxy, "/v1/completions"),
                &completion(&format!("{PROMPT} {i}"), 8),
            )
            .await;
            assert_eq!(status, 503, "{out}");
            assert!(started.elapsed() < Duration::from_secs(5));
            let message = out["error"]["message"].as_str().unwrap();
            assert!(message.contains(&fleet.d.url), "{message}");
        }
        // P exported all three (its counters follow its answers by a step at most).
        wait_metrics(&fleet.p.url, Duration::from_secs(5), |t| {
            metric(t, "ferry_kv_exports_started_total") == 3.0
        })
        .await;
        // The leases run out and P's blocks are free again.
        let p = wait_metrics(&fleet.p.url, Duration::from_secs(10), |t| {
            metric(t, "ferry_kv_exports_expired_total") == 3.0
                && metric(t, "ferry_kv_blocks_used") == 0.0
        })
        .await;
        assert!(metric(&p, "ferry_kv_blocks_free") > 0.0, "{p}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_or_replayed_parameters_sent_straight_to_d_fail_closed() {
    bounded(async {
        let p = prefill(&[]);
        let d = decode(&[]);
        let other_d = decode(&[]);
        let (p, d, other_d) = (p.ready(), d.ready(), other_d.ready());
        let real = export(&p.url, PROMPT).await;
        let target = url(&d.url, "/v1/completions");
        let send = |params: Value, prompt: &str| {
            let body = with(completion(prompt, 4), "kv_transfer_params", params);
            let target = target.clone();
            async move { post(&target, &body).await }
        };
        let forged = [
            with(real.clone(), "export_token", json!("forged-token")),
            with(real.clone(), "remote_block_ids", json!([1, 2, 3, 4, 5, 6])),
        ];
        for params in forged {
            let (status, out) = send(params.clone(), PROMPT).await;
            assert_eq!(status, 500, "{params}: {out}");
            assert_eq!(out["error"]["type"], "generation_error", "{out}");
        }
        // The real parameters for another prompt.
        let (status, out) = send(real.clone(), "Some other prompt entirely, not P's.").await;
        assert_eq!(status, 500, "{out}");
        // A malformed set is a 400 naming the key.
        let (status, out) = send(with(real.clone(), "remote_port", json!(0)), PROMPT).await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["param"], "kv_transfer_params.remote_port");
        // The real ones still work (nothing above consumed the export), once.
        let (status, out) = send(real.clone(), PROMPT).await;
        assert_eq!(status, 200, "{out}");
        // A replay on another D: P serves each export once.
        let replay = with(completion(PROMPT, 4), "kv_transfer_params", real);
        let (status, out) = post(&url(&other_d.url, "/v1/completions"), &replay).await;
        assert_eq!(status, 500, "a replay: {out}");
        // Parameters of other weights are stale, not forged: D loads nothing, computes the
        // prompt and releases the export (the token is the right to), so the real parameters
        // find it gone afterwards.
        let fresh = export(&p.url, PROMPT).await;
        let stale = with(fresh.clone(), "weight_version", json!("v-other"));
        let (status, out) = send(stale, PROMPT).await;
        assert_eq!(status, 200, "computed, not failed: {out}");
        // The release reaches P on its own connection: P's blocks come back at once, not
        // after the lease.
        wait_metrics(&p.url, Duration::from_secs(5), |t| {
            metric(t, "ferry_kv_blocks_used") == 0.0
        })
        .await;
        let (status, out) = post(
            &url(&other_d.url, "/v1/completions"),
            &with(completion(PROMPT, 4), "kv_transfer_params", fresh),
        )
        .await;
        assert_eq!(status, 500, "released: {out}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_p_and_two_d_share_the_load() {
    bounded(async {
        let starting = [prefill(&[]), prefill(&[]), decode(&[]), decode(&[])];
        let procs: Vec<Proc> = starting.into_iter().map(Starting::ready).collect();
        let urls: Vec<&str> = procs.iter().map(|p| p.url.as_str()).collect();
        let proxy = proxy(&urls[..2], &urls[2..], &[]).ready();
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let body = completion(&format!("{PROMPT} Number {i}."), 30);
                let target = url(&proxy.url, "/v1/completions");
                tokio::spawn(async move { post(&target, &body).await })
            })
            .collect();
        for task in tasks {
            let (status, out) = task.await.unwrap();
            assert_eq!(status, 200, "{out}");
        }
        let fleet = metrics_text(&proxy.url).await;
        for u in &urls {
            let sent = fleet
                .lines()
                .find(|l| {
                    l.starts_with("ferry_proxy_requests_total") && l.contains(&format!("\"{u}\""))
                })
                .unwrap_or_else(|| panic!("no count for {u}: {fleet}"));
            let n: f64 = sent.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(n >= 1.0, "{u} got no request: {fleet}");
        }
        // The instances' own metrics, labelled.
        assert!(
            fleet.contains("ferry_kv_loads_finished_total{instance="),
            "{fleet}"
        );
        assert_eq!(
            metric(&fleet, "ferry_kv_loads_finished_total"),
            8.0,
            "{fleet}"
        );
        for d in &procs[2..] {
            let m = metrics_text(&d.url).await;
            assert!(metric(&m, "ferry_kv_loads_finished_total") >= 1.0, "{m}");
        }
        let (status, health) = get(&url(&proxy.url, "/health")).await;
        assert_eq!(status, 200, "{health}");
        assert_eq!(health["status"], "ok", "{health}");
        assert_eq!(health["instances"].as_array().unwrap().len(), 4);
        let (status, models) = get(&url(&proxy.url, "/v1/models")).await;
        assert_eq!(status, 200);
        assert_eq!(models["data"][0]["id"], "tiny", "{models}");
        let (status, tokens) =
            post(&url(&proxy.url, "/tokenize"), &json!({"prompt": "Hello"})).await;
        assert_eq!(status, 200, "{tokens}");
        assert!(tokens["count"].as_u64().unwrap() >= 1, "{tokens}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_instance_is_a_quick_503_and_a_partial_admin_call_names_it() {
    bounded(async {
        let p = prefill(&[]);
        let d = decode(&[]);
        let (p, d) = (p.ready(), d.ready());
        let dead = dead_url();
        let proxy = procs::proxy(&[&dead], &[&d.url], &[]).ready();
        let started = Instant::now();
        let (status, out) = post(&url(&proxy.url, "/v1/completions"), &completion(PROMPT, 4)).await;
        assert_eq!(status, 503, "{out}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(
            out["error"]["message"].as_str().unwrap().contains(&dead),
            "{out}"
        );
        let (status, health) = get(&url(&proxy.url, "/health")).await;
        assert_eq!(status, 503, "{health}");
        let (status, paused) = post(&url(&proxy.url, "/pause?mode=keep"), &json!(null)).await;
        assert_eq!(status, 502, "{paused}");
        let message = paused["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&dead) && message.contains("1 of 2"),
            "{message}"
        );
        let (status, _) = post(&url(&proxy.url, "/resume"), &json!(null)).await;
        assert_eq!(status, 502);

        // With a live P beside the dead one, requests go to the live one.
        let proxy = procs::proxy(&[&dead, &p.url], &[&d.url], &[]).ready();
        for _ in 0..3 {
            let (status, out) =
                post(&url(&proxy.url, "/v1/completions"), &completion(PROMPT, 4)).await;
            assert_eq!(status, 200, "{out}");
        }
        let (status, health) = get(&url(&proxy.url, "/health")).await;
        assert_eq!(
            (status, health["status"].as_str()),
            (200, Some("degraded")),
            "{health}"
        );
        // A weight update that reaches only some instances is an error naming the ones it
        // missed (P and D now disagree, which is why it is an error).
        let (status, out) = post(
            &url(&proxy.url, "/update_weight_version"),
            &json!({"new_version": "v9"}),
        )
        .await;
        assert_eq!(status, 502, "{out}");
        let message = out["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&dead) && !message.contains(&d.url),
            "{message}"
        );
        assert_eq!(out["instances"][2]["body"]["new_version"], "v9", "{out}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_guard_the_proxy_and_reach_the_instances_and_bad_input_is_a_400() {
    bounded(async {
        let instance_key = [("FERRY_API_KEY", "sk-instance-key")];
        let p = serve_env(&["--kv-role", "kv_producer"], &instance_key);
        let d = serve_env(&["--kv-role", "kv_consumer"], &instance_key);
        let (p, d) = (p.ready(), d.ready());
        let keys = [
            ("FERRY_API_KEY", "sk-client-key"),
            ("FERRY_INSTANCE_API_KEY", "sk-instance-key"),
        ];
        let proxy = proxy_env(&[&p.url], &[&d.url], &[], &keys).ready();
        let target = url(&proxy.url, "/v1/completions");
        let body = completion(PROMPT, 4);
        let (status, _, _) = call(reqwest::Method::POST, &target, Some(&body), &[]).await;
        assert_eq!(status, 401);
        let bearer = [("Authorization", "Bearer sk-client-key")];
        let (status, out, _) = call(reqwest::Method::POST, &target, Some(&body), &bearer).await;
        assert_eq!(status, 200, "{out}");
        let (status, out, _) = call(
            reqwest::Method::GET,
            &url(&proxy.url, "/is_paused"),
            None,
            &bearer,
        )
        .await;
        assert_eq!((status, &out["is_paused"]), (200, &json!(false)), "{out}");
        assert_eq!(get(&url(&proxy.url, "/health")).await.0, 200);

        // Bad input: the instances' 400 naming the field, or the proxy's for a body that is
        // not a JSON object.
        let bad = with(body.clone(), "max_tokens", json!("many"));
        let (status, out, _) = call(reqwest::Method::POST, &target, Some(&bad), &bearer).await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["param"], "max_tokens", "{out}");
        let (status, out, _) = call(
            reqwest::Method::POST,
            &target,
            Some(&json!([1, 2])),
            &bearer,
        )
        .await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["type"], "invalid_request_error");

        // Without --enable-admin-api the admin routes are 404s.
        let plain = spawn(
            &[
                "proxy".to_owned(),
                "--port".to_owned(),
                "0".to_owned(),
                "--prefill".to_owned(),
                p.url.clone(),
                "--decode".to_owned(),
                d.url.clone(),
            ],
            &[],
        )
        .ready();
        assert_eq!(post(&url(&plain.url, "/pause"), &json!(null)).await.0, 404);
    })
    .await;
}

#[test]
fn bad_proxy_flags_are_errors_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(FERRY)
            .arg("proxy")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--prefill", "http://127.0.0.1:1"]);
    assert!(err.contains("--decode"), "{err}");
    let err = run(&["--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"]);
    assert!(err.contains("--prefill"), "{err}");
    let err = run(&["--prefill", "http://h:1/v1", "--decode", "http://h:2"]);
    assert!(err.contains("without a path"), "{err}");
    let err = run(&["--prefill", "http://h:1", "--decode", "http://h:1"]);
    assert!(err.contains("given twice"), "{err}");
    let err = run(&[
        "--prefill",
        "http://h:1",
        "--decode",
        "http://h:2",
        "--connect-timeout-seconds",
        "0",
    ]);
    assert!(err.contains("--connect-timeout-seconds"), "{err}");
    let err = run(&[
        "--prefill",
        "http://h:1",
        "--decode",
        "http://h:2",
        "--stream-idle-timeout-seconds=-1",
    ]);
    assert!(err.contains("--stream-idle-timeout-seconds"), "{err}");
}

/// The default model (SmolLM2-135M-Instruct, fetched by scripts/fetch-model.sh; this test
/// FAILS, never skips, without it): 1P1D behind the proxy gives one engine's greedy tokens
/// and logprobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_model_gives_one_engines_tokens_through_p_and_d() {
    let cache = ferry_model::cache_dir(std::env::var_os("FERRY_CACHE"), std::env::var_os("HOME"))
        .expect("FERRY_CACHE or HOME is set");
    let path = ferry_model::default_model_path(&cache);
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/fetch-model.sh` first",
        path.display()
    );
    let model = path.to_str().unwrap().to_owned();
    bounded(async {
        let args = |role: Option<&str>| {
            let mut a = vec![
                "serve".to_owned(),
                "--model".to_owned(),
                model.clone(),
                "--served-model-name".to_owned(),
                "smol".to_owned(),
                "--port".to_owned(),
                "0".to_owned(),
                "--kv-cache-bytes".to_owned(),
                "64MiB".to_owned(),
                "--max-model-len".to_owned(),
                "512".to_owned(),
            ];
            if let Some(r) = role {
                a.extend(["--kv-role".to_owned(), r.to_owned()]);
            }
            a
        };
        let p = spawn(&args(Some("kv_producer")), &[]);
        let d = spawn(&args(Some("kv_consumer")), &[]);
        let (p, d) = (p.ready(), d.ready());
        let proxy = proxy(&[&p.url], &[&d.url], &[]).ready();
        let body = json!({"model": "smol", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                          "logprobs": 2, "ignore_eos": true});
        let (status, pd) = post(&url(&proxy.url, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{pd}");
        // One engine: D itself computing the prompt (a cache salt keeps it off the loaded
        // blocks).
        let alone = with(body, "cache_salt", json!("computed-here"));
        let (status, one) = post(&url(&d.url, "/v1/completions"), &alone).await;
        assert_eq!(status, 200, "{one}");
        assert_eq!(
            one["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{one}"
        );
        assert_eq!(pd["choices"][0]["text"], one["choices"][0]["text"]);
        assert_eq!(pd["choices"][0]["logprobs"], one["choices"][0]["logprobs"]);
        let m = metrics_text(&d.url).await;
        assert_eq!(metric(&m, "ferry_kv_loads_finished_total"), 1.0, "{m}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_through_the_proxy_reports_the_ttft_disaggregation_adds() {
    bounded(async {
        let single = serve(&[]);
        let fleet = pd_fleet(&[], &[]);
        let single = single.ready();
        let args: Vec<String> = [
            "bench",
            "serve",
            "--url",
            &fleet.proxy.url,
            "--baseline-url",
            &single.url,
            "--num-requests",
            "6",
            "--concurrency",
            "2",
            "--prompt-len",
            "64",
            "--output-len",
            "8",
            "--vocab-size",
            "256",
            "--json",
        ]
        .map(str::to_owned)
        .to_vec();
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new(FERRY)
                .args(&args)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        for side in ["target", "baseline"] {
            assert_eq!(r[side]["n_completed"], 6, "{side}: {r}");
            assert_eq!(r[side]["n_output_len_mismatch"], 0, "{side}: {r}");
        }
        assert!(r["ttft_added_ms"]["p50"].is_number(), "{r}");
        let d = metrics_text(&fleet.d.url).await;
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 6.0, "{d}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_id_reaches_d_and_a_client_that_goes_away_frees_d() {
    bounded(async {
        let fleet = pd_fleet(&[], &[]);
        let proxy = fleet.proxy.url.clone();
        let long = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 900,
                          "ignore_eos": true, "temperature": 0, "stream": true});
        // An abort through the proxy by the client's request id ends the stream on D.
        let target = url(&proxy, "/v1/completions");
        let body = long.clone();
        let aborted = tokio::spawn(async move {
            let response = client()
                .post(&target)
                .header("X-Request-Id", "rl-rollout-17")
                .json(&body)
                .send()
                .await
                .unwrap();
            response.text().await.unwrap()
        });
        wait_metrics(&fleet.d.url, Duration::from_secs(20), |t| {
            metric(t, "ferry_num_requests_running") >= 1.0
        })
        .await;
        let (status, out) = post(
            &url(&proxy, "/abort_requests"),
            &json!({"request_ids": ["rl-rollout-17"]}),
        )
        .await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["aborted"], 1, "{out}");
        let text = aborted.await.unwrap();
        assert!(text.contains(r#""finish_reason":"abort""#), "{text}");
        assert!(text.contains("data: [DONE]"), "{text}");

        // A client that goes away mid-stream: D's request ends too, and the proxy's count.
        let mut response = client()
            .post(url(&proxy, "/v1/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let first = response.chunk().await.unwrap();
        assert!(first.is_some());
        wait_metrics(&fleet.d.url, Duration::from_secs(20), |t| {
            metric(t, "ferry_num_requests_running") >= 1.0
        })
        .await;
        drop(response);
        wait_metrics(&fleet.d.url, Duration::from_secs(10), |t| {
            metric(t, "ferry_num_requests_running") == 0.0
        })
        .await;
        wait_metrics(&proxy, Duration::from_secs(10), |t| {
            metric(t, "ferry_proxy_in_flight_requests") == 0.0
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_wake_release_and_reset_through_the_proxy_reach_every_instance() {
    bounded(async {
        let fleet = pd_fleet(&[], &[]);
        let proxy = fleet.proxy.url.clone();
        let body = completion(PROMPT, 6);
        let (status, before) = post(&url(&proxy, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{before}");
        let admin = |path: &str| {
            let target = url(&proxy, path);
            async move {
                let (status, out) = post(&target, &json!(null)).await;
                assert_eq!(status, 200, "{target}: {out}");
                assert_eq!(out["instances"].as_array().unwrap().len(), 2, "{out}");
                out
            }
        };
        admin("/sleep?level=1&mode=wait").await;
        let (_, sleeping) = get(&url(&proxy, "/is_sleeping")).await;
        assert_eq!(sleeping["is_sleeping"], true, "{sleeping}");
        let woken = admin("/wake_up").await;
        assert_eq!(woken["is_sleeping"], false, "{woken}");
        admin("/pause?mode=wait&clear_cache=true").await;
        admin("/release_kv_cache_memory").await;
        let reset = admin("/reset_prefix_cache").await;
        assert_eq!(reset["success"], true, "{reset}");
        admin("/wake_up?tags=kv_cache").await;
        admin("/resume").await;
        for instance in [&fleet.p.url, &fleet.d.url] {
            let (_, paused) = get(&url(instance, "/is_paused")).await;
            assert_eq!(paused["is_paused"], false, "{instance}: {paused}");
        }
        let (status, after) = post(&url(&proxy, "/v1/completions"), &body).await;
        assert_eq!(status, 200, "{after}");
        assert_eq!(
            after["choices"][0]["logprobs"],
            before["choices"][0]["logprobs"]
        );
    })
    .await;
}

/// A P and a D on different weight versions: the proxy's version reads are a 409 naming
/// both, never one instance's version, and `/health` (with or without the proxy's admin API)
/// stays 200 with `version_skew`; once aligned through the proxy, all agree again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_on_different_weight_versions_are_a_409_and_a_version_skew() {
    bounded(async {
        let fleet = pd_fleet(&[], &[]);
        let proxy = fleet.proxy.url.clone();
        let (p, d) = (&fleet.p.url, &fleet.d.url);
        // The same proxy without its admin API still sees the skew on /health.
        let plain = spawn(
            &[
                "proxy".into(),
                "--port".into(),
                "0".into(),
                "--prefill".into(),
                p.clone(),
                "--decode".into(),
                d.clone(),
            ],
            &[],
        )
        .ready();

        let (status, agreed) = get(&url(&proxy, "/get_weight_version")).await;
        assert_eq!(status, 200, "{agreed}");
        let initial = agreed["weight_version"].as_str().unwrap().to_owned();
        assert_eq!(agreed["instances"].as_array().unwrap().len(), 2, "{agreed}");
        for base in [&proxy, &plain.url] {
            let (status, health) = get(&url(base, "/health")).await;
            assert_eq!(status, 200, "{health}");
            assert_eq!(health["version_skew"], false, "{health}");
        }

        // P alone moves to another version, asked directly.
        let (status, out) = post(
            &url(p, "/update_weight_version"),
            &json!({"new_version": "skewed-p"}),
        )
        .await;
        assert_eq!(status, 200, "{out}");
        for path in ["/get_weight_version", "/weight_info"] {
            let (status, out) = get(&url(&proxy, path)).await;
            assert_eq!(status, 409, "{path}: {out}");
            assert_eq!(out["error"]["type"], "conflict_error", "{out}");
            let message = out["error"]["message"].as_str().unwrap();
            for part in [
                format!("prefill {p} runs \"skewed-p\""),
                format!("decode {d} runs \"{initial}\""),
            ] {
                assert!(message.contains(&part), "{part}: {message}");
            }
            let instances = out["instances"].as_array().unwrap();
            assert_eq!(instances.len(), 2, "{out}");
            assert_eq!(
                (&instances[0]["url"], &instances[0]["role"]),
                (&json!(p), &json!("prefill"))
            );
            assert_eq!(instances[0]["status"], 200, "{out}");
            assert_eq!(instances[0]["body"]["weight_version"], "skewed-p", "{out}");
            assert_eq!(
                instances[1]["body"]["weight_version"],
                initial.as_str(),
                "{out}"
            );
        }
        let expected = json!([
            {"url": p, "role": "prefill", "version": "skewed-p"},
            {"url": d, "role": "decode", "version": initial},
        ]);
        for base in [&proxy, &plain.url] {
            let (status, health) = get(&url(base, "/health")).await;
            assert_eq!(status, 200, "{health}");
            assert_eq!(health["status"], "ok", "{health}");
            assert_eq!(health["version_skew"], true, "{health}");
            assert_eq!(health["weight_versions"], expected, "{health}");
        }

        // One version set through the proxy: every read agrees again.
        let (status, out) = post(
            &url(&proxy, "/update_weight_version"),
            &json!({"new_version": "aligned"}),
        )
        .await;
        assert_eq!(status, 200, "{out}");
        for path in ["/get_weight_version", "/weight_info"] {
            let (status, out) = get(&url(&proxy, path)).await;
            assert_eq!(status, 200, "{path}: {out}");
            assert_eq!(out["weight_version"], "aligned", "{out}");
            assert_eq!(out["instances"].as_array().unwrap().len(), 2, "{out}");
        }
        for base in [&proxy, &plain.url] {
            let (status, health) = get(&url(base, "/health")).await;
            assert_eq!(status, 200, "{health}");
            assert_eq!(health["version_skew"], false, "{health}");
            assert_eq!(
                health["weight_versions"][1]["version"], "aligned",
                "{health}"
            );
        }
    })
    .await;
}
