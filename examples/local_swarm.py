"""What every framework example shares: run the same script as a swarm of local peers and as one process.

`compare(script, ...)` starts, as subprocesses of `script`:
  - `--reference`: one process training on all the data with `peers` times the batch (what DDP over `peers`
    ranks computes), for the same number of optimizer steps, so both see the same total samples;
  - `--worker I` for I in 0..peers-1: each runs its own daemon inside it (`peertrain.start`, no mDNS), the
    first listening on a free loopback port and the others joining it, and trains on its shard.
Each writes a JSON result and its final parameters; `compare` prints one JSON summary: the held-out figure of
each peer and of the reference, the worst gap in points, and how far the peers' models are apart (the largest
distance to their mean, relative to the mean's norm).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

RUN_TIMEOUT_S = 900.0  # one example's whole run on a 2-core machine takes a few minutes at most
# The daemons' settings for peers on one host (what `peer local` runs): they dial the loopback addresses they
# learn of one another and allow many connections from one IP, which the defaults, made for the internet, refuse.
LOCAL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_swarm(args):
    """The worker's own daemon, inside its process (the example's `--worker` path calls this)."""
    import peertrain

    join = [args.join] if args.join else None
    return peertrain.start(LOCAL_CONFIG, home=args.home, listen=args.listen, join=join, swarm=args.swarm_name,
                           mdns=False)


def end_together(args) -> None:
    """A barrier among the workers before they settle: on these tiny models a peer slowed by a busy machine
    ends seconds after the others, hundreds of steps, and settling (which goes on while a partner moves us)
    cannot see a partner whose last steps barely move. A real run's peers end minutes apart at worst and
    settle on their own (WrappingOptimizer.settle)."""
    _barrier(args, "done")


def start_together(args) -> None:
    """A barrier among the workers (files in the run's folder), so that they start their steps within
    milliseconds of each other: on these tiny models hundreds of steps fit in the second that daemons take to
    see each other, and a comparison at equal steps wants peers that train side by side. (A real run needs no
    such thing: a late peer joins from its partners' model.)"""
    _barrier(args, "ready")


def stay_for_the_late_peer(args) -> None:
    """With `--late-peer`: the early peers keep their daemons up (serving their model) until the late peer has
    trained, so it always finds them to join from: on a loaded machine it started after they had finished
    and trained alone. The late peer says it is done; a bounded wait."""
    if args.worker is None or not (args.late or args.late_peer):
        return
    folder = Path(args.out).parent
    if args.late:  # the late peer itself (its flag is --late, the early ones' --late-peer)
        (folder / "late-done").touch()
        return
    _wait_for(lambda: (folder / "late-done").exists(), "the late peer to train", timeout=RUN_TIMEOUT_S)


def _barrier(args, name: str) -> None:
    if args.worker is None or args.late:
        return
    folder = Path(args.out).parent
    (folder / f"{name}-{args.worker}").touch()
    deadline = time.monotonic() + 120
    while sum(1 for _ in folder.glob(f"{name}-*")) < args.peers - bool(args.late_peer):
        if time.monotonic() > deadline:
            raise SystemExit(f"[example] the other peers did not reach '{name}' within 120s")
        time.sleep(0.01)


WORKER_FLAGS = {"peers", "worker", "reference", "home", "listen", "join", "swarm_name", "out", "late", "late_peer"}


def parser(doc: str, *, steps: int, batch: int, lr: float, batch_help: str = "samples per step of each peer"):
    """An example's command line: its training flags (`--steps`, `--batch`, `--lr`, with its defaults), and the
    flags `compare` gives the script's two other roles."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps of each peer and of the reference "
                                                            f"(default {steps})")
    p.add_argument("--batch", type=int, default=batch, help=f"{batch_help} (default {batch})")
    p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr})")
    add_worker_arguments(p)
    return p


def passthrough(args) -> list[str]:
    """The example's own flags as parsed, for its workers and reference to train alike."""
    out: list[str] = []
    for key, value in vars(args).items():
        if key in WORKER_FLAGS or value is None or value is False:
            continue
        out += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def add_worker_arguments(parser) -> None:
    """The flags `compare` passes to the script's two other roles."""
    parser.add_argument("--peers", type=int, default=3, help="local peers to train with (default 3)")
    parser.add_argument("--worker", type=int, default=None, help=argparse_hidden())
    parser.add_argument("--reference", action="store_true", help=argparse_hidden())
    parser.add_argument("--home", help=argparse_hidden())
    parser.add_argument("--listen", default="127.0.0.1:0", help=argparse_hidden())
    parser.add_argument("--join", default="", help=argparse_hidden())
    parser.add_argument("--swarm-name", default="", help=argparse_hidden())
    parser.add_argument("--out", help=argparse_hidden())
    parser.add_argument("--late", action="store_true", help=argparse_hidden())
    parser.add_argument("--late-peer", action="store_true",
                        help="start the last peer once the others train: it joins from their model (a late joiner)")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def write_result(path: str, result: dict, params) -> None:
    """A role's result: JSON, and its final parameters as one flat float64 vector (for the agreement)."""
    import torch

    flat = torch.cat([p.detach().reshape(-1).double().cpu() for p in params])
    torch.save(flat, f"{path}.pt")
    Path(path).write_text(json.dumps(result))


def compare(script: str, args, *, figure: str = "accuracy", higher_is_better: bool = True, ranks: int = 1) -> dict:
    """Run `script` as `args.peers` local peers and as one reference process, with the flags it was given;
    print and return the summary. With `--late-peer` the last peer starts only once the others have started
    training, and joins from them; with `ranks` > 1 each peer is a torchrun job of that many gloo ranks (one
    peer: peertrain/distributed.py)."""
    import torch

    peers, late_peer, own = args.peers, args.late_peer, passthrough(args)
    if peers < 2:
        raise SystemExit("--peers: a swarm needs at least 2 peers")
    work = Path(tempfile.mkdtemp(prefix="peertrain-example-"))
    name, first = f"example-{uuid.uuid4().hex[:8]}", f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = {"reference": _start(script, own + ["--reference", "--peers", str(peers)], work, "reference", env)}
    for i in range(peers):
        late = late_peer and i == peers - 1
        role = ["--worker", str(i), "--peers", str(peers), "--home", str(work / f"peer{i}"), "--swarm-name", name,
                "--listen", first if i == 0 else "127.0.0.1:0"] + ([] if i == 0 else ["--join", first])
        role += ["--late"] if late else ["--late-peer"] if late_peer else []
        if late:
            _wait_for(lambda: sum(1 for _ in work.glob("ready-*")) == peers - 1, "the first peers to train")
        launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                                          "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        procs[f"peer{i}"] = _start(script, own + role, work, f"peer{i}",
                                   {**env, "PEERTRAIN_RANK": str(i), "PEERTRAIN_WORLD": str(peers)}, launcher)
    print(f"[example] training {peers} peers and the single-process reference; logs in {work}", file=sys.stderr)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for role, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise SystemExit(f"[example] {role} did not finish in {RUN_TIMEOUT_S:.0f}s; its log: {work / role}.log")
        if proc.returncode != 0:
            for p in procs.values():
                p.kill()
            tail = (work / f"{role}.log").read_text()[-3000:]
            raise SystemExit(f"[example] {role} failed (exit {proc.returncode}); the end of its log:\n{tail}")
    results = {role: json.loads((work / f"{role}.json").read_text()) for role in procs}
    ref = results["reference"][figure]
    swarm = [results[f"peer{i}"][figure] for i in range(peers)]
    models = torch.stack([torch.load(work / f"peer{i}.json.pt") for i in range(peers)])
    mean = models.mean(0)
    spread = float((models - mean).norm(dim=1).max() / mean.norm())
    gaps = [(ref - v) if higher_is_better else (v - ref) for v in swarm]
    summary = {"figure": figure, "single_process": ref, "peers": swarm, "worst_gap": round(max(gaps), 4),
               "models_apart": round(spread, 5), "steps": results["peer0"].get("steps"),
               "joined_at_step": [results[f"peer{i}"].get("joined_at_step") for i in range(peers)],
               "seconds": {role: r.get("seconds") for role, r in results.items()}, "logs": str(work)}
    print(json.dumps(summary), flush=True)
    return summary


def _wait_for(done, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"[example] gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(0.05)


def _start(script: str, argv: list[str], work: Path, role: str, env: dict,
           launcher: list[str] | None = None) -> subprocess.Popen:
    log = open(work / f"{role}.log", "w")
    return subprocess.Popen([sys.executable, *(launcher or []), script, *argv, "--out", str(work / f"{role}.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def digits_accuracy(model, data) -> float:
    """Held-out accuracy, in percent, of a classifier of `digits()`."""
    import torch

    x, y = data.tensors
    with torch.no_grad():
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()


def digits():
    """UCI handwritten digits (8x8, 10 classes), shipped with peertrain: (train, held-out) TensorDatasets, a
    fixed 80/20 split."""
    from importlib import resources

    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    data = np.load(resources.files("trainers") / "data" / "digits.npz")
    x = torch.tensor(data["images"], dtype=torch.float32).reshape(-1, 64) / 16.0
    y = torch.tensor(data["labels"], dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])
