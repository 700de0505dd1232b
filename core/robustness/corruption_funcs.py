"""The corruptions themselves (Hendrycks & Dietterich 2019, "Benchmarking neural network robustness to common
corruptions"), internal: call them through core.robustness.corruption_ops.corrupt / corrupt_batch.

Each per-image corruption takes the uint8 image [H, W, C] (C = 1 or 3), its severity's constant `p`, the
image's generator and a context (band, side), and returns values in [0, 255] (float or uint8). The batched
ones take the whole batch [N, H, W, C] and `rng_for(i)`, the generator of the batch's i-th image.
"""

from __future__ import annotations

from functools import lru_cache
from io import BytesIO

import cv2
import numpy as np
from PIL import Image
from scipy.ndimage import map_coordinates

from core.robustness.corruption_filters import (
    _clipped_zoom,
    _disk,
    _frost_texture,
    _gaussian,
    _gaussian2d,
    _glass_shuffle,
    _hsv2rgb,
    _luma,
    _motion_blur,
    _plasma_fractal,
    _rgb2hsv,
)
from core.robustness.corruption_tables import (
    _ELASTIC_SCALE,
    _FROST_SCALE,
    BANDS,
    FROST_TEXTURES,
    LUMA,
)


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
