"""The "internet lab": home LANs behind NAT routers plus a public segment, all in network namespaces.

Topology (nothing is created in, or attached to, the root namespace):

    {p}h0 --eth0==vh0--+                                      (public hosts 10.99.0.11, .12, ...)
    {p}h1 --eth0==vh1--+-- br0 in {p}i  ("the internet", 10.99.0.0/24)
                       +--vr1==wan-- {p}r1: router, NAT, bridge "lan" 192.168.1.1/24 --vh2==eth0-- {p}h2 ...
                       +--vr2==wan-- {p}r2: ...                       192.168.2.1/24 --vh4==eth0-- {p}h4 ...

where {p} is ``{prefix}{pid}``.  Router k's WAN address is 10.99.0.{k}; its LAN hosts are
192.168.{k}.{2,3,...} with a default route through it.  A router masquerades what leaves by ``wan``
("preserving" keeps the source port when it is free, "random" is ``--random-fully``) and drops
whatever arrives on ``wan`` unsolicited, like a home router: public hosts and other LANs reach a
LAN host only through a connection it opened (or a simultaneous open through port-preserving NATs).

Multicast stays inside each LAN (a router does not forward it) and the internet bridge does not
flood it either, as the real internet would not carry it: mDNS finds LAN neighbours only.  Public
hosts get a multicast route all the same, so zeroconf's sends go nowhere instead of failing.
Nothing outside 10.99.0.0/24 is routable anywhere, so stray traffic fails fast instead of leaking.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from peer.testing.netns import Host, NetnsError, _delete_netns, _list_netns, _run, cleanup_stale, probe_namespace, tbf

_INTERNET = "10.99.0"  # the public /24: routers' WAN addresses are .1..; public hosts .11..
_FIRST_PUBLIC = 11
_MAX_LANS = _FIRST_PUBLIC - 1
_NATS = {"preserving": [], "random": ["--random-fully"]}
DEFAULT_LANS = (("lan1", 2, "preserving"), ("lan2", 2, "preserving"), ("lan3", 1, "random"))


@dataclass
class Site:
    """One LAN behind a NAT router, or (name "public", no router) the public internet segment."""

    name: str
    hosts: list[Host]
    router: str | None  # the router's namespace
    public_ip: str | None  # the router's WAN address: what the internet sees as these hosts' source
    nat: str  # "none" (public hosts), "preserving" (MASQUERADE), "random" (MASQUERADE --random-fully)


@dataclass
class InternetLab:
    """The sites, and what it takes to rate-limit and tear down their links."""

    sites: dict[str, Site]
    internet_ns: str
    # host name -> (namespace, device) of the far end of its eth0 veth, for tbf on both directions
    _far_end: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)
    _created: list[str] = field(default_factory=list, repr=False)

    def hosts(self) -> list[Host]:
        """Every end host, public first, by global index."""
        return sorted((h for s in self.sites.values() for h in s.hosts), key=lambda h: h.index)

    def site_of(self, host: Host) -> Site:
        for site in self.sites.values():
            if any(h.name == host.name for h in site.hosts):
                return site
        raise KeyError(f"{host.name} is not a host of this lab")

    def external_ip(self, host: Host) -> str:
        """The address the internet sees for `host`: its own if public, else its router's WAN address."""
        site = self.site_of(host)
        return site.public_ip or host.ip

    @property
    def namespaces(self) -> list[str]:
        return list(self._created)

    def limit(self, host: Host, mbit: float) -> None:
        """(Re)apply a tbf rate limit on `host`'s link, both directions (as Lan.limit)."""
        far_ns, far_dev = self._far_end[host.name]
        for ns, dev in ((host.name, "eth0"), (far_ns, far_dev)):
            tbf(ns, dev, mbit)

    public_limit = limit  # a public host's link is limited the same way

    def unlimit(self, host: Host) -> None:
        far_ns, far_dev = self._far_end[host.name]
        for ns, dev in ((host.name, "eth0"), (far_ns, far_dev)):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def _wan_link(self, site: str) -> tuple[tuple[str, str], tuple[str, str]]:
        router = self.sites[site].router
        if router is None:
            raise ValueError(f"site {site!r} has no router")
        k = int(router.rsplit("r", 1)[1])
        return (router, "wan"), (self.internet_ns, f"vr{k}")

    def router_limit(self, site: str, mbit: float) -> None:
        """tbf on a router's WAN link both directions: the whole LAN's internet uplink and downlink."""
        for ns, dev in self._wan_link(site):
            tbf(ns, dev, mbit)

    def router_unlimit(self, site: str) -> None:
        for ns, dev in self._wan_link(site):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def _teardown(self) -> list[str]:
        """Kill our processes, delete our namespaces; returns the names that refused to go."""
        for host in self.hosts():
            host._kill_procs()
        for ns in reversed(self._created):
            _delete_netns(ns)
        left = set(_list_netns())
        return [ns for ns in self._created if ns in left]


