"""Positional self-attention (PSA) without gating, in the T-CNN head layout ([Cordonnier20]; [ConViT21] Eq. 4 and Appendix A).

One softmax over the sum of content and positional logits, per head h and query i::
    A^h_ij = softmax_j( Q^h_i . K^h_j / sqrt(d_h) - alpha_h |delta_ij - Delta^h|^2 )
    out_i  = sum_h sum_j A^h_ij V_j W_out^h + b

The positional logit is v_pos^h . r_ij with the quadratic encoding r_ij = (|delta|^2, delta_1, delta_2) and
v_pos^h = -alpha_h (1, -2 Delta^h_1, -2 Delta^h_2) ([Cordonnier20] Lemma 1; [ConViT21] Eq. 5), up to a per-head constant that
cancels in the softmax. Unlike GPSA ([ConViT21] Eq. 7) there is no gate: content and position compete inside one
softmax, which is what [ConViT21] Appendix A ("vanilla PSA") compares against.

Layout (as the T-CNN GPSA, [TCNN21] Sec. 2): one head per kernel tap (head h <-> tap (h // k, h % k), row-major,
centre Delta^h = dilation * (h // k - k // 2, h % k - k // 2) in (row, col)), every head sees all D_in input
channels through one shared W_val (init identity) and has its own output projection W_out^h =
W_filter[:, :, tap(h)]; ``weight`` IS the conv filter [D_out, D_in, k, k] (same name and shape as the conv it
replaces, so optimizer state maps by name). Input and output are NCHW maps.

Zero padding: the input is zero-padded by the conv's padding and the attention runs over the padded key
grid. A padded key is the zero token: its value is 0 and its content logit Q_i . (W_key 0) = 0, so it takes
its positional share of the softmax mass and contributes nothing, exactly as the conv's zero padding (keep
``qkv_bias=False``, the default, for this to hold after training too).

Convolutional init ([Cordonnier20] Eq. 5, [ConViT21] Eq. 5): centres on the taps, alpha = alpha_init, W_val = I and the content
logits identically zero. [Cordonnier20] sets W_qry = W_key = 0; that is a saddle (both gradients vanish identically), so
the default ``qk_init="zero_key"`` sets only W_key = 0 and draws W_qry from timm's ViT init: the content logits
Q_i . K_j = 0 all the same (the layer computes the positional attention exactly), and W_key receives a
gradient from the first step, after which W_qry does too. ``qk_init="zero"`` is [Cordonnier20]'s literal choice (content
projections then never train), ``"random"`` draws both (the content logits are then small but not zero).
With large alpha the positional softmax is one-hot on the tap and the layer computes the conv exactly.

Stride s: ``stride_mode="exact"`` computes queries only at the conv's output positions (0, s, 2s, ...),
identical to stride-1 attention followed by [::s, ::s]; ``"s1"`` is stride-1 attention followed by an s x s
average pool (BoTNet's choice; not function-preserving), as in `core.nn.gpsa_tcnn.TcnnGPSA`.

The content + positional softmax runs through ``F.scaled_dot_product_attention`` with the positional logits as
an additive float mask [heads, Lq, Lk] shared by the whole batch (computed once per forward; reused across
forwards while autograd is off and the parameters are unchanged).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.locality import grid_distances
from core.nn.positional import STRIDE_MODES, PositionalHeads

__all__ = ["PSA", "QK_INITS"]

QK_INITS = ("zero_key", "zero", "random")


class PSA(PositionalHeads, nn.Module):
    """Ungated positional self-attention with the quadratic encoding, T-CNN head layout (module docstring).

    Args:
        in_dim, out_dim: input / output channels.
        kernel_size, stride, dilation: the conv's geometry (odd square kernel, padding = dilation (k - 1) / 2).
        stride_mode: "exact" or "s1".
        qk_head_dim: per-head query/key width (default ceil(D_in / heads): W_qry, W_key about D_in x D_in).
        qkv_bias: bias on the q/k/v projections (off: padded keys stay exact zero tokens).
        bias: bias on the output projection.
        alpha_init: initial locality strength alpha (rectified, > 0).
        qk_init: "zero_key" (default), "zero" ([Cordonnier20] Eq. 5 literally) or "random" (see module docstring).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None = None,
        *,
        kernel_size: int = 3,
        stride: int = 1,
        dilation: int = 1,
        stride_mode: str = "exact",
        qk_head_dim: int | None = None,
        qkv_bias: bool = False,
        bias: bool = True,
        alpha_init: float = 1.0,
        qk_init: str = "zero_key",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"PSA: kernel_size must be odd, got {kernel_size}")
        if stride < 1 or dilation < 1:
            raise ValueError(f"PSA: stride and dilation must be >= 1, got {stride}, {dilation}")
        if stride_mode not in STRIDE_MODES:
            raise ValueError(f"PSA: stride_mode must be one of {STRIDE_MODES}, got {stride_mode!r}")
        if qk_init not in QK_INITS:
            raise ValueError(f"PSA: qk_init must be one of {QK_INITS}, got {qk_init!r}")
        if not alpha_init > 0:
            raise ValueError(f"PSA: alpha_init must be > 0, got {alpha_init}")
        out_dim = in_dim if out_dim is None else out_dim
        self.in_dim, self.out_dim = in_dim, out_dim
        self.num_heads = kernel_size**2
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        self.padding = dilation * (kernel_size - 1) // 2
        self.stride_mode = stride_mode
        self.qk_head_dim = qk_head_dim or math.ceil(in_dim / self.num_heads)
        self.v_dim = in_dim
        self.qk_init = qk_init
        qk = self.num_heads * self.qk_head_dim
        self.qkv_weight = nn.Parameter(torch.empty(2 * qk + in_dim, in_dim, **dd))
        self.qkv_bias = nn.Parameter(torch.zeros(2 * qk + in_dim, **dd)) if qkv_bias else None
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim, kernel_size, kernel_size, **dd))
        self.bias = nn.Parameter(torch.zeros(out_dim, **dd)) if bias else None
        self.pos_alpha = nn.Parameter(torch.empty(self.num_heads, **dd))
        self.pos_center = nn.Parameter(torch.empty(self.num_heads, 2, **dd))
        self._cache: dict[tuple, tuple[tuple, torch.Tensor]] = {}
        self.reset_parameters()
        # Convolutional init of the positional part: alpha = alpha_init, centres on the kernel taps.
        self.set_positional(
            alpha=torch.full((self.num_heads,), float(alpha_init)), centers=self.tap_offsets()
        )

    # ----------------------------------------------------------------------------------------- init
    def tap_offsets(self) -> torch.Tensor:
        """Conv-like centres [heads, 2] (row, col): head h <-> tap (h // k, h % k), row-major."""
        return self.conv_tap_offsets()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Convolutional init ([Cordonnier20] Eq. 5) of all but the positional part (`set_positional`): W_val = I, content
        logits zero (``qk_init``); ``weight`` gets kaiming init until `from_conv` copies the filter in."""
        qk = self.num_heads * self.qk_head_dim
        wq, wk, wv = self.qkv_weight.split([qk, qk, self.v_dim])
        nn.init.trunc_normal_(wq, std=0.02)
        nn.init.trunc_normal_(wk, std=0.02)
        if self.qk_init in ("zero_key", "zero"):
            wk.zero_()
        if self.qk_init == "zero":
            wq.zero_()
        wv.copy_(torch.eye(self.v_dim, self.in_dim))
        if self.qkv_bias is not None:
            self.qkv_bias.zero_()
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            self.bias.zero_()

    @torch.no_grad()
    def set_positional(self, *, alpha: torch.Tensor, centers: torch.Tensor) -> None:
        """Set rectified alpha [heads] (> ALPHA_MIN) and centres [heads, 2] (row, col)."""
        alpha = torch.as_tensor(alpha, dtype=torch.float64).reshape(self.num_heads)
        self._set_softplus_positional(
            alpha, torch.as_tensor(centers, dtype=torch.float64).reshape(self.num_heads, 2)
        )

    def _apply(self, fn: Any, recurse: bool = True) -> PSA:
        self._cache = {}
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------------------ analysis values
    @staticmethod
    def positional_parameter_names() -> tuple[str, ...]:
        """Positional parameters (alpha~, centres): no weight decay in fine-tuning ([TCNN21] Sec. 3)."""
        return ("pos_alpha", "pos_center")

    @staticmethod
    def gating_parameter_names() -> tuple[str, ...]:
        """PSA has no gate."""
        return ()

    def alpha(self) -> torch.Tensor:
        """Rectified locality strength alpha [heads] = softplus(alpha~, beta=5) + ALPHA_MIN."""
        return self._softplus_alpha()

    def centers(self) -> torch.Tensor:
        """Attention centres Delta [heads, 2] as (row, col) offsets in input pixels."""
        return self.pos_center

    def gate(self) -> torch.Tensor:
        """No gate in PSA: NaN per head (so per-head tables keep their shape; plots skip NaN)."""
        return torch.full((self.num_heads,), float("nan"), device=self.pos_alpha.device)

    # -------------------------------------------------------------------------------- geometry
    def positional_logits(self, h: int, w: int) -> torch.Tensor:
        """-alpha_h |delta - Delta^h|^2 over the zero-padded key grid: [heads, Lq, (h + 2p)(w + 2p)], float32+.

        delta = key position - query position (row, col); the quadratic score splits into a row and a column
        term, so it is built as an outer sum of two 1-D tables.
        """
        cdt = torch.float64 if self.pos_alpha.dtype == torch.float64 else torch.float32
        dev = self.pos_alpha.device
        hq, wq, s = self._query_size(h, w)
        p = self.padding
        a = self.alpha().to(cdt)[:, None, None]
        c = self.pos_center.to(cdt)
        dr = (
            torch.arange(-p, h + p, device=dev, dtype=cdt)[None, :]
            - torch.arange(0, hq * s, s, device=dev, dtype=cdt)[:, None]
        )  # [Hq, h + 2p]
        dc = (
            torch.arange(-p, w + p, device=dev, dtype=cdt)[None, :]
            - torch.arange(0, wq * s, s, device=dev, dtype=cdt)[:, None]
        )  # [Wq, w + 2p]
        sr = -a * (dr[None] - c[:, 0, None, None]) ** 2  # [heads, Hq, h + 2p]
        sc = -a * (dc[None] - c[:, 1, None, None]) ** 2  # [heads, Wq, w + 2p]
        nh = self.num_heads
        return (sr[:, :, None, :, None] + sc[:, None, :, None, :]).reshape(
            nh, hq * wq, (h + 2 * p) * (w + 2 * p)
        )

    def _pos_mask(self, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        """Positional logits cast to the activation dtype, cached while autograd is off and params unchanged."""
        if torch.is_grad_enabled():
            return self.positional_logits(h, w).to(dtype)
        key = (int(h), int(w), dtype)  # ints also while torch.jit.trace records (sizes come as tensors)
        stamp = tuple((q.data_ptr(), q._version) for q in (self.pos_alpha, self.pos_center))
        hit = self._cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = self.positional_logits(h, w).to(dtype)
        self._cache[key] = (stamp, value)
        return value

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """q [B, heads, Lq, d], k [B, heads, Lk, d], v [B, Lk, C] over the zero-padded grid; and (h, w)."""
        if x.ndim != 4:
            raise ValueError(f"PSA expects [B, C, H, W], got shape {tuple(x.shape)}")
        b, _, h, w = x.shape
        hq, wq, s = self._query_size(h, w)
        p, nh, dq = self.padding, self.num_heads, self.qk_head_dim
        qk = nh * dq
        wq_, wk_, wv_ = self.qkv_weight.split([qk, qk, self.v_dim])
        bq = bk = bv = None
        if self.qkv_bias is not None:
            bq, bk, bv = self.qkv_bias.split([qk, qk, self.v_dim])
        xq = x[:, :, ::s, ::s].permute(0, 2, 3, 1).reshape(b, hq * wq, -1)
        xk = F.pad(x, (p, p, p, p)).permute(0, 2, 3, 1).reshape(b, (h + 2 * p) * (w + 2 * p), -1)
        q = F.linear(xq, wq_, bq).unflatten(-1, (nh, dq)).transpose(1, 2)
        k = F.linear(xk, wk_, bk).unflatten(-1, (nh, dq)).transpose(1, 2)
        v = F.linear(xk, wv_, bv)
        return q, k, v, h, w

    # -------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, D_in, H, W] -> [B, D_out, H', W'] (H' = ceil(H / stride))."""
        q, k, v, h, w = self._qkv(x)
        b, nh, lq, _ = q.shape
        lk, c = v.shape[1], v.shape[2]
        hq, wq, _ = self._query_size(h, w)
        mask = self._pos_mask(h, w, q.dtype)[None]  # [1, heads, Lq, Lk], shared by the batch
        y = F.scaled_dot_product_attention(q, k, v[:, None].expand(b, nh, lk, c), attn_mask=mask)
        # y: [B, heads, Lq, C]; out_i = sum_h y^h_i W_out^h + b with W_out^h = weight[:, :, tap(h)]
        w2 = self.weight.permute(0, 2, 3, 1).reshape(self.out_dim, nh * self.in_dim)
        out = F.linear(y.permute(0, 2, 1, 3).reshape(b, lq, nh * c), w2, self.bias)
        out = out.view(b, hq, wq, self.out_dim).permute(0, 3, 1, 2)
        if self.stride > 1 and self.stride_mode == "s1":
            out = F.avg_pool2d(out, self.stride, self.stride, ceil_mode=True, count_include_pad=False)
        return out

    # -------------------------------------------------------------------------------- analysis
    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor, *, part: str = "mixed") -> torch.Tensor:
        """Attention for input ``x``: [B, heads, Lq, L] over the real input pixels (row-major), queries at the
        attention's output positions (before the s1 pooling). ``part``: "mixed" (the layer's attention),
        "content" (softmax of the content logits alone) or "positional" (of the positional logits alone).
        Border rows sum to less than 1: the rest of the mass sits on the zero-valued padded keys."""
        if part not in ("mixed", "content", "positional"):
            raise ValueError(f"attention_maps: part must be mixed|content|positional, got {part!r}")
        q, k, _, h, w = self._qkv(x)
        pos = self.positional_logits(h, w).to(q.dtype)[None]
        con = (q @ k.transpose(-2, -1)) * self.qk_head_dim**-0.5
        logits = {"mixed": con + pos, "content": con, "positional": pos.expand_as(con)}[part]
        attn = logits.softmax(-1)
        p = self.padding
        b, nh, lq, _ = attn.shape
        attn = attn.view(b, nh, lq, h + 2 * p, w + 2 * p)[..., p : p + h, p : p + w]
        return attn.reshape(b, nh, lq, h * w)

    @torch.no_grad()
    def nonlocality(self, x: torch.Tensor) -> torch.Tensor:
        """Nonlocality per head [heads] ([ConViT21] Eq. 8): (1/Lq) sum_ij A^h_ij |delta_ij|, batch-averaged."""

        attn = self.attention_maps(x).mean(0)
        h, w = int(x.shape[-2]), int(x.shape[-1])
        hq, wq, s = self._query_size(h, w)
        dist = grid_distances(h, w, s, dtype=attn.dtype, device=attn.device)
        return (attn * dist).sum(dim=(-2, -1)) / (hq * wq)

    def extra_repr(self) -> str:
        return (
            f"{self.in_dim}, {self.out_dim}, heads={self.num_heads}, qk_head_dim={self.qk_head_dim}, "
            f"kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
            f"stride_mode={self.stride_mode}, qk_init={self.qk_init}"
        )
