"""Where a bench's processes run, and how much of this machine they get.

`Net` places peer i on 127.0.0.1 or on host i of a virtual LAN (`peer.testing.netns.Lan`), and hands out
rendezvous addresses for torch.distributed; `cpu_probe_ms` says how busy the machine is right now, since
runs of one invocation are only comparable while other work on it stays about the same.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DAEMON_PORT = 7100  # inside a LAN every daemon listens on it, so each knows the others' addresses up front
ALLREDUCE_PORT = 29500  # torch.distributed's customary rendezvous port; inside a LAN nothing else uses it


NO_NETNS = "network namespaces need root and iproute2; run with --no-netns for daemons on 127.0.0.1"


def netns_refused(wanted: bool) -> bool:
    """True (having said why on stderr) if a bench wants network namespaces this machine cannot make."""
    from peer.testing.netns import netns_available

    if wanted and not netns_available():
        print(NO_NETNS, file=sys.stderr)
        return True
    return False


def run_root(stack: ExitStack, logs: str | None, prefix: str) -> Path:
    """Where a bench keeps its daemons' homes: `logs` if given (kept, for reading the logs after), else a
    temporary directory removed when `stack` closes."""
    if logs:
        root = Path(logs).resolve()
        root.mkdir(parents=True, exist_ok=True)
        return root
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a rendezvous that cannot bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Net:
    """Where the peers run: 127.0.0.1, or host i of a virtual LAN (peer.testing.netns.Lan)."""

    lan: Any = None
    port: int = ALLREDUCE_PORT  # the last all-reduce rendezvous port used inside the LAN

    def host(self, i: int) -> Any:
        return self.lan.hosts[i] if self.lan is not None else None

    def master(self) -> str:
        """HOST:PORT for rank 0 of the next all-reduce run."""
        if self.lan is None:
            return f"127.0.0.1:{free_port()}"
        self.port += 1  # a fresh port per run: the last run's may sit in TIME_WAIT
        return f"{self.lan.hosts[0].ip}:{self.port}"

    def tx_bytes(self, i: int) -> int | None:
        """eth0 bytes sent by host i so far (only meaningful inside a namespace)."""
        if self.lan is None:
            return None
        out = self.host(i).run(["cat", "/proc/net/dev"], capture_output=True, text=True, timeout=15).stdout
        for line in out.splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
        return None


def cpu_probe_ms() -> float:
    """Milliseconds for a fixed pure-Python loop: how much CPU other work on this host leaves us right now
    (the runs of one invocation are only comparable while it stays about the same)."""
    t = time.perf_counter()
    sum(i * i for i in range(300_000))
    return round((time.perf_counter() - t) * 1000, 1)
