"""Common-corruption suites (Hendrycks & Dietterich 2019) with one constant table per resolution band.

The T-CNN paper's robustness claim ([TCNN21], Table 2 and Fig. 3) is measured on ImageNet-C: 15 corruptions in
four categories, five severities each, plus four held-out "extra" corruptions. CIFAR-10-C and
Tiny-ImageNet-C are the same suite with constants re-tuned for 32 px and 64 px images. The pip package
``imagecorruptions`` hard-codes the 224 px constants, which are far too strong at 28-32 px (blurs and
pixelate turn images into flat colour, noise is 2-4x CIFAR-10-C's), so this module keeps the package's
algorithms and helpers (``disk``, ``_motion_blur``, the numba pixel shuffle of glass blur, ...) and feeds
them the constants of the band the image size falls into.

Resolution bands (chosen from ``max(height, width)``; thresholds are the geometric means of the nominal
sizes, sqrt(32*64) ~ 45 and sqrt(64*224) ~ 120):

==========  ==============  =====================  =================================================
band        nominal size    image side             constants from hendrycks/robustness
==========  ==============  =====================  =================================================
``cifar``   32              <= 45 px (MNIST: 28)   ``make_cifar_c.py`` (CIFAR-10-C)
``tiny``    64              46 .. 119 px           ``make_tinyimagenet_c.py`` (Tiny-ImageNet-C)
``imagenet``224             >= 120 px              ``make_imagenet_c.py`` (ImageNet-C)
==========  ==============  =====================  =================================================

Constants are applied as published, except the two that the reference scripts express relative to the
image size: elastic_transform's (alpha, sigma, affine) are fractions of the image side (the scripts'
``IMSIZE`` multiplier; ImageNet-C's 244/224 factor is kept), and frost's texture is resized by the band's
factor (CIFAR 0.2, Tiny 0.3, ImageNet 1.0) times ``side / nominal size``, so a 28 px image sees the same
frost pattern relative to its size as a 32 px CIFAR image.

Grayscale: an image with one channel (or a 2-D image) is corrupted on its single channel and comes back
with one channel. Corruptions that add colour (frost's texture, spatter's water/mud, saturate) contribute
their luma (ITU-R BT.601: 0.299 R + 0.587 G + 0.114 B). ``saturate`` changes only colour saturation and
is close to meaningless on grayscale data (severities 1-3 leave a gray image unchanged, 4-5 only darken
it): :func:`is_meaningful` returns False for it, the stored sets carry that flag and
:mod:`core.robustness` leaves such sets out of every summary.

Determinism: every image draws its randomness from its own generator, seeded from a stable hash
(BLAKE2b) of ``(seed, corruption, severity, image index)`` -- never Python's ``hash()``, never the global
NumPy state. glass_blur's numba shuffle and impulse_noise (which ignore ``np.random.seed``) get their
seeds from that generator too, so a corrupted set is byte-identical across processes, worker counts and
batch sizes (on the same NumPy/SciPy/OpenCV versions).

Other fixes of the package's pitfalls: frost textures are read once per process (cached); spatter's
division by zero when no liquid pixel passes its threshold (an all-black image in the package) yields the
uncorrupted image instead; glass_blur's numba kernel is compiled with ``cache=True`` (once per machine and
source version, then loaded in ~0.5 s) and loaded once per worker (:func:`warm_up`).

Where the package and the reference scripts differ, this module follows the scripts that made the public
sets: zoom_blur and snow zoom into the image centre (the package crops the top-left corner), pixelate
resamples with BOX both ways (the package upsamples with NEAREST), elastic_transform is the scripts'
affine + displacement-field version (the package's has another parameterisation). Frost picks among the
first five textures in the cifar band, as make_cifar_c.py does (``randint(5)``: the sixth, a dark and dense
one, is never drawn there), and among all six in the tiny and imagenet bands (:data:`FROST_TEXTURES`). Outputs are rounded to the nearest
integer (the scripts truncate with ``np.uint8``, which darkens every image by half a gray level and turns
exact no-ops into off-by-one changes).

Speed (Fashion-MNIST, 28 px, one core): ~0.12 ms per corrupted image averaged over the 19 x 5 sets, ~12x
faster than calling the package per image. Deterministic corruptions run on whole batches (stacked along
the channel axis), fog's fractal is vectorised over images, zoom is separable bilinear interpolation,
motion blur a compiled loop, Gaussian kernels are cached -- each checked against the package or scipy in
tests/test_corruptions.py. Generating with ``workers > 1`` spawns processes: call it under
``if __name__ == "__main__":`` in scripts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from functools import lru_cache
from io import BytesIO
from pathlib import Path
from typing import Any, NamedTuple

import cv2
import numpy as np
from numba import njit
from PIL import Image
from scipy.ndimage import correlate1d, map_coordinates

from core.robustness.suite import (  # the suite's names, defined once there and used by this module's callers
    BENCHMARK_CORRUPTIONS as BENCHMARK_CORRUPTIONS,
)
from core.robustness.suite import CATEGORIES as CATEGORIES
from core.robustness.suite import CATEGORY_OF as CATEGORY_OF
from core.robustness.suite import CORRUPTIONS as CORRUPTIONS
from core.robustness.suite import EXTRA_CORRUPTIONS as EXTRA_CORRUPTIONS
from core.robustness.suite import SEVERITIES as SEVERITIES
from core.utils.atomic import atomic_write

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

# ----------------------------------------------------------------------------------------------------------
# Seeding
# ----------------------------------------------------------------------------------------------------------

_tls = threading.local()


def image_seed(seed: int, corruption: str, severity: int, index: int) -> bytes:
    """32 stable bytes for one (seed, corruption, severity, image index): BLAKE2b, never Python's hash()."""
    key = f"tcnn-corruptions/{int(seed)}/{corruption}/{int(severity)}/{int(index)}".encode()
    return hashlib.blake2b(key, digest_size=32).digest()


