"""Conv -> GPSA surgery: turn a (trained) timm ResNet-family CNN into its T-CNN ([TCNN21], Sec. 2).

`to_tcnn` copies the model and replaces every k x k (k > 1) convolution of the chosen stages by a T-CNN GPSA
(`core.nn.gpsa_tcnn.TcnnGPSA`) at the same attribute path (e.g. ``layer4.0.conv2``). The GPSA's ``weight`` is
the conv filter (same name, same shape), its ``bias`` the conv bias, W_val = I, heads sit on the kernel taps;
BatchNorm, activations, SE, shortcuts and everything else are untouched. With large alpha_init and
lambda_init (e.g. 50) the T-CNN computes the CNN's function to float precision (stride_mode="exact"); the
paper's init is alpha = lambda = 1 ([TCNN21], Sec. 2 "How convolutional should the initialization be?").

Supported: timm ResNet (basic and bottleneck blocks), ResNet-D, ResNet-RS, SE-ResNet, anti-aliased and dilated
variants, torchvision's ResNets, the project's small CIFAR ResNets and He et al.'s CIFAR ResNets - any model
with stages ``layer1`` ... ``layerN`` of plain ``nn.Conv2d`` layers; in any other net the convs are named by
module-name patterns (``reparam.stages: ["features.7.*"]``).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Sequence

import torch.nn as nn

from core.nn.gpsa import GPSA
from core.nn.gpsa_tcnn import TcnnGPSA
from core.nn.positional import STRIDE_MODES
from core.nn.psa import PSA

__all__ = [
    "ATTENTIONS",
    "attention_modules",
    "conversion_targets",
    "gpsa_modules",
    "model_stages",
    "to_psa",
    "to_tcnn",
]

ATTENTIONS = ("gpsa", "psa")


def model_stages(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ResNet stages ``layer1`` ... ``layerN`` of ``model`` in order, as (name, module)."""
    stages = []
    i = 1
    while isinstance(getattr(model, f"layer{i}", None), nn.Module):
        stages.append((f"layer{i}", getattr(model, f"layer{i}")))
        i += 1
    return stages


def _spatial_convs(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Conv2d]]:
    """The k x k convolutions (k > 1) under ``module``, as (qualified name, conv)."""
    return [
        (f"{prefix}{name}", m)
        for name, m in module.named_modules()
        if isinstance(m, nn.Conv2d) and max(m.kernel_size) > 1
    ]


def conversion_targets(model: nn.Module, stages: Sequence[int | str]) -> list[tuple[str, nn.Conv2d]]:
    """The convolutions `to_tcnn` converts: every k x k conv (k > 1) of the ResNet stages ``stages`` indexes
    (layer1..layerN, negative from the end), and every one whose module name matches a pattern of
    ``stages`` (fnmatch, e.g. ``"features.7.*"``), for a net that is not ResNet-like. One-line ValueErrors."""
    patterns = [s for s in stages if isinstance(s, str)]
    indices = [int(s) for s in stages if not isinstance(s, str)]
    targets: dict[str, nn.Conv2d] = {}
    if indices:
        all_stages = model_stages(model)
        if not all_stages:
            raise ValueError(
                f"to_tcnn: {type(model).__name__} has no ResNet stages (layer1, layer2, ...); name the convs "
                "by module-name patterns instead"
            )
        n = len(all_stages)
        picked: list[int] = []
        for s in indices:
            if not -n <= s < n:
                raise ValueError(f"to_tcnn: stage index {s} out of range for {n} stages")
            if s % n not in picked:
                picked.append(s % n)
        for idx in sorted(picked):
            stage_name, stage = all_stages[idx]
            targets.update(_spatial_convs(stage, f"{stage_name}."))
        if not targets:
            raise ValueError(f"to_tcnn: no k x k convolutions (k > 1) in stages {sorted(picked)}")
    for pattern in patterns:
        found = [(name, m) for name, m in _spatial_convs(model) if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            raise ValueError(f"to_tcnn: no k x k convolution (k > 1) matches {pattern!r}")
        targets.update(found)
    if not targets:
        raise ValueError("to_tcnn: no stages selected")
    return list(targets.items())


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)


