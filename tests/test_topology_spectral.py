"""The daemon's spectral work (peer/topology/spectral.py): solved in a worker thread, cached per view."""

from __future__ import annotations

import trio

from peer.topology.fixed import random_regular
from peer.topology.graph import GraphView
from peer.topology.mixing import graph_spectral_gap
from peer.topology.spectral import SpectralWorker
from tests.topology_helpers import names


def test_the_gap_is_solved_once_per_unchanged_view():
    ids = names(64)
    edges = random_regular(ids, 4, 0)
    view = GraphView.from_edges(ids, edges)
    same = GraphView.from_edges(list(reversed(ids)), list(edges))  # equal structure, a different object
    other = view.without_edge(*sorted(next(iter(view.edges))))
    worker = SpectralWorker()

    async def main() -> None:
        assert not worker.is_current(view)
        assert await worker.view_gap(view) == graph_spectral_gap(view)
        assert await worker.view_gap(same) == graph_spectral_gap(view) and worker.computed == 1
        assert worker.is_current(same) and not worker.is_current(other)
        assert await worker.view_gap(other) == graph_spectral_gap(other) and worker.computed == 2
    trio.run(main)


def test_spectral_work_runs_one_at_a_time_off_the_event_loop():
    worker = SpectralWorker()
    active, peak, loop_ticks = [0], [0], [0]

    def work(x: int) -> int:
        import time
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        active[0] -= 1
        return x

    async def ticker() -> None:
        while True:
            loop_ticks[0] += 1
            await trio.sleep(0.005)

    async def main() -> None:
        results = []
        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            async with trio.open_nursery() as jobs:
                for i in range(4):
                    jobs.start_soon(lambda i=i: _append(results, worker.run(work, i)))
            n.cancel_scope.cancel()
        assert sorted(results) == [0, 1, 2, 3]
    trio.run(main)
    assert peak[0] == 1  # serialized
    assert loop_ticks[0] >= 10  # the event loop kept running while the work slept in its thread


async def _append(out: list, coro) -> None:
    out.append(await coro)
