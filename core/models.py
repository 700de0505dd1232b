"""Model factory: `build(kind, arch, num_classes, **options)` for every model kind the project knows.

Kinds
- "cnn": any timm model name or a project-registered small net (below).
- "tcnn": the CNN above reparameterized by `core.reparam.to_tcnn` (000, Sec. 2). Options ``alpha_init``,
  ``lambda_init``, ``stages``, ``stride_mode`` go to `to_tcnn`; the rest to the CNN.
- "psa": the CNN converted like "tcnn" but to ungated positional self-attention (`core.psa.PSA`; 003,
  001 Appendix A): ``alpha_init``, ``stages``, ``stride_mode``, ``qk_init``.
- "hybrid_scratch": the T-CNN architecture of a randomly initialised CNN, trained from scratch (t1 = 0 in
  000 Table 3); built exactly as "tcnn" (the stages treat it differently: pretraining trains it directly).
- "convit": the project's ConViT (001): timm's ConViT architecture (``convit_tiny``, ``convit_small``,
  ``convit_base`` configs, and ``convit_fmnist``, a small one for 28 px single-channel inputs) running on the
  ConViT-mode `core.gpsa.GPSA`. It loads a timm ConViT state_dict with plain ``load_state_dict`` (the GPSA
  converts timm's keys), after which its logits equal timm's.
- "aa_resnet": Attention Augmented ResNet (004), `core.aa.build_aa_resnet`.
- "cmhsa": the two-phase model of 002, `core.cmhsa.build_cmhsa` (option ``phase``: "conv" or "mhsa").

Ablation switches (001 Table 3), options of "convit" and, where they mean something, of the T-CNN kinds:
- ``gating``: "train" (default) or "freeze0": every gating parameter lambda is set to 0 and frozen, so each
  head pays the same attention to content and position (001 Table 3 footnote 4: "no gating").
  convit, tcnn, hybrid_scratch.
- ``conv_init``: true (default) or false: false drops the convolutional (locality) init of 001 Eq. 5: W_val
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
from timm.models import register_model
from timm.models.convit import GPSA as TimmGPSA
from timm.models.convit import ConVit
from timm.models.resnet import BasicBlock, ResNet

from core.gpsa import GPSA

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
    "lazy_attr",
    "set_stochastic_depth",
]

KINDS = ("cnn", "tcnn", "convit", "psa", "hybrid_scratch", "aa_resnet", "cmhsa")
# Kinds whose fine-tuned model is a reparameterized pretrained network: they have a matched control (the same
# pretrained checkpoint fine-tuned with the same recipe, unconverted; stages/control.py).
REPARAMETERIZED_KINDS = ("tcnn", "psa", "cmhsa")

PROJECT_ARCHS: dict[str, dict[str, Any]] = {
    # name: ResNet kwargs. Widths chosen so the default CPU pipeline fits its time goal.
    "resnet10_cifar": dict(block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
    # The default: a dilated last stage (timm's output_stride=16: layer4 keeps layer3's resolution, its second
    # 3x3 conv gets dilation 2), so at 28 px the T-CNN's GPSA layers work on 7x7 maps (4x4 on resnet10_cifar);
    # the conversion of dilated convs is exact (core.gpsa: centres at dilation * tap). The last stage keeps
    # layer3's 64 channels: at 7x7 a 128-wide one trains 1.6x slower as a T-CNN (and 1.55x as a CNN; measured
    # on 2 cores, AVX-512 EPYC), which the default chain's 10-minute budget cannot pay.
    "resnet10_cifar_os16": dict(
        block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 64), output_stride=16
    ),
    "resnet18_cifar": dict(block=BasicBlock, layers=(2, 2, 2, 2), channels=(64, 128, 256, 512)),
}

# timm's ConViT configs (001 Table 1: Ti, S, B; embed_dim is per head, 48 x heads in total).
CONVIT_CONFIGS: dict[str, dict[str, Any]] = {
    "convit_tiny": dict(embed_dim=48, num_heads=4, local_up_to_layer=10, locality_strength=1.0),
    "convit_small": dict(embed_dim=48, num_heads=9, local_up_to_layer=10, locality_strength=1.0),
    "convit_base": dict(embed_dim=48, num_heads=16, local_up_to_layer=10, locality_strength=1.0),
    # Small, for the default data (28 px, 1 channel) on a CPU: 4 x 4 px patches -> 7 x 7 tokens, 4 heads of
    # width 16 (64 channels), 3 GPSA blocks then 1 SA block.
    "convit_fmnist": dict(
        img_size=28, patch_size=4, in_chans=1, embed_dim=16, num_heads=4, depth=4, mlp_ratio=2.0,
        local_up_to_layer=3, locality_strength=1.0,
    ),
}  # fmt: skip

# Options of the conv -> attention conversion (`core.reparam.to_tcnn`), per converting kind.
CONVERSION_OPTIONS: dict[str, tuple[str, ...]] = {
    "tcnn": ("alpha_init", "lambda_init", "stages", "stride_mode"),
    "hybrid_scratch": ("alpha_init", "lambda_init", "stages", "stride_mode"),
    "psa": ("alpha_init", "stages", "stride_mode", "qk_init"),
}
# Ablation switches (001 Table 3) and the kinds they apply to.
ABLATION_OPTIONS: dict[str, tuple[str, ...]] = {
    "gating": ("convit", "tcnn", "hybrid_scratch"),
    "conv_init": ("convit",),
    "freeze_gpsa": ("convit", "tcnn", "psa", "hybrid_scratch"),
}
GATING_MODES = ("train", "freeze0")
_TCNN_OPTIONS = CONVERSION_OPTIONS["tcnn"]
_TIMM_FACTORY_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")


def _cifar_resnet(name: str, pretrained: bool = False, **kwargs: Any) -> ResNet:
    if pretrained:
        raise ValueError(f"{name}: no pretrained weights exist for the project's small nets")
    for key in _TIMM_FACTORY_KWARGS:  # passed (as None) by timm.create_model; ResNet does not take them
        kwargs.pop(key, None)
    cfg = {**PROJECT_ARCHS[name], **kwargs}
    in_chans = cfg.get("in_chans", 3)
    stem_width = cfg["channels"][0]
    # timm's plain stem is fixed at 64 channels; its 'deep' stem ends at 2 * stem_width channels, which lets
    # the stem width follow `channels[0]`. The stem is then replaced by the CIFAR-style one: a single 3x3
    # stride-1 conv and no max-pool, so 28 px inputs reach the last stage at 4x4.
    model = ResNet(stem_type="deep", stem_width=stem_width // 2, **cfg)
    model.conv1 = nn.Conv2d(in_chans, stem_width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    for info in model.feature_info:
        info["reduction"] = max(1, info["reduction"] // 4)
    model.pretrained_cfg = {"architecture": name, "num_classes": model.num_classes}
    return model


@register_model
def resnet10_cifar(pretrained: bool = False, **kwargs: Any) -> ResNet:
    return _cifar_resnet("resnet10_cifar", pretrained, **kwargs)


@register_model
def resnet10_cifar_os16(pretrained: bool = False, **kwargs: Any) -> ResNet:
    return _cifar_resnet("resnet10_cifar_os16", pretrained, **kwargs)


@register_model
def resnet18_cifar(pretrained: bool = False, **kwargs: Any) -> ResNet:
    return _cifar_resnet("resnet18_cifar", pretrained, **kwargs)


class ConViT(ConVit):
    """timm's ConViT with its GPSA layers replaced by the project's ConViT-mode `core.gpsa.GPSA`.

    Construction reproduces timm's init exactly (timm's GPSA weights are loaded into ours). A timm ConViT
    state_dict loads with ``load_state_dict`` (keys converted by the GPSA), giving timm's logits. Extra option
    ``positional``: "softplus" (default; alpha = softplus(alpha~) > 0) or "linear" (raw v_pos, needed for
    checkpoints whose pos_proj has a non-negative |delta|^2 weight); ``attn_impl``: see `core.gpsa.GPSA`.
    """

    def __init__(
        self,
        *,
        positional: str | None = None,
        attn_impl: str = "auto",
        conv_init: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("attn_drop_rate", 0.0):
            raise ValueError("ConViT: attn_drop_rate is not supported by the project's GPSA")
        if positional is None:
            positional = "softplus" if conv_init else "linear"
        if not conv_init and positional != "linear":
            raise ValueError(
                "ConViT: conv_init=false needs positional='linear' (a randomly initialised v_pos may be anti-local)"
            )
        super().__init__(**kwargs)
        grid = tuple(self.patch_embed.grid_size)
        for i, blk in enumerate(self.blocks):
            old = blk.attn
            if not isinstance(old, TimmGPSA):
                continue
            new = GPSA(
                old.dim,
                num_heads=old.num_heads,
                mode="convit",
                qkv_bias=old.qk.bias is not None,
                positional=positional,
                alpha_init=max(float(old.locality_strength), 1e-3),
                proj_drop=old.proj_drop.p,
                attn_impl=attn_impl,
                device=old.qk.weight.device,
                dtype=old.qk.weight.dtype,
            )
            new.grid_size = grid
            if old.qk.weight.device.type != "meta":
                try:
                    new.load_state_dict(old.state_dict())  # timm's init, converted by the GPSA's load hook
                except ValueError as e:
                    raise ValueError(f"ConViT block {i}: {e}") from None
                if not conv_init:
                    _vit_init(new)
            blk.attn = new


@torch.no_grad()
def _vit_init(g: GPSA) -> None:
    """001 Table 3 "no conv init": W_val and v_pos get timm's ViT init (truncated normal, std 0.02, as every
    linear layer of the ConViT) instead of the identity and the locality init of 001 Eq. 5."""
    qk = 2 * g.num_heads * g.qk_head_dim
    nn.init.trunc_normal_(g.qkv_weight[qk:], std=0.02)
    nn.init.trunc_normal_(g.pos_weight, std=0.02)


def _build_convit(arch: str, num_classes: int, **options: Any) -> ConViT:
    if arch not in CONVIT_CONFIGS:
        raise ValueError(f"kind 'convit': unknown arch {arch!r} (choose from {sorted(CONVIT_CONFIGS)})")
    if options.pop("pretrained", False):
        raise ValueError(
            "kind 'convit': pretrained downloads are not supported; load a timm state_dict instead"
        )
    return ConViT(num_classes=num_classes, **{**CONVIT_CONFIGS[arch], **options})


def is_known_arch(arch: str, kind: str | None = None) -> bool:
    """Whether ``arch`` names a model of ``kind``; None: of any kind (a CNN, a ConViT config, a cmhsa arch).

    CNN-based kinds (cnn, tcnn, psa, hybrid_scratch) take timm names and the project's small nets; "convit"
    its configs; "cmhsa" `core.cmhsa.CMHSA_ARCHS`; "aa_resnet" is checked by `core.aa.build_aa_resnet`."""
    if kind == "convit":
        return arch in CONVIT_CONFIGS
    if kind == "cmhsa":
        return arch in _cmhsa_archs()
    if kind == "aa_resnet":
        return True
    if kind is None and (arch in CONVIT_CONFIGS or arch in _cmhsa_archs()):
        return True
    return arch in PROJECT_ARCHS or timm.is_model(arch)


def _cmhsa_archs() -> tuple[str, ...]:
    try:
        from core.cmhsa import CMHSA_ARCHS
    except ImportError:
        return ()
    return tuple(CMHSA_ARCHS)


def lazy_attr(module: str, attr: str, kind: str) -> Any:
    """``module.attr``, with one clear line when the module has not landed yet."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            raise ValueError(
                f"model kind {kind!r} needs {module.replace('.', '/')}.py, which is missing"
            ) from None
        raise
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ValueError(f"model kind {kind!r}: {module} has no {attr}") from None


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
    """001 Table 3 switches on the GPSA / PSA layers of ``model`` (in place; see the module docstring)."""
    from core.reparam import gpsa_modules

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


