"""Where and how a training run computes: its device, deterministic kernels (bitwise resume on CPU) and the
seeds of the global RNGs (core.training.loop).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def select_device(name: str | None = None) -> torch.device:
    """`name`, else env TCNN_DEVICE, else CUDA when available, else CPU."""
    name = name or os.environ.get("TCNN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels on CPU (bitwise resume); on CUDA keep the fast cuDNN autotuner instead."""
    if device.type == "cpu":
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)
    else:
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = before


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (model init, stochastic depth, dropout)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
