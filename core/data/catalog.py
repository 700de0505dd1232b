"""The datasets the importers know, as far as their names say: channels, classes and stored image size.

A table of plain values in a module that imports nothing but the standard library, so the configuration checks
``data.name`` (and a published benchmark against it) without loading the importers, numpy or torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetImages:
    """What a dataset's images are, as far as its name says (None: read from the files, an imagefolder's)."""

    channels: int | None
    num_classes: int | None
    image_size: int | None  # the stored images' side in pixels


DATASETS = {
    "fashion_mnist": DatasetImages(1, 10, 28),
    "cifar10": DatasetImages(3, 10, 32),
    "cifar100": DatasetImages(3, 100, 32),
    "imagefolder": DatasetImages(None, None, None),
}
