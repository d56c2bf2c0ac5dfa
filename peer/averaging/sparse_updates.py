"""Every update to everyone: a round's update, sent sparse with error feedback, and the step all peers take
from the ones they received (SparseLoCo's outer step; design.md, "Sparse updates"). The daemon's side is
peer/averaging/pushes.py; a trainer's, peertrain/outer.py (`codec="sparse"`).

Each peer keeps, per group, an error-feedback accumulator e (flat float32). At a round's end, with u its
round's update (its weights now less the round's reference):

    e <- decay * e + u;   q = sparse(e) as the wire decodes it;   e <- e - q

and sends q. Every peer then steps the reference by outer_lr times the mean of the q's it holds (its own
included), summed in the order of the senders' ids, so peers that hold the same q's compute the same bits
and their replicas stay identical. What a send leaves out stays in e and goes in a later one; `decay` < 1
forgets a share of it each round (SparseLoCo's beta, which also plays the outer momentum's part), and
`outer_lr` > 1 makes up for the mean of sparse updates, whose kept entries differ between senders, being
smaller than the mean of dense ones.

Sans-I/O: numpy in, numpy out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from peer.averaging.edge_copies import SPARSE_BLOCK, SPARSE_TOPK
from protocol.limits import DEFAULT_LIMITS
from protocol.tensor_decoder import TensorDecoder
from protocol.tensor_encoder import EncodedTensor, TensorEncoder

# Measured (docs/benchmarks.md, 2026-11-29, eleventh session: `python -m peer.testing.sparse_mixing_sim`, four
# replicas of a 0.4 M-parameter char transformer, 60 rounds of 10 Adam steps, 64 of 4096 entries): with decay 1
# and outer lr 1 the peers' loss was 10.7% above an exact all-reduce's; decay 0.8 and outer lr 4 brought it to
# 1.6% and 1.2% (seeds 0 and 1), the best of the nine pairs tried. At eight peers it gave 2.3%, and an outer lr
# of 8 (the sum of the sends, as 4 is at four peers) 33%: it does not follow the number of senders.
EF_DECAY = 0.8
OUTER_LR = 4.0


@dataclass
class UpdateFeedback:
    """One peer's error-feedback accumulator for one group: what its sparse sends have left out, decayed."""

    size: int
    decay: float = EF_DECAY
    topk: int = SPARSE_TOPK
    error: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size: expected an integer >= 1, got {self.size!r}")
        if not (isinstance(self.decay, (int, float)) and 0.0 < self.decay <= 1.0):
            raise ValueError(f"decay: expected a number in (0, 1], got {self.decay!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or not 1 <= self.topk <= SPARSE_BLOCK:
            raise ValueError(f"topk: expected an integer in [1, {SPARSE_BLOCK}], got {self.topk!r}")
        self.error = np.zeros(self.size, dtype=np.float32)

    def send(self, update: np.ndarray) -> np.ndarray:
        """This round's sparse send, as every receiver decodes it (the wire's own encoder and decoder), for
        `update` = our weights less the round's reference; what it leaves out is kept for later rounds."""
        return send_with_feedback(self.error, update, decay=self.decay, topk=self.topk)


def send_with_feedback(error: np.ndarray, update: np.ndarray, *, decay: float = EF_DECAY,
                       topk: int = SPARSE_TOPK) -> np.ndarray:
    """`UpdateFeedback.send` on an accumulator the caller holds (flat float32, changed in place)."""
    return encode_with_feedback(error, update, decay=decay, topk=topk)[0]


def encode_with_feedback(error: np.ndarray, update: np.ndarray, *, decay: float = EF_DECAY, topk: int = SPARSE_TOPK,
                         name: str = "q", shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, EncodedTensor]:
    """`send_with_feedback`, and the send encoded once for the wire (tensor `name` of `shape`, default flat): what
    a trainer hands its daemon to push to every partner (peer/averaging/pushes.py), which then encodes nothing.
    The accumulator is the caller's (a trainer keeps one per tensor, in its checkpointed state)."""
    u = np.asarray(update, dtype=np.float32).reshape(-1)
    if u.shape != error.shape:
        raise ValueError(f"update of {u.size} values for a group of {error.size}")
    if not np.isfinite(u).all():
        raise ValueError(f"update: {int((~np.isfinite(u)).sum())} of {u.size} values are NaN or infinite")
    error *= np.float32(decay)
    error += u
    encoded = TensorEncoder(name, error.reshape(shape or error.shape), codec="sparse", topk=topk).encoded()
    decoder = TensorDecoder(encoded.header(0), DEFAULT_LIMITS)
    for chunk in encoded.chunks():
        decoder.write(chunk)
    q = np.asarray(decoder.finish().array, dtype=np.float32).reshape(-1)
    error -= q
    return q, encoded


def nonzero_entries(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A decoded sparse send as (flat indices, values) of its nonzero entries: 1.6% of it, kept as the yardstick
    of partners' pushes' angle (peer/averaging/push_gate.py) where the dense send would be a model's size."""
    flat = q.reshape(-1)
    idx = np.flatnonzero(flat)
    return idx, flat[idx]


def outer_step(reference: np.ndarray, received: Mapping[str, np.ndarray], *, outer_lr: float = OUTER_LR) -> np.ndarray:
    """The next round's reference: `reference` + outer_lr x the mean of the sends `received` (sender id -> q,
    ours included), added in the order of the ids, so that every peer holding the same sends gets the same
    bits whatever order they arrived in."""
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        raise ValueError(f"outer_lr: expected a finite number > 0, got {outer_lr!r}")
    if not received:
        raise ValueError("no sends to step by: a peer's own send is always among them")
    ref = np.asarray(reference, dtype=np.float32).reshape(-1)
    total = np.zeros_like(ref)
    for sender in sorted(received):
        q = np.asarray(received[sender], dtype=np.float32).reshape(-1)
        if q.shape != ref.shape:
            raise ValueError(f"send from {sender}: {q.size} values for a group of {ref.size}")
        total += q
    return ref + np.float32(outer_lr / len(received)) * total
