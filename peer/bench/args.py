"""Every `peer bench` command's arguments and one-line description, declared without the benches.

`peer --help` and `peer bench X --help` build their parsers from here, so this module imports nothing
heavy; a bench module (numpy, torch, trio, daemons) is imported only when that bench runs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Callable

from peertrain.swarm import AVERAGE_MODES
from protocol.cipher import CIPHERS

Parser = argparse.ArgumentParser

TRAIN_MODES = ("adpsgd", "dpsgd", "allreduce", "local", "local_q8")
TRAIN_DEGREE = 2  # gossip target degree of `peer bench train`, as configs/train-digits.toml
DIGITS_MODES = "adpsgd,dpsgd,allreduce"  # the digits models' comparison (issues before 20)
# `peer bench train --model char_transformer` (issue 20): a language model's target is its held-out loss, and
# the question is local steps vs per-step exchanges on slow links. Sized to finish in minutes on 2 cores:
LM_MODEL = "char_transformer"
LM_MODES = "local,local_q8,adpsgd,allreduce"  # local_q8: 8-bit outer exchanges with error feedback, vs local's float32
LM_MODEL_OPTIONS = {"d_model": 64, "n_layers": 2, "n_heads": 4, "block": 32}  # 110,529 parameters, 442 KB
LM_BATCH = 16  # per worker: a step is ~18 ms of compute on one core, so a 20 Mbit/s all-reduce (~0.27 s) dominates it
LM_TARGET_LOSS = 2.45  # every mode reaches it, from ln(65) = 4.17: all-reduce in 80 steps, gossip peers in 60-180
LM_MAX_STEPS = 400  # step budget per peer/rank: 2x what the slowest mode needs, so a slow run is still timed
LM_EVAL_EVERY = 10  # steps between evaluations (all-reduce's ~0.3 s steps: a 3 s resolution)
LM_EVAL_SAMPLES = 512  # the first 512 held-out windows (16k tokens, ~0.2 s): all 2,380 take 0.86 s, ~48 steps' compute
LM_INNER_STEPS = 20  # H: a float32 exchange (~0.4 s at 20 Mbit/s) hides behind a round (~0.6 s); H=10 skipped up to
#                       45% of rounds' exchanges and was slower, H=40 no faster (docs/benchmarks.md, 2026-11-26)
LM_REPEATS = 3  # a gossip run to the loss takes ~5 s, of which peers' start skew alone is up to 2 s: take a median
# A fixed ring (degree 2, as TRAIN_DEGREE): with every link alike rewiring has nothing to route around, and its
# bandwidth probes (256 KiB to each connected peer every 10 s: ~90 KB/s per peer idle, a ring 8 KB/s) weigh as much
# as this 442 KB model's 8-bit exchanges in a 5 s run: the q8/float32 bytes would measure probes, not averaging.
LM_TOPOLOGY = "ring"


def parse_size(text: str) -> int:
    """'64MiB', '1GiB', '512KiB', '1000000' -> bytes."""
    t = text.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.lower().endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def transport_arguments(p: Parser) -> None:
    p.add_argument("--size", default="64MiB", help="tensor size (e.g. 64MiB, 1GiB); default 64MiB")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds after one warm-up (default 5)")
    p.add_argument("--cipher", choices=["auto", *CIPHERS], default="auto",
                   help="session cipher (default auto: the fastest on this machine)")
    p.add_argument("--chunk", default="1MiB", help="frame size for tensor chunks (default 1MiB)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child side of the benchmark


def discovery_arguments(p: Parser) -> None:
    p.add_argument("--n", type=int, default=8, help="daemons per trial (default 8)")
    p.add_argument("--trials", type=int, default=3, help="trials; the median is reported (default 3)")
    p.add_argument("--timeout", type=float, default=60.0, help="give up on a trial after this many seconds")
    p.add_argument("--config", default=None, help="config for the daemons (default configs/local.toml)")


def average_arguments(p: Parser) -> None:
    p.add_argument("--peers", type=int, default=2, help="daemons on this host (default 2)")
    p.add_argument("--size", default="64MiB", help="float32 tensor size (e.g. 64MiB, 1GiB); default 64MiB")
    p.add_argument("--rounds", type=int, default=7,
                   help="measured exchanges after one warm-up (default 7; at most 19: a daemon reports its last 20)")
    p.add_argument("--cipher", choices=["auto", *CIPHERS], default="auto",
                   help="session cipher (default auto: the fastest on this machine)")
    p.add_argument("--chunk", default="1MiB", help="tensor chunk (frame) size (default 1MiB)")
    p.add_argument("--codec", choices=["raw", "float16", "q8"], default="raw",
                   help="gossip codec (default raw: float32 bytes as they are)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds node 0 waits before its first exchange, so the topology is complete (default 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="give up on one swarm after this many seconds")
    p.add_argument("--no-all", action="store_true", help="with more than 2 peers, skip the all-neighbours swarm")
    p.add_argument("--no-gloo", action="store_true", help="with more than 2 peers, skip the gloo all_reduce")
    p.add_argument("--no-defence", action="store_true",
                   help="daemons that never clip nor judge a partner (to measure what the defence costs)")


def gossip_arguments(p: Parser) -> None:
    p.add_argument("--n", type=int, default=8, help="daemons per topology (default 8)")
    p.add_argument("--size", default=None,
                   help="vector per peer, e.g. 16MiB (default 16MiB; 2MiB with --netns, so slow links finish in minutes)")
    p.add_argument("--topologies", default="rewired,ring,exponential,random_regular",
                   help="comma-separated kinds to run, in order (default rewired,ring,exponential,random_regular)")
    p.add_argument("--degree", type=int, default=4, help="target degree for rewired and random_regular (default 4)")
    p.add_argument("--target", type=float, default=1e-3, help="relative consensus error to reach (default 1e-3)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="give up on one topology's consensus after this many seconds (default 120)")
    p.add_argument("--settle", type=float, default=None,
                   help="start_delay of the job: seconds for the graph to form (and rewiring to settle) before "
                        "averaging (default 6; 25 with --netns, where probing slow paths and rewiring around them "
                        "takes longer: with 10 s the rewired gap was still rising)")
    p.add_argument("--mode", choices=AVERAGE_MODES, default="one",
                   help="one neighbour per round (AD-PSGD) or all (D-PSGD); default one")
    p.add_argument("--rewire-interval", type=float, default=None, help="[topology] rewire_interval (default: the daemon's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the start vectors and of random_regular")
    p.add_argument("--netns", action="store_true", help="one network namespace per daemon on a virtual LAN (needs root)")
    p.add_argument("--slow-links", type=int, default=None, metavar="K",
                   help="with --netns: hosts whose own link is slow, tbf both ways (default 2; 0 with --slow-pairs)")
    p.add_argument("--slow-pairs", type=float, default=0.0, metavar="FRAC",
                   help="with --netns: this fraction of host pairs (random, --seed) get a slow path of their own, "
                        "shaped per destination: slowness a topology can route around, unlike a slow host")
    p.add_argument("--slow-mbit", type=float, default=20.0,
                   help="with --netns: the slow rate in Mbit/s, both ways (default 20)")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="keep daemon homes and logs under DIR (default: a temp dir, removed)")
    p.add_argument("--exact-every", type=float, default=None, metavar="S",
                   help="also time the target on exact errors from group_stats cuts taken every S seconds "
                        "(default 0.5 with --netns, off otherwise: a cut copies every vector)")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run every topology R times (interleaved) and report each one's median run: a fixed "
                        "graph's luck with slow pairs depends on the random peer IDs (default 1)")
    p.add_argument("--trace", action="store_true", help="add the error trace [[seconds, error], ...] per topology")


def train_arguments(p: Parser) -> None:
    p.add_argument("--n", type=int, default=4, help="peers / ranks (default 4)")
    p.add_argument("--model", default=None,
                   help="digits_mlp (default), digits_cnn, digits_wide_mlp (default with --netns: 9.9 MB of "
                        "parameters), "
                        f"{LM_MODEL} (a language model sized {LM_MODEL_OPTIONS}: timed to a held-out loss, "
                        f"batch {LM_BATCH}, evaluated on the first {LM_EVAL_SAMPLES} held-out windows)")
    p.add_argument("--target", type=float, default=None,
                   help="held-out accuracy to reach (default 0.95; digits models)")
    p.add_argument("--target-loss", type=float, default=None,
                   help=f"held-out loss to reach instead of an accuracy (default {LM_TARGET_LOSS} for {LM_MODEL})")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated subset of {','.join(TRAIN_MODES)} (default {DIGITS_MODES}; {LM_MODES} for "
                        f"{LM_MODEL}). local: gossip_sgd mode local (--inner-steps local steps, then a DiLoCo outer "
                        "Nesterov step, lr 0.7, momentum 0.9; outer weights averaged pairwise, float32); local_q8: "
                        "the same with 8-bit outer exchanges and error feedback")
    p.add_argument("--inner-steps", type=int, default=LM_INNER_STEPS, metavar="H",
                   help=f"local modes: local steps per outer round; they evaluate at each round's end "
                        f"(default {LM_INNER_STEPS})")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"steps between evaluations (default 20; 5 for digits_wide_mlp; {LM_EVAL_EVERY} for "
                        f"{LM_MODEL}, "
                        "local modes every H unless given)")
    p.add_argument("--max-steps", type=int, default=0,
                   help=f"budget: most steps per peer/rank (default {LM_MAX_STEPS} for {LM_MODEL}; else --epochs)")
    p.add_argument("--epochs", type=float, default=0.0,
                   help="budget: most passes over a peer's own shard (default: twice the model recipe's, so a "
                        "peer slower than the recipe is still timed)")
    p.add_argument("--batch-size", type=int, default=0,
                   help=f"per-worker batch (default: the model's recipe; {LM_BATCH} for {LM_MODEL})")
    p.add_argument("--lr", type=float, default=0.0, help="learning rate (default: the model's recipe)")
    p.add_argument("--degree", type=int, default=TRAIN_DEGREE,
                   help=f"gossip target degree of the rewired topology (default 2, as configs/train-digits.toml; "
                        f"{LM_MODEL}: a fixed {LM_TOPOLOGY}, no bandwidth probes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="raw", choices=["raw", "float16", "q8"], help="gossip tensor codec (default raw)")
    p.add_argument("--trainer", default="trainers.gossip_sgd",
                   help="trainer module our daemons host (a gossip_sgd variant taking the same options)")
    p.add_argument("--repeats", type=int, default=0,
                   help=f"runs per mode, interleaved; medians are reported (default 1; {LM_REPEATS} for {LM_MODEL})")
    p.add_argument("--netns", action="store_true", help="one network namespace per peer/rank (needs root)")
    p.add_argument("--slow-link", type=float, default=0.0, metavar="MBIT",
                   help="with --netns: limit the last host's link to MBIT (tbf, both directions)")
    p.add_argument("--link-mbit", type=float, default=0.0, metavar="MBIT",
                   help="with --netns: limit every host's link to MBIT (tbf, both directions; no added latency: "
                        "this kernel has no netem)")
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


def wan_arguments(p: Parser) -> None:
    p.add_argument("--n", type=int, default=4, help="peers / ranks, one network namespace each (default 4)")
    p.add_argument("--link-mbit", type=float, default=0.0, metavar="MBIT",
                   help="every host's link, tbf both ways (default 0: chosen so that one float32 exchange of the "
                        "big model takes --ratio times one outer round's compute, from a measured step)")
    p.add_argument("--ratio", type=float, default=5.0,
                   help="float32 exchange ÷ outer round compute the chosen link gives (default 5, issue 41's)")
    p.add_argument("--big-model", default="lm_100m", help="model of the bytes, wall and utilization runs (default lm_100m)")
    p.add_argument("--big-model-options", type=json.loads, default={}, help="its sizes, JSON (default: the preset)")
    p.add_argument("--big-modes", default="allreduce,adpsgd,local,local_q8,local_sparse",
                   help="modes run on the big model, in order (default allreduce,adpsgd,local,local_q8,local_sparse; "
                        "'' skips; local_sparse: each round's update, 64 of every 4096 values, pushed to every peer)")
    p.add_argument("--big-batch", type=int, default=2, help="per-peer batch of the big model (default 2)")
    p.add_argument("--big-inner-steps", type=int, default=1,
                   help="H of the big model's local modes (default 1: a round is one step, so the link a ratio "
                        "of 5 asks for stays near 100 Mbit/s on this CPU)")
    p.add_argument("--big-rounds", type=int, default=4, help="outer rounds per peer of local modes and AD-PSGD's "
                                                             "steps (x H) on the big model (default 4)")
    p.add_argument("--big-allreduce-steps", type=int, default=2, help="all-reduce steps on the big model (default 2)")
    p.add_argument("--small-model", default="lm_14m", help="model of the loss curves (default lm_14m)")
    p.add_argument("--small-model-options", type=json.loads, default={}, help="its sizes, JSON (default: the preset)")
    p.add_argument("--small-modes", default="local,allreduce,local_q8,adpsgd,local_sparse",
                   help="modes run to the target on the small model (default local,allreduce,local_q8,adpsgd,"
                        "local_sparse; '' skips)")
    p.add_argument("--small-batch", type=int, default=8, help="per-peer batch of the small model (default 8)")
    p.add_argument("--small-inner-steps", type=int, default=10, help="H of its local modes (default 10)")
    p.add_argument("--small-steps", type=int, default=80, help="most steps per peer of its gossip modes (default 80)")
    p.add_argument("--small-allreduce-steps", type=int, default=30, help="most all-reduce steps on it (default 30)")
    p.add_argument("--target-loss", type=float, default=2.7,
                   help="held-out loss the small model is timed to (default 2.7: one process of lm_14m reaches it "
                        "after ~30k tokens, 2.55 after 80k, from ln(65) = 4.17)")
    p.add_argument("--eval-every", type=int, default=5,
                   help="steps between evaluations of the small model's all-reduce and AD-PSGD (default 5; local "
                        "modes evaluate at round ends)")
    p.add_argument("--eval-samples", type=int, default=64,
                   help="held-out windows the small model is evaluated on (default 64; the big one: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="give up on one run after this many seconds")
    p.add_argument("--keep", default="", help="keep homes and logs under this directory")


def attach_arguments(p: Parser) -> None:
    p.add_argument("--size", default="64MiB", help="float32 vector averaged per exchange (default 64MiB)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed exchanges per swarm after one warm-up (default 7; at most 19)")
    p.add_argument("--repeat", type=int, default=2, help="hosted and attached swarms each, alternating (default 2)")
    p.add_argument("--cipher", choices=["auto", *CIPHERS], default="auto", help="session cipher (default auto)")
    p.add_argument("--chunk", default="1MiB", help="tensor chunk (frame) size (default 1MiB)")
    p.add_argument("--ranks", type=int, default=2,
                   help="processes per host in the bytes-per-host comparison (0 or 1: skip it; default 2)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per process there (default 600)")
    p.add_argument("--average-every", type=int, default=50,
                   help="steps between averaging rounds there (default 50: a round ends before the next begins, "
                        "so rounds are not skipped as busy)")
    p.add_argument("--timeout", type=float, default=180.0, help="give up on one swarm after this many seconds")


def hostile_arguments(p: Parser) -> None:
    p.add_argument("--classes", default="",
                   help="comma-separated attack classes to run, in order (default: all, as listed by "
                        "`python -m peer.testing.attacks --help`)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="give up if the honest peer has not averaged with the victim after this many seconds")


def byzantine_arguments(p: Parser) -> None:
    p.add_argument("--n", type=int, default=8, help="daemons per swarm, honest and lying (default 8)")
    p.add_argument("--fractions", default="1/8,1/4",
                   help="shares of the daemons that lie, comma-separated (default 1/8,1/4; at least one liar each)")
    p.add_argument("--attacks", default="",
                   help="comma-separated attacks (default: all of peer.testing.byzantine.ATTACKS, in order)")
    p.add_argument("--topologies", default="rewired,two_cliques",
                   help="comma-separated topology kinds (default rewired,two_cliques)")
    p.add_argument("--degree", type=int, default=3, help="target degree of the rewired topology (default 3)")
    p.add_argument("--steps", type=int, default=300,
                   help="steps every honest peer trains; accuracy is read at this step (default 300: ~97%% without "
                        "attack)")
    p.add_argument("--eval-every", type=int, default=50, help="honest peers' steps between evaluations (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the shards (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on one swarm after this many seconds")
    p.add_argument("--no-defence", action="store_true",
                   help="every honest daemon with the defence switched off (the bench-only switch): the figures "
                        "without it")
    p.add_argument("--no-cost", action="store_true",
                   help="skip the no-attack runs with the defence off (no_attack_cost_points)")
    p.add_argument("--lm", action="store_true",
                   help="also the char transformer with local steps, at the smallest fraction on the first topology")
    p.add_argument("--lm-steps", type=int, default=200, help="steps every honest peer of the LM runs trains (default 200)")
    p.add_argument("--exchange-size", default="64MiB",
                   help="vector of the exchange-time comparison, defence on vs off (default 64MiB; 0: skip it)")
    p.add_argument("--exchange-rounds", type=int, default=7, help="timed exchanges per swarm there (default 7)")
    p.add_argument("--exchange-repeat", type=int, default=2,
                   help="swarms with the defence on and off each, interleaved (default 2)")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="keep daemon homes and logs under DIR (default: a temp dir, removed)")


def pipeline_arguments(p: Parser) -> None:
    p.add_argument("--daemons", type=int, default=6,
                   help="stage peers, one daemon each (default 6: 4 stages, two of them with 2 peers; at least 5 "
                        "to kill a peer of a stage that has two)")
    p.add_argument("--duration", type=float, default=150.0,
                   help="seconds measured once every driver has finished a microbatch: 15%% warm-up, 35%% baseline, "
                        "the rest after the kill (default 150; start-up adds ~30-60 s)")
    p.add_argument("--window", type=float, default=10.0,
                   help="seconds of throughput averaged when timing the recovery after the kill (default 10: a "
                        "microbatch is 8 samples, so a shorter window at ~13 samples/s swings by more than 10%%)")
    p.add_argument("--cpus", type=float, default=2.0,
                   help="CPUs the whole swarm gets: each daemon is capped at CPUS/daemons, or at its --shares of "
                        "them with --uneven (default 2)")
    p.add_argument("--no-caps", action="store_true", help="do not cap the daemons' CPU (cgroup cpu.max)")
    p.add_argument("--no-netns", action="store_true",
                   help="daemons on 127.0.0.1 instead of one network namespace each (no root needed)")
    p.add_argument("--no-kill", action="store_true", help="skip the kill -9 phase (throughput and bound only)")
    p.add_argument("--in-flight", type=int, default=None,
                   help="microbatches each driver keeps moving (default 2: with 6 drivers, 12 in all, fewer than a "
                        "server's [pipeline] max_queue, so no call is refused as busy; 0: the trainer's 2 x stages; "
                        "with --codec, default 1)")
    p.add_argument("--forward-codec", choices=["raw", "float16", "q8"], default="raw",
                   help="activations on the wire (default raw)")
    p.add_argument("--backward-codec", choices=["raw", "float16", "q8"], default="raw",
                   help="gradients on the wire (default raw)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (d_model 32, 4 blocks): checks the plumbing fast")
    p.add_argument("--seed", type=int, default=0,
                   help="model and data seed; with --churn also which peers are killed (default 0)")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="keep daemon homes and logs under DIR (default: a temp dir, removed)")
    b = p.add_argument_group(
        "a model bigger than one host (issue 28)",
        "--big starts --daemons daemons (6 by default), one stage each, each in a memory cgroup of --memory-mib "
        "MiB with [pipeline] memory_mib the same, training 42 residual blocks of 3072² (397 M parameters: 5.9 "
        "GiB with gradients and Adam's moments) on the digits; every daemon drives --samples samples, "
        "--in-flight (default 1) at once. Reports "
        "model_mib, memory_cap_mib, max_daemon_rss_mib, samples_per_s, efficiency against the slowest stage's "
        "bound, lost and duplicate_gradients. Needs root and memory cgroups (v1 or v2); ~12 GB of RAM in all, ~5 minutes on 2 CPUs.")
    b.add_argument("--big", action="store_true", help="train a model bigger than any one daemon's memory cap")
    b.add_argument("--big-model", default="trainers.pipeline.wide:big_bench", metavar="FACTORY",
                   help="the model factory --big trains (default trainers.pipeline.wide:big_bench; "
                        "trainers.pipeline.wide:issue_235m is issue 39's 235 M-parameter model, for 4 daemons at "
                        "--memory-mib 1800)")
    b.add_argument("--memory-mib", type=int, default=1960,
                   help="each daemon's memory cap and [pipeline] memory_mib (default 1960: the model is 3.1x it)")
    m = p.add_argument_group(
        "a stage's memory against plain torch (issue 39)",
        "--memory runs a stage of four 4096² blocks (67 M parameters) twice, in fresh processes: as a plain torch "
        "loop and as a pipeline stage served as the daemon serves it, with Adam and with SGD; reports each one's "
        "peak resident memory, memory_vs_torch (their ratio) and the plan's estimate against the measured peak. "
        "No daemons; ~1 minute and ~2 GB of RAM. The plain run reports the Adam figures too, under `memory`.")
    m.add_argument("--memory", action="store_true", help="compare a stage's peak memory with a plain torch loop's")
    c = p.add_argument_group(
        "codecs compared (issue 28)",
        "--codec runs, for each codec named (raw always, as the reference), a fresh swarm of 4 daemons, one per "
        "stage, training the same model (one block per stage: the same cut every run; no dropout) from the same "
        "seed on the same data, the codec used for activations and gradients alike. Each driver drives "
        "--samples samples; then every driver's validation loss through the pipeline is asked for. Reported per "
        "codec: the validation loss and its gap to raw's, session bytes out per microbatch and their ratio to "
        "raw's, samples/s, microbatches done and failed; and `recommended`: the codec with the fewest bytes whose "
        "loss is within --tolerance of raw's. With one driver and one microbatch in flight (the defaults) nothing "
        "depends on timing, so a gap is the codec's alone. ~1 minute per codec on 2 CPUs. --daemons, --duration, "
        "--window, --no-kill, --forward-codec and --backward-codec do not apply.")
    c.add_argument("--codec", default=None, metavar="C,C,...",
                   help="compare these codecs (raw, float16, q8; one or a comma list), e.g. --codec raw,float16,q8")
    c.add_argument("--samples", type=int, default=None,
                   help="samples each driver drives (--big: default 96; --codec and --liar: default 1600: 200 microbatches of "
                        "8, 50 optimizer steps of 32, ~40 s; the loss is still falling, so a codec that slows "
                        "learning shows)")
    c.add_argument("--drivers", type=int, default=1,
                   help="daemons that drive, from rank 0 (default 1: deterministic; up to 4, each on its own data "
                        "shard, the loss the drivers' mean, the steps then timing-dependent)")
    c.add_argument("--tolerance", type=float, default=0.01,
                   help="largest relative loss gap to raw's a recommended codec may have (default 0.01: 1%%, "
                        "within what the same training varies by when only its timing changes; below it the "
                        "bytes decide)")
    g = p.add_argument_group(
        "peers of different speeds and churn (issue 17)",
        "--uneven runs three fresh swarms in turn, each daemon always under its own CPU cap: 'static' (peer i "
        "pinned to stage i mod 4, rebalancing off: a speed-blind layout; its stage maps give every peer's "
        "speed), 'best' (the brute-force best assignment for those speeds, pinned: the reference every "
        "fraction divides by) and 'rebalanced' (static's start with rebalancing on). --churn then kills -9 "
        "and restarts a random peer every --churn-every seconds in the rebalanced swarm (alone: in one "
        "equal-capped swarm, its own throughput before the churn is the reference). Default total with "
        "both: ~8 minutes. --duration and --no-kill do not apply.")
    g.add_argument("--uneven", action="store_true",
                   help="per-daemon CPU caps of different sizes (--shares of --cpus) and the static / best / "
                        "rebalanced runs: fraction_of_best_static and fraction_of_best_rebalanced")
    g.add_argument("--churn", action="store_true",
                   help="a churn phase with rebalancing on: fraction_of_best_churn, recovery_s per event, lost")
    g.add_argument("--shares", default=None, metavar="W,W,...",
                   help="relative CPU per daemon, scaled to add up to --cpus (default 2,2,1.5,1,1,0.5: with 2 CPUs "
                        "0.5 .. 0.125 each; the best assignment can even out the 4 stages only by pairing a slow "
                        "peer with a fast one, so a speed-blind layout is far from it)")
    g.add_argument("--cpu-priority", type=float, default=1.0, metavar="X",
                   help="the daemons' cgroups weigh X times a normal process against other work on the host (v1 "
                        "cpu.shares, v2 cpu.weight); the caps still bound them. On a host busy with other work "
                        "the peers otherwise get less than their caps, and unevenly (see cpu_used_of_cap in the "
                        "JSON): X=8 gives them their caps, leaving others the CPUs beyond --cpus (default 1)")
    g.add_argument("--warmup", type=float, default=20.0,
                   help="seconds after every driver's first microbatch (and the switch to the uneven caps) before "
                        "measuring: the stage servers' speed averages settle (default 20)")
    g.add_argument("--measure", type=float, default=40.0,
                   help="seconds of throughput measured in the static and best runs, and the rebalanced run's "
                        "settled figure (its last MEASURE seconds) (default 40: ~60 microbatches at ~12 samples/s, "
                        "so a few in flight at either end move it by ~3%%)")
    g.add_argument("--rebalance-for", type=float, default=120.0,
                   help="seconds the rebalanced run goes on from its first microbatches: time to find the best "
                        "stages, then --measure of them (default 120)")
    g.add_argument("--churn-every", type=float, default=30.0,
                   help="seconds between kills in the churn phase (default 30; recovery is looked for until the "
                        "next kill, in windows of --window)")
    g.add_argument("--churn-events", type=int, default=4, help="kills in the churn phase (default 4)")
    g.add_argument("--churn-pause", type=float, default=2.0,
                   help="seconds a killed peer stays down before it is restarted on its own home (default 2: "
                        "less than the peers' dead_after of 4 s, so they may still hold its calls)")
    v = p.add_argument_group(
        "a lying stage server (issue 29)",
        "--liar runs an honest swarm, then one per attacker named, each fresh: 6 daemons, stage 1 with three peers "
        "(the third lies in the attacker runs and only serves), the other stages one each, rebalancing off; the "
        "five others drive --samples samples each (--in-flight, default 1) under [pipeline] verify_fraction "
        "(--verify-fraction, default the config's 0.05), then the first driver's validation loss is asked for. "
        "Reports liar_banned (every driver banned it, in every attacker run), microbatches_until_banned (the "
        "most microbatches a driver drove before it banned it), false_bans (honest peers banned, all runs), "
        "verify_overhead (the honest run's checks' compute seconds over its calls'), the detection rate (verdicts "
        "on the liar's answers that found it the outlier) and each run's validation loss against the honest "
        "run's. Uses the codec comparison's model (one block per stage). ~2-4 minutes per run on 2 CPUs.")
    v.add_argument("--liar", nargs="?", const="scale:1.05,noise:0.3,flip,stale", default=None, metavar="A,A,...",
                   help="attackers, one run each: scale:F (outputs times F), noise:S (plus noise S times their "
                        "RMS), flip (gradients negated), stale (the weights it started with) (default, with no "
                        "value: scale:1.05,noise:0.3,flip,stale)")
    v.add_argument("--verify-fraction", type=float, default=None, metavar="F",
                   help="[pipeline] verify_fraction of every daemon (default: the config's, 0.05)")


def nat_arguments(p: Parser) -> None:
    p.add_argument("--mbit", type=float, default=50.0,
                   help="tbf rate on every end host's link, both directions, in Mbit/s (default 50)")
    p.add_argument("--mib", type=int, default=64, help="vector exchanged when timing each path, in MiB (default 64)")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds every pair gets to connect (default 60, the issue's goal)")
    p.add_argument("--settle", type=float, default=20.0,
                   help="seconds of averaging after every pair connected, before the figures are read, and the "
                        "longest wait before the timed exchanges start (default 20; the tests use 2)")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="keep daemon homes and logs under DIR (default: a temp dir, removed)")


def scale_arguments(p: Parser) -> None:
    p.add_argument("--peers", type=int, default=1000, help="simulated peers (default 1000; the goals are for 10000)")
    p.add_argument("--steady", type=float, default=600.0,
                   help="simulated seconds of steady state, where control traffic is counted (default 600: one "
                        "gap-estimate epoch)")
    p.add_argument("--churn", type=float, default=0.01,
                   help="fraction of the swarm that churns per simulated minute in steady state: half joins, a "
                        "quarter leaves, a quarter crashes (default 0.01)")
    p.add_argument("--recover", type=float, default=60.0,
                   help="simulated seconds after half the swarm crashes at once before connectivity is read "
                        "(default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the links, churn and rules (default 0)")
    p.add_argument("--no-consensus", action="store_true",
                   help="skip the simulated averaging on the final graph and on a random regular one")
    p.add_argument("--real", type=int, default=0, metavar="N",
                   help="run N real daemons on loopback with [membership] views = 'partial' instead, and the "
                        "simulator at N peers without churn beside them (peer/bench/scale_real.py)")
    p.add_argument("--settle", type=float, default=30.0,
                   help="with --real: seconds after the graph first connects before the steady window (default 30)")
    p.add_argument("--real-steady", type=float, default=120.0,
                   help="with --real: seconds of steady state over which control bytes are counted (default 120)")
    p.add_argument("--real-timeout", type=float, default=300.0,
                   help="with --real: seconds to wait for one connected graph within the degree bounds (default 300)")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="with --real: keep daemon homes and logs under DIR (default: a temp dir, removed)")


def sybil_arguments(p: Parser) -> None:
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds per simulated attack whose outcome varies (the radius ratchet, the colluding "
                        "servers; default 3)")


@dataclass(frozen=True)
class Bench:
    """One `peer bench` command: the module whose `run(args) -> int` it calls, and how it is described."""

    module: str
    doc: str
    add_arguments: Callable[[Parser], None]

    def build(self, p: Parser) -> None:
        """Its own arguments, then the --json flag every bench shares."""
        self.add_arguments(p)
        p.add_argument("--json", action="store_true",
                       help="print the JSON object compact, on one line (default: indented)")


BENCHES = {
    "transport": Bench("peer.bench.transport",
                       "encrypted vs plain TCP vs in-memory AEAD throughput between two processes",
                       transport_arguments),
    "discovery": Bench("peer.bench.discovery",
                       "time until N local daemons are all connected, and idle daemon memory",
                       discovery_arguments),
    "average": Bench("peer.bench.average",
                     "one pairwise average of a big tensor through the real engine (and gloo all_reduce)",
                     average_arguments),
    "gossip": Bench("peer.bench.gossip",
                    "time to consensus per topology (rewired, ring, exponential, random_regular)",
                    gossip_arguments),
    "train": Bench("peer.bench.train",
                   "AD-PSGD vs D-PSGD vs local steps vs gloo all-reduce data parallel: time to a target accuracy "
                   "or loss",
                   train_arguments),
    "wan": Bench("peer.bench.wan",
                 "training where the links bind (issue 41): per mode, bytes, wall time and compute utilization per "
                 "outer step of a 100 M-parameter model, loss against tokens of a small one", wan_arguments),
    "attach": Bench("peer.bench.attach",
                    "averaging from an attached process vs a hosted trainer (overhead), and bytes per host with "
                    "torchrun ranks as one peer vs one peer each", attach_arguments),
    "hostile": Bench("peer.bench.hostile",
                     "every attack class against one daemon beside an honest peer: pass/fail, memory, drop time",
                     hostile_arguments),
    "byzantine": Bench("peer.bench.byzantine",
                       "honest digits swarms with lying peers (sign flip, scaled, ALIE, IPM, dissensus, label flip, "
                       "sleeper): honest accuracy vs no attack, bans, false positives, the defence's cost",
                       byzantine_arguments),
    "pipeline": Bench("peer.bench.pipeline_main",
                      "4-stage swarm pipeline across CPU-capped daemons: samples/s vs the slowest stage, kill -9 recovery, "
                      "validation loss vs one process, a stage's memory vs plain torch",
                      pipeline_arguments),
    "scale": Bench("peer.bench.scale",
                   "simulated swarm of N peers running the partial-view and local rewiring rules: state and "
                   "control bytes per peer, connectivity after half fail, gap vs random regular, join time",
                   scale_arguments),
    "sybil": Bench("peer.bench.sybil",
                   "colluders and many cheap keys against the real rules, simulated in-process: a radius ratchet, "
                   "an eclipse of partial views, stage servers that lie alike, a ban-list flush",
                   sybil_arguments),
    "nat": Bench("peer.bench.nat",
                 "daemons behind NATs (internet lab): how each pair connects, seconds to it, throughput direct vs "
                 "punched vs relayed", nat_arguments),
}
