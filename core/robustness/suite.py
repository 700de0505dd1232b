"""The common-corruption suite's names (Hendrycks & Dietterich 2019): 15 benchmark corruptions in four
categories plus 4 held-out extras, five severities. Plain Python, so the config can validate names without
loading the corruption code (OpenCV, numba, SciPy)."""

from __future__ import annotations

CATEGORIES: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
    "extra": ("speckle_noise", "gaussian_blur", "spatter", "saturate"),
}
CORRUPTIONS: tuple[str, ...] = tuple(c for cs in CATEGORIES.values() for c in cs)
BENCHMARK_CORRUPTIONS: tuple[str, ...] = CORRUPTIONS[:15]  # the 15 that enter mCE
EXTRA_CORRUPTIONS: tuple[str, ...] = CORRUPTIONS[15:]  # held out; reported separately
CATEGORY_OF: dict[str, str] = {c: cat for cat, cs in CATEGORIES.items() for c in cs}
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
