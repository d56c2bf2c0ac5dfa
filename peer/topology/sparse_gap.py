"""The spectral gap of a graph too large for a dense eigensolve (10^4 peers: `peer bench scale`).

`mixing.spectral_gap` diagonalizes the dense n x n matrix: at n = 10^4 that is 800 MB and minutes. Here
W is applied as a sparse operator (numpy only: an edge list and `bincount`), and the Lanczos iteration,
restricted to the vectors orthogonal to the all-ones one (W's eigenvector for 1, known in advance), finds
the extreme eigenvalues of W there; SLEM is the larger modulus of the two ends. Full
reorthogonalization keeps it exact in floating point: a few hundred iterations of n-vectors is a few
tens of MB at n = 10^4. On random 4-regular graphs it agrees with the dense solve to 1e-12 (n = 200,
1000), and takes a few seconds at n = 10^4.
"""

from __future__ import annotations

import numpy as np

_CONVERGED = 1e-9  # change of the extreme Ritz values over a check interval that counts as converged
_CHECK_EVERY = 20


def mh_operator(n: int, pairs: np.ndarray):
    """(src, dst, weights, self weights) of the Metropolis-Hastings W for undirected edges `pairs` (k x 2)."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    i, j = pairs[:, 0], pairs[:, 1]
    deg = np.bincount(np.concatenate([i, j]), minlength=n)
    w = 1.0 / (1.0 + np.maximum(deg[i], deg[j]))
    src, dst, ww = np.concatenate([i, j]), np.concatenate([j, i]), np.concatenate([w, w])
    return src, dst, ww, 1.0 - np.bincount(src, weights=ww, minlength=n)


def apply(op, x: np.ndarray) -> np.ndarray:
    """W x for an operator from `mh_operator`."""
    src, dst, ww, self_w = op
    return self_w * x + np.bincount(src, weights=ww * x[dst], minlength=len(x))


def sparse_spectral_gap(n: int, pairs, *, max_iter: int = 400, seed: int = 0) -> float:
    """1 - SLEM of the MH matrix of the graph on nodes 0..n-1 with undirected edges `pairs`: the same number
    as `mixing.spectral_gap(mixing_matrix(adj))` (0 for a disconnected graph, and for n <= 1)."""
    if n <= 1:
        return 0.0
    op = mh_operator(n, pairs)
    m = min(max_iter, n - 1)
    rng = np.random.default_rng(seed)
    basis = np.empty((m + 1, n))
    v = rng.standard_normal(n)
    v -= v.mean()
    basis[0] = v / np.linalg.norm(v)
    alpha: list[float] = []
    beta: list[float] = []
    last = None
    for k in range(m):
        w = apply(op, basis[k])
        w -= w.mean()
        a = float(w @ basis[k])
        alpha.append(a)
        for _ in range(2):  # twice is enough (Kahan): the basis stays orthogonal to working precision
            q = basis[: k + 1]
            w -= q.T @ (q @ w)
        b = float(np.linalg.norm(w))
        if b < 1e-12:
            break
        beta.append(b)
        basis[k + 1] = w / b
        if (k + 1) % _CHECK_EVERY == 0:
            ends = _ends(alpha, beta)
            if last is not None and max(abs(ends[0] - last[0]), abs(ends[1] - last[1])) < _CONVERGED:
                break
            last = ends
    lo, hi = _ends(alpha, beta)
    gap = 1.0 - max(abs(lo), abs(hi))
    return 0.0 if gap < 1e-12 else min(gap, 1.0)


def _ends(alpha: list[float], beta: list[float]) -> tuple[float, float]:
    k = len(alpha)
    t = np.diag(alpha) + np.diag(beta[: k - 1], 1) + np.diag(beta[: k - 1], -1)
    ev = np.linalg.eigvalsh(t)
    return float(ev[0]), float(ev[-1])
