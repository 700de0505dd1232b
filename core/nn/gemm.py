"""The GPSA's GEMMs on CPU float32: forward through oneDNN, backward through oneDNN or BLAS by CPU.

``linear(x, W, b) = x W^T + b`` (F.linear semantics) and ``project(x, W, b, stride)``, the 1x1 projection of an
NCHW map ([B, C, H, W] -> [B, N, H', W']); F.linear / F.conv2d off CPU float32.

Why not plain ``F.linear``: on CPU, PyTorch runs float32 GEMMs through MKL, and which kernels MKL picks depends
on the CPU. Measured side by side (benchmarks/gemm.py, 2 threads):
- AMD EPYC with AVX-512: MKL's dispatcher takes its generic (non-AVX-512) SGEMM kernels on AMD, half the
  throughput of oneDNN's (the T-CNN's 3136 x 4536 x 504 output GEMM: 79 vs 36 ms forward, forward + backward
  250 vs 135 ms; 1.8-2.2x at every GPSA shape). Forcing MKL's AVX-512 path on AMD (the
  ``mkl_serv_intel_cpu_true`` shim) gives wrong results, so it is not an option.
- AMD EPYC (Zen 3) with AVX2 only: forward about equal (oneDNN 0.99-1.19x as fast), but oneDNN's backward
  (the 1x1 convolution's data and weight gradients) is 1.5-1.9x slower than MKL's two GEMMs.
So the forward always runs in oneDNN, and the backward in oneDNN only on AVX-512 CPUs that are not Intel's
(where MKL is slow); elsewhere (AVX2, Intel) in BLAS (``torch.mm``, MKL), see `onednn_backward`. The environment
variable ``TCNN_GEMM_BACKWARD`` = ``onednn`` | ``blas`` | ``auto`` (default) overrides the choice.

oneDNN runs a GEMM as a 1x1 convolution when the rows are laid out as one channels-last image of M x 1 pixels with
K channels: no copy in or out (the output [1, N, M, 1] channels-last is the [M, N] result). Same float32
arithmetic on every route; results differ from F.linear's by rounding only (relative 1e-6).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BACKWARD_ENV", "linear", "linear_split", "onednn_backward", "project", "use_onednn"]

BACKWARD_ENV = "TCNN_GEMM_BACKWARD"
_BACKWARD_CHOICES = ("auto", "onednn", "blas")


def use_onednn(x: torch.Tensor) -> bool:
    """oneDNN route for float32 CPU tensors when PyTorch was built with it (else ``F.linear``)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _cpu_vendor() -> str:
    """The CPU vendor string of Linux's /proc/cpuinfo ("AuthenticAMD", "GenuineIntel", ...), or "" if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def _auto_onednn_backward() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and _cpu_vendor() != "GenuineIntel"


def onednn_backward() -> bool:
    """Whether the gradients of `linear` / `project` run in oneDNN (else in BLAS); see the module docstring."""
    choice = os.environ.get(BACKWARD_ENV, "auto").strip().lower() or "auto"
    if choice not in _BACKWARD_CHOICES:
        raise ValueError(f"{BACKWARD_ENV} must be one of {_BACKWARD_CHOICES}, got {choice!r}")
    return _auto_onednn_backward() if choice == "auto" else choice == "onednn"


def _needs_blas_backward(*tensors: torch.Tensor | None) -> bool:
    return (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in tensors)
        and not onednn_backward()
    )


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k, n = weight.shape[1], weight.shape[0]
    rows = x.reshape(-1, k).contiguous()  # a view for the usual contiguous x
    m = rows.shape[0]
    image = rows.view(1, m, 1, k).permute(0, 3, 1, 2)  # [1, K, M, 1] channels-last: one image, M pixels
    out = F.conv2d(image, weight[:, :, None, None], bias)  # [1, N, M, 1], channels-last
    return out.permute(0, 2, 3, 1).reshape(*x.shape[:-1], n)


_ROW_BLOCK = 1024
_ROW_BLOCK_FROM = 4096
_ROW_BLOCK_MIN_KN = 65536


def _row_blocked(m: int, b: torch.Tensor) -> bool:
    """Whether `_mm_row_blocks` splits an [m, K] @ b [K, N] GEMM into row blocks."""
    return m >= _ROW_BLOCK_FROM and b.shape[0] * b.shape[1] >= _ROW_BLOCK_MIN_KN


def _mm_row_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; for tall ``a`` (at least `_ROW_BLOCK_FROM` rows) as GEMMs over blocks of `_ROW_BLOCK` rows
    written into one output.

    Why: MKL's 2-thread SGEMM slows down on tall data-gradient GEMMs (M >= 6k rows, N = K_forward <= 512),
    whatever the output's allocation; the same arithmetic in 1024-row blocks runs at its small-M speed. Measured
    side by side on an AMD EPYC Zen 3 (AVX2, 2 threads), one GEMM, whole vs blocks: 8192 x 1134 -> 378 65-77 vs
    47-53 ms, 8192 x 378 -> 378 25 vs 17 ms, 12544 x 756 -> 252 44 vs 32 ms, 6272 x 756 -> 252 20 vs 16 ms;
    3136-row GEMMs are equal either way, and so are small right operands (below `_ROW_BLOCK_MIN_KN` elements:
    6272 x 72 -> 64 took 0.84 ms whole, 1.04 in blocks). Each output row is the same dot products either way.
    """
    return _mm_row_blocks_sum([a], [b])


