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
source version) and loaded once per worker (:func:`warm_up`).

Where the package and the reference scripts differ, this module follows the scripts that made the public sets:
zoom_blur and snow zoom into the image centre (the package crops the top-left corner), pixelate resamples with
BOX both ways (the package upsamples with NEAREST), elastic_transform is the scripts' affine + displacement-
field version (the package's has another parameterisation). Frost picks among the first five textures in the
cifar band, as make_cifar_c.py does (``randint(5)``: the sixth, a dark and dense one, is never drawn there),
and among all six in the tiny and imagenet bands (:data:`FROST_TEXTURES`). Outputs are rounded to the nearest
integer (the scripts truncate with ``np.uint8``, which darkens every image by half a gray level and turns
exact no-ops into off-by-one changes).

Speed (benchmarks/corruptions.py measures it against the package called per image): deterministic corruptions
run on whole batches (stacked along the channel axis), fog's fractal is vectorised over images, zoom is
separable bilinear interpolation, motion blur a compiled loop, Gaussian kernels are cached -- each checked
against the package or scipy in tests/test_corruptions.py. Generating with ``workers > 1`` spawns processes:
call it under ``if __name__ == "__main__":`` in scripts.

Layout (one job per module; this one re-exports their public names, the import path every caller uses):
``corruption_tables`` (names, bands, constant tables), ``corruption_seeding`` (one generator per image),
``corruption_filters`` (the image filters), ``corruption_funcs`` (the corruptions), ``corruption_ops`` (the seeded
entry points ``corrupt`` / ``corrupt_batch``), ``corruption_sets`` (whole sets over a process pool: ``iter_sets``)
and ``corruption_store`` (the Parquet store: ``write_set`` / ``read_set``, checksums, ``select_indices``).
"""

from __future__ import annotations

from core.robustness.corruption_filters import (
    _clipped_zoom,
    _frost_files,
    _frost_texture,
    _gaussian,
    _gaussian2d,
    _glass_shuffle,
    _motion_blur,
    _plasma_fractal,
)
from core.robustness.corruption_funcs import _Ctx, _spatter
from core.robustness.corruption_ops import corrupt, corrupt_batch, warm_up
from core.robustness.corruption_seeding import image_rng, image_seed
from core.robustness.corruption_sets import default_workers, iter_sets
from core.robustness.corruption_store import (
    INDEX,
    SET_FORMAT,
    StoredSet,
    content_digest,
    fingerprint,
    read_set,
    read_set_meta,
    select_indices,
    set_is_valid,
    set_meta,
    set_path,
    write_set,
)
from core.robustness.corruption_tables import (
    _FROST_SCALE,
    BANDS,
    BENCHMARK_CORRUPTIONS,
    CATEGORIES,
    CATEGORY_OF,
    COLOUR_ONLY,
    CONSTANTS,
    CORRUPTION_VERSION,
    CORRUPTIONS,
    EXTRA_CORRUPTIONS,
    FROST_TEXTURES,
    LUMA,
    NON_MONOTONE,
    SEVERITIES,
    band_for_size,
    is_meaningful,
)

__all__ = [
    "INDEX",
    "BANDS", "BENCHMARK_CORRUPTIONS", "CATEGORIES", "CATEGORY_OF", "COLOUR_ONLY", "CONSTANTS", "CORRUPTIONS",
    "CORRUPTION_VERSION", "EXTRA_CORRUPTIONS", "FROST_TEXTURES", "LUMA", "NON_MONOTONE", "SET_FORMAT", "SEVERITIES",
    "StoredSet", "band_for_size", "content_digest", "corrupt", "corrupt_batch", "default_workers", "fingerprint",
    "image_rng", "image_seed", "is_meaningful", "iter_sets", "read_set", "read_set_meta", "select_indices",
    "set_is_valid", "set_meta", "set_path", "warm_up", "write_set",
    # internals the tests exercise directly
    "_Ctx", "_FROST_SCALE", "_clipped_zoom", "_frost_files", "_frost_texture", "_gaussian", "_gaussian2d", "_glass_shuffle",
    "_motion_blur", "_plasma_fractal", "_spatter",
]  # fmt: skip
