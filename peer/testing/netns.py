"""Network-namespace harness: a private virtual LAN of "hosts" for multi-host tests.

Topology (nothing is created in, or attached to, the root namespace):

    {prefix}{pid}h0 --eth0==vh0--+
    {prefix}{pid}h1 --eth0==vh1--+-- br0  (in namespace {prefix}{pid}br)
    ...                          |

Every host namespace gets ``lo`` up, ``eth0`` = ``{subnet}.{i+1}/24`` with
multicast on, and a 224.0.0.0/4 route so mDNS works inside with zeroconf's
default interfaces.  There is no default route: anything not on the LAN
fails fast (ENETUNREACH) instead of leaking or hanging.  Rate limits are
``tbf`` on both ends of a host's veth pair, so upload and download are capped.

Namespace names carry our pid, so parallel runs never collide, and
namespaces left behind by dead pids are deleted on the next start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from peer.testing.process import terminate_all

_CMD_TIMEOUT = 15.0  # seconds for any single ip/tc invocation
_PROC_GRACE = 3.0  # a process left running in a namespace at teardown gets this long after SIGTERM
_BRIDGE = "br0"


class NetnsError(RuntimeError):
    """An ip/tc command failed while building or tearing down the virtual LAN."""


def _run(argv: list[str], *, check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _list_netns() -> list[str]:
    """Names of all named namespaces (``ip netns list`` prints "name (id: N)")."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _delete_netns(ns: str) -> None:
    """Kill what still runs inside one of *our* namespaces, then delete it (its veths vanish)."""
    for pid in _ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _run(["ip", "netns", "delete", ns], check=False)


# What follows ``{prefix}{pid}`` in our namespace names: hosts, the LAN bridge, probes, and the
# internet lab's (peer/testing/internet.py) routers "r{k}" and internet segment "i".
_SUFFIX = r"(h\d+|r\d+|br|i|probe)"


def cleanup_stale(prefix: str = "pt") -> list[str]:
    """Delete namespaces named ``{prefix}{pid}...`` whose pid is dead; returns their names."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+){_SUFFIX}$")
    removed = []
    for ns in _list_netns():
        m = pattern.match(ns)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            _delete_netns(ns)
            removed.append(ns)
    return removed


def our_namespaces(prefix: str = "pt") -> list[str]:
    """Namespaces this process created with `prefix` (for leak checks)."""
    mine = re.compile(rf"^{re.escape(prefix)}{os.getpid()}{_SUFFIX}$")
    return [ns for ns in _list_netns() if mine.match(ns)]


def probe_namespace(prefix: str, check: Callable[[str], bool]) -> bool:
    """Whether `check(ns)` holds in a fresh namespace made for the question (deleted after); False when
    we cannot make one or a command fails."""
    probe = f"{prefix}{os.getpid()}probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (NetnsError, OSError, subprocess.TimeoutExpired):
        return False
    try:
        return check(probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired):
        return False
    finally:
        _run(["ip", "netns", "delete", probe], check=False)


def netns_available() -> bool:
    """True if we are root, have ip, and can really create (and delete) a namespace."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    return probe_namespace("pt", lambda ns: _run(["ip", "-n", ns, "link", "set", "lo", "up"], check=False).returncode == 0)


def tbf(ns: str, dev: str, mbit: float) -> None:
    """A tbf rate limit on one device; burst at least 1 ms worth of the rate: a fixed small burst (32 kbit)
    is accurate at low rates but undershoots above a few hundred Mbit/s."""
    if mbit <= 0:
        raise ValueError(f"rate must be positive: {mbit}")
    rate_kbit = max(1, round(mbit * 1000))
    burst_bytes = max(4096, int(mbit * 1e6 / 8 / 1000))
    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
          "rate", f"{rate_kbit}kbit", "burst", str(burst_bytes), "latency", "50ms"])


def tc_available() -> bool:
    return shutil.which("tc") is not None


