"""The tensors a trainer shares for averaging, and how an exchange reads and updates them.

A trainer keeps training while exchanges run, so the engine works on snapshots: each side sends a copy of
its tensors taken under the trainer's lock, and the exchange's whole effect is one in-place addition,
x += w * s * (other's snapshot - own snapshot), made block by block (s <= 1, the same on both sides:
peer/averaging/bounds.py). Both are additions, so a trainer step and an update can interleave in any
order without changing the sum (peer/averaging/exchange.py).

A lock may be bounded: an attached process's (peer/attach/shm.py) gives up with a TimeoutError when the
other process holds it too long. Before an exchange commits that only fails it (the snapshot raises,
nothing is applied on either side). After, the other side applies its half whatever we do, and a server
cannot refuse a commit, so an update must never stop half-way: what cannot be added for want of the lock
is owed (kept, one buffer per group however many updates it sums), and added under the lock the next
time the engine has it (a snapshot, the next exchange's first step). The sum is whole again then, and
anything the engine reads of the group (snapshots, stats, downloads served) already includes it.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import numpy as np

from peer.averaging import norms
from peer.averaging.bounds import clip_scale, opposed
from peer.averaging.reach import OwnReach
from protocol.limits import DEFAULT_LIMITS
from protocol.schema.gossip import TensorSpec
from protocol.schema.topology import MAX_GROUP_CHARS
from protocol.tensor_codec import DTYPES as TENSOR_DTYPES
from protocol.tensor_codec import DENSE_CODECS, FLOAT_DTYPES, codec_params, tensor_nbytes
from protocol.tensor_decoder import TensorDecoder
from protocol.tensor_encoder import TensorEncoder

MAX_SPARE = 1  # idle buffer sets kept per group: bounds the memory this costs to one copy
APPLY_BLOCK_BYTES = 1 << 20  # a block and its two operands stay in L2


def _dtype_name(t: Any) -> str:
    if isinstance(t, np.ndarray):
        return str(t.dtype)
    return str(t.dtype).removeprefix("torch.")


class SharedTensors:
    """A named group of tensors a trainer shares for averaging, guarded by one lock.

    Holds numpy arrays or torch tensors (CPU or CUDA). The trainer takes `lock` while it changes them
    (an optimizer step); the engine takes it to snapshot them and to add an exchange's update.
    """

    def __init__(self, name: str, tensors: dict[str, Any], *, lock: threading.Lock | None = None,
                 codec: str | None = None, error_feedback: bool = False, averaged: bool = True):
        if not (isinstance(name, str) and 0 < len(name) <= MAX_GROUP_CHARS):  # our records list it to every peer
            raise ValueError(f"group name {name!r}: expected a string of 1 to {MAX_GROUP_CHARS} characters")
        for key, t in tensors.items():
            if not (t.flags.c_contiguous if isinstance(t, np.ndarray) else t.is_contiguous()):
                raise ValueError(f"tensor {key!r} of group {name!r} is not contiguous: the engine updates it in "
                                 "place, so pass a contiguous one (np.ascontiguousarray / .contiguous())")
            if _dtype_name(t) not in FLOAT_DTYPES:
                raise ValueError(f"tensor {key!r} of group {name!r} is {_dtype_name(t)}: averaging adds fractional "
                                 f"weights in place, so share only floating-point tensors ({', '.join(sorted(FLOAT_DTYPES))}); "
                                 "keep counters such as BatchNorm's num_batches_tracked out of the group")
        if codec is not None and codec not in DENSE_CODECS:
            raise ValueError(f"group {name!r}: codec {codec!r} is not one of {', '.join(DENSE_CODECS)}")
        self.name = name
        self.tensors = dict(tensors)
        self.codec = codec  # how its exchanges encode it (None: the daemon's [gossip] codec)
        self.error_feedback = error_feedback  # carry a lossy codec's rounding into the next exchange
        self.averaged = averaged  # False: served to joining partners (download) but never averaged
        self.push_lr: float | None = None  # partners' pushed updates are added x push_lr / n (None: refused)
        self._residual: list[Any] | None = None  # what lossy sends left out so far (error feedback)
        self._residual_busy = False  # one exchange at a time carries the residual
        self._residual_lock = threading.Lock()  # guards the reservation (taken in worker threads)
        self.lock = lock or threading.Lock()
        self.step = 0  # the trainer's step, shared in offers so late joiners can tell who is ahead
        self.is_torch = not all(isinstance(t, np.ndarray) for t in self.tensors.values())
        self.specs = [TensorSpec(name=k, dtype=_dtype_name(t), shape=list(t.shape)) for k, t in self.tensors.items()]
        self.nbytes = sum(int(np.prod(s.shape)) * TENSOR_DTYPES[s.dtype].itemsize for s in self.specs)
        self.elements = sum(int(np.prod(s.shape)) for s in self.specs)  # the values the angle is judged over
        self.last_distance: float | None = None  # ||x_other - x_own|| / ||x_own|| at the last exchange
        self.norm: float | None = None  # ||x|| at the last update's snapshot (None: not known yet, or replaced since)
        self._spare: list[list[Any]] = []  # CPU buffers shaped like `tensors`, reused by snapshot()
        self._spare_lock = threading.Lock()
        self._owed: list[Any] | None = None  # updates not yet added for want of the lock (module docstring)
        self._owed_lock = threading.Lock()  # guards `_owed` (an apply owes without holding `lock`)
        self.reach = OwnReach([int(np.prod(s.shape)) for s in self.specs])  # how far our own steps move us

    def snapshot(self) -> list[Any]:
        """Copies of every tensor, on the CPU (a consistent cut: taken under the lock).

        The copies go into spare buffers when there are some (`release`): a fresh array costs page
        faults and kernel zeroing on every exchange (about as much as the copy itself), a reused one only the copy.
        """
        with self._spare_lock:
            bufs = self._spare.pop() if self._spare else None
        with self.lock:
            self._settle_owed()
            if bufs is None:
                if self.is_torch:
                    bufs = [t.detach().to("cpu", copy=True) for t in self.tensors.values()]
                else:
                    bufs = [t.copy() for t in self.tensors.values()]
            else:
                for buf, t in zip(bufs, self.tensors.values()):
                    if self.is_torch:
                        buf.copy_(t.detach())
                    else:
                        np.copyto(buf, t)
            self.reach.snapshot(bufs)  # under the lock: no update lands between the cut and its probe
            return bufs

    def as_sent(self, values: list[Any], codec: str) -> list[Any]:
        """What a neighbour decodes from `values` (a snapshot of this group) sent with `codec`.

        Why: each side adds w * (received - own). With a lossy codec the received copy of our snapshot is
        q(own), not own, so only w * (q(b) - q(a)) on one side and w * (q(a) - q(b)) on the other cancel;
        using the exact snapshot would change the swarm-wide sum by w * ((q(a) - a) + (q(b) - b)) per exchange.
        """
        if codec == "raw":
            return values
        out = []
        for v in values:  # encode and decode in memory; NaN/Inf kept (the receiver judges those)
            encoder = TensorEncoder("x", v, codec=codec)
            decoder = TensorDecoder(encoder.header(0), DEFAULT_LIMITS, allow_nonfinite=True)
            for chunk in encoder.chunks():
                decoder.write(chunk)
            got = decoder.finish()
            out.append(got.to_torch() if self.is_torch else got.array)
        return out

    def wire_nbytes(self, codec: str) -> int:
        """Bytes one side's tensors take on the wire with `codec` (what an exchange really sends, for the
        counters and the link measurements that rewiring trusts: a q8 exchange moves about a quarter)."""
        return sum(tensor_nbytes(s.dtype, s.shape, codec, *codec_params(codec)) for s in self.specs)

    def add_residual(self, own: list[Any], codec: str) -> bool:
        """Error feedback, before a lossy send: add to our snapshot `own` (in place) what earlier sends left out,
        and reserve the residual for this exchange (True), unless another exchange holds it or there is nothing
        to carry. Why it keeps the sum and still converges: both sides apply w * (q(b + r_b) - q(a + r_a)), so
        the pair's updates cancel exactly; each side's rounding error is the change of its residual, which
        telescopes over exchanges instead of adding up (`keep_residual`). A whole-group pass: call it from a
        worker thread."""
        if not self.error_feedback or codec == "raw":
            return False
        with self._residual_lock:
            if self._residual_busy:
                return False
            self._residual_busy = True
        if self._residual is not None:
            for o, r in zip(own, self._residual):
                o += r
        return True

    def keep_residual(self, own: list[Any], sent: list[Any] | None) -> None:
        """After an exchange that reserved the residual (`add_residual`): if it committed (`sent`, what the
        other side decoded of `own`), the new residual is what this send left out (own - sent); if it did not
        (None), the old one stands. Releases the reservation. A whole-group pass: call it from a worker thread."""
        try:
            if sent is not None:
                if self._residual is None:
                    self._residual = [o - s for o, s in zip(own, sent)]
                else:
                    for r, o, sv in zip(self._residual, own, sent):
                        r[...] = o - sv
        finally:
            self._residual_busy = False

    def release(self, bufs: list[Any]) -> None:
        """Hand back a snapshot, or received tensors of the same specs, once nothing reads them anymore."""
        if len(bufs) != len(self.tensors) or not all(_fits(buf, t) for buf, t in zip(bufs, self.tensors.values())):
            return
        with self._spare_lock:
            if len(self._spare) < MAX_SPARE:
                self._spare.append(bufs)

    def apply(self, weight: float, others: list[Any], own: list[Any], *,
              radii: tuple[float, float] | None = None) -> Applied:
        """x += weight * s * (other - own) for every tensor, in place (the exchange's whole effect); returns
        s, ||other - own|| and whether the two point away from each other (Applied).

        s is 1, or less where the distance is past the smaller of the two sides' announced `radii`
        (peer/averaging/bounds.py; None: never clipped, the bench's switch). Both sides compute the same s
        from the same pair: the distance and the product (for `opposed`) come from norms.diff_sq_and_dot over
        the wire values `others` and `own`, whatever the tensors are (numpy, torch, CUDA, bfloat16), so the
        pair's updates cancel. Why two
        passes: s must be known before anything is added (a trainer step may read the tensors meanwhile),
        so a first read-only pass takes the distance; a second adds, block by block, the difference going
        to one small scratch block that stays in cache, so `others` (the received copy) is only read; our
        snapshot's norm (for the next radius) is taken there, from its blocks in cache. The lock is taken
        per block, so a trainer step waits for one block at most; both are additions, so how they
        interleave does not change the result. Torch tensors in CPU memory take the same path through
        numpy views of their memory; only device tensors and bfloat16 (no numpy dtype) use whole-tensor
        torch operations. It never raises for want of the lock: if the lock times out, the blocks not yet
        added are owed (`owing`; the module docstring).
        """
        pointing_away = False
        if radii is not None:
            diff_sq, dot = norms.diff_sq_and_dot(others, own)
            scale = clip_scale(diff_sq, *radii, dot=dot, elements=self.elements)
            pointing_away = opposed(diff_sq, dot, self.elements)
        else:
            diff_sq, scale = None, 1.0
        if scale > 0.0:
            self.reach.applied(weight * scale, others, own)  # counted before it lands (reach.py)
        own_sq = 0.0  # of our snapshot: the distance's yardstick in status, and our next radius's
        arrays = _host_arrays(self.tensors.values(), others, own)
        if arrays is None:
            import torch

            if diff_sq is None:
                diff_sq = norms.diff_sq(others, own)  # (the bench's switch: only for the distance status shows)
            if scale > 0.0:
                deltas = []
                for o, a in zip(others, own):
                    d = o.to(a.dtype) if isinstance(o, torch.Tensor) else torch.from_numpy(np.asarray(o)).to(a.dtype)
                    deltas.append(d.sub(a))
                moved = [d.to(t.device, non_blocking=False) for t, d in zip(self.tensors.values(), deltas)]
                try:
                    with self.lock:
                        for t, d in zip(self.tensors.values(), moved):
                            t.data.add_(d, alpha=weight * scale)
                except TimeoutError:  # raised taking it, before the first add: all of it is owed
                    for k, d in enumerate(moved):
                        self._owe(k, 0, d.mul_(weight * scale))
                own_sq = norms.sum_sq(own)
        elif scale > 0.0:
            locked = True  # False once the lock timed out: the blocks left are owed, not waited for again
            measured = 0.0  # the distance on the way, in cache, when the first pass did not take it
            for k, (t, o, a) in enumerate(zip(*arrays)):
                tf, of, af = t.reshape(-1), o.reshape(-1), a.reshape(-1)
                step = max(1, APPLY_BLOCK_BYTES // tf.itemsize)
                scratch = np.empty(min(step, tf.shape[0]), dtype=tf.dtype)
                for i in range(0, tf.shape[0], step):
                    tb = tf[i:i + step]
                    d = scratch[:tb.shape[0]]
                    np.subtract(of[i:i + step], af[i:i + step], out=d)
                    own_sq += _sum_sq(af[i:i + step])  # in cache, as the subtraction left it
                    if diff_sq is None:
                        measured += _sum_sq(d)
                    d *= weight * scale
                    if locked:
                        try:
                            with self.lock:
                                np.add(tb, d, out=tb)
                            continue
                        except TimeoutError:  # raised taking it: this block is not added
                            locked = False
                    self._owe(k, i, d)
            if diff_sq is None:
                diff_sq = measured
        if scale > 0.0:
            self.norm = own_sq ** 0.5
        assert diff_sq is not None
        distance = diff_sq ** 0.5 if diff_sq >= 0.0 else math.nan
        norm = self.norm or 0.0
        self.last_distance = distance / norm if norm > 0 else distance
        return Applied(scale, distance, pointing_away)

    def add_scaled(self, weight: float, values: list[Any]) -> None:
        """x += weight * values for every tensor, in place: a partner's pushed update (peer/averaging/pushes.py),
        which nothing sends back, so there is no pair's sum to keep. Block by block under the lock, as `apply`
        adds; blocks the lock refuses (an attached process held it past its bound) are owed, never dropped."""
        arrays = _host_arrays(self.tensors.values(), values)
        if arrays is None:
            import torch

            moved = [(v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))).to(t.device, t.dtype)
                     for t, v in zip(self.tensors.values(), values)]
            try:
                with self.lock:
                    for t, d in zip(self.tensors.values(), moved):
                        t.data.add_(d, alpha=weight)
            except TimeoutError:
                for k, d in enumerate(moved):
                    self._owe(k, 0, d.mul_(weight))
            return
        locked = True
        for k, (t, v) in enumerate(zip(*arrays)):
            tf, vf = t.reshape(-1), v.reshape(-1)
            step = max(1, APPLY_BLOCK_BYTES // tf.itemsize)
            for i in range(0, tf.shape[0], step):
                tb = tf[i:i + step]
                d = np.multiply(vf[i:i + step], weight, dtype=tf.dtype)
                if locked:
                    try:
                        with self.lock:
                            np.add(tb, d, out=tb)
                        continue
                    except TimeoutError:
                        locked = False
                self._owe(k, i, d)

    def own_norm(self, values: list[Any]) -> float:
        """Our norm, for the radius we announce: our snapshot's at the last update, or (none yet, or our
        tensors were replaced since) that of `values`, our snapshot now. A whole-group pass only then: call it
        from a worker thread."""
        if self.norm is None:
            self.norm = norms.sum_sq(values) ** 0.5
        return self.norm

    @property
    def owing(self) -> bool:
        """Is an update owed (its lock timed out mid-apply), not yet added?"""
        return self._owed is not None

    def _owe(self, k: int, start: int, delta: Any) -> None:
        """Keep `delta`, the part of an update for tensor `k` from flat element `start` on, to add later."""
        with self._owed_lock:
            if self._owed is None:
                self._owed = [_zeros_like(t) for t in self.tensors.values()]
            owed = self._owed[k]
            if isinstance(owed, np.ndarray):
                part = owed.reshape(-1)[start:start + delta.shape[0]]
                np.add(part, delta, out=part)
            else:
                owed.add_(delta)

    def _settle_owed(self) -> None:
        """Add what earlier updates owe (the caller holds `lock`)."""
        with self._owed_lock:
            owed, self._owed = self._owed, None
        if owed is None:
            return
        for t, d in zip(self.tensors.values(), owed):
            if isinstance(d, np.ndarray):
                view = t if isinstance(t, np.ndarray) else t.detach().numpy()
                np.add(view, d, out=view)
            else:
                t.data.add_(d)

    def distance_sq(self, values: list[Any]) -> tuple[float, float, float]:
        """(||values - x||^2, ||x||^2, ||values||^2) against the tensors now: checks a parameter download."""
        own = self.snapshot()
        try:
            return norms.diff_sq(values, own), norms.sum_sq(own), norms.sum_sq(values)
        finally:
            self.release(own)

    def norm_sq(self) -> float:
        """||x||^2 of the tensors now (0: a model of zeros, which takes a download only a second one confirms)."""
        own = self.snapshot()
        try:
            return norms.sum_sq(own)
        finally:
            self.release(own)

    def stats(self, *, values: bool = False) -> dict:
        """Sum and squared norm (float64) of the whole group now; with `values`, the raw bytes too."""
        snap = self.snapshot()
        arrs = [t.numpy() if not isinstance(t, np.ndarray) else t for t in snap] if self.is_torch else snap
        out = {"sum": float(sum(np.sum(a, dtype=np.float64) for a in arrs)),
               "sumsq": float(sum(np.dot(a.ravel().astype(np.float64), a.ravel().astype(np.float64)) for a in arrs)),
               "nbytes": self.nbytes, "step": self.step}
        if values:
            out["values"] = [np.ascontiguousarray(a).tobytes() for a in arrs]
            out["dtypes"] = [str(a.dtype) for a in arrs]
        return out

    def sync(self) -> None:
        """Nothing to fold in: the engine updates these tensors in place (SharedGroup's interface, which an
        attached process's mirrored GPU tensors need)."""

    def load(self, values: list[Any]) -> None:
        """Replace every tensor's value (a joining peer adopting a neighbour's parameters; an update still
        owed is dropped with the values it was for)."""
        with self.lock:
            with self._owed_lock:
                self._owed = None
            self.norm = None  # taken again at the next exchange
            self.reach.restart()  # replaced, not moved by our steps
            for t, v in zip(self.tensors.values(), values):
                if self.is_torch:
                    t.data.copy_(v.to(t.device))
                else:
                    t[...] = v


def _zeros_like(t: Any) -> Any:
    """A zero buffer an owed update of `t` adds into: numpy where the blocked update views `t` as numpy (numpy
    arrays, torch CPU tensors numpy can view), else a torch tensor on `t`'s device."""
    if isinstance(t, np.ndarray):
        return np.zeros_like(t)
    arrays = _host_arrays([t])
    if arrays is not None:
        return np.zeros_like(arrays[0][0])
    import torch

    return torch.zeros_like(t.detach())


class Applied(NamedTuple):
    """What one apply did: the clip's factor s, ||other - own||, and whether the two point away from each
    other (bounds.opposed: s is 0 then, and radius.py strikes the partner)."""

    scale: float
    distance: float
    opposed: bool


def _sum_sq(v: np.ndarray) -> float:
    """Sum of squares of a block in cache, for what only this side reads (our norm, the distance status shows
    without the clip); float16 is widened first (its own dot product overflows past 65504). What both sides
    must agree on is norms.diff_sq_and_dot's."""
    if v.dtype.itemsize < 4:
        v = v.astype(np.float64)
    with np.errstate(over="ignore"):  # values near the dtype's limit square to inf: radius.py takes nothing then
        return float(np.dot(v, v))


def _host_arrays(*groups) -> tuple[list[np.ndarray], ...] | None:
    """numpy arrays sharing the memory of every tensor in `groups` (numpy arrays as they are, torch CPU
    tensors through `.numpy()`), or None if one cannot be viewed so (on a device, or bfloat16).

    No contiguity check here: a group's own tensors are contiguous (`SharedTensors` refuses others), and
    snapshots and received copies are fresh arrays. Returning None for a numpy array would send a numpy
    group down the torch path, which cannot take it."""
    out: tuple[list[np.ndarray], ...] = tuple([] for _ in groups)
    for views, tensors in zip(out, groups):
        for t in tensors:
            if not isinstance(t, np.ndarray):
                if getattr(getattr(t, "device", None), "type", None) != "cpu":
                    return None
                try:
                    t = t.detach().numpy()
                except (TypeError, RuntimeError):  # a dtype numpy lacks
                    return None
            views.append(t)
    return out


def _fits(buf: Any, t: Any) -> bool:
    """Can `buf` hold a CPU snapshot of `t`: same dtype and shape, contiguous, writable, on the CPU?"""
    if isinstance(t, np.ndarray):
        return (isinstance(buf, np.ndarray) and buf.dtype == t.dtype and buf.shape == t.shape
                and buf.flags.c_contiguous and buf.flags.writeable)
    return (not isinstance(buf, np.ndarray) and buf.dtype == t.dtype and tuple(buf.shape) == tuple(t.shape)
            and buf.device.type == "cpu" and buf.is_contiguous())
