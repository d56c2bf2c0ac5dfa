"""The local wire between an attached training process and its host's daemon: typed requests, checked.

It rides the control socket (a Unix socket, mode 0600, in the daemon's home): a client sends the control
command `attach` and keeps the connection, which then carries msgpack requests, one reply each, in order,
framed like every control-socket message (peer/control.py's `pack`: protocol/frames.py's length prefix).
A `share` request carries the segment's descriptor (SCM_RIGHTS, peer/attach/shm.py). Only processes of the
daemon's user reach the socket, but a client is still checked like a peer: every field's type and range here,
at decode, so the service only ever sees well-formed requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from peer.attach.shm import SEGMENT_DTYPES
from peertrain.swarm import AVERAGE_MODES
from protocol.schema.topology import MAX_GROUP_CHARS
from protocol.tensor_codec import DENSE_CODECS

PROTOCOL = 1  # bumped when a request changes meaning; a client of another version is refused at attach
MAX_FRAME = 1 << 20  # one request (a metrics dict, a group's specs): far above honest use, small enough to hold
MAX_REPLY = 16 << 20  # a reply (exchange results, membership news) the client accepts
# (the `attach` command that opens a session is a control request: peer/control.py's MAX_REQUEST bounds it)
MAX_TENSORS = 4096  # tensors in one group: a large transformer has ~1000 parameter tensors
MAX_NAME = 200  # characters of a tensor name (or a label)
MAX_GROUP = MAX_GROUP_CHARS  # characters of a group name: peers' records list the groups they share
MAX_DIMS = 8
MAX_METRICS = 64  # keys of one publish: a trainer's figures, not a log


class WireError(ValueError):
    """A malformed request; the message says which field and why."""


def unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as exc:
        raise WireError(f"not msgpack: {type(exc).__name__}") from None


def _name(v: Any, what: str, longest: int = MAX_NAME) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= longest:
        raise WireError(f"{what}: expected a name of 1 to {longest} characters")
    return v


def _group(v: Any, what: str) -> str:
    return _name(v, what, MAX_GROUP)


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise WireError(f"{what}: expected an integer from {lo} to {hi}")
    return v


@dataclass(frozen=True)
class Share:
    """Average these tensors (they live in the segment sent with this request) as group `group`: with `codec`
    ("" for the daemon's), error feedback or not, or only serve them to joining partners (`averaged` false)."""

    group: str
    specs: list[tuple[str, str, tuple[int, ...]]]
    codec: str = ""
    error_feedback: bool = False
    averaged: bool = True


@dataclass(frozen=True)
class Unshare:
    group: str


@dataclass(frozen=True)
class Average:
    """Average `group` now: with one neighbour (AD-PSGD) or all (D-PSGD); `wait` for the results, or start it
    in the background. `step` is the client's optimizer step, shown to peers that join."""

    group: str
    mode: str
    wait: bool
    step: int


@dataclass(frozen=True)
class Download:
    """Replace the group's tensors with a partner's, if that partner's step is at least `min_step`."""

    group: str
    min_step: int


@dataclass(frozen=True)
class Publish:
    metrics: dict[str, Any]


@dataclass(frozen=True)
class Poll:
    """Membership news, neighbours, which groups are averaging: what a client asks between steps."""


@dataclass(frozen=True)
class Detach:
    """Unshare everything and end the session (a crashed client's connection ending does the same)."""


Request = Share | Unshare | Average | Download | Publish | Poll | Detach


def decode(obj: Any) -> Request:
    """A request from its msgpack form, or WireError naming what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise WireError("a request is a map with an 'op'")
    op = obj["op"]
    if op == "share":
        raw = obj.get("specs")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TENSORS:
            raise WireError(f"share.specs: expected 1 to {MAX_TENSORS} tensors")
        specs, seen = [], set()
        for i, s in enumerate(raw):
            if not isinstance(s, list) or len(s) != 3:
                raise WireError(f"share.specs[{i}]: expected [name, dtype, shape]")
            name = _name(s[0], f"share.specs[{i}].name")
            if name in seen:
                raise WireError(f"share.specs[{i}]: tensor {name!r} named twice")
            seen.add(name)
            if s[1] not in SEGMENT_DTYPES:
                raise WireError(f"share.specs[{i}].dtype: expected one of {', '.join(SEGMENT_DTYPES)}")
            if not isinstance(s[2], list) or len(s[2]) > MAX_DIMS:
                raise WireError(f"share.specs[{i}].shape: expected at most {MAX_DIMS} dimensions")
            shape = tuple(_int(d, f"share.specs[{i}].shape", 0, 1 << 40) for d in s[2])
            specs.append((name, s[1], shape))
        codec = obj.get("codec", "")
        if codec not in ("", *DENSE_CODECS):
            raise WireError(f"share.codec: expected one of {', '.join(DENSE_CODECS)} (or empty: the daemon's)")
        flags = {k: obj.get(k, default) for k, default in (("error_feedback", False), ("averaged", True))}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise WireError(f"share.{k}: expected true or false")
        return Share(_group(obj.get("group"), "share.group"), specs, codec, **flags)
    if op == "unshare":
        return Unshare(_group(obj.get("group"), "unshare.group"))
    if op == "average":
        if obj.get("mode") not in AVERAGE_MODES:
            raise WireError(f"average.mode: expected one of {', '.join(AVERAGE_MODES)}")
        if not isinstance(obj.get("wait"), bool):
            raise WireError("average.wait: expected true or false")
        return Average(_group(obj.get("group"), "average.group"), obj["mode"], obj["wait"],
                       _int(obj.get("step"), "average.step", 0, 1 << 62))
    if op == "download":
        return Download(_group(obj.get("group"), "download.group"), _int(obj.get("min_step"), "download.min_step", 0, 1 << 62))
    if op == "publish":
        m = obj.get("metrics")
        if not isinstance(m, dict) or len(m) > MAX_METRICS:
            raise WireError(f"publish.metrics: expected a map of at most {MAX_METRICS} figures")
        for k, v in m.items():
            _name(k, "publish.metrics key")
            ok = v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and not math.isnan(v))
            if not ok or (isinstance(v, str) and len(v) > 500):
                raise WireError(f"publish.metrics[{k!r}]: expected a number, a short string or null")
        return Publish(dict(m))
    if op == "poll":
        return Poll()
    if op == "detach":
        return Detach()
    raise WireError(f"unknown op {op[:40]!r}")


def encode(req: Request) -> dict:
    """The msgpack form of a request (the client's side of `decode`)."""
    if isinstance(req, Share):
        return {"op": "share", "group": req.group, "specs": [[n, d, list(s)] for n, d, s in req.specs],
                "codec": req.codec, "error_feedback": req.error_feedback, "averaged": req.averaged}
    if isinstance(req, Unshare):
        return {"op": "unshare", "group": req.group}
    if isinstance(req, Average):
        return {"op": "average", "group": req.group, "mode": req.mode, "wait": req.wait, "step": req.step}
    if isinstance(req, Download):
        return {"op": "download", "group": req.group, "min_step": req.min_step}
    if isinstance(req, Publish):
        return {"op": "publish", "metrics": req.metrics}
    if isinstance(req, Poll):
        return {"op": "poll"}
    return {"op": "detach"}
