"""Geometry of attention on a pixel grid: query-key distances and the nonlocality of [ConViT21] Eq. 8 (one
definition, used by every attention layer's statistics and by the dissection)."""

from __future__ import annotations

from typing import Any

import torch


def grid_distances(
    h: int, w: int, stride: int = 1, *, dtype: torch.dtype = torch.float64, device: Any = None
) -> torch.Tensor:
    """|delta_ij| [Lq, L] between queries at (r s, c s) (r < ceil(h/s), c < ceil(w/s)) and keys on the h x w
    grid, both row-major, in input pixels."""
    hq, wq = -(-h // stride), -(-w // stride)
    rq = torch.arange(0, hq * stride, stride, dtype=dtype, device=device)
    cq = torch.arange(0, wq * stride, stride, dtype=dtype, device=device)
    dr = torch.arange(h, dtype=dtype, device=device)[None, :] - rq[:, None]
    dc = torch.arange(w, dtype=dtype, device=device)[None, :] - cq[:, None]
    return (dr[:, None, :, None] ** 2 + dc[None, :, None, :] ** 2).sqrt().reshape(hq * wq, h * w)


def nonlocality(attn: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """[ConViT21] Eq. 8 per head: D_loc^h = (1/L) sum_ij A^h_ij |delta_ij| for attention [..., heads, Lq, L] and
    distances [Lq, L]; leading (batch) dimensions are averaged. Average the result over heads for D_loc^l."""
    d = (attn.double() * distances.double()).sum(dim=(-2, -1)) / attn.shape[-2]
    return d.reshape(-1, attn.shape[-3]).mean(0)
