"""One attached process of `peer bench attach`: shares a float32 vector with its daemon and either times
blocking averages it starts (`--initiate`) or only lets its daemon serve them until `--stop-file` appears.
Prints one JSON line: the vector's sum before and after, and each timed call's seconds."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import peertrain

STOP_WAIT_S = 600.0  # a server never outlives its bench by more than this


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--home", required=True)
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--initiate", action="store_true")
    p.add_argument("--stop-file", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.from_numpy(np.random.default_rng([0, args.rank]).standard_normal(args.elements).astype(np.float32))
    with peertrain.attach(args.home, label="peer bench attach") as swarm:
        group = swarm.share("vector", {"x": x})
        initial = float(x.double().sum())
        wall, daemon, failed = [], [], []
        if args.initiate:
            swarm.wait_for_peers(1, group="vector", timeout=60)
            ok, tries = 0, 0
            while ok < args.rounds + 1 and tries < 3 * (args.rounds + 1):  # the first ok one is a warm-up
                tries += 1
                t0 = time.perf_counter()
                results = swarm.average("vector")
                dt = time.perf_counter() - t0
                if not (results and results[0].ok):
                    failed.append(results[0].reason if results else "no partner")
                    time.sleep(0.1)
                    continue
                ok += 1
                if ok > 1:
                    wall.append(dt)
                    daemon.append(results[0].seconds)
        else:
            deadline = time.monotonic() + STOP_WAIT_S
            while not Path(args.stop_file).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        with group.lock:
            final = float(x.double().sum())
    print(json.dumps({"initial_sum": initial, "final_sum": final, "wall_s": wall, "daemon_s": daemon,
                      "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
