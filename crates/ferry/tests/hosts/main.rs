//! P, D and the proxy on hosts of their own (network namespaces joined by veth pairs, see
//! `net.rs`), with the fleet's transfer secret and faults on real links: a P–D link cut
//! mid-transfer, a rate-limited link under load, a relay that stalls, truncates or delays a
//! transfer (`relay.rs`), the proxy's link to D cut during a stream, P killed and restarted on
//! the same address, and the RL cycle across hosts.
//!
//! Each test runs in seconds: the servers' transfer and load timeouts are shortened by flag
//! (`--kv-io-timeout-seconds`, `--kv-load-timeout-seconds`, `--kv-lease-seconds`). The tests
//! take one lock each, so their processes never compete for the CPU, and each is bounded.
//! Where namespaces cannot be made they print a skip line, unless `FERRY_REQUIRE_HOSTS=1`
//! (`.ci/run`).

mod net;
#[allow(dead_code)] // Shared with the proxy tests; not every helper is used here.
#[path = "../proxy/procs.rs"]
mod procs;
mod relay;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use net::{Host, Link, Net};
use procs::*;
use relay::{Fault, Relay};
use serde_json::{json, Value};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TEST_BOUND: Duration = Duration::from_secs(120);

async fn bounded<F: std::future::Future<Output = ()>>(body: F) {
    let _turn = SERIAL.lock().await;
    tokio::time::timeout(TEST_BOUND, body)
        .await
        .expect("the test ran past its bound");
}

/// The port every server listens on in its own namespace.
const HTTP_PORT: u16 = 8000;
/// P's (and D's) KV transfer listener.
const KV_PORT: u16 = 7100;
const SECRET: &str = "the fleet's transfer secret for the host tests";
/// Shortened bounds, so a fault ends in seconds.
const IO_TIMEOUT_S: &str = "2";
const LOAD_TIMEOUT_S: f64 = 3.0;
const LEASE_S: &str = "2";

/// Three hosts (P, D and the proxy), each linked to the other two and to the root namespace
/// (where the test's client runs), and a server on each.
struct Fleet {
    p: Proc,
    /// Kept running while the fleet lives.
    _d: Proc,
    _proxy: Proc,
    /// P's and D's URLs from the root namespace.
    p_url: String,
    d_url: String,
    proxy_url: String,
    /// D's URL as the proxy knows it (what its errors name).
    d_url_at_proxy: String,
    p_host: Host,
    p_args: Vec<String>,
    /// P's environment beyond the secret (UCX's, over NIXL), for a restart.
    p_env: Vec<(&'static str, String)>,
    pd: Link,
    xd: Link,
    /// The root-side end of D's management link, where a relay poses as P.
    relay_addr: SocketAddr,
    /// P's transfer listener as the root namespace reaches it.
    p_kv_at_root: SocketAddr,
    _net: Net,
}

#[derive(Default)]
struct Options<'a> {
    p_extra: &'a [&'a str],
    d_extra: &'a [&'a str],
    proxy_extra: &'a [&'a str],
    /// P advertises the relay's address (`Fleet::relay_addr`) instead of its own on the P–D
    /// link.
    via_relay: bool,
    /// P and D move KV with `--kv-transport nixl` (UCX over TCP on the P–D link only).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    nixl: bool,
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// `ferry serve` on every interface of its host; P advertises `transfer_host` (D advertises
/// nothing, so it needs none).
fn serve_args(role: &str, transfer_host: Option<&str>, extra: &[String]) -> Vec<String> {
    let mut args = strings(&[
        "serve",
        "--model",
        "tiny",
        "--host",
        "0.0.0.0",
        "--port",
        &HTTP_PORT.to_string(),
        "--enable-admin-api",
        "--kv-cache-bytes",
        "16MiB",
        "--max-model-len",
        "1024",
        "--kv-role",
        role,
        "--kv-transfer-port",
        &KV_PORT.to_string(),
        "--kv-io-timeout-seconds",
        IO_TIMEOUT_S,
        "--kv-load-timeout-seconds",
        &LOAD_TIMEOUT_S.to_string(),
        "--kv-lease-seconds",
        LEASE_S,
    ]);
    if let Some(host) = transfer_host {
        args.extend(strings(&["--kv-transfer-host", host]));
    }
    args.extend_from_slice(extra);
    args
}

