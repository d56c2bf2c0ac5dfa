"""`peer doctor`: can this machine join its swarm, and if not, what to change.

Each check reports what it found and, when something is wrong, the one thing to try. Most are local
(config, home, identity key, swarm key, listen port); bootstrap addresses are probed for real, with a
handshake under a throw-away identity (the home's may be in use by the running daemon, and a second
session under one peer ID would displace the first); reachability, relays and the daemon's own view of
its bootstrap peers come from the running daemon's status (`checks_from_status`), since only a daemon
can ask peers to dial it back. Exit code 1 if any check fails.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from peer.cli.doctor_status import Check, checks_from_status, clock_check, short

if TYPE_CHECKING:  # the command imports trio (through explain) only when it runs: `peer --help` stays instant
    from peer.config import Config
    from peer.nat.explain import DialProblem

DEFAULT_TIMEOUT = 5.0
"""Seconds for each probe step (resolve, connect, handshake): the daemon's own default handshake_timeout,
so a peer too slow for the probe is too slow for the daemon's dials as well."""
MARKS = {"ok": ("✔", "green"), "warn": ("!", "yellow"), "fail": ("✘", "red"), "skip": ("–", "dim")}


@dataclass(frozen=True)
class Probe:
    """One bootstrap address dialed: who answered and how fast, or why not."""

    address: str
    peer_id: str = ""
    seconds: float = 0.0  # connect and handshake
    clock_offset: float | None = None  # the remote's wall clock minus ours, if its handshake carried it
    problem: DialProblem | None = None
    allow_list: bool = False  # refused by an allow-list


# ---- local checks ---------------------------------------------------------------------------------

def check_home(root: Path) -> Check:
    from peer.home import Home, HomeError

    if not root.exists():
        parent = next(p for p in root.parents if p.exists())
        if os.access(parent, os.W_OK | os.X_OK):
            return Check("home", "ok", f"{root} does not exist yet; `peer start` creates it")
        return Check("home", "fail", f"{root} does not exist and {parent} is not writable",
                     "pick a home this user can create with --home (or $PEERTRAIN_HOME)")
    try:
        Home(root).ensure()
        fd, tmp = tempfile.mkstemp(prefix=".doctor.", dir=root)
        os.close(fd)
        os.unlink(tmp)
    except HomeError as exc:
        return Check("home", "fail", str(exc).partition("; ")[0], str(exc).partition("; ")[2])
    except OSError as exc:
        return Check("home", "fail", f"cannot write in {root}: {exc.strerror}",
                     "fix its permissions or pick another with --home")
    return Check("home", "ok", f"{root}: private (mode {stat.S_IMODE(root.stat().st_mode):04o}) and writable")


def check_identity(root: Path) -> Check:
    from peer.home import Home
    from protocol import identity as ident

    path = Home(root).identity_file
    if not path.exists():
        return Check("identity", "ok", f"no key yet: `peer start` (or `peer id`) creates {path}")
    try:
        key = ident.private_key_from_bytes(path.read_bytes())
        mode = stat.S_IMODE(path.stat().st_mode)
    except (OSError, ValueError) as exc:
        return Check("identity", "fail", f"cannot read the identity key {path}: {exc}",
                     "move it away to create a new identity (a new peer ID)")
    peer_id = ident.peer_id_from_public_bytes(ident.public_key_bytes(key))
    if mode & 0o077:
        return Check("identity", "warn", f"peer {peer_id}, but {path} has mode {mode:04o}: other users can read "
                     "this machine's identity key", f"chmod 600 {path}")
    return Check("identity", "ok", f"peer {peer_id} (key mode 0600)")


def check_daemon(root: Path, cfg: Config | None, timeout: float) -> tuple[Check, dict | None]:
    from peer.control import ControlError, call

    try:
        st = call(root, "status", timeout=timeout)
    except ControlError as exc:
        if str(exc).startswith("no daemon"):
            return Check("daemon", "skip", f"none runs with home {root}",
                         f"start one: `peer start --home {root}`"), None
        return Check("daemon", "warn", f"the control socket did not answer: {exc}", "look at the daemon's log"), None
    except OSError as exc:
        return Check("daemon", "warn", f"the control socket did not answer: {exc.strerror or exc}",
                     "look at the daemon's log"), None
    finding = (f"running: pid {st.get('pid')}, swarm {st.get('swarm')}, listening on {st.get('listen')}, "
               f"{st.get('connected', 0)} peers connected")
    if cfg is not None and st.get("swarm") != cfg.daemon.swarm:
        return Check("daemon", "warn", finding + f"; this config says swarm {cfg.daemon.swarm}",
                     "restart the daemon with this config, or run doctor with the daemon's"), st
    return Check("daemon", "ok", finding), st


