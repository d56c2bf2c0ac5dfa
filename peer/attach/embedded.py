"""A daemon inside the training process itself (`peertrain.start`): for a script that should join a swarm
without a separate `peer start`.

The daemon runs in its own thread under its own trio loop, exactly as `peer start` runs it (same config,
home, control socket), and the script attaches to it through the control socket like any other process:
one mechanism for both (peer/attach/client.py), and tensors still move by shared memory, not by socket.
Stopping: `swarm.close()`, or the end of the process (the thread is a daemon thread; the daemon's atexit
hook asks it to stop and waits a bounded time, so peers get a goodbye and the peer cache is saved).
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path

from peer.attach.client import AttachedSwarm, AttachError

log = logging.getLogger("peertrain.attach")

START_WAIT_S = 30.0  # the daemon is up (listening, control socket served) within this, or start() fails
STOP_WAIT_S = 35.0  # a graceful stop takes at most the daemon's own 30 s bound on saving state and goodbyes


class EmbeddedDaemon:
    """A Daemon running in a thread of this process."""

    def __init__(self, config, home):
        import trio

        from peer.daemon import Daemon

        self.home = home
        self._trio = trio
        self._token = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.daemon = Daemon(config, home, signals=False)
        self.thread = threading.Thread(target=self._main, name="peertrain-daemon", daemon=True)

    def _main(self) -> None:
        trio = self._trio

        async def run() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as n:
                await n.start(self.daemon.run)
                self._started.set()

        try:
            trio.run(run)
        except BaseException as exc:  # reported by start(), or logged if it happens later
            self._error = exc
            if self._started.is_set():
                log.exception("the embedded daemon stopped with an error")
        finally:
            self._started.set()

    def start(self) -> None:
        self.thread.start()
        if not self._started.wait(START_WAIT_S):
            raise AttachError(f"the embedded daemon did not start within {START_WAIT_S:.0f}s")
        if self._error is not None:
            raise AttachError(f"the embedded daemon did not start: {type(self._error).__name__}: {self._error}") from self._error
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop gracefully (goodbyes, peer cache) and wait for the thread, bounded."""
        if self.thread.is_alive() and self._token is not None:
            try:
                self._trio.from_thread.run_sync(self.daemon.request_stop, "the training process is done",
                                                trio_token=self._token)
            except self._trio.RunFinishedError:
                pass
            self.thread.join(STOP_WAIT_S)
        atexit.unregister(self.stop)


class EmbeddedSwarm(AttachedSwarm):
    """An AttachedSwarm whose daemon lives in this process; closing it stops that daemon too."""

    def __init__(self, embedded: EmbeddedDaemon, *, label: str = ""):
        self.embedded = embedded
        super().__init__(embedded.home.root, label=label)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.embedded.stop()


def start(config: str | Path | None = None, *, home: str | Path | None = None, listen: str | None = None,
          join: list[str] | None = None, swarm: str | None = None, mdns: bool | None = None,
          label: str = "") -> EmbeddedSwarm:
    """Run a daemon inside this process (config file < these arguments, as `peer start`) and attach to it."""
    from peer import config as c
    from peer.home import Home, default_home

    cfg = c.load(config)
    daemon: dict = {}
    if listen:
        daemon["listen"] = listen
    if join:
        daemon["join"] = list(cfg.daemon.join) + list(join)
    if swarm:
        daemon["swarm"] = swarm
    changes: dict = {"daemon": daemon} if daemon else {}
    if mdns is not None:
        changes["discovery"] = {"mdns": mdns}
    cfg = cfg.replace(**changes) if changes else cfg
    if cfg.trainer.name:
        raise AttachError(f"[trainer] name = {cfg.trainer.name!r}: an embedded daemon hosts no trainer (this "
                          "process is the trainer); use a config without a [trainer] section")
    embedded = EmbeddedDaemon(cfg, Home(Path(home).expanduser() if home else default_home()))
    embedded.start()
    try:
        return EmbeddedSwarm(embedded, label=label)
    except BaseException:
        embedded.stop()
        raise
