"""`peer bench pipeline`: a 4-stage swarm pipeline of real daemons, CPU-capped so the whole run fits in two cores.

N daemons (default 6) host `trainers.swarm_pipeline`: peer r serves stage r for r < 4, the others take the
stage with the least capacity, and every peer drives microbatches until stopped. With `--netns` (the default
as root) each daemon has its own network namespace on one virtual LAN; every daemon is capped at
`--cpus`/N CPUs (cgroup `cpu.max`, or v1 `cpu.cfs_quota_us` where the cpu controller lives there:
peer/bench/cpu_caps.py), so a peer's CPU is its own, as on separate small machines; in 10 ms periods, so a peer's
measured speed (the bound below) is what its cap sustains, not a quota's burst after idling (cpu_caps.py).

Phases, on the bench's clock from the moment every driver has finished a microbatch: warm-up, then a baseline
window (throughput of all drivers; the slowest-stage bound from the stage map's announced, measured
samples/s; their ratio is the efficiency), then a kill -9 of one peer of a stage that has two, and the time
until the survivors' throughput over a `--window` is back within 10% of the baseline (scaled down by the
bound's drop, if losing the peer lowered the bound). The figures are computed in peer/bench/pipeline_figures.py.
Then a survivor's validation loss against one process trained on as many samples (`loss_vs_reference`,
peer/bench/pipeline_reference.py), and a stage's peak memory against a plain torch loop's (`memory_vs_torch`,
peer/bench/pipeline_memory.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass

from peer.bench import pipeline_memory
from peer.bench import pipeline_reference as reference
from peer.bench.cpu_caps import SPEED_PERIOD_US, CpuCaps
from peer.bench.hosts import DAEMON_PORT, netns_refused, run_root
from peer.bench.pipeline_figures import (Poll, busy_shares, bytes_per_microbatch, capacities_over, driver_of,
                                         median_deadline, rate, recovery, session_bytes_out, total)
from peer.testing.netns import virtual_lan
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm

STAGES = 4  # the benchmark: 4 stages
POLL_S = 0.5  # seconds between status rounds: fine enough for a recovery measured in seconds, cheap for capped daemons
START_TIMEOUT_S = 300.0  # start-up (imports, profiling and planning under a third of a CPU each) to the first microbatches
WARMUP_SHARE, BASELINE_SHARE = 0.15, 0.35  # of --duration; the rest follows the kill
EVALUATE_TIMEOUT_S = 300.0  # a pass of the validation microbatches through 4 CPU-capped stages, after the run
STATUS_TIMEOUT_S = 10.0  # a capped daemon busy computing can take a while to answer its control socket


@dataclass(frozen=True)
class Model:
    """The built-in char transformer, sized so compute dominates the calls' overhead under a third of a CPU
    (a stage ~60 ms per microbatch uncapped on this VM) and a run takes ~3 minutes."""

    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 8
    block: int = 64
    microbatch: int = 8
    batch_size: int = 32  # samples per optimizer step of a stage, swarm-wide
    dropout: float = 0.1
    lr: float = 1e-3


TINY = Model(d_model=32, n_layers=4, n_heads=2, block=16, microbatch=8, batch_size=16)  # --tiny: plumbing checks


def _options(m: Model, a) -> dict:
    return {**asdict(m), "stages": STAGES, "samples": 0, "in_flight": a.in_flight, "forward_codec": a.forward_codec,
            "backward_codec": a.backward_codec, "seed": a.seed}


class Poller:
    """Every daemon's status, asked side by side, kept as `Poll`s; a killed daemon is no longer asked."""

    def __init__(self, swarm: LocalSwarm, t0: float):
        self.swarm, self.t0 = swarm, t0
        self.dead: set[int] = set()
        self.polls: list[Poll] = []
        self._pool = ThreadPoolExecutor(len(swarm.daemons))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def poll(self) -> Poll:
        def one(i: int):
            d = self.swarm.daemons[i]
            if i in self.dead:
                return None
            d.check_alive()
            return d.try_status(timeout=STATUS_TIMEOUT_S)
        t = self.now()
        sts = list(self._pool.map(one, range(len(self.swarm.daemons))))
        p = Poll(t + (self.now() - t) / 2, sts)
        self.polls.append(p)
        return p

    def until(self, t_end: float) -> None:
        while self.now() < t_end:
            t = self.now()
            self.poll()
            time.sleep(max(0.0, POLL_S - (self.now() - t)))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def daemon_config(name: str, i: int, lan, options: dict):
    """Daemon i's config in swarm `name`: on 127.0.0.1 with mDNS, or in its namespace joining the others."""
    if lan is None:
        return swarm_config(swarm=name, trainer="trainers.swarm_pipeline", options=options)
    join = [f"{h.ip}:{DAEMON_PORT}" for h in lan.hosts if h is not lan.hosts[i]]
    return swarm_config(swarm=name, listen=f"0.0.0.0:{DAEMON_PORT}", mdns=False, interfaces=[], join=join,
                        trainer="trainers.swarm_pipeline", options=options)


