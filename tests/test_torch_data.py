"""Users' torch datasets in the hosted trainer (trainers/torch_data.py): sharding map-style and iterable
datasets, losses by import path, evaluation, and the errors bad input gets. `gossip_sgd.run` runs in this
process against a stand-in for the daemon's Swarm handle; tests/test_training.py runs it in real daemons."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from tests import user_data
from trainers import gossip_sgd, torch_data
from trainers.datasets import load_digits
from trainers.models import build_model
from trainers.torch_data import DataError


class LoneSwarm:
    """The Swarm handle of a peer alone in its swarm: no neighbours, metrics and checkpoints kept in memory."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self.published: list[dict] = []

    def rank_and_world(self, world=None):
        return self.rank, self.world

    def share(self, name, tensors, *, lock: threading.Lock | None = None, partners=None):
        class Group:
            step, last_distance = 0, None
        group = Group()
        group.lock = lock or threading.Lock()
        return group

    def download(self, group, *, min_step=1):
        return None

    def wait_for_peers(self, n=1, *, group=None, timeout=30.0):
        return 0

    def load_checkpoint(self, map_location=None):
        return None

    def save_checkpoint(self, state):
        pass

    def on_checkpoint_request(self, fn):
        pass

    def peers(self):
        return []

    def neighbours(self):
        return []

    def should_stop(self):
        return False

    def average_in_background(self, group, mode="one"):
        return False

    def publish(self, metrics):
        self.published.append(dict(metrics))

    def log(self, msg, *args):
        pass


def train(options: dict, *, rank: int = 0, world: int = 1) -> dict:
    return gossip_sgd.run(LoneSwarm(rank, world), {"join_wait": 0.0, "checkpoint_every": 0, **options})


def items(part) -> list[int]:
    """The sample values of a shard of a dataset whose items are (value, value)."""
    return [int(x) for x, _ in (part if not isinstance(part, Subset) else (part[i] for i in range(len(part))))]


# --- sharding ---------------------------------------------------------------------------------------


def test_map_style_shards_are_a_seeded_disjoint_cover():
    ds = TensorDataset(torch.arange(103), torch.arange(103))
    parts = [torch_data.shard(ds, r, 4, seed=7) for r in range(4)]
    assert all(isinstance(p, Subset) for p in parts)
    got = [items(p) for p in parts]
    assert sorted(sum(got, [])) == list(range(103))  # disjoint and covering
    assert max(map(len, got)) - min(map(len, got)) <= 1
    assert items(torch_data.shard(ds, 2, 4, seed=7)) == got[2]  # every peer computes the same split
    assert items(torch_data.shard(ds, 2, 4, seed=8)) != got[2]


def test_a_hugging_face_dataset_is_sharded_by_its_own_select_with_the_same_partition():
    """peertrain.shard keeps a `datasets.Dataset` one (a Trainer drops unused columns only from those); the
    rows are the partition every other map-style dataset gets. A stand-in with the API: `datasets` is not a
    dependency."""
    from peertrain.data import shard

    class Columns:  # what peertrain.data.is_hf_dataset looks for: select, column_names, len
        column_names = ["input_ids", "text"]

        def __init__(self, rows):
            self.rows = list(rows)

        def __len__(self):
            return len(self.rows)

        def select(self, indices):
            return Columns(self.rows[i] for i in indices)

    class Place:  # the part of a Swarm handle shard reads
        local_rank, local_world = 0, 1

        def rank_and_world(self, world):
            return 2, 4

    part = shard(Columns(range(103)), Place(), seed=7)
    assert isinstance(part, Columns)
    assert part.rows == items(torch_data.shard(TensorDataset(torch.arange(103), torch.arange(103)), 2, 4, seed=7))


