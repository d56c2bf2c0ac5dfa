"""Checkpoints as data: written atomically, read back without running code.

Every handle (hosted, attached, multi-rank) and `peer export` save and load a job's state through these
three functions, so a torn file or a planted pickle is handled one way. Trio-free, like peertrain/swarm.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from peer.home import atomic_write
from peertrain.swarm import LATEST_CHECKPOINT

log = logging.getLogger("peertrain.trainer")


class CheckpointRefused(ValueError):
    """A checkpoint file that cannot be read as data alone (tensors, numbers, strings, lists and dicts)."""


def read_checkpoint(path: Path, map_location: Any = "cpu", *, mapped: bool = False) -> Any:
    """torch.load with weights_only=True: a checkpoint is data, and a pickle that would have to build other
    objects (run code) to load is refused, so a file planted in a home cannot run code in the daemon or in
    `peer export`. `mapped`: the tensors are the file's pages, mapped (read as they are used, and the kernel's
    to drop again), not read into memory. Raises CheckpointRefused saying why."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        reason = next((ln for ln in lines if "GLOBAL" in ln), lines[-1])  # torch names the global it refused
        raise CheckpointRefused(f"refusing checkpoint {path}: it holds more than tensors and plain data, and "
                                f"loading it could run code ({reason})") from None
    except Exception as exc:
        raise CheckpointRefused(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None


def save_checkpoint(directory: Path, state: dict[str, Any], name: str = LATEST_CHECKPOINT) -> Path:
    """torch.save to directory/<name> atomically (a crash never leaves a torn file)."""
    import torch

    path = Path(directory) / name
    atomic_write(path, lambda f: torch.save(state, f), mode=0o600)  # streamed: no copy of the state in memory
    return path


def load_checkpoint(directory: Path, name: str = LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
    """The checkpoint saved as `name`, or None if there is none or it is refused (logged: the job starts
    afresh rather than run what a planted file would make it run)."""
    path = Path(directory) / name
    if not path.exists():
        return None
    try:
        return read_checkpoint(path, map_location)
    except CheckpointRefused as exc:
        log.error("%s; starting without it", exc)
        return None
