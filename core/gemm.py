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

__all__ = ["BACKWARD_ENV", "linear", "onednn_backward", "project", "use_onednn"]

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


def _blas_grads(
    ctx: Any, rows: torch.Tensor, weight: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``rows W^T + b`` for the upstream ``g`` [M, N] as two BLAS GEMMs and a column sum."""
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    gx = torch.mm(g, weight) if need_x else None
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
