"""The image filters the corruptions are built from (Hendrycks & Dietterich 2019, "Benchmarking neural network
robustness to common corruptions"): disks, plasma fractal, zoom, motion blur, glass shuffle, Gaussian filters,
HSV, frost textures -- the package's where they take no hidden global randomness
(core.robustness.corruption_funcs uses them).
"""

from __future__ import annotations

import importlib.resources
import math
import warnings
from functools import lru_cache
from typing import Any

import cv2
import numpy as np
from numba import njit
from scipy.ndimage import correlate1d

from core.robustness.corruption_tables import (
    LUMA,
)


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
    weights as scipy's zoom, faster (benchmarks/corruptions.py); values agree to ~1e-6 (tested against
    scipy). Works on non-square images (the package's version crops the top-left corner, the scripts' assume
    squares)."""
    y0, y1, fy, x0, x1, fx = _zoom_taps(x.shape[0], x.shape[1], float(zoom_factor))
    fy = fy.astype(x.dtype)[:, None, None]
    fx = fx.astype(x.dtype)[None, :, None]
    rows = x[y0] * (1 - fy) + x[y1] * fy
    return rows[:, x0] * (1 - fx) + rows[:, x1] * fx


def _motion_blur(x: np.ndarray, radius: int, sigma: float, angle: float) -> np.ndarray:
    """The package's ``_motion_blur`` (its numpy emulation of ImageMagick's one-sided motion blur): a sum of
    edge-clamped shifts along `angle` weighted by a half-Gaussian. Computed from one edge-padded copy by a
    compiled loop instead of two np.roll per tap; identical floats (same products, summed in the same tap
    order; tested), faster (benchmarks/corruptions.py)."""
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
