"""AA-ResNets ([Bello19], Sec. 4.2): timm ResNets whose 3x3 convs of the chosen stages are attention augmented
convolutions (`core.nn.aa.AAConv2d`; the choices [Bello19] leaves open are documented there)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import timm
import torch
import torch.nn as nn
from timm.models.resnet import BasicBlock, Bottleneck

from core.models.cnn_layout import model_stages
from core.models.resnets import PROJECT_ARCHS
from core.nn.aa import AAConv2d, check_ratios, pool_size

__all__ = ["build_aa_resnet"]


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


def _aa_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the AA options with their defaults, the rest for ``timm.create_model``); the attention ratios are
    checked here."""
    opts = dict(options)
    aa = {
        "kappa": opts.pop("kappa", 0.25),
        "upsilon": opts.pop("upsilon", 0.25),
        "num_heads": opts.pop("num_heads", 8),
        "stages": tuple(opts.pop("stages", (-3, -2, -1))),
        "relative": bool(opts.pop("relative", True)),
        "downsample_first": opts.pop("downsample_first_stage", None),
        "img_size": opts.pop("img_size", None),
    }
    check_ratios(aa["kappa"], aa["upsilon"], aa["num_heads"])
    return aa, opts


def _input_hw(img_size: Any, model: nn.Module, project_net: bool) -> tuple[int, int]:
    """The input (H, W) the relative embeddings are sized for: `img_size` (int or pair), default the arch's
    timm input size, 32 for the project's nets."""
    if img_size is None:
        img_size = 32 if project_net else model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    return (int(img_size), int(img_size)) if isinstance(img_size, int | float) else tuple(map(int, img_size))


def _target_convs(
    model: nn.Module, arch: str, stages: tuple, downsample_first: bool
) -> list[tuple[str, nn.Conv2d, bool]]:
    """(name, conv, downsample) of the 3x3 conv of every block of the chosen stages, in module order;
    downsample only in the first chosen stage, when `downsample_first`."""
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
    return targets


def _aa_conv(conv: nn.Conv2d, in_hw: tuple[int, int], down: bool, aa: dict[str, Any]) -> AAConv2d:
    """The `AAConv2d` replacing `conv`, its attention sized for the feature map it attends over: the conv's
    input (`in_hw`) pooled once for a stride of 2 and once more when it downsamples."""
    h, w = in_hw
    for _ in range(int(conv.stride[0] == 2) + int(down)):
        h, w = pool_size(h), pool_size(w)
    return AAConv2d(
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size[0],
        conv.stride[0],
        kappa=aa["kappa"],
        upsilon=aa["upsilon"],
        num_heads=aa["num_heads"],
        feat_size=(h, w),
        relative=aa["relative"],
        downsample=down,
    )


def build_aa_resnet(arch: str, num_classes: int, **options: Any) -> nn.Module:
    """AA-ResNet (Bello et al. 2019, "Attention augmented convolutional networks", [Bello19] Sec. 4.2): a timm
    ResNet whose 3x3 convs of the chosen stages are `AAConv2d`.

    Args:
        arch: timm ResNet-family name (``resnet50`` = AA-ResNet-50) or a project small net
            (``resnet10_cifar``).
        num_classes: classifier outputs.
        options: ``kappa`` (0.25), ``upsilon`` (0.25) - [Bello19] Table 2/6 first row; ``num_heads``
            (8, [Bello19] Sec. 4.2);
            ``stages`` (indices into [layer1..layerN], default (-3, -2, -1): the last three, [Bello19] Sec. 4.2);
            ``img_size`` (int or (H, W); sizes the relative embedding tables; default the arch's timm input
            size,
            32 for the project's nets); ``downsample_first_stage`` (None = True for timm nets, False for the
            project's small nets; see module docstring); ``relative`` (True); everything else (``in_chans``,
            ``drop_path_rate``, ...) goes to ``timm.create_model``.

    The result is a pure function of (arch, num_classes, options) up to the random init, so a state_dict loads
    into a model rebuilt from the same arguments.
    """
    aa, timm_opts = _aa_options(options)
    if not (arch in PROJECT_ARCHS or timm.is_model(arch)):
        raise ValueError(f"aa_resnet: unknown arch {arch!r}")
    project_net = arch in PROJECT_ARCHS
    model = timm.create_model(arch, num_classes=num_classes, **timm_opts)
    downsample_first = not project_net if aa["downsample_first"] is None else aa["downsample_first"]
    img_hw = _input_hw(aa["img_size"], model, project_net)
    targets = _target_convs(model, arch, aa["stages"], downsample_first)
    sizes = _conv_input_sizes(model, [t[0] for t in targets], img_hw)
    for conv_name, conv, down in targets:
        parent, _, leaf = conv_name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, _aa_conv(conv, sizes[conv_name], down, aa))
    model.aa_config = dict(
        kappa=aa["kappa"],
        upsilon=aa["upsilon"],
        num_heads=aa["num_heads"],
        stages=aa["stages"],
        img_size=img_hw,
        relative=aa["relative"],
    )
    return model
