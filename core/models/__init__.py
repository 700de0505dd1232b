"""Model factory: `build(kind, arch, num_classes, **options)` for every model kind the project knows.

Kinds
- "cnn": any timm model name or a project-registered small net (below).
- "tcnn": the CNN above reparameterized by `core.reparam.to_tcnn` ([TCNN21], Sec. 2). Options ``alpha_init``,
  ``lambda_init``, ``stages``, ``stride_mode`` go to `to_tcnn`; the rest to the CNN.
- "psa": the CNN converted like "tcnn" but to ungated positional self-attention (`core.nn.psa.PSA`; [Cordonnier20],
  [ConViT21] Appendix A): ``alpha_init``, ``stages``, ``stride_mode``, ``qk_init``.
- "hybrid_scratch": the T-CNN architecture of a randomly initialised CNN, trained from scratch (t1 = 0 in
  [TCNN21] Table 3); built exactly as "tcnn" (the stages treat it differently: pretraining trains it directly).
- "convit": the project's ConViT ([ConViT21]): timm's ConViT architecture (``convit_tiny``, ``convit_small``,
  ``convit_base`` configs, and ``convit_fmnist``, a small one for 28 px single-channel inputs) running on the
  ConViT-mode `core.nn.gpsa.GPSA`. It loads a timm ConViT state_dict with plain ``load_state_dict`` (the GPSA
  converts timm's keys), after which its logits equal timm's.
- "aa_resnet": Attention Augmented ResNet ([Bello19]), `core.models.aa_resnet.build_aa_resnet`.
- "cmhsa": the two-phase model of [Li21], `core.nn.cmhsa.build_cmhsa` (option ``phase``: "conv" or "mhsa").

Ablation switches ([ConViT21] Table 3), options of "convit" and, where they mean something, of the T-CNN kinds:
- ``gating``: "train" (default) or "freeze0": every gating parameter lambda is set to 0 and frozen, so each
  head pays the same attention to content and position ([ConViT21] Table 3 footnote 4: "no gating").
  convit, tcnn, hybrid_scratch.
- ``conv_init``: true (default) or false: false drops the convolutional (locality) init of [ConViT21] Eq. 5: W_val
  and the positional embedding v_pos get timm's ViT init (truncated normal, std 0.02) like every other
  linear layer; v_pos is then stored raw (``positional="linear"``) since a random one may be anti-local.
  convit only (the T-CNN kinds are convolutional by construction).
- ``freeze_gpsa``: false (default) or true: every parameter of every GPSA (PSA) layer is frozen
  (requires_grad False; the optimizers skip them). convit, tcnn, psa, hybrid_scratch.
The switches act at build time, so a model rebuilt from its checkpoint spec is frozen the same way.

Small CIFAR-style ResNets (3x3 stride-1 stem, no max-pool; for 28-64 px inputs) are registered in timm's
registry, so `timm.create_model("resnet10_cifar")` works like any timm name.
"""

from __future__ import annotations

from typing import Any

import timm
import torch
import torch.nn as nn
from timm.layers import DropPath

from core.models.aa_resnet import build_aa_resnet
from core.models.convit import CONVIT_CONFIGS, ConViT, build_convit
from core.models.reparam import gpsa_modules, to_tcnn
from core.models.resnets import PROJECT_ARCHS
from core.nn.cmhsa import CMHSA_ARCHS, build_cmhsa

__all__ = [
    "ABLATION_OPTIONS",
    "CONVERSION_OPTIONS",
    "CONVIT_CONFIGS",
    "KINDS",
    "PROJECT_ARCHS",
    "REPARAMETERIZED_KINDS",
    "ConViT",
    "apply_ablations",
    "backbone_options",
    "build",
    "check_options",
    "is_known_arch",
    "set_drop_path",
    "set_stochastic_depth",
]

KINDS = ("cnn", "tcnn", "convit", "psa", "hybrid_scratch", "aa_resnet", "cmhsa")
# Kinds whose fine-tuned model is a reparameterized pretrained network: they have a matched control (the same
# pretrained checkpoint fine-tuned with the same recipe, unconverted; stages/control.py).
REPARAMETERIZED_KINDS = ("tcnn", "psa", "cmhsa")

