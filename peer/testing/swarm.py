"""Many real daemons at once: `LocalSwarm` starts them, waits for a state of the whole swarm, and always
stops them (a context manager). `swarm_config` builds their config from the typed `Config`, so a test
or benchmark cannot write a key the daemon would reject.

Every daemon gets its own home under the swarm's root; each swarm gets its own name (`unique_swarm`),
so swarms started at the same time on one host never see each other's peers.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from peer.config import Config, to_toml
from peer.home import Home, atomic_write
from peer.testing.daemon import DaemonProcess
from peer.testing.views import view_graph
from peer.testing.process import stop_all, wait_for
from peertrain.swarm import RANK_ENV, WORLD_ENV

CONNECT_TIMEOUT = 60.0  # 8 daemons on 2 loaded cores connect in ~5 s (peer bench discovery); generous
NODE_PREFIX = "node"  # `peer local` names its daemons node1, node2, ...

# Failure detection and reconnects a few times faster than the daemon's defaults, so a swarm of real
# daemons settles and notices a killed peer within seconds; still slow enough for a loaded 2-core host.
FAST_MEMBERSHIP = {"heartbeat_interval": 0.5, "dead_after": 4.0, "reconnect_min": 0.2, "reconnect_max": 3.0,
                   "pex_interval": 1.0, "max_connections_per_ip": 64}

_swarm_counter = itertools.count()


def unique_swarm(prefix: str = "t") -> str:
    """A swarm name no other swarm on this host is using (pid, a counter and the clock)."""
    return f"{prefix}{os.getpid()}x{next(_swarm_counter)}x{int(time.time() * 1000) % 100000}"


def rank_env(rank: int, world: int) -> dict[str, str]:
    """The environment telling a daemon's trainer which data shard is its own."""
    return {RANK_ENV: str(rank), WORLD_ENV: str(world)}


TEST_VIEWS_ENV = "PEERTRAIN_TEST_VIEWS"


def swarm_config(*, swarm: str, listen: str = "127.0.0.1:0", mdns: bool = True,
                 interfaces: list[str] | None = None, join: list[str] | None = None,
                 topology: dict | None = None, gossip: dict | None = None, trainer: str = "",
                 options: dict | None = None, membership: dict | None = None, pipeline: dict | None = None,
                 log_level: str = "info") -> Config:
    """A validated config for daemons on one host (mDNS on loopback) or in namespaces (`interfaces=[]`).

    `PEERTRAIN_TEST_VIEWS=partial` in the environment runs every swarm that does not choose its
    `[membership] views` with partial views: how the membership, topology, NAT and training tests were run
    against them (docs/design.md, "Partial views")."""
    membership = {**FAST_MEMBERSHIP, **(membership or {})}
    topology = dict(topology or {})
    if os.environ.get(TEST_VIEWS_ENV) and "views" not in membership:
        membership["views"] = os.environ[TEST_VIEWS_ENV]
        if membership["views"] == "partial" and topology.get("kind") == "full":
            del topology["kind"]  # the few peers of a test: partial views link them all (target_degree)
    return Config().replace(
        daemon={"swarm": swarm, "listen": listen, "join": list(join or []), "log_level": log_level},
        discovery={"mdns": mdns, "interfaces": list(interfaces if interfaces is not None else ["127.0.0.1"]),
                   "private_addresses": True},  # one host or private namespace addresses: dial them
        membership=membership,
        topology=topology,
        gossip=dict(gossip or {}),
        pipeline=dict(pipeline or {}),
        trainer={"name": trainer, "options": dict(options or {})},
    )


def write_config(path: Path, config: Config) -> Path:
    """Write `config` as TOML (atomically) and return the path."""
    atomic_write(Path(path), to_toml(config).encode())
    return Path(path)


def node_homes(root: Path) -> list[Path]:
    """The homes of `peer local`'s daemons under `root`, in node order."""
    if not root.is_dir():
        return []
    homes = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(NODE_PREFIX)]
    return sorted(homes, key=lambda p: int(p.name[len(NODE_PREFIX):]) if p.name[len(NODE_PREFIX):].isdigit() else 0)


