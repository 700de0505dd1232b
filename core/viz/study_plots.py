"""Figures of a study whose fine-tuning lr is chosen on validation data (pipelines/studies/results.py).

- :func:`plot_lr_grid`: validation accuracy, clean test accuracy and mean corruption accuracy (mCA) against
  the fine-tuning lr, T-CNN and control, mean over seeds with Student's 95% t-interval (T-CNN, d'Ascoli et
  al. 2021, SM A, Fig. 6: the outcome depends on the lr).
- :func:`plot_val_curves`: validation accuracy per fine-tuning epoch, per arm and lr (mean over seeds): where
  it stops rising.
- :func:`plot_head_gates`: per GPSA layer, every head's gate sigma(lambda_h), attention span 1/alpha_h and
  nonlocality over fine-tuning ([TCNN21] Fig. 4B-C, 5; [ConViT21] Eq. 8), for each seed's chosen T-CNN, with the
  content-based threshold sigma(lambda) = 0.1 drawn.

Inputs are plain records (dicts of the committed CSV tables); each function returns PNG bytes and writes
them atomically when given a path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from core.viz.report_plots import finish_figure, layer_panels  # noqa: E402

ARM_STYLE = {"tcnn": ("T-CNN", "tab:red", "o"), "control": ("control (no attention)", "tab:blue", "s")}
CONTENT_GATE = 0.1  # a head with sigma(lambda) below this attends mostly by content ([TCNN21] Fig. 5)


def _t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    from core.robustness.intervals import t_interval

    ci = t_interval(list(values))
    mean = ci["mean"] if ci["mean"] is not None else float("nan")
    lo = ci["low"] if ci["low"] is not None else mean
    hi = ci["high"] if ci["high"] is not None else mean
    return mean, lo, hi


def plot_lr_grid(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike | None = None, *, title: str = ""
) -> bytes:
    """``rows``: one per (seed, lr) with ``lr`` and ``<arm>_val_accuracy`` / ``_clean_accuracy`` / ``_mca``
    (fractions) and ``cnn_*`` for the pretrained CNN; also ``<arm>_selected`` (the lr its seed chose)."""
    panels = (("val_accuracy", "validation accuracy (chooses the lr)"), ("clean_accuracy", "clean test accuracy"),
              ("mca", "mean corruption accuracy (mCA)"))  # fmt: skip
    lrs = sorted({float(r["lr"]) for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.9))
    for ax, (metric, label) in zip(axes, panels):
        for arm, (name, color, marker) in ARM_STYLE.items():
            stats = [
                _t_interval([100 * r[f"{arm}_{metric}"] for r in rows if float(r["lr"]) == lr]) for lr in lrs
            ]
            mean = np.array([s[0] for s in stats])
            err = np.array([[m - s[1] for m, s in zip(mean, stats)], [s[2] - m for m, s in zip(mean, stats)]])
            ax.errorbar(lrs, mean, yerr=err, color=color, marker=marker, capsize=4, label=name)
            chosen = [float(r["lr"]) for r in rows if r.get(f"{arm}_selected")]
            for lr in sorted(set(chosen)):
                k = lrs.index(lr)
                ax.annotate(f"{chosen.count(lr)}x", (lr, mean[k]), textcoords="offset points",
                            xytext=(6, -12 if arm == "control" else 6), fontsize=7, color=color)  # fmt: skip
        cnn = [100 * r[f"cnn_{metric}"] for r in rows if r.get(f"cnn_{metric}") is not None]
        if cnn:
            ax.axhline(float(np.mean(cnn)), color="gray", ls=":", label="pretrained CNN")
        ax.set_xscale("log")
        ax.set_xlabel("fine-tuning lr (at batch 1024)")
        ax.set_ylabel(f"{label} (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        (title + ": " if title else "") + "mean over seeds, 95% t-interval; "
        "'kx': the lr k seeds chose for that arm on validation accuracy", fontsize=10,
    )  # fmt: skip
    fig.tight_layout()
    return finish_figure(fig, path)


def plot_val_curves(
    history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike | None = None,
    *,
    title: str = "",
    tail: int = 3,
) -> bytes:
    """``history``: one per (seed, arm, lr, epoch) with ``val_accuracy``; epoch 0 = before fine-tuning. Top row:
    every epoch, mean over seeds with its t-band; bottom row: the last ``tail`` + 1 epochs of every seed (thin
    lines, own scale), where "has validation accuracy stopped rising?" is read."""
    arms = [a for a in ARM_STYLE if any(h["arm"] == a for h in history)]
    lrs = sorted({float(h["lr"]) for h in history if h["arm"] in arms})
    fig, axes = plt.subplots(2, len(arms), figsize=(5.2 * len(arms), 6.4), sharey="row", squeeze=False)
    cmap = plt.get_cmap("viridis")
    for col, arm in enumerate(arms):
        top, bottom = axes[0][col], axes[1][col]
        for k, lr in enumerate(lrs):
            colour = cmap(k / max(1, len(lrs) - 1))
            sel = [h for h in history if h["arm"] == arm and float(h["lr"]) == lr]
            epochs = sorted({int(h["epoch"]) for h in sel})
            stats = [
                _t_interval([100 * h["val_accuracy"] for h in sel if int(h["epoch"]) == e]) for e in epochs
            ]
            top.fill_between(epochs, [s[1] for s in stats], [s[2] for s in stats], color=colour, alpha=0.15)
            top.plot(epochs, [s[0] for s in stats], marker=".", color=colour, label=f"lr {lr:g}")
            first = max(epochs[0], epochs[-1] - tail)
            for seed in sorted({h["seed"] for h in sel}):
                curve = sorted((int(h["epoch"]), 100 * h["val_accuracy"]) for h in sel
                               if h["seed"] == seed and int(h["epoch"]) >= first)  # fmt: skip
                bottom.plot(*zip(*curve), marker=".", lw=0.9, color=colour)
        top.set_title(ARM_STYLE[arm][0], fontsize=10)
        bottom.set_xlabel("fine-tuning epoch")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel("validation accuracy (%)")
    axes[1][0].set_ylabel(f"last {tail + 1} epochs, each seed (%)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(
        (title + ": " if title else "") + "validation accuracy per epoch (top: mean over seeds, 95% t-band)",
        fontsize=10,
    )
    fig.tight_layout()
    return finish_figure(fig, path)


QUANTITIES = (("gate", r"gate $\sigma(\lambda_h)$"), ("inv_alpha", r"span $1/\alpha_h$"),
              ("nonlocality", "nonlocality (px)"))  # fmt: skip


def plot_head_gates(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike | None = None, *, title: str = ""
) -> bytes:
    """``rows``: one per (seed, epoch, layer, head) with ``gate``, ``inv_alpha``, ``nonlocality``. One column
    per layer, one row per quantity; a line per head and seed (colour = head, line style = seed)."""
    layers = list(dict.fromkeys(str(r["layer"]) for r in rows))
    seeds = sorted({int(r["seed"]) for r in rows})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(
        len(QUANTITIES), len(layers), figsize=(3.1 * len(layers), 7.2), sharex=True, squeeze=False
    )
    cmap = plt.get_cmap("tab10")

    def draw(ax: Any, layer: str, q: str) -> None:
        for s_i, seed in enumerate(seeds):
            mine = [r for r in rows if str(r["layer"]) == layer and int(r["seed"]) == seed]
            for head in sorted({int(r["head"]) for r in mine}):
                pts = sorted(
                    (int(r["epoch"]), float(r[q]))
                    for r in mine
                    if int(r["head"]) == head and r.get(q) is not None
                )
                if pts:
                    ax.plot(
                        *zip(*pts), color=cmap(head % 10), ls=styles[s_i % len(styles)], lw=0.9, alpha=0.8
                    )
        if q == "gate":
            ax.axhline(CONTENT_GATE, color="black", lw=0.8, ls=":")

    layer_panels(axes, layers, QUANTITIES, draw)
    handles = [
        plt.Line2D([], [], color="gray", ls=styles[k % len(styles)], label=f"seed {s}")
        for k, s in enumerate(seeds)
    ]
    handles.append(
        plt.Line2D(
            [], [], color="black", ls=":", label=rf"$\sigma(\lambda)$ = {CONTENT_GATE} (content-based below)"
        )
    )
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(
        (title + ": " if title else "") + "every GPSA head over fine-tuning (colour = head)", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return finish_figure(fig, path)