def image_rng(seed: int, corruption: str, severity: int, index: int) -> np.random.Generator:
    """The generator of one image: a PCG64 whose 128-bit state and increment come from :func:`image_seed`.

    Setting the state directly costs ~3 us against ~25 us for a seeded Generator (SeedSequence) and
    ~350 us for a legacy RandomState, which matters at 10^6 images. The returned object is reused per
    thread: draw from it before asking for the next image's generator.
    """
    digest = image_seed(seed, corruption, severity, index)
    gen = getattr(_tls, "gen", None)
    if gen is None:
        gen = _tls.gen = np.random.Generator(np.random.PCG64(0))
    gen.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {
            "state": int.from_bytes(digest[:16], "little"),
            "inc": int.from_bytes(digest[16:], "little") | 1,
        },
        "has_uint32": 0,
        "uinteger": 0,
    }
    return gen


# ----------------------------------------------------------------------------------------------------------
# Helpers (the package's where they take no hidden global randomness)
# ----------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _package() -> Any:
    """imagecorruptions.corruptions, imported on first use (heavy: numba, skimage)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import imagecorruptions.corruptions as pkg  # noqa: PLC0415

    return pkg


@lru_cache(maxsize=64)
def _disk(radius: float, alias_blur: float) -> np.ndarray:
    """The package's anti-aliased disk kernel of defocus_blur, computed once per (radius, alias_blur)."""
    return _package().disk(radius=radius, alias_blur=alias_blur)


def _luma(x: np.ndarray) -> np.ndarray:
    """[..., 3] -> [..., 1]"""
    return (x[..., :3] @ LUMA)[..., None]


@lru_cache(maxsize=1)
def _frost_files() -> tuple[np.ndarray, ...]:
    """The package's six frost textures as RGB uint8, read once per process."""
    pkg = _package()
    out = []
    for name in ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg"):
        ref = importlib.resources.files(pkg.__package__) / "frost" / name
        with importlib.resources.as_file(ref) as path:
            bgr = cv2.imread(str(path))
        if bgr is None:
            raise FileNotFoundError(f"frost texture {name} missing from the imagecorruptions package")
        out.append(np.ascontiguousarray(bgr[..., ::-1]))
    return tuple(out)


@lru_cache(maxsize=64)
def _frost_texture(idx: int, scale: float, gray: bool) -> np.ndarray:
    """Texture `idx` resized by `scale` (cv2 bilinear, as the reference scripts), float64, RGB or luma."""
    tex = _frost_files()[idx]
    if scale != 1.0:
        tex = cv2.resize(tex, (0, 0), fx=scale, fy=scale)
    tex = tex.astype(np.float64)
    return _luma(tex) if gray else tex


def _plasma_fractal(mapsize: int, wibbledecay: float, u: np.ndarray) -> np.ndarray:
    """Diamond-square height maps in [0, 1], one per row of `u` ([N, mapsize**2 - 1] uniforms in [0, 1)).

    The package's ``plasma_fractal`` vectorised over a batch: it draws its wibble from the global NumPy
    state, here every image brings its own uniforms (drawn from its own generator), consumed in the
    package's order. All operations are elementwise per image, so a map does not depend on the batch.
    """
    n = u.shape[0]
    maparray = np.empty((n, mapsize, mapsize), dtype=np.float64)
    maparray[:, 0, 0] = 0
    stepsize = mapsize
    wibble = 100.0
    pos = 0

    def wibbled_mean(array: np.ndarray) -> np.ndarray:
        nonlocal pos
        k = array.shape[1] * array.shape[2]
        draws = u[:, pos : pos + k].reshape(array.shape)
        pos += k
        return array / 4 + wibble * (-wibble + (2 * wibble) * draws)  # uniform(-wibble, wibble)

    while stepsize >= 2:
        half = stepsize // 2
        # squares: centre = mean of the four corners + wibble
        corners = maparray[:, 0:mapsize:stepsize, 0:mapsize:stepsize]
        acc = corners + np.roll(corners, shift=-1, axis=1)
        acc += np.roll(acc, shift=-1, axis=2)
        maparray[:, half:mapsize:stepsize, half:mapsize:stepsize] = wibbled_mean(acc)
        # diamonds
        dr = maparray[:, half:mapsize:stepsize, half:mapsize:stepsize]
        ul = maparray[:, 0:mapsize:stepsize, 0:mapsize:stepsize]
        lt = (dr + np.roll(dr, 1, axis=1)) + (ul + np.roll(ul, -1, axis=2))
        maparray[:, 0:mapsize:stepsize, half:mapsize:stepsize] = wibbled_mean(lt)
        tt = (dr + np.roll(dr, 1, axis=2)) + (ul + np.roll(ul, -1, axis=1))
        maparray[:, half:mapsize:stepsize, 0:mapsize:stepsize] = wibbled_mean(tt)
        stepsize //= 2
        wibble /= wibbledecay
    assert pos == u.shape[1]
    maparray -= maparray.min(axis=(1, 2), keepdims=True)
    return maparray / maparray.max(axis=(1, 2), keepdims=True)


