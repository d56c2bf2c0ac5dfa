"""`peer bench sybil` (issue 40): every figure and goal it names, from one seed (a few seconds, in-process)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from peer.bench import sybil


def test_bench_sybil_reports_every_figure_and_goal(capsys):
    assert sybil.run(SimpleNamespace(seeds=1, json=True)) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["simulated"] is True and set(got["met"]) == set(sybil.GOALS)
    assert got["eclipse_honest_edges_left"] == "4 of 4" and got["ban_flush_lifted"] is False
    assert got["colluding_servers_banned"] is True and got["honest_servers_banned"] == 0
    assert got["radius_ratchet_max_ratio"] >= 1.0
