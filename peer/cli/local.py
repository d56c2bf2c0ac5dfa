"""`peer local`: a whole swarm on one host, for trying peertrain out and for tests.

Each daemon is a real `peer start` subprocess with its own home (`ROOT/nodeK`) and a free port on
127.0.0.1; they find each other through mDNS bound to loopback (configs/local.toml). Their logs go to
`ROOT/nodeK/daemon.log` and also stream here with a `[nodeK]` prefix (not with --demo, which shows a
live table instead). Ctrl-C stops them all: SIGTERM, a bounded wait, then SIGKILL for any that hang.
A demo is over when training is done (exit 0), or has failed (exit 1, saying why): every trainer ended and
one failed, every daemon exited, or --timeout passed first (`demo_end`).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from peer.home import Home
from peer.testing.process import ProcessExited
from peer.testing.swarm import NODE_PREFIX, LocalSwarm, node_homes, rank_env

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.toml"
PIPELINE_TRAINER = "trainers.swarm_pipeline"  # the trainer whose peers keep serving once they are done driving
# node1's dashboard in a demo: a fixed port, so the README's SSH tunnel line works as written; a busy one
# falls back to a free port (printed either way)
DEMO_DASHBOARD_PORT = 8470
DASHBOARD_WAIT_S = 30.0  # node1 answers with its dashboard's address within seconds; past this, the demo goes on without


def collect(root: Path, names: set[str] | None = None) -> list[dict]:
    """One row per daemon home under `root` (only `names`, if given): its status, or why there is none."""
    from peer.control import ControlError, call

    rows = []
    for home in node_homes(root):
        if names is not None and home.name not in names:
            continue
        try:
            rows.append({"node": home.name, "home": str(home), "status": call(home, "status", timeout=3)})
        except (ControlError, OSError) as exc:
            rows.append({"node": home.name, "home": str(home), "status": None, "error": str(exc).split(";")[0][:40]})
    return rows


def _is_pipeline(trainers: list[dict]) -> bool:
    return any(t.get("trainer") == PIPELINE_TRAINER for t in trainers)


def _training_finished(rows: list[dict]) -> bool:
    """Every live daemon's trainer is done; a pipeline's peers keep serving their stage after driving their
    samples (others may still need it), so for a pipeline, done is every one of them having `driving_done`."""
    live = [r["status"] for r in rows if r["status"]]
    trainers = [s.get("trainer") for s in live if s.get("trainer")]
    if _is_pipeline(trainers):
        return all(t.get("driving_done") for t in trainers)
    return bool(trainers) and all(t.get("state") == "done" for t in trainers)


ENDED = ("done", "stopped")  # trainer states after which it does nothing more (besides "failed: ...")


@dataclass(frozen=True)
class DemoEnd:
    """How a `peer local --demo` run ends: `ok` (exit 0) or not, why, and each failed trainer's
    (node, cause, log file)."""

    ok: bool
    reason: str
    failures: tuple[tuple[str, str, str], ...] = ()


def demo_end(rows: list[dict], *, timeout_s: float | None = None) -> DemoEnd | None:
    """Whether a demo is over, from its daemons' rows (`collect`'s, each with `running`: its process is alive);
    `timeout_s` once --timeout has passed. None: keep watching. A trainer that failed is not waited for once
    every other has ended too (done, stopped or failed) or its daemon is gone."""
    from peer.cli.status_view import trainer_failure

    if _training_finished(rows):
        return DemoEnd(True, "training finished")
    failures = tuple((r["node"], cause, str(Home(Path(r["home"])).log_file)) for r in rows
                     if (cause := trainer_failure((r.get("status") or {}).get("trainer"))) is not None)

    def ended(r: dict) -> bool:
        tr = (r.get("status") or {}).get("trainer") or {}
        if r.get("status") is None:
            return not r.get("running", True)
        return tr.get("state") in ENDED or bool(tr.get("driving_done")) or trainer_failure(tr) is not None

    if failures and all(ended(r) for r in rows):
        every = len(failures) == len(rows)
        why = "every trainer failed" if every else f"{len(failures)} of {len(rows)} trainers failed"
        return DemoEnd(False, why, failures)
    if rows and not any(r.get("running", True) for r in rows):
        return DemoEnd(False, "every daemon exited before training finished", failures)
    if timeout_s is not None:
        return DemoEnd(False, f"--timeout {timeout_s:g}s passed before training finished", failures)
    return None


def _print_end(end: DemoEnd, rows: list[dict]) -> None:
    """Why a demo failed: each failed trainer's cause and log; after a timeout, where each trainer was."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True, soft_wrap=True)  # a log path stays on one line, whole
    console.print()  # the live table's last line may not end one
    console.print(f"[bold red]peer local --demo failed[/]: {escape(end.reason)}")
    for node, cause, log_file in end.failures:
        console.print(f"  [bold]{node}[/]: [red]{escape(cause)}[/]\n    log: {log_file}")
    failed = {node for node, _, _ in end.failures}
    for r in rows:
        if r["node"] in failed:
            continue
        tr = (r.get("status") or {}).get("trainer")
        if tr is None:
            console.print(f"  [bold]{r['node']}[/]: {escape(r.get('error') or 'no trainer status')}   "
                          f"log: {Home(Path(r['home'])).log_file}")
            continue
        acc = tr.get("accuracy")
        console.print(f"  [bold]{r['node']}[/]: {escape(str(tr.get('state')))}, step {tr.get('step', '-')}"
                      + (f", held-out accuracy {acc * 100:.1f}%" if acc is not None else "")
                      + (f" (target {tr['target_accuracy'] * 100:.0f}%)" if tr.get("target_accuracy") else ""))


