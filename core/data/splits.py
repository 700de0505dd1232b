"""Class-balanced splits and fractions: the images a run trains, validates and tests on.

The public data API of the project (see tcnn_team/INTERFACES.md, "Data"):

- importers (``import_dataset`` and friends, in core/data/importers.py) write ``<split>-NNNNN.parquet`` +
  ``manifest.json``;
- :func:`~core.data.shard_reader.read_manifest`, :func:`~core.data.shard_reader.load_split` read them back
  (core/data/shard_reader.py: checksums verified; a truncated, missing or altered shard fails with one line naming
  the file);
- :func:`split_train_val`, :func:`fraction_indices`, :func:`train_val_indices` choose the images a run trains
  and validates on ([ConViT21], Table 2 protocol for fractions); :func:`half_split` splits the test split
  into a validation half and a test half (``data.val_from: test_half``); :func:`plan_splits` is the whole
  choice; :func:`stratified_head` caps a split at a class-balanced number of images (``data.limit``, the
  smoke size);
- :class:`~core.data.loader.BatchLoader` (core/data/loader.py) turns arrays into augmented, normalized batches whose
  randomness is a pure function of (seed, epoch, step); :class:`~core.data.shard_reader.ShardDataset` is the
  per-sample torch Dataset for data too large to hold in memory.

How the validation split and the training fraction combine (:func:`train_val_indices`): the validation split
is carved from the full training split first, independent of the fraction, so every fraction of a sweep is
validated on the same images; the fraction f is then applied per class to the remaining training images, so
for one seed the smaller fractions are subsets of the larger ones.

Where validation comes from (``data.val_from``, :data:`VAL_FROM`): ``train`` carves it out of the training
split as above; ``test_half`` (a CNN trained on every training image, e.g. a released one imported through
``pretrain.source``, has seen them all) takes a fixed, class-balanced half of the test split as validation and
keeps the other half as the test split every stage reads (the clean test accuracy, the corrupted sets); the
training split is then used whole (:func:`half_split`, :func:`plan_splits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.data.shard_reader import load_split, read_manifest

# Stream tags: each random choice draws from its own seeded stream, so adding one never shifts another.
_VAL_STREAM = 0x5641  # "VA"
_FRACTION_STREAM = 0x4652  # "FR"

#: ``data.val_from``: where the validation images come from (the module docstring).
VAL_FROM = ("train", "test_half")

#: How :func:`half_split` chooses, in words (what the roles record, :func:`split_roles`).
HALF_RULE = {
    "val": "even ranks of each class in test-index order (its 0th, 2nd, 4th ... image)",
    "test": "odd ranks of each class in test-index order (its 1st, 3rd, 5th ... image)",
}


def _class_indices(labels: np.ndarray) -> dict[int, np.ndarray]:
    order = np.argsort(labels, kind="stable")
    classes, starts = np.unique(labels[order], return_index=True)
    bounds = [*starts[1:], len(labels)]
    return {int(c): order[s:e] for c, s, e in zip(classes, starts, bounds)}


def _labels(labels: Any) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be a 1-d integer array, got {arr.dtype} {arr.shape}")
    if len(arr) and arr.min() < 0:
        raise ValueError("labels must be non-negative")
    return arr


def split_train_val(labels: Any, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Class-balanced, deterministic split into (train_idx, val_idx), both sorted and disjoint.

    Class c gets ``val_size * n_c / N`` validation images, rounded by largest remainder so the total is
    exactly ``val_size``; which images is the head of a per-class permutation seeded by (seed, class).
    """
    labels = _labels(labels)
    n = len(labels)
    if not 0 <= val_size < n:
        raise ValueError(f"data.val_size: {val_size} must be in [0, {n}) for a training split of {n} images")
    groups = _class_indices(labels)
    classes = sorted(groups)
    counts = np.array([len(groups[c]) for c in classes], np.int64)
    quota = val_size * counts / n
    take = np.floor(quota).astype(np.int64)
    remainder = val_size - int(take.sum())
    order = np.lexsort((np.arange(len(classes)), -(quota - take)))  # largest fractional part first
    take[order[:remainder]] += 1
    val_parts, train_parts = [], []
    for c, k, count in zip(classes, take, counts):
        if k >= count and val_size > 0:
            raise ValueError(
                f"data.val_size: {val_size} leaves class {c} ({count} images) no training images"
            )
        perm = np.random.default_rng([seed, _VAL_STREAM, c]).permutation(groups[c])
        val_parts.append(perm[:k])
        train_parts.append(perm[k:])
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.empty(0, np.int64)
    train = np.sort(np.concatenate(train_parts)) if train_parts else np.empty(0, np.int64)
    return train.astype(np.int64), val.astype(np.int64)


