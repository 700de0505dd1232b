"""The registry of model kinds: one `ModelKind` record per kind, the one place a kind is defined.

Config validation, the model factory (`core.models.build`), checkpoint specs (`core.models.spec`), the stages
(pretrain, reparam, control), the sweep and the report look a kind up here instead of branching on its name,
so adding a kind is one record in `BUILTIN_KINDS` below (or one `register(ModelKind(...))` call for a kind of
your own) next to its builder (timm's one-registration-per-model idea, `timm.models.register_model`).

A record names its code by reference (``"package.module:attribute"``) and this module imports nothing but the
standard library: the configuration checks kind names without loading any network, and a stage loads only the
code of the kind it builds (the CNN's pretraining never imports the attention layers, so DVC does not rerun it
when they change: `ModelKind.code`).

What a record says:
- ``build``: the reference of ``build(arch, num_classes, **options)``, the kind's network, untrained (converting
  kinds: the CNN is built by timm and converted with `core.models.conversion.to_tcnn`; see ``attention``).
- ``archs``: the reference of the closed set of arch names, or None for timm's registry (which holds the
  project's small nets).
- what pretraining trains: the plain CNN (``pretrains_cnn``; the reparam stage converts it afterwards) or the
  kind's own network from scratch;
- how it converts: ``attention`` ("gpsa": T-CNN, [TCNN21] Sec. 2; "psa": [Cordonnier20]) with the
  ``conversion`` options of `to_tcnn`, read from the ``reparam`` section (conversion after pretraining) or from
  ``model.options`` (``conversion_in="options"``: the conversion is part of the architecture pretraining
  trains, so it is a model option and changing it re-runs pretraining), or ``reparameterize(model)`` for a
  two-phase model (a reference; ``phases``: the pretraining phase and the phase after reparameterization; [Li21]);
- whether it has a matched control (`ModelKind.has_control`: the fine-tuned model is a reparameterized
  pretrained network);
- whether ``model.arch`` may name a user's builder (``builders``, `core.models.builders`);
- its ablation switches ([ConViT21] Table 3; `ABLATION_SWITCHES`), the builder option that takes the input
  size (``image_size_option``; pretraining sets it to ``data.image_size``) and any further option check.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ABLATION_SWITCHES",
    "BUILTIN_KINDS",
    "CONVERSION",
    "Conversion",
    "GATING_MODES",
    "REPARAM_KEYS",
    "ModelKind",
    "all_kinds",
    "get",
    "kind_names",
    "record",
    "register",
    "resolve",
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
#: The module that converts a CNN's convs to GPSA / PSA (`to_tcnn`), loaded by the converting kinds only.
CONVERSION = "core.models.conversion"


def resolve(ref: str) -> Any:
    """The object a ``"package.module:attribute"`` reference names (imported on first use)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Conversion:
    """How a CNN's k x k convs become positional attention, and the switches on the result: GPSA ([TCNN21]
    Sec. 2: locality strength alpha, gate lambda, Eq. 7) or ungated PSA ([Cordonnier20]; ``qk_init``), which
    stages (indices or module-name patterns), how strides are kept, and [ConViT21] Table 3's ``gating`` /
    ``freeze_gpsa``. Built once from params or options (`ModelKind.conversion_of`), whose checks validated
    every value, and handed whole to `core.models.conversion.to_attention`."""

    attention: Literal["gpsa", "psa"] = "gpsa"
    alpha_init: float = 1.0
    lambda_init: float = 1.0
    stages: tuple[int | str, ...] = (-1,)
    stride_mode: str = "exact"
    qk_init: str | None = None  # PSA only; None: the layer's default
    gating: str = "train"
    freeze_gpsa: bool = False

    def apply(self, cnn: Any) -> Any:
        """``cnn`` with its convs converted and the switches set (`core.models.conversion.to_attention`; the
        conversion module is loaded here, on first use, so only the converting kinds load it)."""
        return resolve(f"{CONVERSION}:to_attention")(cnn, self)

    def replace(self, **changes: Any) -> Conversion:
        """This conversion with some settings changed (the reparam stage's other inits and stride mode)."""
        return dataclasses.replace(self, **changes)

    def layers(self) -> dict[str, Any]:
        """The layer settings of `core.models.conversion.to_tcnn`."""
        out = {"attention": self.attention, "alpha_init": self.alpha_init, "lambda_init": self.lambda_init,
               "stages": self.stages, "stride_mode": self.stride_mode}  # fmt: skip
        return out if self.qk_init is None else {**out, "qk_init": self.qk_init}

    def switches(self) -> dict[str, Any]:
        """The ablation switches on the converted network (`core.models.factory.apply_ablations`)."""
        return {"gating": self.gating, "freeze_gpsa": self.freeze_gpsa}

    def section(self) -> dict[str, Any]:
        """The checkpoint spec's conversion section (`core.models.spec`)."""
        return {"alpha_init": float(self.alpha_init), "lambda_init": float(self.lambda_init),
                "stages": list(self.stages), "stride_mode": self.stride_mode, "attention": self.attention}  # fmt: skip


