"""The training loss (cross-entropy on hard or mixed labels) and a model's loss and top-1 accuracy over
batches: the figures of every epoch's validation in core.training.loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.training import distributed as D
from core.training.precision import autocast


class TrainLoss(nn.Module):
    """Cross-entropy for hard labels (with optional label smoothing) or soft targets (mixup / cutmix)."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if target.ndim == 2:
            return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)


def hard_labels(target: torch.Tensor) -> torch.Tensor:
    """Class indices of the targets (the argmax of soft, mixed targets)."""
    return target.argmax(dim=-1) if target.ndim == 2 else target


def to_device(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """A batch on `device` (channels-last for an image batch when asked)."""
    x = x.to(device, non_blocking=True)
    if channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device | None = None,
    channels_last: bool = False,
    precision: str = "auto",
) -> dict[str, float]:
    """Mean cross-entropy and top-1 accuracy of `model` (put in eval mode, restored after) over `batches`,
    computed under `precision` (core.training.precision). Under data parallelism `batches` is this rank's
    shard and the sums are added over ranks, so every rank returns the whole set's figures."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    try:
        for x, y in batches:
            x = to_device(x, device, channels_last)
            y = hard_labels(y.to(device))
            with autocast(device, precision):
                logits = model(x)
            loss_sum += float(F.cross_entropy(logits.float(), y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += int(y.numel())
    finally:
        model.train(was_training)
    if D.world().parallel:
        sums = D.all_sum(torch.tensor([loss_sum, correct, n], dtype=torch.float64))
        loss_sum, correct, n = float(sums[0]), int(sums[1]), int(sums[2])
    if n == 0:
        return {"loss": float("nan"), "acc": float("nan"), "n": 0}
    return {"loss": loss_sum / n, "acc": correct / n, "n": n}


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, *, device: torch.device | None = None) -> torch.Tensor:
    """fp32 logits of `model` in eval mode (for equivalence checks)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return model(x.to(device)).float().cpu()
    finally:
        model.train(was_training)
