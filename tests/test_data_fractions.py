"""Class-balanced training fractions ([ConViT21], Table 2) and the validation split."""

from __future__ import annotations

import numpy as np
import pytest

from core.data import fraction_indices, split_train_val, train_val_indices
from core.data.splits import limit_positions, stratified_head

# Deliberately unbalanced classes, shuffled, with a class of 3 images and a missing label (4).
COUNTS = {0: 500, 1: 300, 2: 120, 3: 77, 5: 3}
FRACTIONS = [0.05, 0.1, 0.3, 0.5, 1.0]  # the grid of [ConViT21], Table 2


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    y = np.concatenate([np.full(n, c) for c, n in COUNTS.items()]).astype(np.int64)
    return np.random.default_rng(123).permutation(y)


def test_hand_computed_sizes() -> None:
    y = np.array([0] * 10 + [1] * 5 + [2] * 1)
    # 0.5 * 10 = 5; 0.5 * 5 = 2.5 -> 3 (half up); 0.5 * 1 = 0.5 -> 1
    assert np.bincount(y[fraction_indices(y, 0.5, seed=0)]).tolist() == [5, 3, 1]
    # 0.05 * 10 = 0.5 -> 1; 0.05 * 5 = 0.25 -> 0, but every class keeps at least one image
    assert np.bincount(y[fraction_indices(y, 0.05, seed=0)]).tolist() == [1, 1, 1]


@pytest.mark.parametrize("f", FRACTIONS)
def test_exact_sizes_and_class_balance(labels: np.ndarray, f: float) -> None:
    idx = fraction_indices(labels, f, seed=7)
    assert len(np.unique(idx)) == len(idx) and np.all(np.diff(idx) > 0)
    kept = np.bincount(labels[idx], minlength=6)
    for c, n in COUNTS.items():
        assert kept[c] == max(1, int(np.floor(f * n + 0.5)))
        assert abs(kept[c] - f * n) <= 0.5 or kept[c] == 1  # balance: f of each class, to the image
    assert kept[4] == 0


def test_full_fraction_keeps_everything(labels: np.ndarray) -> None:
    assert np.array_equal(fraction_indices(labels, 1.0, seed=3), np.arange(len(labels)))


def test_nested_across_fractions(labels: np.ndarray) -> None:
    for seed in (0, 1, 2):
        sets = [set(fraction_indices(labels, f, seed).tolist()) for f in FRACTIONS]
        for small, large in zip(sets, sets[1:]):
            assert small < large


def test_deterministic_per_seed(labels: np.ndarray) -> None:
    a = fraction_indices(labels, 0.3, seed=11)
    assert np.array_equal(a, fraction_indices(labels.copy(), 0.3, seed=11))
    assert not np.array_equal(a, fraction_indices(labels, 0.3, seed=12))


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_bad_fraction(labels: np.ndarray, bad: float) -> None:
    with pytest.raises(ValueError, match="sample_fraction"):
        fraction_indices(labels, bad, seed=0)


def test_fashion_mnist_sized_labels_give_exact_per_class_counts() -> None:
    y = np.repeat(np.arange(10), 6000)
    for f, per_class in [(0.05, 300), (0.1, 600), (0.3, 1800), (0.5, 3000)]:
        assert np.bincount(y[fraction_indices(y, f, seed=0)]).tolist() == [per_class] * 10


def test_split_train_val_exact_balanced_disjoint(labels: np.ndarray) -> None:
    train, val = split_train_val(labels, 100, seed=5)
    assert len(val) == 100 and len(train) == len(labels) - 100
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(len(labels)))
    per_class = np.bincount(labels[val], minlength=6)
    for c, n in COUNTS.items():  # proportional: 100 * n / 1000, rounded either way
        assert abs(per_class[c] - 100 * n / len(labels)) < 1
    again = split_train_val(labels, 100, seed=5)
    assert np.array_equal(again[1], val) and np.array_equal(again[0], train)
    assert not np.array_equal(split_train_val(labels, 100, seed=6)[1], val)


def test_split_train_val_balanced_labels() -> None:
    y = np.repeat(np.arange(10), 6000)
    _, val = split_train_val(y, 5000, seed=0)
    assert np.bincount(y[val]).tolist() == [500] * 10


def test_split_train_val_zero_and_too_large(labels: np.ndarray) -> None:
    train, val = split_train_val(labels, 0, seed=0)
    assert len(val) == 0 and len(train) == len(labels)
    with pytest.raises(ValueError, match="val_size"):
        split_train_val(labels, len(labels), seed=0)