def fraction_indices(labels: Any, fraction: float, seed: int) -> np.ndarray:
    """Keep a fraction of EACH class ([ConViT21], Table 2): sorted indices into ``labels``.

    Class c keeps ``max(1, floor(fraction * n_c + 1/2))`` images: the head of one permutation seeded by
    (seed, class) and independent of the fraction, so for one seed a smaller fraction is a subset of a larger
    one. ``fraction == 1`` keeps everything.
    """
    labels = _labels(labels)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"data.sample_fraction: {fraction} must be in (0, 1]")
    keep = []
    for c, idx in _class_indices(labels).items():
        k = max(1, int(np.floor(fraction * len(idx) + 0.5)))
        perm = np.random.default_rng([seed, _FRACTION_STREAM, c]).permutation(len(idx))
        keep.append(idx[perm[:k]])
    return np.sort(np.concatenate(keep)).astype(np.int64) if keep else np.empty(0, np.int64)


def stratified_head(labels: Any, n: int | None) -> np.ndarray:
    """Sorted positions of ``n`` class-balanced images of ``labels``: classes take turns in index order (the
    r-th image of every class comes before the (r+1)-th of any), so class counts differ by at most one while
    a class has images left. No RNG: a deterministic function of the labels, and growing n keeps every image
    chosen before. ``n`` None (no cap) or at least the split's size: every position.

    The one rule for a capped set: the corrupted sets' selection (`core.robustness.corruptions.select_indices`)
    and ``data.limit`` (:func:`limit_positions`); because the rule nests, the corrupted sets of a capped test
    split are the full split's first ones."""
    labels = np.asarray(labels).reshape(-1)
    total = len(labels)
    if n is None or n >= total:
        return np.arange(total)
    if n <= 0:
        raise ValueError(f"a cap must be positive, got {n}")
    order = np.lexsort((np.arange(total), _class_ranks(labels)))
    return np.sort(order[:n])


def _class_ranks(labels: np.ndarray) -> np.ndarray:
    """Each image's rank within its class, in index order (0 for the first image of its class)."""
    rank = np.empty(len(labels), dtype=np.int64)
    for k in np.unique(labels):
        where = np.flatnonzero(labels == k)
        rank[where] = np.arange(len(where))
    return rank


