"""Dissection views for any attention model ([TCNN21] Fig. 4-5; [ConViT21] Eq. 8, Fig. 5).

Works on every layer `core.reparam.attention_modules` finds: T-CNN GPSA, ConViT GPSA (token inputs on a
grid), PSA, and any other module with an ``attention_maps(x)`` method returning [B, heads, Lq, L] over an
(h, w) key grid (NCHW input) - the per-head accessors (alpha, gate, centers) are used where present.

- :func:`capture_inputs`: each layer's REAL input when a batch goes through the whole network (forward
  pre-hooks), the input the nonlocality of [ConViT21] Fig. 5 is computed on.
- :func:`layer_stats`: per layer and head, 1/alpha_h (span), sigma(lambda_h) (gate) and the nonlocality
  D_loc^h = (1/L) sum_ij A^h_ij |delta_ij| ([ConViT21] Eq. 8) on those real inputs; the per-epoch records of the
  finetune stage (history.json "gpsa", gpsa.csv via :func:`long_rows`).
- :func:`centre_query_maps`: the attention of the query nearest the centre of each layer's grid, per head
  ([TCNN21] Fig. 5), as `LayerAttention` so `core.viz.report_plots.plot_attention_maps` draws it.
- :func:`mass_contours` + :func:`plot_attention_contours`: the smallest sets of keys holding 90/50/10 % of a
  head's attention mass (highest-density regions) and their contours.
- :func:`dynamics_table` / :func:`plot_nonlocality`: the per-epoch records as a pyarrow table; the layer
  nonlocality over epochs ([ConViT21] Fig. 5). Span and gate over epochs ([TCNN21] Fig. 4) are drawn by
  `core.viz.report_plots.plot_gpsa_dynamics` from the same rows.

Everything returns data (numpy arrays, pyarrow tables, dataclasses) or matplotlib figures; nothing here
writes files or talks to tracking.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn as nn

from core.models.conversion import attention_modules
from core.nn.attention_layers import is_positional
from core.nn.locality import grid_distances, nonlocality

__all__ = [
    "Contour",
    "attention_grid",
    "capture_inputs",
    "centre_query_maps",
    "dynamics_table",
    "layer_stats",
    "long_rows",
    "mass_contours",
    "LayerAttention",
]

CONTOUR_LEVELS = (0.9, 0.5, 0.1)


# ------------------------------------------------------------------------------------------ geometry
def _square_grid(m: nn.Module, x: torch.Tensor, n_keys: int) -> tuple[int, int]:
    """The (h, w) attention grid of a layer attending over ``n_keys`` keys: its input grid (NCHW) or that grid
    pooled k times by a stride-2 operator (ceil(n / 2) per pooling, [Bello19] Sec. 3.2); tokens: the module's
    ``grid_size`` or a square."""
    if x.ndim == 3:
        return attention_grid(m, x)
    if x.ndim == 4:
        h, w = int(x.shape[-2]), int(x.shape[-1])
        for _ in range(6):
            if h * w == n_keys:
                return h, w
            h, w = -(-h // 2), -(-w // 2)
    side = math.isqrt(n_keys)
    if side * side == n_keys:
        return side, side
    raise ValueError(f"cannot place {n_keys} keys on the layer's input grid {tuple(x.shape)}")


def _stride(m: nn.Module) -> int:
    """Query stride of a layer's attention (1 for ConViT and for stride_mode "s1")."""
    s = int(getattr(m, "stride", 1) or 1)
    return s if getattr(m, "stride_mode", "exact") == "exact" else 1


def attention_grid(m: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """The (h, w) key grid of layer ``m`` for its input ``x`` (NCHW maps, or ConViT tokens on ``grid_size``)."""
    if x.ndim == 4:
        return int(x.shape[-2]), int(x.shape[-1])
    n = int(x.shape[1])
    size = getattr(m, "grid_size", None)
    if size is not None and size[0] * size[1] == n:
        return int(size[0]), int(size[1])
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"{type(m).__name__}: {n} tokens are not a square grid")
    return side, side