# Options of the conv -> attention conversion (`core.reparam.to_tcnn`), per converting kind.
CONVERSION_OPTIONS: dict[str, tuple[str, ...]] = {
    "tcnn": ("alpha_init", "lambda_init", "stages", "stride_mode"),
    "hybrid_scratch": ("alpha_init", "lambda_init", "stages", "stride_mode"),
    "psa": ("alpha_init", "stages", "stride_mode", "qk_init"),
}
# Ablation switches ([ConViT21] Table 3) and the kinds they apply to.
ABLATION_OPTIONS: dict[str, tuple[str, ...]] = {
    "gating": ("convit", "tcnn", "hybrid_scratch"),
    "conv_init": ("convit",),
    "freeze_gpsa": ("convit", "tcnn", "psa", "hybrid_scratch"),
}
GATING_MODES = ("train", "freeze0")
_TCNN_OPTIONS = CONVERSION_OPTIONS["tcnn"]


def is_known_arch(arch: str, kind: str | None = None) -> bool:
    """Whether ``arch`` names a model of ``kind``; None: of any kind (a CNN, a ConViT config, a cmhsa arch).

    CNN-based kinds (cnn, tcnn, psa, hybrid_scratch) take timm names and the project's small nets; "convit"
    its configs; "cmhsa" `core.nn.cmhsa.CMHSA_ARCHS`; "aa_resnet" is checked by `core.models.aa_resnet.build_aa_resnet`."""
    if kind == "convit":
        return arch in CONVIT_CONFIGS
    if kind == "cmhsa":
        return arch in CMHSA_ARCHS
    if kind == "aa_resnet":
        return True
    if kind is None and (arch in CONVIT_CONFIGS or arch in CMHSA_ARCHS):
        return True
    return arch in PROJECT_ARCHS or timm.is_model(arch)


def check_options(kind: str, options: dict[str, Any]) -> None:
    """Validate the ablation switches and conversion options of ``kind`` (one-line ValueError naming the key).

    Options the switches do not know are left to the constructors (timm kwargs etc.)."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r} (choose from {list(KINDS)})")
    for key, kinds in ABLATION_OPTIONS.items():
        if key in options and kind not in kinds:
            raise ValueError(f"options.{key}: applies to kinds {list(kinds)}, not {kind!r}")
    if "gating" in options and options["gating"] not in GATING_MODES:
        raise ValueError(f"options.gating: must be one of {list(GATING_MODES)}, got {options['gating']!r}")
    for key in ("conv_init", "freeze_gpsa"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"options.{key}: must be true or false, got {options[key]!r}")
    if kind == "psa" and "lambda_init" in options:
        raise ValueError("options.lambda_init: kind 'psa' has no gate (no lambda)")
    if kind == "cmhsa" and options.get("phase", "conv") not in ("conv", "mhsa"):
        raise ValueError(f"options.phase: must be 'conv' or 'mhsa', got {options['phase']!r}")


def backbone_options(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of ``kind`` that the underlying CNN takes (ablation and conversion keys removed)."""
    drop = set(ABLATION_OPTIONS) | set(CONVERSION_OPTIONS.get(kind, ()))
    return {k: v for k, v in options.items() if k not in drop}


def apply_ablations(model: nn.Module, *, gating: str = "train", freeze_gpsa: bool = False) -> nn.Module:
    """[ConViT21] Table 3 switches on the GPSA / PSA layers of ``model`` (in place; see the module docstring)."""
    if gating not in GATING_MODES:
        raise ValueError(f"gating must be one of {list(GATING_MODES)}, got {gating!r}")
    layers = gpsa_modules(model)
    if (gating != "train" or freeze_gpsa) and not layers:
        raise ValueError("ablation switches need a model with GPSA layers")
    for _, m in layers:
        if gating == "freeze0":
            if not hasattr(m, "gating_param"):
                raise ValueError(f"gating='freeze0': {type(m).__name__} has no gate")
            with torch.no_grad():
                m.gating_param.zero_()
            m.gating_param.requires_grad_(False)
        if freeze_gpsa:
            for p in m.parameters():
                p.requires_grad_(False)
    return model


def set_drop_path(model: nn.Module, rate: float) -> int:
    """Stochastic depth with timm's linear rule: block i of n drops its residual branch with rate*i/(n-1).

    Applies to every module with a `drop_path` attribute (timm ResNet BasicBlock / Bottleneck), in
    definition order; rate 0 removes it. Returns the number of blocks touched.
    """
    blocks = [m for m in model.modules() if hasattr(m, "drop_path") and not isinstance(m, DropPath)]
    n = len(blocks)
    for i, block in enumerate(blocks):
        r = rate * i / (n - 1) if n > 1 else rate
        block.drop_path = DropPath(r) if r > 0 else None
    return n