def _iptables(ns: str, *rule: str) -> None:
    _run(["ip", "netns", "exec", ns, "iptables", "-w", "5", *rule])


def internet_available() -> bool:
    """True if we are root with ip and iptables, and a namespace really accepts NAT and conntrack rules."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None:
        return False

    def nat_works(ns: str) -> bool:
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _iptables(ns, "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE", "--random-fully")
        _iptables(ns, "-A", "FORWARD", "-i", "lo", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                  "-j", "ACCEPT")
        return True
    return probe_namespace("pti", nat_works)


def _add_ns(lab: InternetLab, ns: str) -> None:
    _run(["ip", "netns", "add", ns])
    lab._created.append(ns)
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])


def _add_bridge(ns: str, name: str) -> None:
    # STP off + forward_delay 0: ports forward at once; no snooping: multicast is simply flooded
    # (on a LAN), or, with mcast_flood off on every port (the internet), dropped.
    _run(["ip", "-n", ns, "link", "add", name, "type", "bridge",
          "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0"])
    _run(["ip", "-n", ns, "link", "set", name, "up"])


def _add_host(lab: InternetLab, host: Host, bridge_ns: str, bridge: str, *, flood_multicast: bool,
              gateway: str | None) -> None:
    """A host namespace whose eth0 is a veth into `bridge` (in `bridge_ns`), named vh{index} there."""
    _add_ns(lab, host.name)
    port = f"vh{host.index}"
    _run(["ip", "-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.name])
    _run(["ip", "-n", bridge_ns, "link", "set", port, "master", bridge, "up"])
    if not flood_multicast:
        _run(["ip", "-n", bridge_ns, "link", "set", port, "type", "bridge_slave", "mcast_flood", "off"])
    lab._far_end[host.name] = (bridge_ns, port)
    _run(["ip", "-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
    _run(["ip", "-n", host.name, "link", "set", "eth0", "multicast", "on", "up"])
    _run(["ip", "-n", host.name, "route", "add", "224.0.0.0/4", "dev", "eth0"])
    if gateway is not None:
        _run(["ip", "-n", host.name, "route", "add", "default", "via", gateway])


def _add_router(lab: InternetLab, site: Site, k: int) -> str:
    """Router k: `wan` on the internet bridge, bridge `lan` for its hosts, NAT and a home firewall."""
    assert site.router is not None and site.public_ip is not None
    r, inet = site.router, lab.internet_ns
    _add_ns(lab, r)
    _run(["ip", "-n", inet, "link", "add", f"vr{k}", "type", "veth", "peer", "name", "wan", "netns", r])
    _run(["ip", "-n", inet, "link", "set", f"vr{k}", "master", "br0", "up"])
    _run(["ip", "-n", inet, "link", "set", f"vr{k}", "type", "bridge_slave", "mcast_flood", "off"])
    _run(["ip", "-n", r, "addr", "add", f"{site.public_ip}/24", "dev", "wan"])
    _run(["ip", "-n", r, "link", "set", "wan", "up"])
    _add_bridge(r, "lan")
    _run(["ip", "-n", r, "addr", "add", f"192.168.{k}.1/24", "dev", "lan"])
    _run(["ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    _iptables(r, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE", *_NATS[site.nat])
    for chain in ("INPUT", "FORWARD"):  # no unsolicited inbound, to the router or through it
        _iptables(r, "-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                  "-j", "ACCEPT")
        _iptables(r, "-A", chain, "-i", "wan", "-j", "DROP")
    return r


@contextmanager
def internet_lab(
    *,
    public: int = 2,
    lans: tuple[tuple[str, int, str], ...] = DEFAULT_LANS,
    prefix: str = "pti",
    rate_mbit: float | None = None,
) -> Iterator[InternetLab]:
    """`public` hosts on the internet segment and, per (name, hosts, nat) in `lans`, a LAN behind its
    own NAT router (see the module docstring).  Hosts are numbered globally, public first, then each
    LAN's in order.  `rate_mbit` puts a tbf limit on every end host's link, both directions.  Checks
    that every LAN host reaches a public host before yielding; always cleans up, even on exceptions."""
    if not 0 <= public <= 200:
        raise ValueError(f"public must be in 0..200: {public}")
    if len(lans) > _MAX_LANS:
        raise ValueError(f"at most {_MAX_LANS} LANs: {len(lans)}")
    names = [name for name, _, _ in lans]
    if len(set(names)) != len(names) or "public" in names:
        raise ValueError(f"LAN names must be distinct and not 'public': {names}")
    for name, n, nat in lans:
        if not 1 <= n <= 250:
            raise ValueError(f"LAN {name!r}: hosts must be in 1..250: {n}")
        if nat not in _NATS:
            raise ValueError(f"LAN {name!r}: nat must be one of {sorted(_NATS)}: {nat!r}")
    if not re.fullmatch(r"[a-z]+", prefix):
        raise ValueError(f"prefix must be lowercase letters (the pid follows it): {prefix!r}")
    cleanup_stale(prefix)
    p = f"{prefix}{os.getpid()}"
    index = 0
    pub_hosts = []
    for i in range(public):
        pub_hosts.append(Host(name=f"{p}h{index}", ip=f"{_INTERNET}.{_FIRST_PUBLIC + i}", index=index))
        index += 1
    sites = {"public": Site("public", pub_hosts, router=None, public_ip=None, nat="none")}
    for k, (name, n, nat) in enumerate(lans, start=1):
        hosts = []
        for j in range(n):
            hosts.append(Host(name=f"{p}h{index}", ip=f"192.168.{k}.{j + 2}", index=index))
            index += 1
        sites[name] = Site(name, hosts, router=f"{p}r{k}", public_ip=f"{_INTERNET}.{k}", nat=nat)
    lab = InternetLab(sites=sites, internet_ns=f"{p}i")
    wanted = {lab.internet_ns, *(s.router for s in sites.values() if s.router), *(h.name for h in lab.hosts())}
    clash = wanted & set(_list_netns())
    if clash:
        raise NetnsError(f"namespaces {sorted(clash)} already exist: "
                         "nested internet_lab in one process needs another prefix")
    try:
        _add_ns(lab, lab.internet_ns)
        _add_bridge(lab.internet_ns, "br0")
        for host in pub_hosts:
            _add_host(lab, host, lab.internet_ns, "br0", flood_multicast=False, gateway=None)
        lan_sites = [s for s in sites.values() if s.router is not None]
        for k, site in enumerate(lan_sites, start=1):
            router = _add_router(lab, site, k)
            for host in site.hosts:
                _add_host(lab, host, router, "lan", flood_multicast=True, gateway=f"192.168.{k}.1")
        if rate_mbit is not None:
            for host in lab.hosts():
                lab.limit(host, rate_mbit)
        if pub_hosts:
            target = pub_hosts[0].ip
            for host in (h for s in lan_sites for h in s.hosts):
                if not host.can_reach(target):
                    raise NetnsError(f"{host.name} ({host.ip}) cannot reach public host {target} through its NAT")
    except BaseException:
        lab._teardown()
        raise
    try:
        yield lab
    except BaseException:
        lab._teardown()
        raise
    left = lab._teardown()
    if left:
        raise NetnsError(f"could not delete namespaces {left}")
