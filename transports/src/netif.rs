//! Choosing the addresses a rank publishes, and the one a peer connects to.
//!
//! The commonest failure in the field is a rank telling peers on other
//! machines to connect to 127.0.x.x because its hostname resolves to loopback
//! (vllm #5094, gloo #223). So a rank never publishes one guessed address: it
//! publishes every usable one, most preferred first and loopback last
//! ([`publish_order`]), and each peer picks from that list ([`peer_address`]):
//! loopback when it shares the host, else the first routable address.
//!
//! The choice is a pure function of the interface list, an optional spec
//! (`CHORUS_SOCKET_IFNAME` with `NCCL_SOCKET_IFNAME`'s grammar, or
//! `GLOO_SOCKET_IFNAME`'s exact names) and the local address that routes to
//! the master. [`list_interfaces`], [`route_to`] and [`local_addresses`] are
//! the thin IO around it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// chorus's own variable, read with `NCCL_SOCKET_IFNAME`'s grammar.
const CHORUS_SOCKET_IFNAME: &str = "CHORUS_SOCKET_IFNAME";
/// Gloo's variable: exact names only.
const GLOO_SOCKET_IFNAME: &str = "GLOO_SOCKET_IFNAME";
/// The discard port: [`route_to`] needs some port to `connect` to, and sends
/// nothing to it.
const DISCARD_PORT: u16 = 9;

/// One address of one network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// The interface name, e.g. `eth0`, `ib0`, `lo`.
    pub name: String,
    /// One of its addresses (an interface with several appears once per
    /// address).
    pub addr: IpAddr,
}

/// Which interfaces a user allows, as written in `CHORUS_SOCKET_IFNAME`
/// (`NCCL_SOCKET_IFNAME`'s grammar) or `GLOO_SOCKET_IFNAME` (exact names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfaceSpec {
    /// The variable whose grammar was parsed, named in error messages.
    var: &'static str,
    /// The spec as written, for error messages.
    text: String,
    /// The listed names (prefixes unless `exact`).
    names: Vec<String>,
    /// `^`: the listed interfaces are the ones *not* to use.
    exclude: bool,
    /// `=`: names match whole interface names rather than prefixes.
    exact: bool,
}

impl IfaceSpec {
    /// Parses `NCCL_SOCKET_IFNAME`'s grammar (as used by
    /// `CHORUS_SOCKET_IFNAME`): a comma list of name prefixes (`eth,ib`); a
    /// leading `^` excludes the listed interfaces instead (`^docker,lo`);
    /// then a leading `=` makes the names exact (`=eth0`, `^=docker0`).
    /// Whitespace around entries and empty entries are ignored.
    pub fn parse(s: &str) -> Result<IfaceSpec, NetifError> {
        let mut rest = s.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = rest[1..].trim_start();
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = rest[1..].trim_start();
        }
        let names = split_names(CHORUS_SOCKET_IFNAME, s, rest)?;
        Ok(IfaceSpec {
            var: CHORUS_SOCKET_IFNAME,
            text: s.to_string(),
            names,
            exclude,
            exact,
        })
    }

    /// Parses `GLOO_SOCKET_IFNAME`'s grammar: a comma list of exact interface
    /// names.
    pub fn exact_list(s: &str) -> Result<IfaceSpec, NetifError> {
        let names = split_names(GLOO_SOCKET_IFNAME, s, s)?;
        Ok(IfaceSpec {
            var: GLOO_SOCKET_IFNAME,
            text: s.to_string(),
            names,
            exclude: false,
            exact: true,
        })
    }

    /// Whether the interface called `name` may be used.
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }
}

