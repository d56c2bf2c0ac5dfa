"""The daemon's spectral computations, off the event loop: the view's gap (for status) and rewiring plans
(each a few dozen gaps) run in a worker thread, one at a time, so an eigensolve never stalls sessions,
heartbeats or `peer status`. Their cost is bounded by the view's size (`records.MAX_VIEW_RECORDS`) and
the planner's `RewireConfig.max_evaluations`. The view's gap is cached per view structure (nodes and
edges: all a Metropolis gap depends on), so an unchanged view is never solved twice."""

from __future__ import annotations

from typing import Callable, TypeVar

import trio

from peer.topology.graph import Edge, GraphView
from peer.topology.mixing import graph_spectral_gap

T = TypeVar("T")
ViewKey = tuple[frozenset[str], frozenset[Edge]]


def view_key(view: GraphView) -> ViewKey:
    """What the view's gap depends on: two equal keys have the same gap."""
    return view.nodes, view.edges


def _gap(view: GraphView) -> float:
    try:
        return graph_spectral_gap(view)
    except ValueError:  # a view that is no valid mixing graph has no gap to speak of
        return 0.0


class SpectralWorker:
    """One worker thread's worth of spectral work, serialized, plus the last view gap it computed."""

    def __init__(self) -> None:
        self._lock = trio.Lock()  # at most one computation at a time: a status burst cannot pile up threads
        self._key: ViewKey | None = None
        self.gap = 0.0  # the gap of the view with key `_key` (0.0 before the first computation)
        self.computed = 0  # gaps solved so far (cache misses)

    def is_current(self, view: GraphView) -> bool:
        return self._key == view_key(view)

    async def view_gap(self, view: GraphView) -> float:
        """The view's gap: cached if its structure is unchanged, else solved in the worker thread."""
        key = view_key(view)
        async with self._lock:
            if key != self._key:
                self.gap = await trio.to_thread.run_sync(_gap, view)
                self._key = key
                self.computed += 1
            return self.gap

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` (a pure computation on immutable views) in the worker thread, after any other."""
        async with self._lock:
            return await trio.to_thread.run_sync(fn, *args)