def _start(swarm: LocalSwarm, a, lan, caps, options: dict) -> None:
    name = unique_swarm("bp")
    for i in range(a.daemons):
        cfg = daemon_config(name, i, lan, options)
        d = swarm.start(f"p{i}", config=cfg, host=lan.hosts[i] if lan else None,
                        env={**rank_env(i, a.daemons), "OMP_NUM_THREADS": "1"})
        if caps is not None:
            caps.add(i, d.pid)


def _ready(p: Poll) -> bool:
    """Every driver has finished a microbatch and every stage has a peer."""
    if any(st is None for st in p.statuses):
        return False
    for st in p.statuses:
        if (st.get("trainer") or {}).get("state", "").startswith("failed"):
            raise RuntimeError(f"a trainer failed: {st['trainer'].get('state')}")
    return all(driver_of(st).get("done", 0) > 0 for st in p.statuses) and all(
        s["peers"] for s in p.statuses[0]["pipeline"]["stage_map"])


def _victim(st: dict, peer_index: dict[str, int]) -> tuple[int, int] | None:
    """(daemon index, stage) of the peer to kill: a stage with exactly two peers if there is one (the issue's
    case: the stage is left with one), else the most crowded; among those the one with the most capacity
    (losing a peer there lowers the bound least); in it, the peer started last."""
    crowded = [s for s in st["pipeline"]["stage_map"] if len(s["peers"]) >= 2]
    if not crowded:
        return None
    s = max(crowded, key=lambda s: (len(s["peers"]) == 2, len(s["peers"]), s["capacity"]))
    return max(peer_index[p["peer_id"]] for p in s["peers"]), s["stage"]


def _peers_per_stage(st: dict) -> list[int]:
    return [len(s["peers"]) for s in sorted(st["pipeline"]["stage_map"], key=lambda s: s["stage"])]


