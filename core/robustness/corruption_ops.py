"""The entry points of the corruption algorithms, `corrupt` / `corrupt_batch` (see core.robustness.corruptions):
each image seeded per (seed, corruption, severity, image) (core.robustness.corruption_seeding), dispatched to the
per-image or batched function of its corruption (core.robustness.corruption_funcs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import cv2
import numpy as np

from core.robustness.corruption_filters import _frost_files, _glass_shuffle, _motion_blur, _package
from core.robustness.corruption_funcs import (
    _brightness_batch,
    _contrast_batch,
    _Ctx,
    _defocus_blur,
    _elastic_transform,
    _fog_batch,
    _frost,
    _gaussian_blur_batch,
    _gaussian_noise,
    _glass_blur_batch,
    _impulse_noise,
    _jpeg_compression,
    _motion_blur_image,
    _pixelate,
    _saturate_batch,
    _shot_noise,
    _snow,
    _spatter,
    _speckle_noise,
    _zoom_blur_batch,
)
from core.robustness.corruption_seeding import image_rng
from core.robustness.corruption_tables import (
    BANDS,
    CONSTANTS,
    CORRUPTIONS,
    SEVERITIES,
    _check_name,
    band_for_size,
)

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


def check_setting(corruption: str, severity: int, band: str | None) -> None:
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
    check_setting(corruption, severity, band)
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
        # sub-batches small enough for the stacked float copies to stay in cache (zoom_blur slows down on
        # large stacks); images are independent, so this changes no byte
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
