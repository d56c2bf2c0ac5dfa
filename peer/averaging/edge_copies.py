"""Per-edge public copies: what a sparse outer exchange sends and what it applies (design.md, "Sparse
updates": the design chosen for issue 41; this module is its arithmetic, not yet wired into the exchange).

Both ends of an edge hold, for one group, two flat float32 copies, crosswise: `mine` (what the partner
believes of our tensors) and `theirs` (what we believe of the partner's). An exchange sends q = sparse(x −
mine) each way (top-k per chunk, 2-bit values: protocol/tensor_codec.py); both ends add the *decoded* q's to
the copies, so the copies stay identical at both ends; then each end moves by γ·(theirs − mine), and since
the partner's (theirs − mine) is ours negated, the pair's sum is kept exactly. What a send leaves out stays
in x − mine and goes in a later send: error feedback with no residual buffer. The exchange's own update,
x += w·s·(other − own), is this with own := mine, other := theirs after the commit, so the radius clip and
the angle test are taken on exactly what is applied.

Sans-I/O: numpy in, numpy out; the exchange (peer/averaging/exchange.py) will hold one per (group, partner).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from protocol.limits import DEFAULT_LIMITS
from protocol.tensor_codec import codec_params
from protocol.tensor_decoder import TensorDecoder
from protocol.tensor_encoder import TensorEncoder

SPARSE_BLOCK, SPARSE_TOPK = codec_params("sparse")  # the wire's defaults: 64 of every 4096 (1/108 of float32)
CONSENSUS_STEP = 0.01  # γ, each end's move towards the other's copy. CHOCO bounds it by the compression: two
#                        unrelated replicas at 64 of 4096 came to agree with 0.01 (0.08 of the start after 100
#                        exchanges, 7e-4 after 300), oscillated with 0.03 and diverged with 0.1 and more
#                        (tests/test_averaging_edge_copies.py). Dense pairwise averaging moves by 0.5.


def sparse_roundtrip(values: np.ndarray, *, block: int = SPARSE_BLOCK, topk: int = SPARSE_TOPK) -> np.ndarray:
    """What a partner decodes of `values` sent with the sparse codec: the same encoder and decoder as the
    wire, so both ends add bit-identical values to their copies."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    enc = TensorEncoder("q", flat, codec="sparse", block=block, topk=topk)
    dec = TensorDecoder(enc.header(1), DEFAULT_LIMITS)
    for chunk in enc.chunks():
        dec.write(chunk)
    return np.asarray(dec.finish().array, dtype=np.float32).reshape(-1)


@dataclass
class EdgeCopies:
    """One edge's two public copies of one group (flat float32), and how many exchanges they have seen."""

    mine: np.ndarray
    theirs: np.ndarray
    version: int = 0

    def __post_init__(self) -> None:
        self.mine = np.array(self.mine, dtype=np.float32).reshape(-1)
        self.theirs = np.array(self.theirs, dtype=np.float32).reshape(-1)
        if self.mine.shape != self.theirs.shape:
            raise ValueError(f"edge copies of {self.mine.size} and {self.theirs.size} values: one group has one size")

    @classmethod
    def start(cls, mine_sent: np.ndarray, theirs_received: np.ndarray) -> "EdgeCopies":
        """A new edge (or one whose copies disagreed): its first exchange is dense, and both ends set the
        copies to what it carried, as decoded (the q8 values, not the exact ones)."""
        return cls(mine_sent, theirs_received)

    def send(self, x: np.ndarray) -> np.ndarray:
        """Our sparse send, as the partner will decode it: the largest entries of x − mine (what earlier sends
        left out included)."""
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.shape != self.mine.shape:
            raise ValueError(f"group of {x.size} values on an edge of {self.mine.size}")
        return sparse_roundtrip(x - self.mine)

    def commit(self, q_mine: np.ndarray, q_theirs: np.ndarray) -> np.ndarray:
        """Both ends' sends were delivered: add them to the copies; the difference to apply, theirs − mine
        (our move is γ times it; the partner's is γ times its negation, bit for bit)."""
        self.mine += q_mine
        self.theirs += q_theirs
        self.version += 1
        return self.theirs - self.mine

    def fingerprint(self) -> bytes:
        """What both ends compare before an exchange (with `version`): equal while the copies agree. Our
        (mine, theirs) is the partner's (theirs, mine), so the order is canonical, not ours."""
        a, b = sorted((self.mine.tobytes(), self.theirs.tobytes()))
        return hashlib.blake2b(a + b, digest_size=16).digest()

    def mirrored(self) -> "EdgeCopies":
        """The partner's view of the same edge."""
        return EdgeCopies(self.theirs.copy(), self.mine.copy(), self.version)