@pytest.mark.process
def test_iterable_shards_take_every_world_th_item_and_reiterate():
    stream = user_data.Stream(torch.arange(10), torch.arange(10))
    parts = [torch_data.shard(stream, r, 3) for r in range(3)]
    assert [items(p) for p in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert items(parts[0]) == [0, 3, 6, 9]  # a second epoch iterates the stream again
    assert torch_data.shard_size(parts[1]) is None  # a stream without __len__
    loader = torch_data.loader(parts[0], 2, num_workers=2)  # workers split the peer's items, none read twice
    assert sorted(int(v) for x, _ in torch_data.batches(loader, "t") for v in x) == [0, 3, 6, 9]


def test_shard_sizes_of_an_iterable_with_a_length():
    class Sized(user_data.Stream):
        def __len__(self):
            return len(self.x)
    stream = Sized(torch.arange(10), torch.arange(10))
    assert [torch_data.shard_size(torch_data.shard(stream, r, 3)) for r in range(3)] == [4, 3, 3]


def test_builtin_and_tensor_datasets_batch_alike():
    """The built-in digits and the same rows as a TensorDataset give identical batches for one seed."""
    train, _ = load_digits()
    mine = TensorDataset(train.x, train.y)
    a = torch_data.loader(torch_data.shard(train, 1, 4, seed=3), 32, generator=torch.Generator().manual_seed(5))
    b = torch_data.loader(torch_data.shard(mine, 1, 4, seed=3), 32, generator=torch.Generator().manual_seed(5))
    for (xa, ya), (xb, yb) in zip(torch_data.batches(a, "a"), torch_data.batches(b, "b"), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# --- losses and evaluation ------------------------------------------------------------------------------


def test_loss_by_import_path():
    out, y = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    want = torch.nn.functional.cross_entropy(out, y)
    for spec in ("", "torch.nn.functional:cross_entropy", "torch.nn:CrossEntropyLoss"):
        assert torch.allclose(torch_data.load_loss(spec)(out, y), want), spec
    with pytest.raises(DataError, match=r"\[trainer.options\] loss: .*no module named 'nowhere'"):
        torch_data.load_loss("nowhere.mod:fn")
    with pytest.raises(DataError, match=r"\[trainer.options\] loss: .*returned Tensor\[5\] float32; expected a scalar"):
        torch_data.load_loss("tests.user_data:per_sample_loss")(out, y)
    with pytest.raises(DataError, match=r"\[trainer.options\] loss: 'torch:Generator' is a class but not a torch.nn"):
        torch_data.load_loss("torch:Generator")


def test_evaluate_gives_accuracy_only_for_class_logits():
    model = build_model("digits_mlp")
    _, test = user_data.digits_tensors()
    loss, acc = torch_data.evaluate(model, test, torch_data.load_loss(""), torch.device("cpu"))
    assert loss > 0 and 0.0 <= acc <= 1.0
    _, reg = user_data.regression()
    loss, acc = torch_data.evaluate(torch.nn.Linear(8, 1), reg, torch_data.load_loss("torch.nn.functional:mse_loss"),
                                    torch.device("cpu"))
    assert loss > 0 and acc is None


# --- the hosted trainer on users' data ----------------------------------------------------------------


def test_gossip_sgd_trains_on_plain_tensor_datasets():
    r = train({"model": "digits_mlp", "dataset_factory": "tests.user_data:digits_tensors", "target_accuracy": 0.93})
    assert r["reached_target"], r


def test_gossip_sgd_trains_on_an_iterable_shard():
    r = train({"model": "digits_mlp", "dataset_factory": "tests.user_data:digits_stream", "max_steps": 300,
               "eval_every": 100}, rank=1, world=2)
    assert r["step"] == 300 and r["accuracy"] > 0.85, r
    assert r["epoch"] >= 1  # passes counted, the epoch's length learnt from the first


def test_gossip_sgd_with_a_loss_by_path_and_no_accuracy():
    r = train({"model_factory": "tests.user_data:linear_regressor", "dataset_factory": "tests.user_data:regression",
               "loss": "torch.nn.functional:mse_loss", "optimizer": "sgd", "lr": 0.05, "batch_size": 16,
               "max_steps": 200, "eval_every": 50})
    assert r["accuracy"] is None and r["test_loss"] < 0.05, r


def test_gossip_sgd_without_a_test_set_reports_the_training_loss():
    r = train({"model": "digits_mlp", "dataset_factory": "tests.user_data:digits_no_test", "max_steps": 30})
    assert r["accuracy"] is None and r["test_loss"] is None and r["loss"] > 0, r


@pytest.mark.parametrize("options, error", [
    ({"dataset_factory": "tests.user_data:not_a_pair"},
     r"dataset_factory 'tests.user_data:not_a_pair' returned torch.utils.data.dataset.TensorDataset; expected a pair"),
    ({"dataset_factory": "tests.user_data:nope"}, r"\[trainer.options\] dataset_factory: .*no attribute 'nope'"),
    ({"dataset_factory": "tests.user_data:strings", "max_steps": 5},
     r"dataset_factory 'tests.user_data:strings': the train set: a sample is \(str, int\); expected an "
     r"\(input, target\) pair of tensors"),
    ({"dataset_factory": "tests.user_data:digits_no_test", "target_accuracy": 0.9},
     r"\[trainer.options\] target_accuracy: .* has no test set"),
    ({"dataset_factory": "tests.user_data:digits_stream"},
     r"\[trainer.options\] max_steps: .*IterableDataset without __len__"),
    ({"loss": "tests.user_data:per_sample_loss", "max_steps": 5}, r"\[trainer.options\] loss: .*expected a scalar"),
    ({"model_factory": "tests.user_data:broken_model"}, r"this model factory always fails"),
    ({"model_factory": "tests.user_data:digits_tensors", "lr": 0.1, "batch_size": 8, "max_steps": 5},
     r"\[trainer.options\] model_factory 'tests.user_data:digits_tensors' returned tuple; expected a torch.nn.Module"),
    ({"num_workers": -1}, r"\[trainer.options\] num_workers: expected >= 0"),
])
def test_bad_input_names_the_option(options, error):
    with pytest.raises((DataError, ValueError, RuntimeError), match=error):
        train({"model": "digits_mlp", **options})


def test_an_empty_shard_names_world():
    with pytest.raises(DataError, match=r"\[trainer.options\] world: shard 3 of 4 .* is empty"):
        train({"model": "digits_mlp", "dataset_factory": "tests.user_data:strings"}, rank=3, world=4)


def test_an_empty_iterable_shard_names_world():
    with pytest.raises(DataError, match=r"\[trainer.options\] world: shard 2 of 3 .* yielded no batch"):
        train({"model": "digits_mlp", "dataset_factory": "tests.test_torch_data:two_items", "max_steps": 5},
              rank=2, world=3)


def two_items():
    return user_data.Stream(torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)), None


class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise KeyError(i)


@pytest.mark.process
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_loader_failure_names_the_option(num_workers):
    """In the trainer's thread or in a DataLoader worker (which wraps the traceback), the cause is one line."""
    loader = torch_data.loader(Broken(), 2, num_workers=num_workers)
    with pytest.raises(DataError, match=r"^my option: loading a batch failed: KeyError: \d$"):
        list(torch_data.batches(loader, "my option"))
    strings, _ = user_data.strings()
    loader = torch_data.loader(strings, 2, num_workers=num_workers)
    with pytest.raises(DataError, match=r"^my option: a sample is \(str, int\); expected an \(input, target\) pair"):
        list(torch_data.batches(loader, "my option"))


@pytest.mark.process
def test_workers_give_the_same_batches():
    train, _ = user_data.digits_tensors()
    part = torch_data.shard(train, 0, 4, seed=1)
    inline, workers = (torch_data.loader(part, 32, generator=torch.Generator().manual_seed(2), num_workers=n)
                       for n in (0, 2))
    assert isinstance(workers, DataLoader)
    for (xa, ya), (xb, yb) in zip(torch_data.batches(inline, "a"), torch_data.batches(workers, "b"), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# --- batches of a fixed size, passes, and the pipeline's data (trainers/swarm_pipeline.py) -----------------


def _values(batches) -> list[list[int]]:
    return [[int(v) for v in x] for x, _ in batches]


def test_drop_last_gives_only_full_batches_map_style_and_iterable():
    ds = TensorDataset(torch.arange(10), torch.arange(10))
    full = torch_data.loader(ds, 4, generator=torch.Generator().manual_seed(0), drop_last=True)
    some = torch_data.loader(ds, 4, generator=torch.Generator().manual_seed(0))
    assert len(full) == 2 and len(some) == 3
    got, every = _values(torch_data.batches(full, "t")), _values(torch_data.batches(some, "t"))
    assert [len(b) for b in got] == [4, 4] and got == every[:2]  # the same order, less the short tail
    assert len(set(sum(got, []))) == 8
    stream = torch_data.loader(user_data.Stream(torch.arange(10), torch.arange(10)), 4, drop_last=True)
    assert _values(torch_data.batches(stream, "t")) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_take_and_endless_passes():
    loader = torch_data.loader(TensorDataset(torch.arange(6), torch.arange(6)), 2, shuffle=False)
    assert _values(torch_data.take(loader, 2, "t")) == [[0, 1], [2, 3]]
    assert len(torch_data.take(loader, 9, "t")) == 3
    it = torch_data.endless(loader, "t", empty="nothing")
    assert _values(next(it) for _ in range(7)) == [[0, 1], [2, 3], [4, 5]] * 2 + [[0, 1]]
    empty = torch_data.loader(TensorDataset(torch.arange(3), torch.arange(3)), 4, drop_last=True)
    with pytest.raises(DataError, match="^too small$"):
        next(torch_data.endless(empty, "t", empty="too small"))


def _pipeline_data(train, test=None):
    from trainers.swarm_pipeline import PipelineData
    return PipelineData(train, test, "[trainer.options] dataset_factory 'mine:data'")


def test_pipeline_microbatches_are_full_seeded_and_sharded():
    from trainers.swarm_pipeline import sample_microbatch, training_microbatches
    data = _pipeline_data(TensorDataset(torch.arange(103).float()[:, None], torch.arange(103)))
    seen = []
    for rank in range(3):
        it = training_microbatches(data, rank, 3, microbatch=8, seed=1)
        passes = [[int(v) for _, y in (next(it) for _ in range(4)) for v in y] for _ in range(2)]  # 34: 4 full
        mine = set(items(torch_data.shard(data.train, rank, 3, seed=1)))
        for p in passes:  # a fresh order each pass, its short tail left out
            assert len(p) == len(set(p)) == 32 and set(p) <= mine
        assert passes[0] != passes[1]
        again = training_microbatches(data, rank, 3, microbatch=8, seed=1)
        assert [int(v) for _, y in (next(again) for _ in range(4)) for v in y] == passes[0]
        seen.append(mine)
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])  # disjoint shards
    x, y = sample_microbatch(data, 8, seed=1)
    assert x.dtype == torch.float32 and x.shape == (8, 1) and torch.equal(sample_microbatch(data, 8, seed=1)[1], y)
    with pytest.raises(DataError, match=r"^\[trainer.options\] microbatch: this peer's shard \(rank 2 of 3\) of "
                                        r"\[trainer.options\] dataset_factory 'mine:data''s train set has 34 samples"):
        training_microbatches(data, 2, 3, microbatch=40, seed=1)
    with pytest.raises(DataError, match=r"^\[trainer.options\] microbatch: .* fewer samples than one microbatch of 200"):
        sample_microbatch(data, 200, seed=1)


