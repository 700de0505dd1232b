"""The gated mix of GPSA ([TCNN21] Eq. 7; [ConViT21] Eq. 6): ``pos + con * g_con``, the convex mix of the content and
positional attention with sigma(lambda) already folded into ``pos``, as one fused op with a 3-pass backward; and the
flush of subnormal probabilities that keeps CPU matmuls fast (core.nn.gpsa, core.nn.gpsa_tcnn, core.nn.gpsa_convit).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _flush_tiny(p: torch.Tensor) -> torch.Tensor:
    """Zero the (non-negative) probabilities below sqrt(smallest normal): 1e-19 in float32.

    Softmaxes underflow into subnormal numbers far from the attention center, and matmuls with subnormal
    operands run many times slower on x86 CPUs (benchmarks/gpsa.py measures it). Products of two kept
    factors stay normal. The change is below 1e-19 absolute, far under float precision. Only for float32/64
    (the positional softmaxes are always computed in one of them).
    """
    return F.threshold(p, torch.finfo(p.dtype).tiny ** 0.5, 0.0)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Positional softmaxes run in float32 at least (float64 when the module is float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mix(
    con: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, perm: tuple | None, probs: bool
) -> torch.Tensor:
    """The forward of `_GatedMix`: ``pos + con * g_con`` in ``con``'s layout (or ``perm`` of it), flushed."""
    if perm is None:
        out = torch.empty_like(con, memory_format=torch.contiguous_format)
    else:  # allocate physically in the permuted order, return in con's logical order
        inv = [perm.index(i) for i in range(con.ndim)]
        out = con.new_empty([con.shape[i] for i in perm]).permute(inv)
    torch.addcmul(pos, con, g_con, out=out)
    if probs and out.device.type == "cpu" and out.dtype in (torch.float32, torch.float64):
        F.threshold_(out, torch.finfo(out.dtype).tiny ** 0.5, 0.0)  # mixed attention: see _flush_tiny
    return out


class _GatedMix(torch.autograd.Function):
    """y = pos + con * g_con (broadcast), written in ``con``'s memory layout (or ``perm`` of it).

    The convex mix of [TCNN21] Eq. 7 with sigma(lambda) already folded into ``pos``. A fused forward and a
    3-pass backward (lerp's autograd takes 5 passes over the activation); ``pos``'s gradient is ``gy`` itself.
    """

    @staticmethod
    def forward(
        ctx: Any, con: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, perm: tuple | None, probs: bool
    ) -> torch.Tensor:
        out = _mix(con, pos, g_con, perm, probs)
        ctx.save_for_backward(con, g_con)
        ctx.pos_shape = pos.shape
        return out

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        con, g_con = ctx.saved_tensors
        d_con = gy * g_con if ctx.needs_input_grad[0] else None
        d_pos = gy.sum_to_size(ctx.pos_shape) if ctx.needs_input_grad[1] else None
        d_g = (gy * con).sum_to_size(g_con.shape) if ctx.needs_input_grad[2] else None
        return d_con, d_pos, d_g, None, None


def gated_mix(
    con: torch.Tensor,
    pos: torch.Tensor,
    g_con: torch.Tensor,
    perm: tuple | None = None,
    *,
    probs: bool = False,
) -> torch.Tensor:
    """``pos + con * g_con``; ``probs``: the operands are attention probabilities (flush subnormals).

    With autograd off (evaluation) the same ops run without the autograd.Function, so that a traced graph
    holds only aten ops (`core.training.inference` traces and freezes it)."""
    if not torch.is_grad_enabled():
        return _mix(con, pos, g_con, perm, probs)
    return _GatedMix.apply(con, pos, g_con, perm, probs)
