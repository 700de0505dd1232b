"""The constant tables of the corruption suite, one per resolution band (severity 1 -> 5), with the band rule
and the names: see core.robustness.corruptions for the whole story."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.robustness.suite import (  # the suite's names, defined once there
    BENCHMARK_CORRUPTIONS as BENCHMARK_CORRUPTIONS,
)
from core.robustness.suite import CATEGORIES as CATEGORIES
from core.robustness.suite import CATEGORY_OF as CATEGORY_OF
from core.robustness.suite import CORRUPTIONS as CORRUPTIONS
from core.robustness.suite import EXTRA_CORRUPTIONS as EXTRA_CORRUPTIONS
from core.robustness.suite import SEVERITIES as SEVERITIES

# ----------------------------------------------------------------------------------------------------------
# Names, categories, bands
# ----------------------------------------------------------------------------------------------------------

COLOUR_ONLY: frozenset[str] = frozenset({"saturate"})  # meaningless on grayscale data

BANDS: dict[str, int] = {"cifar": 32, "tiny": 64, "imagenet": 224}  # band -> nominal image side
BAND_MAX_SIDE: dict[str, int] = {"cifar": 45, "tiny": 119}  # largest side of each band; above: imagenet

LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R BT.601, as PIL's "L" conversion

#: Version of the generating code. Stored with every corrupted set; bump it whenever an output byte changes.
CORRUPTION_VERSION = "2"


def band_for_size(height: int, width: int) -> str:
    """The constant band for an image of this size (see the module docstring for the thresholds)."""
    side = max(int(height), int(width))
    if side <= BAND_MAX_SIDE["cifar"]:
        return "cifar"
    if side <= BAND_MAX_SIDE["tiny"]:
        return "tiny"
    return "imagenet"


def is_meaningful(corruption: str, channels: int) -> bool:
    """False for corruptions that only act on colour (saturate) applied to grayscale (1-channel) data."""
    _check_name(corruption)
    return not (channels == 1 and corruption in COLOUR_ONLY)


def _check_name(corruption: str) -> None:
    if corruption not in CATEGORY_OF:
        raise ValueError(f"unknown corruption {corruption!r}; choose from {list(CORRUPTIONS)}")


# ----------------------------------------------------------------------------------------------------------
# Constant tables (severity 1 -> 5), from hendrycks/robustness make_{cifar,tinyimagenet,imagenet}_c.py
# ----------------------------------------------------------------------------------------------------------

_IMAGENET: dict[str, tuple[Any, ...]] = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),  # (radius, alias blur)
    "glass_blur": ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)),  # (sigma, delta, iters)
    "motion_blur": ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15)),  # (radius, sigma)
    "zoom_blur": ((1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.02), (1, 1.26, 0.02), (1, 1.31, 0.03)),
    "snow": (
        (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
        (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
        (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
        (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
    ),
    "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),  # (image, texture) weights
    "fog": ((1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)),  # (strength, wibble decay)
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    # (alpha, sigma, affine) as fractions of the side (times 244/224, see _ELASTIC_SCALE)
    "elastic_transform": (
        (2, 0.7, 0.1),
        (2, 0.08, 0.2),
        (0.05, 0.01, 0.02),
        (0.07, 0.01, 0.02),
        (0.12, 0.01, 0.02),
    ),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "speckle_noise": (0.15, 0.2, 0.35, 0.45, 0.6),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "spatter": (
        (0.65, 0.3, 4, 0.69, 0.6, 0),
        (0.65, 0.3, 3, 0.68, 0.6, 0),
        (0.65, 0.3, 2, 0.68, 0.5, 0),
        (0.65, 0.3, 1, 0.65, 1.5, 1),
        (0.67, 0.4, 1, 0.65, 1.5, 1),
    ),
    "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
}

_TINY: dict[str, tuple[Any, ...]] = {
    "gaussian_noise": (0.04, 0.08, 0.12, 0.15, 0.18),
    "shot_noise": (250, 100, 50, 30, 15),
    "impulse_noise": (0.01, 0.02, 0.05, 0.08, 0.14),
    "defocus_blur": ((0.5, 0.6), (1, 0.1), (1.5, 0.1), (2.5, 0.01), (3, 0.1)),
    "glass_blur": ((0.1, 1, 1), (0.5, 1, 1), (0.6, 1, 2), (0.7, 2, 1), (0.9, 2, 2)),
    "motion_blur": ((10, 1), (10, 1.5), (10, 2), (10, 2.5), (12, 3)),
    "zoom_blur": ((1, 1.06, 0.01), (1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.01), (1, 1.26, 0.01)),
    "snow": (
        (0.1, 0.2, 1, 0.6, 8, 3, 0.8),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.8),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.7),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.65),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.6),
    ),
    "frost": ((1, 0.3), (0.9, 0.4), (0.8, 0.45), (0.75, 0.5), (0.7, 0.55)),
    "fog": ((0.4, 3), (0.7, 3), (1, 2.5), (1.5, 2), (2, 1.75)),
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "elastic_transform": (
        (0, 0, 0.08),
        (0.05, 0.3, 0.06),
        (0.1, 0.08, 0.06),
        (0.1, 0.03, 0.03),
        (0.16, 0.03, 0.02),
    ),
    "pixelate": (0.9, 0.8, 0.7, 0.6, 0.5),
    "jpeg_compression": (65, 58, 50, 40, 25),
    "speckle_noise": (0.15, 0.2, 0.25, 0.3, 0.35),
    "gaussian_blur": (0.5, 0.75, 1, 1.25, 1.5),
    "spatter": (
        (0.62, 0.1, 0.7, 0.7, 0.6, 0),
        (0.65, 0.1, 0.8, 0.7, 0.6, 0),
        (0.65, 0.3, 1, 0.69, 0.6, 0),
        (0.65, 0.1, 0.7, 0.68, 0.6, 1),
        (0.65, 0.1, 0.5, 0.67, 0.6, 1),
    ),
    "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (30, 0.2)),
}

_CIFAR: dict[str, tuple[Any, ...]] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
    "shot_noise": (500, 250, 100, 75, 50),
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),
    "zoom_blur": ((1, 1.06, 0.01), (1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.01), (1, 1.26, 0.01)),
    "snow": (
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ),
    "frost": ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)),
    "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),
    "elastic_transform": (
        (0, 0, 0.08),
        (0.05, 0.2, 0.07),
        (0.08, 0.06, 0.06),
        (0.1, 0.04, 0.05),
        (0.1, 0.03, 0.03),
    ),
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),
    "jpeg_compression": (80, 65, 58, 50, 40),
    "speckle_noise": (0.06, 0.1, 0.12, 0.16, 0.2),
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1),
    "spatter": (
        (0.62, 0.1, 0.7, 0.7, 0.5, 0),
        (0.65, 0.1, 0.8, 0.7, 0.5, 0),
        (0.65, 0.3, 1, 0.69, 0.5, 0),
        (0.65, 0.1, 0.7, 0.69, 0.6, 1),
        (0.65, 0.1, 0.5, 0.68, 0.6, 1),
    ),
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),
}

#: CONSTANTS[band][corruption][severity - 1]
CONSTANTS: dict[str, dict[str, tuple[Any, ...]]] = {"cifar": _CIFAR, "tiny": _TINY, "imagenet": _IMAGENET}
_FROST_SCALE = {"cifar": 0.2, "tiny": 0.3, "imagenet": 1.0}  # texture resize factor at the nominal size
#: How many of the package's frost textures (frost1.png ... frost6.jpg, in that order) each band draws from:
#: the cifar band follows make_cifar_c.py (``np.random.randint(5)``), the published CIFAR-10-C.
FROST_TEXTURES = {"cifar": 5, "tiny": 6, "imagenet": 6}
_ELASTIC_SCALE = {"cifar": 1.0, "tiny": 1.0, "imagenet": 244 / 224}  # ImageNet-C multiplies by 244, not 224

#: Where mean |corrupted - clean| need not grow strictly with severity, and why (the tests check every other
#: corruption of each band for strict growth on fixed images). Elsewhere the constants make it grow.
_FROST_WHY = (
    "the image weight falls while the frost weight rises (e.g. CIFAR severities 3-4: image 0.9 -> 0.85 at "
    "frost 0.4), so on bright images frost replaces more than it adds; and each image draws one of five or "
    "six textures of very different brightness, so means over a few images are not ordered"
)
_ELASTIC_WHY = (
    "each severity mixes a random affine jitter that shrinks (0.08 -> 0.03 of the side) with a smoothed "
    "displacement field that grows; the affine part dominates the pixel change, which falls with severity"
)
NON_MONOTONE: dict[str, dict[str, str]] = {
    "cifar": {
        "glass_blur": "severities 1-3 differ only in blur sigma (0.05-0.4) around the same one-pass pixel "
        "jitter, which dominates the change; severity 4 has a smaller sigma than 3 and two passes",
        "motion_blur": "severity 4 (radius 8, sigma 2) differs from 3 (radius 6, sigma 2) only by "
        "half-Gaussian taps beyond 6 px, of weight < 1e-9: the same blur up to the random angle",
        "frost": _FROST_WHY,
        "elastic_transform": _ELASTIC_WHY,
        "spatter": "severities 1-3 add translucent water, 4-5 opaque mud: two mechanisms, not one scale",
        "saturate": "severities 1-2 desaturate (x0.3, x0.1), 3-5 oversaturate; on gray images 1-3 change "
        "nothing",
    },
    "tiny": {
        "glass_blur": "severity 4 trades severity 3's second shuffle pass for a larger delta (2): about the "
        "same change",
        "frost": _FROST_WHY,
        "elastic_transform": _ELASTIC_WHY,
        "spatter": "severities 1-3 add translucent water, 4-5 opaque mud: two mechanisms, not one scale",
        "saturate": "severities 1-2 desaturate (x0.3, x0.1), 3-5 oversaturate",
    },
    "imagenet": {
        "glass_blur": "delta and passes alternate across severities (2/1/3/2/2 passes, delta 1-4)",
        "snow": "severity 2's flakes are small and dense, 3's large and sparse (AlexNet's error dips too)",
        "frost": _FROST_WHY,
        "fog": "severities 3 and 4 share strength 2.5; only the fractal's roughness (decay 1.7 -> 1.5) changes",
        "elastic_transform": "severities 1-2 use a large smooth field and affine (0.1-0.2 of the side), 3-5 a "
        "fine field with small affine: two regimes (AlexNet's error dips at 3 too)",
        "spatter": "severities 1-3 add translucent water, 4-5 opaque mud: two mechanisms, not one scale",
        "saturate": "severities 1-2 desaturate (x0.3, x0.1), 3-5 oversaturate",
    },
}
