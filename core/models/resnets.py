"""The project's small CIFAR-style ResNets (3x3 stride-1 stem, no max-pool; for 28-64 px inputs), registered in
timm's registry so `timm.create_model("resnet10_cifar")` works like any timm name."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from timm.models import register_model
from timm.models.resnet import BasicBlock, ResNet

__all__ = ["PROJECT_ARCHS"]

PROJECT_ARCHS: dict[str, dict[str, Any]] = {
    # name: ResNet kwargs. Widths chosen so the default CPU pipeline fits its time goal.
    "resnet10_cifar": dict(block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
    # The default: a dilated last stage (timm's output_stride=16: layer4 keeps layer3's resolution, its second
    # 3x3 conv gets dilation 2), so at 28 px the T-CNN's GPSA layers work on 7x7 maps (4x4 on resnet10_cifar);
    # the conversion of dilated convs is exact (core.nn.gpsa: centres at dilation * tap). The last stage keeps
    # layer3's 64 channels: a 128-wide one trains markedly slower at 7x7 (benchmarks/train.py), which the
    # default chain's budget cannot pay.
    "resnet10_cifar_os16": dict(
        block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 64), output_stride=16
    ),
    "resnet18_cifar": dict(block=BasicBlock, layers=(2, 2, 2, 2), channels=(64, 128, 256, 512)),
    # The CIFAR-10 study's network (pipelines/studies/cifar10_lr.yaml): the dilated last stage keeps 8x8 maps
    # at 32 px and holds two blocks, so the T-CNN converts four 3x3 convs, each attending over 64 positions
    # (T-CNN, d'Ascoli et al. 2021, Sec. 2 converts every 3x3 conv of the last stage). 0.90 M parameters.
    "resnet12_cifar_os16": dict(
        block=BasicBlock, layers=(1, 1, 1, 2), channels=(32, 64, 128, 128), output_stride=16
    ),
}

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


def _register(name: str) -> None:
    """Register ``name`` of :data:`PROJECT_ARCHS` in timm's registry (``timm.create_model(name)``)."""

    def factory(pretrained: bool = False, **kwargs: Any) -> ResNet:
        return _cifar_resnet(name, pretrained, **kwargs)

    factory.__name__ = factory.__qualname__ = name
    factory.__module__ = __name__
    register_model(factory)


for _name in PROJECT_ARCHS:
    _register(_name)
