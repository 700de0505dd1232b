"""Corruption suites: constants per band, seeding, grayscale, fixes of the package's pitfalls, equivalence of
the fast paths with the package's own code, severity ordering, stored sets."""

from __future__ import annotations

import gzip
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
from scipy.ndimage import zoom as scizoom

from core.robustness import corruptions as C

FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _pkg():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import imagecorruptions
        import imagecorruptions.corruptions as pkg
    return imagecorruptions, pkg


@pytest.fixture(scope="module")
def fmnist() -> np.ndarray:
    """The first 32 Fashion-MNIST test images, uint8 [32, 28, 28, 1] (read from the raw IDX file)."""
    path = FMNIST / "t10k-images-idx3-ubyte.gz"
    if not path.is_file():
        pytest.skip("Fashion-MNIST IDX files not installed")
    with gzip.open(path) as f:
        return np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)[:32].copy()


def natural(size: int, n: int, seed: int = 0) -> np.ndarray:
    """n RGB crops of scikit-image's sample photographs, resized to size x size."""
    import skimage.data as data

    srcs = [data.astronaut(), data.chelsea(), data.coffee(), data.rocket(), data.immunohistochemistry()]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        im = srcs[i % len(srcs)]
        h, w = im.shape[:2]
        s = int(min(h, w) * rng.uniform(0.5, 1.0))
        y, x = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
        crop = np.ascontiguousarray(im[y : y + s, x : x + s, :3])
        out.append(cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA))
    return np.stack(out)


# ---------------------------------------------------------------------------------------------- tables


def test_names_and_categories_match_the_benchmark():
    assert len(C.CORRUPTIONS) == 19 and C.CORRUPTIONS[:3] == ("gaussian_noise", "shot_noise", "impulse_noise")
    assert len(C.BENCHMARK_CORRUPTIONS) == 15 and len(C.EXTRA_CORRUPTIONS) == 4
    assert C.EXTRA_CORRUPTIONS == ("speckle_noise", "gaussian_blur", "spatter", "saturate")
    assert C.CATEGORIES["weather"] == ("snow", "frost", "fog", "brightness")
    _, pkg_names = _pkg()[0], _pkg()[0].get_corruption_names("all")
    assert list(C.CORRUPTIONS) == pkg_names  # the package's order, too


def test_every_band_has_five_severities_for_all_19():
    for band, table in C.CONSTANTS.items():
        assert set(table) == set(C.CORRUPTIONS), band
        for name, values in table.items():
            assert len(values) == 5, (band, name)


# values typed from ROBUSTNESS.md / hendrycks/robustness make_*_c.py (an independent copy of the table)
@pytest.mark.parametrize(
    "band, name, expected",
    [
        ("cifar", "gaussian_noise", (0.04, 0.06, 0.08, 0.09, 0.10)),
        ("cifar", "shot_noise", (500, 250, 100, 75, 50)),
        ("cifar", "jpeg_compression", (80, 65, 58, 50, 40)),
        ("cifar", "pixelate", (0.95, 0.9, 0.85, 0.75, 0.65)),
        ("cifar", "contrast", (0.75, 0.5, 0.4, 0.3, 0.15)),
        ("cifar", "glass_blur", ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2))),
        ("cifar", "motion_blur", ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5))),
        ("cifar", "saturate", ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2))),
        ("tiny", "impulse_noise", (0.01, 0.02, 0.05, 0.08, 0.14)),
        ("tiny", "gaussian_blur", (0.5, 0.75, 1, 1.25, 1.5)),
        ("tiny", "fog", ((0.4, 3), (0.7, 3), (1, 2.5), (1.5, 2), (2, 1.75))),
        ("tiny", "saturate", ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (30, 0.2))),
        ("imagenet", "speckle_noise", (0.15, 0.2, 0.35, 0.45, 0.6)),
        ("imagenet", "defocus_blur", ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5))),
        ("imagenet", "jpeg_compression", (25, 18, 15, 10, 7)),
    ],
)
def test_constants_match_the_published_tables(band, name, expected):
    assert C.CONSTANTS[band][name] == expected


def test_imagenet_band_uses_the_package_constants():
    """The package hard-codes the ImageNet-C constants: read them back from its source."""
    import inspect

    _, pkg = _pkg()
    src = inspect.getsource(pkg.gaussian_noise) + inspect.getsource(pkg.shot_noise)
    assert "[.08, .12, 0.18, 0.26, 0.38]" in src and "[60, 25, 12, 5, 3]" in src
    assert C.CONSTANTS["imagenet"]["gaussian_noise"] == (0.08, 0.12, 0.18, 0.26, 0.38)
    assert C.CONSTANTS["imagenet"]["shot_noise"] == (60, 25, 12, 5, 3)


