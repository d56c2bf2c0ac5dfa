"""`peer bench train`: time to a target accuracy for AD-PSGD, D-PSGD and a gloo all-reduce baseline.

One invocation trains the same model, data shards, per-worker batch, optimizer and lr three ways: our
daemons hosting `trainers.gossip_sgd` in `adpsgd` and `dpsgd` mode, and `trainers.allreduce_baseline`
(torch.distributed, one process per rank, started as `python -m ...`: `peer/` never imports `trainers`).

Clocks exclude start-up: for our modes each peer's training clock starts after its daemon has found the
swarm (the trainer's own `elapsed_s`), for all-reduce after process-group init and a barrier.
`seconds_to_target` is, for our modes, the wall time from the first peer's training start until the LAST
peer's local model reached the target (every peer evaluates its own model on the held-out set every
`eval_every` steps); for all-reduce, until rank 0's (shared) model reached it. `--netns` runs every peer
and every rank in its own network namespace and can throttle one host's link (`--slow-link MBIT`);
`--straggler F` slows one peer's steps F-fold and reports the other peers' steps/s with and without it.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("adpsgd", "dpsgd", "allreduce")
DEFAULT_TOPOLOGY = {"kind": "rewired", "target_degree": 2, "min_degree": 1, "max_degree": 3}  # train-digits.toml


def add_arguments(p) -> None:
    p.add_argument("--n", type=int, default=4, help="peers / ranks (default 4)")
    p.add_argument("--model", default=None,
                   help="digits_mlp (default), digits_cnn, digits_wide_mlp (default with --netns: 9.9 MB of parameters)")
    p.add_argument("--target", type=float, default=None, help="held-out accuracy to reach (default 0.95)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of adpsgd,dpsgd,allreduce")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 20; 5 for digits_wide_mlp)")
    p.add_argument("--epochs", type=float, default=0.0,
                   help="budget: most passes over a peer's own shard (default: twice the model recipe's, so a "
                        "peer slower than the recipe is still timed)")
    p.add_argument("--batch-size", type=int, default=0, help="per-worker batch (default: the model's recipe)")
    p.add_argument("--lr", type=float, default=0.0, help="learning rate (default: the model's recipe)")
    p.add_argument("--degree", type=int, default=DEFAULT_TOPOLOGY["target_degree"],
                   help="gossip target degree (default 2, as configs/train-digits.toml)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="raw", choices=["raw", "float16", "q8"], help="gossip tensor codec (default raw)")
    p.add_argument("--trainer", default="trainers.gossip_sgd",
                   help="trainer module our daemons host (a gossip_sgd variant taking the same options)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved; medians are reported")
    p.add_argument("--netns", action="store_true", help="one network namespace per peer/rank (needs root)")
    p.add_argument("--slow-link", type=float, default=0.0, metavar="MBIT",
                   help="with --netns: limit the last host's link to MBIT (tbf, both directions)")
    p.add_argument("--straggler", type=float, default=0.0, metavar="F",
                   help="instead of time-to-target: slow the last peer's steps F-fold and compare the others' steps/s")
    p.add_argument("--no-caps", action="store_true",
                   help="with --straggler: do not cap each peer at cpus/n CPUs (cgroup cpu quota)")
    p.add_argument("--straggler-steps", type=int, default=800,
                   help="steps per gossip peer in --straggler runs (all-reduce ranks run a quarter of them)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="let each peer stop at its own target (gossip_sgd target_accuracy) instead of all training "
                        "until every peer has reached it")
    p.add_argument("--timeout", type=float, default=240.0, help="give up on one run after this many seconds")
    p.add_argument("--keep", default="", help="keep homes and logs under this directory")
    p.add_argument("--json", action="store_true", help="print only the (compact) JSON object")


# ------------------------------------------------------------------------------------------ network


@dataclass
class Net:
    """Where the peers run: 127.0.0.1, or host i of a virtual LAN (peer.testing.netns.Lan)."""

    lan: Any = None
    port: int = 29500  # next all-reduce rendezvous port inside the LAN

    def host(self, i: int) -> Any:
        return self.lan.hosts[i] if self.lan is not None else None

    def master(self) -> str:
        if self.lan is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return f"127.0.0.1:{s.getsockname()[1]}"
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


# ------------------------------------------------------------------------------------------ our modes


def _metrics(home: Path) -> list[dict]:
    try:
        lines = home.joinpath("metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _peer_summary(lines: list[dict], target: float) -> dict:
    """One peer's run from its metrics.jsonl: when its clock started, when its model reached the target."""
    stepped = [m for m in lines if m.get("elapsed_s") is not None and m.get("step") is not None]
    if not stepped:
        return {"started": False}
    start = stepped[0]["ts"] - stepped[0]["elapsed_s"]
    last = stepped[-1]
    hit = next((m for m in stepped if target and (m.get("accuracy") or 0.0) >= target), None)
    return {
        "started": True, "start_wall": start, "steps": last["step"], "elapsed_s": last["elapsed_s"],
        "epochs": last.get("epoch"), "samples_per_s": last.get("samples_per_s"),
        "steps_per_s": last["step"] / max(last["elapsed_s"], 1e-9), "accuracy": last.get("accuracy"),
        "reached": hit is not None,
        "reach_wall": start + hit["elapsed_s"] if hit else None,
        "seconds_to_target": hit["elapsed_s"] if hit else None,
        "epochs_to_target": hit.get("epoch") if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "meta": next((m for m in lines if "parameters" in m), {}),
    }


