"""Attacks on membership against a real daemon (issue 15): peer records that list huge numbers of
addresses, or many records whose addresses name a third party, sent by throwaway identities."""

from __future__ import annotations

import time

import pytest
import trio

from peer.testing.attacker import attacker_session
from peer.testing.attacks import run_scenario
from peer.testing.swarm import swarm_config, unique_swarm, write_config
from protocol import identity as ident
from protocol.schema import PeerExchange, PeerRecord, Ping, Pong, peer_record_signing_bytes
from tests.daemons import wait_for

pytestmark = pytest.mark.slow


def signed_peer_record(swarm: str, addresses: list[str]) -> PeerRecord:
    key = ident.generate_identity()
    pub = ident.public_key_bytes(key)
    now = time.time()
    rec = PeerRecord(peer_id=ident.peer_id_from_public_bytes(pub), public_key=pub, swarm=swarm, addresses=addresses,
                     issued=now, expires=now + 3600, signature=b"")
    return PeerRecord(rec.peer_id, pub, swarm, addresses, now, now + 3600,
                      ident.sign(key, peer_record_signing_bytes(rec)))


def closed_ports(n: int) -> list[int]:
    """Ports on 127.0.0.1 that refuse connections (bound, never listened on, then released)."""
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def dial_failures(d) -> int:
    return d.log_path.read_text(errors="replace").count(" failed: ")


def test_a_peer_record_with_90000_addresses_is_refused_at_once(cluster, tmp_path):
    swarm = unique_swarm()
    d = cluster.start("victim", config=write_config(tmp_path / "c.toml", swarm_config(swarm=swarm, mdns=False)))
    status = d.wait_ready()
    obs = run_scenario("oversized_peer_record", status)
    assert obs.closed_after_s is not None and obs.closed_after_s < 1.0, f"the daemon took {obs.closed_after_s}s to refuse the record"
    st = d.status()
    assert d.running and st["connected"] == 0 and len(st["peers"]) == 1  # the attacker, dead
    assert "90000 addresses" in st["peers"][0]["reason"]


@pytest.mark.full_view("peer exchange")
def test_records_naming_a_third_party_cause_no_flood_of_dials(cluster, tmp_path):
    """300 throwaway identities, each at 8 refused ports on 127.0.0.1: the daemon holds at most 8 dials
    at once and backs off per host, so over 6 s it makes dozens of attempts, not thousands."""
    swarm = unique_swarm()
    cfg = swarm_config(swarm=swarm, mdns=False, log_level="debug", membership={"reconnect_max": 3.0})
    d = cluster.start("victim", config=write_config(tmp_path / "c.toml", cfg))
    status = d.wait_ready()
    ports = closed_ports(64)
    records = [signed_peer_record(swarm, [f"127.0.0.1:{ports[(i * 8 + j) % 64]}" for j in range(8)])
               for i in range(300)]

    async def attack() -> None:
        async with attacker_session(status) as s, trio.open_nursery() as nursery:
            async def pong() -> None:
                async for env in s.incoming:
                    if isinstance(env.message, Ping):
                        await s.reply(env, Pong(echo=env.message.sent))
            nursery.start_soon(pong)
            for i in range(0, len(records), 100):
                await s.send_message(PeerExchange(peers=records[i:i + 100]))
            await trio.to_thread.run_sync(lambda: wait_for(lambda: len(d.status()["peers"]) > 300, timeout=10,
                                                           what="the daemon to learn the records"))
            start = await trio.to_thread.run_sync(dial_failures, d)
            await trio.sleep(6.0)  # the window we count dials in (no state to wait for: we measure a rate)
            n = await trio.to_thread.run_sync(dial_failures, d) - start
            # backoff 0.2 s doubling to 3 s, each expiry lets at most MAX_DIALS_IN_PROGRESS through
            assert n <= 8 * 12, f"{n} dials in 6 s"
            assert not s.closed.is_set()
            nursery.cancel_scope.cancel()
    trio.run(attack)
    assert d.running