@pytest.mark.parametrize(
    "side, band", [(8, "cifar"), (28, "cifar"), (32, "cifar"), (45, "cifar"), (46, "tiny"), (64, "tiny"),
                   (119, "tiny"), (120, "imagenet"), (224, "imagenet"), (512, "imagenet")],
)  # fmt: skip
def test_band_thresholds(side, band):
    assert C.band_for_size(side, side) == band
    assert C.band_for_size(side, 8) == band  # the larger side decides


# ---------------------------------------------------------------------------------------------- API


@pytest.mark.parametrize("shape", [(28, 28), (28, 28, 1), (30, 26, 3)])
def test_shape_and_dtype_are_preserved(fmnist, shape):
    img = np.resize(fmnist[0], shape).astype(np.uint8)
    for name in C.CORRUPTIONS:
        out = C.corrupt(img, name, 3, seed=1, index=5)
        assert out.shape == img.shape and out.dtype == np.uint8, name


def test_bad_arguments_are_rejected(fmnist):
    with pytest.raises(ValueError, match="unknown corruption"):
        C.corrupt(fmnist[0], "rain", 1)
    with pytest.raises(ValueError, match="severity"):
        C.corrupt(fmnist[0], "fog", 6)
    with pytest.raises(TypeError, match="uint8"):
        C.corrupt(fmnist[0].astype(np.float32), "fog", 1)
    with pytest.raises(ValueError, match="8 px"):
        C.corrupt(np.zeros((6, 6), np.uint8), "fog", 1)


def test_batch_equals_one_image_at_a_time(fmnist):
    """Batched fast paths (stacked channels, per-image draws) give every image the bytes it gets alone."""
    rgb = natural(32, 3)
    for images in (fmnist[:5], rgb):
        idx = np.array([7, 3, 11, 0, 2])[: len(images)]
        for name in C.CORRUPTIONS:
            batch = C.corrupt_batch(images, name, 4, seed=9, indices=idx)
            alone = np.stack(
                [C.corrupt(images[i], name, 4, seed=9, index=int(idx[i])) for i in range(len(images))]
            )
            assert np.array_equal(batch, alone), name


# ---------------------------------------------------------------------------------------------- seeding


def test_seeding_is_per_seed_corruption_severity_and_index(fmnist):
    x = fmnist[:2]
    for name in ("gaussian_noise", "impulse_noise", "glass_blur", "frost", "fog", "elastic_transform"):
        a = C.corrupt_batch(x, name, 3, seed=0, indices=[0, 1])
        assert np.array_equal(a, C.corrupt_batch(x, name, 3, seed=0, indices=[0, 1])), name
        assert not np.array_equal(a, C.corrupt_batch(x, name, 3, seed=1, indices=[0, 1])), name
        assert not np.array_equal(a[1], C.corrupt(x[1], name, 3, seed=0, index=2)), name
    # the same image with the same index in two different corruptions draws different numbers
    assert C.image_seed(0, "fog", 3, 1) != C.image_seed(0, "snow", 3, 1) != C.image_seed(0, "fog", 4, 1)


def test_global_numpy_state_is_neither_used_nor_touched(fmnist):
    """glass_blur and impulse_noise ignore np.random.seed in the package; here nothing depends on it."""
    np.random.seed(123)
    state = np.random.get_state()[1].copy()
    outs = []
    for g in (1, 2):
        np.random.seed(g)
        outs.append([C.corrupt(fmnist[0], n, 2, seed=4) for n in C.CORRUPTIONS])
    for n, a, b in zip(C.CORRUPTIONS, *outs):
        assert np.array_equal(a, b), n
    np.random.seed(123)
    C.corrupt(fmnist[0], "fog", 2)
    assert np.array_equal(np.random.get_state()[1], state)


# ---------------------------------------------------------------------------------------------- equivalence


def test_motion_blur_equals_the_package(fmnist):
    _, pkg = _pkg()
    for angle in (-45.0, -17.3, 0.0, 30.2, 44.9):
        for radius, sigma in ((6, 1), (9, 2.5), (15, 8), (20, 15)):
            ref = pkg._motion_blur(fmnist[0], radius, sigma, angle)
            ours = C._motion_blur(fmnist[0].astype(np.float64), radius, sigma, angle)
            assert np.array_equal(ref, ours), (angle, radius)
            layer = fmnist[1][..., 0] / 255.0
            assert np.array_equal(
                pkg._motion_blur(layer, radius, sigma, angle), C._motion_blur(layer, radius, sigma, angle)
            )


