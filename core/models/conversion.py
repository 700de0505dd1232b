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
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from core.models.cnn_layout import conversion_targets, model_stages
from core.models.factory import apply_ablations
from core.models.kinds import Conversion
from core.nn.attention_layers import attention_modules, gpsa_modules
from core.nn.gpsa import GPSA
from core.nn.gpsa_tcnn import TcnnGPSA
from core.nn.positional import STRIDE_MODES
from core.nn.psa import PSA, QK_INITS

__all__ = [
    "ATTENTIONS",
    "attention_modules",
    "conversion_targets",
    "gpsa_modules",
    "model_stages",
    "to_attention",
    "to_tcnn",
]

#: Each attention a conv can become: its layer class (built by ``from_conv``) and the settings only it takes.
#: A new attention type is one entry here (and its name in `core.models.kinds.Conversion`).
LAYERS: dict[str, tuple[type[GPSA | PSA], tuple[str, ...]]] = {
    "gpsa": (TcnnGPSA, ("lambda_init",)),  # [TCNN21] Sec. 2
    "psa": (PSA, ("qk_init",)),  # [Cordonnier20], [ConViT21] Appendix A
}
ATTENTIONS = tuple(LAYERS)


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
            layer, own = LAYERS[attention]
            settings = {"lambda_init": lambda_init, "qk_init": qk_init}
            gpsa = layer.from_conv(
                conv, alpha_init=alpha_init, stride_mode=stride_mode, **{k: settings[k] for k in own}
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"to_tcnn: cannot convert {path}: {e}") from None
        _set_submodule(new, path, gpsa)
    return new


def to_attention(cnn: nn.Module, conversion: Conversion) -> nn.Module:
    """The project's one conversion: a NEW module where ``conversion`` turned the chosen convs of ``cnn`` into
    GPSA ([TCNN21] Sec. 2) or PSA ([Cordonnier20]) layers (`to_tcnn`) and set its switches ([ConViT21] Table 3,
    `core.models.factory.apply_ablations`); ``cnn`` is untouched."""
    return apply_ablations(to_tcnn(cnn, **conversion.layers()), **conversion.switches())


def check_psa_options(options: dict[str, Any]) -> None:
    if "lambda_init" in options:
        raise ValueError("options.lambda_init: kind 'psa' has no gate (no lambda)")
    if "qk_init" in options and options["qk_init"] not in QK_INITS:
        raise ValueError(f"options.qk_init: must be one of {list(QK_INITS)}, got {options['qk_init']!r}")


def check_hybrid_options(options: dict[str, Any]) -> None:
    """The conversion settings a hybrid_scratch model carries in ``model.options`` ([TCNN21] Table 3, t1 = 0)."""
    a = options.get("alpha_init", 1.0)
    if isinstance(a, bool) or not isinstance(a, int | float) or not a > 0:
        raise ValueError(f"options.alpha_init: must be a number > 0, got {a!r}")
    lam = options.get("lambda_init", 1.0)
    if isinstance(lam, bool) or not isinstance(lam, int | float):
        raise ValueError(f"options.lambda_init: must be a number, got {lam!r}")
    st = options.get("stages", [-1])
    if (
        not isinstance(st, list | tuple)
        or not st
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in st)
    ):
        raise ValueError(f"options.stages: must be a non-empty list of stage indices, got {st!r}")
    if options.get("stride_mode", "exact") not in STRIDE_MODES:
        raise ValueError(
            f"options.stride_mode: must be one of {list(STRIDE_MODES)}, got {options['stride_mode']!r}"
        )
