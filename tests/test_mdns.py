"""MdnsDiscovery on loopback only (interfaces=["127.0.0.1"]): nothing leaves this host.

Names carry our pid plus random bits and every test uses its own swarm, so
parallel runs (or other developers' daemons on this host) neither collide on
instance names nor show up in our results: they are "another swarm".
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio
from zeroconf import ServiceInfo, ServiceStateChange, Zeroconf

from peer.membership.mdns import SERVICE_TYPE, Announcement, MdnsDiscovery
from peer.testing.netns import ProcOutput

LOOPBACK = ["127.0.0.1"]
PROBE = Path(__file__).with_name("netns_mdns_probe.py")
LOGGER = "peer.membership.mdns"


def _tag() -> str:
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def _disc(peer_id: str, swarm: str, port: int, pv: int = 1) -> MdnsDiscovery:
    return MdnsDiscovery(peer_id=peer_id, swarm=swarm, port=port, protocol_version=pv,
                         interfaces=LOOPBACK, log=logging.getLogger(f"{LOGGER}.{peer_id}"))


def _zeroconf_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zeroconf")]


def _garbage_infos(tag: str, swarm: str, impersonated: str) -> dict[str, tuple[ServiceInfo, str]]:
    """Hostile/broken announcements and the DEBUG reason each must be ignored with."""

    def info(label: str, props: dict[bytes, bytes] | bytes, port: int = 5555) -> ServiceInfo:
        return ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port, properties=props,
                           server=f"{label}.local.", parsed_addresses=["127.0.0.1"])

    def ok(label: str) -> dict[bytes, bytes]:
        return {b"id": label.encode(), b"swarm": swarm.encode(), b"pv": b"1", b"port": b"5555"}

    cases = {
        "nonutf8": (lambda l: {**ok(l), b"id": b"\xff\xfe\xfd"}, "TXT 'id' is not UTF-8"),
        "noswarm": (lambda l: {k: v for k, v in ok(l).items() if k != b"swarm"}, "TXT 'swarm' missing"),
        "badpv": (lambda l: {**ok(l), b"pv": b"one"}, "TXT 'pv' is not a decimal integer"),
        "newpv": (lambda l: {**ok(l), b"pv": b"2"}, "incompatible protocol version 2"),
        "bigport": (lambda l: {**ok(l), b"port": b"99999"}, "bad TXT port 99999"),
        "zeroport": (lambda l: {**ok(l), b"port": b"0"}, "bad TXT port 0"),
        "negport": (lambda l: {**ok(l), b"port": b"-1"}, "TXT 'port' is not a decimal integer"),
        "srvport": (lambda l: {**ok(l), b"port": b"5556"}, "SRV port 5555 disagrees with TXT port 5556"),
        "spoof": (lambda l: {**ok(l), b"id": impersonated.encode()}, "instance name does not match TXT id"),
        "notxt": (lambda l: b"\x00", "TXT 'id' missing"),
        "badtxt": (lambda l: b"\x09id=\xff\x01", "TXT 'id'"),
    }
    out = {}
    for case, (props, reason) in cases.items():
        label = f"junk-{case}-{tag}"
        out[label] = (info(label, props(label)), reason)
    return out


@pytest.mark.process
def test_three_peers_discover_each_other_and_ignore_strangers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tag = _tag()
    swarm = f"swarm-{tag}"
    ids = [f"p{i}-{tag}" for i in range(3)]
    stranger = f"stranger-{tag}"
    garbage = _garbage_infos(tag, swarm, impersonated=ids[0])
    threads_before = set(_zeroconf_threads())
    found: dict[str, dict[str, Announcement]] = {pid: {} for pid in [*ids, stranger]}
    timings: dict[str, float] = {}

    async def collect(me: str, recv: trio.MemoryReceiveChannel[Announcement], all_in: trio.Event) -> None:
        async for ann in recv:
            found[me][ann.peer_id] = ann
            if all(len(found[p]) >= 2 for p in ids):
                all_in.set()

    async def main() -> None:
        all_in = trio.Event()
        raw = await trio.to_thread.run_sync(lambda: Zeroconf(interfaces=LOOPBACK))
        try:
            async with trio.open_nursery() as nursery:
                # Register the hostile announcements concurrently with the real peers.
                for info, _ in garbage.values():
                    nursery.start_soon(trio.to_thread.run_sync, raw.register_service, info)
                async with trio.open_nursery() as peers:
                    discs = [_disc(pid, swarm, 9100 + i) for i, pid in enumerate(ids)]
                    discs.append(_disc(stranger, f"other-{tag}", 9199))
                    for d in discs:
                        send, recv = trio.open_memory_channel[Announcement](64)
                        peers.start_soon(d.run, send)
                        peers.start_soon(collect, d.peer_id, recv, all_in)
                    t0 = trio.current_time()
                    with trio.fail_after(10):
                        await all_in.wait()
                    timings["discovery"] = trio.current_time() - t0
                    # Every hostile name, and the stranger of another swarm, must have been looked at and
                    # rejected; resolving is asynchronous, so poll the log (bounded) rather than assume.
                    expected = [(label, reason) for label, (_, reason) in garbage.items()]
                    expected.append((stranger, f"other swarm 'other-{tag}'"))
                    with trio.fail_after(10):
                        while not all(any(label in r.getMessage() and reason in r.getMessage()
                                          for r in caplog.records) for label, reason in expected):
                            await trio.sleep(0.05)
                    t1 = trio.current_time()
                    peers.cancel_scope.cancel()
                timings["shutdown"] = trio.current_time() - t1
        finally:
            await trio.to_thread.run_sync(raw.close)

    trio.run(main)

    for i, me in enumerate(ids):
        others = {p for p in ids if p != me}
        assert set(found[me]) == others, f"{me} found {sorted(found[me])}"
        for pid in others:
            port = 9100 + ids.index(pid)
            assert found[me][pid] == Announcement(pid, swarm, 1, (("127.0.0.1", port),))
    assert found[stranger] == {}, "a peer of another swarm must see none of ours"
    log = [r.getMessage() for r in caplog.records]
    assert any(stranger in m and f"other swarm 'other-{tag}'" in m for m in log)
    assert any(ids[0] in m and "our own announcement" in m for m in log)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "garbage must not cause errors"
    assert timings["discovery"] < 10
    assert timings["shutdown"] < 3.0, timings
    # Every zeroconf loop/browser thread we started is gone again.
    deadline = time.monotonic() + 3
    while set(_zeroconf_threads()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_zeroconf_threads()) - threads_before


@pytest.mark.process
def test_cross_process_discovery_on_loopback() -> None:
    """Two probe processes and this process find each other: multicast on lo crosses processes."""
    tag = _tag()
    swarm = f"xproc-{tag}"
    ids = [f"x{i}-{tag}" for i in range(3)]
    procs = [
        ProcOutput(subprocess.Popen(
            [sys.executable, str(PROBE), "--peer-id", pid, "--swarm", swarm, "--port", str(9200 + i),
             "--expect", "2", "--timeout", "20", "--interfaces", "127.0.0.1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), label=pid)
        for i, pid in enumerate(ids[1:], start=1)
    ]
    mine: dict[str, Announcement] = {}

    async def main() -> None:
        send, recv = trio.open_memory_channel[Announcement](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_disc(ids[0], swarm, 9200).run, send)
            with trio.fail_after(15):
                async for ann in recv:
                    mine[ann.peer_id] = ann
                    if len(mine) == 2:
                        break
            # Keep announcing until both children have found us too.
            for p in procs:
                line = await trio.to_thread.run_sync(p.wait_for, lambda l: '"done"' in l, 15)
                assert line is not None, p.dump()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        for p in procs:
            assert p.proc.stdin is not None
            p.proc.stdin.close()
            assert p.proc.wait(timeout=10) == 0, p.dump()
            p.join()
            done = [e for e in p.events() if e["event"] == "done"]
            assert done and set(done[0]["found"]) == set(ids) - {p.label}, p.dump()
        assert set(mine) == set(ids[1:])
        assert mine[ids[1]].addresses == (("127.0.0.1", 9201),)
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=5)


@pytest.mark.process
def test_cancel_during_registration_is_prompt_and_clean() -> None:
    """Cancelling before task_status.started() still unregisters/closes within a bound."""
    threads_before = set(_zeroconf_threads())

    async def main() -> None:
        send, _recv = trio.open_memory_channel[Announcement](1)
        with trio.move_on_after(0.3):
            await _disc(f"early-{_tag()}", f"s-{_tag()}", 9300).run(send)

    t_start = time.monotonic()
    trio.run(main)
    assert time.monotonic() - t_start < 5.0  # registration probing (~1.5 s) + close, not unbounded
    deadline = time.monotonic() + 3
    while set(_zeroconf_threads()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_zeroconf_threads()) - threads_before


@pytest.mark.process
def test_updates_are_delivered_and_repeats_suppressed() -> None:
    """A peer that changes its port is announced again; an unchanged refresh is not."""
    tag = _tag()
    swarm = f"upd-{tag}"
    label = f"mover-{tag}"

    def info(port: int) -> ServiceInfo:
        props = {b"id": label.encode(), b"swarm": swarm.encode(), b"pv": b"1", b"port": str(port).encode()}
        return ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port, properties=props,
                           server=f"{label}.local.", parsed_addresses=["127.0.0.1"])

    got: list[Announcement] = []

    async def main() -> None:
        raw = await trio.to_thread.run_sync(lambda: Zeroconf(interfaces=LOOPBACK))
        try:
            send, recv = trio.open_memory_channel[Announcement](64)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_disc(f"watcher-{tag}", swarm, 9400).run, send)
                await trio.to_thread.run_sync(raw.register_service, info(5601))  # concurrently: ~1.5 s each
                with trio.fail_after(10):
                    got.append(await recv.receive())
                await trio.to_thread.run_sync(raw.update_service, info(5602))
                with trio.fail_after(10):
                    got.append(await recv.receive())
                await trio.to_thread.run_sync(raw.update_service, info(5602))  # same data again
                with trio.move_on_after(1.0):
                    got.append(await recv.receive())
                nursery.cancel_scope.cancel()
        finally:
            await trio.to_thread.run_sync(raw.close)

    trio.run(main)
    assert [a.addresses for a in got] == [(("127.0.0.1", 5601),), (("127.0.0.1", 5602),)]


def _resolved(name: str, props: dict[bytes, bytes] | bytes, *, port: int = 7000,
              addresses: list[str] | None = None) -> ServiceInfo:
    return ServiceInfo(SERVICE_TYPE, name, port=port, properties=props,
                       parsed_addresses=addresses if addresses is not None else ["10.0.0.5"])


@pytest.mark.parametrize(
    ("name", "props", "kwargs", "reason"),
    [
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {}, None),
        ("me.", {b"id": b"me", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {}, "our own peer id"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {"addresses": []},
         "no usable addresses"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {"addresses": ["0.0.0.0"]},
         "no usable addresses"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {"addresses": ["fe80::1"]},
         "no usable addresses"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {"port": 0},
         "SRV port 0 disagrees"),
        ("b.", {b"id": b"b", b"swarm": b"s" * 200, b"pv": b"1", b"port": b"7000"}, {}, "too long"),
        ("b.", {b"id": b"b\x00", b"swarm": b"s", b"pv": b"1", b"port": b"7000"}, {}, "unprintable"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": "\u0661".encode(), b"port": b"7000"}, {},
         "not a decimal integer"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"9" * 40, b"port": b"7000"}, {}, "too long"),
        ("b.", {b"id": b"b", b"swarm": b"s", b"pv": b"1", b"port": None}, {}, "TXT 'port' missing"),
    ],
)
def test_validation(name: str, props: dict[bytes, bytes], kwargs: dict, reason: str | None,
                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    disc = MdnsDiscovery(peer_id="me", swarm="s", port=7001, protocol_version=1, interfaces=LOOPBACK)
    full = name + SERVICE_TYPE
    ann = disc._validate(full, _resolved(full, props, **kwargs))
    if reason is None:
        assert ann == Announcement("b", "s", 1, (("10.0.0.5", 7000),))
    else:
        assert ann is None
        assert any(reason in r.getMessage() and full in r.getMessage() for r in caplog.records), caplog.text


def test_unresolvable_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    disc = MdnsDiscovery(peer_id="me", swarm="s", port=7001, protocol_version=1, interfaces=LOOPBACK)
    assert disc._validate("x." + SERVICE_TYPE, None) is None
    assert "did not resolve" in caplog.text


def test_delivery_and_bridge_never_raise() -> None:
    """Full/closed consumer channels and a finished trio run only drop events."""
    disc = MdnsDiscovery(peer_id="me", swarm="s", port=7001, protocol_version=1, interfaces=LOOPBACK)
    ann = Announcement("b", "s", 1, (("10.0.0.5", 7000),))
    handler_box: list = []

    async def main() -> None:
        send, recv = trio.open_memory_channel[Announcement](0)
        assert not disc._deliver(send, ann)  # full (no buffer, no receiver waiting)
        recv.close()
        assert not disc._deliver(send, ann)  # broken
        send.close()
        assert not disc._deliver(send, ann)  # closed
        ev_send, _ev_recv = trio.open_memory_channel[tuple[str, ServiceStateChange]](0)
        handler = disc._make_browser_handler(trio.lowlevel.current_trio_token(), ev_send, threading.Event())
        # From a foreign thread while trio is alive: the buffer is full, so it is dropped.
        await trio.to_thread.run_sync(lambda: handler(zeroconf=None, service_type=SERVICE_TYPE,
                                                      name="b." + SERVICE_TYPE,
                                                      state_change=ServiceStateChange.Added))
        handler_box.append(handler)

    trio.run(main)
    # trio is gone now: the callback must still return quietly.
    errors: list[BaseException] = []

    def late() -> None:
        try:
            handler_box[0](zeroconf=None, service_type=SERVICE_TYPE, name="b." + SERVICE_TYPE,
                           state_change=ServiceStateChange.Updated)
        except BaseException as exc:  # pragma: no cover - this is the failure being tested for
            errors.append(exc)

    t = threading.Thread(target=late)
    t.start()
    t.join(5)
    assert not errors


@pytest.mark.parametrize("bad", [{"peer_id": "a.b"}, {"peer_id": ""}, {"peer_id": "x" * 64},
                                 {"swarm": ""}, {"port": 0}, {"port": 70000}, {"protocol_version": -1}])
def test_constructor_rejects_bad_identity(bad: dict) -> None:
    args = {"peer_id": "me", "swarm": "s", "port": 7001, "protocol_version": 1, **bad}
    with pytest.raises(ValueError):
        MdnsDiscovery(**args, interfaces=LOOPBACK)


def test_own_service_info_defaults() -> None:
    info = _disc("me", "s", 7001, pv=3)._own_service_info()
    assert info.name == f"me.{SERVICE_TYPE}"
    assert info.server == "me.local."
    assert info.parsed_addresses() == ["127.0.0.1"]
    assert info.properties == {b"id": b"me", b"swarm": b"s", b"pv": b"3", b"port": b"7001"}
    explicit = MdnsDiscovery(peer_id="me", swarm="s", port=7001, protocol_version=1, interfaces=LOOPBACK,
                             advertise_addresses=["10.1.2.3"])._own_service_info()
    assert explicit.parsed_addresses() == ["10.1.2.3"]
    assert socket.inet_aton("10.1.2.3") in explicit.addresses
