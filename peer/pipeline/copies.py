"""A copy of a pipeline stage's state that a daemon keeps: on disk in its home by default, in memory if asked.

A copy (the stage a peer left, or a backup of the next one: peer/pipeline/state_transfer.py) is the stage's whole state,
weights and optimizer state, several times its parameters' bytes. The pipeline exists to train models bigger
than one host, so a copy goes to a file in HOME/stage-copies/ (peer/home.py, `Home.stage_copies`) and the daemon
keeps only what it announces and checks: key, stage, step, samples, each tensor's name, dtype and shape, and
its bytes. `in_memory` copies are for a caller that knows memory allows it.

A live stage's state that a peer asks for is written the same way, to a file of its own for that one transfer
(`write_snapshot`: no fsync, no atomic replace; removed when the transfer ends, and at start by `remove_stale`),
and read back mapped, as a copy on disk is when it is served (`load(mapped=True)`): what is sent is file pages the
kernel can drop, never a second copy of a stage in the daemon's memory. Before 2026-11-30 each transfer held a
copy of weights and optimizer state in memory, outside the stage's budget; `[pipeline] max_state_uploads` (2)
peers announcing the stage could make a stage peer hold two of them at once.

One file per (pipeline, cut, stage): a newer copy of that stage replaces it atomically (peer.home.atomic_write,
the mechanism checkpoints use), so a reader sees the old copy or the new one, never a torn file. The file says
which copy it holds; `load` checks that and every tensor's spec against what was kept, and raises
CopyUnreadable naming the file and what is wrong. A file is read as data only (peertrain.checkpoints,
`read_checkpoint`: torch.load with weights_only), so one planted in the home cannot run code in the daemon.
Writing and reading block on the disk: both are done off the trio thread (state.py says where).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.home import atomic_write
from peertrain.pipeline import CopyUnreadable, Named, PipelineKey, Spec
from peertrain.checkpoints import CheckpointRefused, read_checkpoint

log = logging.getLogger("peertrain.pipeline")

COPY_FORMAT = 1  # the file layout's version: a file of another layout is refused, never misread
COPY_SUFFIX = ".copy.pt"
SNAPSHOT_SUFFIX = ".sending.pt"  # a live state being sent (`write_snapshot`)
NAME_CHARS = 32  # of the pipeline's name kept in a file name, for a person listing the folder; a hash tells them apart

def spec_of(name: str, tensor: Any) -> Spec:
    return name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def copy_file(directory: Path, key: PipelineKey, stage: int) -> Path:
    """The one file of stage `stage` of `key`'s cut: the pipeline's name may hold any character, so the name
    is shown sanitized and told apart by a hash of the name and the cuts."""
    digest = hashlib.sha256(repr((key.name, tuple(key.cuts))).encode()).hexdigest()[:16]
    shown = re.sub(r"[^A-Za-z0-9_.-]", "_", key.name)[:NAME_CHARS]
    return Path(directory) / f"{shown}-{digest}-stage{stage}{COPY_SUFFIX}"


@dataclass
class KeptCopy:
    key: PipelineKey
    stage: int
    step: int
    samples: int
    specs: list[Spec]  # every tensor's (name, dtype, shape), in order
    nbytes: int  # the tensors' bytes (what holding it in memory costs)
    path: Path | None = None  # its file; None: held in memory (`held`)
    held: Named | None = field(default=None, repr=False)
    kept_at: float = field(default_factory=time.monotonic)
    unreadable: str = ""  # why its file did not load ("": it did, or was not read yet); state.py then forgets it

    @property
    def on_disk(self) -> bool:
        return self.path is not None

    @classmethod
    def in_memory(cls, key: PipelineKey, stage: int, tensors: Named, step: int, samples: int) -> KeptCopy:
        """Hold `tensors` as they are (no copy: the caller hands them over)."""
        tensors = list(tensors)
        return cls(key, stage, step, samples, [spec_of(n, t) for n, t in tensors], _nbytes(tensors), held=tensors)

    @classmethod
    def write(cls, directory: Path, key: PipelineKey, stage: int, tensors: Named, step: int, samples: int) -> KeptCopy:
        """Write the copy to its file, replacing that stage's older one atomically; the copy without its tensors.
        Blocks on the disk (call it off the trio thread); tensors anywhere (a GPU's too) are read back on CPU."""
        import torch

        tensors = list(tensors)
        path = copy_file(directory, key, stage)
        content = _content(key, stage, tensors, step, samples)
        atomic_write(path, lambda f: torch.save(content, f), mode=0o600)  # streamed: no second copy in memory
        return cls(key, stage, step, samples, [spec_of(n, t) for n, t in tensors], _nbytes(tensors), path=path)

    @classmethod
    def write_snapshot(cls, path: Path, key: PipelineKey, stage: int, tensors: Named, step: int,
                       samples: int) -> KeptCopy:
        """Write a live stage's state to `path` for one transfer (module docstring): streamed, as `write`, but
        neither fsynced nor replaced atomically (nobody reads it but the transfer that wrote it)."""
        import torch

        tensors = list(tensors)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            torch.save(_content(key, stage, tensors, step, samples), f)
        return cls(key, stage, step, samples, [spec_of(n, t) for n, t in tensors], _nbytes(tensors), path=Path(path))

    def load(self, *, mapped: bool = False) -> tuple[Named, int, int]:
        """(tensors, step, samples), as a stage's export_state gives them: the held tensors (shared: import
        them into one worker only), or fresh ones read from the file (`mapped`: the file's pages, for sending
        them). Step and samples are the file's: a newer copy of the stage may have replaced it since this one
        was kept. Reading blocks on the disk: call it off the trio thread. Raises CopyUnreadable (and notes why
        in `unreadable`)."""
        if self.path is None:
            assert self.held is not None
            return self.held, self.step, self.samples
        try:
            return self._read(self.path, mapped)
        except CopyUnreadable as exc:
            self.unreadable = str(exc)
            raise

    def _read(self, path: Path, mapped: bool) -> tuple[Named, int, int]:
        import torch

        where = f"copy of stage {self.stage} of pipeline {self.key.name[:64]!r} ({path})"
        try:
            with open(path, "rb") as f:  # a zip is what torch.save writes; torch.load would try else as a bare pickle
                if not zipfile.is_zipfile(f):
                    raise CopyUnreadable(f"{where}: not a file torch.save wrote (torn, or overwritten by something else)")
            data = read_checkpoint(path, mapped=mapped)
        except (CheckpointRefused, FileNotFoundError) as exc:
            if not path.exists():
                raise CopyUnreadable(f"{where}: its file is gone (dropped, or removed by someone)") from None
            raise CopyUnreadable(f"{where}: {exc}") from None
        except OSError as exc:
            raise CopyUnreadable(f"{where}: cannot read it: {exc.strerror or exc}") from None
        if not isinstance(data, dict) or data.get("format") != COPY_FORMAT:
            raise CopyUnreadable(f"{where}: not a stage copy of format {COPY_FORMAT}")
        held = (data.get("pipeline"), data.get("cuts"), data.get("stage"))
        if held != (self.key.name, list(self.key.cuts), self.stage):
            raise CopyUnreadable(f"{where}: the file holds stage {held[2]!r} of {str(held[0])[:64]!r} cut at {held[1]!r}")
        names, values, step, samples = data.get("names"), data.get("tensors"), data.get("step"), data.get("samples")
        if not (isinstance(names, list) and isinstance(values, list) and len(names) == len(values)
                and all(isinstance(n, str) for n in names) and all(isinstance(v, torch.Tensor) for v in values)):
            raise CopyUnreadable(f"{where}: its tensors are not a list of named tensors")
        for what, n in (("step", step), ("samples", samples)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise CopyUnreadable(f"{where}: its {what} is {n!r}, not an int >= 0")
        tensors = list(zip(names, values))
        specs = [spec_of(n, t) for n, t in tensors]
        if specs != self.specs:
            bad = next((f"{s} instead of {k}" for s, k in zip(specs, self.specs) if s != k),
                       f"{len(specs)} tensors instead of {len(self.specs)}")
            raise CopyUnreadable(f"{where}: the file does not hold the tensors kept: {bad}"[:500])
        return tensors, step, samples


def _content(key: PipelineKey, stage: int, tensors: Named, step: int, samples: int) -> dict:
    """What a copy's file holds (COPY_FORMAT)."""
    return {"format": COPY_FORMAT, "pipeline": key.name, "cuts": list(key.cuts), "stage": stage, "step": step,
            "samples": samples, "names": [n for n, _ in tensors], "tensors": [t for _, t in tensors]}


def snapshot_file(directory: Path, n: int) -> Path:
    """The file of the `n`-th live state this daemon sends (one per transfer at a time)."""
    return Path(directory) / f"state-{n}{SNAPSHOT_SUFFIX}"


def _nbytes(tensors: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def remove_files(paths: list[Path]) -> None:
    """Remove copies' files (blocking: freeing a big file takes a while on some file systems); one already
    gone is fine, one that cannot be removed is logged."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove stage copy %s: %s", p, exc.strerror)


def remove_stale(directory: Path) -> int:
    """Remove what an earlier run of the daemon left in `directory` (its copies, a temp file a crash left);
    how many files. Not re-adopted: a restarted peer resumes its stage from its own checkpoint, and a copy is
    only worth keeping while it is announced as fresh; an old one would cost disk and be handed out stale."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    stale = [Path(e.path) for e in entries if not e.is_dir(follow_symlinks=False)]
    remove_files(stale)
    if stale:
        log.info("removed %d stage copy file(s) an earlier run left in %s", len(stale), directory)
    return len(stale)
