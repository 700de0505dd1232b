"""GPSA benchmark: ratios measured side by side in one run (issue 3).

    .venv/bin/python benchmarks/gpsa.py [--quick] [--device cpu|cuda] [--threads 2] [--sections convit,tcnn,model]

1. The ConViT GPSA (core.nn.gpsa_convit) vs timm's GPSA, forward and forward+backward, at
   (batch, tokens, dim, heads) = (64, 14x14, 252, 9), (32, 16x16, 378, 9), (8, 28x28, 252, 9), (64, 7x7, 504, 9);
   and peak memory of one forward+backward.
2. The T-CNN GPSA (core.nn.gpsa_tcnn) vs the 3x3 conv it replaces (dim -> dim, padding 1) at the same shapes
   (NCHW maps).
3. Whole models, T-CNN (to_tcnn, paper init alpha = lambda = 1) vs its CNN: resnet10_cifar at 28 px and
   resnet50 at 224 px, images/s in eval forward and in a training step.

Timing: the contenders run interleaved (A, B, A, B, ...) for ``--reps`` rounds after warm-up on the same inputs,
so load from other processes on the shared machine hits both alike. Each ratio is the median over rounds of the
ratio within a round (a slow phase of the machine divides out), printed with its interquartile range (``_iqr``);
``_ms`` / ``img_s`` columns are median times. Only the ratios are meant to be compared (the ``_cpu`` columns, from
process CPU time, are the less load-sensitive ones). The layer-level forward+backward feeds the same fixed dense
upstream gradient to both contenders.

Peak memory (CPU): the PyTorch profiler with ``profile_memory=True`` records every allocation and free made
through the c10 CPU allocator (including the temporaries inside fused kernels) with the running "Total
Allocated"; the peak is its maximum minus its value when the measured call starts, so inputs and parameters
that exist beforehand do not count. This is exact bookkeeping of tensor memory, unlike RSS deltas (glibc keeps
freed pages, other allocations interfere) or tracemalloc (blind to the tensor allocator). On CUDA:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # silence the profiler's "no GPU" chatter on CPU machines
# Idle OpenMP threads sleep instead of spinning: spinning would burn CPU time that other processes on the shared
# machine need and would count as "work" in the CPU-time measure. Applies to all contenders alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.models.conversion import to_tcnn  # noqa: E402
from core.models.factory import build  # noqa: E402
from core.nn.gpsa_convit import ConvitGPSA  # noqa: E402
from core.nn.gpsa_tcnn import TcnnGPSA  # noqa: E402

SHAPES = [(64, 14, 252, 9), (32, 16, 378, 9), (8, 28, 252, 9), (64, 7, 504, 9)]
GOALS = {14: 3.5, 16: 3.5, 28: 7.0, 7: 1.1}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class Timings:
    """Per-call seconds of interleaved contenders: ``wall[name][i]`` and ``cpu[name][i]`` for round i."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def ms(self, name: str) -> float:
        """Median wall milliseconds of one contender."""
        return statistics.median(self.wall[name]) * 1e3

    def _pairs(self, num: str, den: str, cpu: bool) -> list[float]:
        t = self.cpu if cpu else self.wall
        return [a / b for a, b in zip(t[num], t[den])]

    def ratio(self, num: str, den: str, *, cpu: bool = False) -> float:
        """Median over rounds of time(num) / time(den), each ratio taken within one round (side by side), so a
        slow phase of the shared machine that spans a round divides out."""
        return statistics.median(self._pairs(num, den, cpu))

    def quartiles(self, num: str, den: str) -> str:
        """Lower-upper quartile of the per-round wall ratios: the run's spread, printed next to the median."""
        r = self._pairs(num, den, False)
        if len(r) < 2:
            return f"{r[0]:.2f}"
        q = statistics.quantiles(r, n=4, method="inclusive")
        return f"{q[0]:.2f}-{q[2]:.2f}"


def _ratio_columns(name: str, t: Timings, num: str, den: str) -> dict:
    """The columns ``name`` (median ratio time(num) / time(den)), ``name_iqr`` and ``name_cpu`` of a table row."""
    return {
        name: t.ratio(num, den),
        f"{name}_iqr": t.quartiles(num, den),
        f"{name}_cpu": t.ratio(num, den, cpu=True),
    }


