"""T-CNN vs CNN throughput and peak memory on one GPU, and the exactness of the conversion there.

    python benchmarks/gpu_throughput.py [--out table.md]      # on a CUDA machine (scripts/gpu_check.sh runs it)
    python benchmarks/gpu_throughput.py --dry-run             # CPU, tiny sizes: the same code paths, in CI

Networks: timm's ResNet-50 at 224 px (1000 classes; [TCNN21] fine-tunes ResNet-RS-50 at 224-320 px) and the
CIFAR-10 study's network (resnet12_cifar_os16, 32 px). Each is measured as the CNN and as its T-CNN (every
3x3 conv of the last stage a GPSA, [TCNN21] Sec. 2), for training (AdamW step, as fine-tuning runs it) and
evaluation (no_grad forward), in fp32 and bf16 autocast, with channels-last off and on. Images/s is the
median over timed steps (after warm-up, CUDA synchronised); peak memory is
``torch.cuda.max_memory_allocated`` for that configuration alone. The T-CNN / CNN ratio of each row pair is
printed next to it.

Exactness: the T-CNN at alpha = lambda = 50 computes the CNN's function ([TCNN21] Sec. 2.2: the positional
attention is then a one-hot on the conv's 9 offsets); max |logit difference| on a random batch with TF32 off
(float32 everywhere) and with TF32 on for convolutions and matmuls (PyTorch's default enables it for
cuDNN convolutions only).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import torch
import torch.nn.functional as F

from core.models.conversion import to_tcnn
from core.models.factory import build
from core.training.optim import build_adamw
from core.training.precision import autocast


@dataclass(frozen=True)
class Net:
    arch: str
    image_size: int
    num_classes: int
    train_batch: int
    eval_batch: int


FULL = (Net("resnet50", 224, 1000, 256, 1024), Net("resnet12_cifar_os16", 32, 10, 1024, 4096))
DRY = (Net("resnet50", 32, 1000, 2, 2), Net("resnet12_cifar_os16", 16, 10, 2, 4))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _tf32(on: bool) -> Iterator[None]:
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def measure(model: torch.nn.Module, net: Net, mode: str, precision: str, channels_last: bool,
            device: torch.device, warmup: int, steps: int) -> tuple[float, float]:  # fmt: skip
    """(images/s, peak GiB) of `mode` ("train" or "eval") for `model` on `device`."""
    batch = net.train_batch if mode == "train" else net.eval_batch
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = copy.deepcopy(model).to(device, memory_format=fmt)
    x = torch.randn(batch, 3, net.image_size, net.image_size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, net.num_classes, (batch,), device=device)
    opt = build_adamw(model, lr=1e-5, gate_lr=1e-2, weight_decay=0.05) if mode == "train" else None
    model.train(mode == "train")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        if opt is not None:
            with autocast(device, precision):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        else:
            with torch.no_grad(), autocast(device, precision):
                model(x)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return batch / statistics.median(times), peak


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random batch-norm affine parameters and running statistics, so that every converted conv reaches the
    logits (timm zero-initialises each residual branch's last BN, which would hide the conv behind a 0)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.weight.data = torch.rand(n, generator=g) + 0.5
            m.bias.data = 0.1 * torch.randn(n, generator=g)
            m.running_mean = 0.1 * torch.randn(n, generator=g)
            m.running_var = torch.rand(n, generator=g) + 0.5
    return model


def exactness(cnn: torch.nn.Module, net: Net, device: torch.device) -> dict[str, float]:
    """max |logit difference| between the CNN and its T-CNN at alpha = lambda = 50, TF32 off and on."""
    cnn = randomize_norms(cnn)
    tcnn = to_tcnn(cnn, alpha_init=50.0, lambda_init=50.0).to(device).eval()
    cnn = copy.deepcopy(cnn).to(device).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, net.image_size, net.image_size, generator=g).to(device)
    out = {}
    for label, on in (("fp32", False), ("tf32", True)):
        with _tf32(on), torch.no_grad():
            ref = cnn(x)
            out[label] = (tcnn(x) - ref).abs().max().item()
            out[f"{label}_scale"] = ref.abs().max().item()
    return out


def rate(images_per_s: float) -> str:
    """Whole images/s, with three significant digits below 100 (a CPU dry run's rates)."""
    return f"{images_per_s:.0f}" if images_per_s >= 100 else f"{images_per_s:.3g}"


def rows(nets: tuple[Net, ...], device: torch.device, warmup: int, steps: int) -> Iterator[str]:
    """Markdown table rows: one per (network, mode, precision, channels-last), CNN and T-CNN side by side."""
    yield "| network | px | mode | batch | precision | channels-last | CNN img/s | T-CNN img/s | T-CNN/CNN | CNN peak GiB | T-CNN peak GiB |"
    yield "|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|"
    for net in nets:
        torch.manual_seed(0)
        cnn = build("cnn", net.arch, net.num_classes)
        tcnn = to_tcnn(cnn)
        for mode in ("train", "eval"):
            for precision in ("fp32", "bf16"):
                for cl in (False, True):
                    c_rate, c_mem = measure(cnn, net, mode, precision, cl, device, warmup, steps)
                    t_rate, t_mem = measure(tcnn, net, mode, precision, cl, device, warmup, steps)
                    batch = net.train_batch if mode == "train" else net.eval_batch
                    yield (f"| {net.arch} | {net.image_size} | {mode} | {batch} | {precision} | {'on' if cl else 'off'} "
                           f"| {rate(c_rate)} | {rate(t_rate)} | {t_rate / c_rate:.2f} | {c_mem:.2f} | {t_mem:.2f} |")  # fmt: skip


def junit_table(junit: Path) -> list[str]:
    """One markdown row per test of a pytest junit-xml report: outcome, seconds, the first line of a failure."""
    out = ["| test | outcome | s | detail |", "|---|---|---:|---|"]
    counts: dict[str, int] = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if bad is None else {"failure": "FAILED", "error": "ERROR"}.get(bad.tag, "skipped")
        counts[outcome] = counts.get(outcome, 0) + 1
        detail = "" if bad is None else (bad.get("message") or "").splitlines()[0][:100].replace("|", "/")
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        out.append(f"| {name} | {outcome} | {float(case.get('time', 0)):.1f} | {detail} |")
    return [f"tests: {', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}", "", *out]


def readme_table(table: str) -> str:
    """The summary in docs/scale.md of a committed gpu_check table: per network and mode, CNN / T-CNN img/s (and their
    ratio) in fp32, bf16 and bf16 + channels-last, and the T-CNN's peak memory in bf16 + channels-last."""
    cells: dict[tuple[str, str], dict[tuple[str, str], list[str]]] = {}
    for line in table.splitlines():
        c = [x.strip() for x in line.strip("|").split("|")]
        if len(c) == 11 and c[2] in ("train", "eval"):
            cells.setdefault((f"{c[0]}, {c[1]}", f"{c[2]}, {c[3]}"), {})[(c[4], c[5])] = c[6:]
    out = [
        "| network, px | mode, batch | fp32 CNN / T-CNN img/s | bf16 CNN / T-CNN img/s "
        "| bf16 + channels-last CNN / T-CNN img/s | T-CNN peak GiB (bf16, CL) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (net, mode), by in cells.items():
        rates = [
            f"{int(by[k][0]):,} / {int(by[k][1]):,} ({by[k][2]}x)"
            for k in (("fp32", "off"), ("bf16", "off"), ("bf16", "on"))
        ]
        peak = by[("bf16", "on")]
        out.append(
            f"| {net} | {mode} | {' | '.join(rates)} | {float(peak[4]):.1f} (CNN {float(peak[3]):.1f}) |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, one timed step (CI)")
    ap.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--junit", type=Path, help="a pytest --junitxml report: its tests open the table")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device (use --dry-run on a CPU)")
    device = torch.device("cpu" if args.dry_run else "cuda")
    nets, warmup, steps = (DRY, 0, 1) if args.dry_run else (FULL, 3, args.steps)
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    lines = [f"device: {name}; torch {torch.__version__}", ""]
    if args.junit:
        lines += [*junit_table(args.junit), ""]
        print("\n".join(lines), flush=True)
    for line in rows(nets, device, warmup, steps):
        print(line, flush=True)
        lines.append(line)
    lines += [
        "",
        "| network | max abs logit diff, TF32 off | TF32 on | max abs logit |",
        "|---|---:|---:|---:|",
    ]
    for net in nets:
        torch.manual_seed(0)
        e = exactness(build("cnn", net.arch, net.num_classes), net, device)
        lines.append(f"| {net.arch} | {e['fp32']:.2e} | {e['tf32']:.2e} | {e['fp32_scale']:.2f} |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
