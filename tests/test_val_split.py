"""``data.val_from: test_half`` (issue 48): a CNN trained on every training image (a released one, imported
through pretrain.source) is validated on a fixed, class-balanced half of the test split and tested -- clean
and corrupted -- on the other half only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _train_helpers import write_dataset

from core.config import ConfigError, Params, validate_params
from core.data import half_split, load_split, plan_splits, positions_of_test, roles_text, split_roles
from core.robustness import corruptions as C
from stages import corrupt, evaluate, robustness_bench
from stages.harness import training as T
from stages.harness.runner import StageError

# Unbalanced, shuffled classes, one of them odd-sized and one a single image.
COUNTS = {0: 40, 1: 31, 2: 12, 3: 1, 5: 9}


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    y = np.concatenate([np.full(n, c) for c, n in COUNTS.items()]).astype(np.int64)
    return np.random.default_rng(5).permutation(y)


def _by_slicing(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rule written another way: each class's indices in order, every other one from the first (val)
    and from the second (test)."""
    val, test = [], []
    for c in sorted(set(labels.tolist())):
        idx = [i for i, y in enumerate(labels.tolist()) if y == c]
        val += idx[0::2]
        test += idx[1::2]
    return np.array(sorted(val)), np.array(sorted(test))


def test_the_halves_by_hand() -> None:
    y = np.array([1, 0, 0, 1, 0, 1, 1, 0, 2])
    val, test = half_split(y)
    # class 0 at 1, 2, 4, 7 -> 1, 4 | 2, 7; class 1 at 0, 3, 5, 6 -> 0, 5 | 3, 6; class 2 at 8 -> 8 | -
    assert val.tolist() == [0, 1, 4, 5, 8] and test.tolist() == [2, 3, 6, 7]


def test_the_halves_are_disjoint_cover_the_split_and_are_class_balanced(labels: np.ndarray) -> None:
    val, test = half_split(labels)
    assert not set(val.tolist()) & set(test.tolist())
    assert sorted([*val.tolist(), *test.tolist()]) == list(range(len(labels)))
    for c, n in COUNTS.items():
        assert (labels[val] == c).sum() == (n + 1) // 2 and (labels[test] == c).sum() == n // 2
    assert all(np.array_equal(a, b) for a, b in zip((val, test), _by_slicing(labels)))


def test_cifar10_sized_halves_and_the_line_a_report_prints() -> None:
    train = np.repeat(np.arange(10), 5000)
    test = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 1000))
    plan = plan_splits(train, test, val_from="test_half", val_size=0, fraction=1.0, seed=3)
    assert np.array_equal(plan.train, np.arange(50_000))  # every training image
    assert plan.val_split == "test" and (len(plan.val), len(plan.test)) == (5000, 5000)
    roles = split_roles(plan, train, test)
    assert roles["val"]["per_class"] == roles["test"]["per_class"] == 500
    assert roles_text(roles) == (
        "validation: 5,000 test images (500 per class, even ranks of each class in test-index order (its 0th, "
        "2nd, 4th ... image)); test and corrupted sets: the other 5,000 test images (500 per class)"
    )


def test_the_halves_do_not_depend_on_the_seed_or_the_fraction(labels: np.ndarray) -> None:
    train = np.repeat(np.arange(6), 20)
    plans = [plan_splits(train, labels, val_from="test_half", val_size=0, fraction=f, seed=s)
             for s in (0, 1, 2**40) for f in (1.0, 0.5)]  # fmt: skip
    for p in plans:
        assert np.array_equal(p.val, plans[0].val) and np.array_equal(p.test, plans[0].test)
    assert not np.array_equal(plans[1].train, plans[3].train)  # the fraction still draws per seed


def test_limits_cap_each_half_within_it(labels: np.ndarray) -> None:
    val, test = half_split(labels)
    plan = plan_splits(np.repeat(np.arange(3), 10), labels, val_from="test_half", val_size=0, fraction=1.0,
                       seed=0, limit={"val": 10, "test": 12})  # fmt: skip
    assert len(plan.val) == 10 and set(plan.val.tolist()) <= set(val.tolist())
    assert len(plan.test) == 12 and set(plan.test.tolist()) <= set(test.tolist())
    assert np.array_equal(positions_of_test(labels, val_from="test_half", limit={"test": 12}), plan.test)
    assert positions_of_test(labels) is None  # val_from train, uncapped: the whole split


def test_a_validation_carve_with_the_test_half_is_refused_in_one_line(labels: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"^data.val_size: 10 carves validation from the training split"):
        plan_splits(
            np.repeat(np.arange(3), 10), labels, val_from="test_half", val_size=10, fraction=1.0, seed=0
        )
    raw = {"data": {"val_from": "test_half", "val_size": 100}}
    with pytest.raises(ConfigError) as info:
        validate_params(raw)
    assert str(info.value).startswith("data.val_size: 100 carves validation") and "\n" not in str(info.value)
    assert validate_params({"data": {"val_from": "test_half", "val_size": 0}}).data.val_from == "test_half"
    assert Params().data.val_from == "train"


