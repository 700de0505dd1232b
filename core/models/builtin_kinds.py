"""The project's model kinds, one `core.models.kinds.ModelKind` record each.

- "cnn": any timm model name or a project-registered small net (`core.models.resnets`); fine-tuned without
  attention it is [TCNN21] Table 1's "without SA" baseline.
- "tcnn": the CNN reparameterized by `core.reparam.to_tcnn` after pretraining ([TCNN21] Sec. 2).
- "psa": the same conversion to ungated positional self-attention (`core.nn.psa.PSA`; [Cordonnier20],
  [ConViT21] Appendix A); option ``qk_init``.
- "hybrid_scratch": the T-CNN architecture of a randomly initialised CNN, trained from scratch (t1 = 0 in
  [TCNN21] Table 3); its conversion is part of the architecture, so it lives in ``model.options``.
- "convit": the project's ConViT ([ConViT21]) on `core.nn.gpsa_convit.ConvitGPSA` (timm's configs and
  ``convit_fmnist``); it loads a timm ConViT state_dict.
- "aa_resnet": Attention Augmented ResNet ([Bello19]), `core.models.aa_resnet.build_aa_resnet`.
- "cmhsa": the two-phase model of [Li21] (`core.nn.cmhsa`): pretrained in its convolution phase, turned into
  its self-attention phase by the reparam stage (Theorem 1).
"""

from __future__ import annotations

from typing import Any

import timm
import torch.nn as nn

from core.models.aa_resnet import build_aa_resnet
from core.models.builders import build_external, is_builder
from core.models.convit import CONVIT_CONFIGS, build_convit
from core.models.kinds import ModelKind, register
from core.nn.cmhsa import CMHSA_ARCHS, build_cmhsa, to_mhsa
from core.nn.positional import STRIDE_MODES
from core.nn.psa import QK_INITS

GPSA_CONVERSION = ("alpha_init", "lambda_init", "stages", "stride_mode")


def build_cnn(arch: str, num_classes: int, **options: Any) -> nn.Module:
    """A timm (or project) CNN, or the network of a user's builder ``package.module:function``
    (`core.models.builders`; it takes no options besides the input channels it is checked against)."""
    if is_builder(arch):
        in_chans = options.pop("in_chans", None)
        if options:
            raise ValueError(f"model.options: a user's builder ({arch}) takes none, got {sorted(options)}")
        return build_external(arch, num_classes, in_chans)
    return timm.create_model(arch, num_classes=num_classes, **options)


def _check_psa(options: dict[str, Any]) -> None:
    if "lambda_init" in options:
        raise ValueError("options.lambda_init: kind 'psa' has no gate (no lambda)")
    if "qk_init" in options and options["qk_init"] not in QK_INITS:
        raise ValueError(f"options.qk_init: must be one of {list(QK_INITS)}, got {options['qk_init']!r}")


def _check_phase(options: dict[str, Any]) -> None:
    if options.get("phase", "conv") not in ("conv", "mhsa"):
        raise ValueError(f"options.phase: must be 'conv' or 'mhsa', got {options['phase']!r}")


def _check_hybrid_conversion(options: dict[str, Any]) -> None:
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


register(
    ModelKind("cnn", build_cnn, "a timm CNN (or a project small net)", pretrains_cnn=True, builders=True)
)
register(
    ModelKind(
        "tcnn", build_cnn, "the CNN's last-stage 3x3 convs as GPSA after pretraining ([TCNN21] Sec. 2)",
        pretrains_cnn=True, attention="gpsa", conversion=GPSA_CONVERSION, ablations=("gating", "freeze_gpsa"),
        builders=True,
    )
)  # fmt: skip
register(
    ModelKind(
        "psa", build_cnn, "the CNN's convs as ungated positional self-attention ([Cordonnier20])",
        pretrains_cnn=True, attention="psa", conversion=("alpha_init", "stages", "stride_mode", "qk_init"),
        ablations=("freeze_gpsa",), check_options=_check_psa, builders=True,
    )
)  # fmt: skip
register(
    ModelKind(
        "hybrid_scratch", build_cnn, "the T-CNN architecture trained from scratch ([TCNN21] Table 3, t1 = 0)",
        attention="gpsa", conversion=GPSA_CONVERSION, conversion_in="options",
        conversion_defaults={"alpha_init": 1.0, "lambda_init": 1.0, "stages": [-1], "stride_mode": "exact"},
        ablations=("gating", "freeze_gpsa"), check_options=_check_hybrid_conversion,
    )
)  # fmt: skip
register(
    ModelKind(
        "convit", build_convit, "ConViT ([ConViT21]) on the project's GPSA", archs=CONVIT_CONFIGS,
        ablations=("gating", "conv_init", "freeze_gpsa"), image_size_option="img_size",
    )
)  # fmt: skip
register(ModelKind("aa_resnet", build_aa_resnet, "Attention Augmented ResNet ([Bello19])"))
register(
    ModelKind(
        "cmhsa", build_cmhsa, "convolution phase -> self-attention phase ([Li21] Theorem 1)", archs=CMHSA_ARCHS,
        reparameterize=to_mhsa, phases=("conv", "mhsa"), check_options=_check_phase,
    )
)  # fmt: skip
