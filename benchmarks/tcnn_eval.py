"""Would a faster evaluation of the T-CNN pay for the CIFAR-10 study? Evaluation img/s of the study's T-CNN
(and its CNN), eager against the candidates, side by side in interleaved rounds (ratio = median of per-round
ratios), and training img/s in fp32 against bf16 autocast.

    .venv/bin/python benchmarks/tcnn_eval.py [--arch resnet12_cifar_os16] [--size 32] [--rounds 5]

Evaluation candidates (all channels-last, fp32 unless named): TorchScript trace + freeze (what evaluate uses
for the CNN: core/training/inference.py ``inference_model``), ``torch.compile`` (inductor; its compile time is printed,
it is paid once per model and process), and bf16 autocast (not used by evaluate, which measures robustness in
fp32; shown for scale). Compare ratios from one run on one machine, and say which CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from core.models import build


def _rate(fn: Callable[[], object], n: int, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def _eval_candidates(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    model = model.eval().to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.freeze(torch.jit.trace(model, x, check_trace=False).eval())
        t0 = time.perf_counter()
        compiled = torch.compile(model)
        compiled(x)
        print(f"  torch.compile: {time.perf_counter() - t0:.1f} s to compile")

    def run(m: Callable[[torch.Tensor], torch.Tensor], bf16: bool = False) -> Callable[[], object]:
        def go() -> object:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return m(x)

        return go

    return {
        "eager": run(model),
        "torchscript": run(traced),
        "compile": run(compiled),
        "bf16 eager": run(model, True),
    }


def _train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> Callable[[], object]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> object:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="resnet12_cifar_os16")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--eval-batch", type=int, default=500)
    ap.add_argument("--train-batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.eval_batch, 3, args.size, args.size)
    xt = torch.randn(args.train_batch, 3, args.size, args.size).contiguous(memory_format=torch.channels_last)
    yt = torch.randint(0, 10, (args.train_batch,))
    print(f"{args.arch} at {args.size} px, {torch.get_num_threads()} threads")
    for kind in ("cnn", "tcnn"):
        model = build(kind, args.arch, 10)
        print(f"{kind}: evaluation candidates")
        cands = _eval_candidates(model, x)
        rounds: dict[str, list[float]] = {k: [] for k in cands}
        for _ in range(args.rounds):
            for name, fn in cands.items():
                rounds[name].append(_rate(fn, len(x)))
        base = rounds["eager"]
        for name, rates in rounds.items():
            ratio = statistics.median(r / b for r, b in zip(rates, base))
            print(f"  eval {name:12s} {statistics.median(rates):8.0f} img/s   x{ratio:.2f} vs eager")
        train = build(kind, args.arch, 10).train().to(memory_format=torch.channels_last)
        steps = {"fp32": _train_step(train, xt, yt, False), "bf16": _train_step(train, xt, yt, True)}
        trates: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds):
            for name, fn in steps.items():
                trates[name].append(_rate(fn, len(xt), reps=2))
        ratio = statistics.median(b / f for b, f in zip(trates["bf16"], trates["fp32"]))
        print(f"  train fp32 {statistics.median(trates['fp32']):.0f} img/s, bf16 {statistics.median(trates['bf16']):.0f}"
              f" img/s: x{ratio:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