def to_tcnn(
    model: nn.Module,
    *,
    alpha_init: float = 1.0,
    lambda_init: float = 1.0,
    stages: Sequence[int | str] = (-1,),
    stride_mode: str = "exact",
    attention: str = "gpsa",
    qk_init: str = "zero_key",
) -> nn.Module:
    """Return a NEW module where each k x k conv (k > 1) of the chosen stages is a T-CNN GPSA ([TCNN21], Sec. 2).

    Args:
        model: a timm ResNet-family model (the input is never modified).
        alpha_init: initial rectified locality strength alpha (> 0; the paper uses 1).
        lambda_init: initial gating parameter lambda (sigma(lambda) = weight of the positional attention).
        stages: indices into [layer1, ..., layerN] (negative from the end; default: the last stage) and/or
            module-name patterns (fnmatch) of the convs to convert (`conversion_targets`).
        stride_mode: "exact" (stride-1 attention then [::s, ::s]; function-preserving) or "s1" (BoTNet-style
            stride-1 attention then s x s average pooling; not function-preserving).
        attention: "gpsa" ([TCNN21], the default) or "psa": ungated positional self-attention (`core.nn.psa.PSA`,
            [Cordonnier20] / [ConViT21] Appendix A) in the same head layout; ``lambda_init`` is then unused.
        qk_init: PSA only: how W_qry, W_key start (see `core.nn.psa`; the default keeps the content logits 0).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"to_tcnn: attention must be one of {ATTENTIONS}, got {attention!r}")
    if stride_mode not in STRIDE_MODES:
        raise ValueError(f"to_tcnn: stride_mode must be 'exact' or 's1', got {stride_mode!r}")
    # alpha_init is checked where it becomes a parameter (GPSA / PSA construction), not on the way there.
    new = copy.deepcopy(model)
    targets = conversion_targets(new, stages)
    for path, conv in targets:
        try:
            if attention == "gpsa":
                gpsa = TcnnGPSA.from_conv(
                    conv, alpha_init=alpha_init, lambda_init=lambda_init, stride_mode=stride_mode
                )
            else:
                gpsa = PSA.from_conv(conv, alpha_init=alpha_init, stride_mode=stride_mode, qk_init=qk_init)
        except (TypeError, ValueError) as e:
            raise ValueError(f"to_tcnn: cannot convert {path}: {e}") from None
        _set_submodule(new, path, gpsa)
    return new


def to_psa(
    model: nn.Module,
    *,
    alpha_init: float = 1.0,
    stages: Sequence[int] = (-1,),
    stride_mode: str = "exact",
    qk_init: str = "zero_key",
) -> nn.Module:
    """`to_tcnn` with ungated positional self-attention (`core.nn.psa.PSA`; [Cordonnier20], [ConViT21] Appendix A)."""
    return to_tcnn(
        model, alpha_init=alpha_init, stages=stages, stride_mode=stride_mode, attention="psa", qk_init=qk_init
    )


def gpsa_modules(model: nn.Module) -> list[tuple[str, GPSA | PSA]]:
    """All positional self-attention layers of ``model`` (GPSA, T-CNN or ConViT, and PSA) as (qualified
    name, module), in module order. They share the analysis accessors (alpha, gate, centers, attention_maps,
    nonlocality) and `positional_parameter_names` / `gating_parameter_names` (a PSA has no gate)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (GPSA, PSA))]


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention layer that can show its attention: GPSA / PSA and any module (e.g. of core.nn.aa,
    core.nn.cmhsa) exposing an ``attention_maps(x)`` method; (qualified name, module) in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (GPSA, PSA)) or callable(getattr(m, "attention_maps", None))
    ]
