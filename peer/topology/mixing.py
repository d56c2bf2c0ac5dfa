"""Gossip mixing weights and the two numbers that judge a topology.

Peers average parameters pairwise: in an exchange over edge i-j both sides apply
x += w_ij (x_other - x) with the *same* w_ij, so the swarm's sum is preserved. The
topology's W, and D-PSGD's all-neighbour rounds, use Metropolis-Hastings weights
(one-neighbour exchanges use the pairwise 1/3: docs/design.md, "Which weight")

    w_ij = 1 / (1 + max(d_i, d_j)),    w_ii = 1 - sum_j w_ij,

because each peer can compute them from its neighbours' degrees alone, and the
resulting W is symmetric and doubly stochastic on *every* graph. The `+ 1` also
makes the rule robust to stale degree gossip: each term is at most 1 / (1 + d_i)
with d_i the peer's own (exactly known) degree, so a row never sums above
d_i / (1 + d_i) and the self-weight stays >= 1 / (1 + d_i) > 0. A positive diagonal
keeps W aperiodic (no eigenvalue -1), so gossip converges on any connected graph.

Alternatives considered (mean gaps measured on random graphs): lazy MH (W + I)/2
halves the gap (0.112 -> 0.056 on sparse random graphs) with no benefit, since MH
already has no eigenvalue near -1; max-degree weights 1/(1 + d_max) need a global
d_max and lose about 25% on irregular graphs (0.083); dropping the `+ 1`
(1/max(d_i, d_j)) gains up to 15% on expanders but has zero gap on bipartite graphs
such as an even ring; 1/(max + 1/2) gains only 5-10%. Optimal weights need a global
SDP solve. Rewiring changes the gap far more than any of these, so MH stays.

A topology is then judged by
  * its spectral gap 1 - SLEM(W): error contracts by about (1 - gap) per round;
  * its predicted round time: an averaging round waits for the slowest edge.
The rewiring planner (`rewire.py`) trades these two off.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from peer.topology.graph import GraphView

_SYM_TOL = 1e-9
_GAP_ZERO = 1e-12


def metropolis_weight(d_i: int, d_j: int) -> float:
    """The Metropolis-Hastings weight of edge i-j from the endpoints' degrees."""
    if d_i < 1 or d_j < 1:
        raise ValueError(f"endpoints of an edge have degree >= 1, got {d_i}, {d_j}")
    return 1.0 / (1.0 + max(d_i, d_j))


def local_weights(neighbour_degrees: Mapping[str, int]) -> tuple[float, dict[str, float]]:
    """One peer's row of W: (self weight, {neighbour: weight}).

    The peer's own degree is `len(neighbour_degrees)`; this is all a daemon needs to
    mix locally, and it matches `mixing_matrix` for the same graph.
    """
    d_i = len(neighbour_degrees)
    row = {n: metropolis_weight(d_i, d_j) for n, d_j in neighbour_degrees.items()}
    return 1.0 - sum(row.values()), row


def _as_adjacency(graph: GraphView | np.ndarray) -> np.ndarray:
    if isinstance(graph, GraphView):
        return graph.adjacency()[1]
    a = np.asarray(graph, dtype=float)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"adjacency must be square, got shape {a.shape}")
    if not np.allclose(a, a.T):
        raise ValueError("adjacency must be symmetric (undirected graph)")
    if np.any(np.diag(a) != 0):
        raise ValueError("adjacency must have a zero diagonal (no self-loops)")
    return (a != 0).astype(float)


def mixing_matrix(graph: GraphView | np.ndarray) -> np.ndarray:
    """The Metropolis-Hastings mixing matrix.

    For a `GraphView`, rows/columns follow `view.ids()` (sorted ids). An adjacency
    matrix is read as "nonzero off-diagonal entry = edge".
    """
    a = _as_adjacency(graph)
    n = a.shape[0]
    deg = a.sum(axis=1)
    w = np.where(a > 0, 1.0 / (1.0 + np.maximum.outer(deg, deg)), 0.0)
    w[np.diag_indices(n)] = 1.0 - w.sum(axis=1)
    return w


