//! Hosts of their own for tests: network namespaces joined by veth pairs, each pair a link with
//! a /30 of its own, that a test can cut (`ip link set … down`), restore and rate-limit
//! (`tc … tbf`).
//!
//! A [`Net`] takes a /24 of 10.200.0.0/13 for itself (from its process id and a counter, so
//! tests and test processes run side by side) and names everything it makes after the process:
//! namespaces `ferry-t<pid>-<n>-<host>`, root-side link ends `fv<pid>x<k>`. Dropping it kills
//! what runs in its namespaces and deletes them (their link ends go with them, and so do the
//! peers of those ends in the root namespace). A process killed outright leaves them behind:
//! the next [`Net::new`] deletes every `ferry-t<pid>-…` namespace whose process is gone.
//!
//! Where namespaces cannot be made (no root, no `ip`), [`Net::new`] prints a skip line and
//! returns `None`, unless `FERRY_REQUIRE_HOSTS=1`, which `.ci/run` sets: CI runs as root, so
//! there the tests must run.
//!
//! Addresses exist only inside the namespaces and on the root-side ends of their links; no
//! namespace has a default route, so traffic never leaves the hosts a test made.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

const PREFIX: &str = "ferry-t";

/// Runs `ip`/`tc` style commands; `Err` carries what the command printed.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(program: &str, args: &[&str]) {
    if let Err(e) = run(program, args) {
        panic!("{e}");
    }
}

/// Which side of a link: a namespace, or the root namespace (where the test runs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Side {
    Root,
    Host(String),
}

impl Side {
    /// `ip` with `-n NS` for a namespace.
    fn ip(&self, args: &[&str]) -> Result<(), String> {
        match self {
            Side::Root => run("ip", args),
            Side::Host(ns) => {
                let mut all = vec!["-n", ns.as_str()];
                all.extend_from_slice(args);
                run("ip", &all)
            }
        }
    }

    fn tc(&self, args: &[&str]) -> Result<(), String> {
        match self {
            Side::Root => run("tc", args),
            Side::Host(ns) => {
                let mut all = vec!["netns", "exec", ns.as_str(), "tc"];
                all.extend_from_slice(args);
                run("ip", &all)
            }
        }
    }
}

/// A host: a network namespace with loopback up.
#[derive(Debug, Clone)]
pub struct Host {
    pub ns: String,
}

impl Host {
    pub fn side(&self) -> Side {
        Side::Host(self.ns.clone())
    }

    /// Sets a (namespaced) sysctl on this host only.
    pub fn sysctl(&self, key: &str, value: &str) {
        must(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns,
                "sysctl",
                "-q",
                "-w",
                &format!("{key}={value}"),
            ],
        );
    }
}

/// A veth pair between two sides, `a` at `.1` and `b` at `.2` of its /30.
#[derive(Debug, Clone)]
pub struct Link {
    pub a: (Side, String),
    pub b: (Side, String),
    pub addr_a: Ipv4Addr,
    pub addr_b: Ipv4Addr,
}

impl Link {
    /// Takes both ends down: packets stop, open TCP connections stay open and silent.
    pub fn cut(&self) {
        for (side, dev) in [&self.a, &self.b] {
            side.ip(&["link", "set", dev, "down"]).unwrap();
        }
    }

    /// Brings both ends back up (their addresses and routes come back with them).
    pub fn restore(&self) {
        for (side, dev) in [&self.a, &self.b] {
            side.ip(&["link", "set", dev, "up"]).unwrap();
        }
    }

    /// Limits each direction to `rate` (tc's syntax, e.g. `50mbit`) with a token bucket.
    pub fn limit(&self, rate: &str) {
        for (side, dev) in [&self.a, &self.b] {
            side.tc(&[
                "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kb",
                "latency", "400ms",
            ])
            .unwrap();
        }
    }
}

