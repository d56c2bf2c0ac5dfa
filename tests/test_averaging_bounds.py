"""Bounded damage and bans in the averaging engine: the symmetric clip rule, the hold, the ban list, and two
engines in one process (tests/test_gossip_engine.py's pair) where one side's values are poisoned."""

from __future__ import annotations

import math

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from peer.averaging import bans as bans_mod
from peer.averaging.bans import BanList
from peer.averaging.bounds import HOLD_BASE_S, hold_seconds, update_scale
from peer.averaging.shared import SharedTensors
from protocol.schema.gossip import ParamsRequest
from protocol.schema.session import ErrorReply
from tests.test_gossip_engine import exchange_and_wait, run_pair, total

finite = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False)
anything = st.floats(allow_nan=True, allow_infinity=True)


@given(anything, anything, anything, st.floats(min_value=1.0, max_value=1e6))
def test_the_scale_is_the_same_on_both_sides_and_within_0_1(diff_sq, a_sq, b_sq, ratio):
    s = update_scale(diff_sq, a_sq, b_sq, ratio)
    assert s == update_scale(diff_sq, b_sq, a_sq, ratio)  # each side passes its own norm first
    assert 0.0 <= s <= 1.0


@given(finite, finite, finite, st.floats(min_value=1.0, max_value=1e6))
def test_the_clipped_difference_is_within_the_bound(diff_sq, a_sq, b_sq, ratio):
    s = update_scale(diff_sq, a_sq, b_sq, ratio)
    assert s * math.sqrt(diff_sq) <= ratio * math.sqrt(min(a_sq, b_sq)) * (1 + 1e-12) + 1e-300
    if math.sqrt(diff_sq) <= ratio * math.sqrt(min(a_sq, b_sq)):
        assert s == 1.0


def test_an_overflowing_norm_applies_nothing():
    assert update_scale(math.inf, 1.0, 1.0, 8.0) == 0.0
    assert update_scale(1.0, math.nan, 1.0, 8.0) == 0.0


def test_the_hold_grows_with_the_bytes_and_is_capped_by_the_exchange_timeout():
    assert hold_seconds(0, 30.0) == HOLD_BASE_S
    assert hold_seconds(1 << 20, 30.0) > hold_seconds(1 << 10, 30.0)
    assert hold_seconds(1 << 40, 30.0) == 30.0


def _pair(a_values: np.ndarray, b_values: np.ndarray):
    return SharedTensors("g", {"w": a_values.copy()}), SharedTensors("g", {"w": b_values.copy()})


def _exchange(ga: SharedTensors, gb: SharedTensors, w: float, ratio: float) -> tuple[float, float]:
    a, b = ga.snapshot(), gb.snapshot()
    a, b = [x.copy() for x in a], [x.copy() for x in b]
    return ga.apply(w, b, a, max_ratio=ratio), gb.apply(w, a, b, max_ratio=ratio)


@pytest.mark.parametrize("poison", [lambda x: -1000.0 * x, lambda x: np.full_like(x, 3e38), lambda x: x * 0.0])
def test_both_sides_clip_alike_so_the_sum_is_kept_and_the_honest_side_stays_bounded(poison):
    honest = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    ga, gb = _pair(honest, poison(honest))
    before = ga.tensors["w"].astype(np.float64).sum() + gb.tensors["w"].astype(np.float64).sum()
    sa, sb = _exchange(ga, gb, 1 / 3, 8.0)
    assert sa == sb < 1.0
    after = ga.tensors["w"].astype(np.float64).sum() + gb.tensors["w"].astype(np.float64).sum()
    assert np.all(np.isfinite(ga.tensors["w"]))
    # the honest side moved by at most w * ratio * the smaller norm
    moved = np.linalg.norm((ga.tensors["w"] - honest).astype(np.float64))
    assert moved <= (1 / 3) * 8.0 * np.linalg.norm(honest.astype(np.float64)) * 1.0001
    if np.all(np.isfinite(gb.tensors["w"])) and abs(before) < 1e30:
        assert after == pytest.approx(before, abs=1e-3 * max(1.0, float(np.abs(honest).sum())))


def test_honest_models_are_never_clipped():
    rng = np.random.default_rng(2)
    ga, gb = _pair(rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32))
    assert _exchange(ga, gb, 1 / 3, 8.0) == (1.0, 1.0)  # independent starts: about 1.4 times the norm apart


def test_three_strikes_ban_for_a_growing_interval_that_expires():
    b = BanList()
    assert not b.strike("p", "lapsed", 0.0) and not b.strike("p", "lapsed", 1.0)
    assert b.strike("p", "lapsed", 2.0)
    assert "lapsed" in b.banned("p", 3.0) and b.banned("q", 3.0) is None
    first = bans_mod.FIRST_BAN_S
    assert b.banned("p", 2.0 + first) is None  # expired
    for t in (first + 3, first + 4, first + 5):
        banned = b.strike("p", "lapsed", t)
    assert banned and b.banned("p", first + 5 + 2 * first - 1) is not None  # the second ban lasts twice as long
    assert [p for p, _, _ in b.active(first + 6)] == ["p"]


def test_strikes_outside_the_window_are_forgotten():
    b = BanList()
    w = bans_mod.STRIKE_WINDOW_S
    assert not any(b.strike("p", "x", t) for t in (0.0, 1.0, w + 2.0, w + 3.0))


