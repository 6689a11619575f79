//! `GET /metrics`: Prometheus text. Latency histograms (time to first token, inter-token
//! latency, request latency) are recorded here, in the server, per output chunk as clients
//! see them; engine figures (queue lengths, KV blocks, prefix-cache hit rate, step and forward
//! seconds, KV transfers started, pulled, expired, failed (and apart: broken, timed out,
//! cancelled, refused), bytes and load seconds, the offload tier's bytes, hits, stores, loads,
//! evictions and flushes) are read from the engine's latest stats snapshot at scrape time.

use std::fmt;
use std::sync::Arc;

use ferry_engine::EngineStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type StatsFn = dyn Fn() -> EngineStats + Send + Sync;

/// Histograms and counters the server records, and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    ttft_seconds: Histogram,
    itl_seconds: Histogram,
    request_seconds: Histogram,
    prompt_tokens: Counter,
}

const TTFT_BUCKETS: [f64; 17] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
    40.0,
];
const ITL_BUCKETS: [f64; 17] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5,
    1.0, 2.5,
];
const REQUEST_BUCKETS: [f64; 14] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
];

impl Metrics {
    /// `stats` is called on every scrape to read the engine's latest snapshot.
    pub fn new(stats: impl Fn() -> EngineStats + Send + Sync + 'static) -> Self {
        let mut registry = Registry::with_prefix("ferry");
        let ttft_seconds = Histogram::new(TTFT_BUCKETS);
        let itl_seconds = Histogram::new(ITL_BUCKETS);
        let request_seconds = Histogram::new(REQUEST_BUCKETS);
        let prompt_tokens = Counter::default();
        registry.register(
            "time_to_first_token_seconds",
            "Time from request arrival to the first output token, per choice",
            ttft_seconds.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between two output chunks of one choice",
            itl_seconds.clone(),
        );
        registry.register(
            "request_latency_seconds",
            "Time from request arrival to a choice's last token",
            request_seconds.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of accepted generation requests (per choice)",
            prompt_tokens.clone(),
        );
        registry.register_collector(Box::new(EngineCollector {
            stats: Arc::new(stats),
        }));
        Self {
            registry,
            ttft_seconds,
            itl_seconds,
            request_seconds,
            prompt_tokens,
        }
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft_seconds.observe(seconds);
    }

    pub fn observe_itl(&self, seconds: f64) {
        self.itl_seconds.observe(seconds);
    }

    pub fn observe_request(&self, seconds: f64) {
        self.request_seconds.observe(seconds);
    }

