"""Model factory: `build(kind, arch, num_classes, **options)` for every model kind the project knows.

Small CIFAR-style ResNets (3x3 stride-1 stem, no max-pool; for 28-64 px inputs) are registered in timm's
registry, so `timm.create_model("resnet10_cifar")` works like any timm name.
"""

from __future__ import annotations

from typing import Any

import timm
import torch.nn as nn
from timm.models import register_model
from timm.models.resnet import BasicBlock, ResNet

PROJECT_ARCHS: dict[str, dict[str, Any]] = {
    # name: ResNet kwargs. Widths chosen so the default CPU pipeline fits its time goal.
    "resnet10_cifar": dict(block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
    "resnet18_cifar": dict(block=BasicBlock, layers=(2, 2, 2, 2), channels=(64, 128, 256, 512)),
}


def _cifar_resnet(name: str, pretrained: bool = False, **kwargs: Any) -> ResNet:
    if pretrained:
        raise ValueError(f"{name}: no pretrained weights exist for the project's small nets")
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


def is_known_arch(arch: str) -> bool:
    return arch in PROJECT_ARCHS or timm.is_model(arch)


def build(kind: str, arch: str, num_classes: int, **options: Any) -> nn.Module:
    """Build a model of `kind` ("cnn", "tcnn", ...) on the timm architecture `arch`."""
    if not is_known_arch(arch):
        raise ValueError(f"unknown arch {arch!r}")
    if kind == "cnn":
        return timm.create_model(arch, num_classes=num_classes, **options)
    raise ValueError(f"model kind {kind!r} is not available yet")
