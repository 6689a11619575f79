//! Where D may connect to load KV: the allowed peers (`connectors.md`, *Trust*).
//!
//! Only the fleet can fill D's cache: a `remote_host` in a request's transfer parameters is
//! used only if it is an address inside this set. The set holds addresses and networks
//! (CIDRs) only; host names are resolved by whoever builds it (`ferry serve` at start for
//! `--kv-allowed-peers`, the HTTP edge for a request's `remote_host`), once, and the address
//! that was checked is the one connected to. Sans-IO: no resolution happens here.
//!
//! Written by hand rather than with an IP-network crate: the whole need is "parse an address
//! or `address/prefix` and test membership", a few lines over `std::net`.

use std::net::IpAddr;

/// One address or network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// An address (`127.0.0.2`, `::1`) or a network (`10.0.0.0/8`, `fd00::/8`).
    pub fn parse(s: &str) -> Result<Self, PeerError> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr = ip_literal(addr).ok_or_else(|| PeerError::NotAnAddress(s.to_owned()))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= max => p,
                _ => {
                    return Err(PeerError::Prefix {
                        net: s.to_owned(),
                        max,
                    })
                }
            },
        };
        Ok(Self { addr, prefix })
    }

    /// Whether `ip` is inside (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        match (canonical(self.addr), ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// One address, as a network of itself.
impl From<IpAddr> for IpNet {
    fn from(addr: IpAddr) -> Self {
        Self {
            addr,
            prefix: if addr.is_ipv4() { 32 } else { 128 },
        }
    }
}

/// `host` as an IP address, if it is one (IPv6 with or without brackets); `None` for a name.
pub fn ip_literal(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The peers D may load KV from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedPeers {
    nets: Vec<IpNet>,
}

impl Default for AllowedPeers {
    /// Loopback only: one machine's P and D.
    fn default() -> Self {
        Self::loopback()
    }
}

impl AllowedPeers {
    /// `127.0.0.0/8` and `::1`.
    pub fn loopback() -> Self {
        Self {
            nets: vec![
                IpNet::parse("127.0.0.0/8").expect("valid"),
                IpNet::parse("::1").expect("valid"),
            ],
        }
    }

    pub fn new(nets: Vec<IpNet>) -> Self {
        Self { nets }
    }

    /// Parses a comma- or space-separated list of addresses and CIDRs.
    pub fn parse(list: &str) -> Result<Self, PeerError> {
        let nets = list
            .split([',', ' '])
            .filter(|s| !s.is_empty())
            .map(IpNet::parse)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { nets })
    }

    pub fn nets(&self) -> &[IpNet] {
        &self.nets
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|n| n.contains(ip))
    }

    /// Checks a `remote_host` as the core sees it: an address (already resolved at the
    /// edge) inside the set. `Err` says why not.
    pub fn check_host(&self, host: &str) -> Result<IpAddr, PeerError> {
        let ip = ip_literal(host).ok_or_else(|| PeerError::HostName(host.to_owned()))?;
        if self.contains(ip) {
            Ok(ip)
        } else {
            Err(PeerError::NotAllowed {
                host: host.to_owned(),
                allowed: self.describe(),
            })
        }
    }

    /// The set, for messages.
    pub fn describe(&self) -> String {
        if self.nets.is_empty() {
            return "none".into();
        }
        self.nets
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Why an address, a network or a `remote_host` is refused; `Display` is the message a
/// command-line error or a refused load carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// Neither an address nor `address/prefix`.
    #[error("{0:?} is not an IP address or CIDR")]
    NotAnAddress(String),
    /// A network whose prefix length is not a number up to the address's bits.
    #[error("{net:?}: the prefix length must be 0..={max}")]
    Prefix { net: String, max: u8 },
    /// A `remote_host` that is a name: the edge resolves names, the core takes addresses.
    #[error("remote_host {0:?} is not an IP address (names are resolved at the edge)")]
    HostName(String),
    /// A `remote_host` outside the allowed peers (`allowed` lists them).
    #[error("remote_host {host:?} is not an allowed KV peer (allowed: {allowed})")]
    NotAllowed { host: String, allowed: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_networks_parse_and_contain_what_they_should() {
        let p = AllowedPeers::parse("127.0.0.2, 10.1.0.0/16 fd00::/8").unwrap();
        assert!(p.contains("127.0.0.2".parse().unwrap()));
        assert!(!p.contains("127.0.0.1".parse().unwrap()));
        assert!(p.contains("10.1.200.3".parse().unwrap()));
        assert!(!p.contains("10.2.0.1".parse().unwrap()));
        assert!(p.contains("fd12::1".parse().unwrap()));
        assert!(!p.contains("fe80::1".parse().unwrap()));
        // An IPv4-mapped IPv6 address is its IPv4 address.
        assert!(p.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(IpNet::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert_eq!(
            IpNet::parse("10.0.0.0/33"),
            Err(PeerError::Prefix {
                net: "10.0.0.0/33".into(),
                max: 32
            })
        );
        assert_eq!(
            IpNet::parse("example.com"),
            Err(PeerError::NotAnAddress("example.com".into()))
        );
    }

    #[test]
    fn the_default_is_loopback_and_names_are_refused_by_the_core() {
        let p = AllowedPeers::default();
        assert!(p.check_host("127.0.0.1").is_ok());
        assert!(p.check_host("::1").is_ok());
        assert!(p.check_host("[::1]").is_ok());
        assert_eq!(
            p.check_host("192.168.1.5"),
            Err(PeerError::NotAllowed {
                host: "192.168.1.5".into(),
                allowed: "127.0.0.0/8, ::1/128".into()
            })
        );
        assert_eq!(
            p.check_host("localhost"),
            Err(PeerError::HostName("localhost".into()))
        );
    }
}
