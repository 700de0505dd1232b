"""The reparameterization step of every model kind, as its registry record says (`core.models.kinds`).

- a kind that converts its pretrained CNN (``pretrains_cnn`` and ``attention``): `core.models.conversion.to_attention`
  with its `Conversion` ([TCNN21] Sec. 2: GPSA; [Cordonnier20]: PSA), then the ablation switches;
- a two-phase kind (``reparameterize``): its own map, e.g. [Li21] Theorem 1's convolution -> self-attention;
- every other kind: the pretrained network passes through unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from core.models.kinds import ABLATION_SWITCHES, REPARAM_KEYS, Conversion, ModelKind
from core.models.spec import make_model_spec


@dataclass
class Reparameterized:
    """The network the reparam stage hands to fine-tuning, its checkpoint spec and how it came about."""

    model: nn.Module
    spec: dict[str, Any]
    converted: bool
    #: The optimizer state of the pretraining run carries over by name and shape only (a two-phase model's
    #: new parameters start without state); a GPSA conversion maps each conv's state onto its GPSA.
    carry_by_name: bool
    note: str | None = None
    #: The conversion that made ``model`` (a CNN converted to attention), for whoever varies it (the reparam
    #: stage's other stride mode and inits); None for every other kind.
    conversion: Conversion | None = None


def state_kept_by_name(state: dict[str, dict[str, Any]], model: nn.Module) -> dict[str, dict[str, Any]]:
    """The optimizer state of the parameters that exist in ``model`` under the same name and shape (what a
    `Reparameterized` network with ``carry_by_name`` keeps of the pretraining run's state)."""
    params = dict(model.named_parameters())
    out = {}
    for name, st in state.items():
        p = params.get(name)
        if p is not None and all(
            not (isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape != p.shape) for v in st.values()
        ):
            out[name] = st
    return out


def switches(kind: ModelKind, options: dict[str, Any]) -> dict[str, Any]:
    """The ablation switches of ``options`` that act on the converted network of ``kind``."""
    return {k: options[k] for k in ABLATION_SWITCHES if k in kind.ablations and k in options}


def reparameterize(
    cnn: nn.Module, spec_cnn: dict[str, Any], kind: ModelKind, reparam: Any, options: dict[str, Any]
) -> Reparameterized:
    """The network of ``kind`` made from the pretrained ``cnn`` (rebuilt from ``spec_cnn``) and its spec; ``cnn``
    itself is left as it is (a network that passes through is a copy of it)."""
    arch, n, chans = spec_cnn["arch"], spec_cnn["num_classes"], spec_cnn["in_chans"]
    if kind.reparameterizes and kind.attention is not None:
        conversion = kind.conversion_of(reparam, options)
        model = conversion.apply(cnn)
        extra = {k: options[k] for k in kind.conversion if k not in REPARAM_KEYS and k in options}  # qk_init
        spec_options = {**spec_cnn["options"], **switches(kind, options), **extra}
        spec = make_model_spec(kind, arch, n, chans, spec_options, conversion.section())
        return Reparameterized(model, spec, converted=True, carry_by_name=False, conversion=conversion)
    if kind.reparameterize is not None and kind.phases is not None:
        model = kind.reparameterizer()(cnn)
        spec = make_model_spec(kind, arch, n, chans, spec_cnn["options"], phase=kind.phases[1])
        note = f"{kind.name}: {kind.phases[0]} phase -> {kind.phases[1]} phase ({kind.summary})"
        return Reparameterized(model, spec, converted=True, carry_by_name=True, note=note)
    model = copy.deepcopy(cnn)
    note = f"model.kind={kind.name!r}: no reparameterization, the network passes through"
    return Reparameterized(model, spec_cnn, converted=False, carry_by_name=False, note=note)