@dataclass(frozen=True)
class ModelKind:
    """One model kind (see the module docstring for what each field means)."""

    name: str
    build: str
    summary: str = ""
    archs: str | None = None
    pretrains_cnn: bool = False
    attention: Literal["gpsa", "psa"] | None = None
    conversion: tuple[str, ...] = ()
    conversion_in: Literal["reparam", "options"] = "reparam"
    conversion_defaults: dict[str, Any] = field(default_factory=dict)
    reparameterize: str | None = None
    phases: tuple[str, str] | None = None
    ablations: tuple[str, ...] = ()
    image_size_option: str | None = None
    check_options: str | None = None
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

    def builder(self) -> Callable[..., Any]:
        """The kind's ``build(arch, num_classes, **options)``."""
        return resolve(self.build)

    def arch_names(self) -> Collection[str] | None:
        """The closed set of arch names (None: timm's registry)."""
        return None if self.archs is None else resolve(self.archs)

    def checker(self) -> Callable[[dict[str, Any]], None] | None:
        """The kind's own option check, if any."""
        return None if self.check_options is None else resolve(self.check_options)

    def reparameterizer(self) -> Callable[[Any], Any] | None:
        """A two-phase kind's map from its first phase to its second ([Li21] Theorem 1)."""
        return None if self.reparameterize is None else resolve(self.reparameterize)

    def code(self) -> tuple[str, ...]:
        """The modules that build, check and convert this kind's network (the conversion module when it
        converts): what a stage that builds it loads, and so its DVC deps."""
        refs = (self.build, self.archs, self.check_options, self.reparameterize)
        modules = [r.partition(":")[0] for r in refs if r is not None]
        if self.attention is not None:
            modules.append(CONVERSION)
        return tuple(dict.fromkeys(modules))

    def source_mismatch(self, spec_cnn: dict[str, Any]) -> str | None:
        """Why a pretraining checkpoint of ``spec_cnn`` cannot be reparameterized to this kind (None: it can)."""
        converted_already = self.reparameterizes and self.attention is not None and spec_cnn.get("tcnn")
        if spec_cnn["kind"] == self.pretraining_kind and not converted_already:
            return None
        held = "a T-CNN" if spec_cnn.get("tcnn") is not None else f"a {spec_cnn['kind']!r} model"
        return (
            f"holds {held} already; model.kind={self.name!r} expects a {self.pretraining_kind!r} "
            "pretraining checkpoint"
        )

    @property
    def pretraining_kind(self) -> str:
        """The kind of the network pretraining trains: "cnn" when this kind converts a pretrained CNN."""
        return "cnn" if self.pretrains_cnn else self.name

    def pretraining_record(self) -> ModelKind:
        """The record of `pretraining_kind` (the CNN's, for the kinds that convert it after pretraining)."""
        return get(self.pretraining_kind)

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

    def backbone_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options of this kind that the underlying CNN takes (ablation switches and conversion keys
        removed)."""
        drop = set(ABLATION_SWITCHES) | set(self.conversion)
        return {k: v for k, v in options.items() if k not in drop}

    def conversion_of(self, reparam: Any, options: Mapping[str, Any]) -> Conversion:
        """This kind's `Conversion`: the reparam keys from the ``reparam`` section (``conversion_in="reparam"``;
        None: from ``options`` too), every other conversion key (psa's ``qk_init``) and the switches from the
        options, the record's defaults for what neither gives."""
        if self.attention is None:
            raise ValueError(f"kind {self.name!r} does not convert a CNN")
        values: dict[str, Any] = dict(self.conversion_defaults)
        from_reparam = reparam is not None and self.conversion_in == "reparam"
        if from_reparam:
            values.update({k: getattr(reparam, k) for k in REPARAM_KEYS})
        keys = [k for k in self.conversion if not (from_reparam and k in REPARAM_KEYS)]
        values.update({k: options[k] for k in (*keys, "gating", "freeze_gpsa") if k in options})
        stages = tuple(s if isinstance(s, str) else int(s) for s in values.pop("stages", (-1,)))
        return Conversion(attention=self.attention, stages=stages, **values)


_CNN = "core.models.cnn:build_cnn"
#: The project's kinds ([TCNN21] Sec. 2 and Table 3, [Cordonnier20], [ConViT21], [Bello19], [Li21]); what each is
#: and does: its ``summary`` and `core.models.cnn` (the CNN), `core.models.conversion` (the conversion).
BUILTIN_KINDS: tuple[ModelKind, ...] = (
    ModelKind("cnn", _CNN, "a timm CNN (or a project small net)", pretrains_cnn=True, builders=True),
    ModelKind(
        "tcnn", _CNN, "the CNN's last-stage 3x3 convs as GPSA after pretraining ([TCNN21] Sec. 2)",
        pretrains_cnn=True, attention="gpsa", conversion=REPARAM_KEYS, ablations=("gating", "freeze_gpsa"),
        builders=True,
    ),
    ModelKind(
        "psa", _CNN, "the CNN's convs as ungated positional self-attention ([Cordonnier20])",
        pretrains_cnn=True, attention="psa", conversion=("alpha_init", "stages", "stride_mode", "qk_init"),
        ablations=("freeze_gpsa",), check_options=f"{CONVERSION}:check_psa_options", builders=True,
    ),
    ModelKind(
        "hybrid_scratch", _CNN, "the T-CNN architecture trained from scratch ([TCNN21] Table 3, t1 = 0)",
        attention="gpsa", conversion=REPARAM_KEYS, conversion_in="options",
        conversion_defaults={"alpha_init": 1.0, "lambda_init": 1.0, "stages": [-1], "stride_mode": "exact"},
        ablations=("gating", "freeze_gpsa"), check_options=f"{CONVERSION}:check_hybrid_options",
    ),
    ModelKind(
        "convit", "core.models.convit:build_convit", "ConViT ([ConViT21]) on the project's GPSA",
        archs="core.models.convit:CONVIT_CONFIGS", ablations=("gating", "conv_init", "freeze_gpsa"),
        image_size_option="img_size",
    ),
    ModelKind("aa_resnet", "core.models.aa_resnet:build_aa_resnet", "Attention Augmented ResNet ([Bello19])"),
    ModelKind(
        "cmhsa", "core.nn.cmhsa:build_cmhsa", "convolution phase -> self-attention phase ([Li21] Theorem 1)",
        archs="core.nn.cmhsa:CMHSA_ARCHS", reparameterize="core.nn.cmhsa:to_mhsa", phases=("conv", "mhsa"),
        check_options="core.nn.cmhsa:check_phase_option",
    ),
)  # fmt: skip

_REGISTRY: dict[str, ModelKind] = {k.name: k for k in BUILTIN_KINDS}


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


def record(kind: str | ModelKind) -> ModelKind:
    """The record ``kind`` is or names: what the public entry points (`core.models.build`, the spec maker) take,
    so a caller holding the record (``params.model.record``) passes it and nothing looks it up again."""
    return kind if isinstance(kind, ModelKind) else get(kind)


def kind_names() -> list[str]:
    return list(_REGISTRY)


def all_kinds() -> Iterator[ModelKind]:
    yield from _REGISTRY.values()
