"""What the positional self-attention layers share: heads centred on a conv's taps with a locality strength
alpha ([Cordonnier20] Lemma 1; [ConViT21] Eq. 5; [TCNN21] Sec. 2), built from a conv whose filter they hold.

`core.nn.gpsa.GPSA` (gated; its T-CNN and ConViT subclasses) and `core.nn.psa.PSA` (ungated) both take
`PositionalHeads`: the conv-tap centres, alpha rectified by a softplus ([TCNN21] footnote 1), the query grid
of the two stride modes and ``from_conv``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.nn.attention_layers import STRIDE_MODES

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "ALPHA_BETA",
    "ALPHA_MIN",
    "STRIDE_MODES",
    "PositionalHeads",
    "conv_geometry",
    "conv_kwargs",
    "load_conv",
    "relative_encodings",
    "softplus_inverse",
]

ALPHA_BETA = 5.0  # softplus sharpness for the locality strength ([TCNN21], footnote 1)
ALPHA_MIN = 1e-6  # floor added to the softplus: in fp32 softplus(x) underflows to exactly 0 for x < ~-18


def softplus_inverse(alpha: torch.Tensor | float, beta: float = ALPHA_BETA) -> torch.Tensor:
    """Inverse of ``softplus(x, beta) = log(1 + exp(beta x)) / beta`` for alpha > 0.

    x = alpha + log(1 - exp(-beta alpha)) / beta, computed with expm1 so that it is exact for large alpha
    (where x = alpha to float precision) and finite for tiny alpha.
    """
    a = torch.as_tensor(alpha, dtype=torch.float64)
    if bool((a <= 0).any()):
        raise ValueError(f"softplus_inverse needs alpha > 0, got min {float(a.min())}")
    return a + torch.log(-torch.expm1(-beta * a)) / beta


def relative_encodings(
    height: int, width: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense relative encodings r_ij = (|delta|^2, delta_1, delta_2) on a height x width grid, [L, L, 3].

    delta = position(j) - position(i) with delta_1 the row and delta_2 the column offset; tokens are in
    row-major order. For analysis and tests; the layer itself uses the separable form (module docstring).
    """
    rows = torch.arange(height, device=device, dtype=dtype).repeat_interleave(width)
    cols = torch.arange(width, device=device, dtype=dtype).repeat(height)
    d1 = rows[None, :] - rows[:, None]
    d2 = cols[None, :] - cols[:, None]
    return torch.stack([d1**2 + d2**2, d1, d2], dim=-1)


def conv_geometry(conv: nn.Conv2d, who: str) -> tuple[int, int, int]:
    """(kernel, stride, dilation) of a conv that attention can reproduce exactly (plain nn.Conv2d, square odd
    kernel, equal strides / dilations, no groups, zero padding of dilation * (k - 1) / 2); else one clear error
    naming ``who``."""
    if type(conv) is not nn.Conv2d:
        raise TypeError(f"{who}: unsupported conv type {type(conv).__name__} (need nn.Conv2d)")
    kh, kw = conv.kernel_size
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    if kh != kw or kh % 2 == 0:
        raise ValueError(f"{who}: kernel must be square and odd, got {conv.kernel_size}")
    if sh != sw or dh != dw:
        raise ValueError(f"{who}: stride/dilation must be equal on both axes, got {conv}")
    if conv.groups != 1:
        raise ValueError(f"{who}: grouped convolutions are not supported (groups={conv.groups})")
    if conv.padding_mode != "zeros":
        raise ValueError(f"{who}: padding_mode must be 'zeros', got {conv.padding_mode!r}")
    want = dh * (kh - 1) // 2
    pad = conv.padding
    if isinstance(pad, str):
        if pad != "same" or sh != 1:
            raise ValueError(f"{who}: padding {pad!r} with stride {sh} is not supported")
    elif tuple(pad) != (want, want):
        raise ValueError(f"{who}: padding must be {want} (got {pad}) for kernel {kh}, dilation {dh}")
    return kh, sh, dh


def conv_kwargs(conv: nn.Conv2d, who: str) -> dict[str, Any]:
    """The constructor arguments that give a GPSA / PSA ``conv``'s geometry, bias, device and dtype."""
    kh, sh, dh = conv_geometry(conv, who)
    w = conv.weight
    return {
        "in_dim": conv.in_channels, "out_dim": conv.out_channels, "kernel_size": kh, "stride": sh,
        "dilation": dh, "bias": conv.bias is not None, "device": w.device, "dtype": w.dtype,
    }  # fmt: skip


def load_conv(m: M, conv: nn.Conv2d) -> M:
    """Copy ``conv``'s filter and bias into ``m`` (the T-CNN layout: ``weight`` IS the filter) and its
    train/eval mode; returns ``m``."""
    with torch.no_grad():
        m.weight.copy_(conv.weight)
        if conv.bias is not None:
            m.bias.copy_(conv.bias)
    m.train(conv.training)
    return m


class PositionalHeads:
    """Mixin of the positional-attention layers (module docstring): needs ``num_heads``, ``kernel_size``,
    ``dilation``, ``stride``, ``stride_mode`` and, for the softplus parameterisation, ``pos_alpha`` [heads]
    and ``pos_center`` [heads, 2]."""

    num_heads: int
    kernel_size: int
    dilation: int
    stride: int
    stride_mode: str
    pos_alpha: torch.Tensor
    pos_center: torch.Tensor

    @classmethod
    def from_conv(
        cls, conv: nn.Conv2d, *, alpha_init: float = 1.0, stride_mode: str = "exact", **kwargs: Any
    ):
        """The layer computing ``conv`` at large alpha: ``weight`` = the filter, ``bias`` = the conv's bias,
        W_val = I ([Cordonnier20] Lemma 1; [TCNN21] Sec. 2)."""
        m = cls(
            **conv_kwargs(conv, f"{cls.__name__}.from_conv"),
            stride_mode=stride_mode,
            alpha_init=alpha_init,
            **kwargs,
        )
        return load_conv(m, conv)

    def conv_tap_offsets(self) -> torch.Tensor:
        """Conv-like centres [heads, 2] (row, col): head h <-> tap (h // k, h % k), row-major, dilated."""
        k, c, d = self.kernel_size, self.kernel_size // 2, self.dilation
        idx = torch.arange(self.num_heads)
        return torch.stack([(idx // k - c) * d, (idx % k - c) * d], dim=1).to(torch.float64)

    @torch.no_grad()
    def _set_softplus_positional(self, alpha: torch.Tensor, centers: torch.Tensor) -> None:
        if bool((alpha <= ALPHA_MIN).any()):
            raise ValueError(f"{type(self).__name__}: alpha must be > {ALPHA_MIN}, got {alpha.tolist()}")
        self.pos_alpha.copy_(softplus_inverse(alpha - ALPHA_MIN))
        self.pos_center.copy_(centers)

    def _softplus_alpha(self) -> torch.Tensor:
        """Rectified locality strength alpha [heads] = softplus(alpha~, beta=5) + ALPHA_MIN."""
        return F.softplus(self.pos_alpha, beta=ALPHA_BETA) + ALPHA_MIN

    def _query_size(self, h: int, w: int) -> tuple[int, int, int]:
        """(query rows, query cols, query stride) for an h x w input."""
        s = self.stride if self.stride_mode == "exact" else 1
        return -(-h // s), -(-w // s), s
