"""mDNS/DNS-SD peer discovery on the LAN, bridged from zeroconf's threads into trio.

This is deliberately the one small module where threads meet trio:

* zeroconf (sync API) runs its own asyncio loop in a private thread, and a
  ``ServiceBrowser`` fires callbacks in yet another thread.  That callback does
  nothing but hop the raw ``(name, state_change)`` event into trio with
  ``trio.from_thread.run_sync(send_nowait, ..., trio_token=token)``, so
  zeroconf's threads never block on us and never see our exceptions.
* Resolving a name (``ServiceInfo.request``) blocks, so trio runs it in worker
  threads (``trio.to_thread.run_sync``) under a ``CapacityLimiter``; a remote
  peer that announces garbage can therefore cost us at most one bounded
  resolve per name, never a stuck event loop.
* Validation and delivery into the caller's channel happen in trio.

Loopback: ``interfaces=["127.0.0.1"]`` works across processes on Linux as is,
no extra zeroconf option needed.  zeroconf joins 224.0.0.251 on ``lo`` and sets
``IP_MULTICAST_IF=127.0.0.1`` + ``IP_MULTICAST_LOOP=1`` on its responder socket
(bound to 127.0.0.1:5353 with SO_REUSEADDR/SO_REUSEPORT), so every process's
wildcard listener gets every packet even though ``lo`` lacks the MULTICAST
flag.  The one trap is unicast: several processes share 127.0.0.1:5353 via
SO_REUSEPORT, so a unicast reply to a QU ("unicast response wanted") question
is handed to just one of them, maybe the wrong one.  We therefore ask only
QM (multicast) questions, both when browsing and when resolving.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import ifaddr
import trio
from zeroconf import (
    DNSQuestionType,
    InterfaceChoice,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

SERVICE_TYPE = "_peertrain._tcp.local."

# Bounds on what we accept from the network; TXT strings are at most 255 bytes anyway.
_MAX_ID_LEN = 63  # one DNS label: the peer ID is the service instance label
_MAX_SWARM_LEN = 128


@dataclass(frozen=True)
class Announcement:
    """A validated, resolved peer seen on the LAN (same swarm, compatible protocol)."""

    peer_id: str
    swarm: str
    protocol_version: int
    addresses: tuple[tuple[str, int], ...]  # (ip, port)


class _Rejected(Exception):
    """Why a remote announcement is ignored; only ever logged at DEBUG."""


@dataclass
class _ResolveState:
    """Per-run bookkeeping of the trio side: which names are being resolved and what we sent."""

    running: set[str] = field(default_factory=set)
    again: set[str] = field(default_factory=set)  # changed while a resolve was in flight
    last_sent: dict[str, Announcement] = field(default_factory=dict)  # keyed by name.lower()


def _txt(props: dict[Any, Any], key: str, max_len: int = 255) -> str:
    """Fetch one TXT value as printable text, or reject the announcement."""
    raw = props.get(key.encode())
    if raw is None:
        raise _Rejected(f"TXT {key!r} missing or empty")
    if not isinstance(raw, bytes):
        raise _Rejected(f"TXT {key!r} has unexpected type {type(raw).__name__}")
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Rejected(f"TXT {key!r} is not UTF-8") from exc
    if not value or len(value) > max_len or not value.isprintable():
        raise _Rejected(f"TXT {key!r} is empty, too long or unprintable: {value[:40]!r}")
    return value


def _txt_int(props: dict[Any, Any], key: str) -> int:
    """Fetch one TXT value as a plain non-negative decimal integer, or reject."""
    value = _txt(props, key, max_len=10)
    if not value.isascii() or not value.isdigit():
        raise _Rejected(f"TXT {key!r} is not a decimal integer: {value!r}")
    return int(value)


def _interface_ipv4s(include_loopback: bool) -> list[str]:
    """This host's (or namespace's) IPv4 addresses, for the A records when none were given."""
    ips: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if not ip.is_IPv4 or not isinstance(ip.ip, str):
                continue
            addr = ipaddress.IPv4Address(ip.ip)
            if addr.is_link_local or (addr.is_loopback and not include_loopback):
                continue
            ips.append(ip.ip)
    return sorted(set(ips))


class MdnsDiscovery:
    """Announce this peer via DNS-SD and report other peers of the same swarm.

    ``interfaces=None`` lets zeroconf use every interface (use it only on a
    real LAN or inside a network namespace); tests pass ``["127.0.0.1"]``.
    """

    def __init__(
        self,
        *,
        peer_id: str,
        swarm: str,
        port: int,
        protocol_version: int,
        interfaces: list[str] | None = None,
        advertise_addresses: list[str] | None = None,
        log: logging.Logger | None = None,
        resolve_timeout: float = 3.0,
        shutdown_timeout: float = 5.0,
        max_concurrent_resolves: int = 4,
        event_buffer: int = 256,
    ) -> None:
        if not peer_id or "." in peer_id or len(peer_id.encode()) > _MAX_ID_LEN or not peer_id.isprintable():
            raise ValueError(f"peer_id must be one printable DNS label of <= {_MAX_ID_LEN} bytes: {peer_id!r}")
        if not swarm or len(swarm) > _MAX_SWARM_LEN or not swarm.isprintable():
            raise ValueError(f"swarm must be 1..{_MAX_SWARM_LEN} printable characters: {swarm!r}")
        if not 0 < port < 65536:
            raise ValueError(f"port out of range: {port}")
        if protocol_version < 0:
            raise ValueError(f"protocol_version must be >= 0: {protocol_version}")
        self.peer_id = peer_id
        self.swarm = swarm
        self.port = port
        self.protocol_version = protocol_version
        self.interfaces = list(interfaces) if interfaces is not None else None
        self.advertise_addresses = list(advertise_addresses) if advertise_addresses is not None else None
        self.resolve_timeout = resolve_timeout
        self.shutdown_timeout = shutdown_timeout
        self.max_concurrent_resolves = max_concurrent_resolves
        self.event_buffer = event_buffer
        self._log = log or logging.getLogger(__name__)
        self.instance_name = f"{peer_id}.{SERVICE_TYPE}"

    # ------------------------------------------------------------------ trio side

    async def run(
        self,
        found: trio.MemorySendChannel[Announcement],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Register our service, browse for others, send each valid Announcement (also updates)
        into `found` until cancelled; on cancel, unregister and close zeroconf cleanly (in a
        thread), within a bounded time.

        ``task_status.started()`` fires once we are registered (probing done) and browsing.
        Errors opening sockets or registering (e.g. a name conflict) propagate.
        """
        token = trio.lowlevel.current_trio_token()
        own = self._own_service_info()
        events_send, events_recv = trio.open_memory_channel[tuple[str, ServiceStateChange]](self.event_buffer)
        stopping = threading.Event()  # lets a late zeroconf callback drop its event without touching trio
        zc = await trio.to_thread.run_sync(self._open_zeroconf)
        browser: ServiceBrowser | None = None
        registered = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._process_events, zc, events_recv, found)
                handler = self._make_browser_handler(token, events_send, stopping)
                browser = await trio.to_thread.run_sync(
                    partial(ServiceBrowser, zc, SERVICE_TYPE, handlers=[handler], question_type=DNSQuestionType.QM)
                )
                # Probing + announcing takes ~1.5 s; browsing already runs meanwhile.
                await trio.to_thread.run_sync(partial(zc.register_service, own, allow_name_change=False))
                registered = True
                self._log.info(
                    "mdns: announced %s (swarm=%s pv=%d) at %s port %d",
                    self.peer_id, self.swarm, self.protocol_version,
                    ",".join(own.parsed_addresses()), self.port,
                )
                task_status.started()
        finally:
            stopping.set()
            with trio.move_on_after(self.shutdown_timeout, shield=True) as scope:
                await trio.to_thread.run_sync(
                    partial(self._close_blocking, zc, browser, own if registered else None),
                    abandon_on_cancel=True,
                )
            events_send.close()
            if scope.cancelled_caught:
                self._log.warning("mdns: zeroconf shutdown exceeded %.1fs; abandoned it", self.shutdown_timeout)

    async def _process_events(
        self,
        zc: Zeroconf,
        events: trio.MemoryReceiveChannel[tuple[str, ServiceStateChange]],
        found: trio.MemorySendChannel[Announcement],
    ) -> None:
        """Turn browser events into resolves, at most one in flight per name."""
        limiter = trio.CapacityLimiter(self.max_concurrent_resolves)
        state = _ResolveState()
        async with events, trio.open_nursery() as nursery:
            async for name, change in events:
                if name.lower() == self.instance_name.lower():
                    self._log.debug("mdns: ignoring %s: our own announcement", name)
                    continue
                if change is ServiceStateChange.Removed:
                    state.last_sent.pop(name.lower(), None)
                    self._log.debug("mdns: %s went away", name)
                    continue
                if name in state.running:
                    state.again.add(name)
                    continue
                state.running.add(name)
                nursery.start_soon(self._resolve_and_deliver, zc, name, found, limiter, state)

    async def _resolve_and_deliver(
        self,
        zc: Zeroconf,
        name: str,
        found: trio.MemorySendChannel[Announcement],
        limiter: trio.CapacityLimiter,
        state: _ResolveState,
    ) -> None:
        """Resolve `name` (again, if it changed meanwhile) and deliver it if valid and new."""
        try:
            while True:
                state.again.discard(name)
                # abandon_on_cancel: shutdown must not wait for a resolve of a silent peer.
                info = await trio.to_thread.run_sync(
                    partial(self._resolve_blocking, zc, name), limiter=limiter, abandon_on_cancel=True
                )
                ann = self._validate(name, info)
                # Suppress exact repeats, but only of announcements the consumer really got.
                if ann is not None and state.last_sent.get(name.lower()) != ann and self._deliver(found, ann):
                    state.last_sent[name.lower()] = ann
                if name not in state.again:
                    return
        finally:
            state.running.discard(name)

    def _validate(self, name: str, info: ServiceInfo | None) -> Announcement | None:
        """Check a resolved remote service; anything odd is logged at DEBUG and dropped."""
        try:
            return self._announcement_from(name, info)
        except _Rejected as why:
            self._log.debug("mdns: ignoring %s: %s", name, why)
        except Exception:  # a remote peer's garbage must never take the daemon down
            self._log.debug("mdns: ignoring %s: unparseable announcement", name, exc_info=True)
        return None

    def _announcement_from(self, name: str, info: ServiceInfo | None) -> Announcement:
        if info is None:
            raise _Rejected(f"did not resolve within {self.resolve_timeout:.1f}s (no SRV/TXT/A)")
        props = info.properties or {}
        peer_id = _txt(props, "id", max_len=_MAX_ID_LEN)
        if name.lower() != f"{peer_id}.{SERVICE_TYPE}".lower():
            raise _Rejected(f"instance name does not match TXT id {peer_id!r}")
        if peer_id == self.peer_id:
            raise _Rejected("carries our own peer id")
        swarm = _txt(props, "swarm", max_len=_MAX_SWARM_LEN)
        if swarm != self.swarm:
            raise _Rejected(f"other swarm {swarm!r}")
        pv = _txt_int(props, "pv")
        if pv != self.protocol_version:
            raise _Rejected(f"incompatible protocol version {pv} (ours {self.protocol_version})")
        port = _txt_int(props, "port")
        if not 0 < port < 65536:
            raise _Rejected(f"bad TXT port {port}")
        if info.port != port:
            raise _Rejected(f"SRV port {info.port} disagrees with TXT port {port}")
        addresses: list[tuple[str, int]] = []
        for ip in info.parsed_addresses():
            addr = ipaddress.ip_address(ip)
            if addr.is_unspecified or addr.is_multicast or (addr.version == 6 and addr.is_link_local):
                continue  # undialable (link-local v6 would need a scope id we don't carry)
            if (ip, port) not in addresses:
                addresses.append((ip, port))
        if not addresses:
            raise _Rejected("no usable addresses")
        return Announcement(peer_id=peer_id, swarm=swarm, protocol_version=pv, addresses=tuple(addresses))

    def _deliver(self, found: trio.MemorySendChannel[Announcement], ann: Announcement) -> bool:
        """Hand `ann` to the consumer without ever blocking; False if it had to be dropped."""
        try:
            found.send_nowait(ann)
        except trio.WouldBlock:
            self._log.debug("mdns: dropped announcement of %s: consumer channel full", ann.peer_id)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._log.debug("mdns: dropped announcement of %s: consumer channel closed", ann.peer_id)
        else:
            self._log.debug("mdns: found %s at %s", ann.peer_id, ann.addresses)
            return True
        return False

    # --------------------------------------------------------------- thread side

    def _make_browser_handler(
        self,
        token: trio.lowlevel.TrioToken,
        events: trio.MemorySendChannel[tuple[str, ServiceStateChange]],
        stopping: threading.Event,
    ) -> Any:
        """Build the ServiceBrowser callback; it runs in zeroconf's browser thread."""
        log = self._log

        def on_service_state_change(
            zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
        ) -> None:
            if stopping.is_set():
                return
            try:
                trio.from_thread.run_sync(events.send_nowait, (name, state_change), trio_token=token)
            except trio.WouldBlock:
                log.debug("mdns: dropped %s event for %s: event buffer full", state_change.name, name)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.RunFinishedError):
                log.debug("mdns: dropped %s event for %s: discovery stopped", state_change.name, name)
            except Exception:  # never let anything escape into zeroconf's thread
                log.debug("mdns: dropped %s event for %s", state_change.name, name, exc_info=True)

        return on_service_state_change

    def _open_zeroconf(self) -> Zeroconf:
        interfaces: Any = InterfaceChoice.All if self.interfaces is None else self.interfaces
        return Zeroconf(interfaces=interfaces)

    def _own_service_info(self) -> ServiceInfo:
        if self.advertise_addresses is not None:
            addresses = self.advertise_addresses
        elif self.interfaces is not None:
            addresses = self.interfaces
        else:
            addresses = _interface_ipv4s(include_loopback=False) or ["127.0.0.1"]
        return ServiceInfo(
            SERVICE_TYPE,
            self.instance_name,
            port=self.port,
            properties={
                "id": self.peer_id,
                "swarm": self.swarm,
                "pv": str(self.protocol_version),
                "port": str(self.port),
            },
            server=f"{self.peer_id}.local.",
            parsed_addresses=list(addresses),
        )

    def _resolve_blocking(self, zc: Zeroconf, name: str) -> ServiceInfo | None:
        """Resolve SRV/TXT/A for `name`; runs in a trio worker thread (it blocks)."""
        try:
            info = ServiceInfo(SERVICE_TYPE, name)
            if info.request(zc, self.resolve_timeout * 1000, question_type=DNSQuestionType.QM):
                return info
        except Exception:  # bad name, zeroconf shutting down, ...
            self._log.debug("mdns: resolving %s failed", name, exc_info=True)
        return None

    def _close_blocking(self, zc: Zeroconf, browser: ServiceBrowser | None, own: ServiceInfo | None) -> None:
        """Stop browsing, send goodbyes, close sockets; runs in a worker thread."""
        try:
            if browser is not None:
                browser.cancel()
            if own is not None:
                zc.unregister_service(own)
        except Exception:
            self._log.debug("mdns: error while unregistering", exc_info=True)
        finally:
            zc.close()