def _zoom_axis(length: int, zoom_factor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Linear-interpolation taps (i0, i1, frac) along one axis of the reference scripts' centred
    ``clipped_zoom``: crop ceil(L / z) around the centre, zoom by z as scipy.ndimage.zoom(order=1) does
    (output length round(crop * z), in = out * (crop - 1) / (out - 1)), trim back to L around the centre."""
    crop = int(np.ceil(length / zoom_factor))
    top = (length - crop) // 2
    out_len = int(round(crop * zoom_factor))
    trim = (out_len - length) // 2
    o = np.arange(trim, trim + length, dtype=np.float64)
    c = o * ((crop - 1) / (out_len - 1)) if out_len > 1 else np.zeros_like(o)
    i0 = np.minimum(np.floor(c).astype(np.int64), crop - 1)
    frac = c - i0
    i1 = np.minimum(i0 + 1, crop - 1)
    return top + i0, top + i1, frac


@lru_cache(maxsize=256)
def _zoom_taps(h: int, w: int, zoom_factor: float) -> tuple[np.ndarray, ...]:
    return (*_zoom_axis(h, zoom_factor), *_zoom_axis(w, zoom_factor))


def _clipped_zoom(x: np.ndarray, zoom_factor: float) -> np.ndarray:
    """The reference scripts' centred ``clipped_zoom`` (crop the centre, ``scipy.ndimage.zoom(order=1)``,
    trim back to H x W) as separable bilinear interpolation on [H, W, K]: the same sample positions and
    weights as scipy's zoom, ~20x faster at 28 px; values agree to ~1e-6 (tested against scipy). Works on
    non-square images (the package's version crops the top-left corner, the scripts' assume squares)."""
    y0, y1, fy, x0, x1, fx = _zoom_taps(x.shape[0], x.shape[1], float(zoom_factor))
    fy = fy.astype(x.dtype)[:, None, None]
    fx = fx.astype(x.dtype)[None, :, None]
    rows = x[y0] * (1 - fy) + x[y1] * fy
    return rows[:, x0] * (1 - fx) + rows[:, x1] * fx


def _motion_blur(x: np.ndarray, radius: int, sigma: float, angle: float) -> np.ndarray:
    """The package's ``_motion_blur`` (its numpy emulation of ImageMagick's one-sided motion blur): a sum of
    edge-clamped shifts along `angle` weighted by a half-Gaussian. Computed from one edge-padded copy by a
    compiled loop instead of two np.roll per tap; identical floats (same products, summed in the same tap
    order; tested), ~3x faster at 28 px."""
    width = 2 * radius + 1
    kernel = _package().getMotionBlurKernel(width, sigma)
    # numpy's sin/cos (as the package), then plain floats: the same IEEE doubles, faster scalar arithmetic
    py, px = float(width * np.sin(np.deg2rad(angle))), float(width * np.cos(np.deg2rad(angle)))
    hypot = math.hypot(py, px)
    h, w = x.shape[:2]
    shifts = []
    for i in range(width):
        dy = -math.ceil(((i * py) / hypot) - 0.5)
        dx = -math.ceil(((i * px) / hypot) - 0.5)
        if abs(dy) >= h or abs(dx) >= w:
            break  # simulated motion exceeded the image borders
        shifts.append((i, dy, dx))
    pad = max(max(abs(dy), abs(dx)) for _, dy, dx in shifts)
    x3 = x.reshape(h, w, -1).astype(np.float64, copy=False)
    xp = cv2.copyMakeBorder(x3, pad, pad, pad, pad, cv2.BORDER_REPLICATE).reshape(
        h + 2 * pad, w + 2 * pad, -1
    )
    taps = np.array([i for i, _, _ in shifts], dtype=np.int64)
    dys = np.array([dy for _, dy, _ in shifts], dtype=np.int64)
    dxs = np.array([dx for _, _, dx in shifts], dtype=np.int64)
    # the package starts from float32 zeros, which the first float64 term promotes to float64
    return _shift_accumulate(xp, pad, kernel[taps].astype(np.float64), dys, dxs).reshape(x.shape)


@njit(cache=True)
def _shift_accumulate(xp, pad, weights, dys, dxs):  # pragma: no cover - compiled
    """sum_t weights[t] * xp[pad - dys[t] + r, pad - dxs[t] + c]: the motion-blur taps, accumulated in tap
    order with one rounding per product and per sum, as the package's numpy loop does (tested equal)."""
    h, w, ch = xp.shape[0] - 2 * pad, xp.shape[1] - 2 * pad, xp.shape[2]
    out = np.empty((h, w, ch))
    oy = pad - dys
    ox = pad - dxs
    for r in range(h):
        for c in range(w):
            for z in range(ch):
                acc = 0.0
                for t in range(weights.shape[0]):
                    acc += weights[t] * xp[oy[t] + r, ox[t] + c, z]
                out[r, c, z] = acc
    return out


@njit(cache=True)
def _glass_shuffle(x, delta, iterations, seed):  # pragma: no cover - compiled
    """The package's ``_shuffle_pixels_njit_glass_blur`` (same code, same numba RNG stream; tested equal),
    compiled with ``cache=True`` so the ~3-10 s compile happens once per machine, not once per process.

    For every pixel from the bottom-right corner up, "swap" it with a neighbour at offset
    randint(-delta, delta) in each direction. On a 3-D array the tuple swap assigns through views, so it
    copies the neighbour onto the pixel (as in the reference RGB implementation) rather than swapping."""
    np.random.seed(seed)
    d0, d1 = x.shape[0], x.shape[1]
    for _ in range(iterations):
        for h in range(d0 - delta, delta, -1):
            for w in range(d1 - delta, delta, -1):
                dx, dy = np.random.randint(-delta, delta, size=(2,))
                h_prime, w_prime = h + dy, w + dx
                x[h, w], x[h_prime, w_prime] = x[h_prime, w_prime], x[h, w]
    return x


@lru_cache(maxsize=256)
def _gauss_weights(sigma: float, truncate: float) -> np.ndarray:
    """scipy.ndimage.gaussian_filter1d's kernel (order 0): exp(-x^2 / (2 sigma^2)) on
    x = -r..r, r = int(truncate * sigma + 0.5), normalised to sum 1 (same formula, same floats)."""
    radius = int(truncate * float(sigma) + 0.5)
    x = np.arange(-radius, radius + 1)
    phi = np.exp(-0.5 / (float(sigma) * float(sigma)) * x**2)
    return phi / phi.sum()


def _gaussian2d(x: np.ndarray, sigma: float, mode: str, truncate: float) -> np.ndarray:
    """scipy.ndimage.gaussian_filter(x, sigma) over the first two axes of x (identical floats: the same
    correlate1d calls with the same weights, which are cached instead of recomputed per image)."""
    if sigma <= 1e-15:
        return np.array(x, dtype=np.float64 if x.dtype.kind != "f" else x.dtype)
    weights = _gauss_weights(float(sigma), float(truncate))
    out = correlate1d(x, weights, axis=0, mode=mode)
    return correlate1d(out, weights, axis=1, mode=mode)


def _gaussian(x: np.ndarray, sigma: float) -> np.ndarray:
    """skimage.filters.gaussian(x, sigma, channel_axis=-1) on a float image [H, W, K]: the same scipy
    filtering (mode 'nearest', truncate 4, channel axis untouched) without skimage's per-call overhead;
    channels are independent."""
    return _gaussian2d(x, sigma, "nearest", 4.0)