    pub fn add_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.inc_by(n as u64);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Reads the engine's snapshot at scrape time (the engine thread is never touched).
struct EngineCollector {
    stats: Arc<StatsFn>,
}

impl fmt::Debug for EngineCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EngineCollector")
    }
}

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let s = (self.stats)();
        let sched = &s.scheduler;
        let hit_rate = if sched.prefix_query_tokens == 0 {
            0.0
        } else {
            sched.prefix_hit_tokens as f64 / sched.prefix_query_tokens as f64
        };
        let gauges: [(&str, &str, f64); 8] = [
            (
                "engine_paused",
                "1 while the engine is paused (between a pause or sleep and a resume)",
                f64::from(u8::from(s.lifecycle.paused)),
            ),
            (
                "engine_sleeping",
                "1 while some memory is released by a sleep",
                f64::from(u8::from(s.lifecycle.sleeping)),
            ),
            (
                "num_requests_running",
                "Requests running in the engine",
                sched.n_running as f64,
            ),
            (
                "num_requests_waiting",
                "Requests waiting in the engine",
                sched.n_waiting as f64,
            ),
            (
                "kv_blocks_used",
                "KV blocks held by requests",
                sched.n_blocks_used as f64,
            ),
            (
                "kv_blocks_free",
                "KV blocks free (cached or not)",
                sched.n_blocks_free as f64,
            ),
            (
                "kv_blocks_total",
                "KV blocks in the pool",
                s.n_blocks_total as f64,
            ),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up",
                hit_rate,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        // An info metric: the version is a label, the value always 1.
        let info = ConstGauge::new(1.0);
        let mut family = encoder.encode_descriptor(
            "weight_version_info",
            "The weight version now loaded (label `version`)",
            None,
            info.metric_type(),
        )?;
        info.encode(family.encode_family(&[("version", s.weight_version.as_str())])?)?;
        let t = &s.transfers;
        let counters: [(&str, &str, f64); 23] = [
            (
                "lifecycle_calls",
                "Lifecycle calls (pause, resume, sleep, ...) the engine handled",
                s.n_lifecycle_calls_total as f64,
            ),
            (
                "lifecycle_call_seconds",
                "Engine-thread time spent handling lifecycle calls",
                s.lifecycle_call_seconds_total,
            ),
            (
                "prefix_cache_hit_tokens",
                "Prompt tokens found in the prefix cache",
                sched.prefix_hit_tokens as f64,
            ),
            (
                "prefix_cache_query_tokens",
                "Prompt tokens looked up in the prefix cache",
                sched.prefix_query_tokens as f64,
            ),
            (
                "preemptions",
                "Requests preempted for lack of KV blocks",
                sched.n_preemptions as f64,
            ),
            ("engine_steps", "Engine steps", s.n_steps as f64),
            (
                "engine_step_seconds",
                "Wall time of whole engine steps",
                s.step_seconds_total,
            ),
            (
                "engine_forward_seconds",
                "Wall time inside the model forward",
                s.forward_seconds_total,
            ),
            (
                "generation_tokens",
                "Tokens generated by the engine",
                s.n_generated_tokens_total as f64,
            ),
            (
                "requests_finished",
                "Requests the engine finished",
                s.n_requests_finished_total as f64,
            ),
            (
                "engine_step_failures",
                "Engine steps that failed",
                s.n_step_failures_total as f64,
            ),
            (
                "kv_exports_started",
                "P/D (P): prompt KV exports published for a reader",
                t.n_exports_started_total as f64,
            ),
            (
                "kv_exports_pulled",
                "P/D (P): exports a reader pulled in full",
                t.n_exports_pulled_total as f64,
            ),
            (
                "kv_exports_expired",
                "P/D (P): exports whose blocks came back unread (lease expired, or revoked by a \
                 cache reset)",
                t.n_exports_expired_total as f64,
            ),
            (
                "kv_loads_started",
                "P/D (D): KV loads started",
                t.n_loads_started_total as f64,
            ),
            (
                "kv_loads_finished",
                "P/D (D): KV loads whose blocks landed",
                t.n_loads_finished_total as f64,
            ),
            (
                "kv_loads_failed",
                "P/D (D): KV loads that did not land (broken, timed out, cancelled or refused)",
                t.n_loads_failed_total as f64,
            ),
            (
                "kv_loads_broken",
                "P/D (D): KV loads that broke (the link, the peer)",
                t.n_loads_broken_total as f64,
            ),
            (
                "kv_loads_timed_out",
                "P/D (D): KV loads that timed out (a transfer step, or --kv-load-timeout)",
                t.n_loads_timed_out_total as f64,
            ),
            (
                "kv_loads_cancelled",
                "P/D (D): KV loads cut short by a cache reset or the request's end",
                t.n_loads_cancelled_total as f64,
            ),
            (
                "kv_loads_refused",
                "P/D (D): KV loads refused before any block moved (revoked, expired or \
                 invalid export)",
                t.n_loads_refused_total as f64,
            ),
            (
                "kv_transfer_bytes",
                "P/D: KV bytes moved (landed loads on D, pulled exports on P)",
                t.bytes_total as f64,
            ),
            (
                "kv_load_seconds",
                "P/D (D): wall time of finished KV loads, start to landing",
                t.load_seconds_total,
            ),
        ];
        for (name, help, v) in counters {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        if let Some(tier) = &s.tier {
            encode_tier(&mut encoder, tier)?;
        }
        Ok(())
    }
}