@pytest.mark.slow  # compiles the package's numba kernel (3-10 s)
def test_glass_shuffle_equals_the_package_kernel():
    _, pkg = _pkg()
    rng = np.random.default_rng(0)
    for shape, c in (((28, 28, 1), (0.4, 1, 2)), ((32, 30, 3), (0.9, 2, 1)), ((20, 20, 1), (1.5, 4, 2))):
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        for seed in (0, 7, 123456):
            ref = pkg._shuffle_pixels_njit_glass_blur(shape[0], shape[1], x.copy(), c, seed)
            ours = C._glass_shuffle(x.copy(), c[1], c[2], seed)
            assert np.array_equal(ref, ours), (shape, seed)
            assert not np.array_equal(ours, x)


def _clipped_zoom_scipy(img: np.ndarray, z: float) -> np.ndarray:
    """The reference scripts' clipped_zoom (square images), with scipy's zoom."""
    h = img.shape[0]
    ch = int(np.ceil(h / z))
    top = (h - ch) // 2
    out = scizoom(img[top : top + ch, top : top + ch], (z, z, 1), order=1)
    trim = (out.shape[0] - h) // 2
    return out[trim : trim + h, trim : trim + h]


@pytest.mark.parametrize("size", [28, 32, 64])
def test_fast_clipped_zoom_matches_scipy(size):
    x = np.random.default_rng(size).random((size, size, 2)).astype(np.float32)
    for z in np.arange(1, 1.31, 0.01).tolist() + [1.75, 2.25, 4.5]:
        ref, ours = _clipped_zoom_scipy(x, z), C._clipped_zoom(x, z)
        assert ref.shape == ours.shape and np.abs(ref - ours).max() < 1e-5, z


def test_gaussian_matches_scipy_and_skimage():
    from scipy.ndimage import gaussian_filter
    from skimage.filters import gaussian

    x = np.random.default_rng(1).random((28, 28, 3))
    for sigma in (0.05, 0.4, 1.0, 2.5, 6.0):
        assert np.array_equal(C._gaussian(x, sigma), gaussian_filter(x, (sigma, sigma, 0), mode="nearest"))
        assert np.allclose(C._gaussian(x, sigma), gaussian(x, sigma=sigma, channel_axis=-1), atol=1e-12)
        y = x[..., 0].astype(np.float32)
        ref = gaussian_filter(y, sigma, mode="reflect", truncate=3)
        assert np.array_equal(C._gaussian2d(y, sigma, "reflect", 3), ref)


def test_plasma_fractal_matches_the_package():
    """Same uniforms in the same order -> the package's fog map (it works in float32)."""
    _, pkg = _pkg()
    for mapsize, decay in ((32, 3.0), (64, 1.75), (256, 1.4)):
        np.random.seed(5)
        ref = pkg.plasma_fractal(mapsize=mapsize, wibbledecay=decay)
        u = np.random.RandomState(5).random_sample(mapsize * mapsize - 1)
        ours = C._plasma_fractal(mapsize, decay, u[None])[0]
        assert np.allclose(ours, ref, atol=1e-5), mapsize


def test_saturate_gray_shortcut_equals_the_hsv_route(fmnist):
    import skimage.color

    x = fmnist[:3]
    for sev in C.SEVERITIES:
        p = C.CONSTANTS["cifar"]["saturate"][sev - 1]
        hsv = skimage.color.rgb2hsv(np.repeat(x / 255.0, 3, axis=3))
        hsv[..., 1] = np.clip(hsv[..., 1] * p[0] + p[1], 0, 1)
        ref = np.rint(np.clip(skimage.color.hsv2rgb(hsv) @ C.LUMA, 0, 1) * 255)[..., None]
        assert np.array_equal(C.corrupt_batch(x, "saturate", sev), ref.astype(np.uint8)), sev


# ---------------------------------------------------------------------------------------------- grayscale

# corruptions whose randomness is spatial (not per channel): gray in must equal the luma of the RGB result
_SPATIAL = [
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "gaussian_blur", "spatter", "saturate",
]  # fmt: skip


