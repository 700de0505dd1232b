"""Plumbing shared by the training stages: a prepared dataset split into train / val / test arrays, and
batch loaders over them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.data.loader import BatchLoader, Mixing
from core.data.shard_reader import load_labels, manifest_fingerprint, read_manifest, verify_split
from core.data.splits import load_splits, plan_splits, split_roles


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
    # streamed (data.stream): no arrays (the *_x are None); the shards, and the train / val positions in them
    stream_dir: Path | None = None
    train_idx: np.ndarray | None = None
    val_idx: np.ndarray | None = None  # positions in the stored `val_split`
    test_idx: np.ndarray | None = None  # None: the whole test split
    # where validation comes from (data.val_from: "test" for test_half), and which images play which role
    # (core.data.splits.split_roles; what metrics record)
    val_split: str = "train"
    roles: dict[str, Any] | None = None


def load_datasets(
    data_dir: str | os.PathLike, *, val_size: int, sample_fraction: float, seed: int,
    stream_size: int | None = None, limit: Mapping[str, int | None] | None = None, val_from: str = "train",
) -> Datasets:  # fmt: skip
    """Load a prepared dataset (core.data.load_splits): a class-balanced validation set carved out of the
    training split, a class-balanced `sample_fraction` of the rest ([ConViT21] Table 2), and the test split,
    each capped by `limit` (``data.limit``, core.data.splits.limit_positions) where it is set. `val_from`
    "test_half" (``data.val_from``): validation is the test split's fixed validation half, the test split its
    other half, and training uses every training image (core.data.splits.plan_splits).
    `stream_size` (an encoded dataset streamed at that resolution): only labels are read here, the same split
    is kept as positions, and the loaders decode per batch (core.data.stream).
    Errors are core.data.DataError / ValueError with one line naming the file or key."""
    if stream_size is not None:
        return _streamed(Path(data_dir), val_from, val_size, sample_fraction, seed, stream_size, limit)
    s = load_splits(data_dir, val_size=val_size, sample_fraction=sample_fraction, seed=seed, limit=limit,
                    val_from=val_from)  # fmt: skip
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
        fingerprint=manifest_fingerprint(s.manifest),
        val_split=s.plan.val_split,
        roles=s.roles,
    )


def _streamed(
    data_dir: Path, val_from: str, val_size: int, fraction: float, seed: int, size: int,
    limit: Mapping[str, int | None] | None,
) -> Datasets:  # fmt: skip
    manifest = read_manifest(data_dir)
    if manifest["image_encoding"] != "encoded":
        raise ValueError(
            f"data.stream: {data_dir} holds {manifest['image_encoding']!r} images, not encoded ones"
        )
    for split in ("train", "test"):
        verify_split(data_dir, split, manifest)  # once here; the loaders skip it
    labels = load_labels(data_dir, "train")
    test_y = load_labels(data_dir, "test")
    plan = plan_splits(labels, test_y, val_from=val_from, val_size=val_size, fraction=fraction, seed=seed,
                       limit=limit)  # fmt: skip
    tr, va, te = plan.train, plan.val, plan.test
    val_y = (test_y if plan.val_split == "test" else labels)[va]
    return Datasets(
        train_x=None, train_y=labels[tr], val_x=None, val_y=val_y, test_x=None,
        test_y=test_y if te is None else test_y[te], mean=[float(v) for v in manifest["mean"]],
        std=[float(v) for v in manifest["std"]], num_classes=int(manifest["num_classes"]),
        in_chans=1 if manifest.get("image_mode") == "L" else 3, image_size=int(size),
        fingerprint=manifest_fingerprint(manifest),
        stream_dir=data_dir, train_idx=tr, val_idx=va, test_idx=te, val_split=plan.val_split,
        roles=split_roles(plan, labels, test_y),
    )  # fmt: skip


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
    device: Any = None,
) -> Any:
    """A core.data.BatchLoader over `split` ("train", "val", "test"), or a StreamLoader for a streamed
    dataset; `image_size` None = native; `rank` of `world_size` data-parallel workers gets its shard of every
    (global) batch."""
    if ds.stream_dir is not None:
        return _stream_loader(ds, split, batch_size=batch_size, train=train, seed=seed, augment=augment,
                              image_size=image_size, num_workers=num_workers, rank=rank, world_size=world_size,
                              device=device)  # fmt: skip
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


def _stream_loader(ds: Datasets, split: str, *, augment: Any, num_workers: int, **kw: Any) -> Any:
    """StreamLoader over the streamed split (RandomResizedCrop + flip when training), with Mixup/CutMix on
    top when `augment` asks for them."""
    from core.data.stream import StreamLoader

    stored = {"train": "train", "val": ds.val_split, "test": "test"}[split]
    indices = {"train": ds.train_idx, "val": ds.val_idx, "test": ds.test_idx}[split]
    kw["image_size"] = kw["image_size"] or ds.image_size
    loader = StreamLoader(ds.stream_dir, stored, indices=indices, mean=ds.mean, std=ds.std, verify=False,
                          num_workers=num_workers, persistent_workers=num_workers > 0 and kw["train"],
                          **kw)  # fmt: skip  # eval loaders run once an epoch: their workers need not idle
    if kw["train"] and augment is not None and (augment.mixup > 0 or augment.cutmix > 0):
        return Mixing(loader, augment, ds.num_classes, kw["seed"])
    return loader
