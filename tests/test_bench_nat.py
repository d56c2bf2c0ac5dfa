"""`peer bench nat`: its arguments, and how its figures are read from daemon statuses (synthetic ones here;
the bench itself needs root and iptables and takes minutes, so it is run by hand: docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from peer.bench import nat
from peer.testing.internet import internet_available
from peer.bench.nat_figures import (ExchangeLog, PairWatch, PeakBytes, connect_summary, direct_fraction,
                                    exchange_figures, first_cross_lan_average, goals, mb_s, pair_how, path_class,
                                    punchable, relay_link_fraction)
from tests.daemons import REPO
from peer.testing.pace import scaled

NAT = {"public": "none", "lan1": "preserving", "lan2": "preserving", "lan3": "random"}


def _args(**kw) -> argparse.Namespace:
    base = {"mbit": 50.0, "mib": 64, "connect_timeout": 60.0, "settle": 20.0, "logs": None, "json": True}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.process
def test_help_lists_the_options() -> None:
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "nat", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr
    for opt in ("--mbit", "--mib", "--connect-timeout", "--logs", "--json"):
        assert opt in proc.stdout


@pytest.mark.parametrize("kw, words", [({"mbit": 0.0}, "--mbit"), ({"mbit": -5.0}, "--mbit"), ({"mib": 0}, "--mib"),
                                       ({"mib": 4096}, "--mib"), ({"connect_timeout": 0.0}, "--connect-timeout")])
def test_bad_arguments_exit_2_before_building_anything(kw, words, capsys) -> None:
    assert nat.run(_args(**kw)) == 2
    assert words in capsys.readouterr().err


def test_without_the_lab_it_exits_2_with_a_reason(monkeypatch, capsys) -> None:
    monkeypatch.setattr(nat, "internet_available", lambda: False)
    assert nat.run(_args()) == 2
    assert "iptables" in capsys.readouterr().err


# ---- statuses -------------------------------------------------------------------------------------------

def _view(pid: str, path: str = "direct", state: str = "connected", first: float = 0.0, by: dict | None = None,
          since: float = 0.0, rtt: float | None = None) -> dict:
    return {"peer_id": pid, "state": state, "path": path if state == "connected" else "", "via": "",
            "first_connected": first, "connected_since": since, "bytes_by_path": by or {}, "rtt_ms": rtt}


def _st(pid: str, started: float, views: list[dict], by_peer: dict | None = None) -> dict:
    return {"peer_id": pid, "started_at": started, "peers": views, "gossip": {"by_peer": by_peer or {}}}


def test_pair_how_prefers_punched_then_relayed_and_needs_both_ends() -> None:
    assert pair_how(_view("b"), _view("a")) == "direct"
    assert pair_how(_view("b", "punched"), _view("a", "direct")) == "punched"
    assert pair_how(_view("b", "relayed"), _view("a", "punched")) == "punched"
    assert pair_how(_view("b", "relayed"), _view("a", "direct")) == "relayed"
    assert pair_how(_view("b"), _view("a", state="dead")) == "failed"
    assert pair_how(_view("b"), None) == "failed"


def test_punchable_pairs_are_public_or_port_preserving_at_both_ends() -> None:
    assert punchable("public", "lan1", NAT) and punchable("lan1", "lan2", NAT)
    assert not punchable("lan1", "lan3", NAT) and not punchable("public", "lan3", NAT)


def test_pair_seconds_are_the_later_first_session_minus_the_later_start() -> None:
    watch = PairWatch(["x", "y", "z"])
    sts = {"x": _st("X", 100.0, [_view("Y", first=103.0), _view("Z", state="dialing")]),
           "y": _st("Y", 101.0, [_view("X", first=102.5), _view("Z", "relayed", first=110.0)]),
           "z": _st("Z", 102.0, [_view("Y", "punched", first=110.4)])}
    assert not watch.update(sts)  # x-z never connected at both ends
    rep = {(p["a"], p["b"]): p for p in watch.report({"x": "X", "y": "Y", "z": "Z"})}
    assert rep[("x", "y")]["how"] == "direct" and rep[("x", "y")]["seconds_to_session"] == pytest.approx(2.0)
    assert rep[("y", "z")]["how"] == "punched" and rep[("y", "z")]["seconds_to_session"] == pytest.approx(8.4)
    assert rep[("x", "z")]["how"] == "failed" and rep[("x", "z")]["seconds_to_session"] is None
    s = connect_summary(list(rep.values()))
    assert s["pairs_connected_fraction"] == 0.667
    assert s["max_seconds_to_session"] == pytest.approx(8.4)
    assert s["pairs_by_how"] == {"direct": 1, "punched": 1, "relayed": 0, "failed": 1}
    # the first sighting sticks: a later poll with another path does not change it
    sts["x"]["peers"][1] = _view("Z", "relayed", first=120.0)
    sts["z"]["peers"].append(_view("X", "relayed", first=120.0))
    assert watch.update(sts)
    assert watch.first[("y", "z")]["how"] == "punched" and watch.first[("x", "z")]["how"] == "relayed"


def test_bytes_fraction_counts_each_pair_once_and_keeps_peaks_of_lost_sessions() -> None:
    names = ["p", "a", "b", "c"]  # public, lan1, lan2, lan3
    site = {"p": "public", "a": "lan1", "b": "lan2", "c": "lan3"}
    peak = PeakBytes()
    first = {"p": _st("P", 0, [_view("A", by={"direct": 100}), _view("C", by={"direct": 50})]),
             "a": _st("A", 0, [_view("P", by={"direct": 100}), _view("B", "relayed", by={"relayed": 40}),
                               _view("C", "relayed", by={"relayed": 30})]),
             "b": _st("B", 0, [_view("A", "relayed", by={"relayed": 40})]), "c": _st("C", 0, [])}
    peak.update(first)
    # the punch replaced the relayed session, and its 40 relayed bytes vanished from the count
    later = {**first, "a": _st("A", 0, [_view("P", by={"direct": 200}), _view("B", "punched", by={"punched": 160}),
                                        _view("C", "relayed", by={"relayed": 90})])}
    peak.update(later)
    pairs = [(x, y) for i, x in enumerate(names) for y in names[i + 1:]]
    possible = [(x, y) for x, y in pairs if punchable(site[x], site[y], NAT)]
    frac, tot = direct_fraction(peak, possible)
    assert tot == {"direct": 100, "punched": 160, "relayed": 40}  # p-a from p's view only (not a's 200 too)
    assert frac == pytest.approx(260 / 300, abs=1e-4)
    frac_all, tot_all = direct_fraction(peak, pairs)
    assert tot_all == {"direct": 100 + 50, "punched": 160, "relayed": 40 + 90}
    assert frac_all == pytest.approx(310 / 440, abs=1e-4)
    assert peak.lost(later) == ["a-b: relayed 40"]


def test_first_cross_lan_average_counts_only_peers_of_other_lans() -> None:
    site = {"p": "public", "a1": "lan1", "a2": "lan1", "b": "lan2"}
    ex = lambda at: {"exchanges": 3, "bytes": 1, "first_at": at, "last_s": 0.1}  # noqa: E731
    sts = {"p": _st("P", 0.0, []),
           "a1": _st("A1", 10.0, [], {"P": ex(10.5), "A2": ex(11.0), "B": ex(19.0)}),
           "a2": _st("A2", 12.0, [], {"A1": ex(13.0)}),
           "b": _st("B", 11.0, [], {"A1": ex(19.0), "P": ex(12.0)})}
    assert first_cross_lan_average(sts, site) == {"a1": 9.0, "a2": None, "b": 8.0}


def test_throughput_and_relay_link_fraction() -> None:
    size = 64 << 20
    assert mb_s(size, 10.0) == pytest.approx(2 * size / 10 / 1e6)
    # at 50 Mbit a relay's link takes in both directions' 64 MiB: 2 x 64 MiB x 8 / 50e6 = 21.47 s at best
    ideal = 2 * size * 8 / 50e6
    assert relay_link_fraction(size, ideal, 50) == pytest.approx(1.0)
    assert relay_link_fraction(size, ideal / 0.8, 50) == pytest.approx(0.8)


def test_exchange_log_times_new_exchanges_and_drops_ones_whose_session_changed() -> None:
    log = ExchangeLog()
    log.start(_st("I", 0, [], {"P": {"exchanges": 1, "last_s": 9.0}}))
    views = [_view("P", since=100.0, rtt=3.0), _view("B", "punched", since=150.0, rtt=80.0)]
    log.update(_st("I", 0, views, {"P": {"exchanges": 1, "last_s": 9.0}}), now_wall=160.0)
    assert log.samples == {}  # nothing new since the start
    log.update(_st("I", 0, views, {"P": {"exchanges": 2, "last_s": 12.0}, "B": {"exchanges": 1, "last_s": 12.0}}),
               now_wall=160.0)
    assert [s["seconds"] for s in log.samples["P"]] == [12.0]
    assert "B" not in log.samples and log.excluded[0]["why"].startswith("its session changed")  # began at 148 < 150
    assert log.max_rtt_ms == {"P": 3.0, "B": 80.0}
    assert not log.done(["P"], 2)
    log.update(_st("I", 0, views, {"P": {"exchanges": 4, "last_s": 11.0}}), now_wall=175.0)
    assert log.done(["P"], 2) and "note" in log.samples["P"][1]


def test_exchange_figures_by_path() -> None:
    size = 64 << 20
    site = {"i": "lan1", "p1": "public", "p2": "public", "n": "lan1", "b": "lan2", "c": "lan3"}
    id_name = {"I": "i", "P1": "p1", "P2": "p2", "N": "n", "B": "b", "C": "c"}
    expected = {"p1": "direct", "p2": "direct", "n": "direct", "b": "punched", "c": "relayed"}
    log = ExchangeLog(samples={
        "P1": [{"seconds": 12.0, "path": "direct"}, {"seconds": 12.4, "path": "direct"}],
        "P2": [{"seconds": 12.2, "path": "direct"}],
        "N": [{"seconds": 11.0, "path": "direct"}],
        "B": [{"seconds": 13.0, "path": "relayed"}, {"seconds": 12.2, "path": "punched"}],
        "C": [{"seconds": 25.0, "path": "relayed"}]})
    final = {"P1": "direct", "P2": "direct", "N": "direct", "B": "punched", "C": "relayed"}
    f = exchange_figures(log, id_name, site, "i", expected, size, 50.0, final)
    assert f["direct_mb_s"] == pytest.approx(mb_s(size, 12.2), abs=1e-3)  # median of 12.0, 12.4, 12.2
    assert f["direct_lan_mb_s"] == pytest.approx(mb_s(size, 11.0), abs=1e-3)
    assert f["punched_mb_s"] == pytest.approx(mb_s(size, 12.2), abs=1e-3)  # the relayed sample is left out
    assert f["punched_to_direct"] == pytest.approx(1.0)
    assert f["relay_link_fraction"] == pytest.approx(relay_link_fraction(size, 25.0, 50.0), abs=1e-3)
    b = next(p for p in f["per_peer"] if p["peer"] == "b")
    assert b["exchanges_timed"] == 1 and len(b["other_path_samples"]) == 1
    # a peer no longer on its path at the end counts for nothing
    f2 = exchange_figures(log, id_name, site, "i", expected, size, 50.0, {**final, "C": "punched"})
    assert f2["relayed_mb_s"] is None and f2["relay_link_fraction"] is None
    assert path_class("direct", "lan1", "public") == "direct_public" and path_class("direct", "lan1", "lan2") is None


def test_goals() -> None:
    good = {"pairs_connected_fraction": 1.0, "max_seconds_to_session": 12.0, "direct_bytes_fraction": 0.95,
            "exchange": {"punched_to_direct": 0.95, "relay_link_fraction": 0.85}}
    assert all(g["met"] for g in goals(good).values())
    bad = {"pairs_connected_fraction": 0.9, "max_seconds_to_session": 70.0, "direct_bytes_fraction": None,
           "exchange": {"punched_to_direct": 0.85, "relay_link_fraction": None}}
    assert not any(g["met"] for g in goals(bad).values())


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not internet_available(), reason="needs root, iproute2 and iptables (NAT in namespaces)")
def test_bench_nat_small_run_reports_every_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "nat", "--mib", "1", "--mbit", "400", "--settle", "0",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=scaled(300))  # ~30 s idle
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    for key in ("pairs", "pairs_connected_fraction", "max_seconds_to_session", "direct_bytes_fraction",
                "seconds_to_first_cross_lan_average", "exchange", "goals"):
        assert key in out, key
    assert out["pairs_connected_fraction"] == 1.0, out["pairs"]
    assert {p["how_at_end"] for p in out["pairs"]} == {"direct", "punched", "relayed"}, out["pairs"]
    assert out["exchange"]["punched_mb_s"] > 0 and out["exchange"]["relayed_mb_s"] > 0
