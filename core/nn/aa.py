"""Attention Augmented convolution ([Bello19], Bello et al.); the AA-ResNets are built by `core.models.aa_resnet`.

An attention augmented convolution ([Bello19], Sec. 3.2) concatenates convolutional feature maps with multi-head
self-attention feature maps:
    AAConv(X) = Concat[Conv(X), MHA(X)],  d_v = upsilon F_out attention channels, d_k = kappa F_out key depth,

where Conv has F_out - d_v output filters (the attention channels *replace* conv filters, [Bello19] Sec. 4 "we
substitute convolutional feature maps with self-attention feature maps"), the queries / keys / values come
from one 1x1 convolution F_in -> 2 d_k + d_v, the N_h heads are combined by a 1x1 convolution d_v -> d_v
(W^O, [Bello19] Eq. 2), and the attention logits carry 2D relative position logits ([Bello19] Eq. 3-4):
    l_ij = q_i^T (k_j + r^W_{j_x - i_x} + r^H_{j_y - i_y}) / sqrt(d_k^h).

r^H [2H - 1, d_k^h] and r^W [2W - 1, d_k^h] are learned per layer and shared across heads ([Bello19] Sec. 3.1.1),
which adds (2(H + W) - 2) d_k^h parameters per layer. The relative logits are computed with the memory
efficient "relative to absolute" trick of [Bello19] Appendix A.3 (timm's `rel_logits_1d`, a port of that code).

Choices that [Bello19] leaves open, and how they are made here
- Rounding: d_k and d_v are rounded to a multiple of N_h (at least one dimension per head); d_v <= F_out.
  ``upsilon = 1`` is the fully attentional layer (no conv part, [Bello19] Table 6 last row).
- Spatial sizes: the relative embedding tables are sized for the attention grid at ``img_size`` (the build
  resolution). At other resolutions relative distances beyond the table are clipped to its last entry (the
  clipping of Shaw et al. [37], whose relative attention [Bello19] extends); inside the table nothing changes. So
  any input size works, odd and non-square included.
- Stride 2 (first block of a stage, where timm puts the stride on the 3x3 conv): the attention runs on the
  input average-pooled with [Bello19]'s downsampling operator (3x3, stride 2, padding 1, padded zeros not counted,
  [Bello19] Sec. 3.2), whose output grid is exactly the strided conv's grid (both are floor((n - 1) / 2) + 1 for
  any n, odd included), so the two parts concatenate without resampling. The alternative - full-resolution
  attention then pooling of its output - would cost 16x the attention memory for no gain in the paper's
  framing; [Bello19] downsamples attention *inputs* wherever it needs to save memory.
- "Downsample only during the first stage" ([Bello19] Sec. 4.2): in the first augmented stage the attention input is
  pooled once more (3x3 / 2 average pool) and the attention output is upsampled back by bilinear
  interpolation ([Bello19] Sec. 3.2). On by default for timm (ImageNet) ResNets, off for the project's small CIFAR
  nets ([Bello19] Appendix A.1, CIFAR: "we do not downsample feature maps before the attention operation").
- Where: once per residual block ([Bello19] Sec. 3.2) on the 3x3 conv of the last three stages ([Bello19] Sec. 4.2):
  ``conv2`` of a bottleneck block, ``conv1`` (the first 3x3, the one that carries the stride) of a basic block
  (as [Bello19] does for Wide-ResNets: "augmenting the first convolution of all residual blocks").
- The augmented conv keeps the block's BatchNorm over all F_out channels ([Bello19] Sec. 3.2).
- Biases: the qkv and output 1x1 convolutions have biases (TensorFlow's ``conv2d`` default in [Bello19] A.3); the
  conv part has none (like the ResNet conv it replaces).

Parameter counts (AA-ResNet-50, timm ``resnet50``, 224 px, N_h = 8, kappa = upsilon): with the choices above
the change per augmented layer is [Bello19] Eq. 5,

    Delta = F_in F_out (2 kappa + (1 - k^2) upsilon + upsilon^2 F_out / F_in),

plus biases and relative embeddings (a few thousand parameters in total):
    kappa = upsilon   0.25    0.5     0.75    1.0
    this module       23.78   22.15   20.68   19.36  M
    [Bello19] Table 6       24.3    22.3    20.7    19.4   M

The 0.5 - 1.0 rows match to rounding; the 0.25 row is 0.52 M below the paper. The paper's own numbers are not
all consistent with Eq. 5 (Table 3 lists 25.8 M for kappa = upsilon = 0.2 where Eq. 5 gives 24.1 M), and
no variant that keeps Eq. 5 for the other rows reaches 24.3. Variants checked and rejected: keeping all F_out
conv filters (attention channels added instead of substituted: +F_in d_v k^2 per layer, 26.6 M at 0.25);
relative embeddings per head instead of shared (+0.03 M at 0.25, +0.13 M at 1.0; contradicts [Bello19] Sec. 3.1.1).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers.bottleneck_attn import rel_logits_1d

from core.nn.locality import grid_distances, nonlocality

__all__ = ["AAConv2d", "aa_modules", "check_ratios", "pool_size"]


def pool_size(n: int) -> int:
    """Output length of a 3x3 / stride-2 / padding-1 window (avg pool or conv) over length ``n``."""
    return (n - 1) // 2 + 1


def _pool(x: torch.Tensor) -> torch.Tensor:
    """[Bello19]'s downsampling operator: 3x3 average pooling, stride 2 (TF 'SAME': padded zeros not counted)."""
    return F.avg_pool2d(x, kernel_size=3, stride=2, padding=1, count_include_pad=False)