/// Splits a comma list of interface names, rejecting lists that would
/// silently match nothing or everything.
fn split_names(var: &str, text: &str, list: &str) -> Result<Vec<String>, NetifError> {
    let bad = |reason: &str| NetifError::BadSpec {
        var: var.to_string(),
        spec: text.to_string(),
        reason: reason.to_string(),
    };
    let names: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect();
    if names.is_empty() {
        return Err(bad("it names no interface; give a comma list such as eth0,ib0"));
    }
    // `eth0,^docker` reads as "eth0 but not docker" yet would match an
    // interface literally named `^docker`: say so instead of matching nothing.
    if names.iter().any(|n| n.contains(['^', '='])) {
        return Err(bad(
            "'^' (exclude) and '=' (exact names) apply to the whole list and go only at its start, as in ^=docker0,lo",
        ));
    }
    if names.iter().any(|n| n.contains(char::is_whitespace)) {
        return Err(bad("interface names contain no spaces; separate names with commas"));
    }
    Ok(names)
}

/// Errors choosing the network interface.
#[derive(Debug, thiserror::Error)]
pub enum NetifError {
    /// The spec allows none of this host's interfaces (or only addresses that
    /// cannot be used, such as IPv6 link-local ones).
    #[error("{var}={spec} matches no interface; available: {}", list_or_none(available))]
    NoMatchingInterface {
        /// The variable the spec came from.
        var: String,
        /// The spec as written.
        spec: String,
        /// This host's interfaces with their addresses, e.g. `eth0 (10.0.0.2)`.
        available: Vec<String>,
    },
    /// The spec does not parse.
    #[error("{var}={spec:?} is not a valid interface list: {reason}")]
    BadSpec {
        /// The variable the spec came from.
        var: String,
        /// The spec as written.
        spec: String,
        /// What is wrong and how to write it.
        reason: String,
    },
    /// Listing interfaces or asking the kernel for a route failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: io::Error,
    },
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(", ")
    }
}

/// Reads the interface spec from the environment: `CHORUS_SOCKET_IFNAME`
/// (`NCCL_SOCKET_IFNAME`'s grammar) first, then `GLOO_SOCKET_IFNAME` (exact
/// names). Returns the variable's name with the spec, or `None` when neither
/// is set (an empty value counts as unset).
pub fn spec_from_env(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<(String, IfaceSpec)>, NetifError> {
    let read = |var: &str| lookup(var).filter(|v| !v.trim().is_empty());
    if let Some(v) = read(CHORUS_SOCKET_IFNAME) {
        return Ok(Some((CHORUS_SOCKET_IFNAME.to_string(), IfaceSpec::parse(&v)?)));
    }
    if let Some(v) = read(GLOO_SOCKET_IFNAME) {
        return Ok(Some((GLOO_SOCKET_IFNAME.to_string(), IfaceSpec::exact_list(&v)?)));
    }
    Ok(None)
}

/// Whether a peer could connect to `addr` at all. IPv6 link-local addresses
/// (fe80::/10) are left out because an [`IpAddr`] cannot carry the scope id
/// they need.
fn usable(addr: IpAddr) -> bool {
    let link_local_v6 = matches!(addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80);
    !addr.is_unspecified() && !addr.is_multicast() && !link_local_v6
}

/// NCCL's default preference among interface names: `ib*`, then everything
/// but `docker*` and `lo*`, then `docker*`, then `lo*`.
fn name_class(name: &str) -> u8 {
    if name.starts_with("ib") {
        0
    } else if name.starts_with("docker") {
        2
    } else if name.starts_with("lo") {
        3
    } else {
        1
    }
}

/// Loopback order: 127.0.0.1 (what every stack answers on), then other
/// 127/8 addresses, then ::1.
fn loopback_class(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(a) if a == Ipv4Addr::LOCALHOST => 0,
        IpAddr::V4(_) => 1,
        IpAddr::V6(_) => 2,
    }
}

