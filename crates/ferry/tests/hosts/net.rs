//! Hosts of their own for tests: network namespaces joined by links, each with a /30 of its
//! own, that a test can cut (`ip link set … down`), restore and rate-limit (`tc … tbf`).
//!
//! A link is two veth pairs through a bridge in the net's switch namespace (`…-sw`), as two
//! hosts plugged into a switch: a cut takes the `b` host's switch port down, so `b` loses its
//! carrier while `a` keeps its own, and what `a` sends is lost on the way, not refused by its
//! kernel. (A veth pair straight between the hosts would take `a`'s carrier with the cut: its
//! kernel would refuse to send, and TCP waits out such local errors forever instead of
//! counting unanswered keep-alive probes, which is not how a broken network behaves.)
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

    /// The hardware address of `dev`.
    fn mac(&self, dev: &str) -> String {
        let mut args = vec!["link", "show", "dev", dev];
        if let Side::Host(ns) = self {
            args.splice(0..0, ["-n", ns.as_str()]);
        }
        let out = Command::new("ip")
            .args(&args)
            .output()
            .expect("ip link show");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .unwrap_or_else(|| panic!("no hardware address for {dev}: {text}"))
            .to_owned()
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

/// A link between two sides through the switch, `a` at `.1` and `b` at `.2` of its /30.
#[derive(Debug, Clone)]
pub struct Link {
    pub a: (Side, String),
    pub b: (Side, String),
    pub addr_a: Ipv4Addr,
    pub addr_b: Ipv4Addr,
    /// The switch's port that `b` is plugged into.
    switch: Side,
    port_b: String,
}

impl Link {
    /// Unplugs `b` (its switch port down): packets stop both ways, open TCP connections stay
    /// open and silent, `a` keeps its carrier.
    pub fn cut(&self) {
        self.switch
            .ip(&["link", "set", &self.port_b, "down"])
            .unwrap();
    }

    /// Plugs `b` back in.
    pub fn restore(&self) {
        self.switch
            .ip(&["link", "set", &self.port_b, "up"])
            .unwrap();
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
    /// Every namespace made, the switch's included.
    hosts: Vec<Host>,
    /// The namespace whose bridges join the links' ends.
    switch: Side,
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
        let switch = format!("{tag}-sw");
        must("ip", &["netns", "add", &switch]);
        Some(Net {
            tag,
            subnet,
            hosts: vec![Host { ns: switch.clone() }],
            switch: Side::Host(switch),
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
        let Side::Host(switch) = &self.switch else {
            unreachable!("the switch is a namespace")
        };
        let bridge = format!("br{k}");
        must(
            "ip",
            &["-n", switch, "link", "add", &bridge, "type", "bridge"],
        );
        must("ip", &["-n", switch, "link", "set", &bridge, "up"]);
        let side = |h: Option<&Host>| h.map_or(Side::Root, Host::side);
        let (side_a, side_b) = (side(a), side(b));
        let pid = std::process::id();
        let mut ends = Vec::new();
        for (s, end, addr) in [(&side_a, 'a', addr_a), (&side_b, 'b', addr_b)] {
            // A host's end is named in its own namespace; a root-side end must be unique
            // among every test process: the process and a per-process counter (at most 15
            // bytes, the kernel's limit).
            let dev = match s {
                Side::Root => format!("fv{pid:x}x{:x}", NEXT.fetch_add(1, Ordering::Relaxed)),
                Side::Host(_) => format!("eth{k}"),
            };
            let port = format!("p{k}{end}");
            let mut add = vec!["link", "add", dev.as_str()];
            if let Side::Host(ns) = s {
                add.extend(["netns", ns.as_str()]);
            }
            add.extend(["type", "veth", "peer", "name", &port, "netns", switch]);
            must("ip", &add);
            must(
                "ip",
                &["-n", switch, "link", "set", &port, "master", &bridge],
            );
            must("ip", &["-n", switch, "link", "set", &port, "up"]);
            s.ip(&["addr", "add", &format!("{addr}/30"), "dev", &dev])
                .unwrap();
            s.ip(&["link", "set", &dev, "up"]).unwrap();
            ends.push((s.clone(), dev, port));
        }
        let (b_side, b_dev, port_b) = ends.pop().expect("two ends");
        let (a_side, a_dev, _) = ends.pop().expect("two ends");
        // Each end knows the other's hardware address for good, as after a first exchange:
        // with the link cut, packets then go out and are lost, instead of waiting on address
        // resolution that fails, which the kernel reports to TCP as a local error.
        for (s, dev, peer, peer_side, peer_dev) in [
            (&a_side, &a_dev, addr_b, &b_side, &b_dev),
            (&b_side, &b_dev, addr_a, &a_side, &a_dev),
        ] {
            let mac = peer_side.mac(peer_dev);
            s.ip(&[
                "neigh",
                "replace",
                &peer.to_string(),
                "lladdr",
                &mac,
                "dev",
                dev,
                "nud",
                "permanent",
            ])
            .unwrap();
        }
        Link {
            a: (a_side, a_dev),
            b: (b_side, b_dev),
            addr_a,
            addr_b,
            switch: self.switch.clone(),
            port_b,
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
