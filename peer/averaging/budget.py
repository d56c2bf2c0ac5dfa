"""The weight of the exchanges in flight at one peer, and the transfers it serves at once.

Convexity under concurrency: a peer runs at most one exchange per neighbour at a time (when both
initiate at once, the smaller peer ID's offer wins) and never lets the weights of exchanges in flight add
up to more than 1, so each update stays a convex combination even with many exchanges at once. An
initiator sets its weight aside before it offers, so exchanges it serves meanwhile cannot take it; a
server may accept with less than offered (down to a quarter of the rule's weight) rather than refuse.
When both ends initiate at once, the winner's offer is served with the loser's own reservation: the
loser's offer is refused or never sent, so no weight is counted twice, and D-PSGD rounds, where every
peer initiates with every neighbour at once, do not starve each other's budgets.

The initiator's side (peer/averaging/engine.py) and the server's (serving.py) share one `WeightBudget`;
the server's side and parameter downloads (download.py) share one `ServingSlots`.
"""

from __future__ import annotations

from peer.averaging.weights import MIN_WEIGHT_SHARE

_EPS = 1e-12  # float slack on "at least a quarter of the rule's weight" (1/3 * 0.25 is not exact)


class WeightBudget:
    """Weight set aside per peer: for the exchange we initiated with it, and for the one we serve it."""

    def __init__(self, me: str):
        self.me = me
        self.initiating: dict[str, float] = {}  # peer -> weight set aside for the exchange we initiated
        self.serving: dict[str, float] = {}  # peer -> weight of the exchange we serve for it

    def room(self) -> float:
        """Weight still free: all exchanges in flight, served or initiated, add up to <= 1."""
        return 1.0 - sum(self.serving.values()) - sum(self.initiating.values())

    def busy_with(self, peer_id: str) -> bool:
        """Is an exchange with `peer_id` under way, either way round?"""
        return peer_id in self.serving or peer_id in self.initiating

    def loses_collision(self, peer_id: str) -> bool:
        """Would an offer from `peer_id` be refused as a second exchange with it? On a collision (we
        initiated with it too) the smaller peer ID's offer wins."""
        return peer_id in self.serving or (peer_id in self.initiating and peer_id > self.me)

    def offerable(self, cap: float) -> float | None:
        """The most an offer may carry under a rule capped at `cap`, or None when our room is under a quarter
        of the cap (an exchange that small is not worth its bytes)."""
        w = min(cap, self.room())
        return w if w >= MIN_WEIGHT_SHARE * cap - _EPS else None

    def acceptable(self, peer_id: str, offered: float, cap: float) -> float | None:
        """The weight we can serve `peer_id`'s offer with: the least of what it offered, our cap and our room,
        counting as ours what we set aside for our own offer to it (it lost the collision: that offer is
        refused, since our reply follows theirs on the session, or never sent). None when under a quarter of
        the cap."""
        room = self.room() + self.initiating.get(peer_id, 0.0)
        w = min(offered, cap, room)
        return w if w >= MIN_WEIGHT_SHARE * cap - _EPS else None

    def in_flight(self) -> int:
        """Peers with an exchange under way."""
        return len(self.serving.keys() | self.initiating.keys())


class ServingSlots:
    """How many transfers we serve at once, exchanges and downloads together: each holds a snapshot of
    a group and a share of our upload, so [gossip] max_concurrent_exchanges bounds them all."""

    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0

    def full(self) -> bool:
        """All slots taken: a request for another transfer is refused as busy."""
        return self.taken >= self.limit

    def take(self) -> None:
        """Take a slot for a transfer we now serve (checked with `full` first); `give_back` when it ends."""
        self.taken += 1

    def give_back(self) -> None:
        self.taken -= 1
