"""Finding a network's attention layers by what they can do, not by their class, so that code which only
needs to find them (the optimizer's parameter groups, the ablation switches, the dissection) does not import
the attention layers themselves: a CNN's training never loads the GPSA code.

- positional self-attention layers (T-CNN and ConViT GPSA, [TCNN21] Sec. 2, [ConViT21] Eq. 5; PSA,
  [Cordonnier20]) name their positional and gating parameters (``positional_parameter_names``,
  ``gating_parameter_names``; a PSA has no gate) and share the analysis accessors;
- every attention layer that can show its attention has ``attention_maps(x)`` (GPSA, PSA, Attention Augmented
  convolutions [Bello19], [Li21]'s MHSA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # duck-typed: this module loads no torch, so the configuration checks stride modes cheaply
    import torch.nn as nn

__all__ = ["STRIDE_MODES", "attention_modules", "gpsa_modules", "is_positional"]

#: How a strided conv's positional attention keeps its stride (`core.nn.positional`): "exact" (stride-1
#: attention then [::s, ::s]; function-preserving) or "s1" (BoTNet-style, then s x s average pooling). Here,
#: in a module that loads no layer, so the configuration checks the names without the attention code.
STRIDE_MODES = ("exact", "s1")


def is_positional(m: nn.Module) -> bool:
    """A positional self-attention layer (GPSA or PSA, or a new type with the same accessors)."""
    return callable(getattr(m, "positional_parameter_names", None))


def gpsa_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """All positional self-attention layers of ``model`` (GPSA, T-CNN or ConViT, and PSA) as (qualified
    name, module), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_positional(m)]


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention layer that can show its attention: GPSA / PSA and any module (e.g. of core.nn.aa,
    core.nn.cmhsa) exposing an ``attention_maps(x)`` method; (qualified name, module) in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if is_positional(m) or callable(getattr(m, "attention_maps", None))
    ]
