"""Averaging attacks of issue 15 (registered in `peer.testing.attacks.SCENARIOS`): parameters and
offers asked for by a peer that is no neighbour (and a pipeline stage's state by a peer that serves no
stage of it), a neighbour that lets accepted exchanges lapse, and one that commits poisoned values.

Their own module because they speak the averaging exchange from the attacker's side (`offer`,
`_exchange`) against the victim of `peer.testing.attacks.averaging_configs`.
"""

from __future__ import annotations

import numpy as np
import trio

from peer.averaging.bans import BAN_AFTER
from peer.averaging.shares import SHARE_WINDOW_S
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.testing.attacker import attacker_session
from peer.testing.attacks import (HOLD_S, LOAD_MARGIN_S, SIZE, SPECS, Observed, answer_pings, become_neighbour,
                                  my_id, scenario, victim_status)
from protocol.schema.gossip import (NO_BOUND, AverageAccept, AverageCommit, AverageOffer, AverageReject,
                                    ParamsRequest)
from protocol.schema.pipeline import StageStateRequest
from protocol.refusal import TRY_LATER, Code
from protocol.schema.session import ErrorReply


TRY_LATER_S = SHARE_WINDOW_S + 15.0
"""How long an exchange's offer is asked again while the victim answers it busy: its exchange with the honest
peer in flight (a loaded machine makes those long), or our moves of its model past the honest peer's share,
which drains in SHARE_WINDOW_S (CI's run of the poisoning test failed once, unexplained; this is the suspect)."""


def offer(session, **kw) -> tuple[AverageOffer, OutgoingGroup]:
    """An offer of the victim's group, and the tensor group its values go out on. Announces no clip radius
    of its own (NO_BOUND: the victim's alone bounds the exchange) unless `radius` says otherwise."""
    ours = OutgoingGroup(session, SPECS)
    return AverageOffer(group="vector", tensors=SPECS, streams=ours.streams, max_weight=0.5, rule="metropolis",
                        **{"radius": NO_BOUND, **kw}), ours


def _describe(message) -> str:
    said = " ".join(str(x) for x in (getattr(message, "code", ""), getattr(message, "reason", "")) if x)
    return f"{type(message).__name__}: {said}"


@scenario("params_as_non_neighbour", "refuse", "a parameter download and an offer from a peer that is no neighbour",
          averaging=True)
async def params_as_non_neighbour(status: dict) -> Observed:
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        obs = Observed(attacker=my_id(s))
        reply = await s.request(ParamsRequest(group="vector"), timeout=10)
        rejected = await s.request(offer(s)[0], timeout=10)
        obs.facts = {"params_reply": _describe(reply.message), "offer_reply": _describe(rejected.message),
                     "session_kept": not s.closed.is_set()}
        obs.ok = (isinstance(reply.message, ErrorReply) and reply.message.code == "not_neighbour"
                  and isinstance(rejected.message, AverageReject) and rejected.message.code == "not_neighbour")
        obs.reason = obs.facts["params_reply"]
        n.cancel_scope.cancel()
    return obs


@scenario("stage_state_as_non_member", "refuse",
          "a stage's state (weights, optimizer) asked for by a peer that serves no stage of the pipeline")
async def stage_state_as_non_member(status: dict) -> Observed:
    pl = status.get("pipeline") or {}
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        obs = Observed(attacker=my_id(s))
        req = StageStateRequest(pl.get("pipeline") or "shakespeare", pl.get("my_stage") or 0, pl.get("cuts") or [])
        reply = await s.request(req, timeout=10)
        obs.facts = {"state_reply": _describe(reply.message), "session_kept": not s.closed.is_set()}
        obs.ok = isinstance(reply.message, ErrorReply) and reply.message.code == "not_a_member"
        obs.reason = obs.facts["state_reply"]
        n.cancel_scope.cancel()
    return obs


