"""Figures of the run report (matplotlib, Agg backend): training curves, [TCNN21] Fig. 4- and Fig. 5-style plots.

- :func:`plot_training_curves`: train / validation loss and accuracy (and the learning rate) of pretraining
  and fine-tuning on one epoch axis, the reparameterization epoch t1 marked ([TCNN21] Fig. 4A).
- :func:`gpsa_dynamics` + :func:`plot_gpsa_dynamics`: per GPSA layer, the attention span 1/alpha_h ([TCNN21] Eq. 3-4)
  and the gate sigma(lambda_h) (Eq. 7) of every head over the fine-tuning epochs, thin lines per head and
  the head mean thick ([TCNN21] Fig. 4B-C); nonlocality ([ConViT21] Eq. 8) as a third row when recorded.
- :func:`plot_attention_maps`: the attention map of a centre query of each attention layer, per head, for one
  input image fed through the whole network (data from :func:`core.analysis.dissect.centre_query_maps`),
  sigma(lambda_h) annotated ([TCNN21] Fig. 5).

Every plot function returns the PNG bytes (so a report can embed them) and, given ``path``, also writes them
atomically (temporary file in the same directory, fsync, os.replace).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

from core.analysis.dissect import CONTOUR_LEVELS, LayerAttention, dynamics_table, mass_contours
from core.utils.atomic import atomic_write_bytes

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = [
    "DYNAMICS_QUANTITIES",
    "gpsa_dynamics",
    "plot_attention_contours",
    "plot_attention_maps",
    "plot_gpsa_dynamics",
    "plot_nonlocality",
    "plot_training_curves",
    "preprocess_image",
    "to_png",
    "write_bytes_atomic",
]

#: gpsa.csv columns plotted by :func:`plot_gpsa_dynamics`, with their axis labels.
DYNAMICS_QUANTITIES: dict[str, str] = {
    "inv_alpha": r"attention span $1/\alpha_h$",
    "gate": r"gate $\sigma(\lambda_h)$",
    "nonlocality": "nonlocality (px)",
}
_DPI = 110


# ------------------------------------------------------------------------------------------------- output
def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> Path:
    """Write bytes (a PNG, the report's HTML) atomically (temp file in the same directory, fsync, os.replace),
    readable by others (a report is for sharing; mkstemp would leave 0600)."""
    return atomic_write_bytes(path, data)


def finish_figure(fig: Any, path: str | os.PathLike | None) -> bytes:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=_DPI)
    finally:
        plt.close(fig)
    data = buf.getvalue()
    if path is not None:
        write_bytes_atomic(data, path)
    return data


def _grid(
    nrow: int, ncol: int, cell: tuple[float, float], *, left: float, right: float, top: float, bottom: float,
    wspace: float, hspace: float, **kw: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """A figure of nrow x ncol axes of `cell` (w, h) inches with fixed margins and gaps in inches.

    Fixed geometry instead of tight_layout: the layout pass measures every tick label and costs more than
    drawing on small figures."""
    cw, ch = cell
    width = left + right + ncol * cw + (ncol - 1) * wspace
    height = top + bottom + nrow * ch + (nrow - 1) * hspace
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, height), dpi=_DPI, squeeze=False, **kw)
    fig.subplots_adjust(
        left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
        wspace=wspace / cw, hspace=hspace / ch,
    )  # fmt: skip
    return fig, axes


def _num(v: Any) -> float:
    """A CSV / JSON cell as float (empty or missing -> nan)."""
    if v is None or v == "":
        return float("nan")
    return float(v)


# ----------------------------------------------------------------------------------------- training curves
def _curve(history: Sequence[Mapping[str, Any]], key: str, offset: float, epoch_key: str) -> tuple:
    xs, ys = [], []
    for row in history:
        y = _num(row.get(key))
        if math.isfinite(y):
            xs.append(_num(row.get(epoch_key, row.get("epoch"))) + offset)
            ys.append(y)
    return np.asarray(xs), np.asarray(ys)


def plot_training_curves(
    pretrain: Sequence[Mapping[str, Any]] | None,
    finetune: Sequence[Mapping[str, Any]] | None,
    path: str | os.PathLike | None = None,
    *,
    reparam_epoch: int | None = None,
    title: str | None = None,
    control: Sequence[Mapping[str, Any]] | None = None,
) -> bytes:
    """Loss, accuracy and learning rate per epoch: pretraining (blue), fine-tuning of the T-CNN (orange) and
    of its matched control (green); solid = train, dashed = validation. Fine-tuning is drawn at
    ``reparam_epoch + finetune_epoch`` (t1 + t), so the phases share the axis of [TCNN21] Table 3's schedule; the
    reparameterization is a dotted vertical line.

    Rows are history.json rows of the stages (``epoch``, ``finetune_epoch``, ``train_loss``, ``train_acc``,
    ``val_loss``, ``val_acc``, ``lr``). Any history may be None or empty.
    """
    phases = []
    if pretrain:
        phases.append(("pretrain", pretrain, 0.0, "epoch", "tab:blue"))
    for name, hist, color in (("T-CNN", finetune, "tab:orange"), ("control", control, "tab:green")):
        if not hist:
            continue
        t1 = float(reparam_epoch or 0)
        key = "finetune_epoch" if any("finetune_epoch" in r for r in hist) else "epoch"
        if key == "epoch":  # no relative column: shift so the first row sits at t1
            t1 -= min(_num(r.get("epoch")) for r in hist)
        phases.append((name, hist, t1, key, color))
    if not phases:
        raise ValueError("plot_training_curves: no history to plot")
    fig, axes = _grid(1, 3, (3.7, 2.6), left=0.65, right=0.15, top=0.45, bottom=0.5, wspace=0.75, hspace=0)
    axes = axes[0]
    for ax, (metric, label) in zip(axes, (("loss", "loss"), ("acc", "accuracy"), ("lr", "learning rate"))):
        for name, hist, off, ekey, color in phases:
            if metric == "lr":
                x, y = _curve(hist, "lr", off, ekey)
                if len(x):
                    ax.plot(x, y, color=color, marker="o", ms=3, label=name)
                continue
            for split, style in (("train", "-"), ("val", "--")):
                x, y = _curve(hist, f"{split}_{metric}", off, ekey)
                if len(x):
                    ax.plot(x, y, style, color=color, marker="o", ms=3, label=f"{name} {split}")
        if metric == "lr" and ax.lines and all((np.asarray(ln.get_ydata()) > 0).all() for ln in ax.lines):
            ax.set_yscale("log")  # pretraining and fine-tuning peaks differ by orders of magnitude
        if reparam_epoch is not None and pretrain and (finetune or control):
            ax.axvline(reparam_epoch, color="grey", ls=":", lw=1.2, label=f"reparam. (t1={reparam_epoch})")
        if ax.lines:
            ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(
        title
        or "Training curves: pretraining (blue), T-CNN fine-tuning (orange), control fine-tuning (green); "
        "solid = train, dashed = validation",
        fontsize=10,
    )
    return finish_figure(fig, path)


# ----------------------------------------------------------------------------------------- GPSA dynamics
@dataclass
class Dynamics:
    """Per-head GPSA values over fine-tuning: ``values[layer][quantity]`` is [epochs, heads] (nan = missing)."""

    epochs: np.ndarray  # fine-tuning epoch of each row (0 = right after reparameterization)
    values: dict[str, dict[str, np.ndarray]]


def gpsa_dynamics(rows: Iterable[Mapping[str, Any]]) -> Dynamics:
    """Long rows (gpsa.csv of the finetune stage: ``epoch, layer, head, inv_alpha, gate, nonlocality``; str or
    number cells) -> :class:`Dynamics`. Epochs are made relative to the first one (in "continue" mode the
    stage labels them t1 .. E)."""
    rows = list(rows)
    if not rows:
        raise ValueError("gpsa_dynamics: no rows")
    for i, r in enumerate(rows):
        missing = [k for k in ("epoch", "layer", "head") if k not in r]
        if missing:
            raise ValueError(f"gpsa_dynamics: row {i} lacks {missing}")
    epochs = sorted({int(_num(r["epoch"])) for r in rows})
    layers = list(dict.fromkeys(str(r["layer"]) for r in rows))
    heads = {
        layer: 1 + max(int(_num(r["head"])) for r in rows if str(r["layer"]) == layer) for layer in layers
    }
    quantities = [q for q in DYNAMICS_QUANTITIES if any(q in r and r[q] not in (None, "") for r in rows)]
    e_index = {e: i for i, e in enumerate(epochs)}
    values = {
        layer: {q: np.full((len(epochs), heads[layer]), np.nan) for q in quantities} for layer in layers
    }
    for r in rows:
        layer, e, h = str(r["layer"]), e_index[int(_num(r["epoch"]))], int(_num(r["head"]))
        for q in quantities:
            values[layer][q][e, h] = _num(r.get(q))
    return Dynamics(np.asarray(epochs) - epochs[0], values)


def layer_panels(
    axes: Any,
    layers: Sequence[str],
    quantities: Sequence[tuple[str, str]],
    draw: Callable[[Any, str, str], None],
) -> None:
    """[TCNN21] Fig. 4B-C's grid of GPSA panels: one column per layer, one row per (quantity, label); ``draw(ax,
    layer, quantity)`` plots a panel's lines, and every panel gets the same look (the gate axis [0, 1], a grid,
    the layer over the top row, the quantity left of the first column, integer fine-tuning epochs below)."""
    for j, layer in enumerate(layers):
        for i, (q, label) in enumerate(quantities):
            ax = axes[i][j]
            draw(ax, layer, q)
            if q == "gate":
                ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
            if i == 0:
                ax.set_title(layer, fontsize=9)
            if j == 0:
                ax.set_ylabel(label, fontsize=9)
            if i == len(quantities) - 1:
                ax.set_xlabel("fine-tuning epoch", fontsize=9)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_gpsa_dynamics(
    dyn: Dynamics, path: str | os.PathLike | None = None, *, title: str | None = None
) -> bytes:
    """[TCNN21] Fig. 4B-C per layer: one column per GPSA layer, one row per quantity (1/alpha_h, sigma(lambda_h),
    nonlocality); thin coloured lines = heads (the same colour is the same head in every panel), thick black =
    mean over heads. The span axis turns logarithmic when it covers more than a factor 20."""
    layers = list(dyn.values)
    quantities = [q for q in DYNAMICS_QUANTITIES if q in next(iter(dyn.values.values()), {})]
    if not layers or not quantities:
        raise ValueError("plot_gpsa_dynamics: nothing to plot")
    nrow, ncol = len(quantities), len(layers)
    fig, axes = _grid(
        nrow,
        ncol,
        (3.0, 2.0),
        left=0.8,
        right=0.15,
        top=0.6,
        bottom=1.05,
        wspace=0.75,
        hspace=0.25,
        sharex=True,
    )
    cmap = plt.get_cmap("tab10")
    max_heads = max(v.shape[1] for per_layer in dyn.values.values() for v in per_layer.values())

    def draw(ax: Any, layer: str, q: str) -> None:
        v = dyn.values[layer][q]
        for h in range(v.shape[1]):
            ax.plot(dyn.epochs, v[:, h], color=cmap(h % 10), lw=0.9, alpha=0.75, marker=".", ms=3)
        with np.errstate(all="ignore"):
            mean = np.nanmean(v, axis=1) if v.size else v
        ax.plot(dyn.epochs, mean, color="black", lw=2.6, label="mean over heads")
        finite = v[np.isfinite(v)]
        if q == "inv_alpha" and finite.size and finite.min() > 0 and finite.max() / finite.min() > 20:
            ax.set_yscale("log")

    layer_panels(axes, layers, [(q, DYNAMICS_QUANTITIES[q]) for q in quantities], draw)
    handles = [plt.Line2D([], [], color=cmap(h % 10), lw=1.2, label=f"head {h}") for h in range(max_heads)]
    handles.append(plt.Line2D([], [], color="black", lw=2.6, label="mean"))
    per_row = len(handles) if len(handles) <= 4 * ncol else math.ceil(len(handles) / 2)
    fig.legend(
        handles=handles, loc="lower center", ncol=per_row, fontsize=7, frameon=False, borderaxespad=0.3
    )
    fig.suptitle(
        title or "GPSA dynamics over fine-tuning ([TCNN21] Fig. 4): thin = heads, thick = mean", fontsize=10
    )
    return finish_figure(fig, path)


# ----------------------------------------------------------------------------------------- attention maps
def preprocess_image(
    image: np.ndarray, mean: Sequence[float], std: Sequence[float], image_size: int | None = None
) -> torch.Tensor:
    """uint8 [H, W, C] (or [H, W]) -> normalised float [1, C, H, W], resized bilinearly to ``image_size`` when
    it differs: the same transform as core.robustness.count_correct."""
    img = np.asarray(image)
    if img.ndim == 2:
        img = img[..., None]
    x = torch.from_numpy(np.array(img, dtype=np.float32, copy=True)).permute(2, 0, 1)[None] / 255.0
    m = torch.as_tensor(list(mean), dtype=torch.float32).reshape(1, -1, 1, 1)
    s = torch.as_tensor(list(std), dtype=torch.float32).reshape(1, -1, 1, 1)
    x = (x - m) / s
    if image_size is not None and tuple(x.shape[-2:]) != (image_size, image_size):
        x = torch.nn.functional.interpolate(
            x, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    return x


def _query_box(ax: Any, r: float, c: float, hh: float, ww: float) -> None:
    ax.add_patch(Rectangle((c - 0.5, r - 0.5), ww, hh, fill=False, edgecolor="red", lw=1.6))


def plot_attention_maps(
    layers: Sequence[LayerAttention],
    image: np.ndarray,
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
) -> bytes:
    """[TCNN21] Fig. 5: one row per GPSA layer; first column the input image with the query's footprint (red box),
    then one panel per head: the centre query's attention over the layer's input pixels (red box = query),
    sigma(lambda_h) in red under the map, 1/alpha_h in the title. Each map is scaled to its own maximum."""
    if not layers:
        raise ValueError("plot_attention_maps: no GPSA layer")
    img = np.asarray(image)
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[..., 0]
    ih, iw = img.shape[:2]
    nheads = max(la.maps.shape[0] for la in layers)
    ncol = 1 + nheads
    fig, axes = _grid(len(layers), ncol, (1.3, 1.3), left=0.5, right=0.1, top=0.6, bottom=0.32, wspace=0.15,
                      hspace=0.62)  # fmt: skip
    for i, la in enumerate(layers):
        h, w = la.grid
        ax = axes[i, 0]
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=255, interpolation="nearest")
        sy, sx = ih / h, iw / w  # one input pixel of the layer covers sy x sx image pixels
        ax.add_patch(
            Rectangle(
                (la.query[1] * sx - 0.5, la.query[0] * sy - 0.5), sx, sy, fill=False, edgecolor="red", lw=1.6
            )
        )
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"{la.name}\n{h}x{w} keys, stride {la.stride}", fontsize=9)
        if i == 0:
            ax.set_title("input", fontsize=9)
        for hd in range(nheads):
            ax = axes[i, 1 + hd]
            ax.set_xticks([])
            ax.set_yticks([])
            if hd >= la.maps.shape[0]:
                ax.axis("off")
                continue
            m = la.maps[hd]
            ax.imshow(m, cmap="viridis", vmin=0, vmax=max(float(m.max()), 1e-12), interpolation="nearest")
            _query_box(ax, la.query[0], la.query[1], 1, 1)
            ax.set_title(f"h{hd}  1/α={la.inv_alpha[hd]:.2g}", fontsize=9, pad=3)
            ax.set_xlabel(f"σ(λ)={la.gate[hd]:.2f}", color="red", fontsize=10.5, labelpad=2)
    fig.suptitle(
        title
        or "Attention of the centre query per GPSA layer and head ([TCNN21] Fig. 5); red: query, σ(λ_h)",
        fontsize=11,
    )
    return finish_figure(fig, path)


# ---------------------------------------------------------------------------------- dissection figures
def plot_attention_contours(
    layers: Sequence[Any], levels: Sequence[float] = CONTOUR_LEVELS, *, title: str | None = None
) -> Any:
    """One row per layer, one panel per head: the centre query's map (log colour scale) with the contours
    enclosing ``levels`` of its mass (`core.analysis.dissect.mass_contours`); red box = query. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if not layers:
        raise ValueError("plot_attention_contours: no attention layer")
    nheads = max(la.maps.shape[0] for la in layers)
    fig, axes = plt.subplots(
        len(layers), nheads, figsize=(1.5 * nheads + 0.5, 1.6 * len(layers) + 0.8), squeeze=False
    )
    colours = plt.get_cmap("autumn")(np.linspace(0, 0.8, len(levels)))
    for i, la in enumerate(layers):
        for hd in range(nheads):
            ax = axes[i, hd]
            ax.set_xticks([])
            ax.set_yticks([])
            if hd >= la.maps.shape[0]:
                ax.axis("off")
                continue
            m = np.asarray(la.maps[hd], dtype=np.float64)
            ax.imshow(np.log10(np.maximum(m, 1e-6)), cmap="viridis", vmin=-6, vmax=0, interpolation="nearest")
            if m.sum() > 0 and m.shape[0] > 1 and m.shape[1] > 1:
                for c, col in zip(mass_contours(m, levels), colours):
                    ax.contour(c.mask.astype(float), levels=[0.5], colors=[col], linewidths=1.2)
            ax.add_patch(
                Rectangle((la.query[1] - 0.5, la.query[0] - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.2)
            )
            if i == 0:
                ax.set_title(f"head {hd}", fontsize=8)
            if hd == 0:
                ax.set_ylabel(la.name, fontsize=8)
    handles = [
        plt.Line2D([], [], color=col, lw=1.5, label=f"{int(round(100 * f))}% of the mass")
        for f, col in zip(levels, colours)
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(levels), fontsize=8, frameon=False)
    fig.suptitle(title or "Centre-query attention (log scale) and mass contours", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


def plot_nonlocality(rows: Iterable[Mapping[str, Any]], *, title: str | None = None) -> Any:
    """[ConViT21] Fig. 5: the nonlocality of each layer (mean over heads) over epochs, from long rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = dynamics_table(rows)
    if table.num_rows == 0:
        raise ValueError("plot_nonlocality: no rows")
    d = table.to_pydict()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for layer in dict.fromkeys(d["layer"]):
        by_epoch: dict[int, list[float]] = {}
        for e, lay, v in zip(d["epoch"], d["layer"], d["nonlocality"]):
            if lay == layer and v is not None:
                by_epoch.setdefault(e, []).append(v)
        if by_epoch:
            es = sorted(by_epoch)
            ax.plot(es, [float(np.mean(by_epoch[e])) for e in es], marker=".", label=layer)
    ax.set_xlabel("epoch")
    ax.set_ylabel("nonlocality (px)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or "Nonlocality per layer ([ConViT21] Eq. 8, Fig. 5)", fontsize=10)
    fig.tight_layout()
    return fig


def to_png(fig: Any, dpi: int = 110) -> bytes:
    """Render a matplotlib figure to PNG bytes and close it (for reports embedding the figures)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return buf.getvalue()