def set_stochastic_depth(model: nn.Module, rate: float) -> int:
    """`set_drop_path` (timm's linear rule over the blocks) for every kind: blocks whose forward
    calls ``self.drop_path(...)`` unconditionally (ConViT, cmhsa) get ``nn.Identity`` where the rule gives 0
    (timm's ResNet blocks take None). Returns the number of blocks touched."""
    from timm.models.resnet import BasicBlock as TimmBasic
    from timm.models.resnet import Bottleneck

    n = set_drop_path(model, rate)
    for m in model.modules():
        if hasattr(m, "drop_path") and m.drop_path is None and not isinstance(m, (TimmBasic, Bottleneck)):
            m.drop_path = nn.Identity()
    return n


def convert(cnn: nn.Module, kind: str, **options: Any) -> nn.Module:
    """The conversion step of the converting kinds ("tcnn", "hybrid_scratch": GPSA; "psa": PSA) followed by
    the ablation switches: a NEW module (``cnn`` untouched). ``options``: conversion keys and switches."""
    check_options(kind, options)
    conv = {k: options.pop(k) for k in CONVERSION_OPTIONS[kind] if k in options}
    ablate = {k: options.pop(k) for k in ("gating", "freeze_gpsa") if k in options}
    if options:
        raise ValueError(f"kind {kind!r}: unknown conversion option(s) {sorted(options)}")
    if "stages" in conv:
        conv["stages"] = tuple(conv["stages"])
    model = to_tcnn(cnn, attention="psa" if kind == "psa" else "gpsa", **conv)
    return apply_ablations(model, **ablate)


def build(kind: str, arch: str, num_classes: int, **options: Any) -> nn.Module:
    """Build a model of ``kind`` (see the module docstring) on architecture ``arch`` with ``num_classes``.

    ``options`` go to the timm constructor (e.g. ``in_chans``, ``drop_path_rate`` (alias ``drop_path``),
    ``img_size``); for "tcnn" / "hybrid_scratch" also ``alpha_init``, ``lambda_init``, ``stages``,
    ``stride_mode`` (see `core.reparam.to_tcnn`), for "psa" ``alpha_init``, ``stages``, ``stride_mode``,
    ``qk_init``; for "convit" also ``positional``, ``attn_impl`` (see `ConViT`); the ablation switches
    ``gating``, ``conv_init``, ``freeze_gpsa``; for "aa_resnet" / "cmhsa" whatever `core.models.aa_resnet.build_aa_resnet`
    / `core.nn.cmhsa.build_cmhsa` take (cmhsa: ``phase``).
    """
    options = dict(options)
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r} (choose from {list(KINDS)})")
    check_options(kind, options)
    if not is_known_arch(arch, kind):
        if kind == "convit":
            raise ValueError(f"kind 'convit': unknown arch {arch!r} (choose from {sorted(CONVIT_CONFIGS)})")
        if kind == "cmhsa":
            raise ValueError(f"kind 'cmhsa': unknown arch {arch!r} (choose from {sorted(CMHSA_ARCHS)})")
        raise ValueError(f"unknown arch {arch!r}")
    if "drop_path" in options:  # params.yaml's model.drop_path is timm's drop_path_rate
        options["drop_path_rate"] = options.pop("drop_path")
    if kind == "cnn":
        return timm.create_model(arch, num_classes=num_classes, **options)
    if kind in CONVERSION_OPTIONS:
        cnn = timm.create_model(arch, num_classes=num_classes, **backbone_options(kind, options))
        rest = {k: v for k, v in options.items() if k in CONVERSION_OPTIONS[kind] or k in ABLATION_OPTIONS}
        return convert(cnn, kind, **rest)
    if kind == "convit":
        ablate = {k: options.pop(k) for k in ("gating", "freeze_gpsa") if k in options}
        return apply_ablations(build_convit(arch, num_classes, **options), **ablate)
    if kind == "aa_resnet":
        return build_aa_resnet(arch, num_classes, **options)
    phase = options.pop("phase", "conv")
    return build_cmhsa(arch, num_classes, phase=phase, **options)