fn start_in(host: &Host, args: &[String], env: &[(&str, &str)]) -> Starting {
    let mut all = vec![("FERRY_KV_TRANSFER_SECRET", SECRET)];
    all.extend_from_slice(env);
    spawn_in(Some(&host.ns), args, &all, &[])
}

impl Fleet {
    fn start(test: &str, options: Options<'_>) -> Option<Fleet> {
        let mut net = Net::new(test)?;
        let (p, d, x) = (net.host("p"), net.host("d"), net.host("x"));
        let (root_p, root_d, root_x) = (
            net.link(None, Some(&p)),
            net.link(None, Some(&d)),
            net.link(None, Some(&x)),
        );
        let pd = net.link(Some(&p), Some(&d));
        let xp = net.link(Some(&x), Some(&p));
        let xd = net.link(Some(&x), Some(&d));
        let relay_addr = SocketAddr::new(root_d.addr_a.into(), KV_PORT);
        let p_kv_at_root = SocketAddr::new(root_p.addr_b.into(), KV_PORT);
        let advertised = if options.via_relay {
            relay_addr.ip().to_string()
        } else {
            pd.addr_a.to_string()
        };
        let transport = strings(if options.nixl {
            &["--kv-transport", "nixl"]
        } else {
            &[]
        });
        // UCX over TCP, on the P–D link's interface (named alike on both hosts).
        let p_env: Vec<(&'static str, String)> = if options.nixl {
            vec![
                ("UCX_TLS", "tcp,self".into()),
                ("UCX_NET_DEVICES", pd.a.1.clone()),
            ]
        } else {
            Vec::new()
        };
        let ucx: Vec<(&str, &str)> = p_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut p_extra = transport.clone();
        p_extra.extend(strings(options.p_extra));
        let p_args = serve_args("kv_producer", Some(&advertised), &p_extra);
        let mut d_extra = strings(&[
            "--kv-allowed-peers",
            &format!("{},{}", pd.addr_a, relay_addr.ip()),
        ]);
        d_extra.extend(transport);
        d_extra.extend(strings(options.d_extra));
        let d_args = serve_args("kv_consumer", None, &d_extra);
        let (p_proc, d_proc) = (start_in(&p, &p_args, &ucx), start_in(&d, &d_args, &ucx));
        let (p_proc, d_proc) = (p_proc.ready(), d_proc.ready());
        let (p_at_x, d_at_x) = (
            format!("http://{}:{HTTP_PORT}", xp.addr_b),
            format!("http://{}:{HTTP_PORT}", xd.addr_b),
        );
        let mut proxy_args = strings(&[
            "proxy",
            "--host",
            "0.0.0.0",
            "--port",
            &HTTP_PORT.to_string(),
            "--enable-admin-api",
            "--prefill",
            &p_at_x,
            "--decode",
            &d_at_x,
        ]);
        proxy_args.extend(strings(options.proxy_extra));
        let proxy = spawn_in(Some(&x.ns), &proxy_args, &[], &[]).ready();
        Some(Fleet {
            p: p_proc,
            _d: d_proc,
            _proxy: proxy,
            p_url: format!("http://{}:{HTTP_PORT}", root_p.addr_b),
            d_url: format!("http://{}:{HTTP_PORT}", root_d.addr_b),
            proxy_url: format!("http://{}:{HTTP_PORT}", root_x.addr_b),
            d_url_at_proxy: d_at_x,
            p_host: p,
            p_args,
            p_env,
            pd,
            xd,
            relay_addr,
            p_kv_at_root,
            _net: net,
        })
    }

    /// One engine's answer to `body`: P computes it whole (a request without transfer
    /// parameters), which is what P/D must give.
    async fn reference(&self, body: &Value) -> Value {
        let (status, out) = post(&url(&self.p_url, "/v1/completions"), body).await;
        assert_eq!(status, 200, "{out}");
        out
    }

    async fn via_proxy(&self, body: &Value) -> (u16, Value) {
        post(&url(&self.proxy_url, "/v1/completions"), body).await
    }

    /// D's metrics once it is settled: every load it started finished or failed, and no
    /// request is left (its counters follow its answers by a step).
    async fn d_metrics(&self) -> String {
        wait_metrics(&self.d_url, Duration::from_secs(10), |t| {
            metric(t, "ferry_kv_loads_started_total")
                == metric(t, "ferry_kv_loads_finished_total")
                    + metric(t, "ferry_kv_loads_failed_total")
                && metric(t, "ferry_num_requests_running") == 0.0
                && metric(t, "ferry_num_requests_waiting") == 0.0
        })
        .await
    }

