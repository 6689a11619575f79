//! The RL loop through `ferry proxy` in front of one P and one D (`ferry serve --model tiny`
//! processes on loopback), every flag at its default but `--enable-admin-api` (so D runs
//! `--kv-load-failure-policy fail`): eight clients send completions through the proxy while a
//! trainer runs 40 weight-update cycles through it (a clearing keep pause, a weight reload from
//! disk, sometimes an extra prefix-cache reset or a clearing wait pause, a resume). Nobody asks
//! for an abort, so no request may be lost: every answer is a 200 that ends with `length` or
//! `stop`, every admin call succeeds, and afterwards every KV block on P and D is free again.
//!
//! Guards the issue "The RL loop loses nothing with P/D at default settings": a request whose
//! export was computed before a weight update used to fail on D with a 500 ("the exported KV
//! was computed with weights "0", this engine runs "proxy-…"") in about 0.3% of requests.

#[allow(dead_code)] // Shared with the proxy tests; not every helper is used here.
#[path = "proxy/procs.rs"]
mod procs;
#[path = "rl_loop/common.rs"]
mod rl_loop;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rl_loop_through_the_proxy_loses_nothing_at_default_settings() {
    let report = rl_loop::run_rl_loop(&[], &[]).await;
    assert!(report.d_loads > 0.0, "D loaded KV from P: {report:?}");
    eprintln!(
        "rl_loop_pd: {} requests, {} loads; slowest clearing keep pause {:?}",
        report.n_sent,
        report.d_loads,
        report.keep_pauses.iter().max()
    );
}
