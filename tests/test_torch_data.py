"""Users' torch datasets in the hosted trainer (trainers/torch_data.py): sharding map-style and iterable
datasets, losses by import path, evaluation, and the errors bad input gets. `gossip_sgd.run` runs in this
process against a stand-in for the daemon's Swarm handle; tests/test_training.py runs it in real daemons."""

from __future__ import annotations

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
