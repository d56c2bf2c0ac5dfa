"""Relays and hole punching between real daemons on 127.0.0.1 (issue 18). Two peers that say they are
behind NAT (`[nat] reachability = "private"`) advertise only relayed addresses, so they can reach each
other only through the public relay: the circuit carries their averaging, and hole punching then moves
them to a direct session. A peer with a wrong swarm key gets nowhere, relay included. (The same with
real NAT routers: tests/test_nat_lab.py.)"""

from __future__ import annotations

import pytest

from peer.testing.swarm import swarm_config, unique_swarm, write_config

pytestmark = pytest.mark.slow


def configs(tmp_path, *, punch: bool):
    swarm = unique_swarm("nat")
    trainer = dict(trainer="trainers.consensus", options={"size": 4096, "rounds": 0, "interval": 0.1,
                                                           "track_error": False, "world": 3},
                   topology={"kind": "full"})
    relay = swarm_config(swarm=swarm, mdns=False, **trainer).replace(nat={"reachability": "public"})
    return swarm, relay, trainer


def peer_entry(status: dict, peer_id: str) -> dict:
    return next((p for p in status["peers"] if p["peer_id"] == peer_id), {})


def start(cluster, tmp_path, *, punch: bool):
    swarm, relay_cfg, trainer = configs(tmp_path, punch=punch)
    relay = cluster.start("relay", config=write_config(tmp_path / "r.toml", relay_cfg))
    rs = relay.wait_ready()
    behind = swarm_config(swarm=swarm, mdns=False, join=[rs["listen"]], **trainer).replace(
        nat={"reachability": "private", "hole_punching": punch})
    a = cluster.start("a", config=write_config(tmp_path / "a.toml", behind))
    b = cluster.start("b", config=write_config(tmp_path / "b.toml", behind))
    return relay, a.wait_ready() and a, b.wait_ready() and b


def test_two_peers_behind_nat_average_through_a_relay_that_sees_no_keys(cluster, tmp_path):
    relay, a, b = start(cluster, tmp_path, punch=False)
    ids = {d.name: d.peer_id for d in (relay, a, b)}

    def relayed_and_averaging(st) -> dict | None:
        p = peer_entry(st, ids["b"])
        return st if (p.get("path") == "relayed" and p.get("via") == ids["relay"]
                      and st["gossip"]["by_peer"].get(ids["b"], {}).get("exchanges", 0) >= 3) else None
    st = a.wait_until(relayed_and_averaging, timeout=45, what="a and b to average through the relay")
    assert st["nat"]["reachability"] == "nat" and st["nat"]["relays"][0]["peer_id"] == ids["relay"]
    assert all("/relay/" in addr for addr in st["nat"]["advertised"])  # no direct address in a's record
    rs = relay.status()
    assert rs["nat"]["relay_server"]["circuits"] >= 1 and rs["nat"]["relay_server"]["bytes_relayed"] > 0
    assert rs["nat"]["relay_server"]["reservations"] >= 2
    # the relay forwards sealed bytes it cannot read: it holds no session with a's and b's circuit
    assert peer_entry(rs, ids["a"]).get("path") == "direct"

    # a peer with another swarm key gets nowhere: the relay refuses it at the handshake like anyone would
    key = tmp_path / "other.key"
    key.write_bytes(b"k" * 32)
    wrong = swarm_config(swarm=relay.status()["swarm"], mdns=False, join=[rs["listen"]]).replace(
        security={"swarm_key_file": str(key)})
    c = cluster.start("c", config=write_config(tmp_path / "c.toml", wrong))
    c.wait_ready()
    relay.wait_until(lambda s: s["listener"]["handshake_failures"] >= 1, timeout=20, what="the relay to refuse c")
    assert c.status()["connected"] == 0
    assert all(p["peer_id"] != c.peer_id for d in (relay, a, b) for p in d.status()["peers"])


def test_hole_punching_replaces_the_relayed_session_with_a_direct_one(cluster, tmp_path):
    relay, a, b = start(cluster, tmp_path, punch=True)

    def punched(st) -> dict | None:
        return st if peer_entry(st, b.peer_id).get("path") == "punched" else None
    st = a.wait_until(punched, timeout=45, what="a and b to punch through to a direct session")
    sb = b.wait_until(lambda s: s if peer_entry(s, a.peer_id).get("path") == "punched" else None, timeout=10,
                      what="b to agree")
    assert st["nat"]["punches"]["succeeded"] + sb["nat"]["punches"]["succeeded"] >= 2  # both ends count theirs
    def exchanges(s: dict) -> int:
        return s["gossip"]["by_peer"].get(b.peer_id, {}).get("exchanges", 0)
    before = exchanges(st)
    a.wait_until(lambda s: exchanges(s) >= before + 3, timeout=20,
                 what="averaging to go on over the punched session")
    relay.wait_until(lambda s: s["nat"]["relay_server"]["circuits"] == 0, timeout=20,
                     what="the relayed session to close once the direct one took over")