def _rgb2hsv(x: np.ndarray) -> np.ndarray:
    import skimage.color  # noqa: PLC0415

    return skimage.color.rgb2hsv(x)


def _hsv2rgb(x: np.ndarray) -> np.ndarray:
    import skimage.color  # noqa: PLC0415

    return skimage.color.hsv2rgb(x)


# ----------------------------------------------------------------------------------------------------------
# The corruptions (internal: call them through corrupt / corrupt_batch). Each takes the uint8 image [H, W, C] (C = 1 or 3), its severity's constant `p`, the
# image's generator and a context (band, side), and returns values in [0, 255] (float or uint8).
# ----------------------------------------------------------------------------------------------------------


class _Ctx:
    __slots__ = ("band", "side", "gray")

    def __init__(self, band: str, side: int, gray: bool) -> None:
        self.band, self.side, self.gray = band, side, gray


def _f(img: np.ndarray) -> np.ndarray:
    return img / 255.0


def _gaussian_noise(img, p, rng, ctx):
    x = _f(img)
    return np.clip(x + rng.normal(size=x.shape, scale=p), 0, 1) * 255


def _shot_noise(img, p, rng, ctx):
    x = _f(img)
    return np.clip(rng.poisson(x * p) / float(p), 0, 1) * 255


def _impulse_noise(img, p, rng, ctx):
    import skimage.util  # noqa: PLC0415

    x = skimage.util.random_noise(_f(img), mode="s&p", rng=rng, amount=p)
    return np.clip(x, 0, 1) * 255


def _speckle_noise(img, p, rng, ctx):
    x = _f(img)
    return np.clip(x + x * rng.normal(size=x.shape, scale=p), 0, 1) * 255


def _defocus_blur(img, p, rng, ctx):
    x = _f(img)
    kernel = _disk(float(p[0]), float(p[1]))
    out = np.stack([cv2.filter2D(x[:, :, d], -1, kernel) for d in range(x.shape[2])], axis=-1)
    return np.clip(out, 0, 1) * 255


def _motion_blur_image(img, p, rng, ctx):
    angle = rng.uniform(-45, 45)
    return np.clip(_motion_blur(img.astype(np.float64), radius=p[0], sigma=p[1], angle=angle), 0, 255)


def _snow(img, p, rng, ctx):
    x = np.asarray(img, dtype=np.float32) / 255.0
    layer = rng.normal(size=x.shape[:2], loc=p[0], scale=p[1])
    layer = _clipped_zoom(layer[..., None], p[2])
    layer[layer < p[3]] = 0
    layer = np.clip(layer[..., 0], 0, 1)
    layer = _motion_blur(layer, radius=p[4], sigma=p[5], angle=rng.uniform(-135, -45))
    layer = (np.round(layer * 255).astype(np.uint8) / 255.0)[..., None]  # snow layer stored as 8 bit
    gray = x if x.shape[2] == 1 else cv2.cvtColor(x, cv2.COLOR_RGB2GRAY)[..., None]
    x = p[6] * x + (1 - p[6]) * np.maximum(x, gray * 1.5 + 0.5)
    return np.clip(x + layer + np.rot90(layer, k=2), 0, 1) * 255


def _frost(img, p, rng, ctx):
    h, w = img.shape[:2]
    idx = int(rng.integers(0, FROST_TEXTURES[ctx.band]))
    scale = _FROST_SCALE[ctx.band] * ctx.side / BANDS[ctx.band]
    tex = _frost_texture(idx, round(scale, 6), ctx.gray)
    top = int(rng.integers(0, tex.shape[0] - h))
    left = int(rng.integers(0, tex.shape[1] - w))
    crop = tex[top : top + h, left : left + w]
    return np.clip(p[0] * img + p[1] * crop, 0, 255)


def _pil(img: np.ndarray) -> Image.Image:
    return Image.fromarray(img[..., 0], mode="L") if img.shape[2] == 1 else Image.fromarray(img, mode="RGB")


def _from_pil(im: Image.Image, channels: int) -> np.ndarray:
    a = np.asarray(im)
    return a[..., None] if channels == 1 else a


def _jpeg_compression(img, p, rng, ctx):
    buf = BytesIO()
    _pil(img).save(buf, "JPEG", quality=p)
    buf.seek(0)
    return _from_pil(Image.open(buf), img.shape[2])


def _pixelate(img, p, rng, ctx):
    h, w = img.shape[:2]
    im = _pil(img).resize((int(w * p), int(h * p)), Image.BOX)
    return _from_pil(im.resize((w, h), Image.BOX), img.shape[2])  # BOX both ways, as the reference scripts


def _elastic_transform(img, p, rng, ctx):
    """The reference scripts' elastic transform (random affine + smoothed displacement field), whose
    constants the band tables hold; the package's own version has a different parameterisation."""
    size = min(img.shape[:2]) * _ELASTIC_SCALE[ctx.band]
    alpha, sigma, affine = p[0] * size, p[1] * size, p[2] * size
    x = np.asarray(img, dtype=np.float32) / 255.0
    h, w = x.shape[:2]
    center = np.float32((h, w)) // 2
    square = min(h, w) // 3
    pts1 = np.float32([center + square, [center[0] + square, center[1] - square], center - square])
    pts2 = pts1 + rng.uniform(-affine, affine, size=pts1.shape).astype(np.float32)
    m = cv2.getAffineTransform(pts1, pts2)
    x = cv2.warpAffine(x, m, (w, h), borderMode=cv2.BORDER_REFLECT_101)
    if x.ndim == 2:
        x = x[..., None]
    dx = (_gaussian2d(rng.uniform(-1, 1, size=(h, w)), sigma, "reflect", 3) * alpha).astype(np.float32)
    dy = (_gaussian2d(rng.uniform(-1, 1, size=(h, w)), sigma, "reflect", 3) * alpha).astype(np.float32)
    yy, xx = _grid(h, w)
    coords = [(yy + dy).ravel(), (xx + dx).ravel()]
    out = np.stack(
        [
            map_coordinates(x[..., c], coords, order=1, mode="reflect").reshape(h, w)
            for c in range(x.shape[2])
        ],
        axis=-1,
    )
    return np.clip(out, 0, 1) * 255