def set_stochastic_depth(model: nn.Module, rate: float) -> int:
    """`core.train.set_drop_path` (timm's linear rule over the blocks) for every kind: blocks whose forward
    calls ``self.drop_path(...)`` unconditionally (ConViT, cmhsa) get ``nn.Identity`` where the rule gives 0
    (timm's ResNet blocks take None). Returns the number of blocks touched."""
    from timm.models.resnet import BasicBlock as TimmBasic
    from timm.models.resnet import Bottleneck

    from core.train import set_drop_path

    n = set_drop_path(model, rate)
    for m in model.modules():
        if hasattr(m, "drop_path") and m.drop_path is None and not isinstance(m, (TimmBasic, Bottleneck)):
            m.drop_path = nn.Identity()
    return n


def convert(cnn: nn.Module, kind: str, **options: Any) -> nn.Module:
    """The conversion step of the converting kinds ("tcnn", "hybrid_scratch": GPSA; "psa": PSA) followed by
    the ablation switches: a NEW module (``cnn`` untouched). ``options``: conversion keys and switches."""
    from core.reparam import to_tcnn

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
    ``gating``, ``conv_init``, ``freeze_gpsa``; for "aa_resnet" / "cmhsa" whatever `core.aa.build_aa_resnet`
    / `core.cmhsa.build_cmhsa` take (cmhsa: ``phase``).
    """
    options = dict(options)
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r} (choose from {list(KINDS)})")
    check_options(kind, options)
    if not is_known_arch(arch, kind):
        if kind == "convit":
            raise ValueError(f"kind 'convit': unknown arch {arch!r} (choose from {sorted(CONVIT_CONFIGS)})")
        if kind == "cmhsa" and _cmhsa_archs():
            raise ValueError(f"kind 'cmhsa': unknown arch {arch!r} (choose from {sorted(_cmhsa_archs())})")
        if kind != "cmhsa":
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
        return apply_ablations(_build_convit(arch, num_classes, **options), **ablate)
    if kind == "aa_resnet":
        return lazy_attr("core.aa", "build_aa_resnet", kind)(arch, num_classes, **options)
    phase = options.pop("phase", "conv")
    return lazy_attr("core.cmhsa", "build_cmhsa", kind)(arch, num_classes, phase=phase, **options)