@dataclass
class Host:
    """One namespace on the virtual LAN; commands run inside it via ``ip netns exec``."""

    name: str
    ip: str
    index: int = 0
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start a process inside the namespace; the Lan kills it at teardown if still running."""
        proc = subprocess.Popen(self.argv(argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run to completion inside the namespace (default timeout 60 s, so nothing hangs)."""
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(argv), **kw)

    def can_reach(self, ip: str, *, timeout: float = 2.0) -> bool:
        """TCP round trip to a closed port: a RST (refused) proves two-way reachability; no ping needed."""
        code = (
            "import socket,sys\n"
            f"try: socket.create_connection(({ip!r}, 9), timeout={timeout})\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError as e: print(e); sys.exit(1)\n"
        )
        proc = self.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout + 10)
        return proc.returncode == 0

    def _kill_procs(self) -> None:
        terminate_all(self._procs, _PROC_GRACE)  # the owner (e.g. a LocalSwarm) has normally stopped them
        self._procs.clear()


@dataclass
class Lan:
    """The hosts plus the bridge namespace that links them."""

    hosts: list[Host]
    bridge_ns: str

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(h.name for h in self.hosts)]

    def limit(self, i: int, mbit: float) -> None:
        """(Re)apply a tbf rate limit on host i's link, both directions, at runtime."""
        for ns, dev in ((self.hosts[i].name, "eth0"), (self.bridge_ns, f"vh{i}")):
            tbf(ns, dev, mbit)

    def unlimit(self, i: int) -> None:
        """Remove host i's rate limit (both directions)."""
        for ns, dev in ((self.hosts[i].name, "eth0"), (self.bridge_ns, f"vh{i}")):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def _teardown(self, created: list[str]) -> list[str]:
        """Kill our processes, delete our namespaces; returns the names that refused to go."""
        for host in self.hosts:
            host._kill_procs()
        for ns in reversed(created):
            _delete_netns(ns)
        left = set(_list_netns())
        return [ns for ns in created if ns in left]


@contextmanager
def virtual_lan(
    n: int,
    *,
    prefix: str = "pt",
    subnet: str = "10.77.0",
    rate_mbit: dict[int, float] | None = None,
) -> Iterator[Lan]:
    """n namespaces ("{prefix}{pid}h{i}"), each with a veth into one bridge living in its own namespace (not the root namespace, so nothing touches the host's networking), addresses {subnet}.{i+1}/24, lo up, multicast enabled on the veths (mDNS must work inside), and optional tbf rate limit (egress on the host's veth and on the bridge side toward it, so both directions are limited) for hosts listed in rate_mbit. Always cleans up (namespaces deleted → veths vanish) even on exceptions."""
    if not 1 <= n <= 250:
        raise ValueError(f"n must be in 1..250: {n}")
    if not re.fullmatch(r"[a-z]+", prefix):
        raise ValueError(f"prefix must be lowercase letters (the pid follows it): {prefix!r}")
    cleanup_stale(prefix)
    pid = os.getpid()
    lan = Lan(
        hosts=[Host(name=f"{prefix}{pid}h{i}", ip=f"{subnet}.{i + 1}", index=i) for i in range(n)],
        bridge_ns=f"{prefix}{pid}br",
    )
    clash = set(lan.namespaces) & set(_list_netns())
    if clash:
        raise NetnsError(f"namespaces {sorted(clash)} already exist: nested virtual_lan in one process needs another prefix")
    created: list[str] = []
    try:
        br = lan.bridge_ns
        _run(["ip", "netns", "add", br])
        created.append(br)
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        # STP off + forward_delay 0: ports forward at once; no snooping: multicast is simply flooded.
        _run(["ip", "-n", br, "link", "add", _BRIDGE, "type", "bridge",
              "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0"])
        _run(["ip", "-n", br, "link", "set", _BRIDGE, "up"])
        for i, host in enumerate(lan.hosts):
            _run(["ip", "netns", "add", host.name])
            created.append(host.name)
            # Create the pair inside the bridge namespace, moving one end straight into the host's.
            _run(["ip", "-n", br, "link", "add", f"vh{i}", "type", "veth", "peer", "name", "eth0", "netns", host.name])
            _run(["ip", "-n", br, "link", "set", f"vh{i}", "master", _BRIDGE, "up"])
            _run(["ip", "-n", host.name, "link", "set", "lo", "up"])
            _run(["ip", "-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", host.name, "link", "set", "eth0", "multicast", "on", "up"])
            _run(["ip", "-n", host.name, "route", "add", "224.0.0.0/4", "dev", "eth0"])
        for i, mbit in (rate_mbit or {}).items():
            lan.limit(i, mbit)
    except BaseException:
        lan._teardown(created)
        raise
    try:
        yield lan
    except BaseException:
        lan._teardown(created)
        raise
    left = lan._teardown(created)
    if left:
        raise NetnsError(f"could not delete namespaces {left}")


