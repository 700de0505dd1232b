"""``linear(x, W, b) = x W^T + b`` through oneDNN's 1x1 convolution on CPU float32 (F.linear elsewhere).

Why not ``F.linear``: on CPU, PyTorch runs float32 GEMMs through MKL, whose dispatcher picks its generic
(non-AVX-512) SGEMM kernels on AMD CPUs - half the throughput of the oneDNN kernels the CNN's convolutions get
on the same machine (benchmarks/gemm.py on a 2-core AMD EPYC with AVX-512: the T-CNN's 3136 x 4536 x 504 output
GEMM takes 79 ms in MKL vs 36 ms in oneDNN, forward + backward 250 vs 135 ms; 1.8-2.2x at every GPSA shape).
Forcing MKL's AVX-512 path on AMD (the ``mkl_serv_intel_cpu_true`` shim) gives wrong results, so it is not an
option. oneDNN runs a GEMM as a 1x1 convolution when the rows are laid out as one channels-last image of M x 1
pixels with K channels: no copy in or out (the output [1, N, M, 1] channels-last is the [M, N] result), forward
and backward both in oneDNN. Same float32 arithmetic; results differ from MKL's by rounding only (relative 1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear", "use_onednn"]


def use_onednn(x: torch.Tensor) -> bool:
    """oneDNN route for float32 CPU tensors when PyTorch was built with it (else ``F.linear``)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` semantics ([..., K] x [N, K] -> [..., N]); see the module docstring for the route."""
    if not use_onednn(x) or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return F.linear(x, weight, bias)
    k, n = weight.shape[1], weight.shape[0]
    rows = x.reshape(-1, k).contiguous()  # a view for the usual contiguous x
    m = rows.shape[0]
    image = rows.view(1, m, 1, k).permute(0, 3, 1, 2)  # [1, K, M, 1] channels-last: one image, M pixels
    out = F.conv2d(image, weight[:, :, None, None], bias)  # [1, N, M, 1], channels-last
    return out.permute(0, 2, 3, 1).reshape(*x.shape[:-1], n)