/// The hosts and links of one test. See the module doc.
pub struct Net {
    tag: String,
    subnet: [u8; 3],
    hosts: Vec<Host>,
    n_links: u8,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl Net {
    /// A new net, or `None` (after a skip line naming `test`) where namespaces cannot be made.
    pub fn new(test: &str) -> Option<Net> {
        let pid = std::process::id();
        clean_stale();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{PREFIX}{pid}-{n}");
        // 10.200.0.0/13: the second octet 200..=207 and the third from the process and the
        // counter, so two nets of a run never share a /24.
        let slot = (pid.wrapping_mul(97).wrapping_add(n)) % (8 * 256);
        let subnet = [10, 200 + (slot / 256) as u8, (slot % 256) as u8];
        let probe = format!("{tag}-probe");
        if let Err(e) = run("ip", &["netns", "add", &probe]) {
            let required = std::env::var("FERRY_REQUIRE_HOSTS").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "FERRY_REQUIRE_HOSTS=1 but network namespaces cannot be made: {e}"
            );
            eprintln!("skipping {test}: network namespaces cannot be made here ({e})");
            return None;
        }
        must("ip", &["netns", "del", &probe]);
        Some(Net {
            tag,
            subnet,
            hosts: Vec::new(),
            n_links: 0,
        })
    }

    /// A new host named `name` (a namespace with loopback up).
    pub fn host(&mut self, name: &str) -> Host {
        let ns = format!("{}-{name}", self.tag);
        must("ip", &["netns", "add", &ns]);
        let host = Host { ns };
        host.side().ip(&["link", "set", "lo", "up"]).unwrap();
        self.hosts.push(host.clone());
        host
    }

    /// A link between `a` and `b` (`None`: the root namespace), both ends up, with the next
    /// /30 of this net's /24.
    pub fn link(&mut self, a: Option<&Host>, b: Option<&Host>) -> Link {
        let k = self.n_links;
        assert!(k < 63, "a net has at most 63 links");
        self.n_links += 1;
        let [o1, o2, o3] = self.subnet;
        let addr_a = Ipv4Addr::new(o1, o2, o3, 4 * k + 1);
        let addr_b = Ipv4Addr::new(o1, o2, o3, 4 * k + 2);
        let pid = std::process::id();
        // Names live in their own namespace, except root-side ends, which must be unique
        // among every test process: the process and a per-process counter (15 bytes at most).
        let unique = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = |side: &Option<&Host>, end: char| match side {
            None => format!("fv{pid:x}x{unique:x}{end}"),
            Some(_) => format!("eth{k}"),
        };
        let (name_a, name_b) = (name(&a, 'a'), name(&b, 'b'));
        let side = |h: Option<&Host>| h.map_or(Side::Root, Host::side);
        let (side_a, side_b) = (side(a), side(b));
        let mut add: Vec<String> = vec!["link".into(), "add".into(), name_a.clone()];
        if let Side::Host(ns) = &side_a {
            add.extend(["netns".into(), ns.clone()]);
        }
        add.extend([
            "type".into(),
            "veth".into(),
            "peer".into(),
            "name".into(),
            name_b.clone(),
        ]);
        if let Side::Host(ns) = &side_b {
            add.extend(["netns".into(), ns.clone()]);
        }
        let add: Vec<&str> = add.iter().map(String::as_str).collect();
        must("ip", &add);
        for (s, dev, addr) in [(&side_a, &name_a, addr_a), (&side_b, &name_b, addr_b)] {
            s.ip(&["addr", "add", &format!("{addr}/30"), "dev", dev])
                .unwrap();
            s.ip(&["link", "set", dev, "up"]).unwrap();
        }
        Link {
            a: (side_a, name_a),
            b: (side_b, name_b),
            addr_a,
            addr_b,
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for host in &self.hosts {
            remove_namespace(&host.ns);
        }
    }
}

/// Kills what runs in `ns`, then deletes it (with its link ends and their peers).
fn remove_namespace(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-9", pid]).status();
        }
    }
    let _ = run("ip", &["netns", "del", ns]);
}

/// Deletes every namespace of an earlier test process that is gone (killed before its
/// `Net`s were dropped).
fn clean_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(ns) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = ns
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove_namespace(ns);
        }
    }
}
