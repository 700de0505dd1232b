"""Gated positional self-attention (GPSA): what the T-CNN and the ConViT layer share.

GPSA ([ConViT21], Eq. 6-7; [TCNN21], Eq. 7): per head h and query i,

    A^h_ij = (1 - sigma(lambda_h)) softmax_j(Q^h_i . K^h_j / sqrt(d_h)) + sigma(lambda_h) softmax_j(v_pos^h . r_ij)
    out_i  = sum_h sum_j A^h_ij V^h_j W_out^h + b

with the fixed relative encodings r_ij = (|delta|^2, delta_1, delta_2), delta = key position - query position, and
v_pos^h = -alpha_h (1, -2 Delta^h_1, -2 Delta^h_2) ([TCNN21], Eq. 4), i.e. a positional score -alpha_h |delta - Delta^h|^2
up to a per-head constant that cancels in the softmax. A convex mix of two softmaxes is already normalised, so
there is no renormalisation pass ([ConViT21], Eq. 6 writes one; it is the identity up to rounding).

Two layers share the base `GPSA` (gates, positional parameters and their cached factors, content scores, the
gated mix, attention maps, nonlocality):
- `core.nn.gpsa_tcnn.TcnnGPSA` ([TCNN21] Sec. 2): one head per kernel tap, conv-shaped NCHW input and output,
  ``weight`` IS the conv filter, exact or s1 strides, ``from_conv``;
- `core.nn.gpsa_convit.ConvitGPSA` ([ConViT21]): channels split across heads, tokens [B, N, C] on a grid,
  loads timm's ConViT GPSA weights.
``mode`` ("tcnn" / "convit") is a read-only class attribute naming the layer.

Speed (see benchmarks/gpsa.py). The positional score is separable, -alpha((dy - Dy)^2 + (dx - Dx)^2), so the
positional softmax over a rectangular (padded) key grid is the outer product of a row softmax and a column
softmax: P^h = Py^h (x) Px^h. It is input-independent: computed once per forward for the whole batch (and
reused across forwards while autograd is off and the parameters are unchanged), and applied to the values with
the batch folded into the GEMM (`GPSA._apply_positional`): one matmul with the dense P on small maps, one per
axis with the factors on larger ones (cost (H + W) per token instead of H * W). q/k/v come from one fused
projection. The content term goes through ``F.scaled_dot_product_attention`` (``attn_impl="sdpa"``);
``attn_impl="dense"`` instead materialises the mixed attention once and multiplies it with V in one batched
matmul; ``"auto"`` picks the dense path on CPU up to the layer's ``auto_dense_max_tokens`` keys. Probabilities
below 1e-19 are flushed to zero (see `core.nn.gated_mix._flush_tiny`): subnormal operands slow CPU matmuls
10-45x. The gated mix itself is `core.nn.gated_mix.gated_mix`.

What GPSA shares with the ungated `core.nn.psa.PSA` (conv-tap centres, the softplus-rectified alpha, the query
grid of the stride modes, ``from_conv``) is `core.nn.positional.PositionalHeads`.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.gated_mix import _compute_dtype, _flush_tiny
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

_POSITIONAL = ("softplus", "linear")
_ATTN_IMPLS = ("auto", "sdpa", "dense")


class GPSA(PositionalHeads, nn.Module, metaclass=abc.ABCMeta):
    """Gated positional self-attention, the shared base (module docstring); build `TcnnGPSA` or `ConvitGPSA`.

    A subclass resolves its geometry and passes it here; it provides the input layout (`_tokens`), the
    convolutional init of the centres (`tap_offsets`) and of ``weight`` (`_reset_weight`), and ``forward``.

    Args:
        in_dim, out_dim: input / output channels D_in, D_out.
        num_heads: attention heads.
        weight_shape: shape of ``weight`` (the conv filter or the output projection).
        kernel_size, stride, dilation, stride_mode: the geometry of the query and key grids
            (padding = dilation * (kernel_size - 1) // 2).
        qk_head_dim: per-head query/key width.
        qkv_bias: bias on the q/k/v projections.
        bias: bias on the output projection.
        positional: "softplus" (alpha = softplus(alpha~, beta=5) + ALPHA_MIN, centers Delta; [TCNN21] footnote 1)
            or "linear" (raw v_pos in R^3 per head, exactly timm's unconstrained ``pos_proj``).
        alpha_init, lambda_init: initial locality strength alpha (rectified) and gating parameter lambda.
        proj_drop: dropout after the output projection.
        attn_impl: "auto", "sdpa" or "dense".
    """

    #: "tcnn" or "convit": which layer this is (read-only, set by the subclass).
    mode: ClassVar[str]
    #: attn_impl="auto" on CPU takes the dense path up to this many keys.
    auto_dense_max_tokens: ClassVar[float]

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_heads: int,
        weight_shape: tuple[int, ...],
        *,
        kernel_size: int,
        stride: int,
        dilation: int,
        stride_mode: str,
        qk_head_dim: int,
        qkv_bias: bool,
        bias: bool,
        positional: str,
        alpha_init: float,
        lambda_init: float,
        proj_drop: float,
        attn_impl: str,
        device: Any,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        for name, value, allowed in (
            ("positional", positional, _POSITIONAL),
            ("attn_impl", attn_impl, _ATTN_IMPLS),
        ):
            if value not in allowed:
                raise ValueError(f"{type(self).__name__}: {name} must be one of {allowed}, got {value!r}")
        if alpha_init <= 0:
            raise ValueError(f"{type(self).__name__}: alpha_init must be > 0, got {alpha_init}")
        self.in_dim, self.out_dim, self.num_heads = in_dim, out_dim, num_heads
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        self.padding = dilation * (kernel_size - 1) // 2
        self.stride_mode = stride_mode
        self.qk_head_dim, self.v_dim = qk_head_dim, in_dim  # ConViT splits V across heads, T-CNN shares it
        self.positional, self.attn_impl = positional, attn_impl

        qk = num_heads * qk_head_dim
        self.qkv_weight = nn.Parameter(torch.empty(2 * qk + in_dim, in_dim, **dd))
        self.qkv_bias = nn.Parameter(torch.zeros(2 * qk + in_dim, **dd)) if qkv_bias else None
        self.weight = nn.Parameter(torch.empty(*weight_shape, **dd))
        self.bias = nn.Parameter(torch.zeros(out_dim, **dd)) if bias else None
        self.gating_param = nn.Parameter(torch.full((num_heads,), float(lambda_init), **dd))
        if positional == "softplus":
            self.pos_alpha = nn.Parameter(torch.empty(num_heads, **dd))
            self.pos_center = nn.Parameter(torch.empty(num_heads, 2, **dd))
        else:
            self.pos_weight = nn.Parameter(torch.empty(num_heads, 3, **dd))  # columns (|delta|^2, d1, d2)
        self.proj_drop = nn.Dropout(proj_drop)
        self._enc_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_parameters()
        # Convolutional init of the positional part: alpha = alpha_init, centres on the kernel taps.
        self.set_positional(
            alpha=torch.full((self.num_heads,), float(alpha_init)), centers=self.tap_offsets()
        )

    # ----------------------------------------------------------------------------------------- init
    @abc.abstractmethod
    def tap_offsets(self) -> torch.Tensor:
        """Conv-like centers [heads, 2] (row, col) of the convolutional init."""

    @abc.abstractmethod
    def _reset_weight(self) -> None:
        """Initialise ``weight`` (in place, under no_grad)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Convolutional init ([TCNN21] Eq. 4, 6) of all but the positional part (`set_positional`): W_val = I.

        q/k get timm's ViT init (truncated normal, std 0.02); ``weight`` is the subclass's (`_reset_weight`).
        """
        qk = 2 * self.num_heads * self.qk_head_dim
        nn.init.trunc_normal_(self.qkv_weight[:qk], std=0.02)
        self.qkv_weight[qk:].copy_(torch.eye(self.v_dim, self.in_dim))
        if self.qkv_bias is not None:
            self.qkv_bias.zero_()
        self._reset_weight()
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
    @abc.abstractmethod
    def _tokens(self, x: torch.Tensor, size: tuple[int, int] | None) -> tuple[torch.Tensor, int, int]:
        """Input -> tokens [B, L, C] (channels last) and the grid (h, w)."""

    def _use_dense(self, device: torch.device, tokens: int) -> bool:
        """Whether this call takes the dense path: ``attn_impl`` when explicit; for "auto", on CPU only, with at
        most ``auto_dense_max_tokens`` keys (the subclass's measured choice)."""
        if self.attn_impl != "auto":
            return self.attn_impl == "dense"
        return device.type == "cpu" and tokens <= self.auto_dense_max_tokens

    def _project_qkv(
        self, tokens: torch.Tensor, h: int, w: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Lq, heads, d], k [B, L, heads, d], v [B, L, D_in] from tokens [B, L, C] on an h x w grid;
        queries only at the output positions of an exact stride."""
        b = tokens.shape[0]
        hq, wq, s = self._query_size(h, w)
        nh, dq, dv = self.num_heads, self.qk_head_dim, self.v_dim
        qk = nh * dq
        wqkv, bqkv = self.qkv_weight, self.qkv_bias
        # one GEMM, split (not sliced: a slice's backward zero-fills + adds per slice)
        if s == 1:
            q, k, v = F.linear(tokens, wqkv, bqkv).split([qk, qk, dv], dim=-1)  # [B, L, *] column views
        else:  # exact stride: queries only at the conv's output positions
            xq = tokens.view(b, h, w, -1)[:, ::s, ::s].reshape(b, hq * wq, -1)
            wq_, wkv = wqkv.split([qk, qk + dv])
            bq, bkv = (None, None) if bqkv is None else bqkv.split([qk, qk + dv])
            q = F.linear(xq, wq_, bq)
            k, v = F.linear(tokens, wkv, bkv).split([qk, dv], dim=-1)
        return q.unflatten(-1, (nh, dq)), k.unflatten(-1, (nh, dq)), v

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
        cached apart from one made without it, so the two never mix. Sizes in the key are ints also while
        ``torch.jit.trace`` records (it hands out sizes as tensors), so a traced graph takes the cached value
        as a constant."""
        if torch.is_grad_enabled():
            return make()
        key = tuple(int(k) if isinstance(k, torch.Tensor) else k for k in key)
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

    def _geometry_repr(self) -> str:
        """The subclass's geometry for `extra_repr` (", kernel_size=..."; empty by default)."""
        return ""

    def extra_repr(self) -> str:
        s = f"{self.in_dim}, {self.out_dim}, heads={self.num_heads}, mode={self.mode}, qk_head_dim={self.qk_head_dim}"
        return s + self._geometry_repr() + f", positional={self.positional}, attn_impl={self.attn_impl}"
