"""Datasets the trainers use, loaded from files shipped in `trainers/data/` so training never downloads.

Two tasks are bundled: UCI handwritten digits (8x8 images, 10 classes) for fast classification
runs, and a Shakespeare corpus for char-level next-token prediction. Both are torch map-style
datasets, so the hosted trainers shard and batch them exactly as they do a user's
(trainers/torch_data.py); they also keep a small interface of their own (`subset`, `batches`)
for the single-process baselines. `__getitems__` hands a whole batch over already stacked
(`Rows`), which keeps a DataLoader over them as fast as slicing tensors. `load_factory` lets a
config name a user's own model or dataset factory as "package.module:attr".
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainers.models import LM_PRESETS

DIGITS_FILE = "digits.npz"
CORPUS_FILE = "shakespeare.txt"

Batch = tuple[torch.Tensor, torch.Tensor]


def data_path(name: str) -> Any:
    """A shipped data file; via importlib.resources so it works installed, editable or zipped."""
    return resources.files("trainers") / "data" / name


def _shuffled(n: int, shuffle: bool, generator: torch.Generator | None) -> torch.Tensor:
    return torch.randperm(n, generator=generator) if shuffle else torch.arange(n)


def _batch_indices(n: int, batch_size: int, generator: torch.Generator | None, shuffle: bool,
                   drop_last: bool) -> Iterator[torch.Tensor]:
    """Index tensors of one pass over n items in minibatches (shared by every dataset kind)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = _shuffled(n, shuffle, generator)
    stop = n - (n % batch_size if drop_last else 0)
    for start in range(0, stop, batch_size):
        yield order[start : start + batch_size]


class Rows(Sequence):
    """Samples fetched together, already stacked (one tensor per field, rows along dim 0).

    A dataset's `__getitems__` returns it so the loader (trainers/torch_data.py) takes the stacked tensors
    as the batch instead of stacking one sample at a time again; it is still a sequence of samples, so any
    other collate function reads it as torch expects of `__getitems__`.
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i):  # type: ignore[override]
        return tuple(t[i] for t in self.tensors)


@dataclass
class ArrayDataset(Dataset):
    """Features and labels held fully in memory (digits is tiny): indexing a batch is one gather per tensor."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} rows but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Batch:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> Rows:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return Rows(self.x[idx], self.y[idx])

    def subset(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> ArrayDataset:
        """The rows at `indices` (e.g. this peer's shard from `partition`)."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return ArrayDataset(self.x[idx], self.y[idx])

    def batches(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> Iterator[Batch]:
        """One pass over the data in minibatches, shuffled by `generator` so runs are reproducible."""
        for idx in _batch_indices(len(self), batch_size, generator, shuffle, drop_last):
            yield self.x[idx], self.y[idx]


@dataclass(frozen=True)
class Vocab:
    """Character vocabulary of a corpus; ids follow sorted character order so they are stable."""

    chars: str
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("vocab characters must be unique")
        object.__setattr__(self, "_index", {c: i for i, c in enumerate(self.chars)})

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class CharDataset(Dataset):
    """Windows of `block` token ids; the target of each position is the next character.

    `starts` lists the window offsets that make up one epoch (non-overlapping by default), so
    `len`, `subset` and `partition` work on windows exactly as they do on digits rows.
    """

    data: torch.Tensor
    block: int
    starts: torch.Tensor

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        if len(self.starts) and int(self.starts.max()) + self.block + 1 > len(self.data):
            raise ValueError("a window runs past the end of the data")

    @classmethod
    def from_ids(cls, data: torch.Tensor, block: int, stride: int | None = None) -> CharDataset:
        stride = block if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        last = len(data) - block - 1
        if last < 0:
            raise ValueError(f"{len(data)} tokens are too few for windows of {block}")
        return cls(data, block, torch.arange(0, last + 1, stride, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Batch:
        s = int(self.starts[i])
        return self.data[s : s + self.block], self.data[s + 1 : s + self.block + 1]

    def __getitems__(self, indices: list[int]) -> Rows:
        return Rows(*self._gather(self.starts[torch.as_tensor(indices, dtype=torch.long)]))

    def subset(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> CharDataset:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return CharDataset(self.data, self.block, self.starts[idx])

    def _gather(self, starts: torch.Tensor) -> Batch:
        offsets = starts[:, None] + torch.arange(self.block + 1)
        chunk = self.data[offsets]
        return chunk[:, :-1], chunk[:, 1:]

    def batches(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> Iterator[Batch]:
        """One pass over the windows: x and y are (batch, block) long tensors."""
        for idx in _batch_indices(len(self), batch_size, generator, shuffle, drop_last):
            yield self._gather(self.starts[idx])


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-class shuffled split, so every class keeps its share in both halves."""
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_digits(
    *, test_fraction: float = 0.2, seed: int = 0, as_images: bool = False
) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test) digits, pixels scaled to [0, 1]; x is (N, 64), or (N, 1, 8, 8) with `as_images`.

    The split depends only on `seed`, so every peer of a swarm agrees on which rows are held out.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    with data_path(DIGITS_FILE).open("rb") as f, np.load(f) as npz:
        images = npz["images"].astype(np.float32) / 16.0
        labels = npz["labels"].astype(np.int64)
    x = images.reshape(len(images), 1, 8, 8) if as_images else images.reshape(len(images), 64)
    tr, te = _stratified_split(labels, test_fraction, seed)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(labels)
    return ArrayDataset(xt[tr], yt[tr]), ArrayDataset(xt[te], yt[te])


