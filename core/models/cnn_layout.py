"""Where a CNN's convolutions are: the ResNet stages ``layer1`` ... ``layerN`` and the k x k convolutions the
T-CNN conversion replaces ([TCNN21] Sec. 2 converts every 3x3 conv of the last stage). Plain CNN code, no
attention: the Attention Augmented ResNet ([Bello19]) and the conversion (`core.models.conversion`) both use it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch.nn as nn

__all__ = ["conversion_targets", "model_stages"]


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


def _candidates(convs: list[tuple[str, nn.Conv2d]], shown: int = 12) -> str:
    """The convs a pattern could name (fnmatch over these names), the last ones first: a ResNet-like or VGG-like
    net keeps its deepest stage at the end."""
    if not convs:
        return "the model has no k x k convolution"
    names = [name for name, _ in convs]
    more = f" (and {len(names) - shown} earlier)" if len(names) > shown else ""
    return f"its k x k convolutions, last first: {', '.join(reversed(names[-shown:]))}{more}"


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
    convs = _spatial_convs(model) if patterns else []
    for pattern in patterns:
        found = [(name, m) for name, m in convs if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            raise ValueError(
                f"to_tcnn: no k x k convolution (k > 1) matches {pattern!r}; {_candidates(convs)}"
            )
        targets.update(found)
    if not targets:
        raise ValueError("to_tcnn: no stages selected")
    return list(targets.items())
