"""Attention Augmented convolution and AA-ResNets (004, Bello et al.).

An attention augmented convolution (004, Sec. 3.2) concatenates convolutional feature maps with multi-head
self-attention feature maps:

    AAConv(X) = Concat[Conv(X), MHA(X)],  d_v = upsilon F_out attention channels, d_k = kappa F_out key depth,

where Conv has F_out - d_v output filters (the attention channels *replace* conv filters, 004 Sec. 4 "we
substitute convolutional feature maps with self-attention feature maps"), the queries / keys / values come
from one 1x1 convolution F_in -> 2 d_k + d_v, the N_h heads are combined by a 1x1 convolution d_v -> d_v
(W^O, 004 Eq. 2), and the attention logits carry 2D relative position logits (004 Eq. 3-4):

    l_ij = q_i^T (k_j + r^W_{j_x - i_x} + r^H_{j_y - i_y}) / sqrt(d_k^h).

r^H [2H - 1, d_k^h] and r^W [2W - 1, d_k^h] are learned per layer and shared across heads (004 Sec. 3.1.1),
which adds (2(H + W) - 2) d_k^h parameters per layer. The relative logits are computed with the memory
efficient "relative to absolute" trick of 004 Appendix A.3 (timm's `rel_logits_1d`, a port of that code).

Choices that 004 leaves open, and how they are made here
- Rounding: d_k and d_v are rounded to a multiple of N_h (at least one dimension per head); d_v <= F_out.
  ``upsilon = 1`` is the fully attentional layer (no conv part, 004 Table 6 last row).
- Spatial sizes: the relative embedding tables are sized for the attention grid at ``img_size`` (the build
  resolution). At other resolutions relative distances beyond the table are clipped to its last entry (the
  clipping of Shaw et al. [37], whose relative attention 004 extends); inside the table nothing changes. So
  any input size works, odd and non-square included.
- Stride 2 (first block of a stage, where timm puts the stride on the 3x3 conv): the attention runs on the
  input average-pooled with 004's downsampling operator (3x3, stride 2, padding 1, padded zeros not counted,
  004 Sec. 3.2), whose output grid is exactly the strided conv's grid (both are floor((n - 1) / 2) + 1 for
  any n, odd included), so the two parts concatenate without resampling. The alternative - full-resolution
  attention then pooling of its output - would cost 16x the attention memory for no gain in the paper's
  framing; 004 downsamples attention *inputs* wherever it needs to save memory.
- "Downsample only during the first stage" (004 Sec. 4.2): in the first augmented stage the attention input is
  pooled once more (3x3 / 2 average pool) and the attention output is upsampled back by bilinear
  interpolation (004 Sec. 3.2). On by default for timm (ImageNet) ResNets, off for the project's small CIFAR
  nets (004 Appendix A.1, CIFAR: "we do not downsample feature maps before the attention operation").
- Where: once per residual block (004 Sec. 3.2) on the 3x3 conv of the last three stages (004 Sec. 4.2):
  ``conv2`` of a bottleneck block, ``conv1`` (the first 3x3, the one that carries the stride) of a basic block
  (as 004 does for Wide-ResNets: "augmenting the first convolution of all residual blocks").
- The augmented conv keeps the block's BatchNorm over all F_out channels (004 Sec. 3.2).
- Biases: the qkv and output 1x1 convolutions have biases (TensorFlow's ``conv2d`` default in 004 A.3); the
  conv part has none (like the ResNet conv it replaces).

Parameter counts (AA-ResNet-50, timm ``resnet50``, 224 px, N_h = 8, kappa = upsilon): with the choices above
the change per augmented layer is 004 Eq. 5,

    Delta = F_in F_out (2 kappa + (1 - k^2) upsilon + upsilon^2 F_out / F_in),

plus biases and relative embeddings (a few thousand parameters in total):

    kappa = upsilon   0.25    0.5     0.75    1.0
    this module       23.78   22.15   20.68   19.36  M
    004 Table 6       24.3    22.3    20.7    19.4   M

The 0.5 - 1.0 rows match to rounding; the 0.25 row is 0.52 M below the paper. The paper's own numbers are not
all consistent with Eq. 5 (Table 3 lists 25.8 M for kappa = upsilon = 0.2 where Eq. 5 gives 24.1 M), and
no variant that keeps Eq. 5 for the other rows reaches 24.3. Variants checked and rejected: keeping all F_out
conv filters (attention channels added instead of substituted: +F_in d_v k^2 per layer, 26.6 M at 0.25);
relative embeddings per head instead of shared (+0.03 M at 0.25, +0.13 M at 1.0; contradicts 004 Sec. 3.1.1).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers.bottleneck_attn import rel_logits_1d
from timm.models.resnet import BasicBlock, Bottleneck

import core.models  # noqa: F401  (registers the project's small nets with timm)
from core.reparam import model_stages

__all__ = ["AAConv2d", "aa_modules", "build_aa_resnet"]


def _pool_size(n: int) -> int:
    """Output length of a 3x3 / stride-2 / padding-1 window (avg pool or conv) over length ``n``."""
    return (n - 1) // 2 + 1


def _pool(x: torch.Tensor) -> torch.Tensor:
    """004's downsampling operator: 3x3 average pooling, stride 2 (TF 'SAME': padded zeros not counted)."""
    return F.avg_pool2d(x, kernel_size=3, stride=2, padding=1, count_include_pad=False)


