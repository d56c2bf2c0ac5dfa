"""Which weight one averaging exchange carries, under the rule its offer names.

An exchange with one random neighbour (AD-PSGD, `mode="one"`) uses the pairwise rule, w = 1/3, whatever
the degrees. The exchange's matrix I - w (e_i - e_j)(e_i - e_j)^T removes a share 2w(1 - w) of the pair's
squared disagreement: 0.44 at 1/3, 0.5 at the optimum 1/2 that AD-PSGD and randomized gossip (Boyd et al.
2006) use, and only 0.32 at Metropolis-Hastings' 1/5 on a degree-4 graph (MH shrinks with the degree, so a
better-connected graph mixed hardly faster than a ring). 1/3 rather than 1/2 because the weight stays set
aside while a transfer runs: at 1/2 two exchanges fill a peer's budget, so one slow neighbour blocks half
of it; at 1/3 three fit (measured in `peer bench gossip --netns --slow-pairs 0.4`: fixed graphs with slow
edges reached consensus faster at 1/3 than at 1/2). Averaging with all neighbours at once (D-PSGD,
`mode="all"`) uses MH weights: there a peer's weights over all its exchanges must stay <= 1, and each side
capping at 1/(1+own degree) makes the smaller of the two caps exactly the MH weight.
"""

from __future__ import annotations

WEIGHT_RULES = ("pairwise", "metropolis")
PAIRWISE_WEIGHT = 1.0 / 3.0  # see the module docstring: 89% of the optimum 1/2's effect, three exchanges at once
MIN_WEIGHT_SHARE = 0.25  # an exchange with less than this share of its rule's weight is not worth its bytes


def rule_cap(rule: str, degree: int) -> float:
    """The most weight one exchange may carry under `rule`, as one side with `degree` neighbours sees it."""
    if rule == "pairwise":
        return PAIRWISE_WEIGHT
    if rule == "metropolis":
        return 1.0 / (1.0 + max(1, degree))
    raise ValueError(f"unknown weight rule {rule!r} (choose from {', '.join(WEIGHT_RULES)})")
