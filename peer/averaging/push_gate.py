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
  added: the decoded push, against our own decoded push on its support) is not added, and is a strike: honest
  peers of one task, training from one model, take rounds that point the same way, so a sign-flipped update
  (ours, or the swarm's mean negated, which holds ours) is a liar's. Honest pushes read +0.01 to +0.03 on
  `lm_14m` at one step a round, +0.13 to +0.28 on the tests' char model at 20 (docs/benchmarks.md): above
  -0.1 by far more than their spread. As for exchanges, a group under OPPOSED_MIN_ELEMENTS values is not
  judged so (pushes.py gives no support then).

The cheapest attack is a key that pushes just inside the bound as often as the bucket lets it: 4.5 of our
round's move per round, per key, and never struck; the angle does not see a push orthogonal to ours (noise,
or the others' mean negated off our support). Only partners may push (neighbours, whose number the degree
caps), so k Sybil neighbours reach 4.5k.
"""

from __future__ import annotations

import math
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


@dataclass
class PushGate:
    """One group's record of our own pushes, and each partner's token bucket for its pushes to us."""

    own_norm: float | None = None  # ||our last push|| (None: we have not pushed yet)
    own_at: float | None = None  # when we last pushed
    own_round_s: float | None = None  # seconds between our last two pushes
    own_support: list[tuple[np.ndarray, np.ndarray]] | None = None  # our last push per tensor: (flat indices, values)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)  # sender -> its pushes' token bucket

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
        """Why a push of this norm (and cosine with our own) is evidence against its sender (a strike), or None."""
        if self.own_norm is None:
            return None
        if not math.isfinite(norm) or norm > PUSH_STRIKE_RATIO * self.own_norm:
            return f"pushed an update {norm:.3g} long, past {PUSH_STRIKE_RATIO:g}x our own ({self.own_norm:.3g})"
        if self.opposed(cosine):
            return f"pushed an update pointing away from ours (cosine {cosine:.2f})"
        return None

    @staticmethod
    def opposed(cosine: float | None) -> bool:
        """Whether a push of this cosine with ours points away from ours (NaN included; None: not judged)."""
        return cosine is not None and not cosine >= -OPPOSED_COSINE

    def scale(self, norm: float, cosine: float | None = None) -> float:
        """The factor a push of this norm is added with: 1, less past the bound, 0 if it is evidence (not finite,
        past PUSH_STRIKE_RATIO, or opposed to ours: no honest push, so none of it is taken)."""
        if self.own_norm is None or self.evidence(norm, cosine) is not None:
            return 0.0
        bound = PUSH_NORM_BOUND * self.own_norm
        return 1.0 if norm <= bound else bound / norm
