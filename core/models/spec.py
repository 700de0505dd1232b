"""Model specs: the JSON-able description a checkpoint stores to rebuild its model, and the spec of the
network a run pretrains for each model kind.

A spec is ``{"kind", "arch", "num_classes", "in_chans", "options",
"tcnn": {"alpha_init", "lambda_init", "stages", "stride_mode", "attention"} | None, "phase": "conv" | "mhsa"}``.
``tcnn`` is the conversion section of the kinds built by converting a CNN (`core.models.convert`): "tcnn" and
"hybrid_scratch" (attention "gpsa") and "psa" (attention "psa"; lambda_init unused); ``phase`` the phase of a
"cmhsa" model ([Li21]). Older specs without "attention" / "phase" read as "gpsa" / None. ``options`` holds the
backbone options and the ablation switches (`core.models`), which the rebuild applies again (frozen
parameters stay frozen).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from core.models import CONVERSION_OPTIONS, backbone_options, build

MODEL_SPEC_KEYS = ("kind", "arch", "num_classes", "in_chans", "options", "tcnn")
TCNN_SPEC_KEYS = ("alpha_init", "lambda_init", "stages", "stride_mode")
CONVERTED_KINDS = ("tcnn", "psa", "hybrid_scratch")
# Kinds whose pretraining trains a plain CNN that the reparam stage converts afterwards.
CONVERTED_LATER = ("cnn", "tcnn", "psa")


def make_model_spec(
    kind: str,
    arch: str,
    num_classes: int,
    in_chans: int,
    options: dict[str, Any] | None = None,
    tcnn: dict[str, Any] | None = None,
    phase: str | None = None,
) -> dict[str, Any]:
    """The `model_spec` dict of the checkpoint contract (INTERFACES.md; module docstring)."""
    if tcnn is not None:
        missing = [k for k in TCNN_SPEC_KEYS if k not in tcnn]
        if missing:
            raise ValueError(f"model_spec.tcnn lacks {missing}")
        attention = str(tcnn.get("attention", "psa" if kind == "psa" else "gpsa"))
        if attention not in ("gpsa", "psa") or (attention == "psa") != (kind == "psa"):
            raise ValueError(f"model_spec.tcnn.attention {attention!r} does not fit kind {kind!r}")
        tcnn = {
            "alpha_init": float(tcnn["alpha_init"]),
            "lambda_init": float(tcnn["lambda_init"]),
            "stages": [int(s) for s in tcnn["stages"]],
            "stride_mode": str(tcnn["stride_mode"]),
            "attention": attention,
        }
    if phase is not None and kind != "cmhsa":
        raise ValueError(f"model_spec.phase applies to kind 'cmhsa' only, not {kind!r}")
    spec = {
        "kind": kind,
        "arch": arch,
        "num_classes": int(num_classes),
        "in_chans": int(in_chans),
        "options": dict(options or {}),
        "tcnn": tcnn,
    }
    if kind == "cmhsa":
        spec["phase"] = str(phase or "conv")
    return spec


def build_from_spec(spec: dict[str, Any]) -> nn.Module:
    """Build the (untrained) module a `model_spec` describes, of any kind (`core.models.build`).

    A spec with a ``tcnn`` section builds the CNN of its options and converts it (``to_tcnn`` with the
    section's settings, GPSA or PSA) - kind "tcnn", "psa" or "hybrid_scratch" (an old spec of kind "cnn" with
    a section reads as "tcnn"); a "cmhsa" spec builds its ``phase``.
    """

    missing = [k for k in MODEL_SPEC_KEYS if k not in spec]
    if missing:
        raise ValueError(f"model_spec lacks {missing}")
    kind = spec["kind"]
    options = dict(spec["options"] or {})
    options.setdefault("in_chans", spec["in_chans"])
    tcnn = spec.get("tcnn")
    if tcnn is not None:
        if kind not in CONVERTED_KINDS:
            kind = "tcnn"
        section = {
            "alpha_init": tcnn["alpha_init"],
            "lambda_init": tcnn["lambda_init"],
            "stages": tuple(tcnn["stages"]),
            "stride_mode": tcnn["stride_mode"],
        }
        if tcnn.get("attention", "gpsa") == "psa":
            kind = "psa"
            section.pop("lambda_init")
        options.update(section)  # the section wins over option copies of the same keys
    if kind == "cmhsa":
        options["phase"] = spec.get("phase") or options.get("phase", "conv")
    return build(kind, spec["arch"], spec["num_classes"], **options)


def pretraining_kind(kind: str) -> str:
    """The network pretraining trains for model kind `kind`: the CNN for kinds cnn/tcnn/psa (converted after
    pretraining), the model itself otherwise: convit, aa_resnet and hybrid_scratch (the T-CNN architecture
    from scratch, t1 = 0 of [TCNN21] Table 3) from scratch, cmhsa in its convolution phase ([Li21])."""
    return "cnn" if kind in CONVERTED_LATER else kind


def pretraining_spec(
    kind: str, arch: str, options: dict[str, Any], num_classes: int, in_chans: int, image_size: int
) -> dict[str, Any]:
    """The spec of the network pretraining trains (see :func:`pretraining_kind`).

    - cnn / tcnn / psa: the CNN, with the backbone options only (the ablation switches act after conversion);
    - hybrid_scratch: the converted random CNN: ``options`` alpha_init, lambda_init, stages, stride_mode
      (defaults 1, 1, [-1], exact: the paper's init) form the spec's conversion section;
    - convit: ``img_size`` defaults to `image_size`;
    - cmhsa: phase "conv".
    """
    options = dict(options)
    if kind in CONVERTED_LATER:
        return make_model_spec("cnn", arch, num_classes, in_chans, backbone_options(kind, options))
    if kind == "hybrid_scratch":
        conv = {
            "alpha_init": 1.0,
            "lambda_init": 1.0,
            "stages": [-1],
            "stride_mode": "exact",
            **{k: options.pop(k) for k in CONVERSION_OPTIONS[kind] if k in options},
        }
        return make_model_spec(kind, arch, num_classes, in_chans, options, tcnn=conv)
    if kind == "convit":
        options.setdefault("img_size", image_size)
    phase = "conv" if kind == "cmhsa" else None
    return make_model_spec(kind, arch, num_classes, in_chans, options, phase=phase)
