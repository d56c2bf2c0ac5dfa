"""A stage's live training state as a flat list of named tensors, the form it travels in between peers.

A peer moving to another stage downloads that stage's state from a peer serving it, as a tensor
group: (name, dtype, shape) specs first, then the tensors. The receiver checks the specs against
what its own stage can load (`check_specs`) before it allocates anything; the sender may be hostile.

Name grammar:

``m/<global key>``
    One module state_dict entry (parameter or buffer), keyed model-wide as
    `StageWorker._global` writes it ("m/3.attn.qkv.weight"). Every entry of the stage is
    required, with exactly its dtype and shape.
``o/<global param name>/<state key>``
    One per-parameter optimizer state value ("o/3.attn.qkv.weight/exp_avg"), for a parameter the
    stage's optimizer trains. The state key matches ``[A-Za-z_][A-Za-z0-9_]{0,31}``, at most
    `MAX_KEYS_PER_PARAM` per parameter; the dtype is a float dtype; the shape is the parameter's
    or [] (0-d). Tensor states travel as they are; Python-number states (older optimizers keep
    `step` as a float) travel as 0-d float64 tensors under the key suffixed ":num"
    ("o/3.ln1.weight/step:num") and come back as Python numbers (an int if integral). None
    states are left out. A parameter may have no state (a fresh optimizer has none at all).

No name twice, no other prefix, at most `ENTRIES_PER_MODULE_ENTRY` entries per module entry.
Where the receiver's optimizer can be probed (a throwaway copy of it stepped once on a 2-element
parameter), each parameter with state must carry exactly the keys that optimizer keeps, each
parameter-shaped or 0-d as it keeps it, so a state the receiver could not step with is refused
up front (say from a peer using another optimizer). Hyperparameters (lr etc.) do not travel:
the receiver's configuration decides them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from protocol.tensor_codec import FLOAT_DTYPES

STATE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
NUM_SUFFIX = ":num"
MAX_KEYS_PER_PARAM = 8
ENTRIES_PER_MODULE_ENTRY = 9
REASON_CHARS = 300


def dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _short(x: Any, n: int = 100) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


@dataclass(frozen=True)
class StateLayout:
    """What one stage can load: its module entries and the parameters its optimizer trains."""

    module: dict[str, tuple[str, list[int]]]  # global key -> (dtype, shape), state_dict order
    params: dict[str, tuple[int, nn.Parameter]]  # global param name -> (optimizer index, param)
    opt_keys: dict[str, bool] | None  # state key -> parameter-shaped (else 0-d); None: unknown


def optimizer_params(opt: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in its state_dict() order (index i is state key i)."""
    return [p for g in opt.param_groups for p in g["params"]]


def probe_keys(opt: torch.optim.Optimizer) -> dict[str, bool] | None:
    """State key -> parameter-shaped?, as a copy of `opt`'s class and defaults keeps it after one
    step; None if it cannot be probed (a constructor taking other arguments, a closure, GPU only)."""
    try:
        p = nn.Parameter(torch.zeros(2))
        probe = type(opt)([p], **opt.defaults)
        p.grad = torch.zeros(2)
        probe.step()
        state = probe.state.get(p, {})
        return {k: isinstance(v, Tensor) and v.dim() > 0 for k, v in state.items()
                if v is not None and isinstance(k, str) and STATE_KEY.fullmatch(k)}
    except Exception:  # noqa: BLE001 (any optimizer may fail in its own way: then it is not probed)
        return None


def check_specs(layout: StateLayout, specs: Any) -> str | None:
    """None if `specs` [(name, dtype, shape)] is a state `layout` can load, else why (the first offender).

    Allocates nothing proportional to the specs but the set of names seen (and a count per parameter).
    """
    return None if (r := _check(layout, specs)) is None else r[:REASON_CHARS]