/// Orders the addresses a rank publishes, most preferred first.
///
/// - With `spec`: the usable addresses of the matching interfaces, in
///   interface order, IPv4 before IPv6; `route_to_master` is ignored because
///   the user chose. No match is [`NetifError::NoMatchingInterface`].
/// - Without: `route_to_master` first unless it is loopback or unspecified
///   (it is the address the master's network reaches); then non-loopback
///   addresses in NCCL's default order (`ib*`, everything but `docker*` and
///   `lo*`, `docker*`, `lo*`), IPv4 before IPv6 within each class; then
///   loopback (127.0.0.1, other 127/8, ::1). So loopback is published, for
///   peers on the same host, but never alone when a real interface exists.
///
/// IPv6 link-local addresses are never published (no scope id). Duplicates
/// are dropped, keeping the first.
pub fn publish_order(
    spec: Option<&IfaceSpec>,
    interfaces: &[Interface],
    route_to_master: Option<IpAddr>,
) -> Result<Vec<IpAddr>, NetifError> {
    let usable_ifaces = interfaces.iter().filter(|i| usable(i.addr));
    let mut ordered: Vec<IpAddr> = Vec::new();
    match spec {
        Some(spec) => {
            let mut chosen: Vec<&Interface> = usable_ifaces.filter(|i| spec.matches(&i.name)).collect();
            // Stable, so interface order holds within each family.
            chosen.sort_by_key(|i| i.addr.is_ipv6());
            ordered.extend(chosen.iter().map(|i| i.addr));
            if ordered.is_empty() {
                return Err(NetifError::NoMatchingInterface {
                    var: spec.var.to_string(),
                    spec: spec.text.clone(),
                    available: describe(interfaces),
                });
            }
        }
        None => {
            if let Some(route) = route_to_master.filter(|a| usable(*a) && !a.is_loopback()) {
                ordered.push(route);
            }
            let (mut loopback, mut others): (Vec<&Interface>, Vec<&Interface>) =
                usable_ifaces.partition(|i| i.addr.is_loopback());
            others.sort_by_key(|i| (name_class(&i.name), i.addr.is_ipv6()));
            loopback.sort_by_key(|i| loopback_class(i.addr));
            ordered.extend(others.iter().chain(&loopback).map(|i| i.addr));
        }
    }
    let mut seen = Vec::with_capacity(ordered.len());
    ordered.retain(|a| {
        let new = !seen.contains(a);
        seen.push(*a);
        new
    });
    Ok(ordered)
}

/// `name (addr, addr)` per interface, in first-seen order, for messages.
fn describe(interfaces: &[Interface]) -> Vec<String> {
    let mut grouped: Vec<(&str, Vec<String>)> = Vec::new();
    for i in interfaces {
        match grouped.iter_mut().find(|(name, _)| *name == i.name) {
            Some((_, addrs)) => addrs.push(i.addr.to_string()),
            None => grouped.push((&i.name, vec![i.addr.to_string()])),
        }
    }
    grouped
        .into_iter()
        .map(|(name, addrs)| format!("{name} ({})", addrs.join(", ")))
        .collect()
}

/// The address to connect to, from a peer's published list (most preferred
/// first): on the same host, a loopback address if one was published, else
/// the first; on another host, the first non-loopback address. `None` means
/// the peer published only loopback (or nothing) and cannot be reached from
/// here; the caller reports that, naming the peer.
pub fn peer_address(published: &[IpAddr], same_host: bool) -> Option<IpAddr> {
    if same_host {
        published
            .iter()
            .copied()
            .find(IpAddr::is_loopback)
            .or_else(|| published.first().copied())
    } else {
        published
            .iter()
            .copied()
            .find(|a| !a.is_loopback() && !a.is_unspecified())
    }
}

/// This host's interface addresses, skipping interfaces that are not running
/// (down, or no carrier): their addresses would be published yet unreachable.
pub fn list_interfaces() -> Result<Vec<Interface>, NetifError> {
    let all = if_addrs::get_if_addrs().map_err(|source| NetifError::Io {
        context: "cannot list the network interfaces".to_string(),
        source,
    })?;
    Ok(all
        .into_iter()
        .filter(if_addrs::Interface::is_oper_up)
        .map(|i| Interface {
            addr: i.ip(),
            name: i.name,
        })
        .collect())
}

