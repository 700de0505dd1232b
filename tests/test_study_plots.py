"""core.viz.study_plots: what the study's figures draw, read back from the figure and compared with the numbers
computed here by hand (numpy, scipy's t quantile) from the rows given to them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scipy import stats

from core.viz import study_plots as P

LRS = (1e-4, 1e-3, 1e-2)


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the plot functions hand to ``finish_figure`` (they still get saved)."""
    kept: list[Any] = []
    save = P.finish_figure

    def keep(fig: Any, path: Any) -> bytes:
        kept.append(
            {"axes": fig.axes, "lines": [[ln.get_xydata().copy() for ln in ax.lines] for ax in fig.axes]}
        )
        return save(fig, path)

    monkeypatch.setattr(P, "finish_figure", keep)
    return kept


def _history() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    return [{"seed": s, "arm": arm, "lr": lr, "epoch": e, "val_accuracy": float(0.6 + 0.04 * e + rng.normal(0, 0.01))}
            for s in range(3) for arm in ("tcnn", "control") for lr in LRS for e in range(7)]  # fmt: skip


def test_val_curves_draw_the_seed_mean_on_top_and_each_seeds_last_epochs_below(figures: list[Any]) -> None:
    history = _history()
    png = P.plot_val_curves(history, tail=3)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    top_tcnn, top_control, bottom_tcnn, bottom_control = fig["lines"]  # 2 x 2 axes, row-major
    for arm, top, bottom in (("tcnn", top_tcnn, bottom_tcnn), ("control", top_control, bottom_control)):
        assert len(top) == len(LRS) and len(bottom) == 3 * len(LRS)  # a mean per lr; a line per (lr, seed)
        for k, lr in enumerate(LRS):
            want = [100 * np.mean([h["val_accuracy"] for h in history if (h["arm"], h["lr"], h["epoch"]) == (arm, lr, e)])
                    for e in range(7)]  # fmt: skip
            np.testing.assert_allclose(top[k][:, 1], want)
            for s in range(3):
                line = bottom[3 * k + s]
                want = [(e, 100 * h["val_accuracy"]) for e in range(3, 7) for h in history
                        if (h["arm"], h["lr"], h["seed"], h["epoch"]) == (arm, lr, s, e)]  # fmt: skip
                np.testing.assert_allclose(line, want)


def test_lr_grid_draws_means_with_student_t_intervals(figures: list[Any]) -> None:
    rng = np.random.default_rng(1)
    rows = [{"lr": lr, "seed": s, **{f"{m}_{k}": float(rng.uniform(0.7, 0.9)) for m in ("tcnn", "control", "cnn")
                                     for k in ("val_accuracy", "clean_accuracy", "mca")},
             "tcnn_selected": lr == 1e-2, "control_selected": lr == 1e-3}
            for lr in LRS for s in range(3)]  # fmt: skip
    P.plot_lr_grid(rows)
    (fig,) = figures
    ax = fig["axes"][1]  # clean test accuracy
    for container in ax.containers:  # errorbar containers: (line, caps, bars), one per arm
        arm = "tcnn" if container.get_label() == "T-CNN" else "control"
        means = container.lines[0].get_ydata()
        for k, lr in enumerate(LRS):
            v = np.array([100 * r[f"{arm}_clean_accuracy"] for r in rows if r["lr"] == lr])
            half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
            assert means[k] == pytest.approx(v.mean())
            (seg,) = [s for s in container.lines[2][0].get_segments() if s[0][0] == pytest.approx(lr)]
            assert sorted(seg[:, 1]) == pytest.approx([v.mean() - half, v.mean() + half])
    assert len(ax.containers) == 2
