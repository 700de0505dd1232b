"""The ConViT's gated positional self-attention ([ConViT21] Eq. 6-7): a GPSA on tokens [B, N, C] on an (H, W) grid.

Channels split across heads (D_v = D / heads), ``weight`` is the [D_out, D] output projection, the centres of
the convolutional init a sqrt(heads) x sqrt(heads) kernel ([ConViT21] Eq. 5; even sizes centred like timm's
``local_init``). Loads timm ConViT GPSA weights (see `ConvitGPSA._load_timm_keys`). ``attn_impl="auto"`` takes
the dense path on CPU for maps of at most `_DENSE_MAX_TOKENS` tokens, where the attention matrices are small and
SDPA's CPU flash kernel, tiled for long sequences, is the slower one. The shared machinery is `core.nn.gpsa`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.gated_mix import gated_mix
from core.nn.gpsa import ALPHA_MIN, GPSA, softplus_inverse

__all__ = ["ConvitGPSA"]

# On CPU, attn_impl="auto": the dense path up to this many keys. benchmarks/gpsa.py shapes and
# others, forward+backward time SDPA / dense on a 2-core AVX2 EPYC: 4x4 1.08, 7x7 1.13-1.24, 8x8 1.16,
# 10x10 1.26; 12x12 0.91, 14x14 0.85; the benchmark's 14x14, 16x16 and 28x28 shapes 0.63, 0.72 and 0.39.
_DENSE_MAX_TOKENS = 100


class ConvitGPSA(GPSA):
    """The ConViT GPSA ([ConViT21]; module docstring): tokens [B, N, C] -> [B, N, D_out].

    Args:
        in_dim: input channels D (divisible by num_heads).
        out_dim: output channels (default in_dim).
        num_heads: attention heads (required; a square number for the convolutional init).
        qk_head_dim: per-head query/key width (default D / heads, as in timm).
        qkv_bias, bias, positional, alpha_init, lambda_init, proj_drop, attn_impl: see `core.nn.gpsa.GPSA`.
    The token grid is ``forward``'s ``size``, else ``grid_size`` (set by the model), else a square.
    """

    mode: ClassVar[str] = "convit"
    auto_dense_max_tokens: ClassVar[float] = _DENSE_MAX_TOKENS

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None = None,
        num_heads: int | None = None,
        *,
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
        if num_heads is None or num_heads < 1:
            raise ValueError("ConvitGPSA: num_heads is required")
        if in_dim % num_heads:
            raise ValueError(f"ConvitGPSA: in_dim {in_dim} is not divisible by num_heads {num_heads}")
        out_dim = in_dim if out_dim is None else out_dim
        super().__init__(
            in_dim, out_dim, num_heads, (out_dim, in_dim),
            kernel_size=1, stride=1, dilation=1, stride_mode="exact",
            qk_head_dim=qk_head_dim or in_dim // num_heads, qkv_bias=qkv_bias, bias=bias,
            positional=positional, alpha_init=alpha_init, lambda_init=lambda_init, proj_drop=proj_drop,
            attn_impl=attn_impl, device=device, dtype=dtype,
        )  # fmt: skip
        self.grid_size: tuple[int, int] | None = None  # the token grid when forward gets no size
        self._register_load_state_dict_pre_hook(self._load_timm_keys)

    def tap_offsets(self) -> torch.Tensor:
        """Conv-like centers [heads, 2] (row, col): a sqrt(heads) x sqrt(heads) kernel, even sizes centred like
        timm's local_init."""
        k = int(round(self.num_heads**0.5))
        if k * k != self.num_heads:
            raise ValueError(f"ConvitGPSA: local init needs a square number of heads, got {self.num_heads}")
        c, d = (k - 1) / 2 if k % 2 == 0 else k // 2, 1
        idx = torch.arange(self.num_heads)
        return torch.stack([(idx // k - c) * d, (idx % k - c) * d], dim=1).to(torch.float64)

    def _reset_weight(self) -> None:
        """The output projection: timm's ViT init (truncated normal, std 0.02)."""
        nn.init.trunc_normal_(self.weight, std=0.02)

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

    def _tokens(self, x: torch.Tensor, size: tuple[int, int] | None) -> tuple[torch.Tensor, int, int]:
        """Tokens [B, N, C] and their grid: ``size``, else ``grid_size``, else a square."""
        if x.ndim != 3:
            raise ValueError(f"ConvitGPSA expects tokens [B, N, C], got shape {tuple(x.shape)}")
        n = x.shape[1]
        if size is None:
            size = self.grid_size
        if size is None or size[0] * size[1] != n:
            side = math.isqrt(n)
            if side * side != n:
                raise ValueError(f"ConvitGPSA: {n} tokens are not a square grid; pass size=(H, W)")
            size = (side, side)
        return x, int(size[0]), int(size[1])

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """Tokens [B, N, C] on grid ``size`` (module docstring) -> [B, N, D_out]."""
        tokens, h, w = self._tokens(x, size)
        q, k, v = self._project_qkv(tokens, h, w)
        v = v.unflatten(-1, (self.num_heads, self.v_dim // self.num_heads))
        y = self._mix(q, k, v, h, w, dense=self._use_dense(x.device, tokens.shape[1]))
        return self.proj_drop(F.linear(y, self.weight, self.bias))

    def _mix(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, w: int, *, dense: bool
    ) -> torch.Tensor:
        """Attention ([ConViT21] Eq. 6-7), heads owning D/heads channels each; ``dense``: the mixed attention
        materialised, else SDPA plus the separable positional term. q, k, v: [B, L, heads, d]. Returns [B, L, D]."""
        b, lq, nh, _ = q.shape
        dv = v.shape[-1]
        act = v.dtype
        g_con = self._gates(act)[1]
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, L, d] views
        if dense:
            attn = self._scores(qh, kh).softmax(dim=-1)
            pos = self._gated_positional(h, w, act)
            attn = gated_mix(attn, pos, g_con[:, None, None], probs=True)
            return (attn @ vh).transpose(1, 2).reshape(b, lq, nh * dv)
        con = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)  # [B, L, heads, d], contiguous
        py, px = self._gated_factors(h, w, act)  # sigma(lambda) folded into Py
        pos = self._apply_positional(v.view(b, h, w, nh, dv), py, px, shared=False)
        y = gated_mix(con.reshape(b, h, w, nh, dv), pos, g_con[:, None])
        return y.view(b, lq, nh * dv)
