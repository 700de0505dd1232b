"""Stage `finetune`: train the reparameterized network from `root/runs/reparam/tcnn.pt`.

`finetune.mode` picks the recipe (`core.training.recipes`):
- "fresh" ([TCNN21] Sec. 3): AdamW, linear warmup over `finetune.warmup_epochs` to
  lr = finetune.lr x finetune.batch_size / 1024, then per-step cosine decay over `finetune.epochs`; the
  gating parameters lambda (Eq. 7) use finetune.gate_lr x finetune.batch_size / 1024 (the paper gives both
  at batch 1024; scaling both keeps its gate / weight ratio), on the same warmup + cosine shape; no weight
  decay on alpha, lambda, attention centres, norms and biases; stochastic depth `finetune.drop_path` (timm's
  linear rule over the ResNet blocks); augmentation `Params.augment_for("finetune")`; resolution
  `finetune.image_size` (null = pretraining resolution); data order seeded by derive_seed(seed, "finetune").
- "continue" ([TCNN21] Table 3): the pretraining run goes on with the T-CNN in place of the CNN. It trains the
  t2 = pretrain.epochs - reparam.epoch epochs that remain of the schedule planned over pretrain.epochs
  (`finetune.epochs` is ignored in this mode; t2 = 0 just evaluates the converted network), with the CNN
  run's SGD (pretrain.lr, momentum, weight_decay), its per-step warmup + cosine schedule at the step it
  reached, its momentum buffers (a converted conv's buffer moves to the GPSA parameter that holds the
  filter; new GPSA parameters start with empty state), its RNG states, its data order (epochs t1..E-1 of
  the same BatchLoader seed), batch size, augmentation, resolution and `model.drop_path`. Gates get the
  same lr as every other parameter: one optimizer, one schedule.

The matched control (stages/control.py) runs the same function (`stages.harness.fine_tuning.train`) on the CNN checkpoint at t1 (no
reparameterization): the same optimizer, lr schedule, epochs, resolution, augmentation, stochastic depth, data
order and seeds -- only the network differs ([TCNN21] Table 1, "without SA"). To keep the random streams equal, the
global RNG is re-seeded after the model is built (building a T-CNN draws its new W_qry/W_key), so stochastic
depth draws the same masks in both runs.

Outputs (`root/runs/finetune/`, published when the run completes): tcnn-final.pt (model checkpoint),
history.csv / history.json (one row per epoch, the first row being the state right after
reparameterization; per attention layer (GPSA, PSA, ConViT, AA, cmhsa's MHSA; `core.analysis.dissect.layer_stats`)
mean 1/alpha, sigma(lambda) where the layer has them, and the nonlocality ([ConViT21] Eq. 8) on the layer's real
input for a fixed validation batch), gpsa.csv (per epoch, layer and head), metrics.json. Every model kind
fine-tunes the same way: AdamW groups from `core.training.optim.param_groups` (GPSA / PSA positional parameters
without weight decay, GPSA gates at finetune.gate_lr); parameters frozen by ablation switches stay frozen.
Resume as in the pretrain stage (`root/runs/.partial/finetune/`).

`finetune.stop` (optional; `core.training.early_stop`): the run stops once validation accuracy plateaus and
publishes the best-validation epoch's weights; metrics.json then says `stopped_epoch`, `best_epoch`,
`best_val_accuracy` (fine-tuning epochs, 1-based) and `stop_reason`, for the T-CNN and the control alike.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.analysis.dissect import layer_stats, long_rows
from core.config import Params
from stages.harness import chain
from stages.harness import training as T
from stages.harness.fine_tuning import NAME, Variant, identity, preflight, train
from stages.harness.runner import stage_main

__all__ = ["NAME", "TCNN", "check", "identity", "main", "run", "source_path"]

TCNN = Variant(NAME, "tcnn-final.pt", layer_stats, long_rows)


def source_path(root: Path) -> Path:
    return root / chain.output("reparam", "tcnn.pt")


def run(params: Params, *, root: Path = Path("."), freeze: Sequence[str] = ()) -> dict[str, Any]:
    """Fine-tune the reparameterized network; `freeze` (plus `finetune.freeze`) names parameters to keep fixed."""
    root = Path(root)
    src = source_path(root)
    required = ("model", "model_spec") + (("carry",) if params.finetune.mode == "continue" else ())
    ckpt = T.load_checkpoint(src, required, "reparameterized model written by the reparam stage")
    return train(params, root, ckpt, src, TCNN, freeze=freeze)


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the reparameterized model exists, the data too, the checkpoint cadence is readable."""
    preflight(params, root, source_path(root), "reparameterized model written by the reparam stage")


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, data_parallel=T.data_parallel, check=check)


if __name__ == "__main__":
    sys.exit(main())
