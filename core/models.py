"""Model factory: `build(kind, arch, num_classes, **options)` for every model kind the project knows.

Kinds
- "cnn": any timm model name or a project-registered small net (below).
- "tcnn": the CNN above reparameterized by `core.reparam.to_tcnn` (000, Sec. 2). Options ``alpha_init``,
  ``lambda_init``, ``stages``, ``stride_mode`` go to `to_tcnn`; the rest to the CNN.
- "convit": the project's ConViT (001): timm's ConViT architecture (``convit_tiny``, ``convit_small``,
  ``convit_base`` configs) running on the ConViT-mode `core.gpsa.GPSA`. It loads a timm ConViT state_dict
  with plain ``load_state_dict`` (the GPSA converts timm's keys), after which its logits equal timm's.

Small CIFAR-style ResNets (3x3 stride-1 stem, no max-pool; for 28-64 px inputs) are registered in timm's
registry, so `timm.create_model("resnet10_cifar")` works like any timm name.
"""

from __future__ import annotations

from typing import Any

import timm
import torch.nn as nn
from timm.models import register_model
from timm.models.convit import GPSA as TimmGPSA
from timm.models.convit import ConVit
from timm.models.resnet import BasicBlock, ResNet

from core.gpsa import GPSA

__all__ = ["CONVIT_CONFIGS", "PROJECT_ARCHS", "ConViT", "build", "is_known_arch"]

