"""The attacks of issue 15 as library code: one scenario per attack class, shared by the attack tests
(tests/test_attack_*.py) and `peer bench hostile`.

Each scenario takes the victim's `peer status --json` and runs its attack through `attacker_session` as a
fresh identity over the real protocol; it returns what it observed (`Observed`): whether and when the
victim closed the attacker's session and why, what it refused, and the facts a test asserts on. Scenarios
never assert: a test judges the facts, the bench judges `Observed.ok` plus its own bounds (memory, the
honest peer). The victim's status is polled through its control socket (`status["home"]`), so a scenario
needs nothing but the status and runs as well in a separate attacker process:

    python -m peer.testing.attacks SCENARIO --status-json '{"listen": ..., ...}'

prints the `Observed` as one JSON object. This module is the harness (the victim, the registry, the
helpers every class uses, the attacker process); the classes are in modules of their own, by the plane
they attack (`attacks_streams`, `attacks_topology`, `attacks_averaging`, `attacks_liveness`,
`attacks_nat`), imported at the end of this one. Adding a class is one `@scenario(...)` function there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import msgpack
import trio

from peer.averaging.bounds import COMMIT_SLACK_S, hold_seconds
from peer.config import Config
from peer.control import call
from peer.testing.swarm import swarm_config
from protocol import identity as ident
from protocol.frames import KIND_MESSAGE
from protocol.schema import EdgeAccept, EdgeCommit, EdgePropose, Ping, Pong
from protocol.schema.gossip import TensorSpec

# ---- the victim the averaging classes need -----------------------------------------------------------

SIZE = 4096  # float32s of the victim's consensus vector: 16 KiB a side, so an exchange is quick
SPECS = [TensorSpec(name="x", dtype="float32", shape=[SIZE])]
EXCHANGE_TIMEOUT = 3.0  # the victim's hold: min(this, hold_seconds(16 KiB)) + COMMIT_SLACK_S
LOAD_MARGIN_S = 5.0  # a loaded 2-core machine's scheduling delay on top of the victim's own deadline
CLOSE_WAIT_S = 10.0  # a session the victim closes at decode time is closed well within this
HOLD_S = hold_seconds(SIZE * 4, EXCHANGE_TIMEOUT) + COMMIT_SLACK_S  # how long the victim holds an accepted offer


def averaging_configs(swarm: str, victim_listen: str | None = None, *, membership: dict | None = None) -> Config:
    """The victim's config (consensus vector served, never initiating) or, with `victim_listen`, the honest
    peer's (joins the victim and averages with it every 50 ms)."""
    options = {"size": SIZE, "rounds": 0, "world": 2, "track_error": False}
    options.update({"initiate": False} if victim_listen is None else {"interval": 0.05})
    cfg = swarm_config(swarm=swarm, mdns=False, trainer="trainers.consensus", options=options,
                       gossip={"exchange_timeout": EXCHANGE_TIMEOUT}, membership=membership,
                       join=[victim_listen] if victim_listen else None)
    # the victim relays (as a public daemon would), so the relay's caps are attacked too
    return cfg.replace(nat={"reachability": "public"}) if victim_listen is None else cfg


# ---- what a scenario saw -------------------------------------------------------------------------------

@dataclass
class Observed:
    """What one attack observed. `ok`: the victim did what the class requires (closed, refused, banned)."""

    attacker: str = ""  # the attacker's peer id (the last one, where a scenario uses several)
    ok: bool = False
    closed_after_s: float | None = None  # from the offending message to the victim closing our session
    banned_after_s: float | None = None  # from the first offending message to the victim banning us
    reason: str = ""  # the victim's reason (its status entry for us, or its reply)
    facts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    """One attack class. `outcome`: what the victim must do — "drop" the session (within the bound the
    bench checks), "refuse" the request and keep the session, "ban" the peer, or stay "bounded" in memory."""

    name: str
    outcome: str
    doc: str
    run: Callable[[dict], Awaitable[Observed]]
    averaging: bool = False  # needs the victim of `averaging_configs` (a consensus vector, a neighbour to be)


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, outcome: str, doc: str, *, averaging: bool = False):
    """Register the decorated `async def f(status) -> Observed` as attack class `name`."""
    def register(fn: Callable[[dict], Awaitable[Observed]]):
        SCENARIOS[name] = Scenario(name, outcome, doc, fn, averaging)
        return fn
    return register