def test_pipeline_microbatches_of_a_stream_take_every_world_th_item():
    from trainers.swarm_pipeline import training_microbatches
    data = _pipeline_data(user_data.Stream(torch.arange(10), torch.arange(10)))
    it = training_microbatches(data, 1, 2, microbatch=2, seed=0)
    assert _values(next(it) for _ in range(3)) == [[1, 3], [5, 7], [1, 3]]  # the odd items, a short tail left out
    small = training_microbatches(data, 1, 2, microbatch=6, seed=0)  # no length to check up front
    with pytest.raises(DataError, match=r"^\[trainer.options\] microbatch: .* yielded no microbatch of 6 samples"):
        next(small)


def test_pipeline_validation_microbatches_and_no_test_set():
    from trainers.swarm_pipeline import NO_TEST, _evaluate, validation_microbatches
    test = TensorDataset(torch.arange(20).float(), torch.arange(20))
    got = validation_microbatches(_pipeline_data(test, test), 8, 2)
    assert _values(got) == [list(range(8)), list(range(8, 16))]
    assert len(validation_microbatches(_pipeline_data(test, test), 8, 5)) == 3  # all there is
    assert validation_microbatches(_pipeline_data(test), 8, 2) is None
    assert _evaluate(None, None) == {"val_loss": None, "val_error": NO_TEST}
    with pytest.raises(DataError, match=r"'mine:data': the test set is empty"):
        validation_microbatches(_pipeline_data(test, TensorDataset(torch.zeros(0), torch.zeros(0))), 8, 2)


