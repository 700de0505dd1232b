"""What every model of a robustness comparison is evaluated on, and how: one clean test split, one test
resolution, one normalization, one batch size and one device for every model, so that each difference between
two models is paired image by image (core.robustness.intervals; [TCNN21] Fig. 3).

`Suite` names a family of corrupted sets (the corrupt stage's or a published benchmark's), `Bench` the clean
split and the evaluation options, `example_batch` the first clean images as the models see them (what the
fastest inference form is traced on, core.training.inference). The evaluate stage builds them from its params
(stages.robustness_bench).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Suite:
    """One family of corrupted sets every model is evaluated on: the corrupt stage's (``robustness.dir``) or a
    published benchmark (``robustness.public``, core.robustness.public_sets.PublicSets)."""

    name: str  # "generated" | the published kind
    source: Any  # a directory of stored sets, or a callable (corruption, severity) -> StoredSet
    corruptions: tuple[str, ...]
    severities: tuple[int, ...]


@dataclass(frozen=True)
class Bench:
    """What every model is evaluated on, and how: the full clean test split, at `Params.test_image_size`, with
    the normalization the models expect, in batches of ``robustness.batch_size``, on one device."""

    images: Any
    labels: Any
    manifest: dict[str, Any]
    size: int | None
    norm: dict[str, Any]
    batch_size: int
    device: torch.device
    #: Where the clean images sit in the split the corrupted sets index (a ``data.limit`` cap, sorted
    #: positions; core.data.capped_test_positions); None: they are all of it, in order.
    clean_index: Any = None

    def options(self) -> dict[str, Any]:
        """The options of core.robustness.evaluation's functions."""
        return {"mean": self.norm["mean"], "std": self.norm["std"], "device": self.device,
                "image_size": self.size}  # fmt: skip


def example_batch(images: Any, norm: dict[str, Any], size: int | None, n: int) -> torch.Tensor:
    """The first `n` clean images as the models see them (normalised, resized like count_correct does)."""
    x = torch.from_numpy(np.ascontiguousarray(images[:n])).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(norm["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(norm["std"], dtype=torch.float32).view(1, -1, 1, 1)
    x = (x - mean) / std
    if size is not None and tuple(x.shape[-2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.contiguous()
