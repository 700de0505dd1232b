"""Sweep figures (matplotlib, Agg backend), one per grid axis the sweep varies: test accuracy against the
reparameterization epoch t1 ([TCNN21] Table 3), against the training-sample fraction ([ConViT21] Table 2), an
alpha_init x lambda_init heatmap, and accuracy / mCE by model kind. Each point is the mean over the trials of
its grid value, the bar its min-max range. PNGs are written atomically.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

from core.viz.plots import save_png

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 110
T1, ALPHA, LAMBDA, FRACTION = (
    "reparam.epoch",
    "reparam.alpha_init",
    "reparam.lambda_init",
    "data.sample_fraction",
)


def _aggregate(rows: list[dict[str, Any]], keys: tuple[str, ...], metric: str) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r.get(metric) is not None:
            out[tuple(r[k] for k in keys)].append(float(r[metric]))
    return out


def _line(ax: Any, agg: dict[tuple, list[float]], label: str, **kw: Any) -> None:
    xs = sorted(agg)
    if not xs:
        return
    means = [sum(agg[x]) / len(agg[x]) for x in xs]
    lo = [max(0.0, m - min(agg[x])) for m, x in zip(means, xs)]  # rounding: mean of equal values
    hi = [max(0.0, max(agg[x]) - m) for m, x in zip(means, xs)]
    ax.errorbar([x[0] for x in xs], means, yerr=[lo, hi], marker="o", capsize=3, label=label, **kw)


def _t1_figure(name: str, rows: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """Clean and corrupted (mCA) T-CNN accuracy against the reparameterization epoch t1, with the CNN at the
    end of pretraining as a reference line ([TCNN21] Table 3)."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    _line(ax, _aggregate(rows, (T1,), "tcnn_clean_accuracy"), "T-CNN clean")
    _line(ax, _aggregate(rows, (T1,), "tcnn_mca"), "T-CNN corrupted (mCA)", linestyle="--")
    cnn = [r["cnn_clean_accuracy"] for r in rows if r["cnn_clean_accuracy"] is not None]
    if cnn:
        ax.axhline(sum(cnn) / len(cnn), color="gray", linestyle=":", label="CNN (end of pretraining)")
    ax.set_xlabel("reparameterization epoch t1 (grid value)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{name}: accuracy vs t1 ([TCNN21] Table 3)")
    ax.legend(fontsize=8)
    return save_png(fig, out_dir / "accuracy_vs_t1.png", DPI)


def _fraction_figure(
    name: str, rows: Sequence[dict[str, Any]], out_dir: Path, fraction_scales_epochs: bool
) -> Path:
    """CNN and T-CNN clean accuracy against the training-sample fraction, log scale ([ConViT21] Table 2)."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    _line(ax, _aggregate(rows, (FRACTION,), "cnn_clean_accuracy"), "CNN")
    _line(ax, _aggregate(rows, (FRACTION,), "tcnn_clean_accuracy"), "T-CNN")
    ax.set_xscale("log")
    ax.set_xlabel(
        "training-sample fraction f (epochs x 1/f)"
        if fraction_scales_epochs
        else "training-sample fraction f"
    )
    ax.set_ylabel("clean test accuracy")
    ax.set_title(f"{name}: CNN vs T-CNN by sample fraction ([ConViT21] Table 2)")
    ax.legend(fontsize=8)
    return save_png(fig, out_dir / "accuracy_vs_fraction.png", DPI)


def _heatmap_panel(
    fig: Any, ax: Any, agg: dict[tuple, list[float]], alphas: list[Any], lambdas: list[Any], title: str
) -> None:
    """One alpha_init x lambda_init heatmap of a T-CNN metric's trial means, each cell labelled (an untried
    cell is NaN: blank, unlabelled)."""
    cells = [
        [sum(agg[(a, lam)]) / len(agg[(a, lam)]) if agg.get((a, lam)) else float("nan") for lam in lambdas]
        for a in alphas
    ]
    im = ax.imshow(cells, origin="lower", cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lambdas)), [str(v) for v in lambdas])
    ax.set_yticks(range(len(alphas)), [str(v) for v in alphas])
    ax.set_xlabel("lambda_init")
    ax.set_ylabel("alpha_init")
    ax.set_title(f"T-CNN {title}")
    for i, line in enumerate(cells):
        for j, v in enumerate(line):
            if v == v:
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, ax=ax)


def _heatmap_figure(
    name: str, grid: dict[str, list[Any]], rows: Sequence[dict[str, Any]], out_dir: Path
) -> Path:
    """T-CNN clean accuracy and mCA over the alpha_init x lambda_init grid, side by side."""
    alphas, lambdas = sorted(grid[ALPHA]), sorted(grid[LAMBDA])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, metric, title in zip(axes, ("tcnn_clean_accuracy", "tcnn_mca"), ("clean accuracy", "mCA")):
        _heatmap_panel(fig, ax, _aggregate(rows, (ALPHA, LAMBDA), metric), alphas, lambdas, title)
    fig.suptitle(f"{name}: alpha_init x lambda_init")
    fig.tight_layout()
    return save_png(fig, out_dir / "alpha_lambda_heatmap.png", DPI)


def _kind_figure(name: str, krows: list[dict[str, Any]], out_dir: Path) -> Path:
    """Clean accuracy and mCE (against the sweep's one baseline) per model kind, as labelled bars."""
    labels = [f"{k['kind']}\n{k['arch']}" for k in krows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.9))
    for ax, key, title in zip(axes, ("clean_accuracy", "mce"), ("clean accuracy", "mCE")):
        vals = [k[key] if k[key] is not None else float("nan") for k in krows]
        ax.bar(range(len(krows)), vals)
        ax.set_xticks(range(len(krows)), labels, rotation=20, fontsize=8)
        ax.set_title(title)
        for i, v in enumerate(vals):
            if v == v:
                ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{name}: by model.kind (mCE vs {krows[0]['baseline']})", fontsize=10)
    fig.tight_layout()
    return save_png(fig, out_dir / "accuracy_by_kind.png", DPI)


def sweep_plots(
    name: str,
    grid: dict[str, list[Any]],
    rows: Sequence[dict[str, Any]],
    kind_rows: Sequence[dict[str, Any]],
    out_dir: Path,
    *,
    fraction_scales_epochs: bool = True,
) -> list[Path]:
    """The figures a sweep's ``grid`` supports, from its finished trials' ``rows`` (summary.parquet's columns)
    and its by-kind rows; returns the files written."""
    written: list[Path] = []
    if not rows:
        return written

    def varies(key: str) -> bool:
        return len(grid.get(key, [])) > 1

    if varies(T1):
        written.append(_t1_figure(name, rows, out_dir))
    if varies(FRACTION):
        written.append(_fraction_figure(name, rows, out_dir, fraction_scales_epochs))
    if varies(ALPHA) and varies(LAMBDA):
        written.append(_heatmap_figure(name, grid, rows, out_dir))
    krows = [k for k in kind_rows if not k["kind"].startswith("cnn (")]
    if krows:
        written.append(_kind_figure(name, krows, out_dir))
    return written
