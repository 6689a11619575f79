//! `/metrics` of the fleet: the proxy's own figures per instance (up, requests in flight,
//! requests sent, failures), then every instance's own metrics with `instance` and `role`
//! labels added, each metric family's samples from all instances together (the text format
//! wants a family's samples in one group).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

use crate::fleet::Instance;

/// The content type ferry's servers answer `/metrics` with (OpenMetrics text).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One instance's scrape: `None` when it could not be read.
#[derive(Debug)]
pub struct Scrape<'a> {
    pub instance: &'a Instance,
    pub text: Option<String>,
}

/// The whole `/metrics` text.
pub fn render(scrapes: &[Scrape<'_>]) -> String {
    let mut out = String::new();
    own_metrics(&mut out, scrapes);
    let mut families = Families::default();
    for s in scrapes {
        if let Some(text) = &s.text {
            families.add(text, &labels(s.instance));
        }
    }
    families.write(&mut out);
    out.push_str("# EOF\n");
    out
}

fn labels(i: &Instance) -> String {
    format!(
        "instance=\"{}\",role=\"{}\"",
        escape(&i.url),
        i.role.as_str()
    )
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn own_metrics(out: &mut String, scrapes: &[Scrape<'_>]) {
    type Figure = fn(&Scrape<'_>) -> u64;
    let figures: [(&str, &str, &str, &str, Figure); 13] = [
        (
            "ferry_proxy_instance_up",
            "gauge",
            "",
            "Whether the instance answered this scrape.",
            |s| u64::from(s.text.is_some()),
        ),
        (
            "ferry_proxy_in_flight_requests",
            "gauge",
            "",
            "Generation requests the proxy has on the instance now.",
            |s| s.instance.in_flight() as u64,
        ),
        (
            "ferry_proxy_requests",
            "counter",
            "_total",
            "Generation requests the proxy sent to the instance.",
            |s| s.instance.n_requests(),
        ),
        (
            "ferry_proxy_failures",
            "counter",
            "_total",
            "Requests that could not reach the instance or broke off mid-answer.",
            |s| s.instance.n_failures(),
        ),
        (
            "ferry_proxy_kv_synced",
            "gauge",
            "",
            "Whether the proxy follows the instance's KV events (routing it by prefix).",
            |s| u64::from(s.instance.kv().sync == crate::kv_index::Sync::Synced),
        ),
        (
            "ferry_proxy_kv_index_blocks",
            "gauge",
            "",
            "Blocks of the instance's device prefix cache the proxy's prefix index holds.",
            |s| s.instance.kv().n_blocks() as u64,
        ),
        (
            "ferry_proxy_kv_index_tier_blocks",
            "gauge",
            "",
            "Blocks of the instance's offload tier the proxy's prefix index holds.",
            |s| s.instance.kv().n_tier_blocks() as u64,
        ),
        (
            "ferry_proxy_kv_index_drops",
            "counter",
            "_total",
            "Times the instance's prefix index was dropped (a wipe, a new epoch or version, a lost batch, a clearing admin call).",
            |s| s.instance.kv().n_drops,
        ),
        (
            "ferry_proxy_kv_fences",
            "counter",
            "_total",
            "Admin calls through the proxy that may have wiped the instance's cache (a reset, a clearing pause or sleep, a memory release, a weight change); each emptied its prefix index before the proxy answered.",
            |s| s.instance.n_fences.load(Relaxed),
        ),
        (
            "ferry_proxy_kv_routed_requests",
            "counter",
            "_total",
            "Requests routed to the instance by prefix.",
            |s| s.instance.n_kv_routed.load(Relaxed),
        ),
        (
            "ferry_proxy_kv_predicted_hit_tokens",
            "counter",
            "_total",
            "Prompt tokens the prefix index predicted cached on the instance, over the requests routed there.",
            |s| s.instance.n_predicted_hit_tokens.load(Relaxed),
        ),
        (
            "ferry_proxy_kv_misses",
            "counter",
            "_total",
            "Requests routed for a predicted hit whose answer reported fewer cached_tokens.",
            |s| s.instance.n_kv_misses.load(Relaxed),
        ),
        (
            "ferry_proxy_kv_stale_routes",
            "counter",
            "_total",
            "Misses on blocks the index still held from before a wipe, routed more than 100 ms after it.",
            |s| s.instance.n_stale_routes.load(Relaxed),
        ),
    ];
    for (name, kind, suffix, help, figure) in figures {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for s in scrapes {
            let _ = writeln!(
                out,
                "{name}{suffix}{{{}}} {}",
                labels(s.instance),
                figure(s)
            );
        }
    }
}

/// Metric families in the order first seen, each with its metadata lines once and its
/// samples from every instance.
#[derive(Debug, Default)]
struct Families {
    order: Vec<String>,
    by_name: BTreeMap<String, Family>,
}

#[derive(Debug, Default)]
struct Family {
    meta: Vec<String>,
    samples: Vec<String>,
}

impl Families {
    fn family(&mut self, name: &str) -> &mut Family {
        if !self.by_name.contains_key(name) {
            self.order.push(name.to_owned());
        }
        self.by_name.entry(name.to_owned()).or_default()
    }

    fn add(&mut self, text: &str, labels: &str) {
        // Samples belong to the family of the last `# TYPE`/`# HELP` line before them.
        let mut current = String::new();
        for line in text.lines() {
            if line.is_empty() || line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# ") {
                let mut parts = rest.splitn(3, ' ');
                let (Some(kind), Some(name)) = (parts.next(), parts.next()) else {
                    continue;
                };
                current = name.to_owned();
                let prefix = format!("# {kind} {name}");
                let family = self.family(name);
                if !family.meta.iter().any(|m| m.starts_with(&prefix)) {
                    family.meta.push(line.to_owned());
                }
                continue;
            }
            let sample = with_labels(line, labels);
            self.family(&current).samples.push(sample);
        }
    }

    fn write(&self, out: &mut String) {
        for name in &self.order {
            let family = &self.by_name[name];
            for line in family.meta.iter().chain(&family.samples) {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// A sample line with `labels` added first: `name{a="b"} 1` → `name{labels,a="b"} 1`.
fn with_labels(line: &str, labels: &str) -> String {
    let cut = line.find(['{', ' ']).unwrap_or(line.len());
    let (name, rest) = line.split_at(cut);
    match rest.strip_prefix('{') {
        Some(inner) if inner.starts_with('}') => format!("{name}{{{labels}{inner}"),
        Some(inner) => format!("{name}{{{labels},{inner}"),
        None => format!("{name}{{{labels}}}{rest}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Role;

    #[test]
    fn labels_every_sample_and_groups_families() {
        let p = Instance::new("http://p:1", Role::Prefill);
        let d = Instance::new("http://d:2", Role::Decode);
        let text = "# HELP ferry_x X.\n# TYPE ferry_x counter\nferry_x_total 3\n\
                    # HELP ferry_y Y.\n# TYPE ferry_y histogram\n\
                    ferry_y_bucket{le=\"1.0\"} 2\nferry_y_sum 0.5\n# EOF\n";
        let out = render(&[
            Scrape {
                instance: &p,
                text: Some(text.to_owned()),
            },
            Scrape {
                instance: &d,
                text: None,
            },
        ]);
        assert!(out.contains("ferry_proxy_instance_up{instance=\"http://p:1\",role=\"prefill\"} 1"));
        assert!(out.contains("ferry_proxy_instance_up{instance=\"http://d:2\",role=\"decode\"} 0"));
        assert!(
            out.contains("ferry_y_bucket{instance=\"http://p:1\",role=\"prefill\",le=\"1.0\"} 2")
        );
        assert!(out.contains("ferry_x_total{instance=\"http://p:1\",role=\"prefill\"} 3"));
        assert_eq!(out.matches("# TYPE ferry_x counter").count(), 1);
        assert!(out.ends_with("# EOF\n"));
        assert_eq!(out.matches("# EOF").count(), 1);
        assert_eq!(with_labels("a{} 1", "l=\"v\""), "a{l=\"v\"} 1");
    }

    #[test]
    fn families_from_two_instances_stay_together() {
        let p = Instance::new("http://p", Role::Prefill);
        let d = Instance::new("http://d", Role::Decode);
        let text = "# TYPE a gauge\na 1\n# TYPE b gauge\nb 2\n";
        let scrape = |i| Scrape {
            instance: i,
            text: Some(text.to_owned()),
        };
        let out = render(&[scrape(&p), scrape(&d)]);
        let tail: Vec<&str> = out.lines().filter(|l| !l.contains("ferry_proxy")).collect();
        assert_eq!(
            tail,
            [
                "# TYPE a gauge",
                "a{instance=\"http://p\",role=\"prefill\"} 1",
                "a{instance=\"http://d\",role=\"decode\"} 1",
                "# TYPE b gauge",
                "b{instance=\"http://p\",role=\"prefill\"} 2",
                "b{instance=\"http://d\",role=\"decode\"} 2",
                "# EOF",
            ]
        );
    }
}
