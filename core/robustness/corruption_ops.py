"""The corruption algorithms: per-image and batched functions, seeded per (seed, corruption, severity, image),
and the entry points `corrupt` / `corrupt_batch` (see core.robustness.corruptions)."""

from __future__ import annotations

import hashlib
import importlib.resources
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from io import BytesIO
from typing import Any

import cv2
import numpy as np
from numba import njit
from PIL import Image
from scipy.ndimage import correlate1d, map_coordinates

from core.robustness.corruption_tables import (
    _ELASTIC_SCALE,
    _FROST_SCALE,
    BANDS,
    CONSTANTS,
    CORRUPTIONS,
    FROST_TEXTURES,
    LUMA,
    SEVERITIES,
    _check_name,
    band_for_size,
)

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