@lru_cache(maxsize=16)
def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    return np.meshgrid(np.arange(h), np.arange(w), indexing="ij")


_SPATTER_WATER = np.array([175, 238, 238]) / 255.0  # pale turquoise
_SPATTER_MUD = np.array([63, 42, 20]) / 255.0  # mud brown


def _spatter(img, p, rng, ctx):
    x = np.asarray(img, dtype=np.float32) / 255.0
    liquid = rng.normal(size=x.shape[:2], loc=p[0], scale=p[1])
    liquid = _gaussian2d(liquid, p[2], "nearest", 4.0)
    liquid[liquid < p[3]] = 0
    water = _luma(_SPATTER_WATER[None, None])[0, 0] if ctx.gray else _SPATTER_WATER
    mud = _luma(_SPATTER_MUD[None, None])[0, 0] if ctx.gray else _SPATTER_MUD
    if p[5] == 0:
        liquid = (liquid * 255).astype(np.uint8)
        dist = 255 - cv2.Canny(liquid, 50, 150)
        dist = cv2.distanceTransform(dist, cv2.DIST_L2, 5)
        _, dist = cv2.threshold(dist, 20, 20, cv2.THRESH_TRUNC)
        dist = cv2.blur(dist, (3, 3)).astype(np.uint8)
        dist = cv2.equalizeHist(dist)
        ker = np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]])
        dist = cv2.filter2D(dist, cv2.CV_8U, ker)
        dist = cv2.blur(dist, (3, 3)).astype(np.float32)
        m = liquid * dist
        peak = m.max()
        if peak <= 0:  # no liquid pixel passed the threshold: nothing to spatter (the package divides by 0)
            return img
        m = (m / peak * p[4])[..., None]
        return np.clip(x + m * water, 0, 1) * 255
    m = np.where(liquid > p[3], 1, 0).astype(np.float32)
    m = _gaussian2d(m, p[4], "nearest", 4.0)
    m[m < 0.8] = 0
    m = m[..., None]
    return np.clip(x * (1 - m) + mud * m, 0, 1) * 255


# Corruptions computed for a whole batch [N, H, W, C] at once. Random ones take `rng_for(i)`, the generator of
# the batch's i-th image, and draw each image's numbers from its own generator in a fixed order; all the
# arithmetic is elementwise per image (or per channel, with the images stacked along the channel axis), so
# an image gets the same floats whatever batch it is in (tested against batches of one).


def _stack(images: np.ndarray) -> np.ndarray:
    """[N, H, W, C] -> [H, W, N*C]"""
    n, h, w, c = images.shape
    return images.transpose(1, 2, 0, 3).reshape(h, w, n * c)


def _unstack(x: np.ndarray, n: int, c: int) -> np.ndarray:
    h, w = x.shape[:2]
    return x.reshape(h, w, n, c).transpose(2, 0, 1, 3)


def _zoom_blur_batch(images, p, ctx, rng_for):
    n, _, _, c = images.shape
    x = _stack(images).astype(np.float32) / np.float32(255.0)
    factors = np.arange(*p)
    out = np.zeros_like(x)
    for z in factors:
        out += _clipped_zoom(x, z)
    return _unstack(np.clip((x + out) / (len(factors) + 1), 0, 1) * 255, n, c)


def _glass_blur_batch(images, p, ctx, rng_for):
    n, _, _, c = images.shape
    sigma, delta, iters = p
    # blur, quantise to uint8 (truncating, as the package), shuffle pixels locally, blur again
    x = np.uint8(_gaussian(_stack(images) / 255.0, sigma) * 255)
    x = np.ascontiguousarray(_unstack(x, n, c))
    for i in range(n):
        seed = int(rng_for(i).integers(0, 2**31 - 1))
        # a 3-D array even for grayscale: x[h, w] is then a view, and the "swap" copies one pixel onto the
        # other exactly as it does on RGB images (a 2-D array would swap scalars instead)
        _glass_shuffle(x[i], int(delta), int(iters), seed)
    return _unstack(np.clip(_gaussian(_stack(x) / 255.0, sigma), 0, 1) * 255, n, c)


def _gaussian_blur_batch(images, p, ctx, rng_for):
    n, _, _, c = images.shape
    return _unstack(np.clip(_gaussian(_stack(images) / 255.0, p), 0, 1) * 255, n, c)


def _contrast_batch(images, p, ctx, rng_for):
    x = images / 255.0
    means = np.mean(x, axis=(1, 2), keepdims=True)
    return np.clip((x - means) * p + means, 0, 1) * 255


def _fog_batch(images, p, ctx, rng_for):
    n, h, w, _ = images.shape
    mapsize = 1 << (max(h, w) - 1).bit_length()
    u = np.stack([rng_for(i).random(mapsize * mapsize - 1) for i in range(n)])
    x = images / 255.0
    max_val = x.max(axis=(1, 2, 3), keepdims=True)
    x = x + p[0] * _plasma_fractal(mapsize, p[1], u)[:, :h, :w, None]
    return np.clip(x * max_val / (max_val + p[0]), 0, 1) * 255


def _brightness_batch(images, p, ctx, rng_for):
    x = images / 255.0
    if x.shape[3] == 1:  # V of a gray pixel is the pixel itself
        return np.clip(x + p, 0, 1) * 255
    x = _rgb2hsv(x)
    x[..., 2] = np.clip(x[..., 2] + p, 0, 1)
    return np.clip(_hsv2rgb(x), 0, 1) * 255


def _saturate_batch(images, p, ctx, rng_for):
    x = images / 255.0
    if x.shape[3] == 1:
        # a gray pixel has hue 0 and saturation 0 -> saturation s' = clip(p1); HSV -> RGB gives
        # (V, V (1 - s'), V (1 - s')), whose luma is V (0.299 + 0.701 (1 - s')) (tested against skimage)
        s_new = min(max(0.0 * p[0] + p[1], 0.0), 1.0)
        return np.clip(x * (LUMA[0] + (LUMA[1] + LUMA[2]) * (1 - s_new)), 0, 1) * 255
    hsv = _rgb2hsv(x)
    hsv[..., 1] = np.clip(hsv[..., 1] * p[0] + p[1], 0, 1)
    return np.clip(_hsv2rgb(hsv), 0, 1) * 255