def _head_depth(ratio: float, f_out: int, num_heads: int) -> int:
    """ratio * F_out rounded to a multiple of N_h, at least N_h (one dimension per head)."""
    return max(1, round(ratio * f_out / num_heads)) * num_heads


class AAConv2d(nn.Module):
    """Attention augmented convolution ([Bello19], Sec. 3.2): Concat[Conv(X) (F_out - d_v maps), MHA(X) (d_v maps)].

    Args:
        in_channels, out_channels: F_in, F_out of the convolution being augmented.
        kernel_size, stride: of the convolution part (padding kernel_size // 2).
        kappa: d_k / F_out (key depth ratio), in (0, 1].
        upsilon: d_v / F_out (ratio of attention channels), in (0, 1]; 1 = no conv part.
        num_heads: N_h.
        feat_size: (H, W) of the attention grid the relative embedding tables are sized for.
        relative: add 2D relative position logits ([Bello19] Eq. 3); False = position-unaware attention
            ([Bello19] Table 7).
        downsample: pool the attention input once more (3x3/2 avg) and upsample its output bilinearly
            ([Bello19] Sec. 3.2), on top of the pooling a stride-2 conv implies.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        *,
        kappa: float,
        upsilon: float,
        num_heads: int = 8,
        feat_size: tuple[int, int] = (14, 14),
        relative: bool = True,
        downsample: bool = False,
    ) -> None:
        super().__init__()
        check_ratios(kappa, upsilon, num_heads)
        if stride not in (1, 2):
            raise ValueError(f"AAConv2d: stride must be 1 or 2, got {stride}")
        if kernel_size % 2 != 1:
            raise ValueError(f"AAConv2d: kernel_size must be odd, got {kernel_size}")
        if out_channels < num_heads:
            raise ValueError(f"AAConv2d: out_channels {out_channels} < num_heads {num_heads}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = kernel_size, stride
        self.num_heads = num_heads
        self.dk = _head_depth(kappa, out_channels, num_heads)
        self.dv = min(_head_depth(upsilon, out_channels, num_heads), out_channels // num_heads * num_heads)
        self.dkh, self.dvh = self.dk // num_heads, self.dv // num_heads
        self.relative, self.downsample = relative, downsample
        self.feat_size = (int(feat_size[0]), int(feat_size[1]))
        n_conv = out_channels - self.dv
        self.conv = (
            nn.Conv2d(in_channels, n_conv, kernel_size, stride, kernel_size // 2, bias=False)
            if n_conv
            else None
        )
        self.qkv = nn.Conv2d(in_channels, 2 * self.dk + self.dv, 1)
        self.proj = nn.Conv2d(self.dv, self.dv, 1)  # W^O ([Bello19] Eq. 2): mixes the heads
        if relative:
            h, w = self.feat_size
            # [Bello19] A.3 initialises with std dkh^-0.5 (its TF call passes that as the *mean*, a known slip).
            self.rel_height = nn.Parameter(torch.randn(2 * h - 1, self.dkh) * self.dkh**-0.5)
            self.rel_width = nn.Parameter(torch.randn(2 * w - 1, self.dkh) * self.dkh**-0.5)
        if self.conv is not None:
            nn.init.kaiming_normal_(self.conv.weight, mode="fan_out", nonlinearity="relu")

    # ---- relative logits ([Bello19] Eq. 3-4) ----
    @staticmethod
    def _table(table: torch.Tensor, n: int) -> torch.Tensor:
        """Rows of ``table`` ([2T - 1, d], offsets -(T-1)..T-1) for offsets -(n-1)..n-1, clipped."""
        t = (table.shape[0] + 1) // 2
        idx = torch.arange(-(n - 1), n, device=table.device).clamp(-(t - 1), t - 1) + (t - 1)
        return table[idx]

    def relative_logits(self, q: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """S_H^rel + S_W^rel of [Bello19] Eq. 4 for queries q [B, N_h, h*w, d_k^h] (row-major): [B, N_h, hw, hw].

        Entry [i, j] = q_i . (r^W_{j_x - i_x} + r^H_{j_y - i_y}) ([Bello19] Eq. 3 without the key term), via the
        rel-to-abs trick of [Bello19] A.3 (timm's port `rel_logits_1d`). timm's `PosEmbedRel` wraps the same
        function but fixes the grid at construction (it reshapes q to its stored feat_size), so it cannot run
        at other resolutions; here the grid is the runtime one (tables sliced / clipped).
        """
        b, nh, _, d = q.shape
        qg = q.reshape(b * nh, h, w, d)
        rel_w = rel_logits_1d(qg, self._table(self.rel_width, w), permute_mask=(0, 1, 3, 2, 4))
        rel_h = rel_logits_1d(
            qg.transpose(1, 2), self._table(self.rel_height, h), permute_mask=(0, 3, 1, 4, 2)
        )
        return (rel_w + rel_h).reshape(b, nh, h * w, h * w)

    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 2:
            x = _pool(x)
        if self.downsample:
            x = _pool(x)
        return x

    def _weights_and_values(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention weights [B, N_h, L, L] and values [B, N_h, L, d_v^h] on the attention grid of ``a``."""
        b, _, h, w = a.shape
        nh = self.num_heads
        k, q, v = self.qkv(a).split([self.dk, self.dk, self.dv], dim=1)  # [Bello19] A.3 order

        def heads(t: torch.Tensor, d: int) -> torch.Tensor:
            return t.reshape(b, nh, d, h * w).transpose(-1, -2)

        q = heads(q, self.dkh) * self.dkh**-0.5
        k, v = heads(k, self.dkh), heads(v, self.dvh)
        logits = q @ k.transpose(-1, -2)
        if self.relative:
            logits = logits + self.relative_logits(q, h, w)
        return logits.softmax(dim=-1), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, hi, wi = x.shape
        p = self.kernel_size // 2
        ho, wo = (
            (hi + 2 * p - self.kernel_size) // self.stride + 1,
            (wi + 2 * p - self.kernel_size) // self.stride + 1,
        )
        a = self._attention_input(x)
        h, w = a.shape[-2:]
        attn, v = self._weights_and_values(a)
        out = (
            (attn @ v).transpose(-1, -2).reshape(b, self.dv, h, w)
        )  # heads combined: channel = head * dvh + c
        out = self.proj(out)
        if (h, w) != (ho, wo):
            out = F.interpolate(out, size=(ho, wo), mode="bilinear", align_corners=False)
        if self.conv is None:
            return out
        return torch.cat([self.conv(x), out], dim=1)

    # ---- analysis (same names as core.nn.gpsa.GPSA) ----
    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> torch.Tensor:
        """Attention weights [B, N_h, L, L] on the attention grid (after the input pooling), row-major."""
        return self._weights_and_values(self._attention_input(x))[0]

    @torch.no_grad()
    def nonlocality(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head nonlocality [N_h] ([ConViT21] Eq. 8) in attention-grid pixels, batch-averaged."""
        a = self._attention_input(x)
        h, w = a.shape[-2:]
        attn = self._weights_and_values(a)[0]

        return nonlocality(attn, grid_distances(h, w, device=attn.device)).to(attn.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"dk={self.dk}, dv={self.dv}, heads={self.num_heads}, feat_size={self.feat_size}, "
            f"relative={self.relative}, downsample={self.downsample}"
        )


def check_ratios(kappa: float, upsilon: float, num_heads: int) -> None:
    if not (isinstance(kappa, int | float) and 0 < kappa <= 1):
        raise ValueError(f"aa_resnet: kappa (= d_k / F_out) must be in (0, 1], got {kappa!r}")
    if not (isinstance(upsilon, int | float) and 0 < upsilon <= 1):
        raise ValueError(f"aa_resnet: upsilon (= d_v / F_out) must be in (0, 1], got {upsilon!r}")
    if not (isinstance(num_heads, int) and num_heads >= 1):
        raise ValueError(f"aa_resnet: num_heads must be a positive int, got {num_heads!r}")


def aa_modules(model: nn.Module) -> list[tuple[str, AAConv2d]]:
    """All `AAConv2d` layers of ``model`` as (name, module)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AAConv2d)]
