"""GPSA at the speed of the convolution it replaces (issue 58): the released ResNet-20's T-CNN against its CNN,
the reference GPSA path against the fused one, next to the ratio the arithmetic allows.

    .venv/bin/python benchmarks/gpsa_resnet20.py [--rounds 5] [--steps 2] [--threads 2] [--eval-batch 500]
    .venv/bin/python benchmarks/gpsa_resnet20.py --profile   # where each training step goes (torch.profiler)

The networks are `trial_cost_resnet20.networks()` (the released ResNet-20 and its T-CNN: layer3's six 3x3
convs on 8x8 maps -> TcnnGPSA, exact stride, alpha = lambda = 1), in the fine-tuning stage's layout
(channels-last). Three forms, interleaved round by round in this one process (round 0 warms up), so load from
other processes hits all alike; each ratio is the median over rounds of the ratio within a round, with the
range over rounds:
- "CNN": the control arm;
- "T-CNN reference": ``cpp_attention = fused_attention = conv_output = False``: autograd's graph of the plain
  ops, ``F.linear`` for the output GEMM (the implementation before issue 58; the fallback);
- "T-CNN fused": ``fused_attention = conv_output = True`` (`core.nn.gated_attention`, the 1x1-conv GEMM);
- "T-CNN C++": ``cpp_attention`` (`core.nn.gated_attention_cpp`: one image per thread, the maps recomputed in
  backward), ``F.linear`` for the output GEMM: TcnnGPSA's default;
- "T-CNN C++, conv output": the C++ attention and the 1x1-conv output GEMM (``conv_output``).
Training: full AdamW steps (the study's batch 128, 32 px, fp32), wall and process CPU time (the CPU-time
ratio is the less load-sensitive one on a shared machine). Evaluation: eager channels-last forwards at
``--eval-batch`` and the evaluate stage's form (`core.training.inference.inference_model`).

The limit: torch.utils.flop_counter counts the GEMM / convolution / bmm FLOPs of one forward+backward of each
network; at equal FLOP rates the T-CNN's training speed relative to the CNN's is FLOPs(CNN) / FLOPs(T-CNN).
The optimizer: AdamW's step alone as a for-loop (the default on CPU), foreach and fused, against a whole
training step (issue 58 item 4: kept only if it pays). The CPU (model name, AVX flags) and the load average
before and after are printed: compare ratios from one run on one machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from trial_cost_resnet20 import WEIGHTS, networks

from core.nn.gated_attention_cpp import available as cpp_available
from core.training.inference import _ChannelsLast, inference_model
from core.training.optim import build_adamw, param_groups
from core.utils.machine import cpu_model

FORMS = ("CNN", "T-CNN reference", "T-CNN fused", "T-CNN C++", "T-CNN C++, conv output")
#: Each T-CNN form's switches: (cpp_attention, fused_attention, conv_output).
SWITCHES = {"T-CNN reference": (False, False, False), "T-CNN fused": (False, True, True),
            "T-CNN C++": (True, False, False), "T-CNN C++, conv output": (True, False, True)}  # fmt: skip


def cpu_line(threads: int) -> str:
    """Model name, AVX flags and torch's CPU capability."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = {f for f in line.split(":", 1)[1].split() if f.startswith("avx")}
            break
    return (f"CPU: {cpu_model()} ({os.cpu_count()} CPUs; {' '.join(sorted(flags)) or 'no AVX'}); "
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {threads} threads")  # fmt: skip


def gpsa_form(tcnn: torch.nn.Module, form: str) -> torch.nn.Module:
    """A copy of the T-CNN whose GPSA layers take ``form``'s path (`SWITCHES`)."""
    out = copy.deepcopy(tcnn)
    for m in out.modules():
        if hasattr(m, "fused_attention"):
            m.cpp_attention, m.fused_attention, m.conv_output = SWITCHES[form]
    return out


def flops_per_image(model: torch.nn.Module, batch: int) -> float:
    """GEMM/conv/bmm FLOPs of one forward+backward per image (torch.utils.flop_counter) at ``batch`` (the
    T-CNN folds W_val into its output weight only from batch * pixels >= heads * D_out on: batch-dependent)."""
    m = copy.deepcopy(model).train()
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(m(x), y).backward()
    return fc.get_total_flops() / batch


def ratios(times: dict[str, list[float]], base: str = "CNN") -> dict[str, tuple[float, float, float]]:
    """Speed relative to ``base`` (time(base) / time(form)) per round: median, min, max."""
    out = {}
    for k, t in times.items():
        r = [b / a for a, b in zip(t, times[base])]
        out[k] = (statistics.median(r), min(r), max(r))
    return out


def interleave(calls: dict, rounds: int) -> tuple[dict[Any, list[float]], dict[Any, list[float]]]:
    """Wall and process-CPU seconds of each call per round, interleaved (round 0 warms up)."""
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(rounds + 1):
        for k, f in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            if r:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    return wall, cpu


def show(title: str, wall: dict, cpu: dict, images: int) -> None:
    rw, rc = ratios(wall), ratios(cpu)
    print(f"\n{title}")
    print("| form | img/s (median wall) | speed / CNN, wall (range) | speed / CNN, CPU time (range) |")
    print("|---|---:|---:|---:|")
    for k in wall:
        print(f"| {k} | {images / statistics.median(wall[k]):.1f} | {rw[k][0]:.3f} ({rw[k][1]:.2f}-{rw[k][2]:.2f}) "
              f"| {rc[k][0]:.3f} ({rc[k][1]:.2f}-{rc[k][2]:.2f}) |")  # fmt: skip


def profile(
    models: dict[str, torch.nn.Module], x: torch.Tensor, y: torch.Tensor, steps: int, top: int = 12
) -> None:
    """Where each network's training step goes: torch.profiler's self CPU time per op over ``steps`` AdamW steps
    (after one warm-up step), the ``top`` ops and their share of the step (--profile)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, model in models.items():
        m = copy.deepcopy(model).train().to(memory_format=torch.channels_last)
        opt = build_adamw(m, lr=1.25e-4, gate_lr=0.0125, weight_decay=0.05)

        def step(m: torch.nn.Module = m, opt: torch.optim.Optimizer = opt) -> None:
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops)
        print(
            f"\nprofile, {name}: {total / 1e3 / steps:.0f} ms of self CPU time per step (all threads' ops), top {top}"
        )
        print("| op | ms per step | share |")
        print("|---|---:|---:|")
        for e in ops[:top]:
            print(
                f"| {e.key} | {e.self_cpu_time_total / 1e3 / steps:.1f} | {100 * e.self_cpu_time_total / total:.1f}% |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="training steps per round and form")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", type=Path, default=WEIGHTS)
    ap.add_argument("--profile", action="store_true",
                    help="only where the CNN's and the default T-CNN's training steps go (torch.profiler)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(cpu_line(args.threads))
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    cnn, tcnn, note = networks(args.weights)
    print(f"network: {note}")
    if not cpp_available():
        raise SystemExit("gpsa_resnet20: the C++ attention did not build (see the log line above)")
    nets = {"CNN": cnn, **{k: gpsa_form(tcnn, k) for k in SWITCHES}}

    # counted on the reference path: the flop counter does not see inside the C++ kernel
    fl = {
        "CNN": flops_per_image(cnn, args.batch),
        "T-CNN": flops_per_image(nets["T-CNN reference"], args.batch),
    }
    print(f"\nFLOPs per image, forward+backward at batch {args.batch} (GEMM/conv/bmm): CNN {fl['CNN'] / 1e6:.0f} M, T-CNN "
          f"{fl['T-CNN'] / 1e6:.0f} M: the ratio the arithmetic allows is {fl['CNN'] / fl['T-CNN']:.3f} "
          f"(85%: {0.85 * fl['CNN'] / fl['T-CNN']:.3f})", flush=True)  # fmt: skip

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    if args.profile:
        return profile({k: nets[k] for k in ("CNN", "T-CNN C++, conv output")}, x, y, max(args.steps, 3))
    train = {k: copy.deepcopy(m).train().to(memory_format=torch.channels_last) for k, m in nets.items()}
    opts = {k: build_adamw(m, lr=1.25e-4, gate_lr=0.0125, weight_decay=0.05) for k, m in train.items()}

    def step(k: str) -> None:
        for _ in range(args.steps):
            loss = F.cross_entropy(train[k](x), y)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()

    wall, cpu = interleave({k: (lambda k=k: step(k)) for k in train}, args.rounds)
    show(f"training (AdamW steps, batch {args.batch}, channels-last)", wall, cpu, args.steps * args.batch)
    step_s = statistics.median(wall["T-CNN C++"]) / args.steps

    xe = torch.randn(args.eval_batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ev = {(k, "eager"): _ChannelsLast(copy.deepcopy(m).eval().to(memory_format=torch.channels_last))
          for k, m in nets.items()}  # fmt: skip
    hows = {}
    for k, m in nets.items():
        ev[(k, "evaluate stage")], hows[k] = inference_model(copy.deepcopy(m).eval(), xe)

    def run(key: tuple[str, str]) -> None:
        with torch.no_grad():
            ev[key](xe)

    wall, cpu = interleave({key: (lambda key=key: run(key)) for key in ev}, args.rounds)
    for part in ("eager", "evaluate stage"):
        w = {k: wall[(k, part)] for k in nets}
        c = {k: cpu[(k, part)] for k in nets}
        forms = "" if part == "eager" else ": " + "; ".join(f"{k}: {how}" for k, how in hows.items())
        show(f"evaluation, {part} (batch {args.eval_batch}){forms}", w, c, args.eval_batch)

    # AdamW alone on the T-CNN's parameters and gradients: for-loop (default on CPU), foreach, fused.
    m = train["T-CNN C++"]
    kinds = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    adam = {
        k: torch.optim.AdamW(param_groups(m, lr=1e-4, weight_decay=0.05, gate_lr=1e-2), lr=1e-4, **kw)
        for k, kw in kinds.items()
    }
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    wall, _ = interleave(
        {k: (lambda o=o: [o.step() for _ in range(20)]) for k, o in adam.items()}, args.rounds
    )
    print("\nAdamW step alone on the T-CNN (ms, median of rounds of 20): "
          + ", ".join(f"{k} {1e3 * statistics.median(v) / 20:.2f}" for k, v in wall.items())
          + f"; one training step of the C++ T-CNN: {1e3 * step_s:.0f} ms")  # fmt: skip
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