# ---------------------------------------------------------------- measurement helpers

_RECEIVER = r"""
import json, socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(1)
srv.settimeout(10)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(10)
skip = int(sys.argv[3])  # ignore the initial burst (tbf bucket + socket buffers)
total, t0, n0, t1 = 0, None, 0, None
while True:
    chunk = conn.recv(65536)
    if not chunk:
        break
    total += len(chunk)
    now = time.monotonic()
    if t0 is None and total >= skip:
        t0, n0 = now, total
    t1 = now
rate = (total - n0) * 8 / (t1 - t0) / 1e6 if t0 is not None and t1 > t0 else 0.0
print(json.dumps({"bytes": total, "mbit": rate}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
end = time.monotonic() + float(sys.argv[3])
buf = b"x" * 65536
while time.monotonic() < end:
    s.sendall(buf)
s.close()
"""


class ProcOutput:
    """Drain a child's stdout/stderr in threads (pipes never fill up) and let tests poll its lines.

    Mixing select() with readline() on buffered pipes loses lines; this does not.
    """

    def __init__(self, proc: subprocess.Popen[str], label: str = "") -> None:
        self.proc = proc
        self.label = label or " ".join(map(str, proc.args))[-80:]  # type: ignore[arg-type]
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._drain, args=(stream, sink), daemon=True)
            for stream, sink in ((proc.stdout, self.out), (proc.stderr, self.err))
            if stream is not None
        ]
        for t in self._threads:
            t.start()

    def _drain(self, stream: Any, sink: list[str]) -> None:
        for line in stream:
            with self._cond:
                sink.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float) -> str | None:
        """First stdout line matching `pred`, waiting at most `timeout` s (None if none / exited)."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.out[seen:]:
                    if pred(line):
                        return line
                seen = len(self.out)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not any(t.is_alive() for t in self._threads)):
                    return None
                self._cond.wait(min(left, 0.2))

    def events(self) -> list[dict[str, Any]]:
        """stdout lines that are JSON objects."""
        found = []
        for line in list(self.out):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                found.append(obj)
        return found

    def join(self, timeout: float = 5.0) -> None:
        for t in self._threads:
            t.join(timeout)

    def dump(self) -> str:
        """Everything the child printed, for assertion messages."""
        return (f"--- {self.label} (rc={self.proc.poll()}) stdout:\n" + "\n".join(self.out)
                + "\n--- stderr:\n" + "\n".join(self.err[-60:]))


def measure_tcp_mbit(sender: Host, receiver: Host, *, seconds: float = 1.5, port: int = 5201) -> float:
    """Goodput in Mbit/s of one TCP stream sender -> receiver (bounded by `seconds`).

    The first 128 KiB are excluded: they ride the tbf bucket and socket buffers.
    """
    recv = receiver.popen([sys.executable, "-c", _RECEIVER, receiver.ip, str(port), str(128 * 1024)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ProcOutput(recv, label=f"receiver in {receiver.name}")
    try:
        if out.wait_for(lambda line: line == "ready", timeout=10) is None:
            raise NetnsError(f"receiver did not start\n{out.dump()}")
        snd = sender.run([sys.executable, "-c", _SENDER, receiver.ip, str(port), str(seconds)],
                         capture_output=True, text=True, timeout=seconds + 20)
        recv.wait(timeout=seconds + 20)
        out.join()
        events = out.events()
        if snd.returncode != 0 or recv.returncode != 0 or not events:
            raise NetnsError(f"measurement failed: sender rc={snd.returncode} {snd.stderr!r}\n{out.dump()}")
        return float(events[-1]["mbit"])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(timeout=5)