PROJECT_ARCHS: dict[str, dict[str, Any]] = {
    # name: ResNet kwargs. Widths chosen so the default CPU pipeline fits its time goal.
    "resnet10_cifar": dict(block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
    "resnet18_cifar": dict(block=BasicBlock, layers=(2, 2, 2, 2), channels=(64, 128, 256, 512)),
}

# timm's ConViT configs (001 Table 1: Ti, S, B; embed_dim is per head, 48 x heads in total).
CONVIT_CONFIGS: dict[str, dict[str, Any]] = {
    "convit_tiny": dict(embed_dim=48, num_heads=4, local_up_to_layer=10, locality_strength=1.0),
    "convit_small": dict(embed_dim=48, num_heads=9, local_up_to_layer=10, locality_strength=1.0),
    "convit_base": dict(embed_dim=48, num_heads=16, local_up_to_layer=10, locality_strength=1.0),
}

_TCNN_OPTIONS = ("alpha_init", "lambda_init", "stages", "stride_mode")
_TIMM_FACTORY_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")


def _cifar_resnet(name: str, pretrained: bool = False, **kwargs: Any) -> ResNet:
    if pretrained:
        raise ValueError(f"{name}: no pretrained weights exist for the project's small nets")
    for key in _TIMM_FACTORY_KWARGS:  # passed (as None) by timm.create_model; ResNet does not take them
        kwargs.pop(key, None)
    cfg = {**PROJECT_ARCHS[name], **kwargs}
    in_chans = cfg.get("in_chans", 3)
    stem_width = cfg["channels"][0]
    # timm's plain stem is fixed at 64 channels; its 'deep' stem ends at 2 * stem_width channels, which lets
    # the stem width follow `channels[0]`. The stem is then replaced by the CIFAR-style one: a single 3x3
    # stride-1 conv and no max-pool, so 28 px inputs reach the last stage at 4x4.
    model = ResNet(stem_type="deep", stem_width=stem_width // 2, **cfg)
    model.conv1 = nn.Conv2d(in_chans, stem_width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    for info in model.feature_info:
        info["reduction"] = max(1, info["reduction"] // 4)
    model.pretrained_cfg = {"architecture": name, "num_classes": model.num_classes}
    return model


@register_model
def resnet10_cifar(pretrained: bool = False, **kwargs: Any) -> ResNet:
    return _cifar_resnet("resnet10_cifar", pretrained, **kwargs)


@register_model
def resnet18_cifar(pretrained: bool = False, **kwargs: Any) -> ResNet:
    return _cifar_resnet("resnet18_cifar", pretrained, **kwargs)


class ConViT(ConVit):
    """timm's ConViT with its GPSA layers replaced by the project's ConViT-mode `core.gpsa.GPSA`.

    Construction reproduces timm's init exactly (timm's GPSA weights are loaded into ours). A timm ConViT
    state_dict loads with ``load_state_dict`` (keys converted by the GPSA), giving timm's logits. Extra option
    ``positional``: "softplus" (default; alpha = softplus(alpha~) > 0) or "linear" (raw v_pos, needed for
    checkpoints whose pos_proj has a non-negative |delta|^2 weight); ``attn_impl``: see `core.gpsa.GPSA`.
    """

    def __init__(self, *, positional: str = "softplus", attn_impl: str = "auto", **kwargs: Any) -> None:
        if kwargs.get("attn_drop_rate", 0.0):
            raise ValueError("ConViT: attn_drop_rate is not supported by the project's GPSA")
        super().__init__(**kwargs)
        grid = tuple(self.patch_embed.grid_size)
        for i, blk in enumerate(self.blocks):
            old = blk.attn
            if not isinstance(old, TimmGPSA):
                continue
            new = GPSA(
                old.dim,
                num_heads=old.num_heads,
                mode="convit",
                qkv_bias=old.qk.bias is not None,
                positional=positional,
                alpha_init=max(float(old.locality_strength), 1e-3),
                proj_drop=old.proj_drop.p,
                attn_impl=attn_impl,
                device=old.qk.weight.device,
                dtype=old.qk.weight.dtype,
            )
            new.grid_size = grid
            if old.qk.weight.device.type != "meta":
                try:
                    new.load_state_dict(old.state_dict())  # timm's init, converted by the GPSA's load hook
                except ValueError as e:
                    raise ValueError(f"ConViT block {i}: {e}") from None
            blk.attn = new


def _build_convit(arch: str, num_classes: int, **options: Any) -> ConViT:
    if arch not in CONVIT_CONFIGS:
        raise ValueError(f"kind 'convit': unknown arch {arch!r} (choose from {sorted(CONVIT_CONFIGS)})")
    if options.pop("pretrained", False):
        raise ValueError(
            "kind 'convit': pretrained downloads are not supported; load a timm state_dict instead"
        )
    return ConViT(num_classes=num_classes, **{**CONVIT_CONFIGS[arch], **options})


def is_known_arch(arch: str) -> bool:
    return arch in PROJECT_ARCHS or timm.is_model(arch)


def build(kind: str, arch: str, num_classes: int, **options: Any) -> nn.Module:
    """Build a model of ``kind`` ("cnn", "tcnn", "convit") on architecture ``arch`` with ``num_classes``.

    ``options`` go to the timm constructor (e.g. ``in_chans``, ``drop_path_rate`` (alias ``drop_path``),
    ``img_size``); for "tcnn" also ``alpha_init``, ``lambda_init``, ``stages``, ``stride_mode`` (see
    `core.reparam.to_tcnn`); for "convit" also ``positional`` and ``attn_impl`` (see `ConViT`).
    """
    if not is_known_arch(arch):
        raise ValueError(f"unknown arch {arch!r}")
    if "drop_path" in options:  # params.yaml's model.drop_path is timm's drop_path_rate
        options["drop_path_rate"] = options.pop("drop_path")
    if kind == "cnn":
        return timm.create_model(arch, num_classes=num_classes, **options)
    if kind == "tcnn":
        from core.reparam import to_tcnn

        tcnn_opts = {k: options.pop(k) for k in _TCNN_OPTIONS if k in options}
        cnn = timm.create_model(arch, num_classes=num_classes, **options)
        return to_tcnn(cnn, **tcnn_opts)
    if kind == "convit":
        return _build_convit(arch, num_classes, **options)
    raise ValueError(f"model kind {kind!r} is not available yet")
