"""The CNN of the kinds that convert one ("cnn", "tcnn", "psa", "hybrid_scratch"; `core.models.kinds`): any timm
model name, a project small net (`core.models.resnets`, in timm's registry) or a user's builder
``package.module:function`` (`core.models.builders`). Fine-tuned without attention it is [TCNN21] Table 1's
"without SA" baseline.
"""

from __future__ import annotations

from typing import Any

import timm
import torch.nn as nn

from core.models.builders import build_external, is_builder

__all__ = ["build_cnn"]


def build_cnn(arch: str, num_classes: int, **options: Any) -> nn.Module:
    """A timm (or project) CNN, or the network of a user's builder ``package.module:function``
    (`core.models.builders`; it takes no options besides the input channels it is checked against)."""
    if is_builder(arch):
        in_chans = options.pop("in_chans", None)
        if options:
            raise ValueError(f"model.options: a user's builder ({arch}) takes none, got {sorted(options)}")
        return build_external(arch, num_classes, in_chans)
    import core.models.resnets  # noqa: F401 (registers the project's small nets in timm's registry)

    return timm.create_model(arch, num_classes=num_classes, **options)
