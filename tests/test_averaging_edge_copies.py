"""Per-edge public copies (peer/averaging/edge_copies.py), the arithmetic of the sparse outer exchange issue
41 asks for: both ends apply the same decoded values (the pair's sum is kept), what a send leaves out goes
in a later one (error feedback), and a pair that exchanges only sparse sends still comes to agree."""

from __future__ import annotations

import numpy as np
import pytest

from peer.averaging.edge_copies import CONSENSUS_STEP, SPARSE_BLOCK, SPARSE_TOPK, EdgeCopies, sparse_roundtrip
from protocol.tensor_codec import tensor_nbytes

N = 3 * SPARSE_BLOCK + 100  # three whole chunks and a short one


def pair(seed: int = 0) -> tuple[np.ndarray, np.ndarray, EdgeCopies, EdgeCopies]:
    rng = np.random.default_rng(seed)
    xi, xj = rng.normal(size=N).astype(np.float32), rng.normal(size=N).astype(np.float32)
    ei = EdgeCopies.start(xi, xj)  # a dense first exchange set both copies
    return xi, xj, ei, ei.mirrored()


def exchange(xi, xj, ei: EdgeCopies, ej: EdgeCopies, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    qi, qj = ei.send(xi), ej.send(xj)
    di, dj = ei.commit(qi, qj), ej.commit(qj, qi)
    assert np.array_equal(di, -dj)  # the partner applies our move negated, bit for bit
    return xi + gamma * di, xj + gamma * dj


def test_the_pairs_sum_is_kept_and_the_copies_stay_identical_at_both_ends():
    xi, xj, ei, ej = pair()
    rng = np.random.default_rng(1)
    total = xi.astype(np.float64) + xj
    for _ in range(30):
        local = rng.normal(scale=0.01, size=(2, N)).astype(np.float32)  # each trains between exchanges
        xi, xj = xi + local[0], xj + local[1]
        total += local[0].astype(np.float64) + local[1]
        xi, xj = exchange(xi, xj, ei, ej, gamma=0.5)
        assert np.array_equal(ei.mine, ej.theirs) and np.array_equal(ei.theirs, ej.mine)
        assert ei.fingerprint() == ej.fingerprint() and ei.version == ej.version
        np.testing.assert_allclose(xi.astype(np.float64) + xj, total, atol=1e-4)


def test_what_a_send_leaves_out_goes_in_a_later_one():
    """Error feedback without a residual: for a fixed x, the public copy closes in on it send after send."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=N).astype(np.float32)
    e = EdgeCopies(np.zeros(N, np.float32), np.zeros(N, np.float32))
    gaps = []
    for _ in range(80):
        q = e.send(x)
        assert np.count_nonzero(q) <= SPARSE_TOPK * 4  # a top-k per chunk, never more
        e.commit(q, np.zeros(N, np.float32))
        gaps.append(float(np.linalg.norm(x - e.mine) / np.linalg.norm(x)))
    assert gaps[-1] < 0.25 * gaps[0] and gaps[-1] < 0.3


def test_a_pair_exchanging_only_sparse_sends_comes_to_agree():
    """Two unrelated random replicas (the hardest case: every entry differs) at CONSENSUS_STEP: measured
    ‖xi − xj‖ at 0.08 of its start after 100 exchanges and 7e-4 after 300 (0.03 oscillates, 0.1 diverges:
    CHOCO's step is bounded by the compression, here 64 of 4096)."""
    xi, xj, ei, ej = pair(3)
    start = float(np.linalg.norm(xi - xj))
    for _ in range(300):
        xi, xj = exchange(xi, xj, ei, ej, gamma=CONSENSUS_STEP)
    assert float(np.linalg.norm(xi - xj)) < 0.01 * start


def test_a_lost_commit_shows_in_the_fingerprint():
    xi, xj, ei, ej = pair(4)
    qi, qj = ei.send(xi + 1), ej.send(xj - 1)  # (each trained since the copies were set)
    ei.commit(qi, qj)  # our side committed; the partner's commit was lost
    assert ei.fingerprint() != ej.fingerprint()  # the next offer's check makes that exchange dense again


def test_a_sparse_send_is_a_hundredth_of_float32s_bytes():
    n = 1 << 20
    assert 4 * n / tensor_nbytes("float32", [n], "sparse", SPARSE_BLOCK, SPARSE_TOPK) > 100


def test_sizes_must_agree():
    with pytest.raises(ValueError, match="one group has one size"):
        EdgeCopies(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="edge of 3"):
        EdgeCopies(np.zeros(3), np.zeros(3)).send(np.zeros(5))
    assert sparse_roundtrip(np.zeros(10)).shape == (10,)


def test_the_sparse_mixing_measurement_runs_every_mode_and_counts_what_each_sends():
    """`python -m peer.testing.sparse_mixing_sim` (docs/benchmarks.md, ninth session), at two rounds: the modes
    that keep replicas identical do, the bytes a round are the codec's share, and bad arguments are refused."""
    from peer.testing.sparse_mixing_sim import main, run, sparse_share

    assert 0.009 < sparse_share() < 0.0095  # 1/108 of float32's bytes at the wire's defaults
    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 2, "block": 16}  # the arithmetic, not the loss: a fast-tier size
    got = {m: run(m, 4, 4, 1, 0, tiny) for m in ("allreduce", "pairwise", "everyone", "edges:0.05")}
    assert all(np.isfinite(r["val_loss_peers"]) for r in got.values()), got
    assert got["allreduce"]["spread_late"] == 0.0 and got["everyone"]["spread_late"] == 0.0
    assert got["pairwise"]["spread_late"] > 0.0  # two matchings in four rounds do not make four replicas one
    assert got["everyone"]["received_per_round_models"] == pytest.approx(3 * sparse_share(), abs=1e-4)
    # a peer's edges' first (dense, q8) exchanges in rounds 0 and 1, then a sparse send on each in rounds 2 and 3
    assert got["edges:0.05"]["sent_per_round_models"] == pytest.approx((2 * 0.25 + 2 * sparse_share()) / 4, abs=1e-4)
    denser = run("everyone:256:0.9:1.5", 2, 2, 1, 0, tiny)  # 256 of every 4096 entries: four times the indices and codes
    assert denser["sent_per_round_models"] == pytest.approx(sparse_share(256), abs=1e-4) and sparse_share(256) > 0.035
    with pytest.raises(SystemExit):
        main(["--peers", "3"])
