"""The registry of model kinds: one `ModelKind` record per kind, the one place a kind is defined.

Config validation, the model factory (`core.models.build`), checkpoint specs (`core.models.spec`), the stages
(pretrain, reparam, control), the sweep and the report look a kind up here instead of branching on its name,
so adding a kind is one `register(ModelKind(...))` call next to its builder (the project's own kinds:
`core.models.builtin_kinds`, registered when `core.models` is imported) (timm's one-registration-per-model
idea, `timm.models.register_model`).

What a record says:
- ``build(arch, num_classes, **options)``: the kind's network, untrained (converting kinds: the CNN is built by
  timm and converted with `core.models.reparam.to_tcnn`; see ``attention``).
- ``archs``: the closed set of arch names, or None for timm's registry (which holds the project's small nets).
- what pretraining trains: the plain CNN (``pretrains_cnn``; the reparam stage converts it afterwards) or the
  kind's own network from scratch;
- how it converts: ``attention`` ("gpsa": T-CNN, [TCNN21] Sec. 2; "psa": [Cordonnier20]) with the
  ``conversion`` options of `to_tcnn`, read from the ``reparam`` section (conversion after pretraining) or from
  ``model.options`` (``conversion_in="options"``: the conversion is part of the architecture pretraining
  trains, so it is a model option and changing it re-runs pretraining), or ``reparameterize(model)`` for a
  two-phase model (``phases``: the pretraining phase and the phase after reparameterization; [Li21]);
- whether it has a matched control (`ModelKind.has_control`: the fine-tuned model is a reparameterized
  pretrained network);
- whether ``model.arch`` may name a user's builder (``builders``, `core.models.builders`);
- its ablation switches ([ConViT21] Table 3; `ABLATION_SWITCHES`), the builder option that takes the input
  size (``image_size_option``; pretraining sets it to ``data.image_size``) and any further option check.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.nn as nn

__all__ = [
    "ABLATION_SWITCHES",
    "GATING_MODES",
    "REPARAM_KEYS",
    "ModelKind",
    "all_kinds",
    "get",
    "kind_names",
    "register",
    "unregister",
]

#: [ConViT21] Table 3's ablation switches: option name -> what it does (the records say which kinds take them).
ABLATION_SWITCHES: dict[str, str] = {
    "gating": "'train' (default) or 'freeze0': every gating parameter lambda set to 0 and frozen (no gating)",
    "conv_init": "true (default) or false: drop the convolutional init of [ConViT21] Eq. 5",
    "freeze_gpsa": "false (default) or true: every parameter of every GPSA / PSA layer frozen",
}
GATING_MODES = ("train", "freeze0")
#: The conversion settings of the ``reparam`` section ([TCNN21] Sec. 2), in `to_tcnn`'s names.
REPARAM_KEYS = ("alpha_init", "lambda_init", "stages", "stride_mode")


@dataclass(frozen=True)
class ModelKind:
    """One model kind (see the module docstring for what each field means)."""

    name: str
    build: Callable[..., nn.Module]
    summary: str = ""
    archs: Collection[str] | None = None
    pretrains_cnn: bool = False
    attention: Literal["gpsa", "psa"] | None = None
    conversion: tuple[str, ...] = ()
    conversion_in: Literal["reparam", "options"] = "reparam"
    conversion_defaults: dict[str, Any] = field(default_factory=dict)
    reparameterize: Callable[[nn.Module], nn.Module] | None = None
    phases: tuple[str, str] | None = None
    ablations: tuple[str, ...] = ()
    image_size_option: str | None = None
    check_options: Callable[[dict[str, Any]], None] | None = None
    builders: bool = (
        False  # model.arch may name a user's builder, package.module:function (core.models.builders)
    )

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ablations) - set(ABLATION_SWITCHES))
        if unknown:
            raise ValueError(f"kind {self.name!r}: unknown ablation switch(es) {unknown}")
        if (self.attention is None) != (not self.conversion):
            raise ValueError(
                f"kind {self.name!r}: a converting kind names its attention and conversion options"
            )

    @property
    def pretraining_kind(self) -> str:
        """The kind of the network pretraining trains: "cnn" when this kind converts a pretrained CNN."""
        return "cnn" if self.pretrains_cnn else self.name

    @property
    def reparameterizes(self) -> bool:
        """Whether the reparam stage turns the pretrained network into a different one ([TCNN21] Sec. 2,
        [Li21] Theorem 1); otherwise the network passes through unchanged."""
        return (self.pretrains_cnn and self.attention is not None) or self.reparameterize is not None

    @property
    def has_control(self) -> bool:
        """A matched control exists: the same pretrained checkpoint fine-tuned with the same recipe, unconverted."""
        return self.reparameterizes

    @property
    def pretrains_attention(self) -> bool:
        """Pretraining trains positional-attention layers with gates (the hybrid from scratch, [TCNN21] Table 3's
        t1 = 0): they take `finetune.gate_lr` there too."""
        return self.attention == "gpsa" and not self.pretrains_cnn

    @property
    def final_is_tcnn(self) -> bool:
        """The fine-tuned network is a T-CNN (GPSA converted from a CNN, after or before pretraining)."""
        return self.attention == "gpsa"

    def conversion_from(self, reparam: Any, options: dict[str, Any]) -> dict[str, Any]:
        """This kind's `to_tcnn` settings from the ``reparam`` section and ``model.options``: the reparam keys
        from their home (`conversion_in`), every other conversion key (psa's ``qk_init``) from the options."""
        conv: dict[str, Any] = {}
        for key in self.conversion:
            if key in REPARAM_KEYS and self.conversion_in == "reparam":
                conv[key] = getattr(reparam, key)
            elif key in options:
                conv[key] = options[key]
            elif key in self.conversion_defaults:
                conv[key] = self.conversion_defaults[key]
        if "stages" in conv:
            conv["stages"] = [s if isinstance(s, str) else int(s) for s in conv["stages"]]
        return conv


_REGISTRY: dict[str, ModelKind] = {}


def register(kind: ModelKind) -> ModelKind:
    """Add ``kind`` to the registry (a name registered twice is refused)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"model kind {kind.name!r} is registered already")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind (tests that register a toy kind)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> ModelKind:
    """The record of kind ``name``; a one-line ValueError naming the known kinds otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model kind {name!r} (choose from {kind_names()})") from None


def kind_names() -> list[str]:
    return list(_REGISTRY)


def all_kinds() -> Iterator[ModelKind]:
    yield from _REGISTRY.values()
