"""Gated positional self-attention (GPSA), in two modes that share one implementation.

GPSA ([ConViT21], Eq. 6-7; [TCNN21], Eq. 7): per head h and query i,

    A^h_ij = (1 - sigma(lambda_h)) softmax_j(Q^h_i . K^h_j / sqrt(d_h)) + sigma(lambda_h) softmax_j(v_pos^h . r_ij)
    out_i  = sum_h sum_j A^h_ij V^h_j W_out^h + b

with the fixed relative encodings r_ij = (|delta|^2, delta_1, delta_2), delta = key position - query position, and
v_pos^h = -alpha_h (1, -2 Delta^h_1, -2 Delta^h_2) ([TCNN21], Eq. 4), i.e. a positional score -alpha_h |delta - Delta^h|^2
up to a per-head constant that cancels in the softmax. A convex mix of two softmaxes is already normalised, so
there is no renormalisation pass ([ConViT21], Eq. 6 writes one; it is the identity up to rounding).

Modes
- ``"convit"``: channels split across heads (D_v = D / heads), ``weight`` is the [D_out, D] output projection,
  input tokens [B, N, C] on a (H, W) grid. Loads timm ConViT GPSA weights (see `_load_timm_keys`).
- ``"tcnn"`` ([TCNN21], Sec. 2): one head per kernel tap, every head sees all input channels: one value projection
  W_val [D_in, D_in] shared by the heads (init identity), and a per-head output projection W_out^h =
  W_filter[:, :, tap(h)]; ``weight`` IS the conv filter [D_out, D_in, k, k] (same name and shape as the conv
  parameter it replaces). Head h <-> tap (h // k, h % k) (row-major, the order of ``weight.flatten(2)``),
  center Delta^h = dilation * (h // k - k // 2, h % k - k // 2) in (row, col). Input and output are NCHW maps.
  Zero padding is emulated: the positional softmax runs over the zero-padded key grid (padded keys have value 0
  and only take their share of the softmax mass, exactly as the conv's zero padding does); the content softmax
  runs over the real pixels only. Stride s: ``stride_mode="exact"`` computes the queries at the conv's output
  positions (0, s, 2s, ...) only - identical to stride-1 attention followed by [::s, ::s], at 1/s^2 the cost;
  ``stride_mode="s1"`` is BoTNet's choice: stride-1 attention followed by an s x s average pool (ceil mode,
  no padded zeros counted) - not function-preserving.

Speed (see benchmarks/gpsa.py). The positional score is separable, -alpha((dy - Dy)^2 + (dx - Dx)^2), so the
positional softmax over a rectangular (padded) key grid is the outer product of a row softmax and a column
softmax: P^h = Py^h (x) Px^h. It is input-independent: computed once per forward for the whole batch (and
reused across forwards while autograd is off and the parameters are unchanged), and applied to the values with
the batch folded into the GEMM: one matmul with the dense P on small maps, one per axis with the factors on
larger ones (cost (H + W) per token instead of H * W). q/k/v come from one fused projection. The content term
goes through ``F.scaled_dot_product_attention`` (``attn_impl="sdpa"``). ``attn_impl="dense"`` instead
materialises the mixed attention once and multiplies it with V in one batched matmul; ``"auto"`` uses it on
CPU for the T-CNN mode, where SDPA's fused kernel does not apply (it needs equal q/k/v head widths; T-CNN
values are D_in wide per head) and its math fallback would materialise the attention anyway, and for the ConViT
mode on maps of at most `_DENSE_MAX_TOKENS` tokens, where it is measured faster. The dense T-CNN
path (`_forward_tcnn_dense`) reads the NCHW map in place, folds W_val into the output weight and ends in the
conv's own im2col-shaped GEMM (heads * D_in -> D_out). Probabilities below 1e-19 are flushed to zero (see
`_flush_tiny`): subnormal operands slow CPU matmuls 10-45x.

What GPSA shares with the ungated `core.nn.psa.PSA` (conv-tap centres, the softplus-rectified alpha, the query
grid of the stride modes, ``from_conv``) is `core.nn.positional.PositionalHeads`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.positional import (
    ALPHA_BETA,
    ALPHA_MIN,
    STRIDE_MODES,
    PositionalHeads,
    relative_encodings,
    softplus_inverse,
)

__all__ = [
    "STRIDE_MODES",
    "ALPHA_BETA",
    "ALPHA_MIN",
    "GPSA",
    "softplus_inverse",
    "relative_encodings",
]

_MODES = ("convit", "tcnn")
_POSITIONAL = ("softplus", "linear")
_ATTN_IMPLS = ("auto", "sdpa", "dense")
# ConViT mode on CPU, attn_impl="auto": the dense path up to this many keys. benchmarks/gpsa.py shapes and
# others, forward+backward time SDPA / dense on a 2-core AVX2 EPYC: 4x4 1.08, 7x7 1.13-1.24, 8x8 1.16,
# 10x10 1.26; 12x12 0.91, 14x14 0.85; the benchmark's 14x14, 16x16 and 28x28 shapes 0.63, 0.72 and 0.39.
_DENSE_MAX_TOKENS = 100


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


class _GatedMix(torch.autograd.Function):
    """y = pos + con * g_con (broadcast), written in ``con``'s memory layout (or ``perm`` of it).

    The convex mix of [TCNN21] Eq. 7 with sigma(lambda) already folded into ``pos``. A fused forward and a
    3-pass backward (lerp's autograd takes 5 passes over the activation); ``pos``'s gradient is ``gy`` itself.
    """

    @staticmethod
    def forward(
        ctx: Any, con: torch.Tensor, pos: torch.Tensor, g_con: torch.Tensor, perm: tuple | None, probs: bool
    ) -> torch.Tensor:
        if perm is None:
            out = torch.empty_like(con, memory_format=torch.contiguous_format)
        else:  # allocate physically in the permuted order, return in con's logical order
            inv = [perm.index(i) for i in range(con.ndim)]
            out = con.new_empty([con.shape[i] for i in perm]).permute(inv)
        torch.addcmul(pos, con, g_con, out=out)
        if probs and out.device.type == "cpu" and out.dtype in (torch.float32, torch.float64):
            F.threshold_(out, torch.finfo(out.dtype).tiny ** 0.5, 0.0)  # mixed attention: see _flush_tiny
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


def _gated_mix(
    con: torch.Tensor,
    pos: torch.Tensor,
    g_con: torch.Tensor,
    perm: tuple | None = None,
    *,
    probs: bool = False,
) -> torch.Tensor:
    """``pos + con * g_con``; ``probs``: the operands are attention probabilities (flush subnormals)."""
    return _GatedMix.apply(con, pos, g_con, perm, probs)


class GPSA(PositionalHeads, nn.Module):
    """Gated positional self-attention; see the module docstring for the two modes.

    Args:
        in_dim: input channels D_in.
        out_dim: output channels (default in_dim).
        num_heads: attention heads (T-CNN mode: kernel_size ** 2, one per tap).
        mode: "convit" or "tcnn".
        kernel_size, stride, dilation: T-CNN mode only, the conv's geometry (odd square kernel,
            padding = dilation * (kernel_size - 1) // 2).
        stride_mode: "exact" or "s1" (T-CNN mode with stride > 1).
        qk_head_dim: per-head query/key width (default: ceil(D_in / heads), so W_qry, W_key are about
            D_in x D_in as in [TCNN21] Sec. 2; ConViT mode: D_in / heads as in timm).
        qkv_bias: bias on the q/k/v projections.
        bias: bias on the output projection.
        positional: "softplus" (alpha = softplus(alpha~, beta=5) + ALPHA_MIN, centers Delta; [TCNN21] footnote 1)
            or "linear" (raw v_pos in R^3 per head, exactly timm's unconstrained ``pos_proj``).
        alpha_init, lambda_init: initial locality strength alpha (rectified) and gating parameter lambda.
        proj_drop: dropout after the output projection (ConViT).
        attn_impl: "auto", "sdpa" or "dense".
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None = None,
        num_heads: int | None = None,
        *,
        mode: str = "convit",
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
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        for name, value, allowed in (
            ("mode", mode, _MODES),
            ("stride_mode", stride_mode, STRIDE_MODES),
            ("positional", positional, _POSITIONAL),
            ("attn_impl", attn_impl, _ATTN_IMPLS),
        ):
            if value not in allowed:
                raise ValueError(f"GPSA: {name} must be one of {allowed}, got {value!r}")
        out_dim = in_dim if out_dim is None else out_dim
        if mode == "tcnn":
            if kernel_size < 1 or kernel_size % 2 == 0:
                raise ValueError(f"GPSA(tcnn): kernel_size must be odd, got {kernel_size}")
            if num_heads not in (None, kernel_size**2):
                raise ValueError(f"GPSA(tcnn): num_heads must be kernel_size**2 = {kernel_size**2}")
            num_heads = kernel_size**2
            if stride < 1 or dilation < 1:
                raise ValueError(f"GPSA(tcnn): stride and dilation must be >= 1, got {stride}, {dilation}")
            v_dim = in_dim  # one W_val shared by all heads ([TCNN21], Eq. 6)
            qk_head_dim = qk_head_dim or math.ceil(in_dim / num_heads)
        else:
            if num_heads is None or num_heads < 1:
                raise ValueError("GPSA(convit): num_heads is required")
            if in_dim % num_heads:
                raise ValueError(f"GPSA(convit): in_dim {in_dim} is not divisible by num_heads {num_heads}")
            if stride != 1:
                raise ValueError("GPSA(convit): stride must be 1")
            v_dim = in_dim
            qk_head_dim = qk_head_dim or in_dim // num_heads
            kernel_size, dilation = 1, 1
        if alpha_init <= 0:
            raise ValueError(f"GPSA: alpha_init must be > 0, got {alpha_init}")
        self.mode = mode
        self.in_dim, self.out_dim, self.num_heads = in_dim, out_dim, num_heads
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        self.padding = dilation * (kernel_size - 1) // 2
        self.stride_mode = stride_mode
        self.qk_head_dim, self.v_dim = qk_head_dim, v_dim
        self.positional, self.attn_impl = positional, attn_impl
        self.grid_size: tuple[int, int] | None = None  # ConViT mode: token grid when the input is [B, N, C]

        qk = num_heads * qk_head_dim
        self.qkv_weight = nn.Parameter(torch.empty(2 * qk + v_dim, in_dim, **dd))
        self.qkv_bias = nn.Parameter(torch.zeros(2 * qk + v_dim, **dd)) if qkv_bias else None
        if mode == "tcnn":
            self.weight = nn.Parameter(torch.empty(out_dim, in_dim, kernel_size, kernel_size, **dd))
        else:
            self.weight = nn.Parameter(torch.empty(out_dim, in_dim, **dd))
        self.bias = nn.Parameter(torch.zeros(out_dim, **dd)) if bias else None
        self.gating_param = nn.Parameter(torch.full((num_heads,), float(lambda_init), **dd))
        if positional == "softplus":
            self.pos_alpha = nn.Parameter(torch.empty(num_heads, **dd))
            self.pos_center = nn.Parameter(torch.empty(num_heads, 2, **dd))
        else:
            self.pos_weight = nn.Parameter(torch.empty(num_heads, 3, **dd))  # columns (|delta|^2, d1, d2)
        self.proj_drop = nn.Dropout(proj_drop)
        self._enc_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._register_load_state_dict_pre_hook(self._load_timm_keys)
        self.reset_parameters()
        # Convolutional init of the positional part: alpha = alpha_init, centres on the kernel taps.
        self.set_positional(
            alpha=torch.full((self.num_heads,), float(alpha_init)), centers=self.tap_offsets()
        )

    # ----------------------------------------------------------------------------------------- init
    def tap_offsets(self) -> torch.Tensor:
        """Conv-like centers [heads, 2] (row, col): T-CNN head h <-> tap (h // k, h % k), row-major."""
        if self.mode == "tcnn":
            return self.conv_tap_offsets()
        # ConViT: a sqrt(heads) x sqrt(heads) kernel, even sizes centred like timm's local_init
        k = int(round(self.num_heads**0.5))
        if k * k != self.num_heads:
            raise ValueError(f"GPSA(convit): local init needs a square number of heads, got {self.num_heads}")
        c, d = (k - 1) / 2 if k % 2 == 0 else k // 2, 1
        idx = torch.arange(self.num_heads)
        return torch.stack([(idx // k - c) * d, (idx % k - c) * d], dim=1).to(torch.float64)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Convolutional init ([TCNN21] Eq. 4, 6) of all but the positional part (`set_positional`): W_val = I.

        q/k (and the ConViT output projection) get timm's ViT init (truncated normal, std 0.02); the T-CNN
        ``weight`` is left for `from_conv` to fill with the filter.
        """
        qk = 2 * self.num_heads * self.qk_head_dim
        nn.init.trunc_normal_(self.qkv_weight[:qk], std=0.02)
        self.qkv_weight[qk:].copy_(torch.eye(self.v_dim, self.in_dim))
        if self.qkv_bias is not None:
            self.qkv_bias.zero_()
        if self.mode == "convit":
            nn.init.trunc_normal_(self.weight, std=0.02)
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            self.bias.zero_()

    @torch.no_grad()
    def set_positional(self, *, alpha: torch.Tensor, centers: torch.Tensor) -> None:
        """Set rectified alpha [heads] (> 0) and centers [heads, 2] (row, col) in either parameterisation."""
        alpha = torch.as_tensor(alpha, dtype=torch.float64).reshape(self.num_heads)
        centers = torch.as_tensor(centers, dtype=torch.float64).reshape(self.num_heads, 2)
        if self.positional == "softplus":
            self._set_softplus_positional(alpha, centers)
        else:  # v_pos = -alpha (1, -2 Delta_1, -2 Delta_2)
            self.pos_weight.copy_(torch.cat([-alpha[:, None], 2 * alpha[:, None] * centers], dim=1))

    @classmethod
    def from_conv(
        cls,
        conv: nn.Conv2d,
        *,
        alpha_init: float = 1.0,
        lambda_init: float = 1.0,
        stride_mode: str = "exact",
        **kwargs: Any,
    ) -> GPSA:
        """T-CNN GPSA computing ``conv`` ([TCNN21] Sec. 2): weight = filter, bias = conv bias, W_val = I."""
        return super().from_conv(
            conv,
            alpha_init=alpha_init,
            stride_mode=stride_mode,
            mode="tcnn",
            lambda_init=lambda_init,
            **kwargs,
        )

    def _load_timm_keys(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """Accept timm ConViT GPSA keys (qk, v, proj, pos_proj, gating_param) in ``load_state_dict``.

        timm scores positions with ``pos_proj``, a Linear(3, heads) on (delta_x, delta_y, |delta|^2) (column
        then row offset), i.e. v_pos = (w_x, w_y, w_d2) plus a bias that cancels in the softmax. In the
        softplus parameterisation alpha = -w_d2 and Delta = (w_y, w_x) / (2 alpha); a head with alpha <= 0
        (anti-local, possible after training) cannot be represented there and raises a clear error: build the
        model with ``positional="linear"``, which stores the raw v_pos.
        """
        if prefix + "qk.weight" not in state_dict:
            return
        if self.mode != "convit":
            raise ValueError(f"{prefix}: timm ConViT keys can only be loaded into a ConViT-mode GPSA")
        sd = state_dict
        sd[prefix + "qkv_weight"] = torch.cat([sd.pop(prefix + "qk.weight"), sd.pop(prefix + "v.weight")])
        if prefix + "qk.bias" in sd:
            sd[prefix + "qkv_bias"] = torch.cat([sd.pop(prefix + "qk.bias"), sd.pop(prefix + "v.bias")])
        sd[prefix + "weight"] = sd.pop(prefix + "proj.weight")
        if prefix + "proj.bias" in sd:
            sd[prefix + "bias"] = sd.pop(prefix + "proj.bias")
        w = sd.pop(prefix + "pos_proj.weight").to(torch.float64)  # [heads, 3] on (dx, dy, d2)
        sd.pop(prefix + "pos_proj.bias", None)
        dtype = self.gating_param.dtype
        if self.positional == "linear":
            sd[prefix + "pos_weight"] = torch.stack([w[:, 2], w[:, 1], w[:, 0]], dim=1).to(dtype)
            return
        alpha = -w[:, 2]
        bad = (alpha <= ALPHA_MIN).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"{prefix.rstrip('.')}: timm pos_proj gives alpha = -w[:, 2] <= 0 for heads {bad} "
                f"({alpha[bad].tolist()}); the softplus parameterisation needs alpha > 0 - "
                "build the model with positional='linear' to load it"
            )
        sd[prefix + "pos_alpha"] = softplus_inverse(alpha - ALPHA_MIN).to(dtype)
        sd[prefix + "pos_center"] = (torch.stack([w[:, 1], w[:, 0]], dim=1) / (2 * alpha[:, None])).to(dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> GPSA:
        self._enc_cache = {}  # cached encodings follow .to() / .half() / .cuda()
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------------------ analysis values
    @staticmethod
    def positional_parameter_names() -> tuple[str, ...]:
        """Names (relative to the GPSA) of its positional parameters: gating lambda, alpha~, centers, v_pos.

        Used for no-weight-decay and the gate learning rate ([TCNN21] Sec. 3); only those present exist.
        """
        return ("gating_param", "pos_alpha", "pos_center", "pos_weight")

    @staticmethod
    def gating_parameter_names() -> tuple[str, ...]:
        """Names of the gating parameters lambda (the ones [TCNN21] Sec. 3 trains with lr 0.1)."""
        return ("gating_param",)

    def alpha(self) -> torch.Tensor:
        """Rectified locality strength alpha [heads] (softplus(alpha~, beta=5) + ALPHA_MIN; or -v_pos[0])."""
        if self.positional == "softplus":
            return self._softplus_alpha()
        return -self.pos_weight[:, 0]

    def gate(self) -> torch.Tensor:
        """sigma(lambda) [heads]: the weight of the positional attention ([TCNN21] Eq. 7)."""
        return torch.sigmoid(self.gating_param)

    def centers(self) -> torch.Tensor:
        """Attention centers Delta [heads, 2] as (row, col) offsets in input pixels."""
        if self.positional == "softplus":
            return self.pos_center
        return self.pos_weight[:, 1:] / (2 * self.alpha()[:, None])

    # -------------------------------------------------------------------------------- geometry
    def _offsets(self, n: int, nq: int, s: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """1-D offsets key - query [nq, n + 2 pad] over the zero-padded key axis (cached)."""
        key = ("off", n, nq, s, device, dtype)
        off = self._enc_cache.get(key)
        if off is None:
            p = self.padding
            keys = torch.arange(-p, n + p, device=device, dtype=dtype)
            queries = torch.arange(0, nq * s, s, device=device, dtype=dtype)
            off = keys[None, :] - queries[:, None]
            self._enc_cache[key] = off
        return off

    def positional_factors(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column positional softmaxes (Py [heads, Hq, h], Px [heads, Wq, w]) for an h x w input.

        P^h[(qr, qc), (kr, kc)] = Py^h[qr, kr] Px^h[qc, kc] is exactly the 2-D softmax of v_pos^h . r over the
        (zero-padded) key grid, because the quadratic score is a sum of a row and a column term. Padded key
        columns are dropped after the softmax: they hold zeros, so their share of the mass contributes nothing.
        """
        dev = self.gating_param.device
        cdt = _compute_dtype(self.gating_param.dtype)
        hq, wq, s = self._query_size(h, w)
        p = self.padding
        if self.positional == "softplus":
            a = self.alpha().to(cdt)[:, None, None]
            c = self.pos_center.to(cdt).t()[:, :, None, None]  # [2, heads, 1, 1]: row, col centers
        else:
            wp = self.pos_weight.to(cdt)
        if h == w:  # both axes share the offsets: one batched score + softmax (fewer tiny ops)
            off = self._offsets(h, hq, s, dev, cdt)[None, None]  # [1, 1, Hq, h + 2p]
            if self.positional == "softplus":
                sc = -a * (off - c) ** 2
            else:
                sc = wp[:, 0, None, None] * off**2 + wp[:, 1:].t()[:, :, None, None] * off
            pyx = _flush_tiny(sc.softmax(dim=-1)[..., p : p + h])
            return pyx[0], pyx[1]
        out = []
        for axis, (n, nq) in enumerate(((h, hq), (w, wq))):
            off = self._offsets(n, nq, s, dev, cdt)[None]
            if self.positional == "softplus":
                sc = -a * (off - c[axis]) ** 2
            else:
                sc = wp[:, 0, None, None] * off**2 + wp[:, 1 + axis, None, None] * off
            out.append(_flush_tiny(sc.softmax(dim=-1)[..., p : p + n]))
        return out[0], out[1]

    def positional_attention(self, h: int, w: int) -> torch.Tensor:
        """Dense positional attention [heads, Hq * Wq, h * w] (input-independent; real keys only)."""
        py, px = self.positional_factors(h, w)
        nh, hq, _ = py.shape
        wq = px.shape[1]
        return (py[:, :, None, :, None] * px[:, None, :, None, :]).reshape(nh, hq * wq, h * w)

    # -------------------------------------------------------------------------------- forward
    def _use_dense(self, device: torch.device, tokens: int) -> bool:
        """ "auto" picks the dense path on CPU for the T-CNN mode, where SDPA's fused kernel does not apply
        (per-head values are D_in wide, not d_qk) and its math fallback would materialise the attention too,
        and for the ConViT mode on small maps (``tokens`` keys <= `_DENSE_MAX_TOKENS`), where the attention
        matrices are small and SDPA's CPU flash kernel, tiled for long sequences, is the slower one."""
        if self.attn_impl != "auto":
            return self.attn_impl == "dense"
        if device.type != "cpu":
            return False
        return self.mode == "tcnn" or tokens <= _DENSE_MAX_TOKENS

    def _tokens(self, x: torch.Tensor, size: tuple[int, int] | None) -> tuple[torch.Tensor, int, int]:
        """Input -> tokens [B, L, C] (channels last) and the grid (h, w)."""
        if self.mode == "tcnn":
            if x.ndim != 4:
                raise ValueError(f"GPSA(tcnn) expects [B, C, H, W], got shape {tuple(x.shape)}")
            b, c, h, w = x.shape
            return x.permute(0, 2, 3, 1).reshape(b, h * w, c), h, w
        if x.ndim != 3:
            raise ValueError(f"GPSA(convit) expects tokens [B, N, C], got shape {tuple(x.shape)}")
        n = x.shape[1]
        if size is None:
            size = self.grid_size
        if size is None or size[0] * size[1] != n:
            side = math.isqrt(n)
            if side * side != n:
                raise ValueError(f"GPSA: {n} tokens are not a square grid; pass size=(H, W)")
            size = (side, side)
        return x, int(size[0]), int(size[1])

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """T-CNN mode: [B, D_in, H, W] -> [B, D_out, H', W']. ConViT mode: [B, N, C] on grid ``size``."""
        if self.mode == "tcnn" and self._use_dense(x.device, x.shape[-2] * x.shape[-1]):
            return self._forward_tcnn_dense(x)
        tokens, h, w = self._tokens(x, size)
        b, lk, _ = tokens.shape
        hq, wq, s = self._query_size(h, w)
        lq = hq * wq
        nh, dq, dv = self.num_heads, self.qk_head_dim, self.v_dim
        qk = nh * dq
        wqkv, bqkv = self.qkv_weight, self.qkv_bias
        # one GEMM, split (not sliced: a slice's backward zero-fills + adds per slice)
        if s == 1:
            q, k, v = F.linear(tokens, wqkv, bqkv).split([qk, qk, dv], dim=-1)  # [B, L, *] column views
        else:  # exact stride: queries only at the conv's output positions
            xq = tokens.view(b, h, w, -1)[:, ::s, ::s].reshape(b, lq, -1)
            wq_, wkv = wqkv.split([qk, qk + dv])
            bq, bkv = (None, None) if bqkv is None else bqkv.split([qk, qk + dv])
            q = F.linear(xq, wq_, bq)
            k, v = F.linear(tokens, wkv, bkv).split([qk, dv], dim=-1)
        q, k = q.unflatten(-1, (nh, dq)), k.unflatten(-1, (nh, dq))
        if self.mode == "convit":
            v = v.unflatten(-1, (nh, dv // nh))
        mix = self._mix_tcnn if self.mode == "tcnn" else self._mix_convit
        y = mix(q, k, v, h, w, dense=self._use_dense(x.device, lk))
        if self.mode == "tcnn":  # y: [B, Lq, D_out], output projection and bias included
            out = y.view(b, hq, wq, self.out_dim).permute(0, 3, 1, 2)
            if self.stride > 1 and self.stride_mode == "s1":
                out = F.avg_pool2d(out, self.stride, self.stride, ceil_mode=True, count_include_pad=False)
            return self.proj_drop(out)
        return self.proj_drop(F.linear(y, self.weight, self.bias))

    def _forward_tcnn_dense(self, x: torch.Tensor) -> torch.Tensor:
        """T-CNN mode, dense path: out_i = sum_h sum_j A^h_ij V_j W_out^h + b ([TCNN21] Eq. 5), conv-shaped GEMMs.

        Works on the NCHW map as it comes (no token copy of the input):
        1. q^T, k^T [B * heads, d, L] straight from the [B, C, L] view of x: a 1x1-conv-shaped GEMM per image
           (queries only at the output positions for an exact stride);
        2. A^h = (1 - sigma(lambda_h)) softmax(q k^T / sqrt(d)) + sigma(lambda_h) P^h, stored [B, Lq, heads, L]
           (the batch-shared P^h comes from the cache; mix and flush in one pass, `_GatedMix`);
        3. Y = A X: one batched matmul [B, Lq * heads, L] @ [B, L, C] reading x's NCHW view transposed;
        4. out = Y W2^T + b with W2 = [W_out^h W_val]_h, [D_out, heads * D_in]: one GEMM with the conv's own
           im2col shape (M = B * Lq, K = heads * D_in, N = D_out), the bias fused in; returned as an NCHW view
           of the channels-last result (BatchNorm and the residual add take it as is).
        W_val is folded into the output weight (V never materialised) whenever that is cheaper: always when the
        folded weight is reused (autograd off: cached until a parameter changes), otherwise when
        B * L >= heads * D_out (the fold costs heads * D_out * D_in^2 multiply-adds, the projection B * L * D_in^2).
        Same function up to float rounding (at the init W_val = I and the fold is exact).

        Projections run as 1x1 convolutions (`_project`), the output GEMM as one ``F.linear``.
        """
        if x.ndim != 4:
            raise ValueError(f"GPSA(tcnn) expects [B, C, H, W], got shape {tuple(x.shape)}")
        b, c, h, w = x.shape
        hq, wq, s = self._query_size(h, w)
        lk, lq = h * w, hq * wq
        nh, dq, cout = self.num_heads, self.qk_head_dim, self.out_dim
        grad = torch.is_grad_enabled()
        fold = self.qkv_bias is None and (not grad or b * lk >= nh * cout)
        xs = x.flatten(2)  # [B, C, L]: a view for NCHW and channels_last inputs
        qk = nh * dq
        wqkv, bqkv = self.qkv_weight, self.qkv_bias
        # views below for NCHW inputs; reshape copies where a channels_last input made conv2d's output CL
        if s == 1 and bqkv is None:  # one GEMM for q and k: rows (head, q|k, d), one block per head
            both = self._project(x, self._cached(("qk_rows",), self._qk_rows), None, 1)
            both = both.reshape(b * nh, 2 * dq, lk)
            qt, kt = both[:, :dq], both[:, dq:]
        else:
            bq, bk = (None, None) if bqkv is None else (bqkv[:qk], bqkv[qk : 2 * qk])
            qt = self._project(x, wqkv[:qk], bq, s).reshape(b * nh, dq, lq)
            kt = self._project(x, wqkv[qk : 2 * qk], bk, 1).reshape(b * nh, dq, lk)
        scores = torch.baddbmm(
            qt.new_zeros(()).expand(b * nh, lq, lk), qt.transpose(1, 2), kt, beta=0.0, alpha=dq**-0.5
        )
        attn = scores.view(b, nh, lq, lk).softmax(dim=-1)
        act = attn.dtype
        g_con = self._gates(act)[1]
        pos = self._gated_positional(h, w, act)
        # mixed attention, stored [B, Lq, heads, L] so that Y's rows come out in (query, head) order
        attn = _gated_mix(attn, pos, g_con[:, None, None], (0, 2, 1, 3), probs=True)
        if fold:
            vt = xs
        else:
            vt = self._project(x, wqkv[2 * qk :], None if bqkv is None else bqkv[2 * qk :], 1)
        y = torch.bmm(attn.transpose(1, 2).reshape(b, lq * nh, lk), vt.transpose(1, 2))  # [B, Lq * heads, C]
        w2 = self._cached(("w2", fold), lambda: self._tcnn_out_weight(fold))
        out = F.linear(y.view(b * lq, nh * c), w2, self.bias).view(b, hq, wq, cout).permute(0, 3, 1, 2)
        if self.stride > 1 and self.stride_mode == "s1":
            out = F.avg_pool2d(out, self.stride, self.stride, ceil_mode=True, count_include_pad=False)
        return self.proj_drop(out)

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

    def _tcnn_out_weight(self, fold: bool) -> torch.Tensor:
        """[D_out, heads * D_in] with columns (head, channel): W_out^h = weight[:, :, tap(h)], times W_val if
        ``fold`` (sum_h A^h X W_val^T W_out^h^T = sum_h (A^h X) (W_out^h W_val)^T)."""
        nh, cout, cin = self.num_heads, self.out_dim, self.in_dim
        if not fold:
            return self.weight.permute(0, 2, 3, 1).reshape(cout, nh * cin)
        wv = self.qkv_weight[2 * nh * self.qk_head_dim :]
        wf = torch.matmul(self.weight.permute(2, 3, 0, 1).reshape(nh * cout, cin), wv)  # rows (tap, out)
        return wf.view(nh, cout, cin).transpose(0, 1).reshape(cout, nh * cin)

    @staticmethod
    def _apply_positional(v: torch.Tensor, py: torch.Tensor, px: torch.Tensor, shared: bool) -> torch.Tensor:
        """Batch-shared positional attention: out[b, r, c, h] = sum Py[h, r, r'] Px[h, c, c'] v[b, r', c', h].

        v: [B, h, w, heads, d] (ConViT: each head its own channels) or [B, h, w, d] (``shared``, T-CNN: every
        head reads all channels). The positional softmaxes are the same for every image, so the batch folds
        into the GEMM's long dimension. Small maps: one matmul of the dense [heads, Lq, L] attention against V
        reshaped to [L, B * d]; larger maps: one matmul per axis with the factors, which costs (h + w) instead
        of h * w per token. Returns a [B, Hq, Wq, heads, d] view (head-major memory).
        """
        nh, hq, hk = py.shape
        wq, wk = px.shape[1], px.shape[2]
        b, d = v.shape[0], v.shape[-1]
        if hk * wk <= 2 * (hk + wk) + 24:  # up to 7x7: one GEMM-friendly matmul beats two with K = h, w
            pos = (py[:, :, None, :, None] * px[:, None, :, None, :]).reshape(nh, hq * wq, hk * wk)
            if shared:  # [heads * Lq, L] @ [L, B * d]
                t = torch.mm(
                    pos.reshape(nh * hq * wq, hk * wk), v.permute(1, 2, 0, 3).reshape(hk * wk, b * d)
                )
            else:  # [heads, Lq, L] @ [heads, L, B * d]
                t = torch.bmm(pos, v.permute(3, 1, 2, 0, 4).reshape(nh, hk * wk, b * d))
            return t.view(nh, hq, wq, b, d).permute(3, 1, 2, 0, 4)
        if shared:  # the same values for every head: [(B, h, d), w] @ Px^T -> [heads, (B, h, d), Wq]
            t = torch.matmul(v.permute(0, 1, 3, 2).reshape(b * hk * d, wk), px.transpose(1, 2))
        else:
            t = torch.bmm(v.permute(3, 0, 1, 4, 2).reshape(nh, b * hk * d, wk), px.transpose(1, 2))
        # rows: per (head, image) [(d, Wq), h] @ Py^T -> [heads * B, (d, Wq), Hq]; the transposed operand is a view
        t = t.view(nh * b, hk, d * wq).transpose(1, 2)
        pyt = py.transpose(1, 2)[:, None].expand(nh, b, hk, hq).reshape(nh * b, hk, hq)
        t = torch.bmm(t, pyt)
        return t.view(nh, b, d, wq, hq).permute(1, 4, 3, 0, 2)

    def _mix_convit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        h: int,
        w: int,
        *,
        dense: bool,
    ) -> torch.Tensor:
        """ConViT mode: heads own D/heads channels each. q, k, v: [B, L, heads, d]. Returns [B, L, D]."""
        b, lq, nh, _ = q.shape
        dv = v.shape[-1]
        act = v.dtype
        g_con = self._gates(act)[1]
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, L, d] views
        if dense:
            attn = self._scores(qh, kh).softmax(dim=-1)
            pos = self._gated_positional(h, w, act)
            attn = _gated_mix(attn, pos, g_con[:, None, None], probs=True)
            return (attn @ vh).transpose(1, 2).reshape(b, lq, nh * dv)
        con = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)  # [B, L, heads, d], contiguous
        py, px = self._gated_factors(h, w, act)  # sigma(lambda) folded into Py
        pos = self._apply_positional(v.view(b, h, w, nh, dv), py, px, shared=False)
        y = _gated_mix(con.reshape(b, h, w, nh, dv), pos, g_con[:, None])
        return y.view(b, lq, nh * dv)

    def _mix_tcnn(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        h: int,
        w: int,
        *,
        dense: bool,
    ) -> torch.Tensor:
        """T-CNN mode, SDPA path (the dense one is `_forward_tcnn_dense`): attention and output projection,
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
        y = _gated_mix(con.permute(0, 2, 1, 3).reshape(b, hq, wq, nh, c), pos, g_con[:, None])
        # y: (head, channel) order per query; W_out^h = weight[:, :, tap(h)]
        w2 = self._cached(("w2", False), lambda: self._tcnn_out_weight(False))
        return F.linear(y.reshape(b, lq, nh * c), w2, self.bias)

    def _gated_positional(self, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        """sigma(lambda_h) P^h, dense [heads, Lq, L], computed in float32 (or 64) and flushed, then cast."""

        def make() -> torch.Tensor:
            pos = self.positional_attention(h, w)
            return _flush_tiny(pos * self.gate().to(pos.dtype)[:, None, None]).to(dtype)

        return self._cached(("gated_pos", h, w, dtype), make)

    def _gated_factors(self, h: int, w: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma(lambda_h) Py^h, Px^h), flushed, cast to ``dtype``."""

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            py, px = self.positional_factors(h, w)
            return _flush_tiny(py * self.gate().to(py.dtype)[:, None, None]).to(dtype), px.to(dtype)

        return self._cached(("gated_factors", h, w, dtype), make)

    def _cached(self, key: tuple, make: Any) -> Any:
        """Input-independent tensors derived from the parameters, reused while autograd is off (eval,
        inference) and the parameters are unchanged (same storage and version counter); recomputed with a
        fresh graph whenever gradients are recorded. A value made under autocast (e.g. bf16 GEMM weights) is
        cached apart from one made without it, so the two never mix."""
        if torch.is_grad_enabled():
            return make()
        stamp = tuple((p.data_ptr(), p._version) for p in self.parameters(recurse=False))
        dev = self.weight.device.type
        if torch.is_autocast_enabled(dev):
            key = (*key, "autocast", torch.get_autocast_dtype(dev))
        hit = self._enc_cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = make()
        self._enc_cache[key] = (stamp, value)
        return value

    def _scores(self, qh: torch.Tensor, kh: torch.Tensor) -> torch.Tensor:
        """Content logits Q K^T / sqrt(d) [B, heads, Lq, L]; the scale is applied inside the GEMM."""
        b, nh, lq, dq = qh.shape
        lk = kh.shape[2]
        zero = qh.new_zeros(()).expand(b * nh, lq, lk)
        s = torch.baddbmm(
            zero,
            qh.reshape(b * nh, lq, dq),
            kh.reshape(b * nh, lk, dq).transpose(1, 2),
            beta=0.0,
            alpha=dq**-0.5,
        )
        return s.view(b, nh, lq, lk)

    def _gates(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma(lambda), 1 - sigma(lambda)) per head; the latter as sigma(-lambda), exact for large lambda."""
        lam = self.gating_param
        return torch.sigmoid(lam).to(dtype), torch.sigmoid(-lam).to(dtype)

    # -------------------------------------------------------------------------------- analysis
    def _grid_of(self, x: torch.Tensor, size: tuple[int, int] | None) -> tuple[int, int]:
        _, h, w = self._tokens(x, size)
        return h, w

    @torch.no_grad()
    def attention_maps(
        self, x: torch.Tensor, size: tuple[int, int] | None = None, *, part: str = "mixed"
    ) -> torch.Tensor:
        """Attention for input ``x``: [B, heads, Lq, L] (queries at the output positions of the attention,
        i.e. before the s1 pooling; keys are the real input pixels, row-major). ``part`` in
        {"mixed", "content", "positional"}. T-CNN border rows sum to less than 1: the rest of the positional
        mass sits on the zero-valued padded keys, exactly as in the conv.
        """
        if part not in ("mixed", "content", "positional"):
            raise ValueError(f"attention_maps: part must be mixed|content|positional, got {part!r}")
        tokens, h, w = self._tokens(x, size)
        b = tokens.shape[0]
        hq, wq, s = self._query_size(h, w)
        nh, dq = self.num_heads, self.qk_head_dim
        pos = self.positional_attention(h, w).to(tokens.dtype).expand(b, -1, -1, -1)
        if part == "positional":
            return pos.clone()
        xq = tokens.view(b, h, w, -1)[:, ::s, ::s].reshape(b, hq * wq, -1)
        wq_, bq = self.qkv_weight[: nh * dq], None if self.qkv_bias is None else self.qkv_bias[: nh * dq]
        wk_ = self.qkv_weight[nh * dq : 2 * nh * dq]
        bk = None if self.qkv_bias is None else self.qkv_bias[nh * dq : 2 * nh * dq]
        q = F.linear(xq, wq_, bq).unflatten(-1, (nh, dq)).transpose(1, 2)
        k = F.linear(tokens, wk_, bk).unflatten(-1, (nh, dq)).transpose(1, 2)
        con = (q @ k.transpose(-2, -1) * dq**-0.5).softmax(-1)
        if part == "content":
            return con
        g = self.gate().to(tokens.dtype)[:, None, None]
        return (1 - g) * con + g * pos

    @torch.no_grad()
    def nonlocality(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """Nonlocality per head [heads] ([ConViT21] Eq. 8): D_loc^h = (1/Lq) sum_ij A^h_ij |delta_ij|, batch-averaged.

        delta is measured in input pixels between the query position and the key; average over heads for the
        layer value.
        """
        attn = self.attention_maps(x, size).mean(0)  # [heads, Lq, L]
        h, w = self._grid_of(x, size)
        hq, wq, s = self._query_size(h, w)
        rq = torch.arange(0, hq * s, s, device=attn.device, dtype=attn.dtype)
        cq = torch.arange(0, wq * s, s, device=attn.device, dtype=attn.dtype)
        rk = torch.arange(h, device=attn.device, dtype=attn.dtype)
        ck = torch.arange(w, device=attn.device, dtype=attn.dtype)
        dr = rk[None, :] - rq[:, None]  # [Hq, h]
        dc = ck[None, :] - cq[:, None]  # [Wq, w]
        dist = (dr[:, None, :, None] ** 2 + dc[None, :, None, :] ** 2).sqrt().reshape(hq * wq, h * w)
        return (attn * dist).sum(dim=(-2, -1)) / (hq * wq)

    def extra_repr(self) -> str:
        s = f"{self.in_dim}, {self.out_dim}, heads={self.num_heads}, mode={self.mode}, qk_head_dim={self.qk_head_dim}"
        if self.mode == "tcnn":
            s += f", kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}"
            s += f", stride_mode={self.stride_mode}"
        return s + f", positional={self.positional}, attn_impl={self.attn_impl}"