def _trainer_state(st: dict | None) -> str:
    return ((st or {}).get("trainer") or {}).get("state", "")


def run_gossip(mode: str, a, net: Net, root: Path, *, options: dict, delays: dict[int, float],
               wait_for: list[int], target: float, gossip: dict, membership: dict, caps: Any = None) -> dict:
    """Start n daemons hosting gossip_sgd and stop them once every peer's model has reached `target`
    (read from the metrics each peer appends at every evaluation), or, without a target, once the
    trainers of the peers in `wait_for` are done."""
    from peer.bench.harness import Swarm, make_config, unique_swarm

    swarm_name = unique_swarm(f"bt{mode}")
    tx0 = [net.tx_bytes(i) for i in range(a.n)]
    t_begin = time.monotonic()
    with Swarm(root) as swarm:
        for i in range(a.n):
            cfg = make_config(
                swarm=swarm_name, listen="0.0.0.0:7100" if net.lan else "127.0.0.1:0", mdns=True,
                interfaces=[] if net.lan else ["127.0.0.1"],
                topology={**DEFAULT_TOPOLOGY, "target_degree": a.degree, "max_degree": max(a.degree, 3)},
                gossip=gossip, membership=membership, trainer=a.trainer,
                options={**options, "mode": mode, "step_delay": delays.get(i, 0.0)})
            node = swarm.start(f"{mode}{i}", cfg, host=net.host(i),
                               env={"PEERTRAIN_RANK": str(i), "PEERTRAIN_WORLD": str(a.n), "OMP_NUM_THREADS": "1"})
            if caps is not None:
                caps.add(i, node.proc.pid)

        def finished(sts: list[dict | None]) -> bool:
            states = [_trainer_state(st) for st in sts]
            if any(s.startswith("failed") for s in states):
                raise RuntimeError(f"a trainer failed: {states}")
            if target:
                return all(states[i] == "done" or _peer_summary(_metrics(node.home), target).get("reached")
                           for i, node in enumerate(swarm.nodes))
            return all(states[i] == "done" for i in wait_for)

        swarm.wait(finished, timeout=a.timeout, what=f"{mode} peers to reach the target or finish", interval=0.25)
        statuses = swarm.statuses()
        tx1 = [net.tx_bytes(i) for i in range(a.n)]
        homes = [node.home for node in swarm.nodes]
    wall = time.monotonic() - t_begin
    peers = [_peer_summary(_metrics(h), target) for h in homes]
    wire = [sum(p["bytes_out"] for p in (st or {}).get("peers", [])) if st else None for st in statuses]
    payload = [((st or {}).get("gossip") or {}).get("bytes_sent") for st in statuses]
    exchanges = [((st or {}).get("gossip") or {}).get("exchanges") for st in statuses]
    recent = [x for st in statuses for x in (((st or {}).get("gossip") or {}).get("recent_s") or [])]
    failed = [((st or {}).get("gossip") or {}).get("failed") for st in statuses]
    rejected = [((st or {}).get("gossip") or {}).get("rejected") for st in statuses]
    degrees = [((st or {}).get("topology") or {}).get("degree") for st in statuses]
    measured = [b - a0 for a0, b in zip(tx0, tx1)] if None not in tx0 + tx1 else None
    return {"peers": peers, "wire_bytes_out": wire, "gossip_payload_bytes_sent": payload, "exchanges": exchanges,
            "failed_exchanges": failed, "rejected_offers": rejected, "degrees": degrees, "recent_exchange_s": recent, "netdev_tx_bytes": measured, "bench_wall_s": round(wall, 1)}


