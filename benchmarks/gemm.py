"""GEMM route benchmark: ``F.linear`` (MKL on CPU) vs ``core.gemm.linear`` (oneDNN 1x1 convolution), side by side.

    .venv/bin/python benchmarks/gemm.py [--threads 2] [--reps 10]

Shapes (M, K, N) are the GPSA's own: the T-CNN output GEMM at 7x7 (B = 64, heads * D_in = 9 * 504 -> 504), the
ConViT q/k/v and output projections at 7x7 and 14x14, and the default net's last stage (B = 128, 4 x 4). Both
contenders run interleaved on the same inputs (median of ``--reps``); forward alone and forward + backward
(both operands require grad). Prints the ratios and the largest relative difference between the two results.
Why it matters: MKL runs its generic (non-AVX-512) SGEMM kernels on AMD CPUs, oneDNN does not (core/gemm.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.gemm import linear  # noqa: E402

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


def _row(shape: tuple[int, int, int], gen: torch.Generator, reps: int) -> str:
    m, k, n = shape
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = torch.randn(n, k, generator=gen, requires_grad=True)
    b = torch.randn(n, generator=gen, requires_grad=True)
    g = torch.randn(m, n, generator=gen)
    with torch.no_grad():
        ref, got = F.linear(x, w, b), linear(x, w, b)
        diff = ((ref - got).abs().max() / ref.abs().max()).item()
        fwd = _median_ms({"mkl": lambda: F.linear(x, w, b), "onednn": lambda: linear(x, w, b)}, reps)
    fb = _median_ms(
        {"mkl": lambda: F.linear(x, w, b).backward(g), "onednn": lambda: linear(x, w, b).backward(g)}, reps
    )
    return (
        f"| {m} x {k} x {n} | {fwd['mkl']:.1f} | {fwd['onednn']:.1f} | {fwd['mkl'] / fwd['onednn']:.2f} "
        f"| {fb['mkl']:.1f} | {fb['onednn']:.1f} | {fb['mkl'] / fb['onednn']:.2f} | {diff:.1e} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = next(
        (ln.strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln), "?"
    )
    print(f"torch {torch.__version__}, {args.threads} threads, {cpu}")
    print(
        "| M x K x N | fwd MKL ms | fwd oneDNN ms | fwd ratio | f+b MKL ms | f+b oneDNN ms | f+b ratio | rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        print(_row(shape, gen, args.reps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