class LocalSwarm:
    """The daemons of one test, benchmark or `peer local` run, each with a home under `root`.

    Use it as a context manager: on the way out every daemon is stopped (SIGTERM, then SIGKILL past the
    deadline), and if the block raised, their log tails are printed to stderr."""

    def __init__(self, root: Path, *, echo: Callable[[str, str], None] | None = None):
        self.root = Path(root)
        self.echo = echo  # echo(name, line): stream every daemon's output (peer local's console mode)
        self.daemons: list[DaemonProcess] = []

    def start(self, name: str, *args: str, config: Config | Path | None = None, home: Path | None = None,
              env: dict[str, str] | None = None, host: Any = None) -> DaemonProcess:
        """Start one daemon named `name` (home `root/name` unless given). A `Config` is written into the
        home as `Home.launch_config`; a path is used as it is."""
        home = Path(home) if home is not None else self.root / name
        if isinstance(config, Config):
            config = write_config(Home(home).launch_config, config)
        echo = (lambda line, _n=name: self.echo(_n, line)) if self.echo is not None else None
        daemon = DaemonProcess.create(name, home, config=config, args=args, env=env, host=host, echo=echo)
        self.daemons.append(daemon)
        return daemon.start()

    def restart(self, daemon: DaemonProcess, *, config: Config | None = None) -> DaemonProcess:
        """Start `daemon` again after it exited (stopped, killed, crashed): the same home, so the same identity,
        peer cache and checkpoints; the same environment and network namespace. A `Config` replaces the one
        in its home first (e.g. to unpin what only its first start should have)."""
        if daemon.running:
            raise RuntimeError(f"{daemon.name} is still running (pid {daemon.pid})")
        if config is not None:
            if daemon.config is None:
                raise ValueError(f"{daemon.name} was started without a config file to replace")
            write_config(daemon.config, config)
        return daemon.start()

    def start_nodes(self, n: int, config: Config | Path, *, args: tuple[str, ...] = (),
                    hosts: list[Any] | None = None, names: Callable[[int], str] | None = None) -> list[DaemonProcess]:
        """Start `n` daemons sharing one config, each told its data shard (rank i of n)."""
        name_of = names or (lambda i: f"{NODE_PREFIX}{i + 1}")
        return [self.start(name_of(i), *args, config=config, env=rank_env(i, n),
                           host=hosts[i] if hosts is not None else None) for i in range(n)]

    def statuses(self) -> list[dict | None]:
        """Every daemon's status, None for one that does not answer right now."""
        return [d.try_status() for d in self.daemons]

    def wait(self, predicate: Callable[[list[dict | None]], Any], *, timeout: float, what: str,
             interval: float = 0.1, progress: Callable[[list[dict | None]], Any] | None = None) -> float:
        """Poll all statuses until `predicate(statuses)` is truthy; the seconds it took. A daemon that
        exits meanwhile fails the wait at once (ProcessExited, with its log). With `progress` (a reading of
        the same statuses: samples done), `timeout` bounds the time without progress (`wait_for`)."""
        t0 = time.monotonic()
        last: list[list[dict | None]] = [[]]

        def check() -> Any:
            for d in self.daemons:
                d.check_alive()
            last[0] = self.statuses()
            return predicate(last[0])
        wait_for(check, timeout=timeout, what=what, interval=interval,
                 progress=None if progress is None else lambda: progress(last[0]))
        return time.monotonic() - t0

    def wait_connected(self, timeout: float = CONNECT_TIMEOUT) -> float:
        """Until the swarm has formed: every daemon has a session to every other one (full views), or, for
        daemons with partial views, their active views form one connected graph, every edge listed by both
        ends (sessions then come and go with the views)."""
        n = len(self.daemons)

        def formed(sts: list[dict | None]) -> bool:
            if not all(sts):
                return False
            if all((s.get("topology") or {}).get("views") for s in sts):
                g = view_graph(sts)
                return g["connected"] and g["edges_one_sided"] == 0
            return all(s["connected"] >= n - 1 for s in sts)
        return self.wait(formed, timeout=timeout, what=f"{n} daemons to connect")

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"===== {d.name} ({d.log_path}) =====\n{d.log_tail(lines)}" for d in self.daemons)

    def dump_logs(self, lines: int = 80) -> None:
        print("\n" + self.log_tails(lines), file=sys.stderr)

    def stop(self, timeout: float | None = None) -> list[int | None]:
        """Stop every daemon side by side; their exit codes, in start order."""
        return stop_all(self.daemons) if timeout is None else stop_all(self.daemons, timeout)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            self.dump_logs()
        self.stop()
