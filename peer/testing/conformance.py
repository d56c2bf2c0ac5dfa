"""`check_swarm`: what every `Swarm` handle promises (peertrain/swarm.py), checked by behaviour, in the manner of
`trio.testing.check_two_way_stream`. mypy checks that each handle's signatures fit the protocol
(tests/swarm_conformance.py); this checks that each does what the protocol's docstrings say.

Run it on the two peers of a two-peer swarm at once, each on its own handle: by hosting this module as their
trainer (`[trainer] name = "peer.testing.conformance"`: it runs the check on the daemon's `TrainerSwarm` and
publishes the outcome), or by calling it in threads on handles a test opened (`AttachedSwarm`, `HostRanks`).
The peer whose ID sorts first starts the exchange of the pair's group; the other only serves it, so the values
each ends with are known: 1 and 3 mixed with the weight the exchange reports, their sum kept. A failed
promise raises AssertionError naming it; `check_closable` checks a `ClosableSwarm`'s closing on top.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from peertrain.swarm import AVERAGE_MODES, ClosableSwarm, ExchangeResult, Swarm
from protocol.schema.topology import MAX_GROUP_CHARS

PAIR = "conformance.pair"  # the group both peers share and average
ALONE = "conformance.alone"  # + the peer's place: a group only it shares, so it has nobody to average with
BAD = "conformance.bad"  # a group refused at `share`: never shared after
START_VALUES = (1.0, 3.0)  # the pair's values on the first and second peer (by sorted ID): their sum, 4, is kept
SHAPES = {"w": (3, 4), "b": (5,)}  # two tensors of different shapes: each keeps its own
CHECK_TIMEOUT_S = 60.0  # for the partner to appear and share, and for the one exchange (a loaded 2-core host)
POLL_S = 0.05  # the serving peer looks at its values this often
CHECKPOINT = "conformance.pt"


@dataclass
class Outcome:
    """What one peer's check saw: the test compares the two peers' (the pair's sum, the one weight)."""

    peer_id: str
    partner: str
    initiator: bool
    weight: float  # the exchange's mixing weight (the initiator's report; the server's inferred from its values)
    value: float  # the pair's value here after the exchange


def _refused(what: str, fn: Callable[[], Any]) -> str:
    """Call `fn`, which must raise ValueError (a clear refusal, not a crash of another kind); its message."""
    try:
        fn()
    except ValueError as exc:
        assert str(exc), f"{what}: refused without saying why"
        return str(exc)
    raise AssertionError(f"{what}: accepted, but the contract refuses it")


def _uniform(group: Any, what: str) -> float:
    """The one value every coordinate of `group`'s tensors holds, shapes and dtypes as shared."""
    group.sync()
    with group.lock:
        tensors = {k: torch.as_tensor(v).clone() for k, v in group.tensors.items()}
    assert set(tensors) == set(SHAPES), f"{what}: tensors {sorted(tensors)}, shared {sorted(SHAPES)}"
    for k, t in tensors.items():
        assert tuple(t.shape) == SHAPES[k] and t.dtype == torch.float32, f"{what}: {k} is {t.dtype} {tuple(t.shape)}"
    values = torch.cat([t.flatten() for t in tensors.values()])
    assert torch.isfinite(values).all(), f"{what}: non-finite values {values}"
    assert torch.allclose(values, values[0].expand_as(values), atol=1e-6), f"{what}: values not uniform {values}"
    return float(values[0])


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full(shape, value, dtype=torch.float32) for k, shape in SHAPES.items()}


def _who(swarm: Swarm, timeout: float) -> str:
    """The identity and who-is-around promises; the one partner."""
    assert isinstance(swarm.peer_id, str) and swarm.peer_id, swarm.peer_id
    assert isinstance(swarm.home, Path) and isinstance(swarm.checkpoint_dir, Path)
    assert 0 <= swarm.local_rank < swarm.local_world, (swarm.local_rank, swarm.local_world)
    assert not swarm.should_stop(), "should_stop() before anything stopped"
    t0 = time.monotonic()
    have = swarm.wait_for_peers(1, timeout=timeout)
    assert have >= 1 and time.monotonic() - t0 <= timeout + 5, f"wait_for_peers: {have} peers"
    peers = swarm.peers()
    assert len(peers) == 1 and swarm.peer_id not in peers, f"a swarm of two expected, peers(): {peers}"
    assert set(swarm.neighbours()) <= set(peers), (swarm.neighbours(), peers)
    rank, world = swarm.rank_and_world(2)
    assert world == 2 and 0 <= rank < 2, (rank, world)
    for pid, what in swarm.membership_events():
        assert isinstance(pid, str) and what in ("joined", "left"), (pid, what)
    counts = swarm.exchanges()
    assert all(isinstance(counts.get(k), int) for k in ("initiated", "served", "failed")), counts
    return peers[0]


def _bad_input(swarm: Swarm) -> None:
    """Refused with a ValueError, and nothing shared for it."""
    _refused("share of integer tensors", lambda: swarm.share(BAD, {"x": torch.zeros(3, dtype=torch.int64)}))
    _refused("share with an unknown codec", lambda: swarm.share(BAD, _tensors(0.0), codec="no-such-codec"))
    for name in ("", "g" * (MAX_GROUP_CHARS + 1)):  # peers' records list the groups: names are bounded
        _refused(f"share as {name!r}", lambda: swarm.share(name, _tensors(0.0)))
        assert swarm.average(name) == [], f"a group refused as {name!r} is averaged"
    assert swarm.average(BAD) == [], "a group whose share was refused is averaged"
    assert "no-such-mode" not in AVERAGE_MODES
    _refused("average in an unknown mode", lambda: swarm.average(PAIR, mode="no-such-mode"))