@pytest.mark.parametrize("name", _SPATIAL)
def test_grayscale_in_gives_luma_of_the_colour_result(fmnist, name):
    gray = fmnist[:4]
    rgb = np.repeat(gray, 3, axis=3)
    for sev in (1, 5):
        g = C.corrupt_batch(gray, name, sev, seed=2).astype(float)[..., 0]
        c = C.corrupt_batch(rgb, name, sev, seed=2).astype(float) @ C.LUMA
        # both paths round to integers: allow a level or two; where the colour path clipped a channel (frost
        # and spatter add colour) its luma differs by construction, so compare the unclipped pixels only
        rgb_out = C.corrupt_batch(rgb, name, sev, seed=2)
        inside = ((rgb_out > 0) & (rgb_out < 255)).all(axis=3) | (rgb_out.min(axis=3) == rgb_out.max(axis=3))
        diff = np.abs(g - c)[inside]
        assert inside.mean() > 0.5 and diff.max() <= 2.0 and diff.mean() <= 0.3, (name, sev, diff.max())


def test_grayscale_stays_one_channel_and_colour_corruptions_add_luma(fmnist):
    out = C.corrupt_batch(fmnist[:4], "spatter", 5, seed=0)
    assert out.shape == (4, 28, 28, 1)
    assert C.is_meaningful("saturate", 1) is False
    assert C.is_meaningful("saturate", 3) and C.is_meaningful("fog", 1)


# ---------------------------------------------------------------------------------------------- pitfalls


def test_spatter_without_liquid_returns_the_image_not_black(fmnist):
    x = fmnist[0]
    p = (0.65, 0.3, 4, 10.0, 0.6, 0)  # threshold 10: no liquid pixel can pass
    out = C._spatter(x, p, np.random.default_rng(0), C._Ctx("cifar", 28, True))
    assert np.array_equal(np.asarray(out, dtype=np.uint8), x)


