"""Stream attacks of issue 15 (registered in `peer.testing.attacks.SCENARIOS`): a tensor header nobody
asked for, announcing 4 GiB, and a flood of fat control messages.

Their own module because they attack a session's bounds on what it holds (parked headers, queued messages),
not a service's handler.
"""

from __future__ import annotations

import trio

from peer.session.streams import PARKED_HEADER_SECONDS
from peer.session.transport import SessionClosed
from peer.testing.attacker import attacker_session
from peer.testing.attacks import Observed, answer_pings, my_id, scenario, until_closed
from protocol.limits import GiB
from protocol.schema import TensorHeader
from protocol.schema.gossip import AverageOffer, TensorSpec


@scenario("huge_tensor_header", "drop", "an unsolicited tensor header announcing 4 GiB")
async def huge_tensor_header(status: dict) -> Observed:
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        t0 = trio.current_time()
        await s.send_message(TensorHeader(stream=1, name="w", dtype="float32", shape=[1 << 30], codec="raw",
                                          nbytes=4 * GiB))
        async with trio.open_nursery() as n:
            n.start_soon(answer_pings, s)  # a live peer in every other way: the header alone must get us dropped
            await until_closed(status, s, t0, obs, PARKED_HEADER_SECONDS + 15)
            n.cancel_scope.cancel()
    return obs


@scenario("control_flood", "bounded", "2000 control messages of ~60 KB each (offers naming 50 fat specs)")
async def control_flood(status: dict) -> Observed:
    fat = AverageOffer(group="g", tensors=[TensorSpec("x" * 1000 + str(i), "float32", [1]) for i in range(50)],
                       streams=[], max_weight=0.1, rule="pairwise", codec="raw", step=0)
    sent = 0
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        try:
            with trio.move_on_after(10):
                for _ in range(2000):  # ~120 MB decoded if all were held
                    await s.send_message(fat)
                    sent += 1
        except (SessionClosed, OSError):  # the victim closed the session mid-flood (its right): bounded too
            pass
        obs.facts = {"sent": sent, "closed": s.closed.is_set()}
    obs.ok = True  # the bound is the victim's memory, which the caller measures
    return obs