def summarise_gossip(run: dict, n: int) -> dict:
    peers = run["peers"]
    ok = [p for p in peers if p.get("started")]
    reached = [p for p in ok if p["reached"]]
    all_reached = len(reached) == n
    start = min((p["start_wall"] for p in ok), default=None)
    sps = [p["samples_per_s"] for p in ok if p.get("samples_per_s") is not None]
    tx = run["netdev_tx_bytes"]
    out = {
        "reached_target": all_reached, "peers_reached": len(reached),
        "seconds_to_target": round(max(p["reach_wall"] for p in reached) - start, 3) if all_reached else None,
        "seconds_to_target_first_peer": round(min(p["reach_wall"] for p in reached) - start, 3) if reached else None,
        "seconds_to_target_median_peer": (round(statistics.median(p["reach_wall"] for p in reached) - start, 3)
                                          if all_reached else None),
        "start_skew_s": round(max(p["start_wall"] for p in ok) - start, 3) if ok else None,
        "epochs_to_target": max(p["epochs_to_target"] for p in reached) if all_reached else None,
        "steps_to_target_per_peer": [p["steps_to_target"] for p in peers] if ok else None,
        "final_accuracy_per_peer": [round(p["accuracy"], 4) if p.get("accuracy") is not None else None for p in peers],
        "samples_per_s_per_peer": round(statistics.mean(sps), 1) if sps else None,
        "samples_per_s_each": [round(s, 1) for s in sps],
        "samples_per_s_total": round(sum(sps), 1) if sps else None,
        "bytes_sent_per_peer": (round(statistics.mean(tx)) if tx else
                                round(statistics.mean(b for b in run["wire_bytes_out"] if b is not None))),
        "bytes_sent_source": ("measured: eth0 tx_bytes of each peer's namespace, daemon start to the end"
                              if tx else "measured: the daemon's encrypted session bytes_out to all peers"),
        "gossip_payload_bytes_per_peer": round(statistics.mean(b for b in run["gossip_payload_bytes_sent"] if b is not None)),
        "exchanges_per_peer": run["exchanges"], "failed_exchanges_per_peer": run["failed_exchanges"],
        "rejected_offers_per_peer": run.get("rejected_offers"), "degree_at_end_per_peer": run.get("degrees"),
        "exchange_s_median": round(statistics.median(run["recent_exchange_s"]), 4) if run["recent_exchange_s"] else None,
        "steps_per_exchange": (round(sum(p["steps"] for p in ok) / max(1, sum(e or 0 for e in run["exchanges"])), 2)
                               if ok else None),
        "bench_wall_s": run["bench_wall_s"],
        "parameters": next((p["meta"].get("parameters") for p in ok if p["meta"]), None),
    }
    return out


# ------------------------------------------------------------------------------------------ all-reduce