def half_split(labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """(val_idx, test_idx): the test split's validation half and test half (``data.val_from: test_half``),
    sorted, disjoint, together the whole split.

    Per class, in test-index order, the images of even rank (the class's 0th, 2nd, 4th ...) validate and those
    of odd rank test (:data:`HALF_RULE`): no RNG and no seed, so every run, seed and arm sees the same halves;
    class c of n_c images puts ceil(n_c / 2) in validation and floor(n_c / 2) in test (CIFAR-10: 500 and 500)."""
    labels = _labels(labels)
    even = _class_ranks(labels) % 2 == 0
    return np.flatnonzero(even).astype(np.int64), np.flatnonzero(~even).astype(np.int64)


def limit_positions(labels: Any, limit: Mapping[str, int | None] | None, split: str) -> np.ndarray | None:
    """Positions into ``labels`` that ``data.limit`` keeps of ``split`` (:func:`stratified_head` of
    ``limit[split]``); None when the split is not capped (no limit, or a cap at least its size)."""
    n = (limit or {}).get(split)
    if n is None or n >= len(labels):
        return None
    return stratified_head(labels, n)


def train_val_indices(
    labels: Any, *, val_size: int, fraction: float, seed: int,
    limit: Mapping[str, int | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(train_idx, val_idx) into the training split: validation first, then the fraction of the rest, then
    ``limit`` (``data.limit``'s train and val caps, :func:`limit_positions`) of each.

    The validation set does not depend on the fraction; the training indices for fraction f1 < f2 are a
    subset of those for f2 (same seed). Indices are sorted.
    """
    labels = _labels(labels)
    train, val = split_train_val(labels, val_size, seed)
    train = train[fraction_indices(labels[train], fraction, seed)]
    return _capped(train, labels, limit, "train"), _capped(val, labels, limit, "val")


def _capped(
    idx: np.ndarray, labels: np.ndarray, limit: Mapping[str, int | None] | None, split: str
) -> np.ndarray:
    keep = limit_positions(labels[idx], limit, split)
    return idx if keep is None else idx[keep]


@dataclass
class Splits:
    """What a training stage needs: arrays for train (after val + fraction), val and test, plus the manifest."""

    train: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    manifest: dict[str, Any]
    train_idx: np.ndarray  # positions in the stored train split (for provenance)
    val_idx: np.ndarray  # positions in the stored split validation comes from (plan.val_split)
    plan: SplitPlan | None = None
    roles: dict[str, Any] | None = None  # split_roles: which images play which role


def load_splits(
    data_dir: str | Path, *, val_size: int, sample_fraction: float, seed: int, image_size: int | None = None,
    limit: Mapping[str, int | None] | None = None, val_from: str = "train",
) -> Splits:  # fmt: skip
    """Load train and test and choose each role's images (:func:`plan_splits`: validation from the training
    split or from the test split's validation half, the fraction, ``data.limit``)."""
    manifest = read_manifest(data_dir)
    x, y = load_split(data_dir, "train", image_size=image_size)
    tx, ty = load_split(data_dir, "test", image_size=image_size)
    plan = plan_splits(y, ty, val_from=val_from, val_size=val_size, fraction=sample_fraction, seed=seed,
                       limit=limit)  # fmt: skip
    vx, vy = (tx, ty) if plan.val_split == "test" else (x, y)
    test = (tx, ty) if plan.test is None else (np.ascontiguousarray(tx[plan.test]), ty[plan.test])
    tr, va = plan.train, plan.val
    return Splits((x[tr], y[tr]), (vx[va], vy[va]), test, manifest, tr, va, plan, split_roles(plan, y, ty))


def load_test(
    data_dir: str | Path, limit: Mapping[str, int | None] | None = None, *, image_size: int | None = None,
    val_from: str = "train",
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The test split every stage evaluates on (:func:`positions_of_test`): all of it, or its test half
    (``data.val_from: test_half``), then ``data.limit``'s class-balanced cap; rows in ``index`` order."""
    images, labels = load_split(data_dir, "test", image_size=image_size)
    keep = positions_of_test(labels, val_from=val_from, limit=limit)
    return (images, labels) if keep is None else (np.ascontiguousarray(images[keep]), labels[keep])


def positions_of_test(
    labels: Any, *, val_from: str = "train", limit: Mapping[str, int | None] | None = None
) -> np.ndarray | None:
    """Positions into the stored test split of the test split every stage reads: the whole split
    (``val_from`` "train") or its test half (:func:`half_split`), then ``limit``'s test cap
    (:func:`limit_positions`); None: the whole split, uncapped."""
    labels = _labels(labels)
    _check_val_from(val_from)
    if val_from == "train":
        return limit_positions(labels, limit, "test")
    half = half_split(labels)[1]
    return _capped(half, labels, limit, "test")


def capped_test_positions(
    labels: Any, *, val_from: str = "train", limit: Mapping[str, int | None] | None = None
) -> np.ndarray | None:
    """Where the images :func:`load_test` returns sit in the split the corrupted sets index (the whole test
    split, or its test half): ``data.limit``'s test cap as positions into that split; None when uncapped.
    A corrupted image of index j pairs with the clean image at position ``searchsorted(result, j)``."""
    labels = _labels(labels)
    _check_val_from(val_from)
    base = labels if val_from == "train" else labels[half_split(labels)[1]]
    return limit_positions(base, limit, "test")


def _check_val_from(val_from: str) -> None:
    if val_from not in VAL_FROM:
        raise ValueError(f"data.val_from: {val_from!r} is not one of {', '.join(VAL_FROM)}")


@dataclass(frozen=True)
class SplitPlan:
    """Which stored images play which role: ``train`` positions in the stored train split, ``val`` positions in
    the stored ``val_split`` ("train", or "test" under ``data.val_from: test_half``), ``test`` positions in the
    stored test split (None: all of it)."""

    val_from: str
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray | None

    @property
    def val_split(self) -> str:
        return "test" if self.val_from == "test_half" else "train"


def plan_splits(
    train_labels: Any, test_labels: Any, *, val_from: str = "train", val_size: int, fraction: float, seed: int,
    limit: Mapping[str, int | None] | None = None,
) -> SplitPlan:  # fmt: skip
    """The images of each role (:class:`SplitPlan`). ``val_from`` "train": :func:`train_val_indices`;
    "test_half": every training image (at ``fraction``, then ``limit``'s train cap), the validation half of the
    test split (:func:`half_split`, then ``limit``'s val cap) and its test half (:func:`positions_of_test`).
    ``val_size`` must then be 0: a validation set carved from training images too would contradict it."""
    _check_val_from(val_from)
    test_labels = _labels(test_labels)
    if val_from == "test_half" and val_size:
        raise ValueError(f"data.val_size: {val_size} carves validation from the training split; "
                         "data.val_from: test_half takes it from the test split (set data.val_size: 0)")  # fmt: skip
    train, val = train_val_indices(train_labels, val_size=val_size, fraction=fraction, seed=seed, limit=limit)
    if val_from == "test_half":
        val = _capped(half_split(test_labels)[0], test_labels, limit, "val")
    return SplitPlan(val_from, train, val, positions_of_test(test_labels, val_from=val_from, limit=limit))


def _class_counts(labels: np.ndarray) -> int | list[int]:
    """Images per class: one number when every class has as many, else [fewest, most]."""
    counts = np.unique(labels, return_counts=True)[1] if len(labels) else np.zeros(1, np.int64)
    lo, hi = int(counts.min()), int(counts.max())
    return lo if lo == hi else [lo, hi]


def split_roles(plan: SplitPlan, train_labels: Any, test_labels: Any) -> dict[str, Any]:
    """Which images play which role, for metrics and reports (:func:`roles_text`): per role (train, val, test)
    the stored split it comes from, its images, its images per class and the rule that chose them; the test
    role is also the source of the corrupted sets."""
    train_labels, test_labels = _labels(train_labels), _labels(test_labels)
    test = np.arange(len(test_labels)) if plan.test is None else plan.test
    val_labels = (test_labels if plan.val_split == "test" else train_labels)[plan.val]
    half = plan.val_from == "test_half"
    return {
        "val_from": plan.val_from,
        "train": _role("train", train_labels[plan.train],
                       "every training image" if half else "the training split less the validation images"),
        "val": _role(plan.val_split, val_labels,
                     HALF_RULE["val"] if half else "data.val_size images carved from the training split (seeded)"),
        "test": _test_rule(plan.val_from, test_labels[test]),
    }  # fmt: skip


def role_of_test(test_labels: Any, *, val_from: str = "train", limit: Mapping[str, int | None] | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """The test role of :func:`split_roles` (with ``val_from``), from the stored test split's labels alone: what
    the clean test accuracy and the corrupted sets are measured on."""
    test_labels = _labels(test_labels)
    keep = positions_of_test(test_labels, val_from=val_from, limit=limit)
    return {"val_from": val_from, **_test_rule(val_from, test_labels if keep is None else test_labels[keep])}


def _test_rule(val_from: str, labels: np.ndarray) -> dict[str, Any]:
    return _role("test", labels, HALF_RULE["test"] if val_from == "test_half" else "the whole test split")


def _role(split: str, labels: np.ndarray, rule: str) -> dict[str, Any]:
    return {"split": split, "images": len(labels), "per_class": _class_counts(labels), "rule": rule}


def _per_class(r: dict[str, Any]) -> str:
    n = r["per_class"]
    return f"{n:,} per class" if isinstance(n, int) else f"{n[0]:,}-{n[1]:,} per class"


def training_text(roles: dict[str, Any]) -> str:
    """The training role of :func:`split_roles` as a report prints it, e.g. "training: 50,000 training images
    (5,000 per class, every training image)"."""
    train = roles["train"]
    return f"training: {train['images']:,} training images ({_per_class(train)}, {train['rule']})"


def roles_text(roles: dict[str, Any]) -> str:
    """One line a report can print, e.g. "validation: 5,000 test images (500 per class, even ranks of each class
    in test-index order); test and corrupted sets: the other 5,000 test images (500 per class)"."""
    per_class = _per_class
    val, test = roles["val"], roles["test"]
    if roles["val_from"] == "test_half":
        return (f"validation: {val['images']:,} test images ({per_class(val)}, {val['rule']}); test and corrupted "
                f"sets: the other {test['images']:,} test images ({per_class(test)})")  # fmt: skip
    return (f"validation: {val['images']:,} training images ({per_class(val)}, carved from the training split); "
            f"test and corrupted sets: {test['images']:,} test images ({per_class(test)})")  # fmt: skip