def check_doubly_stochastic(w: np.ndarray, tol: float = 1e-9) -> None:
    """Raise ValueError (with the offending numbers) unless W is doubly stochastic.

    Checks: square, finite, entries >= -tol, every row and column sums to 1 +- tol.
    Symmetry is not required here; `spectral_gap` checks it where it matters.
    """
    w = np.asarray(w, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"mixing matrix must be square, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("mixing matrix has non-finite entries")
    if w.size and w.min() < -tol:
        i, j = np.unravel_index(np.argmin(w), w.shape)
        raise ValueError(f"negative weight W[{i},{j}] = {w[i, j]:.3g}")
    for axis, name in ((1, "row"), (0, "column")):
        sums = w.sum(axis=axis)
        bad = np.flatnonzero(np.abs(sums - 1.0) > tol)
        if bad.size:
            k = int(bad[0])
            raise ValueError(
                f"{bad.size} {name}(s) do not sum to 1, e.g. {name} {k} sums to {sums[k]!r}"
            )


def spectral_gap(w: np.ndarray) -> float:
    """1 - SLEM(W): one minus the second-largest eigenvalue modulus.

    Computed as 1 - ||W - 11^T/n||_2, which for a symmetric doubly stochastic W is
    1 - max(|lambda_2|, |lambda_n|) and needs no guessing which eigenvalue is the
    trivial 1. Returns 0.0 for a disconnected graph (lambda_2 = 1: gossip never
    reaches consensus) and for n <= 1 (nothing to mix; treating it as "no gap"
    keeps floor checks conservative). W must be symmetric (ValueError otherwise).
    """
    w = np.asarray(w, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"mixing matrix must be square, got shape {w.shape}")
    n = w.shape[0]
    if n <= 1:
        return 0.0
    if not np.allclose(w, w.T, atol=_SYM_TOL, rtol=0.0):
        raise ValueError("spectral_gap needs a symmetric mixing matrix")
    eig = np.linalg.eigvalsh(w - np.full((n, n), 1.0 / n))
    gap = 1.0 - float(np.max(np.abs(eig)))
    return 0.0 if gap < _GAP_ZERO else min(gap, 1.0)


def graph_spectral_gap(view: GraphView) -> float:
    """Spectral gap of the view's Metropolis-Hastings mixing matrix."""
    return spectral_gap(mixing_matrix(view))


def edge_time(
    view: GraphView,
    a: str,
    b: str,
    shard_bytes: float,
    default_bandwidth_bps: float,
    default_rtt_s: float,
) -> float:
    """Predicted seconds for one exchange over pair a-b (edge or candidate)."""
    return view.link(a, b).transfer_time(shard_bytes, default_bandwidth_bps, default_rtt_s)


def node_round_time(
    view: GraphView,
    node: str,
    shard_bytes: float,
    default_bandwidth_bps: float,
    default_rtt_s: float,
) -> float:
    """The slowest of `node`'s own edges (0.0 if it has none)."""
    return max(
        (
            edge_time(view, node, m, shard_bytes, default_bandwidth_bps, default_rtt_s)
            for m in view.neighbours(node)
        ),
        default=0.0,
    )


def predicted_round_time(
    view: GraphView,
    shard_bytes: float,
    default_bandwidth_bps: float,
    default_rtt_s: float,
) -> float:
    """Seconds for one averaging round: the slowest edge's bytes/bandwidth + rtt.

    Unmeasured bandwidth or rtt fall back to the defaults; no edges gives 0.0.
    """
    if shard_bytes < 0:
        raise ValueError(f"shard_bytes must be >= 0, got {shard_bytes}")
    return max(
        (
            edge_time(view, *tuple(e), shard_bytes, default_bandwidth_bps, default_rtt_s)
            for e in view.edges
        ),
        default=0.0,
    )
