"""The two fine-tuning recipes of the reparameterized network ([TCNN21] Sec. 3 and Table 3), which the matched
control follows too: the optimizer, its lr schedule and the epochs to run.

- `fresh` ([TCNN21] Sec. 3): AdamW, linear warmup to lr = finetune.lr x batch / 1024 then per-step cosine
  decay over finetune.epochs; the gating parameters lambda (Eq. 7) at finetune.gate_lr x batch / 1024; no
  weight decay on the positional parameters, norms and biases (`core.training.optim.build_adamw`).
- `continued` ([TCNN21] Table 3): the pretraining run goes on from epoch t1 with the T-CNN in place of the CNN:
  its SGD with the carried momentum buffers, its warmup + cosine schedule at the step it reached, over the
  t2 = pretrain.epochs - t1 epochs that remain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.training.optim import WarmupCosine, build_adamw, build_sgd, load_named_state


@dataclass
class Recipe:
    """What `core.training.loop.fit` trains with, and the recipe's facts for the run's metrics."""

    optimizer: torch.optim.Optimizer
    scheduler: WarmupCosine
    epochs: range
    info: dict[str, Any]


def fresh(model: torch.nn.Module, finetune: Any, steps_per_epoch: int) -> Recipe:
    """[TCNN21] Sec. 3 with the ``finetune`` section (`core.config.FinetuneConfig`)."""
    peak_lr, gate_lr = finetune.scaled_lrs()
    optimizer = build_adamw(model, lr=peak_lr, gate_lr=gate_lr, weight_decay=finetune.weight_decay)
    scheduler = WarmupCosine(
        optimizer,
        total_steps=finetune.epochs * steps_per_epoch,
        warmup_steps=round(finetune.warmup_epochs * steps_per_epoch),
    )
    return Recipe(optimizer, scheduler, range(0, finetune.epochs), {"peak_lr": peak_lr, "gate_lr": gate_lr})


def continued(model: torch.nn.Module, pretrain: Any, carry: dict[str, Any], steps_per_epoch: int) -> Recipe:
    """[TCNN21] Table 3: the pretraining run of the ``pretrain`` section (`core.config.PretrainConfig`) resumed at
    the epoch, step, optimizer state and schedule ``carry`` holds (written by the reparam stage). A ValueError
    says why the carried state does not fit."""
    t1 = int(carry["epoch"])
    total = pretrain.epochs * steps_per_epoch
    saved = carry["scheduler"]
    if carry.get("steps_per_epoch") not in (0, steps_per_epoch) or saved.get("total_steps") != total:
        raise ValueError(
            f"its schedule ({saved.get('total_steps')} steps) does not match pretrain.* now "
            f"({pretrain.epochs} epochs x {steps_per_epoch} steps); rerun pretrain and reparam"
        )
    optimizer = build_sgd(
        model, lr=pretrain.lr, momentum=pretrain.momentum, weight_decay=pretrain.weight_decay
    )
    try:
        load_named_state(optimizer, model, carry["optimizer_state"])
    except KeyError as err:
        raise ValueError(f"carried optimizer state does not fit the model ({err})") from None
    scheduler = WarmupCosine(
        optimizer,
        total_steps=total,
        warmup_steps=int(saved["warmup_steps"]),
        min_factor=float(saved.get("min_factor", 0.0)),
        start_step=int(carry["global_step"]),
    )
    info = {"t1": t1, "t2": pretrain.epochs - t1, "peak_lr": pretrain.lr}
    return Recipe(optimizer, scheduler, range(t1, pretrain.epochs), info)
