"""Shipped data, sharding, factory specs, model shapes and the single-process regression baseline.

The digits_mlp accuracy asserted here is the figure distributed trainers are compared against.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from trainers import baseline, datasets, models
from trainers.baseline import evaluate, seeded_model, torch_threads, train_single
from trainers.datasets import (
    ArrayDataset,
    Vocab,
    data_path,
    load_char_corpus,
    load_digits,
    load_factory,
    partition,
)
from trainers.models import build_model, count_parameters, pick_device

# --- shipped data -------------------------------------------------------------------------------


def test_digits_npz_is_the_uci_set() -> None:
    with data_path("digits.npz").open("rb") as f, np.load(f) as npz:
        images, labels = npz["images"], npz["labels"]
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert labels.shape == (1797,) and labels.dtype == np.int64
    assert images.min() == 0 and images.max() == 16
    assert sorted(np.unique(labels)) == list(range(10))


def test_load_digits_shapes_and_split() -> None:
    train, test = load_digits()
    assert len(train) + len(test) == 1797
    assert abs(len(test) - 0.2 * 1797) <= 10
    assert train.x.shape == (len(train), 64) and train.x.dtype == torch.float32
    assert train.y.dtype == torch.int64
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    counts = torch.bincount(test.y, minlength=10)
    assert int(counts.min()) >= 30, "split should be stratified: every class held out"

    images, _ = load_digits(as_images=True)
    assert images.x.shape == (len(train), 1, 8, 8)
    assert torch.equal(images.x.reshape(len(train), 64), train.x)

    again, _ = load_digits(seed=0)
    other, _ = load_digits(seed=1)
    assert torch.equal(again.x, train.x) and torch.equal(again.y, train.y)
    assert not torch.equal(other.x, train.x)


def test_array_dataset_batches_cover_each_row_once() -> None:
    ds = ArrayDataset(torch.arange(10).float()[:, None], torch.arange(10))
    seen = torch.cat([y for _, y in ds.batches(3, torch.Generator().manual_seed(0))])
    assert sorted(seen.tolist()) == list(range(10))
    again = torch.cat([y for _, y in ds.batches(3, torch.Generator().manual_seed(0))])
    assert torch.equal(seen, again)
    assert [len(y) for _, y in ds.batches(3, drop_last=True)] == [3, 3, 3]
    assert ds.subset(np.array([1, 4])).y.tolist() == [1, 4]
    with pytest.raises(ValueError):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(2))


def test_char_corpus_windows_predict_the_next_character() -> None:
    raw = data_path("shakespeare.txt").read_bytes()
    assert 200_000 <= len(raw) <= 1_000_000 and raw.isascii()

    train, test, vocab = load_char_corpus(block=32)
    assert len(vocab) == 65 and isinstance(vocab, Vocab)
    assert len(train) > 5 * len(test) > 0
    x, y = next(train.batches(4, torch.Generator().manual_seed(0)))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the inputs shifted by one"
    text = vocab.decode(x[0])
    assert torch.equal(vocab.encode(text), x[0])
    assert len(train.subset([0, 2])) == 2
    with pytest.raises(ValueError):
        vocab.encode("\u00e9")


# --- partition ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "world"), [(1797, 1), (1437, 3), (10, 4), (3, 5), (0, 2), (1000, 7)])
def test_partition_is_disjoint_covering_and_balanced(n: int, world: int) -> None:
    shards = [partition(n, r, world, seed=42) for r in range(world)]
    joined = np.concatenate(shards)
    assert len(joined) == n and len(np.unique(joined)) == n
    assert set(joined.tolist()) == set(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    for r, s in enumerate(shards):
        assert s.dtype == np.int64
        assert np.array_equal(s, partition(n, r, world, seed=42)), "deterministic for a seed"


def test_partition_depends_on_seed_and_rejects_bad_ranks() -> None:
    assert not np.array_equal(partition(100, 0, 4, seed=1), partition(100, 0, 4, seed=2))
    for bad in [dict(n=10, rank=4, world=4), dict(n=10, rank=-1, world=4), dict(n=10, rank=0, world=0),
                dict(n=-1, rank=0, world=1)]:
        with pytest.raises(ValueError):
            partition(**bad, seed=0)


# --- load_factory -------------------------------------------------------------------------------


def test_load_factory_resolves_callables() -> None:
    assert load_factory("trainers.models:build_model") is build_model
    assert load_factory("trainers.models:DigitsMLP") is models.DigitsMLP
    assert load_factory(" trainers.datasets:Vocab.from_text ") == Vocab.from_text
    assert isinstance(load_factory("trainers.models:build_model")("digits_mlp"), models.DigitsMLP)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("trainers.models", "package.module:attr"),
        ("trainers.models:", "package.module:attr"),
        (":build_model", "package.module:attr"),
        ("a:b:c", "package.module:attr"),
        ("trainers/models.py:f", "package.module:attr"),
        ("", "package.module:attr"),
        ("no_such_pkg_peertrain.mod:f", "no module named"),
        ("trainers.no_such_module:f", "no module named"),
        ("trainers.models:no_such_attr", "no attribute"),
        ("trainers.models:DIGITS_FEATURES", "not a callable"),
    ],
)
def test_load_factory_rejects_bad_specs(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        load_factory(spec)


# --- models -------------------------------------------------------------------------------------


def test_pick_device_prefers_cuda() -> None:
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("name", "opts", "x", "out"),
    [
        ("digits_mlp", {}, torch.rand(5, 64), (5, 10)),
        ("digits_cnn", {}, torch.rand(5, 1, 8, 8), (5, 10)),
        ("digits_cnn", {}, torch.rand(5, 64), (5, 10)),
        ("digits_wide_mlp", {}, torch.rand(5, 64), (5, 10)),
        ("char_transformer", {"vocab": 65}, torch.randint(0, 65, (3, 64)), (3, 64, 65)),
        ("char_transformer", {"vocab": 65, "block": 64}, torch.randint(0, 65, (2, 17)), (2, 17, 65)),
    ],
)
def test_model_forward_shapes(name: str, opts: dict, x: torch.Tensor, out: tuple[int, ...]) -> None:
    model = build_model(name, **opts)
    with torch.no_grad():
        assert model(x).shape == out


def test_parameter_counts() -> None:
    counts = {}
    for name in models.MODELS:
        lm = name == "char_transformer" or name in models.LM_PRESETS
        with torch.device("meta") if name in models.LM_PRESETS else contextlib.nullcontext():  # no storage
            counts[name] = count_parameters(build_model(name, **({"vocab": 65} if lm else {})))
    print("parameter counts:", counts)
    assert counts["digits_mlp"] == 64 * 128 + 128 + 128 * 10 + 10
    assert counts["digits_cnn"] < 100_000
    assert 2_000_000 <= counts["digits_wide_mlp"] <= 8_000_000, "slow-link benchmark needs several MB"
    assert 100_000 < counts["char_transformer"] < 1_000_000
    assert counts["lm_100m"] == 106_616_129 and counts["lm_14m"] == 14_295_617  # issue 41: >= 1e8; 10-30 M


def test_build_model_errors() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet50")
    with pytest.raises(ValueError, match="bad options"):
        build_model("digits_mlp", width=3)
    with pytest.raises(ValueError, match="bad options"):
        build_model("char_transformer")
    with pytest.raises(ValueError, match="divisible"):
        build_model("char_transformer", vocab=10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="exceeds block"):
        build_model("char_transformer", vocab=10, block=8)(torch.zeros(1, 9, dtype=torch.long))


def test_char_transformer_is_causal() -> None:
    model = seeded_model("char_transformer", 0, vocab=20, d_model=32, n_heads=2, block=16).eval()
    a = torch.randint(0, 20, (1, 16), generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 20
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.allclose(la[:, :10], lb[:, :10], atol=1e-5), "future tokens leaked into the past"
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_seeded_model_is_reproducible_and_leaves_global_rng_alone() -> None:
    before = torch.random.get_rng_state()
    a, b = seeded_model("digits_mlp", 7), seeded_model("digits_mlp", 7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = seeded_model("digits_mlp", 8)
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


# --- training -----------------------------------------------------------------------------------


def test_digits_mlp_baseline_reaches_95_percent() -> None:
    result = train_single("digits_mlp", seed=0)
    print(
        f"digits_mlp baseline: held-out accuracy {result.test_accuracy:.4f}, train loss {result.train_loss:.4f}, "
        f"{result.epochs} epochs in {result.seconds:.2f} s ({result.samples_per_s:.0f} samples/s) "
        f"{result.hyperparams}"
    )
    assert result.test_accuracy >= 0.95
    assert result.epochs == baseline.RECOMMENDED["digits_mlp"].epochs
    assert result.parameters == 9610


def test_evaluate_restores_mode_and_scores_perfect_predictor() -> None:
    train, _ = load_digits()
    model = build_model("digits_mlp")
    model.train()
    loss, acc = evaluate(model, train, "cpu")
    assert model.training and loss > 0 and 0.0 <= acc <= 1.0

    class Oracle(torch.nn.Module):
        """Reads the label out of the input, so its loss is ~0 and accuracy exactly 1."""

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(x[:, 0].long(), 10).float() * 50

    labels = torch.tensor([3, 1, 4, 1, 5, 9])
    loss, acc = evaluate(Oracle(), ArrayDataset(labels.float()[:, None], labels), "cpu", batch_size=4)
    assert acc == 1.0 and loss < 1e-6


def test_char_transformer_loss_decreases() -> None:
    train, test, vocab = load_char_corpus(block=32)
    model = seeded_model("char_transformer", 0, vocab=len(vocab), d_model=64, n_layers=1, n_heads=4, block=32)
    opt = baseline.make_optimizer(model.parameters(), "adam", lr=1e-2)
    probe = test.subset(range(64))
    before, _ = evaluate(model, probe, "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch_threads(1):
        for step, (x, y) in enumerate(train.batches(16, gen)):
            loss = baseline.batch_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 39:
                break
    after, acc = evaluate(model, probe, "cpu")
    print(f"char_transformer held-out loss {before:.3f} -> {after:.3f} after 40 steps (accuracy {acc:.3f})")
    assert before > 3.5 and after < before - 0.8


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert baseline.main(["--model", "digits_mlp", "--epochs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "digits_mlp" and out["epochs"] == 1 and 0.0 <= out["test_accuracy"] <= 1.0


def test_load_for_model_pairs_every_builtin() -> None:
    for name in models.MODELS:
        train, _, opts = datasets.load_for_model(name)
        x, _ = next(train.batches(2))
        big = name in models.LM_PRESETS  # shapes only: on the meta device, no storage, no compute
        with torch.device("meta") if big else contextlib.nullcontext():
            model = build_model(name, **opts)
        with torch.no_grad():
            assert model(x.to("meta") if big else x).shape[0] == 2
    with pytest.raises(ValueError):
        datasets.load_for_model("nope")


def test_the_link_bound_presets_have_their_sizes_and_take_overrides() -> None:
    """Issue 41's workloads: over 1e8 parameters, and a 10-30 M sibling; on the shipped corpus, with the
    preset's context; `model_options` still size them (a test can host a small one)."""
    counts = {}
    for name in models.LM_PRESETS:
        train, _, opts = datasets.load_sized_model(name, {})
        assert opts["block"] == models.LM_PRESETS[name]["block"] and train.batches(1) is not None
        with torch.device("meta"):
            counts[name] = models.count_parameters(build_model(name, **opts))
    assert counts["lm_100m"] >= 1e8 and 1e7 <= counts["lm_14m"] <= 3e7
    _, _, opts = datasets.load_sized_model("lm_14m", {"n_layers": 1, "block": 32})
    small = build_model("lm_14m", **opts)
    assert opts["block"] == 32 and models.count_parameters(small) < 3e6
    assert "lm_100m" in baseline.RECOMMENDED and "lm_14m" in baseline.RECOMMENDED
