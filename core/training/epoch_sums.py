"""The running sums of a training epoch (loss, correct, images, time, lr), summed over data-parallel ranks,
kept in the resume checkpoint, and turned into the epoch's history row and log line (core.training.loop).
"""

from __future__ import annotations

from typing import Any

import torch

from core.training import distributed as D
from core.training.optim import WarmupCosine


def reduced_accum(a: dict[str, Any]) -> dict[str, Any]:
    """The epoch accumulators summed over ranks (loss, correct, images); this rank's time and lr."""
    if not D.world().parallel:
        return a
    counts = D.all_sum(torch.tensor([float(a["images"])], dtype=torch.float64, device=a["loss_sum"].device))
    return {
        **a,
        "loss_sum": D.all_sum(a["loss_sum"]),
        "correct": D.all_sum(a["correct"]),
        "images": int(counts.item()),
    }


def zero_accum(a: dict[str, Any]) -> dict[str, Any]:
    """The sums with loss, correct and images zeroed (a non-zero rank resuming: rank 0 carries the sums)."""
    return {**a, "loss_sum": torch.zeros_like(a["loss_sum"]), "correct": torch.zeros_like(a["correct"]),
            "images": 0}  # fmt: skip


def new_accum(device: torch.device | None = None) -> dict[str, Any]:
    """Empty sums at an epoch's start."""
    return {
        "loss_sum": torch.zeros((), dtype=torch.float64, device=device),
        "correct": torch.zeros((), dtype=torch.int64, device=device),
        "images": 0,
        "time_s": 0.0,
        "lr": float("nan"),
    }


def accum_to_state(a: dict[str, Any]) -> dict[str, Any]:
    """The sums as a checkpoint keeps them (on CPU)."""
    return {**a, "loss_sum": a["loss_sum"].cpu(), "correct": a["correct"].cpu()}


def accum_from_state(a: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The sums of a checkpoint, back on `device`."""
    return {**a, "loss_sum": a["loss_sum"].to(device), "correct": a["correct"].to(device)}


def epoch_row(label: int, global_step: int, a: dict[str, Any], scheduler: WarmupCosine) -> dict[str, Any]:
    """The history row of the epoch completing as `label`, from its (rank-summed) sums."""
    n = max(1, a["images"])
    return {
        "epoch": label,
        "step": global_step,
        "lr": a["lr"],  # lr of the epoch's last step (the schedule is per step)
        "train_loss": float(a["loss_sum"]) / n,
        "train_acc": int(a["correct"]) / n,
        "images_per_s": a["images"] / a["time_s"] if a["time_s"] > 0 else float("nan"),
        "train_time_s": a["time_s"],
    }


def epoch_line(desc: str, row: dict[str, Any], total: int) -> str:
    """The log line of an epoch's history row."""
    parts = [f"{desc} epoch {row['epoch']}/{total}", f"lr {row['lr']:.3g}", f"loss {row['train_loss']:.4f}"]
    parts.append(f"acc {row['train_acc']:.4f}")
    if "val_acc" in row:
        parts.append(f"val_loss {row['val_loss']:.4f} val_acc {row['val_acc']:.4f}")
    parts.append(f"{row['images_per_s']:.0f} img/s")
    return " | ".join(parts)