def _print_pipeline_result(console, live: list[dict]) -> None:
    """The pipeline demo's result: each driver's validation loss through the pipeline and the microbatch count."""
    trs = [(r["node"], r["status"]["trainer"]) for r in live]
    val = [f"{node} {t['val_loss']:.3f}" for node, t in trs if t.get("val_loss") is not None]
    done = sum(t.get("microbatches_done", 0) for _, t in trs)
    failed = sum(t.get("microbatches_failed", 0) for _, t in trs)
    resent = sum(t.get("calls_resent", 0) for _, t in trs)
    rate = sum(t.get("samples_per_s", 0) for _, t in trs)
    console.print()  # the live table's last line may not end one
    console.print(f"[bold green]pipeline training finished[/]: {done} microbatches done, {failed} failed, "
                  f"{resent} calls re-sent; {rate:.1f} samples/s over all drivers; validation loss through the "
                  f"pipeline per driver: {', '.join(val) or 'none'}")
    console.print(f"stopping the daemons: each writes its stage (blocks, optimizer) to HOME/checkpoints/latest.pt, "
                  f"e.g. {live[0]['home']}/checkpoints/latest.pt")


def _print_result(rows: list[dict]) -> None:
    from rich.console import Console

    console = Console()
    live = [r for r in rows if r["status"] and r["status"].get("trainer")]
    if not live:
        return
    if _is_pipeline([r["status"]["trainer"] for r in live]):
        _print_pipeline_result(console, live)
        return
    trs = [r["status"]["trainer"] for r in live]
    accs = [t.get("accuracy") or 0.0 for t in trs]
    reached = [t for t in trs if t.get("reached_target")]
    target = trs[0].get("target_accuracy") or 0
    console.print(f"[bold green]training finished[/]: {len(reached)}/{len(trs)} peers reached the {target * 100:.0f}% "
                  f"target (slowest after {max((t['seconds_to_target'] for t in reached), default=0):.1f}s of training); "
                  f"held-out accuracy of the final models (an exchange landing after a peer's target check can move "
                  f"its model a little): min {min(accs) * 100:.2f}% / mean {sum(accs) / len(accs) * 100:.2f}%")
    console.print(f"export a model with: peer export --home {live[0]['home']} model.pt")


def _demo_dashboard_listen() -> str:
    """127.0.0.1:DEMO_DASHBOARD_PORT if it is free now, else 127.0.0.1:0 (the daemon picks one)."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", DEMO_DASHBOARD_PORT))
        except OSError:
            return "127.0.0.1:0"
    return f"127.0.0.1:{DEMO_DASHBOARD_PORT}"


def _start_demo_nodes(swarm: LocalSwarm, n: int, config: Path) -> None:
    """`n` daemons on `config`; node1 with its dashboard on (unless the config sets `[dashboard] listen`)."""
    from peer.config import load

    cfg = load(config)
    key = cfg.security.swarm_key_file
    if key and not Path(key).is_absolute():  # node1's copy of the config lives in its home, not beside the key
        cfg = cfg.replace(security={"swarm_key_file": str((config.parent / key).resolve())})
    chosen = not cfg.dashboard.listen
    if chosen:
        cfg = cfg.replace(dashboard={"listen": _demo_dashboard_listen()})
    node1 = swarm.start(f"{NODE_PREFIX}1", config=cfg, env=rank_env(0, n))
    if chosen and not cfg.dashboard.listen.endswith(":0"):
        # the port was free when we looked; another demo may have taken it since (node1 then stops at start,
        # saying so): node1 again, on any free port, before its peers count on it
        try:
            _wait_dashboard(node1)
        except ProcessExited:
            swarm.restart(node1, config=cfg.replace(dashboard={"listen": "127.0.0.1:0"}))
        except TimeoutError:
            pass  # slow to start: the demo's own deadline decides
    for i in range(1, n):
        swarm.start(f"{NODE_PREFIX}{i + 1}", config=config, env=rank_env(i, n))


def _wait_dashboard(node) -> str:
    """`node`'s dashboard address, once it serves; ProcessExited if it stops, TimeoutError past DASHBOARD_WAIT_S."""
    return node.wait_until(lambda st: (st.get("dashboard") or {}).get("url"), timeout=DASHBOARD_WAIT_S,
                           what="its dashboard to listen", interval=0.2)