/// The offload tier's figures (only on an engine with a tier, `--kv-offload-bytes`).
fn encode_tier(
    encoder: &mut DescriptorEncoder<'_>,
    t: &ferry_engine::TierStats,
) -> Result<(), fmt::Error> {
    let gauges: [(&str, &str, f64); 2] = [
        (
            "kv_offload_bytes_used",
            "Offload tier: host bytes holding offloaded KV blocks (stored or being stored)",
            t.bytes_used as f64,
        ),
        (
            "kv_offload_bytes_capacity",
            "Offload tier: host bytes it may use (--kv-offload-bytes, whole offloaded blocks)",
            t.bytes_capacity as f64,
        ),
    ];
    for (name, help, v) in gauges {
        let g = ConstGauge::new(v);
        g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
    }
    let counters: [(&str, &str, f64); 6] = [
        (
            "kv_offload_hits",
            "Offload tier: admissions that loaded a prefix from the tier",
            t.n_hits as f64,
        ),
        (
            "kv_offload_hit_blocks",
            "Offload tier: KV blocks loaded from the tier",
            t.n_hit_blocks as f64,
        ),
        (
            "kv_offload_stores",
            "Offload tier: offloaded blocks stored",
            t.n_stores as f64,
        ),
        (
            "kv_offload_loads",
            "Offload tier: load jobs started",
            t.n_loads as f64,
        ),
        (
            "kv_offload_evictions",
            "Offload tier: offloaded blocks evicted to make room",
            t.n_evictions as f64,
        ),
        (
            "kv_offload_flushes",
            "Offload tier: flush sets a cache reset handed to the copier",
            t.n_flushes as f64,
        ),
    ];
    for (name, help, v) in counters {
        let c = ConstCounter::new(v);
        c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_engine::SchedulerStats;

    /// `name value` of every sample line, for exact checks.
    fn samples(text: &str) -> Vec<(String, f64)> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (name, value) = l.rsplit_once(' ').unwrap();
                (name.to_owned(), value.parse().unwrap())
            })
            .collect()
    }

    fn get(text: &str, name: &str) -> f64 {
        samples(text)
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
            .1
    }

    #[test]
    fn renders_engine_figures_and_histograms() {
        let m = Metrics::new(|| EngineStats {
            scheduler: SchedulerStats {
                n_running: 3,
                n_waiting: 2,
                n_blocks_used: 10,
                n_blocks_free: 5,
                prefix_hit_tokens: 1,
                prefix_query_tokens: 4,
                // The engine's own step count is the one exported.
                n_steps: 99,
                ..SchedulerStats::default()
            },
            n_steps: 7,
            step_seconds_total: 2.0,
            forward_seconds_total: 1.5,
            n_generated_tokens_total: 42,
            weight_version: "v7".into(),
            n_lifecycle_calls_total: 3,
            lifecycle_call_seconds_total: 0.5,
            lifecycle: ferry_engine::LifecycleStatus {
                paused: true,
                ..Default::default()
            },
            transfers: ferry_engine::TransferStats {
                n_exports_started_total: 4,
                n_exports_pulled_total: 3,
                n_exports_expired_total: 1,
                n_loads_started_total: 6,
                n_loads_finished_total: 5,
                n_loads_failed_total: 1,
                bytes_total: 4096,
                load_seconds_total: 0.25,
                ..ferry_engine::TransferStats::default()
            },
            ..EngineStats::default()
        });
        m.observe_ttft(0.03);
        m.observe_itl(0.002);
        m.observe_itl(0.004);
        m.add_prompt_tokens(7);
        let text = m.render().unwrap();
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(get(&text, "ferry_num_requests_running"), 3.0);
        assert_eq!(get(&text, "ferry_num_requests_waiting"), 2.0);
        assert_eq!(get(&text, "ferry_kv_blocks_used"), 10.0);
        assert_eq!(get(&text, "ferry_kv_blocks_free"), 5.0);
        assert_eq!(get(&text, "ferry_prefix_cache_hit_rate"), 0.25);
        assert_eq!(get(&text, "ferry_engine_step_seconds_total"), 2.0);
        assert_eq!(get(&text, "ferry_engine_forward_seconds_total"), 1.5);
        assert_eq!(get(&text, "ferry_generation_tokens_total"), 42.0);
        assert_eq!(get(&text, "ferry_engine_steps_total"), 7.0);
        assert_eq!(get(&text, "ferry_prompt_tokens_total"), 7.0);
        assert_eq!(get(&text, "ferry_engine_paused"), 1.0);
        assert_eq!(get(&text, "ferry_lifecycle_calls_total"), 3.0);
        assert_eq!(get(&text, "ferry_lifecycle_call_seconds_total"), 0.5);
        assert_eq!(get(&text, "ferry_engine_sleeping"), 0.0);
        assert_eq!(get(&text, "ferry_kv_exports_started_total"), 4.0);
        assert_eq!(get(&text, "ferry_kv_exports_pulled_total"), 3.0);
        assert_eq!(get(&text, "ferry_kv_exports_expired_total"), 1.0);
        assert_eq!(get(&text, "ferry_kv_loads_started_total"), 6.0);
        assert_eq!(get(&text, "ferry_kv_loads_finished_total"), 5.0);
        assert_eq!(get(&text, "ferry_kv_loads_failed_total"), 1.0);
        assert_eq!(get(&text, "ferry_kv_transfer_bytes_total"), 4096.0);
        assert_eq!(get(&text, "ferry_kv_load_seconds_total"), 0.25);
        assert!(
            !text.contains("kv_offload"),
            "no tier, no tier metrics: {text}"
        );
        assert_eq!(
            get(&text, r#"ferry_weight_version_info{version="v7"}"#),
            1.0
        );
        assert_eq!(get(&text, "ferry_time_to_first_token_seconds_count"), 1.0);
        assert_eq!(get(&text, "ferry_inter_token_latency_seconds_count"), 2.0);
        assert_eq!(
            get(
                &text,
                r#"ferry_inter_token_latency_seconds_bucket{le="0.0025"}"#
            ),
            1.0
        );
    }

    #[test]
    fn renders_each_way_a_load_did_not_land_apart() {
        let m = Metrics::new(|| EngineStats {
            transfers: ferry_engine::TransferStats {
                n_loads_failed_total: 14,
                n_loads_broken_total: 5,
                n_loads_timed_out_total: 3,
                n_loads_cancelled_total: 4,
                n_loads_refused_total: 2,
                ..ferry_engine::TransferStats::default()
            },
            ..EngineStats::default()
        });
        let text = m.render().unwrap();
        assert_eq!(get(&text, "ferry_kv_loads_failed_total"), 14.0);
        assert_eq!(get(&text, "ferry_kv_loads_broken_total"), 5.0);
        assert_eq!(get(&text, "ferry_kv_loads_timed_out_total"), 3.0);
        assert_eq!(get(&text, "ferry_kv_loads_cancelled_total"), 4.0);
        assert_eq!(get(&text, "ferry_kv_loads_refused_total"), 2.0);
    }

    #[test]
    fn renders_the_offload_tier_when_there_is_one() {
        let m = Metrics::new(|| EngineStats {
            tier: Some(ferry_engine::TierStats {
                bytes_used: 4096,
                bytes_capacity: 8192,
                n_hits: 2,
                n_hit_blocks: 9,
                n_stores: 12,
                n_loads: 2,
                n_evictions: 3,
                n_flushes: 1,
            }),
            ..EngineStats::default()
        });
        let text = m.render().unwrap();
        assert_eq!(get(&text, "ferry_kv_offload_bytes_used"), 4096.0);
        assert_eq!(get(&text, "ferry_kv_offload_bytes_capacity"), 8192.0);
        assert_eq!(get(&text, "ferry_kv_offload_hits_total"), 2.0);
        assert_eq!(get(&text, "ferry_kv_offload_hit_blocks_total"), 9.0);
        assert_eq!(get(&text, "ferry_kv_offload_stores_total"), 12.0);
        assert_eq!(get(&text, "ferry_kv_offload_loads_total"), 2.0);
        assert_eq!(get(&text, "ferry_kv_offload_evictions_total"), 3.0);
        assert_eq!(get(&text, "ferry_kv_offload_flushes_total"), 1.0);
    }
}
