"""`[membership] views = "auto"` without processes: the switching decision (`AutoSwitch`), the config, and an
`AutoView` in a membership with no sockets that switches at run time, by size or by a peer's view message;
and a full-view daemon that ignores a view message instead of closing the session."""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from peer.config import ConfigError, from_mapping
from peer.membership.auto_switch import AUTO_SWITCH_PEERS, AutoSwitch
from peer.membership.auto_view import AutoView
from peer.membership.peers import PeerInfo
from peer.membership.service import Membership
from peer.membership.view_driver import ViewDriver
from peer.membership.view_mode import FullView
from peer.session.router import Router
from peer.session.transport import TransportConfig
from peer.testing.swarm import swarm_config
from protocol import identity as ident
from protocol.schema.views import Entry, Join


# ---- the decision ------------------------------------------------------------------------------------
def test_switches_once_when_the_swarm_reaches_the_threshold() -> None:
    s = AutoSwitch(threshold=5)
    assert not s.size(4, now=1.0) and not s.partial
    assert "full, 4 of 5 peers known; switches at 5" in s.describe(4)
    assert s.size(5, now=2.0) and s.partial and s.switched_at == 2.0
    assert not s.size(50, now=3.0) and not s.view_message("x" * 20, now=3.0)  # once: never again
    assert not s.size(1, now=4.0) and s.partial  # one-way: a swarm that shrinks stays partial
    assert s.describe(1).startswith("auto (partial since") and "5 peers known" in s.describe(1)


def test_a_peers_view_message_switches_a_small_swarm() -> None:
    s = AutoSwitch(threshold=AUTO_SWITCH_PEERS)
    assert s.view_message("abcdefgh" * 4, now=1.0) and s.partial
    assert "partial-view message from abcdefgh" in s.describe(2)


def test_never_switches_where_partial_views_cannot_run() -> None:
    s = AutoSwitch(threshold=2, possible=False)
    assert not s.size(100, now=1.0) and not s.view_message("p", now=1.0) and not s.partial
    assert "never switches" in s.describe(100)


# ---- the config --------------------------------------------------------------------------------------
def test_auto_is_the_default_and_bad_names_are_refused_with_the_allowed_ones() -> None:
    cfg = from_mapping({})
    assert cfg.membership.views == "auto" and cfg.membership.auto_peers == AUTO_SWITCH_PEERS
    with pytest.raises(ConfigError, match="'auto', 'full', 'partial'"):
        from_mapping({"membership": {"views": "half"}})
    # a fixed graph: partial views refused, auto accepted (it keeps the full view)
    with pytest.raises(ConfigError, match="kind"):
        from_mapping({"membership": {"views": "partial"}, "topology": {"kind": "ring"}})
    from_mapping({"membership": {"views": "auto"}, "topology": {"kind": "ring"}})
    with pytest.raises(ConfigError, match="auto_peers"):
        from_mapping({"membership": {"auto_peers": 1}})


# ---- in a membership with no sockets -----------------------------------------------------------------
def _membership(**membership) -> Membership:
    cfg = swarm_config(swarm="s", mdns=False, membership=membership)
    return Membership(config=cfg, transport=TransportConfig(identity=ident.generate_identity(), swarm="s"),
                      peer_id="me" * 10, router=Router(), listen_port=lambda: 4000)


def _connected(m: Membership, n: int) -> None:
    """n peers the full view has sessions with, as far as the size count sees (no session object)."""
    for i in range(n):
        m.peers[f"p{i:02d}" * 5] = PeerInfo(peer_id=f"p{i:02d}" * 5, state="connected")


class FakeSession:
    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.short = peer_id[:8]
        self.closed_with: str | None = None

    async def aclose(self, reason: str = "") -> None:
        self.closed_with = reason


def test_auto_view_switches_at_run_time_when_the_swarm_grows() -> None:
    async def main() -> None:
        m = _membership(views="auto", auto_peers=4)
        v = m.views
        assert isinstance(v, AutoView) and not v.chooses_edges and v.wants_dial("anyone")
        assert v.status_fields()["view_mode"].startswith("auto (full, 1 of 4")
        async with trio.open_nursery() as n:
            n.start_soon(v.run)
            await trio.sleep(5)
            assert v.partial is None  # alone: stays full
            _connected(m, 3)
            await trio.sleep(2)
            assert isinstance(v.partial, ViewDriver) and v.chooses_edges and v.mode is v.partial
            st = v.status_fields()
            assert st["view_mode"].startswith("auto (partial since") and "views" in st
            assert not v.wants_dial("p00" * 5)  # partial views dial only what a message waits for
            n.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@asynccontextmanager
async def _running_auto_view():
    """An auto view's membership, its view mode running, and a session to send from."""
    m = _membership(views="auto")
    assert isinstance(m.views, AutoView)
    async with trio.open_nursery() as n:
        n.start_soon(m.views.run)
        yield m, m.views, FakeSession("q" * 20)
        n.cancel_scope.cancel()


def test_a_view_message_switches_an_auto_view_and_is_answered_not_refused() -> None:
    async def main() -> None:
        async with _running_auto_view() as (m, v, sender):
            await trio.sleep(1)
            env = SimpleNamespace(message=Join(Entry(sender.peer_id, ("127.0.0.1:4001",))), size=80)
            await m.router.dispatch(sender, env)
            assert sender.closed_with is None
            assert v.partial is not None and v.chooses_edges
            assert v.partial.received_messages == 1  # handed to the driver made at the switch
            assert "partial-view message from qqqqqqqq" in v.status_fields()["view_mode"]
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_view_message_its_sender_may_not_send_switches_nothing() -> None:
    """A Join naming another peer (view_messages.check refuses it) and a gap round leave an auto view full."""
    async def main() -> None:
        from protocol.schema.views import GapRound
        async with _running_auto_view() as (m, v, sender):
            await m.router.dispatch(sender, SimpleNamespace(message=Join(Entry("r" * 20, ())), size=80))
            gap = GapRound(epoch=1, round=0, values=(0.5,), degree=2, slope=None)
            await m.router.dispatch(sender, SimpleNamespace(message=gap, size=80))
            await trio.sleep(2)
            assert v.partial is None and sender.closed_with is None and not v.chooses_edges
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("views", ["full", "auto-fixed"])
def test_a_full_view_ignores_a_view_message_and_keeps_the_session(views: str) -> None:
    """A `views = "full"` daemon (and an auto one that cannot switch, its [topology] kind fixed) in a mixed
    swarm: a partial-view peer's message is logged and dropped, never a reason to close the session."""
    async def main() -> None:
        if views == "full":
            m = _membership(views="full")
            assert isinstance(m.views, FullView)
        else:
            cfg = swarm_config(swarm="s", mdns=False, membership={"views": "auto"}, topology={"kind": "ring"})
            m = Membership(config=cfg, transport=TransportConfig(identity=ident.generate_identity(), swarm="s"),
                           peer_id="me" * 10, router=Router(), listen_port=lambda: 4000)
        sender = FakeSession("q" * 20)
        env = SimpleNamespace(message=Join(Entry(sender.peer_id, ("127.0.0.1:4001",))), size=80)
        await m.router.dispatch(sender, env)
        assert sender.closed_with is None and not m.views.chooses_edges
    trio.run(main)
