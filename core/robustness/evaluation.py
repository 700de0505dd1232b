"""Robustness evaluation: top-1 accuracy of a model on the clean images and on every stored corrupted set
(the counts the corruption-error metrics of Hendrycks & Dietterich 2019 are computed from; core.robustness.metrics).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from core.robustness.corruptions import CATEGORY_OF, StoredSet, read_set, set_path
from core.robustness.eval_table import TABLE_SCHEMA, per_image_table, table_row


def _normaliser(mean: Sequence[float], std: Sequence[float], channels: int, device: torch.device) -> tuple:
    m = torch.as_tensor(list(mean), dtype=torch.float32, device=device).reshape(1, -1, 1, 1)
    s = torch.as_tensor(list(std), dtype=torch.float32, device=device).reshape(1, -1, 1, 1)
    if m.shape[1] not in (1, channels) or s.shape[1] not in (1, channels):
        raise ValueError(f"mean/std have {m.shape[1]}/{s.shape[1]} entries for {channels}-channel images")
    return m, s


def _predicted(
    model: torch.nn.Module,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    mean: Sequence[float],
    std: Sequence[float],
    device: str | torch.device = "cpu",
    image_size: int | None = None,
    class_subset: Sequence[int] | np.ndarray | None = None,
) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """(top-1 predicted classes on `device`, labels) of each batch: the one forward pass of this module."""
    device = torch.device(device)
    model.eval()
    subset = None
    if class_subset is not None:
        subset = torch.as_tensor(np.asarray(class_subset, dtype=np.int64), device=device)
    norm = None
    for images, labels in batches:
        images = np.asarray(images)
        if images.ndim == 3:
            images = images[..., None]
        images = np.ascontiguousarray(images)
        if not images.flags.writeable:  # memory-mapped / Arrow-backed arrays
            images = images.copy()
        x = torch.from_numpy(images).to(device)
        x = x.permute(0, 3, 1, 2).float().div_(255.0)
        if norm is None:
            norm = _normaliser(mean, std, x.shape[1], device)
        x = (x - norm[0]) / norm[1]
        if image_size is not None and tuple(x.shape[-2:]) != (image_size, image_size):
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        logits = model(x)
        if subset is not None:
            yield subset[logits.index_select(1, subset).argmax(1)], np.asarray(labels, dtype=np.int64)
        else:
            yield logits.argmax(1), np.asarray(labels, dtype=np.int64)


@torch.inference_mode()
def correct_per_image(
    model: torch.nn.Module, batches: Iterable[tuple[np.ndarray, np.ndarray]], **options: Any
) -> np.ndarray:
    """Top-1 correctness (bool [N], in batch order) of `model` on batches of (uint8 images [B, H, W, C],
    int labels [B]).

    Images are scaled to [0, 1], normalised with the per-channel `mean`/`std` and, when `image_size` is
    given and differs, resized (bilinear). With `class_subset` (indices into the model's classes, e.g. the
    200 ImageNet-A classes in the 1000-class head) the prediction is the best class of the subset, as in
    the ImageNet-A/R evaluation; labels are then in the model's full class space.
    """
    out = [(pred == torch.as_tensor(y, device=pred.device)).cpu().numpy()
           for pred, y in _predicted(model, batches, **options)]  # fmt: skip
    return np.concatenate(out) if out else np.zeros(0, dtype=bool)


@torch.inference_mode()
def predictions(
    model: torch.nn.Module, batches: Iterable[tuple[np.ndarray, np.ndarray]], **options: Any
) -> np.ndarray:
    """The top-1 predicted class (int64 [N], in batch order) of `model` on the batches, computed exactly as
    :func:`correct_per_image` computes correctness (the same options)."""
    out = [pred.cpu().numpy() for pred, _ in _predicted(model, batches, **options)]
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


def count_correct(
    model: torch.nn.Module, batches: Iterable[tuple[np.ndarray, np.ndarray]], **kwargs: Any
) -> tuple[int, int]:
    """(top-1 correct, images) of `model` over the batches (see :func:`correct_per_image` for the options)."""
    correct = correct_per_image(model, batches, **kwargs)
    return int(correct.sum()), len(correct)


def array_batches(
    images: np.ndarray, labels: np.ndarray, batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(images, labels) in consecutive batches of ``batch_size``: how the evaluation feeds a set."""
    for a in range(0, len(images), batch_size):
        yield images[a : a + batch_size], labels[a : a + batch_size]