def test_the_built_in_corpus_keeps_its_microbatches_on_the_common_path():
    """The demo's driver reads the same windows it read through CharDataset's own `subset`/`batches`, each
    batch fetched in one gather (`__getitems__`)."""
    from trainers.datasets import load_char_corpus, partition
    from trainers.swarm_pipeline import training_microbatches
    train, test, _ = load_char_corpus(block=16)
    own = train.subset(partition(len(train), 1, 4, seed=3))
    want = list(own.batches(8, torch.Generator().manual_seed(3 * 7919 + 1 * 104729), drop_last=True))[:50]
    it = training_microbatches(_pipeline_data(train, test), 1, 4, microbatch=8, seed=3)
    for wx, wy in want:
        x, y = next(it)
        assert torch.equal(x, wx) and torch.equal(y, wy)
    assert callable(getattr(train, "__getitems__", None))


def test_a_users_float_blocks_serve_as_stages():
    """The stage worker learns its input specs from a float-feature sample (not token ids): stage 0 of a user's
    Linear+ReLU blocks takes float32 features, stage 1 float targets under mse_loss."""
    from trainers.pipeline.blocks import from_factory
    from trainers.pipeline.stage import StageWorker
    from trainers.swarm_pipeline import sample_microbatch
    x, y = sample_microbatch(_pipeline_data(*user_data.regression()), 8, seed=0)
    workers = [StageWorker(from_factory("tests.user_data:regression_blocks"), bounds, stage=s, stages=2,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), max_batch=8, sample_x=x, sample_y=y)
               for s, bounds in enumerate([(0, 2), (2, 3)])]
    assert workers[0].input_specs("forward", 8) == [("x", "float32", [8, 8])]
    assert workers[1].input_specs("loss", 8) == [("h", "float32", [8, 32]), ("y", "float32", [8, 1])]
    _, (h,), _ = workers[0].compute("forward", [x], seed=1)
    loss, (grad,), held = workers[1].compute("loss", [h, y], seed=1)
    assert math.isfinite(loss) and grad.shape == h.shape and held is not None and held.accumulate()
    loss, outs, held = workers[0].compute("backward", [x, grad], seed=1)
    assert (loss, outs) == (None, []) and held is not None and held.accumulate()