_SUB_BATCH_PIXELS = 64 * 28 * 28  # values per sub-batch of the batched corruptions

_BATCH_FUNCS: dict[str, Callable[..., np.ndarray]] = {
    "zoom_blur": _zoom_blur_batch,
    "glass_blur": _glass_blur_batch,
    "gaussian_blur": _gaussian_blur_batch,
    "contrast": _contrast_batch,
    "fog": _fog_batch,
    "brightness": _brightness_batch,
    "saturate": _saturate_batch,
}

_FUNCS: dict[str, Callable[..., np.ndarray]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "defocus_blur": _defocus_blur,
    "motion_blur": _motion_blur_image,
    "snow": _snow,
    "frost": _frost,
    "elastic_transform": _elastic_transform,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
    "speckle_noise": _speckle_noise,
    "spatter": _spatter,
}
assert set(_FUNCS) | set(_BATCH_FUNCS) == set(CORRUPTIONS) and not set(_FUNCS) & set(_BATCH_FUNCS)


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------


def _as_hwc(image: np.ndarray) -> tuple[np.ndarray, bool]:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise TypeError(f"image: expected a uint8 numpy array, got {getattr(image, 'dtype', type(image))}")
    squeeze = image.ndim == 2
    if squeeze:
        image = image[..., None]
    if image.ndim != 3 or image.shape[2] not in (1, 3):
        raise ValueError(f"image: expected shape [H, W], [H, W, 1] or [H, W, 3], got {list(image.shape)}")
    if min(image.shape[:2]) < 8:
        raise ValueError(f"image: sides must be at least 8 px, got {list(image.shape[:2])}")
    return np.ascontiguousarray(image), squeeze


def _check(corruption: str, severity: int, band: str | None) -> None:
    _check_name(corruption)
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of 1..5, got {severity!r}")
    if band is not None and band not in BANDS:
        raise ValueError(f"unknown band {band!r}; choose from {list(BANDS)}")


def _to_uint8(out: np.ndarray) -> np.ndarray:
    if out.dtype == np.uint8:
        return out
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def corrupt(
    image: np.ndarray,
    corruption: str,
    severity: int,
    *,
    seed: int = 0,
    index: int = 0,
    band: str | None = None,
) -> np.ndarray:
    """One corrupted image: uint8 [H, W] | [H, W, 1] | [H, W, 3] in, the same shape and dtype out.

    The randomness is a pure function of (seed, corruption, severity, index); `band` defaults to
    :func:`band_for_size` of the image. Equal to ``corrupt_batch(image[None], ..., indices=[index])[0]``.
    """
    img, squeeze = _as_hwc(image)
    out = corrupt_batch(img[None], corruption, severity, seed=seed, indices=[index], band=band)[0]
    return out[..., 0] if squeeze else out