/// The local address the kernel would use to reach `target`.
///
/// Connecting a UDP socket only makes the kernel choose a route and a source
/// address: no packet is sent.
pub fn route_to(target: IpAddr) -> Result<IpAddr, NetifError> {
    let io_err = |source| NetifError::Io {
        context: format!("cannot find the local address that routes to {target}"),
        source,
    };
    let any: IpAddr = match target {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind(SocketAddr::new(any, 0)).map_err(io_err)?;
    socket.connect(SocketAddr::new(target, DISCARD_PORT)).map_err(io_err)?;
    Ok(socket.local_addr().map_err(io_err)?.ip())
}

/// Where a connection to `target` leaves this host, for error messages:
/// "10.0.0.1 on eth0", or why the route is unknown.
pub fn describe_route(target: IpAddr) -> String {
    match route_to(target) {
        Ok(local) => {
            let name = list_interfaces()
                .ok()
                .and_then(|all| all.into_iter().find(|i| i.addr == local))
                .map_or_else(|| "an unlisted interface".to_string(), |i| i.name);
            format!("{local} on {name}")
        }
        Err(_) => "no route".to_string(),
    }
}

/// The addresses this rank publishes, most preferred first: the spec from
/// `lookup` ([`spec_from_env`]), this host's interfaces
/// ([`list_interfaces`]) and, without a spec, the route to `master`
/// ([`route_to`]), combined by [`publish_order`]. A master that cannot be
/// routed to is not an error here: the default order still applies, and the
/// connection that follows reports the real problem.
pub fn local_addresses(
    master: Option<IpAddr>,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<IpAddr>, NetifError> {
    let spec = spec_from_env(lookup)?;
    let interfaces = list_interfaces()?;
    // A spec overrides the route, so only ask the kernel without one.
    let route = match (&spec, master) {
        (None, Some(master)) => match route_to(master) {
            Ok(addr) => Some(addr),
            Err(err) => {
                tracing::debug!(%err, "no route to the master; using the default interface order");
                None
            }
        },
        _ => None,
    };
    let addrs = publish_order(spec.as_ref().map(|(_, s)| s), &interfaces, route)?;
    tracing::debug!(?addrs, ?route, "addresses to publish");
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn iface(name: &str, addr: &str) -> Interface {
        Interface {
            name: name.to_string(),
            addr: ip(addr),
        }
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| ip(s)).collect()
    }

    /// A typical GPU node: loopback, docker bridge, ethernet, InfiniBand.
    fn host() -> Vec<Interface> {
        vec![
            iface("lo", "127.0.0.1"),
            iface("lo", "::1"),
            iface("docker0", "172.17.0.1"),
            iface("eth0", "10.0.0.2"),
            iface("eth0", "fd00::2"),
            iface("eth0", "fe80::1"),
            iface("ib0", "192.168.1.2"),
            iface("ib0", "fd01::2"),
        ]
    }

    #[test]
    fn prefix_spec() {
        let s = IfaceSpec::parse("eth,ib").unwrap();
        assert!(s.matches("eth0") && s.matches("ib1") && s.matches("eth"));
        assert!(!s.matches("docker0") && !s.matches("lo") && !s.matches("et"));
    }

    #[test]
    fn exclude_spec() {
        let s = IfaceSpec::parse("^docker,lo").unwrap();
        assert!(s.matches("eth0") && s.matches("ib0"));
        assert!(!s.matches("docker0") && !s.matches("lo") && !s.matches("lo2"));
    }

    #[test]
    fn exact_spec() {
        let s = IfaceSpec::parse("=eth0").unwrap();
        assert!(s.matches("eth0"));
        assert!(!s.matches("eth01") && !s.matches("eth"));
    }

    #[test]
    fn exact_exclude_spec() {
        let s = IfaceSpec::parse("^=docker0").unwrap();
        assert!(!s.matches("docker0"));
        assert!(s.matches("docker01") && s.matches("eth0") && s.matches("lo"));
    }

    #[test]
    fn spec_whitespace_and_empty_entries() {
        let s = IfaceSpec::parse("  ^ = eth0 , ,ib0 ,").unwrap();
        assert!(s.exclude && s.exact);
        assert_eq!(s.names, ["eth0", "ib0"]);
        assert_eq!(s.text, "  ^ = eth0 , ,ib0 ,");
    }

    #[test]
    fn bad_specs() {
        for bad in ["", " ", ",", "^", "^=", "=, ,", "eth0,^docker", "eth0,=ib0", "eth 0"] {
            let err = IfaceSpec::parse(bad).unwrap_err();
            assert!(matches!(err, NetifError::BadSpec { .. }), "{bad:?}: {err}");
            assert!(err.to_string().starts_with("CHORUS_SOCKET_IFNAME="), "{err}");
        }
        let err = IfaceSpec::exact_list("^eth0").unwrap_err();
        assert!(err.to_string().starts_with("GLOO_SOCKET_IFNAME=\"^eth0\""), "{err}");
        assert!(IfaceSpec::exact_list(" , ").is_err());
    }

    #[test]
    fn gloo_exact_list() {
        let s = IfaceSpec::exact_list("eth0, ib0").unwrap();
        assert!(s.matches("eth0") && s.matches("ib0"));
        assert!(!s.matches("eth01") && !s.matches("eth") && !s.matches("lo"));
    }

    #[test]
    fn spec_from_env_prefers_chorus_then_gloo() {
        let env = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let run = |m: HashMap<String, String>| spec_from_env(&move |k| m.get(k).cloned());

        assert!(run(env(&[])).unwrap().is_none());
        assert!(run(env(&[("GLOO_SOCKET_IFNAME", " ")])).unwrap().is_none());

        let (var, spec) = run(env(&[("GLOO_SOCKET_IFNAME", "eth")])).unwrap().unwrap();
        assert_eq!(var, "GLOO_SOCKET_IFNAME");
        assert!(!spec.matches("eth0"), "gloo names are exact");

        let both = env(&[("CHORUS_SOCKET_IFNAME", "eth"), ("GLOO_SOCKET_IFNAME", "ib0")]);
        let (var, spec) = run(both).unwrap().unwrap();
        assert_eq!(var, "CHORUS_SOCKET_IFNAME");
        assert!(spec.matches("eth0"));

        let empty_chorus = env(&[("CHORUS_SOCKET_IFNAME", ""), ("GLOO_SOCKET_IFNAME", "ib0")]);
        assert_eq!(run(empty_chorus).unwrap().unwrap().0, "GLOO_SOCKET_IFNAME");

        assert!(run(env(&[("CHORUS_SOCKET_IFNAME", "^")])).is_err());
    }

    #[test]
    fn spec_picks_matching_in_interface_order_v4_first() {
        let spec = IfaceSpec::parse("eth,ib").unwrap();
        let got = publish_order(Some(&spec), &host(), Some(ip("192.168.1.2"))).unwrap();
        // fe80::1 is link-local: dropped.
        assert_eq!(got, ips(&["10.0.0.2", "192.168.1.2", "fd00::2", "fd01::2"]));
    }

    #[test]
    fn spec_ignores_route() {
        let spec = IfaceSpec::parse("=eth0").unwrap();
        let got = publish_order(Some(&spec), &host(), Some(ip("192.168.1.2"))).unwrap();
        assert_eq!(got, ips(&["10.0.0.2", "fd00::2"]));
    }

    #[test]
    fn spec_may_choose_loopback() {
        let spec = IfaceSpec::parse("lo").unwrap();
        let got = publish_order(Some(&spec), &host(), None).unwrap();
        assert_eq!(got, ips(&["127.0.0.1", "::1"]));
    }

    #[test]
    fn spec_matching_nothing_lists_what_is_available() {
        let spec = IfaceSpec::parse("eth9").unwrap();
        let interfaces = [iface("lo", "127.0.0.1"), iface("eth0", "10.0.0.2")];
        let err = publish_order(Some(&spec), &interfaces, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "CHORUS_SOCKET_IFNAME=eth9 matches no interface; available: lo (127.0.0.1), eth0 (10.0.0.2)"
        );
        let NetifError::NoMatchingInterface { available, .. } = err else {
            panic!("wrong error")
        };
        assert_eq!(available, ["lo (127.0.0.1)", "eth0 (10.0.0.2)"]);

        // Matching only a link-local address is matching nothing usable.
        let spec = IfaceSpec::exact_list("eth0").unwrap();
        let err = publish_order(Some(&spec), &[iface("eth0", "fe80::1")], None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "GLOO_SOCKET_IFNAME=eth0 matches no interface; available: eth0 (fe80::1)"
        );

        let err = publish_order(Some(&spec), &[], None).unwrap_err();
        assert!(err.to_string().ends_with("available: none"), "{err}");
    }

    #[test]
    fn default_order_follows_nccl() {
        let got = publish_order(None, &host(), None).unwrap();
        assert_eq!(
            got,
            ips(&[
                "192.168.1.2",
                "fd01::2",
                "10.0.0.2",
                "fd00::2",
                "172.17.0.1",
                "127.0.0.1",
                "::1",
            ])
        );
    }

    #[test]
    fn default_order_puts_route_first_without_duplicate() {
        let got = publish_order(None, &host(), Some(ip("10.0.0.2"))).unwrap();
        assert_eq!(got[0], ip("10.0.0.2"));
        assert_eq!(got.iter().filter(|a| **a == ip("10.0.0.2")).count(), 1);
        assert_eq!(got.len(), 7);
    }

    #[test]
    fn loopback_or_unspecified_route_is_ignored() {
        let plain = publish_order(None, &host(), None).unwrap();
        for route in ["127.0.0.1", "::1", "0.0.0.0", "::", "fe80::9"] {
            assert_eq!(publish_order(None, &host(), Some(ip(route))).unwrap(), plain);
        }
    }

    #[test]
    fn route_not_among_interfaces_is_still_published_first() {
        let got = publish_order(None, &[iface("lo", "127.0.0.1")], Some(ip("10.9.9.9"))).unwrap();
        assert_eq!(got, ips(&["10.9.9.9", "127.0.0.1"]));
    }

    #[test]
    fn default_order_classes_and_loopback_order() {
        let interfaces = [
            iface("lo", "::1"),
            iface("lo", "127.0.0.2"),
            iface("lo", "127.0.0.1"),
            iface("lo:1", "10.1.1.1"),
            iface("docker0", "fd02::1"),
            iface("docker0", "172.17.0.1"),
            iface("enp1s0", "fd00::5"),
            iface("enp1s0", "10.0.0.5"),
            iface("wlan0", "192.168.0.9"),
            iface("ibp2s0", "10.2.0.5"),
        ];
        let got = publish_order(None, &interfaces, None).unwrap();
        assert_eq!(
            got,
            ips(&[
                "10.2.0.5",
                "10.0.0.5",
                "192.168.0.9",
                "fd00::5",
                "172.17.0.1",
                "fd02::1",
                "10.1.1.1",
                "127.0.0.1",
                "127.0.0.2",
                "::1",
            ])
        );
    }

    #[test]
    fn only_loopback_host_publishes_loopback() {
        let interfaces = [iface("lo", "127.0.0.1"), iface("lo", "::1")];
        let got = publish_order(None, &interfaces, None).unwrap();
        assert_eq!(got, ips(&["127.0.0.1", "::1"]));
        assert!(publish_order(None, &[], None).unwrap().is_empty());
    }

    #[test]
    fn duplicate_interface_entries_are_dropped() {
        let interfaces = [iface("eth0", "10.0.0.2"), iface("eth0", "10.0.0.2")];
        assert_eq!(publish_order(None, &interfaces, None).unwrap(), ips(&["10.0.0.2"]));
        let spec = IfaceSpec::parse("eth").unwrap();
        assert_eq!(
            publish_order(Some(&spec), &interfaces, None).unwrap(),
            ips(&["10.0.0.2"])
        );
    }

    #[test]
    fn peer_address_same_host_prefers_loopback() {
        let published = ips(&["10.0.0.2", "fd00::2", "127.0.0.1", "::1"]);
        assert_eq!(peer_address(&published, true), Some(ip("127.0.0.1")));
        let no_loopback = ips(&["10.0.0.2", "fd00::2"]);
        assert_eq!(peer_address(&no_loopback, true), Some(ip("10.0.0.2")));
        assert_eq!(peer_address(&[], true), None);
    }

    #[test]
    fn peer_address_other_host_takes_first_routable() {
        let published = ips(&["127.0.0.1", "10.0.0.2", "fd00::2"]);
        assert_eq!(peer_address(&published, false), Some(ip("10.0.0.2")));
        let only_loopback = ips(&["127.0.0.1", "::1"]);
        assert_eq!(peer_address(&only_loopback, false), None);
        assert_eq!(peer_address(&[], false), None);
    }

    #[test]
    fn local_machine_has_loopback_and_routes_to_it() {
        let interfaces = list_interfaces().unwrap();
        assert!(interfaces.iter().any(|i| i.addr.is_loopback()), "{interfaces:?}");
        // Loopback only: no traffic may leave this machine.
        assert!(route_to(ip("127.0.0.1")).unwrap().is_loopback());
    }

    #[test]
    fn local_addresses_with_loopback_master_and_spec() {
        // The master is loopback, so the route is ignored; the result is
        // whatever this host has, loopback last.
        let none = |_: &str| None;
        let addrs = local_addresses(Some(ip("127.0.0.1")), &none).unwrap();
        let first_loopback = addrs.iter().position(IpAddr::is_loopback).unwrap();
        assert!(addrs[first_loopback..].iter().all(IpAddr::is_loopback));

        let lo_only = |k: &str| (k == "CHORUS_SOCKET_IFNAME").then(|| "=lo".to_string());
        let addrs = local_addresses(None, &lo_only).unwrap();
        assert!(!addrs.is_empty() && addrs.iter().all(IpAddr::is_loopback));

        let nothing = |k: &str| (k == "GLOO_SOCKET_IFNAME").then(|| "no-such-if0".to_string());
        let err = local_addresses(None, &nothing).unwrap_err();
        assert!(err.to_string().contains("lo (127.0.0.1"), "{err}");
    }

    fn arb_addr() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            Just(ip("127.0.0.1")),
            Just(ip("127.0.1.1")),
            Just(ip("::1")),
            Just(ip("fe80::1")),
            Just(ip("0.0.0.0")),
            (0u8..4, 0u8..4).prop_map(|(a, b)| IpAddr::from([10, 0, a, b])),
            (0u16..4).prop_map(|a| IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, a])),
        ]
    }

    fn arb_interfaces() -> impl Strategy<Value = Vec<Interface>> {
        let name = prop_oneof![Just("lo"), Just("eth0"), Just("ib0"), Just("docker0"), Just("enp1s0")];
        prop::collection::vec((name, arb_addr()), 0..12).prop_map(|v| {
            v.into_iter()
                .map(|(name, addr)| Interface {
                    name: name.to_string(),
                    addr,
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn default_order_invariants(
            interfaces in arb_interfaces(),
            route in prop::option::of(arb_addr()),
        ) {
            let got = publish_order(None, &interfaces, route).unwrap();
            let mut dedup = got.clone();
            dedup.sort();
            dedup.dedup();
            prop_assert_eq!(dedup.len(), got.len(), "duplicates in {:?}", got);
            prop_assert!(got.iter().all(|a| usable(*a)));
            // Loopback comes last, and every usable interface address is there.
            if let Some(first) = got.iter().position(IpAddr::is_loopback) {
                prop_assert!(got[first..].iter().all(IpAddr::is_loopback));
            }
            for i in interfaces.iter().filter(|i| usable(i.addr)) {
                prop_assert!(got.contains(&i.addr));
            }
            // A peer elsewhere is never sent to loopback while a real address exists.
            let real = got.iter().any(|a| !a.is_loopback());
            prop_assert_eq!(peer_address(&got, false).is_some(), real);
        }

        #[test]
        fn parse_never_panics(s in "[ ,^=a-z0-9]{0,12}") {
            if let Ok(spec) = IfaceSpec::parse(&s) {
                prop_assert!(!spec.names.is_empty());
                let _ = spec.matches("eth0");
            }
        }
    }
}
