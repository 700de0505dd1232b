"""A search's validation curves (matplotlib, Agg): validation accuracy against the fine-tuning epoch, one panel
per arm (the T-CNN and its matched control), each trial coloured by the value of the searched key on a log scale
when its range is log-uniform; a trial the scheduler stopped ends in an x, the arm's chosen trial is drawn thick.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

from core.viz.plots import save_png

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import colors  # noqa: E402

DPI = 110


def search_curves(
    curves: Sequence[dict[str, Any]],
    key: str,
    log: bool,
    arms: Sequence[str],
    path: Path,
    title: str,
) -> Path:
    """``curves``: one per trial: {"arm", "value" (of ``key``), "epochs", "val_acc" (lists), "stopped" (bool),
    "chosen" (bool)}."""
    values = [float(c["value"]) for c in curves if isinstance(c.get("value"), int | float)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    norm = (
        colors.LogNorm(lo, hi)
        if log and lo > 0 and hi > lo
        else colors.Normalize(lo, hi if hi > lo else lo + 1)
    )
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(arms), figsize=(5.2 * len(arms), 3.8), sharey=True, squeeze=False)
    for ax, arm in zip(axes[0], arms, strict=True):
        for c in (c for c in curves if c["arm"] == arm and c["epochs"]):
            color = cmap(norm(float(c["value"]))) if isinstance(c.get("value"), int | float) else "grey"
            ax.plot(c["epochs"], [100 * v for v in c["val_acc"]], color=color,
                    lw=2.8 if c.get("chosen") else 1.2, alpha=1.0 if c.get("chosen") else 0.8)  # fmt: skip
            if c.get("stopped"):
                ax.plot(c["epochs"][-1], 100 * c["val_acc"][-1], "x", color=color, ms=7)
        ax.set_title(f"{arm}")
        ax.set_xlabel("fine-tuning epoch")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation accuracy (%)")
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=list(axes[0]), label=key)
    fig.suptitle(f"{title}: x = stopped by the scheduler, thick = the arm's choice", fontsize=9)
    return save_png(fig, path, DPI)
