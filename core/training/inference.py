"""The fastest equivalent form of a trained model for pure inference (evaluation of clean and corrupted sets):
eager, channels-last (oneDNN's native layout on CPU), a traced and frozen TorchScript graph, and that graph
run on sub-batches. A form qualifies only when its logits match the eager model's (speed only, never the
numbers' meaning).

GPSA layers ([TCNN21] Eq. 7) trace too: with autograd off their input-independent terms (the gated positional
attention sigma(lambda_h) softmax(v_pos^h . r_ij) for the fixed map size, the folded W_out^h W_val) come from
the layer's cache, so one eager call before tracing makes them constants of the graph, and the gated mix runs
as plain aten ops (`core.nn.gated_mix.gated_mix`). Sub-batches: in eval mode every image's logits are a function of
that image alone (batch norm uses its running statistics), so the batch can be split anywhere; a few dozen
images keep the activations and the [heads, L, L] attention maps in the CPU caches, which a batch of hundreds
does not.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch

from core.utils.errors import first_line

#: Sub-batch sizes tried for the fastest form (the best of them is picked by timing, `inference_model`).
SUB_BATCHES = (64, 128)


class _ChannelsLast(torch.nn.Module):
    """Feeds the wrapped model channels-last inputs (faster convolutions on CPU: oneDNN's native layout)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.contiguous(memory_format=torch.channels_last))


class _Guarded(torch.nn.Module):
    """``fast`` on inputs of the example's image shape (what it was traced for), in sub-batches of ``size``
    images (None: whole batches); any other input shape goes to the eager ``fallback``."""

    def __init__(
        self, fast: Any, fallback: torch.nn.Module, shape: tuple[int, ...], size: int | None = None
    ) -> None:
        super().__init__()
        self.fast, self.fallback, self.shape, self.size = fast, fallback, tuple(shape), size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.shape:
            return self.fallback(x)
        if self.size is None or x.shape[0] <= self.size:
            return self.fast(x)
        return torch.cat([self.fast(part) for part in x.split(self.size)])


def _trace(model: torch.nn.Module, example: torch.Tensor) -> Any:
    """``model`` traced on ``example`` and frozen (batch norm folded into the convolutions, weights packed),
    after one eager call that fills the GPSA layers' caches of input-independent tensors."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(example[:1])
        return torch.jit.freeze(torch.jit.trace(model, example, check_trace=False).eval())


def _candidates(model: torch.nn.Module, example: torch.Tensor) -> list[tuple[str, Any]]:
    """The forms to try: eager, channels-last, traced (when tracing works), and the fastest base form of those
    (traced, else channels-last) on sub-batches of each of `SUB_BATCHES` smaller than the example batch."""
    shape = tuple(example.shape[1:])
    cl = _ChannelsLast(copy.deepcopy(model).to(memory_format=torch.channels_last)).eval()
    out: list[tuple[str, Any]] = [("eager", model), ("eager, channels-last", cl)]
    fast, name = cl, "eager, channels-last"
    try:
        fast, name = _trace(cl, example), "TorchScript (traced, frozen), channels-last"
        out.append((name, _Guarded(fast, cl, shape)))
    except Exception as err:  # tracing is an optimisation only
        print(f"evaluate: TorchScript not used ({type(err).__name__}: {first_line(err, 120)})")
    out += [
        (f"{name}, in batches of {s}", _Guarded(fast, cl, shape, s)) for s in SUB_BATCHES if s < len(example)
    ]
    return out


def inference_model(model: torch.nn.Module, example: torch.Tensor, *, tol: float = 1e-4) -> tuple[Any, str]:
    """The fastest of a few equivalent forms of `model` (eval mode) for pure inference, and its name.

    Candidates (`_candidates`): the eager model; channels-last weights and inputs (oneDNN's native layout on
    CPU); a traced and frozen TorchScript graph (batch norm folded into the convolutions; GPSA models included,
    see the module docstring), used for inputs of the example's image shape only; and that graph (or, where
    tracing fails, the channels-last model) run on sub-batches. Speed only: a candidate qualifies when its
    logits match the eager model's within `tol` (float32 rounding) on `example` and on its first third (a
    batch of another size, as a last batch is), and the one with the shortest time of one call on `example`
    (after the check's calls warmed it up) is used."""
    model = model.eval()
    part = example[: max(1, len(example) // 3)]
    with torch.no_grad():
        reference, ref_part = model(example), model(part)
    best: tuple[float, str, Any] | None = None
    for kind, candidate in _candidates(model, example):
        try:
            with torch.no_grad():
                if not _matches(candidate, (example, part), (reference, ref_part), tol):
                    continue
                t0 = time.perf_counter()
                candidate(example)
                elapsed = time.perf_counter() - t0
        except Exception:  # a candidate that fails is skipped; the eager model always works
            continue
        if best is None or elapsed < best[0]:
            best = (elapsed, kind, candidate)
    assert best is not None  # the eager model matches itself
    return best[2], best[1]


def _matches(
    candidate: Any, inputs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...], tol: float
) -> bool:
    """Whether ``candidate``'s logits on each input are within ``tol`` of the eager model's."""
    return all((candidate(x) - ref).abs().max().item() <= tol for x, ref in zip(inputs, refs))
