"""What each special speed path buys end to end: default T-CNN training and evaluation img/s with the path on
and off, measured side by side (interleaved rounds; the ratio is the median of the per-round ratios).

    .venv/bin/python benchmarks/speed_paths.py [--arch resnet10_cifar_os16] [--batch 128] [--rounds 5]

Paths (each "off" variant swaps one path for the plain PyTorch call it replaces, all else as by default):
- ``dense_attention``: the T-CNN GPSA's dense attention path (``attn_impl="auto"``) vs ``"sdpa"``;
- ``channels_last``: channels-last models and inputs vs NCHW;
- ``torchscript_eval``: the CNN in the form evaluate picks (core/training/inference.py ``inference_model``: traced,
  frozen, possibly in sub-batches; benchmarks/tcnn_eval.py measures the T-CNN's) vs eager.
A ratio > 1 means the path is faster by that factor. Compare ratios from one run on one machine.

Paths that bought less than 5% here were removed: GPSA GEMM routes chosen by CPU vendor (oneDNN forward,
oneDNN/BLAS backward), row-blocked data-gradient GEMMs and the custom q/k/v backward measured 1.024 / 1.008 /
1.024 on training and 1.046 on evaluation (AMD EPYC AVX-512, 2 threads, 5 rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from core.models.conversion import gpsa_modules, to_tcnn
from core.models.factory import build
from core.training.optim import build_adamw


def _train_rate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    opt = build_adamw(model, lr=1e-5, gate_lr=1e-2, weight_decay=0.05)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * x.shape[0] / (time.perf_counter() - t0)


@torch.no_grad()
def _eval_rate(model: Callable, x: torch.Tensor, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        model(x)
    return steps * x.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet10_cifar_os16")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=500)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cnn = build("cnn", args.arch, 10, in_chans=1)
    tcnn = to_tcnn(cnn)
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))
    xe = torch.randn(args.eval_batch, 1, 28, 28)
    cl = torch.channels_last

    def tcnn_cl() -> torch.nn.Module:
        return copy.deepcopy(tcnn).to(memory_format=cl)

    def sdpa_tcnn() -> torch.nn.Module:
        m = tcnn_cl()
        for _, g in gpsa_modules(m):
            g.attn_impl = "sdpa"
        return m

    xc, xec = x.contiguous(memory_format=cl), xe.contiguous(memory_format=cl)
    from core.training.inference import inference_model

    cnn_eval = copy.deepcopy(cnn).eval()
    scripted, kind = inference_model(cnn_eval, xe)
    null = contextlib.nullcontext
    # name -> (what is measured, on: (model factory, input, context), off: (...))
    cases = {
        "dense_attention": ("train", (tcnn_cl, xc, null), (sdpa_tcnn, xc, null)),
        "channels_last": ("train", (tcnn_cl, xc, null), (lambda: copy.deepcopy(tcnn), x, null)),
        "dense_attention_eval": ("eval", (tcnn_cl, xec, null), (sdpa_tcnn, xec, null)),
        "channels_last_eval": ("eval", (tcnn_cl, xec, null), (lambda: copy.deepcopy(tcnn), xe, null)),
        "torchscript_eval": ("eval", (lambda: scripted, xe, null), (lambda: cnn_eval, xe, null)),
    }
    print(f"{args.arch}, batch {args.batch} (eval {args.eval_batch}), {torch.get_num_threads()} threads; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; evaluate picks: {kind}")  # fmt: skip
    for name, (what, on, off) in cases.items():
        ratios, rates = [], {"on": [], "off": []}
        for _ in range(args.rounds):
            for label, (factory, inp, ctx) in (("on", on), ("off", off)):
                with ctx():
                    m = factory()
                    if what == "train":
                        _train_rate(m, inp, y, 2)  # warm-up
                        rates[label].append(_train_rate(m, inp, y, args.steps))
                    else:
                        m = m.eval() if hasattr(m, "eval") else m
                        _eval_rate(m, inp, 2)
                        rates[label].append(_eval_rate(m, inp, args.steps))
            ratios.append(rates["on"][-1] / rates["off"][-1])
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{name:22s} {what:5s} on {statistics.median(rates['on']):7.0f} img/s  off "
              f"{statistics.median(rates['off']):7.0f} img/s  ratio {statistics.median(ratios):.3f} "
              f"[{q[0]:.3f}-{q[2]:.3f}]", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
