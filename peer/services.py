"""What a service of the daemon is, what it may read of its daemon, and the registry that holds them.

The daemon (peer/daemon.py) owns one nursery; beside membership it runs services (NAT, topology, gossip,
pipeline, attached processes, a trainer, metrics). Each is a `Service`: a name, `run` (started in the
daemon's nursery, with `task_status.started()` once it serves) and `status()` (merged into `peer status
--json` under its name). A service may also offer control commands, kept control sessions, training
figures or a graceful shutdown: each such capability is a small protocol below, and the daemon asks the
registry for the services that have it. Services are found by their type (`services.get(GossipEngine)`),
never by attribute name, and receive what they use in their constructors (peer/daemon.py's
`load_services` is where they are wired).

No service writes into another's attributes. What one part needs of the others is a capability it asks the
registry for when it needs it (libp2p's Notifee and ConnManager.Protect are the model): the fields of our
topology record (`HasRecordFields`), the sessions not to close as idle (`KeepsSessions`), how NAT shapes
what membership advertises and dials (`ShapesAddresses`), the link figures and the edges the partial views
use (`MeasuresLinks`, `FollowsViewEdges`). Membership, built before any service, holds the registry too
(as `Providers`) and asks it at run time; tests/test_seams.py fails on a write into another's attributes.

"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import trio

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from peer.config import Config
    from peer.home import Home
    from peer.membership.dialing import DialRelayed
    from peer.membership.service import Membership
    from peer.session.router import Router
    from peer.session.transport import TransportConfig
    from peer.topology.graph import LinkEstimate
    from protocol.schema.pipeline import StageAnnouncement
    from protocol.schema.training import TrainingFigures

Command = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # a control command: its args -> its reply
SessionHandler = Callable[..., Awaitable[None]]  # a control command that keeps its connection (peer/control.py)


class DaemonContext(Protocol):
    """What a service may read of the daemon that hosts it (set before any service is built)."""

    config: Config
    home: Home
    peer_id: str
    identity: Ed25519PrivateKey
    router: Router
    transport: TransportConfig
    membership: Membership
    listen_addr: tuple[str, int]
    services: Services  # filled by load_services in start order: ask it at run time, not in a constructor


@runtime_checkable
class Service(Protocol):
    """One service of the daemon."""

    name: str  # its key in `peer status --json`

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None: ...

    def status(self) -> dict[str, Any]: ...


@runtime_checkable
class HasCommands(Protocol):
    """Offers control-socket commands (`peer status`'s neighbours: `group_stats`, `checkpoint`, ...)."""

    def commands(self) -> dict[str, Command]: ...


@runtime_checkable
class HasSessions(Protocol):
    """Offers control commands that keep their connection (an attached process's session)."""

    def sessions(self) -> dict[str, SessionHandler]: ...


@runtime_checkable
class HasTraining(Protocol):
    """Has training figures for `peer status`'s panel when no trainer is hosted (an attached process's)."""

    def training(self) -> dict[str, Any] | None: ...


@runtime_checkable
class HasShutdown(Protocol):
    """Saves state before the daemon stops (bounded by the daemon's shutdown deadline)."""

    async def shutdown(self) -> None: ...


@dataclass(frozen=True)
class RecordFields:
    """What one service adds to our signed topology record (peer/topology/records.py), and the size of an
    exchange the topology's rewiring plans with."""

    stage: StageAnnouncement | None = None  # the pipeline stage we serve (the pipeline service)
    groups: Sequence[str] = ()  # the averaging groups we share (the gossip engine)
    training: TrainingFigures | None = None  # our training figures, for others' dashboards
    shard_bytes: int | None = None  # what one averaging exchange sends each way (the rewiring's cost model)


@runtime_checkable
class HasRecordFields(Protocol):
    """Contributes to our topology record. The topology service merges the contributions each time it builds
    the record: groups are joined, and of the rest the first service in start order that has one gives it."""

    def record_fields(self) -> RecordFields: ...


@runtime_checkable
class KeepsSessions(Protocol):
    """Needs its sessions with some peers kept (libp2p's ConnManager.Protect): a session one of these keeps is
    never closed as idle, neither by the listener making room nor by the partial views' idle sweep."""

    def keeps_session(self, peer_id: str) -> bool: ...


@runtime_checkable
class ShapesAddresses(Protocol):
    """What NAT traversal tells membership: which of our addresses to advertise, and how to dial through a
    relay (peer/nat/service.py)."""

    def advertise_observed(self) -> bool:
        """Whether the addresses peers observe us at are worth advertising (not when dial-back said they
        are unreachable)."""
        ...

    def verified_hosts(self) -> list[str]:
        """Hosts of ours that peers dialed back (we are public at them)."""
        ...

    def relayed_addresses(self) -> list[str]:
        """Our relayed addresses (the reservations we hold)."""
        ...

    def dial_relayed(self) -> DialRelayed | None:
        """How to dial a peer through one of its relays; None: we cannot."""
        ...


@runtime_checkable
class MeasuresLinks(Protocol):
    """Has figures for our links to peers (the topology service), for the partial views' rewiring rule."""

    def link_estimate(self, peer_id: str) -> LinkEstimate | None: ...


@runtime_checkable
class FollowsViewEdges(Protocol):
    """Told when the partial views make a peer a gossip neighbour (`up`) or no longer one (the topology
    service sets its edges from them). `degree`: the neighbour's degree as its view messages said."""

    def view_edge(self, peer_id: str, up: bool, reason: str, degree: int) -> None: ...


S = TypeVar("S")


class Providers(Protocol):
    """What a part built before the services (membership) holds of the registry: ask it for a capability."""

    def providing(self, capability: type[S]) -> list[S]: ...


class Services:
    """The daemon's services in start order, each registered under its own type."""

    def __init__(self) -> None:
        self._in_order: list[Service] = []
        self._by_type: dict[type, Service] = {}
        # capability -> its providers: asked on hot paths (every dial round, every record), and an isinstance
        # check against a runtime protocol costs tens of microseconds per service
        self._providing: dict[type, tuple[Service, ...]] = {}

    def add(self, service: S) -> S:
        if not isinstance(service, Service):
            raise TypeError(f"{type(service).__name__} is not a Service (name, run, status)")
        if type(service) in self._by_type:
            raise ValueError(f"a {type(service).__name__} is registered already")
        self._in_order.append(service)
        self._by_type[type(service)] = service
        self._providing.clear()
        return service

    def get(self, kind: type[S]) -> S:
        """The service of type `kind` (LookupError naming it if this daemon runs none)."""
        found = self.find(kind)
        if found is None:
            raise LookupError(f"this daemon runs no {kind.__name__}")
        return found

    def find(self, kind: type[S]) -> S | None:
        return self._by_type.get(kind)  # type: ignore[return-value]  # registered under its own type

    def providing(self, capability: type[S]) -> list[S]:
        """The services that have `capability` (one of the Has* protocols), in start order."""
        found = self._providing.get(capability)
        if found is None:
            found = self._providing[capability] = tuple(s for s in self._in_order if isinstance(s, capability))
        return list(found)  # type: ignore[arg-type]  # each passed isinstance(s, capability)

    def __iter__(self) -> Iterator[Service]:
        return iter(self._in_order)

    def __len__(self) -> int:
        return len(self._in_order)