@scenario("lapsing_neighbour", "ban", f"a neighbour that lets {BAN_AFTER} accepted exchanges lapse", averaging=True)
async def lapsing_neighbour(status: dict) -> Observed:
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        me = my_id(s)
        obs = Observed(attacker=me, facts={"held_s": [], "hold_bound_s": HOLD_S + LOAD_MARGIN_S})
        if not await become_neighbour(s, status):
            obs.reason = "could not become a neighbour"
            n.cancel_scope.cancel()
            return obs
        first = None
        for i in range(BAN_AFTER):
            msg, _ours = offer(s)  # our tensor never follows, and we never commit
            reply = await s.request(msg, timeout=10)
            if not isinstance(reply.message, AverageAccept):
                obs.reason = f"offer {i} not accepted: {_describe(reply.message)}"
                break
            # the victim's snapshot may come (we take it off the wire unread); ours never does
            IncomingGroup(s, reply.message.streams, SPECS).discard()
            t0 = trio.current_time()
            first = t0 if first is None else first
            with trio.move_on_after(HOLD_S + LOAD_MARGIN_S):
                while (await victim_status(status))["gossip"]["lapsed"].get(me, 0) <= i:
                    await trio.sleep(0.2)
            obs.facts["held_s"].append(round(trio.current_time() - t0, 3))
        st = await victim_status(status)
        obs.facts["bans"] = st["bans"]
        mine = [b for b in st["bans"] if b["peer"] == me]
        if mine and first is not None:
            obs.banned_after_s = trio.current_time() - first
            obs.reason = mine[0]["reason"]
        rejected = await s.request(offer(s)[0], timeout=10)
        refused = await s.request(ParamsRequest(group="vector"), timeout=10)
        obs.facts["offer_after_ban"] = _describe(rejected.message)
        obs.facts["params_after_ban"] = _describe(refused.message)
        obs.ok = (bool(mine) and "lapse" in obs.reason and len(obs.facts["held_s"]) == BAN_AFTER
                  and all(t <= HOLD_S + LOAD_MARGIN_S for t in obs.facts["held_s"])
                  and isinstance(rejected.message, AverageReject) and rejected.message.code == "banned"
                  and isinstance(refused.message, ErrorReply) and refused.message.code == "banned")
        n.cancel_scope.cancel()
    return obs


async def _exchange(s, status: dict, values: np.ndarray) -> np.ndarray:
    """One whole exchange as the initiator: send `values`, get the victim's snapshot, commit, and wait until
    the victim has applied it (its clip counted), so the next offer is not refused as in flight."""
    clipped = (await victim_status(status))["gossip"]["clipped"].get(my_id(s), 0)
    with trio.fail_after(TRY_LATER_S):
        while True:
            msg, ours = offer(s)
            got: list = []

            async def ask() -> None:
                got.append(await s.request(msg, timeout=10))
            async with trio.open_nursery() as n:
                n.start_soon(ask)
                n.start_soon(lambda: ours.send([values]))
            reply = got[0]
            if not (isinstance(reply.message, AverageReject) and Code.parse(reply.message.code) in TRY_LATER):
                break
            await trio.sleep(0.5)  # busy with the honest peer's exchange, or past our share of its moves: later
    if not isinstance(reply.message, AverageAccept):
        raise RuntimeError(f"offer not accepted: {_describe(reply.message)}")
    theirs = await IncomingGroup(s, reply.message.streams, SPECS).receive(timeout=10)
    await s.send_message(AverageCommit(exchange=reply.reply_to))
    with trio.fail_after(30):  # a status call or two, on a loaded machine
        while (await victim_status(status))["gossip"]["clipped"].get(my_id(s), 0) <= clipped:
            await trio.sleep(0.2)
    return np.asarray(theirs[0])


@scenario("poisoning_neighbour", "ban", "a neighbour committing 3e38 everywhere, -1000x the victim's model, 3e38 again",
          averaging=True)
async def poisoning_neighbour(status: dict) -> Observed:
    norms: list[float] = []
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        me = my_id(s)
        obs = Observed(attacker=me, facts={"norms": norms})
        if not await become_neighbour(s, status):
            obs.reason = "could not become a neighbour"
            n.cancel_scope.cancel()
            return obs
        # the victim's snapshot each exchange brings shows what the one before did to it
        t0 = trio.current_time()
        huge = np.full(SIZE, 3e38, np.float32)  # its distance overflows: nothing applied, struck
        start = await _exchange(s, status, huge)  # learn its values
        norms.append(float(np.linalg.norm(start)))
        norms.append(float(np.linalg.norm(await _exchange(s, status, -1000.0 * start))))  # clipped, struck
        norms.append(float(np.linalg.norm(await _exchange(s, status, huge))))
        st = await victim_status(status)
        obs.facts.update(clipped=st["gossip"]["clipped"].get(me), bans=st["bans"])
        mine = [b for b in st["bans"] if b["peer"] == me]
        if mine:
            obs.banned_after_s, obs.reason = trio.current_time() - t0, mine[0]["reason"]
        # a clipped update moves the victim by at most w * max_update_ratio (8) * its norm, w <= 1/3 with 2
        # neighbours (metropolis); unclipped, -1000x would have made it 334x
        obs.facts["norm_bound"] = (1 + 8 / 3) * max(norms[:2]) * 1.01
        obs.ok = (bool(mine) and obs.facts["clipped"] == BAN_AFTER and bool(np.all(np.isfinite(norms)))
                  and norms[2] <= obs.facts["norm_bound"])
        n.cancel_scope.cancel()
    return obs
