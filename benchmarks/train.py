"""Training throughput of the default CNN and its T-CNN (images/s), measured side by side.

    .venv/bin/python benchmarks/train.py [--arch resnet10_cifar] [--batch 128] [--steps 20] [--device cpu]

Runs full SGD steps (forward, backward, update) on random 28 px one-channel batches, alternating the
variants round by round so that machine noise hits all of them alike; prints the median images/s of each
and the ratios (other helpers share the machine: compare ratios, not absolute numbers).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from core.models.conversion import to_tcnn
from core.models.factory import build
from core.training.environment import select_device
from core.training.optim import build_sgd
from core.training.precision import autocast


def _step_rate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    opt = build_sgd(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
    device = x.device
    t0 = time.perf_counter()
    for _ in range(steps):
        with autocast(device):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * x.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet10_cifar")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--size", type=int, default=28)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = select_device(args.device)
    torch.manual_seed(0)
    cnn = build("cnn", args.arch, 10, in_chans=1)
    variants = {}
    for name, net in (("cnn", cnn), ("tcnn", to_tcnn(cnn))):
        for cl in (False, True):
            m = copy.deepcopy(net).to(device).train()
            if cl:
                m = m.to(memory_format=torch.channels_last)
            variants[f"{name}{'+cl' if cl else ''}"] = (m, cl)
    x = torch.randn(args.batch, 1, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for m, cl in variants.values():  # warm-up (oneDNN / cuDNN kernel selection)
        _step_rate(m, x.contiguous(memory_format=torch.channels_last) if cl else x, y, 3)
    for _ in range(args.rounds):
        for name, (m, cl) in variants.items():
            xx = x.contiguous(memory_format=torch.channels_last) if cl else x
            rates[name].append(_step_rate(m, xx, y, args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{args.arch} batch {args.batch} {args.size}px on {device} ({torch.get_num_threads()} threads):")
    for k, v in med.items():
        print(f"  {k:8s} {v:8.0f} img/s   x{v / med['cnn']:.2f} vs cnn")
    print(
        f"  tcnn/cnn (best layouts): {max(med['tcnn'], med['tcnn+cl']) / max(med['cnn'], med['cnn+cl']):.2f}"
    )


if __name__ == "__main__":
    main()