def corrupt_batch(
    images: np.ndarray,
    corruption: str,
    severity: int,
    *,
    seed: int = 0,
    indices: Sequence[int] | np.ndarray | None = None,
    band: str | None = None,
) -> np.ndarray:
    """Corrupt images [N, H, W, C] (uint8, C = 1 or 3); image i is seeded with ``indices[i]`` (default
    ``range(N)``). Image i of the output does not depend on the other images of the batch."""
    _check(corruption, severity, band)
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[3] not in (1, 3):
        raise ValueError(f"images: expected uint8 [N, H, W, 1|3], got {images.dtype} {list(images.shape)}")
    n, h, w, c = images.shape
    if min(h, w) < 8:
        raise ValueError(f"images: sides must be at least 8 px, got {[h, w]}")
    indices = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.shape != (n,):
        raise ValueError(f"indices: expected {n} image indices, got shape {list(indices.shape)}")
    band = band or band_for_size(h, w)
    ctx = _Ctx(band, min(h, w), c == 1)
    p = CONSTANTS[band][corruption][severity - 1]
    images = np.ascontiguousarray(images)

    def rng_for(i: int) -> np.random.Generator:
        return image_rng(seed, corruption, severity, int(indices[i]))

    batched = _BATCH_FUNCS.get(corruption)
    if batched is not None:
        # sub-batches small enough for the stacked float copies to stay in cache (zoom_blur at 28 px is
        # 3x slower on 1000-image stacks than on 64-image ones); images are independent, so this changes
        # no byte
        step = max(1, _SUB_BATCH_PIXELS // (h * w * c))
        out = np.empty_like(images)
        for a in range(0, n, step):
            out[a : a + step] = _to_uint8(
                batched(images[a : a + step], p, ctx, lambda i, a=a: rng_for(a + i))
            )
        return out
    fn = _FUNCS[corruption]
    out = np.empty_like(images)
    for i in range(n):
        out[i] = _to_uint8(fn(images[i], p, rng_for(i), ctx))
    return out


def warm_up() -> None:
    """Load what every worker needs once: the package, glass_blur's numba kernel (compiled on the first
    call ever and cached on disk, then loaded), the frost textures. Also pins OpenCV to one thread (the
    workers are the parallelism)."""
    cv2.setNumThreads(1)
    _package()
    _glass_shuffle(np.zeros((8, 8, 1), dtype=np.uint8), 1, 1, 0)
    _motion_blur(np.zeros((8, 8, 1)), 2, 1.0, 10.0)
    _frost_files()


# ----------------------------------------------------------------------------------------------------------
# Parallel generation of whole sets
# ----------------------------------------------------------------------------------------------------------

#: Rough relative cost per image (28 px, measured) used to start the slow sets first.
_COST = {
    "snow": 5,
    "elastic_transform": 4,
    "jpeg_compression": 3,
    "spatter": 3,
    "motion_blur": 3,
    "glass_blur": 2,
    "zoom_blur": 2,
    "defocus_blur": 2,
    "shot_noise": 2,
    "impulse_noise": 2,
}


def _work(task: tuple[np.ndarray, str, int, int, np.ndarray, str]) -> np.ndarray:
    images, corruption, severity, seed, indices, band = task
    return corrupt_batch(images, corruption, severity, seed=seed, indices=indices, band=band)


def _worker_init() -> None:
    warm_up()


_SINGLE_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def _ended_on_error(pool: ProcessPoolExecutor) -> Iterator[ProcessPoolExecutor]:
    """The pool, shut down normally on success; on any error or stop signal (or a generator closed early) its
    queued tasks are cancelled and its worker processes terminated, so none outlives the caller."""
    try:
        yield pool
    except BaseException:
        procs = list((getattr(pool, "_processes", None) or {}).values())  # no public API before Python 3.14
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.join(5)
        raise
    pool.shutdown(wait=True)


def iter_sets(
    images: np.ndarray,
    pairs: Iterable[tuple[str, int]],
    *,
    seed: int = 0,
    indices: Sequence[int] | np.ndarray | None = None,
    band: str | None = None,
    workers: int | None = None,
    chunk_size: int = 500,
    progress: bool = False,
) -> Iterator[tuple[str, int, np.ndarray]]:
    """Yield ``(corruption, severity, corrupted images)`` for every (corruption, severity) in `pairs`, each
    as soon as it is complete (in no fixed order).

    `images` is uint8 [N, H, W, C]; image i is seeded with ``indices[i]`` (default ``range(N)``; pass the
    images' indices in the full test set so a set's images do not depend on which subset was chosen). Work
    is split into chunks of `chunk_size` images spread over `workers` processes (default: all cores;
    1 = in this process), slow corruptions first; at most 2 chunks per worker are in flight, so memory stays
    bounded by the sets being assembled. Each worker loads the frost textures and the cached numba kernels
    once. The output does not depend on `workers` or `chunk_size`. Workers are spawned (not forked: safe
    after torch / OpenMP initialisation), so a calling script needs ``if __name__ == "__main__":``.
    """
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[3] not in (1, 3):
        raise ValueError(f"images: expected uint8 [N, H, W, 1|3], got {images.dtype} {list(images.shape)}")
    n = len(images)
    indices = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.shape != (n,):
        raise ValueError(f"indices: expected {n} image indices, got shape {list(indices.shape)}")
    pairs = list(dict.fromkeys((str(c), int(s)) for c, s in pairs))
    for c, s in pairs:
        _check(c, s, band)
    if n == 0 or not pairs:
        return
    band = band or band_for_size(*images.shape[1:3])
    workers = default_workers() if workers is None else max(1, int(workers))
    chunk_size = max(1, int(chunk_size))
    pairs.sort(key=lambda cs: -_COST.get(cs[0], 1))
    bounds = [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]
    tasks = [(c, s, a, b) for c, s in pairs for a, b in bounds]
    pending = {cs: len(bounds) for cs in pairs}
    buffers: dict[tuple[str, int], np.ndarray] = {}

    bar = None
    if progress:
        import sys  # noqa: PLC0415

        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(
            total=len(pairs) * n, unit="img", desc=f"corrupt ({workers} workers)", smoothing=0.05,
            mininterval=0.2 if sys.stderr.isatty() else 5.0,
        )  # fmt: skip

    def finish(c: str, s: int, a: int, b: int, out: np.ndarray) -> tuple[str, int, np.ndarray] | None:
        buf = buffers.get((c, s))
        if buf is None:
            buf = buffers[(c, s)] = np.empty_like(images)
        buf[a:b] = out
        if bar is not None:
            bar.update(b - a)
        pending[(c, s)] -= 1
        return (c, s, buffers.pop((c, s))) if pending[(c, s)] == 0 else None

    def task_args(c: str, s: int, a: int, b: int) -> tuple[np.ndarray, str, int, int, np.ndarray, str]:
        return images[a:b], c, s, seed, indices[a:b], band

    try:
        if workers == 1 or len(tasks) == 1:
            warm_up()
            for c, s, a, b in tasks:
                done = finish(c, s, a, b, _work(task_args(c, s, a, b)))
                if done is not None:
                    yield done
            return
        import multiprocessing as mp  # noqa: PLC0415

        warm_up()  # compiles and caches glass_blur's kernel here, once, before the workers load it

        # spawned workers inherit the environment: one BLAS/OpenMP thread each (the workers are the parallelism)
        saved = {k: os.environ.get(k) for k in _SINGLE_THREAD_ENV}
        os.environ.update({k: "1" for k in _SINGLE_THREAD_ENV})
        try:
            pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init)
            with _ended_on_error(pool):
                queue = iter(tasks)
                in_flight: dict[Any, tuple[str, int, int, int]] = {}

                def submit() -> None:
                    while len(in_flight) < 2 * workers:
                        task = next(queue, None)
                        if task is None:
                            return
                        in_flight[pool.submit(_work, task_args(*task))] = task

                submit()
                while in_flight:
                    finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        c, s, a, b = in_flight.pop(fut)
                        done = finish(c, s, a, b, fut.result())
                        if done is not None:
                            yield done
                    submit()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        if bar is not None:
            bar.close()


# ----------------------------------------------------------------------------------------------------------
# Stored sets: <dir>/<corruption>/<severity>.parquet (and <dir>/clean.parquet)
# ----------------------------------------------------------------------------------------------------------

SET_FORMAT = 3  # 3: the stored content's sha256 in the metadata, verified on every read
_META_KEY = b"tcnn.corrupted_set"


class StoredSet(NamedTuple):
    images: np.ndarray  # uint8 [N, H, W, C]
    labels: np.ndarray  # int64 [N]
    indices: np.ndarray  # int64 [N]: the images' indices in the source test split
    meta: dict[str, Any]


def set_path(root: str | os.PathLike, corruption: str, severity: int) -> Path:
    """<root>/<corruption>/<severity>.parquet, or <root>/clean.parquet for corruption "clean"."""
    if corruption == "clean":
        return Path(root) / "clean.parquet"
    return Path(root) / corruption / f"{int(severity)}.parquet"