# --------------------------------------------------------------------------------------- real inputs
@torch.no_grad()
def capture_inputs(
    model: nn.Module, x: torch.Tensor, layers: Sequence[tuple[str, nn.Module]] | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Feed ``x`` through ``model`` (eval mode, restored after) and return ({layer name: its input}, logits).

    Inputs are captured by forward pre-hooks, so they are what each layer really receives inside the network
    ([ConViT21] Fig. 5 is computed on these, not on random tensors).
    """

    layers = list(layers) if layers is not None else attention_modules(model)
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach()))
        for name, m in layers
    ]
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        logits = model(x.to(device)).detach()
    finally:
        for hk in hooks:
            hk.remove()
        model.train(was_training)
    return inputs, logits


def _head_values(m: nn.Module, name: str) -> list[float] | None:
    fn = getattr(m, name, None)
    if not callable(fn):
        return None
    try:
        v = fn().detach().double().cpu().reshape(-1)
    except (TypeError, NotImplementedError):
        return None
    return None if bool(torch.isnan(v).all()) else v.tolist()


@torch.no_grad()
def layer_stats(model: nn.Module, probe: torch.Tensor) -> dict[str, dict[str, list[float]]]:
    """Per attention layer, per head: ``inv_alpha`` (1/alpha_h, [TCNN21] Eq. 3-4), ``gate`` (sigma(lambda_h),
    Eq. 7; only for gated layers) and ``nonlocality`` ([ConViT21] Eq. 8, on the layer's real input for ``probe``).
    The same shape for every attention model; {} without attention layers."""

    layers = attention_modules(model)
    if not layers or probe.numel() == 0:
        return {}
    inputs, _ = capture_inputs(model, probe, layers)
    out: dict[str, dict[str, list[float]]] = {}
    for name, m in layers:
        if name not in inputs:  # not on the forward path
            continue
        rec: dict[str, list[float]] = {}
        alpha = _head_values(m, "alpha")
        if alpha is not None:
            rec["inv_alpha"] = [1.0 / a for a in alpha]
        gate = _head_values(m, "gate")
        if gate is not None:
            rec["gate"] = gate
        x = inputs[name]
        if callable(getattr(m, "nonlocality", None)):
            nl = m.nonlocality(x)
        else:
            attn = m.attention_maps(x)
            if is_positional(m):
                h, w, s = *attention_grid(m, x), _stride(m)
            else:
                (h, w), s = _square_grid(m, x, int(attn.shape[-1])), 1
            nl = nonlocality(attn, grid_distances(h, w, s, device=attn.device))
        rec["nonlocality"] = nl.detach().double().cpu().reshape(-1).tolist()
        out[name] = rec
    return out


def long_rows(history: Iterable[Mapping[str, Any]], key: str = "gpsa") -> list[dict[str, Any]]:
    """One row per (epoch, layer, head) with inv_alpha, gate, nonlocality (None where a layer lacks one, e.g.
    the gate of a PSA): the gpsa.csv of the finetune stage, read by `core.viz.report_plots.gpsa_dynamics`."""
    rows = []
    for row in history:
        for layer, s in (row.get(key) or {}).items():
            heads = max((len(v) for v in s.values()), default=0)
            for h in range(heads):
                rec: dict[str, Any] = {"epoch": row["epoch"], "layer": layer, "head": h}
                for q in ("inv_alpha", "gate", "nonlocality"):
                    vals = s.get(q) or []
                    rec[q] = vals[h] if h < len(vals) else None
                rows.append(rec)
    return rows


def dynamics_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Long per-(epoch, layer, head) rows (:func:`long_rows` or gpsa.csv) as a typed pyarrow table."""
    rows = list(rows)

    def num(v: Any) -> float | None:
        return None if v is None or v == "" else float(v)

    return pa.table(
        {
            "epoch": pa.array([int(float(r["epoch"])) for r in rows], pa.int64()),
            "layer": pa.array([str(r["layer"]) for r in rows], pa.string()),
            "head": pa.array([int(float(r["head"])) for r in rows], pa.int64()),
            **{
                q: pa.array([num(r.get(q)) for r in rows], pa.float64())
                for q in ("inv_alpha", "gate", "nonlocality")
            },
        }
    )


# ------------------------------------------------------------------------------------ centre queries
@dataclass
class LayerAttention:
    """The attention of one query of a GPSA layer, per head, over the layer's input pixels (keys)."""

    name: str
    maps: (
        np.ndarray
    )  # [heads, h, w]: A^h_{q, j} for the chosen query q, keys j on the input grid ([TCNN21] Eq. 7)
    query: tuple[int, int]  # (row, col) of the query on the input grid
    grid: tuple[int, int]  # (h, w) of the layer input
    stride: int  # query stride (1 for stride_mode "s1": the attention runs at stride 1 before pooling)
    gate: np.ndarray  # sigma(lambda_h) [heads]
    inv_alpha: np.ndarray  # 1 / alpha_h [heads]
    centers: np.ndarray  # Delta_h [heads, 2] (row, col)


def _centre_index(n_keys: int, n_queries: int, stride: int) -> int:
    centre = (n_keys - 1) / 2
    return int(np.argmin([abs(i * stride - centre) for i in range(n_queries)]))


@torch.no_grad()
def centre_query_maps(model: nn.Module, x: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
    """[TCNN21] Fig. 5 for any attention model: feed one image ``x`` [1, C, H, W] through ``model`` and return,
    per attention layer, the attention of the query nearest the centre of its grid over the layer's input
    grid, per head, as `LayerAttention` (gate / 1/alpha / centres NaN where a layer has
    none), plus the logits. ConViT layers: the maps cover the patch tokens (the class token joins later)."""
    if x.ndim != 4 or x.shape[0] != 1:
        raise ValueError(f"centre_query_maps: expected one image [1, C, H, W], got {tuple(x.shape)}")
    inputs, logits = capture_inputs(model, x)

    out = []
    for name, m in attention_modules(model):
        if name not in inputs:
            continue
        inp = inputs[name]
        att = m.attention_maps(inp)[0].double().cpu()  # [heads, Lq, L]
        if is_positional(m):
            h, w = attention_grid(m, inp)
            s = _stride(m)
        else:  # e.g. AA layers attend on their (pooled) attention grid, queries = keys
            h, w = _square_grid(m, inp, int(att.shape[-1]))
            s = 1
        hq, wq = -(-h // s), -(-w // s)
        if att.shape[1] != hq * wq or att.shape[2] != h * w:
            raise ValueError(f"centre_query_maps: {name}: unexpected attention shape {tuple(att.shape)}")
        qr, qc = _centre_index(h, hq, s), _centre_index(w, wq, s)
        nh = att.shape[0]

        def vals(attr: str, shape: tuple[int, ...], m: nn.Module = m) -> np.ndarray:
            fn = getattr(m, attr, None)
            if callable(fn):
                return fn().detach().double().cpu().numpy().reshape(shape)
            return np.full(shape, np.nan)

        alpha = vals("alpha", (nh,))
        out.append(
            LayerAttention(
                name=name,
                maps=att[:, qr * wq + qc, :].reshape(nh, h, w).numpy(),
                query=(qr * s, qc * s),
                grid=(h, w),
                stride=s,
                gate=vals("gate", (nh,)),
                inv_alpha=1.0 / alpha,
                centers=vals("centers", (nh, 2)),
            )
        )
    return out, logits.cpu()


# ------------------------------------------------------------------------------------ mass contours
@dataclass
class Contour:
    """The smallest set of keys holding at least ``level`` of the attention mass (highest values first)."""

    level: float  # requested fraction of the map's total mass
    threshold: float  # the set is {A >= threshold}
    mask: np.ndarray  # [h, w] bool
    area: int  # number of keys in the set
    mass: float  # fraction of the total mass it really holds (>= level)


def mass_contours(attn_map: np.ndarray, levels: Sequence[float] = CONTOUR_LEVELS) -> list[Contour]:
    """Highest-density regions of one attention map [h, w]: for each level f, the smallest set of keys whose
    attention sums to at least f of the map's total (ties at the threshold included), with its threshold.
    Contours of the map at these thresholds enclose 90/50/10 % of the mass."""
    a = np.asarray(attn_map, dtype=np.float64)
    if a.ndim != 2 or not np.isfinite(a).all() or (a < 0).any():
        raise ValueError("mass_contours: need a finite non-negative 2-D map")
    total = float(a.sum())
    if total <= 0:
        raise ValueError("mass_contours: the map has no mass")
    flat = np.sort(a.reshape(-1))[::-1]
    cum = np.cumsum(flat) / total
    out = []
    for f in levels:
        if not 0 < f <= 1:
            raise ValueError(f"mass_contours: level {f} outside (0, 1]")
        k = int(np.searchsorted(cum, f - 1e-12))  # first index where the cumulative mass reaches f
        t = float(flat[min(k, flat.size - 1)])
        mask = a >= t
        out.append(Contour(float(f), t, mask, int(mask.sum()), float(a[mask].sum() / total)))
    return out
