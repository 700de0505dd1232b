"""The T-CNN's gated positional self-attention ([TCNN21] Sec. 2): a GPSA shaped like the conv it replaces.

One head per kernel tap, every head sees all input channels: one value projection W_val [D_in, D_in] shared by
the heads (init identity), and a per-head output projection W_out^h = W_filter[:, :, tap(h)]; ``weight`` IS the
conv filter [D_out, D_in, k, k] (same name and shape as the conv parameter it replaces). Head h <-> tap
(h // k, h % k) (row-major, the order of ``weight.flatten(2)``), center Delta^h = dilation * (h // k - k // 2,
h % k - k // 2) in (row, col). Input and output are NCHW maps.

Zero padding is emulated: the positional softmax runs over the zero-padded key grid (padded keys have value 0
and only take their share of the softmax mass, exactly as the conv's zero padding does); the content softmax
runs over the real pixels only. Stride s: ``stride_mode="exact"`` computes the queries at the conv's output
positions (0, s, 2s, ...) only - identical to stride-1 attention followed by [::s, ::s], at 1/s^2 the cost;
``stride_mode="s1"`` is BoTNet's choice: stride-1 attention followed by an s x s average pool (ceil mode, no
padded zeros counted) - not function-preserving.

Paths (the shared machinery is in `core.nn.gpsa`): ``attn_impl="auto"`` takes the dense path on CPU at every
map size, because SDPA's fused kernel does not apply (it needs equal q/k/v head widths; T-CNN values are D_in
wide per head) and its math fallback would materialise the attention anyway. The dense path
(`TcnnGPSA._forward_dense`) reads the NCHW map in place, folds W_val into the output weight and ends in the
conv's own im2col-shaped GEMM (heads * D_in -> D_out). Its attention core (softmax, gated mix, A.X) runs by
default through the C++/OpenMP kernel (``cpp_attention``, `core.nn.gated_attention_cpp`: one image per thread,
the maps recomputed in backward) where it applies, else through `_attend_reference` (autograd's graph of the
plain ops, the reference the tests compare against); its output GEMM as a 1x1 convolution (``conv_output``,
default on). Opt-in (``fused_attention``): the attention as one Python autograd node over chunks of images
(`core.nn.gated_attention`). All equal to the reference to float32 precision; speeds in docs/benchmarks.md.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.gated_attention import gated_attention
from core.nn.gated_attention_cpp import available as cpp_available
from core.nn.gated_attention_cpp import gated_attention_cpp, gated_attention_cpp_qk
from core.nn.gated_mix import gated_mix
from core.nn.gpsa import GPSA
from core.nn.positional import STRIDE_MODES

__all__ = ["TcnnGPSA"]


class TcnnGPSA(GPSA):
    """The T-CNN GPSA ([TCNN21] Sec. 2; module docstring): [B, D_in, H, W] -> [B, D_out, H', W'].

    Args:
        in_dim: input channels D_in.
        out_dim: output channels (default in_dim).
        num_heads: kernel_size ** 2 (one per tap) or None.
        kernel_size, stride, dilation: the conv's geometry (odd square kernel,
            padding = dilation * (kernel_size - 1) // 2).
        stride_mode: "exact" or "s1" (with stride > 1).
        qk_head_dim: per-head query/key width (default ceil(D_in / heads), so W_qry, W_key are about
            D_in x D_in as in [TCNN21] Sec. 2).
        qkv_bias, bias, positional, alpha_init, lambda_init, proj_drop, attn_impl: see `core.nn.gpsa.GPSA`.
    """

    mode: ClassVar[str] = "tcnn"
    auto_dense_max_tokens: ClassVar[float] = math.inf
    #: The dense path's attention through `core.nn.gated_attention` (one autograd node, chunked, hand-written
    #: backward); False (default): autograd's graph of the plain ops (`_attend_reference`), the reference.
    #: Off by default: faster with 1 thread, slower with 2 on a loaded 2-core EPYC (benchmarks/gpsa_resnet20.py).
    fused_attention: bool = False
    #: The dense path's attention through the C++/OpenMP kernel (`core.nn.gated_attention_cpp`: one image per
    #: thread, the maps recomputed in backward) where it applies (`_cpp_ok`): CPU, float32/64, no autocast, not
    #: while tracing, the extension built; otherwise the paths below.
    cpp_attention: bool = True
    #: The output GEMM as a 1x1 convolution (oneDNN's kernels; the default: MKL's ``F.linear`` runs at about a third
    #: of oneDNN's FLOP rate on AMD CPUs); False: ``F.linear`` (the BLAS's).
    conv_output: bool = True

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None = None,
        num_heads: int | None = None,
        *,
        kernel_size: int = 3,
        stride: int = 1,
        dilation: int = 1,
        stride_mode: str = "exact",
        qk_head_dim: int | None = None,
        qkv_bias: bool = False,
        bias: bool = True,
        positional: str = "softplus",
        alpha_init: float = 1.0,
        lambda_init: float = 1.0,
        proj_drop: float = 0.0,
        attn_impl: str = "auto",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if stride_mode not in STRIDE_MODES:
            raise ValueError(f"TcnnGPSA: stride_mode must be one of {STRIDE_MODES}, got {stride_mode!r}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"TcnnGPSA: kernel_size must be odd, got {kernel_size}")
        if num_heads not in (None, kernel_size**2):
            raise ValueError(f"TcnnGPSA: num_heads must be kernel_size**2 = {kernel_size**2}")
        if stride < 1 or dilation < 1:
            raise ValueError(f"TcnnGPSA: stride and dilation must be >= 1, got {stride}, {dilation}")
        out_dim = in_dim if out_dim is None else out_dim
        heads = kernel_size**2
        super().__init__(
            in_dim, out_dim, heads, (out_dim, in_dim, kernel_size, kernel_size),
            kernel_size=kernel_size, stride=stride, dilation=dilation, stride_mode=stride_mode,
            qk_head_dim=qk_head_dim or math.ceil(in_dim / heads), qkv_bias=qkv_bias, bias=bias,
            positional=positional, alpha_init=alpha_init, lambda_init=lambda_init, proj_drop=proj_drop,
            attn_impl=attn_impl, device=device, dtype=dtype,
        )  # fmt: skip

    @classmethod
    def from_conv(
        cls,
        conv: nn.Conv2d,
        *,
        alpha_init: float = 1.0,
        lambda_init: float = 1.0,
        stride_mode: str = "exact",
        **kwargs: Any,
    ) -> TcnnGPSA:
        """The T-CNN GPSA computing ``conv`` ([TCNN21] Sec. 2): weight = filter, bias = conv bias, W_val = I."""
        return super().from_conv(
            conv, alpha_init=alpha_init, stride_mode=stride_mode, lambda_init=lambda_init, **kwargs
        )

    def tap_offsets(self) -> torch.Tensor:
        """Conv-like centers [heads, 2] (row, col): head h <-> tap (h // k, h % k), row-major, dilated."""
        return self.conv_tap_offsets()

    def _reset_weight(self) -> None:
        """The filter's default init (nn.Conv2d's); `from_conv` overwrites it with the conv's filter."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def _geometry_repr(self) -> str:
        return (
            f", kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}"
            f", stride_mode={self.stride_mode}"
        )

    def _tokens(self, x: torch.Tensor, size: tuple[int, int] | None) -> tuple[torch.Tensor, int, int]:
        """NCHW map -> tokens [B, L, C] and its grid (h, w); ``size`` is ignored (the map carries its grid)."""
        if x.ndim != 4:
            raise ValueError(f"TcnnGPSA expects [B, C, H, W], got shape {tuple(x.shape)}")
        b, c, h, w = x.shape
        return x.permute(0, 2, 3, 1).reshape(b, h * w, c), h, w

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """[B, D_in, H, W] -> [B, D_out, H', W'] (``size`` is accepted for the shared signature, and ignored)."""
        if self._use_dense(x.device, x.shape[-2] * x.shape[-1]):
            return self._forward_dense(x)
        tokens, h, w = self._tokens(x, size)
        q, k, v = self._project_qkv(tokens, h, w)
        hq, wq, _ = self._query_size(h, w)
        y = self._mix(q, k, v, h, w)  # [B, Lq, D_out], output projection and bias included
        return self._finish(y.view(x.shape[0], hq, wq, self.out_dim).permute(0, 3, 1, 2))

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        """The s1 stride's average pool (BoTNet's choice) and the output dropout."""
        if self.stride > 1 and self.stride_mode == "s1":
            out = F.avg_pool2d(out, self.stride, self.stride, ceil_mode=True, count_include_pad=False)
        return self.proj_drop(out)

    def _forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Dense path: out_i = sum_h sum_j A^h_ij V_j W_out^h + b ([TCNN21] Eq. 5), conv-shaped GEMMs.

        Works on the NCHW map as it comes (no token copy of the input):
        1. q^T, k^T [B, heads, d, L] straight from the [B, C, L] view of x: a 1x1-conv-shaped GEMM per image
           (queries only at the output positions for an exact stride), as views of the projections' outputs
           (NCHW or channels-last; the C++ kernel reads them as they are, q and k as one tensor at stride 1);
        2. A^h = (1 - sigma(lambda_h)) softmax(q k^T / sqrt(d)) + sigma(lambda_h) P^h, stored [B, Lq, heads, L]
           (the batch-shared P^h comes from the cache);
        3. Y = A X: batched matmuls [B, Lq * heads, L] @ [B, L, C] reading x's NCHW view transposed. Steps 2-3
           are the C++ kernel (``cpp_attention``, `core.nn.gated_attention_cpp`; the default where it applies),
           `_attend_reference` (autograd's graph of the plain ops; the reference) or, with ``fused_attention``,
           one autograd node, `core.nn.gated_attention.gated_attention` (a chunk of images at a time, the maps
           recomputed in backward, a hand-written backward);
        4. out = Y W2^T + b with W2 = [W_out^h W_val]_h, [D_out, heads * D_in]: one GEMM with the conv's own
           im2col shape (M = B * Lq, K = heads * D_in, N = D_out), the bias fused in, run as a 1x1 convolution
           (``conv_output``: as a 1x1 convolution of Y's channels-last view, oneDNN's kernels; the GEMM alone
           2.6x faster than MKL's ``F.linear`` on an AMD EPYC with 1 thread); an NCHW view of a channels-last
           result (BatchNorm and the residual add take it as is).
        W_val is folded into the output weight (V never materialised) whenever that is cheaper: always when the
        folded weight is reused (autograd off: cached until a parameter changes), otherwise when
        B * L >= heads * D_out (the fold costs heads * D_out * D_in^2 multiply-adds, the projection B * L * D_in^2).
        Same function up to float rounding (at the init W_val = I and the fold is exact).

        Projections run as 1x1 convolutions (`_project`), the output GEMM as one 1x1 convolution (or ``F.linear``).
        """
        if x.ndim != 4:
            raise ValueError(f"TcnnGPSA expects [B, C, H, W], got shape {tuple(x.shape)}")
        b, c, h, w = x.shape
        hq, wq, s = self._query_size(h, w)
        lk, lq = h * w, hq * wq
        nh, dq, cout = self.num_heads, self.qk_head_dim, self.out_dim
        grad = torch.is_grad_enabled()
        fold = self.qkv_bias is None and (not grad or b * lk >= nh * cout)
        xs = x.flatten(2)  # [B, C, L]: a view for NCHW and channels_last inputs
        qk = nh * dq
        wqkv, bqkv = self.qkv_weight, self.qkv_bias
        # [B, heads, d, L] views of the projections' outputs, NCHW or channels-last (no copy)
        qk_one = s == 1 and bqkv is None
        if qk_one:  # one GEMM for q and k: rows (head, q|k, d), one block per head
            both = self._project(x, self._cached(("qk_rows",), self._qk_rows), None, 1)
            both = both.unflatten(1, (nh, 2 * dq))
            qt, kt = both[:, :, :dq], both[:, :, dq:]
        else:
            bq, bk = (None, None) if bqkv is None else (bqkv[:qk], bqkv[qk : 2 * qk])
            qt = self._project(x, wqkv[:qk], bq, s).unflatten(1, (nh, dq))
            kt = self._project(x, wqkv[qk : 2 * qk], bk, 1).unflatten(1, (nh, dq))
        if fold:
            vt = xs
        else:
            vt = self._project(x, wqkv[2 * qk :], None if bqkv is None else bqkv[2 * qk :], 1)
        cpp = self._cpp_ok(qt, kt, vt)
        if cpp or self._fused_ok(qt, kt, vt):
            act = qt.dtype
            g_con = self._gates(act)[1]
            pos = self._gated_positional(h, w, act)
            if cpp and qk_one:  # q and k as the one projection output, its gradient one tensor in its strides
                y = gated_attention_cpp_qk(both, vt, pos, g_con, dq**-0.5)  # [B, Lq * heads, C]
            elif cpp:
                y = gated_attention_cpp(qt, kt, vt, pos, g_con, dq**-0.5)
            else:
                y = gated_attention(qt.flatten(0, 1), kt.flatten(0, 1), vt, pos, g_con, dq**-0.5)
        else:  # [B * heads, d, L]: views for NCHW inputs, copies for channels-last ones
            y = self._attend_reference(qt.flatten(0, 1), kt.flatten(0, 1), vt, h, w)
        w2 = self._cached(("w2", fold), lambda: self._out_weight(fold))
        if self.conv_output:  # the same GEMM as a 1x1 convolution over the channels-last view of Y (oneDNN)
            out = F.conv2d(y.view(b, hq, wq, nh * c).permute(0, 3, 1, 2), w2[:, :, None, None], self.bias)
        else:
            out = F.linear(y.view(b * lq, nh * c), w2, self.bias).view(b, hq, wq, cout).permute(0, 3, 1, 2)
        return self._finish(out)

    def _cpp_ok(self, *ts: torch.Tensor) -> bool:
        """Whether the C++ kernel (`core.nn.gated_attention_cpp`) computes this call: ``cpp_attention`` on, CPU,
        one float32/64 dtype, no autocast, not tracing (a traced graph holds only aten ops) and the extension
        built (`cpp_available`; otherwise one log line and the Python paths)."""
        dt = ts[0].dtype
        return (
            self.cpp_attention
            and ts[0].device.type == "cpu"
            and dt in (torch.float32, torch.float64)
            and all(t.dtype == dt for t in ts)
            and not torch.is_autocast_enabled("cpu")
            and not torch.jit.is_tracing()
            and cpp_available()
        )

    def _fused_ok(self, *ts: torch.Tensor) -> bool:
        """Whether `core.nn.gated_attention` computes this call: ``fused_attention`` on, one dtype throughout
        and no autocast (its hand-written backward does not re-cast); otherwise `_attend_reference`."""
        dt = ts[0].dtype
        return (
            self.fused_attention
            and all(t.dtype == dt for t in ts)
            and not torch.is_autocast_enabled(ts[0].device.type)
        )

    def _attend_reference(
        self, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, h: int, w: int
    ) -> torch.Tensor:
        """Y = A X [B, Lq * heads, C] through autograd's graph of the plain ops (the reference the fused
        `core.nn.gated_attention.gated_attention` is tested against; also its fallback under autocast)."""
        bn, dq, lq = qt.shape
        b, _, lk = vt.shape
        nh = bn // b
        scores = torch.baddbmm(
            qt.new_zeros(()).expand(bn, lq, lk), qt.transpose(1, 2), kt, beta=0.0, alpha=dq**-0.5
        )
        attn = scores.view(b, nh, lq, lk).softmax(dim=-1)
        act = attn.dtype
        g_con = self._gates(act)[1]
        pos = self._gated_positional(h, w, act)
        # mixed attention, stored [B, Lq, heads, L] so that Y's rows come out in (query, head) order
        attn = gated_mix(attn, pos, g_con[:, None, None], (0, 2, 1, 3), probs=True)
        return torch.bmm(attn.transpose(1, 2).reshape(b, lq * nh, lk), vt.transpose(1, 2))

    def _qk_rows(self) -> torch.Tensor:
        """W_q, W_k rows reordered to (head, q|k, d): one projection GEMM yields [B, heads, 2 d, L] blocks."""
        nh, dq = self.num_heads, self.qk_head_dim
        wqk = self.qkv_weight[: 2 * nh * dq].view(2, nh, dq, self.in_dim)
        return wqk.transpose(0, 1).reshape(2 * nh * dq, self.in_dim)

    @staticmethod
    def _project(x: torch.Tensor, wgt: torch.Tensor, bias: torch.Tensor | None, stride: int) -> torch.Tensor:
        """``wgt @ x + bias`` at every ``stride``-th pixel of the NCHW map x: [B, rows, L'], as a 1x1
        convolution (oneDNN on CPU; the weight gradient is one GEMM).
        Faster than a batched matmul against the weight expanded over the batch, in eval too
        (benchmarks/gpsa.py).
        """
        return F.conv2d(x, wgt[:, :, None, None], bias, stride=stride).flatten(2)

    def _out_weight(self, fold: bool) -> torch.Tensor:
        """[D_out, heads * D_in] with columns (head, channel): W_out^h = weight[:, :, tap(h)], times W_val if
        ``fold`` (sum_h A^h X W_val^T W_out^h^T = sum_h (A^h X) (W_out^h W_val)^T)."""
        nh, cout, cin = self.num_heads, self.out_dim, self.in_dim
        if not fold:
            return self.weight.permute(0, 2, 3, 1).reshape(cout, nh * cin)
        wv = self.qkv_weight[2 * nh * self.qk_head_dim :]
        wf = torch.matmul(self.weight.permute(2, 3, 0, 1).reshape(nh * cout, cin), wv)  # rows (tap, out)
        return wf.view(nh, cout, cin).transpose(0, 1).reshape(cout, nh * cin)

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """SDPA path (the dense one is `_forward_dense`): attention and output projection,
        out_i = sum_h sum_j A^h_ij V_j W_out^h + b ([TCNN21] Eq. 5).

        q: [B, Lq, heads, d], k: [B, L, heads, d], v: [B, L, C] (shared by the heads). Returns [B, Lq, D_out].
        """
        b, lq, nh, _ = q.shape
        lk, c = v.shape[1], v.shape[2]
        act = v.dtype
        g_con = self._gates(act)[1]
        hq, wq, _ = self._query_size(h, w)
        qh, kh = q.transpose(1, 2), k.transpose(1, 2)
        con = F.scaled_dot_product_attention(qh, kh, v[:, None].expand(b, nh, lk, c))  # [B, heads, Lq, C]
        py, px = self._gated_factors(h, w, act)
        pos = self._apply_positional(v.view(b, h, w, c), py, px, shared=True)
        y = gated_mix(con.permute(0, 2, 1, 3).reshape(b, hq, wq, nh, c), pos, g_con[:, None])
        # y: (head, channel) order per query; W_out^h = weight[:, :, tap(h)]
        w2 = self._cached(("w2", False), lambda: self._out_weight(False))
        return F.linear(y.reshape(b, lq, nh * c), w2, self.bias)