def bench(fns: dict[str, Callable[[], object]], device: torch.device, reps: int, warmup: int = 2) -> Timings:
    """Per-call seconds for each fn over ``reps`` rounds, run interleaved (A, B, A, B, ...).

    Interleaving makes load from other processes hit all contenders alike; ratios are taken per round and their
    median reported (`Timings.ratio`), robust to the bursts. ``cpu`` is the process CPU time (all threads;
    OpenMP threads wait passively, see the top of this file), which a busy machine inflates much less than wall
    time: the contention-robust measure of the work done.
    """
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(warmup):
        for f in fns.values():
            f()
    _sync(device)
    for _ in range(reps):
        for k, f in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            _sync(device)
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return Timings(wall, cpu)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ start/stop chatter on fd 2 (it bypasses Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated during fn() beyond what was allocated when it started (see module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - start


def _fwd(m: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def f() -> object:
        with torch.no_grad():
            return m(x)

    return f


def _fwd_bwd(m: nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None) -> Callable[[], object]:
    """Forward + backward. ``grad``: the upstream gradient (a fixed dense tensor, the same for all contenders);
    None: backward from ``out.sum()`` (whole models: the gradient then passes through the classifier)."""

    def f() -> None:
        out = m(x)
        if grad is None:
            out.float().sum().backward()
        else:
            out.backward(grad)

    return f


def _upstream(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fixed random upstream gradient shaped like m(x): a real layer receives a dense gradient, whereas
    ``out.sum()`` would hand it a zero-stride broadcast that sends some backward kernels down other paths."""
    with torch.no_grad():
        out = m(x)
    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)


def _zero_grads(*mods: nn.Module) -> None:
    for m in mods:
        m.zero_grad(set_to_none=True)


def section_convit(device: torch.device, reps: int) -> list[dict]:
    from timm.models.convit import GPSA as TimmGPSA

    rows = []
    for b, s, d, h in SHAPES:
        torch.manual_seed(0)
        ref = TimmGPSA(d, num_heads=h).to(device)
        ref.local_init()
        with torch.no_grad():
            ref.gating_param.normal_()
        ours = ConvitGPSA(d, num_heads=h).to(device)
        ours.load_state_dict(ref.state_dict())
        x = torch.randn(b, s * s, d, device=device, requires_grad=True)
        with torch.no_grad():
            err = (ours(x) - ref(x)).abs().max().item()
        gy = _upstream(ref, x)
        f = bench({"timm": _fwd(ref, x), "ours": _fwd(ours, x)}, device, reps)
        fb = bench({"timm": _fwd_bwd(ref, x, gy), "ours": _fwd_bwd(ours, x, gy)}, device, reps)
        _zero_grads(ref, ours)
        x.grad = None
        mem_t = peak_memory(_fwd_bwd(ref, x, gy), device)
        _zero_grads(ref, ours)
        x.grad = None
        mem_o = peak_memory(_fwd_bwd(ours, x, gy), device)
        rows.append(
            dict(
                shape=f"({b}, {s}x{s}, {d}, {h})",
                fwd_timm_ms=f.ms("timm"),
                fwd_ours_ms=f.ms("ours"),
                **_ratio_columns("fwd_speedup", f, "timm", "ours"),
                fb_timm_ms=fb.ms("timm"),
                fb_ours_ms=fb.ms("ours"),
                **_ratio_columns("fb_speedup", fb, "timm", "ours"),
                mem_timm_mb=mem_t / 2**20,
                mem_ours_mb=mem_o / 2**20,
                mem_ratio=mem_o / max(mem_t, 1),
                goal=GOALS[s],
                max_abs_diff=err,
            )
        )
        print(_fmt_row(rows[-1]), flush=True)
    return rows


def section_tcnn(device: torch.device, reps: int) -> list[dict]:
    rows = []
    for b, s, d, _ in SHAPES:
        torch.manual_seed(0)
        conv = nn.Conv2d(d, d, 3, padding=1, bias=False).to(device)
        gpsa = TcnnGPSA.from_conv(conv)
        x = torch.randn(b, d, s, s, device=device, requires_grad=True)
        gy = _upstream(conv, x)
        f = bench({"conv": _fwd(conv, x), "gpsa": _fwd(gpsa, x)}, device, reps)
        fb = bench({"conv": _fwd_bwd(conv, x, gy), "gpsa": _fwd_bwd(gpsa, x, gy)}, device, reps)
        rows.append(
            dict(
                shape=f"({b}, {s}x{s}, {d}, 9)",
                fwd_conv_ms=f.ms("conv"),
                fwd_gpsa_ms=f.ms("gpsa"),
                **_ratio_columns("fwd_cost_ratio", f, "gpsa", "conv"),
                fb_conv_ms=fb.ms("conv"),
                fb_gpsa_ms=fb.ms("gpsa"),
                **_ratio_columns("fb_cost_ratio", fb, "gpsa", "conv"),
            )
        )
        print(_fmt_row(rows[-1]), flush=True)
    return rows


def section_model(device: torch.device, reps: int, quick: bool) -> list[dict]:
    rows = []
    cases = [("resnet10_cifar", 1, 28, 128, 10)]
    if not quick:
        cases.append(("resnet50", 3, 224, 8, 1000))
    for arch, cin, px, batch, ncls in cases:
        torch.manual_seed(0)
        cnn = build("cnn", arch, ncls, in_chans=cin).to(device)
        tcnn = to_tcnn(cnn)
        x = torch.randn(batch, cin, px, px, device=device)
        cnn.eval()
        tcnn.eval()
        f = bench({"cnn": _fwd(cnn, x), "tcnn": _fwd(tcnn, x)}, device, reps)
        cnn.train()
        tcnn.train()
        fb = bench({"cnn": _fwd_bwd(cnn, x), "tcnn": _fwd_bwd(tcnn, x)}, device, reps)
        rows.append(
            dict(
                model=f"{arch} @ {px} px, batch {batch}",
                eval_cnn_img_s=batch / f.ms("cnn") * 1e3,
                eval_tcnn_img_s=batch / f.ms("tcnn") * 1e3,
                **_ratio_columns("eval_ratio", f, "cnn", "tcnn"),
                train_cnn_img_s=batch / fb.ms("cnn") * 1e3,
                train_tcnn_img_s=batch / fb.ms("tcnn") * 1e3,
                **_ratio_columns("train_ratio", fb, "cnn", "tcnn"),
            )
        )
        print(_fmt_row(rows[-1]), flush=True)
    return rows


EQUIV_CASES = [
    ("resnet10_cifar", 1, [(28, 28), (27, 21)]),
    ("resnet18", 3, [(64, 64), (99, 75)]),
    ("resnet26d", 3, [(64, 64), (99, 75)]),
    ("seresnet18", 3, [(64, 64), (99, 75)]),
    ("resnet50", 3, [(224, 224), (131, 97)]),
    ("resnetrs50", 3, [(160, 160), (131, 97)]),
]


def section_equivalence(quick: bool) -> list[dict]:
    """max |logits(T-CNN) - logits(CNN)| in float32 eval mode, random init with non-trivial BatchNorm."""
    import timm

    rows = []
    cases = EQUIV_CASES[:2] if quick else EQUIV_CASES
    for arch, cin, sizes in cases:
        torch.manual_seed(0)
        cnn = timm.create_model(arch, num_classes=10, in_chans=cin)
        g = torch.Generator().manual_seed(0)
        for m in cnn.modules():
            if isinstance(m, nn.BatchNorm2d):
                with torch.no_grad():
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(m.bias.shape, generator=g) * 0.4 - 0.2)
                m.reset_running_stats()
                m.momentum = None
        cnn.train()
        with torch.no_grad():
            for _ in range(3):
                cnn(torch.randn(3, cin, *sizes[1], generator=g))
        cnn.eval()
        xs = [torch.randn(2, cin, *hw, generator=g) for hw in sizes]
        with torch.no_grad():
            ref = [cnn(x) for x in xs]
        for mode in ("exact", "s1"):
            for init in (50.0, 1.0):
                tcnn = to_tcnn(cnn, alpha_init=init, lambda_init=init, stride_mode=mode).eval()
                with torch.no_grad():
                    errs = [(tcnn(x) - r).abs().max().item() for x, r in zip(xs, ref)]
                row = dict(arch=arch, stride_mode=mode, alpha_lambda=init)
                for hw, e in zip(sizes, errs):
                    row[f"err@{hw[0]}x{hw[1]}"] = e
                row["logit_std"] = ref[0].std().item()
                rows.append(row)
                print(_fmt_row(row), flush=True)
    return rows


def _fmt_row(row: dict) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def _table(title: str, rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    out = [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        out.append(
            "| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, small model only")
    ap.add_argument("--sections", default="convit,tcnn,model", help="any of convit,tcnn,model,equiv")
    ap.add_argument("--shapes", default="", help="comma-separated subset of spatial sizes, e.g. 14,7")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    reps = 3 if args.quick else args.reps
    if args.shapes:
        keep = {int(v) for v in args.shapes.split(",")}
        SHAPES[:] = [sh for sh in SHAPES if sh[1] in keep]
    sections = set(args.sections.split(","))
    unknown = sections - {"convit", "tcnn", "model", "equiv"}
    if unknown:
        print(f"benchmarks/gpsa.py: unknown section(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, reps {reps}")
    report = []
    if "convit" in sections:
        report.append(
            _table("ConViT GPSA vs timm GPSA (speedup = timm time / ours)", section_convit(device, reps))
        )
    if "tcnn" in sections:
        report.append(
            _table("T-CNN GPSA vs conv3x3 (cost ratio = GPSA time / conv time)", section_tcnn(device, reps))
        )
    if "model" in sections:
        report.append(
            _table(
                "Whole model, T-CNN vs CNN (ratio = T-CNN img/s / CNN img/s)",
                section_model(device, reps, args.quick),
            )
        )
    if "equiv" in sections:
        rows = section_equivalence(args.quick)
        # one table per resolution pair: the column names differ per architecture
        for arch in dict.fromkeys(r["arch"] for r in rows):
            report.append(
                _table(
                    f"Equivalence error, {arch} (max |logit diff|, float32 eval)",
                    [r for r in rows if r["arch"] == arch],
                )
            )
    print()
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