def _check(layout: StateLayout, specs: Any) -> str | None:
    if not isinstance(specs, (list, tuple)):
        return f"the specs are a {type(specs).__name__}, not a list"
    limit = len(layout.module) * ENTRIES_PER_MODULE_ENTRY
    if len(specs) > limit:
        return f"entry {limit}: more than {limit} entries ({ENTRIES_PER_MODULE_ENTRY} per module entry)"
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if not (isinstance(spec, (list, tuple)) and len(spec) == 3 and isinstance(spec[0], str)):
            return f"entry {i}: not a (name, dtype, shape) triple"
        name, dtype, shape = spec
        where = f"entry {i} {_short(name)}"
        if not isinstance(dtype, str) or not isinstance(shape, (list, tuple)) \
                or any(type(d) is not int for d in shape):
            return f"{where}: the dtype must be a str and the shape a list of ints"
        if name in seen:
            return f"{where}: duplicate name"
        prefix, _, rest = name.partition("/")
        if prefix == "m":
            want = layout.module.get(rest)
            if want is None:
                return f"{where}: not a module state entry of this stage"
            if dtype != want[0]:
                return f"{where}: dtype {_short(dtype, 20)}, expected {want[0]}"
            if list(shape) != want[1]:
                return f"{where}: shape {_short(list(shape), 60)}, expected {want[1]}"
        elif prefix == "o":
            why = _check_opt(layout, rest, dtype, list(shape), seen, counts)
            if why:
                return f"{where}: {why}"
        else:
            return f"{where}: unknown prefix (names start with m/ or o/)"
        seen.add(name)
    for key in layout.module:
        if f"m/{key}" not in seen:
            return f"{_short('m/' + key)}: missing (every module entry of the stage is required)"
    keys = layout.opt_keys if layout.opt_keys is not None else {}
    for pname in counts:
        for key in keys:
            if f"o/{pname}/{key}" not in seen and f"o/{pname}/{key}{NUM_SUFFIX}" not in seen:
                return (f"{_short(f'o/{pname}/{key}')}: missing (this stage's optimizer keeps "
                        f"{', '.join(keys)} for a parameter with state)")
    return None


def _check_opt(layout: StateLayout, rest: str, dtype: str, shape: list[int], seen: set[str],
               counts: dict[str, int]) -> str | None:
    pname, _, key = rest.rpartition("/")
    if pname not in layout.params:
        return "not a parameter this stage's optimizer trains"
    base = key.removesuffix(NUM_SUFFIX)
    num = base != key
    if not STATE_KEY.fullmatch(base):
        return "bad state key (want [A-Za-z_][A-Za-z0-9_]{0,31}, optionally with :num)"
    if (f"o/{pname}/{base}" if num else f"o/{rest}{NUM_SUFFIX}") in seen:
        return "duplicate state key (both as a tensor and as a number)"
    if counts.get(pname, 0) >= MAX_KEYS_PER_PARAM:
        return f"more than {MAX_KEYS_PER_PARAM} state keys for one parameter"
    if dtype not in FLOAT_DTYPES:
        return f"dtype {_short(dtype, 20)}: optimizer state must be a float dtype"
    pshape = list(layout.params[pname][1].shape)
    if num and (dtype != "float64" or shape):
        return "a :num state travels as a 0-d float64 tensor"
    if shape and shape != pshape:
        return f"shape {_short(shape, 60)}, expected the parameter's {pshape} or []"
    if layout.opt_keys is not None:
        if base not in layout.opt_keys:
            return f"this stage's optimizer keeps no state {base!r} (it keeps {', '.join(layout.opt_keys) or 'none'})"
        shaped = layout.opt_keys[base]
        if not ((not num and shape == pshape) if shaped else not shape):
            return f"this stage's optimizer keeps {base!r} " + ("as a parameter-shaped tensor" if shaped else "0-d")
    counts[pname] = counts.get(pname, 0) + 1
    return None


def cpu_copy(t: Tensor) -> Tensor:
    """A detached, contiguous copy of `t` on the CPU."""
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def flatten(module_state: Iterable[tuple[str, Tensor]], named_params: Iterable[tuple[str, nn.Parameter]],
            opt_state: Any) -> list[tuple[str, Tensor]]:
    """The module entries (global keys) and each named parameter's optimizer state, as named tensors: the
    tensors themselves, detached (`cpu_copy` them to keep them past the caller's lock)."""
    out = [(f"m/{k}", v.detach()) for k, v in module_state]
    for name, p in named_params:
        for key, v in opt_state.get(p, {}).items():
            if isinstance(v, Tensor):
                out.append((f"o/{name}/{key}", v.detach()))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append((f"o/{name}/{key}{NUM_SUFFIX}", torch.tensor(float(v), dtype=torch.float64)))
            elif v is not None:
                raise ValueError(f"o/{name}/{key}: a {type(v).__name__} optimizer state cannot travel")
    return out


def split(layout: StateLayout, tensors: list[tuple[str, Tensor]]) -> tuple[dict[str, Tensor], dict[int, dict[str, Any]]]:
    """A checked state -> (global key -> module tensor, optimizer state_dict()["state"]).

    The optimizer part holds the given tensors themselves (no copy) and the :num ones as Python numbers.
    """
    module: dict[str, Tensor] = {}
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors:
        prefix, _, rest = name.partition("/")
        if prefix == "m":
            module[rest] = t
            continue
        pname, _, key = rest.rpartition("/")
        value: Any = t
        if key.endswith(NUM_SUFFIX):
            key, x = key.removesuffix(NUM_SUFFIX), float(t)
            value = int(x) if x.is_integer() else x
        state.setdefault(layout.params[pname][0], {})[key] = value
    return module, state