def _head_depth(ratio: float, f_out: int, num_heads: int) -> int:
    """ratio * F_out rounded to a multiple of N_h, at least N_h (one dimension per head)."""
    return max(1, round(ratio * f_out / num_heads)) * num_heads


class AAConv2d(nn.Module):
    """Attention augmented convolution (004, Sec. 3.2): Concat[Conv(X) (F_out - d_v maps), MHA(X) (d_v maps)].

    Args:
        in_channels, out_channels: F_in, F_out of the convolution being augmented.
        kernel_size, stride: of the convolution part (padding kernel_size // 2).
        kappa: d_k / F_out (key depth ratio), in (0, 1].
        upsilon: d_v / F_out (ratio of attention channels), in (0, 1]; 1 = no conv part.
        num_heads: N_h.
        feat_size: (H, W) of the attention grid the relative embedding tables are sized for.
        relative: add 2D relative position logits (004 Eq. 3); False = position-unaware attention
            (004 Table 7).
        downsample: pool the attention input once more (3x3/2 avg) and upsample its output bilinearly
            (004 Sec. 3.2), on top of the pooling a stride-2 conv implies.
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
        _check_ratios(kappa, upsilon, num_heads)
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
        self.proj = nn.Conv2d(self.dv, self.dv, 1)  # W^O (004 Eq. 2): mixes the heads
        if relative:
            h, w = self.feat_size
            # 004 A.3 initialises with std dkh^-0.5 (its TF call passes that as the *mean*, a known slip).
            self.rel_height = nn.Parameter(torch.randn(2 * h - 1, self.dkh) * self.dkh**-0.5)
            self.rel_width = nn.Parameter(torch.randn(2 * w - 1, self.dkh) * self.dkh**-0.5)
        if self.conv is not None:
            nn.init.kaiming_normal_(self.conv.weight, mode="fan_out", nonlinearity="relu")

    # ---- relative logits (004 Eq. 3-4) ----
    @staticmethod
    def _table(table: torch.Tensor, n: int) -> torch.Tensor:
        """Rows of ``table`` ([2T - 1, d], offsets -(T-1)..T-1) for offsets -(n-1)..n-1, clipped."""
        t = (table.shape[0] + 1) // 2
        idx = torch.arange(-(n - 1), n, device=table.device).clamp(-(t - 1), t - 1) + (t - 1)
        return table[idx]

    def relative_logits(self, q: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """S_H^rel + S_W^rel of 004 Eq. 4 for queries q [B, N_h, h*w, d_k^h] (row-major): [B, N_h, hw, hw].

        Entry [i, j] = q_i . (r^W_{j_x - i_x} + r^H_{j_y - i_y}) (004 Eq. 3 without the key term), via the
        rel-to-abs trick of 004 A.3 (timm's port `rel_logits_1d`). timm's `PosEmbedRel` wraps the same
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
        k, q, v = self.qkv(a).split([self.dk, self.dk, self.dv], dim=1)  # 004 A.3 order

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

    # ---- analysis (same names as core.gpsa.GPSA) ----
    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> torch.Tensor:
        """Attention weights [B, N_h, L, L] on the attention grid (after the input pooling), row-major."""
        return self._weights_and_values(self._attention_input(x))[0]

    @torch.no_grad()
    def nonlocality(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head nonlocality [N_h] (001 Eq. 8) in attention-grid pixels, batch-averaged."""
        a = self._attention_input(x)
        h, w = a.shape[-2:]
        attn = self._weights_and_values(a)[0]
        from core.dissect import grid_distances, nonlocality  # lazy: dissect pulls in pyarrow

        return nonlocality(attn, grid_distances(h, w, device=attn.device)).to(attn.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"dk={self.dk}, dv={self.dv}, heads={self.num_heads}, feat_size={self.feat_size}, "
            f"relative={self.relative}, downsample={self.downsample}"
        )


def _check_ratios(kappa: float, upsilon: float, num_heads: int) -> None:
    if not (isinstance(kappa, int | float) and 0 < kappa <= 1):
        raise ValueError(f"aa_resnet: kappa (= d_k / F_out) must be in (0, 1], got {kappa!r}")
    if not (isinstance(upsilon, int | float) and 0 < upsilon <= 1):
        raise ValueError(f"aa_resnet: upsilon (= d_v / F_out) must be in (0, 1], got {upsilon!r}")
    if not (isinstance(num_heads, int) and num_heads >= 1):
        raise ValueError(f"aa_resnet: num_heads must be a positive int, got {num_heads!r}")


def _target_conv(block: nn.Module) -> str:
    if isinstance(block, Bottleneck):
        return "conv2"
    if isinstance(block, BasicBlock):
        return "conv1"
    raise ValueError(f"aa_resnet: unsupported residual block {type(block).__name__}")


def _conv_input_sizes(model: nn.Module, names: Sequence[str], img_size: tuple[int, int]) -> dict[str, tuple]:
    """Spatial input size of each named conv for an ``img_size`` input (shapes only, on the meta device)."""
    meta = copy.deepcopy(model).to("meta")
    sizes: dict[str, tuple] = {}
    hooks = [
        meta.get_submodule(n).register_forward_hook(
            lambda _m, inp, _out, n=n: sizes.__setitem__(n, tuple(inp[0].shape[-2:]))
        )
        for n in names
    ]
    in_chans = next(m for m in meta.modules() if isinstance(m, nn.Conv2d)).in_channels
    with torch.no_grad():
        meta.eval()(torch.empty(1, in_chans, *img_size, device="meta"))
    for hk in hooks:
        hk.remove()
    return sizes


def build_aa_resnet(arch: str, num_classes: int, **options: Any) -> nn.Module:
    """AA-ResNet (004, Sec. 4.2): a timm ResNet whose 3x3 convs of the chosen stages are `AAConv2d`.

    Args:
        arch: timm ResNet-family name (``resnet50`` = AA-ResNet-50) or a project small net
            (``resnet10_cifar``).
        num_classes: classifier outputs.
        options: ``kappa`` (0.25), ``upsilon`` (0.25) - 004 Table 2/6 first row; ``num_heads``
            (8, 004 Sec. 4.2);
            ``stages`` (indices into [layer1..layerN], default (-3, -2, -1): the last three, 004 Sec. 4.2);
            ``img_size`` (int or (H, W); sizes the relative embedding tables; default the arch's timm input
            size,
            32 for the project's nets); ``downsample_first_stage`` (None = True for timm nets, False for the
            project's small nets; see module docstring); ``relative`` (True); everything else (``in_chans``,
            ``drop_path_rate``, ...) goes to ``timm.create_model``.

    The result is a pure function of (arch, num_classes, options) up to the random init, so a state_dict loads
    into a model rebuilt from the same arguments.
    """
    opts = dict(options)
    kappa = opts.pop("kappa", 0.25)
    upsilon = opts.pop("upsilon", 0.25)
    num_heads = opts.pop("num_heads", 8)
    stages = tuple(opts.pop("stages", (-3, -2, -1)))
    relative = bool(opts.pop("relative", True))
    downsample_first = opts.pop("downsample_first_stage", None)
    img_size = opts.pop("img_size", None)
    _check_ratios(kappa, upsilon, num_heads)
    if not core.models.is_known_arch(arch):
        raise ValueError(f"aa_resnet: unknown arch {arch!r}")
    project_net = arch in core.models.PROJECT_ARCHS
    model = timm.create_model(arch, num_classes=num_classes, **opts)
    if downsample_first is None:
        downsample_first = not project_net
    if img_size is None:
        img_size = 32 if project_net else model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    img_hw = (
        (int(img_size), int(img_size)) if isinstance(img_size, int | float) else tuple(map(int, img_size))
    )

    all_stages = model_stages(model)
    n = len(all_stages)
    if not all_stages:
        raise ValueError(f"aa_resnet: {arch} has no ResNet stages (layer1, layer2, ...)")
    picked = sorted({int(s) % n for s in stages if -n <= int(s) < n})
    if len(picked) != len(stages) or not picked:
        raise ValueError(f"aa_resnet: stages {stages} out of range for {n} stages (or repeated)")
    targets: list[tuple[str, nn.Conv2d, bool]] = []
    for rank, idx in enumerate(picked):
        stage_name, stage = all_stages[idx]
        for block_name, block in stage.named_children():
            conv_name = f"{stage_name}.{block_name}.{_target_conv(block)}"
            conv = model.get_submodule(conv_name)
            if conv.groups != 1 or conv.dilation != (1, 1) or conv.kernel_size[0] != conv.kernel_size[1]:
                raise ValueError(f"aa_resnet: {conv_name} is grouped, dilated or non-square; not supported")
            targets.append((conv_name, conv, downsample_first and rank == 0))
    sizes = _conv_input_sizes(model, [t[0] for t in targets], img_hw)
    for conv_name, conv, down in targets:
        h, w = sizes[conv_name]
        for _ in range(int(conv.stride[0] == 2) + int(down)):
            h, w = _pool_size(h), _pool_size(w)
        aa = AAConv2d(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size[0],
            conv.stride[0],
            kappa=kappa,
            upsilon=upsilon,
            num_heads=num_heads,
            feat_size=(h, w),
            relative=relative,
            downsample=down,
        )
        parent, _, leaf = conv_name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, aa)
    model.aa_config = dict(
        kappa=kappa, upsilon=upsilon, num_heads=num_heads, stages=stages, img_size=img_hw, relative=relative
    )
    return model


def aa_modules(model: nn.Module) -> list[tuple[str, AAConv2d]]:
    """All `AAConv2d` layers of ``model`` as (name, module)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AAConv2d)]
