"""Plumbing shared by the training stages: a prepared dataset split into train / val / test arrays, and
batch loaders over them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from core.data.loader import BatchLoader
from core.data.splits import load_splits
from core.utils.hashing import stable_hash


@dataclass
class Datasets:
    """Train / validation / test arrays of a prepared dataset, split per the project protocol."""

    train_x: Any
    train_y: Any
    val_x: Any
    val_y: Any
    test_x: Any
    test_y: Any
    mean: list[float]
    std: list[float]
    num_classes: int
    in_chans: int
    image_size: int
    fingerprint: str  # hash of manifest.json (which holds every shard's sha256)


def load_datasets(
    data_dir: str | os.PathLike, *, val_size: int, sample_fraction: float, seed: int
) -> Datasets:
    """Load a prepared dataset (core.data.load_splits): a class-balanced validation set carved out of the
    training split, a class-balanced `sample_fraction` of the rest (001 Table 2), and the test split.
    Errors are core.data.DataError / ValueError with one line naming the file or key."""
    s = load_splits(data_dir, val_size=val_size, sample_fraction=sample_fraction, seed=seed)
    h, _, c = s.manifest["image_shape"]
    return Datasets(
        train_x=s.train[0],
        train_y=s.train[1],
        val_x=s.val[0],
        val_y=s.val[1],
        test_x=s.test[0],
        test_y=s.test[1],
        mean=[float(v) for v in s.manifest["mean"]],
        std=[float(v) for v in s.manifest["std"]],
        num_classes=int(s.manifest["num_classes"]),
        in_chans=int(c),
        image_size=int(h),
        fingerprint=stable_hash({k: v for k, v in s.manifest.items() if k != "source"}),
    )


def make_loader(
    ds: Datasets,
    split: str,
    *,
    batch_size: int,
    train: bool,
    seed: int,
    augment: Any = None,
    image_size: int | None = None,
    num_workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Any:
    """A core.data.BatchLoader over `split` ("train", "val", "test"); `image_size` None = native; `rank` of
    `world_size` data-parallel workers gets its shard of every (global) batch."""
    x, y = getattr(ds, f"{split}_x"), getattr(ds, f"{split}_y")
    return BatchLoader(
        x,
        y,
        batch_size=batch_size,
        train=train,
        seed=seed,
        mean=ds.mean,
        std=ds.std,
        augment=augment if train else None,
        image_size=None if image_size in (None, ds.image_size) else image_size,
        num_workers=num_workers,
        num_classes=ds.num_classes,
        rank=rank,
        world_size=world_size,
    )


def first_batch(loader: Any, n: int) -> torch.Tensor:
    """The first `n` inputs of an evaluation loader (a fixed probe batch)."""
    xs, have = [], 0
    for x, _ in loader.batches(0):
        xs.append(x)
        have += x.shape[0]
        if have >= n:
            break
    return torch.cat(xs)[:n] if xs else torch.empty(0)