def test_the_ban_list_keeps_a_bounded_number_of_peers(monkeypatch):
    monkeypatch.setattr(bans_mod, "MAX_TRACKED", 5)
    b = BanList()
    for i in range(50):
        b.strike(f"p{i}", "x", 0.0)
    assert len(b._peers) == 5


# ---- two engines in one process over a real session ----------------------------------------------

@pytest.mark.process
def test_an_engine_pair_clips_a_poisoned_neighbour_alike_on_both_sides_and_keeps_the_sum():
    async def body(a, b):
        b.groups["params"].tensors["w"][:] = -1000.0  # a's values are 1.0: 1001 times a's norm apart
        before = total(a) + total(b)
        result = await exchange_and_wait(a, b)
        assert result.ok
        assert total(a) + total(b) == pytest.approx(before, rel=1e-5)
        assert a.stats.clipped == {b.me: 1} and b.stats.clipped == {a.me: 1}
        w = a.groups["params"].tensors["w"]
        assert np.all(np.abs(w - 1.0) <= result.weight * 8.0 * 1.0001)  # moved at most w * ratio * |a|
    trio.run(run_pair, body)


@pytest.mark.process
def test_an_engine_pair_applies_nothing_of_values_whose_norm_overflows():
    async def body(a, b):
        b.groups["params"].tensors["w"][:] = 3e38
        result = await exchange_and_wait(a, b)
        assert result.ok
        np.testing.assert_array_equal(a.groups["params"].tensors["w"], 1.0)
        np.testing.assert_array_equal(b.groups["params"].tensors["w"], np.float32(3e38))
    trio.run(run_pair, body)


@pytest.mark.process
def test_a_peer_whose_updates_keep_being_clipped_is_banned_and_refused():
    async def body(a, b):
        for _ in range(bans_mod.BAN_AFTER):
            b.groups["params"].tensors["w"][:] = -1000.0 * a.groups["params"].tensors["w"]
            assert (await exchange_and_wait(a, b)).ok
        assert [x["peer"] for x in a.status()["bans"]] == [b.me]
        result = await a.exchange(b.me, "params")  # we no longer initiate with it
        assert not result.ok and "banned" in result.reason
        result = await b.exchange(a.me, "params")  # and refuse its offers, saying why
        assert not result.ok and "banned" in result.reason
    trio.run(run_pair, body)


@pytest.mark.process
def test_parameters_are_served_to_neighbours_only_and_a_download_is_checked():
    async def body(a, b):
        got = await a.downloads.fetch_params("params", b.me)
        assert got is not None and float(got[0][0][0]) == 3.0
        b.groups["params"].tensors["w"][:] = 1e30  # past max_update_ratio of a's model
        assert await a.downloads.fetch_params("params", b.me) is None
        assert a.stats.clipped == {b.me: 1}
        b.topology.neighbours.clear()  # a is no longer b's neighbour
        session = a.membership.connected()[b.me]
        reply = await session.request(ParamsRequest(group="params"), timeout=5)
        assert isinstance(reply.message, ErrorReply) and reply.message.code == "not_neighbour"
        assert b.stats.params_refused == 1
    trio.run(run_pair, body)


def test_a_joining_download_asks_past_busy_partners_without_using_up_its_tries(monkeypatch):
    """A TRY_LATER refusal (busy) is no answer about the partner: it uses up none of DOWNLOAD_TRIES; any
    other refusal or failure does."""
    from peer.averaging import download
    from peer.averaging.budget import ServingSlots
    from peer.averaging.ledger import Ledger
    from protocol.refusal import Code, Refusal

    peers = [f"p{i}" for i in range(6)]
    monkeypatch.setattr(download.random, "shuffle", lambda xs: None)  # asked in this order

    def downloads(answers: dict) -> tuple[download.Downloads, list]:
        asked: list = []
        d = download.Downloads(None, groups={"g": object()}, slots=ServingSlots(1), ledger=Ledger(),
                               may_download=lambda p, g: None, holders=lambda g: list(peers), connected=dict)

        async def fetch_params(group, pid):
            asked.append(pid)
            return answers.get(pid)

        d.fetch_params = fetch_params
        return d, asked

    busy = Refusal(Code.BUSY, "serving as many transfers as it may; ask again later")
    d, asked = downloads({**{p: busy for p in peers[:5]}, "p5": (["values"], 3)})
    assert trio.run(d.fetch_from_partners, "g") == (["values"], 3)
    assert asked == peers  # five busy partners, then one that answers
    d, asked = downloads({p: Refusal(Code.NOT_NEIGHBOUR, "no") for p in peers})
    assert trio.run(d.fetch_from_partners, "g") is None
    assert len(asked) == download.DOWNLOAD_TRIES


def test_peer_status_shows_bans_and_per_peer_counts():
    import time

    from rich.console import Console

    from peer.cli.status_view import render_status

    st = {"peer_id": "a" * 52, "swarm": "s", "protocol_version": 1, "version": "0", "listen": "127.0.0.1:1",
          "mdns": False, "ciphers": ["x"], "uptime_s": 1.0, "pid": 1, "home": "/h", "connected": 0, "peers": [],
          "bans": [{"peer": "b" * 52, "until": time.time() + 120, "reason": "let an exchange we had accepted lapse"}],
          "gossip": {"clipped": {"c" * 52: 2}, "lapsed": {"b" * 52: 3}}}
    console = Console(record=True, width=160)
    console.print(render_status(st))
    out = console.export_text()
    assert "banned from averaging" in out and "bbbbbbbb" in out and "lapse" in out
    assert "cccccccc 2" in out and "bbbbbbbb 3" in out