def _alone(swarm: Swarm, place: int) -> None:
    """A group nobody else shares: averaging it returns no exchange and leaves the values as they were."""
    name = f"{ALONE}.{place}"
    group = swarm.share(name, _tensors(7.0))
    assert group.name == name and set(group.tensors) == set(SHAPES), (group.name, list(group.tensors))
    for mode in AVERAGE_MODES:
        assert swarm.average(name, mode=mode) == [], f"average({mode}) of a group no other peer shares"
    assert isinstance(swarm.average_in_background(name), bool)
    time.sleep(0.2)  # a background round, if one started, has nobody to run with either
    assert _uniform(group, "a lone group after averaging") == 7.0
    swarm.unshare(name)
    assert swarm.average(name) == [], "an unshared group is averaged"
    assert swarm.average_in_background(name) is False, "a background round of an unshared group started"


def _exchange(swarm: Swarm, partner: str, initiator: bool, timeout: float) -> Outcome:
    """The pair's one exchange: the initiator's result, both sides' values moved toward each other."""
    start = START_VALUES[0 if initiator else 1]
    group = swarm.share(PAIR, _tensors(start))
    deadline = time.monotonic() + timeout
    assert swarm.wait_for_peers(1, group=PAIR, timeout=timeout) >= 1, "the partner never shared the pair's group"
    if initiator:
        result: ExchangeResult | None = None
        while result is None and time.monotonic() < deadline:
            t0 = time.monotonic()
            results = swarm.average(PAIR)
            assert time.monotonic() - t0 <= timeout, "average outlived its deadline"
            assert all(isinstance(r, ExchangeResult) for r in results), results
            result = next((r for r in results if r.ok), None)
            if result is None:
                time.sleep(POLL_S * 4)  # no neighbour yet, or the partner busy
        assert result is not None, f"no exchange with {partner} within {timeout:.0f}s"
        assert result.peer_id == partner and result.reason == "" and result.code is None, result
        assert 0 < result.weight <= 0.5 and result.seconds >= 0 and result.bytes_sent > 0, result
        value = _uniform(group, "the initiator's values after the exchange")
        want = start + result.weight * (START_VALUES[1] - start)
        assert abs(value - want) < 1e-5, f"values {value} after an exchange of weight {result.weight}: want {want}"
        assert swarm.exchanges()["initiated"] >= 1, swarm.exchanges()
        weight = result.weight
    else:
        value = start
        while value == start and time.monotonic() < deadline:
            time.sleep(POLL_S)
            value = _uniform(group, "the server's values")
        assert value != start, f"{partner} never exchanged with us within {timeout:.0f}s"
        assert START_VALUES[0] < value < start, f"served values {value}: not moved toward {START_VALUES[0]}"
        assert swarm.exchanges()["served"] >= 1, swarm.exchanges()
        weight = (start - value) / (start - START_VALUES[0])
    return Outcome(swarm.peer_id, partner, initiator, weight, value)


def _reporting(swarm: Swarm) -> None:
    swarm.publish({"conformance_step": 1, "loss": 0.5, "note": "conformance"})
    swarm.log("conformance: %s", "publish and log accepted")
    x = torch.arange(4.0)
    path = swarm.save_checkpoint({"x": x, "step": 3}, CHECKPOINT)
    assert path.exists() and path.parent == swarm.checkpoint_dir, path
    got = swarm.load_checkpoint(CHECKPOINT)
    assert got is not None and torch.equal(got["x"], x) and got["step"] == 3, got
    assert swarm.load_checkpoint("conformance-never-saved.pt") is None


def check_swarm(swarm: Swarm, *, timeout: float = CHECK_TIMEOUT_S) -> Outcome:
    """Check `swarm` keeps the `Swarm` promises; run at once on both peers of a two-peer swarm (module doc)."""
    assert isinstance(swarm, Swarm), f"{type(swarm).__name__} does not implement Swarm"
    partner = _who(swarm, timeout)
    initiator = swarm.peer_id < partner
    _bad_input(swarm)
    _alone(swarm, 0 if initiator else 1)
    outcome = _exchange(swarm, partner, initiator, timeout)
    _reporting(swarm)
    assert not swarm.should_stop()
    return outcome


def check_pair(a: Outcome, b: Outcome) -> None:
    """The two peers' outcomes agree: one initiator, one weight, and the pair's sum kept (the exchange is
    symmetric: what one side gained the other lost)."""
    assert {a.peer_id, b.peer_id} == {a.partner, b.partner} and a.initiator != b.initiator, (a, b)
    assert abs(a.weight - b.weight) < 1e-5, (a, b)
    assert abs((a.value + b.value) - sum(START_VALUES)) < 1e-5, f"the pair's sum moved: {a.value} + {b.value}"


def check_closable(swarm: ClosableSwarm) -> None:
    """Closing detaches: the context manager is the handle, `close` is idempotent, and the handle then says
    it should stop rather than hang."""
    assert isinstance(swarm, ClosableSwarm), f"{type(swarm).__name__} does not implement ClosableSwarm"
    with swarm as entered:
        assert entered is swarm
    swarm.close()  # a second close: nothing to do, no error
    assert swarm.should_stop(), "should_stop() is False on a closed handle"


def run(swarm: Any, options: dict) -> dict:
    """Hosted as a trainer: check the daemon's handle, publish the outcome (`conformance`: passed or the failed
    promise) and return it."""
    try:
        outcome: dict[str, Any] = {"conformance": "passed", **asdict(check_swarm(swarm))}
    except AssertionError as exc:
        outcome = {"conformance": f"failed: {exc}"}
    swarm.publish(outcome)
    return outcome
