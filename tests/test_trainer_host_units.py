"""The trainer host imports the trainer module off the event loop: a heavy import (torch) must not leave the
daemon's heartbeats unanswered (under a small CPU share it took 10 s, and every peer dropped its session)."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import trio

from peer.trainer_host import TrainerHost

IMPORT_S = 0.4  # the fake trainer's import: long beside the ticks below, short for a unit test


def _daemon(tmp_path, name: str) -> SimpleNamespace:
    home = SimpleNamespace(root=tmp_path, checkpoints=tmp_path / "ckpt", metrics_file=tmp_path / "metrics.json")
    return SimpleNamespace(peer_id="p" * 20, home=home, config=SimpleNamespace(trainer=SimpleNamespace(name=name, options={})),
                           membership=SimpleNamespace(watch=lambda fn: None))


def test_a_slow_trainer_import_leaves_the_event_loop_running(tmp_path, monkeypatch):
    (tmp_path / "slow_trainer_mod.py").write_text(
        f"import time\ntime.sleep({IMPORT_S})\n\ndef run(swarm, options):\n    return {{'ran': True}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_trainer_mod", raising=False)
    host = TrainerHost(_daemon(tmp_path, "slow_trainer_mod"), None, None, None)  # type: ignore[arg-type]
    gaps: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            async def tick() -> None:
                last = time.monotonic()
                while True:
                    await trio.sleep(0.01)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
            n.start_soon(tick)
            t0 = time.monotonic()
            await n.start(host.run)
            assert time.monotonic() - t0 >= IMPORT_S  # the import did happen before the host started
            await host._done.wait()
            n.cancel_scope.cancel()

    trio.run(main)
    assert host.metrics.get("ran") is True and host.metrics["state"] == "done"
    assert max(gaps) < IMPORT_S / 2, f"the event loop stalled {max(gaps):.2f}s during the trainer's import"
