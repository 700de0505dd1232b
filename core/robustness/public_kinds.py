"""The published corruption benchmarks the project reads, as far as their names say: layout, channels, classes
and stored size ([Hendrycks19]: CIFAR-10-C, CIFAR-100-C, ImageNet-C, Tiny-ImageNet-C).

Plain values in a module that imports nothing but the standard library, so the configuration checks
``robustness.public.kind`` against the dataset without loading the readers (`core.robustness.public_sets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PublicKind:
    """A published benchmark's layout and images (Hendrycks & Dietterich 2019: CIFAR-10-C and CIFAR-100-C are
    32 px RGB arrays; ImageNet-C and Tiny-ImageNet-C are trees of RGB JPEGs, resized here)."""

    layout: Literal["npy", "tree"]
    channels: int
    num_classes: int
    image_size: int | None  # the stored arrays' side; None for a tree (images resized and cropped on reading)


PUBLIC_KINDS = {
    "cifar10_c": PublicKind("npy", 3, 10, 32),
    "cifar100_c": PublicKind("npy", 3, 100, 32),
    "imagenet_c": PublicKind("tree", 3, 1000, None),
    "tiny_imagenet_c": PublicKind("tree", 3, 200, None),
}
