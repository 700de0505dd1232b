"""[TCNN21] Fig. 5 for one test image: the centre query's attention per attention layer and head of the
fine-tuned model (`core.analysis.dissect.centre_query_maps`), what the CNN and the T-CNN predict for the
image, and per-layer statistics for the report's table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.analysis.dissect import centre_query_maps
from core.utils.errors import first_line
from core.viz.report_plots import plot_attention_maps, preprocess_image


@dataclass
class AttentionFigure:
    """The figure (PNG) or why there is none (``note``), its caption, per-layer statistics and the maps."""

    png: bytes | None
    caption: str | None = None
    stats: list[dict[str, Any]] = field(default_factory=list)
    layers: list[Any] = field(default_factory=list)
    note: str | None = None


def attention_figure(
    cnn: torch.nn.Module,
    tcnn: torch.nn.Module,
    image: np.ndarray,
    label: int | None,
    source: str,
    *,
    norm: dict[str, Any],
    cnn_norm: dict[str, Any],
    image_size: int | None,
    cnn_image_size: int | None,
    label_names: Sequence[str] = (),
) -> AttentionFigure:
    """Fig. 5 of ``tcnn`` on the uint8 ``image`` [H, W, C] (normalized with ``norm``), next to the CNN's
    prediction on the same image (with ``cnn_norm``)."""

    def name(i: int | None) -> str:
        return "?" if i is None else (f"{i} ({label_names[i]})" if 0 <= i < len(label_names) else str(i))

    x = preprocess_image(image, norm["mean"], norm["std"], image_size)
    try:
        layers, logits = centre_query_maps(tcnn, x)
    except ValueError as err:  # e.g. the ConViT GPSA (token inputs): no conv-grid maps to draw
        return AttentionFigure(None, note=f"No attention maps: {first_line(err)}.")
    with torch.no_grad():
        cnn_pred = int(
            cnn(preprocess_image(image, cnn_norm["mean"], cnn_norm["std"], cnn_image_size)).argmax()
        )
    tcnn_pred = int(logits.argmax())
    caption = f"Input: {source}; label {name(label)}; CNN predicts {name(cnn_pred)}, T-CNN predicts {name(tcnn_pred)}."
    stats = []
    for la in layers:
        q = la.maps
        stats.append(
            {
                "layer": la.name,
                "grid": f"{la.grid[0]}x{la.grid[1]}",
                "query": f"({la.query[0]}, {la.query[1]})",
                "mass": float(q.sum(axis=(1, 2)).min()),
                "peak": float(q.reshape(q.shape[0], -1).max(axis=1).mean()),
                "gate": float(np.nanmean(la.gate)) if np.isfinite(la.gate).any() else None,
            }
        )
    title = (
        f"Centre-query attention per GPSA layer and head ([TCNN21] Fig. 5); label {name(label)}, "
        f"T-CNN predicts {name(tcnn_pred)}"
    )
    return AttentionFigure(plot_attention_maps(layers, image, title=title), caption, stats, list(layers))