def fingerprint(images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> str:
    """sha256 of the clean images, labels and indices a set was made from (detects a changed source)."""
    h = hashlib.sha256()
    images = np.ascontiguousarray(images, dtype=np.uint8)
    h.update(repr(list(images.shape)).encode())
    h.update(images.tobytes())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return h.hexdigest()


def set_meta(
    corruption: str,
    severity: int,
    *,
    seed: int,
    band: str,
    image_shape: Sequence[int],
    n: int,
    source: str,
) -> dict[str, Any]:
    """The metadata stored with (and checked against) a set; `source` is :func:`fingerprint` of the clean
    images. ``meaningful`` is False for saturate on grayscale images (left out of every summary)."""
    clean = corruption == "clean"
    if not clean:
        _check(corruption, severity, band)
    channels = int(image_shape[-1])
    return {
        "format": SET_FORMAT,
        "version": CORRUPTION_VERSION,
        "corruption": corruption,
        "severity": 0 if clean else int(severity),
        "category": "clean" if clean else CATEGORY_OF[corruption],
        "meaningful": True if clean else is_meaningful(corruption, channels),
        "band": band,
        "seed": int(seed),
        "image_shape": [int(v) for v in image_shape],
        "n": int(n),
        "source": source,
    }


def write_set(
    path: str | os.PathLike, images: np.ndarray, labels: np.ndarray, indices: np.ndarray, meta: dict[str, Any]
) -> Path:
    """Write one set as Parquet, atomically (temp file in the same directory, fsync, os.replace).

    Columns: ``index`` (int64, position in the source split), ``label`` (int64), ``image`` (fixed-size
    binary of H*W*C bytes, row-major HWC uint8, as the prepared data shards); `meta` is stored as JSON in
    the schema metadata. zstd, no dictionary (~40 ms per 10k 28 px images). The bytes depend only on the
    arguments, so two processes writing the same set produce identical files.
    """
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    images = np.ascontiguousarray(images, dtype=np.uint8)
    if images.ndim == 3:
        images = images[..., None]
    n = len(images)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if labels.shape != (n,) or indices.shape != (n,):
        raise ValueError(f"write_set: {n} images but {labels.size} labels and {indices.size} indices")
    per = int(np.prod(images.shape[1:]))
    image_col = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(per), n, [None, pa.py_buffer(images.reshape(-1))]
    )
    table = pa.table({"index": indices, "label": labels, "image": image_col})
    meta = {**meta, "image_shape": [int(v) for v in images.shape[1:]], "n": n,
            "sha256": content_digest(images, labels, indices)}  # fmt: skip
    table = table.replace_schema_metadata({_META_KEY: json.dumps(meta, sort_keys=True).encode()})
    return atomic_write(
        path,
        lambda fh: pq.write_table(
            table, fh, compression="zstd", use_dictionary=False, row_group_size=max(n, 1)
        ),
    )


def read_set_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """The stored metadata of a set, or None when the file is missing, truncated or not one of ours."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        md = pq.read_metadata(path)
        raw = (md.schema.to_arrow_schema().metadata or {}).get(_META_KEY)
        if raw is None:
            return None
        meta = json.loads(raw)
        if md.num_rows != meta.get("n"):
            return None
        return meta
    except (OSError, ValueError):
        return None


def content_digest(images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> str:
    """sha256 of a set's content as stored (uint8 images, int64 labels and indices), kept in its metadata and
    recomputed by :func:`read_set`: a damaged file is detected where it is read."""
    h = hashlib.sha256()
    for a in (
        np.ascontiguousarray(images, np.uint8),
        np.asarray(labels, np.int64),
        np.asarray(indices, np.int64),
    ):
        h.update(repr(list(a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def set_is_valid(path: str | os.PathLike, expected: dict[str, Any]) -> bool:
    """True when `path` holds a complete set whose metadata equals `expected` (see :func:`set_meta`) and
    whose content matches its stored sha256 (the whole file is read)."""
    meta = read_set_meta(path)
    if meta is None or any(meta.get(k) != v for k, v in expected.items()):
        return False
    try:
        read_set(path)
    except (OSError, ValueError):
        return False
    return True


def read_set(path: str | os.PathLike) -> StoredSet:
    """Read a set written by :func:`write_set` (clear error naming the file when missing or corrupt).

    ``images`` is a read-only view of the Arrow buffer (no copy); copy it before writing into it."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: corrupted set not found (run the corrupt stage)")
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {})[_META_KEY])
        shape = tuple(int(v) for v in meta["image_shape"])
        col = table.column("image").combine_chunks()
        per = int(np.prod(shape))
        if col.type != pa.binary(per) or col.null_count:
            raise ValueError(f"image column of type {col.type}, expected fixed_size_binary[{per}]")
        images = np.frombuffer(col.buffers()[1], np.uint8, count=len(col) * per, offset=col.offset * per)
        images = images.reshape((table.num_rows, *shape))
        labels = table.column("label").to_numpy().astype(np.int64)
        indices = table.column("index").to_numpy().astype(np.int64)
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: not a readable corrupted set ({type(err).__name__}: {err})") from None
    if "sha256" not in meta:
        raise ValueError(f"{path}: written without a checksum (an older version); rerun the corrupt stage")
    if content_digest(images, labels, indices) != meta["sha256"]:
        raise ValueError(f"{path}: checksum mismatch, the file is damaged; rerun the corrupt stage")
    return StoredSet(images, labels, indices, meta)


def select_indices(labels: np.ndarray, n: int, mode: str = "stratified") -> np.ndarray:
    """Which test images to corrupt: sorted indices of `n` images.

    "first": the first n. "stratified" (default): classes take turns in index order -- the r-th image of
    every class comes before the (r+1)-th of any -- so class counts differ by at most one while a class has
    images left, and the choice is a deterministic function of the labels (no RNG). Growing n keeps every
    previously chosen image.
    """
    labels = np.asarray(labels).reshape(-1)
    total = len(labels)
    if n <= 0:
        raise ValueError(f"n_images must be positive, got {n}")
    if n >= total:
        return np.arange(total)
    if mode == "first":
        return np.arange(n)
    if mode != "stratified":
        raise ValueError(f"unknown selection mode {mode!r} (stratified | first)")
    rank = np.empty(total, dtype=np.int64)
    for k in np.unique(labels):
        where = np.flatnonzero(labels == k)
        rank[where] = np.arange(len(where))
    order = np.lexsort((np.arange(total), rank))
    return np.sort(order[:n])
