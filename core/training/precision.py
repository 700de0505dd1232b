"""Numeric precision of training and evaluation: one setting (params.yaml ``precision``), honoured on CPU and
CUDA alike, so the reduced-precision paths a GPU run takes are tested on CPU (torch's CPU autocast supports
bf16 and fp16).

- ``auto``: bf16 autocast on CUDA, fp32 elsewhere (the behaviour before the setting existed);
- ``fp32``: no autocast;
- ``bf16``: autocast to bfloat16 (fp32's exponent range: no loss scaling needed);
- ``fp16``: autocast to float16 with a dynamic loss scale (torch's GradScaler), whose state the training
  checkpoints carry, so a resume is exact.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a context is made: the configuration checks the names only
    import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # torch dtype names


def resolve(precision: str, device: torch.device) -> str:
    """The concrete precision (fp32 | bf16 | fp16) that ``precision`` means on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager:
    """torch.autocast for ``precision`` on ``device`` (a no-op context for fp32)."""
    import torch

    concrete = resolve(precision, device)
    if concrete == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, _DTYPES[concrete]))


def grad_scaler(device: torch.device, precision: str = "auto") -> torch.amp.GradScaler:
    """A loss scaler, enabled for fp16 only (bf16 and fp32 need none)."""
    import torch

    return torch.amp.GradScaler(device.type, enabled=resolve(precision, device) == "fp16")