def evaluate_model(
    model: torch.nn.Module,
    clean: tuple[np.ndarray, np.ndarray],
    corrupted_dir: str | os.PathLike | Callable[[str, int], StoredSet],
    corruptions: Sequence[str],
    severities: Sequence[int],
    *,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 500,
    device: str | torch.device = "cpu",
    model_name: str = "model",
    image_size: int | None = None,
    per_image: bool = False,
    clean_index: np.ndarray | None = None,
) -> pa.Table | tuple[pa.Table, pa.Table]:
    """Top-1 accuracy of `model` on the clean images and on every stored corrupted set.

    `clean` is (uint8 images [N, H, W, C], labels [N]) -- image i has test index i, or ``clean_index[i]`` when
    the clean images are a cap of the split the sets index (``data.limit``; sorted); the sets are read from
    ``<corrupted_dir>/<corruption>/<severity>.parquet`` (written by the corrupt stage), or, when
    `corrupted_dir` is a callable, from ``corrupted_dir(corruption, severity)`` (e.g.
    :meth:`core.robustness.public_sets.PublicSets.load`). Returns a table with
    :data:`TABLE_SCHEMA`: a clean row (corruption "clean", severity 0) then one row per corruption x
    severity, with ``meaningful`` copied from the set (False: saturate on grayscale). Concatenate the tables
    of several models (``pa.concat_tables``) to compare them. With ``per_image``, also the correctness of
    every image (:data:`PER_IMAGE_SCHEMA`, rows keyed by the image's test index), what
    :func:`core.robustness.paired_bootstrap.bootstrap_metrics` resamples.
    """
    images, labels = clean
    if len(images) != len(labels):
        raise ValueError(f"clean: {len(images)} images but {len(labels)} labels")
    opts = {"mean": mean, "std": std, "device": device, "image_size": image_size}
    rows, parts = [], []
    correct = correct_per_image(model, array_batches(images, np.asarray(labels), batch_size), **opts)
    rows.append(table_row(model_name, "clean", 0, int(correct.sum()), len(correct), True))
    parts.append(("clean", 0, np.arange(len(correct)), correct))
    for c in corruptions:
        if c not in CATEGORY_OF:
            raise ValueError(f"unknown corruption {c!r}")
        for s in severities:
            stored = (
                corrupted_dir(c, s) if callable(corrupted_dir) else read_set(set_path(corrupted_dir, c, s))
            )
            correct = correct_per_image(
                model, array_batches(stored.images, stored.labels, batch_size), **opts
            )
            meaningful = bool(stored.meta.get("meaningful", True))
            rows.append(table_row(model_name, c, int(s), int(correct.sum()), len(correct), meaningful))
            parts.append((c, int(s), _clean_positions(stored.indices, clean_index, c, s), correct))
    table = pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)
    if not per_image:
        return table
    return table, per_image_table(model_name, parts)


def _clean_positions(indices: np.ndarray, clean_index: np.ndarray | None, c: str, s: int) -> np.ndarray:
    """The positions among the clean images of a set's images (their test indices): the indices themselves,
    or where they sit in ``clean_index``; a corrupted image whose original is not among them is an error (the
    paired bootstrap would pair it with another image)."""
    if clean_index is None:
        return np.asarray(indices)
    pos = np.searchsorted(clean_index, indices)
    inside = pos < len(clean_index)
    if not inside.all() or not np.array_equal(clean_index[pos], indices):
        raise ValueError(f"{c}/{s}: corrupted images whose clean originals are not in the capped test split")
    return pos
