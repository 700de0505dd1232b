"""Model factory: `build(kind, arch, num_classes, **options)` for every kind of the registry
(`core.models.kinds`, where the project's kinds are listed with what each means).

Converting kinds (a record with ``attention``: "tcnn", "psa", "hybrid_scratch") build the CNN with timm and
convert it with `core.models.conversion.to_tcnn` ([TCNN21] Sec. 2; loaded only for them); their conversion options go to `to_tcnn`, the rest
to the CNN. Every other kind's record builds its network directly.

Ablation switches ([ConViT21] Table 3; `core.models.kinds.ABLATION_SWITCHES`), options of the kinds whose
record lists them:
- ``gating``: "train" (default) or "freeze0": every gating parameter lambda is set to 0 and frozen, so each
  head pays the same attention to content and position ([ConViT21] Table 3 footnote 4: "no gating").
- ``conv_init``: true (default) or false: false drops the convolutional (locality) init of [ConViT21] Eq. 5: W_val
  and the positional embedding v_pos get timm's ViT init (truncated normal, std 0.02) like every other
  linear layer; v_pos is then stored raw (``positional="linear"``) since a random one may be anti-local.
- ``freeze_gpsa``: false (default) or true: every parameter of every GPSA (PSA) layer is frozen
  (requires_grad False; the optimizers skip them).
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

from core.models import kinds
from core.models.builders import is_builder, load_builder
from core.models.kinds import ABLATION_SWITCHES, GATING_MODES, REPARAM_KEYS, ModelKind
from core.models.resnets import PROJECT_ARCHS
from core.nn.attention_layers import gpsa_modules

__all__ = [
    "apply_ablations",
    "build",
    "check_arch",
    "construct",
    "check_options",
    "is_known_arch",
    "set_drop_path",
    "set_stochastic_depth",
]


def is_known_arch(arch: str, kind: ModelKind | None = None) -> bool:
    """Whether ``arch`` names a model of ``kind`` (its record's closed set, else timm's registry, which holds
    the project's small nets); None: of any kind."""
    if kind is None:
        return any(is_known_arch(arch, k) for k in kinds.all_kinds())
    if is_builder(arch):
        return kind.builders
    archs = kind.arch_names()
    return arch in archs if archs is not None else (arch in PROJECT_ARCHS or timm.is_model(arch))


def check_arch(kind: ModelKind, arch: str) -> None:
    """One-line ValueError unless ``arch`` is a model of ``kind`` (a user's builder ``module:function`` is
    imported here, for the kinds that take one)."""
    if is_builder(arch):
        if not kind.builders:
            takers = [k.name for k in kinds.all_kinds() if k.builders]
            raise ValueError(f"a user's builder ({arch}) serves kinds {takers}, not {kind.name!r}")
        load_builder(arch)
        return
    if not is_known_arch(arch, kind):
        archs = kind.arch_names()
        if archs is not None:
            raise ValueError(f"unknown arch {arch!r} for kind {kind.name!r} (choose from {sorted(archs)})")
        raise ValueError(f"unknown arch {arch!r} (not a timm model name nor a project-registered net)")


def check_options(kind: ModelKind, options: dict[str, Any]) -> None:
    """Validate the ablation switches and conversion options of ``kind`` (one-line ValueError naming the key).

    Options the switches do not know are left to the constructors (timm kwargs etc.)."""
    for key in ABLATION_SWITCHES:
        if key in options and key not in kind.ablations:
            takers = [k.name for k in kinds.all_kinds() if key in k.ablations]
            raise ValueError(f"options.{key}: applies to kinds {takers}, not {kind.name!r}")
    if "gating" in options and options["gating"] not in GATING_MODES:
        raise ValueError(f"options.gating: must be one of {list(GATING_MODES)}, got {options['gating']!r}")
    for key in ("conv_init", "freeze_gpsa"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"options.{key}: must be true or false, got {options[key]!r}")
    checker = kind.checker()
    if checker is not None:
        checker(options)


def check_model_options(kind: ModelKind, options: dict[str, Any]) -> None:
    """`check_options` for ``model.options`` of params.yaml: a converting kind whose conversion follows
    pretraining takes the `reparam` section's keys from there, never from the options."""
    check_options(kind, options)
    foreign = sorted(set(options) & _conversion_keys() - set(REPARAM_KEYS) - set(kind.conversion))
    if foreign:
        takers = [k.name for k in kinds.all_kinds() if foreign[0] in k.conversion]
        raise ValueError(f"options.{foreign[0]}: applies to kinds {takers}, not {kind.name!r}")
    if kind.conversion_in == "reparam":
        bad = [k for k in REPARAM_KEYS if k in options and k in kind.conversion]
        if bad:
            raise ValueError(
                f"options.{bad[0]}: kind {kind.name!r} converts with reparam.{bad[0]}; set that instead"
            )
    if kind.phases is not None and "phase" in options:
        raise ValueError(
            f"options.phase: set by the stages (pretrain: {kind.phases[0]}, reparam onwards: "
            f"{kind.phases[1]}), not an option"
        )


#: The switches `apply_ablations` applies to a built model (``conv_init`` acts inside the builder).
POST_BUILD_SWITCHES = ("gating", "freeze_gpsa")


def _conversion_keys() -> set[str]:
    return {key for k in kinds.all_kinds() for key in k.conversion}


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


def build(kind: str | ModelKind, arch: str, num_classes: int, **options: Any) -> nn.Module:
    """Build a model of ``kind`` (its registry record or name, `core.models.kinds`) on ``arch`` with
    ``num_classes``.

    ``options`` go to the kind's builder (timm kwargs such as ``in_chans``, ``drop_path_rate`` (alias
    ``drop_path``), ``img_size``; convit's ``positional``, ``attn_impl``; aa_resnet's and cmhsa's own), except
    a converting kind's conversion keys and switches (its `core.models.kinds.Conversion`, to
    `core.models.conversion.to_attention`) and the ablation switches.
    """
    record = kinds.record(kind)
    check_options(record, options)
    check_arch(record, arch)
    return construct(record, arch, num_classes, options)


def construct(record: ModelKind, arch: str, num_classes: int, options: dict[str, Any]) -> nn.Module:
    """`build` without its checks: the network of a kind, arch and options that are known good (checked by
    `build`, by the config, or equal to a spec made from checked params: `core.models.spec.network`)."""
    options = dict(options)
    if "drop_path" in options:  # params.yaml's model.drop_path is timm's drop_path_rate
        options["drop_path_rate"] = options.pop("drop_path")
    if record.attention is not None:  # a CNN converted: its conversion keys and switches make the Conversion
        conversion = record.conversion_of(None, options)
        taken = {*record.conversion, *POST_BUILD_SWITCHES}
        cnn = record.builder()(arch, num_classes, **{k: v for k, v in options.items() if k not in taken})
        return conversion.apply(cnn)
    ablate = {k: options.pop(k) for k in POST_BUILD_SWITCHES if k in options}
    return apply_ablations(record.builder()(arch, num_classes, **options), **ablate)
