"""The pretrained network at t1 that the reparam stage converts and the control fine-tunes unconverted ([TCNN21]
Sec. 2: the CNN's checkpoint at epoch t1 = reparam.epoch; or the imported CNN, `pretrain.source`): where it is,
what it must hold, and loading it checked against params (its kind, its spec or import digest) and against
the network code it was pretrained with where DVC does not track it (`stages.harness.identity.network_code`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.config import Params
from stages.harness import chain
from stages.harness import training as T
from stages.harness.identity import stale_network_code
from stages.harness.runner import StageError

__all__ = ["load_source", "required", "source_label", "source_path"]

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


def load_source(params: Params, root: Path) -> dict[str, Any]:
    """The t1 checkpoint, checked to be what params ask for: an import of this source, or a training run."""
    src = source_path(params, root)
    ckpt = T.load_checkpoint(src, required(params), source_label(params))
    held = ckpt.get("model_spec")
    mismatch = (
        params.model.record.source_mismatch(held) if isinstance(held, dict) and "kind" in held else None
    )
    if mismatch is not None:  # the specific word for a checkpoint of another kind
        raise StageError(f"{src}: {mismatch} (rerun pretrain)")
    T.check_cnn_checkpoint(ckpt, params, src)
    stale = stale_network_code(ckpt.get("network_code") or {})
    if stale:
        raise StageError(
            f"{src}: pretrained with another {stale[0]} (network code dvc.yaml does not list for this config: "
            f"model.kind={params.model.kind!r}'s, or model.arch={params.model.arch!r}'s); rerun pretraining: "
            "dvc repro -f pretrain"
        )
    return ckpt