@pytest.mark.full_view("peer exchange")
def test_private_addresses_from_peers_are_not_dialed_unless_allowed(cluster, tmp_path):
    swarm = unique_swarm()
    cfg = swarm_config(swarm=swarm, mdns=False).replace(discovery={"private_addresses": False})
    d = cluster.start("victim", config=write_config(tmp_path / "c.toml", cfg))
    status = d.wait_ready()
    private = signed_peer_record(swarm, ["127.0.0.1:9", "10.0.0.1:9", "169.254.1.1:9", "localhost:9"])
    public = signed_peer_record(swarm, ["8.8.8.8:9"])

    async def attack() -> None:
        async with attacker_session(status) as s:
            await s.send_message(PeerExchange(peers=[private, public]))
            await s.request(Ping(sent=1.0), timeout=10)  # handled after the exchange
            st = await trio.to_thread.run_sync(d.status)
            known = {p["peer_id"] for p in st["peers"]}
            assert public.peer_id in known and private.peer_id not in known
    trio.run(attack)


def _membership(advertise: list[str]):
    from peer.membership.service import Membership
    from peer.session.router import Router
    from peer.session.transport import TransportConfig
    cfg = swarm_config(swarm="s", mdns=False).replace(discovery={"advertise": advertise})
    t = TransportConfig(identity=ident.generate_identity(), swarm="s")
    return Membership(config=cfg, transport=t, peer_id="me", router=Router(), listen_port=lambda: 4000)


@pytest.mark.full_view("a Membership made outside trio, which partial views need")
def test_an_observed_address_is_advertised_only_when_peers_at_distinct_ips_agree():
    m = _membership([])
    m.vote_observed("6.6.6.6", reporter_ip="1.1.1.1", reporter="evil1")
    m.vote_observed("6.6.6.6", reporter_ip="1.1.1.1", reporter="evil2")  # same IP: one vote
    m.vote_observed("not an ip", reporter_ip="2.2.2.2", reporter="evil3")
    assert m.observed_hosts == [] and m.own_record().addresses == []
    m.vote_observed("6.6.6.6", reporter_ip="3.3.3.3", reporter="honest")
    assert m.observed_hosts == ["6.6.6.6"]
    configured = _membership(["5.5.5.5"])  # a configured address comes first, whatever peers report
    for ip in ("1.1.1.1", "3.3.3.3"):
        configured.vote_observed("6.6.6.6", reporter_ip=ip, reporter=ip)
    assert configured.own_record().addresses == ["5.5.5.5:4000", "6.6.6.6:4000"]


def test_address_merging_is_linear_and_bounded():
    from peer.membership.service import MAX_ADDRESSES, PeerInfo
    info = PeerInfo("p")
    t0 = time.perf_counter()
    info.add_addresses(("10.0.0.1", i) for i in range(1, 90_001))
    assert time.perf_counter() - t0 < 0.5 and len(info.addresses) == MAX_ADDRESSES
    assert not info.add_addresses([info.addresses[0]])


def test_a_swarm_asking_work_of_keys_refuses_a_free_one_and_takes_a_worked_one(cluster, tmp_path):
    """`[membership] identity_bits` (issue 40): the daemon makes its own key with the work, refuses a fresh
    key without it at the handshake, and takes a key made with it."""
    from peer.home import Home

    bits = 12  # ~4,000 keys drawn: a fraction of a second
    cfg = swarm_config(swarm=unique_swarm(), mdns=False).replace(membership={"identity_bits": bits})
    d = cluster.start("victim", config=write_config(tmp_path / "c.toml", cfg))
    status = d.wait_ready()
    own = Home(d.home).load_or_create_identity()
    assert ident.identity_work(ident.public_key_bytes(own)) >= bits
    free = next(k for k in iter(ident.generate_identity, None) if ident.identity_work(ident.public_key_bytes(k)) < bits)

    async def attack() -> None:
        # the responder checks the initiator's key in the handshake's last message: our side has sent it and
        # holds a session, which the daemon closes at once, saying why in its log
        async with attacker_session(status, identity=free) as s:
            with trio.fail_after(20):
                await s.closed.wait()
        async with attacker_session(status, identity=ident.generate_identity(bits)) as s:
            await s.request(Ping(sent=1.0), timeout=10)
    trio.run(attack)
    wait_for(lambda: f"this swarm asks {bits} ([membership] identity_bits)" in d.log_path.read_text(), timeout=10,
             what="the refusal in the daemon's log")
