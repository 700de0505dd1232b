"""Robustness figures (matplotlib, Agg backend): [TCNN21] Fig. 3-style gains with intervals and corruption contact
sheets.

Both functions write their PNG atomically (temporary file in the same directory, fsync, os.replace).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

from core.utils.atomic import atomic_write

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from core.robustness.corruptions import CATEGORIES, CORRUPTIONS, SEVERITIES  # noqa: E402


def save_png(fig: Any, path: Path, dpi: int) -> Path:
    """Write ``fig`` as a PNG atomically and close it."""
    try:
        return atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=dpi))
    finally:
        plt.close(fig)


class _Tiles(NamedTuple):
    """The sheet's geometry: tiles of ``th`` x ``tw`` px (the image upscaled ``scale`` times), ``cols`` per
    example image (clean, then each severity), ``gap`` px between tiles and ``group_gap`` more between the
    example images' groups."""

    scale: int
    th: int
    tw: int
    cols: int
    gap: int = 2
    group_gap: int = 10

    def x(self, group: int, col: int) -> int:
        """Left edge of tile `col` of example image `group`."""
        return group * (self.cols * (self.tw + self.gap) + self.group_gap) + col * (self.tw + self.gap)

    def y(self, row: int) -> int:
        """Top edge of the tiles of row `row` (one corruption)."""
        return row * (self.th + self.gap)


def _shown(
    sets: Mapping[tuple[str, int], np.ndarray],
    corruptions: Sequence[str] | None,
    severities: Sequence[int] | None,
) -> tuple[Sequence[str], Sequence[int]]:
    """The rows and severities to show: by default every corruption with a set (benchmark order) and every
    severity any of them has."""
    if corruptions is None:
        corruptions = [x for x in CORRUPTIONS if any((x, s) in sets for s in SEVERITIES)]
    if severities is None:
        severities = sorted({s for (x, s) in sets if x in corruptions})
    if not corruptions or not severities:
        raise ValueError("contact_sheet: no corrupted sets to show")
    return corruptions, severities


def _mosaic(
    clean: np.ndarray,
    sets: Mapping[tuple[str, int], np.ndarray],
    corruptions: Sequence[str],
    severities: Sequence[int],
    tiles: _Tiles,
) -> np.ndarray:
    """The sheet's pixels, uint8 RGB on white: nearest-neighbour upscaled tiles (grayscale repeated to RGB);
    a missing set leaves its tiles white."""
    k = len(clean)
    width = k * tiles.cols * (tiles.tw + tiles.gap) + (k - 1) * tiles.group_gap
    height = len(corruptions) * (tiles.th + tiles.gap)
    mosaic = np.full((height, width, 3), 255, dtype=np.uint8)

    def put(img: np.ndarray, row: int, col: int, group: int) -> None:
        img = np.repeat(np.repeat(img, tiles.scale, axis=0), tiles.scale, axis=1)
        if img.shape[2] == 1:
            img = np.repeat(img, 3, axis=2)
        y, x = tiles.y(row), tiles.x(group, col)
        mosaic[y : y + tiles.th, x : x + tiles.tw] = img

    for r, name in enumerate(corruptions):
        for g in range(k):
            put(clean[g], r, 0, g)
            for j, s in enumerate(severities):
                imgs = sets.get((name, s))
                if imgs is not None:
                    im = np.asarray(imgs)[g]
                    put(im if im.ndim == 3 else im[..., None], r, j + 1, g)
    return mosaic


def _sheet_figure(
    mosaic: np.ndarray,
    tiles: _Tiles,
    k: int,
    corruptions: Sequence[str],
    severities: Sequence[int],
    title: str | None,
    dpi: int,
) -> Any:
    """The mosaic at one figure pixel per mosaic pixel, on a fixed 0..255 scale, corruption names on the left
    and "clean" / severity labels on top of each example image's tiles."""
    height, width = mosaic.shape[:2]
    left, top = 1.6, 0.5 if title is None else 0.8
    fig = plt.figure(figsize=(width / dpi + left + 0.2, height / dpi + top + 0.2), dpi=dpi)
    ax = fig.add_axes(
        (left / fig.get_figwidth(), 0.2 / fig.get_figheight(), width / dpi / fig.get_figwidth(),
         height / dpi / fig.get_figheight())
    )  # fmt: skip
    ax.imshow(mosaic, interpolation="nearest", vmin=0, vmax=255)
    ax.set_yticks([tiles.y(r) + tiles.th / 2 for r in range(len(corruptions))], list(corruptions), fontsize=9)
    xticks, xlabels = [], []
    for g in range(k):
        for j, lab in enumerate(["clean", *[str(s) for s in severities]]):
            xticks.append(tiles.x(g, j) + tiles.tw / 2)
            xlabels.append(lab)
    ax.set_xticks(xticks, xlabels, fontsize=9)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.15 / fig.get_figheight(), va="top")
    return fig