def _mm_row_blocks_sum(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """``sum_i a_i @ b_i``, in blocks of rows as in `_mm_row_blocks` (each block accumulated in place)."""
    if torch.is_grad_enabled():  # double backward: out= and in-place cannot record a graph
        out = torch.mm(a[0], b[0])
        for ai, bi in zip(a[1:], b[1:]):
            out = torch.addmm(out, ai, bi)
        return out
    m = a[0].shape[0]
    out = a[0].new_empty(m, b[0].shape[1])
    step = _ROW_BLOCK if _row_blocked(m, b[0]) else max(m, 1)
    for i in range(0, m, step):
        o = out[i : i + step]
        torch.mm(a[0][i : i + step], b[0], out=o)
        for ai, bi in zip(a[1:], b[1:]):
            o.addmm_(ai[i : i + step], bi)
    return out


def _blas_grads(
    ctx: Any, rows: torch.Tensor, weight: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``rows W^T + b`` for the upstream ``g`` [M, N] as two BLAS GEMMs and a column sum."""
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    gx = _mm_row_blocks(g, weight) if need_x else None
    gw = torch.mm(g.t(), rows) if need_w else None
    gb = g.sum(0) if need_b else None  # False for a None bias
    return gx, gw, gb


class _Linear(torch.autograd.Function):
    """oneDNN forward, BLAS backward (see the module docstring for when)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        k, n = weight.shape[1], weight.shape[0]
        gx, gw, gb = _blas_grads(ctx, x.reshape(-1, k), weight, gy.reshape(-1, n))
        return (None if gx is None else gx.view(x.shape)), gw, gb


class _LinearSplit(torch.autograd.Function):
    """``(x W_i^T + b_i)_i`` for the row blocks W_i of W: one oneDNN GEMM forward, returned as column views;
    the backward takes the parts' gradients as they come (no concatenation into one [M, N] gradient)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list
    ) -> tuple:
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        return _onednn_linear(x, weight, bias).split(sizes, dim=-1)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        k = weight.shape[1]
        rows = x.reshape(-1, k)
        parts = weight.split(ctx.sizes)
        gs = [g.reshape(-1, w.shape[0]) for g, w in zip(grads, parts)]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = _mm_row_blocks_sum(gs, parts).view(x.shape) if need_x else None
        gw = torch.cat([torch.mm(g.t(), rows) for g in gs]) if need_w else None
        gb = torch.cat([g.sum(0) for g in gs]) if need_b else None
        return gx, gw, gb, None


class _Project(torch.autograd.Function):
    """1x1 projection of an NCHW map: oneDNN forward, BLAS backward on the pixels as rows (channels last)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.conv2d(x, weight[:, :, None, None], bias)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        b, c, h, w = x.shape
        rows = x.permute(0, 2, 3, 1).reshape(b * h * w, c)  # a view for channels-last x
        g = gy.permute(0, 2, 3, 1).reshape(b * h * w, weight.shape[0])
        gx, gw, gb = _blas_grads(ctx, rows, weight, g)
        if gx is not None:
            gx = gx.view(b, h, w, c).permute(0, 3, 1, 2)  # channels-last gradient of x's shape
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` semantics ([..., K] x [N, K] -> [..., N]); see the module docstring for the route."""
    if not use_onednn(x) or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return F.linear(x, weight, bias)
    if _needs_blas_backward(x, weight, bias):
        return _Linear.apply(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def linear_split(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    """``linear(x, weight, bias).split(sizes, dim=-1)``: the GPSA's fused q/k/v projection. On the BLAS backward
    route the parts' gradients go straight into the GEMMs (dX = sum_i dY_i W_i, dW_i = dY_i^T X), without the
    [M, N] concatenation that split's backward would build (at the benchmark's 16x16 shape a 37 MB copy)."""
    if (
        use_onednn(x)
        and x.shape[-1] == weight.shape[1]
        and x.numel() > 0
        and _needs_blas_backward(x, weight, bias)
    ):
        return _LinearSplit.apply(x, weight, bias, list(sizes))
    return linear(x, weight, bias).split(sizes, dim=-1)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int = 1
) -> torch.Tensor:
    """``weight @ x + bias`` at every ``stride``-th pixel of the NCHW map x ([B, C, H, W] -> [B, N, H', W']),
    i.e. a 1x1 ``F.conv2d``; the backward as in `linear`."""
    if use_onednn(x) and x.numel() > 0 and _needs_blas_backward(x, weight, bias):
        if stride > 1:
            x = x[:, :, ::stride, ::stride]
        return _Project.apply(x, weight, bias)
    return F.conv2d(x, weight[:, :, None, None], bias, stride=stride)
