"""Any torch dataset as a trainer's data: shard it by rank, batch it, evaluate on it, and say plainly what is
wrong with it.

The hosted trainers (`gossip_sgd`, `swarm_pipeline`) feed both the built-in data sets (trainers/datasets.py,
themselves torch map-style datasets) and a user's `dataset_factory` through here, so the path that trains the
demos is the one users' data takes. A dataset is either map-style (anything with `__len__` and `__getitem__`: TensorDataset, a
torchvision-style dataset, a list of pairs) or a `torch.utils.data.IterableDataset`; a sample is an
(input, target) pair of tensors, numbers or arrays. Torch only, no daemon imports: `shard` is meant to be
reused in a user's own script.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, Subset, TensorDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from trainers.baseline import batch_loss
from trainers.datasets import Rows, load_factory, partition

EVAL_BATCH = 512  # samples per evaluation batch: amortises per-batch overhead, small enough for any GPU or CPU
DEFAULT_LOSS = "cross-entropy over the last dimension of the output (the `loss` option unset)"

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DataError(ValueError):
    """Data, a dataset factory or a loss that does not fit: the message names the option and what was expected."""


def describe(obj: Any) -> str:
    """A short, type-level picture of a value for an error message (`(Tensor[3, 8, 8] float32, int)`)."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, (tuple, list)) and len(obj) <= 4:
        return "(" + ", ".join(describe(x) for x in obj) + ("," if len(obj) == 1 else "") + ")"
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _cause(exc: BaseException) -> str:
    """One line for an exception (our own DataError needs no type name); an exception from a DataLoader worker
    wraps the original traceback, whose last line ("Type: message") is the cause."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()] or [""]
    if "Original Traceback" in text:
        last = lines[-1]
        return last.partition(": ")[2] if isinstance(exc, DataError) and ": " in last else last
    return lines[0] if isinstance(exc, DataError) else f"{type(exc).__name__}: {lines[0]}"


def _pair(batch: Any) -> bool:
    return (isinstance(batch, (tuple, list)) and len(batch) == 2
            and isinstance(batch[0], torch.Tensor) and isinstance(batch[1], torch.Tensor))


def is_iterable(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def check_dataset(dataset: Any, what: str) -> None:
    """Refuse, naming `what`, anything that is neither map-style nor an IterableDataset."""
    if is_iterable(dataset) or (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return
    raise DataError(f"{what} is {describe(dataset)}; expected a torch.utils.data.Dataset (map-style, with __len__ "
                    "and __getitem__) or a torch.utils.data.IterableDataset")


def load_datasets(spec: str) -> tuple[Any, Any | None]:
    """Call the `dataset_factory` a config names; its (train, test) checked (test may be None: no accuracy)."""
    try:
        factory = load_factory(spec)
    except ValueError as exc:
        raise DataError(f"[trainer.options] dataset_factory: {exc}") from None
    what = f"[trainer.options] dataset_factory {spec!r}"
    got = factory()
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise DataError(f"{what} returned {describe(got)}; expected a pair (train, test) of torch datasets "
                        "(test may be None)")
    train, test = got
    check_dataset(train, f"{what}: the train set")
    if test is not None:
        check_dataset(test, f"{what}: the test set")
    return train, test


class IterableShard(IterableDataset):
    """Every `world`-th item of an iterable dataset, from position `rank`.

    An iterable cannot be split by index (nothing says how long it is or lets us jump into it), so the
    honest split every peer computes alike is round-robin over one shared stream: each peer reads the whole
    stream and keeps its items, which is disjoint and covering when every peer's stream yields the same
    items in the same order. Each epoch iterates the dataset again from its start (its own order, if it
    shuffles). DataLoader workers split this peer's items the same way, so none is read twice.
    """

    def __init__(self, dataset: IterableDataset, rank: int, world: int) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}) with world >= 1, got rank {rank} of {world}")
        self.dataset, self.rank, self.world = dataset, rank, world

    def __iter__(self) -> Iterator[Any]:
        items = itertools.islice(iter(self.dataset), self.rank, None, self.world)
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            items = itertools.islice(items, info.id, None, info.num_workers)
        return items


def shard(dataset: Any, rank: int, world: int, seed: int = 0) -> Subset | IterableShard:
    """This peer's part of `dataset`: rank `rank` of `world`, the same split on every peer.

    Map-style: a seeded shuffled partition of the indices (`partition`: disjoint, covering, sizes within
    one), as a `torch.utils.data.Subset`. Iterable: `IterableShard` (every world-th item; `seed` is unused,
    an iterable keeps its own order).
    """
    check_dataset(dataset, "the dataset to shard")
    if is_iterable(dataset):
        return IterableShard(dataset, rank, world)
    return Subset(dataset, partition(len(dataset), rank, world, seed=seed).tolist())


def shard_size(part: Any) -> int | None:
    """Items in a shard; None for an iterable that does not say its length."""
    if isinstance(part, IterableShard):
        try:
            n = len(part.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None
        return max(0, math.ceil((n - part.rank) / part.world))
    return len(part)


class _StackedTensorDataset(TensorDataset):
    """A TensorDataset that fetches a batch with one gather per tensor (torch's own fetches row by row)."""

    def __getitems__(self, indices: list[int]) -> Rows:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return Rows(*(t[idx] for t in self.tensors))


class IndexBatches(Sampler[list[int]]):
    """Batches of indices into a dataset: `index` (a Subset's indices, or all) in a fresh order drawn from
    `generator` each pass, cut into `batch_size` pieces (a short last piece left out with `drop_last`). It
    stands in for Subset + RandomSampler + BatchSampler with the same order, in one permutation per pass
    instead of Python work per sample: the built-in data sets' steps are a few hundred microseconds, and
    per-sample sampling cost a tenth of that."""

    def __init__(self, index: torch.Tensor, batch_size: int, generator: torch.Generator | None, shuffle: bool,
                 drop_last: bool = False) -> None:
        self.index, self.batch_size, self.generator, self.shuffle = index, batch_size, generator, shuffle
        self.drop_last = drop_last

    def __len__(self) -> int:
        n = len(self.index)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.index[torch.randperm(len(self.index), generator=self.generator)] if self.shuffle else self.index
        if self.drop_last:
            order = order[: len(order) - len(order) % self.batch_size]
        for chunk in order.split(self.batch_size) if len(order) else ():  # no batch of nothing (split gives one)
            yield chunk.tolist()


def _unwrap(data: Any) -> tuple[Any, torch.Tensor]:
    """The dataset to fetch from and the indices of `data` in it: a Subset is read straight from its dataset
    (one batched fetch instead of one per sample); a plain TensorDataset gathers a batch in one go."""
    if isinstance(data, Subset):
        base, index = data.dataset, torch.as_tensor(data.indices, dtype=torch.long)
    else:
        base, index = data, torch.arange(len(data))
    if type(base) is TensorDataset:
        base = _StackedTensorDataset(*base.tensors)
    return base, index


def collate(samples: Any) -> Any:
    """Stack samples into a batch; one a dataset already stacked (`Rows`) is taken as it is."""
    if isinstance(samples, Rows):
        return samples.tensors
    first = samples[0] if len(samples) else None
    try:
        batch = default_collate(samples)
    except (TypeError, RuntimeError) as exc:
        raise DataError(f"samples like {describe(first)} do not stack into a batch: {_cause(exc)}") from None
    if not _pair(batch):
        raise DataError(f"a sample is {describe(first)}; expected an (input, target) pair of tensors, numbers or "
                        "arrays")
    return batch


class InlineLoader:
    """What a DataLoader without workers does for a map-style dataset (the same sampler, fetch and collate,
    so the same batches), minus its per-batch bookkeeping (profiler ranges, iterator state): that cost
    ~15 µs a batch, 8% of a digits MLP step. No pinned memory: with data small enough to load in the
    trainer's thread, a plain copy is as fast."""

    def __init__(self, dataset: Any, batch_sampler: IndexBatches) -> None:
        self.dataset, self.batch_sampler = dataset, batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        fetch = getattr(self.dataset, "__getitems__", None)
        for idx in self.batch_sampler:
            yield collate(fetch(idx) if fetch else [self.dataset[i] for i in idx])


Loader = DataLoader | InlineLoader


def loader(data: Any, batch_size: int, *, generator: torch.Generator | None = None, shuffle: bool = True,
           drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False) -> Loader:
    """Batches of a dataset or shard, pass after pass: shuffled by `generator` each pass when map-style, in
    stream order when iterable; with `drop_last`, every batch has exactly `batch_size` samples (a pass's short
    tail is left out). A DataLoader, or with no workers for a map-style dataset, an InlineLoader giving the
    same batches. Build it once and iterate it every epoch (workers are kept between passes)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise DataError(f"[trainer.options] num_workers: expected >= 0, got {num_workers}")
    # Workers' seeds come from a generator of their own: a DataLoader draws from it at every pass, which would
    # shift the order drawn from `generator` and make batches depend on num_workers.
    seeds = torch.Generator().manual_seed(generator.initial_seed() + 1) if generator is not None else None
    common: dict[str, Any] = dict(num_workers=num_workers, collate_fn=collate, pin_memory=pin_memory,
                                  generator=seeds, persistent_workers=num_workers > 0)
    if is_iterable(data):
        return DataLoader(data, batch_size=batch_size, drop_last=drop_last, **common)
    base, index = _unwrap(data)
    sampler = IndexBatches(index, batch_size, generator, shuffle, drop_last)
    return InlineLoader(base, sampler) if num_workers == 0 else DataLoader(base, batch_sampler=sampler, **common)


def batches(data: Loader, what: str) -> Iterator[Batch]:
    """One pass over a loader as (input, target) tensors; a failure to load names `what` (the option)."""
    it = iter(data)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as exc:
            failed = "" if isinstance(exc, DataError) else "loading a batch failed: "
            raise DataError(f"{what}: {failed}{_cause(exc)}") from exc
        if not _pair(batch):  # a dataset's own __getitems__ stacked something else
            raise DataError(f"{what}: a batch is {describe(batch)}; expected (input, target) tensors")
        yield batch[0], batch[1]


def take(data: Loader, n: int, what: str) -> list[Batch]:
    """The first `n` batches of one pass (fewer if the pass is shorter): a fixed validation set, or a sample
    batch to measure a model on."""
    return list(itertools.islice(batches(data, what), n))


def endless(data: Loader, what: str, empty: str) -> Iterator[Batch]:
    """Batches pass after pass, for as long as the caller reads; a pass that yields none raises DataError
    `empty` (the same pass would yield none again: data too small for a batch, or an exhausted stream)."""
    while True:
        got = False
        for batch in batches(data, what):
            got = True
            yield batch
        if not got:
            raise DataError(empty)


class CheckedLoss:
    """A loss function that must return one number per batch; anything else is a config error, said once."""

    def __init__(self, fn: LossFn, name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        try:
            loss = self.fn(output, target)
        except Exception as exc:
            raise DataError(f"[trainer.options] loss: {self.name} failed on output {describe(output)} and target "
                            f"{describe(target)}: {_cause(exc)}") from exc
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            raise DataError(f"[trainer.options] loss: {self.name} returned {describe(loss)}; expected a scalar "
                            "floating-point tensor (reduce over the batch, e.g. reduction='mean')")
        return loss if loss.dim() == 0 else loss.reshape(())


def load_loss(spec: str) -> CheckedLoss:
    """The `loss` option: "pkg.mod:fn" naming a function (e.g. "torch.nn.functional:mse_loss") or a torch.nn
    loss class ("torch.nn:SmoothL1Loss", built with no arguments); empty for cross-entropy."""
    if not spec:
        return CheckedLoss(batch_loss, DEFAULT_LOSS)
    try:
        fn = load_factory(spec)
    except ValueError as exc:
        raise DataError(f"[trainer.options] loss: {exc}") from None
    if isinstance(fn, type):
        if not issubclass(fn, nn.Module):
            raise DataError(f"[trainer.options] loss: {spec!r} is a class but not a torch.nn.Module; expected a "
                            "loss function or a torch.nn loss class")
        fn = fn()
    return CheckedLoss(fn, repr(spec))


def _class_logits(output: torch.Tensor, target: torch.Tensor) -> bool:
    """Output scores classes along its last dimension for integer labels of the remaining shape."""
    return (output.is_floating_point() and not target.is_floating_point() and target.dtype != torch.bool
            and output.dim() == target.dim() + 1 and output.shape[:-1] == target.shape)


@torch.no_grad()
def evaluate(model: nn.Module, data: Any, loss_fn: LossFn, device: torch.device, *,
             what: str = "the test set") -> tuple[float, float | None]:
    """(mean loss per sample, accuracy) over a dataset or loader, in batches. Accuracy is per label (per token
    for sequences) and None unless the model's output is class logits for integer labels. The model's
    train/eval mode is restored afterwards, so a trainer can call this mid-run."""
    data = data if isinstance(data, (DataLoader, InlineLoader)) else loader(data, EVAL_BATCH, shuffle=False)
    was_training = model.training
    model.eval()
    total, samples, correct, labels, logits = 0.0, 0, 0, 0, True
    try:
        for x, y in batches(data, what):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            total += float(loss_fn(out, y)) * len(y)
            samples += len(y)
            if logits and isinstance(out, torch.Tensor) and _class_logits(out, y):
                correct += int((out.argmax(-1) == y).sum())
                labels += y.numel()
            else:
                logits = False
    finally:
        model.train(was_training)
    if samples == 0:
        raise DataError(f"{what} is empty: nothing to evaluate on")
    return total / samples, (correct / labels if logits and labels else None)
