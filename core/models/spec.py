"""Model specs: the JSON-able description a checkpoint stores to rebuild its model, and the spec of the
network a run pretrains for each model kind.

A spec is ``{"kind", "arch", "num_classes", "in_chans", "options",
"tcnn": {"alpha_init", "lambda_init", "stages", "stride_mode", "attention"} | None, "phase": "conv" | "mhsa"}``.
``tcnn`` is the conversion section of the kinds built by converting a CNN (`core.models.kinds.Conversion`): "tcnn" and
"hybrid_scratch" (attention "gpsa") and "psa" (attention "psa"; lambda_init unused); ``phase`` the phase of a
"cmhsa" model ([Li21]). Older specs without "attention" / "phase" read as "gpsa" / None. ``options`` holds the
backbone options and the ablation switches (`core.models`), which the rebuild applies again (frozen
parameters stay frozen).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from core.models import kinds
from core.models.factory import build, construct
from core.models.kinds import REPARAM_KEYS, ModelKind

MODEL_SPEC_KEYS = ("kind", "arch", "num_classes", "in_chans", "options", "tcnn")
TCNN_SPEC_KEYS = REPARAM_KEYS  # the conversion section holds the reparam section's settings


def make_model_spec(
    kind: str | ModelKind,
    arch: str,
    num_classes: int,
    in_chans: int,
    options: dict[str, Any] | None = None,
    tcnn: dict[str, Any] | None = None,
    phase: str | None = None,
) -> dict[str, Any]:
    """The `model_spec` dict of the checkpoint contract (INTERFACES.md; module docstring) for ``kind`` (a record
    or its name; the spec holds the name)."""
    record = kinds.record(kind)
    if tcnn is not None:
        missing = [k for k in TCNN_SPEC_KEYS if k not in tcnn]
        if missing:
            raise ValueError(f"model_spec.tcnn lacks {missing}")
        attention = str(tcnn.get("attention", record.attention or "gpsa"))
        if attention != (record.attention or "gpsa"):
            raise ValueError(f"model_spec.tcnn.attention {attention!r} does not fit kind {record.name!r}")
        tcnn = {
            "alpha_init": float(tcnn["alpha_init"]),
            "lambda_init": float(tcnn["lambda_init"]),
            "stages": [s if isinstance(s, str) else int(s) for s in tcnn["stages"]],
            "stride_mode": str(tcnn["stride_mode"]),
            "attention": attention,
        }
    if phase is not None and record.phases is None:
        raise ValueError(f"model_spec.phase applies to two-phase kinds only, not {record.name!r}")
    spec = {
        "kind": record.name,
        "arch": arch,
        "num_classes": int(num_classes),
        "in_chans": int(in_chans),
        "options": dict(options or {}),
        "tcnn": tcnn,
    }
    if record.phases is not None:
        spec["phase"] = str(phase or record.phases[0])
    return spec


def build_from_spec(spec: dict[str, Any]) -> nn.Module:
    """Build the (untrained) module a `model_spec` describes, of any kind (`core.models.build`: its arch and
    options checked).

    A spec with a ``tcnn`` section builds the CNN of its options and converts it (``to_tcnn`` with the
    section's settings, GPSA or PSA); an old spec of a non-converting kind with a section reads as the kind that
    converts a pretrained CNN with its attention ("tcnn" or "psa"); a two-phase spec builds its ``phase``.
    """
    record, options = _kind_and_options(spec)
    return build(record, spec["arch"], spec["num_classes"], **options)


def network(spec: dict[str, Any]) -> nn.Module:
    """The (untrained) module of a spec known to be good, unchecked (`core.models.factory.construct`): one that
    equals the spec of params the config checked (`pretraining_spec`), as the pretrained CNN a stage reads
    does once it is compared with it; a spec from anywhere else goes through `build_from_spec`."""
    record, options = _kind_and_options(spec)
    return construct(record, spec["arch"], spec["num_classes"], options)


def _kind_and_options(spec: dict[str, Any]) -> tuple[ModelKind, dict[str, Any]]:
    """The kind a spec builds and the options its builder takes (module docstring; `build_from_spec`)."""
    missing = [k for k in MODEL_SPEC_KEYS if k not in spec]
    if missing:
        raise ValueError(f"model_spec lacks {missing}")
    record = kinds.get(spec["kind"])
    options = dict(spec["options"] or {})
    options.setdefault("in_chans", spec["in_chans"])
    tcnn = spec.get("tcnn")
    if tcnn is not None:
        attention = tcnn.get("attention", "gpsa")
        if record.attention != attention:
            record = next(k for k in kinds.all_kinds() if k.pretrains_cnn and k.attention == attention)
        section = {k: tcnn[k] for k in TCNN_SPEC_KEYS if k in record.conversion}
        section["stages"] = tuple(section["stages"])
        options.update(section)  # the section wins over option copies of the same keys
    if record.phases is not None:
        options["phase"] = spec.get("phase") or options.get("phase", record.phases[0])
    return record, options


def pretraining_spec(
    kind: ModelKind, arch: str, options: dict[str, Any], num_classes: int, in_chans: int, image_size: int
) -> dict[str, Any]:
    """The spec of the network pretraining trains for ``kind`` (its `ModelKind.pretraining_kind`: the CNN for
    kinds that convert it afterwards, the model itself otherwise -- hybrid_scratch is the T-CNN architecture
    from scratch, t1 = 0 of [TCNN21] Table 3; a two-phase model trains its first phase, [Li21]):

    - kinds that convert after pretraining: the CNN, with the backbone options only (the ablation switches act
      after conversion);
    - kinds converted before pretraining (hybrid_scratch): the converted random CNN; the record's conversion
      keys of ``options`` (defaults: its `conversion_defaults`, the paper's init) form the spec's section;
    - a kind whose builder is sized by an option (convit's ``img_size``): it defaults to `image_size`;
    - two-phase kinds: their first phase.
    """
    options = dict(options)
    if kind.pretrains_cnn:
        return make_model_spec(
            kind.pretraining_record(), arch, num_classes, in_chans, kind.backbone_options(options)
        )
    if kind.attention is not None:
        conv = {
            **kind.conversion_defaults,
            **{k: options.pop(k) for k in kind.conversion if k in options},
        }
        return make_model_spec(kind, arch, num_classes, in_chans, options, tcnn=conv)
    if kind.image_size_option is not None:
        options.setdefault(kind.image_size_option, image_size)
    return make_model_spec(kind, arch, num_classes, in_chans, options)
