"""Which pushed updates a peer takes, and how far each may move it (sans-I/O: the caller says when).

With the sparse outer exchange (peer/averaging/pushes.py) every partner's round update is added to our outer
weights, and nothing is sent back: there is no pair whose sum the clip must keep, so the bound is ours alone.
What a partner may make us add is measured against what we ourselves did, never against what partners said:

* **Size.** A push may be at most PUSH_NORM_BOUND times the norm of our own last push; a larger one is scaled
  down to it (and counted). Honest peers of one task take rounds of like size (the same model, inner steps
  and learning rate); a liar's push is held to a few of ours, whatever it claims or its partners send.
* **Rate.** A sender may push at most PUSH_RATE times per our own round (the time between our last two
  pushes), in bursts of PUSH_BURST (a token bucket per sender); a push past it is refused (`TOO_SOON`), not
  queued, and its sender tries again shortly (pushes.py). So one key moves us by at most
  PUSH_NORM_BOUND x PUSH_RATE of our own round's move per round, after a burst.
* **Before our first push** we have no yardstick: pushes are refused (`TOO_SOON`) until we made one. An honest
  early push is lost to its receivers; the dense re-synchronisation (peertrain/outer.py) brings it back.
* **Evidence.** A push past PUSH_STRIKE_RATIO times our own is a strike against its sender (bans.py), and
  none of it is added: a liar that pushes far out moves no one and is banned, then refused.
* **Angle.** A push pointing away from our own last one (cosine below -OPPOSED_COSINE, taken on what would be
  added: the decoded push, against our own decoded push on its support) is not added: honest peers of one
  task, training from one model, take rounds that point the same way, so a sign-flipped update (ours, or the
  swarm's mean negated, which holds ours) is a liar's. Honest pushes read +0.01 to +0.03 on `lm_14m` at one
  step a round, +0.13 to +0.28 on the tests' char model at 20 (docs/benchmarks.md). A strike needs more than
  one push: the mean cosine of a sender's latest ANGLE_WINDOW pushes, once ANGLE_MIN_PUSHES are known, below
  -OPPOSED_MEAN_COSINE. Where peers hold different labels (non-IID data) honest sparse pushes point away
  now and then: in a simulation of 4 and 8 peers on the digits with label-skewed shards
  (`python -m peer.testing.push_angle_sim`; docs/benchmarks.md, 2026-11-30), single honest pushes read down
  to -0.235, 4 of one sender's 40 were past -0.1 (three in a row: a ban, when each was a strike), while the
  mean of 4 never went below -0.143 nor the mean of 8 below -0.097; the swarm's mean update negated read
  -0.40 (8 peers) to -0.51 (4) in the median. So such an honest push is left out (1-3% of them under that
  skew), and its sender is not struck. As for exchanges, a group under OPPOSED_MIN_ELEMENTS values is not
  judged so (pushes.py gives no support then).

The cheapest attack is a key that pushes just inside the bound as often as the bucket lets it: 4.5 of our
round's move per round, per key, and never struck; the angle does not see a push orthogonal to ours (noise,
or the others' mean negated off our support). Only partners may push (neighbours, whose number the degree
caps), so k Sybil neighbours reach 4.5k.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from peer.averaging.bounds import OPPOSED_COSINE
from peer.per_peer import touch
from peer.token_bucket import TokenBucket
from protocol.refusal import Code, Refusal

PUSH_NORM_BOUND = 3.0  # a push may be this many times our own last push's norm: honest rounds differ by less
#                        than 2x (the same model, steps and rate); 3 leaves room for a faster peer's longer round
PUSH_STRIKE_RATIO = 20.0  # a push this many times our own last one is evidence, not noise: a strike (bans.py). Honest
#                           rounds shrink as training goes, but by 2-5x between a laggard's round and ours, not 20x
PUSH_RATE = 1.5  # pushes a sender may make per our own round: a peer half again our speed gets every one through
PUSH_BURST = 3.0  # ... and a few at once: rounds jitter (an evaluation, a checkpoint), and pushes wait out a busy link
ANGLE_WINDOW = 8  # a sender's latest cosines whose mean is judged: honest label-skewed means of 8 stayed above -0.1
ANGLE_MIN_PUSHES = 4  # ... once this many are known: a single honest push read down to -0.235, a mean of 4 -0.143
OPPOSED_MEAN_COSINE = 0.2  # the mean below -this is a strike: the swarm's negated mean push reads ~-0.4 to -0.5


@dataclass
class PushGate:
    """One group's record of our own pushes, and each partner's token bucket for its pushes to us."""

    own_norm: float | None = None  # ||our last push|| (None: we have not pushed yet)
    own_at: float | None = None  # when we last pushed
    own_round_s: float | None = None  # seconds between our last two pushes
    own_support: list[tuple[np.ndarray, np.ndarray]] | None = None  # our last push per tensor: (flat indices, values)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)  # sender -> its pushes' token bucket
    angles: dict[str, deque[float]] = field(default_factory=dict)  # sender -> its latest pushes' cosines with ours

    def pushed(self, norm: float, now: float, support: list[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """We pushed an update of this norm now (`support`: its nonzero entries, for the angle; None: not judged)."""
        if math.isfinite(norm) and norm > 0.0:
            self.own_norm = norm
            self.own_support = support
        if self.own_at is not None and now > self.own_at:
            self.own_round_s = now - self.own_at
        self.own_at = now

    def refusal(self, sender: str, now: float) -> Refusal | None:
        """Why a push from `sender` is not taken now (before its bytes are read), or None."""
        if self.own_norm is None:
            return Refusal(Code.TOO_SOON, "no round of our own yet to bound a push by")
        bucket = touch(self.buckets, sender, lambda: TokenBucket(1.0, PUSH_BURST, now=now))
        if self.own_round_s is not None:
            bucket.rate = PUSH_RATE / self.own_round_s
        if not bucket.try_take(1.0, now):
            return Refusal(Code.TOO_SOON, f"at most {PUSH_RATE:g} pushes per round of ours "
                           f"({self.own_round_s or 0.0:.1f} s), {PUSH_BURST:g} at once")
        return None

    def cosine(self, norm: float, dot: float) -> float | None:
        """The cosine of a push of `norm` whose product with our own last push is `dot`, or None (no yardstick)."""
        if self.own_norm is None or self.own_support is None or not (norm > 0.0 and math.isfinite(norm)):
            return None
        return dot / (norm * self.own_norm) if math.isfinite(dot) else float("nan")

    def evidence(self, norm: float, cosine: float | None = None) -> str | None:
        """Why a push of this norm (and cosine with our own) is evidence against its sender (a strike), or None.
        One push pointing away is not (module docstring: `turned_away` judges a sender's latest)."""
        if self.own_norm is None:
            return None
        if not math.isfinite(norm) or norm > PUSH_STRIKE_RATIO * self.own_norm:
            return f"pushed an update {norm:.3g} long, past {PUSH_STRIKE_RATIO:g}x our own ({self.own_norm:.3g})"
        if cosine is not None and not math.isfinite(cosine):
            return "pushed an update whose product with ours overflows"
        return None

    def turned_away(self, sender: str, cosine: float | None) -> str | None:
        """Note a push's cosine with ours (None: not judged, nothing noted); why its sender's latest pushes,
        together, point away from ours (a strike), or None."""
        if cosine is None or not math.isfinite(cosine):
            return None
        latest = touch(self.angles, sender, lambda: deque(maxlen=ANGLE_WINDOW))
        latest.append(cosine)
        mean = sum(latest) / len(latest)
        if len(latest) >= ANGLE_MIN_PUSHES and mean < -OPPOSED_MEAN_COSINE:
            return f"pushed updates pointing away from ours (mean cosine {mean:.2f} over its latest {len(latest)})"
        return None

    @staticmethod
    def opposed(cosine: float | None) -> bool:
        """Whether a push of this cosine with ours points away from ours (NaN included; None: not judged)."""
        return cosine is not None and not cosine >= -OPPOSED_COSINE

    def scale(self, norm: float, cosine: float | None = None) -> float:
        """The factor a push of this norm is added with: 1, less past the bound, 0 if it is evidence (not finite,
        past PUSH_STRIKE_RATIO) or opposed to ours (an honest push rarely is: none of it is taken)."""
        if self.own_norm is None or self.evidence(norm, cosine) is not None or self.opposed(cosine):
            return 0.0
        bound = PUSH_NORM_BOUND * self.own_norm
        return 1.0 if norm <= bound else bound / norm
