"""`peer`: the command line of peertrain.

Each subcommand is a small function; the daemon itself lives in peer/daemon.py. Heavy imports (trio,
torch, zeroconf) happen inside the subcommands that need them so `peer status` stays instant.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from peer import __version__
from peer.cli.args import add_config_overrides, add_home, effective_config, home_of

EPILOG = """\
examples:
  peer start --config configs/lan.toml              run a daemon on this machine (foreground)
  peer start --home /tmp/a --listen 127.0.0.1:0 --join 10.0.0.5:7100 --no-mdns
  peer status --watch                               live view of this daemon and its peers
  peer local --n 4 --config configs/local.toml      a whole swarm on one host (Ctrl-C stops all)
  peer bench transport --size 64MiB --json          measure the encrypted channel

The home directory (--home, default $PEERTRAIN_HOME or ~/.peertrain) holds the identity key,
config snapshot, peer cache, checkpoints, metrics and the control socket.
"""


def cmd_start(args) -> int:
    import trio

    from peer.daemon import Daemon
    from peer.home import Home
    from peer.logs import setup_logging
    from protocol import identity as ident

    cfg = effective_config(args)
    home = Home(home_of(args)).ensure()
    claim = home.claim()  # before the identity key: a second daemon on this home stops here
    bits = cfg.membership.identity_bits
    if bits and not home.identity_file.exists():
        print(f"making this home's identity key with {bits} bits of work ([membership] identity_bits): about "
              f"2^{bits} keys drawn, once", file=sys.stderr, flush=True)
    key = home.load_or_create_identity(bits)
    peer_id = ident.peer_id_from_public_bytes(ident.public_key_bytes(key))
    setup_logging(fmt=cfg.daemon.log_format, level=cfg.daemon.log_level, peer=ident.short_id(peer_id))
    daemon = Daemon(cfg, home, claim=claim)
    trio.run(daemon.run)
    return 0


def cmd_stop(args) -> int:
    from peer.control import call
    from peer.home import Home

    home = home_of(args)
    reply = call(home, "stop")
    pid = reply.get("pid")
    # Wait (bounded) for the socket to disappear, so scripts can rely on "stopped" meaning stopped.
    sock = Home(home).control_socket
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and sock.exists():
        time.sleep(0.1)
    if sock.exists():
        print(f"daemon (pid {pid}) asked to stop but is still shutting down after {args.timeout:.0f}s", file=sys.stderr)
        return 1
    print(f"daemon (pid {pid}) stopped")
    return 0


def cmd_status(args) -> int:
    from peer.control import call

    home = home_of(args)
    if args.json:
        st = call(home, "topology" if args.topology else "status")
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.live import Live

    from peer.cli.status_view import render_status

    console = Console(width=None if sys.stdout.isatty() else 120)

    def render():
        if args.topology:
            from peer.cli.status_view import render_topology

            return render_topology(call(home, "topology"))
        return render_status(call(home, "status"))

    if not args.watch:
        console.print(render())
        return 0
    if not console.is_terminal:  # piped or logged: Live would print nothing until Ctrl-C; print each refresh
        try:
            while True:
                console.print(render())
                time.sleep(args.interval)
        except KeyboardInterrupt:
            pass
        return 0
    with Live(render(), console=console, refresh_per_second=2, screen=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(render())
        except KeyboardInterrupt:
            pass
    return 0


def cmd_id(args) -> int:
    from peer.home import Home
    from protocol import identity as ident

    key = Home(home_of(args)).ensure().load_or_create_identity(args.identity_bits)
    print(ident.peer_id_from_public_bytes(ident.public_key_bytes(key)))
    return 0


def cmd_config(args) -> int:
    from peer import config as c

    if args.action == "docs":
        print(c.docs_markdown())
        return 0
    print(c.to_toml(effective_config(args)), end="")
    return 0


def cmd_local(args) -> int:
    from peer.cli import local

    return local.main(args)


def cmd_bench(args) -> int:
    # `kill` (SIGTERM) must unwind like Ctrl-C does, so a bench still stops its daemons and removes the
    # network namespaces it made instead of leaving them behind.
    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    return args.bench_run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peer", description="peertrain: asynchronous peer-to-peer decentralized training for PyTorch.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"peertrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("start", help="run a daemon in the foreground (Ctrl-C or `peer stop` stops it)",
                       description="Run a peertrain daemon in the foreground. It finds peers (mDNS and --join), "
                                   "keeps encrypted sessions to them, and hosts the trainer named in the config.")
    add_home(p)
    add_config_overrides(p)
    p.set_defaults(fn=cmd_start)

    p = sub.add_parser("stop", help="ask the daemon of a home directory to stop gracefully")
    add_home(p)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to exit (default 30)")
    p.set_defaults(fn=cmd_stop)

    p = sub.add_parser("status", help="show a daemon, its peers, topology and training")
    add_home(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")
    p.add_argument("--watch", action="store_true", help="refresh continuously until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--topology", action="store_true", help="show the whole known gossip graph")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("id", help="print this home's peer ID (creating the identity key if needed)")
    add_home(p)
    p.add_argument("--identity-bits", type=int, default=0, metavar="N",
                   help="the work the key must carry, as a swarm's [membership] identity_bits asks: a new key is "
                        "made so (about 2^N tries), an older weaker one refused (default 0)")
    p.set_defaults(fn=cmd_id)

    p = sub.add_parser("config", help="show the effective config, or the reference of every key")
    p.add_argument("action", choices=["show", "docs"], help="show: effective config as TOML; docs: key reference")
    add_config_overrides(p)
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("local", help="run N daemons on this host (each with its own home and port)",
                       description="Start N daemons as subprocesses with homes under --root, stream their logs "
                                   "with a prefix, and stop them all on Ctrl-C. `peer local status` summarizes them "
                                   "(a failed trainer in red, with its cause). With --demo: a live table instead of "
                                   "logs; exit 0 once training is done, 1 as soon as every trainer has failed (each "
                                   "node's cause and log file printed) or when --timeout passes first.")
    p.add_argument("action", nargs="?", choices=["run", "status", "stop"], default="run")
    p.add_argument("--n", type=int, default=4, help="number of daemons (default 4)")
    p.add_argument("--config", metavar="FILE", default=None, help="config for every daemon (default configs/local.toml)")
    p.add_argument("--root", metavar="DIR", default="runs/local", help="folder holding node homes (default runs/local)")
    p.add_argument("--demo", action="store_true", help="show a live summary table instead of raw logs; exit 0 when training reaches its target, 1 when "
                        "every trainer failed or --timeout passed first; node1 serves the dashboard (its URL is printed)")
    p.add_argument("--stay", action="store_true", help="with --demo: once training ends, keep the daemons and node1's "
                        "dashboard up until Ctrl-C (the exit status is still the demo's)")
    p.add_argument("--json", action="store_true", help="with status: machine-readable output")
    p.add_argument("--timeout", type=float, default=0, help="stop everything after this many seconds (0 = never); with --demo, a failure (exit 1)")
    p.set_defaults(fn=cmd_local)

    p = sub.add_parser("bench", help="benchmarks that print JSON (transport, discovery, average, gossip, train)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    from peer.bench import register_all

    register_all(bsub)
    p.set_defaults(fn=cmd_bench)

    from peer.cli import doctor, export

    export.register(sub)
    doctor.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from peer.config import ConfigError
    from peer.control import ControlError
    from peer.home import HomeError

    try:
        try:
            return args.fn(args) or 0
        except BaseExceptionGroup as group:  # trio nurseries wrap errors; show the one that matters
            raise _single_error(group) from None
    except (ConfigError, ControlError, HomeError, ValueError) as exc:
        print(f"peer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"peer {args.command}: error: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _single_error(group: BaseExceptionGroup) -> BaseException:
    """The lone leaf error of a (nested) exception group, or the group itself if there are several."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


if __name__ == "__main__":
    sys.exit(main())