def test_spatter_never_blackens_where_the_package_does():
    """The package divides by zero (all-black output) on some 32 px images; ours keeps them."""
    ic, pkg = _pkg()
    from PIL import Image

    x = natural(32, 1)[0]
    black_pkg = 0
    for i in range(200):
        np.random.seed(i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if np.uint8(pkg.spatter(Image.fromarray(x), 1)).max() == 0:
                black_pkg += 1
    assert black_pkg > 0  # the pitfall is real at 32 px ...
    ours = C.corrupt_batch(np.repeat(x[None], 200, 0), "spatter", 1, band="imagenet", indices=np.arange(200))
    assert (ours.reshape(200, -1).max(axis=1) > 0).all()  # ... and gone here (same constants)


def test_frost_textures_are_read_once_per_process(monkeypatch, fmnist):
    calls = []
    real = cv2.imread
    monkeypatch.setattr(cv2, "imread", lambda *a, **k: calls.append(a) or real(*a, **k))
    C._frost_files.cache_clear()
    C._frost_texture.cache_clear()
    for sev in C.SEVERITIES:
        C.corrupt_batch(fmnist[:10], "frost", sev)
    assert len(calls) == 6


# ---------------------------------------------------------------------------------------------- severities


def _changes(images: np.ndarray, name: str) -> list[float]:
    return [
        float(np.abs(C.corrupt_batch(images, name, s).astype(float) - images).mean()) for s in C.SEVERITIES
    ]


def _check_monotone(images: np.ndarray, band: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strict growth of the mean change for every corruption not in NON_MONOTONE[band]. Every severity draws
    the same random numbers here (common random numbers: the generator ignores the severity), so the
    ordering reflects the constants, not the luck of the draw."""
    from core.robustness import corruption_ops

    real = C.image_rng
    monkeypatch.setattr(
        corruption_ops, "image_rng", lambda seed, name, severity, index: real(seed, name, 0, index)
    )
    assert C.band_for_size(*images.shape[1:3]) == band
    for name in C.CORRUPTIONS:
        ch = _changes(images, name)
        if name in C.NON_MONOTONE[band]:
            assert ch[-1] > 0 or (name == "saturate" and images.shape[3] == 1), (name, ch)
        else:
            assert all(b > a for a, b in zip(ch, ch[1:])), (band, name, ch)


def test_change_grows_with_severity_cifar_band(fmnist, monkeypatch):
    _check_monotone(fmnist[:16], "cifar", monkeypatch)


def test_change_grows_with_severity_tiny_band(monkeypatch):
    _check_monotone(natural(64, 8), "tiny", monkeypatch)


def test_change_grows_with_severity_cifar_band_rgb(monkeypatch):
    _check_monotone(natural(32, 16), "cifar", monkeypatch)


@pytest.mark.slow
def test_change_grows_with_severity_imagenet_band(monkeypatch):
    _check_monotone(natural(224, 3), "imagenet", monkeypatch)


def _sharpness(im: np.ndarray) -> float:
    im = im.astype(float)
    return float(np.abs(np.diff(im, axis=0)).mean() + np.abs(np.diff(im, axis=1)).mean())


def test_severity_5_blurs_at_28px_are_not_flat(fmnist):
    """Contrast kept (std) and edges kept (mean gradient) -- where the package's 224 px constants leave a
    nearly flat image (checked for defocus, gaussian and motion blur, so the criterion can fail)."""
    x = fmnist[:8]
    for name in ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur", "gaussian_blur"):
        out = C.corrupt_batch(x, name, 5)
        std = np.mean([o.std() / c.std() for o, c in zip(out, x)])
        sharp = np.mean([_sharpness(o) / _sharpness(c) for o, c in zip(out, x)])
        assert std > 0.6 and sharp > 0.4, (name, std, sharp)
    _, pkg = _pkg()
    from PIL import Image

    for name in ("defocus_blur", "gaussian_blur", "motion_blur"):
        np.random.seed(0)
        naive = [np.uint8(getattr(pkg, name)(Image.fromarray(np.repeat(c, 3, 2)), 5))[..., 0] for c in x]
        std = np.mean([o.std() / c.std() for o, c in zip(naive, x)])
        assert std < 0.6, (name, std)


# ---------------------------------------------------------------------------------------------- sets


def test_select_indices_is_stratified_and_nested():
    labels = np.repeat(np.arange(4), [50, 30, 10, 40])[np.random.default_rng(0).permutation(130)]
    for n in (1, 7, 20, 39, 40, 100):
        idx = C.select_indices(labels, n)
        assert len(idx) == n == len(set(idx.tolist())) and np.all(np.diff(idx) > 0)
        counts = np.bincount(labels[idx], minlength=4)
        if n <= 40:  # every class still has images: counts differ by at most one
            assert counts.max() - counts.min() <= 1, (n, counts)
        assert set(C.select_indices(labels, max(1, n - 5)).tolist()) <= set(idx.tolist())
    assert np.array_equal(C.select_indices(labels, 5, "first"), np.arange(5))
    assert np.array_equal(C.select_indices(labels, 500), np.arange(130))


def test_set_roundtrip_and_validity(tmp_path, fmnist):
    x = C.corrupt_batch(fmnist[:6], "fog", 2, indices=np.arange(10, 16))
    labels, idx = np.arange(6) % 3, np.arange(10, 16)
    meta = C.set_meta("fog", 2, seed=0, band="cifar", image_shape=x.shape[1:], n=6, source="abc")
    path = C.write_set(C.set_path(tmp_path, "fog", 2), x, labels, idx, meta)
    assert path == tmp_path / "fog" / "2.parquet"
    got = C.read_set(path)
    assert np.array_equal(got.images, x) and np.array_equal(got.labels, labels)
    assert np.array_equal(got.indices, idx) and got.meta["category"] == "weather"
    assert C.set_is_valid(path, meta)
    assert not C.set_is_valid(path, {**meta, "seed": 1})
    assert not C.set_is_valid(tmp_path / "missing.parquet", meta)
    path.write_bytes(path.read_bytes()[:-40])  # truncated
    assert not C.set_is_valid(path, meta)
    with pytest.raises(ValueError, match="not a readable corrupted set"):
        C.read_set(path)
    assert [p.name for p in path.parent.iterdir()] == ["2.parquet"]  # no temp files left behind
    assert (
        C.set_meta("saturate", 1, seed=0, band="cifar", image_shape=(28, 28, 1), n=1, source="")["meaningful"]
        is False
    )


def test_iter_sets_in_process_matches_corrupt_batch(fmnist):
    pairs = [("shot_noise", 2), ("zoom_blur", 5), ("frost", 1)]
    idx = np.arange(100, 107)
    got = {
        (c, s): x for c, s, x in C.iter_sets(fmnist[:7], pairs, seed=3, indices=idx, workers=1, chunk_size=3)
    }
    assert set(got) == set(pairs)
    for c, s in pairs:
        assert np.array_equal(got[(c, s)], C.corrupt_batch(fmnist[:7], c, s, seed=3, indices=idx))