def measure(a, swarm: LocalSwarm, caps) -> dict:
    t_launch = time.monotonic()
    poller = Poller(swarm, t_launch)
    try:
        while True:
            p = poller.poll()
            if _ready(p):
                break
            if poller.now() > START_TIMEOUT_S:
                seen = [(driver_of(st).get("done"), _peers_per_stage(st) if st and st.get("pipeline") else None)
                        for st in p.statuses]
                raise TimeoutError(f"not every driver finished a microbatch within {START_TIMEOUT_S:.0f}s: "
                                   f"(done, peers per stage) by daemon {seen}")
            time.sleep(POLL_S)
        t_ready = p.t
        st0 = p.statuses[0]
        peer_index = {st["peer_id"]: i for i, st in enumerate(p.statuses)}
        everyone = list(range(a.daemons))
        t_base0 = t_ready + WARMUP_SHARE * a.duration
        t_base1 = t_base0 + BASELINE_SHARE * a.duration
        poller.until(t_base1)
        base = [q for q in poller.polls if t_base0 <= q.t <= t_base1]
        before = rate(poller.polls, everyone, t_base0, t_base1)
        viewer = 0
        caps_before = capacities_over(poller.polls, viewer, STAGES, t_base0, t_base1)
        bound = min(caps_before) if caps_before else None
        last = base[-1]
        mb0, mb1 = total(base[0], everyone, "done"), total(last, everyone, "done")
        by0 = [session_bytes_out(s) for s in base[0].statuses]
        by1 = [session_bytes_out(s) for s in last.statuses]
        measured_bytes = (round((sum(by1) - sum(by0)) / (mb1 - mb0))
                          if None not in by0 + by1 and mb1 and mb0 is not None and mb1 > mb0 else None)
        retried_before = total(last, everyone, "retried")
        kill: dict = {"done": False}
        survivors = everyone
        recovery_s = None
        if not a.no_kill:
            victim = _victim(last.statuses[viewer], peer_index)
            if victim is None:
                kill["reason"] = f"no stage has two peers (peers per stage {_peers_per_stage(last.statuses[0])})"
            else:
                vi, vstage = victim
                viewer = 0 if vi != 0 else 1
                survivors = [i for i in everyone if i != vi]
                killed_in_flight = driver_of(last.statuses[vi]).get("in_flight")
                t_kill = poller.now()
                swarm.daemons[vi].kill()
                poller.dead.add(vi)
                t_end = t_kill + (1 - WARMUP_SHARE - BASELINE_SHARE) * a.duration
                poller.until(t_end)
                window = min(a.window, (t_end - t_kill) / 3)
                caps_after = capacities_over(poller.polls, viewer, STAGES, (t_kill + t_end) / 2, t_end)
                bound_after = min(caps_after) if caps_after else None
                scale = min(1.0, bound_after / bound) if bound and bound_after else 1.0
                reference = before * scale if before else None
                recovery_s, trace = recovery(poller.polls, survivors, t_kill, reference, window) if reference else (None, [])
                kill = {
                    "done": True, "daemon": vi, "stage": vstage, "at_s": round(t_kill - t_ready, 2),
                    "killed_driver_in_flight": killed_in_flight,
                    "samples_per_s_after": _r(rate(poller.polls, survivors, (t_kill + t_end) / 2, t_end)),
                    "bound_after_samples_per_s": _r(bound_after),
                    "stage_capacity_after": [_r(c) for c in caps_after] if caps_after else None,
                    "reference_samples_per_s": _r(reference), "window_s": round(window, 2),
                    "min_window_samples_per_s": min((r for _, r in trace), default=None),
                    "trace": trace,
                }
        end = poller.poll()
        final = [end.statuses[i] for i in survivors]
        dead_last = [last.statuses[i] for i in everyone if i not in survivors]  # a killed driver as last seen
        drivers = [driver_of(st) for st in final + dead_last]
        figures = {
            "samples_per_s": _r(before),
            "slowest_stage_bound_samples_per_s": _r(bound),
            "efficiency": round(before / bound, 3) if before and bound else None,
            "done": sum(d.get("done", 0) for d in drivers),
            "done_by_survivors": sum(driver_of(st).get("done", 0) for st in final),
            "retried": sum(d.get("retried", 0) for d in drivers),
            "retried_after_kill": sum(d.get("retried", 0) for d in drivers) - (retried_before or 0),
            "resent_calls": sum(d.get("resent", 0) for d in drivers),
            "lost": sum(d.get("failed", 0) for d in drivers),
            "failures": [f for d in drivers for f in d.get("failures", [])][:10],
            "in_flight_at_end": sum(driver_of(st).get("in_flight", 0) for st in final),
            "recovery_s": _r(recovery_s),
            "request_deadline_s": median_deadline(final),
            "stage_capacity_samples_per_s": [_r(c) for c in caps_before] if caps_before else None,
            "compute_busy_by_daemon": busy_shares(poller.polls, everyone, t_base0, t_base1),
            "peers_per_stage": _peers_per_stage(last.statuses[0]),
            "cuts": st0["pipeline"]["cuts"],
            "session_bytes_out_per_microbatch_measured": measured_bytes,
            "server_refused": _refusals(final),
            "kill": kill,
            "phases_s": {"startup": round(t_ready, 1), "warmup": round(t_base0 - t_ready, 1),
                         "baseline": round(t_base1 - t_base0, 1), "after_kill": round(end.t - t_base1, 1)},
            "cpu_throttled_s": [_r(caps.throttled_s(i)) for i in range(a.daemons)] if caps else None,
        }
        return figures
    finally:
        poller.close()