def check_swarm_key(cfg: Config) -> tuple[Check, bytes | None]:
    from peer.daemon import read_swarm_key

    if not cfg.security.swarm_key_file:
        return Check("swarm key", "ok", "none: an open swarm (any daemon that reaches the port may join)"), None
    try:
        key = read_swarm_key(cfg)
    except ValueError as exc:
        return Check("swarm key", "fail", str(exc), "create it once (`head -c 32 /dev/urandom | base64 > swarm.key`) "
                     "and copy the same file to every machine"), None
    assert key is not None
    return Check("swarm key", "ok", f"{len(key)} bytes, fingerprint {key_fingerprint(key)}",
                 "the fingerprint must be the same on every machine"), key


def key_fingerprint(key: bytes) -> str:
    """Short enough to compare two machines by eye; says nothing usable about the key."""
    return hashlib.sha256(key).hexdigest()[:8]


def bind_problem(host: str, port: int) -> str | None:
    """Why the daemon could not listen on host:port now, or None if it could."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon's listener does
        try:
            s.bind(addr)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_listen(cfg: Config, status: dict | None) -> Check:
    from peer.config import parse_hostport
    from peer.nat.explain import hostport

    host, port = parse_hostport(cfg.daemon.listen, what="[daemon] listen")
    if status is not None:
        return Check("listen", "ok", f"the daemon listens on {status.get('listen')}")
    if port == 0:
        return Check("listen", "ok", "port 0: a free port is picked at start",
                     "machines that --join this one need a fixed port ([daemon] listen)")
    problem = bind_problem(host, port)
    if problem is None:
        return Check("listen", "ok", f"{hostport(host, port)} is free")
    fix = {"Address already in use": f"stop the program using it (`ss -ltnp 'sport = :{port}'`) or pick another "
                                     "port with --listen HOST:PORT ([daemon] listen)",
           "Cannot assign requested address": "listen on 0.0.0.0 or on one of this machine's addresses",
           "Permission denied": "use a port above 1023"}.get(problem, "pick another with --listen HOST:PORT")
    if problem == "Address already in use":
        problem += " (by another daemon, with another home?)"
    return Check("listen", "fail", f"cannot listen on {hostport(host, port)}: {problem}", fix)


# ---- bootstrap probes -----------------------------------------------------------------------------

async def probe(address: str, transport, timeout: float) -> Probe:
    """Resolve, connect and handshake with one bootstrap address, then hang up."""
    import trio

    from peer.config import parse_hostport
    from peer.nat.explain import DialProblem, explain_dial_error, hostport
    from peer.session.connect import dial
    from protocol.schema import Goodbye

    host, port = parse_hostport(address, what="[daemon] join")
    try:
        with trio.fail_after(timeout):
            await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except trio.TooSlowError:
        return Probe(address, problem=DialProblem(f"resolving {host} took over {timeout:g} s, so "
                                                  f"{hostport(host, port)} was not dialed", "check this machine's DNS"))
    except OSError as exc:
        return Probe(address, problem=explain_dial_error(exc, host, port, timeout=timeout))
    t0 = trio.current_time()
    try:
        session = await dial(host, port, transport, connect_timeout=timeout)
    except Exception as exc:  # every way a dial fails is explained, none ends the doctor
        return Probe(address, problem=explain_dial_error(exc, host, port, timeout=timeout),
                     allow_list="allow-list" in str(exc))
    now, seconds = time.time(), trio.current_time() - t0
    remote = session.remote_app.get("time") if isinstance(session.remote_app, dict) else None
    offset = remote - now if isinstance(remote, float) and math.isfinite(remote) else None
    await session.send_best_effort(Goodbye(reason="peer doctor probe"), timeout=1.0)
    await session.aclose("peer doctor probe done")
    return Probe(address, session.peer_id, seconds, offset)


def probe_all(cfg: Config, psk: bytes | None, timeout: float) -> list[Probe]:
    import trio

    from peer.session.transport import TransportConfig
    from protocol import identity as ident
    from protocol.cipher import CIPHERS

    configured = cfg.security.ciphers
    # a throwaway identity (the home's may be a running daemon's), with the work the swarm's peers ask of keys
    transport = TransportConfig(identity=ident.generate_identity(cfg.membership.identity_bits), swarm=cfg.daemon.swarm, psk=psk,
                                ciphers=CIPHERS if "auto" in configured else tuple(dict.fromkeys(configured)),
                                app_payload={"probe": True}, handshake_timeout=timeout)
    addresses = list(dict.fromkeys(cfg.daemon.join))
    results: list[Probe | None] = [None] * len(addresses)

    async def one(i: int, address: str) -> None:
        results[i] = await probe(address, transport, timeout)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i, address in enumerate(addresses):
                nursery.start_soon(one, i, address)

    trio.run(main)
    return [r for r in results if r is not None]


def bootstrap_check(p: Probe, allow_peers: Iterable[str] = ()) -> Check:
    name = f"bootstrap {p.address}"
    if p.problem is not None:
        if p.allow_list:  # an allow-list refuses our throw-away key, not necessarily the daemon's own
            return Check(name, "warn", p.problem.cause + " (the probe uses a throw-away key, which no allow-list "
                         "holds)", "check the daemon's own session to it in `peer status`")
        return Check(name, "fail", p.problem.cause, p.problem.fix)
    allow = set(allow_peers)
    if allow and p.peer_id not in allow:
        return Check(name, "fail", f"peer {p.peer_id} answered, but it is not in [security] allow_peers: the "
                     "daemon will refuse it", f"add {p.peer_id} to [security] allow_peers if it belongs in the swarm")
    clock = f", clock {p.clock_offset:+.1f} s" if p.clock_offset is not None else ""
    return Check(name, "ok", f"peer {short(p.peer_id)} answered: handshake in {p.seconds * 1000:.0f} ms{clock}")


# ---- the command ----------------------------------------------------------------------------------

def run_checks(args) -> list[Check]:
    from peer.cli.args import effective_config, home_of
    from peer.config import ConfigError

    root = home_of(args)
    try:
        cfg = effective_config(args)
        checks = [Check("config", "ok", f"{args.config or 'defaults'}: valid (swarm {cfg.daemon.swarm})")]
    except ConfigError as exc:
        cfg, checks = None, [Check("config", "fail", str(exc), "correct the file; `peer config docs` lists every key")]
    checks += [check_home(root), check_identity(root)]
    daemon, status = check_daemon(root, cfg, args.timeout)
    checks.append(daemon)
    if cfg is None:
        return checks + [Check("network", "skip", "not checked: the config does not load", "fix the config first")]
    key_check, psk = check_swarm_key(cfg)
    checks += [key_check, check_listen(cfg, status)]
    probes: list[Probe] = []
    if key_check.status == "fail":
        checks.append(Check("bootstrap", "skip", "not probed: without the swarm key every handshake fails",
                            "fix the swarm key first"))
    elif cfg.daemon.join:
        probes = probe_all(cfg, psk, args.timeout)
        checks += [bootstrap_check(p, cfg.security.allow_peers) for p in probes]
    elif not cfg.discovery.mdns:
        checks.append(Check("bootstrap", "warn", "no [daemon] join address and mDNS off: this daemon only finds "
                            "peers that dial it, or those in its peer store (fine for a swarm's first machine)",
                            "--join HOST:PORT of a swarm member"))
    else:
        checks.append(Check("bootstrap", "skip", "no [daemon] join address: peers are found by mDNS on this LAN"))
    offsets = [(p.address, p.clock_offset) for p in probes if p.clock_offset is not None]
    if status is not None:
        return checks + checks_from_status(status, probe_offsets=offsets)
    checks.append(Check("reachability", "skip", "start the daemon (`peer start`): reachability is measured by "
                        "asking peers to dial back"))
    return checks + [clock_check(offsets)]


def render(checks: list[Check]):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE, show_header=True, header_style="bold")
    for col in ("", "check", "finding", "fix"):
        table.add_column(col, overflow="fold")
    for c in checks:
        mark, style = MARKS.get(c.status, ("?", ""))
        # Text, not markup: findings name config sections like [daemon]
        table.add_row(Text(mark, style=style), Text(c.name), Text(c.finding), Text(c.fix, style="dim"))
    return table


def cmd_doctor(args) -> int:
    checks = run_checks(args)
    ok = not any(c.status == "fail" for c in checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "ok": ok}, indent=2))
    else:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 140)
        console.print(render(checks))
        fails = sum(c.status == "fail" for c in checks)
        console.print("all checks passed" if ok else f"{fails} check{'s' * (fails > 1)} failed")
    return 0 if ok else 1


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check that this machine can join its swarm, and say what to fix",
                       description="Check the config, the home, the swarm key and the listen port, probe every "
                                   "bootstrap address with a real handshake, and read reachability, relays and "
                                   "clocks from the running daemon. Exit code 1 if any check fails.")
    p.add_argument("--home", metavar="DIR", help="daemon home directory (default: $PEERTRAIN_HOME or ~/.peertrain)")
    p.add_argument("--config", metavar="FILE", help="TOML config file, as for `peer start`")
    p.add_argument("--listen", metavar="HOST:PORT", help="listen address to check, as for `peer start`")
    p.add_argument("--join", metavar="HOST:PORT", action="append", default=[],
                   help="bootstrap address to probe (repeatable)")
    p.add_argument("--swarm", metavar="NAME", help="swarm name, as for `peer start`")
    p.add_argument("--json", action="store_true", help='machine-readable output: {"checks": [...], "ok": bool}')
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds for each probe step (default {DEFAULT_TIMEOUT:g})")
    p.set_defaults(fn=cmd_doctor, no_mdns=False, log_format=None, log_level=None)
