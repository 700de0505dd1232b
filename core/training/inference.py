"""The fastest equivalent form of a trained model for pure inference (evaluation of clean and corrupted sets):
eager, channels-last (oneDNN's native layout on CPU) or, for a model without GPSA layers, a traced and frozen
TorchScript graph. A form qualifies only when its logits match the eager model's (speed only, never the
numbers' meaning).
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch

from core.nn.gpsa import GPSA


class _ChannelsLast(torch.nn.Module):
    """Feeds the wrapped model channels-last inputs (faster convolutions on CPU: oneDNN's native layout)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.contiguous(memory_format=torch.channels_last))


def inference_model(model: torch.nn.Module, example: torch.Tensor, *, tol: float = 1e-4) -> tuple[Any, str]:
    """The fastest of a few equivalent forms of `model` (eval mode) for pure inference, and its name.

    Candidates: the eager model; channels-last weights and inputs (oneDNN's native layout on CPU); for a
    model without GPSA layers (the CNN) also a traced and frozen TorchScript graph (batch norm folded into
    the convolutions). Speed only: a candidate qualifies when its logits on `example` match the eager
    model's within `tol` (float32 rounding), and the one with the shortest time on `example` (best of two
    calls, after a warm-up) is used."""
    model = model.eval()
    with torch.no_grad():
        reference = model(example)
    candidates: list[tuple[str, Any]] = [("eager", model)]
    cl = _ChannelsLast(copy.deepcopy(model).to(memory_format=torch.channels_last)).eval()
    candidates.append(("eager, channels-last", cl))
    if not any(isinstance(m, GPSA) for m in model.modules()):
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = torch.jit.freeze(torch.jit.trace(cl, example, check_trace=False).eval())
            candidates.append(("TorchScript (traced, frozen), channels-last", traced))
        except Exception as err:  # tracing is an optimisation only
            print(f"evaluate: TorchScript not used ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
    best: tuple[float, str, Any] | None = None
    for kind, candidate in candidates:
        try:
            with torch.no_grad():
                if (candidate(example) - reference).abs().max().item() > tol:
                    continue
                times = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    candidate(example)
                    times.append(time.perf_counter() - t0)
        except Exception:  # a candidate that fails is skipped; the eager model always works
            continue
        if best is None or min(times) < best[0]:
            best = (min(times), kind, candidate)
    assert best is not None  # the eager model matches itself
    return best[2], best[1]