def run_allreduce(a, net: Net, root: Path, *, args: list[str], caps: Any = None) -> dict:
    """One process per rank (`python -m trainers.allreduce_baseline`); rank 0's JSON line is the result."""
    master = net.master()
    procs = []
    t_begin = time.monotonic()
    with ExitStack() as stack:
        for r in range(a.n):
            out = stack.enter_context(open(root / f"allreduce{r}.out", "w"))
            argv = [sys.executable, "-m", "trainers.allreduce_baseline", "--world", str(a.n), "--rank", str(r),
                    "--master", master, "--timeout", str(int(a.timeout)), *args,
                    *(["--net-dev", "eth0"] if net.lan else [])]
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
            if net.lan:  # else gloo advertises the address its hostname resolves to (127.0.0.1)
                env["GLOO_SOCKET_IFNAME"] = "eth0"
                procs.append(net.host(r).popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
            else:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            if caps is not None:
                caps.add(r, procs[-1].pid)
        try:
            deadline = time.monotonic() + a.timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"all-reduce ranks still running after {a.timeout:.0f}s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    text = (root / "allreduce0.out").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if procs[0].returncode != 0 or not lines:
        raise RuntimeError(f"all-reduce rank 0 failed (rc {procs[0].returncode}):\n{text[-3000:]}")
    result = json.loads(lines[-1])
    result["bench_wall_s"] = round(time.monotonic() - t_begin, 1)
    return result


def summarise_allreduce(r: dict) -> dict:
    sps = r["samples_per_s_per_worker"]
    return {
        "reached_target": r["reached_target"], "seconds_to_target": r["seconds_to_target"],
        "epochs_to_target": r["epochs_to_target"], "steps_to_target": r["steps_to_target"],
        "final_accuracy": round(r["accuracy"], 4),
        "samples_per_s_per_peer": round(statistics.mean(sps), 1), "samples_per_s_each": sps,
        "samples_per_s_total": r["samples_per_s_total"],
        "bytes_sent_per_peer": r["bytes_sent_per_worker"], "bytes_sent_source": r["bytes_sent_source"],
        "bytes_sent_estimate_ring": r["bytes_sent_estimate_ring"], "backend": r["backend"],
        "bench_wall_s": r["bench_wall_s"], "parameters": r["parameters"], "hyperparams": r["hyperparams"],
    }


# ------------------------------------------------------------------------------------------ the bench


@dataclass
class Plan:
    """Everything one invocation decided, shared by all its runs."""

    model: str
    target: float
    eval_every: int
    epochs: float
    options: dict
    allreduce_args: list[str]
    gossip: dict
    membership: dict


def recipe(model: str, a) -> dict:
    """The hyperparameters gossip_sgd and the baseline resolve for this model (asked of the baseline: peer/
    does not import trainers)."""
    argv = [sys.executable, "-m", "trainers.allreduce_baseline", "--world", str(a.n), "--model", model,
            "--print-recipe", *(["--batch-size", str(a.batch_size)] if a.batch_size else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot resolve the recipe of {model!r}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_plan(a) -> Plan:
    model = a.model or ("digits_wide_mlp" if a.netns else "digits_mlp")
    target = a.target if a.target is not None else 0.95
    eval_every = a.eval_every or (5 if model == "digits_wide_mlp" else 20)
    # Without --stop-at-target every peer keeps training until the bench has seen all of them reach the target:
    # a peer that stops at its own target keeps serving exchanges with a frozen model, which drags the others.
    options = {"model": model, "world": a.n, "target_accuracy": target if a.stop_at_target else 0.0,
               "eval_every": eval_every, "seed": a.seed,
               "threads": 1, "checkpoint_every": 0, "join_wait": 60.0}
    ar = ["--model", model, "--target", str(target), "--eval-every", str(eval_every), "--seed", str(a.seed),
          "--threads", "1"]
    epochs = a.epochs or 2 * recipe(model, a)["epochs"]
    options["epochs"] = epochs
    ar += ["--epochs", str(epochs)]
    if a.batch_size:
        options["batch_size"] = a.batch_size
        ar += ["--batch-size", str(a.batch_size)]
    if a.lr:
        options["lr"] = a.lr
        ar += ["--lr", str(a.lr)]
    # A 9.9 MB exchange over a throttled link takes model_bits / rate; give it room, and keep heartbeats
    # (queued behind tensor frames on the same session) from declaring the slow peer dead.
    slow_s = (10e6 * 8 / (a.slow_link * 1e6)) if a.slow_link else 0.0
    gossip = {"exchange_timeout": max(10.0, 4 * slow_s), "codec": a.codec}
    membership = {"dead_after": max(4.0, 3 * slow_s)}
    return Plan(model, target, eval_every, epochs, options, ar, gossip, membership)


def cpu_probe_ms() -> float:
    """Milliseconds for a fixed pure-Python loop: how much CPU other work on this host leaves us right now
    (the runs of one invocation are only comparable while it stays about the same)."""
    t = time.perf_counter()
    sum(i * i for i in range(300_000))
    return round((time.perf_counter() - t) * 1000, 1)


def _median(values: list) -> Any:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals and len(vals) == len(values) else None


def time_to_target(a, plan: Plan, net: Net, root: Path, modes: list[str]) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(a.repeats):
        for mode in modes:
            d = root / f"r{rep}-{mode}"
            d.mkdir(parents=True)
            probe = cpu_probe_ms()
            try:  # one broken run is reported, not allowed to hide the others
                if mode == "allreduce":
                    runs[mode].append(summarise_allreduce(run_allreduce(a, net, d, args=plan.allreduce_args)))
                else:
                    raw = run_gossip(mode, a, net, d, options=plan.options, delays={}, wait_for=list(range(a.n)),
                                     target=plan.target, gossip=plan.gossip, membership=plan.membership)
                    runs[mode].append(summarise_gossip(raw, a.n))
            except (RuntimeError, TimeoutError, OSError) as exc:
                runs[mode].append({"reached_target": False, "seconds_to_target": None, "epochs_to_target": None,
                                   "samples_per_s_per_peer": None, "samples_per_s_total": None,
                                   "bytes_sent_per_peer": None, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})
            runs[mode][-1]["cpu_probe_ms_before"] = probe
    out = {}
    for mode, rs in runs.items():
        best = dict(rs[0]) if len(rs) == 1 else {
            "seconds_to_target": _median([r["seconds_to_target"] for r in rs]),
            "epochs_to_target": _median([r["epochs_to_target"] for r in rs]),
            "samples_per_s_per_peer": _median([r["samples_per_s_per_peer"] for r in rs]),
            "samples_per_s_total": _median([r["samples_per_s_total"] for r in rs]),
            "bytes_sent_per_peer": _median([r["bytes_sent_per_peer"] for r in rs]),
            "reached_target": all(r["reached_target"] for r in rs),
            "trials_seconds_to_target": [r["seconds_to_target"] for r in rs],
            "trials_cpu_probe_ms": [r.get("cpu_probe_ms_before") for r in rs],
            "parameters": rs[0].get("parameters"), "hyperparams": rs[0].get("hyperparams"),
            "trials": rs,
        }
        if mode != "allreduce":
            best["seconds_to_target_median_peer"] = _median([r.get("seconds_to_target_median_peer") for r in rs])
        out[mode] = best
    base = runs.get("allreduce")
    for mode in ("adpsgd", "dpsgd"):
        if base and mode in runs and a.repeats > 1:
            pairs = [r["seconds_to_target"] / b["seconds_to_target"] for r, b in zip(runs[mode], base)
                     if r.get("seconds_to_target") and b.get("seconds_to_target")]
            out[mode]["trials_ratio_to_allreduce"] = [round(x, 3) for x in pairs]
    return out


class CpuCaps:
    """One cgroup (v1 `cpu` controller) per peer, each capped at cpus/n CPUs, for --straggler runs.

    On one shared host the CPU a sleeping straggler gives up would otherwise speed the others up, which peers
    on machines of their own would never see; with a hard cap every peer runs as if on its own small machine.
    """

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, n: int, cpus_each: float):
        self.n, self.cpus_each = n, cpus_each
        self.dirs: list[Path] = []

    @classmethod
    def available(cls) -> bool:
        return os.geteuid() == 0 and (cls.ROOT / "cpu.cfs_quota_us").exists() and os.access(cls.ROOT, os.W_OK)

    def __enter__(self) -> "CpuCaps":
        try:
            for i in range(self.n):
                d = self.ROOT / f"ptbench{os.getpid()}p{i}"
                d.mkdir()
                self.dirs.append(d)
                (d / "cpu.cfs_period_us").write_text("100000")
                (d / "cpu.cfs_quota_us").write_text(str(max(1000, int(self.cpus_each * 100000))))
        except BaseException:
            self.__exit__()
            raise
        return self

    def add(self, i: int, pid: int) -> None:
        """Move process `pid` (all its threads, and children it starts later) into peer i's group."""
        (self.dirs[i] / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc) -> None:
        for d in self.dirs:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        (self.ROOT / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # exited meanwhile
                d.rmdir()
            except OSError:
                pass
        self.dirs.clear()


def straggler(a, plan: Plan, net: Net, root: Path, modes: list[str]) -> dict:
    """Other peers' steps/s without and with one peer slowed `a.straggler`-fold (a fixed run length, no target)."""
    slow = a.n - 1
    others = [i for i in range(a.n) if i != slow]
    steps = a.straggler_steps
    ar_steps = max(plan.eval_every, steps // 4)
    opts = {**plan.options, "target_accuracy": 0.0, "max_steps": steps}  # fixed length: rates, not targets
    ar_args = [*plan.allreduce_args, "--target", "0", "--max-steps", str(ar_steps)]
    cap = None if a.no_caps or not CpuCaps.available() else round((os.cpu_count() or 1) / a.n, 3)
    out: dict[str, Any] = {"cpu_cap_per_peer": cap}
    delay = None
    ordered = sorted(modes, key=lambda m: m != "adpsgd")  # the first mode's step time sets the delay
    for mode in ordered:
        res, probes = {}, {}
        for label in ("without", "with"):
            d = root / f"{mode}-{label}"
            d.mkdir(parents=True)
            probes[label] = cpu_probe_ms()
            with ExitStack() as stack:
                caps = stack.enter_context(CpuCaps(a.n, cap)) if cap else None
                if mode == "allreduce":
                    extra = ["--step-delay", str(delay), "--straggler-rank", str(slow)] if label == "with" else []
                    rates = run_allreduce(a, net, d, args=[*ar_args, *extra], caps=caps)["steps_per_s_per_worker"]
                else:
                    raw = run_gossip(mode, a, net, d, options=opts, delays={slow: delay} if label == "with" else {},
                                     wait_for=others, target=0.0, gossip=plan.gossip, membership=plan.membership,
                                     caps=caps)
                    rates = [p["steps_per_s"] if p.get("started") else None for p in raw["peers"]]
            if delay is None:
                step_s = 1.0 / rates[slow]
                delay = round((a.straggler - 1) * step_s, 5)
                out["measured_step_s"] = {"mode": mode, "seconds": round(step_s, 5)}
            res[label] = rates
        w = statistics.mean(res["without"][i] for i in others)
        s = statistics.mean(res["with"][i] for i in others)
        out[mode] = {
            "others_steps_per_s_without": round(w, 2), "others_steps_per_s_with": round(s, 2),
            "ratio": round(s / w, 3),
            "straggler_steps_per_s_without": round(res["without"][slow], 2),
            "straggler_steps_per_s_with": round(res["with"][slow], 2) if res["with"][slow] else None,
            "straggler_slowdown": round(res["without"][slow] / res["with"][slow], 2) if res["with"][slow] else None,
            "steps": ar_steps if mode == "allreduce" else steps,
            "cpu_probe_ms_before": probes,
        }
    out["step_delay_s"] = delay
    out["straggler_peer"] = slow
    return out


def run(args) -> int:
    a = args
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if a.n < 2:
        raise ValueError("--n must be at least 2")
    if a.slow_link and not a.netns:
        raise ValueError("--slow-link needs --netns (the limit is a tbf qdisc on one host's link)")
    if a.straggler and a.straggler <= 1:
        raise ValueError("--straggler F needs F > 1")
    plan = make_plan(a)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    with ExitStack() as stack:
        if a.keep:
            root = Path(a.keep)
            root.mkdir(parents=True, exist_ok=True)
        else:
            from peer.bench.harness import temp_root

            root = Path(stack.enter_context(temp_root("peertrain-bench-train-")))
        net = Net()
        if a.netns:
            from peer.testing.netns import netns_available, virtual_lan

            if not netns_available():
                raise RuntimeError("--netns needs root and permission to create network namespaces")
            rates = {a.n - 1: a.slow_link} if a.slow_link else None
            net = Net(lan=stack.enter_context(virtual_lan(a.n, prefix="ptb", subnet="10.78.0", rate_mbit=rates)))
        if a.straggler:
            body = {"straggler": straggler(a, plan, net, root, modes)}
        else:
            body = {"modes": time_to_target(a, plan, net, root, modes)}
    result = {
        "bench": "train", "n": a.n, "model": plan.model, "target_accuracy": plan.target, "eval_every": plan.eval_every,
        "epoch_budget": plan.epochs,
        "network": ({"netns": True, "slow_link_mbit": a.slow_link or None,
                     "slow_host": (a.n - 1) if a.slow_link else None} if a.netns else "127.0.0.1"),
        "topology": {**DEFAULT_TOPOLOGY, "target_degree": a.degree, "max_degree": max(a.degree, 3)},
        "gossip": plan.gossip, **body,
    }
    if not a.straggler:
        m = body["modes"]
        base = (m.get("allreduce") or {}).get("seconds_to_target")
        for mode in ("adpsgd", "dpsgd"):
            mine = (m.get(mode) or {}).get("seconds_to_target")
            key = "ratio_to_allreduce" if mode == "adpsgd" else "ratio_dpsgd_to_allreduce"
            result[key] = round(mine / base, 3) if mine and base else None
        found = [v for v in m.values() if v.get("parameters")]
        result["parameters"] = found[0]["parameters"] if found else None
        result["model_mb"] = round(found[0]["parameters"] * 4 / 1e6, 2) if found else None
        result["hyperparams"] = next((v["hyperparams"] for v in m.values() if v.get("hyperparams")), None)
        result["goal"] = ("adpsgd time-to-target <= 0.5x all-reduce with one slow link" if a.slow_link
                          else "adpsgd time-to-target <= 1.3x all-reduce on even links")
        result["notes"] = [
            "seconds_to_target, ours: wall time from the first peer's training start (after discovery) until the "
            "LAST peer's local model reached the target on the held-out set (checked every eval_every steps); "
            "_first_peer and _median_peer are given too",
            "seconds_to_target, all-reduce: from after process-group init + barrier until rank 0's model reached it",
            "epochs = passes over a peer's own shard (= passes over the whole data set by all peers together); "
            "ours: the epoch at which the last peer reached the target",
            "samples_per_s_total: sum of every peer's own average rate over its run",
            "same model, seeded init, shard per rank, per-worker batch, optimizer and lr in every mode",
            ("each peer stopped at its own target (gossip_sgd target_accuracy)" if a.stop_at_target else
             "every peer trains until all have reached the target (then the bench stops them); "
             "--stop-at-target lets each stop at its own"),
        ]
    else:
        result["goal"] = "adpsgd: others' steps/s with the straggler >= 0.85x without"
        result["notes"] = [
            f"the last peer sleeps step_delay_s = ({a.straggler:g} - 1) x its measured adpsgd step time after "
            "each step, in every mode (gossip_sgd step_delay / allreduce_baseline --step-delay)",
            "steps/s are each peer's steps / its own training elapsed_s; fixed run length, no target",
            (f"every peer/rank process was capped at {body['straggler']['cpu_cap_per_peer']} CPUs (cgroup cpu quota), "
             "so the CPU a sleeping straggler frees cannot speed up the others as it would not across machines"
             if body["straggler"]["cpu_cap_per_peer"] else
             "no CPU caps: the CPU the sleeping straggler frees speeds up the others on this shared host, "
             "which can push the ratio above 1"),
        ]
    result["loadavg_before"] = load_before
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["cpus"] = os.cpu_count()
    result["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result) if a.json else json.dumps(result, indent=2))
    if a.straggler:
        return 0
    return 0 if all((v or {}).get("reached_target") for v in body["modes"].values()) else 1