def test_a_published_benchmark_with_the_test_half_is_refused_in_one_line(tmp_path: Path) -> None:
    raw = {"data": {"name": "cifar10", "dir": "data/cifar10", "image_size": 32, "val_from": "test_half",
                    "val_size": 0},
           "robustness": {"dir": "data/cifar10-c", "public": {"kind": "cifar10_c", "dir": str(tmp_path)}}}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        validate_params(raw)
    msg = str(info.value)
    assert (
        msg.startswith("robustness.public: a published benchmark covers the whole test split")
        and "\n" not in msg
    )
    del raw["data"]["val_from"]
    raw["data"]["val_size"] = 5000
    assert validate_params(raw).robustness.public is not None


# ---------------------------------------------------------------------------------------------------------
# the stages: what training / evaluate read as the test split, and what the corrupted sets are drawn from


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("vs") / "ds", n_train=60, n_test=90)


def _params(prepared: Path, out: Path, **over: object) -> Params:
    raw = {"data": {"dir": str(prepared), "val_size": 0, "val_from": "test_half"},
           "robustness": {"dir": str(out / "c"), "n_images": 20, "corruptions": ["fog"], "severities": [2],
                          "workers": 1}, "tracking": {"enabled": False}}  # fmt: skip
    return validate_params(raw).with_overrides(dict(over))


def test_the_dataset_builder_validates_on_one_half_and_tests_on_the_other(
    prepared: Path, tmp_path: Path
) -> None:
    x, y = load_split(prepared, "test")
    tx, ty = load_split(prepared, "train")
    val, test = _by_slicing(y)
    for seed in (0, 9):
        ds = T.datasets(_params(prepared, tmp_path, seed=seed), Path("/"))
        assert np.array_equal(ds.val_x, x[val]) and np.array_equal(ds.val_y, y[val])
        assert np.array_equal(ds.test_x, x[test]) and np.array_equal(ds.test_y, y[test])
        assert np.array_equal(ds.train_x, tx) and np.array_equal(ds.train_y, ty)  # every training image
    assert ds.roles["val"] == {"split": "test", "images": len(val), "per_class": ds.roles["val"]["per_class"],
                               "rule": ds.roles["val"]["rule"]}  # fmt: skip
    assert (ds.roles["test"]["images"], ds.roles["train"]["images"]) == (len(test), 60)
    # evaluate's clean test split is the same half, and its metrics say so
    params = _params(prepared, tmp_path)
    bench = robustness_bench.bench(params, Path("/"))
    assert np.array_equal(bench.images, x[test]) and np.array_equal(bench.labels, y[test])
    assert evaluate.tested_images(params, Path("/"))["images"] == len(test)
    # the default keeps validation in the training split and the whole test split
    whole = T.datasets(
        _params(prepared, tmp_path, **{"data.val_from": "train", "data.val_size": 10}), Path("/")
    )
    assert np.array_equal(whole.test_x, x) and len(whole.val_y) == 10 and len(whole.train_y) == 50


def test_the_corrupted_sets_draw_only_from_the_test_half(prepared: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(C, "default_workers", lambda: 1)
    params = _params(prepared, tmp_path)
    x, y = load_split(prepared, "test")
    val, test = _by_slicing(y)
    corrupt.check(params, Path("/"))
    corrupt.run(params, root=Path("/"))
    bench = robustness_bench.bench(params, Path("/"))
    for c, sev in (("clean", 0), ("fog", 2)):
        stored = C.read_set(C.set_path(tmp_path / "c", c, sev))
        assert len(stored.indices) == 20 and stored.indices.max() < len(test)
    clean = C.read_set(C.set_path(tmp_path / "c", "clean", 0))
    # each corrupted image's index is its clean original's position in evaluate's clean test split (the pairing)
    assert np.array_equal(clean.images, bench.images[clean.indices])
    assert np.array_equal(clean.images, x[test[clean.indices]])
    assert not any((img == x[val]).all(axis=(1, 2, 3)).any() for img in clean.images)  # no validation image
    assert corrupt.source_record(params, prepared)["rule"].startswith("odd ranks")
    # the sets of the whole split have another identity, and n_images is checked against the half
    whole = _params(prepared, tmp_path, **{"data.val_from": "train"})
    assert corrupt.identity(params, {}) != corrupt.identity(whole, {})
    n = len(test)
    with pytest.raises(StageError, match=rf"^robustness.n_images: {n + 1} exceeds the {n} test-half images"):
        corrupt.check(_params(prepared, tmp_path, **{"robustness.n_images": n + 1}), Path("/"))


def test_a_sweeps_margin_counts_the_validation_images_the_trial_recorded(tmp_path: Path) -> None:
    """The lr choice's margin in images (pipelines/sweep/selection.py) is a share of the validation images the
    trial's fine-tuning recorded (its data_roles: here the test split's half), not data.val_size (0 then)."""
    import json

    from pipelines.sweep.selection import val_images
    from stages.harness import chain

    params = {"data": {"val_size": 0, "val_from": "test_half", "limit": None}}
    assert val_images(params, tmp_path) == 0  # nothing recorded: the params' carve-out
    path = tmp_path / chain.metrics_file("finetune")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"data_roles": {"val": {"split": "test", "images": 5000, "per_class": 500}}}))
    assert val_images(params, tmp_path) == 5000
    assert val_images({"data": {"val_size": 5000, "limit": {"val": 300}}}, tmp_path / "none") == 300