def test_train_val_indices_validation_independent_of_fraction(labels: np.ndarray) -> None:
    results = [train_val_indices(labels, val_size=100, fraction=f, seed=2) for f in FRACTIONS]
    val = results[0][1]
    for tr, va in results:
        assert np.array_equal(va, val)
        assert not set(tr.tolist()) & set(va.tolist())
    for (small, _), (large, _) in zip(results, results[1:]):
        assert set(small.tolist()) < set(large.tolist())
    full_train, _ = split_train_val(labels, 100, seed=2)
    assert np.array_equal(results[-1][0], full_train)
    # the fraction is taken of each class of the training part (after carving validation)
    tr, _ = results[2]  # f = 0.3
    remaining = np.bincount(labels[full_train], minlength=6)
    kept = np.bincount(labels[tr], minlength=6)
    for c in COUNTS:
        assert kept[c] == max(1, int(np.floor(0.3 * remaining[c] + 0.5)))


# ----------------------------------------------------------------------------------------------------------
# data.limit, the smoke size: a class-balanced cap on each split (core.data.splits.stratified_head)


def test_stratified_head_hand_computed() -> None:
    y = np.array([2, 0, 0, 1, 0, 2, 1, 0])
    # classes take turns in index order: rank 0 of each class (positions 0, 1, 3), then rank 1 (2, 5, 6) ...
    assert stratified_head(y, 3).tolist() == [0, 1, 3]
    assert stratified_head(y, 5).tolist() == [0, 1, 2, 3, 5]
    assert stratified_head(y, 7).tolist() == [0, 1, 2, 3, 4, 5, 6]  # class 0's third image before its fourth
    assert stratified_head(y, None).tolist() == list(range(8))
    assert stratified_head(y, 100).tolist() == list(range(8))
    with pytest.raises(ValueError, match="positive"):
        stratified_head(y, 0)


@pytest.mark.parametrize("n", [1, 7, 50, 200, 600])
def test_stratified_head_is_balanced_and_nested(labels: np.ndarray, n: int) -> None:
    keep = stratified_head(labels, n)
    assert len(keep) == n and np.all(np.diff(keep) > 0)
    counts = np.bincount(labels[keep], minlength=6)[list(COUNTS)]
    room = np.array([COUNTS[c] for c in COUNTS])
    # the classes with images left get the same share, up to one image; a class that ran out gave all it had
    left = counts < room
    assert left.any() or n == len(labels)
    assert counts[left].max() - counts[left].min() <= 1
    assert np.all(counts[~left] <= counts[left].max())
    assert set(stratified_head(labels, max(1, n - 3)).tolist()) <= set(keep.tolist())


def test_limit_caps_train_and_val_after_the_carve_and_the_fraction(labels: np.ndarray) -> None:
    tr, va = train_val_indices(labels, val_size=100, fraction=0.5, seed=2)
    ctr, cva = train_val_indices(labels, val_size=100, fraction=0.5, seed=2, limit={"train": 40, "val": 20})
    assert len(ctr) == 40 and len(cva) == 20
    assert set(ctr.tolist()) <= set(tr.tolist()) and set(cva.tolist()) <= set(va.tolist())
    assert np.array_equal(ctr, tr[stratified_head(labels[tr], 40)])
    assert np.array_equal(cva, va[stratified_head(labels[va], 20)])
    # a cap above a split's size, or none, leaves it whole
    same = train_val_indices(labels, val_size=100, fraction=0.5, seed=2, limit={"train": 10**6, "test": 5})
    assert np.array_equal(same[0], tr) and np.array_equal(same[1], va)
    assert limit_positions(labels, None, "test") is None
    assert limit_positions(labels, {"test": None}, "test") is None


def test_load_test_caps_the_test_split_and_the_corrupted_sets_nest_in_it(tmp_path) -> None:
    from _train_helpers import write_dataset

    from core.data.shard_reader import load_split
    from core.data.splits import load_test
    from core.robustness.corruptions import select_indices

    d = write_dataset(tmp_path / "ds", n_train=60, n_test=90)
    x, y = load_split(d, "test")
    cx, cy = load_test(d, {"test": 30})
    keep = stratified_head(y, 30)
    assert np.array_equal(cx, x[keep]) and np.array_equal(cy, y[keep])
    assert np.bincount(cy).max() - np.bincount(cy).min() <= 1
    # the corrupted sets of a capped split (n <= cap) are the full split's first ones: the same images
    for n in (10, 30):
        assert np.array_equal(keep[select_indices(cy, n)], select_indices(y, n))
    assert np.array_equal(load_test(d, None)[0], x)
