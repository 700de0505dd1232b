"""GEMM route benchmark: ``F.linear`` (MKL on CPU) vs ``core.nn.gemm.linear`` (oneDNN 1x1 convolution), side by side.

    .venv/bin/python benchmarks/gemm.py [--threads 2] [--reps 10]

Shapes (M, K, N) are the GPSA's own: the T-CNN output GEMM at 7x7 (B = 64, heads * D_in = 9 * 504 -> 504), the
ConViT q/k/v and output projections at 7x7 and 14x14, and the default net's last stage (B = 128, 4 x 4). Both
contenders run interleaved on the same inputs (median of ``--reps``); forward alone and forward + backward
(both operands require grad), with the backward in oneDNN and in BLAS (the two routes of core.nn.gemm). Prints the
ratios and the largest relative difference between the results. Why it matters: MKL runs its generic
(non-AVX-512) SGEMM kernels on AMD CPUs with AVX-512, oneDNN does not; on AVX2 CPUs oneDNN's backward is the
slower one (core/nn/gemm.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.nn.gemm import BACKWARD_ENV, linear, onednn_backward  # noqa: E402

SHAPES = [(3136, 4536, 504), (3136, 504, 1512), (3136, 504, 504), (12544, 252, 756), (2048, 1152, 128)]


def _median_ms(fns: dict, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _route(name: str):
    """A contender: F.linear (MKL), or core.nn.gemm.linear with its backward forced to oneDNN / BLAS."""
    if name == "mkl":
        return F.linear

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        os.environ[BACKWARD_ENV] = name
        return linear(x, w, b)

    return f


ROUTES = ("mkl", "onednn", "blas")  # blas = oneDNN forward, BLAS backward


def _row(shape: tuple[int, int, int], gen: torch.Generator, reps: int) -> str:
    m, k, n = shape
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = torch.randn(n, k, generator=gen, requires_grad=True)
    b = torch.randn(n, generator=gen, requires_grad=True)
    g = torch.randn(m, n, generator=gen)
    fns = {r: _route(r) for r in ROUTES}
    with torch.no_grad():
        ref, got = F.linear(x, w, b), linear(x, w, b)
        diff = ((ref - got).abs().max() / ref.abs().max()).item()
        # no-grad forward: "blas" runs the same code as "onednn", so it is timed once
        fwd = _median_ms({r: (lambda f=fns[r]: f(x, w, b)) for r in ("mkl", "onednn")}, reps)
    fb = _median_ms({r: (lambda f=f: f(x, w, b).backward(g)) for r, f in fns.items()}, reps)
    cells = [
        f"{m} x {k} x {n}",
        f"{fwd['mkl']:.1f}",
        f"{fwd['onednn']:.1f}",
        f"{fwd['mkl'] / fwd['onednn']:.2f}",
    ]
    cells += [f"{fb[r]:.1f}" for r in ROUTES]
    cells += [f"{fb['mkl'] / fb['onednn']:.2f}", f"{fb['mkl'] / fb['blas']:.2f}", f"{diff:.1e}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = next(
        (ln.strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln), "?"
    )
    auto = "onednn" if onednn_backward() else "blas"
    print(
        f"torch {torch.__version__}, {args.threads} threads, {cpu}, {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"backward route chosen here ({BACKWARD_ENV}={os.environ.get(BACKWARD_ENV, 'auto')}): {auto}")
    print(
        "| M x K x N | fwd MKL ms | fwd oneDNN ms | fwd MKL/oneDNN | f+b MKL ms | f+b oneDNN ms "
        "| f+b oneDNN fwd + BLAS bwd ms | f+b MKL/oneDNN | f+b MKL/(oneDNN+BLAS) | rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:  # the contenders set BACKWARD_ENV per call: this process only
        print(_row(shape, gen, args.reps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