def _refusals(statuses: list[dict | None]) -> dict:
    out: dict = {}
    for st in statuses:
        for code, n in (((st or {}).get("pipeline") or {}).get("server", {}).get("refused") or {}).items():
            out[code] = out.get(code, 0) + n
    return out


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def run(args) -> int:
    if args.daemons < STAGES + (0 if args.no_kill else 1):
        print(f"--daemons must be at least {STAGES} (and {STAGES + 1} to kill a peer of a stage that has two)",
              file=sys.stderr)
        return 2
    if args.duration <= 0 or args.window <= 0 or args.cpus <= 0 or args.in_flight < 0:
        print("--duration, --window and --cpus must be positive, --in-flight at least 0", file=sys.stderr)
        return 2
    netns = not args.no_netns
    if netns_refused(netns):
        return 2
    model = TINY if args.tiny else Model()
    options = _options(model, args)
    support = CpuCaps.probe()
    cpus_each = round(args.cpus / args.daemons, 3)
    use_caps = support.mechanism is not None and not args.no_caps
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    with ExitStack() as stack:
        root = run_root(stack, args.logs, "peertrain-pipeline-")
        lan = stack.enter_context(virtual_lan(args.daemons, prefix="ptp", subnet="10.77.16")) if netns else None
        caps = stack.enter_context(CpuCaps(args.daemons, cpus_each, support, period_us=SPEED_PERIOD_US)) \
            if use_caps else None
        swarm = stack.enter_context(LocalSwarm(root))
        _start(swarm, args, lan, caps, options)
        figures = measure(args, swarm, caps)
        live = [d for i, d in enumerate(swarm.daemons) if i != figures["kill"].get("daemon")]
        evaluated = live[0].command("evaluate", timeout=EVALUATE_TIMEOUT_S)
        # the drivers kept training until now: the samples the evaluated model has seen are those done by now
        done_now = sum(driver_of(d.try_status(timeout=STATUS_TIMEOUT_S)).get("done", 0) for d in live)
    samples = (figures["done"] - figures.pop("done_by_survivors") + done_now) * model.microbatch
    figures.update(reference.loss_vs_reference(evaluated.get("val_loss"), options, samples))
    # the 67 M-parameter stage (peer/bench/pipeline_memory.py), ~1 minute and 2 GB: not for --tiny's checks
    figures["memory"] = None if args.tiny else pipeline_memory.figures("adam")
    figures["memory_vs_torch"] = None if args.tiny else figures["memory"]["memory_vs_torch"]
    act = [model.microbatch, model.block, model.d_model]
    tokens = model.microbatch * model.block * 8  # int64 token ids
    out = {
        **figures,
        "bytes_per_microbatch": bytes_per_microbatch(act, STAGES, args.forward_codec, args.backward_codec,
                                                     tokens, tokens),
        "daemons": args.daemons, "stages": STAGES, "in_flight_per_driver": args.in_flight, "netns": netns,
        "cpu_cap": {"mechanism": support.mechanism if use_caps else None,
                    "cpus_each": cpus_each if use_caps else None, "cpus_total": args.cpus if use_caps else None,
                    "period_us": SPEED_PERIOD_US if use_caps else None,
                    "note": ("off (--no-caps)" if args.no_caps else support.reason) if use_caps or args.no_caps
                    else f"UNCAPPED: {support.reason}"},
        "model": {"name": "built-in char transformer (Shakespeare)", **asdict(model)},
        "goals": {"efficiency_at_least_0.8": None if figures["efficiency"] is None else figures["efficiency"] >= 0.8,
                  "loss_vs_reference_at_most_1.02": (None if figures["loss_vs_reference"] is None
                                                     else figures["loss_vs_reference"] <= 1.02),
                  "memory_vs_torch_at_most_1.15": (None if figures["memory_vs_torch"] is None
                                                   else figures["memory_vs_torch"] <= 1.15),
                  "recovery_under_2x_deadline": (None if figures["recovery_s"] is None or not figures["request_deadline_s"]
                                                 else figures["recovery_s"] < 2 * figures["request_deadline_s"]),
                  "zero_lost": figures["lost"] == 0},
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0 if out["samples_per_s"] is not None else 1