# ---- helpers -------------------------------------------------------------------------------------------

def my_id(session) -> str:
    return ident.peer_id_of(session.cfg.identity)


async def victim_status(status: dict) -> dict:
    """The victim's status now, through its control socket."""
    return await trio.to_thread.run_sync(lambda: call(Path(status["home"]), "status"))


async def dropped(status: dict, peer: str, wait: float = 5.0) -> tuple[float | None, str]:
    """Seconds until the victim lists `peer` as no longer connected, with its reason; (None, '') if not
    within `wait` (by default long enough for a session it has just closed to show in its status)."""
    t0 = trio.current_time()
    with trio.move_on_after(wait):
        while True:
            for p in (await victim_status(status))["peers"]:
                if p["peer_id"] == peer and p["state"] != "connected" and p["reason"]:
                    return trio.current_time() - t0, p["reason"]
            await trio.sleep(0.1)
    return None, ""


async def send_raw(session, type_name: str, body: dict) -> None:
    """One message as raw msgpack (NaN included), sealed by the session like any other frame."""
    await session._send_frame(KIND_MESSAGE, 0, msgpack.packb({"t": type_name, "v": 1, "r": 0, "q": 0, "b": body},
                                                             use_bin_type=True))


async def answer_pings(session, got: list | None = None) -> None:
    """What a live peer must do for the victim to keep the session: answer heartbeats; keep the rest in `got`."""
    async for env in session.incoming:
        if isinstance(env.message, Ping):
            await session.reply(env, Pong(echo=env.message.sent))
        elif got is not None:
            got.append(env.message)


async def until_closed(status: dict, session, t0: float, obs: Observed, wait: float = CLOSE_WAIT_S) -> Observed:
    """Wait (at most `wait` s) for the victim to close `session`; fill in when and why."""
    with trio.move_on_after(wait):
        await session.closed.wait()
    if session.closed.is_set():
        obs.closed_after_s = trio.current_time() - t0
        obs.reason = (await dropped(status, obs.attacker))[1]
        obs.ok = True
    else:
        obs.reason = f"session still open after {wait:.0f} s"
    return obs


async def become_neighbour(session, status: dict) -> bool:
    """Become the victim's neighbour through the real edge handshake; False if it refuses, or does not list
    us as one within 20 s."""
    reply = await session.request(EdgePropose(degree=0), timeout=10)
    if not isinstance(reply.message, EdgeAccept):
        return False
    await session.send_message(EdgeCommit(proposal=reply.reply_to))
    with trio.move_on_after(20):
        while not any(n["peer_id"] == my_id(session) for n in (await victim_status(status))["topology"]["neighbours"]):
            await trio.sleep(0.2)
        return True
    return False


# ---- the classes, in modules of their own (importing one registers its scenarios) ------------------------

importlib.import_module("peer.testing.attacks_streams")
importlib.import_module("peer.testing.attacks_topology")
importlib.import_module("peer.testing.attacks_averaging")
importlib.import_module("peer.testing.attacks_liveness")
importlib.import_module("peer.testing.attacks_nat")


# ---- the attacker process --------------------------------------------------------------------------------

def run_scenario(name: str, status: dict) -> Observed:
    """Run attack class `name` against the victim whose status is `status` (blocking)."""
    return trio.run(SCENARIOS[name].run, status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peer.testing.attacks", description=__doc__.split("\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--status-json", required=True, help="the victim's `peer status --json`")
    args = p.parse_args(argv)
    obs = run_scenario(args.scenario, json.loads(args.status_json))
    print(json.dumps(asdict(obs), default=str))
    return 0


if __name__ == "__main__":
    # Run as a script this file is `__main__`, a second copy of the module; modules of more classes register
    # theirs with `peer.testing.attacks`, so its main (and registry) is the one to use.
    from peer.testing.attacks import main as canonical_main

    sys.exit(canonical_main())
