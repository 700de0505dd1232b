"""Stage `control`: the matched control of the T-CNN -- the same CNN checkpoint, fine-tuned without attention.

    python -m stages.control [--params params.yaml]

What attention buys is the T-CNN minus this model ([TCNN21] Table 1 reports the CNN fine-tuned "without SA" next to
each T-CNN). It starts from the pretraining checkpoint the reparam stage converts
(``runs/pretrain/ckpt/ckpt-epoch-{t1:03d}.pt``) and runs the finetune stage's own training function
(`stages.harness.fine_tuning.train`) with the same params: optimizer, lr schedule, epochs, resolution, augmentation,
stochastic depth, data order and seeds; only the reparameterization is missing. In "continue" mode it is the
CNN run continued for the same t2 epochs ([TCNN21] Table 3's CNN row). Names in ``finetune.freeze`` that the CNN
does not have (the GPSA's attention-only parameters) are skipped.

The control exists for the kinds whose fine-tuned model is a reparameterized pretrained network
(their registry record says so: `core.models.kinds.ModelKind.has_control`) and when ``finetune.control`` is true. Otherwise the stage writes its
outputs empty and says why in metrics.json (``enabled: false``), so the DVC graph stays the same.

Outputs (``root/runs/control/``): ``model/control-final.pt``, ``history.json`` / ``history.csv`` (one row per
epoch, as the finetune stage's), ``metrics.json``. Resume state: ``root/runs/.partial/control/``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from core.config import Params
from core.utils.atomic import atomic_write_json, atomic_write_text
from stages.harness import training as T
from stages.harness.fine_tuning import CONTROL, control_checkpoint, control_disabled_reason, preflight, train
from stages.harness.runner import stage_main
from stages.harness.t1_checkpoint import Wanted, load_source, source_label, source_path

VARIANT = CONTROL
NAME = CONTROL.name
checkpoint_path = control_checkpoint
disabled_reason = control_disabled_reason


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    root = Path(root)
    reason = disabled_reason(params)
    if reason is not None:
        return _disabled(root, reason)
    source = load_source(Wanted.of(params, root))
    ckpt = source.ckpt
    start = {"model": ckpt["model"], "model_spec": ckpt["model_spec"], "image_size": ckpt.get("image_size")}
    if source.trained:  # a training checkpoint: what "continue" fine-tuning resumes from
        state = source.optimizer_state()
        start["carry"] = source.carry(state, {k: k for k in state})
    metrics = train(params.for_control(), root, start, source.path, VARIANT, strict_freeze=False)
    return {"enabled": True, **metrics}


def _disabled(root: Path, reason: str) -> dict[str, Any]:
    out = VARIANT.out_dir(root)
    model_dir = checkpoint_path(root).parent
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    atomic_write_json(out / "history.json", [])
    atomic_write_text(out / "history.csv", "finetune_epoch,val_acc,val_loss\n")
    metrics = {"enabled": False, "reason": reason}
    atomic_write_json(out / "metrics.json", metrics)
    print(f"{NAME}: no control ({reason})")
    return metrics


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens (when there is a control): the pretraining checkpoint at t1 and the data exist."""
    if disabled_reason(params) is None:
        preflight(params, root, source_path(params, root), source_label(params))


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, data_parallel=T.data_parallel, check=check)


if __name__ == "__main__":
    sys.exit(main())
