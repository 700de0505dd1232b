"""The pretrained network at t1 that the reparam stage converts and the control fine-tunes unconverted ([TCNN21]
Sec. 2: the CNN's checkpoint at epoch t1 = reparam.epoch; or the imported CNN, `pretrain.source`): where it is,
what it must hold, and loading it checked against params (its kind, its spec or import digest) and against
the network code it was pretrained with where DVC does not track it (`stages.harness.identity.network_code`).

What the params ask of it is read of them once (`Wanted.of`: its path, its keys, the network it must be, with
model.kind's record looked up there); the file is read and checked once, here (:func:`load_source`), and handed
on as a `Pretrained`: the checked checkpoint with its network rebuilt, so no later step looks the kind up or
validates the file again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from core.config import Params
from core.models.spec import network
from core.training.checkpoint import CheckpointError, with_weights
from core.training.optim import named_state
from core.utils.errors import first_line
from stages.harness import chain
from stages.harness import training as T
from stages.harness.identity import stale_network_code
from stages.harness.runner import StageError

__all__ = ["Pretrained", "Wanted", "load_source", "required", "source_label", "source_path"]

REQUIRED = ("model", "model_spec", "optimizer", "param_names", "scheduler", "rng", "epoch", "global_step")
IMPORTED = ("model", "model_spec", "source")  # an imported CNN's checkpoint (stages.imported_cnn.import_cnn)


def source_path(params: Params, root: Path) -> Path:
    """The pretraining checkpoint at t1 (`Params.t1`: reparam.epoch, or the imported CNN's state)."""
    return root / chain.output("pretrain", "ckpt") / f"ckpt-epoch-{params.t1():03d}.pt"


def required(params: Params) -> tuple[str, ...]:
    """The keys the t1 checkpoint must hold: a training checkpoint's, or an import's (no optimizer to carry)."""
    return IMPORTED if params.imports_cnn else REQUIRED


def source_label(params: Params) -> str:
    if params.imports_cnn:
        return "imported CNN written by the pretrain stage (pretrain.source)"
    return f"pretraining checkpoint at reparam.epoch={params.reparam.epoch}"


@dataclass(frozen=True)
class Wanted:
    """The t1 checkpoint the params ask for, read of them once (:meth:`of`): where it is (:func:`source_path`),
    what a refusal calls it (:func:`source_label`), the keys it must hold (:func:`required`) and the network it
    must be (`stages.harness.training.CnnWanted`)."""

    path: Path
    label: str
    required: tuple[str, ...]
    cnn: T.CnnWanted

    @classmethod
    def of(cls, params: Params, root: Path) -> Wanted:
        return cls(source_path(params, root), source_label(params), required(params), T.CnnWanted.of(params))


@dataclass(frozen=True)
class Pretrained:
    """The t1 checkpoint as :func:`load_source` read and checked it: its file, its content and its network
    (rebuilt from the spec, weights loaded, eval mode)."""

    path: Path
    ckpt: dict[str, Any]
    model: nn.Module

    @property
    def spec(self) -> dict[str, Any]:
        """The network's checkpoint spec (`core.models.spec`)."""
        return self.ckpt["model_spec"]

    @property
    def trained(self) -> bool:
        """A training checkpoint (optimizer, scheduler and RNG states to carry), not an import."""
        return "optimizer" in self.ckpt

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """The pretraining run's per-parameter optimizer state, keyed by parameter name ({} for an import)."""
        ckpt = self.ckpt
        return named_state(ckpt["optimizer"], ckpt["param_names"]) if self.trained else {}

    def carry(self, state: dict[str, dict[str, Any]], moved: dict[str, str]) -> dict[str, Any] | None:
        """What "continue" fine-tuning resumes from ([TCNN21] Table 3): the optimizer ``state`` (keyed by the
        fine-tuned network's parameter names; ``moved``: old name -> new), the scheduler, step and RNG states
        of the run; None for an import (no run to continue)."""
        if not self.trained:
            return None
        ckpt = self.ckpt
        return {
            "optimizer_state": state,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in ckpt["optimizer"]["param_groups"]
            ],
            "scheduler": ckpt["scheduler"],
            "epoch": int(ckpt["epoch"]),
            "global_step": int(ckpt["global_step"]),
            "steps_per_epoch": int(ckpt.get("steps_per_epoch", 0)),
            "rng": ckpt["rng"],
            "moved": moved,
        }


def load_source(want: Wanted) -> Pretrained:
    """The t1 checkpoint, checked once to be what the params ask for (``want``: an import of this source, or a
    training run of this kind, spec and network code) and its network rebuilt: every later step takes it as it
    is."""
    src, cnn = want.path, want.cnn
    ckpt = T.load_checkpoint(src, want.required, want.label)
    held = ckpt.get("model_spec")
    mismatch = cnn.kind.source_mismatch(held) if isinstance(held, dict) and "kind" in held else None
    if mismatch is not None:  # the specific word for a checkpoint of another kind
        raise StageError(f"{src}: {mismatch} (rerun pretrain)")
    spec = T.check_cnn_checkpoint(ckpt, cnn, src)  # the params' own spec, which the config checked
    stale = stale_network_code(ckpt.get("network_code") or {})
    if stale:
        raise StageError(
            f"{src}: pretrained with another {stale[0]} (network code dvc.yaml does not list for this config: "
            f"model.kind={cnn.kind.name!r}'s, or model.arch={cnn.arch!r}'s); rerun pretraining: "
            "dvc repro -f pretrain"
        )
    try:
        model = with_weights(network(spec), ckpt, src)
    except CheckpointError as err:
        raise StageError(str(err)) from None
    except (ValueError, TypeError, KeyError) as err:
        raise StageError(f"{src}: cannot rebuild its model from model_spec ({first_line(err)})") from None
    return Pretrained(src, ckpt, model.eval())