    /// Waits until neither P nor D holds a block for a request or an export: every export
    /// ended (pulled, or back by its lease) and every load settled.
    async fn no_block_held(&self) {
        for base in [&self.p_url, &self.d_url] {
            wait_metrics(base, Duration::from_secs(20), |t| {
                metric(t, "ferry_kv_blocks_used") == 0.0
                    && metric(t, "ferry_num_requests_running") == 0.0
                    && metric(t, "ferry_num_requests_waiting") == 0.0
            })
            .await;
        }
    }
}

/// A prompt of about `n` hundred tokens (a few blocks of KV each), different for each `tag`.
fn long_prompt(tag: &str, hundreds: usize) -> String {
    let mut prompt = format!("Request {tag}. ");
    for i in 0..hundreds {
        prompt.push_str(&format!("{PROMPT} Part {i} of {tag}. "));
    }
    prompt
}

/// What P/D must give exactly as one engine does: the tokens and their logprobs.
fn logprobs_of(out: &Value) -> &Value {
    &out["choices"][0]["logprobs"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_p_d_link_cut_mid_transfer_fails_by_the_timeout_under_fail() {
    bounded(link_cut_mid_transfer("fail")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_p_d_link_cut_mid_transfer_recomputes_under_recompute() {
    bounded(link_cut_mid_transfer("recompute")).await;
}

/// The P–D link, slowed so a transfer takes seconds, is cut once D's load started: the load
/// fails by D's bounds and the policy applies; P's export comes back by its lease; nothing is
/// held on either side; the restored link carries the next transfer.
async fn link_cut_mid_transfer(policy: &str) {
    link_cut_mid_transfer_over(policy, false).await;
}

async fn link_cut_mid_transfer_over(policy: &str, nixl: bool) {
    let options = Options {
        // Over NIXL, P's read timeout (1 s, which P tells D with the addresses) ends D's read
        // before D's load bound (3 s) would: the read itself runs out of time.
        p_extra: if nixl {
            &["--kv-read-timeout-seconds", "1"]
        } else {
            &[]
        },
        d_extra: &["--kv-load-failure-policy", policy],
        nixl,
        ..Options::default()
    };
    let Some(fleet) = Fleet::start(&format!("link cut ({policy})"), options) else {
        return;
    };
    // ~500 tokens of KV (256 KiB) over 1 Mbit/s: about two seconds; and P's socket buffers
    // smaller than the transfer, so the cut stalls P's writes too (instead of P handing the
    // whole export to its kernel and counting it pulled).
    fleet.pd.limit("1mbit");
    fleet.p_host.sysctl("net.ipv4.tcp_wmem", "4096 16384 65536");
    let body = completion(&long_prompt("cut", 3), 8);
    let reference = fleet.reference(&body).await;
    let (proxy, request) = (url(&fleet.proxy_url, "/v1/completions"), body.clone());
    let answer = tokio::spawn(async move { post(&proxy, &request).await });
    wait_metrics(&fleet.d_url, Duration::from_secs(20), |t| {
        metric(t, "ferry_kv_loads_started_total") == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    fleet.pd.cut();
    let cut_at = Instant::now();
    let (status, out) = answer.await.unwrap();
    let took = cut_at.elapsed();
    assert!(
        took < Duration::from_secs_f64(LOAD_TIMEOUT_S + 3.0),
        "the answer took {took:?} after the cut"
    );
    let d = fleet.d_metrics().await;
    assert_eq!(metric(&d, "ferry_kv_loads_failed_total"), 1.0, "{d}");
    assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 0.0, "{d}");
    // A stalled transfer is a timeout, whichever bound ended it: TCP's io_timeout (2 s) or,
    // over NIXL, the read's own deadline, P's read timeout.
    assert_eq!(metric(&d, "ferry_kv_loads_timed_out_total"), 1.0, "{d}");
    match policy {
        "fail" => {
            assert_eq!(status, 500, "{out}");
            let message = out["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("KV"), "the error says why: {out}");
        }
        _ => {
            assert_eq!(status, 200, "{out}");
            assert_eq!(
                logprobs_of(&out),
                logprobs_of(&reference),
                "recomputed on D"
            );
        }
    }
    fleet.pd.restore();
    // P's pull broke off: the export is P's again until its lease ends.
    wait_metrics(&fleet.p_url, Duration::from_secs(20), |t| {
        metric(t, "ferry_kv_exports_expired_total") == 1.0
    })
    .await;
    fleet.no_block_held().await;
    // The restored link carries the next transfer.
    let next = completion(&long_prompt("after", 1), 8);
    let reference = fleet.reference(&next).await;
    let (status, out) = fleet.via_proxy(&next).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(logprobs_of(&out), logprobs_of(&reference));
    let d = fleet.d_metrics().await;
    assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 1.0, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_transfers_over_a_50_mbit_link_give_one_engines_tokens() {
    bounded(sixteen_transfers_over_a_50_mbit_link(false)).await;
}

async fn sixteen_transfers_over_a_50_mbit_link(nixl: bool) {
    {
        let options = Options {
            nixl,
            ..Options::default()
        };
        let Some(fleet) = Fleet::start("50 Mbit/s", options) else {
            return;
        };
        fleet.pd.limit("50mbit");
        let bodies: Vec<Value> = (0..16)
            .map(|i| completion(&long_prompt(&i.to_string(), 2), 8))
            .collect();
        let tasks: Vec<_> = bodies
            .iter()
            .map(|body| {
                let (proxy, body) = (url(&fleet.proxy_url, "/v1/completions"), body.clone());
                tokio::spawn(async move { post(&proxy, &body).await })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        for (body, (status, out)) in bodies.iter().zip(&answers) {
            assert_eq!(*status, 200, "{out}");
            let reference = fleet.reference(body).await;
            assert_eq!(logprobs_of(out), logprobs_of(&reference));
        }
        let d = fleet.d_metrics().await;
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 16.0, "{d}");
        assert_eq!(metric(&d, "ferry_kv_loads_failed_total"), 0.0, "{d}");
        fleet.no_block_held().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_stalls_truncates_or_delays_a_transfer_loads_nothing_partial() {
    bounded(async {
        let options = Options {
            d_extra: &["--kv-load-failure-policy", "recompute"],
            via_relay: true,
            ..Options::default()
        };
        let Some(fleet) = Fleet::start("relay faults", options) else {
            return;
        };
        let relay = Relay::start(fleet.relay_addr, fleet.p_kv_at_root).await;
        // One whole transfer through the relay: its bytes.
        relay.set(Fault::Pass);
        let body = completion(&long_prompt("whole", 3), 8);
        let reference = fleet.reference(&body).await;
        let (status, out) = fleet.via_proxy(&body).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(logprobs_of(&out), logprobs_of(&reference));
        let d = fleet.d_metrics().await;
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 1.0, "{d}");
        let whole = relay.forwarded();
        assert!(whole > 64 * 1024, "a transfer of {whole} bytes");

        // Each fault, and the counter that names its kind on D.
        let faults = [
            (
                "stalled midway",
                Fault::StallAfter(whole / 2),
                "ferry_kv_loads_timed_out_total",
            ),
            (
                "closed after half the bytes",
                Fault::CloseAfter(whole / 2),
                "ferry_kv_loads_broken_total",
            ),
            (
                "first byte after the load timeout",
                Fault::DelayFirst(Duration::from_secs_f64(LOAD_TIMEOUT_S + 2.0)),
                "ferry_kv_loads_timed_out_total",
            ),
        ];
        for (i, (what, fault, kind)) in faults.into_iter().enumerate() {
            let kind_before = metric(&fleet.d_metrics().await, kind);
            relay.set(fault);
            // The same length as the whole one, so half its bytes is mid-transfer.
            let body = completion(&long_prompt(&format!("fault {i}"), 3), 8);
            let reference = fleet.reference(&body).await;
            let started = Instant::now();
            let (status, out) = fleet.via_proxy(&body).await;
            assert_eq!(status, 200, "{what}: {out}");
            // Recomputed: the tokens of one engine, nothing from the partial transfer.
            assert_eq!(logprobs_of(&out), logprobs_of(&reference), "{what}");
            assert!(
                started.elapsed() < Duration::from_secs_f64(LOAD_TIMEOUT_S + 5.0),
                "{what}: {:?}",
                started.elapsed()
            );
            let d = fleet.d_metrics().await;
            assert_eq!(
                metric(&d, "ferry_kv_loads_failed_total"),
                (i + 1) as f64,
                "{what}: {d}"
            );
            assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 1.0, "{what}");
            assert_eq!(metric(&d, kind), kind_before + 1.0, "{what}: {d}");
            fleet.no_block_held().await;
        }
        // And a whole transfer again.
        relay.set(Fault::Pass);
        let body = completion(&long_prompt("whole again", 3), 8);
        let reference = fleet.reference(&body).await;
        let (status, out) = fleet.via_proxy(&body).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(logprobs_of(&out), logprobs_of(&reference));
        let d = fleet.d_metrics().await;
        assert_eq!(metric(&d, "ferry_kv_loads_finished_total"), 2.0, "{d}");
        fleet.no_block_held().await;
    })
    .await;
}

/// The proxy's bound on silence in the tests that cut its link to D.
const IDLE_S: f64 = 3.0;

/// A fleet whose proxy bounds silence at [`IDLE_S`], with D paused (keep) holding the one
/// request `send` sent through the proxy, awaited past the bound (so only a dead link can end
/// it); `None` where hosts cannot be made.
async fn held_by_paused_d<T, F>(
    test: &str,
    send: impl FnOnce(String) -> F,
) -> Option<(Fleet, tokio::task::JoinHandle<T>)>
where
    T: Send + 'static,
    F: std::future::Future<Output = T> + Send + 'static,
{
    let options = Options {
        proxy_extra: &["--stream-idle-timeout-seconds", "3"],
        ..Options::default()
    };
    let fleet = Fleet::start(test, options)?;
    let (status, out) = post(&url(&fleet.d_url, "/pause?mode=keep"), &json!(null)).await;
    assert_eq!(status, 200, "{out}");
    let task = tokio::spawn(send(url(&fleet.proxy_url, "/v1/completions")));
    wait_metrics(&fleet.d_url, Duration::from_secs(20), |t| {
        metric(t, "ferry_num_requests_waiting") + metric(t, "ferry_num_requests_running") == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs_f64(IDLE_S + 1.5)).await;
    assert!(!task.is_finished(), "the held request is still awaited");
    Some((fleet, task))
}

/// Cuts the proxy's link to D and returns the held request's outcome, checked to come within
/// the proxy's bound; then restores the link, resumes D and checks D holds nothing.
async fn cut_the_link_to_d<T>(fleet: &Fleet, task: tokio::task::JoinHandle<T>) -> T {
    fleet.xd.cut();
    let cut_at = Instant::now();
    let outcome = task.await.unwrap();
    let took = cut_at.elapsed();
    assert!(
        took < Duration::from_secs_f64(IDLE_S + 2.5),
        "the answer came {took:?} after the cut"
    );
    fleet.xd.restore();
    let (status, out) = post(&url(&fleet.d_url, "/resume"), &json!(null)).await;
    assert_eq!(status, 200, "{out}");
    // D's request does not hang: resumed, it finishes (or the proxy's close reaches D).
    fleet.no_block_held().await;
    outcome
}

/// The failures the proxy counted against D.
async fn proxy_failures_of_d(fleet: &Fleet) -> String {
    let text = metrics_text(&fleet.proxy_url).await;
    text.lines()
        .find(|l| l.starts_with("ferry_proxy_failures_total") && l.contains(&fleet.d_url_at_proxy))
        .unwrap_or_else(|| panic!("{text}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_link_to_d_cut_during_a_stream_is_an_error_naming_d() {
    bounded(async {
        // The paused stream is open and quiet but for D's keep-alives, which hold it open
        // past the proxy's bound.
        let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 16,
                          "temperature": 0, "stream": true});
        let held = held_by_paused_d(
            "stream cut",
            |proxy| async move { stream(&proxy, &body).await },
        );
        let Some((fleet, task)) = held.await else {
            return;
        };
        let (status, events, done) = cut_the_link_to_d(&fleet, task).await;
        assert_eq!(status, 200);
        assert!(done, "{events:?}");
        let error = events.last().unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&fleet.d_url_at_proxy) && message.contains("nothing"),
            "{error}"
        );
        let failures = proxy_failures_of_d(&fleet).await;
        assert!(failures.ends_with(" 1"), "{failures}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_answer_over_a_cut_link_to_d_is_a_502_naming_d() {
    bounded(async {
        // No byte of a held answer comes for as long as the pause lasts, as for a long
        // generation; a live D answers the proxy's keep-alive probes meanwhile.
        let body = completion(PROMPT, 8);
        let held = held_by_paused_d(
            "answer cut",
            |proxy| async move { post(&proxy, &body).await },
        );
        let Some((fleet, task)) = held.await else {
            return;
        };
        let (status, out) = cut_the_link_to_d(&fleet, task).await;
        assert_eq!(status, 502, "{out}");
        let message = out["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&fleet.d_url_at_proxy), "{out}");
        let failures = proxy_failures_of_d(&fleet).await;
        assert!(failures.ends_with(" 1"), "{failures}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_killed_and_restarted_on_its_address_serves_d_again_without_a_stale_connection() {
    bounded(p_killed_and_restarted(false)).await;
}

/// P killed under load and restarted on its address; over NIXL the new P is a new agent with
/// new metadata, which D must load instead of reading through the old one.
async fn p_killed_and_restarted(nixl: bool) {
    {
        let options = Options {
            d_extra: &["--kv-load-failure-policy", "recompute"],
            nixl,
            ..Options::default()
        };
        let Some(mut fleet) = Fleet::start("P restart", options) else {
            return;
        };
        // Transfers before: D has connections to this P.
        for i in 0..3 {
            let body = completion(&long_prompt(&format!("before {i}"), 1), 4);
            let (status, out) = fleet.via_proxy(&body).await;
            assert_eq!(status, 200, "{out}");
        }
        // Clients keep sending while P dies and comes back.
        let proxy = fleet.proxy_url.clone();
        let load = tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..40 {
                let body = completion(&long_prompt(&format!("load {i}"), 1), 4);
                let (status, _) = post(&url(&proxy, "/v1/completions"), &body).await;
                statuses.push(status);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            statuses
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        fleet.p.kill();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let env: Vec<(&str, &str)> = fleet.p_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fleet.p = start_in(&fleet.p_host, &fleet.p_args, &env).ready();
        let statuses = load.await.unwrap();
        // While P was down the proxy answered 503 (no P reachable), or 502 for a prefill P
        // died in; every other answer is whole (recomputed when its pull met the dying P).
        assert!(
            statuses.iter().all(|s| [200, 502, 503].contains(s)),
            "{statuses:?}"
        );
        assert!(statuses.contains(&200), "{statuses:?}");

        // After the restart: every transfer loads, none meets a connection to the old P.
        let d = fleet.d_metrics().await;
        let (finished, failed) = (
            metric(&d, "ferry_kv_loads_finished_total"),
            metric(&d, "ferry_kv_loads_failed_total"),
        );
        for i in 0..5 {
            let body = completion(&long_prompt(&format!("after {i}"), 1), 8);
            let reference = fleet.reference(&body).await;
            let (status, out) = fleet.via_proxy(&body).await;
            assert_eq!(status, 200, "{out}");
            assert_eq!(logprobs_of(&out), logprobs_of(&reference));
        }
        let d = fleet.d_metrics().await;
        assert_eq!(
            metric(&d, "ferry_kv_loads_finished_total"),
            finished + 5.0,
            "{d}"
        );
        assert_eq!(metric(&d, "ferry_kv_loads_failed_total"), failed, "{d}");
        fleet.no_block_held().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rl_cycle_across_hosts_loses_nothing_and_sets_one_version() {
    bounded(rl_cycle_across_hosts(false)).await;
}

/// Over NIXL (`--kv-transport nixl`, UCX over TCP between the hosts), the P/D tests whose
/// faults are on the link or the peers themselves (the relay's stand in for P's side channel
/// only, which a one-sided read bypasses): the RL cycle, sixteen reads over a limited link, P
/// killed and restarted, and the P–D link cut mid-read.
#[cfg(feature = "nixl")]
mod over_nixl {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_rl_cycle_across_hosts_loses_nothing_and_sets_one_version() {
        bounded(rl_cycle_across_hosts(true)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sixteen_reads_over_a_50_mbit_link_give_one_engines_tokens() {
        bounded(sixteen_transfers_over_a_50_mbit_link(true)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn p_killed_and_restarted_on_its_address_serves_d_again_with_new_metadata() {
        bounded(p_killed_and_restarted(true)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_p_d_link_cut_mid_read_fails_by_the_timeout_under_fail() {
        bounded(link_cut_mid_transfer_over("fail", true)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_p_d_link_cut_mid_read_recomputes_under_recompute() {
        bounded(link_cut_mid_transfer_over("recompute", true)).await;
    }
}

async fn rl_cycle_across_hosts(nixl: bool) {
    {
        // The shipped defaults (D's load failure policy included).
        let options = Options {
            nixl,
            ..Options::default()
        };
        let Some(fleet) = Fleet::start("RL cycle", options) else {
            return;
        };
        let proxy = fleet.proxy_url.clone();
        let n_tokens = 900;
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let body = json!({"model": "tiny", "prompt": format!("{PROMPT} ({i})"),
                    "max_tokens": n_tokens, "ignore_eos": true, "temperature": 0,
                    "stream": true, "stream_options": {"include_usage": true}});
                let target = url(&proxy, "/v1/completions");
                tokio::spawn(async move { stream(&target, &body).await })
            })
            .collect();
        wait_metrics(&fleet.d_url, Duration::from_secs(20), |t| {
            metric(t, "ferry_num_requests_running") >= 1.0
        })
        .await;
        let (status, paused) = post(
            &url(&proxy, "/pause?mode=keep&clear_cache=true"),
            &json!(null),
        )
        .await;
        assert_eq!(status, 200, "{paused}");
        let (status, updated) = push(&proxy, "?weight_version=step-1", norm_push(0.5)).await;
        assert_eq!(status, 200, "{updated}");
        let (status, resumed) = post(&url(&proxy, "/resume"), &json!(null)).await;
        assert_eq!(status, 200, "{resumed}");
        for task in tasks {
            let (status, events, done) = task.await.unwrap();
            assert!(status == 200 && done, "{events:?}");
            let usage = &events.last().unwrap()["usage"];
            assert_eq!(usage["completion_tokens"], n_tokens, "{usage}\n{events:?}");
        }
        for base in [&fleet.p_url, &fleet.d_url] {
            let (_, info) = get(&url(base, "/weight_info")).await;
            assert_eq!(info["weight_version"], "step-1", "{base}: {info}");
        }
        // A transfer under the new weights gives P's own answer, tagged with the version.
        let body = completion(&long_prompt("after the update", 1), 8);
        let reference = fleet.reference(&body).await;
        let (status, out) = fleet.via_proxy(&body).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(logprobs_of(&out), logprobs_of(&reference));
        assert_eq!(out["choices"][0]["weight_versions"], json!(["step-1"]));
        fleet.no_block_held().await;
    }
}

/// `ferry bench transfer`'s two ends on two hosts over a link limited to 50 Mbit/s: the rate
/// it reports is the link's, within 20% (TCP/IP headers take about 4% of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_transfer_between_two_hosts_reports_the_rate_of_a_limited_link() {
    bounded(async {
        let Some(mut net) = Net::new("bench transfer") else {
            return;
        };
        let (p, d) = (net.host("p"), net.host("d"));
        let link = net.link(Some(&p), Some(&d));
        let limit_mbit = 50.0;
        link.limit("50mbit");
        let addr = format!("{}:{KV_PORT}", link.addr_a);
        // 8 blocks of the default model's layout (5.9 MB, about a second at the limit), 3
        // pulls.
        const SIZES: [&str; 5] = ["--n-blocks", "8", "--repeat", "3", "--json"];
        let bench = |host: &Host, end: &[&str]| {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", &host.ns, FERRY, "bench", "transfer"])
                .args(SIZES)
                .args(end)
                .args(["--timeout-seconds", "60"])
                .env("FERRY_KV_TRANSFER_SECRET", SECRET)
                .env("RUST_LOG", "warn");
            c
        };
        let mut serve = bench(&p, &["--serve", &addr])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("the serve end");
        let pulled = tokio::task::spawn_blocking(move || {
            bench(&d, &["--pull", &addr])
                .output()
                .expect("the pull end")
        })
        .await
        .unwrap();
        let _ = serve.kill();
        let _ = serve.wait();
        assert!(
            pulled.status.success(),
            "{}",
            String::from_utf8_lossy(&pulled.stderr)
        );
        let report: Value = serde_json::from_slice(&pulled.stdout).expect("one JSON object");
        let rate = report["median_mbit_per_s"].as_f64().unwrap();
        assert!(
            (rate - limit_mbit).abs() <= 0.2 * limit_mbit,
            "{rate:.1} Mbit/s over a {limit_mbit} Mbit/s link: {report}"
        );
        eprintln!("bench transfer over a {limit_mbit} Mbit/s link: {report}");
    })
    .await;
}