def _dashboard_url(swarm: LocalSwarm) -> str | None:
    """node1's dashboard address, once it serves (None if it does not within DASHBOARD_WAIT_S)."""
    try:
        return _wait_dashboard(swarm.daemons[0])
    except (TimeoutError, ProcessExited) as exc:
        print(f"note: node1's dashboard is not up: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None


def _stay(swarm: LocalSwarm) -> None:
    """`--stay`: the demo is over; keep its daemons (and node1's dashboard) up until Ctrl-C or until they exit."""
    print("the daemons stay up (--stay), node1's dashboard too; Ctrl-C stops them", flush=True)
    while any(d.running for d in swarm.daemons):
        time.sleep(0.5)


def main(args) -> int:
    root = Path(args.root)
    if args.action == "status":
        rows = collect(root)
        if not rows:
            print(f"no nodes under {root} (start some with `peer local --n 4`)", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(rows, indent=2, sort_keys=True))
        else:
            from rich.console import Console

            from peer.cli.status_view import render_local_summary

            Console(width=None if sys.stdout.isatty() else 120).print(render_local_summary(rows))
        return 0
    if args.action == "stop":
        from peer.control import ControlError, call

        for home in node_homes(root):
            try:
                call(home, "stop", timeout=3)
                print(f"{home.name}: stopping")
            except ControlError:
                pass
        return 0

    if args.n < 1:
        raise ValueError("--n must be at least 1")
    config = Path(args.config) if args.config else DEFAULT_CONFIG
    if not config.exists():
        raise ValueError(f"config file {config} does not exist")
    # --demo draws a table, so the daemons' output only goes to their log files; else it streams here too.
    swarm = LocalSwarm(root, echo=None if args.demo else (lambda name, line: print(f"[{name}] {line}", flush=True)))
    deadline = time.monotonic() + args.timeout if args.timeout else None
    end: DemoEnd | None = None
    try:
        if args.demo:
            _start_demo_nodes(swarm, args.n, config)
        else:
            swarm.start_nodes(args.n, config)
        print(f"started {args.n} daemons under {root} (config {config}); Ctrl-C stops them all.\n"
              f"  watch one:   peer status --home {root}/node1 --watch\n"
              f"  summary:     peer local status --root {root}", flush=True)
        if args.demo and (url := _dashboard_url(swarm)):
            port = url.rstrip("/").rsplit(":", 1)[-1]
            print(f"  dashboard:   {url}   (node1's, open while the demo runs; from another machine: "
                  f"ssh -L {port}:127.0.0.1:{port} THIS_HOST)", flush=True)
        if args.demo:
            from rich.console import Console
            from rich.live import Live

            from peer.cli.status_view import render_local_summary

            def rows_now() -> list[dict]:  # this run's daemons only (ROOT may hold older runs' homes)
                running = {d.name: d.running for d in swarm.daemons}
                return [dict(r, running=running[r["node"]]) for r in collect(root, set(running))]

            with Live(render_local_summary(rows_now()), console=Console(), refresh_per_second=2) as live:
                while end is None:
                    time.sleep(1.0)
                    rows = rows_now()
                    live.update(render_local_summary(rows))
                    timed_out = deadline is not None and time.monotonic() >= deadline
                    end = demo_end(rows, timeout_s=args.timeout if timed_out else None)
            if end.ok:
                _print_result(rows)
            else:
                _print_end(end, rows)
            if getattr(args, "stay", False):
                _stay(swarm)
        else:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.5)
                if not any(d.running for d in swarm.daemons):
                    break
    except KeyboardInterrupt:
        print("\nstopping all daemons ...", flush=True)
    finally:
        codes = swarm.stop()
    bad = [c for c in codes if c not in (0, -signal.SIGTERM)]
    if bad:
        print(f"daemon exit codes: {codes} (logs under {root}/node*/)", file=sys.stderr)
    return 0 if not bad and (end is None or end.ok) else 1
