"""Membership's dialer, in-process: what it dials, and that a leaving daemon dials nothing; the `Dialer`
alone, on a peer table of our making."""

from __future__ import annotations

import socket

import trio

from peer.config import from_mapping
from peer.membership.dialing import Dialer
from peer.membership.peers import FORGET_AFTER_FAILURES, PeerInfo
from peer.membership.service import Membership
from peer.session.router import Router
from peer.session.transport import TransportConfig
from protocol.identity import generate_identity


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap_failures_after(seconds: float, *, leaving: bool) -> int:
    """Failed dials of a refusing bootstrap address, retried every 0.05-0.15 s; `leaving` once the first failed."""
    cfg = from_mapping({"daemon": {"join": [f"127.0.0.1:{_closed_port()}"]},
                        "membership": {"reconnect_min": 0.05, "reconnect_max": 0.1}})
    m = Membership(config=cfg, transport=TransportConfig(identity=generate_identity(), swarm="t"),
                   peer_id="a" * 20, router=Router(), listen_port=lambda: 0)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(m.run)
            with trio.fail_after(10):
                while m.dialer.bootstrap[0].failures < 1:
                    await trio.sleep(0.01)
            if leaving:
                m.stop_dialing()
            await trio.sleep(seconds)
            n.cancel_scope.cancel()

    trio.run(main)
    return m.dialer.bootstrap[0].failures


def test_a_refused_bootstrap_address_is_dialed_and_counted():
    assert _bootstrap_failures_after(1.0, leaving=False) >= 3


def test_a_leaving_daemon_dials_nothing_new():
    assert _bootstrap_failures_after(1.0, leaving=True) == 1


def _run_dialer(peers: dict[str, PeerInfo], until) -> Dialer:
    cfg = from_mapping({"membership": {"reconnect_min": 0.05, "reconnect_max": 0.1}})
    d = Dialer(cfg.membership, TransportConfig(identity=generate_identity(), swarm="t"), peer_id="a" * 20,
               peers=peers, bootstrap=[], start_session=lambda session: None)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(d.run)
            with trio.fail_after(10):
                while not until():
                    await trio.sleep(0.01)
            d.stop()  # run returns once its dials are done

    trio.run(main)
    return d


def test_a_peer_learned_second_hand_and_never_reached_is_forgotten():
    never, once = "b" * 20, "c" * 20
    peers = {never: PeerInfo(never, source="pex", failures=FORGET_AFTER_FAILURES),
             once: PeerInfo(once, source="pex", failures=FORGET_AFTER_FAILURES, last_seen=1.0)}
    _run_dialer(peers, lambda: never not in peers)
    assert list(peers) == [once]  # once reached: kept (it has nothing to dial, so it is not dialed)


def test_a_refused_address_learned_second_hand_backs_its_host_off_and_a_first_hand_one_does_not():
    port = _closed_port()
    second, first = "b" * 20, "c" * 20
    peers = {second: PeerInfo(second, addresses=[("127.0.0.1", port)], source="pex")}
    d = _run_dialer(peers, lambda: peers[second].failures >= 1)
    assert d.host_backoff["127.0.0.1"].failures >= 1
    peers = {first: PeerInfo(first, addresses=[("127.0.0.1", port)], firsthand={("127.0.0.1", port)}, source="mdns")}
    d = _run_dialer(peers, lambda: peers[first].failures >= 1)
    assert not d.host_backoff and peers[first].state == "discovered"