def contact_sheet(
    clean: np.ndarray,
    sets: Mapping[tuple[str, int], np.ndarray],
    path: str | os.PathLike,
    *,
    corruptions: Sequence[str] | None = None,
    severities: Sequence[int] | None = None,
    title: str | None = None,
    tile: int = 84,
) -> Path:
    """A grid of images: one row per corruption, for each example image the clean one then its severities
    (a visual check of the corrupted sets, as in Hendrycks & Dietterich 2019, Fig. 1).

    `clean` is uint8 [K, H, W, C] (K example images), ``sets[(corruption, severity)]`` uint8 [K, H, W, C]
    (the same K images corrupted). Tiles are upscaled to about `tile` px with nearest-neighbour so a 28 px
    image stays pixel-exact, and drawn on a fixed 0..255 scale (no per-image autoscaling, which would hide
    contrast and brightness corruptions).
    """
    clean = np.asarray(clean)
    if clean.ndim == 3:
        clean = clean[..., None]
    k, h, w, c = clean.shape
    corruptions, severities = _shown(sets, corruptions, severities)
    scale = max(1, round(tile / max(h, w)))
    tiles = _Tiles(scale, h * scale, w * scale, 1 + len(severities))
    mosaic = _mosaic(clean, sets, corruptions, severities, tiles)
    dpi = 100
    fig = _sheet_figure(mosaic, tiles, k, corruptions, severities, title, dpi)
    return save_png(fig, Path(path), dpi)


def plot_gains(
    comparisons: Mapping[str, Mapping[str, Any]],
    keys: Sequence[str],
    path: str | os.PathLike,
    *,
    labels: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Path:
    """[TCNN21] Fig. 3 with uncertainty: the relative improvement acc_B / acc_A - 1 (in %) per corruption category
    (left) and severity (right) for each comparison ``"<B>-<A>"`` in `keys` (grouped bars), with its paired
    bootstrap 95% interval as an error bar (the ``gain_<group>`` entries of
    :func:`core.robustness.comparisons`). A group without an entry is left out."""
    labels = labels or {}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120, gridspec_kw={"width_ratios": [4, 5]})
    colors = ["tab:red", "tab:gray", "tab:blue"]
    for ax, groups in zip(axes, (list(CATEGORIES), [f"sev{s}" for s in SEVERITIES])):
        present = [g for g in groups if any(f"gain_{g}" in comparisons.get(k, {}) for k in keys)]
        width = 0.8 / max(1, len(keys))
        for i, key in enumerate(keys):
            entries = [comparisons.get(key, {}).get(f"gain_{g}") for g in present]
            xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(present))]
            vals = [100 * e["diff"] if e else np.nan for e in entries]
            err = [[100 * (e["diff"] - e["low"]) if e else 0 for e in entries],
                   [100 * (e["high"] - e["diff"]) if e else 0 for e in entries]]  # fmt: skip
            b, a = key.split("-", 1)
            ax.bar(xs, vals, width, yerr=err, capsize=2, color=colors[i % len(colors)],
                   label=f"{labels.get(b, b)} over {labels.get(a, a)}")  # fmt: skip
        ax.set_xticks(range(len(present)), [g.removeprefix("sev") for g in present])
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("category" if groups[0] in CATEGORIES else "severity")
        ax.set_ylabel("relative improvement (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(
        title
        or "Relative improvement in top-1 accuracy on corrupted images (bars: 95% paired-bootstrap intervals)",
        fontsize=9,
    )
    fig.tight_layout()
    return save_png(fig, Path(path), 120)