def load_char_corpus(
    *, block: int, test_fraction: float = 0.1, stride: int | None = None
) -> tuple[CharDataset, CharDataset, Vocab]:
    """(train, test, vocab) for next-character prediction on the shipped corpus.

    The test set is the corpus tail rather than random windows: overlapping random windows would
    leak test text into training.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    text = data_path(CORPUS_FILE).read_text(encoding="utf-8")
    vocab = Vocab.from_text(text)
    ids = vocab.encode(text)
    cut = int(len(ids) * (1.0 - test_fraction))
    train = CharDataset.from_ids(ids[:cut], block, stride)
    test = CharDataset.from_ids(ids[cut:], block, block)
    return train, test, vocab


def load_for_model(
    model: str, *, seed: int = 0, block: int | None = None
) -> tuple[ArrayDataset | CharDataset, ArrayDataset | CharDataset, dict[str, Any]]:
    """(train, test, model_opts) for one of the built-in model names; the opts complete `build_model`.
    `block`: the language models' context (default: the preset's, else 64).

    Explicit mapping rather than magic, so a new built-in model has to say which data it trains on.
    """
    if model in ("digits_mlp", "digits_wide_mlp"):
        train, test = load_digits(seed=seed)
        return train, test, {}
    if model == "digits_cnn":
        train, test = load_digits(seed=seed, as_images=True)
        return train, test, {}
    if model == "char_transformer" or model in LM_PRESETS:
        block = block or (LM_PRESETS[model]["block"] if model in LM_PRESETS else 64)
        ctrain, ctest, vocab = load_char_corpus(block=block)
        return ctrain, ctest, {"vocab": len(vocab), "block": block}
    raise ValueError(f"no built-in dataset for model {model!r}")


def load_sized_model(
    model: str, model_options: dict[str, Any]
) -> tuple[ArrayDataset | CharDataset, ArrayDataset | CharDataset, dict[str, Any]]:
    """`load_for_model` for a built-in model sized by `model_options` (e.g. {d_model, n_layers, block}): its
    `block` also cuts the data's windows, so every trainer that takes model_options builds the same model."""
    block = model_options.get("block")
    train, test, opts = load_for_model(model, **({"block": int(block)} if block else {}))
    return train, test, {**opts, **model_options}


def head(dataset: Any, n: int) -> Any:
    """The first `n` items of a map-style dataset (all of it when n is 0 or too big): a fixed, cheaper held-out
    set, the same on every peer and rank."""
    if not n or n >= len(dataset):
        return dataset
    if hasattr(dataset, "subset"):
        return dataset.subset(range(n))
    return torch.utils.data.Subset(dataset, range(n))


def partition(n: int, rank: int, world: int, *, seed: int) -> np.ndarray:
    """Sorted indices of the shard of range(n) that `rank` of `world` peers trains on.

    A seeded permutation cut into near-equal parts (sizes differ by at most one), so shards are
    disjoint, together cover every index, and every peer computes the same split independently.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(np.array_split(perm, world)[rank]).astype(np.int64)


_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve "package.module:attr" (attr may be dotted) to a callable, as a config names it.

    Every failure is a ValueError that quotes the spec, so a typo in a config reads as a config error.
    """
    if not isinstance(spec, str) or not _SPEC.match(spec.strip()):
        raise ValueError(f"factory spec {spec!r} must look like 'package.module:attr'")
    module_name, _, attr_path = spec.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"factory spec {spec!r}: no module named {e.name!r}") from e
        raise ValueError(f"factory spec {spec!r}: importing {module_name!r} failed: {e}") from e
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"factory spec {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"factory spec {spec!r} names a {type(obj).__name__}, not a callable")
    return obj
